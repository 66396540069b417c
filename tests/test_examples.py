"""The examples: FEPLB on and off give the same loss curve; the pipeline example runs under the deepspeed CLI."""
import copy
import json
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from deepspeed_feplb.testing import free_port, run_distributed

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TOLERANCE = 1e-5  # relative, fp32


STEPS = 6


def _config(name: str, enabled: bool) -> dict:
    config = json.loads((EXAMPLES / name).read_text())
    # inline planning: the same plans as the scheduler process, without its start-up in a short test
    config["feplb"] = {**copy.deepcopy(config["feplb"]), "enabled": enabled, "scheduler": {"mode": "inline"}}
    return config


def train_moe_on_and_off(csv_dir: str) -> dict:
    sys.path.insert(0, str(EXAMPLES))
    import train_moe

    args = Namespace(steps=STEPS, hidden=32, experts=8, top_k=2, context=8, batch=256)
    runs = {}
    for enabled in (True, False):
        config = _config("ds_config.json", enabled)
        if enabled:  # DeepSpeed's CSV monitor receives the FEPLB events
            config["csv_monitor"] = {"enabled": True, "output_path": csv_dir, "job_name": "feplb"}
        runs[enabled] = train_moe.train(args, config, log=None)
    return runs


@pytest.fixture(scope="module")
def csv_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("csv_monitor")


@pytest.fixture(scope="module")
def train_moe_runs(csv_dir):
    return run_distributed(train_moe_on_and_off, 2, str(csv_dir), timeout=240)


def test_train_moe_loss_curve_is_the_same_with_feplb_disabled(train_moe_runs):
    for rank, runs in enumerate(train_moe_runs):
        on, off = [r["loss"] for r in runs[True]], [r["loss"] for r in runs[False]]
        assert on == pytest.approx(off, rel=TOLERANCE), f"rank {rank}: {on} vs {off}"
        assert on[-1] < on[0] - 0.5, f"rank {rank}: the model did not learn: {on}"


def test_train_moe_really_balanced_when_enabled(train_moe_runs):
    on, off = train_moe_runs[0][True], train_moe_runs[0][False]
    assert sum(r["migrated_tokens"] for r in on) > 0, "no migration: the equivalence test would prove nothing"
    assert sum(r["token_straggler_after"] for r in on) < sum(r["token_straggler_before"] for r in on)
    assert all(r["tokens_before"] is None for r in off)  # disabled: DeepSpeed's own forward ran
    assert all(r["gemm_straggler_ms"] >= 0 for r in on + off)  # measured for both


def test_csv_monitor_received_the_feplb_events(train_moe_runs, csv_dir):
    on = train_moe_runs[0][True]
    files = {p.name: p for p in (csv_dir / "feplb").glob("FEPLB_moe_*.csv")}
    for metric in ("token_straggler_before", "token_straggler_after", "gemm_straggler_ms", "migrated_tokens",
                   "migrated_bytes", "plan_latency_us", "fallbacks", "weight_bytes", "weight_copies", "resident_hits",
                   "flushed_copies", "grad_bytes"):
        rows = (files.pop(f"FEPLB_moe_{metric}.csv")).read_text().split()
        assert rows[0] == f"step,{metric}" and len(rows) == 1 + STEPS, rows
        steps, values = zip(*(row.split(",") for row in rows[1:]))
        assert [int(s) for s in steps] == list(range(1, STEPS + 1))  # engine.global_steps after each step
        expected = [r["layers"]["moe"][metric] for r in on]
        assert [float(v) for v in values] == pytest.approx(expected, rel=1e-6, abs=1e-9)
    assert set(files) == {"FEPLB_moe_gemm_max_ms.csv"}
    assert [r["token_straggler_before"] for r in on] == [r["layers"]["moe"]["token_straggler_before"] for r in on]


@pytest.mark.skipif(os.environ.get("FEPLB_CLI_TESTS") != "1" or
                    not os.path.exists(os.path.join(os.path.dirname(sys.executable), "deepspeed")),
                    reason="about a minute on 2 cores: set FEPLB_CLI_TESTS=1 (needs the deepspeed launcher)")
def test_pipeline_example_runs_under_the_deepspeed_cli(tmp_path):
    before = set(os.listdir("/dev/shm"))
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    proc = subprocess.run([launcher, "--num_gpus", "4", "--master_port", str(free_port()),
                           str(EXAMPLES / "train_moe_pipe.py"), "--deepspeed_config",
                           str(EXAMPLES / "ds_config_pipe.json"), "--steps", "2", "--hidden", "32"],
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"step"')]
    assert [line["step"] for line in lines] == [0, 1]
    assert set(lines[0]["layers"]) == {"1.moe", "2.moe"}  # both stages' MoE layers reach rank 0
    assert all(line["micro_batches"] == 4 for line in lines)
    assert "FEPLB pipeline over 2 steps" in proc.stdout
    leaked = {n for n in set(os.listdir("/dev/shm")) - before if n.startswith(("feplb-", "deepspeed"))}
    assert not leaked, f"left in /dev/shm: {leaked}"


def test_train_moe_no_feplb_and_its_summary(capsys):
    """``--no-feplb`` turns the section off (the rest of the ds_config unchanged); the summary
    gives step time and tokens/s for both, the balance lines only with FEPLB."""
    sys.path.insert(0, str(EXAMPLES))
    import train_moe

    off = train_moe.feplb_off(str(EXAMPLES / "ds_config.json"))
    assert off["feplb"]["enabled"] is False and off["feplb"]["dynamic_experts_per_rank"] == 2
    assert off["optimizer"] == json.loads((EXAMPLES / "ds_config.json").read_text())["optimizer"]
    history = [{"step": i, "loss": 1.0, "step_ms": 10.0 + i, "tokens_before": None} for i in range(5)]
    train_moe.summarize(history, tokens_per_step=1000, feplb=False)
    out = capsys.readouterr().out
    assert "FEPLB off (DeepSpeed MoE): step time median 13.0 ms (steps 2..4)" in out
    assert "76,923 tokens/s" in out and "token straggler" not in out
