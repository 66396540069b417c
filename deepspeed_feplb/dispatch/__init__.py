"""Phase 1: every routed (token, expert) pair to its expert's home rank, and back.

Two implementations of `Dispatcher`: `torch_a2a.TorchDispatcher` (``all_to_all_single`` with
uneven splits; any backend, gloo included) and `deepep.DeepEPDispatcher` (DeepEP's buffers,
intranode or across hosts, bf16 on CUDA). `make_dispatcher` picks one from ``feplb.ep_backend``. To add a backend,
implement the two methods below with the same row order and exactness, and select it there.
"""
from __future__ import annotations

import importlib.util
import warnings
from typing import Any, Callable, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from deepspeed_feplb.config import FEPLBConfig, FEPLBConfigError
from deepspeed_feplb.dispatch.dispatched import Dispatched, GroupFacts
from deepspeed_feplb.once import first_time
from deepspeed_feplb.segments import ranks_per_host


class Dispatcher(Protocol):
    """Expert-parallel dispatch over an EP group of ``ep_size`` ranks, ``num_local_experts`` each."""

    def dispatch(self, x: torch.Tensor, expert_ids: torch.Tensor, announce: Sequence[float] = ()) -> Dispatched:
        """x ``[S, H]`` tokens, expert_ids ``[k, S]`` global expert per route (-1: not taken),
        ``announce``: values (as many on every rank) for decisions the group takes alike ->
        `Dispatched`. Differentiable in ``x``."""

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


def deepep_unsupported(ep_size: int, hidden: int, local_ranks: int,
                       internode_missing: Optional[Callable[[], Optional[str]]] = None,
                       group_ranks: Optional[Sequence[int]] = None) -> Optional[str]:
    """Why the DeepEP adapter cannot serve an EP group of ``ep_size`` ranks (``local_ranks`` per
    host) with tokens of ``hidden`` bf16 values, or None when it can. ``internode_missing``: why the
    installed ``deep_ep`` has no internode kernels, or None (default: `deepep.internode_missing`,
    asked only for a group that spans hosts). ``group_ranks``: the group's global ranks, where
    known: across hosts DeepEP takes its ranks ``8 i .. 8 i + 7`` as one host, and ranks lie host
    by host (`domain.learn_ranks_per_host` refuses another placement), so global rank //
    ``local_ranks`` is a rank's host."""
    from deepspeed_feplb.dispatch.deepep import DEEPEP_EP_SIZES, DEEPEP_INTERNODE_EP_SIZES, DEEPEP_NVL_PEERS
    if ep_size <= local_ranks and ep_size not in DEEPEP_EP_SIZES:
        return f"DeepEP's intranode kernels support EP sizes {DEEPEP_EP_SIZES} within a host, not {ep_size}"
    if ep_size > local_ranks:
        if local_ranks != DEEPEP_NVL_PEERS:
            return (f"the EP group of {ep_size} ranks spans hosts of {local_ranks} ranks; DeepEP's internode kernels "
                    f"take hosts of {DEEPEP_NVL_PEERS} GPUs")
        if ep_size not in DEEPEP_INTERNODE_EP_SIZES:
            return (f"DeepEP's internode kernels support EP sizes {DEEPEP_INTERNODE_EP_SIZES} across hosts, not "
                    f"{ep_size}")
        if internode_missing is None:
            from deepspeed_feplb.dispatch.deepep import internode_missing
        reason = internode_missing()
        if reason:
            return reason
        blocks = [group_ranks[i:i + DEEPEP_NVL_PEERS] for i in range(0, len(group_ranks or ()), DEEPEP_NVL_PEERS)]
        split = next((block for block in blocks if len({r // local_ranks for r in block}) > 1), None)
        if split is not None:
            return (f"the EP group's ranks {list(split)} are one host to DeepEP's internode kernels (each "
                    f"{DEEPEP_NVL_PEERS} ranks of the group in order) but lie on several hosts")
    if hidden * 2 % 16:
        return f"DeepEP needs token rows of a multiple of 16 bytes; hidden {hidden} in bf16 is {hidden * 2} bytes"
    return None


def dispatcher_kind(config: FEPLBConfig, ep_size: int, expert_params, hidden: int,
                    group_ranks: Optional[Sequence[int]] = None) -> tuple[str, Optional[str]]:
    """Which dispatcher ``feplb.ep_backend`` gives this EP group of ``ep_size`` ranks (global
    ``group_ranks``, where known) and these experts: ("torch" or "deepep", why "auto" passed
    DeepEP over for a reason worth a warning, or None). ``deepep``: `FEPLBConfigError` if
    ``deep_ep`` does not import, the experts are not bf16 on CUDA, or the adapter does not support
    this group and ``hidden`` (`deepep_unsupported`); ``auto``: DeepEP when all of that holds and
    ``ep_size > 1``, else torch."""
    _, bf16 = _on_cuda_bf16(expert_params)
    local_ranks = ranks_per_host(ep_size)
    if config.ep_backend == "deepep":
        if not deepep_available():
            raise FEPLBConfigError("feplb.ep_backend: \"deepep\" needs the deep_ep package on a CUDA build of torch "
                                   "(docs/GPU.md); use \"auto\" or \"torch\"")
        if not bf16:
            raise FEPLBConfigError("feplb.ep_backend: \"deepep\" dispatches bf16 tokens on CUDA; the experts are not "
                                   "bf16 on CUDA; use \"auto\" or \"torch\"")
        reason = None if ep_size <= 1 else deepep_unsupported(ep_size, hidden, local_ranks, group_ranks=group_ranks)
        if reason:
            raise FEPLBConfigError(f"feplb.ep_backend: \"deepep\": {reason}; use \"auto\" or \"torch\"")
        return "deepep", None
    if config.ep_backend == "auto" and bf16 and ep_size > 1 and deepep_available():
        reason = deepep_unsupported(ep_size, hidden, local_ranks, group_ranks=group_ranks)
        return ("deepep", None) if reason is None else ("torch", reason)
    return "torch", None


def validate_dispatcher(config: FEPLBConfig, ep_size: int, expert_params, hidden: int) -> None:
    """`FEPLBConfigError` where ``feplb.ep_backend`` cannot serve this EP group and these experts."""
    dispatcher_kind(config, ep_size, expert_params, hidden)


def make_dispatcher(config: FEPLBConfig, group, ep_size: int, num_local_experts: int, expert_params, hidden: int,
                    on_error: Optional[Callable[[], None]] = None, stage_times=None) -> Dispatcher:
    """The dispatcher of `dispatcher_kind` (one warning when "auto" passed DeepEP over).
    ``on_error`` runs when a collective fails (it raises naming a dead peer, if it knows one);
    ``stage_times`` (a `stats.StageTimes`) receives the host time of backward's all-to-alls."""
    ranks = dist.get_process_group_ranks(group) if group is not None and dist.is_initialized() else None
    kind, passed_over = dispatcher_kind(config, ep_size, expert_params, hidden, ranks)
    if kind == "deepep":
        from deepspeed_feplb.dispatch.deepep import DeepEPDispatcher
        return DeepEPDispatcher(group, ep_size, num_local_experts)
    if passed_over and first_time(("deepep passed over", passed_over)):
        warnings.warn(f"FEPLB: not using DeepEP ({passed_over}); phase 1 uses torch all_to_all_single", RuntimeWarning,
                      stacklevel=2)
    from deepspeed_feplb.dispatch.torch_a2a import TorchDispatcher
    return TorchDispatcher(group, ep_size, num_local_experts, on_error=on_error, stage_times=stage_times)


__all__ = ["Dispatched", "Dispatcher", "GroupFacts", "deepep_available", "deepep_unsupported", "dispatcher_kind",
           "make_dispatcher", "validate_dispatcher"]
