"""CUDA kernels: compiled for sm_90 on this CPU machine, and their references checked against plain torch.

The kernels themselves run only on a GPU (tests/gpu/test_kernels_gpu.py compares them with these
references there). Compilation tests skip, with the reason, when CuPy or nvcc / libnvrtc is missing.
"""
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from deepspeed_feplb.kernels import cuda as kernels
from deepspeed_feplb.kernels import reference
from deepspeed_feplb.migrate.arena import (
    ALIGN,
    align_up,
    message_layout,
    plan_arena_offsets,
    ring_capacity,
    slot_bytes,
    transport_bytes_per_rank,
)


# ------------------------------------------------------------------------------------ compilation
def _defined_kernels(text: str) -> set:
    return set(re.findall(r'extern "C" __global__ void (\w+)\(', text))


def test_every_kernel_in_the_source_is_listed_for_loading():
    assert _defined_kernels(kernels.source()) == set(kernels.KERNELS)
    assert not re.search(r"^\s*#\s*include", kernels.source(), re.M), "NVRTC on the GPU host has no host headers"


def test_kernels_compile_for_sm90_with_nvcc():
    pytest.importorskip("cupy", reason="CuPy not installed (pip install cupy-cuda12x)")
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH")
    cubin = kernels.compile_cubin("90")
    assert cubin[:4] == b"\x7fELF", "nvcc did not return a cubin"
    for name in kernels.KERNELS:
        assert f".text.{name}\0".encode() in cubin, f"{name} missing from the sm_90 cubin"


def test_kernels_compile_for_sm90_with_nvrtc():
    """The GPU host compiles with NVRTC (CuPy's default): the source must build without nvcc's headers."""
    pytest.importorskip("cupy", reason="CuPy not installed")
    from cupy_backends.cuda.libs import nvrtc
    try:
        nvrtc.getVersion()
    except Exception as exc:  # noqa: BLE001 - any failure to load libnvrtc means "not available"
        pytest.skip(f"libnvrtc not available ({exc}); pip install nvidia-cuda-nvrtc-cu12")
    program = nvrtc.createProgram(kernels.source(), kernels.SOURCE_NAME, [], [])
    try:
        nvrtc.compileProgram(program, ["-arch=sm_90", *kernels.OPTIONS])
    except Exception:
        pytest.fail(f"NVRTC compile failed:\n{nvrtc.getProgramLog(program)}")
    cubin = nvrtc.getCUBIN(program)
    for name in kernels.KERNELS:
        assert f".text.{name}\0".encode() in cubin


def test_cuda_backend_calls_exist_in_cupy_runtime():
    """Catch a misspelt CUDA runtime call without a GPU: every ``self._rt.X`` must exist in CuPy."""
    runtime = pytest.importorskip("cupy.cuda.runtime", reason="CuPy not installed")
    source = Path(__file__).resolve().parents[1].joinpath("deepspeed_feplb/migrate/backend.py").read_text()
    used = set(re.findall(r"self\._rt\.(\w+)", source))
    assert {"malloc", "ipcOpenMemHandle", "memcpyAsync", "streamWaitEvent", "ipcGetEventHandle"} <= used
    missing = sorted(name for name in used if not hasattr(runtime, name))
    assert not missing, f"not in cupy.cuda.runtime: {missing}"


# ------------------------------------------------------------------------------------ references
def _rows(n, h=5, dtype=torch.float32, seed=0):
    return torch.randn(n, h, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_gather_rows_is_index_select_with_zero_rows(dtype):
    src = _rows(7, dtype=torch.float32).mul(10).to(dtype)
    index = torch.tensor([3, -1, 0, 6, 3, -1])
    out = reference.gather_rows(src, index)
    for i, j in enumerate(index.tolist()):
        assert torch.equal(out[i], src[j] if j >= 0 else torch.zeros_like(src[0]))
    assert out.dtype == dtype and out.shape == (6, 5)
    assert kernels.gather_rows(src, index).equal(out)  # CPU tensors take the reference


def test_scatter_rows_inverts_gather_of_a_permutation():
    src = _rows(6)
    perm = torch.randperm(6, generator=torch.Generator().manual_seed(3))
    gathered = reference.gather_rows(src, perm)
    back = reference.scatter_rows(gathered, perm, torch.zeros_like(src))
    assert torch.equal(back, src)
    dst = torch.full((4, 5), 9.0)
    reference.scatter_rows(src[:3], torch.tensor([2, -1, 0]), dst)
    assert torch.equal(dst[2], src[0]) and torch.equal(dst[0], src[2]) and (dst[[1, 3]] == 9).all()


def test_expert_positions_is_a_stable_sort_by_expert():
    g = torch.Generator().manual_seed(5)
    routes = torch.randint(-1, 5, (200, ), generator=g)
    routes[::17] = 7  # outside [0, 5): not local
    counts, position = kernels.expert_positions(routes, 5)
    valid = (routes >= 0) & (routes < 5)
    assert counts.tolist() == [int((routes == e).sum()) for e in range(5)]
    assert (position[~valid] == -1).all()
    order = torch.argsort(torch.where(valid, routes, torch.full_like(routes, 99)), stable=True)[:int(valid.sum())]
    assert torch.equal(position[order], torch.arange(int(valid.sum())))  # stable: receive order kept
    offsets = torch.tensor([100, 0, 50, 7, 3])
    shifted = reference.expert_positions(routes, 5, offsets)
    assert torch.equal(shifted[valid], position[valid] - (torch.cumsum(counts, 0) - counts)[routes[valid]]
                       + offsets[routes[valid]])


def test_the_torch_dispatchers_regroup_takes_rows_from_source_major_to_expert_major():
    """`torch_a2a.expert_major_order` (vectorised) against its definition, block by block, on
    random block sizes with empty blocks, sources and experts."""
    from deepspeed_feplb.dispatch.torch_a2a import expert_major_order
    rng = np.random.default_rng(3)
    for _ in range(300):
        counts = rng.integers(0, 6, size=(rng.integers(1, 9), rng.integers(1, 33)))
        counts *= rng.random(counts.shape) < rng.random()
        starts = np.cumsum(counts.reshape(-1)).reshape(counts.shape) - counts
        want = [row for e in range(counts.shape[1]) for s in range(counts.shape[0])
                for row in range(starts[s, e], starts[s, e] + counts[s, e])]
        got = expert_major_order(counts)
        assert got.dtype == np.int64 and got.tolist() == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_weighted_combine_matches_the_torch_dispatcher_formula(dtype):
    rows = _rows(9, 6, dtype=dtype, seed=1)
    slot = torch.tensor([[0, 4], [-1, 8], [-1, -1], [3, 3]])
    weight = torch.rand(4, 2, generator=torch.Generator().manual_seed(2))
    out = reference.weighted_combine(rows, slot, weight)
    padded = torch.cat([rows, rows.new_zeros(1, 6)])
    routed = padded[torch.where(slot < 0, 9, slot).t()]  # [k, T, H] as TorchDispatcher.combine builds it
    want = (routed * weight.t().unsqueeze(-1)).sum(0).to(dtype)
    assert out.dtype == dtype
    assert torch.equal(out, want)
    assert (out[2] == 0).all()


# ------------------------------------------------------------------------------------ arena sizes
def test_message_layout_is_aligned_and_disjoint():
    specs = [(torch.bfloat16, (3, 7)), (torch.float32, ()), (torch.int64, (0, 4)), (torch.float32, (100, ))]
    offsets, total = message_layout(specs)
    sizes = [42, 4, 0, 400]
    assert offsets == [0, 256, 512, 512] and total == 1024
    assert all(o % ALIGN == 0 for o in offsets)
    for (o, s), nxt in zip(zip(offsets, sizes), offsets[1:] + [total]):
        assert o + s <= nxt
    arena_offsets, arena_total = plan_arena_offsets(np.array([1, 256, 257, 0]))
    assert arena_offsets.tolist() == [0, 256, 512, 1024] and arena_total == 1024


def test_the_slot_formula_of_docs_gpu():
    # GLM-5-like (docs/GPU.md): 72 MiB bf16 experts, hidden 6144, D=4, 3 tensors per chunk, 32k mean rows
    slot = slot_bytes(4, 72 << 20, 3, 32768, 6144 * 2)
    assert slot == align_up(4 * ((72 << 20) + 3 * 256) + 32768 * 6144 * 2)
    # each peer's inbound allocation: a ring of 4 slots holding ``slot``
    assert transport_bytes_per_rank(8, slot) == 7 * 4 * ring_capacity(slot)
    assert slot <= 4 * ring_capacity(slot) < slot + 4 * 256
    assert transport_bytes_per_rank(1, slot) == 0
    assert align_up(1) == 256 and align_up(256) == 256 and align_up(0) == 0


# ------------------------------------------------------------------------------------ selection
def test_selection_on_a_cpu_machine():
    from deepspeed_feplb.config import FEPLBConfigError, load_config
    from deepspeed_feplb.dispatch import make_dispatcher
    from deepspeed_feplb.dispatch.torch_a2a import TorchDispatcher
    from deepspeed_feplb.migrate import cuda_available, transport_class
    from deepspeed_feplb.migrate.shm import ShmTransport
    params = [torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))]
    auto = load_config({"feplb": {}})
    assert isinstance(make_dispatcher(auto, None, 2, 4, params, hidden=64), TorchDispatcher)
    assert transport_class(auto, params) is ShmTransport
    with pytest.raises(FEPLBConfigError, match="feplb.ep_backend"):
        make_dispatcher(load_config({"feplb": {"ep_backend": "deepep"}}), None, 2, 4, params, hidden=64)
    if not cuda_available():
        with pytest.raises(FEPLBConfigError, match="feplb.transport"):
            transport_class(load_config({"feplb": {"transport": "cuda_ce"}}), params)


def test_cuda_experts_never_go_to_the_host_memory_transport():
    """Experts on CUDA with ``transport: shm``, or with ``auto`` where CuPy is missing, are refused
    naming the transport and what is missing (the shm transport would crash on a CPU/CUDA concat)."""
    from types import SimpleNamespace

    from deepspeed_feplb.config import FEPLBConfigError, load_config
    from deepspeed_feplb.migrate import cuda_available, transport_kind
    on_cuda = [SimpleNamespace(is_cuda=True)]
    with pytest.raises(FEPLBConfigError, match="\"shm\" moves host memory and the experts are on CUDA"):
        transport_kind(load_config({"feplb": {"transport": "shm"}}), on_cuda)
    if not cuda_available():
        with pytest.raises(FEPLBConfigError, match="feplb.transport: \"auto\" with experts on CUDA .*needs CuPy"):
            transport_kind(load_config({"feplb": {}}), on_cuda)
    assert transport_kind(load_config({"feplb": {}}), [SimpleNamespace(is_cuda=False)]) == "shm"
