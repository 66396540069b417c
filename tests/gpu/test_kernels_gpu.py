"""Every kernel of ops/feplb_kernels.cu against its reference, on the GPU."""
import pytest
import torch

from deepspeed_feplb.kernels import cuda as kernels
from deepspeed_feplb.kernels import reference

pytestmark = pytest.mark.gpu


def _dev():
    return torch.device("cuda", 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
@pytest.mark.parametrize("hidden", [7, 64, 7168])  # odd row bytes take the byte path, others 16-byte words
def test_gather_and_scatter_rows(dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    src = (torch.randn(300, hidden, generator=g) * 100).to(dtype)
    index = torch.randint(-1, 300, (517, ), generator=g)
    out = kernels.gather_rows(src.to(_dev()), index.to(_dev()))
    assert torch.equal(out.cpu(), reference.gather_rows(src, index))
    perm = torch.randperm(300, generator=g)
    dst = torch.zeros_like(src).to(_dev())
    kernels.scatter_rows(src.to(_dev()), perm.to(_dev()), dst)
    assert torch.equal(dst.cpu(), reference.scatter_rows(src, perm, torch.zeros_like(src)))


@pytest.mark.parametrize("routes,experts", [(0, 4), (1, 1), (1000, 8), (70000, 33)])
def test_expert_positions_stable(routes, experts):
    g = torch.Generator().manual_seed(routes)
    e = torch.randint(-1, experts + 1, (routes, ), generator=g)
    counts, position = kernels.expert_positions(e.to(_dev()), experts)
    ref_counts = reference.expert_counts(e, experts)
    assert torch.equal(counts.cpu(), ref_counts)
    assert torch.equal(position.cpu(), reference.expert_positions(e, experts, torch.cumsum(ref_counts, 0) - ref_counts))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_weighted_combine(dtype):
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(4000, 1024, generator=g).to(dtype)
    slot = torch.randint(-1, 4000, (1500, 4), generator=g)
    weight = torch.rand(1500, 4, generator=g)
    out = kernels.weighted_combine(rows.to(_dev()), slot.to(_dev()), weight.to(_dev())).cpu()
    want = reference.weighted_combine(rows, slot, weight)
    assert out.dtype == dtype
    assert torch.equal(out, want), (out.float() - want.float()).abs().max()
