"""Train a small byte-level MoE language model with FEPLB, launched by the `deepspeed` CLI.

    OMP_NUM_THREADS=1 deepspeed --num_gpus 2 examples/train_moe.py --deepspeed_config examples/ds_config.json

The text is the Python standard library's own sources (present on every machine). There is no
auxiliary loss, so routing skews as it does in real training; FEPLB rebalances every
micro-batch. Every step prints one JSON line (rank 0, `step_record`): ``step`` (the engine's
global step after it, 1-based like DeepSpeed's monitor), loss, step time, rows per rank and
``layers`` (what FEPLB did, per MoE layer), which ``python -m deepspeed_feplb report`` plots; the
summary gives step time, tokens/s, the token straggler before -> after and the scheduler
process's CPU use. ``--no-feplb`` runs the same training with the ``"feplb"`` section's
``enabled: false`` (DeepSpeed's own MoE layer), for an on/off comparison; ``--progress`` draws a
progress bar instead of the per-step JSON lines (needs ``tqdm``).
"""
from __future__ import annotations

import argparse
import json
import os
import sysconfig
import time
from pathlib import Path

import deepspeed
import numpy as np
import torch

import deepspeed_feplb
from deepspeed_feplb.segments import cpu_seconds
from deepspeed_feplb.stats import straggler

WARMUP_STEPS = 2  # not in the step-time summary (first-call costs: runtime start, caches)


def stdlib_bytes(limit: int = 4_000_000) -> np.ndarray:
    """The first ``limit`` bytes of the standard library's .py files, in a fixed order."""
    chunks, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return np.frombuffer(b"".join(chunks)[:limit], dtype=np.uint8)


class ByteMoELM(torch.nn.Module):
    """Next-byte prediction from the previous ``context`` bytes through one MoE layer."""

    def __init__(self, hidden: int, experts: int, ep_size: int, k: int, context: int):
        super().__init__()
        self.embed = torch.nn.Embedding(256, hidden)
        self.mix = torch.nn.Linear(context * hidden, hidden)
        expert = torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                     torch.nn.Linear(4 * hidden, hidden))
        self.moe = deepspeed_feplb.MoE(hidden, expert, num_experts=experts, ep_size=ep_size, k=k, min_capacity=0,
                                       drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False)
        self.head = torch.nn.Linear(hidden, 256)

    def forward(self, context_bytes: torch.Tensor) -> torch.Tensor:
        """context_bytes int64 ``[B, context]`` -> logits ``[B, 256]``."""
        h = self.mix(self.embed(context_bytes).flatten(1))
        y, _, _ = self.moe(h)  # no auxiliary loss: routing is free to skew
        return self.head(h + y)


def batches(data: np.ndarray, batch: int, context: int, seed: int):
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - context - 1, size=batch)
        window = np.stack([data[s:s + context + 1] for s in starts]).astype(np.int64)
        yield torch.from_numpy(window[:, :-1]), torch.from_numpy(window[:, -1])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--context", type=int, default=8)
    parser.add_argument("--batch", type=int, default=512, help="tokens per rank and micro-batch")
    parser.add_argument("--gradient-accumulation-steps", type=int, metavar="M",
                        help="micro-batches per optimizer step (default: the ds_config's); with "
                             "feplb.weight_residency 'step' a helper keeps its expert copies for the M micro-batches")
    parser.add_argument("--no-feplb", action="store_true",
                        help="the same run with FEPLB off (\"feplb\": {\"enabled\": false}: DeepSpeed's own MoE layer)")
    parser.add_argument("--progress", action="store_true",
                        help="a progress bar over the steps instead of the per-step JSON lines (rank 0; needs tqdm)")
    parser.add_argument("--local_rank", type=int, default=-1)
    return deepspeed.add_config_arguments(parser)


def progress_bar(steps: int, enabled: bool):
    """A tqdm bar over ``steps`` on rank 0 when ``enabled``, else None (tqdm is optional)."""
    if not enabled or torch.distributed.get_rank() != 0:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        print("--progress: tqdm is not installed (pip install tqdm); continuing without a progress bar", flush=True)
        return None
    return tqdm(total=steps, unit="step")


def log_line(log, line: str, bar) -> None:
    """``log(line)``, unless a progress bar is drawn in its place (``--progress``)."""
    if bar is None:
        log(line)


def rounded(layers: dict, digits: int = 3) -> dict:
    """``{layer: {metric: value}}`` with float values rounded to ``digits`` decimals (shorter lines)."""
    return {name: {key: round(value, digits) if isinstance(value, float) else value for key, value in entry.items()}
            for name, entry in layers.items()}


def step_record(step: int, loss: float, seconds: float, micro_batch_stats: list[dict], summary: dict | None) -> dict:
    """One JSON line of a training step.

    ``step``: the engine's global step after the step (1-based, the step DeepSpeed's monitor
    writes); ``tokens`` (set by `train`): the step's tokens over all ranks; ``tokens_before`` /
    ``tokens_after``: rows each rank of this rank's NVLink domain computed in the step (int
    ``[G]``, summed over its micro-batches; None with FEPLB off), from
    the layer's ``feplb_stats`` of each micro-batch; ``layers``: ``{layer: {metric: value}}`` of
    the monitor summary (``engine.feplb_monitor.last``, floats to 3 decimals), which ``report`` reads.
    """
    record = {"step": step, "loss": round(loss, 6), "step_ms": round(seconds * 1e3, 2)}
    for key in ("tokens_before", "tokens_after"):
        counts = [stats[key] for stats in micro_batch_stats if stats.get(key) is not None]
        record[key] = np.sum(counts, axis=0).tolist() if counts else None
    record["layers"] = rounded(summary["layers"]) if summary is not None else {}
    return record


def train(args, ds_config=None, log=print) -> list[dict]:
    """Train ``args.steps`` steps on this rank; returns (and logs, on rank 0) one record per step.

    ``ds_config``: a dict or path; default ``args.deepspeed_config``. Needs an initialised
    process group (the EP size is the world size).
    """
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    if getattr(args, "no_feplb", False):
        ds_config = feplb_off(ds_config if ds_config is not None else args.deepspeed_config)
    if getattr(args, "gradient_accumulation_steps", None):
        ds_config = {**as_dict(ds_config if ds_config is not None else args.deepspeed_config),
                     "gradient_accumulation_steps": args.gradient_accumulation_steps}
    torch.manual_seed(0)
    model = ByteMoELM(args.hidden, args.experts, ep_size=world, k=args.top_k, context=args.context)
    engine, _, _, _ = deepspeed_feplb.initialize(args=args if ds_config is None else None, model=model,
                                                 model_parameters=model.parameters(), config=ds_config)
    data = stdlib_bytes()
    loss_fn = torch.nn.CrossEntropyLoss()
    history, scheduler_cpu = [], SchedulerCPU()
    stream = batches(data, args.batch, args.context, seed=1000 + rank)
    bar = progress_bar(args.steps, getattr(args, "progress", False))
    for _ in range(args.steps):
        start = time.perf_counter()
        micro_batch_stats = []
        for _ in range(engine.gradient_accumulation_steps()):
            x, y = next(stream)
            loss = loss_fn(engine(x), y)
            micro_batch_stats.append(dict(engine.module.moe.feplb_stats))
            engine.backward(loss)
            engine.step()
        seconds = time.perf_counter() - start
        collector = getattr(engine, "feplb_monitor", None)
        record = step_record(engine.global_steps, loss.item(), seconds, micro_batch_stats,
                             collector.last if collector is not None else None)
        # over all ranks (report: tokens/s)
        record["tokens"] = args.batch * world * engine.gradient_accumulation_steps()
        history.append(record)
        if rank == 0 and log is not None:
            log_line(log, json.dumps(record), bar)
        if bar is not None:
            bar.update()
        scheduler_cpu.sample(scheduler_pid(engine.module))
    if bar is not None:
        bar.close()
    if (percent := scheduler_cpu.percent()) is not None:
        history[-1]["scheduler_cpu_percent"] = round(percent, 2)
    return history


class SchedulerCPU:
    """CPU the domain's scheduler process used, as a share of one core, from the step it first
    served to the end, summed over the processes that replaced it (a restart has a new pid)."""

    def __init__(self):
        self.first: dict[int, float] = {}  # pid -> its CPU seconds when first seen (0 for a restarted one)
        self.used: dict[int, float] = {}  # pid -> CPU seconds used since, at its last sample
        self.since = 0.0

    def sample(self, pid: int) -> None:
        if pid <= 0:
            return
        now = cpu_seconds(pid)  # 0 once the process is gone: its last sample stands
        if pid not in self.first:
            self.first[pid] = now if not self.first else 0.0
            self.since = self.since or time.perf_counter()
        self.used[pid] = max(self.used.get(pid, 0.0), now - self.first[pid])

    def percent(self) -> float | None:
        """The share of one core in %, or None when no process served."""
        if not self.first:
            return None
        return 100 * sum(self.used.values()) / max(time.perf_counter() - self.since, 1e-9)


def as_dict(ds_config) -> dict:
    """A ds_config given as a dict or a path, as a dict."""
    if isinstance(ds_config, dict):
        return ds_config
    with open(ds_config) as f:
        return json.load(f)


def feplb_off(ds_config) -> dict:
    """The ds_config (dict or path) with ``"feplb": {"enabled": false}``."""
    ds_config = as_dict(ds_config)
    return {**ds_config, "feplb": {**ds_config.get("feplb", {}), "enabled": False}}


def scheduler_pid(model) -> int:
    """Pid of the scheduler process this rank started (rank 0 of its domain; the FEPLB layers of a
    model share it), else 0."""
    for module in model.modules():
        domain = getattr(getattr(module, "stage", None), "domain", None)
        if domain is not None:
            return domain.scheduler.scheduler_pid() if domain.local_rank == 0 else 0
    return 0


def main() -> None:
    args = build_parser().parse_args()
    deepspeed_feplb.init_distributed()  # deepspeed.init_distributed, without DeepSpeed's CPU shm op build
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    history = train(args, log=lambda line: print(line, flush=True))
    if rank == 0 and history:
        gas = args.gradient_accumulation_steps or as_dict(args.deepspeed_config).get("gradient_accumulation_steps", 1)
        summarize(history, tokens_per_step=args.batch * world * gas, feplb=not args.no_feplb)
    torch.distributed.barrier()
    deepspeed_feplb.shutdown()
    torch.distributed.destroy_process_group()


def per_step(history: list[dict], metric: str, combine=np.mean) -> list[float]:
    """``metric`` of each step, combined over the step's MoE layers (``layers`` of `step_record`);
    steps where no layer has it are left out."""
    out = []
    for record in history:
        values = [entry[metric] for entry in (record.get("layers") or {}).values() if metric in entry]
        if values:
            out.append(float(combine(values)))
    return out


def summarize(history: list[dict], tokens_per_step: int, feplb: bool = True, baseline: str = "DeepSpeed MoE") -> None:
    """Print the end summary of `step_record` lines: step time median (after `WARMUP_STEPS`),
    tokens/s, and with FEPLB the token and measured GEMM stragglers, each the mean over steps
    (and over layers) as ``python -m deepspeed_feplb report`` computes them. ``baseline``: what
    runs with FEPLB off."""
    timed = [h["step_ms"] for h in history[WARMUP_STEPS:]] or [h["step_ms"] for h in history]
    step_ms = float(np.median(timed))
    first = len(history) - len(timed)
    print(f"\n{'FEPLB' if feplb else f'FEPLB off ({baseline})'}: step time median {step_ms:.1f} ms "
          f"(steps {history[first]['step']}..{history[-1]['step']}), "
          f"{tokens_per_step / step_ms * 1e3:,.0f} tokens/s over all ranks")
    s_before, s_after = per_step(history, "token_straggler_before"), per_step(history, "token_straggler_after")
    if not feplb or not s_before:
        print(f"  final loss: {history[-1]['loss']}   OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
        return
    before, after = float(np.mean(s_before)), float(np.mean(s_after))
    print(f"FEPLB over {len(history)} steps (mean over steps):")
    if history[0].get("tokens_before") is not None:
        tokens_before = np.array([h["tokens_before"] for h in history])
        tokens_after = np.array([h["tokens_after"] for h in history])
        ratio_before = np.mean([straggler(t)[1] for t in tokens_before])
        ratio_after = np.mean([straggler(t)[1] for t in tokens_after])
        print(f"  rows per rank of the domain (ranks {list(range(tokens_before.shape[1]))}) before: "
              f"{tokens_before.mean(0).round(1).tolist()}   after: {tokens_after.mean(0).round(1).tolist()}   "
              f"max/mean: {ratio_before:.3f} -> {ratio_after:.3f}")
    reduction = f"{100 * (1 - after / before):.1f}%" if before > 0 else "none to make (no straggler in the domain)"
    print(f"  token straggler (max-mean): {before:.1f} -> {after:.1f}   reduction: {reduction}")
    if "scheduler_cpu_percent" in history[-1]:
        print(f"  scheduler process (feplb-sched) CPU: {history[-1]['scheduler_cpu_percent']:.1f}% of one core "
              "(from the step it was up to the end)")
    else:
        print("  scheduler process (feplb-sched): did not serve in this run (it starts when a layer first balances "
              "and serves once it has loaded the planner, or compiled it on a cold numba cache; "
              "feplb.scheduler.mode \"inline\" never starts it); plans came from the ranks")
    if per_step(history, "weight_copies"):
        mean = {key: np.mean(per_step(history, key, np.sum) or [0]) for key in (
            "weight_copies", "weight_bytes", "resident_hits", "flushed_copies", "grad_bytes")}
        print(f"  expert weights copied per step: {mean['weight_copies']:.1f} copies, "
              f"{mean['weight_bytes'] / 1e6:.2f} MB; chunks served from kept copies: {mean['resident_hits']:.1f}; "
              f"copies whose gradients went home at the step's end: {mean['flushed_copies']:.1f}; "
              f"weight-gradients sent: {mean['grad_bytes'] / 1e6:.2f} MB")
    gemm = per_step(history, "gemm_straggler_ms")
    if gemm:
        print(f"  measured GEMM straggler (expert-compute wall time, max-mean over the domain): "
              f"{np.mean(gemm):.2f} ms per step, mean over steps")
    print(f"  final loss: {history[-1]['loss']}   OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")


if __name__ == "__main__":
    main()
