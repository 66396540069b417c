"""Cross-node placement on an engine: after every optimizer step, and around checkpoints.

`install(engine)` (called by `deepspeed_feplb.initialize`, and by a `deepspeed_feplb.MoE` that a plain
``deepspeed.initialize`` configures) makes ``engine.step()`` end with each placed layer's
`ExpertPlacement.end_step` (agree on the step's loads, re-place every ``interval_steps`` steps), and
keeps checkpoints in DeepSpeed's layout: ``save_checkpoint`` runs with every expert back in its
original slot (`canonical_experts`), and after ``load_checkpoint`` the table is the identity.
Idempotent per engine. A layer's state dict records the order its slots hold the experts in
(`record_expert_order`; taken while experts are re-placed outside `canonical_experts`, it warns),
and loading one in another order than the slots' now fails (`check_expert_order`).
"""
from __future__ import annotations

import contextlib
import warnings

from deepspeed_feplb.config import FEPLBConfigError
from deepspeed_feplb.integration import seams
from deepspeed_feplb.migrate.placement import ExpertPlacement


def placed_layers(module):
    """The FEPLB MoE layers under ``module`` that have a placement (attached at their first forward)."""
    return [m for m in module.modules() if isinstance(getattr(m, "placement", None), ExpertPlacement)]


def _expert_params(layer) -> list:
    return [list(expert.parameters()) for expert in layer.experts.deepspeed_experts]


def install(engine) -> None:
    if getattr(engine, "_feplb_placement_installed", False):
        return
    engine._feplb_placement_installed = True

    def after_step(boundary: bool) -> None:
        if not boundary:
            return
        for layer in placed_layers(engine.module):
            times = layer.compute_times
            us_per_token = 3e6 * times.expert_seconds / times.rows if times.rows else 0.0  # forward + backward
            layer.placement.end_step(_expert_params(layer), engine.optimizer, us_per_token)

    @contextlib.contextmanager
    def loading():
        with contextlib.ExitStack() as stack:
            layers = placed_layers(engine.module)
            for layer in layers:
                stack.enter_context(layer.placement.expecting_canonical())
            yield
        for layer in layers:  # the checkpoint put every expert and its optimizer state in its own slot
            layer.placement.reset()

    seams.after_step(engine, after_step)
    seams.around_checkpoints(engine, lambda: canonical_experts(engine), loading)
    seams.clip_fp32_gradients_with(engine, lambda params: canonical_grad_norms(engine.module, params))


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
        experts = _expert_params(layer)  # [E_local][n]
        local = torch.stack([torch.stack([norms[p] if p in norms else p.new_zeros((), dtype=torch.float32)
                                          for p in expert]) for expert in experts])  # [E_local, n]
        gathered = [torch.empty_like(local) for _ in range(placement.ep_size)]
        dist.all_gather(gathered, local, group=placement.ep_group)
        by_slot = torch.cat(gathered)  # [E, n]
        me = dist.get_rank(placement.ep_group)
        mine = me * placement.per_rank + torch.arange(placement.per_rank, device=placement.slot_of.device)
        canonical = by_slot[placement.slot_of[mine].to(by_slot.device)]
        for i, expert in enumerate(experts):
            for j, p in enumerate(expert):
                if p in norms:
                    norms[p] = canonical[i, j]
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
            stack.enter_context(layer.placement.canonical(_expert_params(layer), engine.optimizer))
        yield


ORDER_KEY = "feplb_expert_order"  # in a layer's state-dict metadata: slot -> logical expert
_EXPERTS, _PLACED_EXPERTS = "experts.deepspeed_experts.", "experts.feplb_placed_experts."


def _rename(state_dict, prefix: str, old: str, new: str) -> bool:
    """Rename the keys ``prefix + old + rest`` to ``prefix + new + rest`` in place; whether any was."""
    keys = [k for k in state_dict if k.startswith(prefix + old)]
    for k in keys:
        state_dict[prefix + new + k[len(prefix + old):]] = state_dict.pop(k)
    return bool(keys)


def record_expert_order(layer, state_dict, prefix, local_metadata) -> None:
    """State-dict post-hook of a FEPLB MoE layer: record which logical expert each slot holds in the
    layer's metadata (kept by ``torch.save``). In another order than DeepSpeed's, warn, and name the
    experts ``...experts.feplb_placed_experts.<slot>...``: a loader that does not know the order
    (plain DeepSpeed, another framework) then fails on the keys instead of loading every re-placed
    expert into another's slot; FEPLB loads them (`check_expert_order`)."""
    placement = getattr(layer, "placement", None)
    if placement is None:
        return
    order = placement.slot_order()
    local_metadata[ORDER_KEY] = order
    if order != sorted(order):
        _rename(state_dict, prefix, _EXPERTS, _PLACED_EXPERTS)
        warnings.warn(f"FEPLB: the experts of MoE layer {prefix.rstrip('.') or 'moe'} are re-placed across ranks "
                      "(feplb.placement), so this state dict holds them in placement order, under the keys "
                      f"{prefix}{_PLACED_EXPERTS}*, which only FEPLB loads; for plain DeepSpeed save with "
                      "engine.save_checkpoint, or take the state dict inside "
                      "`with deepspeed_feplb.canonical_experts(engine):` (collective)", stacklevel=3)


def check_expert_order(layer, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                       error_msgs) -> None:
    """Load-state-dict pre-hook of a FEPLB MoE layer: a state dict that holds this layer's experts
    in placement order (`record_expert_order`) loads into the slots they were saved from.

    * With the placement attached (after the first forward), the slots must hold the experts in
      that order now; loading them in another would give every re-placed expert another's weights.
    * Before it (a fresh job), the layer adopts the order: its placement starts from it at the
      first forward, or that forward refuses when ``feplb.placement`` is off (`adopt_loaded_order`).
    """
    renamed = _rename(state_dict, prefix, _PLACED_EXPERTS, _EXPERTS)
    if not any(k.startswith(prefix + _EXPERTS) for k in state_dict):
        return
    name = prefix.rstrip('.') or 'moe'
    if renamed and ORDER_KEY not in local_metadata:
        raise RuntimeError(f"FEPLB: the state dict holds the experts of MoE layer {name} in placement order "
                           f"({prefix}{_PLACED_EXPERTS}*) but not that order (its metadata was lost), so no expert "
                           "can be matched to its weights; save with engine.save_checkpoint instead")
    recorded = [int(e) for e in local_metadata.get(ORDER_KEY, [])]
    placement = getattr(layer, "placement", None)
    if placement is None:
        layer.loaded_expert_order = recorded if recorded != sorted(recorded) else None
        return
    if (recorded or list(range(placement.num_experts))) != placement.slot_order():
        raise RuntimeError(
            f"FEPLB: the state dict holds the experts of MoE layer {name} in "
            f"{'placement' if recorded != sorted(recorded) else 'DeepSpeed'}'s order, but this job has re-placed them "
            "since (feplb.placement); load a checkpoint with engine.load_checkpoint, or load the state dict inside "
            "`with deepspeed_feplb.canonical_experts(engine):` (collective) when it was taken in DeepSpeed's order")


def adopt_loaded_order(layer) -> None:
    """At the layer's first forward: a state dict loaded before it that held the experts in placement
    order (``layer.loaded_expert_order``) becomes the placement's table, or, without a placement
    (``feplb.placement.enabled`` false, or one EP rank), the forward refuses."""
    order = getattr(layer, "loaded_expert_order", None)
    if order is None:
        return
    if layer.placement is None:
        raise FEPLBConfigError(
            f"feplb.placement.enabled: a state dict loaded into this MoE layer holds its experts in placement order "
            f"(slot -> expert {order}), which only a job with feplb.placement.enabled and the saved job's expert-parallel "
            "size can use; enable placement, or save a state dict in DeepSpeed's order (engine.save_checkpoint, or "
            "`with deepspeed_feplb.canonical_experts(engine):`)")
    layer.placement.adopt(order)
    layer.loaded_expert_order = None
