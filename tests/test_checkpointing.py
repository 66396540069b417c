"""Activation checkpointing around the FEPLB layer (torch.utils.checkpoint, reentrant and not):
the recompute in backward re-runs phase 1 and phase 2 on every rank; outputs, gradients and
training with kept weight copies equal DeepSpeed's MoE, and a recompute is not a micro-batch."""
import pytest

from deepspeed_feplb.testing import run_distributed

import moe_cases

TOLERANCE = 1e-5
MODES = ("reentrant", "non-reentrant")


def cases() -> dict:
    out = {mode: moe_cases.checkpointed_case(mode == "reentrant") for mode in MODES}
    out.update({f"{mode} training": moe_cases.accumulation_case(0, "step", 2, steps=2, checkpointing=mode)
                for mode in MODES})
    out["twice"] = moe_cases.second_backward_case()
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(cases, 2, timeout=600)


@pytest.mark.parametrize("mode", MODES)
def test_checkpointed_layer_equals_deepspeed(results, mode):
    for rank, per_rank in enumerate(results):
        name, worst = max(per_rank[mode]["errors"].items(), key=lambda item: item[1])
        assert worst <= TOLERANCE, f"rank {rank}: {name} differs by {worst:.2e}"
    assert sum(r[mode]["migrated"] for r in results) > 0, "no migration: the test would prove nothing"


@pytest.mark.parametrize("mode", MODES)
def test_a_recompute_is_not_a_micro_batch(results, mode):
    assert all(r[mode]["micro_batches_recorded"] == 1 for r in results)


@pytest.mark.parametrize("mode", MODES)
def test_training_with_accumulation_and_kept_copies_equals_deepspeed(results, mode):
    for rank, per_rank in enumerate(results):
        case = per_rank[f"{mode} training"]
        ref, ours = case["losses"]["reference"], case["losses"]["feplb"]
        assert ours == pytest.approx(ref, rel=TOLERANCE), f"rank {rank}: {ours} vs {ref}"
        name, worst = max(case["param_errors"].items(), key=lambda item: item[1])
        assert worst <= TOLERANCE, f"rank {rank}: parameter {name} differs by {worst:.2e}"
    if mode == "non-reentrant":  # the forward with gradients is the original one: copies are kept
        assert results[0][f"{mode} training"]["traffic"]["resident_hits"] > 0


def test_a_balanced_micro_batch_is_back_propagated_once_and_a_second_backward_says_why(results):
    """``torch.autograd.grad(..., retain_graph=True)`` then ``backward()`` through one balanced
    forward: the first equals DeepSpeed's MoE, the second raises on every rank, naming the cause,
    instead of an AttributeError from deep inside phase 2."""
    assert sum(r["twice"]["migrated"] for r in results) > 0, "no migration: the test would prove nothing"
    for r in results:
        assert r["twice"]["input_grad_error"] <= TOLERANCE, r["twice"]
        assert "back-propagated already" in r["twice"]["error"] and "once per forward" in r["twice"]["error"], r
