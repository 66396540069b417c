"""One MoE layer's weight residency on one rank (``feplb.weight_residency``), for phase 2.

Every rank of the domain keeps the same `plan.residency.ResidencyTable` (derived from the plans,
which every rank reads); on top of it this rank keeps

* as a helper, the expert copies it holds (`HeldCopy`: the weights, received once, and the
  weight-gradient accumulated over the step's micro-batches, returned home at the step's end);
* as a home, the stamp of each expert's parameters when a helper received them (their
  `weight_watch.write_marks` and the layer's count of declared changes): if it changed since (an
  in-place write, ``load_state_dict``, a replaced ``p.data``, or `weights_changed`), the next chunk
  carries the weights again, so a helper never computes with a stale copy. No weight is read for
  it. A forward without gradients (an evaluation, which may run on other weights swapped in
  through ``p.data`` and out again) neither uses nor changes a kept copy.

The step ends in the forward of the step's last micro-batch (the gradient-accumulation
boundary): the table is cleared there and the copies of the step travel with that micro-batch's
`Phase2MicroBatch`, whose backward returns their gradients. With ``keep_copies_across_steps``
the copies that micro-batch used are parked (`park`); right after the optimizer step the engine's
hook holds them again with the stepped weights (`migrate.refresh`), and a parked copy no refresh
took is forgotten at the layer's next micro-batch (`unpark`). So no copy outlives the optimizer
step that follows with its old weights, even if that micro-batch never runs a backward.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from deepspeed_feplb.plan.residency import KeptBytes, ResidencyTable
from deepspeed_feplb.weight_watch import write_marks

__all__ = ["HeldCopy", "LayerResidency", "copy_bytes"]


def copy_bytes(params) -> int:
    """What a kept copy of an expert with these parameters holds: its weights and the fp32
    weight-gradient it accumulates (`HeldCopy`)."""
    return sum(p.numel() * (p.element_size() + 4) for p in params)


@dataclass
class HeldCopy:
    """A helper's copy of one home expert: ``params`` as received; ``grads`` the sum of the weight-
    gradients of every chunk it computed this step (None until the first backward), kept in fp32
    for 16-bit parameters so that a step's sum is rounded once, not per micro-batch."""
    params: list[torch.Tensor]
    grads: Optional[list[torch.Tensor]] = None

    def accumulate(self, grads: list[torch.Tensor]) -> None:
        if self.grads is None:
            self.grads = [g.to(torch.float32) if g.element_size() < 4 else g.clone() for g in grads]
        else:
            for acc, g in zip(self.grads, grads):
                acc.add_(g)

    def gradients(self) -> list[torch.Tensor]:
        """The accumulated weight-gradients in the parameters' dtype (zeros if no backward used the copy)."""
        if self.grads is None:
            return [torch.zeros_like(p) for p in self.params]
        return [g.to(p.dtype) for g, p in zip(self.grads, self.params)]


@dataclass
class LayerResidency:
    """This rank's residency state of one MoE layer in a domain of G ranks with E local experts.

    table:   the domain's kept copies (`ResidencyTable`, the same on every rank);
    held:    {(home, local_expert): HeldCopy} this rank holds as a helper;
    sent:    {(local_expert, helper): stamp} of this rank's experts that helpers hold (`stamp`);
    pending: whether some kept copy may hold gradients (every rank of the domain knows it: it
             is set by the plans of micro-batches with gradients), so the step may end only in a
             backward that sends them home.
    """
    table: ResidencyTable
    held: dict = field(default_factory=dict)
    sent: dict = field(default_factory=dict)
    pending: bool = False  # a micro-batch with gradients used kept copies since the step began (domain-wide)
    declared: int = 0  # `weight_watch.weights_changed` calls so far: each makes every kept copy stale
    carries_over: bool = False  # ``keep_copies_across_steps``: the step's last copies are parked for a refresh
    # (entries int64 [K, 3] = (home, local_expert, helper), {(home, local_expert): HeldCopy} this rank holds)
    parked: Optional[tuple] = None
    refreshed: int = 0  # copies held again after optimizer steps (`migrate.refresh`), this layer's, domain-wide

    def stamp(self, params: list[torch.Tensor]) -> tuple:
        """What a helper's copy of an expert with ``params`` was made from (host only)."""
        return self.declared, write_marks(params)

    @classmethod
    def create(cls, G: int, E: int, config, kept_bytes: Optional[KeptBytes] = None,
               copy_bytes: int = 0) -> "LayerResidency":
        """``kept_bytes``: the domain's byte budget over its layers, each copy of this layer counting
        ``copy_bytes`` (its weights and fp32 weight-gradient: `copy_bytes`)."""
        keep = config.max_resident_experts if config.weight_residency == "step" else 0
        return cls(ResidencyTable(G, E, keep, kept_bytes, copy_bytes),
                   carries_over=bool(keep) and config.keep_copies_across_steps)

    def end_step(self) -> tuple[np.ndarray, dict]:
        """The step ends: returns (entries int64 [K, 3] = (home, local_expert, helper) of the kept
        copies, {(home, local_expert): HeldCopy} of those this rank holds) and forgets them all."""
        entries = self.table.flush()
        held, self.held, self.sent, self.pending = self.held, {}, {}, False
        return entries, held

    def park(self, entries: np.ndarray, held: dict) -> None:
        """The step's last micro-batch used the copies ``entries`` int64 [K, 3] (this rank holds
        ``held`` of them): kept for a refresh after the optimizer step (`migrate.refresh`)."""
        self.parked = (np.asarray(entries, np.int64).reshape(-1, 3), dict(held))

    def unpark(self) -> None:
        """A micro-batch begins and no refresh took the parked copies (no engine, or a forward before
        the step): they are forgotten, as without ``keep_copies_across_steps``."""
        self.parked = None
