"""Cost profiles for the simulator: the named ones of `plan.cost`, or ``cpu``, measured here with
real torch GEMMs (the only part of the time model that needs torch)."""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from deepspeed_feplb.plan.cost import PROFILES, ExpertShape, GemmProfile

__all__ = ["get_profile", "calibrate", "calibrate_cpu", "grouped_sweep_us", "fit_row_tile"]

_CPU_ROWS = (1, 8, 16, 24, 32, 64, 96, 128, 256, 512)
_CPU_SHAPE = ExpertShape(hidden=512, ffn_hidden=1024)  # the expert `calibrate` times unless told another
# GPU row counts: below, around and above the tile sizes grouped GEMMs use, up to a large micro-batch
_GPU_ROWS = (16, 64, 96, 128, 192, 256, 384, 512, 640, 1024, 2048, 4096, 8192, 16384, 32768)


def get_profile(name: str, shape: ExpertShape | None = None) -> GemmProfile:
    """A named profile; ``cpu`` and ``gpu`` are measured now (need torch; ``gpu`` a CUDA device)."""
    if name in PROFILES:
        return PROFILES[name]
    if name == "cpu":
        return calibrate_cpu(shape or ExpertShape(hidden=512, ffn_hidden=1024))
    if name == "gpu":
        return calibrate(shape or ExpertShape(), device="cuda")
    raise ValueError(f"unknown cost profile {name!r} (one of {sorted(PROFILES) + ['cpu', 'gpu']})")


def _best_time(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _best_time_cuda(fn, repeat: int, inner: int = 10) -> float:
    """Best over ``repeat`` of the mean of ``inner`` back-to-back calls, timed with CUDA events (s)."""
    import torch
    best = float("inf")
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / inner)
    return best


def calibrate_cpu(shape: ExpertShape = _CPU_SHAPE, rows=_CPU_ROWS,
                  repeat: int = 5) -> GemmProfile:
    """`calibrate` on this machine's CPU in fp32."""
    return calibrate(shape, "cpu", rows, repeat)


def expert_times_us(shape: ExpertShape, device: str = "cpu", rows=_CPU_ROWS, repeat: int = 5) -> list[float]:
    """Forward time (µs) of one expert of ``shape`` (``mats`` matmuls, gated when 3) for each row
    count in ``rows``: fp32 on the CPU, bf16 on a CUDA device (timed with CUDA events)."""
    import torch
    cuda = device != "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    w = [torch.randn(shape.hidden, shape.ffn_hidden, generator=g, device=device, dtype=dtype)
         for _ in range(shape.mats - 1)]
    w.append(torch.randn(shape.ffn_hidden, shape.hidden, generator=g, device=device, dtype=dtype))
    times = []
    for n in rows:
        x = torch.randn(n, shape.hidden, generator=g, device=device, dtype=dtype)

        def run(x=x):
            h = x @ w[0]
            for m in w[1:-1]:
                h = h * (x @ m)
            return h @ w[-1]

        run()
        times.append((_best_time_cuda(run, repeat) if cuda else _best_time(run, repeat)) * 1e6)
    return times


def grouped_sweep_us(shape: ExpertShape, device: str = "cpu", groups: int = 8, rows: int = 512,
                     deltas=range(-128, 129, 8), repeat: int = 5) -> tuple[list[int], list[float]]:
    """Forward time (µs) of one grouped call of ``groups`` experts of ``shape`` (``torch._grouped_mm``
    per projection, as `grouped_mlp.StackedMLP.grouped` calls it; gated when ``mats`` is 3) with
    ``rows`` rows each but the first, whose rows sweep ``rows + delta`` for each of ``deltas``:
    whether a group's time steps at the GEMM's row tile (what ``feplb.chunk_align_tokens: "auto"``
    assumes: a chunk of part of a tile costs that tile) or grows with its rows. fp32 on the CPU, bf16
    on a CUDA device (timed with CUDA events). Returns (the first group's rows, times)."""
    import torch
    cuda = device != "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device=device).manual_seed(0)

    def weights(out_features, in_features):  # [groups, out, in] as a stacked nn.Linear, read transposed
        return torch.randn(groups, out_features, in_features, generator=g, device=device, dtype=dtype).transpose(-2, -1)
    ups = [weights(shape.ffn_hidden, shape.hidden) for _ in range(shape.mats - 1)]
    down = weights(shape.hidden, shape.ffn_hidden)
    swept, times = [], []
    for delta in deltas:
        first = rows + int(delta)
        if first < 0:
            continue
        sizes = [first] + [rows] * (groups - 1)
        x = torch.randn(sum(sizes), shape.hidden, generator=g, device=device, dtype=dtype)
        ends = torch.tensor(np.cumsum(sizes), dtype=torch.int32, device=device)

        def run(x=x, ends=ends):
            h = torch._grouped_mm(x, ups[0], offs=ends)
            for m in ups[1:]:
                h = h * torch._grouped_mm(x, m, offs=ends)
            return torch._grouped_mm(h, down, offs=ends)

        run()
        swept.append(first)
        times.append((_best_time_cuda(run, repeat) if cuda else _best_time(run, repeat)) * 1e6)
    return swept, times


def fit_row_tile(rows, times_us, tiles=(1, 8, 16, 32, 64, 128, 256)) -> dict:
    """The row tile that best explains ``times_us`` over ``rows`` (`grouped_sweep_us`):
    ``t(n) = a + b * ceil(n / tile) * tile`` by least squares for each candidate tile. Returns
    ``{"tile": the best, "rms_us": {tile: the fit's root-mean-square error}}``; ties (rows that are
    multiples of both tiles) go to the smaller tile."""
    n = np.asarray(rows, dtype=np.float64)
    t = np.asarray(times_us, dtype=np.float64)
    rms = {}
    for tile in tiles:
        A = np.stack([np.ones_like(n), np.ceil(n / tile) * tile], axis=1)
        coef, *_ = np.linalg.lstsq(A, t, rcond=None)
        rms[int(tile)] = float(np.sqrt(np.mean((A @ coef - t) ** 2)))
    best = min(rms, key=lambda tile: (round(rms[tile], 9), tile))
    return {"tile": best, "rms_us": rms}


def fit_profile(name: str, shape: ExpertShape, rows, times_us, tiles, ce_gbps: float, net_gbps: float,
                floor: bool = True) -> GemmProfile:
    """Fit ``t(n) = max(floor, overhead + ceil(n / tile) * tile * flops_per_row / rate)`` to measured
    ``times_us`` at ``rows``, in relative terms (the sizes span orders of magnitude). For each
    candidate tile, and each number k of smallest sizes that sit on the floor (none, or 1 to all but
    two; the floor is their median), the rest gives the line by least squares; the candidate with
    the smallest sum of squared relative errors wins, one with a floor only where it fits at least
    10% better than none. ``floor=False``: the line alone (k = 0)."""
    order = np.argsort(np.asarray(rows, dtype=np.float64), kind="stable")
    rows_a = np.asarray(rows, dtype=np.float64)[order]
    t_a = np.maximum(np.asarray(times_us, dtype=np.float64)[order], 1e-9)  # a size timed at 0 weighs like 1 ns
    best = None  # (error, tile, overhead, tflops, floor)
    for tile in tiles:
        padded = np.ceil(rows_a / tile) * tile * shape.flops_per_row
        for k in range(len(rows_a) - 1 if floor else 1):  # k sizes on the floor
            level = float(np.median(t_a[:k])) if k else 0.0
            A = np.stack([np.ones(len(t_a) - k), padded[k:]], axis=1) / t_a[k:, None]
            (c0, c1), *_ = np.linalg.lstsq(A, np.ones(len(t_a) - k), rcond=None)
            if c1 <= 0:
                continue
            c0 = max(0.0, float(c0))
            predicted = np.maximum(level, c0 + c1 * padded)
            err = float(np.sum(((predicted - t_a) / t_a) ** 2))
            if k:
                err = err * 1.1 + 1e-12  # a floor must earn its place
            if best is None or err < best[0]:
                best = (err, tile, c0, 1.0 / (float(c1) * 1e6), level)
    if best is None:  # timings too noisy to fit: fall back to the largest size's average rate
        best = (0.0, 1, 0.0, rows_a[-1] * shape.flops_per_row / (t_a[-1] * 1e6), 0.0)
    return GemmProfile(name, tflops=best[3], tile_m=int(best[1]), overhead_us=best[2], ce_gbps=ce_gbps,
                       net_gbps=net_gbps, floor_us=best[4])


def calibrate(shape: ExpertShape = _CPU_SHAPE, device: str = "cpu", rows=None,
              repeat: int = 5) -> GemmProfile:
    """Measure real torch expert GEMMs on ``device`` and fit the cost model (`fit_profile`).

    CPU: fp32, tiles {1, ..., 32}; the "copy engine" rate is a large tensor copy's bandwidth.
    CUDA (profile ``gpu``): bf16, tiles {1, ..., 256}; one GPU has no peer link to measure, so the
    copy rates are the ``h200`` profile's (NVLink Copy Engine, cross-node NIC); its memory is the device's."""
    import torch
    if device == "cpu":
        rows = rows or _CPU_ROWS
        times = expert_times_us(shape, device, rows, repeat)
        src = torch.empty(1 << 23)
        dst = torch.empty_like(src)
        gbps = src.numel() * 4 / _best_time(lambda: dst.copy_(src), repeat) / 1e9
        return fit_profile("cpu", shape, rows, times, (1, 2, 4, 8, 16, 32), gbps, gbps / 4)
    if not torch.cuda.is_available():
        raise RuntimeError("the gpu cost profile measures a CUDA device, and torch sees none here")
    rows = rows or _GPU_ROWS
    times = expert_times_us(shape, device, rows, repeat)
    link = PROFILES["h200"]
    profile = fit_profile("gpu", shape, rows, times, (1, 2, 4, 8, 16, 32, 64, 128, 256), link.ce_gbps, link.net_gbps)
    return replace(profile, memory_bytes=float(torch.cuda.get_device_properties(torch.device(device)).total_memory))
