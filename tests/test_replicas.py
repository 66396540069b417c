"""Redundant expert replicas across nodes (`plan.replicas`): slots, the per-micro-batch split of a
replicated expert's rows, the gradient exchange's price, and the choice of replicas that pay."""
import functools

import numpy as np
import pytest

from deepspeed_feplb.plan import replicas as rp
from deepspeed_feplb.plan.placement import CrossNodePlacer

G, N, E = 2, 2, 8  # 4 ranks, 2 primaries each
R = G * N
PRIMARIES = E // R


def _slots(replica_at) -> np.ndarray:
    return rp.slot_experts(np.arange(E) // PRIMARIES, np.asarray(replica_at, np.int64).reshape(R, -1))


def test_slots_hold_the_primaries_in_order_then_the_replicas():
    slots = _slots([[-1], [-1], [0], [-1]])
    assert slots.tolist() == [[0, 1, -1], [2, 3, -1], [4, 5, 0], [6, 7, -1]]


def test_a_replicated_experts_rows_split_between_the_nodes_and_none_are_lost():
    src = np.zeros((R, E), np.int64)
    src[:, 0] = [40, 30, 20, 10]  # expert 0 (node 0) is hot: 100 rows
    src[:, 5] = 5  # node 1's own load: 20 rows
    plain = rp.route(src, _slots([[-1]] * R), G, PRIMARIES)
    assert plain[:, :PRIMARIES].sum(axis=1).tolist() == [100, 0, 20, 0]
    split = rp.route(src, _slots([[-1], [-1], [0], [-1]]), G, PRIMARIES)
    assert split.sum() == src.sum()
    assert split[0, 0] + split[2, 2] == 100 and split[2, 1] == 20
    nodes = split.sum(axis=1).reshape(N, G).sum(axis=1)
    assert nodes.tolist() == [60, 60]  # pairs largest first, each split where it would overshoot the other node
    again = rp.route(src, _slots([[-1], [-1], [0], [-1]]), G, PRIMARIES)
    assert np.array_equal(split, again)  # the same on every rank


def test_a_pair_that_would_overshoot_splits_so_that_both_nodes_reach_one_level():
    src = np.zeros((R, E), np.int64)
    src[0, 0] = 101  # one source sends all of hot expert 0's rows: no whole pair can balance the nodes
    src[:, 5] = 5  # node 1's own load: 20 rows
    slots = _slots([[-1], [-1], [0], [-1]])
    parts = rp.split(src, slots, G, PRIMARIES)
    # node 0 (0 rows so far) is the lightest holder: it takes floor((101 + 20 - 0) / 2) = 60 rows and
    # node 1 the other 41, so the nodes end at 60 and 61 rows
    assert parts.source.tolist() == [0, 0] and parts.expert.tolist() == [0, 0]
    assert parts.rank.tolist() == [0, 2] and parts.rows.tolist() == [60.0, 41.0]
    counts = rp.route(src, slots, G, PRIMARIES)
    assert counts.sum(axis=1).reshape(N, G).sum(axis=1).tolist() == [60, 61]
    # a pair that fits below the next node's level is not split
    src[0, 0] = 10
    parts = rp.split(src, slots, G, PRIMARIES)
    assert parts.rank.tolist() == [0] and parts.rows.tolist() == [10.0]
    # experts held once are not in the split
    assert len(rp.split(src, _slots([[-1]] * R), G, PRIMARIES).rows) == 0


def test_fractional_rows_count_whole_when_every_expert_is_replicated():
    """A caller may pass float rows per source (the runtime and the simulator pass int64); with no
    expert held once the nodes start empty and each pair's rows count in full (once they were
    truncated to whole rows, and the 0.4 of the third pair went to the heavier node)."""
    src = np.array([[0.4, 3.4], [19.9, 0.1]])  # 2 nodes of 1 rank, each expert on both
    parts = rp.split(src, np.array([[0, 1], [1, 0]]), 1, 1)
    # 19.9 splits 9 / 10.9, 3.4 splits 2 / 1.4: nodes at 12.3 and 11, so the 0.4 goes to node 1
    assert parts.rank.tolist() == [1, 0, 1, 0, 1, 1]
    assert parts.rows == pytest.approx([9.0, 10.9, 2.0, 1.4, 0.4, 0.1])


def test_expected_counts_fill_the_lightest_node_first():
    w = np.zeros(E)
    w[0], w[5] = 100.0, 20.0
    counts = rp.expected_counts(w, _slots([[-1], [-1], [0], [-1]]), G)
    assert counts.sum() == pytest.approx(120.0)
    assert counts.sum(axis=1).reshape(N, G).sum(axis=1) == pytest.approx([60.0, 60.0])


def test_a_relay_is_priced_hop_by_hop_over_every_link_of_the_two_nodes():
    one = np.array([[0, 2]])  # rank 0 (node 0) to rank 2 (node 1), 2 ranks per node
    # in one piece: 1e6 bytes as 2 shards of 5e5: hop 0 (rank 0 -> 1) and hop 2 (rank 3 -> 2) move one
    # shard each at 2 GB/s, hop 1 one shard per rail at 1 GB/s, one after the other
    assert rp.relay_us(one, R, G, 1e6, 1.0, 2.0, chunk_bytes=1e6) == pytest.approx(250 + 500 + 250)
    # in 5 pieces the hops overlap: 7 rounds, each as long as its slowest hop's piece
    assert rp.relay_us(one, R, G, 1e6, 1.0, 2.0, chunk_bytes=1e5) == pytest.approx((50 + 5 * 100 + 50))
    # the intra-node hops are free when the node's links are: the inter-node hop alone
    assert rp.relay_us(one, R, G, 1e6, 1.0, chunk_bytes=1e6) == pytest.approx(500)
    # one rank per node: no relay, the whole transfer over the sender's own link
    assert rp.relay_us(one, R, 1, 1e6, 1.0, 2.0) == pytest.approx(1000)
    # two transfers out of one node share its rails
    assert rp.relay_us(np.array([[0, 2], [1, 3]]), R, G, 1e6, 1.0, chunk_bytes=1e6) == pytest.approx(1000)
    assert rp.relay_us(np.zeros((0, 2)), R, G, 1e6, 1.0) == 0.0
    with pytest.raises(ValueError, match="share a node"):
        rp.relay_us(np.array([[0, 1]]), R, G, 1e6, 1.0)


def test_the_exchange_is_priced_as_the_runtime_makes_it():
    slots = _slots([[-1], [-1], [0], [1]])  # experts 0 and 1 (both homed on rank 0) have a replica each
    relay = functools.partial(rp.relay_us, ranks=R, ranks_per_node=G, net_gbps=1.0, intra_gbps=2.0)
    # the replicas' fp32 gradient sums (2e6 bytes) go home, then the weights (1e6) come back
    expected = relay(np.array([[2, 0], [3, 0]]), nbytes=2e6) + relay(np.array([[0, 2], [0, 3]]), nbytes=1e6)
    assert rp.exchange_us(slots, PRIMARIES, G, 1e6, 2e6, 1.0, 2.0, held_back=False) == pytest.approx(expected)
    # two replicas of one home share its node's links: rank 0 hands both of rank 1's shards over (hop 0), each
    # rail carries two shards (hop 1), ranks 2 and 3 swap one (hop 2)
    assert relay(np.array([[0, 2], [0, 3]]), nbytes=1e6, chunk_bytes=1e6) == pytest.approx(500 + 1000 + 250)
    assert rp.exchange_us(_slots([[-1]] * R), PRIMARIES, G, 1e6, 2e6, 1.0, 2.0) == 0.0
    # a step of several micro-batches: the sums of all but the last go home while the last one
    # computes (hidden up to ``hidden_us``), then its gradients alone, in their dtype (1e6 bytes);
    # a home takes as many early sums as it has replica slots (1): rank 0's second replica (on rank
    # 3) sends its whole sum at the end
    first, second = np.array([[2, 0]]), np.array([[3, 0]])
    sums, last, whole = relay(first, nbytes=2e6), relay(first, nbytes=1e6), relay(second, nbytes=2e6)
    back = relay(np.array([[0, 2], [0, 3]]), nbytes=1e6)
    two_halves = functools.partial(rp.exchange_us, slots, PRIMARIES, G, 1e6, 2e6, 1.0, 2.0, last_bytes=1e6,
                                   held_back=False)
    assert two_halves(hidden_us=0.0) == pytest.approx(sums + last + whole + back)
    assert two_halves(hidden_us=sums / 4) == pytest.approx(0.75 * sums + last + whole + back)
    assert two_halves(hidden_us=1e12) == pytest.approx(last + whole + back)
    # the stepped weights leave when the next forward begins: hidden up to ``weights_hidden_us``
    assert two_halves(hidden_us=1e12, weights_hidden_us=back / 4) == pytest.approx(last + whole + 0.75 * back)
    assert two_halves(hidden_us=1e12, weights_hidden_us=1e12) == pytest.approx(last + whole)
    # held back to the backward's end (a DeepSpeed MoE layer's runtime): of rank 0's two replicated
    # experts (local indices 0 and 1) one, as a rank has one replica slot: expert 0's sum travels
    # while the layers below compute, behind the first relay (expert 1's, which rank 0 waits for)
    assert rp.held_back_sums(slots, PRIMARIES).tolist() == [True, False]
    assert rp.exchange_us(slots, PRIMARIES, G, 1e6, 2e6, 1.0, 2.0, last_bytes=1e6, hidden_us=1e12) == \
        pytest.approx(whole + back)
    assert rp.exchange_us(slots, PRIMARIES, G, 1e6, 2e6, 1.0, 2.0, hidden_us=1.5 * sums) == \
        pytest.approx(whole + back)  # one half: hidden behind the backward, 2/3 of ``hidden_us``
    apart = _slots([[-1], [-1], [0], [PRIMARIES]])  # replicas of rank 0's and rank 1's experts: both go early
    pairs = rp.replica_pairs(apart, PRIMARIES)
    assert sorted(pairs[:, 0].tolist()) == [0, 1]
    apart_back = relay(pairs, nbytes=1e6)
    assert rp.exchange_us(apart, PRIMARIES, G, 1e6, 2e6, 1.0, 2.0, last_bytes=1e6, hidden_us=1e12,
                          held_back=False) == pytest.approx(relay(pairs[:, ::-1], nbytes=1e6) + apart_back)
    # both at local index 0, one per home: both held back, and the whole gradient exchange hides
    assert rp.held_back_sums(apart, PRIMARIES).all()
    assert rp.exchange_us(apart, PRIMARIES, G, 1e6, 2e6, 1.0, 2.0, last_bytes=1e6, hidden_us=1e12) == \
        pytest.approx(apart_back)
    per_micro_batch = functools.partial(rp.exchange_per_micro_batch, apart, PRIMARIES, G, weight_bytes=1e6,
                                        grad_bytes=2e6, net_gbps=1.0, intra_gbps=2.0, hidden_us=1e12,
                                        held_back=False)
    assert per_micro_batch(micro_batches_per_step=4) == pytest.approx(
        (relay(pairs[:, ::-1], nbytes=1e6) + apart_back) / 4)
    whole_sums = relay(pairs[:, ::-1], nbytes=2e6)
    assert per_micro_batch(micro_batches_per_step=1) == pytest.approx((whole_sums + apart_back) / 1)  # one half
    assert per_micro_batch(micro_batches_per_step=4, weight_bytes=2e6) == pytest.approx(  # fp32 weights: one half
        (whole_sums + relay(pairs, nbytes=2e6)) / 4)


def _skewed_samples(hot: float) -> np.ndarray:
    rng = np.random.default_rng(0)
    samples = rng.uniform(80, 120, (8, E))
    samples[:, 0] += hot  # node 0 carries the hot expert in every micro-batch
    return samples


def test_replicas_are_chosen_where_they_pay_and_not_where_they_do_not():
    e2r = np.arange(E) // PRIMARIES
    args = dict(ranks_per_node=G, redundant=1, dynamic_experts=1, micro_batches_per_step=8)
    choice = rp.choose(_skewed_samples(400.0), e2r, us_per_row=1.0, weight_bytes=1e3, net_gbps=1.0, **args)
    cheap = choice.replica_at
    assert (cheap >= 0).sum() >= 1 and 0 in cheap and choice.gain_us > choice.cost_us > 0
    assert not np.isin(cheap[:G], [0, 1]).any()  # a replica goes to another node than its expert's
    dear = rp.choose(_skewed_samples(400.0), e2r, us_per_row=1.0, weight_bytes=1e9, net_gbps=1.0, **args)
    assert (dear.replica_at < 0).all() and dear.gain_us == dear.cost_us == 0.0
    even = rp.choose(np.full((8, E), 100.0), e2r, us_per_row=1.0, weight_bytes=1e3, net_gbps=1.0, **args)
    assert (even.replica_at < 0).all()  # balanced nodes: nothing to gain
    drifting = np.full((8, E), 100.0)
    drifting[:4, 0] += 400.0  # hot in the earlier micro-batches only: the later ones show no gain
    assert (rp.choose(drifting, e2r, us_per_row=1.0, weight_bytes=1e3, net_gbps=1.0, **args).replica_at < 0).all()


def test_replicas_are_chosen_again_at_every_step_between_decisions():
    """Between decisions the placer chooses its replicas again at every optimizer step: held while
    the hot expert stays hot (a new set must do better, not as well), dropped (no transfer: the
    exchange just stops) once it cools, under a row bound too once the bound holds without them,
    and made for an expert that turns hot after a decision without waiting for the next one."""
    def placer(samples, **extra):
        p = CrossNodePlacer(E, N, G, interval=10_000, expert_state_bytes=1e3, net_gbps=1.0, us_per_token=1.0,
                            dynamic_experts=1, redundant=1, weight_bytes=1e3, micro_batches_per_step=8, warmup=8,
                            move_experts=False, **extra)
        for loads in samples:
            p.observe(loads, refresh=False)
        assert p.due
        p.refresh()
        return p

    hot = placer(_skewed_samples(400.0))
    held = hot.replica_at.copy()
    assert (held >= 0).any()
    for loads in _skewed_samples(400.0)[::-1]:  # the same skew, other noise
        hot.observe(loads, refresh=False)
    assert not hot.due and not hot.review_replicas() and np.array_equal(hot.replica_at, held)
    bound = placer(_skewed_samples(400.0), max_rows_over_mean=1.01)
    for cooled in (hot, bound):
        for _ in range(16):
            cooled.observe(np.full(E, 100.0), refresh=False)
        assert cooled.review_replicas() and (cooled.replica_at < 0).all() and cooled.replica_drops == 1
        assert not cooled.review_replicas()  # nothing left to drop
    late = placer(np.full((8, E), 100.0))  # nothing hot at the decision
    assert (late.replica_at < 0).all()
    for loads in [*_skewed_samples(400.0), *_skewed_samples(400.0)]:
        late.observe(loads, refresh=False)
    assert not late.due and late.review_replicas() and 0 in late.replica_at and late.replica_changes == 1


def test_a_decision_that_keeps_the_homes_keeps_replicas_as_good_as_a_new_set():
    """At a placement decision that moves no home the replicas held stay unless a new set does
    better, as between decisions: with two experts equally hot on one rank, a replica of either
    pays the same, and the decision keeps the one held instead of moving it for nothing."""
    samples = np.full((8, E), 100.0)
    samples[:, :2] += 400.0  # rank 0's two primaries, equally hot
    p = CrossNodePlacer(E, N, G, interval=8, expert_state_bytes=1e3, net_gbps=1.0, us_per_token=1.0,
                        dynamic_experts=1, redundant=1, weight_bytes=1e3, micro_batches_per_step=8, warmup=8,
                        move_experts=False)
    for loads in samples:
        p.observe(loads, refresh=False)
    assert p.due and p.refresh() and p.replica_at.ravel().tolist() == [-1, -1, 0, -1]
    p.replica_at = np.array([[-1], [-1], [1], [-1]])  # its twin, held
    for loads in samples:
        p.observe(loads, refresh=False)
    assert p.due and not p.refresh() and p.replica_at.ravel().tolist() == [-1, -1, 1, -1]


def test_a_measured_host_cost_of_holding_replicas_is_priced():
    """``fixed_us`` (what holding any replica costs per micro-batch beyond its exchange: the host's
    work, measured at runtime) joins the price of every set with a replica: a replica whose gain
    pays its exchange but not that is not made, and one held is dropped at the next step."""
    e2r = np.arange(E) // PRIMARIES
    args = dict(ranks_per_node=G, redundant=1, dynamic_experts=1, micro_batches_per_step=8, us_per_row=1.0,
                weight_bytes=1e3, net_gbps=1.0)
    free = rp.choose(_skewed_samples(400.0), e2r, **args)
    assert (free.replica_at >= 0).any() and free.gain_us > free.cost_us
    dear = rp.choose(_skewed_samples(400.0), e2r, fixed_us=free.gain_us, **args)
    assert (dear.replica_at < 0).all()
    priced = rp.choose(_skewed_samples(400.0), e2r, fixed_us=free.gain_us / 2, **args)
    assert np.array_equal(priced.replica_at, free.replica_at) and priced.cost_us == pytest.approx(
        free.cost_us + free.gain_us / 2)
    p = CrossNodePlacer(E, N, G, interval=10_000, expert_state_bytes=1e3, net_gbps=1.0, us_per_token=1.0,
                        dynamic_experts=1, redundant=1, weight_bytes=1e3, micro_batches_per_step=8, warmup=8,
                        move_experts=False)
    for loads in _skewed_samples(400.0):
        p.observe(loads, refresh=False)
    assert p.refresh() and (p.replica_at >= 0).any()
    p.replica_fixed_us = free.gain_us  # what the runtime measured while they were held
    assert p.review_replicas() and (p.replica_at < 0).all()


def test_a_row_bound_puts_rows_before_time():
    """``feplb.max_rows_over_mean``: a replica whose exchange costs more than it saves is still made
    where it brings the busiest rank toward the bound; where the bound holds without one, none is,
    and of replicas that bring the rows equally close the cheapest set wins."""
    e2r = np.arange(E) // PRIMARIES
    args = dict(ranks_per_node=G, dynamic_experts=1, micro_batches_per_step=8, us_per_row=1.0, weight_bytes=1e9,
                net_gbps=1.0)
    bound = rp.choose(_skewed_samples(400.0), e2r, redundant=1, max_rows_over_mean=1.02, **args)
    assert 0 in bound.replica_at and bound.cost_us > bound.gain_us > 0, bound
    for loads in _skewed_samples(400.0)[4:]:  # the held-out half: the busiest rank came closer to the bound
        assert (rp.predicted_rows(loads, _slots(bound.replica_at), G, 1)
                < rp.predicted_rows(loads, _slots([[-1]] * R), G, 1))
    assert (rp.choose(np.full((8, E), 100.0), e2r, redundant=1, max_rows_over_mean=1.02, **args).replica_at < 0).all()
    two = rp.choose(_skewed_samples(400.0), e2r, redundant=2, max_rows_over_mean=1.02, **args)
    assert (two.replica_at >= 0).sum() == 1 and two.cost_us == bound.cost_us  # a second replica brings nothing


def test_the_placer_adds_replicas_at_its_decision():
    placer = CrossNodePlacer(E, N, G, interval=8, expert_state_bytes=1e3, net_gbps=1.0, us_per_token=1.0,
                             dynamic_experts=1, redundant=1, weight_bytes=1e3, micro_batches_per_step=8)
    for loads in _skewed_samples(400.0):
        placer.observe(loads, refresh=False)
    assert placer.due and placer.refresh()
    assert (placer.replica_at >= 0).any()
    assert placer.slots.shape == (R, PRIMARIES + 1)


def test_the_simulator_replicates_hot_experts_across_nodes_where_it_pays():
    """EP 16 (2 x 8), 32k rows per rank, hot experts that drift between micro-batches: with a replica
    slot per rank feplb splits hot experts' rows between the nodes, and its expert time, the
    gradient exchange included, falls; a replica whose exchange costs more than it saves is never
    made."""
    from deepspeed_feplb.plan.cost import ExpertShape
    from deepspeed_feplb.sim.policies import SimSetup
    from deepspeed_feplb.sim.simulate import simulate
    from deepspeed_feplb.trace.generators import skewed_trace

    trace = skewed_trace(48, 1, 16, 64, tokens_per_rank=4096, top_k=8, skew=1.2, drift=0.5, memory=0.5, seed=4)
    shape = ExpertShape(hidden=6144, ffn_hidden=2048)
    runs = {}
    for redundant in (0, 1):
        setup = SimSetup(ranks_per_node=8, nodes=2, experts=64, shape=shape, micro_batches_per_step=8,
                         redundant_per_rank=redundant)
        runs[redundant] = simulate(trace, setup, ["feplb"]).metrics()["feplb"]
    assert runs[1]["replicas"] > 0 and runs[1]["replica_exchange_us"] > 0
    assert runs[1]["token_max_over_mean"] < runs[0]["token_max_over_mean"]
    assert runs[1]["expert_time_us"] < runs[0]["expert_time_us"]


def test_the_simulator_prices_the_host_work_of_held_replicas():
    """``SimSetup.replica_host_us`` (``simulate --replica-host-us``): the host time of holding any
    replica, per micro-batch, joins the choice's price and the expert time of every micro-batch
    with replicas held. Beyond what a replica saves none is made, and the run is the one without
    a slot (and, as a layer with replica slots carries no copy over an optimizer step, without
    carried copies: `migrate.refresh`); a small one still leaves replicas that pay, each of their
    micro-batches charged."""
    from dataclasses import replace

    from deepspeed_feplb.plan.cost import ExpertShape
    from deepspeed_feplb.sim.policies import SimSetup
    from deepspeed_feplb.sim.simulate import simulate
    from deepspeed_feplb.trace.generators import skewed_trace

    trace = skewed_trace(32, 1, 16, 64, tokens_per_rank=4096, top_k=8, skew=1.2, drift=0.5, memory=0.5, seed=4)
    base = SimSetup(ranks_per_node=8, nodes=2, experts=64, shape=ExpertShape(hidden=6144, ffn_hidden=2048),
                    micro_batches_per_step=8, placement="off", redundant_per_rank=1)
    runs = {host: simulate(trace, replace(base, replica_host_us=host), ["feplb"]).metrics()["feplb"]
            for host in (0.0, 10.0, 1e9)}
    without = simulate(trace, replace(base, redundant_per_rank=0, keep_copies_across_steps=False),
                       ["feplb"]).metrics()["feplb"]
    assert runs[0.0]["replicas"] > 0 and runs[0.0]["expert_time_us"] < without["expert_time_us"]
    assert runs[1e9]["replicas"] == 0 and runs[1e9]["expert_time_us"] == pytest.approx(without["expert_time_us"])
    assert runs[0.0]["expert_time_us"] < runs[10.0]["expert_time_us"] < without["expert_time_us"]
    with pytest.raises(ValueError, match="host time of held replicas"):
        replace(base, replica_host_us=-1.0).check()


def test_the_replica_host_time_option_names_a_bad_value(tmp_path, capsys):
    from deepspeed_feplb.__main__ import main
    for bad in ("-1", "nan", "inf", "lots"):
        with pytest.raises(SystemExit):
            main(["simulate", "--trace", str(tmp_path / "t.npz"), "--replica-host-us", bad])
        assert "--replica-host-us" in capsys.readouterr().err


def test_replica_slots_on_one_node_are_refused():
    from deepspeed_feplb.sim.policies import SimSetup

    with pytest.raises(ValueError, match="1 replica slots per rank need more than one node"):
        SimSetup(ranks_per_node=8, nodes=1, experts=64, redundant_per_rank=1).check()
    for placement in ("auto", "on", "off"):
        SimSetup(ranks_per_node=8, nodes=2, experts=64, redundant_per_rank=1, placement=placement).check()


def test_replicas_alone_keep_every_home_and_still_balance_the_nodes():
    """``feplb.placement.enabled`` false with a replica slot per rank (the simulator's
    ``placement="off"``): no expert gets another home, hot experts still get replicas on the other
    node, and the token max/mean falls against no replica slot (the same EP 16 trace as above)."""
    from deepspeed_feplb.plan.cost import ExpertShape
    from deepspeed_feplb.sim.policies import SimSetup
    from deepspeed_feplb.sim.simulate import simulate
    from deepspeed_feplb.trace.generators import skewed_trace

    trace = skewed_trace(48, 1, 16, 64, tokens_per_rank=4096, top_k=8, skew=1.2, drift=0.5, memory=0.5, seed=4)
    shape = ExpertShape(hidden=6144, ffn_hidden=2048)
    runs = {}
    for redundant in (0, 1):
        setup = SimSetup(ranks_per_node=8, nodes=2, experts=64, shape=shape, micro_batches_per_step=8,
                         redundant_per_rank=redundant, placement="off")
        runs[redundant] = simulate(trace, setup, ["feplb"]).metrics()["feplb"]
    assert "placement_decisions" not in runs[0], "no replica slot, no placement: the cross-node layer ran"
    assert runs[1]["placement_decisions"] > 0 and runs[1]["placement_migrated_experts"] == 0
    assert runs[1]["replicas"] > 0
    assert runs[1]["token_max_over_mean"] < runs[0]["token_max_over_mean"]


def test_a_placer_that_keeps_homes_chooses_replicas_only():
    placer = CrossNodePlacer(E, N, G, interval=8, expert_state_bytes=1e3, net_gbps=1.0, us_per_token=1.0,
                             dynamic_experts=1, redundant=1, weight_bytes=1e3, micro_batches_per_step=8,
                             move_experts=False)
    before = placer.expert_to_rank.copy()
    for loads in _skewed_samples(400.0):
        placer.observe(loads, refresh=False)
    assert placer.due and placer.refresh()
    assert (placer.replica_at >= 0).any()
    assert np.array_equal(placer.expert_to_rank, before) and placer.migrated_experts == 0


def test_replicas_alone_are_first_chosen_after_two_micro_batches_not_at_the_steps_end():
    """Every home kept: the first decision is due mid-step, once `FIRST_REPLICAS_AFTER` micro-batches
    were seen (the runtime decides as the next forward begins), and only the first; a placer
    that may move homes waits for the step's end (its optimizer state moves)."""
    from deepspeed_feplb.plan.placement import FIRST_REPLICAS_AFTER

    for move in (False, True):
        placer = CrossNodePlacer(E, N, G, interval=8, expert_state_bytes=1e3, net_gbps=1.0, us_per_token=1.0,
                                 dynamic_experts=1, redundant=1, weight_bytes=1e3, micro_batches_per_step=8,
                                 warmup=8, move_experts=move)
        samples = _skewed_samples(400.0)
        due = []  # after each micro-batch
        for loads in samples[:FIRST_REPLICAS_AFTER + 1]:
            placer.observe(loads, refresh=False)
            due.append(placer.replicas_due_mid_step)
        assert not placer.due  # the step's end (warmup) is not reached
        if move:
            assert not any(due)
            continue
        assert due == [seen >= FIRST_REPLICAS_AFTER for seen in range(1, FIRST_REPLICAS_AFTER + 2)], due
        assert placer.refresh() and (placer.replica_at >= 0).any()
        assert not placer.replicas_due_mid_step  # decided: later ones come at the steps' ends


def test_the_simulator_chooses_replicas_alone_before_the_first_step_ends():
    """EP 16 (2 x 8), a hot set that does not drift, homes kept: the nodes are balanced from the
    first step's third micro-batch on, and the replicas' exchange is priced."""
    from deepspeed_feplb.plan.cost import ExpertShape
    from deepspeed_feplb.sim.policies import SimSetup
    from deepspeed_feplb.sim.simulate import simulate
    from deepspeed_feplb.trace.generators import skewed_trace

    trace = skewed_trace(16, 1, 16, 64, tokens_per_rank=4096, top_k=8, skew=1.2, drift=0.0, memory=1.0, seed=4)
    setup = SimSetup(ranks_per_node=8, nodes=2, experts=64, shape=ExpertShape(hidden=6144, ffn_hidden=2048),
                     micro_batches_per_step=8, redundant_per_rank=1, placement="off")
    runs = simulate(trace, setup, ["feplb"]).runs
    rows = runs["feplb"].rank_rows[:, 0].reshape(16, 2, 8).sum(-1)  # [micro-batches, nodes]
    node_max_over_mean = rows.max(1) / rows.mean(1)
    assert node_max_over_mean[:2].min() > 1.03 and (node_max_over_mean[2:] < 1.001).all(), node_max_over_mean
    assert runs["feplb"].summary["replica_exchange_us"] > 0


def test_two_holders_on_one_node_share_its_part():
    w = np.zeros(E)
    w[0] = 100.0
    counts = rp.expected_counts(w, _slots([[-1], [-1], [0], [0]]), G)  # both ranks of node 1 hold it
    assert counts.sum() == pytest.approx(100.0)
    nodes = counts.sum(axis=1).reshape(N, G).sum(axis=1)
    assert nodes == pytest.approx([50.0, 50.0])
    assert counts[2, 2] == pytest.approx(25.0) and counts[3, 2] == pytest.approx(25.0)


def test_an_expert_hotter_than_a_node_gets_a_replica_on_several_nodes():
    """4 nodes of 2 ranks, expert 0 with 80% of the rows: one replica leaves a node with 40%; with
    one on every node each computes a fourth of it. The choice weighs both kinds of sequence."""
    nodes, experts = 4, 32
    samples = np.full((8, experts), 10.0)
    samples[:, 0] = 1250.0
    e2r = np.arange(experts) // (experts // (nodes * G))
    choice = rp.choose(samples, e2r, G, redundant=1, dynamic_experts=1, us_per_row=1.0, micro_batches_per_step=8,
                       weight_bytes=1.0, net_gbps=1e6)
    holders = np.flatnonzero((choice.replica_at == 0).any(axis=1))
    assert len({int(q) // G for q in holders}) == nodes - 1, choice.replica_at.tolist()
    counts = rp.route(np.tile(samples[0] / (nodes * G), (nodes * G, 1)), rp.slot_experts(e2r, choice.replica_at), G,
                      experts // (nodes * G))
    node_rows = counts.sum(axis=1).reshape(nodes, G).sum(axis=1)
    assert node_rows.max() / node_rows.mean() < 1.02, node_rows
