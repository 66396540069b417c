"""Measure a Copy-Engine copy on a side stream overlapping a large bf16 GEMM; print/write JSON.

Figures (all measured here, none assumed):
  gemm_ms_alone, gemm_ms_with_copy, gemm_slowdown (ratio), copy_gbps_alone, copy_gbps_with_gemm,
  hbm_add_ms_alone / _with_copy / _slowdown (an HBM-bound streaming add under the same copies),
  copy_kind ("peer" between GPU 0 and 1 with P2P on, else "d2h" into pinned host memory, which also
  runs on a copy engine), device names. Usage: python bench_ce_overlap.py OUT.json
"""
import json
import sys
import time

import torch


def timed(fn, stream, reps):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        fn()  # warm-up
        start.record(stream)
        for _ in range(reps):
            fn()
        end.record(stream)
    return start, end


def main(out_path):
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
    nbytes = 256 << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    peer = torch.cuda.device_count() > 1 and torch.cuda.can_device_access_peer(0, 1)
    if peer:
        dst = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", 1))
        kind = "peer"
    else:
        dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        kind = "d2h"
    compute, side = torch.cuda.Stream(dev), torch.cuda.Stream(dev)

    def gemm():
        torch.matmul(a, b, out=c)

    def copy():
        dst.copy_(src, non_blocking=True)

    reps_g, reps_c = 50, 20
    s, e = timed(gemm, compute, reps_g)
    torch.cuda.synchronize()
    gemm_alone = s.elapsed_time(e) / reps_g
    s, e = timed(copy, side, reps_c)
    torch.cuda.synchronize()
    copy_alone = s.elapsed_time(e) / reps_c
    # overlapped: enough copies to cover the GEMM loop
    reps_c2 = max(1, int(gemm_alone * reps_g / copy_alone) + 2)
    torch.cuda.synchronize()
    sg, eg = timed(gemm, compute, reps_g)
    sc, ec = timed(copy, side, reps_c2)
    torch.cuda.synchronize()
    gemm_with = sg.elapsed_time(eg) / reps_g
    copy_with = sc.elapsed_time(ec) / reps_c2
    # an HBM-bound kernel (a streaming add over 1 GiB) alone and under the same copies
    big = torch.empty(1 << 29, device=dev, dtype=torch.bfloat16)

    def stream_add():
        big.add_(1)

    reps_h = 20
    sh, eh = timed(stream_add, compute, reps_h)
    torch.cuda.synchronize()
    hbm_alone = sh.elapsed_time(eh) / reps_h
    reps_c3 = max(1, int(hbm_alone * reps_h / copy_alone) + 2)
    sh, eh = timed(stream_add, compute, reps_h)
    timed(copy, side, reps_c3)
    torch.cuda.synchronize()
    hbm_with = sh.elapsed_time(eh) / reps_h
    flops = 2 * n ** 3
    result = {
        "device": torch.cuda.get_device_name(dev), "device_count": torch.cuda.device_count(), "copy_kind": kind,
        "gemm_shape": [n, n, n], "gemm_ms_alone": gemm_alone, "gemm_ms_with_copy": gemm_with,
        "gemm_slowdown": gemm_with / gemm_alone, "gemm_tflops_alone": flops / gemm_alone / 1e9,
        "copy_bytes": nbytes, "copy_gbps_alone": nbytes / copy_alone / 1e6,
        "copy_gbps_with_gemm": nbytes / copy_with / 1e6,
        "hbm_add_ms_alone": hbm_alone, "hbm_add_ms_with_copy": hbm_with, "hbm_add_slowdown": hbm_with / hbm_alone,
        "hbm_add_gbps_alone": 2 * big.numel() * big.element_size() / hbm_alone / 1e6,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    print(json.dumps(result, indent=1))
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "ce_overlap.json")
