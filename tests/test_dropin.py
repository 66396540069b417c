"""The drop-in contract (docs/ARCHITECTURE.md, "Contracts"): FEPLB behaves as DeepSpeed's MoE
wherever that one works."""
import pytest
import torch

from deepspeed_feplb.testing import run_distributed

import moe_cases

VARIANTS = {
    "fp32": dict(),
    "bf16": dict(dtype=torch.bfloat16),
    "bf16_contiguous_reference": dict(dtype=torch.bfloat16, feplb={"dynamic_experts_per_rank": 0},
                                      contiguous_reference=True, known_expert=False),
    "bf16_migrating_contiguous_reference": dict(dtype=torch.bfloat16, contiguous_reference=True,
                                                known_expert=False),
    "bf16_grouped_contiguous_reference": dict(dtype=torch.bfloat16, contiguous_reference=True),
    "fp32_per_expert_calls": dict(known_expert=False),
    "residual": dict(residual=True),
    "eval": dict(training=False),
    "ep1": dict(ep_size=1),
    "top1": dict(k=1),
    "disabled_drops_like_deepspeed": dict(feplb={"enabled": False}, reference_drop_tokens=True),
    "inline_scheduler": dict(feplb={"scheduler": {"mode": "inline"}}),
}
# bf16 against DeepSpeed as it is: DeepSpeed rounds each expert's first Linear twice where FEPLB
# rounds once (`moe_cases.contiguous_expert_inputs`); given contiguous rows it rounds alike and the
# migrating layer differs only in the weight-gradients of split experts: two bf16 partial sums, one
# rounding (2^-8 relative) more than DeepSpeed's single GEMM; these two use an expert class FEPLB
# does not recognise (one call per expert). A known MLP's grouped compute (`grouped_mlp`) adds its
# bias after the GEMM's rounding where a Linear's addmm rounds once: one bf16 rounding more per
# Linear (outputs within 2^-7), which the gate's weight-gradient sums over every route (8.3e-3)
TOLERANCE = {"bf16": 2e-2, "bf16_migrating_contiguous_reference": 2**-8, "bf16_grouped_contiguous_reference": 2**-6}


def two_rank_cases():
    results = {name: moe_cases.equivalence_variant(**kwargs) for name, kwargs in VARIANTS.items()}
    results["plain_initialize"] = moe_cases.plain_initialize_case()
    results["sigmoid"] = moe_cases.sigmoid_gating_case()
    return results


@pytest.fixture(scope="module")
def results():
    return run_distributed(two_rank_cases, 2, timeout=600)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_matches_deepspeed(results, variant):
    for rank, per_rank in enumerate(results):
        case = per_rank[variant]
        worst = max(case["errors"].items(), key=lambda item: item[1])
        assert worst[1] <= TOLERANCE.get(variant, 1e-5), f"rank {rank}: {worst[0]} differs by {worst[1]:.2e}"
        assert case["keys_equal"], "state_dict keys differ from DeepSpeed's MoE"


def test_bf16_rounds_as_deepspeed_does_given_contiguous_expert_rows(results):
    """The README's bf16 paragraph: without migration FEPLB is bit-equal to DeepSpeed whose experts
    get contiguous rows; migrating, outputs and input gradients still are."""
    for rank, per_rank in enumerate(results):
        assert per_rank["bf16_contiguous_reference"]["bitwise"], f"rank {rank}: {per_rank['bf16_contiguous_reference']}"
        migrating = per_rank["bf16_migrating_contiguous_reference"]["errors"]
        assert migrating["output"] == migrating["input_grad"] == 0.0, f"rank {rank}: {migrating}"


@pytest.mark.parametrize("variant", ["fp32", "bf16", "bf16_migrating_contiguous_reference", "residual", "eval",
                                     "inline_scheduler"])
def test_variant_really_migrates(results, variant):
    assert results[0][variant]["stats"]["migrated_tokens"] > 0


@pytest.mark.parametrize("variant", ["fp32", "ep1", "eval", "bf16_contiguous_reference"])
def test_stats_have_every_key_whether_the_forward_migrated_or_not(results, variant):
    """`MicroBatchStats` keys are always there: code that reads weight_copies of a forward that moved
    nothing must not get a KeyError."""
    from deepspeed_feplb.stats import MicroBatchStats
    stats = results[0][variant]["stats"]
    assert set(stats) == set(MicroBatchStats.__annotations__), set(stats) ^ set(MicroBatchStats.__annotations__)
    if not stats["moves"]:
        assert stats["weight_copies"] == stats["grad_bytes"] == 0 and stats["seq"] == -1


def test_single_rank_ep_does_not_migrate(results):
    assert results[0]["ep1"]["stats"]["migrated_tokens"] == 0


def test_inline_scheduler_is_not_reported_as_fallback(results):
    assert not results[0]["inline_scheduler"]["stats"]["fallback"]


def test_plain_deepspeed_initialize_reads_the_feplb_section(results):
    case = results[0]["plain_initialize"]
    assert (case["D"], case["helpers"]) == (1, 1)
    assert case["stats"]["tokens_after"], "the layer did not run its FEPLB path"


def test_sigmoid_gating_is_exact_under_migration_and_updates_its_bias(results):
    for rank, per_rank in enumerate(results):
        case = per_rank["sigmoid"]
        worst = max(case["errors"].items(), key=lambda item: item[1])
        assert worst[1] <= 1e-5, f"rank {rank}: {worst[0]} differs by {worst[1]:.2e}"
        assert case["bias_moved"] and case["bias_equal"]
    assert results[0]["sigmoid"]["stats"]["migrated_tokens"] > 0


def dropless_warning() -> dict:
    import warnings

    import deepspeed_feplb
    from deepspeed_feplb.once import forget
    forget("dropless")
    seen = {}
    for drop_tokens in (False, True, True):
        layer = deepspeed_feplb.MoE(8, torch.nn.Linear(8, 8), num_experts=2, ep_size=1, k=1, drop_tokens=drop_tokens,
                                    use_rts=False)
        layer.set_deepspeed_parallelism()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            layer(torch.randn(16, 8))
        messages = [str(w.message) for w in caught]
        seen.setdefault(drop_tokens, []).append([m for m in messages if "drop_tokens=True" in m])
        seen.setdefault("dropping", []).append(layer.deepspeed_moe.gate.drop_tokens)
    return seen


def test_a_layer_built_to_drop_tokens_is_told_once_that_feplb_drops_none():
    seen = run_distributed(dropless_warning, 1, timeout=120)[0]
    assert seen[False] == [[]], "a dropless layer needs no warning"
    assert len(seen[True][0]) == 1 and "feplb.enabled" in seen[True][0][0]
    assert seen[True][1] == [], "warned twice"
    assert seen["dropping"] == [False, False, False]  # FEPLB enabled: dropless, as the warning says


def test_print_shows_that_convert_worked():
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    import deepspeed_feplb
    model = torch.nn.Sequential(DeepSpeedMoE(8, torch.nn.Linear(8, 8), num_experts=2, ep_size=1, k=1))
    assert "FEPLB" not in repr(model)
    deepspeed_feplb.convert(model, {"dynamic_experts_per_rank": 2})
    assert "FEPLB, dynamic_experts_per_rank=2" in repr(model) and isinstance(model[0], deepspeed_feplb.MoE)
