"""Cross-node placement on a DeepSpeed engine: moves at its optimizer steps, checkpoints and
gradient norms in DeepSpeed's layout.

`install(engine)` (called by `deepspeed_feplb.initialize`, and by a `deepspeed_feplb.MoE` that a
plain ``deepspeed.initialize`` configures) makes ``engine.step()`` end with each placed layer's
`ExpertPlacement.end_step` (agree on the step's loads, re-place every ``interval_steps`` steps),
makes ``engine.forward`` begin by sending the stepped weights to every layer's replica slots
(`integration.replicas.ReplicaSlots.refresh_ahead`: they travel while the layers before each one
compute; when the forward returns, every such relay is ordered before what comes next, even for
a layer that did not run), runs ``save_checkpoint`` with every expert back in its original slot (`canonical_experts`),
makes the table the identity after ``load_checkpoint``, and clips gradients with each slot's
norms in DeepSpeed's layout (`canonical_grad_norms`). Idempotent per engine.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch.distributed as dist

from deepspeed_feplb.config import FEPLBConfig, FEPLBConfigError
from deepspeed_feplb.domain import domain_size
from deepspeed_feplb.integration import seams
from deepspeed_feplb.integration.placement import ExpertPlacement, replica_slots_per_rank
from deepspeed_feplb.once import first_time


def placed_layers(module):
    """The FEPLB MoE layers under ``module`` that have a placement (a DeepSpeed MoE layer's is
    attached at its first forward, an AutoEP layer's experts' when FEPLB is installed): each has
    ``placement``, ``stage`` and ``expert_states(optimizer)`` (`ModuleExperts` or
    `StackedExperts`)."""
    return [m for m in module.modules() if isinstance(getattr(m, "placement", None), ExpertPlacement)]


def unsupported(model, ds_config: dict) -> Optional[tuple[str, str]]:
    """(what, the fix) that placement cannot move an expert's state under, or None: ZeRO stage 3
    (experts partitioned across ranks), pipelines (whose engine steps internally), and fp16 or bf16
    at ZeRO stage 0 (DeepSpeed's fp16 optimizer wrapper keeps the fp32 master weights in groups of
    its own, apart from the parameters)."""
    from deepspeed.runtime.pipe.module import PipelineModule
    stage = int((ds_config.get("zero_optimization") or {}).get("stage", 0))
    if stage > 2:
        return f"ZeRO stage {stage}", "use stage 0, 1 or 2"
    if isinstance(model, PipelineModule):
        return "pipeline parallelism yet", ""
    half = [key for key in ("bf16", "bfloat16", "fp16") if (ds_config.get(key) or {}).get("enabled") is True]
    if half and stage == 0:
        return (f"{half[0]} at ZeRO stage 0 (DeepSpeed's fp16/bf16 optimizer wrapper keeps the fp32 master weights "
                "apart from the parameters, and a moved expert could not take them along)",
                "use zero_optimization.stage 1 or 2")
    return None


def cross_node_layer(config: FEPLBConfig, ep_sizes: list[int]) -> bool:
    """Whether MoE layers over EP groups of ``ep_sizes`` may run the cross-node layer (an
    `ExpertPlacement`, driven at the optimizer steps): ``feplb.placement.enabled`` true (decided:
    `resolve_auto`), or replica slots on a group that spans NVLink domains, every expert then
    keeping its home (`placement.replica_slots_per_rank`; "auto" ones are decided with the engine
    built, `engine.resolve_replica_slots`)."""
    if config.placement.enabled is True:
        return True
    if config.placement.redundant_experts_per_rank == "auto":
        return any(size > domain_size(config, size) for size in ep_sizes)
    return any(replica_slots_per_rank(config, size) for size in ep_sizes)


def check_config(model, ds_config: dict) -> None:
    """Raise `FEPLBConfigError` for what placement cannot move an expert's state under (`unsupported`),
    and what replica slots cannot sum their gradients under (the same runs)."""
    found = unsupported(model, ds_config)
    if found is not None:
        what, fix = found
        raise FEPLBConfigError(f"feplb.placement: not supported with {what}; {fix + ', or ' if fix else ''}"
                               "set feplb.placement.enabled to false and redundant_experts_per_rank to 0")


def resolve_auto(config: FEPLBConfig, model, ds_config: dict, ep_sizes: list[int]) -> FEPLBConfig:
    """``config`` with ``feplb.placement.enabled: "auto"`` decided for the job: true where an MoE
    layer's EP group (of ``ep_sizes``) spans more than one NVLink domain and the run supports
    placement (`unsupported`), else false, said in one line (EP rank 0) where such a group stays
    without it (with no replica slots either). Any other setting is returned as it is."""
    enabled, slots = config.placement.enabled, config.placement.redundant_experts_per_rank
    if "auto" not in (enabled, slots):
        return config
    spans = [size for size in ep_sizes if size > domain_size(config, size)]
    reason = unsupported(model, ds_config) if spans else None
    if reason is not None and _rank() == 0 and first_time("placement auto off"):
        auto = [(key, what) for key, value, what in (("enabled", enabled, "placement"),
                                                      ("redundant_experts_per_rank", slots, "replica slots"))
                if value == "auto"]
        keys, whats = (" and ".join(part[i] for part in auto) for i in (0, 1))
        print(f'deepspeed_feplb: feplb.placement.{keys} {"are" if len(auto) > 1 else "is"} "auto": the '
              f"expert-parallel group of {spans[0]} ranks spans NVLink domains, but {whats} "
              f"{'stays' if whats == 'placement' else 'stay'} off: it is not supported with {reason[0]}", flush=True)
    update = {}
    if enabled == "auto":
        update["enabled"] = bool(spans) and reason is None
    if reason is not None or (slots == "auto" and not spans):  # replica slots are refused under the same runs
        update["redundant_experts_per_rank"] = 0
    placement = config.placement.model_copy(update=update)
    return config.model_copy(update={"placement": placement})


def with_replica_slots(config: FEPLBConfig, slots: int) -> FEPLBConfig:
    """``config`` with ``feplb.placement.redundant_experts_per_rank`` set to ``slots``."""
    return config.model_copy(update={"placement": config.placement.model_copy(
        update={"redundant_experts_per_rank": slots})})


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def moe_ep_sizes(model, ds_config: dict) -> list[int]:
    """The EP group sizes of ``model``'s DeepSpeed MoE layers and of the layers DeepSpeed AutoEP
    will build from ``ds_config``'s ``expert_parallel`` section."""
    from deepspeed.moe.layer import MoE
    sizes = [m.ep_size for m in model.modules() if isinstance(m, MoE)] if model is not None else []
    autoep = ds_config.get("expert_parallel") or {}
    if autoep.get("enabled", False):
        sizes.append(int(autoep.get("autoep_size", 1)))
    return sizes


def install(engine) -> None:
    """Move experts at ``engine``'s optimizer steps (`check_config` first: raises for what cannot)."""
    if getattr(engine, "_feplb_placement_installed", False):
        return
    check_config(getattr(engine, "module", None), engine.config)
    engine._feplb_placement_installed = True
    replica_slots = []  # the placed layers' `ReplicaSlots`, in module order, as of the last step
    first_step = [True]  # until the first optimizer step ends

    def after_step(boundary: bool) -> None:
        if not boundary:
            return
        layers = placed_layers(engine.module)
        # found once per step, not per forward (a walk over every module); a layer's placement
        # attaches at its first forward, before the first step
        replica_slots[:] = _replica_slots(layers)
        first_step[0] = False
        for i, layer in enumerate(layers):
            # the replicas' review of layer i is weighed by EP rank i mod the group's size alone
            layer.placement.end_step(layer.expert_states(engine.optimizer), _us_per_token(layer),
                                     review_owner=i % layer.placement.ep_size)
        for layer in layers:  # every rank weighs its layers' reviews at once, then they share them
            layer.placement.decide_review()
        for layer in layers:
            layer.placement.share_review()

    @contextlib.contextmanager
    def loading():
        with contextlib.ExitStack() as stack:
            layers = placed_layers(engine.module)
            for layer in layers:
                stack.enter_context(layer.placement.expecting_canonical())
            yield
        for layer in layers:  # the checkpoint put every expert and its optimizer state in its own slot
            layer.placement.reset()

    def ahead() -> None:  # collective: every rank's layers in the same order
        if first_step[0]:  # replicas alone may be chosen before the first step ends (`decide_mid_step`)
            layers = placed_layers(engine.module)
            decided = [layer.placement.decide_mid_step(_us_per_token(layer), engine.gradient_accumulation_steps())
                       for layer in layers]
            if any(decided):
                replica_slots[:] = _replica_slots(layers)
        for slots in replica_slots:
            slots.refresh_ahead()

    def settled() -> None:  # a layer that did not run: its relay ends before anything writes what it reads
        for slots in replica_slots:
            slots.wait_arriving()

    seams.after_step(engine, after_step)
    seams.around_forward(engine, ahead, settled)
    seams.around_checkpoints(engine, lambda: canonical_experts(engine), loading)
    seams.clip_fp32_gradients_with(engine, lambda params: canonical_grad_norms(engine.module, params))


def _replica_slots(layers) -> list:
    """The `ReplicaSlots` of ``layers`` (placed layers), in their order, where they have any."""
    return [layer.placement.replicas for layer in layers if layer.placement.replicas is not None]


def _us_per_token(layer) -> float:
    """The layer's measured expert time per routed row, forward and backward (µs; 0: not timed yet)."""
    times = layer.stage.compute_times if layer.stage is not None else None
    return 3e6 * times.expert_seconds / times.rows if times and times.rows else 0.0


def canonical_grad_norms(module, params: list) -> list:
    """The gradient norm (0-dim float32) of each of ``params`` as DeepSpeed's layout would give it on
    this rank: a re-placed layer's expert parameter in local slot ``i`` counts with the norm of the
    same parameter of the expert that slot ``i`` of this rank holds in DeepSpeed's layout, wherever
    that expert lives now (per-parameter norms all-gathered over the EP group).

    DeepSpeed's ZeRO 0 clipping averages per-rank norms over the data-parallel group, so a rank's
    norm must not depend on which experts placement put there: with each rank's own experts the
    clip coefficient (and every parameter's update) would differ from DeepSpeed's after the first
    re-placement. Collective over the EP groups of re-placed layers."""
    import torch
    import torch.distributed as dist
    norms = {p: p.grad.data.detach().float().norm(2) for p in params}
    for layer in placed_layers(module):
        placement = layer.placement
        if placement.identity:  # the same on every rank of the EP group: all skip the gather alike
            continue
        experts = layer.expert_states(None)
        local = experts.norm_table(norms)  # [E_local, n]
        gathered = [torch.empty_like(local) for _ in range(placement.ep_size)]
        dist.all_gather(gathered, local, group=placement.ep_group)
        by_slot = torch.cat(gathered)  # [E, n]
        me = dist.get_rank(placement.ep_group)
        mine = me * placement.per_rank + torch.arange(placement.per_rank, device=placement.slot_of.device)
        experts.set_norms(by_slot[placement.slot_of[mine].to(by_slot.device)], norms)
    return [norms[p] for p in params]


@contextlib.contextmanager
def canonical_experts(engine):
    """Within the block every re-placed expert of ``engine``'s model (a DeepSpeed engine) sits in
    its original slot, with its optimizer state: ``engine.module.state_dict()`` taken there is in
    DeepSpeed MoE's layout, which plain DeepSpeed and FEPLB under any placement load, and a state
    dict in that layout loads there (leaving the block moves the loaded experts, with their
    optimizer state, back to their placed slots). Collective over the expert-parallel groups (every
    rank enters it); ``save_checkpoint`` uses it itself."""
    with contextlib.ExitStack() as stack:
        for layer in placed_layers(engine.module):
            stack.enter_context(layer.placement.canonical(layer.expert_states(engine.optimizer)))
        yield
