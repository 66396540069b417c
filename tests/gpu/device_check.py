"""The device check: every GPU-path check in one run, one JSON of figures written after each stage.

    python tests/gpu/device_check.py --out DIR          # on a GPU machine: fails without CUDA or CuPy
    python tests/gpu/device_check.py --cpu --out DIR    # the dry run CI does: same stages, CPU stand-ins

Stages (each records ``ok`` and its figures in ``DIR/device_checks.json`` as soon as it ends, so a
time-out still leaves data):

1. ``preflight``: versions, device; on a GPU run, CUDA and CuPy must work (the check fails, never skips).
2. ``kernels``: every kernel of ops/feplb_kernels.cu against its torch reference, bit for bit, over
   dtypes and edge shapes (0 rows, odd row bytes, k = 0, subnormal values in the combine).
3. ``copy``: bandwidth of the project's own copy path (``backend.memcpy_async`` between two
   allocations) against torch's copy of the same bytes, and (CUDA) whether the profiler saw a
   memcpy and no kernel during it, i.e. the copy ran on a copy engine.
4. ``overlap``: (CUDA) slowdown of a large bf16 GEMM and of an HBM-bound kernel while copies run
   on a copy stream (`bench_ce_overlap.py`).
5. ``transport``: two processes (on one GPU, CUDA IPC works between them) exchange messages through
   `CudaCETransport` with injected GPU delays before the data is produced and before it is
   consumed, so a missing event wait corrupts data instead of passing by luck.
   ``transport_speed``: its ping-pong (`bench_transport.py`): one-way time and host CPU per message
   from 4 KiB to 64 MiB, and the 64 MiB message's bandwidth against the ``copy`` stage's.
6. ``layer``: the FEPLB layer (transport ``cuda_ce``; ``shm`` in the dry run) against DeepSpeed's
   MoE on 2 ranks, fp32 with TF32 off: outputs and gradients within 1e-5, tokens migrated > 0;
   helpers return results in parts of 2 rows or more, and a step's kept copies send their gradients
   home early, as at scale.
   ``serve_parts``: a balanced layer's micro-batch with results in one message and in 4 parts
   (`benchmarks/bench_serve_parts.py`), median time of each and their ratio.
   ``grouped_tile``: a grouped expert GEMM's time as one expert's rows sweep across 128-row tile
   boundaries, and the row tile that fits it best (what ``chunk_align_tokens: "auto"`` assumes).
7. ``deepep``: the DeepEP adapter (on `ReferenceBuffer` when ``deep_ep`` is absent) against the torch
   dispatcher on the device.
8. ``syncs``, ``launches``, ``host_calls``, ``memory``, ``layer_speed``, ``launch_budget``: the hot path
   (`hot_path.py`): device-to-host syncs per layer forward (at most 1) and backward (0), kernels per
   layer, host µs per call of the stream and timing calls a layer pass makes often, FEPLB's
   added peak memory against docs/GPU.md's bound, the layer's speed against DeepSpeed's MoE at
   EP = 1, aten ops and host time per layer (`benchmarks/bench_launches.py`).
9. ``leaks``: no ``feplb-`` segment left in /dev/shm, device memory back to where it started.
10. ``gpu_tests``: (CUDA) ``pytest tests/gpu`` with none skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(HERE)]


class Check:
    """Runs the stages in order and rewrites the JSON after each one."""

    def __init__(self, out: Path, cpu: bool):
        self.out, self.cpu = out, cpu
        self.device = torch.device("cpu") if cpu else torch.device("cuda", 0)
        self.result = {"mode": "cpu dry run" if cpu else "cuda", "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                       "stages": {}}

    def stage(self, name: str, fn) -> bool:
        start = time.perf_counter()
        try:
            figures = fn() or {}
            ok = bool(figures.pop("ok", True))
        except Exception as exc:  # noqa: BLE001 - a stage that fails is reported, the next ones still run
            figures, ok = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}, False
        self.result["stages"][name] = {"ok": ok, "seconds": round(time.perf_counter() - start, 2), **figures}
        self.result["ok"] = all(s["ok"] for s in self.result["stages"].values())
        (self.out / "device_checks.json").write_text(json.dumps(self.result, indent=1, default=str))
        print(f"[{name}] {'ok' if ok else 'FAILED'} {json.dumps(figures, default=str)[:400]}", flush=True)
        return ok


# ------------------------------------------------------------------ 1. preflight
def preflight(check: Check) -> dict:
    figures = {"python": platform.python_version(), "torch": torch.__version__, "cuda_build": torch.version.cuda}
    try:
        import cupy
        figures["cupy"] = cupy.__version__
    except ImportError:
        figures["cupy"] = None
    if check.cpu:
        return figures
    from deepspeed_feplb.migrate import cuda_available
    figures["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    if not cuda_available():
        return {**figures, "ok": False, "error": "no CUDA device usable by torch and CuPy: the GPU path cannot run"}
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    figures["free_bytes"], figures["total_bytes"] = torch.cuda.mem_get_info(0)
    from deepspeed_feplb.grouped_mlp import grouped_mm_runs
    figures["grouped_mm_runs"] = {str(dtype): grouped_mm_runs(torch.device("cuda", 0), dtype)
                                  for dtype in (torch.float32, torch.bfloat16, torch.float16)}
    return figures


# ------------------------------------------------------------------ 2. kernels
def kernels(check: Check) -> dict:
    from deepspeed_feplb.kernels import cuda as k
    from deepspeed_feplb.kernels import reference as ref
    dev, g = check.device, torch.Generator().manual_seed(0)
    cases, failed = 0, []

    def same(name, got, want):
        nonlocal cases
        cases += 1
        if not torch.equal(got.cpu(), want):
            failed.append(name)

    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8):
        for rows, hidden in ((0, 16), (1, 7), (300, 64), (300, 7168)):
            src = (torch.randn(rows, hidden, generator=g) * 100).to(dtype)
            index = torch.randint(-1, max(rows, 1), (257, ), generator=g) if rows else torch.full((5, ), -1)
            same(f"gather {dtype} {rows}x{hidden}", k.gather_rows(src.to(dev), index.to(dev)),
                 ref.gather_rows(src, index))
            perm = torch.randperm(rows, generator=g)
            dst = torch.zeros_like(src)
            same(f"scatter {dtype} {rows}x{hidden}", k.scatter_rows(src.to(dev), perm.to(dev), dst.to(dev)),
                 ref.scatter_rows(src, perm, torch.zeros_like(src)))
    for routes, experts in ((0, 4), (1, 1), (1000, 8), (70000, 33)):
        e = torch.randint(-1, experts + 1, (routes, ), generator=g)
        counts, position = k.expert_positions(e.to(dev), experts)
        want_counts = ref.expert_counts(e, experts)
        same(f"expert_counts {routes}/{experts}", counts, want_counts)
        same(f"expert_positions {routes}/{experts}", position,
             ref.expert_positions(e, experts, torch.cumsum(want_counts, 0) - want_counts))
    tiny = torch.finfo(torch.float32).tiny
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for kk in (0, 1, 4):
            rows = torch.randn(400, 256, generator=g)
            rows[:50] *= tiny / 8  # subnormals: flushed to zero by -ftz=true, kept by torch
            rows = rows.to(dtype)
            slot = torch.randint(-1, 400, (150, kk), generator=g)
            weight = torch.rand(150, kk, generator=g)
            same(f"combine {dtype} k={kk}", k.weighted_combine(rows.to(dev), slot.to(dev), weight.to(dev)),
                 ref.weighted_combine(rows, slot, weight))
    return {"ok": not failed, "cases": cases, "failed": failed[:20]}


# ------------------------------------------------------------------ 3. copy bandwidth
def copy(check: Check) -> dict:
    from deepspeed_feplb.migrate.backend import CudaBackend, HostBackend
    nbytes = (8 << 20) if check.cpu else (256 << 20)
    backend = HostBackend(prefix=f"feplb-devcheck-{os.getpid()}") if check.cpu else CudaBackend()
    src, dst = backend.malloc(nbytes), backend.malloc(nbytes)
    stream = backend.stream_create()
    reps = 5 if check.cpu else 20

    def ours():
        for _ in range(reps):
            backend.memcpy_async(dst, src, nbytes, stream)

    def sync():
        if not check.cpu:
            torch.cuda.synchronize()

    ours()
    sync()
    start = time.perf_counter()
    ours()
    sync()
    ours_gbps = reps * nbytes / (time.perf_counter() - start) / 1e9
    a = torch.empty(nbytes, dtype=torch.uint8, device=check.device)
    b = torch.empty_like(a)
    b.copy_(a)
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        b.copy_(a)
    sync()
    torch_gbps = reps * nbytes / (time.perf_counter() - start) / 1e9
    figures = {"bytes": nbytes, "ours_gbps": round(ours_gbps, 1), "torch_copy_gbps": round(torch_gbps, 1)}
    if not check.cpu:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            backend.memcpy_async(dst, src, nbytes, stream)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        figures["profiled"] = names[:10]
        figures["copy_engine"] = any("memcpy" in n.lower() for n in names) and not any(
            "memcpy" not in n.lower() and "memset" not in n.lower() for n in names)
    del a, b
    backend.stream_destroy(stream)
    backend.free(src)
    backend.free(dst)
    return figures


# ------------------------------------------------------------------ 4. overlap
def overlap(check: Check) -> dict:
    if check.cpu:
        return {"skipped_in_dry_run": "needs a GPU's copy engine"}
    path = check.out / "ce_overlap.json"
    run = subprocess.run([sys.executable, str(HERE / "bench_ce_overlap.py"), str(path)], capture_output=True, text=True,
                         timeout=100)
    figures = json.loads(path.read_text()) if path.exists() else {}
    return {"ok": run.returncode == 0, **figures, "log": run.stdout[-1500:] + run.stderr[-1500:]}


# ------------------------------------------------------------------ 5. transport with delays
def _transport_worker(cpu: bool, rounds: int, stream_memops: bool = True) -> dict:
    import torch.distributed as dist

    from deepspeed_feplb.migrate.backend import CudaBackend, HostBackend
    from deepspeed_feplb.migrate.cuda_ce import CudaCETransport
    rank = dist.get_rank()
    names = [f"feplb-devcheck-{os.getpid()}-{time.monotonic_ns()}"]
    dist.broadcast_object_list(names, 0)
    dev = torch.device("cpu") if cpu else torch.device("cuda", 0)
    if not cpu:
        torch.cuda.set_device(0)

    def make(create):
        backend = HostBackend(prefix=f"{names[0]}-mem", stream_memops=stream_memops) if cpu else \
            CudaBackend(stream_memops=stream_memops)
        return CudaCETransport(names[0], rank, 2, 60.0, create, backend=backend, slot_bytes=1 << 16)

    if rank == 0:
        t = make(True)
    dist.barrier()
    if rank:
        t = make(False)

    def delay():
        if cpu:
            time.sleep(0.002)
        else:
            torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time on the current stream

    ok, peer = True, 1 - rank
    for r in range(rounds):
        g = torch.Generator().manual_seed(100 * r + rank)
        x = torch.randn(512 * (r + 1), 256, generator=g).to(dev)
        delay()  # the data below is produced late on the compute stream: the copy must wait for it
        y = x * 2 + 1
        future = t.send(peer, r, [y, x.to(torch.bfloat16)])
        got = t.recv(peer, r)
        delay()  # and consumed late: the sender must not overwrite the slot before we read it
        g2 = torch.Generator().manual_seed(100 * r + peer)
        x2 = torch.randn(512 * (r + 1), 256, generator=g2)
        ok &= torch.equal(got[0].cpu(), x2 * 2 + 1) and torch.equal(got[1].cpu(), x2.to(torch.bfloat16))
        future.result(timeout=60)
    capacities, parts, stream_flags = t.capacities(), t.extra_parts, t.stream_flags
    driver = type(getattr(t.backend, "_driver", None)).__name__  # which driver calls the probe kept
    dist.barrier()
    t.close()
    return {"ok": bool(ok), "capacities": capacities, "extra_parts": parts, "stream_flags": stream_flags,
            "driver_calls": {"_TypedDriver": "cuda.bindings", "_Driver": "ctypes"}.get(driver)}


def transport(check: Check) -> dict:
    """The protocol with late producers and consumers, on stream flags and on the host-flag fallback
    (a driver without stream memory operations, forced)."""
    from deepspeed_feplb.testing import run_distributed
    results = run_distributed(_transport_worker, 2, check.cpu, 8, timeout=120)
    fallback = run_distributed(_transport_worker, 2, check.cpu, 4, False, timeout=120)  # warns once per rank
    return {"ok": all(r["ok"] and r["stream_flags"] for r in results)
            and all(r["ok"] and not r["stream_flags"] for r in fallback),
            "slot_bytes": [r["capacities"] for r in results], "extra_parts": [r["extra_parts"] for r in results],
            "driver_calls": [r["driver_calls"] for r in results], "host_flags_ok": all(r["ok"] for r in fallback)}


def transport_speed(check: Check) -> dict:
    """`bench_transport.py`'s ping-pong, and what phase 2 at hardware speed asks of it: a small
    message one way in at most 20 µs and 20 µs of host CPU, 64 MiB at 90% of the copy bandwidth;
    also back to back, and on the host-flag fallback (for the record: no target)."""
    import bench_transport

    from deepspeed_feplb.testing import run_distributed
    rounds = 5 if check.cpu else 50
    sizes = run_distributed(bench_transport._ping_pong, 2, rounds, check.cpu, timeout=300)[0]
    back_to_back = run_distributed(bench_transport._ping_pong, 2, rounds, check.cpu, False, True, timeout=300)[0]
    host_flags = run_distributed(bench_transport._ping_pong, 2, rounds, check.cpu, False, False, True, timeout=300)[0]
    small, large = sizes[str(min(bench_transport.SIZES))], sizes[str(max(bench_transport.SIZES))]
    copy_gbps = check.result["stages"].get("copy", {}).get("ours_gbps")
    fraction = large["gbps"] / copy_gbps if copy_gbps else None
    return {"sizes": sizes, "back_to_back": back_to_back, "host_flags": host_flags, "copy_gbps": copy_gbps,
            "large_fraction_of_copy": fraction and round(fraction, 3),
            "targets": {"small_one_way_le_20us": small["one_way_us"] <= 20,
                        "small_cpu_per_message_le_20us": small["cpu_us_per_round_trip"] / 2 <= 20,
                        "large_ge_90pct_of_copy": fraction is not None and fraction >= 0.9}}


# ------------------------------------------------------------------ 6. layer vs DeepSpeed
def _layer_worker(cpu: bool) -> dict:
    """The layer against DeepSpeed's MoE with the helpers' serving after their own rows and on
    arrival (on a GPU: the served stream, `phase2.served_stream`)."""
    import deepspeed_feplb
    out = {}
    for on_arrival in (False, True):
        out["on_arrival" if on_arrival else "after_own_rows"] = _layer_against_deepspeed(cpu, on_arrival)
        deepspeed_feplb.shutdown()  # the next pair opens its own domain
    return out


def _layer_against_deepspeed(cpu: bool, on_arrival: bool) -> dict:
    import moe_cases
    dev = torch.device("cpu") if cpu else torch.device("cuda", 0)
    if not cpu:
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    feplb = {"nvlink_domain_size": 2, "dynamic_experts_per_rank": 2, "chunk_align_tokens": 1, "fixed_costs": "ignore",
             "transport": "shm" if cpu else "cuda_ce", "scheduler": {"start_after_steps": 0},
             "serve_on_arrival": on_arrival, **moe_cases.IN_PARTS}
    reference, ours = moe_cases.build_pair(16, 2, 2, {**feplb, "max_helpers_per_expert": 4}, seed=2)
    reference, ours = reference.to(dev), ours.to(dev)
    x, w = moe_cases.rank_inputs(2)
    ref = moe_cases.run_layer(reference, x.to(dev), w.to(dev))
    got = moe_cases.run_layer(ours, x.to(dev), w.to(dev))
    errors = [moe_cases.relative_error(got[0], ref[0]), moe_cases.relative_error(got[1], ref[1])]
    errors += [moe_cases.relative_error(got[2][n], ref[2][n]) for n in ref[2]]
    transport_name = type(ours.deepspeed_moe.stage.domain.transport).__name__
    migrated = int(ours.feplb_stats["migrated_tokens"])
    # weight residency: two micro-batches of one step (the helper keeps its copies after the first,
    # their gradients go home in the second's backward); gradients summed over both, as DeepSpeed's
    hits = 0
    for layer_ in (reference, ours):
        layer_.zero_grad(set_to_none=True)
    for micro, ends in enumerate((False, True)):
        ours.deepspeed_moe.step_ends = lambda ends=ends: ends
        x, w = moe_cases.rank_inputs(10 + micro)
        ref = moe_cases.run_layer(reference, x.to(dev), w.to(dev))
        got = moe_cases.run_layer(ours, x.to(dev), w.to(dev))
        errors.append(moe_cases.relative_error(got[0], ref[0]))
        hits += int(ours.feplb_stats["resident_hits"])
    errors += [moe_cases.relative_error(got[2][n], ref[2][n]) for n in ref[2]]
    return {"worst_error": max(errors), "migrated": migrated, "transport": transport_name, "resident_hits": hits}


def layer(check: Check) -> dict:
    from deepspeed_feplb.testing import run_distributed
    results = run_distributed(_layer_worker, 2, check.cpu, timeout=120)
    out = {"ok": True}
    for mode in results[0]:
        worst = max(r[mode]["worst_error"] for r in results)
        migrated = sum(r[mode]["migrated"] for r in results)
        hits = results[0][mode]["resident_hits"]
        out["ok"] &= worst <= 1e-5 and migrated > 0 and hits > 0
        out[mode] = {"worst_relative_error": worst, "migrated_tokens": migrated, "resident_hits": hits,
                     "transport": results[0][mode]["transport"]}
    return out


def serve_parts(check: Check) -> dict:
    """A helper's results in one message against in parts (`benchmarks/bench_serve_parts.py`): on
    the GPU both ranks on GPU 0 through the real CE transport, bf16, hidden 1024; in the dry run
    the CE transport's code path with an emulated copy engine at the benchmark's shape."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_serve_parts
    opts = {"tokens": 4096, "hidden": 128 if check.cpu else 1024, "ffn": 256 if check.cpu else 2048, "experts": 16,
            "k": 2, "skew": 3.0, "copy_gbps": 0.5, "device": "cpu" if check.cpu else "cuda",
            "reps": 5 if check.cpu else 20, "warmup": 2 if check.cpu else 3}
    result = bench_serve_parts.measure(opts)
    return {"ok": min(result["migrated_rows_rank0"].values()) > 0, **result}


def grouped_tile(check: Check) -> dict:
    """Whether a grouped expert GEMM's time steps at a row tile (`sim.calibrate.grouped_sweep_us`):
    on the GPU 8 GLM-5-sized gated bf16 experts of 512 rows (the recorded 4k trace's: 8 local experts
    per rank), the first one's rows swept from 384 to 640 in steps of 8; in the dry run the same code
    at a small fp32 shape (its times say nothing). ``feplb.chunk_align_tokens: "auto"`` moves whole
    128-row tiles on a GPU because the simulator's profiles pad a piece to them; a fitted tile well
    below that (a time that grows with the rows) would make finer chunks balance rows at no cost."""
    from deepspeed_feplb.plan.cost import ExpertShape
    from deepspeed_feplb.plan.policy import GPU_TILE_ROWS
    from deepspeed_feplb.sim.calibrate import fit_row_tile, grouped_sweep_us
    if check.cpu:
        shape, groups, rows, deltas = ExpertShape(hidden=64, ffn_hidden=128), 4, 64, range(-64, 65, 8)
    else:
        shape, groups, rows, deltas = ExpertShape(), 8, 512, range(-128, 129, 8)
    swept, times = grouped_sweep_us(shape, "cpu" if check.cpu else "cuda", groups, rows, deltas,
                                    repeat=3 if check.cpu else 5)
    fit = fit_row_tile(swept, times)
    at = swept.index(rows)
    per_row = (times[-1] - times[0]) / (swept[-1] - swept[0])
    step = (times[at + 1] - times[at]) / (8 * per_row) if per_row > 0 else None
    return {"ok": all(0 < t < float("inf") for t in times), "groups": groups, "rows": swept,
            "times_us": [round(t, 2) for t in times], "fitted_tile": fit["tile"],
            "fit_rms_us": {tile: round(v, 3) for tile, v in fit["rms_us"].items()},
            # strict tiles: the 8 rows past a tile's end cost a whole tile, so this ratio is about tile / 8
            "step_past_tile_over_8_rows": None if step is None else round(step, 2),
            "chunk_align_auto_rows": GPU_TILE_ROWS}


# ------------------------------------------------------------------ 7. DeepEP adapter
def deepep(check: Check) -> dict:
    from deepspeed_feplb.dispatch import deepep_available
    from deepspeed_feplb.dispatch.deepep import DeepEPDispatcher, ReferenceBuffer
    from deepspeed_feplb.dispatch.torch_a2a import TorchDispatcher
    dev, g = check.device, torch.Generator().manual_seed(7)
    x = torch.randn(257, 64, generator=g).to(dev).requires_grad_(True)
    ids = torch.randint(-1, 12, (2, 257), generator=g).to(dev)
    gates = torch.rand(2, 257, generator=g).to(dev)
    ours = DeepEPDispatcher(None, 1, 12, buffer=ReferenceBuffer(None))
    rows, counts, handle, _ = ours.dispatch(x, ids)
    out = ours.combine(rows * 3, gates, handle)
    out.sum().backward()
    grad = x.grad.clone()
    x.grad = None
    base = TorchDispatcher(None, 1, 12)
    ref_rows, ref_counts, ref_handle, _ = base.dispatch(x, ids)
    ref_out = base.combine(ref_rows * 3, gates, ref_handle)
    ref_out.sum().backward()
    equal = (torch.equal(rows, ref_rows) and (counts == ref_counts).all() and torch.equal(out, ref_out)
             and torch.equal(grad, x.grad))
    return {"ok": bool(equal), "deep_ep_importable": deepep_available(), "buffer": "ReferenceBuffer (EP size 1)"}


# ------------------------------------------------------------------ 9. leaks, 10. gpu tests
def leaks(check: Check, baseline_bytes: int, segments_before: set) -> dict:
    from deepspeed_feplb.segments import leftover_segments, segments_in_use
    # another job's segments are not ours: those there before, and those a live process maps now
    # (this check's ranks have all exited)
    left = sorted(set(leftover_segments()) - segments_before - set(segments_in_use()))
    figures = {"dev_shm_feplb_segments": left}
    if not check.cpu:
        torch.cuda.synchronize()
        figures["device_bytes_now_vs_start"] = [torch.cuda.memory_allocated(0), baseline_bytes]
        return {"ok": not left and torch.cuda.memory_allocated(0) <= baseline_bytes, **figures}
    return {"ok": not left, **figures}


def gpu_tests(check: Check) -> dict:
    if check.cpu:
        return {"skipped_in_dry_run": "tests/gpu skip without CUDA"}
    xml = check.out / "gpu_tests.xml"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/gpu", "-p", "no:cacheprovider",
                          f"--junitxml={xml}"], cwd=ROOT, capture_output=True, text=True, timeout=150)
    import xml.etree.ElementTree as ET
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    return {"ok": run.returncode == 0 and counts["skipped"] == 0 and counts["tests"] > 0, **counts,
            "log": run.stdout[-2000:]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="dry run on the CPU (what CI runs)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for device_checks.json")
    parser.add_argument("--stages", default="", help="comma-separated subset of the stages after preflight "
                        "(default: all), e.g. to rerun the failed ones inside a short device lease")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    check = Check(out, args.cpu)
    if not check.stage("preflight", lambda: preflight(check)):
        return 1  # without CUDA and CuPy nothing else can run: fail, never skip
    from deepspeed_feplb.segments import leftover_segments
    baseline = 0 if args.cpu else torch.cuda.memory_allocated(0)
    segments_before = set(leftover_segments())
    import hot_path
    hot = {name: getattr(hot_path, name) for name in ("syncs", "launches", "host_calls", "memory", "layer_speed")}
    stages = {"kernels": kernels, "copy": copy, "overlap": overlap, "transport": transport,
              "transport_speed": transport_speed, "layer": layer, "serve_parts": serve_parts,
              "grouped_tile": grouped_tile, "deepep": deepep,
              **{name: lambda c, fn=fn: fn(c.cpu) for name, fn in hot.items()},
              "launch_budget": lambda c: hot_path.launch_budget(c.cpu, c.out),
              "parity": lambda c: hot_path.parity(c.cpu),
              "leaks": lambda c: leaks(c, baseline, segments_before), "gpu_tests": gpu_tests}
    chosen = [name.strip() for name in args.stages.split(",") if name.strip()] or list(stages)
    unknown = sorted(set(chosen) - set(stages))
    if unknown:
        parser.error(f"unknown stage(s) {unknown}; choose from {list(stages)}")
    for name in stages:
        if name in chosen:
            check.stage(name, lambda fn=stages[name]: fn(check))
    print(json.dumps({name: s["ok"] for name, s in check.result["stages"].items()}))
    return 0 if check.result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
