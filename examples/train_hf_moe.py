"""Train a tiny Hugging Face MoE model (Mixtral or Qwen3-MoE) with DeepSpeed AutoEP + FEPLB.

    OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/train_hf_moe.py --model mixtral
    OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/train_hf_moe.py \\
        --deepspeed_config examples/ds_config.json

The model is built from its config with random weights (no download). AutoEP shards its experts
over the ranks (``"expert_parallel"``); ``deepspeed_feplb.initialize`` adds FEPLB phase 2 to
every AutoEP layer, driven by the ``"feplb"`` section. ``--skew`` biases the routers towards
rank 0's experts (as a real model's hot experts would be), so FEPLB has something to balance.

ds_config: without ``--deepspeed_config`` a built-in one (``--batch``, ``--zero``, ``--bf16``,
AdamW, FEPLB on). With ``--deepspeed_config PATH`` your file is used as it is, its ``"feplb"``
section included; only what this example needs and the file lacks is added: the micro-batch size
(``--batch``, when the file sets no batch size), an AdamW optimizer and the ``"expert_parallel"``
keys ``enabled``, ``autoep_size`` (the world size) and ``preset_model`` (``--model``).
``--zero`` and ``--bf16``, when given, override the file.

Every step prints one JSON line (rank 0): ``step`` (the engine's global step after it, 1-based),
the loss (mean over ranks), step time and ``layers``: per MoE layer the token stragglers before and
after balancing, migrated tokens, plan latency (the format of examples/train_moe.py, which
``python -m deepspeed_feplb report`` plots); the end summary gives step time, tokens/s and the
token straggler before -> after. Needs ``transformers>=5.0,<5.23`` (docs/AUTOEP.md).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import deepspeed
import numpy as np
import torch
import torch.distributed as dist

import deepspeed_feplb
from deepspeed_feplb.integration.autoep import autoep_stats

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_moe import SchedulerCPU, as_dict, feplb_off, log_line, progress_bar, rounded, scheduler_pid, summarize

VOCAB = 128
OPTIMIZER = {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}}


def tiny_model(name: str, hidden: int, layers: int, experts: int, skew: float, seed: int):
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=False)
    if name == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**common, intermediate_size=2 * hidden, num_local_experts=experts))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, head_dim=hidden // 4, moe_intermediate_size=2 * hidden,
                                                   num_experts=experts, decoder_sparse_step=1, norm_topk_prob=True))
    if skew:
        with torch.no_grad():  # a direction shared by all embeddings that the routers favour for experts 0-1
            u = torch.randn(hidden, generator=torch.Generator().manual_seed(seed + 1))
            u /= u.norm()
            model.model.embed_tokens.weight += skew * u
            for layer in model.model.layers:
                layer.mlp.gate.weight[:2] += 2 * skew * u
    return model


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["mixtral", "qwen3_moe"], default="mixtral")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--zero", type=int, choices=[0, 1, 2],
                        help="ZeRO stage (default: 1 with the built-in ds_config, the file's with --deepspeed_config)")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--no-feplb", action="store_true", help="plain AutoEP, for comparison")
    parser.add_argument("--skew", type=float, default=1.0, help="router bias towards rank 0's experts (0: none)")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4,
                        help="sequences per rank and micro-batch (a --deepspeed_config's batch size wins)")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--progress", action="store_true",
                        help="a progress bar over the steps instead of the per-step JSON lines (rank 0; needs tqdm)")
    parser.add_argument("--local_rank", type=int, default=-1)  # passed by the deepspeed launcher
    return deepspeed.add_config_arguments(parser)


def ds_config(args, world: int) -> dict:
    """The ds_config of this run: the built-in one, or ``args.deepspeed_config``'s with what
    AutoEP and this example need added where the file lacks it (module docstring)."""
    autoep = {"enabled": True, "autoep_size": world, "preset_model": args.model}
    if args.deepspeed_config is None:
        config = {
            "train_micro_batch_size_per_gpu": args.batch,
            "optimizer": OPTIMIZER,
            "zero_optimization": {"stage": 1 if args.zero is None else args.zero},
            "bf16": {"enabled": args.bf16},
            "steps_per_print": 10_000,
            "expert_parallel": autoep,
            # "ignore": these tiny experts cost less than a message, so with measured costs (the
            # default, what a real model uses) FEPLB would rightly skip every micro-batch
            "feplb": {"enabled": True, "dynamic_experts_per_rank": 2, "chunk_align_tokens": "auto",
                      "fixed_costs": "ignore"},
        }
    else:
        user = as_dict(args.deepspeed_config)
        config = {"optimizer": OPTIMIZER, **user, "expert_parallel": {**autoep, **user.get("expert_parallel", {})}}
        if not {"train_batch_size", "train_micro_batch_size_per_gpu"} & set(user):
            config["train_micro_batch_size_per_gpu"] = args.batch
        if args.zero is not None:
            config["zero_optimization"] = {**user.get("zero_optimization", {}), "stage": args.zero}
        if args.bf16:
            config["bf16"] = {**user.get("bf16", {}), "enabled": True}
    return feplb_off(config) if args.no_feplb else config


def layer_summary(micro_batch_stats: list[dict]) -> dict:
    """``{layer: {metric: value}}`` of one step from the ``autoep_stats`` of its micro-batches
    (rank 0's domain): token stragglers and plan latency are means over the micro-batches,
    migrated tokens, fallbacks and weight traffic sums, as in ``engine.feplb_monitor.last``
    (whose collector does not see AutoEP layers)."""
    layers = {}
    for name in micro_batch_stats[0]:
        stats = [step_stats[name] for step_stats in micro_batch_stats if "token_straggler_before" in step_stats[name]]
        if not stats:
            continue
        entry = {key: float(np.mean([s[key] for s in stats]))
                 for key in ("token_straggler_before", "token_straggler_after", "plan_latency_us")}
        entry["migrated_tokens"] = sum(int(s["migrated_tokens"]) for s in stats)
        entry["fallbacks"] = sum(int(s["fallback"]) for s in stats)
        for key in ("weight_bytes", "weight_copies", "resident_hits", "flushed_copies", "grad_bytes"):
            if key in stats[0]:
                entry[key] = sum(int(s[key]) for s in stats)
        layers[name] = entry
    return layers


def train(args, log=print) -> tuple[list[dict], object]:
    """Train ``args.steps`` steps on this rank; returns (one record per step, which rank 0 also
    logs; the engine).

    Needs an initialised process group (AutoEP's EP size is the world size).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    model = tiny_model(args.model, args.hidden, 2, args.experts, args.skew, seed=0)
    engine, _, _, _ = deepspeed_feplb.initialize(model=model, model_parameters=model.parameters(),
                                                 config=ds_config(args, world))
    g = torch.Generator().manual_seed(1000 + rank)
    history, scheduler_cpu = [], SchedulerCPU()
    bar = progress_bar(args.steps, args.progress)
    for _ in range(args.steps):
        start_time = time.perf_counter()
        micro_batch_stats = []
        for _ in range(engine.gradient_accumulation_steps()):
            start = torch.randint(0, VOCAB, (engine.train_micro_batch_size_per_gpu(), 1), generator=g)
            ids = (start + torch.arange(args.seq)) % VOCAB  # learnable: runs of consecutive ids
            loss = engine(ids, labels=ids).loss
            micro_batch_stats.append({name: dict(stats) for name, stats in autoep_stats(engine.module).items()})
            engine.backward(loss)
            engine.step()
        seconds = time.perf_counter() - start_time
        mean_loss = loss.detach().float().clone()
        dist.all_reduce(mean_loss)
        record = {"step": engine.global_steps, "loss": round(mean_loss.item() / world, 6),
                  "step_ms": round(seconds * 1e3, 2), "layers": rounded(layer_summary(micro_batch_stats))}
        history.append(record)
        if rank == 0 and log is not None:
            log_line(log, json.dumps(record), bar)
        if bar is not None:
            bar.update()
        scheduler_cpu.sample(scheduler_pid(engine.module))
    if bar is not None:
        bar.close()
    if history and (percent := scheduler_cpu.percent()) is not None:
        history[-1]["scheduler_cpu_percent"] = round(percent, 2)
    return history, engine


def main() -> None:
    args = build_parser().parse_args()
    try:  # before the process group: one line per rank at once, not a traceback per rank after its start
        import transformers  # noqa: F401 - only checks that it is installed
    except ImportError:
        if int(os.environ.get("RANK", "0")) == 0:
            print("train_hf_moe.py needs Hugging Face transformers (>=5.0,<5.23): pip install -e '.[hf]'",
                  file=sys.stderr)
        sys.exit(1)
    deepspeed_feplb.init_distributed()  # deepspeed.init_distributed, without DeepSpeed's CPU shm op build
    history, engine = train(args, log=lambda line: print(line, flush=True))
    if dist.get_rank() == 0 and history:
        summarize(history, engine.train_batch_size() * args.seq, feplb=not args.no_feplb, baseline="AutoEP")
    dist.barrier()
    deepspeed_feplb.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
