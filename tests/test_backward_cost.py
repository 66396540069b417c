"""Backward at GEMM cost: the expert stage hands each expert its rows through one split, so a layer
backward assembles the rows' gradient once, instead of zero-filling a full-size ``[N, H]`` gradient
per expert (``aten::slice_backward``), which at 32 local experts cost more memory traffic than the
experts' own backward GEMMs."""
import torch

from deepspeed_feplb.testing import run_distributed

LOCAL_EXPERTS = 32
HIDDEN = 16


def _slice_backwards_per_layer_backward(ep_size: int) -> dict:
    """FEPLB's layer (32 local experts, migrating when ``ep_size`` > 1) and DeepSpeed's: the
    ``aten::slice_backward`` calls one backward makes, and whether this rank's layer balanced."""
    import torch.distributed as dist
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    import deepspeed_feplb

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
            y, _, _ = layer(x)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            y.square().sum().backward()
        out[name] = sum(event.count for event in prof.key_averages() if event.key == "aten::slice_backward")
    stats = layers["feplb"].feplb_stats
    out["migrated"] = int(stats.get("migrated_tokens", 0)) if stats else 0
    return out


def test_one_layer_backward_makes_at_most_two_full_size_slice_backwards_without_migration():
    (result, ) = run_distributed(_slice_backwards_per_layer_backward, 1, 1, timeout=120)
    assert result["feplb"] <= 2, result


def test_with_migration_too():
    results = run_distributed(_slice_backwards_per_layer_backward, 2, 2, timeout=180)
    assert sum(r["migrated"] for r in results) > 0, "nothing migrated: the test shows nothing"
    for rank, result in enumerate(results):
        assert result["feplb"] <= 2, (rank, result)
