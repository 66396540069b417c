"""Property and example tests of the FEPLB planner (deepspeed_feplb/plan/policy.py)."""
import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepspeed_feplb.plan.policy import (
    Plan,
    PlanConstraints,
    chunk_align_rows,
    dynamic_candidates,
    lower_bound,
    no_residents,
    plan_domain,
    rows_bound,
)
from deepspeed_feplb.plan.timeline import TimeModel


def check_plan(counts, cons, plan):
    """Assert every contract of a plan (docs/ARCHITECTURE.md and the planner API)."""
    counts = np.asarray(counts, dtype=np.int64)
    G, E = counts.shape
    moves = plan.moves
    assert isinstance(plan, Plan)
    assert moves.dtype == np.int64 and moves.ndim == 2 and moves.shape[1] == 4
    assert plan.rank_rows.dtype == np.int64 and plan.rank_rows.shape == (G,)
    # conservation: rank_rows is what the moves imply, and no token appears or disappears
    expect = counts.sum(axis=1).copy()
    for home, e, helper, tok in moves.tolist():
        assert 0 <= home < G and 0 <= helper < G and helper != home and 0 <= e < E
        assert tok > 0
        expect[home] -= tok
        expect[helper] += tok
    assert np.array_equal(plan.rank_rows, expect)
    assert plan.rank_rows.sum() == counts.sum() and plan.rank_rows.min() >= 0
    if len(moves) == 0:
        return
    # sorted by (home, local_expert)
    keys = moves[:, 0] * (E + 1) + moves[:, 1]
    assert np.all(np.diff(keys) >= 0)
    cand = cons.chosen(counts)  # what the ranks publish
    copies_out = np.zeros(G, dtype=np.int64)
    copies_in = np.zeros(G, dtype=np.int64)
    offloaded = {}
    for (home, e), idx in _groups(moves).items():
        rows = moves[idx]
        assert e in cand[home].tolist(), "only dynamic candidates may move"
        helpers = rows[:, 2].tolist()
        assert len(set(helpers)) == len(helpers) <= cons.max_helpers
        moved = int(rows[:, 3].sum())
        assert moved <= counts[home, e]
        kept = counts[home, e] - moved
        # every chunk is aligned except the one that ends the expert's rows, which is the last
        # chunk; the planner keeps even that one aligned unless it leaves the home no rows
        a = max(1, cons.chunk_align)
        for k, tok in enumerate(rows[:, 3].tolist()):
            last = k == len(rows) - 1
            assert tok % a == 0 or (last and kept == 0), (tok, a, kept)
        copies_out[home] += len(rows)
        for h in helpers:
            copies_in[h] += 1
        offloaded.setdefault(home, set()).add(e)
    for home, es in offloaded.items():  # more than D only where the rows outside the D hottest exceed the mean
        assert len(es) <= int((cand[home] >= 0).sum())
    # copies in flight stay within the memory check's bound: 2D from each peer (`memory.group_memory`)
    assert copies_in.max() <= 2 * min(cons.dynamic_experts, E) * (G - 1)
    budget = cons.copies_per_rank()
    if not math.isinf(budget):
        assert copies_out.max() <= budget and copies_in.max() <= budget
        assert copies_out.max() * cons.expert_bytes <= cons.ce_budget_bytes
        assert copies_in.max() * cons.expert_bytes <= cons.ce_budget_bytes


def _groups(moves):
    out = {}
    for i, (home, e) in enumerate(moves[:, :2].tolist()):
        out.setdefault((home, e), []).append(i)
    return out


@st.composite
def instances(draw):
    G = draw(st.integers(1, 8))
    E = draw(st.integers(1, 8))
    skew = draw(st.sampled_from([0, 1, 3]))
    flat = draw(st.lists(st.integers(0, 2000), min_size=G * E, max_size=G * E))
    counts = np.array(flat, dtype=np.int64).reshape(G, E)
    if skew:  # a few very hot ranks, as without an aux loss
        hot = draw(st.integers(0, G - 1))
        counts[hot] *= 1 + skew * 4
    D = draw(st.integers(0, E + 1))
    H = draw(st.integers(1, 4))
    align = draw(st.sampled_from([1, 2, 8, 128]))
    expert_bytes = draw(st.sampled_from([0, 1000]))
    copies = draw(st.sampled_from([math.inf, 0, 1, 2, 5]))
    budget = math.inf if math.isinf(copies) else copies * 1000 + draw(st.integers(0, 999))
    return counts, PlanConstraints(D, H, align, budget, expert_bytes)


@settings(max_examples=400, deadline=None)
@given(instances())
def test_plan_contracts(inst):
    counts, cons = inst
    plan = plan_domain(counts, cons)
    check_plan(counts, cons, plan)
    # deterministic, and independent of the input's memory layout and dtype
    again = plan_domain(np.asfortranarray(counts.astype(np.int32)), cons)
    assert np.array_equal(plan.moves, again.moves) and np.array_equal(plan.rank_rows, again.rank_rows)
    # never worse than doing nothing, never better than the lower bound
    assert plan.rank_rows.max() <= counts.sum(axis=1).max()
    if counts.shape[0] > 0 and counts.sum() > 0:
        assert plan.rank_rows.max() >= lower_bound(counts, cons.dynamic_experts)


# copies that cost more than most moves save: time alone moves little
COSTLY_COPIES = TimeModel(tile_rows=128, row_us=0.5, piece_us=6.0, weight_copy_us=400.0, grad_copy_us=400.0,
                          row_copy_us=0.03, message_us=50.0)


@settings(max_examples=300, deadline=None)
@given(instances(), st.sampled_from([1.0, 1.03, 1.2]), st.sampled_from([0.0, 0.8, 1.0, 1.3]), st.booleans())
def test_a_row_bound_holds_wherever_the_token_plan_reaches_it(inst, ratio, group_vs_domain, keep):
    """With ``max_rows_over_mean``, whatever the time model prefers, no rank ends above the row cap
    (plus the alignment slack) unless the row plan (no time model) cannot get there either; the
    plan still obeys every limit. ``group_vs_domain``: the EP group's mean rows relative to the
    domain's (0: not given, the domain's own)."""
    counts, cons = inst
    G = counts.shape[0]
    mean_rows = group_vs_domain * counts.sum() / max(1, G)
    bounded = replace(cons, model=COSTLY_COPIES, keep_copies=keep, max_rows_over_mean=ratio, mean_rows=mean_rows)
    plan = plan_domain(counts, bounded)
    check_plan(counts, bounded, plan)
    token_plan = plan_domain(counts, cons)
    cap = rows_bound(ratio, mean_rows if mean_rows > 0 else counts.sum() / max(1, G))
    assert plan.rank_rows.max() <= max(cap + cons.chunk_align - 1, token_plan.rank_rows.max())
    # without a time model the plan balances down to the bound, not further
    tokens_only = plan_domain(counts, replace(bounded, model=None))
    check_plan(counts, bounded, tokens_only)
    assert tokens_only.rank_rows.max() <= max(cap + cons.chunk_align - 1, token_plan.rank_rows.max())
    # a bound that never binds leaves the time model's plan as it is
    loose = plan_domain(counts, replace(bounded, max_rows_over_mean=1e6))
    timed = plan_domain(counts, replace(bounded, max_rows_over_mean=0.0))
    assert np.array_equal(loose.moves, timed.moves)


def test_a_row_bound_is_at_least_one_row():
    """A cap of 0 rows means no bound: a set ratio over a mean below one row still bounds."""
    assert rows_bound(0.0, 100.0) == 0 and rows_bound(None, 100.0) == 0
    assert rows_bound(1.05, 100.0) == 105
    assert rows_bound(1.0, 0.5) == 1
    counts = np.array([[0, 5], [0, 0], [0, 0]], np.int64)
    cons = PlanConstraints(dynamic_experts=1, max_helpers=2, model=COSTLY_COPIES, max_rows_over_mean=1.0)
    assert cons.row_cap(counts) == 1
    assert replace(cons, max_rows_over_mean=0.0).row_cap(counts) == 0


def test_a_row_bound_moves_rows_that_time_alone_keeps():
    counts = np.array([[300, 200, 100], [100, 100, 100], [100, 100, 0], [50, 50, 50]], np.int64)
    cons = PlanConstraints(dynamic_experts=2, max_helpers=2, chunk_align=8, expert_bytes=10**6, model=COSTLY_COPIES)
    assert plan_domain(counts, cons).moves.shape[0] == 0  # no copy pays
    bounded = plan_domain(counts, replace(cons, max_rows_over_mean=1.05))
    check_plan(counts, cons, bounded)
    assert bounded.rank_rows.max() <= rows_bound(1.05, counts.sum() / 4) + 7
    # the mean of the whole EP group counts, not the domain's: a lighter group allows less
    group = plan_domain(counts, replace(cons, max_rows_over_mean=1.05, mean_rows=200.0))
    assert group.rank_rows.max() <= max(210, lower_bound(counts, 2)) + 7
    # copies a helper still holds count against nothing: among the plans within the bound the
    # fastest wins, and it sends the rows to the holder
    resident = no_residents(4, 3)
    resident[0, 0, 0] = 1 << 3
    held = plan_domain(counts, replace(cons, max_rows_over_mean=1.05), resident)
    assert held.rank_rows.max() <= rows_bound(1.05, counts.sum() / 4) + 7
    assert 3 in held.moves[held.moves[:, 0] == 0, 2].tolist()


@settings(max_examples=300, deadline=None)
@given(instances())
def test_reaches_lower_bound_without_limits(inst):
    """With unlimited helpers and Copy-Engine budget and no alignment, water-filling is exact."""
    counts, cons = inst
    G = counts.shape[0]
    cons = PlanConstraints(cons.dynamic_experts, max(1, G - 1), 1)
    plan = plan_domain(counts, cons)
    check_plan(counts, cons, plan)
    if G > 1 and cons.dynamic_experts > 0 and counts.sum() > 0:
        assert plan.rank_rows.max() == lower_bound(counts, cons.dynamic_experts)


@settings(max_examples=300, deadline=None)
@given(instances())
def test_alignment_costs_less_than_one_chunk(inst):
    """With enough helpers, chunk alignment costs less than one chunk of straggler: donors round
    their last chunk down and keep the remainder, receivers fill up to chunk_align - 1 above the
    bound, and one water-filling pass gets there."""
    counts, cons = inst
    G = counts.shape[0]
    cons = PlanConstraints(cons.dynamic_experts, max(1, G - 1), cons.chunk_align)
    plan = plan_domain(counts, cons)
    check_plan(counts, cons, plan)
    if G > 1 and cons.dynamic_experts > 0 and counts.sum() > 0:
        assert plan.rank_rows.max() <= lower_bound(counts, cons.dynamic_experts) + cons.chunk_align - 1


def test_the_planner_moves_only_the_experts_each_rank_published():
    """The ranks choose their dynamic experts (`dynamic_candidates`) and publish them; the planner
    takes the published sets, never re-derives them: a set that is not the D hottest is what moves,
    a rank that published none moves nothing, and without a set the rule applies."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        G, E = int(rng.integers(2, 9)), int(rng.integers(2, 17))
        counts = rng.integers(0, 50, size=(G, E)).astype(np.int64)
        counts[0] *= 4  # a hot rank
        D = int(rng.integers(1, E + 1))
        chosen = np.full((G, D), -1, np.int64)
        for r in range(G):
            k = int(rng.integers(0, D + 1))
            chosen[r, :k] = rng.permutation(E)[:k]  # any experts, in any order
        cons = PlanConstraints(dynamic_experts=D, max_helpers=2)
        plan = plan_domain(counts, cons, dynamic=chosen)
        for home, expert, _, _ in plan.moves:
            assert expert in chosen[home], (chosen, plan.moves)
        assert plan.rank_rows.sum() == counts.sum()
        assert plan_domain(counts, cons, dynamic=cons.chosen(counts)).moves.tolist() == \
            plan_domain(counts, cons).moves.tolist()
    hot = np.array([[90, 80, 10], [5, 5, 5]])
    assert plan_domain(hot, PlanConstraints(1, 2), dynamic=np.array([[-1], [-1]])).moves.shape == (0, 4)
    assert set(plan_domain(hot, PlanConstraints(1, 2), dynamic=np.array([[1], [-1]])).moves[:, 1]) == {1}
    with pytest.raises(ValueError, match="dynamic experts local ids below 3"):
        plan_domain(hot, PlanConstraints(1, 2), dynamic=np.array([[3], [-1]]))


def test_dynamic_candidates_ties_and_shapes():
    counts = np.array([[5, 7, 7, 1], [0, 0, 0, 0], [3, 9, 2, 9]])
    assert dynamic_candidates(counts, 2).tolist() == [[1, 2], [0, 1], [1, 3]]
    assert dynamic_candidates(counts, 9).shape == (3, 4)
    assert dynamic_candidates(counts, 0).shape == (3, 0)
    assert dynamic_candidates(counts, 2).dtype == np.int64


def test_ranks_at_or_below_the_mean_choose_no_dynamic_experts_where_no_limit_binds():
    """Where neither the helper nor the copy limits bind and no row bound caps a rank, plans only
    move rows from ranks above the domain's mean to ranks at or below it: those choose no dynamic
    experts (all their experts run in their static call, fewer operations) and the plan is as
    good. Where a limit binds, every rank chooses its D hottest: the planner may chain through it."""
    counts = np.array([[50, 40, 10], [5, 9, 1], [30, 30, 15], [3, 2, 1]])  # rows 100 15 75 6, mean 49
    assert dynamic_candidates(counts, 2, 49.0, senders_only=True).tolist() == [[0, 1], [-1, -1], [0, 1], [-1, -1]]
    assert dynamic_candidates(counts, 2, 75.0, senders_only=True)[2].tolist() == [-1, -1]  # at the mean: none either
    free = PlanConstraints(dynamic_experts=2, max_helpers=3)
    assert free.senders_only(4) and free.chosen(counts).tolist() == [[0, 1], [-1, -1], [0, 1], [-1, -1]]
    for bound in (PlanConstraints(2, max_helpers=2), PlanConstraints(2, 3, ce_budget_bytes=5.0, expert_bytes=1),
                  PlanConstraints(2, 3, max_rows_over_mean=1.05)):
        assert not bound.senders_only(4)
        assert bound.chosen(counts).tolist() == dynamic_candidates(counts, 2, 49.0).tolist()
    rng = np.random.default_rng(3)
    for _ in range(300):
        G, E = int(rng.integers(2, 9)), int(rng.integers(2, 17))
        counts = rng.integers(0, 60, size=(G, E)) * rng.integers(1, 5, size=(G, 1))
        D, align = int(rng.integers(1, E + 1)), int(rng.integers(1, 4))
        cons = PlanConstraints(dynamic_experts=D, max_helpers=G - 1, chunk_align=align)
        plan = plan_domain(counts, cons)
        check_plan(counts, cons, plan)
        senders = counts.sum(axis=1) * G > counts.sum()
        assert senders[plan.moves[:, 0]].all()
        everyone = plan_domain(counts, cons, dynamic=dynamic_candidates(counts, D))
        assert plan.rank_rows.max() <= max(everyone.rank_rows.max(), lower_bound(counts, D) + align - 1)


def test_degenerate_inputs_give_empty_plans():
    for counts, D in [(np.array([[10, 20, 30]]), 2), (np.array([[10, 0], [90, 3]]), 0),
                      (np.zeros((4, 3), dtype=np.int64), 2), (np.zeros((3, 0), dtype=np.int64), 1)]:
        plan = plan_domain(counts, PlanConstraints(D))
        assert plan.moves.shape == (0, 4) and plan.moves.dtype == np.int64
        assert plan.rank_rows.tolist() == counts.sum(axis=1).tolist()
    with pytest.raises(ValueError):
        plan_domain(np.zeros(4, dtype=np.int64), PlanConstraints(1))
    with pytest.raises(ValueError):
        plan_domain(np.array([[-1, 900], [0, 0]]), PlanConstraints(1))


def test_small_example_by_hand():
    # rank 0 holds 100 + 60 + 40 = 200, rank 1 holds 20, rank 2 holds 20: mean 80.
    counts = np.array([[100, 60, 40], [10, 10, 0], [20, 0, 0]])
    # with D = 1, rank 0's rows outside its hottest expert (100) exceed the mean: it also chooses
    # its next hottest, and the plan reaches the mean
    assert dynamic_candidates(counts, 1, 80.0).tolist() == [[0, 1], [0, -1], [0, -1]]
    assert lower_bound(counts, 1) == 80
    assert plan_domain(counts, PlanConstraints(dynamic_experts=1, max_helpers=2)).rank_rows.max() == 80
    # where rank 0 publishes only expert 0, its static part (100) is what no plan can go below
    plan = plan_domain(counts, PlanConstraints(dynamic_experts=1, max_helpers=2), dynamic=np.array([[0], [-1], [-1]]))
    assert plan.rank_rows.tolist() == [100, 70, 70] or plan.rank_rows.max() == 100
    assert plan.moves[:, :2].tolist() == [[0, 0]] * len(plan.moves)
    assert plan.moves[:, 3].sum() == 100
    plan2 = plan_domain(counts, PlanConstraints(dynamic_experts=2, max_helpers=2))
    assert plan2.rank_rows.max() == 80  # mean reached: 120 tokens leave rank 0
    check_plan(counts, PlanConstraints(dynamic_experts=2, max_helpers=2), plan2)


def test_copy_engine_budget_limits_copies():
    counts = np.array([[400, 300, 200, 100], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    free = plan_domain(counts, PlanConstraints(4, 3))
    assert free.rank_rows.max() == 250
    one = PlanConstraints(4, 3, 1, ce_budget_bytes=1.5e6, expert_bytes=10**6)
    plan = plan_domain(counts, one)
    check_plan(counts, one, plan)
    assert len(plan.moves) == 1 and plan.rank_rows.max() == 600  # best single move: 400 away
    none = PlanConstraints(4, 3, 1, ce_budget_bytes=0.5e6, expert_bytes=10**6)
    assert plan_domain(counts, none).moves.shape == (0, 4)


def test_donor_keeps_its_remainder_below_one_chunk():
    """A donor's last chunk is rounded down: it keeps its excess below one chunk (within the slack)
    instead of taking room a later donor needs. Rounding up instead (the earlier rule) left rank 2
    at 930 here, 2 above the bound plus slack."""
    counts = np.array([[480, 426], [495, 503], [499, 451], [410, 419]])  # loads 906 998 950 829
    cons = PlanConstraints(dynamic_experts=1, max_helpers=1, chunk_align=8)
    assert lower_bound(counts, 1) == 921
    plan = plan_domain(counts, cons)
    check_plan(counts, cons, plan)
    assert plan.rank_rows.max() <= 921 + 7
    assert (plan.moves[:, 3] % 8 == 0).all()


def test_row_order_and_tail_chunk():
    """Chunks are aligned; only a chunk that empties the home may be unaligned."""
    counts = np.array([[1000, 5], [0, 0], [0, 0], [0, 0]])
    cons = PlanConstraints(1, 3, 128)
    plan = plan_domain(counts, cons)
    check_plan(counts, cons, plan)
    assert plan.rank_rows.max() <= lower_bound(counts, 1) + 127


def test_rack_scale_domain():
    """A 72-rank NVLink domain (GB200 NVL72): the compiled pass keeps no per-rank bit masks, so
    any domain size plans, and without limits it reaches the bound."""
    rng = np.random.default_rng(72)
    counts = rng.integers(0, 500, size=(72, 4)) * rng.integers(1, 6, size=(72, 1))
    for cons in (PlanConstraints(2, 3, 8, 20_000, 1000), PlanConstraints(2, 71, 1)):
        plan = plan_domain(counts, cons)
        check_plan(counts, cons, plan)
        assert len(plan.moves) > 0
    assert plan.rank_rows.max() == lower_bound(counts, 2)


def test_whole_expert_chains_when_copies_bind():
    """With two weight copies per rank, the hottest rank of this micro-batch must move one whole
    expert (9,864 rows, larger than any receiver's room) as a single chunk to a receiver that
    first pushes its own dynamic experts on. Chaining only for the last allowed chunk left this
    node 8.9% of the mean load above the MILP optimum (= the lower bound here); chaining for any
    chunk that fits nowhere whole gets within 1%."""
    from deepspeed_feplb.trace.generators import no_aux_trace

    loads = no_aux_trace(1, 1, ranks=8, experts=128, seed=13).counts.sum(axis=2)  # [1, 1, 128]: one node
    counts = loads.reshape(8, 16)
    expert_bytes = 3 * 6144 * 2048 * 2
    cons = PlanConstraints(4, 2, 1, 2 * expert_bytes + 1, expert_bytes)
    plan = plan_domain(counts, cons)
    check_plan(counts, cons, plan)
    bound, mean = lower_bound(counts, 4), counts.sum() / 8
    assert counts.max() == 9864 and bound == 32768
    assert plan.rank_rows.max() - bound <= 0.01 * mean


def test_chain_through_a_rank_above_the_level():
    """Rank 0 is the only receiver and may take two weight copies, but three ranks are above the
    mean (400). The optimum sends rank 1's excess to rank 2, which sends that much more along its
    own chunk to rank 0: a chain through a rank above the level (no new copy at rank 0)."""
    counts = np.array([[0, 18, 9, 15], [9, 119, 295, 17], [15, 26, 465, 130], [3, 101, 1, 377]])
    cons = PlanConstraints(dynamic_experts=2, max_helpers=2, ce_budget_bytes=2.5, expert_bytes=1)
    plan = plan_domain(counts, cons)
    check_plan(counts, cons, plan)
    assert plan.rank_rows.tolist() == [400, 400, 400, 400]
    assert (plan.moves[:, 2] == 0).sum() == 2  # rank 0 received two copies, no more


def test_a_rank_over_the_mean_outside_its_d_hottest_chooses_more():
    """A rank whose rows outside its D hottest experts still exceed its domain's mean would stay
    above the mean whatever the plan: it also chooses its next hottest, one at a time, until they
    do not or it has chosen 2D; without the mean (a backend that tells no other rank's rows) it
    chooses its D hottest."""
    counts = np.array([[40, 30, 20, 10], [30, 30, 30, 30], [5, 5, 0, 0], [1, 0, 0, 0]])  # rows 100 120 10 1
    mean = counts.sum() / 4  # 57.75
    assert dynamic_candidates(counts, 1).tolist() == [[0], [0], [0], [0]]
    # rank 0: 60 rows outside its hottest > 57.75, 30 outside its two hottest; rank 1: 90, then 60
    # outside its two hottest, where 2D stops it
    assert dynamic_candidates(counts, 1, mean).tolist() == [[0, 1], [0, 1], [0, -1], [0, -1]]
    assert dynamic_candidates(counts, 2, mean).tolist() == [[0, 1, -1], [0, 1, 2], [0, 1, -1], [0, 1, -1]]
    assert dynamic_candidates(counts, 1, mean, senders_only=True).tolist() == [[0, 1], [0, 1], [-1, -1], [-1, -1]]
    assert dynamic_candidates(counts, 0, mean).shape == (4, 0)  # D = 0: no migration at all
    assert lower_bound(counts, 1) == 60 and lower_bound(counts, 2) == 58  # rank 1's 60 static rows, else the mean
    for D, bound in ((1, 60), (2, 58)):
        cons = PlanConstraints(dynamic_experts=D, max_helpers=3)
        plan = plan_domain(counts, cons)
        assert plan.rank_rows.max() == bound and (1, 1) in {tuple(m) for m in plan.moves[:, :2].tolist()}
        check_plan(counts, cons, plan)


def test_a_copy_kept_for_the_step_is_priced_over_its_later_micro_batches():
    """With kept copies, a weight copy that costs more than it saves in its own micro-batch pays
    when later micro-batches of the step find it held; at the step's end a held copy that takes
    rows returns the step's gradients after them, which the plan weighs against sending them
    home at the backward's start."""
    counts = np.array([[600, 400], [0, 0]])
    model = TimeModel(tile_rows=1, row_us=1.0, piece_us=0.0, weight_copy_us=700.0, grad_copy_us=700.0,
                      row_copy_us=0.0)

    def plan(later, resident=None, keep=True):
        cons = PlanConstraints(1, 1, model=model, keep_copies=keep, later_micro_batches=later)
        return plan_domain(counts, cons, resident).moves.tolist()

    # no move: 1000 µs a micro-batch; the copy: 1200 µs now (it arrives at 700), 500 µs held, 1200
    # µs at the step's end (the step's gradients leave after the helper's backward)
    assert plan(0) == [] and plan(0, keep=False) == []
    assert plan(1) == []  # 1200 + 1200 against 2000
    assert plan(2) == plan(7) == [[0, 0, 1, 500]]  # 1200 + 500 + 1200 against 3000
    held = no_residents(2, 2)
    held[0, 0, 0] = 1 << 1  # helper 1 holds rank 0's expert 0
    assert plan(1, held) == [[0, 0, 1, 500]]  # free, and its gradients wait for the step's end
    # at the step's end: unused, its gradients go home at the backward's start (1033 µs); used,
    # after the helper's backward of the 500 rows (1200 µs)
    assert plan(0, held) == []


def test_auto_chunks_fill_a_gpus_row_tile_and_stay_small_on_the_host_or_under_a_row_bound():
    """"auto" aligns chunks to the GPU's grouped-GEMM row tile (128) only where the experts run on a
    GPU and no row bound is set (its slack is one chunk); a number is taken as it is."""
    from deepspeed_feplb.config import FEPLBConfig

    assert chunk_align_rows("auto", on_gpu=True) == 128
    assert chunk_align_rows("auto", on_gpu=False) == 8
    assert chunk_align_rows("auto", on_gpu=True, max_rows_over_mean=1.05) == 8
    assert chunk_align_rows(32, on_gpu=True) == chunk_align_rows(32, on_gpu=False) == 32
    config = FEPLBConfig()
    assert config.chunk_align_tokens == "auto"
    assert PlanConstraints.from_config(config, 1 << 20, on_gpu=True).chunk_align == 128
    assert PlanConstraints.from_config(config, 1 << 20).chunk_align == 8
    bounded = FEPLBConfig(max_rows_over_mean=1.1)
    assert PlanConstraints.from_config(bounded, 1 << 20, on_gpu=True).chunk_align == 8
