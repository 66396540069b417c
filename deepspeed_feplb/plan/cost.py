"""The simulator's cost model: expert-GEMM time with tile quantisation, Copy-Engine time.

Expert GEMM (forward) of ``n`` rows on one rank::

    t(n) = 0                                                   if n == 0
         = max(floor_us, overhead_us + ceil(n / tile_m) * tile_m * flops_per_row / (tflops * 1e6))   [µs]

with ``flops_per_row = 2 * mats * hidden * ffn_hidden`` (``mats`` = 3 for a gated (SwiGLU) expert,
2 for a plain MLP). ``tile_m`` models the row tile of a grouped GEMM: every expert's rows are padded
to a whole tile, so splitting an expert into chunks that are not tile multiples costs compute.
A rank's GEMM time is the sum over the expert pieces it computes. ``floor_us`` is what a piece of
any size costs at least: on an H200 a GLM-5-sized expert's forward takes 45-55 µs for 16 to 256
rows (launches and a tile that does not fill the GPU), then grows with its rows
(benchmarks/GPU.md); the named profiles have none, a measured one (``cpu``, ``gpu``) fits it.

Profiles:

* ``h100``: sustained 453 TFLOP/s per GPU for the grouped expert GEMM, 128-row tiles, 2 µs per
  expert piece. 453 TFLOP/s is what makes the paper's EP=8 numbers agree with each other (a token
  straggler of 6,666 tokens costing a 1.110 ms GEMM straggler on GLM-5's 6144 x 2048 SwiGLU
  experts). Copy Engine 370 GB/s one way per GPU pair, 50 GB/s per GPU across nodes
  (400 Gb/s NIC).
* ``h200``: the same SMs with faster HBM: 480 TFLOP/s sustained, otherwise as ``h100``.
* ``cpu``: measured on this machine by `sim.calibrate.calibrate_cpu` (real torch GEMMs: sustained
  rate, per-call
  overhead and the row tile that fits best), with shared-memory "copy engine" bandwidth measured
  the same way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

__all__ = ["GemmProfile", "PROFILES", "ExpertShape", "gemm_us", "rank_gemm_us", "scaled"]


@dataclass(frozen=True)
class GemmProfile:
    """name; tflops: sustained expert-GEMM rate; tile_m: row tile; overhead_us: fixed cost per
    expert piece; ce_gbps: Copy-Engine bandwidth one way per GPU (GB/s); net_gbps: cross-node
    bandwidth per GPU (GB/s); message_us: fixed latency of one phase-2 message (0: an ideal
    transport; `cuda_ce` measured 190-285 µs one way for a small message on an H200, docs/GPU.md); floor_us:
    the least one expert piece's forward costs, whatever its rows (module docstring); memory_bytes:
    one device's memory (inf: host memory), of which `free_at_start` bytes are left free once a
    training run's weights, gradients and optimizer states are in place, as the simulator assumes:
    ``feplb.resident_budget_mb: "auto"`` derives the kept copies' budget from it as the runtime
    does from what it measures at initialize (`residency.resident_budget_bytes`)."""

    name: str
    tflops: float
    tile_m: int
    overhead_us: float
    ce_gbps: float
    net_gbps: float
    message_us: float = 0.0
    floor_us: float = 0.0
    memory_bytes: float = math.inf

    FREE_SHARE = 0.2  # of `memory_bytes`, free at the start: "auto" then keeps up to 10% of it

    @property
    def free_at_start(self) -> float:
        return self.FREE_SHARE * self.memory_bytes


PROFILES = {
    # memory: the nominal capacities, 80 GB and 141 GB of HBM
    "h100": GemmProfile("h100", 453.0, 128, 2.0, 370.0, 50.0, memory_bytes=80e9),
    "h200": GemmProfile("h200", 480.0, 128, 2.0, 370.0, 50.0, memory_bytes=141e9),
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
    def grad_bytes(self) -> int:
        """One expert's gradient in fp32, as a replica's gradient sum travels."""
        return self.mats * self.hidden * self.ffn_hidden * 4

    @property
    def row_bytes(self) -> int:
        return self.hidden * self.dtype_bytes


def gemm_us(tokens: np.ndarray, shape: ExpertShape, profile: GemmProfile) -> np.ndarray:
    """tokens int64 [...] (rows of one expert piece each) -> float64 [...] forward GEMM µs."""
    tokens = np.asarray(tokens, dtype=np.int64)
    tiles = -(-tokens // profile.tile_m)
    t = tiles * (profile.tile_m * shape.flops_per_row / (profile.tflops * 1e6)) + profile.overhead_us
    return np.where(tokens > 0, np.maximum(t, profile.floor_us), 0.0)


def rank_gemm_us(ranks: np.ndarray, tokens: np.ndarray, num_ranks: int, shape: ExpertShape,
                 profile: GemmProfile) -> np.ndarray:
    """Expert pieces (ranks int64 [P], tokens int64 [P]) -> float64 [num_ranks]: each rank's
    forward expert-GEMM time (µs), the sum over the pieces it computes."""
    return np.bincount(np.asarray(ranks, dtype=np.int64), weights=gemm_us(tokens, shape, profile),
                       minlength=num_ranks)


def scaled(profile: GemmProfile, **changes) -> GemmProfile:
    """A copy of ``profile`` with some fields changed."""
    return replace(profile, **changes)
