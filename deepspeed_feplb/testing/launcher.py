"""Run a function on N CPU ranks with gloo, the way a unit test needs it.

Spawned processes (never fork: torch and gloo hold threads), a file store and a free port,
``OMP_NUM_THREADS=1``, DeepSpeed's shm comm op build skipped, and a deadline: a hang becomes a
`TimeoutError`, a failing rank becomes an `AssertionError` carrying that rank's traceback.
"""
from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue
import shutil
import socket
import tempfile
import time
import traceback
from typing import Any, Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, store, results, args, kwargs):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                      OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    import torch
    torch.set_num_threads(1)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed
    import torch.distributed as dist
    try:
        deepspeed.init_distributed("gloo", auto_mpi_discovery=False, init_method=f"file://{store}", rank=rank,
                                   world_size=world_size)
        value = fn(*args, **kwargs)
        results.put((rank, "ok", value))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        return
    from deepspeed_feplb.runtime import shutdown
    shutdown()
    dist.barrier()
    dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args, timeout: float = 300.0, **kwargs) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the per-rank results.

    ``fn`` must be importable (a module-level function). Raises `AssertionError` with the first
    failing rank's traceback, or `TimeoutError` naming the ranks that did not finish in time.
    """
    ctx = mp.get_context("spawn")
    workdir = tempfile.mkdtemp(prefix="feplb-test-")
    store = os.path.join(workdir, "filestore")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, store, results, args, kwargs), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    done: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(done) < world_size:
            try:
                rank, status, value = results.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in done]
                if dead:
                    raise AssertionError(f"rank(s) {dead} died (exit codes {[procs[r].exitcode for r in dead]})")
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(done))
                    raise TimeoutError(f"rank(s) {missing} did not finish within {timeout:g} s (hang?)")
                continue
            done[rank] = (status, value)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
        for p in procs:
            p.join(timeout=30)
        return [done[r][1] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(workdir, ignore_errors=True)
