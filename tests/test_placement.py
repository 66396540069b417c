"""Cross-node placement at runtime (feplb.placement): 4 gloo ranks as 2 nodes of 2, the hot experts
all on node 0. Experts move with their parameters and optimizer state; the training equals
DeepSpeed's MoE fed the same logical experts, and checkpoints keep DeepSpeed's layout."""
import numpy as np
import pytest

import moe_cases
from deepspeed_feplb.testing import run_distributed


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_placement_balances_nodes_and_trains_exactly(zero_stage):
    results = run_distributed(moe_cases.placement_case, 4, zero_stage, timeout=600)
    r = results[0]
    assert all(x["expert_at"] == r["expert_at"] for x in results), "ranks disagree on the placement"
    assert r["refreshes"] >= 1 and r["moved_experts"] > 0
    assert sum(x["moved_bytes"] for x in results) > 0
    # the monitor reports every refresh and the bytes the moved experts carried (what the ranks sent)
    assert r["monitored"] == {"placement_refreshes": r["refreshes"], "placement_moved_experts": r["moved_experts"],
                              "placement_bytes": sum(x["moved_bytes"] for x in results)}
    identity, placed = np.array(r["identity_node_loads"]), np.array(r["placed_node_loads"])
    assert identity.max() / identity.mean() > 1.2, "the router does not load node 0 more: the test shows nothing"
    assert placed.max() / placed.min() <= 1.05, f"node loads after placement {placed} are not within 5%"
    reference, ours = np.array(r["losses"]["reference"]), np.array(r["losses"]["feplb"])
    assert np.allclose(ours, reference, rtol=1e-5, atol=1e-6), f"losses differ: {ours - reference}"
    worst = max(max(x["param_errors"].values()) for x in results)
    assert worst < 1e-4, f"parameters differ from DeepSpeed's MoE by {worst:.2e}"


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_placement_checkpoints_stay_canonical(tmp_path, zero_stage):
    results = run_distributed(moe_cases.placement_checkpoint_case, 4, str(tmp_path), zero_stage, timeout=600)
    r = results[0]
    assert r["placed_at_save"] != sorted(r["placed_at_save"]), "no placement change before the save: nothing tested"
    assert r["placed_after_save"] == r["placed_at_save"], "saving changed the placement"
    for kind in ("feplb", "deepspeed"):
        assert np.allclose(r["resumed"][kind], r["continued"], rtol=1e-5, atol=1e-6), (kind, r["resumed"][kind],
                                                                                        r["continued"])
