"""Train a tiny Hugging Face MoE model (Mixtral or Qwen3-MoE) with DeepSpeed AutoEP + FEPLB.

    OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/train_hf_moe.py --model mixtral

The model is built from its config with random weights (no download). AutoEP shards its experts
over the ranks (``"expert_parallel"``); ``deepspeed_feplb.initialize`` adds FEPLB phase 2 to
every AutoEP layer, driven by the ``"feplb"`` section. ``--skew`` biases the routers towards
rank 0's experts (as a real model's hot experts would be), so FEPLB has something to balance.
Every step prints one JSON line (rank 0): loss, and per MoE layer the rows each rank computed
before and after balancing and the token stragglers (docs/ARCHITECTURE.md, "Metrics"). Needs ``transformers>=5.0,<5.23``
(docs/AUTOEP.md).
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

import deepspeed_feplb
from deepspeed_feplb.integration.autoep import autoep_stats


def tiny_model(name: str, hidden: int, layers: int, experts: int, skew: float, seed: int):
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=128, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["mixtral", "qwen3_moe"], default="mixtral")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--zero", type=int, default=1, choices=[0, 1, 2])
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--no-feplb", action="store_true", help="plain AutoEP, for comparison")
    parser.add_argument("--skew", type=float, default=1.0, help="router bias towards rank 0's experts (0: none)")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--local_rank", type=int, default=-1)  # passed by the deepspeed launcher
    args = parser.parse_args()

    import importlib

    import deepspeed
    if not torch.cuda.is_available():  # DeepSpeed's CPU shm comm op: a compile and 66 MiB in /dev/shm per rank
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed()
    world = dist.get_world_size()
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
        "zero_optimization": {"stage": args.zero},
        "bf16": {"enabled": args.bf16},
        "steps_per_print": 10_000,
        "expert_parallel": {"enabled": True, "autoep_size": world, "preset_model": args.model},
        "feplb": {"enabled": not args.no_feplb, "dynamic_experts_per_rank": 2, "chunk_align_tokens": 8},
    }
    model = tiny_model(args.model, args.hidden, 2, args.experts, args.skew, seed=0)
    engine, _, _, _ = deepspeed_feplb.initialize(model=model, model_parameters=model.parameters(), config=config)

    g = torch.Generator().manual_seed(1000 + dist.get_rank())
    for step in range(args.steps):
        start = torch.randint(0, 128, (args.batch, 1), generator=g)  # learnable: runs of consecutive ids
        ids = (start + torch.arange(args.seq)) % 128
        loss = engine(ids, labels=ids).loss
        stats = autoep_stats(engine.module)
        engine.backward(loss)
        engine.step()
        mean_loss = loss.detach().float().clone()
        dist.all_reduce(mean_loss)
        if dist.get_rank() == 0:
            layers = {name: {k: s[k] for k in ("tokens_before", "tokens_after", "token_straggler_before",
                                                "token_straggler_after", "migrated_tokens", "plan_latency_us")}
                      for name, s in stats.items()}
            print(json.dumps({"step": step, "loss": round(mean_loss.item() / world, 5), "feplb": layers}), flush=True)

    dist.barrier()
    deepspeed_feplb.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
