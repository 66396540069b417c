"""Monitor summaries and events without processes: straggler definitions, byte accounting, CSV output."""
import pytest

from deepspeed_feplb.integration import monitor
from deepspeed_feplb.integration.monitor import Record, events, summarize


def rec(rank, ranks, seconds, before, after, migrated=0, moves=0, fallback=False, training=True):
    stats = {"ranks": ranks, "token_straggler_before": before, "token_straggler_after": after,
             "migrated_tokens": migrated, "moves": moves, "plan_latency_us": 100.0 * (rank + 1), "fallback": fallback}
    return Record(rank, stats, seconds, hidden=8, elem_bytes=4, expert_bytes=1000, training=training)


def test_summary_definitions():
    # one layer, two domains {0,1} and {2,3}, two micro-batches
    ranks = [{0: {"moe": rec(0, [0, 1], 0.010, 6.0, 1.0, migrated=10, moves=1)},
              1: {"moe": rec(0, [0, 1], 0.004, 2.0, 0.0, fallback=True, training=False)}},
             {0: {"moe": rec(1, [0, 1], 0.006, 6.0, 1.0, migrated=10, moves=1)},
              1: {"moe": rec(1, [0, 1], 0.004, 2.0, 0.0, fallback=True, training=False)}},
             {0: {"moe": rec(2, [2, 3], 0.002, 4.0, 0.0, migrated=3, moves=2)}},
             {0: {"moe": rec(3, [2, 3], 0.002, 4.0, 0.0, migrated=3, moves=2)}}]
    s = summarize(ranks, step=7)
    layer = s["layers"]["moe"]
    assert s["step"] == 7 and s["micro_batches"] == 2
    # GEMM straggler per (micro-batch, domain): 10 vs 6 ms -> 2; 4 vs 4 -> 0; 2 vs 2 -> 0; mean 2/3
    assert layer["gemm_straggler_ms"] == pytest.approx(2 / 3)
    assert layer["gemm_max_ms"] == pytest.approx((10 + 4 + 2) / 3)
    assert layer["token_straggler_before"] == pytest.approx((6 + 2 + 4) / 3)
    assert layer["token_straggler_after"] == pytest.approx(1 / 3)
    assert layer["migrated_tokens"] == 13  # counted once per domain, not once per rank
    # training: 2 passes x (2 x tokens x H x 4 bytes + moves x expert bytes)
    assert layer["migrated_bytes"] == 2 * (2 * 10 * 8 * 4 + 1000) + 2 * (2 * 3 * 8 * 4 + 2 * 1000)
    assert layer["fallbacks"] == 1
    assert layer["plan_latency_us"] == pytest.approx((100 + 100 + 300) / 3)  # the domain leader's value


def test_a_fallback_of_any_rank_counts_for_its_domain():
    """Each rank waits for the scheduler process on its own, so only some ranks of a domain may plan
    in-process; every rank's summary counts that micro-batch once (not the domain leader's view)."""
    ranks = [{0: {"moe": rec(0, [0, 1], 0.001, 2.0, 0.0)}},
             {0: {"moe": rec(1, [0, 1], 0.001, 2.0, 0.0, fallback=True)}}]
    assert summarize(ranks, step=0)["layers"]["moe"]["fallbacks"] == 1


def test_layers_without_domains_get_gemm_straggler_over_all_ranks():
    # DeepSpeed's own MOELayer (or FEPLB disabled): no feplb_stats
    ranks = [{0: {"moe": Record(r, {}, t, 8, 4, 0, True)}} for r, t in enumerate([0.003, 0.001])]
    layer = summarize(ranks, step=1)["layers"]["moe"]
    assert layer == {"gemm_straggler_ms": pytest.approx(1.0), "gemm_max_ms": pytest.approx(3.0)}


def test_events_and_csv_monitor(tmp_path, monkeypatch):
    from deepspeed.monitor import csv_monitor
    from deepspeed.monitor.config import CSVConfig

    monkeypatch.setattr(csv_monitor.dist, "get_rank", lambda *a, **k: 0)
    summary = summarize([{0: {"3.moe": rec(0, [0, 1], 0.01, 5.0, 1.0, migrated=4, moves=1)}},
                         {0: {"3.moe": rec(1, [0, 1], 0.02, 5.0, 1.0, migrated=4, moves=1)}}], step=3)
    out = events(summary)
    assert ("FEPLB/3.moe/token_straggler_before", 5.0, 3) in out
    assert {name.split("/")[-1] for name, _, _ in out} == set(monitor.METRICS)
    assert set(summary["layers"]["3.moe"]) == monitor.LayerStepStats.__required_keys__  # every key, always
    writer = csv_monitor.csvMonitor(CSVConfig(enabled=True, output_path=str(tmp_path), job_name="job"))
    writer.write_events(out)
    assert (tmp_path / "job" / "FEPLB_3.moe_gemm_straggler_ms.csv").read_text().split() == ["step,gemm_straggler_ms",
                                                                                             "3,5.0"]


def test_layer_name():
    assert monitor.layer_name("moe.deepspeed_moe") == "moe"
    assert monitor.layer_name("2.moe.deepspeed_moe") == "2.moe"
    assert monitor.layer_name("deepspeed_moe") == "moe"


def test_report_plots_json_lines_and_csv_monitor_dirs(tmp_path, capsys):
    import json

    from deepspeed_feplb.__main__ import main

    log = tmp_path / "run.log"
    lines = ["[2026-01-01] some launcher line", "not json {"]
    for step in range(3):
        lines.append(json.dumps({"step": step, "loss": 5.0 - step, "layers": {"1.moe": {
            "token_straggler_before": 40.0, "token_straggler_after": 4.0 + step, "gemm_straggler_ms": 1.5,
            "migrated_tokens": 10, "migrated_bytes": 1000, "plan_latency_us": 90.0, "fallbacks": 0}}}))
    log.write_text("\n".join(lines) + "\n")
    csv_dir = tmp_path / "csv" / "job"
    csv_dir.mkdir(parents=True)
    (csv_dir / "FEPLB_2.moe_gemm_straggler_ms.csv").write_text("step,gemm_straggler_ms\n1,2.0\n2,4.0\n")
    out = tmp_path / "plots"
    assert main(["report", str(log), str(tmp_path / "csv"), "--out", str(out)]) == 0
    for name in ("stragglers.png", "migration.png", "loss.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())  # two inputs: two runs, side by side
    assert summary["run.log: 1.moe"]["token_straggler_after_mean"] == 5.0
    assert summary["run.log: 1.moe"]["token_straggler_reduction"] == pytest.approx(1 - 5 / 40)
    assert summary["run.log: 1.moe"]["migrated_tokens_total"] == 30
    assert summary["csv: 2.moe"] == {"gemm_straggler_ms_mean": 3.0}
    assert "run.log: 1.moe: token straggler 40.0 -> 5.0" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:  # no per-step records: refused in one line
        main(["report", str(tmp_path / "plots" / "summary.json"), "--out", str(out)])
    assert exit_.value.code == 2 and "summary.json: no per-step stats" in capsys.readouterr().err


def _gather_both_sizes() -> list:
    import torch.distributed as dist

    from deepspeed_feplb.collectives import GATHER_BYTES, gather_small
    rank = dist.get_rank()
    small = gather_small({"rank": rank})
    large = gather_small(b"x" * (GATHER_BYTES + 1000 * rank))  # over the one-collective size: two collectives
    return [small, [len(x) for x in large]]


def test_gather_small_returns_every_ranks_object_whatever_its_size():
    from deepspeed_feplb.collectives import GATHER_BYTES
    from deepspeed_feplb.testing import run_distributed
    for small, large in run_distributed(_gather_both_sizes, 2, timeout=120):
        assert small == [{"rank": 0}, {"rank": 1}]
        assert large == [GATHER_BYTES, GATHER_BYTES + 1000]
