"""Save a FEPLB-trained MoE model with DeepSpeed's checkpointing; load it with FEPLB and without.

    OMP_NUM_THREADS=1 deepspeed --num_gpus 2 examples/checkpoint_moe.py --deepspeed_config examples/ds_config.json

Trains the byte-level model of examples/train_moe.py for ``--steps`` steps through
``deepspeed_feplb.initialize`` and saves it with ``engine.save_checkpoint``. FEPLB keeps
DeepSpeed's parameters and their names (``moe.deepspeed_moe.experts.deepspeed_experts.N...``),
so the checkpoint is an ordinary DeepSpeed MoE checkpoint (one file per expert): it loads into an
engine built with ``"feplb": {"enabled": false}`` (DeepSpeed's own MoE layer) and into a FEPLB
engine alike. The saved engine then trains ``--check-steps`` more steps; each loaded engine trains
the same steps on the same batches, and every loss must match the saved engine's (fp32, 1e-5
relative; from the second step on this needs the checkpoint's optimizer state too). The script
exits with status 1 when they do not.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import deepspeed
import torch
import torch.distributed as dist

import deepspeed_feplb

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_moe import ByteMoELM, as_dict, batches, feplb_off, stdlib_bytes

TOLERANCE = 1e-5  # relative, fp32: FEPLB on and off compute the same losses up to summation order


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps before the checkpoint")
    parser.add_argument("--check-steps", type=int, default=2, help="optimizer steps compared after loading")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="where to save and keep the checkpoint (the same path on every rank); default: a new "
                             "temporary folder, removed at the end")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--context", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256, help="tokens per rank and micro-batch")
    parser.add_argument("--local_rank", type=int, default=-1)
    return deepspeed.add_config_arguments(parser)


def new_engine(args, ds_config):
    """A fresh engine of `ByteMoELM` (seeded: every engine starts from the same weights)."""
    torch.manual_seed(0)
    model = ByteMoELM(args.hidden, args.experts, ep_size=dist.get_world_size(), k=args.top_k, context=args.context)
    engine, _, _, _ = deepspeed_feplb.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    return engine


def train_steps(engine, micro_batches: list) -> list[float]:
    """Forward, backward and ``engine.step()`` on each micro-batch; returns their losses (this rank)."""
    loss_fn = torch.nn.CrossEntropyLoss()
    losses = []
    for x, y in micro_batches:
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def eval_loss(engine, x: torch.Tensor, y: torch.Tensor) -> float:
    """The loss of ``engine``'s current weights on one micro-batch, without training."""
    engine.eval()
    with torch.no_grad():
        loss = torch.nn.CrossEntropyLoss()(engine(x), y).item()
    engine.train()
    return loss


def round_trip(args, ds_config, checkpoint_dir: str, log=print) -> dict:
    """Train, save, load into a DeepSpeed-MoE and a FEPLB engine; collective over the world.

    ``ds_config``: a dict or path, whose ``"feplb"`` section the saving and the FEPLB engine use.
    Returns this rank's losses ``{"saved": [...], "deepspeed": [...], "feplb": [...]}`` of the
    ``args.check_steps`` steps after the checkpoint (one per micro-batch), ``"fresh"``: the
    not-loaded model's loss on the first of them, and ``"keys"``: the MoE layer's state_dict keys.
    ``log`` (rank 0 only; None: quiet) gets what the script prints.
    """
    rank = dist.get_rank()
    say = log if rank == 0 and log is not None else (lambda line: None)
    ds_config = as_dict(ds_config)
    engine = new_engine(args, ds_config)
    per_step = engine.gradient_accumulation_steps()
    stream = batches(stdlib_bytes(), args.batch, args.context, seed=1000 + rank)
    before = [next(stream) for _ in range(args.steps * per_step)]
    after = [next(stream) for _ in range(args.check_steps * per_step)]  # the same batches for every engine

    train_steps(engine, before)
    engine.save_checkpoint(checkpoint_dir)
    tag = f"global_step{engine.global_steps}"
    keys = list(engine.module.moe.state_dict())
    say(f"saved {os.path.join(checkpoint_dir, tag)} after {engine.global_steps} steps: "
        f"{', '.join(sorted(os.listdir(os.path.join(checkpoint_dir, tag)))[:3])}, ...")
    say("MoE layer state_dict keys (DeepSpeed's own names): " + ", ".join(keys[:3]) + ", ...")
    losses = {"saved": train_steps(engine, after), "keys": keys}
    del engine

    for name, config in (("deepspeed", feplb_off(ds_config)), ("feplb", ds_config)):
        engine = new_engine(args, config)
        if name == "deepspeed":
            losses["fresh"] = eval_loss(engine, *after[0])
        path, _ = engine.load_checkpoint(checkpoint_dir, tag=tag)
        if path is None:  # DeepSpeed only warns when it finds nothing to load
            raise FileNotFoundError(f"no checkpoint {tag} in {checkpoint_dir}: pass the same --checkpoint-dir on "
                                    "every rank (a directory every rank can read)")
        losses[name] = train_steps(engine, after)
        del engine
    return losses


def worst_difference(losses: dict) -> float:
    """Largest relative difference of the loaded engines' losses to the saved engine's, over all ranks."""
    mine = max(abs(a - b) / abs(b) for name in ("deepspeed", "feplb") for a, b in zip(losses[name], losses["saved"]))
    worst = torch.tensor([mine], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def rounded(losses: list[float]) -> list[float]:
    return [round(loss, 6) for loss in losses]


def main() -> None:
    args = build_parser().parse_args()
    if args.deepspeed_config is None:
        raise SystemExit("checkpoint_moe.py: pass --deepspeed_config PATH (e.g. examples/ds_config.json)")
    deepspeed_feplb.init_distributed()  # deepspeed.init_distributed, without DeepSpeed's CPU shm op build
    checkpoint_dir = args.checkpoint_dir
    if checkpoint_dir is None:  # rank 0 makes it, every rank uses it, rank 0 removes it at the end
        where = [tempfile.mkdtemp(prefix="feplb_checkpoint_moe-") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(where, src=0)
        checkpoint_dir = where[0]
    losses = round_trip(args, args.deepspeed_config, checkpoint_dir, log=lambda line: print(line, flush=True))
    worst = worst_difference(losses)
    if dist.get_rank() == 0:
        print(f"losses after the checkpoint (rank 0), saved engine:  {rounded(losses['saved'])}")
        print(f"  loaded into FEPLB off (DeepSpeed MoE):              {rounded(losses['deepspeed'])}")
        print(f"  loaded into FEPLB on:                               {rounded(losses['feplb'])}")
        print(f"  not loaded (fresh weights), first step: {losses['fresh']:.6f}")
        print(f"{'match' if worst <= TOLERANCE else 'MISMATCH'}: largest relative difference {worst:.2e} "
              f"over all ranks (tolerance {TOLERANCE:.0e})")
    dist.barrier()
    if args.checkpoint_dir is None and dist.get_rank() == 0:
        shutil.rmtree(checkpoint_dir, ignore_errors=True)
    deepspeed_feplb.shutdown()
    dist.destroy_process_group()
    if worst > TOLERANCE:
        sys.exit(1)


if __name__ == "__main__":
    main()
