"""The FEPLB planner: one NVLink domain's per-expert row counts -> a plan of Copy-Engine moves.

A pure, deterministic function (numpy, with the planning pass compiled by numba; no torch, no
I/O). The runtime layer, the domain's scheduler process, the in-process fallback and the
simulator all call :func:`plan_domain`, so every rank of a domain that reads the same counts gets
the same plan.

Problem (docs/ARCHITECTURE.md, "Metrics"). A domain (a "node" in the simulator) has ``G`` ranks;
rank ``r`` received ``counts[r, e]`` rows (token-expert
pairs) for its local expert ``e``. Each rank may offload its ``D`` hottest local experts, and more
of its next hottest while the rows outside them exceed the domain's mean ("dynamic candidates",
:func:`dynamic_candidates`); the rows of an offloaded expert may be
split between its home and up to ``max_helpers`` helper ranks of the same domain, which receive
one copy of the expert's weights each. Goal: minimise the largest per-rank row count. No plan
can beat the lower bound ``max(ceil(domain mean), max_r(static_r))`` where ``static_r`` is what
rank ``r`` holds outside its dynamic experts (:func:`lower_bound`): the domain's mean, unless a
rank chooses its dynamic experts without knowing it.

Algorithm (the passes in `passes`, compiled by numba): water-filling toward a level ``W`` that
starts at the lower bound. Ranks above ``W`` ("donors", largest excess first) push chunks of
their hottest candidates to ranks below it ("receivers"), best fit first, so that few chunks
(and weight copies) are made; chunks are multiples of ``chunk_align`` rows, a donor keeping its
remainder. Where the helper or copy limits leave a donor above ``W``, receivers make room by
chaining their own dynamic experts on, and ``W`` is raised by bisection until every donor fits
(to within ``chunk_align - 1`` rows, the slack a plan's maximum carries anyway; exactly with chunks
of one row). A second pass fills receivers only up to the level itself where they have a whole
chunk of room below it (donors then spread over more receivers, in more chunks).
Token plans are then judged by the time model (`plan_timed`): the fastest is the plan.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from deepspeed_feplb.plan.hottest import NONE, chosen_rows, dynamic_candidates
from deepspeed_feplb.plan.time_model import MODEL_DTYPE, TimeModel

__all__ = ["PlanConstraints", "Plan", "dynamic_candidates", "lower_bound", "plan_domain", "empty_plan", "no_residents",
           "balancing_may_pay", "rows_bound", "chunk_align_rows", "serves_on_arrival", "GPU_TILE_ROWS",
           "HOST_CHUNK_ROWS"]

# The row tile of a grouped expert GEMM on a GPU: Hopper's CUTLASS grouped GEMM behind
# torch._grouped_mm tiles a large problem's rows by 128 (64 for small ones). A chunk of whole tiles
# adds no padded rows on its helper and leaves its home's remainder padded as the whole expert was.
GPU_TILE_ROWS = 128
# Chunks on host memory (no row tile to fill) and under a row bound, whose slack is one chunk.
HOST_CHUNK_ROWS = 8


def chunk_align_rows(setting, on_gpu: bool, max_rows_over_mean: Optional[float] = None) -> int:
    """``feplb.chunk_align_tokens`` as rows: an int as is; "auto" `GPU_TILE_ROWS` where the experts
    compute on a GPU, `HOST_CHUNK_ROWS` on host memory or with ``max_rows_over_mean`` set (a plan may
    leave a rank up to one chunk less a row over that bound)."""
    if setting != "auto":
        return int(setting)
    return GPU_TILE_ROWS if on_gpu and not max_rows_over_mean else HOST_CHUNK_ROWS


def serves_on_arrival(setting, on_gpu: bool) -> bool:
    """``feplb.serve_on_arrival`` resolved: a bool as is; "auto" where the experts compute on a GPU."""
    return on_gpu if setting == "auto" else bool(setting)


@dataclass(frozen=True)
class PlanConstraints:
    """Limits every plan obeys, and the time model that judges plans.

    dynamic_experts:  D: each rank may offload its D hottest experts (and more, hottest first, while
                      the rows outside them exceed its domain's mean: `hottest.dynamic_candidates`).
    max_helpers:      at most this many helper ranks per offloaded expert.
    chunk_align:      every moved chunk is a multiple of this many rows, except a chunk that
                      ends the expert's rows (one that leaves the home with none of its rows).
    ce_budget_bytes:  hard cap on the weight bytes one rank may send, and one rank may receive,
                      per micro-batch (a chunk to a helper that already holds the expert's weights
                      costs none); inf: no cap, the time model alone decides.
    expert_bytes:     bytes of one expert's weights (each helper of an expert receives one copy);
                      0 means weights are free and only ``max_helpers`` limits the copies.
    model:            the `timeline.TimeModel` the planner minimises the makespan under (None:
                      balance rows only, as many copies as the cap allows).
    keep_copies:      weight copies stay on their helpers until the optimizer step
                      (``feplb.weight_residency: "step"``), so a copy's gradients go home once
                      per step, not with this micro-batch.
    later_micro_batches:  with ``keep_copies``, the micro-batches of the optimizer step after this
                      one: a copy made now also serves them (the planner weighs what it saves there
                      against its cost now); 0: this micro-batch ends the step, so every move returns
                      weight-gradients (a kept copy the step's sum) and the kept copies that no move
                      uses send theirs home at the backward's start.
    max_rows_over_mean:  a bound on rows before time (``feplb.max_rows_over_mean``; 0: none):
                      plans balance rows down to ``row_cap`` (this ratio x ``mean_rows``), and
                      the time model picks the fastest plan only among those that keep every rank
                      within it (or, where the D dynamic experts cannot reach it, within what the
                      row plan reached).
    mean_rows:        rows per rank averaged over the whole EP group (all its domains), for
                      ``row_cap``; 0: the domain's own mean.
    """

    dynamic_experts: int
    max_helpers: int = 2
    chunk_align: int = 1
    ce_budget_bytes: float = math.inf
    expert_bytes: int = 0
    model: Optional[TimeModel] = None
    keep_copies: bool = False
    later_micro_batches: int = 0
    max_rows_over_mean: float = 0.0
    mean_rows: float = 0.0

    @classmethod
    def from_config(cls, config, expert_bytes: int, model: Optional[TimeModel] = None,
                    on_gpu: bool = False) -> "PlanConstraints":
        """The limits a ``"feplb"`` section (a `deepspeed_feplb.FEPLBConfig`) sets for experts of
        ``expert_bytes`` weight bytes on a GPU or not (``on_gpu``: `chunk_align_rows`), judged by
        ``model`` (measured on the previous micro-batch at runtime, modelled in the simulator);
        ``ce_budget: "auto"`` sets no cap."""
        budget = math.inf if config.ce_budget == "auto" else float(config.ce_budget)
        align = chunk_align_rows(config.chunk_align_tokens, on_gpu, config.max_rows_over_mean)
        return cls(dynamic_experts=config.dynamic_experts_per_rank, max_helpers=config.max_helpers_per_expert,
                   chunk_align=align, ce_budget_bytes=budget, expert_bytes=int(expert_bytes),
                   model=model if model is not None and model.finite else None,
                   keep_copies=config.weight_residency == "step",
                   max_rows_over_mean=config.max_rows_over_mean or 0.0)

    def row_cap(self, counts: np.ndarray) -> int:
        """The most rows a rank should compute (``max_rows_over_mean`` x the mean rows per rank,
        rounded down), 0 without a bound. counts int64 [G, E_local]: the domain, whose own mean
        serves when ``mean_rows`` is 0."""
        if not self.max_rows_over_mean:
            return 0
        mean = self.mean_rows if self.mean_rows > 0 else float(np.asarray(counts).sum()) / max(1, len(counts))
        return rows_bound(self.max_rows_over_mean, mean)

    def copies_per_rank(self) -> float:
        """How many expert-weight copies one rank may send (and receive) per micro-batch."""
        if self.expert_bytes <= 0 or math.isinf(self.ce_budget_bytes):
            return math.inf
        return max(0, math.floor(self.ce_budget_bytes / self.expert_bytes))

    def senders_only(self, G: int) -> bool:
        """Whether plans for a domain of ``G`` ranks only ever move rows from ranks above its mean
        to ranks at or below it, so that only the former need dynamic experts. A plan passes rows
        on through a rank below the mean (chaining its own dynamic experts on) only where the
        helper or copy limits bind, or where a row bound caps ranks below the domain's mean."""
        return self.max_helpers >= G - 1 and math.isinf(self.copies_per_rank()) and not self.max_rows_over_mean

    def chosen(self, counts: np.ndarray) -> np.ndarray:
        """The dynamic experts the ranks of a domain choose, each from its own counts and the
        domain's mean, as a rank does when it publishes (`hottest.dynamic_candidates`): counts int64
        [G, E_local] -> int64 [G, W] (`hottest.NONE` where a rank chooses fewer)."""
        counts = np.asarray(counts, dtype=np.int64)
        G = len(counts)
        if not G:
            return dynamic_candidates(counts, self.dynamic_experts)
        return dynamic_candidates(counts, self.dynamic_experts, float(counts.sum()) / G, self.senders_only(G))


@dataclass(frozen=True)
class Plan:
    """moves:     int64 [M, 4] = (home, local_expert, helper, rows), domain-local rank ids, rows > 0,
                 sorted by (home, local_expert); for one (home, local_expert) with n rows the home
                 computes the first n - sum(moved) rows (its home rows) and the moves take the
                 following rows in the order they appear here (one chunk each).
    rank_rows:   int64 [G]: rows each rank of the domain computes after the plan."""

    moves: np.ndarray
    rank_rows: np.ndarray


def empty_plan(counts: np.ndarray) -> Plan:
    """The plan that moves nothing. counts int64 [G, E_local]."""
    counts = np.asarray(counts, dtype=np.int64)
    return Plan(np.zeros((0, 4), dtype=np.int64), counts.sum(axis=1) if counts.ndim == 2 else np.zeros(0, np.int64))


def lower_bound(counts: np.ndarray, D: int) -> int:
    """counts int64 [G, E_local] -> lower bound on the largest per-rank load of any plan that
    moves rows of the dynamic experts the ranks choose with D (`hottest.dynamic_candidates`, given
    the domain's mean): max(ceil(mean), max_r static_r)."""
    counts = np.asarray(counts, dtype=np.int64)
    G = counts.shape[0]
    if G == 0:
        return 0
    loads = counts.sum(axis=1)
    cand = dynamic_candidates(counts, D, float(loads.sum()) / G)
    static = loads - chosen_rows(counts, cand).sum(axis=1)
    return int(max(-(-int(loads.sum()) // G), int(static.max())))


def balancing_may_pay(counts: np.ndarray, piece_us: float, row_us: float, message_us: float,
                      row_cap: int = 0) -> bool:
    """Whether balancing a domain's micro-batch could shorten it, or must bound its rows.

    counts:      int64 [G, E_local]: rows each rank of the domain computes per local expert.
    piece_us:    fixed cost of one expert piece, forward + backward (the domain's ranks are alike).
    row_us:      cost of one row, forward + backward.
    message_us:  the transport's one-way latency per message.
    row_cap:     `PlanConstraints.row_cap` (0: none): a rank above it is reason enough to plan.

    A rank's own time is ``piece_us * (experts with rows) + row_us * rows``. A chunk moved from the
    busiest rank to a helper comes back no sooner than the helper's own time plus one more piece
    and one message (the way there overlaps the helper's own rows at best), while the busiest rank
    saves only the chunk's rows; so when the busiest and the idlest rank differ by less than
    ``piece_us + message_us``, no move shortens the busiest rank: False. Also False for fewer than
    2 ranks or unknown costs (NaN: nothing timed yet)."""
    counts = np.asarray(counts, dtype=np.int64)
    if counts.shape[0] < 2:
        return False
    if row_cap > 0 and counts.sum(axis=1).max() > row_cap:
        return True
    if not (np.isfinite(piece_us) and np.isfinite(row_us) and np.isfinite(message_us)):
        return False
    own = piece_us * (counts > 0).sum(axis=1) + row_us * counts.sum(axis=1)
    return bool(own.max() - own.min() > piece_us + message_us)


def rows_bound(max_rows_over_mean: float, mean_rows: float) -> int:
    """The row cap: ``max_rows_over_mean`` x ``mean_rows`` rounded down (at most `_NO_CAP`, which no
    count reaches; at least 1, since 0 means none); 0 (none) when the ratio is 0 or None."""
    if not max_rows_over_mean:
        return 0
    return int(min(max(1, math.floor(max_rows_over_mean * mean_rows)), _NO_CAP))


def no_residents(G: int, E: int) -> np.ndarray:
    """The residency masks of a domain where no helper holds any weights: int64 [G, E, ceil(G / 64)]
    zeros (`residency.ResidencyTable.resident`)."""
    return np.zeros((G, E, (G + 63) // 64), np.int64)


def plan_domain(counts: np.ndarray, constraints: PlanConstraints, resident: Optional[np.ndarray] = None,
                dynamic: Optional[np.ndarray] = None) -> Plan:
    """Plan one NVLink domain.

    counts:       int64 [G, E_local]: rows (token-expert pairs) that each of the domain's G ranks
                  received for each of its local experts; negative counts raise ValueError.
    constraints:  :class:`PlanConstraints`.
    dynamic:      int64 [G, D']: the dynamic experts each rank chose and published (`hottest.NONE`
                  pads a shorter row), the only experts whose rows move; None: what the ranks
                  would choose, ``constraints.chosen(counts)`` (the simulator, which has no ranks).
    resident:     int64 [G, E_local, ceil(G / 64)] bit masks, or None (no weights held anywhere):
                  bit ``j % 64`` of word ``j // 64`` of ``resident[r, e]`` says helper j holds a copy
                  of rank r's expert e (kept from an earlier micro-batch of this step,
                  `residency.ResidencyTable`); chunks go to such helpers first and cost no copy.
    Returns a :class:`Plan`; moves touch only ``dynamic[home]``, never move
    more than an expert has, respect ``max_helpers``, ``chunk_align`` and the Copy-Engine cap,
    and are deterministic. Degenerate inputs (G <= 1, D == 0, all-zero counts) give no moves, and
    so does a domain whose largest load is within ``chunk_align - 1`` of the mean.
    Without a time model the largest per-rank load is the lower bound (or the row cap, where
    that is higher) plus at most
    ``chunk_align - 1`` whenever the helper and Copy-Engine limits allow it. With one
    (``constraints.model``), the row plans for the cap and for fewer copies per rank, and no
    moves at all, are judged by their makespan (`timeline`), and the fastest is returned; with
    ``constraints.max_rows_over_mean`` only those that keep within its row cap are candidates.

    Cost: one compiled call: the row sums, the published dynamic experts ordered by rows, one
    water-filling pass, and a bisection over chaining passes (to within a chunk's slack) only when
    the helper or Copy-Engine limits bind; with a time model, an evaluation per pass and further
    passes only while the copies cost more than they save. The first call in a process loads the compiled code from
    numba's cache (or compiles it once, a few seconds, into that cache).
    """
    counts = np.asarray(counts, dtype=np.int64)
    if counts.ndim != 2:
        raise ValueError(f"counts must be [G, E_local], got shape {counts.shape}")
    counts = np.ascontiguousarray(counts)
    G, E = counts.shape
    D = min(int(constraints.dynamic_experts), E)
    max_helpers = int(constraints.max_helpers)
    if G <= 1 or D <= 0 or max_helpers <= 0:
        if (counts < 0).any():
            raise ValueError("counts must be non-negative")
        return empty_plan(counts)  # without loading the compiled planner
    if dynamic is None:
        dynamic = constraints.chosen(counts)
    dynamic = np.ascontiguousarray(dynamic, dtype=np.int64)
    if dynamic.ndim != 2 or dynamic.shape[0] != G:
        raise ValueError(f"dynamic must be [G={G}, D], got shape {dynamic.shape}")
    copies = constraints.copies_per_rank()
    copies = G * dynamic.shape[1] * max_helpers if copies == math.inf else int(copies)
    resident = no_residents(G, E) if resident is None else np.ascontiguousarray(resident, dtype=np.int64)
    model = constraints.model.record if constraints.model is not None else _NO_MODEL
    out = _compiled_planner()(counts, dynamic, max_helpers, max(1, int(constraints.chunk_align)), copies, resident,
                              model, bool(constraints.keep_copies), max(0, int(constraints.later_micro_batches)),
                              constraints.row_cap(counts))
    if out.shape[0] < G:
        raise ValueError(f"counts must be non-negative and dynamic experts local ids below {E} (or {NONE}); got "
                         f"counts {counts.tolist()}, dynamic {dynamic.tolist()}")
    return Plan(out[G:].reshape(-1, 4), out[:G])


@functools.cache
def _compiled_planner():
    """`passes.plan_timed`, imported on the first plan that needs it (loading the compiled passes
    takes a while; a plan that moves nothing never pays it) and kept: an import statement per plan
    costs about a microsecond."""
    from deepspeed_feplb.plan.passes import plan_timed
    return plan_timed


_NO_MODEL = np.zeros(0, MODEL_DTYPE)
_NO_CAP = 1 << 60  # a row cap that no domain reaches (and that int64 arithmetic on it cannot overflow)
