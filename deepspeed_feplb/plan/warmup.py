"""Compile the planning pass (`passes`) in the background, so that no training step pays for it.

On a machine whose numba cache is cold, importing `passes` compiles it (15-40 s on a loaded
2-core machine); from a warm cache it loads in about a second, which the first plan pays as
before. With a cold cache the domain's first rank, which plans for its domain until the
scheduler process is up (`scheduler.client.ProcessScheduler`), compiles it in a thread from the
moment its layer attaches; until that is done it hands its domain plans without moves (every
expert computed at home: exact, only not balanced), so no micro-batch waits for the compiler.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

__all__ = ["planner_cached", "start", "ready", "wait"]

_thread: threading.Thread | None = None
_lock = threading.Lock()


def _load() -> None:
    from deepspeed_feplb.plan import passes  # noqa: F401  (compiles into numba's cache, or loads from it)


def planner_cached() -> bool:
    """Whether numba's cache holds the compiled planning pass: in this package's ``__pycache__``,
    or under ``NUMBA_CACHE_DIR``."""
    roots = [Path(__file__).parent / "__pycache__"]
    if os.environ.get("NUMBA_CACHE_DIR"):
        roots.append(Path(os.environ["NUMBA_CACHE_DIR"]))
    return any(next(root.rglob("passes.*.nbi"), None) is not None for root in roots if root.is_dir())


def start() -> None:
    """Compile the planning pass in a daemon thread (once per process), unless numba's cache has it."""
    global _thread
    with _lock:
        if _thread is None and not planner_cached():
            _thread = threading.Thread(target=_load, name="feplb-planner-load", daemon=True)
            _thread.start()


def wait(timeout: float | None = None) -> bool:
    """Wait for a background load to finish (tools and tests that compare plans); returns `ready`."""
    if _thread is not None:
        _thread.join(timeout)
    return ready()


def ready() -> bool:
    """Whether planning now would not wait for the compiler: no background load was started (the
    caller loads the pass itself, as a test or the scheduler process does), or it has finished."""
    return _thread is None or not _thread.is_alive()
