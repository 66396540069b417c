"""`grouped_mlp.StackedMLP` on CUDA in bf16: torch's native grouped GEMM, without a host sync, equal to
one call per expert up to one bf16 rounding, zero weight-gradients for experts without rows (Hopper)."""
import pytest
import torch

pytestmark = pytest.mark.gpu


def _relative(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("hidden, ffn, sizes", [(16, 32, [5, 0, 300, 1, 0]), (2048, 1408, [700, 0, 1, 4093])])
def test_grouped_bf16_equals_one_call_per_expert_without_a_sync(hidden, ffn, sizes):
    from deepspeed_feplb.grouped_mlp import StackedMLP, empty_groups_zeroed, grouped_mm_runs

    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    experts = [torch.nn.Sequential(torch.nn.Linear(hidden, ffn), torch.nn.GELU(), torch.nn.Linear(ffn, hidden))
               .to(dev, torch.bfloat16) for _ in sizes]
    layer = StackedMLP.of(experts[0])
    assert layer is not None and grouped_mm_runs(dev, torch.bfloat16)
    x = torch.randn(sum(sizes), hidden, device=dev, dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    runs = []
    for grouped in (True, False):
        for e in experts:
            e.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        if grouped:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                y = layer.grouped(layer.stack([list(e.parameters()) for e in experts]), xi, sizes)
                y.backward(grad)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        else:
            y = torch.cat([e(rows) for e, rows in zip(experts, xi.split(sizes))])
            y.backward(grad)
        runs.append([y.detach(), xi.grad] + [p.grad if p.grad is not None else torch.zeros_like(p)
                                             for e in experts for p in e.parameters()])
    for got, want in zip(*runs):
        assert _relative(got, want) <= 2**-7
    if empty_groups_zeroed(dev):
        for i in (i for i, n in enumerate(sizes) if n == 0):
            assert all(not g.any() for g in runs[0][2 + 4 * i:6 + 4 * i])
