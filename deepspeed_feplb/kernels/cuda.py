"""Loader and launchers of the CUDA kernels in ``ops/feplb_kernels.cu`` (through CuPy).

Each launcher takes torch tensors. CUDA tensors run the kernel on torch's current stream; CPU
tensors run the reference of the same contract (`deepspeed_feplb.kernels.reference`), so callers need
no device branch. CuPy is imported lazily: importing this module never needs it.

The module is compiled on first use per device with NVRTC (libnvrtc ships with the CuPy wheels'
``[ctk]`` extra or a CUDA toolkit) and exactly `OPTIONS`; `compile_cubin` compiles ahead of time
with nvcc (no GPU needed) and is what the CPU tests run for sm_90.
"""
from __future__ import annotations

import functools
import math
import threading
from pathlib import Path

import numpy as np
import torch

from deepspeed_feplb.kernels import reference

SOURCE_NAME = "feplb_kernels.cu"
KERNELS = ("feplb_gather_rows", "feplb_scatter_rows", "feplb_expert_counts", "feplb_expert_positions",
           "feplb_weighted_combine_f32", "feplb_weighted_combine_bf16", "feplb_weighted_combine_f16")
# -ftz=false: flushing subnormals would make the combine kernel differ from torch on them. CuPy's
# RawModule appends -ftz=true to any options, so the kernels are compiled with NVRTC directly and
# loaded as a plain module (`_module`).
OPTIONS = ("-std=c++17", "-ftz=false")
_COMBINE = {torch.float32: "feplb_weighted_combine_f32", torch.bfloat16: "feplb_weighted_combine_bf16",
            torch.float16: "feplb_weighted_combine_f16"}
_THREADS = 256
_MAX_BLOCKS = 65535


def source_path() -> Path:
    """The kernel source: the installed ``deepspeed_feplb.ops`` package data, else the repo's ``ops/``."""
    try:
        from importlib import resources
        candidate = Path(str(resources.files("deepspeed_feplb.ops") / SOURCE_NAME))
        if candidate.is_file():
            return candidate
    except (ImportError, ModuleNotFoundError, TypeError):
        pass
    candidate = Path(__file__).resolve().parents[2] / "ops" / SOURCE_NAME
    if candidate.is_file():
        return candidate
    raise FileNotFoundError(f"{SOURCE_NAME} not found: neither package data deepspeed_feplb.ops nor {candidate}")


def source() -> str:
    return source_path().read_text()


def compile_cubin(arch: str = "90") -> bytes:
    """Compile every kernel for ``sm_<arch>`` with nvcc through CuPy; works without a GPU."""
    from cupy.cuda import compiler
    return compiler.compile_using_nvcc(source(), options=OPTIONS, arch=arch)


_modules: dict = {}  # device index -> (module, {kernel name: function}); the functions need their module alive
_lock = threading.Lock()


def compile_for_device(arch: str) -> bytes:
    """The kernels for ``sm_<arch>`` (cubin, or PTX when NVRTC cannot target it) with NVRTC and
    exactly `OPTIONS` (no CuPy defaults added)."""
    from cupy.cuda import compiler
    compiled = compiler.compile_using_nvrtc(source(), options=OPTIONS, arch=arch)
    compiled = compiled[0] if isinstance(compiled, tuple) else compiled  # CuPy 14 also returns a name map
    return compiled.encode() if isinstance(compiled, str) else bytes(compiled)


def _module(device_index: int) -> dict:
    """{kernel name: CuPy function} on ``device_index``, compiled once per process and device."""
    import cupy
    from cupy.cuda import function
    with _lock:
        if device_index not in _modules:
            with cupy.cuda.Device(device_index) as device:
                module = function.Module()
                module.load(compile_for_device(device.compute_capability))
                # every kernel now, on this device, not in the middle of a step
                _modules[device_index] = module, {name: module.get_function(name) for name in KERNELS}
        return _modules[device_index][1]


def cuda_index(device: torch.device) -> int:
    """The index of CUDA ``device`` (torch's current device for a bare "cuda")."""
    return device.index if device.index is not None else torch.cuda.current_device()


def current_stream_ptr(index: int) -> int:
    """Torch's current stream on CUDA device ``index``, as a raw handle: torch's C binding where it
    has one (``torch.cuda.current_stream(device)`` builds a Stream object: ~20 µs per call in a
    cProfile of the H200 machine, perhaps less unprofiled, the device check's ``host_calls`` stage
    times it; a layer launches a kernel or takes a stream several times per pass)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(index))
    return int(torch.cuda.current_stream(index).cuda_stream)


@functools.lru_cache(maxsize=64)
def _external_stream(index: int, ptr: int):
    """CuPy's handle of torch's stream ``ptr`` on device ``index`` (torch's current streams are few
    and live as long as the process: the default stream and its pools')."""
    import cupy
    return cupy.cuda.ExternalStream(ptr, index)


def _launch(name: str, device: torch.device, blocks: int, args: tuple) -> None:
    import cupy
    index = cuda_index(device)
    kernel = _module(index)[name]
    with cupy.cuda.Device(index), _external_stream(index, current_stream_ptr(index)):
        kernel((max(1, min(blocks, _MAX_BLOCKS)), ), (_THREADS, ), args)


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def _row_bytes(t: torch.Tensor) -> int:
    """Bytes of one row (``t[i]``); from the shape, so a 0-row tensor still has its row size."""
    return math.prod(t.shape[1:]) * t.element_size() if t.dim() else t.element_size()


def gather_rows(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[i] = src[index[i]]`` (zero row for -1): `reference.gather_rows`, on the GPU for CUDA tensors."""
    if not src.is_cuda:
        result = reference.gather_rows(src, index)
        return out.copy_(result) if out is not None else result
    src, index = src.contiguous(), index.to(device=src.device, dtype=torch.long).contiguous()
    if out is None:
        out = src.new_empty((index.numel(), *src.shape[1:]))
    if index.numel():
        _launch("feplb_gather_rows", src.device, index.numel(),
                (_ptr(src), _ptr(out), _ptr(index), np.int64(index.numel()), np.int64(_row_bytes(src))))
    return out


def scatter_rows(src: torch.Tensor, index: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """``dst[index[i]] = src[i]`` for ``index[i] >= 0``, in place: `reference.scatter_rows`."""
    if not src.is_cuda:
        return reference.scatter_rows(src, index, dst)
    if not dst.is_contiguous():
        raise ValueError("scatter_rows writes into a contiguous dst")
    src, index = src.contiguous(), index.to(device=src.device, dtype=torch.long).contiguous()
    if index.numel():
        _launch("feplb_scatter_rows", src.device, index.numel(),
                (_ptr(src), _ptr(dst), _ptr(index), np.int64(index.numel()), np.int64(_row_bytes(src))))
    return dst


def expert_positions(expert_of_route: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable grouping of routes by expert -> (counts int64 ``[E]``, position int64 ``[R]``, -1 if none).

    Positions use the exclusive prefix of the counts as expert offsets (`reference.expert_positions`).
    """
    if not expert_of_route.is_cuda:
        counts = reference.expert_counts(expert_of_route, num_experts)
        return counts, reference.expert_positions(expert_of_route, num_experts, torch.cumsum(counts, 0) - counts)
    routes = expert_of_route.to(torch.long).contiguous()
    counts = torch.empty(num_experts, dtype=torch.long, device=routes.device)
    position = torch.empty_like(routes)
    if num_experts == 0:
        return counts, position.fill_(-1)
    n = np.int64(routes.numel())
    _launch("feplb_expert_counts", routes.device, num_experts, (_ptr(routes), n, np.int64(num_experts), _ptr(counts)))
    offsets = torch.cumsum(counts, 0) - counts
    _launch("feplb_expert_positions", routes.device, num_experts,
            (_ptr(routes), n, np.int64(num_experts), _ptr(offsets), _ptr(position)))
    return counts, position


def weighted_combine(rows: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j weight[t, j] * rows[slot[t, j]]`` (fp32 accumulation): `reference.weighted_combine`."""
    if not rows.is_cuda:
        return reference.weighted_combine(rows, slot, weight)
    if rows.dtype not in _COMBINE:
        raise TypeError(f"weighted_combine supports {list(_COMBINE)}, got {rows.dtype}")
    rows = rows.contiguous()
    slot = slot.to(device=rows.device, dtype=torch.long).contiguous()
    weight = weight.to(device=rows.device, dtype=torch.float32).contiguous()
    t, k = slot.shape
    out = rows.new_empty((t, rows.shape[1]))
    if t:
        _launch(_COMBINE[rows.dtype], rows.device, t,
                (_ptr(rows), _ptr(slot), _ptr(weight), _ptr(out), np.int64(t), np.int64(k), np.int64(rows.shape[1])))
    return out
