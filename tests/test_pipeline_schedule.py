"""FEPLBTrainSchedule and the engine's per-micro-batch bookkeeping, without processes.

Mirrors DeepSpeed's tests/unit/runtime/pipe/test_pipe_schedule.py: iterate the schedule and
assert on instruction types, buffer ids and micro-batch ids.
"""
import numpy as np
import pytest
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from deepspeed_feplb.integration.monitor import StatsCollector, warm_start_straggler
from deepspeed_feplb.integration.pipeline import (
    FEPLBPipelineEngine,
    FEPLBTrainSchedule,
    MicroBatchState,
    PlanMicroBatch,
)

SHAPES = [(mb, stages, stage) for mb in (1, 2, 3, 8) for stages in (1, 2, 4) for stage in range(stages)]


def flat(sched):
    return [cmd for step in sched.steps() for cmd in step]


@pytest.mark.parametrize("micro_batches,stages,stage_id", SHAPES)
def test_same_instructions_as_deepspeed_plus_plans(micro_batches, stages, stage_id):
    ours = FEPLBTrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
    base = schedule.TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
    ours_steps, base_steps = list(ours.steps()), list(base.steps())
    assert len(ours_steps) == len(base_steps) == 2 * (micro_batches + stages - 1)
    for mine, theirs in zip(ours_steps, base_steps):
        stripped = [c for c in mine if type(c) is not PlanMicroBatch]
        assert [type(c) for c in stripped] == [type(c) for c in theirs]
        assert [getattr(c, "buffer_id", None) for c in stripped] == [getattr(c, "buffer_id", None) for c in theirs]
    assert ours.num_pipe_buffers() == base.num_pipe_buffers()


@pytest.mark.parametrize("micro_batches,stages,stage_id", SHAPES)
def test_micro_batch_ids_and_plan_placement(micro_batches, stages, stage_id):
    cmds = flat(FEPLBTrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage_id))
    kinds = [(type(c).__name__, c.kwargs.get("micro_batch_id")) for c in cmds]
    forwards = [mb for kind, mb in kinds if kind == "ForwardPass"]
    backwards = [mb for kind, mb in kinds if kind == "BackwardPass"]
    plans = [mb for kind, mb in kinds if kind == "PlanMicroBatch"]
    assert forwards == backwards == plans == list(range(micro_batches))
    for i, (kind, mb) in enumerate(kinds):
        if kind == "ForwardPass":
            assert kinds.index(("PlanMicroBatch", mb)) < i  # planned before its forward
            if mb + 1 < micro_batches:  # ...and the next one right after: as early as its data allows
                assert kinds[i + 1] == ("PlanMicroBatch", mb + 1)
        if kind == "BackwardPass":
            assert kinds.index(("ForwardPass", mb)) < i
    buffers = {c.kwargs["micro_batch_id"]: c.buffer_id for c in cmds if type(c) is schedule.ForwardPass}
    for c in cmds:  # a backward uses the buffer its forward filled
        if type(c) is schedule.BackwardPass:
            assert c.buffer_id == buffers[c.kwargs["micro_batch_id"]]
    names = [k for k, _ in kinds]
    assert names[-3:] == ["ReduceTiedGrads", "ReduceGrads", "OptimizerStep"]
    assert names.count("ReduceGrads") == 1


def test_instruction_map_is_rebuilt():
    table = FEPLBPipelineEngine._INSTRUCTION_MAP
    assert table[schedule.ForwardPass] is FEPLBPipelineEngine.__dict__["_exec_forward_pass"]
    assert table[schedule.BackwardPass] is FEPLBPipelineEngine.__dict__["_exec_backward_pass"]
    assert table[schedule.ReduceGrads] is FEPLBPipelineEngine.__dict__["_exec_reduce_grads"]
    assert table[PlanMicroBatch] is FEPLBPipelineEngine.__dict__["_exec_plan_micro_batch"]
    for kind in (schedule.LoadMicroBatch, schedule.SendActivation, schedule.RecvGrad, schedule.OptimizerStep):
        assert table[kind] is PipelineEngine._INSTRUCTION_MAP[kind]
    emitted = {type(c) for m, s, i in SHAPES for c in flat(FEPLBTrainSchedule(m, s, i))}
    assert emitted <= set(table)


class _Bare(FEPLBPipelineEngine):
    """The engine's FEPLB handlers on a bare object (no DeepSpeed engine behind)."""

    def __init__(self):  # noqa: D107 - deliberately skips DeepSpeed's constructor
        import torch
        self.__dict__["_modules"] = {}
        self.feplb_monitor = StatsCollector(torch.nn.Linear(1, 1))
        self.feplb_in_flight = {}
        self._feplb_done = {}
        self._feplb_layers = {}
        self.global_steps = 0
        self.__dict__["monitor"] = None
        self.log = []


@pytest.fixture
def bare(monkeypatch):
    engine = _Bare()
    monkeypatch.setattr(PipelineEngine, "_exec_forward_pass", lambda self, buffer_id: self.log.append(("F", buffer_id)))
    monkeypatch.setattr(PipelineEngine, "_exec_backward_pass",
                        lambda self, buffer_id: self.log.append(("B", buffer_id)))
    monkeypatch.setattr(PipelineEngine, "_exec_reduce_grads", lambda self: self.log.append(("R", None)))
    return engine


@pytest.mark.parametrize("micro_batches,stages,stage_id", [(4, 2, 0), (4, 2, 1), (8, 4, 0), (3, 4, 2)])
def test_state_per_micro_batch_is_freed_by_its_backward(bare, micro_batches, stages, stage_id, monkeypatch):
    sched = FEPLBTrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
    bare.micro_batches = micro_batches
    handlers = {k: v for k, v in FEPLBPipelineEngine._INSTRUCTION_MAP.items()
                if k in (schedule.ForwardPass, schedule.BackwardPass, schedule.ReduceGrads, PlanMicroBatch)}
    ends, later = [], []  # what the layers would read during each forward (weight residency's step end)
    monkeypatch.setattr(PipelineEngine, "_exec_forward_pass",
                        lambda self, buffer_id: (self.log.append(("F", buffer_id)),
                                                 ends.append(self.feplb_step_ends()),
                                                 later.append(self.feplb_later_micro_batches())))
    peak = 0
    for cmd in flat(sched):
        if type(cmd) in handlers:
            handlers[type(cmd)](bare, **cmd.kwargs)
            peak = max(peak, len(bare.feplb_in_flight))
            if type(cmd) is schedule.BackwardPass:
                assert cmd.kwargs["micro_batch_id"] not in bare.feplb_in_flight
    assert bare.feplb_in_flight == {} and bare._feplb_done == {}
    assert peak <= sched.num_pipe_buffers() + 1  # in flight: forwarded, not yet backwarded (+1 planned ahead)
    assert [k for k, _ in bare.log].count("F") == micro_batches and bare.log[-1] == ("R", None)
    # only the last forward ends the step
    assert ends == [False] * (micro_batches - 1) + [True] and bare.feplb_step_ends()
    assert later == list(range(micro_batches - 1, -1, -1))
    assert bare.feplb_later_micro_batches() == 0  # no training forward running
    assert bare.feplb_monitor.last["step"] == 1


def test_backward_without_forward_and_missing_backward_are_errors(bare):
    bare.micro_batches = 2
    with pytest.raises(RuntimeError, match="before its forward"):
        bare._exec_backward_pass(buffer_id=0, micro_batch_id=0)
    bare._exec_plan_micro_batch(micro_batch_id=0)
    bare._exec_forward_pass(buffer_id=0, micro_batch_id=0)
    with pytest.raises(RuntimeError, match="forwarded twice"):
        bare._exec_forward_pass(buffer_id=0, micro_batch_id=0)
    with pytest.raises(RuntimeError, match=r"\[0\] have no backward"):
        bare._exec_reduce_grads()


def test_eval_forward_without_micro_batch_id_passes_through(bare):
    bare._exec_forward_pass(buffer_id=1)
    assert bare.log == [("F", 1)] and bare.feplb_in_flight == {}


def test_warm_start_straggler_applies_a_stale_plan():
    counts = np.array([[10, 2], [1, 1]])  # rank 0: 12 tokens, rank 1: 2
    assert warm_start_straggler(counts, np.zeros((0, 4), np.int64)) == 5.0
    assert warm_start_straggler(counts, np.array([[0, 0, 1, 5]])) == 0.0  # 7 / 7
    # a stale plan cannot move rows the home no longer has: 2 rows of expert 1, not 6
    assert warm_start_straggler(counts, np.array([[0, 1, 1, 6]])) == 3.0  # 10 / 4
    assert isinstance(MicroBatchState(0).hints, dict)
