"""`feplb.stats.record_trace`: the layer records a trace (`trace.format`) of a real run.

* 2 gloo ranks, two FEPLB layers called in the order second-built first: the trace rank 0 writes
  has one step per training forward, layers in first-call order, and for every (step, layer,
  source rank) exactly the counts that source rank's gate reported in ``exp_counts``; eval
  forwards are not recorded; the trace loads and simulates;
* the shipped real trace (examples/train_moe.py on the stdlib sources, no aux loss) is valid and
  skewed, as a no-aux-loss router is.
"""
import os

import numpy as np
import torch
import torch.distributed as dist

import deepspeed_feplb
from deepspeed_feplb.testing import run_distributed
from deepspeed_feplb.trace.format import load_trace, rank_loads
from deepspeed_feplb.trace.record import get_recorder

HIDDEN, TOKENS, WORLD, EXPERTS = 8, 40, 2, 8
SHIPPED = os.path.join(os.path.dirname(__file__), "..", "deepspeed_feplb", "trace", "data", "stdlib_moe_trace.npz")


def _moe(seed, path):
    torch.manual_seed(seed)
    expert = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 3 * HIDDEN), torch.nn.GELU(),
                                 torch.nn.Linear(3 * HIDDEN, HIDDEN))
    moe = deepspeed_feplb.MoE(HIDDEN, expert, num_experts=EXPERTS, ep_size=WORLD, k=2, min_capacity=0,
                              drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False,
                              feplb_config={"nvlink_domain_size": WORLD, "dynamic_experts_per_rank": 1,
                                            "chunk_align_tokens": 1, "fixed_costs": "ignore",
                                            "stats": {"record_trace": path}})
    moe.set_deepspeed_parallelism()
    return moe


def record_two_layers(path, steps):
    first, second = _moe(1, path), _moe(2, path)
    seen = []  # per step: [second's exp_counts, first's exp_counts] (call order)
    migrated = []  # per step: rows the two layers' plans moved (call order)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        x = torch.randn(TOKENS + 3 * dist.get_rank(), HIDDEN, generator=g) + 0.5 * step
        y, _, _ = second(x)
        z, _, _ = first(torch.tanh(y))
        z.square().mean().backward()
        seen.append([second.deepspeed_moe.exp_counts.tolist(), first.deepspeed_moe.exp_counts.tolist()])
        migrated.append([int(layer.feplb_stats["migrated_tokens"]) for layer in (second, first)])
    first.eval()
    second.eval()
    with torch.no_grad():
        second(torch.randn(TOKENS, HIDDEN))  # not a training micro-batch: not recorded
        first(torch.randn(TOKENS, HIDDEN))
    written = get_recorder(path).flush()
    dist.barrier()
    return {"seen": seen, "written": written, "migrated": migrated}


def test_recorded_trace_matches_exp_counts(tmp_path):
    path = str(tmp_path / "rec.npz")
    steps = 5
    results = run_distributed(record_two_layers, WORLD, path, steps, timeout=240)
    assert results[0]["written"] == path and results[1]["written"] is None  # rank 0 writes
    trace = load_trace(path)
    assert trace.counts.shape == (steps, 2, WORLD, EXPERTS) and trace.counts.dtype == np.int64
    assert trace.top_k == 2 and trace.hidden == HIDDEN and trace.ffn_hidden == 3 * HIDDEN
    for rank in range(WORLD):
        expect = np.array(results[rank]["seen"])  # [steps, layers in call order, experts]
        assert np.array_equal(trace.counts[:, :, rank], expect), rank
    # every route counted once: tokens x k per source rank and layer
    assert (trace.counts.sum(axis=3) == 2 * (TOKENS + 3 * np.arange(WORLD))).all()
    # the two layers route differently (distinct gates), so first-call order is observable
    assert not np.array_equal(trace.counts[:, 0], trace.counts[:, 1])
    # what the runtime did: every step's plan (the last step's is gathered by no later forward)
    # and every rank's stage times
    moved = np.zeros((steps, 2), np.int64)
    np.add.at(moved, (trace.plan_moves[:, 0], trace.plan_moves[:, 1]), trace.plan_moves[:, 5])
    expect = np.array(results[0]["migrated"])
    assert np.array_equal(moved[:-1], expect[:-1]) and expect[:-1].sum() > 0, (moved, expect)
    assert (trace.plan_moves[:, 3] // (EXPERTS // WORLD) != trace.plan_moves[:, 2] // (EXPERTS // WORLD)).sum() == 0
    assert trace.stage_us.shape == (steps, 2, WORLD, 8)
    assert (trace.stage_us[:-1, :, :, :2] > 0).all() and np.isnan(trace.stage_us[-1]).all()
    plan_in_hand = trace.stage_us[:-1, :, :, 2]  # every micro-batch balanced ("ignore"): within its forward
    assert (plan_in_hand > 0).all() and (plan_in_hand < trace.stage_us[:-1, :, :, 0]).all()
    cpu = trace.stage_us[:-1, :, :, 5]  # the process's CPU time over the stage: its threads may add up to more
    assert (cpu > 0).all() and (cpu < 3 * trace.stage_us[:-1, :, :, :2].sum(axis=-1)).all()
    message_us = trace.stage_us[:-1, :, :, 6]  # the latency each domain's transport measured when it opened
    assert (message_us > 0).all() and (message_us == message_us[0, 0, 0]).all()
    share = trace.stage_us[:-1, :, :, 7]  # the forward's share of the stage its planner priced
    assert ((share > 0) & (share < 1)).all()


def test_shipped_real_trace_is_valid_and_skewed():
    trace = load_trace(SHIPPED)
    assert os.path.getsize(SHIPPED) < 200_000
    S, L, R, E = trace.counts.shape
    assert S >= 50 and R == 2 and E % R == 0 and trace.top_k >= 1
    assert "train_moe" in trace.source
    per_src = trace.counts.sum(axis=3)
    assert (per_src == per_src.flat[0]).all()  # every step: the same tokens x k from every source
    loads = rank_loads(trace.counts.sum(axis=2), R)  # [S, L, R]
    # no aux loss: the experts' loads are far from uniform
    expert_loads = trace.counts.sum(axis=(0, 2)).astype(float)
    assert expert_loads.max() / expert_loads.mean() > 1.5
    assert loads.max() > loads.mean()


def test_on_a_gpu_the_recorded_stage_times_are_the_devices():
    """`ExpertStage.recorded` reads the stage's CUDA events (here stand-ins with the same methods),
    waiting for each, and leaves a backward that has not run unmeasured."""
    from deepspeed_feplb.expert_stage import _device_times

    class Event:
        def __init__(self, ms):
            self.ms, self.waited = ms, False

        def synchronize(self):
            self.waited = True

        def elapsed_time(self, other):
            return other.ms - self.ms

    begin, forward_end, backward_begin, backward_end = Event(1.0), Event(3.5), Event(10.0), Event(17.0)
    last = {"moves": np.zeros((0, 5), np.int64), "forward_us": 99.0, "backward_us": float("nan"),
            "events": [begin, forward_end, backward_begin, backward_end]}
    read = _device_times(last)
    assert "events" not in read and read["forward_us"] == 2500.0 and read["backward_us"] == 7000.0
    assert forward_end.waited and backward_end.waited
    unfinished = _device_times({**last, "events": [begin, forward_end, None, None]})
    assert unfinished["forward_us"] == 2500.0 and np.isnan(unfinished["backward_us"])
