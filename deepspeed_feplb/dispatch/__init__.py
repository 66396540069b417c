"""Phase 1: every routed (token, expert) pair to its expert's home rank, and back.

Two implementations of `Dispatcher`: `torch_a2a.TorchDispatcher` (``all_to_all_single`` with
uneven splits; any backend, gloo included) and `deepep.DeepEPDispatcher` (DeepEP intranode
buffers, bf16 on CUDA). `make_dispatcher` picks one from ``feplb.ep_backend``. To add a backend,
implement the two methods below with the same row order and exactness, and select it there.
"""
from __future__ import annotations

import importlib.util
from typing import Any, Callable, Optional, Protocol

import numpy as np
import torch

from deepspeed_feplb.config import FEPLBConfig, FEPLBConfigError


class Dispatcher(Protocol):
    """Expert-parallel dispatch over an EP group of ``ep_size`` ranks, ``num_local_experts`` each."""

    def dispatch(self, x: torch.Tensor, expert_ids: torch.Tensor) -> tuple[torch.Tensor, np.ndarray, Any]:
        """x ``[S, H]`` tokens, expert_ids ``[k, S]`` global expert per route (-1: not taken) ->
        (rows ``[N, H]`` grouped by local expert, then by source rank; counts int64
        ``[ep_size, E_local]`` (numpy): rows from each source rank per local expert; a handle for
        `combine`). Differentiable in ``x``."""

    def combine(self, rows: torch.Tensor, gates: torch.Tensor, handle: Any) -> torch.Tensor:
        """The exact inverse of `dispatch`, then the gate-weighted sum over routes (fp32 products):
        rows ``[N, H]`` (grouped as dispatch returned them), gates ``[k, S]`` -> ``[S, H]``."""


def deepep_available() -> bool:
    """True when ``deep_ep`` imports (it raises ImportError without a CUDA build of torch)."""
    if importlib.util.find_spec("deep_ep") is None:
        return False
    try:
        import deep_ep  # noqa: F401
        return True
    except Exception:  # noqa: BLE001 - a broken install means "not available"
        return False


def _on_cuda_bf16(params) -> tuple[bool, bool]:
    params = list(params)
    on_cuda = bool(params) and all(p.is_cuda for p in params)
    return on_cuda, on_cuda and all(p.dtype == torch.bfloat16 for p in params)


def make_dispatcher(config: FEPLBConfig, group, ep_size: int, num_local_experts: int, expert_params,
                    on_error: Optional[Callable[[], None]] = None, stage_times=None) -> Dispatcher:
    """The dispatcher for ``feplb.ep_backend``: ``torch``; ``deepep`` (`FEPLBConfigError` if
    ``deep_ep`` does not import or the experts are not bf16 on CUDA); ``auto``: DeepEP when all
    of that holds and ``ep_size > 1``, else torch. ``on_error`` runs when a collective fails
    (it raises naming a dead peer, if it knows one); ``stage_times`` (a `stats.StageTimes`)
    receives the host time of backward's all-to-alls."""
    from deepspeed_feplb.dispatch.torch_a2a import TorchDispatcher
    _, bf16 = _on_cuda_bf16(expert_params)
    if config.ep_backend == "deepep":
        if not deepep_available():
            raise FEPLBConfigError("feplb.ep_backend: \"deepep\" needs the deep_ep package on a CUDA build of torch "
                                   "(docs/GPU.md); use \"auto\" or \"torch\"")
        if not bf16:
            raise FEPLBConfigError("feplb.ep_backend: \"deepep\" dispatches bf16 tokens on CUDA; the experts are not "
                                   "bf16 on CUDA; use \"auto\" or \"torch\"")
    if config.ep_backend == "deepep" or (config.ep_backend == "auto" and bf16 and ep_size > 1 and deepep_available()):
        from deepspeed_feplb.dispatch.deepep import DeepEPDispatcher
        return DeepEPDispatcher(group, ep_size, num_local_experts)
    return TorchDispatcher(group, ep_size, num_local_experts, on_error=on_error, stage_times=stage_times)
