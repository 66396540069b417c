"""The examples: FEPLB on and off give the same loss curve; their JSON lines are what `report`
reads, with the monitor's steps; train_hf_moe.py takes the user's ds_config; a checkpoint
round trip; the pipeline example runs under the deepspeed CLI."""
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
    config["feplb"] = {**copy.deepcopy(config["feplb"]), "enabled": enabled, "scheduler": {"mode": "inline"},
                       "fixed_costs": "ignore"}  # moves pay at these toy sizes, so the tests exercise phase 2
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
    layer = [r["layers"]["moe"] for r in on]
    assert sum(m["migrated_tokens"] for m in layer) > 0, "no migration: the equivalence test would prove nothing"
    assert sum(m["token_straggler_after"] for m in layer) < sum(m["token_straggler_before"] for m in layer)
    assert all(sum(r["tokens_after"]) == sum(r["tokens_before"]) for r in on)  # rows move, none is lost
    assert all(r["tokens_before"] is None for r in off)  # disabled: DeepSpeed's own forward ran
    assert all(r["layers"]["moe"]["gemm_straggler_ms"] >= 0 for r in on + off)  # measured for both


def test_train_moe_lines_hold_each_number_once(train_moe_runs):
    """One copy of the stats: ``layers`` (the monitor summary) and the step's rows per rank; no
    per-layer numbers repeated at the top level."""
    for record in train_moe_runs[0][True]:
        assert set(record) == {"step", "loss", "step_ms", "tokens", "tokens_before", "tokens_after", "layers"}, \
            sorted(record)
        assert set(record["layers"]) == {"moe"}


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
        assert [r["step"] for r in on] == [int(s) for s in steps]  # the JSON lines count the same steps
        expected = [r["layers"]["moe"][metric] for r in on]  # floats rounded to 3 decimals in the lines
        assert [float(v) for v in values] == pytest.approx(expected, rel=1e-6, abs=1e-3)
    assert set(files) == {"FEPLB_moe_gemm_max_ms.csv"}


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
    assert [line["step"] for line in lines] == [1, 2]  # the engine's global step, as DeepSpeed's monitor counts
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


def test_progress_bar_replaces_the_json_lines():
    sys.path.insert(0, str(EXAMPLES))
    import train_moe

    lines = []
    train_moe.log_line(lines.append, "{}", bar=object())  # --progress: the bar is drawn instead
    assert lines == []
    train_moe.log_line(lines.append, "{}", bar=None)
    assert lines == ["{}"]


def test_train_moe_summary_uses_the_means_of_report(tmp_path, capsys):
    """The end summary prints the token and GEMM stragglers as the mean over steps, the numbers
    `report` computes from the same lines."""
    sys.path.insert(0, str(EXAMPLES))
    from deepspeed_feplb.report import read_jsonl, summary

    import train_moe

    gemm = [0.5, 0.5, 0.5, 3.5]  # median 0.5, mean 1.25: tells the two apart
    history = [{"step": i + 1, "loss": 2.0, "step_ms": 10.0, "tokens_before": [30, 10], "tokens_after": [20, 20],
                "layers": {"moe": {"token_straggler_before": 10.0 + i, "token_straggler_after": 1.0,
                                   "gemm_straggler_ms": g}}} for i, g in enumerate(gemm)]
    log = tmp_path / "run.log"
    log.write_text("".join(json.dumps(h) + "\n" for h in history))
    means = summary(read_jsonl(log)[0])["moe"]
    train_moe.summarize(history, tokens_per_step=1000)
    out = capsys.readouterr().out
    assert f"{means['gemm_straggler_ms_mean']:.2f} ms per step, mean over steps" in out, out
    assert "1.25 ms per step" in out and "0.50 ms" not in out
    assert (f"token straggler (max-mean): {means['token_straggler_before_mean']:.1f} -> "
            f"{means['token_straggler_after_mean']:.1f}") in out, out
    assert "(steps 3..4)" in out  # the steps as the lines number them
    assert "scheduler process (feplb-sched): did not serve in this run" in out  # said, not left out


def test_the_scheduler_cpu_counts_every_process_that_served_and_never_goes_negative():
    import os
    import subprocess
    import sys
    import time

    import train_moe
    cpu = train_moe.SchedulerCPU()
    assert cpu.percent() is None
    first = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # a busy stand-in for feplb-sched
    try:
        cpu.sample(first.pid)
        time.sleep(0.3)
        cpu.sample(first.pid)
    finally:
        first.kill()
        first.wait()
    cpu.sample(first.pid)  # gone: /proc has nothing, its last sample stands
    cpu.sample(os.getpid())  # "restarted": a new pid counts from its own start
    assert 0 < cpu.used[first.pid] and cpu.used[os.getpid()] > 0 and cpu.percent() > 0


# ---------------------------------------------------------------- train_hf_moe.py

def _hf_example():
    sys.path.insert(0, str(EXAMPLES))
    import train_hf_moe

    return train_hf_moe


def _hf_args(*argv: str):
    return _hf_example().build_parser().parse_args(list(argv))


USER_CONFIG = {  # no optimizer, no "expert_parallel": the example adds them; its own "feplb" section
    "train_micro_batch_size_per_gpu": 2,
    "steps_per_print": 1000,
    # fixed_costs "ignore": at these toy sizes no move would pay, and the AutoEP layers skip balancing
    # where none pays (as the DeepSpeed-MoE layer does); this test needs moves to read them back
    "feplb": {"enabled": True, "dynamic_experts_per_rank": 1, "chunk_align_tokens": 8, "scheduler": {"mode": "inline"},
              "fixed_costs": "ignore"},
}


def test_train_hf_moe_reads_the_users_ds_config(tmp_path):
    pytest.importorskip("transformers")
    train_hf_moe = _hf_example()
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({**USER_CONFIG, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                "expert_parallel": {"autoep_size": 1}}))
    config = train_hf_moe.ds_config(_hf_args("--deepspeed_config", str(path), "--model", "qwen3_moe"), world=2)
    assert config["feplb"] == USER_CONFIG["feplb"]  # the user's section, untouched
    assert config["optimizer"]["type"] == "SGD" and config["train_micro_batch_size_per_gpu"] == 2  # the file wins
    assert config["expert_parallel"] == {"enabled": True, "autoep_size": 1, "preset_model": "qwen3_moe"}
    assert "zero_optimization" not in config  # --zero not given: the file's (none)
    assert train_hf_moe.ds_config(_hf_args("--deepspeed_config", str(path), "--zero", "2"), 2)["zero_optimization"] == \
        {"stage": 2}
    without = train_hf_moe.ds_config(_hf_args("--deepspeed_config", str(path), "--no-feplb"), 2)
    assert without["feplb"]["enabled"] is False

    path.write_text(json.dumps({"feplb": {"enabled": True}}))  # nothing else: what AutoEP and the example need is added
    config = train_hf_moe.ds_config(_hf_args("--deepspeed_config", str(path), "--batch", "3"), world=2)
    assert config["train_micro_batch_size_per_gpu"] == 3 and config["optimizer"] == train_hf_moe.OPTIMIZER
    assert config["expert_parallel"] == {"enabled": True, "autoep_size": 2, "preset_model": "mixtral"}
    assert config["feplb"] == {"enabled": True}

    builtin = train_hf_moe.ds_config(_hf_args(), world=2)  # no --deepspeed_config: the built-in one
    assert builtin["zero_optimization"] == {"stage": 1} and builtin["feplb"]["dynamic_experts_per_rank"] == 2


def train_hf_moe_with_config(config_path: str, log_path: str) -> dict:
    import torch.distributed as dist

    from deepspeed_feplb.integration.autoep import autoep_layers

    train_hf_moe = _hf_example()
    args = _hf_args("--deepspeed_config", config_path, "--steps", "3", "--hidden", "32", "--seq", "16")
    lines = []
    history, engine = train_hf_moe.train(args, log=lines.append)
    if dist.get_rank() == 0:
        with open(log_path, "w") as f:
            f.write("a line of DeepSpeed's own output\n" + "".join(line + "\n" for line in lines))
    layers = autoep_layers(engine.module)
    return {"history": history, "logged": len(lines),
            "dynamic": [layer.experts.feplb_config.dynamic_experts_per_rank for layer in layers.values()]}


def test_train_hf_moe_without_transformers_says_what_to_install_in_one_line(tmp_path):
    blocked = tmp_path / "transformers"
    blocked.mkdir()
    (blocked / "__init__.py").write_text("raise ImportError('transformers is not installed here')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    done = subprocess.run([sys.executable, str(EXAMPLES / "train_hf_moe.py")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == ("train_hf_moe.py needs Hugging Face transformers (>=5.0,<5.23): "
                                                     "pip install -e '.[hf]'"), done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_train_hf_moe_runs_with_a_deepspeed_config_and_report_reads_its_lines(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("deepspeed.module_inject.auto_ep_layer")
    from deepspeed_feplb.report import read_jsonl

    config, log = tmp_path / "ds_config.json", tmp_path / "run.log"
    config.write_text(json.dumps(USER_CONFIG))
    results = run_distributed(train_hf_moe_with_config, 2, str(config), str(log), timeout=240)
    assert [r["logged"] for r in results] == [3, 0]  # rank 0 prints
    assert all(r["dynamic"] == [1, 1] for r in results)  # the user's "feplb" section reached both AutoEP layers
    series, loss = read_jsonl(log)
    layers = {"model.layers.0.mlp", "model.layers.1.mlp"}
    assert set(series) == layers, series
    assert sorted(loss) == [1, 2, 3]  # the engine's global steps, as DeepSpeed's monitor counts them
    for name in layers:
        before, after = series[name]["token_straggler_before"], series[name]["token_straggler_after"]
        assert [s for s, _ in before] == [1, 2, 3]
        assert all(a <= b for (_, a), (_, b) in zip(after, before)), (before, after)
    assert sum(v for name in layers for _, v in series[name]["migrated_tokens"]) > 0, "nothing to balance: vacuous"


# ---------------------------------------------------------------- checkpoint_moe.py

def checkpoint_round_trip(checkpoint_dir: str) -> dict:
    sys.path.insert(0, str(EXAMPLES))
    import checkpoint_moe

    args = Namespace(steps=3, check_steps=2, hidden=32, experts=8, top_k=2, context=8, batch=128)
    return checkpoint_moe.round_trip(args, _config("ds_config.json", True), checkpoint_dir, log=None)


def test_checkpoint_round_trip_with_and_without_feplb(tmp_path):
    results = run_distributed(checkpoint_round_trip, 2, str(tmp_path / "checkpoints"), timeout=240)
    for rank, losses in enumerate(results):
        assert len(losses["saved"]) == 2
        for name in ("deepspeed", "feplb"):
            assert losses[name] == pytest.approx(losses["saved"], rel=TOLERANCE), f"rank {rank} {name}: {losses}"
        # the comparison can fail: the same engine without the checkpoint computes another loss
        assert abs(losses["fresh"] - losses["saved"][0]) > 1e-3 * losses["saved"][0], losses
        assert "deepspeed_moe.experts.deepspeed_experts.0.0.weight" in losses["keys"]  # DeepSpeed's own names
    assert list((tmp_path / "checkpoints").glob("global_step3/layer_0_expert_*_mp_rank_00_model_states.pt"))
