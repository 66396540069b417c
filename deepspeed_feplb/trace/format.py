"""Routing traces: the ``.npz`` format, validation and folding onto an EP group.

A trace holds ``counts`` int64 ``[micro_batches, layers, src_ranks, experts]``: tokens (token-expert
pairs) that the router of ``layer`` sent to ``expert`` from EP rank ``src_rank`` at micro-batch
``micro_batch``. Optional scalars: ``top_k``, ``hidden``, ``ffn_hidden``, ``source`` (free text).
Experts are placed contiguously (``expert // (experts / ranks)``), as DeepSpeed does.

A trace recorded by a FEPLB run (`trace.record`) also holds what the runtime did, so that the
simulator's time model can be checked against it (``simulate --compare-measured``):
``plan_moves`` int64 ``[M, 7]`` = (micro_batch, layer, expert, home_rank, helper_rank, rows, fresh):
the plans' moves (EP ranks; ``fresh``: the chunk carried the expert's weights), and
``stage_us`` float64 ``[micro_batches, layers, ranks, 8]``: per EP rank, the expert stage's measured
forward and backward time (host clock on CPU ranks, CUDA events on GPUs), when its plan was in
hand (from the stage's start, host clock; NaN: the micro-batch was not balanced), the rank's
fitted cost of an expert piece and of a row (forward + backward,
`expert_costs.ComputeTimes.fitted_us` of the path the micro-batch took, as they stood before it:
what its planner priced), the CPU time the rank's process used over the forward and the
backward, and the fixed latency of one phase-2 message that its domain's transport measured when
it opened (`Transport.message_us`; NaN: no domain), all µs, and the forward's share of the
stage's busy time that its planner priced (`expert_costs.StageFactor.forward_share`, a fraction),
NaN where not measured. Older traces have 5 columns (no CPU time), 6 (no message latency) or 7
(no forward share); they load and replay as recorded. `load_trace` refuses a file that is not
this (`trace_from_arrays`: wrong shapes or dtypes, a dimension of 0, rows below 0 or above
`MAX_COUNT`, plan moves outside the trace's micro-batches, layers, experts and ranks).
"""
from __future__ import annotations

import os
import zipfile
import zlib
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
from numpy.lib.npyio import NpzFile

from deepspeed_feplb.exits import InputFileError

__all__ = ["MAX_COUNT", "Trace", "load_trace", "trace_from_arrays", "save_trace", "fold_sources", "home_rank",
           "rank_loads"]


@dataclass(frozen=True)
class Trace:
    """counts: int64 [micro_batches, layers, src_ranks, experts]; the scalars are optional metadata."""

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
            raise ValueError(f"trace counts must be [micro_batches, layers, src_ranks, experts], got shape "
                             f"{counts.shape}")
        if counts.size and (not np.issubdtype(counts.dtype, np.integer) or counts.min() < 0):
            raise ValueError("trace counts must be non-negative integers")
        object.__setattr__(self, "counts", counts.astype(np.int64, copy=False))

    @property
    def micro_batches(self) -> int:
        return self.counts.shape[0]

    @property
    def steps(self) -> int:
        """`micro_batches` under its old name."""
        return self.micro_batches

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
    """Read a trace; an unreadable file or one that `trace_from_arrays` refuses raises
    `exits.InputFileError` naming ``path`` and what is wrong."""
    try:
        loaded = np.load(path, allow_pickle=False)
        if isinstance(loaded, NpzFile):
            with loaded:
                arrays = {key: loaded[key] for key in loaded.files}  # they decompress here: a corrupt one fails here
    except (OSError, EOFError, ValueError, MemoryError, zipfile.BadZipFile, zlib.error) as e:
        raise InputFileError(f"{path}: cannot read it as an .npz archive ({type(e).__name__}: {e}); {_EXPECTED}") \
            from None
    if not isinstance(loaded, NpzFile):
        raise InputFileError(f"{path}: a single .npy array, not an .npz archive; {_EXPECTED}")
    return trace_from_arrays(arrays, path)


_EXPECTED = "a trace holds counts int64 [micro_batches, layers, src_ranks, experts]"
MAX_COUNT = 2 ** 40  # rows in one entry of counts or plan_moves: far above any batch, far below int64 overflow in sums
MAX_SIZE = 2 ** 24  # hidden and ffn_hidden: far above any model's


def trace_from_arrays(arrays: dict, path: str | os.PathLike) -> Trace:
    """The `Trace` that the arrays of the trace file ``path`` (name -> array, as ``np.load`` gives
    them) hold. Everything the simulator indexes by is checked here, so that a bad file is refused
    in one line (`exits.InputFileError` naming the file and the first array that is missing, of the
    wrong kind or shape, or holds values no run records) instead of failing deep inside a replay
    or, worse, replaying as nonsense. Arrays of other names are ignored."""
    def refuse(problem: str):
        raise InputFileError(f"{path}: {problem}")

    if "counts" not in arrays:
        refuse(f"no counts array; {_EXPECTED}")
    counts = np.asarray(arrays["counts"])
    if counts.ndim != 4 or not np.issubdtype(counts.dtype, np.integer):
        refuse(f"counts has {_kind(counts)}, expected integers of shape (micro_batches, layers, src_ranks, experts)")
    if 0 in counts.shape:
        refuse(f"counts has shape {counts.shape}: a trace needs at least one step (micro-batch), layer, source rank "
               "and expert")
    low, high = counts.min(), counts.max()
    if low < 0 or high > MAX_COUNT:
        refuse(f"counts holds {low if low < 0 else high}, expected rows from 0 to 2**40 = {MAX_COUNT}")
    micro_batches, layers, ranks, experts = counts.shape
    meta = {}
    for key, most in (("top_k", experts), ("hidden", MAX_SIZE), ("ffn_hidden", MAX_SIZE)):
        if key in arrays:
            value = np.asarray(arrays[key])
            if value.shape != () or not np.issubdtype(value.dtype, np.integer):
                refuse(f"{key} has {_kind(value)}, expected a whole number (shape ())")
            if not 1 <= value <= most:
                refuse(f"{key} is {value}, expected 1 to {most}" + (" (the experts)" if key == "top_k" else ""))
            meta[key] = int(value)
    if "source" in arrays:
        source = np.asarray(arrays["source"])
        if source.shape != () or source.dtype.kind not in "US":
            refuse(f"source has {_kind(source)}, expected a string")
        meta["source"] = str(source)
    if "plan_moves" in arrays:
        moves = np.asarray(arrays["plan_moves"])
        if moves.ndim != 2 or moves.shape[1] != 7 or not np.issubdtype(moves.dtype, np.integer):
            refuse(f"plan_moves has {_kind(moves)}, expected integers of shape (M, 7) = (micro_batch, layer, expert, "
                   "home_rank, helper_rank, rows, fresh)")
        columns = (("micro_batch", micro_batches), ("layer", layers), ("expert", experts), ("home_rank", ranks),
                   ("helper_rank", ranks), ("rows", MAX_COUNT + 1), ("fresh", 2))
        for column, (name, limit) in enumerate(columns):
            bad = np.flatnonzero((moves[:, column] < 0) | (moves[:, column] >= limit))
            if bad.size:
                refuse(f"plan_moves row {bad[0]} has {name} {moves[bad[0], column]}, expected 0 to {limit - 1} "
                       f"(counts has shape {counts.shape})")
        meta["plan_moves"] = moves.astype(np.int64)
    if "stage_us" in arrays:
        stage = np.asarray(arrays["stage_us"])
        real = np.issubdtype(stage.dtype, np.floating) or np.issubdtype(stage.dtype, np.integer)
        if not real or stage.ndim != 4 or stage.shape[:3] != counts.shape[:3] or not 5 <= stage.shape[3] <= 8:
            refuse(f"stage_us has {_kind(stage)}, expected floats of shape (micro_batches, layers, ranks, 5 to 8) = "
                   f"({micro_batches}, {layers}, {ranks}, 5 to 8), as counts")
        meta["stage_us"] = stage.astype(np.float64)
    return Trace(counts=counts, **meta)


def _kind(array: np.ndarray) -> str:
    """An array's shape and dtype, for a message (never its values: a corrupt file's bytes)."""
    return f"shape {array.shape} and dtype {array.dtype}"


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
