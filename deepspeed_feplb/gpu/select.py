"""Choosing phase-1 and phase-2 implementations from the ``"feplb"`` config (used by layer / runtime).

* ``ep_backend``: ``torch`` -> `TorchDispatcher`; ``deepep`` -> `DeepEPDispatcher` (error if
  ``deep_ep`` does not import or the experts are not bf16 on CUDA); ``auto`` -> DeepEP when all
  of that holds, else torch.
* ``transport``: ``shm`` -> `ShmTransport`; ``cuda_ce`` -> `CudaCETransport` (error without a
  CUDA device usable by CuPy); ``auto`` -> cuda_ce when the experts live on CUDA and CuPy works,
  else shm. Both classes take ``(name, local_rank, size, timeout_s, create, watch)``.
"""
from __future__ import annotations

import torch

from deepspeed_feplb.config import FEPLBConfigError
from deepspeed_feplb.gpu import cuda_available, deepep_available


def _on_cuda_bf16(params) -> tuple[bool, bool]:
    params = list(params)
    on_cuda = bool(params) and all(p.is_cuda for p in params)
    return on_cuda, on_cuda and all(p.dtype == torch.bfloat16 for p in params)


def make_dispatcher(config, group, ep_size: int, num_local_experts: int, expert_params, on_error=None):
    from deepspeed_feplb.dispatch.torch_a2a import TorchDispatcher
    on_cuda, bf16 = _on_cuda_bf16(expert_params)
    if config.ep_backend == "deepep":
        if not deepep_available():
            raise FEPLBConfigError("feplb.ep_backend: \"deepep\" needs the deep_ep package on a CUDA build of torch "
                               "(docs/GPU.md); use \"auto\" or \"torch\"")
        if not bf16:
            raise FEPLBConfigError("feplb.ep_backend: \"deepep\" dispatches bf16 tokens on CUDA; the experts are not bf16 on "
                               "CUDA; use \"auto\" or \"torch\"")
    if config.ep_backend == "deepep" or (config.ep_backend == "auto" and bf16 and ep_size > 1 and deepep_available()):
        from deepspeed_feplb.gpu.deepep import DeepEPDispatcher
        return DeepEPDispatcher(group, ep_size, num_local_experts)
    return TorchDispatcher(group, ep_size, num_local_experts, on_error=on_error)


def transport_class(config, expert_params):
    """The transport class for this config and these (already placed) expert parameters."""
    from deepspeed_feplb.migrate.shm import ShmTransport
    on_cuda, _ = _on_cuda_bf16(expert_params)
    if config.transport == "cuda_ce" and not cuda_available():
        raise FEPLBConfigError("feplb.transport: \"cuda_ce\" needs a CUDA device and CuPy (pip install cupy-cuda12x); "
                           "use \"auto\" or \"shm\"")
    if config.transport == "cuda_ce" or (config.transport == "auto" and on_cuda and cuda_available()):
        from deepspeed_feplb.gpu.cuda_ce import CudaCETransport
        return CudaCETransport
    return ShmTransport
