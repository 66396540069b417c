"""One micro-batch's expert stage with FEPLB balancing, shared by every layer kind.

`run_experts` is what `layer.FEPLBMOELayer` (DeepSpeed MoE) and `integration.autoep`
(Hugging Face models sharded by AutoEP) call between phase 1's dispatch and combine:

1. publish this rank's per-expert counts to the domain's scheduler (`scheduler/`);
2. compute the static experts (all but this rank's D hottest) while the scheduler plans;
3. read the `Plan` and run the dynamic experts through `migrate.phase2` (rows and weights to
   helpers of the NVLink domain, results and gradients home; weights a helper kept from earlier
   in the step are not copied again, `migrate.resident`).

The plan is judged by a time model (`plan.timeline`) made from this rank's earlier micro-batches:
its forward expert cost per row, fitted to its timed expert calls (`PieceFit`, x 3 for forward +
backward), ``copy_engine_gbps`` and the transport's latency per message (``feplb.fixed_costs:
"ignore"``: the last micro-batch's expert time per row, no message latency). The cost of one
expert piece (a one-row call, `ComputeTimes.probe`) decides where no move can pay at all
(`plan.policy.balancing_may_pay`); there `run_local` computes the micro-batch without balancing,
timing every expert call for the fit.

The caller says how to run one expert functionally (a module per local expert as template, its
parameters, an `ExpertSpec`) and may give a faster compute for the static experts (e.g.
AutoEP's grouped GEMM).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from deepspeed_feplb.config import FEPLBConfig
from deepspeed_feplb.domain import DomainRuntime
from deepspeed_feplb.migrate.phase2 import DynamicExperts, ExpertSpec, Phase2Step
from deepspeed_feplb.migrate.resident import LayerResidency
from deepspeed_feplb.plan.policy import PlanConstraints, dynamic_candidates
from deepspeed_feplb.plan.timeline import FWD_BWD_GEMMS, TimeModel
from deepspeed_feplb.stats import StageTimes, layer_stats, recomputing, residency_stats

# static_fn(rows, counts, static) -> outputs of the experts in ``static`` (local ids, ascending),
# concatenated in expert order; ``rows``/``counts`` are the whole micro-batch.
StaticFn = Callable[[torch.Tensor, np.ndarray, list], torch.Tensor]


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

        It charges no fixed cost per piece: what makes a one-row call expensive is mostly reading
        the expert's weights, which a large call overlaps with its GEMMs, so the one-row cost would
        overstate what splitting a large piece costs (measured: with it, bench_layer at hidden 256 /
        ffn 2048 balanced less and ran 0.75x of balancing off instead of 0.68-0.70x). The one-row
        cost decides where no move can pay at all (`plan.policy.balancing_may_pay`)."""
        stage = TimeModel.measured(self.expert_seconds, self.rows, expert_bytes, row_bytes, config.copy_engine_gbps)
        if config.fixed_costs == "ignore" or stage is None:
            return stage
        fitted = self.fitted_us()  # none when no call was timed alone (every expert dynamic): the whole stage's
        row_us = fitted[1] if fitted is not None and fitted[1] > 0 else stage.row_us
        return replace(stage, row_us=row_us, message_us=message_us)


def functional_calls(modules: Sequence[torch.nn.Module], params: list[list[torch.Tensor]],
                     spec: ExpertSpec) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """``call(e, x)``: local expert e on rows x, run functionally with ``params[e]`` and its own buffers."""
    return lambda e, x: spec.call(modules[e], params[e], spec.buffers(modules[e]), x)


def timed_pieces(rows: torch.Tensor, counts: np.ndarray, experts: Sequence[int], mark: Callable[[], object],
                 call: Callable[[int, torch.Tensor], torch.Tensor], static_fn: Optional["StaticFn"] = None,
                 pieces: Optional[list] = None) -> list[torch.Tensor]:
    """Outputs of ``experts`` (local ids, ascending) on their rows of ``rows`` (grouped by local
    expert, ``counts int64 [E_local]``): ``call(e, x)`` each, or ``static_fn`` for all at once;
    appends (k pieces, n rows, start mark, end mark) per timed call to ``pieces``."""
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    sizes = [int(counts[e]) for e in experts]
    if static_fn is not None:
        start = mark()
        outs = list(static_fn(rows, counts, list(experts)).split(sizes))
        if pieces is not None and sum(sizes):
            pieces.append((sum(n > 0 for n in sizes), sum(sizes), start, mark()))
        return outs
    outs = []
    for e, n in zip(experts, sizes):
        start = mark()
        outs.append(call(e, rows[starts[e]:starts[e + 1]]))
        if pieces is not None and n:
            pieces.append((1, n, start, mark()))
    return outs


def run_local(rows: torch.Tensor, counts: np.ndarray, call: Callable[[int, torch.Tensor], torch.Tensor],
              times: Optional[ComputeTimes], stage_times: StageTimes, probe: bool = False) -> torch.Tensor:
    """rows ``[N, H]`` grouped by local expert, counts ``int64 [E_local]`` -> outputs ``[N, H]``, every
    expert computed here (no balancing); ``call(e, x)`` runs local expert e. Each call is timed
    into ``times`` (None: not timed); ``probe``: also time a one-row call once (`ComputeTimes.probe`)."""
    mark = times.clock(rows.device) if times is not None else (lambda: 0.0)
    pieces: list = []
    if times is not None and probe:
        times.probe(rows, counts, call, mark)
    begin = mark()
    with stage_times.measure("static experts"):
        outs = timed_pieces(rows, counts, range(len(counts)), mark, call, pieces=pieces if times else None)
    if times is not None:
        end = mark()
        times.finish(begin, end, end, int(counts.sum()), pieces)
    return torch.cat(outs) if outs else rows


def run_experts(rows: torch.Tensor, counts: np.ndarray, modules: Sequence[torch.nn.Module],
                params: list[list[torch.Tensor]], spec: ExpertSpec, domain: DomainRuntime, config: FEPLBConfig,
                expert_bytes: int, times: ComputeTimes, stage_times: Optional[StageTimes] = None,
                static_fn: Optional[StaticFn] = None, residency: Optional[LayerResidency] = None,
                step_ends: bool = True, mean_rows: float = 0.0) -> tuple[torch.Tensor, Optional[dict]]:
    """rows ``[N, H]`` grouped by local expert, counts ``int64 [E_local]`` -> (outputs ``[N, H]``,
    stats or None when ``config.stats`` is off).

    modules[e] runs expert e functionally with ``params[e]`` (named ``spec.param_names``) and its
    own buffers; ``times`` holds the previous micro-batch's compute times and is updated;
    ``stage_times`` receives the host time of each stage (forward now, phase 2's backward later);
    ``residency`` is the layer's weight residency (None: none) and ``step_ends`` says whether this
    micro-batch is the last of its optimizer step (`migrate.resident`); ``mean_rows``: rows per rank
    over the whole EP group, for ``config.max_rows_over_mean`` (0: the domain's mean). A forward that activation
    checkpointing recomputes in backward leaves residency alone and returns no stats.
    """
    stage_times = stage_times if stage_times is not None else StageTimes()
    recompute = recomputing()
    if recompute:  # activation checkpointing re-runs this forward in backward: not a new micro-batch
        residency, step_ends = None, True
    mark = times.clock(rows.device)
    call = functional_calls(modules, params, spec)
    if config.fixed_costs == "measured":
        times.probe(rows, counts, call, mark)
    begin = mark()
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    seq = domain.next_seq()
    row_bytes = rows.shape[1] * rows.element_size()
    model = times.model(config, expert_bytes, row_bytes, domain.transport.message_us)
    constraints = replace(PlanConstraints.from_config(config, expert_bytes, model), mean_rows=float(mean_rows))
    if model is None and config.fixed_costs == "measured" and not config.max_rows_over_mean:
        constraints = replace(constraints, dynamic_experts=0)  # nothing timed yet: no move is known to pay
    resident_row = residency.table.resident[domain.local_rank] if residency is not None else None
    domain.scheduler.publish(seq, counts, constraints, resident_row)

    dynamic = [int(e) for e in dynamic_candidates(counts[None], config.dynamic_experts_per_rank)[0]]
    static = [e for e in range(len(modules)) if e not in dynamic]
    outs: list = [None] * len(modules)
    pieces: list = []
    with stage_times.measure("static experts"):
        for e, y in zip(static, timed_pieces(rows, counts, static, mark, call, static_fn, pieces)):
            outs[e] = y
    static_done = mark()

    with stage_times.measure("plan wait"):
        planned = domain.scheduler.plan(seq)
    needs_grad = torch.is_grad_enabled() and (rows.requires_grad or any(p.requires_grad for p in params[0]))
    step = Phase2Step(domain.transport, seq, domain.local_rank, planned.plan.moves, dynamic,
                      [int(counts[e]) for e in dynamic], list(modules), spec, needs_grad, stage_times,
                      residency, step_ends)
    dyn_x = torch.cat([rows[starts[e]:starts[e + 1]] for e in dynamic]) if dynamic else rows[:0]
    dyn_y = DynamicExperts.apply(step, len(spec.param_names), dyn_x, *[p for e in step.grad_experts for p in params[e]])
    for e, y in zip(dynamic, dyn_y.split([int(counts[e]) for e in dynamic])):
        outs[e] = y
    stats = None
    if config.stats.enabled and not recompute:
        stats = layer_stats(planned.counts, planned.plan.moves, planned.seconds, planned.fallback, domain.ranks,
                            residency_stats(step.fresh, step.keeps, len(step.flush_entries), expert_bytes), seq)
    if not recompute:
        times.finish(begin, static_done, mark(), int(counts.sum()), pieces)
    return torch.cat(outs), stats
