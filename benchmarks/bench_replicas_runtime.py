"""Replica slots in a real training run on CPU: 2 gloo ranks as 2 nodes of one rank each.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_replicas_runtime.py [--steps 40] [--repeat 3] [--json OUT]

``make run``'s training (``examples/train_moe.py``: 16 experts top-2, hidden 64, 512 tokens per
rank, no auxiliary loss, so routing skews towards one rank's experts as the router learns) through
the ``deepspeed`` CLI, three ways, alternated ``--repeat`` times:

* ``replicas``: ``feplb.nvlink_domain_size`` 1 (each rank its own node: no phase 2) and
  ``placement.redundant_experts_per_rank`` 1 with placement off: hot experts of one rank get a
  replica on the other, every expert keeps its home;
* ``no replica``: the same without the replica slot;
* ``DeepSpeed``: ``--no-feplb``, DeepSpeed's MoE.

Each rank has a core of its own, so the busier rank sets the step time, as on GPUs. Per run: the
median step time (after the example's warm-up steps), rank 0's mean rows per step (its experts'
routes; the mean over both ranks is 1,024) and the 1-minute load average at its start. A CPU
measurement, not a GPU one: gloo's exchange and the time model's pricing of it (at
``placement.network_gbps``) differ from a GPU node's.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {"replicas": {"nvlink_domain_size": 1, "placement": {"redundant_experts_per_rank": 1}},
            "no replica": {"nvlink_domain_size": 1, "placement": {"redundant_experts_per_rank": 0}}, "DeepSpeed": None}


def _config(tmp: str, name: str, feplb: dict | None) -> str:
    with open(os.path.join(ROOT, "examples", "ds_config.json")) as f:
        config = json.load(f)
    config["feplb"].update(feplb or {})
    path = os.path.join(tmp, name.replace(" ", "_") + ".json")
    with open(path, "w") as f:
        json.dump(config, f)
    return path


def run_once(config: str, steps: int, feplb: bool, port: int) -> dict:
    """One training through the deepspeed CLI; its summary's figures."""
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    command = [deepspeed, "--num_gpus", "2", "--master_port", str(port), os.path.join(ROOT, "examples", "train_moe.py"),
               "--deepspeed_config", config, "--steps", str(steps)] + ([] if feplb else ["--no-feplb"])
    load = os.getloadavg()[0]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                         timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    step_ms = float(re.search(r"step time median ([0-9.]+) ms", out.stdout).group(1))
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{") and '"step"' in line]
    rows = [r["tokens_before"][0] for r in records if r.get("tokens_before")]
    replicas = [r["layers"]["moe"].get("placement_replicas", 0) for r in records if (r.get("layers") or {}).get("moe")]
    return {"step_ms_median": step_ms, "load_average": round(load, 2),
            "rank0_rows_mean": round(statistics.mean(rows), 1) if rows else None,
            "replicas_held_last_step": replicas[-1] if replicas else None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--port", type=int, default=29741)
    parser.add_argument("--json", metavar="OUT", help="also write the results here")
    args = parser.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    result = {"command": f"OMP_NUM_THREADS=1 python benchmarks/bench_replicas_runtime.py --steps {args.steps} "
                         f"--repeat {args.repeat}", "commit": commit, "machine": f"{os.cpu_count()} cores",
              "order": "replicas, no replica, DeepSpeed, repeated", "variants": {name: [] for name in VARIANTS}}
    with tempfile.TemporaryDirectory() as tmp:
        configs = {name: _config(tmp, name, feplb) for name, feplb in VARIANTS.items()}
        for _ in range(args.repeat):
            for name, feplb in VARIANTS.items():
                run = run_once(configs[name], args.steps, feplb is not None, args.port)
                result["variants"][name].append(run)
                print(name, run, flush=True)
    medians = {name: round(statistics.median(r["step_ms_median"] for r in runs), 2)
               for name, runs in result["variants"].items()}
    result["median_step_ms"] = medians
    result["replicas_over_no_replica"] = round(medians["replicas"] / medians["no replica"], 3)
    result["replicas_over_deepspeed"] = round(medians["replicas"] / medians["DeepSpeed"], 3)
    print(json.dumps({k: result[k] for k in ("median_step_ms", "replicas_over_no_replica", "replicas_over_deepspeed")}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
