"""Routing traces: the ``.npz`` format, validation and folding onto an EP group.

A trace holds ``counts`` int64 ``[steps, layers, src_ranks, experts]``: tokens (token-expert
pairs) that the router of ``layer`` sent to ``expert`` from EP rank ``src_rank`` at micro-batch
``step``. Optional scalars: ``top_k``, ``hidden``, ``ffn_hidden``, ``source`` (free text).
Experts are placed contiguously (``expert // (experts / ranks)``), as DeepSpeed does.

A trace recorded by a FEPLB run (`trace.record`) also holds what the runtime did, so that the
simulator's time model can be checked against it (``simulate --compare-measured``):
``plan_moves`` int64 ``[M, 7]`` = (step, layer, expert, home_rank, helper_rank, rows, fresh):
the plans' moves (EP ranks; ``fresh``: the chunk carried the expert's weights), and
``stage_us`` float64 ``[steps, layers, ranks, 8]``: per EP rank, the expert stage's measured
forward and backward time (host clock on CPU ranks, CUDA events on GPUs), when its plan was in
hand (from the stage's start, host clock; NaN: the micro-batch was not balanced), the rank's
fitted cost of an expert piece and of a row (forward + backward,
`expert_costs.ComputeTimes.fitted_us` of the path the micro-batch took, as they stood before it:
what its planner priced), the CPU time the rank's process used over the forward and the
backward, and the fixed latency of one phase-2 message that its domain's transport measured when
it opened (`Transport.message_us`; NaN: no domain), all µs, and the forward's share of the
stage's busy time that its planner priced (`expert_costs.StageFactor.forward_share`, a fraction),
NaN where not measured. Older traces have 5 columns (no CPU time), 6 (no message latency) or 7
(no forward share); they load and replay as recorded.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

__all__ = ["Trace", "load_trace", "save_trace", "fold_sources", "home_rank", "rank_loads"]


@dataclass(frozen=True)
class Trace:
    """counts: int64 [steps, layers, src_ranks, experts]; the scalars are optional metadata."""

    counts: np.ndarray
    top_k: Optional[int] = None
    hidden: Optional[int] = None
    ffn_hidden: Optional[int] = None
    source: str = ""
    plan_moves: Optional[np.ndarray] = None
    stage_us: Optional[np.ndarray] = None

    def __post_init__(self):
        counts = np.asarray(self.counts)
        if counts.ndim != 4:
            raise ValueError(f"trace counts must be [steps, layers, src_ranks, experts], got shape {counts.shape}")
        if counts.size and (not np.issubdtype(counts.dtype, np.integer) or counts.min() < 0):
            raise ValueError("trace counts must be non-negative integers")
        object.__setattr__(self, "counts", counts.astype(np.int64, copy=False))

    @property
    def steps(self) -> int:
        return self.counts.shape[0]

    @property
    def layers(self) -> int:
        return self.counts.shape[1]

    @property
    def src_ranks(self) -> int:
        return self.counts.shape[2]

    @property
    def experts(self) -> int:
        return self.counts.shape[3]

    def with_counts(self, counts: np.ndarray) -> "Trace":
        return replace(self, counts=counts)


def save_trace(path: str | os.PathLike, trace: Trace) -> None:
    """Write ``trace`` to ``path`` (.npz, compressed)."""
    extra = {k: v for k, v in (("top_k", trace.top_k), ("hidden", trace.hidden),
                               ("ffn_hidden", trace.ffn_hidden)) if v is not None}
    if trace.source:
        extra["source"] = np.array(trace.source)
    for key in ("plan_moves", "stage_us"):
        if getattr(trace, key) is not None:
            extra[key] = getattr(trace, key)
    with open(path, "wb") as f:
        np.savez_compressed(f, counts=trace.counts, **extra)


def load_trace(path: str | os.PathLike) -> Trace:
    """Read a trace; raises ValueError naming what is wrong."""
    with np.load(path, allow_pickle=False) as z:
        if "counts" not in z:
            raise ValueError(f"{path}: no 'counts' array in trace")
        meta = {}
        for key in ("top_k", "hidden", "ffn_hidden"):
            if key in z:
                meta[key] = int(z[key])
        if "source" in z:
            meta["source"] = str(z["source"])
        for key in ("plan_moves", "stage_us"):
            if key in z:
                meta[key] = z[key]
        return Trace(counts=z["counts"], **meta)


def fold_sources(counts: np.ndarray, ranks: int) -> np.ndarray:
    """counts int64 [..., src_ranks, experts] -> int64 [..., ranks, experts].

    ``src_ranks`` must equal ``ranks``, be a multiple of it (consecutive sources are summed), or be
    1 (no source information: each expert's tokens are spread as evenly as possible over the
    sources, the remainder going to the lowest source ranks)."""
    counts = np.asarray(counts, dtype=np.int64)
    S = counts.shape[-2]
    if S == ranks:
        return counts
    if S % ranks == 0:
        return counts.reshape(counts.shape[:-2] + (ranks, S // ranks, counts.shape[-1])).sum(axis=-2)
    if S == 1:
        total = counts[..., 0, :]
        base = total // ranks
        rem = total - base * ranks
        out = np.repeat(base[..., None, :], ranks, axis=-2)
        out += (np.arange(ranks)[:, None] < rem[..., None, :]).astype(np.int64)
        return out
    raise ValueError(f"trace has {S} source ranks; the EP size {ranks} must divide it (or it must be 1)")


def home_rank(experts: int, ranks: int) -> np.ndarray:
    """int64 [experts]: the EP rank that hosts each expert under contiguous placement."""
    if experts % ranks:
        raise ValueError(f"{experts} experts cannot be placed evenly on {ranks} ranks")
    return np.arange(experts, dtype=np.int64) // (experts // ranks)


def rank_loads(expert_loads: np.ndarray, ranks: int) -> np.ndarray:
    """expert_loads int64 [..., experts] -> int64 [..., ranks] under contiguous placement."""
    E = expert_loads.shape[-1]
    if E % ranks:
        raise ValueError(f"{E} experts cannot be placed evenly on {ranks} ranks")
    return expert_loads.reshape(expert_loads.shape[:-1] + (ranks, E // ranks)).sum(axis=-1)
