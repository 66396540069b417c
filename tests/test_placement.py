"""Cross-node placement at runtime (feplb.placement): 4 gloo ranks as 2 nodes of 2, the hot experts
all on node 0. Experts move with their parameters and optimizer state; the training equals
DeepSpeed's MoE fed the same logical experts, and checkpoints keep DeepSpeed's layout."""
import numpy as np
import pytest

import deepspeed_feplb
from deepspeed_feplb.testing import run_distributed

import moe_cases


@pytest.mark.parametrize("zero_stage,ep_size", [(0, 4), (2, 4), (2, 2)], ids=["zero0", "zero2", "zero2-ep2-replicas"])
def test_placement_balances_nodes_and_trains_exactly(zero_stage, ep_size):
    """EP 4 as 2 nodes of 2; and EP 2 (nodes of 1 rank) twice, whose expert-data-parallel replicas
    reduce gradients and, under ZeRO 2, partition the experts' optimizer state between them."""
    domain = 2 if ep_size == 4 else 1
    results = run_distributed(moe_cases.placement_case, 4, zero_stage, 20, domain, ep_size=ep_size, timeout=600)
    r = results[0]
    assert all(x["expert_at"] == r["expert_at"] for x in results), "ranks disagree on the placement"
    assert r["refreshes"] >= 1 and r["moved_experts"] > 0
    sent = sum(x["moved_bytes"] for x in results[:ep_size])  # one EP group (consecutive ranks); replicas alike
    assert sent > 0
    # the monitor reports every refresh and the bytes the moved experts carried (what an EP group's ranks sent)
    assert r["monitored"] == {"placement_refreshes": r["refreshes"], "placement_moved_experts": r["moved_experts"],
                              "placement_bytes": sent}
    identity, placed = np.array(r["identity_node_loads"]), np.array(r["placed_node_loads"])
    assert identity.max() / identity.mean() > 1.2, "the router does not load node 0 more: the test shows nothing"
    assert placed.max() / placed.min() <= 1.05, f"node loads after placement {placed} are not within 5%"
    reference, ours = np.array(r["losses"]["reference"]), np.array(r["losses"]["feplb"])
    assert np.allclose(ours, reference, rtol=1e-5, atol=1e-6), f"losses differ: {ours - reference}"
    worst = max(max(x["param_errors"].values()) for x in results)
    assert worst < 1e-4, f"parameters differ from DeepSpeed's MoE by {worst:.2e}"


# every optimizer's state at ZeRO 0 (torch's) and at ZeRO 1 and 2 (DeepSpeed's flat partitions, one code path)
LEARNING_GATE_CASES = [(0, "adam"), (0, "sgd-momentum"), (0, "sgd"), (1, "sgd-momentum"), (2, "adam")]


def learning_gate_cases() -> dict:
    """`moe_cases.placement_case` for each of `LEARNING_GATE_CASES` in one launch of 4 ranks."""
    out = {}
    for zero_stage, optimizer in LEARNING_GATE_CASES:
        out[(zero_stage, optimizer)] = moe_cases.placement_case(zero_stage, 30, 2, experts_per_rank=8, learn_gate=True,
                                                                optimizer=optimizer, gradient_clipping=0.01)
        deepspeed_feplb.shutdown()  # the next case opens its own domain
    return out


@pytest.fixture(scope="module")
def learning_gate_results():
    return run_distributed(learning_gate_cases, 4, timeout=900)


@pytest.mark.parametrize("zero_stage,optimizer", LEARNING_GATE_CASES)
def test_placement_trains_exactly_with_a_learning_gate_and_clipping(learning_gate_results, zero_stage, optimizer):
    """8 experts per rank, a gate that learns (its loads drift) and a
    gradient clip that binds at every step, 30 steps: DeepSpeed's ZeRO 0 clips with the average of
    per-rank norms, which depend on which experts a rank holds, so the clip must see DeepSpeed's
    layout (`canonical_grad_norms`); before it did, parameters drifted 0.1 (Adam) from DeepSpeed's.
    SGD without momentum keeps no optimizer state: its experts move with their values alone."""
    results = [cases[(zero_stage, optimizer)] for cases in learning_gate_results]
    r = results[0]
    assert r["refreshes"] >= 1 and r["moved_experts"] > 0, "nothing moved: the test shows nothing"
    reference, ours = np.array(r["losses"]["reference"]), np.array(r["losses"]["feplb"])
    assert np.allclose(ours, reference, rtol=1e-5, atol=1e-6), f"losses differ: {ours - reference}"
    worst = max(max(x["param_errors"].values()) for x in results)
    assert worst < 1e-5, f"parameters differ from DeepSpeed's MoE by {worst:.2e}"


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_placement_checkpoints_stay_canonical(tmp_path, zero_stage):
    results = run_distributed(moe_cases.placement_checkpoint_case, 4, str(tmp_path), zero_stage, timeout=600)
    r = results[0]
    assert r["placed_at_save"] != sorted(r["placed_at_save"]), "no placement change before the save: nothing tested"
    assert r["placed_after_save"] == r["placed_at_save"], "saving changed the placement"
    for kind in ("feplb", "deepspeed"):
        assert np.allclose(r["resumed"][kind], r["continued"], rtol=1e-5, atol=1e-6), (kind, r["resumed"][kind],
                                                                                        r["continued"])
    half = r["resumed"]["deepspeed, half the EP size"]
    assert np.allclose(half, r["continued"][:1], rtol=1e-5, atol=1e-6), (half, r["continued"][:1])
    # a state dict outside save_checkpoint: taken directly it warns, in canonical_experts it is the
    # checkpoint's layout; a re-placed run refuses it outside that block and loads it inside
    assert r["warned"] == {"outside": True, "inside": False}, r["warned"]
    assert r["placed_after_canonical"] == r["placed_at_save"]
    assert r["moved_by_saving"] == 0, "moves back and forth for a save counted as re-placements"
    assert max(r["state_errors"].values()) <= 1e-6, r["state_errors"]
    assert r["placed_before_load"] != sorted(r["placed_before_load"]), "the run to load into is not re-placed"
    assert "canonical_experts" in r["refused"], r["refused"]
    assert r["placed_after_load"] == r["placed_before_load"]
    direct = r["resumed"]["state dict into a placed run"]
    assert np.allclose(direct, r["continued"][:1], rtol=1e-5, atol=1e-6), (direct, r["continued"][:1])
    # the state dict taken outside canonical_experts (placement order, warned): a fresh FEPLB job adopts
    # the order before its first forward; plain DeepSpeed fails on its keys, FEPLB without placement refuses
    fresh = r["resumed"]["placement-order state dict into a fresh job"]
    assert r["fresh_placed"] == r["placed_at_save"]
    assert np.allclose(fresh, r["continued"][:1], rtol=1e-5, atol=1e-6), (fresh, r["continued"][:1])
    early = r["resumed"]["placement-order state dict before initialize"]  # (into a deepspeed_feplb.MoE model)
    assert np.allclose(early, r["continued"][:1], rtol=1e-5, atol=1e-6), (early, r["continued"][:1])
    assert "feplb_placed_experts" in r["fresh_refusals"]["deepspeed"], r["fresh_refusals"]
    assert "feplb.placement.enabled" in r["fresh_refusals"]["feplb without placement"], r["fresh_refusals"]


def _simulated_placements(trace, gas: int, interval: int, decay: float, state_bytes: float, us_per_token: list):
    """The simulator's FEPLB policy on the same trace and settings (and the runtime's measured time
    per routed token at each step, where the simulator would use its cost profile): per
    micro-batch the rows each rank receives before balancing, and the placement after each
    optimizer step."""
    from deepspeed_feplb.plan.cost import PROFILES, ExpertShape, scaled
    from deepspeed_feplb.sim.policies import FEPLB, SimSetup
    from deepspeed_feplb.trace.format import fold_sources
    setup = SimSetup(ranks_per_node=2, nodes=2, experts=trace.experts, dynamic_experts=1, chunk_align=1,
                     shape=ExpertShape(hidden=16, ffn_hidden=32, mats=2, dtype_bytes=4),
                     profile=scaled(PROFILES["h100"], net_gbps=1e6, ce_gbps=1e6), placement="on",
                     placement_interval=interval * gas, eplb_decay=decay, expert_state_bytes=state_bytes,
                     micro_batches_per_step=gas)
    policy = FEPLB(setup, 1)
    rows, placements = [], []
    for step in range(trace.steps):
        src = fold_sources(trace.counts[step, 0], 4)
        rows.append(src.sum(axis=0)[policy.slots(0)].sum(axis=1).tolist())
        policy.placers[0].us_per_token = us_per_token[step]  # the runtime's after this micro-batch (its step's end)
        policy.step(step, 0, src)
        if setup.step_ends(step):
            placements.append(policy.placers[0].expert_to_rank.tolist())
    return rows, placements


def test_runtime_placement_equals_the_simulators(tmp_path):
    """Simulator parity: replaying a trace, the runtime makes the simulator's placement decisions
    (the same `CrossNodePlacer`, fed the same loads at the same optimizer steps) and every rank
    receives the rows the simulator gives it."""
    from deepspeed_feplb.trace.format import save_trace
    from deepspeed_feplb.trace.generators import skewed_trace
    trace = skewed_trace(micro_batches=24, layers=1, ranks=4, experts=16, tokens_per_rank=48, top_k=2, skew=1.2,
                         drift=0.4, memory=0.8, seed=4)
    path = tmp_path / "trace.npz"
    save_trace(path, trace)
    results = run_distributed(moe_cases.placement_replay_case, 4, str(path), 2, 2, 0.3, timeout=600)
    r = results[0]
    assert all(x["placements"] == r["placements"] for x in results)
    rows, placements = _simulated_placements(trace, 2, 2, 0.3, r["state_bytes"], r["us_per_token"])
    assert r["refreshes"] >= 2, "the trace never moved an expert: parity shows nothing"
    assert r["placements"] == placements
    runtime_rows = []
    for mb in range(trace.steps):  # each rank's domain reports its ranks' rows: assemble all four
        per_rank = {}
        for x in results:
            per_rank.update(zip(x["micro"][mb]["ranks"], x["micro"][mb]["tokens_before"]))
        runtime_rows.append([per_rank[rank] for rank in range(4)])
    assert runtime_rows == rows


@pytest.mark.parametrize("ds_config,problem", [({"zero_optimization": {"stage": 3}}, "ZeRO stage 3"),
                                               ({}, "pipeline parallelism"),
                                               ({"bf16": {"enabled": True}}, "bf16 at ZeRO stage 0"),
                                               ({"fp16": {"enabled": True}, "zero_optimization": {"stage": 0}},
                                                "fp16 at ZeRO stage 0")])
def test_placement_refuses_what_it_cannot_move(ds_config, problem):
    import torch
    from deepspeed.runtime.pipe.module import PipelineModule

    from deepspeed_feplb.config import FEPLBConfigError
    from deepspeed_feplb.integration.placement_engine import check_config
    model = torch.nn.Linear(2, 2)
    if problem == "pipeline parallelism":
        model = PipelineModule.__new__(PipelineModule)  # only its type matters here
    with pytest.raises(FEPLBConfigError, match=f"feplb.placement: not supported with {problem}"):
        check_config(model, ds_config)
    for fine in ({"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}, {"zero_optimization": {"stage": 0}}):
        check_config(torch.nn.Linear(2, 2), fine)


def test_auto_placement_is_on_where_an_ep_group_spans_domains_and_the_run_supports_it(capsys):
    """``"enabled": "auto"`` becomes true or false for the job: on where a layer's EP group spans
    NVLink domains; off within one domain (silently) and where the run cannot place (one line
    naming why); an explicit setting stays as it is. A layer without an engine has none."""
    from deepspeed_feplb.config import FEPLBConfig
    from deepspeed_feplb.integration.placement import replica_slots_per_rank
    from deepspeed_feplb.integration.placement_engine import moe_ep_sizes, resolve_auto
    auto = FEPLBConfig(nvlink_domain_size=2, placement={"enabled": "auto", "redundant_experts_per_rank": 1})
    assert auto.placement.enabled == "auto" and replica_slots_per_rank(auto, 4) == 0
    zero1 = {"zero_optimization": {"stage": 1}}
    assert resolve_auto(auto, None, zero1, [4]).placement.enabled is True
    assert replica_slots_per_rank(resolve_auto(auto, None, zero1, [4]), 4) == 1
    assert resolve_auto(auto, None, zero1, [2, 2]).placement.enabled is False
    assert capsys.readouterr().out == ""
    refused = resolve_auto(auto, None, {"zero_optimization": {"stage": 3}}, [4])
    assert refused.placement.enabled is False and replica_slots_per_rank(refused, 4) == 0
    said = capsys.readouterr().out.splitlines()
    assert said == ['deepspeed_feplb: feplb.placement.enabled is "auto": the expert-parallel group of 4 ranks spans '
                    "NVLink domains, but placement stays off: it is not supported with ZeRO stage 3"], said
    for explicit in (True, False):
        config = FEPLBConfig(nvlink_domain_size=2, placement={"enabled": explicit, "redundant_experts_per_rank": 0})
        assert resolve_auto(config, None, {"zero_optimization": {"stage": 3}}, [4]) is config
    assert moe_ep_sizes(None, {"expert_parallel": {"enabled": True, "autoep_size": 8}}) == [8]
    assert moe_ep_sizes(None, {"expert_parallel": {"autoep_size": 8}}) == []


def test_auto_replica_slots_are_one_where_an_ep_group_spans_domains_and_the_slots_fit(capsys, monkeypatch):
    """``redundant_experts_per_rank: "auto"`` (the default): 0 within one domain and where the run
    cannot place (one line); else decided with the engine built: 1 where every rank's cross-node
    layers can take a slot, 0 with one line naming why (experts with buffers, experts in host
    memory, or slots over a quarter of the free device memory). A layer without an engine has none."""
    import torch

    import deepspeed_feplb
    import deepspeed_feplb.memory as memory
    from deepspeed_feplb.config import FEPLBConfig
    from deepspeed_feplb.integration.engine import resolve_replica_slots
    from deepspeed_feplb.integration.placement import replica_slots_per_rank
    from deepspeed_feplb.integration.placement_engine import cross_node_layer, resolve_auto
    from deepspeed_feplb.migrate.resident import copy_bytes
    from deepspeed_feplb.once import forget
    default = FEPLBConfig(nvlink_domain_size=2)
    assert default.placement.redundant_experts_per_rank == "auto" and replica_slots_per_rank(default, 4) == 0
    zero1 = {"zero_optimization": {"stage": 1}}
    spanning = resolve_auto(default, None, zero1, [4])
    assert spanning.placement.redundant_experts_per_rank == "auto" and cross_node_layer(spanning, [4])
    one_node = resolve_auto(default, None, zero1, [2, 2])
    assert one_node.placement.redundant_experts_per_rank == 0 and not cross_node_layer(one_node, [2])
    assert capsys.readouterr().out == ""
    forget("placement auto off")
    refused = resolve_auto(default, None, {"zero_optimization": {"stage": 3}}, [4])
    assert refused.placement.redundant_experts_per_rank == 0 and refused.placement.enabled is False
    assert capsys.readouterr().out.splitlines() == [
        'deepspeed_feplb: feplb.placement.redundant_experts_per_rank is "auto": the expert-parallel group of 4 '
        "ranks spans NVLink domains, but replica slots stay off: it is not supported with ZeRO stage 3"]

    def model(**expert_buffers):
        expert = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
        for name, value in expert_buffers.items():
            expert.register_buffer(name, value)
        return torch.nn.Sequential(*(deepspeed_feplb.MoE(hidden_size=8, expert=expert, num_experts=8, ep_size=4, k=2)
                                     for _ in range(3)))

    on_host = resolve_replica_slots(spanning, model())  # CPU ranks: none
    assert on_host.placement.redundant_experts_per_rank == 0 and replica_slots_per_rank(on_host, 4) == 0
    assert capsys.readouterr().out == ('deepspeed_feplb: feplb.placement.redundant_experts_per_rank is "auto" and '
                                       "stays 0: the experts are in host memory (CPU ranks), where the replicas' "
                                       "step-end collectives cost more than they save; set it to a number of slots "
                                       "to have them anyway\n")
    expert = (8 * 16 + 16 + 16 * 8 + 8) * 4  # P: Linear(8, 16) and Linear(16, 8), fp32
    slots = 3 * 2 * copy_bytes(list(model()[0].deepspeed_moe.experts.deepspeed_experts[0].parameters()))
    # a slot per layer: its fp32 weights and gradient sum, and an expert's gradient and a replica's
    # arrived sum held back to a step's last backward's end (a DeepSpeed MoE layer)
    assert slots == 3 * 2 * 2 * expert
    others = 3 * 2 * 2 * 1 * expert  # per layer 2D (G - 1) P of copies held forward to backward (D = 2, G = 2)
    # a quarter of what the other buffers leave: they fit
    monkeypatch.setattr(memory, "device_free_bytes", lambda device: others + 4 * slots)
    decided = resolve_replica_slots(spanning, model())
    assert decided.placement.redundant_experts_per_rank == 1 and replica_slots_per_rank(decided, 4) == 1
    assert capsys.readouterr().out == ""
    assert resolve_replica_slots(decided, model()) is decided  # decided settings stay
    monkeypatch.setattr(memory, "device_free_bytes", lambda device: others + 4 * slots - 1)
    assert resolve_replica_slots(spanning, model()).placement.redundant_experts_per_rank == 0
    said = capsys.readouterr().out
    assert said.startswith('deepspeed_feplb: feplb.placement.redundant_experts_per_rank is "auto" and stays 0: '
                           "rank 0 has 0 MiB of device memory free, FEPLB's other buffers take 0 MiB, and a replica "
                           "slot in each of its 3 cross-node MoE layers takes 0 MiB, more than 25% of what is "
                           "left"), said
    with_buffers = resolve_replica_slots(spanning, model(running=torch.zeros(8)))
    assert with_buffers.placement.redundant_experts_per_rank == 0
    assert "the experts of MoE layer 0.deepspeed_moe have buffers" in capsys.readouterr().out


@pytest.mark.parametrize("free, slots", [(dict.fromkeys(range(4), 2**40), 1),
                                         ({0: None, 1: None, 2: 2**40, 3: 2**40}, 0)],
                         ids=["gpu-memory", "two-ranks-on-host-memory"])
def test_auto_placement_places_and_trains_exactly(free, slots):
    """``"auto"`` placement and replica slots on 4 ranks as 2 nodes of 2 through
    `deepspeed_feplb.initialize`, the experts' memory taken for a GPU's on the ranks ``free`` gives a
    figure (`memory.device_free_bytes`): experts move, and training equals DeepSpeed's MoE. Each rank
    has a replica slot where every rank has plenty free; where two ranks say host memory, every rank
    decides alike: none."""
    results = run_distributed(moe_cases.placement_case, 4, 1, 8, 2, enabled="auto", redundant="auto",
                              free_bytes=free, timeout=600)
    r = results[0]
    assert r["refreshes"] >= 1 and r["moved_experts"] > 0, "auto placement did not move experts"
    assert [x["replica_slots"] for x in results] == [slots] * 4
    reference, ours = np.array(r["losses"]["reference"]), np.array(r["losses"]["feplb"])
    assert np.allclose(ours, reference, rtol=1e-5, atol=1e-6), f"losses differ: {ours - reference}"
    assert max(max(x["param_errors"].values()) for x in results) < 1e-4


def one_node_placement_warning() -> list:
    import contextlib
    import io
    import warnings

    import torch

    import deepspeed_feplb
    layer = deepspeed_feplb.MoE(8, torch.nn.Linear(8, 8), num_experts=4, ep_size=2, k=1, drop_tokens=False,
                                use_rts=False, feplb_config={"nvlink_domain_size": 2,
                                                             "placement": {"enabled": True}})
    layer.set_deepspeed_parallelism()
    out = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(out):
        warnings.simplefilter("always")
        for _ in range(2):
            layer(torch.randn(16, 8))
    return [line for line in out.getvalue().splitlines() if "feplb.placement.enabled" in line] + \
        [str(w.message) for w in caught if "placement" in str(w.message)]


def test_placement_on_one_node_says_it_will_not_move_experts_in_one_line():
    said = run_distributed(one_node_placement_warning, 2, timeout=300)
    assert len(said[0]) == 1 and said[0][0].startswith("deepspeed_feplb: ") and "is one NVLink domain" in said[0][0]
    assert said[1] == [], said  # one line per job: the first rank says it


def test_a_placement_order_is_adopted_only_when_the_layers_weights_loaded():
    """A state dict in placement order hands its order to the layer (for its first forward) only
    when the load of the layer's weights succeeded: a load that fails on them (a size mismatch, a
    missing expert) leaves the layer in DeepSpeed's order, not permuted over weights it never got."""
    import torch

    import deepspeed_feplb
    from deepspeed_feplb.integration.expert_order import ORDER_KEY, _rename

    def layer():
        torch.manual_seed(0)
        return deepspeed_feplb.MoE(8, torch.nn.Linear(8, 8), num_experts=4, ep_size=1, k=1, drop_tokens=False,
                                   use_rts=False, feplb_config={"dynamic_experts_per_rank": 1})

    placed = layer().state_dict()
    _rename(placed, "deepspeed_moe.", (("experts.deepspeed_experts.", "experts.feplb_placed_experts."), ),
            to_placed=True)
    placed._metadata["deepspeed_moe"][ORDER_KEY] = [1, 0, 3, 2]
    good = layer()
    good.load_state_dict(placed)
    assert good.deepspeed_moe.loaded_expert_order == [1, 0, 3, 2]

    mismatched = dict(placed)
    mismatched["deepspeed_moe.experts.feplb_placed_experts.2.weight"] = torch.zeros(8, 9)
    mismatched = type(placed)(mismatched)
    mismatched._metadata = placed._metadata
    bad = layer()
    with pytest.raises(RuntimeError, match="size mismatch"):
        bad.load_state_dict(mismatched)
    assert bad.deepspeed_moe.loaded_expert_order is None

    missing = type(placed)((k, v) for k, v in placed.items() if "feplb_placed_experts.3." not in k)
    missing._metadata = placed._metadata
    partial = layer()
    partial.load_state_dict(missing, strict=False)
    assert partial.deepspeed_moe.loaded_expert_order is None
