"""Bad configuration, bad routing and odd data: a correct result or a clear error, never a hang."""
import pytest

import deepspeed_feplb
from deepspeed_feplb import FEPLBConfigError, load_config
from deepspeed_feplb.integration.engine import check_consistency
from deepspeed_feplb.testing import run_distributed

import moe_cases


def model(num_experts=4, ep_size=2):
    layer = deepspeed_feplb.MoE(moe_cases.HIDDEN, moe_cases.make_expert(), num_experts=num_experts, ep_size=ep_size)
    return moe_cases.TinyMoEModel(layer)


@pytest.mark.parametrize("section,ep_size,world,key", [
    ({}, 4, 2, "ep_size=4 does not divide the world size 2"),
    ({}, 2, 3, "ep_size=2 does not divide the world size 3"),
    ({"nvlink_domain_size": 3}, 4, 4, "feplb.nvlink_domain_size"),
    ({"dynamic_experts_per_rank": 3}, 2, 2, "feplb.dynamic_experts_per_rank: 3 exceeds the 2 local experts"),
    ({"transport": "cuda_ce"}, 2, 2, "feplb.transport"),
    ({"ep_backend": "deepep"}, 2, 2, "feplb.ep_backend"),
])
def test_initialize_checks_the_section_against_model_and_machine(monkeypatch, section, ep_size, world, key):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(FEPLBConfigError, match=key.replace("(", r"\(")):
        check_consistency(model(num_experts=4, ep_size=ep_size), load_config({"feplb": section}))


def test_consistent_setup_passes(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    check_consistency(model(num_experts=8, ep_size=2), load_config({"feplb": {"dynamic_experts_per_rank": 4}}))


@pytest.mark.parametrize("section", [{"dynamic_experts_per_rank": 0}, {"nvlink_domain_size": 1}])
def test_a_layer_that_moves_nothing_inside_a_node_needs_no_transport(monkeypatch, section):
    """Without dynamic experts, or with one rank per NVLink domain, phase 2 never runs: a transport
    this machine cannot open (here cuda_ce without CUDA, as CUDA experts without CuPy) is not
    refused, and the layer builds without one."""
    from deepspeed_feplb.expert_stage import ExpertStage

    monkeypatch.setenv("WORLD_SIZE", "2")
    config = load_config({"feplb": {"transport": "cuda_ce", **section}})
    moe = model(num_experts=4, ep_size=2)
    check_consistency(moe, config)
    stage = ExpertStage(config, None, 2, 2, list(moe_cases.make_expert().parameters()), moe_cases.HIDDEN)
    assert not stage.balances and stage.transport_cls is None


KINDS = ["out_of_range", "nan_hidden", "zero_tokens", "one_expert", "odd_shapes"]


def all_bad_inputs():
    return {kind: moe_cases.bad_input_case(kind) for kind in KINDS}


@pytest.fixture(scope="module")
def results():
    return run_distributed(all_bad_inputs, 2, timeout=300)


def test_out_of_range_expert_ids_fail_on_every_rank_naming_the_bad_one(results):
    for rank in range(2):
        message = results[rank]["out_of_range"]["raised"]
        assert message is not None, f"rank {rank} did not raise"
        assert "rank: count {1: " in message and "[-1, 3]" in message, message


@pytest.mark.parametrize("kind", ["zero_tokens", "one_expert", "odd_shapes"])
def test_degenerate_routing_matches_deepspeed(results, kind):
    for rank in range(2):
        case = results[rank][kind]
        worst = max(case["errors"].items(), key=lambda item: item[1])
        assert worst[1] <= 1e-5, f"rank {rank}: {worst[0]} differs by {worst[1]:.2e}"
        assert sum(case["stats"]["tokens_after"]) == sum(case["stats"]["tokens_before"])


def test_zero_tokens_on_a_rank_gives_an_empty_output(results):
    assert results[1]["zero_tokens"]["shape"] == (0, moe_cases.HIDDEN)


def test_every_token_on_one_expert_is_balanced(results):
    stats = results[0]["one_expert"]["stats"]
    assert stats["migrated_tokens"] > 0 and stats["max_over_mean_after"] <= 1.05, stats


def test_nan_and_inf_propagate_exactly_like_deepspeed(results):
    for rank in range(2):
        case = results[rank]["nan_hidden"]
        assert case["nan_pattern_equal"]
        assert case["errors"]["output"] <= 1e-5
