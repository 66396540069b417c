"""Soak: many steps with random skew while the scheduler process is randomly stalled and killed.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/soak.py --steps 500 --json soak.json

Two gloo ranks, one FEPLB layer and DeepSpeed's dropless MoE with the same weights, compared on
every step (output, input gradient, every parameter gradient). Between steps the domain's
first rank randomly SIGSTOPs the `feplb-sched` process for a while, SIGCONTs it, or SIGKILLs it.
Reports mismatches (must be 0), fallback steps, restarts, resident memory over time (must be
flat), and afterwards the `feplb-` segments and scheduler processes left behind (must be none).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import torch
import torch.distributed as dist

from deepspeed_feplb.segments import leftover_segments, process_alive
from deepspeed_feplb.testing import run_distributed

import moe_cases


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def signal_pid(pid: int, signum: int) -> None:
    """Signal one scheduler process; it may be gone already (its rank killed and reaped a stalled one)."""
    assert pid > 0, pid  # os.kill(-1 or 0, ...) would signal every process we own
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def soak(steps: int, seed: int) -> dict:
    feplb = {"dynamic_experts_per_rank": 2, "chunk_align_tokens": 4,
             "scheduler": {"plan_timeout_ms": 5, "start_after_steps": 0}}
    reference, ours = moe_cases.build_pair(8, 2, 2, feplb, seed=seed)
    rng = torch.Generator().manual_seed(seed)
    gate_weights = [layer.deepspeed_moe.gate.wg.weight for layer in (reference, ours)]
    base = gate_weights[0].detach().clone()
    client = None  # the domain runtime attaches on the first forward
    summary = {"mismatches": 0, "worst_error": 0.0, "fallback_steps": 0, "kills": 0, "stalls": 0, "restarts": 0,
               "migrated_tokens": 0, "rss_mib": [], "scheduler_pids": set()}
    stopped = None
    for step in range(steps):
        with torch.no_grad():  # random skew: a new hot set every step, same on every rank
            skew = torch.rand(base.shape[0], generator=rng) ** 4 * 6.0 / base.shape[1]
            for w in gate_weights:
                w.copy_(base + skew[:, None])
        action = torch.rand((), generator=rng).item()
        if client is not None and client.process is not None:
            pid = client.scheduler_pid()
            if stopped is not None and action < 0.5:
                signal_pid(stopped, signal.SIGCONT)
                stopped = None
            elif stopped is None and pid > 0 and action < 0.04:
                signal_pid(pid, signal.SIGSTOP)
                stopped = pid
                summary["stalls"] += 1
            elif pid > 0 and 0.04 <= action < 0.07:
                signal_pid(pid, signal.SIGKILL)
                summary["kills"] += 1
                stopped = None if stopped == pid else stopped
            summary["scheduler_pids"].add(client.scheduler_pid())
        x, w = moe_cases.rank_inputs(step + 1000 * seed)
        ref = moe_cases.run_layer(reference, x, w)
        out = moe_cases.run_layer(ours, x, w)
        errors = [moe_cases.relative_error(out[0], ref[0]), moe_cases.relative_error(out[1], ref[1])]
        errors += [moe_cases.relative_error(out[2][n], ref[2][n]) for n in ref[2]]
        summary["worst_error"] = max(summary["worst_error"], max(errors))
        summary["mismatches"] += max(errors) > 1e-5
        client = client or ours.deepspeed_moe.stage.domain.scheduler
        stats = ours.feplb_stats
        summary["fallback_steps"] += bool(stats["fallback"])
        summary["migrated_tokens"] += stats["migrated_tokens"]
        for p in list(reference.parameters()) + list(ours.parameters()):
            p.grad = None
        if step % 50 == 0 or step == steps - 1:
            summary["rss_mib"].append(round(rss_mib(), 1))
    if stopped is not None:
        signal_pid(stopped, signal.SIGCONT)
    pids = summary.pop("scheduler_pids") - {0, -1}
    summary["restarts"] = max(len(pids) - 1, 0)
    summary["scheduler_pids"] = sorted(pids)
    summary["segment_prefix"] = ours.deepspeed_moe.stage.domain.name + "-" if ours.deepspeed_moe.stage.domain else None
    dist.barrier()
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the per-rank summaries here")
    args = parser.parse_args()
    start = time.monotonic()
    results = run_distributed(soak, 2, args.steps, args.seed, timeout=3600)
    ours = {pid for r in results for pid in r["scheduler_pids"]}
    deadline = time.monotonic() + 10  # killed ones are reaped by their rank; the rest see the shutdown flag
    while time.monotonic() < deadline and any(process_alive(pid) for pid in ours):
        time.sleep(0.1)
    prefix = results[0]["segment_prefix"]
    report = {"steps": args.steps, "seconds": round(time.monotonic() - start, 1), "ranks": results,
              "leaked_segments": leftover_segments(prefix) if prefix else [],
              "leaked_schedulers": sorted(pid for pid in ours if process_alive(pid))}
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    ok = (all(r["mismatches"] == 0 for r in results) and not report["leaked_segments"]
          and not report["leaked_schedulers"])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
