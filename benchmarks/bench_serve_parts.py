"""Results part by part, measured on CPU: a balanced layer's step with helpers returning one home's
results in one message against in parts, through the Copy-Engine transport's code path with a copy
bandwidth emulated on host memory.

    OMP_NUM_THREADS=1 python benchmarks/bench_serve_parts.py [--json OUT]

Two gloo ranks, one DeepSpeed-kind FEPLB layer per variant (the same weights, seed and routing:
16 experts top-2, hidden 128, ffn 256, 4,096 tokens per rank, the gate skewed towards rank 0's
experts so that about a third of its rows move to rank 1). Phase 2 runs through `CudaCETransport`
on `HostBackend(copy_gbps=...)`: each copy sleeps ``nbytes / copy_gbps`` on its stream's thread
before it lands, as the copy engine's bandwidth would delay it (no CPU time), so a helper's
results reach their home only that long after they are computed. The default 0.5 GB/s makes a
row's copy about a fifth of its forward compute here, near an H100's ratio for GLM-5-sized experts
(row copy 0.033 µs against 0.167 µs of forward GEMM in the simulator's profile).

Variants, interleaved micro-batch by micro-batch: ``1 part`` (``feplb.serve_parts: 1``) and ``4
parts`` (``serve_parts: 4``, ``serve_part_rows: 512``). Per micro-batch the slower rank's host time
for forward + backward; medians over ``--reps`` micro-batches after warm-up, their ratio, and the
load average around the run. A CPU measurement with an emulated copy engine, not a GPU figure.

``--device cuda``: both ranks on GPU 0 through the real `CudaCETransport` (CUDA IPC between the two
processes, copies on the copy engine; ``--copy-gbps`` does not apply), bf16 where the GPU runs
its grouped GEMM natively; the device check's ``serve_parts`` stage runs it so.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {"1 part": {"serve_parts": 1}, "4 parts": {"serve_parts": 4, "serve_part_rows": 512}}


def _worker(opts: dict) -> dict:
    import torch
    import torch.distributed as dist

    import deepspeed_feplb
    from deepspeed_feplb import expert_stage
    from deepspeed_feplb.migrate.backend import HostBackend
    from deepspeed_feplb.migrate.cuda_ce import on_host

    cuda = opts["device"] == "cuda"
    dev, dtype = (torch.device("cuda", 0), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    if cuda:
        torch.cuda.set_device(0)
    else:
        emulated = on_host(lambda prefix, _: HostBackend(prefix=prefix, copy_gbps=opts["copy_gbps"]))
        expert_stage.transport_class = lambda config, expert_params: emulated
    hidden, ffn, experts, tokens = opts["hidden"], opts["ffn"], opts["experts"], opts["tokens"]
    layers = {}
    for name, parts in VARIANTS.items():
        torch.manual_seed(0)
        expert = torch.nn.Sequential(torch.nn.Linear(hidden, ffn), torch.nn.GELU(), torch.nn.Linear(ffn, hidden))
        feplb = {"nvlink_domain_size": 2, "dynamic_experts_per_rank": 2, "chunk_align_tokens": 8,
                 "fixed_costs": "ignore", "scheduler": {"start_after_steps": 0}, "max_helpers_per_expert": 1,
                 "transport": "cuda_ce" if cuda else "shm", **parts}
        layer = deepspeed_feplb.MoE(hidden_size=hidden, expert=expert, num_experts=experts, ep_size=2, k=opts["k"],
                                    min_capacity=0, drop_tokens=False, use_rts=False, feplb_config=feplb)
        with torch.no_grad():  # no auxiliary loss: the gate favours rank 0's experts
            layer.deepspeed_moe.gate.wg.weight[:experts // 2] += opts["skew"] / hidden
        layer.set_deepspeed_parallelism()
        layers[name] = layer.to(dev, dtype)
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    batches = [((torch.randn(tokens, hidden, generator=g) + 1.0).to(dev, dtype),
                torch.randn(tokens, hidden, generator=g).to(dev, dtype)) for _ in range(4)]
    times = {name: [] for name in layers}
    migrated = {}
    for rep in range(opts["warmup"] + opts["reps"]):
        for name, layer in layers.items():  # interleaved: noise hits both variants alike
            x, w = batches[rep % len(batches)]
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            out, l_aux, _ = layer(x.clone().requires_grad_(True))
            ((out * w).sum() + l_aux).backward()
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            if rep >= opts["warmup"]:
                times[name].append(elapsed * 1e6)
            migrated[name] = int(layer.feplb_stats.get("migrated_tokens", 0))
    dist.barrier()
    return {"host_us": times, "migrated_rows": migrated}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--skew", type=float, default=3.0, help="gate skew towards rank 0's experts")
    parser.add_argument("--copy-gbps", type=float, default=0.5, help="emulated copy bandwidth, GB/s (CPU)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: both ranks on GPU 0, the real CE transport")
    parser.add_argument("--reps", type=int, default=30, help="timed micro-batches per variant")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if ROOT not in sys.path:
        sys.path.append(ROOT)

    load = os.getloadavg()[0]
    result = measure(vars(args))
    result["load_average_1m"] = [round(load, 2), round(os.getloadavg()[0], 2)]
    for name, v in result["variants"].items():
        print(f"{name:<8} forward + backward, slower rank: median {v['median_us']:>9.0f} µs "
              f"(p10 {v['p10_us']:.0f}, p90 {v['p90_us']:.0f})")
    print(f"4 parts / 1 part: {result['4 parts / 1 part']}; rows rank 0 moved: {result['migrated_rows_rank0']}; "
          f"load average (1 min) before / after: {result['load_average_1m']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def measure(opts: dict) -> dict:
    """Both variants on 2 ranks (`_worker`): medians, p10 and p90 of the slower rank's micro-batch
    time, their ratio, the rows rank 0 moved, and the commit measured."""
    from deepspeed_feplb.testing import run_distributed

    ranks = run_distributed(_worker, 2, opts, timeout=1800)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    result = {"commit": commit, "shape": {k: v for k, v in opts.items() if k != "json"},
              "migrated_rows_rank0": ranks[0]["migrated_rows"], "variants": {}}
    for name in VARIANTS:
        slower = [max(pair) for pair in zip(*(r["host_us"][name] for r in ranks))]
        result["variants"][name] = {"median_us": round(statistics.median(slower), 1),
                                    "p10_us": round(statistics.quantiles(slower, n=10)[0], 1),
                                    "p90_us": round(statistics.quantiles(slower, n=10)[-1], 1)}
    result["4 parts / 1 part"] = round(result["variants"]["4 parts"]["median_us"]
                                       / result["variants"]["1 part"]["median_us"], 3)
    return result


if __name__ == "__main__":
    sys.exit(main())
