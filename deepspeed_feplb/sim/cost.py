"""The simulator's cost model: expert-GEMM time with tile quantisation, Copy-Engine time.

Expert GEMM (forward) of ``n`` rows on one rank::

    t(n) = 0                                                   if n == 0
         = overhead_us + ceil(n / tile_m) * tile_m * flops_per_row / (tflops * 1e6)   [µs]

with ``flops_per_row = 2 * mats * hidden * ffn_hidden`` (``mats`` = 3 for a gated (SwiGLU) expert,
2 for a plain MLP). ``tile_m`` models the row tile of a grouped GEMM: every expert's rows are padded
to a whole tile, so splitting an expert into chunks that are not tile multiples costs compute.
A rank's GEMM time is the sum over the expert pieces it computes.

Profiles:

* ``h100``: sustained 453 TFLOP/s per GPU for the grouped expert GEMM, 128-row tiles, 2 µs per
  expert piece. 453 TFLOP/s is what makes the paper's EP=8 numbers agree with each other (a token
  straggler of 6,666 tokens costing a 1.110 ms GEMM straggler on GLM-5's 6144 x 2048 SwiGLU
  experts). Copy Engine 370 GB/s one way per GPU pair (DESIGN §6), 50 GB/s per GPU across nodes
  (400 Gb/s NIC).
* ``h200``: the same SMs with faster HBM: 480 TFLOP/s sustained, otherwise as ``h100``.
* ``cpu``: measured here by :func:`calibrate_cpu` (real torch GEMMs: sustained rate, per-call
  overhead and the row tile that fits best), with shared-memory "copy engine" bandwidth measured
  the same way.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

__all__ = ["GemmProfile", "PROFILES", "get_profile", "calibrate_cpu", "ExpertShape", "gemm_us", "rank_gemm_us"]


@dataclass(frozen=True)
class GemmProfile:
    """name; tflops: sustained expert-GEMM rate; tile_m: row tile; overhead_us: fixed cost per
    expert piece; ce_gbps: Copy-Engine bandwidth one way per GPU (GB/s); net_gbps: cross-node
    bandwidth per GPU (GB/s)."""

    name: str
    tflops: float
    tile_m: int
    overhead_us: float
    ce_gbps: float
    net_gbps: float


PROFILES = {
    "h100": GemmProfile("h100", 453.0, 128, 2.0, 370.0, 50.0),
    "h200": GemmProfile("h200", 480.0, 128, 2.0, 370.0, 50.0),
}


@dataclass(frozen=True)
class ExpertShape:
    """hidden, ffn_hidden; mats: 3 for a gated (SwiGLU) expert, 2 for a plain MLP; dtype_bytes."""

    hidden: int = 6144
    ffn_hidden: int = 2048
    mats: int = 3
    dtype_bytes: int = 2

    @property
    def flops_per_row(self) -> float:
        return 2.0 * self.mats * self.hidden * self.ffn_hidden

    @property
    def weight_bytes(self) -> int:
        return self.mats * self.hidden * self.ffn_hidden * self.dtype_bytes

    @property
    def row_bytes(self) -> int:
        return self.hidden * self.dtype_bytes


def gemm_us(tokens: np.ndarray, shape: ExpertShape, profile: GemmProfile) -> np.ndarray:
    """tokens int64 [...] (rows of one expert piece each) -> float64 [...] forward GEMM µs."""
    tokens = np.asarray(tokens, dtype=np.int64)
    tiles = -(-tokens // profile.tile_m)
    t = tiles * (profile.tile_m * shape.flops_per_row / (profile.tflops * 1e6)) + profile.overhead_us
    return np.where(tokens > 0, t, 0.0)


def rank_gemm_us(ranks: np.ndarray, tokens: np.ndarray, num_ranks: int, shape: ExpertShape,
                 profile: GemmProfile) -> np.ndarray:
    """Expert pieces (ranks int64 [P], tokens int64 [P]) -> float64 [num_ranks]: each rank's
    forward expert-GEMM time (µs), the sum over the pieces it computes."""
    return np.bincount(np.asarray(ranks, dtype=np.int64), weights=gemm_us(tokens, shape, profile),
                       minlength=num_ranks)


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


def scaled(profile: GemmProfile, **changes) -> GemmProfile:
    """A copy of ``profile`` with some fields changed."""
    return replace(profile, **changes)
