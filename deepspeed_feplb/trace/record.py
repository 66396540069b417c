"""Record a routing trace (:mod:`.format`) from a real run (``feplb.stats.record_trace``).

Every FEPLB MoE layer calls :meth:`TraceRecorder.record` once per training forward with its
router's choices. The recorder counts this rank's routes per global expert (int64 ``[E]``),
gathers the vectors of the layer's EP group with one ``all_gather`` (so every rank of the group
takes part in the same collectives, in the same order as the forward itself) and keeps them as
``[src_ranks, experts]`` for that layer call. Layers are numbered in the order they are first
called; a layer's n-th recorded call is step n. Only the EP group that holds global rank 0
gathers; rank 0 writes ``counts`` int64 ``[micro_batches, layers, src_ranks, experts]`` (steps that every
layer completed) with :func:`deepspeed_feplb.trace.format.save_trace`, at :meth:`flush`, at
`deepspeed_feplb.shutdown` (through :func:`flush_all`) and at interpreter exit.

What the runtime did is recorded too (`trace.format`: ``plan_moves``, ``stage_us``): each call
also gathers, over the same group, what the layer's expert stage did in the previous micro-batch
(`ExpertStage.recorded`: its domain's plan, and on each rank the stage's forward and backward time
(CUDA events on a GPU), when its plan was in hand, the costs its planner priced and the CPU time
the rank used), whose backward has run by then; the last micro-batch's stays unmeasured.

Eval-mode forwards are not recorded (they are not training micro-batches); a forward recomputed
by activation checkpointing would be recorded twice.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from deepspeed_feplb.collectives import gather_small
from deepspeed_feplb.trace.format import Trace, save_trace

__all__ = ["TraceRecorder", "get_recorder", "flush_all"]

_RECORDERS: dict[str, "TraceRecorder"] = {}
_LOCK = threading.Lock()


class TraceRecorder:
    """Collects one process's share of a routing trace; one per output path (:func:`get_recorder`).

    path:    where rank 0 writes the ``.npz``.
    source:  free text stored in the trace's ``source`` key.
    """

    def __init__(self, path: str | os.PathLike, source: str = ""):
        self.path = os.fspath(path)
        self.source = source
        self.layers: dict[int, int] = {}  # id(layer) -> layer number (first-call order)
        self.calls: list[list[np.ndarray]] = []  # per layer: [src_ranks, experts] per step
        self.stages: list[list[list]] = []  # per layer and step: every EP rank's `ExpertStage.last` (or None)
        self.meta: dict = {}
        self.active: Optional[bool] = None  # this rank's EP group holds global rank 0
        self.writer = False

    def record(self, layer, expert_ids: torch.Tensor) -> None:
        """Count one forward's routes of ``layer`` (a `FEPLBMOELayer`).

        expert_ids: ``[k, S]`` global expert of each route, -1 (or out of range) for a route not
        taken. A collective over ``layer.ep_group`` when the EP size is above 1.
        """
        if not layer.training:
            return
        group = layer.ep_group if layer.ep_size > 1 else None
        if self.active is None:
            self._setup(group)
        if not self.active:
            return
        stage = getattr(layer, "stage", None)
        # the previous micro-batch's stage record, whose backward has run (every rank calls this alike)
        previous = stage.recorded() if stage is not None else None
        everyone = gather_small(previous, group=group, device=expert_ids.device) if group is not None else [previous]
        num_experts = layer.ep_size * layer.num_local_experts
        flat = expert_ids.reshape(-1).long()
        flat = flat[(flat >= 0) & (flat < num_experts)]
        mine = torch.bincount(flat, minlength=num_experts).to(torch.int64)  # on the routes' device: NCCL's
        if group is not None:
            parts = [torch.empty_like(mine) for _ in range(layer.ep_size)]
            dist.all_gather(parts, mine, group=group)
            counts = torch.stack(parts).cpu()
        else:
            counts = mine[None].cpu()
        if not self.writer:
            return
        key = id(layer)
        number = self.layers.get(key)
        if number is None:
            number = self.layers[key] = len(self.layers)
            self.calls.append([])
            self.stages.append([])
            if not self.meta:
                self.meta = {"top_k": int(expert_ids.shape[0]), **_shapes(layer)}
        if self.stages[number] and any(r is not None for r in everyone):
            self.stages[number][-1] = everyone
        self.calls[number].append(counts.numpy())
        self.stages[number].append([None] * len(everyone))

    def _setup(self, group) -> None:
        if not dist.is_available() or not dist.is_initialized():
            self.active = self.writer = True
            return
        members = dist.get_process_group_ranks(group) if group is not None else [dist.get_rank()]
        self.active = 0 in members
        self.writer = dist.get_rank() == 0

    def trace(self) -> Optional[Trace]:
        """What was recorded so far (steps every layer completed), or None before any call."""
        if not self.calls:
            return None
        steps = min(len(c) for c in self.calls)
        counts = np.zeros((steps, len(self.calls)) + self.calls[0][0].shape, dtype=np.int64)
        for number, calls in enumerate(self.calls):
            if steps:
                counts[:, number] = np.stack(calls[:steps])
        source = self.source or f"deepspeed_feplb record_trace of {os.path.basename(sys.argv[0]) or 'python'}"
        return Trace(counts, source=source, **self.meta, **self._runtime(steps, *counts.shape[2:]))

    def _runtime(self, steps: int, ranks: int, experts: int) -> dict:
        """``plan_moves`` and ``stage_us`` (`trace.format`) of the steps kept, or nothing when no
        stage recorded anything (FEPLB off)."""
        stage_us = np.full((steps, len(self.stages), ranks, 8), np.nan)
        moves = set()  # every rank of a domain holds its domain's plan: one copy of each move
        for layer, per_step in enumerate(self.stages):
            for step, everyone in enumerate(per_step[:steps]):
                for rank, last in enumerate(everyone):
                    if last is not None:
                        stage_us[step, layer, rank] = (last["forward_us"], last["backward_us"], last["plan_us"],
                                                       *last["fit_us"], last["cpu_us"], last["message_us"],
                                                       last["forward_share"])
                        moves |= {(step, layer, home * (experts // ranks) + e, home, helper, n, fresh)
                                  for home, e, helper, n, fresh in last["moves"].tolist()}
        if np.isnan(stage_us).all():
            return {}
        return {"plan_moves": np.array(sorted(moves), np.int64).reshape(-1, 7), "stage_us": stage_us}

    def flush(self) -> Optional[str]:
        """Write the trace (rank 0 only; atomically: a temporary file, then a rename). Returns the
        path written, or None."""
        trace = self.trace() if self.writer else None
        if trace is None:
            return None
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        tmp = f"{self.path}.tmp-{os.getpid()}"
        save_trace(tmp, trace)
        os.replace(tmp, self.path)
        return self.path


def _shapes(layer) -> dict:
    """``hidden`` and ``ffn_hidden`` of an expert, if its first weight is a 2-D [ffn, hidden]."""
    try:
        weight = next(p for p in layer.experts.deepspeed_experts[0].parameters() if p.dim() == 2)
        return {"hidden": int(weight.shape[1]), "ffn_hidden": int(weight.shape[0])}
    except (StopIteration, AttributeError, IndexError):
        return {}


def get_recorder(path: Optional[str], source: str = "") -> Optional[TraceRecorder]:
    """The process's recorder for ``path`` (shared by all layers), or None when ``path`` is None."""
    if not path:
        return None
    key = os.path.abspath(os.fspath(path))
    with _LOCK:
        recorder = _RECORDERS.get(key)
        if recorder is None:
            recorder = _RECORDERS[key] = TraceRecorder(path, source)
        return recorder


def flush_all() -> list[str]:
    """Write every recorder's trace (rank 0); returns the paths written."""
    with _LOCK:
        recorders = list(_RECORDERS.values())
    return [p for p in (r.flush() for r in recorders) if p]


atexit.register(flush_all)
