"""Pipeline variant: the byte-level MoE LM on 2 pipeline stages x 2 expert-parallel ranks, with FEPLB.

    OMP_NUM_THREADS=1 deepspeed --num_gpus 4 examples/train_moe_pipe.py --deepspeed_config examples/ds_config_pipe.json

Four ranks: stage 0 = ranks 0-1 (embedding + MoE block), stage 1 = ranks 2-3 (MoE block + head);
inside each stage the two ranks are one expert-parallel group and one NVLink domain, and the
two stages' MoE blocks are balanced independently. `deepspeed_feplb.initialize` builds the FEPLB
pipeline engine (1F1B with per-micro-batch FEPLB bookkeeping); every step prints one JSON line
(rank 0) with the loss and the per-layer FEPLB stats of all stages. No auxiliary loss.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import deepspeed
import numpy as np
import torch
from deepspeed.pipe import PipelineModule

import deepspeed_feplb

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_moe import batches, stdlib_bytes


class EmbedMix(torch.nn.Module):
    """context bytes int64 ``[B, context]`` -> hidden ``[B, H]``."""

    def __init__(self, hidden: int, context: int):
        super().__init__()
        self.embed = torch.nn.Embedding(256, hidden)
        self.mix = torch.nn.Linear(context * hidden, hidden)

    def forward(self, context_bytes: torch.Tensor) -> torch.Tensor:
        return self.mix(self.embed(context_bytes).flatten(1))


class MoEBlock(torch.nn.Module):
    """``h + MoE(h)``: tensor -> tensor, as a pipeline stage needs (no auxiliary loss)."""

    def __init__(self, hidden: int, experts: int, ep_size: int, k: int):
        super().__init__()
        expert = torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                     torch.nn.Linear(4 * hidden, hidden))
        self.moe = deepspeed_feplb.MoE(hidden, expert, num_experts=experts, ep_size=ep_size, k=k, min_capacity=0,
                                       drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.moe(h)[0]


def build_model(args, ep_size: int) -> PipelineModule:
    torch.manual_seed(0)  # every rank builds every layer identically; each keeps its stage's
    layers = [EmbedMix(args.hidden, args.context),
              MoEBlock(args.hidden, args.experts, ep_size, args.top_k),
              MoEBlock(args.hidden, args.experts, ep_size, args.top_k),
              torch.nn.Linear(args.hidden, 256)]
    return PipelineModule(layers=layers, num_stages=args.stages, loss_fn=torch.nn.CrossEntropyLoss(),
                          partition_method="uniform")


def train(args, ds_config=None, log=print) -> list[dict]:
    """Train ``args.steps`` pipeline steps; returns one record per step (the same on every rank)."""
    world = torch.distributed.get_world_size()
    ep_size = world // args.stages  # every rank of a stage is in the stage's expert-parallel group
    model = build_model(args, ep_size)
    engine, _, _, _ = deepspeed_feplb.initialize(args=args if ds_config is None else None, model=model,
                                                 model_parameters=[p for p in model.parameters() if p.requires_grad],
                                                 config=ds_config)
    # stage 0 reads inputs, the last stage reads labels; data-parallel replicas read different text
    data = stdlib_bytes()
    stream = batches(data, engine.train_micro_batch_size_per_gpu(), args.context,
                     seed=1000 + engine.grid.get_data_parallel_rank())
    history = []
    for _ in range(args.steps):
        loss = engine.train_batch(data_iter=stream)
        summary = engine.feplb_monitor.last or {"layers": {}}
        record = {"step": engine.global_steps, "loss": round(float(loss), 6)}  # 1-based, as DeepSpeed's monitor
        record.update({key: summary[key] for key in ("token_straggler_before", "token_straggler_after",
                                                     "gemm_straggler_ms", "migrated_tokens", "migrated_bytes",
                                                     "fallbacks") if key in summary})
        record["micro_batches"] = summary.get("micro_batches")
        record["layers"] = summary["layers"]
        history.append(record)
        if torch.distributed.get_rank() == 0 and log is not None:
            log(json.dumps(record))
    return history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--context", type=int, default=8)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed_feplb.init_distributed()  # deepspeed.init_distributed, without DeepSpeed's CPU shm op build
    history = train(args, log=lambda line: print(line, flush=True))
    if torch.distributed.get_rank() == 0 and history:
        summarize(history)
    torch.distributed.barrier()
    deepspeed_feplb.shutdown()
    torch.distributed.destroy_process_group()


def summarize(history: list[dict]) -> None:
    print(f"\nFEPLB pipeline over {len(history)} steps ({history[-1]['micro_batches']} micro-batches each), "
          "mean per step and layer:")
    for name in history[-1]["layers"]:
        rows = [h["layers"][name] for h in history if name in h["layers"]]
        before = np.mean([r.get("token_straggler_before", 0.0) for r in rows])
        after = np.mean([r.get("token_straggler_after", 0.0) for r in rows])
        warm = [r["warm_start_token_straggler"] for r in rows if "warm_start_token_straggler" in r]
        gemm = np.median([r["gemm_straggler_ms"] for r in rows])
        migrated = sum(r.get("migrated_tokens", 0) for r in rows)
        print(f"  layer {name}: token straggler {before:.1f} -> {after:.1f}"
              + (f" (warm-start plan would leave {np.mean(warm):.1f})" if warm else "")
              + f"   GEMM straggler median {gemm:.2f} ms   migrated tokens {migrated}")
    print(f"  loss {history[0]['loss']} -> {history[-1]['loss']}   OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")


if __name__ == "__main__":
    main()
