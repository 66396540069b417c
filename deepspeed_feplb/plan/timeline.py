"""The time model of one domain's micro-batch, shared by the planner and the simulator.

Per micro-batch and rank of a domain (all times µs). A piece of ``n`` rows costs
``max(piece_floor_us, piece_us + ceil(n / tile_rows) * tile_rows * row_us)`` forward and backward
together:
``forward_share`` of it in the forward, the rest in the backward (GEMMs alone: a third, one GEMM
against the input- and the weight-gradient GEMM; a running layer measures its own share). The
forward and the backward are two timelines, as the runtime orders them; each ends in an all-to-all
that waits for every rank, so the stage's time is the slowest rank's forward plus the slowest
rank's backward (`makespan_us`).

Forward, from the stage's start:

* a rank first computes its own rows: every local expert's rows that stay home; its dynamic
  experts (its D hottest, and any it moves rows of) only once the plan is there, ``plan_us`` after
  the stage began (the static experts compute meanwhile);
* a home's moves to one helper (``n`` rows each) travel as one message, as the runtime sends them:
  one copy over the home's outgoing and the helper's incoming copy-engine link (each link carries
  one copy at a time; messages by home, then helper), of the weights of every expert the helper
  holds no copy of yet (``weight_copy_us`` each) plus the rows (``n * row_copy_us``). No copy
  starts before the plan (the runtime sends between two static experts once it is in hand); with
  ``sends_after_static`` (a grouped static call on CPU ranks, which leaves no point to send from)
  not before its home computed its static experts;
* a helper computes a home's chunks once it has finished its own rows and their whole message has
  arrived, homes in ascending order (the runtime's blocking receives), in `serve_parts` parts
  (``time_model.serve_parts``: up to ``serve_parts`` of at least ``serve_part_rows`` rows; each
  part after the first adds one piece's ``piece_us``); each part's outputs go home as soon as it
  is computed (its rows' ``row_copy_us``), one part at a time, so only the last part's copy
  follows the helper's compute.

Backward, from the backward stage's start (`phase2.DynamicExperts`, then the static experts, then
`phase2.Phase2Anchor`):

* a home sends each helper its chunks' output-gradients at once (one message, ``n *
  row_copy_us``, one copy at a time per link) and computes its own rows' backward, the dynamic
  experts' and the static ones';
* a helper computes a home's chunks' backward once its own rows' backward is done and their
  gradients arrived, homes in ascending order, in the forward's parts; each part's input-gradients
  (its rows' ``row_copy_us``) go home as soon as it is computed, the last part with the
  weight-gradients of the copies it does not keep for later micro-batches of the step
  (``grad_copy_us`` each), one message at a time on the helper's outgoing link; the home
  finishes when they are back. At the step's last micro-batch a kept copy that a chunk uses
  returns the step's accumulated gradients with that chunk's results (``grads_back``), and every
  other kept copy sends them home at the backward's start, after the helper's output-gradients
  (``flush``), so none waits for the end of the backward.

Every message (a chunk there, its outputs back, output-gradients there, gradients back) also
arrives ``message_us`` after its copy ends: the transport's fixed latency per message, which does
not occupy the link (the transport's figure, `Transport.message_us`, docs/GPU.md; 0 in the named
profiles).

The makespan is what the planner minimises and what the simulator reports as ``expert_time_us``.
`TimeModel` (`time_model`) holds the constants; the evaluation is compiled with the planning pass
(`passes.finish_us`, loaded on first use); `rank_finish_us` calls it from Python.
"""
from __future__ import annotations

import numpy as np

from deepspeed_feplb.plan.hottest import dynamic_candidates
from deepspeed_feplb.plan.time_model import FWD_BWD_GEMMS, MODEL_DTYPE, TimeModel

__all__ = ["FWD_BWD_GEMMS", "MODEL_DTYPE", "TimeModel", "makespan_us", "rank_finish_us"]

def rank_finish_us(counts: np.ndarray, moves: np.ndarray, model: TimeModel, fresh: np.ndarray | None = None,
                   grads_back: np.ndarray | None = None, flush: np.ndarray | None = None,
                   dynamic_experts: int = 0) -> np.ndarray:
    """Each rank's forward and backward finish time under ``model`` (`passes.finish_us`, see the
    module docstring).
    counts int64 [G, E]; moves int64 [M, 4]; fresh / grads_back bool [M] (default: every move
    copies weights and returns gradients, i.e. no residency); flush int64 [F, 2] or None;
    ``dynamic_experts``: D, each rank's D hottest experts wait for the plan (as do those with
    moves, whatever D). Returns float64 [2, G] µs: forward from the stage's start, backward from the
    backward stage's start."""
    counts = np.ascontiguousarray(counts, dtype=np.int64)
    moves = np.ascontiguousarray(np.asarray(moves, dtype=np.int64).reshape(-1, 4))
    M = moves.shape[0]
    fresh = np.ones(M, np.bool_) if fresh is None else np.ascontiguousarray(fresh, dtype=np.bool_)
    grads_back = fresh.copy() if grads_back is None else np.ascontiguousarray(grads_back, dtype=np.bool_)
    flush = (np.zeros((0, 2), np.int64) if flush is None
             else np.ascontiguousarray(np.asarray(flush, np.int64).reshape(-1, 2)))
    from deepspeed_feplb.plan.passes import dynamic_mask, finish_us
    return finish_us(counts, moves, fresh, grads_back, flush, model.record,
                     dynamic_mask(counts, dynamic_candidates(counts, dynamic_experts)))


def makespan_us(finish: np.ndarray) -> float:
    """The stage's time (µs) of `rank_finish_us`'s ``[2, G]``: the slowest rank's forward plus the
    slowest rank's backward."""
    return float(finish[0].max() + finish[1].max())
