"""One micro-batch's expert stage with FEPLB balancing, shared by every layer kind.

`run_experts` is what `layer.FEPLBMOELayer` (DeepSpeed MoE) and `integration.autoep`
(Hugging Face models sharded by AutoEP) call between phase 1's dispatch and combine:

1. publish this rank's per-expert counts to the domain's scheduler (`scheduler/`);
2. compute the static experts (all but this rank's D hottest) while the scheduler plans;
3. read the `Plan` and run the dynamic experts through `migrate.phase2` (rows and weights to
   helpers of the NVLink domain, results and gradients home; weights a helper kept from earlier
   in the step are not copied again, `migrate.resident`).

The plan is judged by a time model (`plan.timeline`) made from this rank's previous micro-batch:
its forward expert time per row (x 3 for forward + backward) and ``copy_engine_gbps``.

The caller says how to run one expert functionally (a module per local expert as template, its
parameters, an `ExpertSpec`) and may give a faster compute for the static experts (e.g.
AutoEP's grouped GEMM).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from deepspeed_feplb.config import FEPLBConfig
from deepspeed_feplb.domain import DomainRuntime
from deepspeed_feplb.migrate.phase2 import DynamicExperts, ExpertSpec, Phase2Step
from deepspeed_feplb.migrate.resident import LayerResidency
from deepspeed_feplb.plan.policy import PlanConstraints, dynamic_candidates
from deepspeed_feplb.plan.timeline import TimeModel
from deepspeed_feplb.stats import StageTimes, layer_stats, recomputing, residency_stats

# static_fn(rows, counts, static) -> outputs of the experts in ``static`` (local ids, ascending),
# concatenated in expert order; ``rows``/``counts`` are the whole micro-batch.
StaticFn = Callable[[torch.Tensor, np.ndarray, list], torch.Tensor]


@dataclass
class ComputeTimes:
    """What the previous micro-batch's expert compute took on this rank (sizes the ``auto`` budget).

    On CUDA the host clock around asynchronous launches would time the launches, not the GEMMs:
    there the stage boundaries are CUDA events, read when the next micro-batch starts (they have
    finished by then; if not, the older figures stay). On CPU it is the host clock.
    """
    static_seconds: float = 0.0
    expert_seconds: float = 0.0
    rows: int = 0  # rows this rank computed in the timed micro-batch (before balancing)
    pending: Optional[tuple] = None  # CUDA events (begin, static done, end) not read yet

    def clock(self, device: torch.device) -> Callable[[], object]:
        """A function that marks "now" on ``device``'s timeline (first reads the last micro-batch's events)."""
        if device.type != "cuda":
            return time.perf_counter
        if self.pending is not None and self.pending[-1].query():
            begin, static_done, end = self.pending
            self.static_seconds = begin.elapsed_time(static_done) / 1e3
            self.expert_seconds = begin.elapsed_time(end) / 1e3
            self.pending = None

        def mark():
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return mark

    def finish(self, begin, static_done, end, rows: int) -> None:
        """The marks of this micro-batch of ``rows`` rows (host seconds, or CUDA events to read next time)."""
        self.rows = int(rows)
        if isinstance(begin, float):
            self.static_seconds, self.expert_seconds = static_done - begin, end - begin
        else:
            self.pending = (begin, static_done, end)

    def model(self, config: FEPLBConfig, expert_bytes: int, row_bytes: int) -> Optional[TimeModel]:
        """The planner's time model from these times (None before anything was timed)."""
        return TimeModel.measured(self.expert_seconds, self.rows, expert_bytes, row_bytes, config.copy_engine_gbps)


def run_experts(rows: torch.Tensor, counts: np.ndarray, modules: Sequence[torch.nn.Module],
                params: list[list[torch.Tensor]], spec: ExpertSpec, domain: DomainRuntime, config: FEPLBConfig,
                expert_bytes: int, times: ComputeTimes, stage_times: Optional[StageTimes] = None,
                static_fn: Optional[StaticFn] = None, residency: Optional[LayerResidency] = None,
                step_ends: bool = True) -> tuple[torch.Tensor, Optional[dict]]:
    """rows ``[N, H]`` grouped by local expert, counts ``int64 [E_local]`` -> (outputs ``[N, H]``,
    stats or None when ``config.stats`` is off).

    modules[e] runs expert e functionally with ``params[e]`` (named ``spec.param_names``) and its
    own buffers; ``times`` holds the previous micro-batch's compute times and is updated;
    ``stage_times`` receives the host time of each stage (forward now, phase 2's backward later);
    ``residency`` is the layer's weight residency (None: none) and ``step_ends`` says whether this
    micro-batch is the last of its optimizer step (`migrate.resident`). A forward that activation
    checkpointing recomputes in backward leaves residency alone and returns no stats.
    """
    stage_times = stage_times if stage_times is not None else StageTimes()
    recompute = recomputing()
    if recompute:  # activation checkpointing re-runs this forward in backward: not a new micro-batch
        residency, step_ends = None, True
    mark = times.clock(rows.device)
    begin = mark()
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    seq = domain.next_seq()
    row_bytes = rows.shape[1] * rows.element_size()
    constraints = PlanConstraints.from_config(config, expert_bytes, times.model(config, expert_bytes, row_bytes))
    resident_row = residency.table.resident[domain.local_rank] if residency is not None else None
    domain.scheduler.publish(seq, counts, constraints, resident_row)

    dynamic = [int(e) for e in dynamic_candidates(counts[None], config.dynamic_experts_per_rank)[0]]
    static = [e for e in range(len(modules)) if e not in dynamic]
    outs: list = [None] * len(modules)
    with stage_times.measure("static experts"):
        if static_fn is not None:
            static_y = static_fn(rows, counts, static)
            for e, y in zip(static, static_y.split([int(counts[e]) for e in static])):
                outs[e] = y
        else:
            for e in static:
                outs[e] = spec.call(modules[e], params[e], spec.buffers(modules[e]), rows[starts[e]:starts[e + 1]])
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
        stats = {**layer_stats(planned.counts, planned.plan.moves, planned.seconds, planned.fallback, domain.ranks),
                 **residency_stats(step.fresh, step.keeps, len(step.flush_entries), expert_bytes),
                 "domain_counts": planned.counts, "seq": seq}
    times.finish(begin, static_done, mark(), int(counts.sum()))
    return torch.cat(outs), stats
