"""The time model's constants (`TimeModel`), as the planner, the simulator and the mailbox hold them.

What the constants mean and how a micro-batch is timed with them: `timeline`. Its own module
(numpy only) so that the compiled passes (`passes`) can take the model as a record
(`MODEL_DTYPE`) without importing the evaluation that calls them.
"""
from __future__ import annotations

import math
from dataclasses import astuple, dataclass, fields
from functools import cached_property

import numpy as np

__all__ = ["FWD_BWD_GEMMS", "MODEL_DTYPE", "TimeModel", "serve_parts"]

# fwd + bwd GEMMs of a row: the forward, the input-gradient and the weight-gradient GEMM
FWD_BWD_GEMMS = 3


@dataclass(frozen=True)
class TimeModel:
    """Constants of the time model (µs); see `timeline`'s module docstring.

    tile_rows:       rows of a GEMM tile: an expert piece's rows are padded to whole tiles;
    row_us:          forward + backward GEMM time of one (padded) row;
    piece_us:        fixed cost of one expert piece (forward + backward);
    weight_copy_us:  one expert's weights over one copy-engine link;
    grad_copy_us:    one expert's weight-gradients over one link;
    row_copy_us:     one row's activations over one link;
    message_us:      fixed latency of one message, on top of its copy;
    plan_us:         when the plan is there, from the stage's start;
    sends_after_static: a home sends its chunks once its static experts are computed (a grouped
                     static call on CPU ranks), not as soon as the plan is there;
    serves_on_arrival: a helper computes each chunk it serves as soon as its message is in, ahead
                     of its own rows (``feplb.serve_on_arrival``: a high-priority stream on a GPU),
                     not after them;
    piece_floor_us:  the least one piece costs (forward + backward), whatever its rows (a measured
                     profile's `cost.GemmProfile.floor_us`; 0: none);
    forward_share:   the forward's share of a piece's cost (1 / `FWD_BWD_GEMMS` for GEMMs alone; the
                     runtime's `expert_costs.StageFactor` measures its stage's);
    serve_parts, serve_part_rows: a helper computes one home's chunks in `serve_parts` parts (at
                     most ``serve_parts``, each of at least ``serve_part_rows`` rows) and each part's
                     results go home as soon as it is computed.
    """

    tile_rows: int
    row_us: float
    piece_us: float
    weight_copy_us: float
    grad_copy_us: float
    row_copy_us: float
    message_us: float = 0.0
    plan_us: float = 0.0
    sends_after_static: bool = False
    serves_on_arrival: bool = False
    piece_floor_us: float = 0.0
    forward_share: float = 1.0 / FWD_BWD_GEMMS
    serve_parts: int = 1
    serve_part_rows: int = 1

    @classmethod
    def of(cls, shape, profile) -> "TimeModel":
        """From a simulator `cost.ExpertShape` and `cost.GemmProfile` (forward GEMM x 3)."""
        bw = profile.ce_gbps * 1e3  # bytes per µs
        return cls(int(profile.tile_m), FWD_BWD_GEMMS * shape.flops_per_row / (profile.tflops * 1e6),
                   FWD_BWD_GEMMS * profile.overhead_us, shape.weight_bytes / bw, shape.weight_bytes / bw,
                   shape.row_bytes / bw, profile.message_us, piece_floor_us=FWD_BWD_GEMMS * profile.floor_us)

    @classmethod
    def measured(cls, expert_seconds: float, rows: int, expert_bytes: int, row_bytes: int,
                 gbps: float) -> "TimeModel | None":
        """At runtime with ``feplb.fixed_costs: "ignore"``: from the previous micro-batch's forward
        expert time for ``rows`` rows on this rank (x 3 for forward + backward) and the copy-engine
        bandwidth ``gbps`` (1e9 bytes/s), no fixed costs; None before anything was timed."""
        if expert_seconds <= 0 or rows <= 0:
            return None
        bw = gbps * 1e3
        return cls(1, FWD_BWD_GEMMS * expert_seconds * 1e6 / rows, 0.0, expert_bytes / bw, expert_bytes / bw,
                   row_bytes / bw)

    @cached_property
    def record(self) -> np.ndarray:
        """`MODEL_DTYPE` ``[1]``: the fields by name, as the compiled passes and the mailbox take
        them (made once per model; not to be written)."""
        return np.array([tuple(float(v) for v in astuple(self))], MODEL_DTYPE)

    @classmethod
    def from_record(cls, record) -> "TimeModel":
        """The inverse of `record` (one `MODEL_DTYPE` record, or an array of one)."""
        record = np.asarray(record, MODEL_DTYPE).reshape(-1)[0]
        return cls(**{f.name: _CASTS[f.type](record[f.name]) for f in fields(cls)})

    @property
    def finite(self) -> bool:
        return all(math.isfinite(v) and v >= 0 for v in astuple(self))


def serve_parts(rows: int, max_parts: int, part_rows: int) -> int:
    """How many parts a helper computes one home's ``rows`` rows in: as many as fit parts of at
    least ``part_rows`` rows, at most ``max_parts``, at least 1 (plain arithmetic, so that the
    compiled passes call it too: `passes`)."""
    return max(1, min(max_parts, rows // max(part_rows, 1)))


# The time model as one record of float64 fields named as `TimeModel`'s: the planner's compiled
# passes (`passes.MODEL`) and the mailbox (`scheduler.mailbox.CONSTRAINTS_DTYPE`) read it by name.
MODEL_DTYPE = np.dtype([(f.name, np.float64) for f in fields(TimeModel)], align=True)
_CASTS = {"int": int, "float": float, "bool": bool}  # a field's annotation -> its type
