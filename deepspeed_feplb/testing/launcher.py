"""Run a function on N CPU ranks with gloo, the way a unit test needs it.

Fresh processes (spawn, or a forkserver with torch and DeepSpeed preloaded; never a fork of the
caller: torch and gloo hold threads), a file store and a free port,
``OMP_NUM_THREADS=1``, DeepSpeed's shm comm op build skipped, and a deadline: a hang becomes a
`TimeoutError` (carrying the Python stacks of the ranks that hung), a failing rank becomes a
`RankFailed` (an `AssertionError`) carrying that rank's traceback.

Teardown is clean on every path: ranks that finished call ``deepspeed_feplb.shutdown()``,
``barrier`` and ``destroy_process_group``; ranks that hang or are left blocked by a failing peer
are killed, and the FEPLB shared-memory segments they had mapped (``/dev/shm/feplb-*``, found in
their ``/proc/<pid>/maps`` before the kill) are removed. Only this run's segments are touched, so
concurrent jobs on the same machine are safe.
"""
from __future__ import annotations

import faulthandler
import importlib
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

from deepspeed_feplb.plan.cache import planner_cached

__all__ = ["free_port", "run_distributed", "RankFailed", "RankSkipped"]

_SHM_PREFIX = "/dev/shm/feplb-"


class RankFailed(AssertionError):
    """A rank raised. ``rank``, ``summary`` (last line of its traceback: type and message) and
    ``details`` (the full formatted traceback) describe the first rank that reported a failure."""

    def __init__(self, rank: int, world_size: int, summary: str, details: str):
        super().__init__(f"rank {rank} failed:\n{details}")
        self.rank, self.world_size, self.summary, self.details = rank, world_size, summary, details


class RankSkipped(Exception):
    """A rank called ``pytest.skip`` (or raised unittest's SkipTest); ``reason`` is its message."""

    def __init__(self, rank: int, reason: str):
        super().__init__(f"rank {rank} skipped: {reason}")
        self.rank, self.reason = rank, reason


# what a rank would otherwise import on the way (symbolic_shapes: imported by torch's functional and
# compile paths on first use, sympy included, ~2 s)
_PRELOAD = ["torch", "torch.fx.experimental.symbolic_shapes", "deepspeed", "deepspeed.moe.layer",
            "deepspeed_feplb.integration.deepspeed_moe"]


def _context(start_method: str | None = None):
    """``"spawn"`` (default of `run_distributed`) or ``"forkserver"`` (the pytest plugin's default):
    ranks start from a server that has imported torch and DeepSpeed once, so a rank is ready in well
    under a second instead of re-importing for seconds. ``FEPLB_TEST_START_METHOD`` overrides both.
    The server is a clean single-threaded process started with ``OMP_NUM_THREADS=1`` and DeepSpeed's
    CPU accelerator; the caller's environment is left as it was.
    """
    method = os.environ.get("FEPLB_TEST_START_METHOD") or start_method or "spawn"
    if method not in mp.get_all_start_methods():
        method = "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":
        from multiprocessing import forkserver
        saved = {key: os.environ.get(key) for key in ("OMP_NUM_THREADS", "DS_ACCELERATOR")}
        os.environ.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
        try:
            ctx.set_forkserver_preload(_PRELOAD)
            forkserver.ensure_running()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    return ctx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _is_skip(exc: BaseException) -> bool:
    # pytest's Skipped says its __module__ is "builtins"; match by name (unittest's SkipTest too)
    return any(t.__name__ in ("Skipped", "SkipTest") for t in type(exc).__mro__)


def _worker(payload, rank, world_size, port, store, results, stack_file, environ, cwd, path):
    # a forkserver child starts with the server's environment, directory and sys.path: take the caller's
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    sys.path[:] = path
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                      OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    # the parent sends SIGUSR1 to a rank that hangs: every thread's Python stack goes to stack_file
    stacks = open(stack_file, "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    faulthandler.enable(all_threads=True)  # a crash in native code (CUDA, gloo) still shows where Python was
    import torch
    torch.set_num_threads(1)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed
    import torch.distributed as dist
    try:
        fn, args, kwargs = pickle.loads(payload)
        deepspeed.init_distributed("gloo", auto_mpi_discovery=False, init_method=f"file://{store}", rank=rank,
                                   world_size=world_size)
        results.put((rank, "started", None))
        value = fn(*args, **kwargs)
        results.put((rank, "ok", pickle.dumps(value)))  # plain pickle: tensors are copied, no fd sharing
    except BaseException as exc:  # noqa: BLE001 - everything a rank raises is reported to the parent
        if _is_skip(exc):
            results.put((rank, "skip", str(getattr(exc, "msg", None) or exc)))
        else:
            lines = traceback.format_exception_only(type(exc), exc)
            results.put((rank, "error", ("".join(lines).strip(), traceback.format_exc())))
        return
    from deepspeed_feplb.domain import shutdown
    shutdown()
    dist.barrier()
    dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args, timeout: float = 300.0, start_timeout: float = 300.0,
                    start_method: str | None = None, **kwargs) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the per-rank results.

    ``timeout`` limits ``fn`` itself, counted from the moment every rank has started (spawned,
    imported torch and DeepSpeed, joined the gloo group); ``start_timeout`` limits that start-up,
    which on a loaded machine can take tens of seconds. ``start_method``: ``"spawn"`` (default) or
    ``"forkserver"`` (preloaded torch/DeepSpeed: much faster start-up when a process launches often).

    ``fn`` must be picklable (a module-level function, or an object whose class is importable);
    its return value travels back with plain pickle. Raises `RankFailed` (an `AssertionError`)
    with the first failing rank's traceback, `RankSkipped` if a rank skipped, or `TimeoutError`
    naming the ranks that did not finish in time, followed by their Python stacks.

    On a machine whose numba cache lacks the compiled planner, this process compiles it first (once):
    a domain would otherwise leave the compile to its scheduler process and stay unbalanced
    meanwhile (`plan.cache`), and a test expects its ranks to plan from their first micro-batch.
    """
    if not planner_cached():
        from deepspeed_feplb.plan import passes  # noqa: F401 - imported for its side effect: numba compiles it
    ctx = _context(start_method)
    workdir = tempfile.mkdtemp(prefix="feplb-test-")
    store = os.path.join(workdir, "filestore")
    stack_files = [os.path.join(workdir, f"stacks-rank{r}.txt") for r in range(world_size)]
    payload = pickle.dumps((fn, args, kwargs))  # fails here, in the caller, if fn or an argument cannot travel
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(payload, r, world_size, port, store, results, stack_files[r],
                                               dict(os.environ), os.getcwd(), list(sys.path)), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    done: dict[int, Any] = {}
    started: set[int] = set()
    deadline = time.monotonic() + start_timeout
    try:
        while len(done) < world_size:
            try:
                rank, status, value = results.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in done]
                if dead:
                    raise RankFailed(dead[0], world_size, f"rank {dead[0]} died (exit code {procs[dead[0]].exitcode})",
                                     f"rank(s) {dead} died (exit codes {[procs[r].exitcode for r in dead]})") from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(done))
                    if len(started) < world_size:
                        raise TimeoutError(f"rank(s) {sorted(set(range(world_size)) - started)} did not start within "
                                           f"{start_timeout:g} s") from None
                    stacks = _dump_stacks([procs[r] for r in missing], [stack_files[r] for r in missing], missing)
                    raise TimeoutError(f"rank(s) {missing} did not finish within {timeout:g} s (hang?)"
                                       + stacks) from None
                continue
            if status == "started":
                started.add(rank)
                if len(started) == world_size:
                    deadline = time.monotonic() + timeout
                continue
            if status == "error":
                raise RankFailed(rank, world_size, value[0], value[1])
            if status == "skip":
                raise RankSkipped(rank, value)
            done[rank] = pickle.loads(value)
        for p in procs:
            p.join(timeout=30)
        return [done[r] for r in range(world_size)]
    finally:
        _teardown(procs)
        results.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _dump_stacks(procs, files, ranks) -> str:
    """Ask hung ranks for their Python stacks (faulthandler on SIGUSR1) and return them as text."""
    for p in procs:
        if p.is_alive():
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    time.sleep(0.5)
    out = []
    for rank, path in zip(ranks, files):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            text = ""
        if text:
            out.append(f"\n--- Python stacks of rank {rank} ---\n{text}")
    return "".join(out)


def _mapped_feplb_segments(pid: int) -> set[str]:
    try:
        with open(f"/proc/{pid}/maps") as f:
            paths = {line.rstrip("\n").split(maxsplit=5)[-1] for line in f if _SHM_PREFIX in line}
    except OSError:
        return set()
    return {p.removesuffix(" (deleted)") for p in paths}


def _teardown(procs) -> None:
    """Kill ranks still running (after a failure or a hang) and remove the segments they mapped."""
    alive = [p for p in procs if p.is_alive()]
    segments = set()
    for p in alive:
        segments |= _mapped_feplb_segments(p.pid)
    for p in alive:
        p.kill()
    for p in alive:
        p.join()
    for path in segments:
        if path.startswith(_SHM_PREFIX):
            try:
                os.unlink(path)
            except OSError:
                pass
