"""Kept copies carried over an optimizer step (``feplb.keep_copies_across_steps``).

With ``weight_residency: "step"`` a helper keeps an expert's copy for the rest of the step, and the
step's first micro-batch copies again: the optimizer step changed the weights. The copies the
step's last micro-batch used are parked there (`LayerResidency.park`); right after
``engine.step()`` (the engine's hook, `refresh_kept_copies`) every layer holds them again
(`ResidencyTable.keep`, within the same limits) and each home sends its helpers the stepped
weights of those experts, one message per (home, helper) and layer, so the copies travel while the
next step's first layers compute and its first micro-batch finds them held.

Every rank of a domain takes the same decisions (the tables and the parked entries are derived from
the plans, which every rank reads). The refresh messages go first on their links, before any
message of the next step: every rank sends all its layers' refreshes, then receives its own, in
layer order, so each link delivers them in the order they were sent. A receive lands in the held
copy's own tensors; on a GPU with ``serve_on_arrival`` on the served stream, which alone computes
with them (`phase2.served_stream`), so the copies are in before its next use and the home's sends
follow the optimizer step on the caller's stream.

Not refreshed (their parked copies are forgotten, as without the option, by the hook right after
the step): layers with cross-node placement or replica slots, whose slots may change at the same
step; the engine's first optimizer step, which may allocate the optimizer's state (a kept copy held
through it would take that memory); and a layer stepped without the engine of
`deepspeed_feplb.initialize` (no hook; a pipeline's engine installs none), whose next micro-batch
unparks. A parked copy's gradient sum is dropped once its backward sent it home,
so through the optimizer step a carried copy holds its weights alone.
"""
from __future__ import annotations

import functools
from typing import Sequence

from deepspeed_feplb.migrate import messages
from deepspeed_feplb.migrate.phase2 import REFRESH, on_stream, serving_stream, tag
from deepspeed_feplb.migrate.resident import HeldCopy

__all__ = ["refresh_kept_copies", "REFRESH_TAG"]

REFRESH_TAG = tag(0, REFRESH)  # balanced micro-batches count from 1: no phase-2 message has seq 0


def refresh_kept_copies(stages: Sequence) -> int:
    """After an optimizer step, for ``stages`` (the model's `expert_stage.ExpertStage` objects, in
    module order, the same on every rank): hold each layer's parked copies again with the homes'
    stepped weights. Returns the copies held again (this rank's domain, over the layers)."""
    todo = []
    for stage in stages:
        residency = stage.residency
        if residency is None or residency.parked is None:
            continue
        entries, held = residency.parked
        residency.parked = None
        entries = entries[residency.table.keep(entries)]
        residency.refreshed += len(entries)
        if len(entries):
            todo.append((stage, entries, held))
    for stage, entries, _ in todo:  # every send first: a link then carries this step's refreshes before anything
        _send(stage, entries)
    for stage, entries, held in todo:
        _receive(stage, entries, held)
    return sum(len(entries) for _, entries, _ in todo)


def _send(stage, entries) -> None:
    """This rank's experts' stepped weights to the helpers that keep them (``entries`` (home,
    local_expert, helper)); the stamps say they are current (`LayerResidency.stamp`)."""
    domain, residency = stage.domain, stage.residency
    me = domain.local_rank
    params = stage.experts.weights_now()
    for helper in sorted({j for h, _, j in entries.tolist() if h == me}):
        experts = [e for h, e, j in entries.tolist() if h == me and j == helper]
        payload = [w.detach() for e in experts for w in params[e]]
        domain.transport.send(helper, REFRESH_TAG, payload)
        for e in experts:
            residency.sent[(e, helper)] = residency.stamp(params[e])


def _receive(stage, entries, held: dict) -> None:
    """The stepped weights of the copies this rank keeps, into their own tensors; their step's
    gradient sums start again."""
    domain, residency = stage.domain, stage.residency
    me = domain.local_rank
    with on_stream(serving_stream(stage.config.serve_on_arrival, stage.device)):
        for home in sorted({h for h, _, j in entries.tolist() if j == me}):
            experts = [e for h, e, j in entries.tolist() if h == home and j == me]
            places = [w for e in experts for w in held[(home, e)].params]
            got = domain.transport.recv(home, REFRESH_TAG,
                                        functools.partial(messages.message_buffers, device=places[0].device,
                                                          given=places))
            for place, tensor in zip(places, got):
                if tensor is not place:
                    place.copy_(tensor)
            for e in experts:
                residency.held[(home, e)] = HeldCopy(held[(home, e)].params)
