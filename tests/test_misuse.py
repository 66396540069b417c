"""Misuse that used to hang, crash in gloo or lose state silently is refused at the first forward with
an error that names the cause, on every rank (2 gloo ranks); leftovers of killed jobs are reclaimed."""
import os

import pytest

from deepspeed_feplb.testing import run_distributed

import moe_cases

KINDS = ("experts_differ", "row_bound_differs", "batchnorm", "buffer_update", "plain_buffer", "extra_eval_forward",
         "first_forward_missing")


def cases() -> dict:
    return {kind: moe_cases.misuse_case(kind) for kind in KINDS}


@pytest.fixture(scope="module")
def results():
    return run_distributed(cases, 2, timeout=300)


def test_ranks_that_built_different_layers_are_named(results):
    for r in results:
        assert "num_experts differs across the ranks of its expert-parallel group (rank 0: 8, rank 1: 16)" in \
            r["experts_differ"]["error"], r["experts_differ"]


def test_ranks_with_different_row_bounds_are_named(results):
    """The bound changes which micro-batches a domain plans: ranks that disagree would hang."""
    for r in results:
        assert "feplb.max_rows_over_mean differs across the ranks of its expert-parallel group (rank 0: 1.05, " \
            "rank 1: None)" in r["row_bound_differs"]["error"], r["row_bound_differs"]


def test_an_expert_with_batch_statistics_is_refused(results):
    for r in results:
        assert "BatchNorm1d" in r["batchnorm"]["error"] and "LayerNorm or RMSNorm" in r["batchnorm"]["error"]
        assert r["batchnorm"]["kind"] == "FEPLBModelError", r["batchnorm"]


def test_a_job_that_ends_on_a_model_error_says_so_not_invalid_ds_config(capsys, monkeypatch):
    """The exit line of an uncaught refusal names what is at fault: the "feplb" section or the model."""
    import signal
    import sys

    from deepspeed_feplb import FEPLBConfigError, FEPLBModelError, exits

    monkeypatch.setattr(exits, "_installed", False)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setenv("RANK", "0")
    handler = signal.getsignal(signal.SIGINT)
    try:
        exits.install()
        for error, line in ((FEPLBModelError("the MoE expert contains a BatchNorm1d"), "unsupported model"),
                            (FEPLBConfigError("feplb.scheduler.deadline_us: ..."), "invalid ds_config")):
            sys.excepthook(type(error), error, None)
            assert f"deepspeed_feplb: {line}:\n{error}" in capsys.readouterr().err
    finally:
        signal.signal(signal.SIGINT, handler)


def test_an_expert_that_updates_a_buffer_is_refused_for_migration_and_a_constant_buffer_is_not(results):
    for r in results:
        assert "updates buffer(s) rows" in r["buffer_update"]["error"], r["buffer_update"]
        assert "dynamic_experts_per_rank to 0" in r["buffer_update"]["error"]
        assert r["plain_buffer"]["error"] == ""


def test_an_extra_forward_on_one_rank_is_named_instead_of_desynchronising_the_group(results):
    for r in results:
        error = r["extra_eval_forward"]["error"]
        assert "rank 0: forward 0 without gradients, rank 1: forward 0 with gradients" in error, error


def test_a_rank_that_never_runs_the_first_forward_is_named_within_the_peer_timeout(results):
    error = results[0]["first_forward_missing"]["error"]
    assert "peer_timeout_s=3 s" in error and "1" in error.split("(", 1)[-1], error


def test_the_next_job_reclaims_what_a_killed_one_left():
    from multiprocessing import shared_memory

    from deepspeed_feplb.domain import reclaim_leftovers
    from deepspeed_feplb.segments import open_segment, unlink_quietly

    left = "feplb-testleft-ctl"
    with open(os.path.join("/dev/shm", left), "wb") as f:  # what a SIGKILLed job leaves: mapped by nobody
        f.write(b"\0" * 64)
    live = open_segment("feplb-testlive-ctl", 64, create=True)  # a running job's: this process maps it
    try:
        removed = reclaim_leftovers(min_age_s=0.0)  # (a real leftover is older than a starting job's segments)
        assert left in removed and not os.path.exists(os.path.join("/dev/shm", left))
        assert os.path.exists(os.path.join("/dev/shm", live.name)), "a live job's segment was removed"
    finally:
        live.close()
        unlink_quietly(live)
    assert isinstance(live, shared_memory.SharedMemory)


def test_a_fresh_segment_is_never_taken_for_a_leftover():
    from deepspeed_feplb.domain import reclaim_leftovers

    young = "feplb-testyoung-ctl"
    with open(os.path.join("/dev/shm", young), "wb") as f:  # created, not yet mapped by its starting job
        f.write(b"\0" * 64)
    try:
        assert young not in reclaim_leftovers()
    finally:
        os.unlink(os.path.join("/dev/shm", young))


def _one_expert():
    import torch
    return [torch.zeros(4, 3), torch.zeros(3, 4)]


def test_replica_slots_beyond_the_experts_of_other_nodes_are_refused_when_the_layer_is_built():
    """A node holds one copy of an expert at most (`plan.replicas.choose`), so a rank's replica
    slots beyond E * (N - 1) / R stay empty for good, each holding an expert's weights: refused
    before they are allocated, naming the key, the value and the bound."""
    from deepspeed_feplb import FEPLBConfigError
    from deepspeed_feplb.integration.placement import ExpertPlacement

    with pytest.raises(FEPLBConfigError) as info:  # 8 experts, 4 ranks as 2 nodes of 2: 4 elsewhere, 2 per rank
        ExpertPlacement(8, None, 4, 2, 10, 0.5, 50.0, _one_expert(), redundant=3)
    message = str(info.value)
    assert message.startswith("feplb.placement.redundant_experts_per_rank: 3 replica slots per rank, but a layer "
                              "of 8 experts over 4 ranks (2 nodes of 2) fills at most 2: a node holds one copy of an "
                              "expert at most"), message
    assert message.endswith("set it to at most 2"), message
    with pytest.raises(FEPLBConfigError, match="redundant_experts_per_rank: 1000 .* fills at most 12"):
        ExpertPlacement(32, None, 8, 2, 10, 0.5, 50.0, _one_expert(), redundant=1000)
    with pytest.raises(FEPLBConfigError, match="redundant_experts_per_rank: 1 .*over 2 ranks \\(1 node of 2\\) "
                                               "fills at most 0"):
        ExpertPlacement(8, None, 2, 2, 10, 0.5, 50.0, _one_expert(), redundant=1)


@pytest.mark.parametrize("experts,ranks,per_node", [(8, 4, 2), (16, 4, 2), (32, 8, 2), (16, 8, 4), (12, 6, 2)])
def test_the_replica_slot_bound_is_what_choose_can_fill(experts, ranks, per_node):
    """With every expert hot, `choose`'s candidate sequence fills every slot of the bound (each node
    then holds every expert of the other nodes once) and none beyond it."""
    import numpy as np

    from deepspeed_feplb.plan import replicas

    most = replicas.most_replica_slots(experts, ranks, per_node)
    assert most == experts // ranks * (ranks // per_node - 1)
    e2r = np.repeat(np.arange(ranks), experts // ranks)
    expected = np.linspace(2.0, 1.0, experts)
    for slots in (most, most + 1):
        table = replicas._sequence(expected, e2r, per_node, slots, repeat=True)[-1]
        assert (table[:, :most] >= 0).all() and (table[:, most:] < 0).all(), table
        held = replicas.slot_experts(e2r, table)
        for node in range(ranks // per_node):  # every expert once per node
            assert sorted(held[node * per_node:(node + 1) * per_node, :experts // ranks + most].ravel()) == \
                list(range(experts))


def test_replica_slots_on_a_one_node_group_are_said_to_have_no_effect(capsys, monkeypatch):
    from deepspeed_feplb.config import load_config
    from deepspeed_feplb.integration import seams
    from deepspeed_feplb.integration.placement import ExpertPlacement
    from deepspeed_feplb.once import forget

    monkeypatch.setattr(seams, "expert_data_parallel_group", lambda ep_size: None)
    config = load_config({"feplb": {"nvlink_domain_size": 2, "placement": {"enabled": True,
                                                                          "redundant_experts_per_rank": 1}}})
    forget("one-node replica slots")
    try:
        for _ in range(2):  # two layers: said once
            placement = ExpertPlacement.of(config, 4, None, 2, _one_expert(), "cpu", redundant=0)
            assert placement.replicas is None
        assert capsys.readouterr().out == (
            "deepspeed_feplb: feplb.placement.redundant_experts_per_rank=1 has no effect: the expert-parallel group "
            "(2 ranks) is one NVLink domain (feplb.nvlink_domain_size), so there is no other node to hold replicas\n")
    finally:
        forget("one-node replica slots")
