"""What the weight-change checks cost on this machine (`deepspeed_feplb.weight_watch`).

    OMP_NUM_THREADS=1 python benchmarks/bench_weight_watch.py [--repeat 20] [--json OUT.json]

Per expert shape and dtype: `content_hash` (every bit of the weights; replicas run it once per
accumulation cycle, on the experts whose replicas they hold) and `write_marks` (host only; every
forward of a layer with kept copies or replicas), the median over ``--repeat`` calls, with the
load average while it ran. Shapes: a small expert and a GLM-5-sized one (6144 x 2048, gated: three
matrices); on CPU ranks, fp32 and bf16.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from deepspeed_feplb.weight_watch import content_hash, write_marks  # noqa: E402

SHAPES = {"small 2048x1408 x3": (3, 1408, 2048), "GLM-5 6144x2048 x3": (3, 2048, 6144)}


def median_ms(fn, repeat: int) -> float:
    fn()  # warm: the hash weights of each length are drawn once per process
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    out = {"load_before": os.getloadavg()[0], "threads": torch.get_num_threads(), "cases": {}}
    for name, (mats, rows, cols) in SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            params = [torch.randn(rows, cols).to(dtype) for _ in range(mats)]
            mib = sum(p.numel() * p.element_size() for p in params) / 2**20
            case = {"MiB": round(mib, 1),
                    "content_hash_ms": median_ms(lambda params=params: content_hash(params), args.repeat),
                    "write_marks_us": median_ms(lambda params=params: write_marks(params), args.repeat) * 1e3}
            case["GB_per_s"] = mib * 2**20 / (case["content_hash_ms"] * 1e6)
            out["cases"][f"{name} {str(dtype).removeprefix('torch.')}"] = case
            print(f"{name:>20} {str(dtype):>15}: {mib:7.1f} MiB  content_hash {case['content_hash_ms']:8.1f} ms "
                  f"({case['GB_per_s']:.2f} GB/s)  write_marks {case['write_marks_us']:.1f} µs", flush=True)
    out["load_after"] = os.getloadavg()[0]
    print(f"load average {out['load_before']:.2f} before, {out['load_after']:.2f} after")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
