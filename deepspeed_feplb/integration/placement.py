"""Cross-node placement on an engine: after every optimizer step, and around checkpoints.

`install(engine)` (called by `deepspeed_feplb.initialize`, and by a `deepspeed_feplb.MoE` that a plain
``deepspeed.initialize`` configures) makes ``engine.step()`` end with each placed layer's
`ExpertPlacement.end_step` (agree on the step's loads, re-place every ``interval_steps`` steps), and
keeps checkpoints in DeepSpeed's layout: ``save_checkpoint`` runs with every expert back in its
original slot, and after ``load_checkpoint`` the table is the identity. Idempotent per engine.
"""
from __future__ import annotations

import contextlib

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
    def saving():
        with contextlib.ExitStack() as stack:
            for layer in placed_layers(engine.module):
                stack.enter_context(layer.placement.canonical(_expert_params(layer), engine.optimizer))
            yield

    def loaded() -> None:
        for layer in placed_layers(engine.module):
            layer.placement.reset()

    seams.after_step(engine, after_step)
    seams.around_checkpoints(engine, saving, loaded)
