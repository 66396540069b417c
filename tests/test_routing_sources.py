"""Routing sources and the routed gate, in one process (no ranks): counts -> tokens, generators, gate math."""
import numpy as np
import pytest
import torch
from deepspeed.moe.sharded_moe import TopKGate

from deepspeed_feplb.gate.sigmoid import SigmoidTopKGate
from deepspeed_feplb.testing import (
    RoutedGate,
    RouteRequest,
    TraceRouting,
    assign_counts,
    dirichlet_routing,
    example_trace_path,
    one_hot_expert_routing,
    scale_counts,
    uniform_routing,
    zipf_routing,
)
from deepspeed_feplb.trace.format import load_trace


def request(step=0, layer=0, rank=0, ep_size=4, tokens=32, experts=8, k=2, hidden=4):
    return RouteRequest(torch.zeros(tokens, hidden), step, layer, rank, ep_size, experts, k)


def check_routes(routes, tokens, k, experts):
    routes = np.asarray(routes)
    assert routes.shape == (tokens, k)
    assert routes.min() >= -1 and routes.max() < experts
    for row in routes:
        taken = row[row >= 0]
        assert len(set(taken.tolist())) == len(taken), f"token routed twice to one expert: {row}"
    return routes


@pytest.mark.parametrize("seed", range(20))
def test_assign_counts_is_exact_and_distinct(seed):
    rng = np.random.default_rng(seed)
    tokens, k, experts = int(rng.integers(1, 20)), int(rng.integers(1, 5)), 8
    k = min(k, experts)
    counts = np.zeros(experts, dtype=np.int64)
    for _ in range(int(rng.integers(0, tokens + 1))):  # build counts from real top-k tokens
        counts[rng.choice(experts, size=k, replace=False)] += 1
    routes = check_routes(assign_counts(counts, tokens, k, rng), tokens, k, experts)
    np.testing.assert_array_equal(np.bincount(routes[routes >= 0], minlength=experts), counts)
    assert (routes == -1).sum() == tokens * k - counts.sum()


def test_assign_counts_rejects_what_no_top_k_gate_can_produce():
    with pytest.raises(ValueError, match="need at least 5 tokens"):
        assign_counts(np.array([5, 0, 1]), 4, 2)  # expert 0 would need one token twice
    with pytest.raises(ValueError, match="need at least 4 tokens"):
        assign_counts(np.array([3, 3, 2]), 3, 2)  # 8 pairs > 3 tokens x 2


def test_scale_counts_keeps_the_shape_and_respects_the_cap():
    out = scale_counts(np.array([700, 300, 0, 24]), 64, 32)
    assert out.sum() == 64 and out.max() <= 32
    assert out[0] == 32 and out[2] == 0 and out[1] > out[3]  # the cap moves the excess to the next busiest
    np.testing.assert_array_equal(scale_counts(np.array([3, 1]), 8, 8), [6, 2])


def test_shipped_trace_replays_each_ranks_counts_exactly():
    trace = load_trace(example_trace_path())
    assert trace.counts.shape == (4, 2, 4, 8) and trace.top_k == 2
    source = TraceRouting(trace)
    assert source.tokens_needed(4) == 32
    for step in range(trace.steps):
        for layer in range(trace.layers):
            for rank in range(4):
                routes = check_routes(source(request(step, layer, rank)), 32, 2, 8)
                np.testing.assert_array_equal(np.bincount(routes[routes >= 0], minlength=8),
                                              trace.counts[step, layer, rank])
    with pytest.raises(IndexError, match="only 4 step"):
        source(request(step=4))
    again = np.asarray(TraceRouting(trace, cycle=True)(request(step=5)))
    np.testing.assert_array_equal(np.bincount(again[again >= 0], minlength=8), trace.counts[1, 0, 0])


def test_trace_sources_fold_onto_the_ep_size_and_check_the_layer():
    trace = load_trace(example_trace_path())
    source = TraceRouting(trace, layers=[1])
    routes = np.asarray(source(request(step=2, rank=1, ep_size=2, tokens=64)))
    np.testing.assert_array_equal(np.bincount(routes[routes >= 0], minlength=8), trace.counts[2, 1, 2:].sum(0))
    with pytest.raises(ValueError, match="trace has 8 experts"):
        source(request(experts=16))
    with pytest.raises(ValueError, match="top_k=2"):
        source(request(k=1))
    with pytest.raises(ValueError, match="need at least"):
        source(request(tokens=16))
    scaled = np.asarray(TraceRouting(trace, fit="scale")(request(tokens=8)))
    assert (scaled >= 0).all()  # 16 pairs exactly
    counts = np.bincount(scaled.ravel(), minlength=8)
    assert counts.argmax() == trace.counts[0, 0, 0].argmax()


def test_a_simulator_trace_replays_scaled_to_a_small_batch():
    from deepspeed_feplb.trace.generators import no_aux_trace
    trace = no_aux_trace(2, 2, ranks=4, experts=8, tokens_per_rank=4096, top_k=2)
    routes = check_routes(TraceRouting(trace, fit="scale")(request(step=1, layer=1, rank=2, tokens=16)), 16, 2, 8)
    assert (routes >= 0).all()
    recorded = trace.counts[1, 1, 2]
    assert np.bincount(routes.ravel(), minlength=8).argmax() == recorded.argmax()


def test_generators_are_seeded_skewed_and_distinct_per_token():
    E, S, k = 8, 400, 2
    zipf = zipf_routing(skew=1.5, seed=3)
    a = check_routes(zipf(request(tokens=S)), S, k, E)
    np.testing.assert_array_equal(a, zipf_routing(skew=1.5, seed=3)(request(tokens=S)))
    assert not np.array_equal(a, zipf(request(tokens=S, rank=1)))
    assert not np.array_equal(a, zipf(request(tokens=S, step=1)))
    counts = np.bincount(a.ravel(), minlength=E)
    assert counts[0] == counts.max() and counts[0] > 2 * counts[4:].max()

    hot = check_routes(one_hot_expert_routing(expert=5, fraction=0.75, seed=1)(request(tokens=S)), S, k, E)
    share = (hot == 5).any(axis=1).mean()
    assert 0.65 < share < 0.85
    assert (hot[:, 1:] != 5).all()  # the hot expert is every hot token's first route
    everyone = check_routes(one_hot_expert_routing(expert=2, fraction=1.0)(request(tokens=S, k=1)), S, 1, E)
    assert (everyone == 2).all()

    flat = np.bincount(check_routes(uniform_routing(seed=2)(request(tokens=S)), S, k, E).ravel(), minlength=E)
    assert flat.max() < 1.5 * flat.min()
    dirichlet = dirichlet_routing(alpha=0.2, seed=4)
    p = dirichlet.probabilities(0, E)
    assert p.sum() == pytest.approx(1.0) and p.max() > 0.3
    assert not np.allclose(p, dirichlet.probabilities(1, E))  # one popularity draw per layer


def _gate(k, sigmoid=False):
    torch.manual_seed(k)
    gate = TopKGate(6, 8, k=k, min_capacity=0, capacity_factor=16.0, noisy_gate_policy=None, drop_tokens=True,
                    use_rts=False, top2_2nd_expert_sampling=False)
    if sigmoid:
        from deepspeed_feplb.config import GatingConfig
        gate = SigmoidTopKGate.from_topk_gate(gate, GatingConfig(score="sigmoid", bias_update_rate=0.0))
    return gate


def _own_top_k(gate):
    def source(req):
        with torch.no_grad():
            logits = torch.nn.functional.linear(req.x.float(), gate.wg.weight.float())
        return torch.topk(logits, req.k, dim=1).indices
    return source


def _run(gate, x, weight):
    l_aux, _, E, indices, locations, gates, counts = gate(x, None, True, False)
    loss = (gates * weight[:gates.shape[0]]).sum() + l_aux
    grad, = torch.autograd.grad(loss, gate.wg.weight)
    return l_aux.detach(), indices, locations, gates.detach(), counts, grad


@pytest.mark.parametrize("k,sigmoid", [(1, False), (2, False), (3, False), (2, True)])
def test_routed_gate_equals_the_real_gate_when_it_forces_the_gates_choice(k, sigmoid):
    """Gate values, l_aux, counts and wg's gradient are those of DeepSpeed's gate (or ours, sigmoid)."""
    gate = _gate(k, sigmoid)
    x, weight = torch.randn(24, 6), torch.randn(4, 24)
    ref = _run(gate, x, weight)
    routed = RoutedGate(gate, _own_top_k(gate), 0)
    got = _run(routed, x, weight)
    assert routed.step == 1 and routed.wg is gate.wg
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-7)  # l_aux
    # same routes per token (DeepSpeed's top-2 orders them first/second, as topk does)
    torch.testing.assert_close(got[1].sort(0).values, ref[1].sort(0).values)
    order_ref, order_got = ref[1].argsort(0), got[1].argsort(0)
    torch.testing.assert_close(got[3].gather(0, order_got), ref[3].gather(0, order_ref), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got[4], ref[4])
    torch.testing.assert_close(got[5], ref[5], rtol=1e-5, atol=1e-7)
    assert got[5].abs().sum() > 0
    slots = got[1].long() * 64 + got[2].long()  # every route has its own slot in its expert's buffer
    assert slots.unique().numel() == slots.numel()
    assert set(routed.state_dict()) == set(gate.state_dict())


def test_routed_gate_validates_what_a_source_returns():
    gate = _gate(2)
    x = torch.randn(5, 6)
    for bad, match in [(lambda r: torch.zeros(5, 3, dtype=torch.long), r"shape \(5, 3\)"),
                       (lambda r: torch.tensor([[0, 0]] * 5), "twice"),
                       (lambda r: torch.full((5, 2), 8), "outside"),
                       (lambda r: torch.zeros(5, 2), "integer")]:
        with pytest.raises((ValueError, TypeError), match=match):
            RoutedGate(gate, bad, 0)(x)
    # -1 routes are not taken: zero gate, not counted; a 1-D answer is accepted for k == 1
    out = RoutedGate(gate, lambda r: torch.tensor([[1, -1], [2, 3], [-1, -1], [4, 1], [0, 7]]), 0)(x)
    assert out[6].tolist() == [1, 2, 1, 1, 1, 0, 0, 1] and (out[5][:, 2] == 0).all()
    assert out[5][0, 0].item() == pytest.approx(1.0)  # normalised over the routes taken
    one = RoutedGate(_gate(1), lambda r: torch.arange(5) % 8, 0)(x)
    assert one[3].tolist() == [[0, 1, 2, 3, 4]]
