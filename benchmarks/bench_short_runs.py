"""What FEPLB costs a job made of many short runs (a test suite, a sweep), next to DeepSpeed's MoE.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_short_runs.py [--runs 20] [--ranks 4]

One job of ``--ranks`` gloo CPU processes performs ``--runs`` short runs, each: build a small MoE
model, ``deepspeed.initialize`` it, train ``--steps`` steps, release everything (FEPLB:
`deepspeed_feplb.shutdown()`, which stops the scheduler process and removes the shared memory).
The same job runs with `deepspeed.moe.layer.MoE` and with `deepspeed_feplb.MoE`, alternating
(DeepSpeed, FEPLB, DeepSpeed, FEPLB, ...) so that machine noise hits both alike. Reported: wall
time of each job (spawning the ranks included), their medians and the ratio. FEPLB's share
includes its scheduler process start-up, the numba cache load and the segment set-up.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _job(kind: str, runs: int, steps: int, feplb: dict | None = None) -> float:
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    import deepspeed_feplb

    start = time.perf_counter()
    world = dist.get_world_size()
    config = {"train_batch_size": world, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**6,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "feplb": {"dynamic_experts_per_rank": 2, "chunk_align_tokens": 8, **(feplb or {})}}
    for run in range(runs):
        torch.manual_seed(run)
        layer_cls = DeepSpeedMoE if kind == "deepspeed" else deepspeed_feplb.MoE
        expert = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
        model = torch.nn.ModuleDict({"moe": layer_cls(hidden_size=32, expert=expert, num_experts=2 * world,
                                                      ep_size=world, k=2, min_capacity=0, drop_tokens=False,
                                                      use_rts=False, top2_2nd_expert_sampling=False)})
        init = deepspeed.initialize if kind == "deepspeed" else deepspeed_feplb.initialize
        engine, *_ = init(model=model, model_parameters=model.parameters(), config=config)
        for _ in range(steps):
            x = torch.randn(256, 32) * (1 + torch.arange(32) / 8)  # skewed routing
            out, _, _ = engine.module["moe"](x)
            engine.backward(out.square().mean())
            engine.step()
        del engine, model
        if kind == "feplb":
            deepspeed_feplb.shutdown()
    dist.barrier()
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="short runs per job")
    parser.add_argument("--steps", type=int, default=3, help="training steps per run")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3, help="jobs per kind (alternating)")
    parser.add_argument("--json", metavar="OUT")
    parser.add_argument("--feplb", type=json.loads, default={}, metavar="JSON",
                        help='keys merged into the "feplb" section, e.g. \'{"stats": {"enabled": false}}\' to see '
                             "what a feature costs")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from deepspeed_feplb.testing import run_distributed

    load_before = os.getloadavg()[0]
    walls: dict[str, list] = {"deepspeed": [], "feplb": []}
    inside: dict[str, list] = {"deepspeed": [], "feplb": []}
    for _ in range(args.repeat):
        for kind in walls:
            start = time.perf_counter()
            per_rank = run_distributed(_job, args.ranks, kind, args.runs, args.steps, args.feplb, timeout=1800)
            walls[kind].append(time.perf_counter() - start)
            inside[kind].append(max(per_rank))
    load_after = os.getloadavg()[0]
    median = {k: sorted(v)[len(v) // 2] for k, v in walls.items()}
    print(f"{args.ranks} ranks, {args.runs} runs of {args.steps} steps per job, {args.repeat} jobs per kind "
          f"(alternating); load average {load_before:.2f} before, {load_after:.2f} after, {os.cpu_count()} cores")
    for kind in walls:
        print(f"{kind:<10} job wall s: {', '.join(f'{w:.1f}' for w in walls[kind])}   median {median[kind]:.1f} "
              f"(inside the ranks: median {sorted(inside[kind])[len(inside[kind]) // 2]:.1f})")
    print(f"FEPLB / DeepSpeed (median job wall time): {median['feplb'] / median['deepspeed']:.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "walls": walls, "inside": inside, "load": [load_before, load_after]}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
