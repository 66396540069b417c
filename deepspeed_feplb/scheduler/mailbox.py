"""The domain's mailbox: the shared memory through which ranks and the scheduler process talk.

Every rank of an NVLink domain publishes its per-local-expert row counts for micro-batch
``seq``, the dynamic experts it chose and the plan's constraints into its own slot; whoever plans (the `feplb-sched`
process, or each rank itself when that process is late) reads all slots of ``seq`` and the
scheduler writes the `Plan` into the plan ring, from which every rank reads it back.

Slots and plan entries are rings of `RING` entries guarded like a seqlock (``begin`` written
first, ``end`` last; a reader accepts an entry only if both equal the wanted ``seq`` before and
after it copied the data), so a stale or torn entry is never used for a new micro-batch.

Nobody polls: a rank that published rings ``counts_bell`` and the scheduler rings ``plan_bell``
after writing a plan (`segments.Word`: waiters sleep in the kernel until the word changes).

Layout: a header of `HEADER` int64 words ``[shutdown, scheduler_pid, heartbeat, starting,
counts_bell, plan_bell, served (1 once a scheduler process was ever up), spare]``, then
``[G, RING]`` slots of `slot_dtype` (one per rank and ring entry), then ``[RING]`` plan entries of
`plan_dtype`. Both sides read and write these dtypes' named fields; nothing counts words.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from deepspeed_feplb.plan.hottest import NONE, dynamic_candidates
from deepspeed_feplb.plan.policy import Plan, PlanConstraints
from deepspeed_feplb.plan.time_model import MODEL_DTYPE, TimeModel
from deepspeed_feplb.segments import Word, open_segment, unlink_quietly

_NO_MODEL = np.zeros((), MODEL_DTYPE)

RING = 4
E_MAX = 1024
HEADER = 8
SHUTDOWN, PID, HEARTBEAT, STARTING, COUNTS_BELL, PLAN_BELL, SERVED = range(7)  # header words

# What a rank publishes besides its counts: its `PlanConstraints`, field by field.
CONSTRAINTS_DTYPE = np.dtype([
    ("experts", np.int64), ("dynamic_experts", np.int64), ("max_helpers", np.int64), ("chunk_align", np.int64),
    ("expert_bytes", np.int64), ("ce_budget_bytes", np.float64), ("keep_copies", np.int64),
    ("later_micro_batches", np.int64), ("has_model", np.int64),
    ("model", MODEL_DTYPE),  # `TimeModel.record`
    ("max_rows_over_mean", np.float64), ("mean_rows", np.float64)])


def slot_dtype(ranks: int) -> np.dtype:
    """One rank's slot of one ring entry, in a domain of ``ranks``: seqlock words, constraints,
    counts ``[E_MAX]`` (the first ``experts`` used), the dynamic experts the rank chose
    ``[E_MAX]`` (the first ``experts`` used, `hottest.NONE` after its own) and its row
    of the residency masks ``[E_MAX, W]``, W = ceil(ranks / 64)."""
    return np.dtype([("begin", np.int64), ("end", np.int64), ("constraints", CONSTRAINTS_DTYPE),
                     ("counts", np.int64, (E_MAX, )), ("dynamic", np.int64, (E_MAX, )),
                     ("resident", np.int64, (E_MAX, (ranks + 63) // 64))])


@dataclass(frozen=True)
class DomainCounts:
    """What every rank of a domain published for one micro-batch: what the planner plans from.

    counts:       int64 [G, E_local] rows per rank and local expert;
    dynamic:      int64 [G, W] the dynamic experts each rank chose (`hottest.NONE` pads; W: the most
                  any rank chose, at least D);
    constraints:  the domain's first rank's `PlanConstraints`;
    resident:     int64 [G, E_local, W] the residency masks (`plan.residency`)."""
    counts: np.ndarray
    dynamic: np.ndarray
    constraints: PlanConstraints
    resident: np.ndarray


def plan_dtype(ranks: int) -> np.dtype:
    """One plan entry: seqlock words, the number of moves (-1: too many to publish), the planning
    time (ns), rows per rank ``[G]`` and the moves ``[max_moves, 4]`` (the first ``moves_count``)."""
    return np.dtype([("begin", np.int64), ("end", np.int64), ("moves_count", np.int64), ("plan_ns", np.int64),
                     ("rank_rows", np.int64, (ranks, )), ("moves", np.int64, (max_moves(ranks), 4))])


def max_moves(ranks: int) -> int:
    """Upper bound of plan rows the plan ring can hold for a domain of ``ranks``."""
    return ranks * 64 * 8


def mailbox_bytes(ranks: int) -> int:
    """Bytes of a mailbox for a domain of ``ranks``."""
    return HEADER * 8 + ranks * RING * slot_dtype(ranks).itemsize + RING * plan_dtype(ranks).itemsize


class Mailbox:
    """A domain's mailbox in shared memory; rank 0 of the domain creates and unlinks it."""

    def __init__(self, name: str, ranks: int, create: bool):
        self.name, self.ranks = name, ranks
        self._shm = open_segment(name, mailbox_bytes(ranks), create=create)
        self.owner = create
        slot_type, plan_type = slot_dtype(ranks), plan_dtype(ranks)
        self.header = np.ndarray((HEADER, ), dtype=np.int64, buffer=self._shm.buf)
        self.slots = np.ndarray((ranks, RING), dtype=slot_type, buffer=self._shm.buf, offset=HEADER * 8)
        self.plans = np.ndarray((RING, ), dtype=plan_type, buffer=self._shm.buf,
                                offset=HEADER * 8 + ranks * RING * slot_type.itemsize)
        if create:
            self.header[:] = 0
            for table in (self.slots, self.plans):
                table["begin"], table["end"] = -1, -1
        self.counts_bell = Word(self.header, COUNTS_BELL)  # rung by every publish
        self.plan_bell = Word(self.header, PLAN_BELL)  # rung by every plan
        self._meta, self._constraints = None, None
        # each field as a plain view, taken once: a structured field lookup per access would double
        # the cost of a publish
        self._slot = {name: self.slots[name] for name in slot_type.names}
        self._plan = [{name: self.plans[name][i:i + 1] for name in plan_type.names} for i in range(RING)]

    # ---------------------------------------------------------------- counts
    def publish(self, rank: int, seq: int, counts: np.ndarray, constraints: PlanConstraints,
                resident: np.ndarray | None = None, dynamic: Optional[np.ndarray] = None) -> None:
        """Rank ``rank`` publishes its counts ``int64 [E_local]`` for micro-batch ``seq``, the
        constraints of its plan, its row of the residency masks (int64 [E_local, W]; None: none)
        and the dynamic experts it chose (int64 [<= E_local]; None: its D hottest)."""
        E = counts.shape[0]
        if E > E_MAX:
            raise ValueError(f"FEPLB supports at most {E_MAX} local experts per rank, got {E}")
        slot, i = self._slot, seq % RING
        slot["begin"][rank, i] = -1
        model = constraints.model
        slot["constraints"][rank, i] = (
            E, constraints.dynamic_experts, constraints.max_helpers, constraints.chunk_align, constraints.expert_bytes,
            constraints.ce_budget_bytes, int(constraints.keep_copies), int(constraints.later_micro_batches),
            int(model is not None),
            model.record[0] if model is not None else _NO_MODEL, constraints.max_rows_over_mean, constraints.mean_rows)
        slot["counts"][rank, i, :E] = counts
        if dynamic is None:
            dynamic = dynamic_candidates(counts[None], constraints.dynamic_experts)[0]
        chosen = slot["dynamic"][rank, i]
        chosen[:len(dynamic)] = dynamic
        chosen[len(dynamic):E] = NONE
        slot["resident"][rank, i, :E] = 0 if resident is None else np.asarray(resident, np.int64).reshape(E, -1)
        slot["end"][rank, i] = seq
        slot["begin"][rank, i] = seq
        self.header[COUNTS_BELL] = seq * self.ranks + rank  # a new value per publish: no lost wake-up
        self.counts_bell.notify()

    def read_counts(self, seq: int) -> DomainCounts | None:
        """What every rank published for ``seq``, or None if incomplete."""
        slot, i = self._slot, seq % RING
        if not self._complete(seq):
            return None
        meta = slot["constraints"][0, i].copy()
        E, D = int(meta["experts"]), int(meta["dynamic_experts"])
        counts = slot["counts"][:, i, :E].copy()
        dynamic = slot["dynamic"][:, i, :E].copy()
        resident = slot["resident"][:, i, :E].copy()
        if not self._complete(seq):
            return None  # overwritten while we copied
        key = meta.tobytes()
        if key != self._meta:  # the constraints change once per micro-batch at most: build them then
            model = None
            if meta["has_model"]:
                model = TimeModel.from_record(meta["model"])
            self._constraints = PlanConstraints(
                int(meta["dynamic_experts"]), int(meta["max_helpers"]), int(meta["chunk_align"]),
                float(meta["ce_budget_bytes"]), int(meta["expert_bytes"]), model, bool(meta["keep_copies"]),
                int(meta["later_micro_batches"]), float(meta["max_rows_over_mean"]), float(meta["mean_rows"]))
            self._meta = key
        width = max(min(D, E), int((dynamic != NONE).sum(axis=1).max(initial=0)))  # a rank may choose more than D
        return DomainCounts(counts, np.ascontiguousarray(dynamic[:, :width]), self._constraints, resident)

    def _complete(self, seq: int) -> bool:
        i = seq % RING
        return all(begin == seq and end == seq
                   for begin, end in zip(self._slot["begin"][:, i].tolist(), self._slot["end"][:, i].tolist()))

    def missing_ranks(self, seq: int) -> list[int]:
        """Domain-local ranks that have not published ``seq``."""
        i = seq % RING
        begin, end = self._slot["begin"][:, i], self._slot["end"][:, i]
        return [r for r in range(self.ranks) if begin[r] != seq or end[r] != seq]

    def newest_complete(self) -> int:
        """The newest micro-batch that every rank has published (-1 if none)."""
        return int(self._slot["end"].min(axis=0).max())

    # ---------------------------------------------------------------- plans
    def write_plan(self, seq: int, plan: Plan, plan_ns: int) -> None:
        """Publish ``plan`` for ``seq`` and how long it took to compute (ns). A plan with more moves
        than an entry holds (not within the documented bounds) is published as "none": readers
        then compute it themselves at once instead of waiting for it."""
        moves, plan_rows = plan.moves, plan.rank_rows
        M = moves.shape[0]
        fits = M <= max_moves(self.ranks)
        entry = self._plan[seq % RING]  # each field a view of shape [1, ...]
        entry["begin"][0] = -1
        entry["moves_count"][0], entry["plan_ns"][0] = (M if fits else -1), plan_ns
        if fits:
            entry["rank_rows"][0] = plan_rows
            entry["moves"][0, :M] = moves
        entry["end"][0] = seq
        entry["begin"][0] = seq
        self.header[PLAN_BELL] = seq
        self.plan_bell.notify()

    def has_counts(self, seq: int) -> bool:
        """Whether every rank published its counts for ``seq`` (`read_counts` would return them)."""
        return self._complete(seq)

    def has_plan(self, seq: int) -> bool:
        """Whether the plan for ``seq`` is published (`read_plan` would return it)."""
        entry = self._plan[seq % RING]
        return entry["begin"][0] == seq and entry["end"][0] == seq

    def read_plan(self, seq: int) -> tuple[Plan | None, int] | None:
        """The published `Plan` for ``seq`` and its planning time (ns), or None if not (yet) there;
        the plan is None when it was too large to publish (`write_plan`)."""
        if not self.has_plan(seq):
            return None
        entry = self._plan[seq % RING]
        count, plan_ns = int(entry["moves_count"][0]), int(entry["plan_ns"][0])
        if count < 0:
            return None, plan_ns
        rank_rows = entry["rank_rows"][0].copy()
        moves = entry["moves"][0, :count].copy()
        if not self.has_plan(seq):  # overwritten while we copied
            return None
        return Plan(moves, rank_rows), plan_ns

    def request_shutdown(self) -> None:
        """Ask the scheduler process to exit (it is woken at once)."""
        self.header[SHUTDOWN] = 1
        self.header[COUNTS_BELL] = -1
        self.counts_bell.notify()

    def close(self) -> None:
        del self.header, self.slots, self.plans, self.counts_bell, self.plan_bell
        self._shm.close()
        if self.owner:
            unlink_quietly(self._shm)
