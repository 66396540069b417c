"""Straggler metrics (docs/ARCHITECTURE.md, "Metrics") and the per-forward stats of a FEPLB layer."""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Optional, TypedDict

import numpy as np


def recomputing() -> bool:
    """Whether the current forward runs inside a backward pass: activation checkpointing
    recomputing it (reentrant or not). Such a forward is not a new micro-batch: it is not
    counted in the stats, recorded in a trace, or allowed to change weight residency."""
    import torch
    return torch._C._current_graph_task_id() != -1  # what torch.utils.checkpoint itself asks


def straggler(tokens: np.ndarray) -> tuple[float, float]:
    """tokens ``[R]`` per rank -> (max - mean, max / mean); (0, 1) for an idle group."""
    tokens = np.asarray(tokens, dtype=np.float64)
    mean = tokens.mean() if tokens.size else 0.0
    if mean == 0:
        return 0.0, 1.0
    return float(tokens.max() - mean), float(tokens.max() / mean)


class MicroBatchStats(TypedDict):
    """``layer.feplb_stats``: what one FEPLB layer did in its last forward, for the G ranks of its
    NVLink domain (or this rank alone where it has none). Every key is always present; a forward
    that moved nothing has zeros (and ``seq`` -1 when it did not run phase 2). All keys but
    ``fallback`` and ``weight_resends`` are the same on every rank of the domain."""
    ranks: list            # the G global ranks of the domain
    tokens_before: list    # rows each rank received per local expert, summed: [G]
    tokens_after: list     # rows each rank computed after balancing: [G]
    token_straggler_before: float  # max - mean of tokens_before
    token_straggler_after: float
    max_over_mean_before: float    # max / mean (1 for an idle domain)
    max_over_mean_after: float
    migrated_tokens: int   # rows computed by a helper
    migrated_experts: int  # distinct (home, expert) pairs that sent rows
    moves: int             # chunks of the plan
    plan_latency_us: float
    fallback: bool         # this rank planned in-process because the scheduler process was late
    weight_copies: int     # chunks that carried an expert's weights (the rest found them kept)
    resident_hits: int     # chunks whose helper kept the weights from an earlier micro-batch
    weight_resends: int    # of those, this rank's that carried them again: its weights changed in the step
    flushed_copies: int    # kept copies whose gradients went home at the step's end
    weight_bytes: int      # weight bytes sent, domain-wide
    grad_bytes: int        # weight-gradient bytes returned, domain-wide
    seq: int               # the domain's phase-2 micro-batch number, -1 without phase 2
    domain_counts: np.ndarray  # int64 [G, E_local]: rows each rank received per local expert


NO_TRAFFIC = {"weight_copies": 0, "resident_hits": 0, "weight_resends": 0, "flushed_copies": 0, "weight_bytes": 0,
              "grad_bytes": 0}


def layer_stats(domain_counts: np.ndarray, moves: np.ndarray, plan_seconds: float, fallback: bool,
                ranks: list[int], traffic: Optional[dict] = None, seq: int = -1) -> MicroBatchStats:
    """What one FEPLB layer did in one forward, for the ranks of its NVLink domain (`MicroBatchStats`).

    domain_counts ``int64 [G, E_local]`` rows each rank received per local expert; moves
    ``int64 [M, 4]`` (home, local_expert, helper, tokens); ranks: the G global ranks; traffic:
    `residency_stats` of the micro-batch (none: zeros); seq: its phase-2 number.
    """
    before = domain_counts.sum(axis=1).astype(np.int64)
    after = before.copy()
    np.subtract.at(after, moves[:, 0], moves[:, 3])
    np.add.at(after, moves[:, 2], moves[:, 3])
    s_before, r_before = straggler(before)
    s_after, r_after = straggler(after)
    return MicroBatchStats(
        ranks=list(ranks), tokens_before=before.tolist(), tokens_after=after.tolist(),
        token_straggler_before=s_before, token_straggler_after=s_after,
        max_over_mean_before=r_before, max_over_mean_after=r_after,
        migrated_tokens=int(moves[:, 3].sum()),
        migrated_experts=int(len({(h, e) for h, e in moves[:, :2].tolist()})),
        moves=int(moves.shape[0]), plan_latency_us=plan_seconds * 1e6, fallback=bool(fallback),
        **(traffic or NO_TRAFFIC), seq=int(seq), domain_counts=domain_counts)


def unbalanced_stats(domain_counts: np.ndarray, ranks: list[int]) -> MicroBatchStats:
    """`layer_stats` of a forward that moved nothing: domain_counts ``int64 [G, E_local]``."""
    return layer_stats(domain_counts, np.zeros((0, 4), np.int64), 0.0, False, ranks)


def residency_stats(fresh: np.ndarray, kept: np.ndarray, flushed: int, expert_bytes: int, resent: int = 0) -> dict:
    """Weight traffic of one layer's micro-batch in its domain: fresh / kept bool [M] per move of
    the plan (`plan.residency.ResidencyTable.admit`), ``flushed`` kept copies whose gradients went
    home at the step's end, ``resent`` this rank's chunks (as a home) that carried weights again to
    a helper keeping a copy, because they changed within the step (only the home and its helper
    know: ``weight_resends``, which `integration.monitor` sums over the domain's ranks and moves
    from ``resident_hits`` to ``weight_copies``). Weight and gradient bytes count one expert per
    copy (the parameters' dtype), domain-wide."""
    copies, hits = int(fresh.sum()), int((~fresh).sum())
    grads = int((~kept).sum()) + int(flushed)
    return {"weight_copies": copies, "resident_hits": hits, "weight_resends": int(resent),
            "flushed_copies": int(flushed), "weight_bytes": copies * int(expert_bytes),
            "grad_bytes": grads * int(expert_bytes)}


class StageTimes:
    """Host seconds one FEPLB layer spent per stage, forward and backward, accumulated until `take`.

    Stages: ``gate``, ``dispatch``, ``static experts``, ``plan wait``, ``phase-2 compute``,
    ``phase-2 comm`` (sends, receives and waits), ``combine``, and in backward ``all-to-all bwd``,
    ``phase-2 bwd compute``, ``phase-2 bwd comm``. Costs two clock reads per stage and call.
    """

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def measure(self, stage: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] += time.perf_counter() - start

    def add(self, stage: str, seconds: float) -> None:
        self.seconds[stage] += seconds

    def take(self) -> dict[str, float]:
        """The seconds per stage since the last call, and start over."""
        out = dict(self.seconds)
        self.seconds.clear()
        return out
