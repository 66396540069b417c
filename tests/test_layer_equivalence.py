"""FEPLB's layer equals DeepSpeed's dropless MoE: outputs and every gradient, with real migrations."""
import pytest

from deepspeed_feplb.testing import run_distributed

import moe_cases

TOLERANCE = 1e-5
CASES = [(2, 2), (4, 2), (4, 4)]  # (EP size, NVLink-domain size)


def all_cases():
    return {(ep, domain, k): moe_cases.equivalence_case(ep, domain, k) for ep, domain in CASES for k in (1, 2, 4)}


@pytest.fixture(scope="module")
def four_rank_results():
    return run_distributed(all_cases, 4, timeout=600)


@pytest.mark.parametrize("ep_size,domain", CASES)
@pytest.mark.parametrize("k", [1, 2, 4])
def test_outputs_and_gradients_match_deepspeed(four_rank_results, ep_size, domain, k):
    migrated = 0
    for rank, results in enumerate(four_rank_results):
        case = results[(ep_size, domain, k)]
        worst = max(case["errors"].items(), key=lambda item: item[1])
        assert worst[1] <= TOLERANCE, f"rank {rank}: {worst[0]} differs by {worst[1]:.2e} relative"
        migrated += case["stats"]["migrated_tokens"]
    assert migrated > 0, "the skewed gate produced no migration: the test would not exercise phase 2"


@pytest.mark.parametrize("ep_size,domain", CASES)
@pytest.mark.parametrize("k", [1, 2, 4])
def test_every_routed_pair_is_computed_once(four_rank_results, ep_size, domain, k):
    """Conservation: plans move tokens, never create or drop them, and phase 1 routed them all."""
    routed = 0
    for rank, results in enumerate(four_rank_results):
        stats = results[(ep_size, domain, k)]["stats"]
        assert sum(stats["tokens_after"]) == sum(stats["tokens_before"]), f"rank {rank}: {stats}"
        assert min(stats["tokens_after"]) >= 0
        if rank % domain == 0 and rank < ep_size:  # one report per domain of the first EP group
            routed += sum(stats["tokens_before"])
    assert routed == k * moe_cases.TOKENS * ep_size


@pytest.mark.parametrize("k", [1, 2, 4])
def test_one_domain_of_four_reaches_near_perfect_balance(four_rank_results, k):
    stats = four_rank_results[0][(4, 4, k)]["stats"]
    assert stats["max_over_mean_before"] > 1.3, "the gate is not skewed enough to test balancing"
    assert stats["max_over_mean_after"] <= 1.05, stats


def training_cases():
    return {stage: moe_cases.training_case(stage) for stage in (0, 1, 2)}


@pytest.fixture(scope="module")
def training_results():
    return run_distributed(training_cases, 4, timeout=600)


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_optimizer_steps_through_initialize_match_deepspeed(training_results, zero_stage):
    for rank, results in enumerate(training_results):
        case = results[zero_stage]
        ref, ours = case["losses"]["reference"], case["losses"]["feplb"]
        assert ours == pytest.approx(ref, rel=TOLERANCE), f"rank {rank}: losses {ours} vs {ref}"
        worst = max(case["param_errors"].items(), key=lambda item: item[1])
        assert worst[1] <= TOLERANCE, f"rank {rank}: parameter {worst[0]} differs by {worst[1]:.2e} after training"
    assert sum(r[zero_stage]["migrated"] for r in training_results) > 0
