"""Whether numba's cache already holds the compiled planning pass (`passes`).

From a warm cache a process loads the pass in about a second; on a cold one, importing `passes`
compiles it (15-40 s on a loaded 2-core machine). So a domain whose first rank finds the cache
cold does not plan in-process: it starts its scheduler process at once, which compiles the pass
in its own process, and hands out plans without moves until that process serves
(`scheduler.client.ProcessScheduler`): no training step waits for the compiler. With a warm
cache, `load_in_background` spares the first plan its second of imports.
"""
from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

__all__ = ["planner_cached", "load_in_background"]

_loading: list = []


def planner_cached() -> bool:
    """Whether numba's cache holds the compiled planning pass: in this package's ``__pycache__``,
    or under ``NUMBA_CACHE_DIR``."""
    roots = [Path(__file__).parent / "__pycache__"]
    if os.environ.get("NUMBA_CACHE_DIR"):
        roots.append(Path(os.environ["NUMBA_CACHE_DIR"]))
    return any(next(root.rglob("passes.*.nbi"), None) is not None for root in roots if root.is_dir())


def load_in_background() -> None:
    """Import the compiled planning pass in a daemon thread (once per process) when numba's cache
    holds it: started while DeepSpeed initialises, it is loaded before the first plan, which would
    otherwise import numba and the cache inside a training step (about a second). A plan that comes
    first waits for the import (Python's import lock), as it would have imported it itself."""
    if _loading or "deepspeed_feplb.plan.passes" in sys.modules or not planner_cached():
        return
    thread = threading.Thread(target=_load, name="feplb-planner-load", daemon=True)
    _loading.append(thread)
    thread.start()


def _load() -> None:
    from deepspeed_feplb.plan import passes  # noqa: F401
