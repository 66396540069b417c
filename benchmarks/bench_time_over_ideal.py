"""Expert time over a perfectly balanced layer, simulated on the recorded traces at the defaults.

    python benchmarks/bench_time_over_ideal.py [--json benchmarks/data/sim_time_over_ideal.json]

Runs ``simulate`` (the time model, not a measurement) on the shipped recorded traces
(``stdlib_moe_ep8_{4k,32k}.npz``: 64 experts top-8, 8 source ranks, 4,096 / 32,768 rows per rank)
priced as GLM-5-like experts, 8 micro-batches per step, every option of FEPLB at its default
(the runtime's), as one node of 8 and as 2 nodes of 4, and the 2-node cases once more with the
cross-node placement layer on (``--placement on``: opt-in in the runtime). Per policy it keeps
the token max/mean, the expert time, the ideal (vanilla's compute spread evenly over the EP group,
no transfers), their ratio and FEPLB's excess split into extra pieces, imbalance left, exposed
weight copies and the rest (`simulate`'s JSON).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMAND = ("python -m deepspeed_feplb simulate --trace deepspeed_feplb/trace/data/TRACE --ranks-per-node G --nodes N "
           "--hidden 6144 --ffn-hidden 2048 --micro-batches-per-step 8 --policies feplb,eplb --json OUT.json "
           "[--placement on] (every other option at its default)")
CASES = {"ep8_4k": ("stdlib_moe_ep8_4k.npz", 8, 1, False), "ep8_32k": ("stdlib_moe_ep8_32k.npz", 8, 1, False),
         "ep8_2nodes_4k": ("stdlib_moe_ep8_4k.npz", 4, 2, False),
         "ep8_2nodes_32k": ("stdlib_moe_ep8_32k.npz", 4, 2, False),
         "ep8_2nodes_4k_placement": ("stdlib_moe_ep8_4k.npz", 4, 2, True),
         "ep8_2nodes_32k_placement": ("stdlib_moe_ep8_32k.npz", 4, 2, True)}
KEYS = ("token_max_over_mean", "expert_time_us", "ideal_time_us", "time_over_ideal", "excess_pieces_us",
        "excess_imbalance_us", "copy_exposed_us", "excess_other_us")


def run_case(trace: str, ranks_per_node: int, nodes: int, placement: bool) -> dict:
    from deepspeed_feplb.__main__ import main

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        argv = ["simulate", "--trace", os.path.join(ROOT, "deepspeed_feplb", "trace", "data", trace),
                "--ranks-per-node", str(ranks_per_node), "--nodes", str(nodes), "--hidden", "6144",
                "--ffn-hidden", "2048", "--micro-batches-per-step", "8", "--policies", "feplb,eplb", "--json", out,
                "--no-progress", *(["--placement", "on"] if placement else [])]
        with contextlib.redirect_stdout(io.StringIO()):
            if main(argv) != 0:
                raise RuntimeError(f"simulate failed: {argv}")
        with open(out) as f:
            doc = json.load(f)
    return {"trace": trace, "ranks_per_node": ranks_per_node, "nodes": nodes, "placement": placement,
            "policies": {name: {k: round(float(p[k]), 4) for k in KEYS} for name, p in doc["policies"].items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="OUT", help="also write the results here")
    args = parser.parse_args(argv)
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    result = {"command": COMMAND, "commit": commit,
              "note": "simulated (time model), not measured; ideal = vanilla's compute spread evenly over the EP "
                      "group, no transfers", "cases": {}}
    print("| case | policy | max/mean | time / ideal | pieces | imbalance | exposed copies | other |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, case in CASES.items():
        result["cases"][name] = run_case(*case)
        for policy, p in result["cases"][name]["policies"].items():
            print(f"| {name} | {policy} | {p['token_max_over_mean']:.3f} | {p['time_over_ideal']:.3f} | "
                  f"{p['excess_pieces_us']:.0f} | {p['excess_imbalance_us']:.0f} | {p['copy_exposed_us']:.0f} | "
                  f"{p['excess_other_us']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
