"""One micro-batch balanced over its domain, stage by stage, as the paper runs it.

`BalancedMicroBatch.run` on this rank's rows of one layer:

1. `publish`: the rows per local expert, the dynamic experts this rank chose (its D hottest, and
   up to D more while the rest exceed its domain's mean: `plan.hottest`) and the plan's
   constraints (the time model as last measured, the residency, the micro-batches left in the
   step) go to the domain's scheduler, which plans from what every rank published.
2. `static_experts`: every other expert computes at once; between its calls the rank looks for
   the plan, and once it is there takes it (3.), so its chunks leave while the rest compute.
3. `take_plan`: the plan (waited for, where the static experts finished first) becomes the
   micro-batch's `Phase2MicroBatch`, which sends each chunk's rows, and its expert's weights
   unless the helper keeps a copy, to the helper.
4. `dynamic_experts`: the dynamic experts' home rows, the chunks this rank serves for others,
   the results received (`DynamicExperts`; its backward mirrors the forward: output-gradients to
   the helpers, input- and weight-gradients home).
5. `finish`: the outputs in expert order, the stats, the stage's times for the cost fit.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Optional, Protocol

import numpy as np
import torch

from deepspeed_feplb.config import FEPLBConfig
from deepspeed_feplb.domain import DomainRuntime
from deepspeed_feplb.expert_costs import ComputeTimes
from deepspeed_feplb.experts import LocalExperts, on_graph, timed_pieces
from deepspeed_feplb.migrate.phase2 import DynamicExperts, Phase2Anchor, Phase2MicroBatch, grad_experts, serving_stream
from deepspeed_feplb.migrate.resident import LayerResidency
from deepspeed_feplb.plan.hottest import NONE, dynamic_candidates
from deepspeed_feplb.plan.policy import PlanConstraints, serves_on_arrival
from deepspeed_feplb.scheduler.client import DomainPlan
from deepspeed_feplb.stats import MicroBatchStats, StageTimes, layer_stats, recomputing, residency_stats


class BalancingLayer(Protocol):
    """What a balanced micro-batch uses of its layer's expert stage (`expert_stage.ExpertStage`)."""
    config: FEPLBConfig
    domain: DomainRuntime
    residency: Optional[LayerResidency]
    compute_times: ComputeTimes
    stage_times: StageTimes
    expert_bytes: int


class BalancedMicroBatch:
    """One layer's micro-batch balanced over ``layer.domain`` (module docstring).

    rows ``[N, H]`` grouped by local expert, ``counts`` int64 ``[E_local]``; ``experts``: how the
    layer computes its experts; ``step_ends``: this micro-batch is the last of its optimizer step
    (weight residency); ``later``: how many micro-batches of the step follow it (a copy kept for
    the step serves them: the planner's price of it); ``mean_rows``: rows per rank over the whole EP group, for
    ``feplb.max_rows_over_mean`` (0: the domain's mean); ``domain_mean``: rows per rank over this
    rank's domain, by which a rank at or below it chooses no dynamic experts where plans only move
    rows to it (None: not known, the dispatcher tells no other rank's rows); ``record``: a dict that receives the
    plan's ``moves``, their ``fresh`` flags, the `Phase2MicroBatch` (``phase2``), how long the
    plan was waited for (``plan_wait_s``) and when it was in hand (``plan_in_hand``, host
    seconds), for `ExpertStage._measure`. A forward that activation checkpointing recomputes in
    backward leaves residency alone and returns no stats.
    """

    def __init__(self, layer: BalancingLayer, rows: torch.Tensor, counts: np.ndarray, experts: LocalExperts,
                 step_ends: bool = True, mean_rows: float = 0.0, record: Optional[dict] = None,
                 domain_mean: Optional[float] = None, later: int = 0):
        self.recompute = recomputing()  # activation checkpointing re-runs this forward: not a new micro-batch
        self.config, self.domain, self.times, self.stage_times = (layer.config, layer.domain, layer.compute_times,
                                                                   layer.stage_times)
        self.expert_bytes = layer.expert_bytes
        self.residency = None if self.recompute else layer.residency
        self.step_ends = True if self.recompute else step_ends
        self.later = 0 if self.step_ends else max(1, int(later))
        self.rows, self.counts, self.experts = rows, counts, experts
        self.mean_rows, self.domain_mean, self.record = mean_rows, domain_mean, record
        self.serve_early = serves_on_arrival(self.config.serve_on_arrival, rows.device.type == "cuda")
        self.blocks = list(rows.split(counts.tolist()))
        self.outs: list = [None] * len(counts)
        self.pieces: list = []  # timed calls (`timed_pieces`)
        self.phase2: Optional[Phase2MicroBatch] = None
        self.planned: Optional[DomainPlan] = None
        self.plan_at = self.plan_wait_s = 0.0  # when the plan was in hand (host seconds), how long waited for

    def run(self) -> tuple[torch.Tensor, Optional[MicroBatchStats]]:
        """The outputs ``[N, H]`` and the stats (None with ``feplb.stats`` off or in a recompute)."""
        self.params = self.experts.params()
        with self.experts.calls(self.params) as self.call:
            self.static_fn = self.experts.static(self.params)
            self.mark = self.times.clock(self.rows.device)
            if self.config.fixed_costs == "measured":
                self.times.probe(self.rows, self.counts, self.call, self.mark)
            self.begin = self.mark()
            self.publish()
            self.static_experts()
            self.take_plan()
            self.dynamic_experts()
            return self.finish()

    # ------------------------------------------------------------------ 1. publish
    def publish(self) -> None:
        """The counts, the dynamic experts this rank chose and the plan's constraints, to the
        domain's scheduler (under a new ``seq``)."""
        self.seq = self.domain.next_seq()
        constraints = self._constraints()
        chosen = dynamic_candidates(self.counts[None], constraints.dynamic_experts, self.domain_mean,
                                    constraints.senders_only(self.domain.size))[0]
        chosen = chosen[chosen != NONE]
        self.dynamic = chosen.tolist()
        self.static = [e for e in range(len(self.counts)) if e not in self.dynamic]
        # a forward without gradients computes with no kept copy (`Phase2MicroBatch`): planned without them
        self.needs_grad = torch.is_grad_enabled() and (self.rows.requires_grad
                                                       or any(p.requires_grad for p in self.params[0]))
        trusted = self.residency is not None and self.needs_grad
        resident_row = self.residency.table.resident[self.domain.local_rank] if trusted else None
        self.domain.scheduler.publish(self.seq, self.counts, constraints, resident_row, chosen)

    def _constraints(self) -> PlanConstraints:
        """This micro-batch's `PlanConstraints`: the config's, priced by the time model measured so
        far. D is 0 while nothing is timed and no row bound asks for moves (none is known to pay):
        then every expert is static."""
        config, rows = self.config, self.rows
        # a grouped static call on the CPU leaves no point to send from before it ends (`timed_pieces`)
        on_gpu = rows.device.type == "cuda"
        # the time model's serving on arrival is the GPU's: a served stream beside the rank's own experts
        model = self.times.model(config, self.expert_bytes, rows.shape[1] * rows.element_size(),
                                 self.domain.transport.message_us,
                                 sends_after_static=self.static_fn is not None and not on_gpu,
                                 serves_on_arrival=self.serve_early and on_gpu)
        constraints = replace(PlanConstraints.from_config(config, self.expert_bytes, model, on_gpu),
                              mean_rows=float(self.mean_rows), later_micro_batches=self.later)
        if model is None and config.fixed_costs == "measured" and not config.max_rows_over_mean:
            constraints = replace(constraints, dynamic_experts=0)
        return constraints

    # ------------------------------------------------------------------ 2. static experts
    def static_experts(self) -> None:
        """The static experts, looking for the plan between their calls (`take_plan` as soon as it
        is there: its sends then overlap the rest, as the time model has it)."""
        self._anchor_phase2_inputs()
        with self.stage_times.measure("static experts"):
            outs = timed_pieces(self.rows, self.blocks, self.static, self.mark, self.call, self.static_fn,
                                self.pieces, between=self._plan_if_ready)
        for e, y in zip(self.static, outs):
            self.outs[e] = y
        self.static_done = self.mark()

    def _anchor_phase2_inputs(self) -> None:
        """Phase 2's inputs, taken before the static experts start: its waiting half of backward
        (`Phase2Anchor`) then runs after their backward was queued, and its copies of the rows wait
        for phase 1 only (`Transport.mark`), not for the static experts queued after it."""
        params = self.params
        self.with_grads = grad_experts(self.residency, self.domain.local_rank, self.dynamic, self.step_ends,
                                       self.needs_grad)
        self.dyn_params = [p for e in self.with_grads for p in params[e]]
        self.dyn_x = torch.cat([self.blocks[e] for e in self.dynamic]) if self.dynamic else self.rows[:0]
        if self.needs_grad and not any(p.requires_grad for p in self.dyn_params):
            # the rank may serve others' dynamic experts: its backward must run even so (`on_graph`)
            self.dyn_x = on_graph(self.dyn_x, params[0])
        self.box: dict = {}  # `Phase2Anchor`'s way to the `Phase2MicroBatch`, once there is one
        if self.needs_grad:
            self.dyn_x, *self.dyn_params = Phase2Anchor.apply(self.box, len(self.experts.spec.param_names),
                                                              self.dyn_x, *self.dyn_params)
        self.ready = self.domain.transport.mark()

    def _plan_if_ready(self):
        """For `timed_pieces`, between two static calls: the work of taking the plan, if it is there."""
        if self.phase2 is not None or not self.domain.scheduler.plan_ready(self.seq):
            return None
        return lambda: self._start_phase2(self.domain.scheduler.plan(self.seq))

    # ------------------------------------------------------------------ 3. the plan
    def take_plan(self) -> None:
        """The plan in hand (waited for here, where the static experts finished first) and its
        chunks sent."""
        if self.phase2 is not None:
            return
        waited = time.perf_counter()
        with self.stage_times.measure("plan wait"):
            self._start_phase2(self.domain.scheduler.plan(self.seq))
        self.plan_wait_s = max(0.0, self.plan_at - waited)

    def _start_phase2(self, planned: DomainPlan) -> None:
        self.plan_at, self.planned = time.perf_counter(), planned
        self.row_counts = [int(self.counts[e]) for e in self.dynamic]
        modules, params = self.experts.modules, self.params
        self.phase2 = Phase2MicroBatch(self.domain.transport, self.seq, self.domain.local_rank, planned.plan.moves,
                                       self.dynamic, self.row_counts, list(modules), self.experts.spec,
                                       self.needs_grad, self.with_grads, self.stage_times, self.residency,
                                       self.step_ends, self.ready, self.mark, self.config.serve_parts,
                                       self.config.serve_part_rows, self.serve_early,
                                       serving_stream(self.config.serve_on_arrival, self.rows.device))
        self.phase2.send_forward(self.dyn_x.detach(), [[p.detach() for p in params[e]] for e in self.dynamic])

    # ------------------------------------------------------------------ 4. dynamic experts
    def dynamic_experts(self) -> None:
        """The dynamic experts where the plan puts them: home rows here, chunks on their helpers
        (this rank serves its own share meanwhile), results received into their places."""
        self.box["step"] = self.phase2
        dyn_y = DynamicExperts.apply(self.phase2, len(self.experts.spec.param_names), self.dyn_x, *self.dyn_params)
        for e, y in zip(self.dynamic, dyn_y.split(self.row_counts)):
            self.outs[e] = y
        if not self.dynamic:  # a rank without dynamic experts may serve others': its backward must run too
            self.outs.append(dyn_y)

    # ------------------------------------------------------------------ 5. finish
    def finish(self) -> tuple[torch.Tensor, Optional[MicroBatchStats]]:
        """The outputs in expert order, the stats and the stage's times (`ComputeTimes.finish`)."""
        planned, phase2 = self.planned, self.phase2
        if self.record is not None:
            self.record.update(moves=planned.plan.moves, fresh=phase2.fresh, phase2=phase2,
                               plan_wait_s=self.plan_wait_s, plan_in_hand=self.plan_at)
        stats = None
        if self.config.stats.enabled and not self.recompute:
            stats = layer_stats(planned.counts, planned.plan.moves, planned.seconds, planned.fallback,
                                self.domain.ranks,
                                residency_stats(phase2.fresh, phase2.copy_kept, len(phase2.flush_entries),
                                                self.expert_bytes, phase2.resent), self.seq)
        if not self.recompute:
            self.times.finish(self.begin, self.static_done, self.mark(), int(self.counts.sum()),
                              self.pieces + phase2.timed)
        return torch.cat(self.outs), stats
