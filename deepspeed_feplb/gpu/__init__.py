"""FEPLB's GPU path (DESIGN §6, issue 5): kernels, CUDA IPC peer memory, Copy-Engine transport, DeepEP.

Nothing here imports CuPy or DeepEP at module import time; the helpers below say what this
process can use. Modules:

* `kernels` / `reference`: row permute / pack / unpack / weighted combine kernels and their specs.
* `backend`: the device operations the transport needs (`CudaBackend` over CuPy's runtime, and
  `HostBackend`, the same protocol on host shared memory, used by the CPU tests).
* `arena`: peer-memory arenas (plain ``cudaMalloc`` + IPC handles) and their size formula.
* `cuda_ce`: `CudaCETransport`, the drop-in for `migrate.shm.ShmTransport` on GPUs.
* `deepep`: `DeepEPDispatcher`, the drop-in for `dispatch.torch_a2a.TorchDispatcher`, and
  `ReferenceBuffer`, a CPU implementation of DeepEP's intranode dispatch/combine contract.
"""
from __future__ import annotations

import importlib.util


def cupy_importable() -> bool:
    return importlib.util.find_spec("cupy") is not None


def cuda_available() -> bool:
    """True when torch sees a CUDA device and CuPy can use it (what `CudaCETransport` needs)."""
    try:
        import torch
        if not torch.cuda.is_available():
            return False
        import cupy
        return bool(cupy.cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken CuPy install means "not available"
        return False


def deepep_available() -> bool:
    """True when ``deep_ep`` imports (it raises ImportError without a CUDA build of torch)."""
    if importlib.util.find_spec("deep_ep") is None:
        return False
    try:
        import deep_ep  # noqa: F401
        return True
    except Exception:  # noqa: BLE001
        return False
