"""Routing overrides through real 4-rank FEPLB layers (one gloo launch, many checks).

* a shipped trace replayed through two 4-rank layers reproduces its per-expert counts exactly
  (per source rank in ``exp_counts``, per expert over the EP group, per rank in ``feplb_stats``);
* forcing the gate's own top-k equals DeepSpeed's MoE with its real gate (outputs, all grads);
* `assert_equal_to_unbalanced` passes for skewed routing with real migrations, against FEPLB
  without balancing and against DeepSpeed's MoE, and catches a non-reproducible routing;
* `assert_same_on_all_ranks` passes on a domain's stats and names the ranks that differ;
* an override installed on DeepSpeed's MoE survives conversion to FEPLB and the sigmoid scoring
  option (which swaps the gate at attach time).
"""
import copy

import numpy as np
import pytest
import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE as DeepSpeedMoE

import deepspeed_feplb
from deepspeed_feplb.testing import (
    RoutedGate,
    TraceRouting,
    assert_equal_to_unbalanced,
    assert_same_on_all_ranks,
    distinct_experts,
    example_trace_path,
    one_hot_expert_routing,
    override_routing,
    run_distributed,
    zipf_routing,
)
from deepspeed_feplb.trace.format import load_trace, rank_loads

HIDDEN, TOKENS, WORLD = 8, 32, 4
EXPERT_COUNTS_KEY = "expert_tokens_before"  # per-expert rows in feplb_stats, once the layer reports them
FEPLB = {"nvlink_domain_size": 4, "dynamic_experts_per_rank": 1, "chunk_align_tokens": 1, "fixed_costs": "ignore",
         "max_helpers_per_expert": 3}


def expert(hidden=HIDDEN):
    return torch.nn.Sequential(torch.nn.Linear(hidden, 2 * hidden), torch.nn.GELU(),
                               torch.nn.Linear(2 * hidden, hidden))


def feplb_moe(k=2, experts=8, ep_size=WORLD, feplb=FEPLB, seed=0):
    torch.manual_seed(seed)
    moe = deepspeed_feplb.MoE(HIDDEN, expert(), num_experts=experts, ep_size=ep_size, k=k, min_capacity=0,
                              drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False, feplb_config=feplb)
    moe.set_deepspeed_parallelism()
    distinct_experts(moe, seed)
    return moe


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = feplb_moe(seed=1), feplb_moe(seed=2)

    def forward(self, x):
        y, aux1, _ = self.first(x)
        z, aux2, _ = self.second(torch.tanh(y) + 1.0)
        return z, aux1 + aux2


def inputs(step, tokens=TOKENS):
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(tokens, HIDDEN, generator=g) + 1.0


def replay_trace():
    model = TwoLayers()
    routing = override_routing(model, TraceRouting(example_trace_path()))
    steps = []
    for step in range(4):
        out, l_aux = model(inputs(step))
        (out.square().mean() + 0.01 * l_aux).backward()
        record = {"local": [], "global": [], "stats": []}
        for moe in (model.first, model.second):
            local = moe.deepspeed_moe.exp_counts.clone()
            summed = local.clone()
            dist.all_reduce(summed)
            record["local"].append(local.tolist())
            record["global"].append(summed.tolist())
            record["stats"].append(copy.deepcopy(moe.feplb_stats))
            assert_same_on_all_ranks(moe.feplb_stats["tokens_before"], "tokens_before of the domain")
        steps.append(record)
    grads = {name: float(p.grad.abs().sum()) for name, p in model.named_parameters() if "wg" in name}
    finite = all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    return {"steps": steps, "routed_steps": routing.steps, "gate_grads": grads, "finite": bool(finite)}


def own_top_k_equals_deepspeed(k=2):
    torch.manual_seed(5)
    kwargs = dict(hidden_size=HIDDEN, expert=expert(), num_experts=8, ep_size=WORLD, k=k, min_capacity=0,
                  drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False)
    reference = DeepSpeedMoE(**kwargs)
    ours = deepspeed_feplb.MoE(**kwargs, feplb_config=FEPLB)
    ours.load_state_dict(reference.state_dict())
    for layer in (reference, ours):
        layer.set_deepspeed_parallelism()
        distinct_experts(layer, seed=5)
    wg = ours.deepspeed_moe.gate.wg

    def own_top_k(request):  # the routing the real gate would choose
        return torch.topk(torch.nn.functional.linear(request.x, wg.weight), request.k, dim=1).indices

    override_routing(ours, own_top_k)
    x = inputs(7) + torch.linspace(0, 2, HIDDEN)  # skewed towards some experts by the input itself
    results = []
    for layer in (reference, ours):
        xi = x.clone().requires_grad_(True)
        out, l_aux, _ = layer(xi)
        ((out * torch.cos(out)).sum() + l_aux).backward()
        results.append((out.detach(), xi.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}))
    (ref_out, ref_dx, ref_g), (out, dx, g) = results
    errors = {"output": deepspeed_feplb.testing.relative_error(out, ref_out),
              "input_grad": deepspeed_feplb.testing.relative_error(dx, ref_dx)}
    errors.update({n: deepspeed_feplb.testing.relative_error(g[n], ref_g[n]) for n in ref_g})
    return {"errors": errors, "migrated": ours.feplb_stats["migrated_tokens"]}


_calls = [0]


def unreproducible(request):
    """Routes by a global call counter: the reference copy and the model see different routes."""
    _calls[0] += 1
    return (torch.arange(request.num_tokens)[:, None] * 3 + _calls[0] + torch.arange(request.k)) % request.num_experts


def equal_to_unbalanced():
    out = {}
    for k in (1, 2):
        for against in ("unbalanced", "deepspeed"):
            moe = feplb_moe(k=k, seed=k, feplb={**FEPLB, "nvlink_domain_size": 2})
            override_routing(moe, zipf_routing(skew=1.5, seed=k))
            result = assert_equal_to_unbalanced(moe, inputs(k), against=against)
            out[(k, against)] = {"worst": max(result["errors"].values()), "items": len(result["errors"]),
                                 "migrated": result["stats"][0]["migrated_tokens"],
                                 "grads_untouched": all(p.grad is None for p in moe.parameters())}
    moe = feplb_moe(k=2, seed=3)
    override_routing(moe, unreproducible)
    try:
        assert_equal_to_unbalanced(moe, inputs(3))
        out["caught"] = None
    except AssertionError as exc:
        out["caught"] = str(exc)
    try:
        assert_same_on_all_ranks({"w": torch.tensor([1.0, float(dist.get_rank() % 2)])}, "probe")
        out["differs"] = None
    except AssertionError as exc:
        out["differs"] = str(exc)
    return out


def sigmoid_keeps_the_override():
    """Override a plain DeepSpeed MoE, convert it to FEPLB with sigmoid scoring (which swaps the gate)."""
    feplb = {**FEPLB, "gating": {"score": "sigmoid", "bias_update_rate": 0.01}}
    torch.manual_seed(4)
    ds_moe = DeepSpeedMoE(HIDDEN, expert(), num_experts=8, ep_size=WORLD, k=1, min_capacity=0, drop_tokens=False,
                          use_rts=False)
    ds_moe.set_deepspeed_parallelism()
    override_routing(ds_moe, one_hot_expert_routing(expert=6, fraction=1.0))
    moe = deepspeed_feplb.MoE.from_deepspeed(ds_moe, feplb_config=feplb)
    out, _, counts = moe(inputs(9))
    out.sum().backward()
    gate = moe.deepspeed_moe.gate
    return {"counts": counts.tolist(), "routed": isinstance(gate, RoutedGate), "inner": type(gate.inner).__name__,
            "bias": gate.expert_bias.tolist(), "wg_grad": float(gate.wg.weight.grad.abs().sum()),
            "keys": sorted(moe.state_dict())}


# Per-expert pairs (home rank x local expert) whose balanced plan needs chained moves: rank 0 is
# the only receiver and may take two weight copies (the budget), three ranks are above the mean.
CHAIN_COUNTS = [[1, 1, 1, 1], [20, 13, 0, 2], [25, 12, 4, 4], [25, 12, 4, 3]]


def chained_plan():
    """A plan with a chain through a rank above the level (rank 1 -> rank 2 -> rank 0), under a
    Copy-Engine budget of two weight copies per rank, through the real layer: equal to DeepSpeed's MoE."""
    ids = np.repeat(np.arange(16), np.ravel(CHAIN_COUNTS))
    ids = ids[np.random.default_rng(0).permutation(ids.size)]  # every rank routes to every home

    def routes(request):
        return torch.from_numpy(ids[request.rank * TOKENS:(request.rank + 1) * TOKENS].copy())[:, None]

    expert_bytes = sum(p.numel() * p.element_size() for p in expert().parameters())
    moe = feplb_moe(k=1, experts=16, seed=5, feplb={**FEPLB, "dynamic_experts_per_rank": 2, "max_helpers_per_expert": 2,
                                                    "ce_budget": 2.5 * expert_bytes})
    override_routing(moe, routes)
    result = assert_equal_to_unbalanced(moe, inputs(5), against="deepspeed")
    return {"worst": max(result["errors"].values()), "stats": result["stats"][0]}


def all_cases():
    return {"trace": replay_trace(), "top_k": own_top_k_equals_deepspeed(), "unbalanced": equal_to_unbalanced(),
            "sigmoid": sigmoid_keeps_the_override(), "chain": chained_plan()}


@pytest.fixture(scope="module")
def results():
    return run_distributed(all_cases, WORLD, timeout=300, start_method="forkserver")


def test_replayed_trace_reproduces_its_per_expert_counts_exactly(results):
    trace = load_trace(example_trace_path())
    migrated = 0
    for rank, res in enumerate(results):
        case = res["trace"]
        assert case["routed_steps"] == [4, 4]
        for step, record in enumerate(case["steps"]):
            for layer in range(2):
                recorded = trace.counts[step, layer]
                assert record["local"][layer] == recorded[rank].tolist(), (rank, step, layer)
                assert record["global"][layer] == recorded.sum(0).tolist(), (rank, step, layer)
                stats = record["stats"][layer]
                assert stats["tokens_before"] == rank_loads(recorded.sum(0), WORLD).tolist(), (step, layer, stats)
                assert sum(stats["tokens_after"]) == sum(stats["tokens_before"])
                if EXPERT_COUNTS_KEY in stats:
                    assert np.ravel(stats[EXPERT_COUNTS_KEY]).tolist() == recorded.sum(0).tolist()
                migrated += stats["migrated_tokens"]
                assert stats["token_straggler_after"] < stats["token_straggler_before"], stats
        assert case["finite"] and all(v > 0 for v in case["gate_grads"].values()), case["gate_grads"]
    assert migrated > 0


def test_forcing_the_gates_own_choice_equals_deepspeeds_moe(results):
    for rank, res in enumerate(results):
        worst = max(res["top_k"]["errors"].items(), key=lambda item: item[1])
        assert worst[1] <= 1e-5, f"rank {rank}: {worst}"
    assert sum(res["top_k"]["migrated"] for res in results) > 0


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("against", ["unbalanced", "deepspeed"])
def test_equal_to_unbalanced_passes_with_real_migrations(results, k, against):
    cases = [res["unbalanced"][(k, against)] for res in results]
    assert all(c["worst"] <= 1e-5 and c["items"] >= 10 and c["grads_untouched"] for c in cases), cases
    assert sum(c["migrated"] for c in cases) > 0


def test_equal_to_unbalanced_and_same_on_all_ranks_report_differences(results):
    for rank, res in enumerate(results):
        caught = res["unbalanced"]["caught"]
        assert caught is not None and caught.startswith(f"rank {rank}: the FEPLB model is not equal to the unbalanced")
        assert "output[0] differs by" in caught
        assert res["unbalanced"]["differs"] == ("probe is not the same on all ranks:\n"
                                                "  rank 1 vs rank 0: probe['w']: max abs difference 1\n"
                                                "  rank 3 vs rank 0: probe['w']: max abs difference 1")


def test_sigmoid_scoring_keeps_the_override_and_the_state_dict(results):
    for res in results:
        case = res["sigmoid"]
        assert case["routed"] and case["inner"] == "SigmoidTopKGate"
        assert case["counts"] == [0, 0, 0, 0, 0, 0, TOKENS, 0]
        assert case["bias"][6] < 0 < case["bias"][0]  # aux-free bias learns from the forced load
        assert case["wg_grad"] > 0
        assert "deepspeed_moe.gate.expert_bias" in case["keys"] and "deepspeed_moe.gate.wg.weight" in case["keys"]


def test_chained_plan_equals_deepspeeds_moe(results):
    """Rank 2 computes rank 1's rows while it sends its own to rank 0: exact, and balanced."""
    for rank, res in enumerate(results):
        case = res["chain"]
        assert case["worst"] <= 1e-5, f"rank {rank}: {case}"
        stats = case["stats"]
        assert stats["tokens_before"] == [sum(row) for row in CHAIN_COUNTS] == [4, 35, 45, 44]
        assert stats["tokens_after"] == [TOKENS] * WORLD, stats
