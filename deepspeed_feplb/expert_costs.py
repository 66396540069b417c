"""What this rank's expert compute costs: timed calls, the fitted cost per row and per piece.

`ComputeTimes` keeps the last micro-batch's expert times (the ``auto`` copy budget, the placement's
time per token) and a `PieceFit` over recent timed expert calls, from which `ComputeTimes.model`
builds the planner's `plan.timeline.TimeModel`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from deepspeed_feplb.config import FEPLBConfig
from deepspeed_feplb.plan.timeline import FWD_BWD_GEMMS, TimeModel


@dataclass
class PieceFit:
    """Expert time ``t = k * piece_s + n * row_s`` for a call of ``k`` expert pieces and ``n`` rows
    (forward seconds). ``piece_s`` is what a one-row call costs (`ComputeTimes.probe`); ``row_s`` is
    the least-squares fit of the rest over the timed calls, each micro-batch's calls weighing
    ``decay`` times the previous one's, so it follows a change of speed within a few micro-batches.
    (A straight line through calls of a few hundred to a few thousand rows would put the GEMMs'
    better efficiency at large sizes into the intercept: milliseconds per piece on a CPU where a
    call costs tens of µs, which would make the planner shun every split.)"""
    decay: float = 0.7
    sums: np.ndarray = field(default_factory=lambda: np.zeros(3))  # kn, nn, nt
    warm: bool = False  # the first timed micro-batch pays one-time costs (first calls, allocations): dropped

    def add(self, samples: Sequence[tuple[int, int, float]]) -> None:
        """One micro-batch's samples (k, n, t), ``n > 0``."""
        if not samples:
            return
        if not self.warm:
            self.warm = True
            return
        k, n, t = (np.array(c, dtype=np.float64) for c in zip(*samples))
        self.sums = self.sums * self.decay + np.array([k @ n, n @ n, n @ t])

    def solve(self, piece_s: float) -> Optional[float]:
        """row_s >= 0 given the cost of a piece, or None before any sample."""
        kn, nn, nt = self.sums
        if nn <= 0:
            return None
        return max((nt - piece_s * kn) / nn, 0.0)


@dataclass
class ComputeTimes:
    """What this rank's expert compute took: the last micro-batch (sizes the ``auto`` budget and the
    placement's gain) and a `PieceFit` over the timed expert calls of recent ones (the time model).

    On CUDA the host clock around asynchronous launches would time the launches, not the GEMMs:
    there the marks are CUDA events, read when the next micro-batch starts (they have finished by
    then; if not, the older figures stay). On CPU it is the host clock.
    """
    static_seconds: float = 0.0
    expert_seconds: float = 0.0
    rows: int = 0  # rows this rank computed in the timed micro-batch (before balancing)
    pending: Optional[tuple] = None  # CUDA marks not read yet: (begin, static done, end, pieces)
    fit: PieceFit = field(default_factory=PieceFit)
    piece_s: Optional[float] = None  # what a one-row expert call costs, once `probe` was read
    probe_marks: Optional[list] = None  # its marks (host seconds, or CUDA events not read yet)

    def clock(self, device: torch.device) -> Callable[[], object]:
        """A function that marks "now" on ``device``'s timeline (first reads the last micro-batch's events)."""
        if device.type != "cuda":
            return time.perf_counter
        self.resolve()

        def mark():
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return mark

    def probe(self, rows: torch.Tensor, counts: np.ndarray, call: Callable[[int, torch.Tensor], torch.Tensor],
              mark: Callable[[], object]) -> None:
        """Once: time one-row calls of the first expert with rows (after one untimed call), the fixed
        cost of an expert piece. Without gradients, and the random state is restored, so an expert
        with dropout computes what it would have."""
        if self.probe_marks is not None or not counts.any():
            return
        e = int(np.flatnonzero(counts)[0])
        x = rows[int(counts[:e].sum()):][:1].detach().clone()  # an expert may work on its input in place
        devices = [rows.device] if rows.device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            call(e, x)
            marks = [mark()]
            for _ in range(3):
                call(e, x)
                marks.append(mark())
        self.probe_marks = marks
        self.resolve()

    def resolve(self) -> None:
        """Read the marks of the last micro-batch and of the probe once they are there (CUDA events
        that have completed; host seconds at once)."""
        if self.piece_s is None and self.probe_marks is not None:
            marks = self.probe_marks
            if isinstance(marks[0], float):
                self.piece_s = min(b - a for a, b in zip(marks, marks[1:]))
            elif marks[-1].query():
                self.piece_s = min(a.elapsed_time(b) for a, b in zip(marks, marks[1:])) / 1e3
        if self.pending is not None and self.pending[2].query():
            begin, static_done, end, pieces = self.pending
            self.static_seconds = begin.elapsed_time(static_done) / 1e3
            self.expert_seconds = begin.elapsed_time(end) / 1e3
            self.fit.add([(k, n, a.elapsed_time(b) / 1e3) for k, n, a, b in pieces])
            self.pending = None

    def finish(self, begin, static_done, end, rows: int, pieces: Sequence[tuple] = ()) -> None:
        """The marks of this micro-batch of ``rows`` rows (host seconds, or CUDA events to read next
        time); ``pieces``: (k expert pieces, n rows, start mark, end mark) of its timed expert calls."""
        self.rows = int(rows)
        if isinstance(begin, float):
            self.static_seconds, self.expert_seconds = static_done - begin, end - begin
            self.fit.add([(k, n, b - a) for k, n, a, b in pieces])
        else:
            self.pending = (begin, static_done, end, list(pieces))

    def fitted_us(self) -> Optional[tuple[float, float]]:
        """(piece_us, row_us), forward + backward; None before the probe and a micro-batch were timed."""
        self.resolve()
        row_s = self.fit.solve(self.piece_s) if self.piece_s is not None else None
        return None if row_s is None else (FWD_BWD_GEMMS * self.piece_s * 1e6, FWD_BWD_GEMMS * row_s * 1e6)

    def model(self, config: FEPLBConfig, expert_bytes: int, row_bytes: int,
              message_us: float = 0.0) -> Optional[TimeModel]:
        """The planner's time model from these times (None before anything was timed):
        ``feplb.fixed_costs`` "measured" prices the fitted cost per row and ``message_us``.

        It charges no fixed cost per piece: most of a one-row call is reading the weights, which a
        large call overlaps with its GEMMs, so charging it would overstate what splitting a large
        piece costs (benchmarks/LAYER.md). The one-row cost decides where no move can pay at all
        (`plan.policy.balancing_may_pay`)."""
        stage = TimeModel.measured(self.expert_seconds, self.rows, expert_bytes, row_bytes, config.copy_engine_gbps)
        if config.fixed_costs == "ignore" or stage is None:
            return stage
        fitted = self.fitted_us()  # none when no call was timed alone (every expert dynamic): the whole stage's
        row_us = fitted[1] if fitted is not None and fitted[1] > 0 else stage.row_us
        return replace(stage, row_us=row_us, message_us=message_us)
