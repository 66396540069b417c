"""Cost profiles for the simulator: the named ones of `plan.cost`, or ``cpu``, measured here with
real torch GEMMs (the only part of the time model that needs torch)."""
from __future__ import annotations

import time

import numpy as np

from deepspeed_feplb.plan.cost import PROFILES, ExpertShape, GemmProfile

__all__ = ["get_profile", "calibrate_cpu"]


def get_profile(name: str, shape: ExpertShape | None = None) -> GemmProfile:
    """A named profile; ``cpu`` is measured now (needs torch)."""
    if name in PROFILES:
        return PROFILES[name]
    if name == "cpu":
        return calibrate_cpu(shape or ExpertShape(hidden=512, ffn_hidden=1024))
    raise ValueError(f"unknown cost profile {name!r} (one of {sorted(PROFILES) + ['cpu']})")


def _best_time(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def calibrate_cpu(shape: ExpertShape = ExpertShape(hidden=512, ffn_hidden=1024),
                  rows=(1, 8, 16, 24, 32, 64, 96, 128, 256, 512), repeat: int = 5) -> GemmProfile:
    """Measure real torch expert GEMMs on this machine's CPU and fit the cost model.

    For each row count ``n`` it times the forward of one expert of ``shape`` in fp32 (``mats``
    matmuls), then fits ``t(n) = overhead + ceil(n / tile) * tile * flops_per_row / rate`` by least
    squares for each candidate tile in {1, 2, 4, 8, 16, 32} and keeps the best. The "copy engine"
    rate is the measured bandwidth of a large tensor copy."""
    import torch

    w = [torch.randn(shape.hidden, shape.ffn_hidden) for _ in range(shape.mats - 1)]
    w.append(torch.randn(shape.ffn_hidden, shape.hidden))
    times = []
    for n in rows:
        x = torch.randn(n, shape.hidden)

        def run():
            h = x @ w[0]
            for m in w[1:-1]:
                h = h * (x @ m)
            return h @ w[-1]

        run()
        times.append(_best_time(run, repeat) * 1e6)
    rows_a = np.asarray(rows, dtype=np.float64)
    t_a = np.asarray(times)
    best = None
    for tile in (1, 2, 4, 8, 16, 32):
        padded = np.ceil(rows_a / tile) * tile * shape.flops_per_row
        A = np.stack([np.ones_like(padded), padded], axis=1)
        (c0, c1), *_ = np.linalg.lstsq(A, t_a, rcond=None)
        if c1 <= 0:
            continue
        err = float(np.sum((A @ np.array([c0, c1]) - t_a) ** 2))
        if best is None or err < best[0]:
            best = (err, tile, max(0.0, float(c0)), 1.0 / (float(c1) * 1e6))
    if best is None:  # timings too noisy to fit: fall back to the largest size's average rate
        best = (0.0, 1, 0.0, rows_a[-1] * shape.flops_per_row / (t_a[-1] * 1e6))
    src = torch.empty(1 << 23)
    dst = torch.empty_like(src)
    copy_s = _best_time(lambda: dst.copy_(src), repeat)
    gbps = src.numel() * 4 / copy_s / 1e9
    return GemmProfile("cpu", tflops=best[3], tile_m=best[1], overhead_us=best[2], ce_gbps=gbps, net_gbps=gbps / 4)
