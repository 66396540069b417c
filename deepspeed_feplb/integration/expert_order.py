"""A placed layer's state dict: which logical expert each slot holds travels with it.

A layer's state dict records the order its slots hold the experts in (`record_expert_order`; in
another order than DeepSpeed's the expert keys are renamed, so that a loader that does not know
the order fails instead of loading every re-placed expert into another's slot, and a warning
says how to take one in DeepSpeed's order), and loading one checks it (`check_expert_order`):
a fresh job adopts the saved order, one whose experts moved since refuses another order.
"""
from __future__ import annotations

import warnings

from deepspeed_feplb.config import FEPLBConfigError

ORDER_KEY = "feplb_expert_order"  # in a layer's state-dict metadata: slot -> logical expert
_EXPERTS, _PLACED_EXPERTS = "experts.deepspeed_experts.", "experts.feplb_placed_experts."


# a layer's expert keys (below its prefix) and what they become in placement order: a DeepSpeed MoE
# layer's experts, or (``feplb_expert_keys`` of its experts module) AutoEP's stacked weights
EXPERT_KEYS = ((_EXPERTS, _PLACED_EXPERTS),)


def _expert_keys(layer) -> tuple:
    return getattr(layer, "feplb_expert_keys", EXPERT_KEYS)


def _holds(key: str, stem: str) -> bool:
    """Whether ``key`` is ``stem`` or below it (a stem ending in "." is a module's)."""
    return key.startswith(stem) if stem.endswith(".") else key == stem


def _rename(state_dict, prefix: str, pairs: tuple, to_placed: bool) -> bool:
    """Rename the expert keys ``prefix + canonical + rest`` to ``prefix + placed + rest``
    (``to_placed``) or back, for each (canonical, placed) of ``pairs``, in place; whether any was."""
    renamed = False
    for canonical, placed in pairs:
        old, new = (canonical, placed) if to_placed else (placed, canonical)
        keys = [k for k in state_dict if _holds(k, prefix + old)]
        for k in keys:
            state_dict[prefix + new + k[len(prefix + old):]] = state_dict.pop(k)
        renamed |= bool(keys)
    return renamed


def keep_expert_order(layer) -> None:
    """Register the hooks that keep ``layer``'s expert order in its state dicts (`record_expert_order`,
    `check_expert_order`, `adopt_expert_order`); once, however often a layer is set up."""
    if getattr(layer, "_feplb_state_hooks", False):
        return
    layer._feplb_state_hooks = True
    layer.register_state_dict_post_hook(record_expert_order)
    layer._register_load_state_dict_pre_hook(check_expert_order, with_module=True)
    layer.register_load_state_dict_post_hook(adopt_expert_order)


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
        pairs = _expert_keys(layer)
        _rename(state_dict, prefix, pairs, to_placed=True)
        placed = ", ".join(prefix + p + ("*" if p.endswith(".") else "") for _, p in pairs)
        warnings.warn(f"FEPLB: the experts of MoE layer {prefix.rstrip('.') or 'moe'} are re-placed across ranks "
                      "(feplb.placement), so this state dict holds them in placement order, under the keys "
                      f"{placed}, which only FEPLB loads; for plain DeepSpeed save with "
                      "engine.save_checkpoint, or take the state dict inside "
                      "`with deepspeed_feplb.canonical_experts(engine):` (collective)", stacklevel=3)


def check_expert_order(layer, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                       error_msgs) -> None:
    """Load-state-dict pre-hook of a FEPLB MoE layer: a state dict that holds this layer's experts
    in placement order (`record_expert_order`) loads into the slots they were saved from.

    * With a placement that has moved experts, the slots must hold the experts in that order now;
      loading them in another would give every re-placed expert another's weights.
    * One that has not (a fresh job) adopts the order; without a placement yet (a DeepSpeed MoE
      layer before its first forward) the layer keeps it, and its placement starts from it at the
      first forward, or that forward refuses when ``feplb.placement`` is off (`adopt_loaded_order`).
      Either happens only once the layer's weights loaded (`adopt_expert_order`, the post-hook): a
      load that fails on them leaves the table as it was, not permuted over weights that are not.
    """
    pairs = _expert_keys(layer)
    renamed = _rename(state_dict, prefix, pairs, to_placed=False)
    if not any(_holds(k, prefix + canonical) for k in state_dict for canonical, _ in pairs):
        return
    name = prefix.rstrip('.') or 'moe'
    if renamed and ORDER_KEY not in local_metadata:
        raise RuntimeError(f"FEPLB: the state dict holds the experts of MoE layer {name} in placement order "
                           f"({', '.join(prefix + p for _, p in pairs)}) but not that order (its metadata was lost), "
                           "so no expert can be matched to its weights; save with engine.save_checkpoint instead")
    recorded = [int(e) for e in local_metadata.get(ORDER_KEY, [])]
    placed = recorded if recorded != sorted(recorded) else None
    placement = getattr(layer, "placement", None)
    # adopted by `adopt_expert_order` once this layer's weights loaded: (order, where load errors
    # collect, how many there were, the layer's prefix)
    pending = (placed, error_msgs, len(error_msgs), prefix)
    if placement is None:
        layer._feplb_loaded_order = pending
        return
    if placed and placement.steps == 0 and placement.identity:
        layer._feplb_loaded_order = pending  # nothing moved yet: the slots take the saved order
    elif (recorded or list(range(placement.num_experts))) != placement.slot_order():
        raise RuntimeError(
            f"FEPLB: the state dict holds the experts of MoE layer {name} in "
            f"{'placement' if recorded != sorted(recorded) else 'DeepSpeed'}'s order, but this job has re-placed them "
            "since (feplb.placement); load a checkpoint with engine.load_checkpoint, or load the state dict inside "
            "`with deepspeed_feplb.canonical_experts(engine):` (collective) when it was taken in DeepSpeed's order")
    placement._replicas_stale()  # the experts' weights change: their replicas' come again at the next forward


def adopt_expert_order(layer, incompatible_keys) -> None:
    """Load-state-dict post-hook of a FEPLB MoE layer: the order `check_expert_order` found becomes
    the layer's (its placement's table, or ``layer.loaded_expert_order`` for its first forward) once
    the layer's weights loaded: no load error since, and none of its keys missing."""
    pending = layer.__dict__.pop("_feplb_loaded_order", None)
    if pending is None:
        return
    order, error_msgs, errors_before, prefix = pending
    if len(error_msgs) > errors_before or any(k.startswith(prefix) for k in incompatible_keys.missing_keys):
        return
    placement = getattr(layer, "placement", None)
    if placement is None:
        layer.loaded_expert_order = order
    elif order is not None:
        placement.adopt(order)


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
            f"(slot -> expert {order}), which only a job with feplb.placement.enabled and the saved job's "
            "expert-parallel size can use; enable placement, or save a state dict in DeepSpeed's order "
            "(engine.save_checkpoint, or `with deepspeed_feplb.canonical_experts(engine):`)")
    layer.placement.adopt(order)
    layer.loaded_expert_order = None
