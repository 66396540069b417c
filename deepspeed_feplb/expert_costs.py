"""What this rank's expert compute costs: timed calls, the fitted cost per row and per piece.

`ComputeTimes` keeps the last micro-batch's expert times (the ``auto`` copy budget, the placement's
time per token), a `PieceFit` over recent timed forward expert calls (the static experts' and
each of phase 2's) and a `StageFactor` from those calls to the whole stage, forward and backward
(`ExpertStage._measure` times it); `ComputeTimes.model` builds the planner's
`plan.timeline.TimeModel` from them, and a recorded trace carries them for the simulator's check
(`sim.measured`).
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from deepspeed_feplb.config import FEPLBConfig
from deepspeed_feplb.kernels.cuda import cuda_index, current_stream_ptr
from deepspeed_feplb.plan.timeline import FWD_BWD_GEMMS, TimeModel


def device_mark(device: torch.device) -> torch.cuda.Event:
    """A timing event recorded now on ``device``'s current stream: the experts' device, which need
    not be torch's current one (a loop that placed the model with ``model.to(local_rank)`` leaves
    that at 0), and whose stream their work is queued on. A layer marks 10-20 times per forward: the
    stream comes from torch's raw binding, its torch handle made once (`current_stream_ptr`)."""
    index = cuda_index(device)
    event = torch.cuda.Event(enable_timing=True)
    event.record(_torch_stream(index, current_stream_ptr(index)))
    return event


@functools.lru_cache(maxsize=64)
def _torch_stream(index: int, ptr: int) -> torch.cuda.Stream:
    """Torch's handle of its stream ``ptr`` on device ``index`` (its current streams are few and live
    as long as the process: the default stream and its pools')."""
    return torch.cuda.ExternalStream(ptr, device=index)


@dataclass
class PieceFit:
    """Forward expert time ``t = k * piece_s + n * row_s`` for a call of ``k`` expert pieces and
    ``n`` rows: the least-squares fit of both costs over the timed calls, each micro-batch's calls
    weighing ``decay`` times the previous one's, so it follows a change of speed (another process
    taking a core) within a few micro-batches. The calls of one micro-batch differ in shape (the
    static experts: several pieces of few rows; a dynamic expert's piece: one piece of many rows),
    which separates the two costs; where they do not (every call alike), or the fit would make one
    cost negative, the cost of a piece is the caller's (`ComputeTimes.probe`: a one-row call) and
    the fit gives the cost per row."""
    decay: float = 0.7
    sums: np.ndarray = field(default_factory=lambda: np.zeros(5))  # kk, kn, nn, kt, nt
    warm: bool = False  # the first timed micro-batch pays one-time costs (first calls, allocations): dropped

    def add(self, samples: Sequence[tuple[int, int, float]]) -> None:
        """One micro-batch's samples (k, n, t), ``n > 0``."""
        if not samples:
            return
        if not self.warm:
            self.warm = True
            return
        k, n, t = (np.array(c, dtype=np.float64) for c in zip(*samples))
        self.sums = self.sums * self.decay + np.array([k @ k, k @ n, n @ n, k @ t, n @ t])

    def solve(self, piece_s: Optional[float] = None) -> Optional[tuple[float, float]]:
        """(piece_s, row_s), both >= 0; ``piece_s``: the cost of a piece where the calls do not
        tell it (None: then no fit). None before any sample."""
        kk, kn, nn, kt, nt = self.sums
        if nn <= 0:
            return None
        det = kk * nn - kn * kn
        if det > _WELL_CONDITIONED * kk * nn:
            piece, row = (kt * nn - nt * kn) / det, (kk * nt - kn * kt) / det
            if piece >= 0 and row >= 0:
                return float(piece), float(row)
        if piece_s is None:
            return None
        return piece_s, max(float(nt - piece_s * kn) / nn, 0.0)


# calls whose rows per piece differ by ~2x or more separate the two costs (det / (kk nn) = 1 - cos²)
_WELL_CONDITIONED = 0.05


@dataclass
class StageFactor:
    """What the fitted forward calls of a stage become in the whole stage: (forward + backward stage
    time, less the waits for the plan and for peers) / (its forward expert calls as `PieceFit`
    prices them), decayed like `PieceFit`. It holds the backward (which autograd runs where no call
    can be timed alone) and the stage's own host work (publishing the counts, concatenating, phase
    2's bookkeeping) in proportion to the expert compute; ``forward_share`` is the forward's part of
    that busy time (the time model's `TimeModel.forward_share`). Host clock only: on CUDA it stays
    at `FWD_BWD_GEMMS`, a third forward."""
    decay: float = 0.7
    sums: np.ndarray = field(default_factory=lambda: np.zeros(3))  # busy, calls, forward busy
    warm: bool = False  # the first sample (first calls, the first backward's allocations): dropped

    def add(self, forward_s: float, backward_s: float, calls_s: float) -> None:
        """One stage: its forward and backward busy seconds, and its forward calls as fitted."""
        busy_s = forward_s + backward_s
        if calls_s <= 0 or busy_s <= 0 or forward_s < 0 or backward_s < 0:
            return
        if not self.warm:
            self.warm = True
            return
        self.sums = self.sums * self.decay + np.array([busy_s, calls_s, forward_s])

    @property
    def value(self) -> float:
        busy, calls, _ = self.sums
        return float(busy / calls) if calls > 0 else float(FWD_BWD_GEMMS)

    @property
    def forward_share(self) -> float:
        busy, _, forward = self.sums
        return float(forward / busy) if busy > 0 else 1.0 / FWD_BWD_GEMMS


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
    factor: StageFactor = field(default_factory=StageFactor)  # micro-batches balanced through the domain
    local_factor: StageFactor = field(default_factory=StageFactor)  # those computed here alone (`run_local`)
    calls: tuple = (0, 0)  # the last micro-batch's timed forward calls on the host: (pieces, rows)
    piece_s: Optional[float] = None  # what a one-row expert call costs, once `probe` was read
    probe_marks: Optional[list] = None  # its marks (host seconds, or CUDA events not read yet)

    def clock(self, device: torch.device) -> Callable[[], object]:
        """A function that marks "now" on ``device``'s timeline (first reads the last micro-batch's events)."""
        if device.type != "cuda":
            return time.perf_counter
        self.resolve()
        return lambda: device_mark(device)

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
            self.calls = (sum(k for k, _, _, _ in pieces), sum(n for _, n, _, _ in pieces))
            self.fit.add([(k, n, b - a) for k, n, a, b in pieces])
        else:
            self.pending = (begin, static_done, end, list(pieces))

    def stage_done(self, forward_s: float, backward_s: float, calls: tuple, balanced: bool = True) -> None:
        """A micro-batch's stage has run its backward: ``forward_s`` and ``backward_s`` host seconds,
        each less its waits, for forward expert calls of ``calls`` = (pieces, rows) (`StageFactor`);
        ``balanced``: it went through the domain (phase 2's own work, a backward per piece) rather
        than computing every expert here."""
        fit = self._forward_fit()
        if fit is not None:
            (self.factor if balanced else self.local_factor).add(forward_s, backward_s,
                                                                 calls[0] * fit[0] + calls[1] * fit[1])

    def forward_share(self, balanced: bool = True) -> float:
        """The forward's share of the stage's busy time (`StageFactor.forward_share`) of the path."""
        return (self.factor if balanced else self.local_factor).forward_share

    def fitted_us(self, balanced: bool = True) -> Optional[tuple[float, float]]:
        """(piece_us, row_us), forward + backward (`PieceFit` x `StageFactor`) of a micro-batch
        balanced through the domain (``balanced``, what the planner prices) or computed here
        alone; None before the probe and a micro-batch were timed."""
        self.resolve()
        fit = self._forward_fit()
        if fit is None:
            return None
        factor = (self.factor if balanced else self.local_factor).value * 1e6
        return fit[0] * factor, fit[1] * factor

    def _forward_fit(self) -> Optional[tuple[float, float]]:
        """`PieceFit.solve`'s forward (piece_s, row_s), once the probe was read; else None."""
        return self.fit.solve(self.piece_s) if self.piece_s is not None else None

    def model(self, config: FEPLBConfig, expert_bytes: int, row_bytes: int, message_us: float = 0.0,
              sends_after_static: bool = False, serves_on_arrival: bool = False) -> Optional[TimeModel]:
        """The planner's time model from these times (None before anything was timed):
        ``feplb.fixed_costs`` "measured" prices the fitted costs of a piece and of a row
        (`fitted_us`) and ``message_us``; the simulator's replay of a recorded run
        (`sim.measured`) prices them alike. ``sends_after_static``: a home can send its chunks only
        after its static experts (one grouped call on the CPU: no point in between to send);
        ``serves_on_arrival``: a helper serves each chunk as soon as it is in (`TimeModel`). The
        plan's own latency is left out: every candidate plan waits for it alike."""
        stage = TimeModel.measured(self.expert_seconds, self.rows, expert_bytes, row_bytes, config.copy_engine_gbps)
        if stage is None:
            return None
        stage = replace(stage, sends_after_static=sends_after_static, serves_on_arrival=serves_on_arrival,
                        forward_share=self.factor.forward_share,
                        serve_parts=config.serve_parts, serve_part_rows=config.serve_part_rows)
        if config.fixed_costs == "ignore":
            return stage
        fitted = self.fitted_us()  # none when no call was timed alone (every expert dynamic): the whole stage's
        if fitted is None or fitted[1] <= 0:
            return replace(stage, message_us=message_us)
        return replace(stage, piece_us=fitted[0], row_us=fitted[1], message_us=message_us)
