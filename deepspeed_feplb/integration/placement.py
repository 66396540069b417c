"""Cross-node placement on an engine: after every optimizer step, and around checkpoints.

`install(engine)` (called by `deepspeed_feplb.initialize`, and by a `deepspeed_feplb.MoE` that a plain
``deepspeed.initialize`` configures) makes ``engine.step()`` end with each placed layer's
`ExpertPlacement.end_step` (agree on the step's loads, re-place every ``interval_steps`` steps), and
keeps checkpoints in DeepSpeed's layout: ``save_checkpoint`` runs with every expert back in its
original slot (`canonical_experts`), and after ``load_checkpoint`` the table is the identity.
Idempotent per engine. A state dict taken outside `canonical_experts` while experts are re-placed
warns (`warn_placed_state_dict`); loading a state dict into a layer resets its table, since every
state dict FEPLB writes is canonical.
"""
from __future__ import annotations

import contextlib
import warnings

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

    def loaded() -> None:
        for layer in placed_layers(engine.module):
            layer.placement.reset()

    seams.after_step(engine, after_step)
    seams.around_checkpoints(engine, lambda: canonical_experts(engine), loaded)


@contextlib.contextmanager
def canonical_experts(engine):
    """Within the block every re-placed expert of ``engine``'s model (a DeepSpeed engine) sits in
    its original slot, with its optimizer state: ``engine.module.state_dict()`` taken there is in
    DeepSpeed MoE's layout, which plain DeepSpeed and FEPLB under any placement load. Collective
    over the expert-parallel groups (every rank enters it); ``save_checkpoint`` uses it itself."""
    with contextlib.ExitStack() as stack:
        for layer in placed_layers(engine.module):
            stack.enter_context(layer.placement.canonical(_expert_params(layer), engine.optimizer))
        yield


def warn_placed_state_dict(layer, state_dict, prefix, local_metadata) -> None:
    """State-dict post-hook of a FEPLB MoE layer: a state dict of re-placed experts holds them in
    placement order, which only this job's table can read back: say so."""
    placement = getattr(layer, "placement", None)
    if placement is not None and not placement.canonical_now:
        warnings.warn(f"FEPLB: the experts of MoE layer {prefix.rstrip('.') or 'moe'} are re-placed across ranks "
                      "(feplb.placement), so this state dict holds them in placement order, which plain DeepSpeed and "
                      "another FEPLB job would load into the wrong experts; save with engine.save_checkpoint, or take "
                      "the state dict inside `with deepspeed_feplb.canonical_experts(engine):` (collective)",
                      stacklevel=3)


def reset_after_load(layer, incompatible_keys) -> None:
    """Load-state-dict post-hook of a FEPLB MoE layer: the experts loaded are in canonical order."""
    placement = getattr(layer, "placement", None)
    if placement is not None:
        placement.reset()
