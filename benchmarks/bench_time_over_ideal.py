"""Expert time over a perfectly balanced layer, simulated at the defaults on recorded and generated traces.

    python benchmarks/bench_time_over_ideal.py [--json benchmarks/data/sim_time_over_ideal.json]

Runs ``simulate`` (the time model, not a measurement), every option of FEPLB at its default (the
runtime's), GLM-5-like experts (hidden 6144, ffn 2048), 8 micro-batches per step, on

* the shipped recorded traces (``stdlib_moe_ep8_{4k,32k}.npz``: 64 experts top-8, 8 source ranks,
  4,096 / 32,768 rows per rank), as one node of 8 and as 2 nodes of 4, and the 2-node cases once
  more with the cross-node placement layer on and no replica slot (``--placement on
  --redundant-per-rank 0``: opt-in in the runtime);
* generated traces nobody tuned for (``trace --kind noaux``, its default skew, seed 7, 48
  micro-batches, 256 experts top-8): EP 8 in one node at 2,048 and 32,768 rows per rank (32 local
  experts a rank, against the recorded traces' 8), EP 16 as 2 nodes of 8 at 2,048 and 16,384, EP 64
  as 8 nodes of 8 at 4,096 and 32,768, the EP 64 cases once more with the placement layer and one
  replica slot per rank (``--placement on --redundant-per-rank 1``).

Every case that spans nodes runs twice: without a replica slot (``--redundant-per-rank 0``, the
plain names: no cross-node layer, the runtime's defaults before 2026-12-07) and with one replica
slot per rank and every expert kept at its home (``--placement off --redundant-per-rank 1``,
``_replicas_alone``: the runtime's defaults since, ``redundant_experts_per_rank: "auto"`` where
the slots fit in memory, and the best configuration across nodes we know).

``--extra '--dynamic-experts 3'`` (any `simulate` options) runs every case with them added: a variant
of the defaults, side by side with a run without.

Per policy it keeps the token max/mean, the expert time, the ideal (vanilla's compute spread evenly
over the EP group, no transfers), their ratio and the excess split into extra pieces, imbalance
left, exposed copies and the rest, and the ratio by position in the optimizer step (`simulate`'s
JSON); ``feplb_one_part`` is FEPLB with ``--serve-parts 1`` (each helper returns a home's results in
one message, as before 2026-12-06).
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
COMMAND = ("python -m deepspeed_feplb simulate --trace TRACE --ranks-per-node G --nodes N --hidden 6144 "
           "--ffn-hidden 2048 --micro-batches-per-step 8 --policies feplb,eplb --json OUT.json [--placement on|off] "
           "[--redundant-per-rank 0|1] (every other option at its default; feplb_one_part: the feplb row of the same "
           "with --serve-parts 1); "
           "generated TRACE: python -m deepspeed_feplb trace --out T.npz --kind noaux --ranks R --experts 256 "
           "--tokens-per-rank ROWS --micro-batches 48 --layers 1 --top-k 8 --seed 7")
NO_REPLICA = ("--redundant-per-rank", "0")  # no cross-node layer: the defaults before replica slots were "auto"
PLACEMENT = ("--placement", "on", *NO_REPLICA)  # homes move between nodes, opt-in in the runtime
REPLICA = ("--placement", "on", "--redundant-per-rank", "1")  # and one replica slot per rank
REPLICAS_ALONE = ("--placement", "off", "--redundant-per-rank", "1")  # one slot per rank, every home kept: the defaults
# name: (trace: a shipped file or (ranks, rows per rank) generated, ranks per node, nodes, options beyond the defaults)
CASES = {"ep8_4k": ("stdlib_moe_ep8_4k.npz", 8, 1, ()), "ep8_32k": ("stdlib_moe_ep8_32k.npz", 8, 1, ()),
         "ep8_2nodes_4k": ("stdlib_moe_ep8_4k.npz", 4, 2, NO_REPLICA),
         "ep8_2nodes_32k": ("stdlib_moe_ep8_32k.npz", 4, 2, NO_REPLICA),
         "ep8_2nodes_4k_placement": ("stdlib_moe_ep8_4k.npz", 4, 2, PLACEMENT),
         "ep8_2nodes_32k_placement": ("stdlib_moe_ep8_32k.npz", 4, 2, PLACEMENT),
         "generated_ep8_2k": ((8, 2048), 8, 1, ()), "generated_ep8_32k": ((8, 32768), 8, 1, ()),
         "generated_ep16_2k": ((16, 2048), 8, 2, NO_REPLICA), "generated_ep16_16k": ((16, 16384), 8, 2, NO_REPLICA),
         "generated_ep64_4k": ((64, 4096), 8, 8, NO_REPLICA), "generated_ep64_32k": ((64, 32768), 8, 8, NO_REPLICA),
         "generated_ep64_4k_replica": ((64, 4096), 8, 8, REPLICA),
         "generated_ep64_32k_replica": ((64, 32768), 8, 8, REPLICA),
         "ep8_2nodes_4k_replicas_alone": ("stdlib_moe_ep8_4k.npz", 4, 2, REPLICAS_ALONE),
         "ep8_2nodes_32k_replicas_alone": ("stdlib_moe_ep8_32k.npz", 4, 2, REPLICAS_ALONE),
         "generated_ep16_2k_replicas_alone": ((16, 2048), 8, 2, REPLICAS_ALONE),
         "generated_ep16_16k_replicas_alone": ((16, 16384), 8, 2, REPLICAS_ALONE),
         "generated_ep64_4k_replicas_alone": ((64, 4096), 8, 8, REPLICAS_ALONE),
         "generated_ep64_32k_replicas_alone": ((64, 32768), 8, 8, REPLICAS_ALONE)}
EXTRA: list = []  # --extra: options added to every case (a variant of the defaults)
KEYS = ("token_max_over_mean", "expert_time_us", "ideal_time_us", "time_over_ideal", "excess_pieces_us",
        "excess_imbalance_us", "copy_exposed_us", "excess_other_us", "time_over_ideal_by_step_position")


def _cli(argv: list) -> None:
    from deepspeed_feplb.__main__ import main

    with contextlib.redirect_stdout(io.StringIO()):
        if main(argv) != 0:
            raise RuntimeError(f"failed: {argv}")


def _trace(trace, tmp: str) -> str:
    if isinstance(trace, str):
        return os.path.join(ROOT, "deepspeed_feplb", "trace", "data", trace)
    ranks, rows = trace
    path = os.path.join(tmp, f"noaux_{ranks}_{rows}.npz")
    _cli(["trace", "--out", path, "--kind", "noaux", "--ranks", str(ranks), "--experts", "256", "--tokens-per-rank",
          str(rows), "--micro-batches", "48", "--layers", "1", "--top-k", "8", "--seed", "7"])
    return path


def _simulate(path: str, ranks_per_node: int, nodes: int, options: tuple, tmp: str, *extra: str) -> dict:
    out = os.path.join(tmp, "out.json")
    _cli(["simulate", "--trace", path, "--ranks-per-node", str(ranks_per_node), "--nodes", str(nodes), "--hidden",
          "6144", "--ffn-hidden", "2048", "--micro-batches-per-step", "8", "--policies", "feplb,eplb", "--json", out,
          "--no-progress", *options, *EXTRA, *extra])
    with open(out) as f:
        return {name: {k: _rounded(p[k]) for k in KEYS if k in p} for name, p in json.load(f)["policies"].items()}


def _rounded(value):
    return [round(float(v), 4) for v in value] if isinstance(value, list) else round(float(value), 4)


def run_case(trace, ranks_per_node: int, nodes: int, options: tuple) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = _trace(trace, tmp)
        policies = _simulate(path, ranks_per_node, nodes, options, tmp)
        policies["feplb_one_part"] = _simulate(path, ranks_per_node, nodes, options, tmp, "--serve-parts",
                                               "1")["feplb"]
    return {"trace": trace if isinstance(trace, str) else f"generated noaux, {trace[0]} ranks, {trace[1]} rows",
            "ranks_per_node": ranks_per_node, "nodes": nodes, "placement": tuple(options[:2]) == PLACEMENT[:2],
            "options": " ".join(options), "policies": policies}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="OUT", help="also write the results here")
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    parser.add_argument("--extra", default="", help="simulate options added to every case, e.g. "
                        "'--dynamic-experts 3' (default: none: the defaults)")
    args = parser.parse_args(argv)
    EXTRA[:] = args.extra.split()
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    result = {"command": COMMAND, "commit": commit,
              "note": "simulated (time model), not measured; ideal = vanilla's compute spread evenly over the EP "
                      "group, no transfers", "cases": {}}
    names = args.cases.split(",") if args.cases else list(CASES)
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    print("| case | policy | max/mean | time / ideal | pieces | imbalance | exposed copies | other |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name in names:
        result["cases"][name] = run_case(*CASES[name])
        for policy, p in result["cases"][name]["policies"].items():
            print(f"| {name} | {policy} | {p['token_max_over_mean']:.3f} | {p['time_over_ideal']:.3f} | "
                  f"{p['excess_pieces_us']:.0f} | {p['excess_imbalance_us']:.0f} | {p['copy_exposed_us']:.0f} | "
                  f"{p['excess_other_us']:.0f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
