"""Replicas of hot experts across nodes, simulated: feplb with 0, 1 and 2 replica slots per rank
against EPLB, at EP 64 (8 x 8) and EP 16 (2 x 8).

    .venv/bin/python benchmarks/bench_replicas.py --out benchmarks/data/replicas_sim.json

Every case is one ``python -m deepspeed_feplb simulate`` command (printed as it runs), on seeded
generated traces (``python -m deepspeed_feplb trace``, written to a temporary folder) and on the
two shipped recordings replayed on 16 ranks (``--merge-sources``: their rows per rank halve). D = 4,
up to 7 helpers per expert (the default since 2026-12-03; JSONs of earlier commits used 2),
8 micro-batches per optimizer step, GLM-5-like experts (6144 x 2048 SwiGLU), the h100 profile
(inter-node 50 GB/s per rank, 370 GB/s inside a node); the replicas' exchange (fp32 gradient
sums home, weights back, relayed over every link of the two nodes) is in the expert time. The
simulator is deterministic: the figures do not depend on the machine's load, only its wall time.
Then `scale`: how long a replica decision and one micro-batch's split take at EP 16, 64 and 256;
``--scale-only`` runs that part alone (a decision is made at every optimizer step, per layer):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_replicas.py --scale-only \
        --out benchmarks/data/cpu_replica_decision.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(ROOT, "deepspeed_feplb", "trace", "data")

# name -> (trace generator arguments or a shipped file, ranks per node, nodes)
CASES = {
    "EP64 no-aux 32k": (["--kind", "noaux", "--ranks", "64", "--experts", "256", "--tokens-per-rank", "4096"], 8, 8),
    "EP64 no-aux 4k": (["--kind", "noaux", "--ranks", "64", "--experts", "256", "--tokens-per-rank", "512"], 8, 8),
    "EP64 zipf 32k": (["--kind", "zipf", "--ranks", "64", "--experts", "256", "--tokens-per-rank", "4096"], 8, 8),
    "EP16 no-aux 16k": (["--kind", "noaux", "--ranks", "16", "--experts", "128", "--tokens-per-rank", "2048"], 8, 2),
    "EP16 biased 16k": (["--kind", "biased", "--ranks", "16", "--experts", "128", "--tokens-per-rank", "2048"], 8, 2),
    "EP16 recorded 2k": ("stdlib_moe_ep8_4k.npz", 8, 2),
    "EP16 recorded 16k": ("stdlib_moe_ep8_32k.npz", 8, 2),
}
TRACE_STEPS = {"EP64": "64", "EP16": "96"}


def _run(cmd: list[str]) -> None:
    print(" ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--slots", default="0,1,2", help="replica slots per rank to compare (default: %(default)s)")
    parser.add_argument("--scale-only", action="store_true", help="time a decision and a split only (no simulation)")
    parser.add_argument("--max-rows-over-mean", default=None, metavar="RATIO",
                        help="feplb's bound on rows before time (`feplb.max_rows_over_mean`), passed to every "
                             "simulate command (default: none, time alone)")
    args = parser.parse_args()
    slots = [int(s) for s in args.slots.split(",")]
    py = [sys.executable, "-m"]
    cap = ["--max-rows-over-mean", args.max_rows_over_mean] if args.max_rows_over_mean else []
    results: dict = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for name, (source, G, N) in ({} if args.scale_only else CASES).items():
            extra = []
            if isinstance(source, str):
                trace, extra = os.path.join(SHIPPED, source), ["--merge-sources"]
            else:
                trace = os.path.join(tmp, name.replace(" ", "_") + ".npz")
                _run(py + ["deepspeed_feplb", "trace", "--out", trace, *source, "--steps", TRACE_STEPS[name[:4]],
                           "--layers", "1", "--top-k", "8", "--seed", "3" if name.startswith("EP64") else "1"])
            for r in slots:
                out = os.path.join(tmp, "out.json")
                _run(py + ["deepspeed_feplb", "simulate", "--trace", trace, "--ranks-per-node", str(G),
                           "--nodes", str(N), "--dynamic-experts", "4", "--max-helpers", "7",
                           "--policies", "vanilla,eplb,feplb",
                           "--hidden", "6144", "--ffn-hidden", "2048", "--micro-batches-per-step", "8",
                           "--redundant-per-rank", str(r), "--no-progress", "--json", out, *cap, *extra])
                with open(out) as f:
                    policies = json.load(f)["policies"]
                eplb, feplb = policies["eplb"], policies["feplb"]
                results.setdefault(name, {})[r] = {
                    "eplb": {k: eplb[k] for k in ("token_max_over_mean", "token_straggler", "expert_time_us")},
                    "feplb": {k: feplb.get(k, 0) for k in ("token_max_over_mean", "token_straggler", "expert_time_us",
                                                           "replicas", "replica_exchange_us")}}
    timing = scale()
    print(f"\n{time.perf_counter() - start:.0f} s; load average {os.getloadavg()[0]:.2f}\n")
    if results:
        print("| case | slots | feplb max/mean | straggler vs EPLB | expert time µs | vs EPLB | replicas at end |")
        print("|---|---:|---:|---:|---:|---:|---:|")
    for name, per in results.items():
        for r, res in per.items():
            e, f = res["eplb"], res["feplb"]
            lower = e["token_straggler"] / f["token_straggler"]
            print(f"| {name} | {r} | {f['token_max_over_mean']:.3f} | {lower:.1f}x lower | "
                  f"{f['expert_time_us']:,.0f} | {f['expert_time_us'] / e['expert_time_us']:.3f}x | {f['replicas']} |")
    with open(args.out, "w") as f:
        json.dump({"cases": results, "max_rows_over_mean": args.max_rows_over_mean, "scale": timing,
                   "load_average": os.getloadavg()[0], "commit": _commit()}, f, indent=1)
    return 0


def scale() -> dict:
    """Wall time of a replica decision (`replicas.choose`, on 16 micro-batches; median of 3) and of
    one micro-batch's split (`replicas.route`; median of 5) at EP 16 (128 experts), EP 64 (256)
    and EP 256 (512), nodes of 8, one replica slot per rank, 32k rows per rank of Zipf(1.3)
    popularity that drifts per micro-batch; the compiled calls loaded first (`load_split`), as a
    layer with replica slots does when it attaches."""
    import numpy as np

    from deepspeed_feplb.plan import replicas

    replicas.load_split()
    out = {}
    for G, N, E in ((8, 2, 128), (8, 8, 256), (8, 32, 512)):
        R = G * N
        rng = np.random.default_rng(0)
        popularity = rng.zipf(1.3, E).astype(float)
        popularity /= popularity.sum()
        samples = np.stack([rng.multinomial(R * 32768, rng.dirichlet(popularity * 200 + 1e-3))
                            for _ in range(16)]).astype(float)
        expert_to_rank = np.arange(E) // (E // R)
        decisions = []
        for _ in range(3):
            start = time.perf_counter()
            choice = replicas.choose(samples, expert_to_rank, G, 1, 4, 0.5, 8, 75.5e6, 50.0, grad_bytes=151e6,
                                     intra_gbps=370.0)
            decisions.append(time.perf_counter() - start)
        decide_s = float(np.median(decisions))
        slots = replicas.slot_experts(expert_to_rank, choice.replica_at)
        src = rng.multinomial(32768, popularity, size=R)
        splits = []
        for _ in range(5):
            start = time.perf_counter()
            replicas.route(src, slots, G, E // R)
            splits.append(time.perf_counter() - start)
        out[f"EP{R}"] = {"experts": E, "decision_s": decide_s, "replicas": int((choice.replica_at >= 0).sum()),
                         "route_ms": float(np.median(splits)) * 1e3}
        print(f"EP {R}, {E} experts: decision {decide_s:.3f} s ({out[f'EP{R}']['replicas']} replicas), "
              f"one micro-batch's split {out[f'EP{R}']['route_ms']:.1f} ms", flush=True)
    return out


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
