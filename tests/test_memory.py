"""FEPLB's device memory, known at `deepspeed_feplb.initialize` (deepspeed_feplb/memory.py)."""

from deepspeed_feplb.config import FEPLBConfig
from deepspeed_feplb.memory import ExpertSizes, GroupMemory, group_memory, memory_problems, replica_bytes
from deepspeed_feplb.migrate.arena import inbound_bytes
from deepspeed_feplb.plan.residency import resident_budget_bytes
from deepspeed_feplb.testing import run_distributed

MiB, GiB = 2**20, 2**30
# docs/GPU.md's worked example: GLM-5-like SwiGLU experts (hidden 6144, ffn 2048, bf16), 4 layers,
# one node of 8, the defaults (D = 2, max_resident_experts 8, residency "step", ce_budget "auto")
PARAMS = 3 * 6144 * 2048
GLM = ExpertSizes(expert_bytes=2 * PARAMS, tensors=3, copy_bytes=2 * PARAMS + 4 * PARAMS, row_bytes=6144 * 2)


def test_the_worked_example_of_gpu_md():
    need = group_memory(FEPLBConfig(), ep_size=8, domain=8, layers=[GLM] * 4, ce_transport=True)
    assert GLM.expert_bytes == 72 * MiB and GLM.copy_bytes == 216 * MiB
    assert need.in_flight == 4 * (2 * 2) * 7 * 72 * MiB  # 7.9 GiB: up to 2D dynamic experts per rank
    assert need.kept_most == 4 * 8 * 216 * MiB  # 6.75 GiB
    # "auto" slots: the weights' share of a slot (2 chunks with their weights), the rows' share when
    # the domain opens
    assert need.slots == 7 * inbound_bytes(2 * (72 * MiB + 5 * 256))
    assert 7 * 144 * MiB <= need.slots < 7 * 145 * MiB
    sized = group_memory(FEPLBConfig(transport_slot_mb=128), 8, 8, [GLM] * 4, ce_transport=True)
    assert sized.slots == 7 * inbound_bytes(128 * MiB) and sized.in_flight == need.in_flight
    assert group_memory(FEPLBConfig(), 8, 8, [GLM] * 4, ce_transport=False).slots == 0  # host slots (shm)
    capped = group_memory(FEPLBConfig(ce_budget=1e8), 8, 8, [GLM] * 4, ce_transport=True)
    assert capped.in_flight == 4 * 10**8
    assert group_memory(FEPLBConfig(weight_residency="micro_batch"), 8, 8, [GLM] * 4, True).kept_most == 0
    for off in (FEPLBConfig(dynamic_experts_per_rank=0), FEPLBConfig(nvlink_domain_size=1)):
        assert group_memory(off, 8, 1 if off.nvlink_domain_size == 1 else 8, [GLM] * 4, True, 300) == \
            GroupMemory(deepep=300)


def test_auto_keeps_half_of_what_the_rest_leaves_free_and_at_most_what_copies_take():
    need = group_memory(FEPLBConfig(), 8, 8, [GLM] * 4, ce_transport=True)
    roomy, tight = 24 * GiB, 12 * GiB
    assert resident_budget_bytes("auto", [roomy - need.fixed], need.kept_most) == need.kept_most
    assert resident_budget_bytes("auto", [roomy - need.fixed, tight - need.fixed], need.kept_most) == \
        0.5 * (tight - need.fixed)  # the least of the domain's ranks
    assert resident_budget_bytes("auto", [-GiB], need.kept_most) == 0.0  # the rest did not even fit
    assert resident_budget_bytes("auto", [None, float("inf")], need.kept_most) == float("inf")  # host memory
    assert resident_budget_bytes(512, [tight], need.kept_most) == 512 * MiB


def test_a_rank_that_cannot_hold_the_buffers_is_named_with_the_figures_and_keys():
    need = group_memory(FEPLBConfig(), 8, 8, [GLM] * 4, ce_transport=True, deepep_bytes=300 * MiB)
    assert memory_problems(3, 10 * GiB, need, FEPLBConfig()) == []
    (problem,) = memory_problems(3, 4 * GiB, need, FEPLBConfig())
    assert problem.startswith("rank 3 has 4,096 MiB of device memory free after deepspeed.initialize and its FEPLB "
                              f"layers need {need.fixed / MiB:,.0f} MiB")
    for said in ("phase-2 receive slots 1,008 MiB (feplb.transport_slot_mb", "held from forward to backward 8,064 MiB "
                 "(feplb.ce_budget", "the DeepEP buffer 300 MiB"):
        assert said in problem
    assert "kept" not in problem  # "auto" takes what is left
    budget = FEPLBConfig(resident_budget_mb=4096)
    assert memory_problems(3, 8 * GiB, need, budget) and "kept weight copies 4,096 MiB (feplb.resident_budget_mb" in \
        memory_problems(3, 8 * GiB, need, budget)[0]
    assert memory_problems(3, 14 * GiB, need, budget) == []


def test_replica_slots_count_what_their_layers_have_not_allocated_yet():
    """A replica slot holds one expert's weights (allocated with the layer) and, while a step
    accumulates, the fp32 sum of its gradient, and its expert's home the early half of that sum
    through the step's last micro-batch and, in a DeepSpeed MoE layer, an expert's gradient of
    that micro-batch and a replica's arrived sum to the backward's end; a layer that has allocated
    its slots counts the sums alone, and the share is named with its key."""
    import torch

    params = [torch.zeros(2048, 6144, dtype=torch.bfloat16) for _ in range(3)]  # one GLM-5-like expert
    held_back = 72 * MiB + 144 * MiB
    assert replica_bytes(params, 1, allocated=False) == 72 * MiB + 144 * MiB + 144 * MiB + held_back
    assert replica_bytes(params, 1, allocated=False, held_back=False) == 72 * MiB + 144 * MiB + 144 * MiB
    assert replica_bytes(params, 2, allocated=True) == 2 * (2 * 144 * MiB + held_back)
    assert replica_bytes(params, 0, allocated=False) == 0
    fp32 = [p.float() for p in params]  # the sum goes home in one half: no early half at the home
    assert replica_bytes(fp32, 1, allocated=True, held_back=False) == 144 * MiB
    need = group_memory(FEPLBConfig(), 16, 8, [GLM] * 4, True, replica_slots_bytes=4 * 216 * MiB)
    assert need.replicas == 864 * MiB and need.fixed == need.slots + need.in_flight + need.replicas
    assert group_memory(FEPLBConfig(dynamic_experts_per_rank=0), 16, 8, [GLM] * 4, True, 0, 5) == \
        GroupMemory(replicas=5)  # replicas need no phase 2
    (problem,) = memory_problems(0, 4 * GiB, need, FEPLBConfig())
    assert "replica slots 864 MiB (feplb.placement.redundant_experts_per_rank)" in problem


FREE = {0: 20 * GiB, 1: 12 * GiB}


def initialize_case(free: dict) -> dict:
    """`deepspeed_feplb.initialize` of the tiny model on 2 ranks whose devices have ``free`` bytes
    (the probe stands in for a GPU's; the experts stay on the CPU), then 2 training steps."""
    import torch.distributed as dist

    import deepspeed_feplb
    from deepspeed_feplb import memory

    import moe_cases

    memory.device_free_bytes = lambda device: free[dist.get_rank()]
    feplb = {"nvlink_domain_size": 2, "chunk_align_tokens": 1, "fixed_costs": "ignore", **moe_cases.IN_PARTS}
    torch_model = moe_cases.TinyMoEModel(moe_cases.DeepSpeedMoE(
        hidden_size=moe_cases.HIDDEN, expert=moe_cases.make_expert(), num_experts=8, ep_size=2, k=2, min_capacity=0,
        drop_tokens=False, use_rts=False))
    moe_cases.skew_gate(torch_model.moe.deepspeed_moe.gate.wg.weight, spread=False)
    try:
        engine, *_ = deepspeed_feplb.initialize(model=torch_model, model_parameters=moe_cases.param_groups(torch_model),
                                                config=moe_cases.ds_config(0, feplb))
    except deepspeed_feplb.FEPLBConfigError as error:
        return {"refused": str(error)}
    ranks = tuple(dist.get_process_group_ranks(torch_model.moe.deepspeed_moe.ep_group))
    recorded = memory.kept_budget_of(ranks, 2)
    for step in range(2):
        moe_cases.train_step(engine, *moe_cases.rank_inputs(200 + step))
    stage = engine.module.moe.deepspeed_moe.stage
    return {"recorded": recorded, "domain_budget": stage.domain.kept_bytes.budget,
            "migrated": engine.module.moe.feplb_stats["migrated_tokens"]}


def test_initialize_records_each_domains_kept_copy_budget_and_the_domain_keeps_it():
    """Both ranks take the least free memory of their domain; the domain that opens at the first
    balanced micro-batch keeps that budget rather than deriving its own."""
    first, second = run_distributed(initialize_case, 2, FREE, timeout=300)
    expert = (16 * 32 + 32 + 32 * 16 + 16) * 4  # Linear(16, 32) and Linear(32, 16), fp32: 4,288 bytes
    fixed = 2 * expert  # two dynamic experts' copies held forward to backward, to the one peer
    most = 8 * 2 * expert  # 8 kept copies, each its fp32 weights and an fp32 gradient
    assert first["recorded"] == second["recorded"] == min(most, 0.5 * (12 * GiB - fixed)) == most
    assert first["domain_budget"] == second["domain_budget"] == most


def test_initialize_refuses_on_every_rank_where_one_cannot_hold_the_buffers():
    results = run_distributed(initialize_case, 2, {0: 20 * GiB, 1: 1024}, timeout=300)
    for result in results:
        assert "rank 1 has 0 MiB of device memory free after deepspeed.initialize" in result["refused"]
        assert "weight copies held from forward to backward" in result["refused"]
