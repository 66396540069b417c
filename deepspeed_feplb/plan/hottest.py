"""The one rule for a rank's dynamic experts: its D hottest local experts, ties to the lower id,
and up to D more of its next hottest while the rows outside them exceed its domain's mean; none
for a rank at or below that mean where plans only move rows to such ranks.

A rank applies it to its own counts each balanced micro-batch and publishes the result with them;
the planner moves rows of the published experts only (it never applies the rule itself), and the
simulator applies it for every rank of a replayed trace (`policy.plan_domain` without a set).
numpy only: a rank whose plans come from elsewhere never loads numba."""
from __future__ import annotations

import numpy as np

__all__ = ["chosen_rows", "dynamic_candidates", "NONE"]

NONE = -1  # pads a rank's row of dynamic experts where it has fewer than the others


def dynamic_candidates(counts: np.ndarray, D: int, mean_rows: float | None = None,
                       senders_only: bool = False) -> np.ndarray:
    """counts int64 [G, E_local] -> int64 [G, W]: each rank's dynamic experts, hottest first, ties to
    the lower expert id, `NONE` after a rank's last (W: the most any rank chose, at least
    ``min(D, E_local)``).

    Each rank chooses its D hottest. Given ``mean_rows``, the domain's rows per rank, a rank whose
    rows outside those D are still above it also chooses its next hottest, one at a time, until
    they are not or it has chosen 2D: its static experts alone would keep it above the mean
    whatever the plan (with D = 0, no rank chooses any; 2D bounds the weight copies a helper can
    receive from one home, which the memory check at initialize counts). ``senders_only``: plans
    only ever move rows to a rank at or below the mean (`policy.PlanConstraints.senders_only`), so
    such a rank chooses none (a row of `NONE`) and all its experts run in its static call."""
    counts = np.asarray(counts, dtype=np.int64)
    E = counts.shape[1]
    d = max(0, min(int(D), E))
    order = np.argsort(-counts, axis=1, kind="stable")
    if mean_rows is None or d == 0:
        chosen = np.ascontiguousarray(order[:, :d], dtype=np.int64)
    else:
        hottest_first = np.take_along_axis(counts, order, axis=1)
        outside = counts.sum(axis=1, keepdims=True) - np.cumsum(hottest_first, axis=1)  # rows outside the k + 1 hottest
        wanted = np.maximum(d, 1 + (outside > mean_rows).sum(axis=1))  # cumsum is monotone: a count is the first k
        wanted = np.minimum(wanted, min(2 * d, E))
        chosen = np.where(np.arange(E) < wanted[:, None], order, NONE)[:, :int(wanted.max(initial=d))]
        chosen = np.ascontiguousarray(chosen, dtype=np.int64)
    if senders_only and mean_rows is not None:
        chosen[counts.sum(axis=1) <= mean_rows] = NONE
    return chosen


def chosen_rows(counts: np.ndarray, chosen: np.ndarray) -> np.ndarray:
    """The rows of each rank's chosen experts: counts int64 [G, E_local], chosen int64 [G, W]
    (`dynamic_candidates`) -> int64 [G, W], 0 where `NONE`."""
    return np.take_along_axis(counts, np.maximum(chosen, 0), axis=1) * (chosen != NONE)
