"""Train a small byte-level MoE language model with FEPLB, launched by the `deepspeed` CLI.

    OMP_NUM_THREADS=1 deepspeed --num_gpus 2 examples/train_moe.py --deepspeed_config examples/ds_config.json

The text is the Python standard library's own sources (present on every machine). There is no
auxiliary loss, so routing skews as it does in real training; FEPLB rebalances every
micro-batch. Every step prints one JSON line (rank 0): loss, step time and what FEPLB did; the
summary gives step time, tokens/s and the scheduler process's CPU use. ``--no-feplb`` runs the
same training with the ``"feplb"`` section's ``enabled: false`` (DeepSpeed's own MoE layer), for an
on/off comparison.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

import deepspeed
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
    parser.add_argument("--local_rank", type=int, default=-1)
    return deepspeed.add_config_arguments(parser)


def skip_shm_op() -> None:
    """DeepSpeed's CPU shm comm op leaves 66 MiB files in /dev/shm per rank; gloo alone is enough here."""
    if not torch.cuda.is_available():
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def step_record(step: int, loss: float, seconds: float, stats: dict, summary: dict | None) -> dict:
    """One JSON line: loss, step time, the layer's own stats (domain of rank 0) and the monitor summary of the step."""
    record = {"step": step, "loss": round(loss, 6), "step_ms": round(seconds * 1e3, 2), **{key: stats.get(key) for key in (
        "tokens_before", "tokens_after", "token_straggler_before", "token_straggler_after",
        "migrated_tokens", "plan_latency_us", "fallback")}}
    if summary is not None:
        record.update({key: summary[key] for key in ("gemm_straggler_ms", "migrated_bytes", "weight_bytes",
                                                     "weight_copies", "resident_hits", "flushed_copies", "grad_bytes")
                       if key in summary})
        record["layers"] = summary["layers"]
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
    history, pid = [], 0
    stream = batches(data, args.batch, args.context, seed=1000 + rank)
    for step in range(args.steps):
        start = time.perf_counter()
        for _ in range(engine.gradient_accumulation_steps()):
            x, y = next(stream)
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
        seconds = time.perf_counter() - start
        collector = getattr(engine, "feplb_monitor", None)
        record = step_record(step, loss.item(), seconds, engine.module.moe.feplb_stats,
                             collector.last if collector is not None else None)
        history.append(record)
        if rank == 0 and log is not None:
            log(json.dumps(record))
        if not pid:  # from the step its scheduler process is up (it starts with the first forward)
            pid, wall0 = scheduler_pid(engine.module), time.perf_counter()
            cpu0 = cpu_seconds(pid)
    if pid:
        history[-1]["scheduler_cpu_percent"] = round(100 * (cpu_seconds(pid) - cpu0) / (time.perf_counter() - wall0), 2)
    return history


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
    """Pid of the scheduler process this rank started (rank 0 of each domain), else 0."""
    domain = getattr(model.moe.deepspeed_moe, "domain", None)
    return domain.scheduler.scheduler_pid() if domain is not None and domain.local_rank == 0 else 0


def main() -> None:
    args = build_parser().parse_args()
    skip_shm_op()
    deepspeed.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    history = train(args, log=lambda line: print(line, flush=True))
    if rank == 0 and history:
        gas = args.gradient_accumulation_steps or as_dict(args.deepspeed_config).get("gradient_accumulation_steps", 1)
        summarize(history, tokens_per_step=args.batch * world * gas, feplb=not args.no_feplb)
    torch.distributed.barrier()
    deepspeed_feplb.shutdown()
    torch.distributed.destroy_process_group()


def summarize(history: list[dict], tokens_per_step: int, feplb: bool = True) -> None:
    timed = [h["step_ms"] for h in history[WARMUP_STEPS:]] or [h["step_ms"] for h in history]
    step_ms = float(np.median(timed))
    print(f"\n{'FEPLB' if feplb else 'FEPLB off (DeepSpeed MoE)'}: step time median {step_ms:.1f} ms "
          f"(steps {min(WARMUP_STEPS, len(history) - len(timed))}..{len(history) - 1}), "
          f"{tokens_per_step / step_ms * 1e3:,.0f} tokens/s over all ranks")
    if not feplb or history[0]["tokens_before"] is None:
        print(f"  final loss: {history[-1]['loss']}   OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
        return
    before = np.array([h["tokens_before"] for h in history])
    after = np.array([h["tokens_after"] for h in history])
    s_before = np.mean([straggler(t)[0] for t in before])
    s_after = np.mean([straggler(t)[0] for t in after])
    ratio_before = np.mean([straggler(t)[1] for t in before])
    ratio_after = np.mean([straggler(t)[1] for t in after])
    print(f"FEPLB over {len(history)} steps (mean per step, domain ranks {list(range(before.shape[1]))}):")
    print(f"  tokens per rank before: {before.mean(0).round(1).tolist()}   after: {after.mean(0).round(1).tolist()}")
    print(f"  token straggler (max-mean): {s_before:.1f} -> {s_after:.1f}   max/mean: {ratio_before:.3f} -> "
          f"{ratio_after:.3f}   reduction: {100 * (1 - s_after / max(s_before, 1e-9)):.1f}%")
    if "scheduler_cpu_percent" in history[-1]:
        print(f"  scheduler process (feplb-sched) CPU: {history[-1]['scheduler_cpu_percent']:.1f}% of one core "
              "(from the step it was up to the end)")
    if "weight_copies" in history[-1]:
        mean = {key: np.mean([h.get(key, 0) for h in history]) for key in (
            "weight_copies", "weight_bytes", "resident_hits", "flushed_copies", "grad_bytes")}
        print(f"  expert weights copied per step: {mean['weight_copies']:.1f} copies, {mean['weight_bytes'] / 1e6:.2f} MB; "
              f"chunks served from kept copies: {mean['resident_hits']:.1f}; copies whose gradients went home at the "
              f"step's end: {mean['flushed_copies']:.1f}; weight-gradients sent: {mean['grad_bytes'] / 1e6:.2f} MB")
    gemm = [h["gemm_straggler_ms"] for h in history if h.get("gemm_straggler_ms") is not None]
    if gemm:
        print(f"  measured GEMM straggler (expert-compute wall time, max-mean over the domain): "
              f"median {np.median(gemm):.2f} ms per step")
    print(f"  final loss: {history[-1]['loss']}   OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")


if __name__ == "__main__":
    main()
