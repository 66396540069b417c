"""FEPLB's MoE layer vs DeepSpeed's MoE on 2 CPU ranks under no-aux routing skew, side by side.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_layer.py [--json OUT.json]

Four layers with the same weights and the same skewed gate (no auxiliary loss; the first rank's
experts are the hottest), stepped round-robin so machine noise hits all alike:

* ``deepspeed dropless``: `deepspeed.moe.layer.MoE(drop_tokens=False)` (capacity = the largest
  expert load over the EP group: every expert is padded to it);
* ``deepspeed cap1.0``:   `deepspeed.moe.layer.MoE(drop_tokens=True, capacity_factor=1.0)`;
* ``feplb off (D=0)``:    `deepspeed_feplb.MoE` with balancing off (dropless, no padding);
* ``feplb``:              `deepspeed_feplb.MoE` with ``dynamic_experts_per_rank`` = D, the
  scheduler process and the shared-memory transport;
* ``feplb, rows bounded`` (with ``--max-rows-over-mean R`` only): the same with
  ``feplb.max_rows_over_mean`` = R.

Per layer: median step time (forward + backward, the slower rank of each step), measured GEMM
straggler (max - mean over the 2 ranks of the wall time spent inside expert modules in forward,
`deepspeed_feplb.integration.monitor`), mean of the slowest rank's expert time, and token-expert routes
dropped. Ranks are started by `deepspeed_feplb.testing.run_distributed` (gloo, spawned).

Next to wall time, the CPU time per step of every process of the job: the ranks (all their
threads: copy threads included) and FEPLB's scheduler process; and for the FEPLB layers the host
time per stage (`stats.StageTimes`: gate, dispatch, static experts, plan wait, phase-2 compute and
communication, combine; in backward the all-to-alls, phase 2, and the rest of autograd).
``--quiet-check`` refuses to run when the 1-minute load average says the cores are busy.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = ("deepspeed dropless", "deepspeed cap1.0", "feplb off (D=0)", "feplb")
STAGES = ("gate", "dispatch", "static experts", "plan wait", "phase-2 compute", "phase-2 comm", "combine",
          "forward total", "all-to-all bwd", "phase-2 bwd compute", "phase-2 bwd comm", "backward total")


ROWS_BOUNDED = "feplb, rows bounded"


def _worker(opts: dict) -> dict:
    import numpy as np
    import torch
    import torch.distributed as dist
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    import deepspeed_feplb
    from deepspeed_feplb.integration.monitor import StatsCollector, summarize
    from deepspeed_feplb.segments import cpu_seconds

    torch.manual_seed(0)
    hidden, ffn, experts, k = opts["hidden"], opts["ffn"], opts["experts"], opts["k"]
    expert = torch.nn.Sequential(torch.nn.Linear(hidden, ffn), torch.nn.GELU(), torch.nn.Linear(ffn, hidden))
    common = dict(hidden_size=hidden, expert=expert, num_experts=experts, ep_size=2, k=k, min_capacity=0, use_rts=False,
                  top2_2nd_expert_sampling=False)
    feplb = {"dynamic_experts_per_rank": opts["dynamic"], "max_helpers_per_expert": 1, "chunk_align_tokens": 8,
             "scheduler": {"mode": "process", "plan_timeout_ms": 20}}
    layers = {
        "deepspeed dropless": DeepSpeedMoE(**common, drop_tokens=False),
        "deepspeed cap1.0": DeepSpeedMoE(**common, drop_tokens=True, capacity_factor=1.0),
        "feplb off (D=0)": deepspeed_feplb.MoE(**common, drop_tokens=False,
                                               feplb_config={**feplb, "dynamic_experts_per_rank": 0}),
        "feplb": deepspeed_feplb.MoE(**common, drop_tokens=False, feplb_config=feplb),
    }
    if opts["max_rows_over_mean"]:
        bounded = {**feplb, "max_rows_over_mean": opts["max_rows_over_mean"]}
        layers[ROWS_BOUNDED] = deepspeed_feplb.MoE(**common, drop_tokens=False, feplb_config=bounded)
    reference = layers["deepspeed dropless"]
    with torch.no_grad():  # no-aux skew: popularity falls with the expert id, so rank 0 holds the hot experts
        wg = reference.deepspeed_moe.gate.wg.weight
        wg.mul_(0.3).add_(opts["skew"] / hidden * (1.0 / torch.arange(1, experts + 1)).sqrt()[:, None])
        for i, e in enumerate(reference.deepspeed_moe.experts.deepspeed_experts):  # distinct experts
            g = torch.Generator().manual_seed(100 + dist.get_rank() * experts + i)
            for p in e.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    for layer in layers.values():
        if layer is not reference:
            layer.load_state_dict(reference.state_dict())
        layer.set_deepspeed_parallelism()
    collectors = {name: StatsCollector(layer) for name, layer in layers.items()}
    dropped = {name: 0 for name in layers}
    routes = {name: 0 for name in layers}

    def count_drops(name):
        def hook(module, inputs, output):
            indices = output[3]  # sparse routes: [k, S] expert per route, -1 = dropped
            dropped[name] += int((indices < 0).sum())
            routes[name] += int(indices.numel())
        return hook

    for name, layer in layers.items():
        layer.deepspeed_moe.gate.register_forward_hook(count_drops(name))

    times = {name: [] for name in layers}
    gemm, gemm_max, straggle_after = ({name: [] for name in layers} for _ in range(3))
    cpu_ranks, cpu_sched = ({name: [] for name in layers} for _ in range(2))
    stages = {name: [] for name in layers}

    def scheduler_pid(name: str) -> int:
        """A FEPLB layer's scheduler process (rank 0's child), once its domain and process are up."""
        domain = getattr(getattr(layers[name].deepspeed_moe, "stage", None), "domain", None)
        return domain.scheduler.scheduler_pid() if dist.get_rank() == 0 and domain is not None else 0

    for layer in layers.values():
        if getattr(layer.deepspeed_moe, "stage", None) is not None:
            layer.deepspeed_moe.stage.stage_times.take()
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    for step in range(opts["warmup"] + opts["steps"]):
        x = torch.randn(opts["tokens"], hidden, generator=g) + 1.0
        w = torch.randn(opts["tokens"], hidden, generator=g)
        for name, layer in layers.items():
            if step == opts["warmup"]:
                dropped[name] = routes[name] = 0
            layer.zero_grad(set_to_none=True)
            dist.barrier()
            sched_pid = scheduler_pid(name)
            cpu0, sched0 = time.process_time(), cpu_seconds(sched_pid)
            start = time.perf_counter()
            out = layer(x)[0]
            mid = time.perf_counter()
            (out * w).sum().backward()
            end = time.perf_counter()
            elapsed = torch.tensor([end - start])
            used = torch.tensor([time.process_time() - cpu0, cpu_seconds(sched_pid) - sched0 if sched_pid else 0.0],
                                dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            dist.all_reduce(used)
            staged = getattr(getattr(layer.deepspeed_moe, "stage", None), "stage_times", None)
            if staged is not None:
                host = staged.take()
                host["forward total"], host["backward total"] = mid - start, end - mid
            records = collectors[name].take()
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, records)
            if step >= opts["warmup"]:
                summary = summarize(everyone, step)["layers"]["moe"]
                times[name].append(float(elapsed))
                cpu_ranks[name].append(float(used[0]))
                cpu_sched[name].append(float(used[1]))
                if staged is not None:
                    stages[name].append(host)
                gemm[name].append(summary["gemm_straggler_ms"])
                gemm_max[name].append(summary["gemm_max_ms"])
                if name in ("feplb", ROWS_BOUNDED):  # the layers with an NVLink domain (D=0 has none)
                    straggle_after[name].append((summary["token_straggler_before"], summary["token_straggler_after"]))
    totals = torch.tensor([[dropped[n], routes[n]] for n in layers], dtype=torch.float64)
    dist.all_reduce(totals)
    result = {}
    for i, name in enumerate(layers):
        result[name] = {"median_step_ms": 1e3 * float(np.median(times[name])),
                        # means: /proc counts CPU time in 10 ms ticks, so one step's delta is coarse
                        "ranks_cpu_ms": 1e3 * float(np.mean(cpu_ranks[name])),
                        "scheduler_cpu_ms": 1e3 * float(np.mean(cpu_sched[name])),
                        "gemm_straggler_ms": float(np.median(gemm[name])),
                        "gemm_max_ms": float(np.median(gemm_max[name])),
                        "routes_dropped": int(totals[i, 0]), "routes": int(totals[i, 1])}
        if stages[name]:  # rank 0's host time per stage, median over steps
            keys = sorted({k for h in stages[name] for k in h})
            result[name]["host_ms"] = {k: 1e3 * float(np.median([h.get(k, 0.0) for h in stages[name]])) for k in keys}
        fitted = getattr(getattr(getattr(layers[name], "deepspeed_moe", None), "stage", None), "compute_times", None)
        if name in ("feplb", ROWS_BOUNDED) and fitted is not None and fitted.fitted_us() is not None:
            result[name]["fitted_piece_row_us"] = [round(v, 3) for v in fitted.fitted_us()]  # rank 0's, fwd + bwd
        if straggle_after[name]:
            result[name]["token_straggler_before"] = float(np.mean([b for b, _ in straggle_after[name]]))
            result[name]["token_straggler_after"] = float(np.mean([a for _, a in straggle_after[name]]))
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank and step")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--dynamic", type=int, default=2, help="FEPLB dynamic experts per rank (D)")
    parser.add_argument("--skew", type=float, default=3.0, help="gate skew strength (no auxiliary loss)")
    parser.add_argument("--max-rows-over-mean", type=float, default=None, metavar="RATIO",
                        help=f"also run a FEPLB layer with this bound on rows ({ROWS_BOUNDED!r})")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    parser.add_argument("--quiet-check", action="store_true",
                        help="refuse to run when the 1-minute load average exceeds half the cores (busy machine)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cores = os.cpu_count() or 1
    load_before = os.getloadavg()[0]
    if args.quiet_check and load_before > 0.5 * cores:
        print(f"refusing to measure: load average {load_before:.2f} on {cores} cores (more than half busy); "
              "wait for a quiet machine or drop --quiet-check", file=sys.stderr)
        return 3
    from deepspeed_feplb.testing import run_distributed

    opts = {k: v for k, v in vars(args).items() if k not in ("json", "quiet_check")}
    result = run_distributed(_worker, 2, opts, timeout=900)[0]
    load_after = os.getloadavg()[0]
    print(f"2 CPU ranks (gloo), EP=2, {args.experts} experts, top-{args.k}, hidden {args.hidden}, ffn {args.ffn}, "
          f"{args.tokens} tokens/rank, skew {args.skew}, no aux loss; {args.steps} steps after {args.warmup} warm-up")
    print(f"load average (1 min) {load_before:.2f} before, {load_after:.2f} after, {cores} cores")
    header = (f"{'layer':<20}{'step ms (median)':>18}{'ranks CPU ms/step':>19}{'sched CPU ms/step':>19}"
              f"{'GEMM straggler ms':>19}{'slowest expert ms':>19}{'routes dropped':>16}")
    print(header)
    variants = [n for n in (*VARIANTS, ROWS_BOUNDED) if n in result]
    for name in variants:
        r = result[name]
        print(f"{name:<20}{r['median_step_ms']:>18.1f}{r['ranks_cpu_ms']:>19.1f}{r['scheduler_cpu_ms']:>19.2f}"
              f"{r['gemm_straggler_ms']:>19.2f}{r['gemm_max_ms']:>19.2f}{r['routes_dropped']:>9} / {r['routes']}")
    print("\nhost ms per stage on rank 0 (median over steps):")
    staged = [n for n in variants if "host_ms" in result[n]]
    stages = [k for k in STAGES if any(k in result[n]["host_ms"] for n in staged)]
    print(f"{'stage':<24}" + "".join(f"{n:>18}" for n in staged))
    for k in stages:
        print(f"{k:<24}" + "".join(f"{result[n]['host_ms'].get(k, 0.0):>18.2f}" for n in staged))
    ours, dropless, off = result["feplb"], result["deepspeed dropless"], result["feplb off (D=0)"]
    print(f"\nFEPLB vs DeepSpeed dropless: {dropless['median_step_ms'] / ours['median_step_ms']:.2f}x faster per step")
    print(f"GEMM straggler vs the same layer with balancing off: "
          f"{100 * (1 - ours['gemm_straggler_ms'] / max(off['gemm_straggler_ms'], 1e-9)):.0f}% lower")
    if "token_straggler_before" in ours:
        print(f"token straggler (FEPLB domain): {ours['token_straggler_before']:.1f} -> "
              f"{ours['token_straggler_after']:.1f}")
    if ROWS_BOUNDED in result and "token_straggler_after" in result[ROWS_BOUNDED]:
        bounded = result[ROWS_BOUNDED]
        print(f"with max_rows_over_mean {args.max_rows_over_mean:g}: token straggler "
              f"{bounded['token_straggler_before']:.1f} -> {bounded['token_straggler_after']:.1f}, "
              f"step {bounded['median_step_ms'] / ours['median_step_ms']:.2f}x FEPLB's without it")
    if "fitted_piece_row_us" in ours:
        piece_us, row_us = ours["fitted_piece_row_us"]
        print(f"FEPLB's time model on rank 0 (forward + backward): {piece_us:.1f} µs per expert piece, "
              f"{row_us:.3f} µs per row")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": opts, "results": result}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
