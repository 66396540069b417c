"""`grouped_mlp.StackedMLP` on CUDA in bf16: torch's native grouped GEMM, without a host sync, equal to
one call per expert up to one bf16 rounding, zero weight-gradients for experts without rows (Hopper),
the same gradients every run."""
import contextlib

import pytest
import torch

pytestmark = pytest.mark.gpu


@contextlib.contextmanager
def _no_sync():
    """Every synchronising CUDA call inside the block raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("hidden, ffn, sizes", [(16, 32, [5, 0, 300, 1, 0]), (2048, 1408, [700, 0, 1, 4093])])
def test_grouped_bf16_equals_one_call_per_expert_without_a_sync(hidden, ffn, sizes):
    from test_grouped_mlp import grouped_and_per_expert, relative

    from deepspeed_feplb.grouped_mlp import StackedMLP, empty_groups_zeroed, grouped_mm_runs

    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    experts = [torch.nn.Sequential(torch.nn.Linear(hidden, ffn), torch.nn.GELU(), torch.nn.Linear(ffn, hidden))
               .to(dev, torch.bfloat16) for _ in sizes]
    assert StackedMLP.of(experts[0]) is not None and grouped_mm_runs(dev, torch.bfloat16)
    grouped, per_expert = grouped_and_per_expert(experts, sizes, torch.bfloat16, around_grouped=_no_sync)
    for got, want in zip(grouped, per_expert):
        assert relative(got, want) <= 2**-7
    if empty_groups_zeroed(dev):
        for i in (i for i, n in enumerate(sizes) if n == 0):
            assert all(not g.any() for g in grouped[2 + 4 * i:6 + 4 * i])


def test_grouped_gradients_are_the_same_every_run():
    """The grouped layer's gradients, bias gradients included (summed per expert in row order, not
    with atomics), are bit for bit the same from one run to the next on the GPU."""
    from test_grouped_mlp import grouped_and_per_expert

    torch.manual_seed(0)
    dev, sizes = torch.device("cuda", 0), [700, 0, 1, 4093]
    experts = [torch.nn.Sequential(torch.nn.Linear(2048, 1408), torch.nn.GELU(), torch.nn.Linear(1408, 2048))
               .to(dev, torch.bfloat16) for _ in sizes]
    first, second = (grouped_and_per_expert(experts, sizes, torch.bfloat16)[0] for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, second))
