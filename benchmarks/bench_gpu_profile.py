"""The cost model against a real GPU: expert GEMM times measured on the CUDA device, fitted, and
the simulator's verdict on the shipped traces under the measured profile next to the named one.

    python benchmarks/bench_gpu_profile.py --out DIR        # on a GPU machine (needs CUDA)

For each expert shape (GLM-5-like 6144 x 2048 and DeepSeek-V3-like 7168 x 2048, gated, bf16) it
times one expert's forward (`sim.calibrate.expert_times_us`: best of 5 means of 10 calls, CUDA
events) over 16 to 32,768 rows, fits ``t(n) = max(floor, overhead + ceil(n / tile) * tile * flops / rate)``
(`sim.calibrate.fit_profile`) and reports the fit's worst relative error and what the named
``h200`` profile predicts for the same rows. It then replays the shipped 8-rank traces through
vanilla EP, EPLB and FEPLB (D=4, 8 micro-batches per step, residency ``step``) under both profiles.
Writes ``DIR/gpu_profile.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {"glm5": (6144, 2048), "deepseek_v3": (7168, 2048)}
TRACES = ("stdlib_moe_ep8_4k.npz", "stdlib_moe_ep8_32k.npz")


def measure(hidden: int, ffn: int) -> dict:
    import numpy as np

    from deepspeed_feplb.plan.cost import PROFILES, ExpertShape, gemm_us
    from deepspeed_feplb.sim.calibrate import _GPU_ROWS, expert_times_us, fit_profile

    shape = ExpertShape(hidden=hidden, ffn_hidden=ffn)
    times = expert_times_us(shape, "cuda", _GPU_ROWS)
    fitted = fit_profile("gpu", shape, _GPU_ROWS, times, (1, 2, 4, 8, 16, 32, 64, 128, 256),
                         PROFILES["h200"].ce_gbps, PROFILES["h200"].net_gbps)
    line = fit_profile("gpu", shape, _GPU_ROWS, times, (1, 2, 4, 8, 16, 32, 64, 128, 256),
                       PROFILES["h200"].ce_gbps, PROFILES["h200"].net_gbps, floor=False)
    rows = np.asarray(_GPU_ROWS)
    predicted = gemm_us(rows, shape, fitted)
    named = gemm_us(rows, shape, PROFILES["h200"])
    return {"rows": list(_GPU_ROWS), "measured_us": [round(t, 2) for t in times],
            "fitted": {"tflops": round(fitted.tflops, 1), "tile_m": fitted.tile_m,
                       "overhead_us": round(fitted.overhead_us, 2), "floor_us": round(fitted.floor_us, 2)},
            "fit_worst_relative_error": round(float(np.max(np.abs(predicted - times) / times)), 3),
            "line_fit_worst_relative_error": round(float(np.max(np.abs(gemm_us(rows, shape, line) - times) / times)),
                                                   3),
            "h200_profile_us": [round(float(t), 2) for t in named],
            "h200_over_measured": [round(float(n / t), 3) for n, t in zip(named, times)],
            "tflops_at_rows": [round(2 * 3 * hidden * ffn * n / (t * 1e6), 1) for n, t in zip(_GPU_ROWS, times)]}


def simulate(trace: str, profile: str, out: Path) -> dict:
    path = out / f"sim_{Path(trace).stem}_{profile}.json"
    cmd = [sys.executable, "-m", "deepspeed_feplb", "simulate",
           "--trace", str(ROOT / "deepspeed_feplb/trace/data" / trace),
           "--ranks-per-node", "8", "--dynamic-experts", "4", "--micro-batches-per-step", "8", "--residency", "step",
           "--hidden", "6144", "--ffn-hidden", "2048", "--profile", profile, "--policies", "vanilla,eplb,feplb",
           "--json", str(path)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    if run.returncode:
        return {"error": (run.stdout + run.stderr)[-2000:]}
    result = json.loads(path.read_text())
    keep = ("token_max_over_mean", "gemm_straggler_us", "expert_time_us", "weight_bytes_per_step", "copy_exposed_us")
    return {name: {k: v for k, v in metrics.items() if k in keep} for name, metrics in result["policies"].items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for gpu_profile.json")
    args = parser.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("bench_gpu_profile: needs a CUDA device; torch sees none", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"), "shapes": {}, "simulate": {}}
    for name, (hidden, ffn) in SHAPES.items():
        result["shapes"][name] = measure(hidden, ffn)
        print(name, json.dumps(result["shapes"][name]), flush=True)
        (out / "gpu_profile.json").write_text(json.dumps(result, indent=1))
    for trace in TRACES:
        for profile in ("h200", "gpu"):
            result["simulate"][f"{trace} {profile}"] = simulate(trace, profile, out)
            print(trace, profile, json.dumps(result["simulate"][f"{trace} {profile}"]), flush=True)
            (out / "gpu_profile.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
