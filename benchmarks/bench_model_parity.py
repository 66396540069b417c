"""How far to trust the time model: train, record what the runtime did, replay its own plans.

For each case (ranks x layer size) this trains `examples/train_moe.py` on CPU ranks with
``feplb.stats.record_trace``, then sets the time model's predicted expert-stage makespan of each
recorded micro-batch (its own plan, `sim.measured`) beside the measured one, with the ``cpu``
profile's compute costs (measured now on this machine) and with the run's own fitted costs (as its
planner had them), over all micro-batches but the first and from micro-batch 20 on, and once
more with each micro-batch's own plan latency (when its plan came, not the previous one's: the
model's composition alone, without how well one plan latency foretells the next). Prints a
table and writes ``--out`` (JSON) with the load average.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_model_parity.py --out benchmarks/data/cpu_model_parity.json

The target (issue "the model is the runtime"): median |error| <= 15%, p90 <= 30%. Beside each case,
the same training with one batch repeated (the routing then stays put): the spread of its
measured makespans is the machine's own noise, the floor under any model's error on this machine.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = {  # name: (ranks, hidden, tokens per rank); 16 experts, top-2, ffn 4 x hidden (the example's)
    "ranks2-hidden64-tokens512": (2, 64, 512),
    "ranks2-hidden128-tokens1024": (2, 128, 1024),
    "ranks4-hidden64-tokens512": (4, 64, 512),
    "ranks4-hidden128-tokens1024": (4, 128, 1024),
}
WARM = 20  # micro-batches the scheduler process takes to load its compiled planner on this VM


def record(ranks: int, hidden: int, tokens: int, steps: int, folder: str, port: int, repeated: bool = False) -> str:
    """Train with a recorded trace; returns its path. ``repeated``: one batch over and over at a
    learning rate too small to change the routing (`train_repeated`), so every micro-batch does the
    same work and the spread of its times is the machine's."""
    with open(ROOT / "examples" / "ds_config.json") as f:
        config = json.load(f)
    name = f"r{ranks}_h{hidden}{'_repeated' if repeated else ''}"
    trace = os.path.join(folder, f"{name}.npz")
    config["feplb"]["stats"] = {"record_trace": trace}
    if repeated:
        config["optimizer"]["params"]["lr"] = 1e-7
    path = os.path.join(folder, f"{name}.json")
    with open(path, "w") as f:
        json.dump(config, f)
    script = [__file__, "--train-repeated"] if repeated else [str(ROOT / "examples" / "train_moe.py")]
    command = [str(ROOT / ".venv" / "bin" / "deepspeed"), "--num_gpus", str(ranks), "--master_port", str(port),
               *script, "--deepspeed_config", path, "--steps", str(steps), "--hidden", str(hidden), "--batch",
               str(tokens), "--progress"]
    subprocess.run(command, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return trace


def train_repeated(argv: list[str]) -> None:
    """`examples/train_moe.py` (run by the launcher) with its first batch repeated every step."""
    sys.path.insert(0, str(ROOT / "examples"))
    import train_moe

    fresh = train_moe.batches

    def same(data, batch, context, seed):
        first = next(fresh(data, batch, context, seed))
        while True:
            yield first
    train_moe.batches = same
    sys.argv = [str(ROOT / "examples" / "train_moe.py"), *argv]
    train_moe.main()


def spread(trace_path: str) -> dict:
    """The measured makespan's deviation from its own median from micro-batch `WARM` on: what a
    model that knew each micro-batch's typical time exactly would still be off by."""
    import numpy as np

    from deepspeed_feplb.trace.format import load_trace

    stage = load_trace(trace_path).stage_us[WARM:, 0]
    makespan = stage[..., 0].max(axis=1) + stage[..., 1].max(axis=1)  # as `sim.measured` takes it
    makespan = makespan[np.isfinite(makespan)]
    deviation = np.abs(makespan / np.median(makespan) - 1)
    return {"median_abs_rel_deviation": float(np.median(deviation)),
            "p90_abs_rel_deviation": float(np.percentile(deviation, 90)), "micro_batches": int(len(makespan))}


def compare(trace_path: str, ranks: int) -> dict:
    from deepspeed_feplb.migrate.shm import ShmTransport
    from deepspeed_feplb.plan.cost import ExpertShape
    from deepspeed_feplb.plan.timeline import TimeModel
    from deepspeed_feplb.sim.calibrate import calibrate_cpu
    from deepspeed_feplb.sim.measured import compare_measured, cpu_share
    from deepspeed_feplb.trace.format import load_trace

    trace = load_trace(trace_path)
    shape = ExpertShape(hidden=trace.hidden, ffn_hidden=trace.ffn_hidden, mats=2, dtype_bytes=4)  # fp32 MLP
    model = replace(TimeModel.of(shape, calibrate_cpu(shape)), message_us=ShmTransport.message_us)
    D = json.loads((ROOT / "examples" / "ds_config.json").read_text())["feplb"]["dynamic_experts_per_rank"]
    return {"cpu_share": cpu_share(trace, skip_steps=WARM),
            "profile_costs": compare_measured(trace, model, ranks, dynamic_experts=D),
            "recorded_costs": compare_measured(trace, model, ranks, recorded_costs=True, dynamic_experts=D),
            # the same once the scheduler process has loaded its planner
            f"recorded_costs_from_{WARM}": compare_measured(trace, model, ranks, skip_steps=WARM, recorded_costs=True,
                                                           dynamic_experts=D),
            # each micro-batch's plan when it came, not when the previous one's did: the model's composition alone
            "recorded_costs_own_plan": compare_measured(trace, model, ranks, recorded_costs=True, dynamic_experts=D,
                                                        own_plan_latency=True)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--cases", default=",".join(CASES), help="comma list of case names (default: all)")
    parser.add_argument("--port", type=int, default=29680)
    parser.add_argument("--out", help="JSON output")
    parser.add_argument("--no-floor", action="store_true", help="skip the repeated-batch runs (the noise floor)")
    parser.add_argument("--traces", help="keep the recorded traces in this folder (default: a temporary one)")
    args = parser.parse_args()
    chosen = [c.strip() for c in args.cases.split(",") if c.strip()]
    results, floors = {}, {}
    with tempfile.TemporaryDirectory(prefix="feplb-parity-") as scratch:
        folder = args.traces or scratch
        os.makedirs(folder, exist_ok=True)
        for i, name in enumerate(chosen):
            ranks, hidden, tokens = CASES[name]
            load_before = os.getloadavg()
            start = time.perf_counter()
            trace = record(ranks, hidden, tokens, args.steps, folder, args.port + 2 * i)
            results[name] = {**compare(trace, ranks), "seconds": round(time.perf_counter() - start, 1),
                             "load_before": load_before, "load_after": os.getloadavg()}
            row, late = results[name], results[name][f"recorded_costs_from_{WARM}"]
            print(f"{name}: profile costs median |error| {row['profile_costs']['median_abs_rel_error']:.1%} "
                  f"(p90 {row['profile_costs']['p90_abs_rel_error']:.1%}, signed "
                  f"{row['profile_costs']['median_rel_error']:+.1%}); the run's own costs "
                  f"{row['recorded_costs']['median_abs_rel_error']:.1%} (p90 "
                  f"{row['recorded_costs']['p90_abs_rel_error']:.1%}, signed "
                  f"{row['recorded_costs']['median_rel_error']:+.1%}; from micro-batch {WARM} "
                  f"{late['median_abs_rel_error']:.1%}, p90 {late['p90_abs_rel_error']:.1%}; each plan when it came "
                  f"{row['recorded_costs_own_plan']['median_abs_rel_error']:.1%}, p90 "
                  f"{row['recorded_costs_own_plan']['p90_abs_rel_error']:.1%}); "
                  f"a rank had {row['cpu_share']:.0%} of a core during its stage; load {load_before[0]:.1f}",
                  flush=True)
            if args.no_floor:
                continue
            load_before = os.getloadavg()
            floor = spread(record(ranks, hidden, tokens, args.steps, folder, args.port + 2 * i + 1, repeated=True))
            floors[name] = {**floor, "load_before": load_before, "load_after": os.getloadavg()}
            print(f"{name}, one batch repeated: the makespan's median |deviation| from its median "
                  f"{floor['median_abs_rel_deviation']:.1%}, p90 {floor['p90_abs_rel_deviation']:.1%}", flush=True)
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        with open(args.out, "w") as f:
            json.dump({"commit": commit, "steps": args.steps, "cases": results, "noise_floor": floors}, f, indent=1)
    return 0


if __name__ == "__main__":
    if "--train-repeated" in sys.argv:  # the launcher puts its own arguments first
        train_repeated([a for a in sys.argv[1:] if a != "--train-repeated"])
    else:
        sys.exit(main())
