"""The one rule for a rank's dynamic experts, compiled: its D hottest local experts, ties to the
lower id. `policy.dynamic_candidates` (every rank, every micro-batch) and the planning pass
(`passes`) both call it. Its own module so that a rank that never plans loads only this."""
from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["hottest"]


@njit("void(int64[:, ::1], int64, int64[:, ::1], int64[:, ::1])", cache=True)
def hottest(counts, r, top_e, top_n):
    """The one rule for a rank's dynamic experts: fill row ``r`` of top_e / top_n int64 [G, D]
    with rank r's D hottest experts and their tokens, hottest first, ties to the lower id."""
    order = np.argsort(-counts[r], kind="mergesort")
    for i in range(top_e.shape[1]):
        top_e[r, i] = order[i]
        top_n[r, i] = counts[r, order[i]]
