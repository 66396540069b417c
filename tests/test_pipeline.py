"""The FEPLB pipeline engine on 4 CPU ranks (PP=2 x EP=2): same losses as FEPLB disabled, per-stage stats."""
import copy
import json
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from deepspeed_feplb.testing import run_distributed

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def pipeline_on_and_off() -> dict:
    sys.path.insert(0, str(EXAMPLES))
    import torch.distributed as dist

    from deepspeed_feplb.integration.pipeline import FEPLBPipelineEngine

    import train_moe_pipe

    args = Namespace(steps=2, stages=2, hidden=32, experts=8, top_k=2, context=8)
    base = json.loads((EXAMPLES / "ds_config_pipe.json").read_text())
    base["train_micro_batch_size_per_gpu"] = 64
    base["feplb"]["scheduler"] = {"mode": "inline"}  # same plans; no scheduler start-up in a short test
    base["feplb"]["fixed_costs"] = "ignore"  # moves pay at these toy sizes, so the test exercises phase 2
    out = {}
    engines = []
    original = FEPLBPipelineEngine.__init__

    def spy(self, *a, **k):
        original(self, *a, **k)
        engines.append(self)

    for enabled in (True, False):
        config = copy.deepcopy(base)
        config["feplb"]["enabled"] = enabled
        engines.clear()
        FEPLBPipelineEngine.__init__ = spy
        try:
            history = train_moe_pipe.train(args, config, log=None)
        finally:
            FEPLBPipelineEngine.__init__ = original
        engine = engines[0]
        out[enabled] = {"history": history, "in_flight": len(engine.feplb_in_flight),
                        "stage": engine.stage_id, "engine": type(engine).__name__}
    # a world-spanning group after initialize must not hang (EP groups were created eagerly)
    group = dist.new_group(list(range(dist.get_world_size())))
    dist.barrier(group=group)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(pipeline_on_and_off, 4, timeout=300)


def test_losses_match_feplb_disabled(runs):
    for rank, result in enumerate(runs):
        on = [h["loss"] for h in result[True]["history"]]
        off = [h["loss"] for h in result[False]["history"]]
        assert on == pytest.approx(off, rel=1e-5), f"rank {rank}: {on} vs {off}"


def test_engine_bookkeeping_and_stats_of_both_stages(runs):
    assert [r[True]["stage"] for r in runs] == [0, 0, 1, 1]
    for result in runs:
        assert result[True]["engine"] == "FEPLBPipelineEngine" and result[True]["in_flight"] == 0
    history = runs[0][True]["history"]
    assert all(h["micro_batches"] == 4 for h in history)
    for step in history:
        assert set(step["layers"]) == {"1.moe", "2.moe"}
        for layer in step["layers"].values():
            assert layer["token_straggler_after"] <= layer["token_straggler_before"]
            assert layer["gemm_max_ms"] > 0 and layer["fallbacks"] >= 0
    assert sum(h["migrated_tokens"] for h in history) > 0
    assert sum(h["migrated_bytes"] for h in history) > 0
    # weight residency across the batch's micro-batches: kept copies served later chunks, their
    # gradients went home in the last micro-batch's backward (the losses above stayed equal)
    assert sum(layer["resident_hits"] for h in history for layer in h["layers"].values()) > 0
    assert sum(layer["flushed_copies"] for h in history for layer in h["layers"].values()) > 0
    assert any("warm_start_token_straggler" in layer for h in history[1:] for layer in h["layers"].values())
    assert runs[3][True]["history"] == history  # every rank gets the same summary
