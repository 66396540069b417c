"""Balance in time: the time model, weight residency in the planner and the simulator, and the
runtime's residency (copies kept for the optimizer step, gradients home at its end) against
DeepSpeed's MoE with gradient accumulation."""
import math
from dataclasses import replace

import numpy as np
import pytest

from deepspeed_feplb.plan.policy import PlanConstraints, no_residents, plan_domain
from deepspeed_feplb.plan.residency import KeptBytes, ResidencyTable
from deepspeed_feplb.plan.timeline import TimeModel, makespan_us, rank_finish_us
from deepspeed_feplb.sim.policies import SimSetup
from deepspeed_feplb.sim.simulate import simulate
from deepspeed_feplb.testing import run_distributed
from deepspeed_feplb.trace.format import Trace
from deepspeed_feplb.trace.generators import skewed_trace

import moe_cases

TOLERANCE = 1e-5  # relative, fp32 (as the other layer tests)
MODEL = TimeModel(tile_rows=1, row_us=1.0, piece_us=0.0, weight_copy_us=10.0, grad_copy_us=10.0, row_copy_us=0.1)


# ---------------------------------------------------------------- the time model
def test_finish_times_by_hand():
    counts = np.array([[100, 20], [10, 0]])
    moves = np.array([[0, 0, 1, 40]])
    hand = replace(MODEL, row_us=3.0)  # a row: 1 µs forward, 2 µs backward
    # forward: rank 1 computes its own 10 rows (10 µs) while the copy arrives at 10 + 40 * 0.1 =
    # 14 µs, then the 40 rows: 54 µs; the home computes 60 + 20 rows (80 µs), the outputs are
    # back at 58 µs. Backward: rank 1's own rows take 20 µs (the output-gradients arrived at 4),
    # the chunk's 80: 100 µs; its input-gradients are home at 104, its weight-gradients at 110;
    # the home's 80 rows take 160 µs
    finish = rank_finish_us(counts, moves, hand)
    assert finish.tolist() == [pytest.approx([80.0, 54.0]), pytest.approx([160.0, 100.0])]
    assert makespan_us(finish) == pytest.approx(80.0 + 160.0)
    # a helper that holds the weights starts at 4 µs: no copy; without gradients going home
    kept = rank_finish_us(counts, moves, hand, fresh=np.array([False]), grads_back=np.array([False]))
    assert kept.tolist() == [pytest.approx([80.0, 50.0]), pytest.approx([160.0, 100.0])]
    # the step's end: the kept copy this move uses returns the step's gradient (70 µs here) with the
    # chunk's input-gradients (100 + 4 µs): at 174
    home_bound = replace(hand, grad_copy_us=70.0)
    with_results = rank_finish_us(counts, moves, home_bound, np.array([False]), np.array([True]))
    assert with_results[1].tolist() == pytest.approx([104.0 + 70.0, 100.0])
    # tiles: 1 row costs a whole tile
    tiled = TimeModel(4, 1.0, 2.0, 0.0, 0.0, 0.0)
    assert rank_finish_us(np.array([[1, 4, 5]]), np.zeros((0, 4)), tiled).sum(axis=0).tolist() == \
        pytest.approx([6 + 6 + 10])


def test_a_helper_computes_a_homes_chunks_once_their_whole_message_is_there():
    """The runtime sends one message per (home, helper) with all its chunks, and a helper serves a
    home's chunks together: rank 0 moves 40 rows of expert 0 and 20 of expert 1 to rank 1, both
    with weights (2 x 10 + 60 x 0.1 = 26 µs of copying). Rank 1 starts them at 26 µs, after its own
    10 rows, ends at 86 and the outputs are home at 92 (chunk by chunk it would start the first at
    14). Backward: the output-gradients arrive at 6, rank 1 ends at 20 + 120 = 140, the 60 rows'
    input-gradients and the two weight-gradients are home in one message at 140 + 6 + 20 = 166,
    after rank 0's own 80 rows (160)."""
    counts = np.array([[100, 40], [10, 0]])
    moves = np.array([[0, 0, 1, 40], [0, 1, 1, 20]])
    finish = rank_finish_us(counts, moves, replace(MODEL, row_us=3.0))
    assert finish.tolist() == [pytest.approx([92.0, 86.0]), pytest.approx([166.0, 140.0])]


def test_served_on_arrival_a_chunks_results_leave_before_the_helpers_own_rows_are_done():
    """``serves_on_arrival``: rank 1 (60 rows of its own, 1 µs forward and 2 µs backward a row)
    serves rank 0's 40 rows as they arrive (at 14 µs with the weights) instead of after its own 60
    µs: they end at 54 and are home at 58, not 104, so the home finishes with its own 80 rows.
    Backward: the output-gradients are in at 4 µs, the chunk ends at 84, its input-gradients are home
    at 88 and its weight-gradients at 98 (not 214). Rank 1 itself does the same work either way:
    100 µs forward, 200 backward."""
    counts = np.array([[100, 20], [60, 0]])
    moves = np.array([[0, 0, 1, 40]])
    after_own = rank_finish_us(counts, moves, replace(MODEL, row_us=3.0))
    assert after_own.tolist() == [pytest.approx([104.0, 100.0]), pytest.approx([214.0, 200.0])]
    on_arrival = rank_finish_us(counts, moves, replace(MODEL, row_us=3.0, serves_on_arrival=True))
    assert on_arrival.tolist() == [pytest.approx([80.0, 100.0]), pytest.approx([160.0, 200.0])]


def test_copies_kept_across_optimizer_steps_are_refreshed_and_training_stays_exact(two_ranks):
    """``keep_copies_across_steps`` (the default): after the second optimizer step (of 3) the copies
    the step's last micro-batch used are held again with the stepped weights, so the last step's
    first micro-batch copies fewer weights; between the steps both models' experts are written in
    place (the refreshed copies are then stale, and the next chunk carries the weights again): exact
    all the same (`check_exact`; with an evaluation between the steps:
    `test_weights_written_mid_step_through_data_or_load_state_dict_are_resent`). Without it (false)
    nothing is refreshed."""
    for stage in (0, 1, 2):
        assert two_ranks[0][(stage, "step")]["refreshed"] > 0, stage
    kept, forgotten = two_ranks[0][(0, "step")], two_ranks[0][(0, FORGOTTEN)]
    assert forgotten["refreshed"] == 0
    assert kept["traffic"]["weight_copies"] < forgotten["traffic"]["weight_copies"], (kept["traffic"],
                                                                                      forgotten["traffic"])


def check_served_on_arrival(results: list, stage: int) -> None:
    """The runtime's cases with ``feplb.serve_on_arrival`` (exact by `check_exact`) moved rows, served
    later micro-batches from kept copies and returned their gradients at the step's end."""
    traffic = results[0][(stage, ON_ARRIVAL)]["traffic"]
    assert traffic["moves"] > 0 and traffic["resident_hits"] > 0 and traffic["flushed_copies"] > 0, traffic


def test_a_kept_copy_no_move_uses_flushes_as_the_backward_starts():
    """At the step's end a kept copy that no chunk of the micro-batch uses holds its final gradient
    already: its helper sends it home as its backward starts (`Phase2MicroBatch.backward_home`),
    after its own output-gradients. Rank 1 keeps a copy of rank 0's expert and has moved 100 rows
    to rank 2: their output-gradients leave rank 1 in 10 µs, the copy's gradient (10 µs) follows
    and is home at 20 µs, not after rank 1 has its helper's results (320 µs)."""
    counts = np.array([[1, 0], [200, 0], [50, 0]])
    hand = replace(MODEL, row_us=3.0)
    finish = rank_finish_us(counts, np.array([[1, 0, 2, 100]]), hand, flush=np.array([[0, 1]]))
    assert finish[1].tolist() == pytest.approx([20.0, 320.0, 300.0])


def test_message_latency_delays_arrivals_and_returns():
    """Each message arrives ``message_us`` after its copy ends: with 30 µs the chunk of the hand
    example arrives at 44 µs, its 40 rows end at 84 µs on the helper, the outputs reach the home
    at 84 + 4 + 30 = 118 µs; in the backward the output-gradients arrive at 34 µs, the chunk ends
    at 114 µs, its weight-gradient is home at 114 + 10 + 30 = 154 µs; and a planner that knows a
    message costs more than any move saves moves nothing."""
    counts = np.array([[100, 20], [10, 0]])
    moves = np.array([[0, 0, 1, 40]])
    slow = replace(MODEL, row_us=3.0, message_us=30.0)
    assert rank_finish_us(counts, moves, slow).tolist() == [pytest.approx([118.0, 84.0]),
                                                            pytest.approx([160.0, 114.0])]
    skewed = np.array([[400, 100], [100, 100]])
    assert len(plan_domain(skewed, PlanConstraints(2, 2, 1, model=MODEL)).moves) > 0
    assert len(plan_domain(skewed, PlanConstraints(2, 2, 1, model=replace(MODEL, message_us=1e4))).moves) == 0


def random_domains(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        G, E = rng.integers(2, 9), rng.integers(2, 17)
        yield (rng.zipf(1.6, (G, E)) * rng.integers(1, 200)).clip(0, 5000).astype(np.int64)


@pytest.mark.parametrize("weight_copy_us", [0.0, 50.0, 5_000.0])
def test_the_time_model_plan_is_never_slower_than_the_token_plan_or_no_moves(weight_copy_us):
    model = TimeModel(8, 1.0, 3.0, weight_copy_us, weight_copy_us, 0.05)
    for counts in random_domains(60, seed=int(weight_copy_us)):
        timed = plan_domain(counts, PlanConstraints(2, 2, 8, model=model))
        tokens = plan_domain(counts, PlanConstraints(2, 2, 8))
        t = makespan_us(rank_finish_us(counts, timed.moves, model))
        assert t <= makespan_us(rank_finish_us(counts, tokens.moves, model)) * (1 + 0.005) + 1e-9
        assert t <= makespan_us(rank_finish_us(counts, np.zeros((0, 4)), model)) + 1e-9
    # copies that cost more than any gain: no moves at all
    counts = np.array([[400, 100], [100, 100]])
    assert len(plan_domain(counts, PlanConstraints(2, 2, 1, model=TimeModel(1, 1.0, 0, 1e6, 1e6, 0))).moves) == 0


# ---------------------------------------------------------------- residency in the planner
def test_residency_table_keeps_admits_caps_and_flushes():
    table = ResidencyTable(G=3, E=2, max_resident=1)
    moves = np.array([[0, 0, 1, 5], [0, 1, 1, 5], [2, 0, 0, 3]])
    fresh, kept = table.admit(moves)
    assert fresh.tolist() == [True, True, True] and kept.tolist() == [True, False, True]  # rank 1 holds one copy
    fresh, kept = table.admit(moves)
    assert fresh.tolist() == [False, True, False] and kept.tolist() == [True, False, True]
    assert table.entries().tolist() == [[0, 0, 1], [2, 0, 0]] and len(table) == 2
    fresh, kept = ResidencyTable(3, 2, 8).admit(moves, keep_new=False)  # the step's last micro-batch keeps none
    assert not kept.any()
    assert table.flush().tolist() == [[0, 0, 1], [2, 0, 0]] and len(table) == 0 and not table.resident.any()
    big = ResidencyTable(G=72, E=1, max_resident=1)  # rack-scale domains: several mask words
    big.admit(np.array([[0, 0, 70, 1]]))
    assert big.holds(0, 0, 70) and not big.holds(0, 0, 6) and big.resident.shape == (72, 1, 2)


def test_the_copies_the_steps_last_micro_batch_used_are_held_again_within_the_limits():
    """`used_at_step_end`: the copies whose gradients went home with a move's results; `keep` holds
    them again after a flush, as many as ``max_resident`` and the byte budget let each helper."""
    from deepspeed_feplb.plan.residency import step_end_returns, used_at_step_end
    table = ResidencyTable(G=3, E=2, max_resident=2, kept_bytes=KeptBytes(3, 150.0), copy_bytes=100)
    table.admit(np.array([[0, 0, 1, 5], [2, 0, 0, 3], [0, 1, 2, 4]]))
    last = np.array([[0, 0, 1, 2], [0, 0, 1, 3], [2, 1, 1, 1]])  # expert 0 of rank 0 twice; rank 2's expert 1 new
    with_results, early = step_end_returns(table.flush(), last, np.array([True, True, False]))
    used = used_at_step_end(last, with_results)
    assert used.tolist() == [[0, 0, 1]] and early.tolist() == [[0, 1, 2], [2, 0, 0]]
    assert table.keep(used).tolist() == [True] and table.holds(0, 0, 1) and len(table) == 1
    assert table.keep(used).tolist() == [False] and len(table) == 1  # held already
    assert table.keep(np.array([[2, 1, 1]])).tolist() == [False]  # 200 bytes on rank 1: past its 150
    assert table.kept_bytes.held.tolist() == [0, 100, 0]
    assert ResidencyTable(G=2, E=3, max_resident=1).keep(np.array([[0, 0, 1], [0, 1, 1]])).tolist() == [True, False]
    # a copy held again that no move of the step uses has no gradient to return at its end
    assert table.flush().tolist() == [] and not table.resident.any()
    table.keep(used)
    assert table.admit(np.array([[0, 0, 1, 4]]))[0].tolist() == [False]  # held: no weights travel
    assert table.flush().tolist() == [[0, 0, 1]]


def test_the_layers_of_a_domain_share_one_byte_budget_for_kept_copies():
    kept = KeptBytes(G=3, budget=250)  # per rank: two copies of the first layer's, or one of each
    first, second = ResidencyTable(3, 2, 8, kept, copy_bytes=100), ResidencyTable(3, 2, 8, kept, copy_bytes=120)
    _, ok = first.admit(np.array([[0, 0, 1, 5], [0, 1, 1, 5], [2, 0, 1, 5]]))
    assert ok.tolist() == [True, True, False] and kept.held.tolist() == [0, 200, 0]  # the third would be 300
    _, ok = second.admit(np.array([[0, 0, 1, 5], [0, 0, 2, 5]]))
    assert ok.tolist() == [False, True] and kept.held.tolist() == [0, 200, 120]
    first.flush()
    assert kept.held.tolist() == [0, 0, 120]
    _, ok = second.admit(np.array([[2, 1, 1, 5]]))
    assert ok.tolist() == [True] and kept.held.tolist() == [0, 120, 120]


def test_a_helper_that_holds_the_weights_takes_rows_without_a_copy():
    counts = np.array([[60, 0], [0, 0], [0, 0]])
    no_copies = PlanConstraints(dynamic_experts=1, max_helpers=2, chunk_align=1, ce_budget_bytes=0.0, expert_bytes=100)
    assert len(plan_domain(counts, no_copies).moves) == 0  # the cap allows no copy
    table = ResidencyTable(3, 2, 4)
    table.admit(np.array([[0, 0, 2, 1]]))
    plan = plan_domain(counts, no_copies, table.resident)
    assert plan.moves.tolist() == [[0, 0, 2, 30]]  # only the holder, for free
    # with copies allowed, the holder is chosen first
    plan = plan_domain(counts, PlanConstraints(1, 2, 1), table.resident)
    assert plan.moves[0].tolist()[:3] == [0, 0, 2] and plan.rank_rows.max() == 20
    assert np.array_equal(plan_domain(counts, PlanConstraints(1, 2, 1), no_residents(3, 2)).rank_rows,
                          plan_domain(counts, PlanConstraints(1, 2, 1)).rank_rows)


# ---------------------------------------------------------------- the simulator
def small_trace(rows_per_rank: int) -> Trace:
    return skewed_trace(16, 1, 8, 64, tokens_per_rank=rows_per_rank // 4, top_k=4, skew=1.0, seed=3,
                        hidden=2048, ffn_hidden=1024)


def test_simulator_reports_time_and_residency_cuts_weight_bytes():
    trace = small_trace(4096)
    runs = {}
    for residency in ("micro_batch", "step"):
        setup = SimSetup(ranks_per_node=8, nodes=1, experts=64, dynamic_experts=4, chunk_align=8,
                         micro_batches_per_step=8, residency=residency)
        runs[residency] = simulate(trace, setup, ["fastermoe", "eplb", "feplb-paper", "feplb"]).metrics()
    step, per_mb = runs["step"], runs["micro_batch"]
    for metrics in step.values():
        assert metrics["expert_time_us"] > 0 and metrics["copy_exposed_us"] >= 0
    assert step["vanilla"]["weight_bytes_per_step"] == 0 and step["eplb"]["copy_exposed_us"] == 0
    assert step["feplb"]["weight_bytes_per_step"] * 2 <= per_mb["feplb"]["weight_bytes_per_step"]
    assert step["feplb"]["expert_time_us"] <= min(m["expert_time_us"] for m in step.values())
    assert step["feplb"]["expert_time_us"] < step["vanilla"]["expert_time_us"]
    assert per_mb["feplb-paper"] == step["feplb-paper"]  # the peers do not depend on our residency


def test_the_simulator_carries_the_steps_last_copies_over_the_optimizer_step():
    """``keep_copies_across_steps``: a step's first micro-batch finds the copies the step before
    ended with, so it is faster than without them; their weights count in the bytes copied."""
    trace = small_trace(4096)  # 16 micro-batches: 4 steps of 4, carried over the second and third
    runs = {}
    for keep in (False, True):
        setup = SimSetup(ranks_per_node=8, nodes=1, experts=64, dynamic_experts=4, chunk_align=8,
                         micro_batches_per_step=4, keep_copies_across_steps=keep)
        runs[keep] = simulate(trace, setup, ["feplb"]).metrics()["feplb"]
    first = [run["time_over_ideal_by_step_position"][0] for run in (runs[False], runs[True])]
    assert first[1] < first[0], first
    assert runs[True]["expert_time_us"] < runs[False]["expert_time_us"]
    assert runs[True]["weight_bytes_per_step"] > 0


def test_the_simulator_keeps_copies_within_the_byte_budget_as_the_runtime_does():
    """``resident_budget_mb`` binds in the simulator as at runtime: a node's layers share one
    budget (weights and an fp32 gradient per copy), never exceeded; a tighter budget keeps fewer
    copies, so more weights are copied (none kept: over 3 times as many); "auto" takes half the
    memory the profile has free at the start, as the runtime takes half of what its GPU has."""
    from deepspeed_feplb.plan.residency import AUTO_FREE_SHARE
    from deepspeed_feplb.sim.policies import make_policy
    from deepspeed_feplb.trace.format import fold_sources
    trace = small_trace(4096)
    base = SimSetup(ranks_per_node=8, nodes=1, experts=64, dynamic_experts=4, chunk_align=8, micro_batches_per_step=8)
    copy = base.shape.weight_bytes + base.shape.grad_bytes
    src = fold_sources(trace.counts, base.ranks)
    copied, most_held = {}, {}
    for copies in (0, 1, 2, None):
        budget_mb = "auto" if copies is None else copies * copy / 2**20
        setup = replace(base, resident_budget_mb=budget_mb)
        policy = make_policy("feplb", setup, src.shape[1])
        held = 0
        for step in range(src.shape[0]):
            for layer in range(src.shape[1]):
                policy.step(step, layer, src[step, layer])
                held = max(held, int(policy.kept_bytes[0].held.max()))
        most_held[copies] = held
        copied[copies] = simulate(trace, setup, ["feplb"]).metrics()["feplb"]["weight_bytes_per_step"]
    assert most_held[0] == 0 and most_held[1] == copy and most_held[2] == 2 * copy
    # where the budget keeps copies, far fewer weights travel; "auto" (room for more) copies less than
    # one kept copy per rank does (two against "auto" is the planner's call: a few copies either way)
    assert copied[0] > 3 * max(copied[1], copied[2]) and copied[1] > copied[None]
    assert base.profile.free_at_start * AUTO_FREE_SHARE > most_held[None] > 2 * copy  # "auto" binds less


def test_simulate_takes_the_byte_budget_and_refuses_one_that_cannot_be(tmp_path):
    import json

    from deepspeed_feplb.__main__ import main
    from deepspeed_feplb.trace.format import save_trace
    save_trace(tmp_path / "t.npz", small_trace(2048))
    copied = {}
    for budget in ("0", "auto"):
        out = tmp_path / f"{budget}.json"
        assert main(["simulate", "--trace", str(tmp_path / "t.npz"), "--ranks-per-node", "8",
                     "--micro-batches-per-step", "8", "--policies", "feplb", "--resident-budget-mb", budget,
                     "--json", str(out), "--no-progress"]) == 0
        copied[budget] = json.loads(out.read_text())["policies"]["feplb"]["weight_bytes_per_step"]
    assert copied["0"] > copied["auto"]
    for bad in ("-1", "nan", "inf", "lots"):
        with pytest.raises(SystemExit):
            main(["simulate", "--trace", str(tmp_path / "t.npz"), "--resident-budget-mb", bad])


def test_simulator_steps_and_residency_are_checked():
    with pytest.raises(ValueError, match="micro-batches per step"):
        SimSetup(ranks_per_node=2, nodes=1, experts=4, micro_batches_per_step=0).check()
    with pytest.raises(ValueError, match="residency"):
        SimSetup(ranks_per_node=2, nodes=1, experts=4, residency="forever").check()


# ---------------------------------------------------------------- the runtime
ON_ARRIVAL = "step, served on arrival"  # feplb.serve_on_arrival on CPU ranks: served before the rank's own rows
FORGOTTEN = "step, copies forgotten at the step's end"  # feplb.keep_copies_across_steps false


def accumulation_cases(ep_size: int, stages=(0, 1, 2), on_arrival=(), forgotten=()) -> dict:
    cases = {(stage, residency): moe_cases.accumulation_case(stage, residency, ep_size)
             for stage in stages for residency in ("step", "micro_batch")}
    for stage in on_arrival:
        cases[(stage, ON_ARRIVAL)] = moe_cases.accumulation_case(stage, "step", ep_size,
                                                                 extra={"serve_on_arrival": True})
    for stage in forgotten:
        cases[(stage, FORGOTTEN)] = moe_cases.accumulation_case(stage, "step", ep_size,
                                                                extra={"keep_copies_across_steps": False})
    return cases


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(accumulation_cases, 2, 2, (0, 1, 2), (2, ), (0, ), timeout=600)


@pytest.fixture(scope="module")
def four_ranks():
    return run_distributed(accumulation_cases, 4, 4, (1, ), (1, ), timeout=600)


def check_exact(results: list) -> None:
    for rank, cases in enumerate(results):
        for key, case in cases.items():
            ref, ours = case["losses"]["reference"], case["losses"]["feplb"]
            assert ours == pytest.approx(ref, rel=TOLERANCE), f"rank {rank} {key}: losses {ours} vs {ref}"
            name, worst = max(case["param_errors"].items(), key=lambda item: item[1])
            assert worst <= TOLERANCE, f"rank {rank} {key}: parameter {name} differs by {worst:.2e}"


def check_residency_cuts_copies(results: list, stages) -> None:
    for stage in stages:
        step, per_mb = results[0][(stage, "step")]["traffic"], results[0][(stage, "micro_batch")]["traffic"]
        assert step["moves"] > 0 and step["resident_hits"] > 0 and step["flushed_copies"] > 0, step
        assert per_mb["resident_hits"] == per_mb["flushed_copies"] == 0 and per_mb["weight_copies"] == per_mb["moves"]
        assert 3 * step["weight_copies"] <= per_mb["weight_copies"], (step, per_mb)


def test_two_ranks_with_accumulation_match_deepspeed_and_copy_less(two_ranks):
    check_exact(two_ranks)
    check_residency_cuts_copies(two_ranks, (0, 1, 2))
    check_served_on_arrival(two_ranks, 2)


def test_each_plan_is_priced_for_the_micro_batches_left_in_its_step(two_ranks):
    """The engine tells the planner how many micro-batches of the optimizer step follow the
    balanced one (`seams.later_micro_batches`): a kept copy serves them."""
    for cases in two_ranks:
        for key, case in cases.items():
            assert len(case["priced"]) >= 8, key  # most of the 3 steps' 12 micro-batches balance
            assert all(later == 3 - micro for micro, later in case["priced"]), (key, case["priced"])


def test_four_ranks_with_accumulation_match_deepspeed_and_copy_less(four_ranks):
    check_exact(four_ranks)
    check_residency_cuts_copies(four_ranks, (1, ))
    check_served_on_arrival(four_ranks, 1)


def budget_cases() -> dict:
    import deepspeed_feplb
    free = moe_cases.accumulation_case(0, "step", 2, steps=2)
    deepspeed_feplb.shutdown()  # the domain runtime, with its budget, is shared by the layers of a process
    return {"free": free, "budget": moe_cases.accumulation_case(0, "step", 2, steps=2, budget_copies=0.5)}


def test_a_binding_budget_for_kept_copies_holds_and_training_stays_exact():
    results = run_distributed(budget_cases, 2, timeout=600)
    check_exact(results)
    free, budget = results[0]["free"], results[0]["budget"]
    # without a budget a rank keeps a copy and serves later micro-batches from it
    assert free["most_kept_bytes"] == free["copy_bytes"] and free["traffic"]["resident_hits"] > 0, free
    # half a copy's bytes: none is kept, every move carries its weights, as with "micro_batch"
    traffic = budget["traffic"]
    assert budget["most_kept_bytes"] == 0 and traffic["resident_hits"] == traffic["flushed_copies"] == 0, budget
    assert traffic["weight_copies"] == traffic["moves"] > 0, traffic


def test_stats_are_the_same_on_every_rank(two_ranks):
    assert all(r[(2, "step")]["traffic"] == two_ranks[0][(2, "step")]["traffic"] for r in two_ranks)
    assert not math.isnan(two_ranks[0][(2, "step")]["losses"]["feplb"][-1])


def test_a_kept_copy_sums_16_bit_gradients_in_fp32_and_returns_them_in_the_parameters_dtype():
    import torch

    from deepspeed_feplb.migrate.resident import HeldCopy

    p = torch.zeros(4, dtype=torch.bfloat16)
    held = HeldCopy([p])
    assert held.gradients()[0].dtype == torch.bfloat16 and not held.gradients()[0].any()
    for _ in range(256):  # 256 x (1 + 2^-7): bf16 partial sums would round the small parts away
        held.accumulate([torch.full((4, ), 1 + 2**-7, dtype=torch.bfloat16)])
    assert held.grads[0].dtype == torch.float32 and held.grads[0][0].item() == 258.0
    assert held.gradients()[0].dtype == torch.bfloat16


def mid_step_writes(ep_size: int) -> dict:
    cases = {write: moe_cases.accumulation_case(0, "step", ep_size, write=write)
             for write in ("data", "load_state_dict", "data-undeclared")}
    return {**cases, "evaluation between steps": moe_cases.accumulation_case(0, "step", ep_size, evaluate=True)}


def test_weights_written_mid_step_through_data_or_load_state_dict_are_resent():
    """Between two micro-batches of one step the experts change through ``load_state_dict`` (seen:
    it writes in place), or through ``p.data`` followed by ``deepspeed_feplb.weights_changed`` (the
    one write nothing cheap sees: ``.data`` has a version counter of its own); and after each step
    an evaluation forward runs on other weights swapped in and out through ``p.data``, whose copies
    must not be kept for the next micro-batch. The control: the ``.data`` write undeclared leaves
    the helpers' kept copies stale, and the losses differ."""
    results = run_distributed(mid_step_writes, 2, 2, timeout=600)
    controls = [r.pop("data-undeclared") for r in results]
    check_exact(results)
    for write, case in results[0].items():
        assert case["traffic"]["resident_hits"] > 0, f"{write}: no copy was kept, the test shows nothing"
    worst = max(max(c["param_errors"].values()) for c in controls)
    assert worst > 100 * TOLERANCE, f"undeclared .data writes left no trace ({worst:.1e}): the test shows nothing"


def test_at_the_steps_end_a_used_copy_returns_with_its_last_move_and_the_others_at_once():
    from deepspeed_feplb.plan.residency import step_end_returns
    entries = np.array([[0, 0, 1], [0, 1, 1], [2, 0, 1]])
    moves = np.array([[0, 0, 1, 5], [0, 0, 1, 3], [0, 1, 2, 4], [2, 0, 1, 1]])
    kept = np.array([True, True, False, False])  # (2, 0, 1) moved without its kept copy: a new one
    with_results, early = step_end_returns(entries, moves, kept)
    assert with_results.tolist() == [False, True, False, False]
    assert early.tolist() == [[0, 1, 1], [2, 0, 1]]
