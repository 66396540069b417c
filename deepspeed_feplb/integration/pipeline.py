"""FEPLB in DeepSpeed's pipeline engine: the 1F1B schedule with per-micro-batch FEPLB work.

`FEPLBTrainSchedule` is DeepSpeed's `TrainSchedule` (1F1B) with three changes:

* ``ForwardPass`` and ``BackwardPass`` carry ``micro_batch_id`` (DeepSpeed's handlers only get a
  buffer id, and buffers are reused by different micro-batches);
* ``PlanMicroBatch(micro_batch_id=i)`` is issued right after ``ForwardPass(i-1)`` (the moment
  micro-batch i-1's routing counts are known; the first one before ``ForwardPass(0)``), so the
  warm-start plan for micro-batch ``i`` is computed in a thread while this stage runs the
  backward pass and the p2p transfers that 1F1B puts between the two forwards;
* ``ReduceGrads`` is where the step's FEPLB statistics are aggregated (it runs once per
  ``train_batch`` after the last backward).

`FEPLBPipelineEngine` rebuilds ``_INSTRUCTION_MAP`` (it holds function objects: overriding a
method alone would change nothing) and keeps one `MicroBatchState` per micro-batch in flight,
keyed by micro-batch id: created by ``PlanMicroBatch`` (or the forward), filled by the forward
(the layer records of `StatsCollector`, the warm-start evaluation), checked and freed by the
backward of the *same* micro-batch. The plan itself travels with the activations: each FEPLB
layer keeps its `Phase2MicroBatch` in the autograd context of the micro-batch's forward, so the
backward of micro-batch ``i`` uses exactly the plan its forward used however 1F1B interleaves.

The warm start: `plan.policy.plan_domain` on the previous micro-batch's domain
counts of every FEPLB layer, with the layer's constraints. The scheduler's real plan needs this
micro-batch's counts, which exist only after its gate ran; the warm-start plan is what is known
earlier. The engine reports how good it would have been (``warm_start_token_straggler`` next to
``token_straggler_after``) and restarts a dead scheduler process before the forward instead of
after a plan timeout inside it.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from deepspeed_feplb.integration import seams
from deepspeed_feplb.integration.monitor import StatsCollector, warm_start_straggler
from deepspeed_feplb.plan.policy import PlanConstraints, plan_domain


class PlanMicroBatch(schedule.PipeInstruction):
    """Start FEPLB's work for micro-batch ``micro_batch_id`` as early as its data allows.

    Issued right after the forward pass of the previous micro-batch (before the first forward
    for micro-batch 0). Kwargs: ``micro_batch_id``.
    """


class FEPLBTrainSchedule(schedule.TrainSchedule):
    """1F1B `TrainSchedule` with micro-batch ids on compute instructions and `PlanMicroBatch` (module docstring)."""

    def steps(self):
        for step_id, cmds in enumerate(super().steps()):
            micro_batch_id, is_forward = self._step_to_micro_batch(step_id)
            out = []
            for cmd in cmds:
                if type(cmd) is schedule.ForwardPass:
                    if micro_batch_id == 0:
                        out.append(PlanMicroBatch(micro_batch_id=0))
                    out.append(schedule.ForwardPass(cmd.buffer_id, micro_batch_id=micro_batch_id))
                    if self._valid_micro_batch(micro_batch_id + 1):
                        out.append(PlanMicroBatch(micro_batch_id=micro_batch_id + 1))
                elif type(cmd) is schedule.BackwardPass:
                    out.append(schedule.BackwardPass(cmd.buffer_id, micro_batch_id=micro_batch_id))
                else:
                    out.append(cmd)
            yield out



@dataclass
class MicroBatchState:
    """FEPLB bookkeeping of one micro-batch in flight on this stage."""
    micro_batch_id: int
    hints: dict = field(default_factory=dict)  # layer -> warm-start moves int64 [M, 4]
    thread: Optional[threading.Thread] = None
    records: dict = field(default_factory=dict)  # layer -> monitor.Record of this rank
    forward_done: bool = False


class FEPLBPipelineEngine(PipelineEngine):
    """DeepSpeed's `PipelineEngine` running `FEPLBTrainSchedule` (module docstring).

    Attributes: ``feplb_monitor`` (the `StatsCollector`; ``feplb_monitor.last`` is the summary of the
    last ``train_batch``), ``feplb_in_flight`` (micro-batch id -> `MicroBatchState`).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.feplb_monitor = StatsCollector(self.module)
        self.feplb_in_flight: dict[int, MicroBatchState] = {}
        self._feplb_done: dict[int, dict] = {}
        self._feplb_layers = {name: layer for name, layer in self.feplb_monitor.layers.items()
                              if hasattr(layer, "feplb_config")}
        self._feplb_last_micro_batch = True

    def feplb_step_ends(self) -> bool:
        """Whether the micro-batch being forwarded is the last of ``train_batch`` (`seams.step_ends`):
        its backward, the last of the batch under 1F1B, runs before ``ReduceGrads``."""
        return self._feplb_last_micro_batch

    def feplb_later_micro_batches(self) -> int:
        """How many micro-batches of ``train_batch`` follow the one being forwarded
        (`seams.later_micro_batches`; 0 outside a training forward: ``eval_batch``'s)."""
        current = self.feplb_monitor.micro_batch
        return 0 if current is None else self.micro_batches - 1 - current

    def _train_schedule(self):
        return FEPLBTrainSchedule(micro_batches=self.micro_batches, stages=self.num_stages, stage_id=self.stage_id)

    # ------------------------------------------------------------------ instructions
    def _exec_plan_micro_batch(self, micro_batch_id: int):
        state = self.feplb_in_flight.setdefault(micro_batch_id, MicroBatchState(micro_batch_id))
        jobs = []
        for name, layer in self._feplb_layers.items():
            stage = getattr(layer, "stage", None)
            domain = stage.domain if stage is not None else None
            if domain is None or domain.closed:
                continue
            domain.scheduler.revive()
            previous = self.feplb_monitor.latest.get(name)
            if previous is None or len(previous.stats["ranks"]) < 2:  # no domain-wide counts to plan ahead on
                continue
            counts = np.asarray(previous.stats["domain_counts"])
            model = stage.compute_times.model(stage.config, stage.expert_bytes, stage.sizes.row_bytes,
                                              domain.transport.message_us)
            constraints = replace(PlanConstraints.from_config(stage.config, stage.expert_bytes, model,
                                                              stage.device.type == "cuda"),
                                  later_micro_batches=self.micro_batches - 1 - micro_batch_id)
            jobs.append((name, counts, constraints))
        if jobs:
            def warm_start():
                for name, counts, constraints in jobs:
                    state.hints[name] = plan_domain(counts, constraints).moves
            state.thread = threading.Thread(target=warm_start, name=f"feplb-warm-{micro_batch_id}", daemon=True)
            state.thread.start()

    def _exec_forward_pass(self, buffer_id: int, micro_batch_id: Optional[int] = None):
        if micro_batch_id is None:  # eval_batch's InferenceSchedule: nothing to balance-track
            return seams.deepspeed_instruction(self, "forward_pass", buffer_id)
        state = self.feplb_in_flight.setdefault(micro_batch_id, MicroBatchState(micro_batch_id))
        if state.forward_done:
            raise RuntimeError(f"FEPLB pipeline: micro-batch {micro_batch_id} forwarded twice in one batch")
        self.feplb_monitor.micro_batch = micro_batch_id
        self._feplb_last_micro_batch = micro_batch_id == self.micro_batches - 1
        try:
            seams.deepspeed_instruction(self, "forward_pass", buffer_id)
        finally:
            self.feplb_monitor.micro_batch = None
            self._feplb_last_micro_batch = True
        if state.thread is not None:
            state.thread.join()
            state.thread = None
        state.records = self.feplb_monitor.records.pop(micro_batch_id, {})
        for name, moves in state.hints.items():
            record = state.records.get(name)
            if record is not None and len(record.stats["ranks"]) > 1:
                record.extra["warm_start_token_straggler"] = warm_start_straggler(record.stats["domain_counts"], moves)
        state.hints = {}
        state.forward_done = True

    def _exec_backward_pass(self, buffer_id: int, micro_batch_id: int):
        state = self.feplb_in_flight.get(micro_batch_id)
        if state is None or not state.forward_done:
            raise RuntimeError(f"FEPLB pipeline: backward of micro-batch {micro_batch_id} before its forward")
        seams.deepspeed_instruction(self, "backward_pass", buffer_id)
        self._feplb_done[micro_batch_id] = state.records
        del self.feplb_in_flight[micro_batch_id]  # its plan lived in the autograd graph, freed by backward

    def _exec_reduce_grads(self):
        open_batches = sorted(self.feplb_in_flight)
        if open_batches:
            raise RuntimeError(f"FEPLB pipeline: micro-batch(es) {open_batches} have no backward pass in this batch")
        done, self._feplb_done = self._feplb_done, {}
        self.feplb_monitor.records = done  # flush() takes them
        monitor = self.monitor if _monitor_wanted(self._feplb_layers) else None
        self.feplb_monitor.flush(self.global_steps + 1, monitor)
        seams.deepspeed_instruction(self, "reduce_grads")

    _INSTRUCTION_MAP = seams.pipeline_instructions({
        schedule.ForwardPass: _exec_forward_pass,
        schedule.BackwardPass: _exec_backward_pass,
        schedule.ReduceGrads: _exec_reduce_grads,
        PlanMicroBatch: _exec_plan_micro_batch,
    })


def _monitor_wanted(layers: dict) -> bool:
    configs = [layer.feplb_config for layer in layers.values() if getattr(layer, "feplb_config", None) is not None]
    return all(c.stats.monitor for c in configs) if configs else True
