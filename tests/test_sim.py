"""Tests of the simulator: traces, importers, peer policies, EPLB golden vector, MILP oracle,
metrics against an independent computation, and the CLI contract (docs/ARCHITECTURE.md)."""
import json
import math
import os
from dataclasses import replace

import numpy as np
import pytest

from deepspeed_feplb.plan.cost import ExpertShape, GemmProfile, gemm_us
from deepspeed_feplb.plan.placement import CrossNodePlacer, node_loads, place_experts, rebalance_experts
from deepspeed_feplb.plan.policy import PlanConstraints, lower_bound, plan_domain
from deepspeed_feplb.sim.policies import FasterMoE, SimSetup
from deepspeed_feplb.sim.simulate import simulate
from deepspeed_feplb.trace.format import Trace, fold_sources, load_trace, save_trace
from deepspeed_feplb.trace.generators import GENERATORS, no_aux_trace
from deepspeed_feplb.trace.importers import read_megatron_router_trace

DATA = os.path.join(os.path.dirname(__file__), "data")


def test_eplb_readme_golden_vector():
    weight = np.array([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                       [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
    phy2log, log2phy, logcnt = rebalance_experts(weight, 16, 4, 2, 8)
    assert phy2log.tolist() == [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                                [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
    assert logcnt.sum(axis=1).tolist() == [16, 16]
    for layer in range(2):  # log2phy inverts phy2log
        for e in range(12):
            slots = [s for s in log2phy[layer, e] if s >= 0]
            assert len(slots) == logcnt[layer, e] and all(phy2log[layer, s] == e for s in slots)
    # per-GPU load max/mean from the README: 1.208 and 1.242
    for layer, want in ((0, 1.208), (1, 1.242)):
        per_slot = weight[layer][phy2log[layer]] / logcnt[layer][phy2log[layer]]
        gpu = per_slot.reshape(8, 2).sum(axis=1)
        assert abs(gpu.max() / gpu.mean() - want) < 1e-3


def test_trace_roundtrip_and_fold(tmp_path):
    counts = np.arange(2 * 1 * 4 * 8).reshape(2, 1, 4, 8)
    t = Trace(counts, top_k=2, hidden=16, ffn_hidden=32, source="unit")
    save_trace(tmp_path / "t.npz", t)
    back = load_trace(tmp_path / "t.npz")
    assert np.array_equal(back.counts, counts)
    assert (back.top_k, back.hidden, back.ffn_hidden, back.source) == (2, 16, 32, "unit")
    folded = fold_sources(counts, 2)
    assert np.array_equal(folded[:, :, 0], counts[:, :, 0] + counts[:, :, 1])
    one = fold_sources(counts[:, :, :1], 3)  # no source info: spread evenly, remainder first
    assert np.array_equal(one.sum(axis=2), counts[:, :, 0]) and (one.max(2) - one.min(2)).max() <= 1
    with pytest.raises(ValueError):
        fold_sources(counts, 3)
    with pytest.raises(ValueError):
        Trace(np.zeros((2, 3)))


def test_generators_shapes_and_determinism():
    for kind, gen in GENERATORS.items():
        a = gen(3, 2, 4, 16, tokens_per_rank=64, top_k=2, seed=5)
        b = gen(3, 2, 4, 16, tokens_per_rank=64, top_k=2, seed=5)
        assert a.counts.shape[:2] == (3, 2) and a.counts.shape[3] == 16, kind
        assert np.array_equal(a.counts, b.counts), kind
        if kind != "lplb":  # exact pair totals per source
            assert (a.counts.sum(axis=3) == 64 * 2).all(), kind
    biased = GENERATORS["biased"](1, 1, 2, 16, tokens_per_rank=50, top_k=4, seed=1)
    assert (biased.counts <= 50).all()  # top-k picks distinct experts per token


def test_megatron_router_trace_import(tmp_path):
    recs = {0: [], 1: []}
    rng = np.random.default_rng(0)
    expect = np.zeros((4, 2, 2, 8), dtype=np.int64)  # 2 steps x 2 micro-batches
    for step in range(2):
        for micro in range(2):
            for layer_no, layer in ((1, 0), (3, 1)):
                for rank in range(2):
                    idx = np.stack([rng.choice(8, 2, replace=False) for _ in range(5)])
                    recs[rank].append({"step": step, "stage": "pre_dispatch", "block": "decoder",
                                       "layer": layer_no, "rank": rank, "num_tokens": 5, "topk": 2,
                                       "top_indices": idx.tolist()})
                    np.add.at(expect[step * 2 + micro, layer, rank], idx.ravel(), 1)
    recs[0].append({"step": 0, "layer": 1, "rank": 0, "mtp_idx": 0, "topk": 2, "top_indices": [[0, 1]]})
    for rank, rs in recs.items():
        with open(tmp_path / f"router_trace_rank{rank}.jsonl", "w") as f:
            f.write("\n".join(json.dumps(r) for r in rs) + "\n")
    t = read_megatron_router_trace([tmp_path], num_experts=8)
    assert t.top_k == 2 and np.array_equal(t.counts, expect)
    shipped = read_megatron_router_trace([os.path.join(DATA, "megatron_router_trace")], num_experts=8)
    assert shipped.counts.shape == (2, 2, 2, 8) and shipped.counts.sum() == 2 * 2 * 2 * 6 * 2


def test_gemm_cost_model_tiles():
    shape = ExpertShape(hidden=4, ffn_hidden=8, mats=2)
    prof = GemmProfile("t", tflops=1e-6, tile_m=4, overhead_us=1.0, ce_gbps=1.0, net_gbps=1.0)
    # flops_per_row = 2*2*4*8 = 128; at 1 MFLOP/s -> 128 µs per row, whole tiles of 4 rows
    assert gemm_us(np.array([0, 1, 4, 5]), shape, prof).tolist() == [0.0, 513.0, 513.0, 1025.0]


def test_fit_profile_recovers_tile_rate_and_overhead():
    """The calibration fit on times made by a known profile finds that profile's tile, rate and
    overhead (the tiles 1, 2 and 4 fit these times worse, so the check can fail)."""
    from deepspeed_feplb.sim.calibrate import fit_profile
    shape = ExpertShape(hidden=64, ffn_hidden=128)
    truth = GemmProfile("t", tflops=2e-3, tile_m=8, overhead_us=5.0, ce_gbps=1.0, net_gbps=1.0)
    rows = [1, 3, 8, 9, 17, 24, 31, 64, 100]
    fitted = fit_profile("fit", shape, rows, gemm_us(np.array(rows), shape, truth), (1, 2, 4, 8, 16), 1.0, 1.0)
    assert fitted.tile_m == 8 and fitted.floor_us == 0.0
    assert fitted.tflops == pytest.approx(2e-3, rel=1e-6) and fitted.overhead_us == pytest.approx(5.0, rel=1e-6)


def test_fit_profile_finds_the_floor_under_small_pieces_and_the_time_model_charges_it():
    """A profile whose pieces cost at least 400 µs (its first six sizes sit on that floor): the fit
    finds the floor, tile, rate and overhead; the time model charges a one-row piece the floor,
    forward and backward (x 3), and a large piece its tiles."""
    from deepspeed_feplb.plan.timeline import TimeModel, rank_finish_us
    from deepspeed_feplb.sim.calibrate import fit_profile
    shape = ExpertShape(hidden=64, ffn_hidden=128)
    truth = GemmProfile("t", tflops=2e-3, tile_m=8, overhead_us=5.0, ce_gbps=1.0, net_gbps=1.0, floor_us=400.0)
    rows = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89]
    times = gemm_us(np.array(rows), shape, truth)
    assert times[:6].tolist() == [400.0] * 6 and times[6] > 400.0
    fitted = fit_profile("fit", shape, rows, times, (1, 2, 4, 8, 16), 1.0, 1.0)
    assert fitted.tile_m == 8 and fitted.floor_us == pytest.approx(400.0)
    assert fitted.tflops == pytest.approx(2e-3, rel=1e-6) and fitted.overhead_us == pytest.approx(5.0, rel=1e-6)
    model = TimeModel.of(shape, fitted)
    assert model.piece_floor_us == pytest.approx(1200.0)
    stage = rank_finish_us(np.array([[1], [89]]), np.zeros((0, 4), np.int64), model).sum(axis=0)
    assert stage.tolist() == pytest.approx([1200.0, 3 * times[-1]])


def test_the_floor_fits_the_h200_measurement():
    """The expert GEMMs measured on an H200 (benchmarks/data/h200_gpu_profile.json: 16 to 32,768
    rows, two expert shapes) cost 45-55 µs up to 256 rows, then grow with their rows. The fit with
    a floor is within 15% of every measured size; the line alone is 19-22% off (and 43-46% as it
    was fitted before, in absolute terms)."""
    from deepspeed_feplb.sim.calibrate import fit_profile
    with open(os.path.join(os.path.dirname(__file__), "..", "benchmarks", "data", "h200_gpu_profile.json")) as f:
        measured = json.load(f)["shapes"]
    for name, (hidden, ffn) in {"glm5": (6144, 2048), "deepseek_v3": (7168, 2048)}.items():
        shape, rows, times = ExpertShape(hidden=hidden, ffn_hidden=ffn), measured[name]["rows"], \
            np.array(measured[name]["measured_us"])
        tiles = (1, 2, 4, 8, 16, 32, 64, 128, 256)

        def worst(profile, rows=rows, shape=shape, times=times):
            return float(np.max(np.abs(gemm_us(np.array(rows), shape, profile) - times) / times))
        fitted = fit_profile("gpu", shape, rows, times, tiles, 370.0, 50.0)
        assert 45.0 <= fitted.floor_us <= 55.0 and worst(fitted) <= 0.15, (name, fitted, worst(fitted))
        line = fit_profile("gpu", shape, rows, times, tiles, 370.0, 50.0, floor=False)
        assert line.floor_us == 0.0 and worst(line) > 0.18 > 0.15 >= worst(fitted), (name, line)
        # the same fit from the sizes in another order
        shuffled = np.random.default_rng(0).permutation(len(rows))
        again = fit_profile("gpu", shape, np.array(rows)[shuffled], times[shuffled], tiles, 370.0, 50.0)
        assert again == fitted


def test_the_row_tile_fit_tells_steps_at_tiles_from_time_that_grows_with_the_rows():
    """`fit_row_tile` on sweeps across 128-row tile ends (the device check's ``grouped_tile``): times
    that step by a whole tile past 384 and 512 fit 128; times that grow with every 8 rows fit a tile of
    32 or less, each with 1% noise (0 misfits in 500 seeds of each); and `grouped_sweep_us` times one
    grouped call per swept size here."""
    from deepspeed_feplb.sim.calibrate import fit_row_tile, grouped_sweep_us
    rng = np.random.default_rng(3)
    rows = np.arange(384, 641, 8)
    stepped = 300.0 + 0.5 * np.ceil(rows / 128) * 128
    smooth = 300.0 + 0.5 * rows
    for times, tiled in ((stepped, True), (smooth, False)):
        fit = fit_row_tile(rows, times * (1 + 0.01 * rng.standard_normal(len(times))))
        assert fit["tile"] == 128 if tiled else fit["tile"] <= 32, fit
    assert fit_row_tile(rows, stepped)["rms_us"][128] < 1e-6 < fit_row_tile(rows, stepped)["rms_us"][8]
    swept, times = grouped_sweep_us(ExpertShape(hidden=16, ffn_hidden=32, mats=3), groups=3, rows=16,
                                    deltas=range(-16, 17, 8), repeat=1)
    assert swept == [0, 8, 16, 24, 32] and all(t > 0 for t in times)


def test_gpu_profile_needs_a_device():
    import torch

    from deepspeed_feplb.sim.calibrate import get_profile
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the gpu profile would be measured")
    with pytest.raises(RuntimeError, match="CUDA device"):
        get_profile("gpu")


def _independent_vanilla(counts, ranks):
    """Straight from the metric definitions: contiguous homes, T_r, max - mean."""
    S, L, _, E = counts.shape
    out = np.zeros((S, L))
    for s in range(S):
        for layer in range(L):
            per_expert = counts[s, layer].sum(axis=0)
            T = [sum(per_expert[e] for e in range(E) if e // (E // ranks) == r) for r in range(ranks)]
            out[s, layer] = max(T) - sum(T) / ranks
    return out


def test_the_ideal_and_where_each_policys_time_over_it_goes():
    """The ideal is vanilla's compute spread evenly (mean over ranks, no transfers): vanilla's
    excess is all imbalance; a trace with the same rows on every expert is ideal under vanilla;
    no policy beats the ideal, and the excess splits into pieces, imbalance, exposed copies and the
    rest, which add up to each policy's expert time."""
    trace = no_aux_trace(6, 2, ranks=8, experts=32, tokens_per_rank=512, seed=2)
    setup = SimSetup(4, 2, 32, dynamic_experts=2, chunk_align=1)
    m = simulate(trace, setup, ["fastermoe", "eplb", "feplb"]).metrics()
    vanilla = m["vanilla"]
    assert vanilla["excess_pieces_us"] == pytest.approx(0, abs=1e-6) and vanilla["excess_other_us"] == pytest.approx(
        0, abs=1e-6)
    assert vanilla["excess_imbalance_us"] > 0 and vanilla["time_over_ideal"] > 1.05
    for name, p in m.items():
        assert p["ideal_time_us"] == vanilla["ideal_time_us"], name
        assert p["time_over_ideal"] >= 1 - 1e-9, name
        parts = p["ideal_time_us"] + p["excess_pieces_us"] + p["excess_imbalance_us"] + p["copy_exposed_us"] + p[
            "excess_other_us"]
        assert parts == pytest.approx(p["expert_time_us"], rel=1e-9), name
    assert m["feplb"]["time_over_ideal"] < vanilla["time_over_ideal"]
    even = Trace(np.full((2, 1, 8, 32), 16, np.int64))
    assert simulate(even, setup, []).metrics()["vanilla"]["time_over_ideal"] == pytest.approx(1.0)
    assert "time_over_ideal_by_step_position" not in m["feplb"]  # one micro-batch per step


def test_time_over_ideal_by_position_in_the_step():
    """With several micro-batches per step, the ratio per position in the step: each is its
    position's expert time over its ideal, and they average to the whole (every position has as
    many micro-batches and, on this trace, the same ideal)."""
    trace = Trace(np.tile(no_aux_trace(1, 1, ranks=8, experts=32, tokens_per_rank=512, seed=2).counts, (8, 1, 1, 1)))
    setup = SimSetup(8, 1, 32, dynamic_experts=2, micro_batches_per_step=4)
    run = simulate(trace, setup, ["feplb"]).runs["feplb"]
    by = run.metrics(None)["time_over_ideal_by_step_position"]
    assert len(by) == 4
    assert by == pytest.approx([run.expert_us[p::4].mean() / run.ideal_us[p::4].mean() for p in range(4)])
    assert np.mean(by) == pytest.approx(run.metrics(None)["time_over_ideal"])
    assert by[1] <= by[0]  # the step's first micro-batch makes the copies the next ones hold


def test_the_figure_shows_each_policys_time_over_the_ideal_split_as_the_json_has_it():
    """`simulate --plot`'s panel: per policy a bar of the ideal (1) and its excess parts, as
    multiples of the ideal, ending at the JSON's ``time_over_ideal``."""
    pytest.importorskip("matplotlib")
    from deepspeed_feplb.sim.report import figure

    trace = no_aux_trace(6, 1, ranks=8, experts=32, tokens_per_rank=512, seed=2)
    result = simulate(trace, SimSetup(8, 1, 32, dynamic_experts=2, chunk_align=1), ["eplb", "feplb"])
    metrics = result.metrics()
    fig = figure(result.runs)
    panel = next(ax for ax in fig.axes if ax.get_title().startswith("expert time over the ideal"))
    labels = [t.get_text() for t in panel.get_yticklabels()]
    ends = {}
    for bar in panel.patches:
        row = labels[round(bar.get_y() + bar.get_height() / 2)]
        ends[row] = max(ends.get(row, 0.0), bar.get_x() + bar.get_width())
    assert len(ends) == 3
    for name, p in metrics.items():
        label = next(label for label in labels if label.startswith(name + " (") or label == name)
        drawn = 1 + sum(max(p[k], 0) for k in ("excess_pieces_us", "excess_imbalance_us", "copy_exposed_us",
                                                "excess_other_us")) / p["ideal_time_us"]
        assert ends[label] == pytest.approx(drawn) and drawn >= p["time_over_ideal"] - 1e-9, name
        assert f"{p['time_over_ideal']:.3f}" in [t.get_text().strip() for t in panel.texts]


def test_simulator_reproduces_vanilla_and_balances():
    trace = no_aux_trace(6, 2, ranks=8, experts=32, tokens_per_rank=512, seed=2)
    setup = SimSetup(4, 2, 32, dynamic_experts=2, chunk_align=1)
    res = simulate(trace, setup, ["fastermoe", "eplb", "feplb-paper", "feplb"], keep_moves=True)
    van = res.runs["vanilla"]
    assert np.allclose(van.token_straggler, _independent_vanilla(trace.counts, 8))
    m = res.metrics()
    assert m["vanilla"]["token_straggler"] == pytest.approx(_independent_vanilla(trace.counts, 8).mean())
    for name, run in res.runs.items():  # every policy conserves tokens
        assert np.array_equal(run.rank_rows.sum(axis=-1), trace.counts.sum(axis=(2, 3))), name
    assert m["feplb"]["token_straggler"] < m["feplb-paper"]["token_straggler"] < m["vanilla"]["token_straggler"]
    # feplb's dumped moves replay into its rank tokens, node by node through plan_domain
    feplb = res.runs["feplb"]
    moves = feplb.moves
    for s in range(trace.steps):
        for layer in range(trace.layers):
            loads = trace.counts[s, layer].sum(axis=0)
            T = np.bincount(np.arange(32) // 4, weights=loads, minlength=8)
            mv = moves[(moves[:, 0] == s) & (moves[:, 1] == layer)]
            np.subtract.at(T, mv[:, 3], mv[:, 5])
            np.add.at(T, mv[:, 4], mv[:, 5])
            assert np.array_equal(T, feplb.rank_rows[s, layer])
            assert ((mv[:, 3] // 4) == (mv[:, 4] // 4)).all()  # moves stay inside a node
            assert ((mv[:, 2] // 4) == mv[:, 3]).all()  # contiguous placement at the start


def test_a_row_bound_trades_expert_time_for_row_balance(tmp_path):
    """At 2k rows per rank a GLM-5-sized weight copy costs more than most of the rows it would move
    save, so time alone leaves rows unbalanced; ``max_rows_over_mean`` 1.0 balances them (every
    rank within the bound wherever the row plan reaches it) and pays for it in expert time."""
    from deepspeed_feplb.__main__ import main

    trace = no_aux_trace(16, 1, ranks=8, experts=64, tokens_per_rank=256, seed=4)
    save_trace(tmp_path / "t.npz", trace)
    docs = {}
    for name, extra in (("time", []), ("rows", ["--max-rows-over-mean", "1.0"])):
        out = tmp_path / f"{name}.json"
        assert main(["simulate", "--trace", str(tmp_path / "t.npz"), "--ranks-per-node", "8", "--dynamic-experts", "4",
                     "--micro-batches-per-step", "4", "--policies", "feplb", "--json", str(out), "--no-progress",
                     *extra]) == 0
        docs[name] = json.loads(out.read_text())["policies"]["feplb"]
    assert docs["rows"]["token_max_over_mean"] < docs["time"]["token_max_over_mean"] - 0.02
    assert docs["rows"]["token_max_over_mean"] < 1.02
    assert docs["rows"]["expert_time_us"] > docs["time"]["expert_time_us"]
    with pytest.raises(SystemExit):
        main(["simulate", "--trace", str(tmp_path / "t.npz"), "--ranks-per-node", "8",
              "--json", str(tmp_path / "x.json"), "--max-rows-over-mean", "0.95"])


def test_simulate_aligns_chunks_as_the_runtime_would_on_the_profiles_device(tmp_path):
    """--chunk-align auto (the default) is the runtime's: 128 rows (a GPU's GEMM row tile) under a
    GPU profile, 8 under --max-rows-over-mean; a number is kept; a bad value is named."""
    from deepspeed_feplb.__main__ import main

    save_trace(tmp_path / "t.npz", no_aux_trace(2, 1, ranks=4, experts=16, tokens_per_rank=512, seed=1))
    aligns = {}
    for name, extra in (("gpu", []), ("bound", ["--max-rows-over-mean", "1.1"]), ("set", ["--chunk-align", "16"])):
        out = tmp_path / f"{name}.json"
        assert main(["simulate", "--trace", str(tmp_path / "t.npz"), "--ranks-per-node", "4", "--policies", "feplb",
                     "--json", str(out), "--no-progress", *extra]) == 0
        aligns[name] = json.loads(out.read_text())["setup"]["chunk_align"]
    assert aligns == {"gpu": 128, "bound": 8, "set": 16}
    with pytest.raises(SystemExit):
        main(["simulate", "--trace", str(tmp_path / "t.npz"), "--ranks-per-node", "4", "--chunk-align", "tile"])


def test_simulate_serves_on_arrival_as_the_runtime_would_on_the_profiles_device(tmp_path):
    """--serve-on-arrival auto (the default) is the runtime's: on with a GPU profile (a served
    stream), off with --profile cpu; on, the same trace takes less expert time; a bad value is named."""
    from deepspeed_feplb.__main__ import main

    save_trace(tmp_path / "t.npz", no_aux_trace(4, 1, ranks=4, experts=16, tokens_per_rank=2048, seed=1))
    runs = {}
    for name, extra in (("auto", []), ("off", ["--serve-on-arrival", "off"]),
                        ("cpu", ["--profile", "cpu"]), ("cpu on", ["--profile", "cpu", "--serve-on-arrival", "on"])):
        out = tmp_path / f"{name}.json"
        assert main(["simulate", "--trace", str(tmp_path / "t.npz"), "--ranks-per-node", "4", "--policies", "feplb",
                     "--json", str(out), "--no-progress", *extra]) == 0
        runs[name] = json.loads(out.read_text())
    assert {name: run["setup"]["serve_on_arrival"] for name, run in runs.items()} == \
        {"auto": True, "off": False, "cpu": False, "cpu on": True}
    times = {name: runs[name]["policies"]["feplb"]["expert_time_us"] for name in ("auto", "off")}  # `cpu`: measured
    assert times["auto"] < times["off"], times
    with pytest.raises(SystemExit):
        main(["simulate", "--trace", str(tmp_path / "t.npz"), "--ranks-per-node", "4", "--serve-on-arrival", "yes"])


def test_simulate_gives_a_replica_slot_per_rank_across_nodes_as_the_runtime_does(tmp_path):
    """--redundant-per-rank auto (the default) is the runtime's "auto" where memory allows: one slot
    per rank when the EP group spans nodes of GPUs, none in one node or with the CPU profile (CPU
    ranks); a number is taken as it is; a bad value is named."""
    from deepspeed_feplb.__main__ import main

    save_trace(tmp_path / "t.npz", no_aux_trace(4, 1, ranks=4, experts=16, tokens_per_rank=256, seed=1))
    slots = {}
    two_nodes = ["--ranks-per-node", "2", "--nodes", "2"]
    for name, extra in (("one node", ["--ranks-per-node", "4"]), ("two nodes", two_nodes),
                        ("two nodes, 0", [*two_nodes, "--redundant-per-rank", "0"]),
                        ("two nodes, cpu", [*two_nodes, "--profile", "cpu"])):
        out = tmp_path / "out.json"
        assert main(["simulate", "--trace", str(tmp_path / "t.npz"), "--policies", "feplb", "--json", str(out),
                     "--no-progress", *extra]) == 0
        slots[name] = json.loads(out.read_text())["setup"]["redundant_per_rank"]
    assert slots == {"one node": 0, "two nodes": 1, "two nodes, 0": 0, "two nodes, cpu": 0}
    with pytest.raises(SystemExit):
        main(["simulate", "--trace", str(tmp_path / "t.npz"), "--ranks-per-node", "4", "--redundant-per-rank", "some"])


def test_fastermoe_shadow_rule():
    setup = SimSetup(2, 1, 4, shape=ExpertShape(hidden=2, ffn_hidden=2, mats=2, dtype_bytes=1),
                     profile=GemmProfile("t", 1e-12, 1, 0.0, 1e-9, 1e-9))
    f = FasterMoE(setup, 1)
    # comp = 16 s per row, feature = 2 s, model broadcast = 8 s: per-token cost 3*16 + 4*2 = 56 s.
    # FasterMoE shadows the k-th hottest while 56 * B_{k+1} + 8 * (k + 1) keeps decreasing.
    assert f.shadow_mask(np.array([200, 100, 100, 99])).tolist() == [True, False, False, False]
    assert f.shadow_mask(np.array([200, 100, 90, 0])).tolist() == [True, True, True, False]
    res = f.step(0, 0, np.array([[150, 50, 50, 49], [50, 50, 50, 50]]))
    T = np.bincount(res.piece_rank, weights=res.piece_tokens, minlength=2)
    assert T.tolist() == [150 + 100, 50 + 100 + 99]  # expert 0 computed at its sources
    assert res.extra["shadowed_experts"] == 1 and res.extra["broadcast_us"] == pytest.approx(8e6)


def test_cross_node_placement_balances_nodes():
    rng = np.random.default_rng(0)
    hist = rng.zipf(1.5, 64).astype(float)
    e2r = place_experts(hist, 4, 2)
    assert np.bincount(e2r, minlength=8).tolist() == [8] * 8
    nodes = node_loads(hist, e2r, 4, 2)
    contiguous = node_loads(hist, np.arange(64) // 8, 4, 2)
    assert nodes.max() <= contiguous.max() and nodes.max() - nodes.mean() <= hist.max()
    again = place_experts(hist, 4, 2, previous=e2r)  # stable: nothing moves without a reason
    assert np.array_equal(again, e2r)
    p = CrossNodePlacer(64, 4, 2, interval=2, expert_state_bytes=1.0, us_per_token=1.0)
    p.observe(hist)
    p.observe(hist)
    assert p.refreshes == 1 and node_loads(hist, p.expert_to_rank, 4, 2).max() == pytest.approx(nodes.max())
    costly = CrossNodePlacer(64, 4, 2, interval=1, expert_state_bytes=1e18, us_per_token=1.0)
    costly.observe(hist)
    assert costly.refreshes == 0  # the move would not pay for itself


def test_greedy_close_to_milp_oracle():
    pytest.importorskip("highspy")
    from deepspeed_feplb.sim.oracle import optimal_max_load

    rng = np.random.default_rng(7)
    gaps = {True: [], False: []}
    for i in range(12):
        G, E = (4, 4) if i % 2 else (6, 4)
        counts = rng.multinomial(G * E * 100, rng.dirichlet(np.full(G * E, 0.4))).reshape(G, E)
        free = i % 3 != 0
        cons = PlanConstraints(dynamic_experts=2, max_helpers=2,
                               ce_budget_bytes=math.inf if free else 2.5, expert_bytes=1)
        opt = optimal_max_load(counts, cons, time_limit=5)
        assert opt.optimal
        plan = plan_domain(counts, cons)
        assert plan.rank_rows.max() >= opt.max_load - 1e-6  # the oracle is a true optimum
        assert opt.max_load >= lower_bound(counts, 2) - 1e-6
        gaps[free].append((plan.rank_rows.max() - opt.max_load) / counts.sum(axis=1).mean())
    # measured: optimal on all 12, with or without a budget of two weight copies per rank (before
    # chains through ranks above the level: 1.25% and 10% of the mean load on two budget cases)
    assert np.mean(gaps[True]) <= 0.01 and max(gaps[True]) <= 0.1
    assert np.mean(gaps[False]) <= 0.01 and max(gaps[False]) <= 0.05


def test_cli_simulate_contract(tmp_path):
    from deepspeed_feplb.__main__ import main

    trace = no_aux_trace(4, 1, ranks=8, experts=16, tokens_per_rank=256, seed=1)
    save_trace(tmp_path / "t.npz", trace)
    out, plans, png = tmp_path / "o.json", tmp_path / "p.npz", tmp_path / "o.png"
    rc = main(["simulate", "--trace", str(tmp_path / "t.npz"), "--ranks-per-node", "4", "--nodes", "2",
               "--dynamic-experts", "1", "--policies", "vanilla,fastermoe,eplb,feplb", "--json", str(out),
               "--dump-plans", str(plans), "--plot", str(png), "--no-progress", "--sweep-d", "0,1"])
    assert rc == 0
    doc = json.loads(out.read_text())
    for name in ("vanilla", "fastermoe", "eplb", "feplb"):
        for key in ("token_straggler", "token_max_over_mean", "gemm_straggler_us", "reduction_vs_vanilla"):
            assert isinstance(doc["policies"][name][key], float)
    assert doc["policies"]["vanilla"]["token_straggler"] == pytest.approx(
        _independent_vanilla(trace.counts, 8).mean())
    with np.load(plans) as z:
        assert z["moves"].dtype == np.int64 and z["moves"].shape[1] == 6
        assert z["rank_tokens"].shape == (4, 1, 8)
        assert np.array_equal(z["rank_tokens"].sum(-1), trace.counts.sum(axis=(2, 3)))
    assert png.stat().st_size > 10_000
    rc = main(["trace", "--kind", "zipf", "--steps", "2", "--layers", "1", "--ranks", "2", "--experts", "8",
               "--tokens-per-rank", "16", "--top-k", "2", "--out", str(tmp_path / "z.npz")])
    assert rc == 0 and load_trace(tmp_path / "z.npz").counts.shape == (2, 1, 2, 8)


def _recorded_trace(measured_over_model: float) -> Trace:
    """Two ranks (one domain), experts 0-1 on rank 0 and 2-3 on rank 1, three micro-batches; from
    the second on the runtime moved 10 rows of expert 0 to rank 1 with its weights, and the slowest
    rank's measured stage time is ``measured_over_model`` x the model's 90 µs (see the test)."""
    counts = np.zeros((3, 1, 2, 4), np.int64)
    counts[:, 0, 0] = [30, 10, 5, 5]
    moves = np.array([[1, 0, 0, 0, 1, 10, 1], [2, 0, 0, 0, 1, 10, 1]], np.int64)
    stage = np.full((3, 1, 2, 5), np.nan)
    # forward, backward, plan latency, fitted piece and row cost (what the runtime's planner used)
    stage[1:, 0, 0] = [30.0 * measured_over_model, 60.0 * measured_over_model, 5.0, 0.0, 3.0]
    stage[1:, 0, 1] = [20.0, 40.0, 5.0, 0.0, 3.0]
    return Trace(counts, plan_moves=moves, stage_us=stage)


def test_the_time_model_is_compared_with_a_recorded_runs_own_plans(tmp_path):
    from deepspeed_feplb.plan.timeline import TimeModel
    from deepspeed_feplb.sim.measured import compare_measured, over_ideal, predicted_and_measured

    # 1 µs per row forward, 2 backward, free pieces, a 5 µs weight copy and gradient, 0.1 µs per
    # row copied: rank 0 keeps 20 + 10 rows (30 µs forward, 60 backward); rank 1 computes its 10,
    # then the chunk (arrived at 6 µs) until 20 µs, whose outputs (1 µs) are home at 21 µs; its
    # backward ends at 40 µs, the gradients (5 µs) are home at 45: the makespan is 30 + 60 µs
    # (120 µs without the move, had it been read with the wrong expert or rank)
    model = TimeModel(1, 3.0, 0.0, 5.0, 5.0, 0.1)
    path = tmp_path / "recorded.npz"
    save_trace(path, _recorded_trace(1.1))
    trace = load_trace(path)  # plans and stage times survive the file
    rows = predicted_and_measured(trace, model, ranks_per_node=2)
    # the first micro-batch is skipped; the ideal: (40 + 10) rows at 3 µs over 2 ranks; the measured
    # mean: rank 0's 33 + 66 µs and rank 1's 20 + 40
    assert np.allclose(rows, [[1, 0, 0, 90.0, 99.0, 75.0, 79.5], [2, 0, 0, 90.0, 99.0, 75.0, 79.5]])
    errors = compare_measured(trace, model, ranks_per_node=2)
    assert errors["micro_batches"] == 2 and errors["median_rel_error"] == pytest.approx(-1 / 11)
    assert errors["median_abs_rel_error"] == errors["p90_abs_rel_error"] == pytest.approx(1 / 11)
    with pytest.raises(ValueError, match="no runtime record"):
        compare_measured(Trace(trace.counts), model, ranks_per_node=2)
    split = over_ideal(rows)  # measured 99 µs over the ideal 75: 19.5 of imbalance, 4.5 of the rest
    assert split == pytest.approx({"measured_time_us": 99.0, "ideal_time_us": 75.0, "time_over_ideal": 1.32,
                                   "imbalance_us": 19.5, "rest_us": 4.5, "micro_batches": 2})


def test_the_recorded_costs_replace_the_profiles_compute_costs():
    from deepspeed_feplb.plan.timeline import TimeModel
    from deepspeed_feplb.sim.measured import predicted_and_measured

    slow = TimeModel(1, 7.0, 50.0, 5.0, 5.0, 0.1)  # a profile far from the run: 7 µs per row, 50 per piece
    rows = predicted_and_measured(_recorded_trace(1.0), slow, ranks_per_node=2, recorded_costs=True)
    assert rows[:, 3].tolist() == [90.0, 90.0]  # the run's 3 µs per row and free pieces (see the test above)


def test_the_recorded_message_latency_is_priced_where_the_trace_holds_it():
    from deepspeed_feplb.plan.timeline import TimeModel, makespan_us, rank_finish_us
    from deepspeed_feplb.sim.measured import predicted_and_measured

    model = TimeModel(1, 3.0, 0.0, 5.0, 5.0, 0.1)
    trace = _recorded_trace(1.0)
    stage = np.concatenate([trace.stage_us, np.full(trace.stage_us.shape[:-1] + (2, ), np.nan)], axis=-1)
    stage[1:, 0, :, 3] = 0.0  # a current record: column 3 is the fitted piece cost
    stage[1:, 0, :, 6] = 20.0  # the domain's transport measured 20 µs per message
    rows = predicted_and_measured(replace(trace, stage_us=stage), model, ranks_per_node=2, recorded_costs=True)
    slow_messages = makespan_us(rank_finish_us(trace.counts[1, 0].sum(axis=0).reshape(2, 2), np.array([[0, 0, 1, 10]]),
                                               replace(model, message_us=20.0)))  # plan latency: micro-batch 0's, none
    assert rows[0, 3] == slow_messages > 90.0  # the chunk's messages now end the micro-batch
    given = predicted_and_measured(replace(trace, stage_us=stage), model, ranks_per_node=2, recorded_costs=True,
                                   recorded_message_us=False)  # simulate --message-us: the figure given wins
    assert given[0, 3] < slow_messages
    stage[1:, 0, :, 6] = np.nan  # no domain had opened: the profile's latency (0 here)
    rows = predicted_and_measured(replace(trace, stage_us=stage), model, ranks_per_node=2, recorded_costs=True)
    assert rows[0, 3] < slow_messages


def test_with_its_own_plan_latency_a_micro_batch_waits_for_its_plan_as_it_did():
    """The planner's view prices a micro-batch's plan at the previous one's latency; the check of the
    model's composition alone takes the micro-batch's own."""
    from deepspeed_feplb.plan.timeline import TimeModel, makespan_us, rank_finish_us
    from deepspeed_feplb.sim.measured import predicted_and_measured

    model = TimeModel(1, 3.0, 0.0, 5.0, 5.0, 0.1)
    trace = _recorded_trace(1.0)
    stage = np.concatenate([trace.stage_us, np.full(trace.stage_us.shape[:-1] + (2, ), np.nan)], axis=-1)
    stage[1:, 0, :, 3] = 0.0  # a current record: column 3 is the fitted piece cost
    stage[1, 0, :, 2], stage[2, 0, :, 2] = 5.0, 400.0  # micro-batch 2's plan came late
    trace = replace(trace, stage_us=stage)

    def expect(plan_us):  # the run's 3 µs per row, its move of 10 rows, the plan there at plan_us
        return makespan_us(rank_finish_us(trace.counts[2, 0].sum(axis=0).reshape(2, 2), np.array([[0, 0, 1, 10]]),
                                          replace(model, plan_us=plan_us)))

    planner = predicted_and_measured(trace, model, ranks_per_node=2, recorded_costs=True)
    own = predicted_and_measured(trace, model, ranks_per_node=2, recorded_costs=True, own_plan_latency=True)
    assert planner[1, 3] == pytest.approx(expect(5.0)) and own[0, 3] == pytest.approx(expect(5.0))
    assert own[1, 3] == pytest.approx(expect(400.0)) and own[1, 3] > planner[1, 3] + 300


def test_the_cpu_share_says_whether_the_ranks_had_a_core_each():
    from deepspeed_feplb.sim.measured import cpu_share

    trace = _recorded_trace(1.0)
    assert cpu_share(trace) is None  # recorded before the CPU time was
    stage = np.concatenate([trace.stage_us, np.full(trace.stage_us.shape[:-1] + (1, ), np.nan)], axis=-1)
    stage[1:, 0, 0, 5] = 0.5 * (stage[1:, 0, 0, 0] + stage[1:, 0, 0, 1])  # rank 0 shared its core
    stage[1:, 0, 1, 5] = stage[1:, 0, 1, 0] + stage[1:, 0, 1, 1]
    assert cpu_share(replace(trace, stage_us=stage)) == pytest.approx(0.75)


def test_copies_wait_for_the_plan_and_on_cpu_ranks_for_the_homes_other_experts():
    from deepspeed_feplb.plan.timeline import TimeModel, rank_finish_us

    counts = np.array([[30, 10], [5, 5]])
    moves = np.array([[0, 0, 1, 10]])  # 10 rows of rank 0's expert 0 to rank 1, with its weights
    model = TimeModel(1, 3.0, 0.0, 5.0, 5.0, 0.1)  # a row: 1 µs forward, 2 µs backward
    # the copy engine: the chunk arrives at 6 µs, rank 1 computes it from 10 to 20 µs (its outputs
    # are home at 21, rank 0 ends its own 30 rows at 30); backward: the output-gradients arrive at
    # 1 µs, rank 1 computes the chunk from 20 to 40 µs, rank 0 its rows until 60
    backward = pytest.approx([60.0, 40.0])
    assert rank_finish_us(counts, moves, model).tolist() == [pytest.approx([30.0, 20.0]), backward]
    # a grouped static call on the CPU: the chunk leaves once expert 1's 10 rows are computed (arrives
    # at 16), rank 1 computes it from 16 to 26 µs
    grouped = rank_finish_us(counts, moves, replace(model, sends_after_static=True))
    assert grouped.tolist() == [pytest.approx([30.0, 26.0]), backward]
    # the plan is there at 25 µs: every rank waits for it, the chunk leaves then (arrives at 31),
    # its outputs are home at 42; the backward does not wait for a plan
    late = rank_finish_us(counts, moves, replace(model, sends_after_static=True, plan_us=25.0))
    assert late.tolist() == [pytest.approx([45.0, 41.0]), backward]
    # an unmoved dynamic expert (rank 0's hottest, its 30 rows) waits for the plan too
    waiting = rank_finish_us(counts, np.zeros((0, 4), np.int64), replace(model, plan_us=25.0), dynamic_experts=1)
    assert waiting.tolist() == [pytest.approx([25.0 + 30.0, 25.0 + 5.0]), pytest.approx([80.0, 20.0])]
    assert rank_finish_us(counts, np.zeros((0, 4), np.int64), replace(model, plan_us=25.0)).tolist() == \
        [pytest.approx([40.0, 25.0]), pytest.approx([80.0, 20.0])]
    late_model = replace(model, plan_us=25.0, sends_after_static=True, piece_floor_us=7.0, forward_share=0.4)
    assert TimeModel.from_record(late_model.record) == late_model  # as the mailbox carries it


def test_a_helper_returns_its_results_part_by_part_and_only_the_last_waits_after_its_compute():
    """Home 0 moves 100 rows to helper 1, which keeps a copy of the weights (no weight copy). Forward
    (1 µs a row): the rows arrive at 50 µs, the helper computes them until 150; in one part the
    outputs are home at 200, in 4 parts of 25 rows the last part's (12.5 µs) at 162.5. Backward (2
    µs a row): served from 50 to 250, input-gradients home at 300, or 262.5."""
    from deepspeed_feplb.plan.timeline import TimeModel, rank_finish_us

    counts, moves = np.array([[200], [0]]), np.array([[0, 0, 1, 100]])
    kept = np.zeros(1, np.bool_)
    model = TimeModel(1, 3.0, 0.0, 0.0, 0.0, 0.5)
    for parts, part_rows, home in ((1, 1, [200.0, 300.0]), (4, 25, [162.5, 262.5]), (4, 40, [175.0, 275.0]),
                                   (4, 1000, [200.0, 300.0])):
        finish = rank_finish_us(counts, moves, replace(model, serve_parts=parts, serve_part_rows=part_rows),
                                fresh=kept, grads_back=kept)
        assert finish[:, 0].tolist() == pytest.approx(home), (parts, part_rows)
