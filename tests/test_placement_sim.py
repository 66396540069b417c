"""The cross-node placement layer (`plan.placement`: transfer cost, the gain/cost rule, the
within-node spread, the decision schedule, retention) and how the simulator charges
re-placements (feplb's and EPLB's) in the expert time (benchmarks/PLANNER.md, "Across nodes")."""
import math

import numpy as np
import pytest

from deepspeed_feplb.plan.cost import ExpertShape, GemmProfile
from deepspeed_feplb.plan.placement import (
    CrossNodePlacer,
    holdings,
    improve_placement,
    node_loads,
    placement_rows,
    slot_holdings,
    transfer_us,
)
from deepspeed_feplb.sim.policies import SimSetup
from deepspeed_feplb.sim.simulate import simulate
from deepspeed_feplb.trace.format import Trace

B = 1000.0  # state bytes per expert; with 1 GB/s one expert takes 1 µs


def test_transfer_us_uses_every_ranks_links_in_parallel():
    # 2 nodes x 2 ranks, one expert per rank
    old = holdings(np.array([0, 1, 2, 3]), 4)
    # two cross-node swaps on disjoint ranks: every rank sends one and receives one -> one expert time
    new = holdings(np.array([2, 3, 0, 1]), 4)
    assert transfer_us(old, new, 2, B, net_gbps=1.0, intra_gbps=10.0) == pytest.approx(1.0)
    # an intra-node swap goes over the intra-node link only
    new = holdings(np.array([1, 0, 2, 3]), 4)
    assert transfer_us(old, new, 2, B, net_gbps=1.0, intra_gbps=10.0) == pytest.approx(0.1)
    assert transfer_us(old, new, 2, B, net_gbps=1.0) == 0.0  # intra-node free by default
    # rank 0 receives two experts from the other node: its inbound link carries both
    new = np.zeros((4, 4), bool)
    new[0, [0, 2]] = new[0, 3] = True
    new[1, 1] = True
    assert transfer_us(old, new, 2, B, net_gbps=1.0) == pytest.approx(2.0)
    # a replica (EPLB) comes from a holder on the receiver's node when there is one
    old2 = slot_holdings(np.array([0, 1, 2, 3]), 4, 4)
    new2 = slot_holdings(np.array([0, 1, 2, 0]), 4, 4)  # rank 3 (node 1) now holds expert 0 (node 0)
    assert transfer_us(old2, new2, 2, B, net_gbps=1.0, intra_gbps=10.0) == pytest.approx(1.0)
    new3 = slot_holdings(np.array([0, 0, 2, 3]), 4, 4)  # rank 1 gets expert 0 from rank 0, same node
    assert transfer_us(old2, new3, 2, B, net_gbps=1.0, intra_gbps=10.0) == pytest.approx(0.1)


def _skewed_loads():
    """32 experts on 2 nodes x 2 ranks (8 per rank): node 0 carries two hot experts on rank 0."""
    w = np.full(32, 100.0)
    w[0] = w[1] = 900.0
    return w


def test_improve_placement_moves_only_what_pays():
    w = _skewed_loads()
    cur = np.arange(32) // 8
    before = placement_rows(w, cur, 2, 2, dynamic_experts=1)
    # expensive moves: nothing pays, nothing moves
    new, gain, cost = improve_placement(w, cur, 2, 2, 1, us_per_token=1.0, horizon=10, state_bytes=1e12,
                                        net_gbps=1.0)
    assert np.array_equal(new, cur) and gain == cost == 0.0
    # cheap moves: one hot expert changes node (one swap), the nodes and ranks balance
    new, gain, cost = improve_placement(w, cur, 2, 2, 1, us_per_token=1.0, horizon=10, state_bytes=B,
                                        net_gbps=1.0, intra_gbps=10.0)
    assert gain > cost > 0
    tot = node_loads(w, new, 2, 2)
    assert tot.max() == pytest.approx(tot.mean())
    assert int(np.sum(new != cur)) <= 4  # incremental: a re-packing from scratch would move ~half
    assert np.bincount(new, minlength=4).tolist() == [8] * 4
    assert placement_rows(w, new, 2, 2, 1) < before
    # the two hot experts end on different ranks (each rank's dynamic expert can take one)
    assert new[0] != new[1]


def test_within_node_spread_of_hot_experts():
    # one node of 2 ranks; three hot experts on rank 0, D = 1: rank 0 keeps 2 * 900 + 5 * 100
    # (above the node mean of 2,000) whatever the planner does, unless a hot expert moves to rank 1
    w = _skewed_loads()[:16]
    w[2] = 900.0
    cur = np.arange(16) // 8
    assert placement_rows(w, cur, 1, 2, 1) == pytest.approx(2 * 900 + 500)
    new, gain, cost = improve_placement(w, cur, 1, 2, 1, us_per_token=1.0, horizon=10, state_bytes=B,
                                        net_gbps=1.0, intra_gbps=10.0)
    assert len(set(new[:3].tolist())) == 2 and gain > cost
    assert int(np.sum(new != cur)) == 2  # one swap
    assert placement_rows(w, new, 1, 2, 1) == pytest.approx(w.sum() / 2)


def test_placer_schedule_warmup_and_waiting_for_the_step():
    p = CrossNodePlacer(32, 2, 2, interval=5, warmup=3)
    loads = np.full(32, 10)
    for _ in range(2):
        p.observe(loads, refresh=False)
    assert not p.due
    p.observe(loads, refresh=False)
    assert p.due  # the first decision after the warm-up
    p.observe(loads, refresh=False)
    assert p.due  # still due: the caller waits for its optimizer step
    p.refresh()
    assert p.decisions == 1 and not p.due
    for _ in range(4):
        p.observe(loads, refresh=False)
    assert not p.due
    p.observe(loads, refresh=False)
    assert p.due


def test_retention_follows_whether_the_moving_average_predicts_the_micro_batches():
    w = _skewed_loads()
    mirror = np.roll(w, 24)  # the hot experts on node 1 (rank 3) instead

    def placer():  # moves never pay: the placement stays, only the probe is measured
        return CrossNodePlacer(32, 2, 2, interval=4, warmup=4, expert_state_bytes=1e12, us_per_token=1.0,
                               dynamic_experts=1, decay=0.5)

    steady = placer()
    for _ in range(8):
        steady.observe(w)
    assert steady.retention == pytest.approx(1.0)
    assert steady.effective_horizon == pytest.approx(4 / (1 - steady.max_retention))
    flipped = placer()
    for i in range(8):
        flipped.observe(w if i < 4 else mirror)
    assert flipped.retention == 0.0 and flipped.effective_horizon == 4
    assert steady.refreshes == flipped.refreshes == 0


def _node_skew_trace(steps: int) -> Trace:
    """1 source rank, 16 experts, the hot experts all in the first half (node 0 under contiguous
    placement), the same every micro-batch."""
    loads = np.full(16, 64, dtype=np.int64)
    loads[[0, 1, 3, 5]] = 512
    counts = np.broadcast_to(loads, (steps, 1, 1, 16)).copy()
    return Trace(counts, top_k=2)


def test_simulator_charges_replacements_in_expert_time():
    trace = _node_skew_trace(16)
    prof = GemmProfile("t", 453.0, 128, 2.0, 370.0, 50.0)
    base = dict(ranks_per_node=2, nodes=2, experts=16, dynamic_experts=1, shape=ExpertShape(1024, 512),
                profile=prof, micro_batches_per_step=4, placement_interval=4, placement_horizon=10_000)
    setup = SimSetup(**base)
    res = simulate(trace, setup, ["eplb", "feplb"])
    run = res.runs["feplb"]
    m = res.metrics()
    assert m["feplb"]["placement_refreshes"] >= 1
    charged = run.placement_us[:, 0]
    assert charged.sum() == pytest.approx(m["feplb"]["placement_migration_us"])
    assert charged.sum() > 0
    assert np.all(charged[[i for i in range(16) if (i + 1) % 4]] == 0)  # only at optimizer steps
    # the same run with free transfers: identical plans, expert time lower by exactly the charge
    free = simulate(trace, SimSetup(**base, expert_state_bytes=0.0), ["eplb", "feplb"])
    assert np.allclose(run.expert_us - free.runs["feplb"].expert_us, run.placement_us)
    assert np.array_equal(run.rank_rows, free.runs["feplb"].rank_rows)
    # EPLB is charged the same way for its re-placements
    e = res.runs["eplb"]
    assert m["eplb"]["placement_refreshes"] >= 1 and e.placement_us.sum() > 0
    assert np.allclose(e.expert_us - free.runs["eplb"].expert_us, e.placement_us)
    # a move of state bytes S costs S / net_gbps per rank link (state: 14 bytes per parameter)
    one = setup.state_bytes / (prof.net_gbps * 1e3)
    assert setup.state_bytes == ExpertShape(1024, 512).weight_bytes / 2 * 14
    assert charged.max() >= one - 1e-6
    assert math.isclose(m["feplb"]["placement_us"], charged.mean())
