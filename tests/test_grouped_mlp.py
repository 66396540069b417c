"""`grouped_mlp.StackedMLP`: which experts compute grouped, the same math as one call per expert,
and a launch count that does not grow with the experts; in the layer, the aten-op budget of issue
"GPU hot path II" (the expert stage of a known MLP at 32 local experts)."""
import contextlib

import pytest
import torch

from deepspeed_feplb.grouped_mlp import StackedMLP
from deepspeed_feplb.testing import experts_in_one_buffer, run_distributed
from deepspeed_feplb.testing.op_count import count_ops

H = 16


def mlp(*middle, bias=True, up=H, ffn=2 * H, cls=torch.nn.Sequential):
    return cls(torch.nn.Linear(up, ffn, bias=bias), *middle, torch.nn.Linear(ffn, up, bias=bias))


class Custom(torch.nn.Sequential):
    pass


@pytest.mark.parametrize("expert, known", [
    (mlp(torch.nn.GELU()), True),
    (mlp(torch.nn.SiLU(), bias=False), True),
    (mlp(torch.nn.GELU(approximate="tanh")), True),
    (mlp(torch.nn.Dropout(0.1)), False),  # random: rows would draw in another order
    (mlp(torch.nn.Softmax(dim=-1)), False),  # not elementwise
    (mlp(torch.nn.ReLU(inplace=True)), False),
    (mlp(torch.nn.PReLU()), False),  # a parameter of its own
    (mlp(torch.nn.GELU(), cls=Custom), False),  # a class that may compute something else
    (mlp(torch.nn.GELU(), up=6, ffn=12), False),  # 24-byte rows: the grouped GEMM needs 16-byte multiples
    (torch.nn.Sequential(torch.nn.Linear(H, 2 * H), torch.nn.GELU(), torch.nn.Linear(2 * H, H, bias=False)), False),
    (torch.nn.Sequential(torch.nn.Linear(H, 2 * H), torch.nn.GELU()), False),
])
def test_only_a_known_mlp_is_grouped(expert, known):
    assert (StackedMLP.of(expert) is not None) == known


def grouped_and_per_expert(experts, sizes, dtype, grad_of_sum=False, around_grouped=contextlib.nullcontext):
    """(grouped, per-expert) outputs and gradients of x and of every parameter, on the experts'
    device; the grouped forward and backward run inside ``around_grouped()``."""
    torch.manual_seed(1)
    device, hidden = experts[0][0].weight.device, experts[0][0].in_features
    x = torch.randn(sum(sizes), hidden, dtype=dtype).to(device)
    grad = torch.randn(sum(sizes), hidden, dtype=dtype).to(device)
    runs = []
    for grouped in (True, False):
        for e in experts:
            e.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        with around_grouped() if grouped else contextlib.nullcontext():
            if grouped:
                layer = StackedMLP.of(experts[0])
                y = layer.grouped(layer.stack([list(e.parameters()) for e in experts]), xi, sizes)
            else:
                y = torch.cat([e(rows) for e, rows in zip(experts, xi.split(sizes))])
            y.sum().backward() if grad_of_sum else y.backward(grad)
        runs.append([y.detach(), xi.grad] + [p.grad if p.grad is not None else torch.zeros_like(p)
                                             for e in experts for p in e.parameters()])
    return runs


def relative(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 2**-7)])
@pytest.mark.parametrize("sizes", [[5, 0, 9, 1], [0, 0, 3, 0], [7]])
def test_grouped_equals_one_call_per_expert(dtype, tolerance, sizes):
    torch.manual_seed(0)
    experts = [mlp(torch.nn.GELU()).to(dtype) for _ in sizes]
    grouped, loop = grouped_and_per_expert(experts, sizes, dtype)
    for got, want in zip(grouped, loop):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert relative(got, want) <= tolerance
    empty = [i for i, n in enumerate(sizes) if n == 0]
    for i in empty:  # an expert without rows: zero gradients (its parameters are 4 per expert)
        assert all(not g.any() for g in grouped[2 + 4 * i:2 + 4 * i + 4])


def test_an_expanded_output_gradient_is_taken():
    experts = [mlp(torch.nn.SiLU(), bias=False) for _ in range(3)]
    grouped, loop = grouped_and_per_expert(experts, [4, 2, 6], torch.float32, grad_of_sum=True)
    assert all(relative(a, b) <= 1e-6 for a, b in zip(grouped, loop))


def test_weights_laid_out_as_zero_does_are_grouped_without_a_copy_and_unused_experts_get_no_gradient():
    """`StackedMLP.in_place`: where every expert's parameters lie in one buffer, one expert after the
    other (ZeRO 1/2's flat buffers), each parameter over the experts is a strided view, not a
    `torch.stack` copy of all the static experts' weights per forward; the math is the stacked
    call's. An unused expert (a dynamic one, computed by phase 2) is a group of no rows whose
    parameters get no gradient (None), not zeros that would be added to phase 2's."""
    torch.manual_seed(0)
    sizes, unused = [5, 0, 9, 3], [False, True, False, False]
    experts = [mlp(torch.nn.GELU()) for _ in sizes]
    flat = experts_in_one_buffer(experts)  # as ZeRO 1/2's flat buffers hold them
    layer = StackedMLP.of(experts[0])
    params = [list(e.parameters()) for e in experts]
    x = torch.randn(sum(sizes), H)
    grad = torch.randn(sum(sizes), H)
    outs = []
    for in_place in (True, False):
        for e in experts:
            e.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        with count_ops() as forward:
            weights = layer.in_place(params, unused) if in_place else layer.stack(params)
        if in_place:
            assert forward.non_view == 0
            assert weights[0].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        y = layer.grouped(weights, xi, sizes)
        y.backward(grad)
        outs.append((y.detach(), xi.grad, [[p.grad for p in group] for group in params]))
    (y, gx, grads), (y_ref, gx_ref, grads_ref) = outs
    assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref)
    for i, (got, want) in enumerate(zip(grads, grads_ref)):
        if unused[i]:
            assert all(g is None for g in got) and all(not w.any() for w in want)
        else:
            assert all(torch.equal(g, w) for g, w in zip(got, want)), i
    separate = [mlp(torch.nn.GELU()) for _ in sizes]  # each parameter its own tensor: copied by `stack`
    assert layer.in_place([list(e.parameters()) for e in separate], unused) is None


def test_its_launches_do_not_grow_with_the_experts():
    counts = []
    for k in (4, 32):
        experts = [mlp(torch.nn.GELU()) for _ in range(k)]
        layer = StackedMLP.of(experts[0])
        x = torch.randn(8 * k, H, requires_grad=True)
        with count_ops() as forward:
            y = layer.grouped(layer.stack([list(e.parameters()) for e in experts]), x, [8] * k)
        with count_ops() as backward:
            y.backward(torch.ones_like(y))
        counts.append((forward.non_view, backward.non_view))
    assert counts[0] == counts[1], counts
    assert counts[1][0] <= 14 and counts[1][1] <= 16, counts


def _stage_ops() -> dict:
    """Non-view aten ops of one FEPLB layer (64 experts top-8 over 2 ranks: 32 local, Linear-GELU-
    Linear, D = 0) and of its expert stage, forward and backward (gradients None, as after a step)."""
    import torch.distributed as dist

    import deepspeed_feplb
    from deepspeed_feplb.expert_stage import ExpertStage
    torch.manual_seed(0)
    layer = deepspeed_feplb.MoE(hidden_size=H, expert=mlp(torch.nn.GELU()), num_experts=64, ep_size=2, k=8,
                                min_capacity=0, drop_tokens=False, use_rts=False,
                                feplb_config={"dynamic_experts_per_rank": 0})
    layer.set_deepspeed_parallelism()
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(256, H, generator=g)
    out, l_aux, _ = layer(x.clone().requires_grad_(True))
    (out.sum() + l_aux).backward()
    layer.zero_grad(set_to_none=True)
    run = ExpertStage.run
    stage = {}

    def counted(self, rows, *args, **kwargs):
        with count_ops() as forward:
            out = run(self, rows, *args, **kwargs)
        stage["forward"] = forward.non_view
        return out

    ExpertStage.run = counted
    try:
        with count_ops() as forward:
            out, l_aux, _ = layer(x.clone().requires_grad_(True))
    finally:
        ExpertStage.run = run
    loss = out.sum() + l_aux
    with count_ops() as backward:
        loss.backward()
    return {"stage_forward": stage["forward"], "layer_forward": forward.non_view, "layer_backward": backward.non_view,
            "grouped": layer.deepspeed_moe.stacked_mlp is not None}


def test_a_known_mlp_layer_launches_few_ops_at_32_local_experts():
    for figures in run_distributed(_stage_ops, 2, timeout=120):
        assert figures["grouped"]
        # one call per expert took 97 forward (64 addmm, 32 gelu) and 266 in the layer's backward
        assert figures["stage_forward"] <= 25, figures
        assert figures["layer_forward"] <= 120 and figures["layer_backward"] <= 120, figures


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_under_zero_the_static_experts_weights_are_not_copied_each_forward(zero_stage):
    """ZeRO 1 and 2 lay the experts' parameters in their flat buffer one expert after the other: a
    balanced layer's static experts then compute from their weights as they lie (no `stack`); the
    equivalence with DeepSpeed's MoE under ZeRO 1/2 (`test_layer_equivalence.py`) covers the math."""
    import moe_cases
    for rank, result in enumerate(run_distributed(moe_cases.zero_in_place_case, 2, zero_stage, timeout=240)):
        assert result["ops"].get("stack", 0) == 0 and result["ops"]["_grouped_mm"] >= 2, (rank, result["ops"])
        assert result["migrated"] > 0 or rank == 1, result  # the micro-batch was balanced
