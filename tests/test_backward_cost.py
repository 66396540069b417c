"""Backward at GEMM cost: the expert stage hands each expert its rows through one split, so a layer
backward assembles the rows' gradient once, instead of zero-filling a full-size ``[N, H]`` gradient
per expert (``aten::slice_backward``), which at 32 local experts cost more memory traffic than the
experts' own backward GEMMs. And the host's share: the forward computes the static experts with
the model's own modules (their parameters bound once per forward), not one
`torch.func.functional_call` per expert; only phase 2's pieces run functionally."""
import torch

from deepspeed_feplb.testing import run_distributed

LOCAL_EXPERTS = 32
HIDDEN = 16


def _slice_backwards_per_layer_backward(ep_size: int) -> dict:
    """FEPLB's layer (32 local experts, migrating when ``ep_size`` > 1) and DeepSpeed's: the
    ``aten::slice_backward`` calls one backward makes, whether this rank's layer balanced, and
    FEPLB's functional expert calls in the measured forward."""
    import torch.distributed as dist
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    import deepspeed_feplb
    from deepspeed_feplb.experts import ExpertSpec

    functional = [0]
    call = ExpertSpec.call

    def counted(self, *args):
        functional[0] += 1
        return call(self, *args)
    ExpertSpec.call = counted

    torch.manual_seed(0)
    kwargs = dict(hidden_size=HIDDEN, expert=torch.nn.Linear(HIDDEN, HIDDEN), num_experts=LOCAL_EXPERTS * ep_size,
                  ep_size=ep_size, k=2, min_capacity=0, drop_tokens=False, use_rts=False)
    feplb = {"dynamic_experts_per_rank": 2, "chunk_align_tokens": 1, "fixed_costs": "ignore"}
    layers = {"feplb": deepspeed_feplb.MoE(**kwargs, feplb_config=feplb), "deepspeed": DeepSpeedMoE(**kwargs)}
    out = {}
    for name, layer in layers.items():
        layer.set_deepspeed_parallelism()
        with torch.no_grad():  # every rank's tokens favour the first rank's experts: phase 2 migrates
            layer.deepspeed_moe.gate.wg.weight[:LOCAL_EXPERTS // 2] += 1.0
        x = torch.randn(512, HIDDEN, generator=torch.Generator().manual_seed(dist.get_rank() if ep_size > 1 else 0),
                        requires_grad=True)
        for _ in range(2):  # the second forward is the measured one (the first attaches)
            functional[0] = 0
            y, _, _ = layer(x)
        out[name + "_functional_calls"] = functional[0]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            y.square().sum().backward()
        out[name] = sum(event.count for event in prof.key_averages() if event.key == "aten::slice_backward")
    stats = layers["feplb"].feplb_stats
    out["migrated"] = int(stats.get("migrated_tokens", 0)) if stats else 0
    return out


def test_one_layer_backward_makes_at_most_two_full_size_slice_backwards_without_migration():
    (result, ) = run_distributed(_slice_backwards_per_layer_backward, 1, 1, timeout=120)
    assert result["feplb"] <= 2, result
    assert result["feplb_functional_calls"] == 0, result


def test_with_migration_too():
    results = run_distributed(_slice_backwards_per_layer_backward, 2, 2, timeout=180)
    assert sum(r["migrated"] for r in results) > 0, "nothing migrated: the test shows nothing"
    for rank, result in enumerate(results):
        assert result["feplb"] <= 2, (rank, result)
        # phase 2 only: its D = 2 dynamic experts' pieces at home and the other rank's it helps with
        assert result["feplb_functional_calls"] <= 2 * 2, (rank, result)


def test_bound_parameters_are_the_modules_own_inside_and_come_back_however_the_block_ends():
    import pytest

    from deepspeed_feplb.experts import ExpertSpec, LocalExperts

    def tied():
        module = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Linear(HIDDEN, HIDDEN))
        module[1].weight = module[0].weight  # one parameter under two names
        return module
    modules = [tied(), tied()]
    spec = ExpertSpec.of(modules[0])
    experts = LocalExperts(modules, lambda: None, spec, direct=lambda e, x: modules[e](x))
    own = [[p for p in m.parameters()] for m in modules]
    aliases = [[p.detach().clone().requires_grad_() for p in ps] for ps in own]
    x = torch.randn(3, HIDDEN)
    with experts.calls(aliases) as call:
        for e in range(2):
            assert torch.equal(call(e, x), spec.call(modules[e], aliases[e], [], x))
        assert modules[0][1].weight is aliases[0][0] and modules[0][0].weight is aliases[0][0]
        call(0, x).sum().backward()
    assert aliases[0][0].grad is not None and own[0][0].grad is None
    assert [[p for p in m.parameters()] for m in modules] == own
    with pytest.raises(RuntimeError, match="inside"), experts.calls(aliases):
        raise RuntimeError("inside")
    assert all(a is b for m, ps in zip(modules, own) for a, b in zip(m.parameters(), ps))
    assert modules[0][1].weight is own[0][0]
    with pytest.raises(ValueError, match="one module per local expert"):
        LocalExperts([modules[0], modules[0]], lambda: None, spec, direct=lambda e, x: x)


def test_a_pieces_call_with_given_weights_and_buffers_equals_functional_call():
    from torch.func import functional_call

    from deepspeed_feplb.experts import ExpertSpec

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(HIDDEN, HIDDEN)
            self.out = torch.nn.Linear(HIDDEN, HIDDEN)
            self.out.weight = self.inner.weight  # tied
            self.register_buffer("scale", torch.tensor(2.0))

        def forward(self, x):
            return self.out(self.inner(x).relu()) * self.scale

    template, other = Scaled(), Scaled()
    spec = ExpertSpec.of(template)
    assert spec.buffer_names == ["scale"]
    weights = [p.detach().clone().requires_grad_() for p in other.parameters()]
    buffers = [torch.tensor(3.0)]
    x = torch.randn(5, HIDDEN, requires_grad=True)
    ours = spec.call(template, weights, buffers, x)
    theirs = functional_call(template, {**dict(zip(spec.param_names, weights)), "scale": buffers[0]}, (x, ))
    assert torch.equal(ours, theirs)
    g_ours = torch.autograd.grad(ours.sum(), [x, *weights])
    g_theirs = torch.autograd.grad(theirs.sum(), [x, *weights])
    assert all(torch.equal(a, b) for a, b in zip(g_ours, g_theirs))
    assert template.scale is template._buffers["scale"] and float(template.scale) == 2.0  # its own again
    assert template.out.weight is template.inner.weight and template.inner.weight is not weights[0]
