"""The domain's mailbox: the shared memory through which ranks and the scheduler process talk.

Every rank of an NVLink domain publishes its per-local-expert token counts for micro-batch step
``seq`` (and the plan's constraints) into its own slot; whoever plans (the `feplb-sched`
process, or each rank itself when that process is late) reads all slots of ``seq`` and the
scheduler writes the `Plan` into the plan ring, from which every rank reads it back.

Slots and plan entries are rings of `RING` entries guarded like a seqlock (``begin`` written
first, ``end`` last; a reader accepts an entry only if both equal the wanted ``seq`` before and
after it copied the data), so a stale or torn entry is never used for a new micro-batch.

Nobody polls: a rank that published rings ``counts_bell`` and the scheduler rings ``plan_bell``
after writing a plan (`segments.Word`: waiters sleep in the kernel until the word changes).

Layout (int64 words): a header ``[shutdown, scheduler_pid, heartbeat, starting, counts_bell,
plan_bell, served (1 once a scheduler process was ever up), ...]`` (`HEADER` words); per rank
and ring entry a slot ``[begin, end, E_local, D, max_helpers, chunk_align, expert_bytes,
ce_budget (float64 bits), keep_copies, has_model, model[7] (float64 bits), max_rows_over_mean,
mean_rows (float64 bits), counts[E_MAX],
resident[E_MAX, W]]`` (``resident``: the rank's row of the residency masks, W = ceil(G / 64));
per ring entry a plan ``[begin, end, M, plan_ns, rank_tokens[G], moves[M_max, 4]]``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from deepspeed_feplb.plan.policy import Plan, PlanConstraints
from deepspeed_feplb.plan.timeline import TimeModel
from deepspeed_feplb.segments import Word, open_segment, unlink_quietly

RING = 4
E_MAX = 1024
HEADER = 8
SHUTDOWN, PID, HEARTBEAT, STARTING, COUNTS_BELL, PLAN_BELL, SERVED = range(7)  # header words
_SLOT_META = 19
_MODEL = 10  # first word of the time model in a slot (7 words, `TimeModel.as_array`)
_ROWS = 17  # max_rows_over_mean, mean_rows (float64 bits)
_PLAN_META = 4


def max_moves(ranks: int) -> int:
    """Upper bound of plan rows the plan ring can hold for a domain of ``ranks``."""
    return ranks * 64 * 8


@dataclass(frozen=True)
class MailboxLayout:
    """Word counts of a mailbox for a domain of ``ranks`` ranks."""
    ranks: int

    @property
    def mask_words(self) -> int:
        return (self.ranks + 63) // 64

    @property
    def slot_words(self) -> int:
        return _SLOT_META + E_MAX * (1 + self.mask_words)

    @property
    def plan_words(self) -> int:
        return _PLAN_META + self.ranks + 4 * max_moves(self.ranks)

    @property
    def words(self) -> int:
        return HEADER + self.ranks * RING * self.slot_words + RING * self.plan_words


class Mailbox:
    """A domain's mailbox in shared memory; rank 0 of the domain creates and unlinks it."""

    def __init__(self, name: str, ranks: int, create: bool):
        self.name, self.ranks, self.layout = name, ranks, MailboxLayout(ranks)
        self._shm = open_segment(name, self.layout.words * 8, create=create)
        self.owner = create
        words = np.ndarray((self.layout.words, ), dtype=np.int64, buffer=self._shm.buf)
        if create:
            words[:] = 0
            words[HEADER:] = -1
        self.header = words[:HEADER]
        end_slots = HEADER + ranks * RING * self.layout.slot_words
        self.slots = words[HEADER:end_slots].reshape(ranks, RING, self.layout.slot_words)
        self.plans = words[end_slots:].reshape(RING, self.layout.plan_words)
        self.counts_bell = Word(self.header, COUNTS_BELL)  # rung by every publish
        self.plan_bell = Word(self.header, PLAN_BELL)  # rung by every plan
        self._meta, self._constraints = None, None

    # ---------------------------------------------------------------- counts
    def publish(self, rank: int, seq: int, counts: np.ndarray, constraints: PlanConstraints,
                resident: np.ndarray | None = None) -> None:
        """Rank ``rank`` publishes its counts ``int64 [E_local]`` for micro-batch step ``seq``, the
        constraints of its plan and its row of the residency masks (int64 [E_local, W]; None: none)."""
        E = counts.shape[0]
        if E > E_MAX:
            raise ValueError(f"FEPLB supports at most {E_MAX} local experts per rank, got {E}")
        slot = self.slots[rank, seq % RING]
        slot[0] = -1
        model = constraints.model
        slot[2:_SLOT_META] = (E, constraints.dynamic_experts, constraints.max_helpers, constraints.chunk_align,
                              constraints.expert_bytes, 0, int(constraints.keep_copies), int(model is not None),
                              0, 0, 0, 0, 0, 0, 0, 0, 0)
        slot[7:8].view(np.float64)[0] = constraints.ce_budget_bytes
        slot[_ROWS:_ROWS + 2].view(np.float64)[:] = (constraints.max_rows_over_mean, constraints.mean_rows)
        if model is not None:
            slot[_MODEL:_MODEL + 7].view(np.float64)[:] = model.as_array()
        slot[_SLOT_META:_SLOT_META + E] = counts
        W = self.layout.mask_words
        masks = slot[_SLOT_META + E_MAX:_SLOT_META + E_MAX + E * W]
        masks[:] = 0 if resident is None else np.asarray(resident, np.int64).reshape(-1)
        slot[1] = seq
        slot[0] = seq
        self.header[COUNTS_BELL] = seq * self.ranks + rank  # a new value per publish: no lost wake-up
        self.counts_bell.notify()

    def read_counts(self, seq: int) -> tuple[np.ndarray, PlanConstraints, np.ndarray] | None:
        """All ranks' counts ``int64 [G, E_local]`` for ``seq``, rank 0's constraints and the
        domain's residency masks ``int64 [G, E_local, W]``, or None if incomplete."""
        entries = self.slots[:, seq % RING]
        if not self._complete(entries, seq):
            return None
        meta = entries[0, 2:_SLOT_META].tolist()
        E, W = meta[0], self.layout.mask_words
        counts = entries[:, _SLOT_META:_SLOT_META + E].copy()
        resident = entries[:, _SLOT_META + E_MAX:_SLOT_META + E_MAX + E * W].copy().reshape(self.ranks, E, W)
        if not self._complete(entries, seq):
            return None  # overwritten while we copied
        if meta != self._meta:  # the constraints change once per micro-batch at most: build them then
            _, D, helpers, align, expert_bytes, budget_bits, keep, has_model = meta[:8]
            budget = float(np.int64(budget_bits).view(np.float64))  # from the checked copy, not re-read
            model = None
            if has_model:
                tile, *rest = np.array(meta[_MODEL - 2:_MODEL + 5], np.int64).view(np.float64).tolist()
                model = TimeModel(int(tile), *rest)
            ratio, mean_rows = np.array(meta[_ROWS - 2:_ROWS], np.int64).view(np.float64).tolist()
            self._constraints = PlanConstraints(D, helpers, align, budget, expert_bytes, model, bool(keep), ratio,
                                                mean_rows)
            self._meta = meta
        return counts, self._constraints, resident

    @staticmethod
    def _complete(entries, seq: int) -> bool:
        return all(begin == seq and end == seq for begin, end in entries[:, :2].tolist())  # cheaper than numpy here

    def missing_ranks(self, seq: int) -> list[int]:
        """Domain-local ranks that have not published ``seq``."""
        entries = self.slots[:, seq % RING]
        return [r for r in range(self.ranks) if entries[r, 0] != seq or entries[r, 1] != seq]

    def newest_complete(self) -> int:
        """The newest step that every rank has published (-1 if none)."""
        return int(self.slots[:, :, 1].min(axis=0).max())

    # ---------------------------------------------------------------- plans
    def write_plan(self, seq: int, plan: Plan, plan_ns: int) -> None:
        """Publish ``plan`` for ``seq`` and how long it took to compute (ns). A plan with more moves
        than an entry holds (not within the documented bounds) is published as "none": readers
        then compute it themselves at once instead of waiting for it."""
        moves = plan.moves.reshape(-1)
        fits = moves.size <= 4 * max_moves(self.ranks)
        G = self.ranks
        entry = self.plans[seq % RING]
        entry[0] = -1
        entry[2], entry[3] = (plan.moves.shape[0] if fits else -1), plan_ns
        if fits:
            entry[_PLAN_META:_PLAN_META + G] = plan.rank_tokens
            entry[_PLAN_META + G:_PLAN_META + G + moves.size] = moves
        entry[1] = seq
        entry[0] = seq
        self.header[PLAN_BELL] = seq
        self.plan_bell.notify()

    def read_plan(self, seq: int) -> tuple[Plan | None, int] | None:
        """The published `Plan` for ``seq`` and its planning time (ns), or None if not (yet) there;
        the plan is None when it was too large to publish (`write_plan`)."""
        entry = self.plans[seq % RING]
        if entry[0] != seq or entry[1] != seq:
            return None
        G = self.ranks
        count, plan_ns = int(entry[2]), int(entry[3])
        if count < 0:
            return None, plan_ns
        rank_tokens = entry[_PLAN_META:_PLAN_META + G].copy()
        moves = entry[_PLAN_META + G:_PLAN_META + G + 4 * count].copy().reshape(count, 4)
        if entry[0] != seq or entry[1] != seq:
            return None
        return Plan(moves, rank_tokens), plan_ns

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
