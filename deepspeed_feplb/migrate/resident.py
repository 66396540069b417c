"""One MoE layer's weight residency on one rank (``feplb.weight_residency``), for phase 2.

Every rank of the domain keeps the same `plan.residency.ResidencyTable` (derived from the plans,
which every rank reads); on top of it this rank keeps

* as a helper, the expert copies it holds (`HeldCopy`: the weights, received once, and the
  weight-gradient accumulated over the step's micro-batches, returned home at the step's end);
* as a home, the *fingerprint* of each expert's parameters when a helper received them: if the
  parameters changed since (in place, through ``.data``, by ``load_state_dict``, or replaced), the
  next chunk carries the weights again, so a helper never computes with a stale copy, whatever
  changed them.

The step ends in the forward of the step's last micro-batch (the gradient-accumulation
boundary): the table is cleared there and the copies of the step travel with that micro-batch's
`Phase2MicroBatch`, whose backward returns their gradients. So no copy outlives the optimizer step that
follows, even if that micro-batch never runs a backward.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional

import numpy as np
import torch

from deepspeed_feplb.plan.residency import KeptBytes, ResidencyTable

__all__ = ["Fingerprints", "HeldCopy", "LayerResidency", "copy_bytes", "fingerprint", "fingerprints"]


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


def fingerprint(params: list[torch.Tensor]) -> torch.Tensor:
    """What identifies the content of an expert's parameters: int64 ``[3 * len(params)]``, per
    parameter the sum of its elements' bit patterns and that sum weighted by row index and by
    column index (rows: the first dimension; columns: the rest, flattened).

    The in-place version counter would be free, but a write through ``p.data`` does not advance it
    (``.data`` has a counter of its own), so the content is read: two reductions over the weights,
    on their device, and no copy. Any change of values alters the plain sum unless changes cancel
    exactly in integer arithmetic; moving values between rows or columns alters a weighted sum."""
    return fingerprints([params])[0] if params else torch.zeros(0, dtype=torch.int64)


def fingerprints(experts: list[list[torch.Tensor]]) -> torch.Tensor:
    """`fingerprint` of several experts of one shape (``experts[i]``: expert i's parameters) in one
    pass: int64 ``[len(experts), 3 * parameters]``, equal to stacking each expert's `fingerprint`.

    Per parameter two reductions (its row sums and its column sums), then for all of them at once
    one product with a constant weight matrix and one sum: ``2 * D * n + 4`` operations for D
    experts of n parameters (launches, on a GPU), where one fingerprint at a time took ``9 * D * n``.
    Integer sums wrap alike in any order, so the values are those of the formula, whatever the
    grouping."""
    shapes = [p.shape for p in experts[0]]
    if any([p.shape for p in params] != shapes for params in experts[1:]):
        raise ValueError("fingerprints: the experts' parameters differ in shape; fingerprint them one by one")
    sums = []
    for params in experts:
        for p in params:
            bits = p.detach().reshape(p.shape[0] if p.dim() else 1, -1).view(_INT_OF_SIZE[p.element_size()])
            sums += [bits.sum(dim=1, dtype=torch.int64), bits.sum(dim=0, dtype=torch.int64)]  # [R], [C]
    grid = tuple((len(rows), len(cols)) for rows, cols in zip(sums[0:2 * len(shapes):2], sums[1:2 * len(shapes):2]))
    joined = torch.cat(sums).view(len(experts), -1)  # [D, sum over parameters of R + C]
    return (joined[:, None, :] * _fingerprint_weights(grid, joined.device)).sum(dim=-1)  # [D, 3n]


@lru_cache(maxsize=64)
def _fingerprint_weights(shapes: tuple, device: torch.device) -> torch.Tensor:
    """int64 ``[3n, sum of R + C]`` for parameters of ``shapes`` ((rows R, columns C) each): for
    parameter j, row 3j sums its row sums, row 3j + 1 weights them by 1..R, row 3j + 2 weights its
    column sums by 1..C."""
    total = sum(r + c for r, c in shapes)
    weights = np.zeros((3 * len(shapes), total), dtype=np.int64)
    at = 0
    for j, (rows, cols) in enumerate(shapes):
        weights[3 * j, at:at + rows] = 1
        weights[3 * j + 1, at:at + rows] = np.arange(1, rows + 1)
        weights[3 * j + 2, at + rows:at + rows + cols] = np.arange(1, cols + 1)
        at += rows + cols
    return torch.from_numpy(weights).to(device)


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Fingerprints:
    """The `fingerprint` of each of a rank's dynamic experts for one micro-batch, read on the host
    once the plan says which chunks go to helpers that keep copies.

    On CUDA they are taken when the stage begins, before the static experts are queued, and copied
    to pinned host memory behind an event: reading them when the plan arrives (which may be between
    two static experts' launches) waits for that copy alone, where a ``.tolist()`` of device values
    would wait for every static expert launched so far and leave the device idle while the host
    launches the rest. Elsewhere (host tensors: no wait to avoid) they are computed when read,
    only for the experts asked for. params: per dynamic expert, its parameters.
    """

    def __init__(self, params: list[list[torch.Tensor]]):
        self._params = params
        self._event = None
        if params and params[0] and params[0][0].is_cuda:
            prints = fingerprints(params)  # [D, 3 * parameters]
            self._host = torch.empty(prints.shape, dtype=prints.dtype, pin_memory=True)
            self._host.copy_(prints, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(params[0][0].device))  # the stream the copy is on

    def of(self, experts: list[int]) -> dict[int, tuple]:
        """``{i: fingerprint of dynamic expert i as a tuple}`` for ``experts`` (indices into ``params``)."""
        if not experts:
            return {}
        if self._event is not None:
            self._event.synchronize()
            rows = self._host.tolist()
            return {i: tuple(rows[i]) for i in experts}
        rows = fingerprints([self._params[i] for i in experts]).tolist()  # one read for all of them
        return {i: tuple(row) for i, row in zip(experts, rows)}


@dataclass
class LayerResidency:
    """This rank's residency state of one MoE layer in a domain of G ranks with E local experts.

    table:   the domain's kept copies (`ResidencyTable`, the same on every rank);
    held:    {(home, local_expert): HeldCopy} this rank holds as a helper;
    sent:    {(local_expert, helper): fingerprint as a tuple} of this rank's experts that helpers hold;
    pending: whether some kept copy may hold gradients (every rank of the domain knows it: it
             is set by the plans of micro-batches with gradients), so the step may end only in a
             backward that sends them home.
    """
    table: ResidencyTable
    held: dict = field(default_factory=dict)
    sent: dict = field(default_factory=dict)
    pending: bool = False  # a micro-batch with gradients used kept copies since the step began (domain-wide)

    @classmethod
    def create(cls, G: int, E: int, config, kept_bytes: Optional[KeptBytes] = None,
               copy_bytes: int = 0) -> "LayerResidency":
        """``kept_bytes``: the domain's byte budget over its layers, each copy of this layer counting
        ``copy_bytes`` (its weights and fp32 weight-gradient: `copy_bytes`)."""
        keep = config.max_resident_experts if config.weight_residency == "step" else 0
        return cls(ResidencyTable(G, E, keep, kept_bytes, copy_bytes))

    def end_step(self) -> tuple[np.ndarray, dict]:
        """The step ends: returns (entries int64 [K, 3] = (home, local_expert, helper) of the kept
        copies, {(home, local_expert): HeldCopy} of those this rank holds) and forgets them all."""
        entries = self.table.flush()
        held, self.held, self.sent, self.pending = self.held, {}, {}, False
        return entries, held
