"""Replica slots at runtime (``feplb.placement.redundant_experts_per_rank``): copies of hot experts on
other nodes, chosen at placement decisions (`plan.replicas.choose`), each micro-batch's rows split
between an expert's holders (`plan.replicas.split`).

A replica holds the expert's weights only. It is neither a parameter of the model nor of the
optimizer, so ZeRO partitions, optimizer state, state dicts and checkpoints never see it:

* **Weights** come from the expert's home (its primary slot) at the first forward after each
  optimizer step, and after anything that may have changed them (a decision, a checkpoint load,
  a `canonical_experts` block): `ReplicaSlots.refresh`, point to point over the EP group.
* **Gradients**: the layer computes a replica slot like any local expert, on parameters that are
  aliases of the replica's weights (`deepspeed_moe.ExpertGradOrder`). Its backward hands the
  replicas' gradients to `ReplicaSlots.backward`, which sums them over the step's micro-batches
  and, in the backward of the step's last micro-batch, sends each sum to the expert's home, where
  it joins the expert's own gradient before DeepSpeed reduces it (ZeRO 0/1/2 alike: to DeepSpeed
  it is part of that micro-batch's gradient). Training equals DeepSpeed's MoE.

Every rank of the EP group runs `refresh` and `backward` alike (both are collective), from the
same replica table (`ExpertPlacement.replica_at`).
"""
from __future__ import annotations

import warnings
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist


class ReplicaSlots:
    """This rank's ``S`` replica slots of one MoE layer.

    Args:
        placement: the layer's `integration.placement.ExpertPlacement` (its tables say which
            expert each slot holds and where each expert's home is).
        template: one expert's parameters (shapes, dtypes, device of the copies).
        slots: S, replica slots per rank.
    """

    def __init__(self, placement, template: list[torch.Tensor], slots: int):
        self.placement = placement
        self.weights = [[torch.zeros_like(p, memory_format=torch.contiguous_format).detach() for p in template]
                        for _ in range(slots)]  # [S][n]: what each slot computes with
        self._sums: list[Optional[list[torch.Tensor]]] = [None] * slots  # the step's gradients so far, per slot
        self._experts = [-1] * slots  # the expert each of this rank's slots held at the last refresh
        self.stale = True  # the weights may differ from their experts' (set by the placement, cleared by refresh)
        self.refreshes = 0  # times the weights were sent
        self.grad_sends = 0  # replica gradients sent home

    @property
    def me(self) -> int:
        group = self.placement.ep_group
        return dist.get_rank(group) if group is not None else 0

    def _peer(self, rank: int) -> int:
        return dist.get_global_rank(self.placement.ep_group, int(rank))

    def _held(self) -> list[tuple[int, int, int]]:
        """(rank, slot, expert) of every held replica slot of the EP group, in rank then slot order."""
        at = self.placement.replica_at
        return [(int(q), int(j), int(at[q, j])) for q, j in zip(*np.nonzero(at >= 0))]

    def refresh(self, expert_params: list[list[torch.Tensor]]) -> None:
        """Collective over the EP group: every held replica slot receives its expert's current
        weights from the expert's home (``expert_params``: this rank's primary experts' parameters,
        ``[E_local][n]``)."""
        me, ops = self.me, []
        with torch.no_grad():
            for q, j, e in self._held():
                home, local = self.placement.home_of(e)
                if home == me == q:
                    raise AssertionError(f"expert {e} has a replica on its own home rank {me}")
                if home == me:
                    ops += [dist.P2POp(dist.isend, p.detach().contiguous(), self._peer(q))
                            for p in expert_params[local]]
                elif q == me:
                    ops += [dist.P2POp(dist.irecv, w, self._peer(home)) for w in self.weights[j]]
            if ops:
                for request in dist.batch_isend_irecv(ops):
                    request.wait()
        # a slot that now holds another expert starts its sum afresh; one that holds the same (a
        # refresh in the middle of a step, after a `canonical_experts` block) keeps it
        now = self.placement.replica_at[me].tolist()
        self._sums = [s if e == before else None for s, e, before in zip(self._sums, now, self._experts)]
        self._experts = now
        self.stale = False
        self.refreshes += 1

    def backward(self, primary_grads: list[list[torch.Tensor]], replica_grads: list[list[torch.Tensor]],
                 step_ends: bool) -> list[list[torch.Tensor]]:
        """One micro-batch's backward: add the replica slots' weight-gradients ``replica_grads``
        (``[S][n]``) to the step's sums; when the step ends, send each sum to its expert's home
        (collective over the EP group) and return ``primary_grads`` (``[E_local][n]``) with the
        sums of this rank's experts' replicas added (in holder-rank order), else unchanged."""
        me = self.me
        held = self._held()
        for q, j, _ in held:
            if q == me:
                grads = replica_grads[j]
                # in fp32, so that a step's sum is rounded once (as DeepSpeed accumulates a bf16
                # model's gradients), and sent so
                self._sums[j] = ([g.float() for g in grads] if self._sums[j] is None
                                 else [s.add_(g) for s, g in zip(self._sums[j], grads)])
        if not step_ends:
            return primary_grads
        ops, arriving = [], []
        for q, j, e in held:
            home, local = self.placement.home_of(e)
            if q == me:
                ops += [dist.P2POp(dist.isend, s.contiguous(), self._peer(home)) for s in self._sums[j]]
                self.grad_sends += 1
            elif home == me:
                buffers = [torch.empty_like(g, dtype=torch.float32) for g in primary_grads[local]]
                ops += [dist.P2POp(dist.irecv, b, self._peer(q)) for b in buffers]
                arriving.append((local, buffers))
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        out = [list(grads) for grads in primary_grads]
        for local, buffers in arriving:
            out[local] = [(g.float() + b).to(g.dtype) for g, b in zip(out[local], buffers)]
        self._sums = [None] * len(self.weights)
        return out

    def end_step(self) -> None:
        """At the optimizer step: a replica gradient sum still here did not reach its expert (the
        step's last micro-batch ran no backward through the layer, or ran one that did not end
        the step): it is dropped, with a warning, rather than added to the next step's."""
        lost = [j for j, sums in enumerate(self._sums) if sums is not None]
        if lost:
            warnings.warn(f"FEPLB: the gradients of replica slot(s) {lost} did not reach their experts before the "
                          "optimizer step (its last micro-batch ran no backward through this MoE layer); they are "
                          "dropped", RuntimeWarning, stacklevel=2)
            self._sums = [None] * len(self.weights)
