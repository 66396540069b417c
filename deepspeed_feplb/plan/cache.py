"""Whether numba's cache already holds the compiled planning pass (`passes`).

From a warm cache a process loads the pass in about a second; on a cold one, importing `passes`
compiles it (15-40 s on a loaded 2-core machine). So a domain whose first rank finds the cache
cold does not plan in-process: it starts its scheduler process at once, which compiles the pass
in its own process, and hands out plans without moves until that process serves
(`scheduler.client.ProcessScheduler`): no training step waits for the compiler. With a warm
cache loading still takes about a second on a loaded 2-core VM, so where plans need not move from
the first micro-batch (measured costs) the process is started when the domain opens and plans
move nothing until it serves; ``feplb.fixed_costs: "ignore"`` and ``max_rows_over_mean`` promise
moves or a row bound from the first micro-batch, so there the domain's first rank loads the cache
itself at its first plan. A run that never balances never loads numba.
"""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["planner_cached"]


def planner_cached() -> bool:
    """Whether numba's cache holds the compiled planning pass: in this package's ``__pycache__``,
    or under ``NUMBA_CACHE_DIR``."""
    roots = [Path(__file__).parent / "__pycache__"]
    if os.environ.get("NUMBA_CACHE_DIR"):
        roots.append(Path(os.environ["NUMBA_CACHE_DIR"]))
    return any(next(root.rglob("passes.*.nbi"), None) is not None for root in roots if root.is_dir())

