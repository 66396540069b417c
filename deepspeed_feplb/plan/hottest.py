"""The one rule for a rank's dynamic experts: its D hottest local experts, ties to the lower id;
none for a rank at or below its domain's mean rows where plans only move rows to such ranks.

A rank applies it to its own counts each balanced micro-batch and publishes the result with them;
the planner moves rows of the published experts only (it never applies the rule itself), and the
simulator applies it for every rank of a replayed trace (`policy.plan_domain` without a set).
numpy only: a rank whose plans come from elsewhere never loads numba."""
from __future__ import annotations

import numpy as np

__all__ = ["dynamic_candidates", "NONE"]

NONE = -1  # pads a rank's row of dynamic experts where it has fewer than the others


def dynamic_candidates(counts: np.ndarray, D: int, mean_rows: float | None = None) -> np.ndarray:
    """counts int64 [G, E_local] -> int64 [G, min(D, E_local)]: each rank's D hottest local
    experts, hottest first, ties to the lower expert id. ``mean_rows``: the domain's rows per rank,
    where plans only ever move rows to a rank at or below it (`policy.PlanConstraints.senders_only`):
    such a rank chooses none (a row of `NONE`), so all its experts run in its static call."""
    counts = np.asarray(counts, dtype=np.int64)
    d = max(0, min(int(D), counts.shape[1]))
    chosen = np.ascontiguousarray(np.argsort(-counts, axis=1, kind="stable")[:, :d], dtype=np.int64)
    if mean_rows is not None:
        chosen[counts.sum(axis=1) <= mean_rows] = NONE
    return chosen
