"""The per-node scheduler: a shared-memory mailbox and the `feplb-sched` process that plans.

Every rank of an NVLink domain publishes its per-local-expert token counts for micro-batch
step ``seq`` into its own slot of the domain's mailbox; the scheduler process waits until all
ranks published ``seq``, calls `plan_node` and writes the plan into the plan ring. Ranks read
the plan back. If the plan is late (process dead, stalled, or ``mode="inline"``), each rank
computes the *same* plan in-process from the same mailbox data: the planner is deterministic,
so the domain stays consistent without any extra communication.

Slots are rings of `RING` entries guarded like a seqlock (``begin`` written first, ``end`` last;
a reader accepts an entry only if both equal the wanted ``seq`` before and after it copied the
data), so a stale or torn entry is never used for a new micro-batch.

Slot layout (int64): ``[begin, end, E_local, D, max_helpers, chunk_align, expert_bytes,
ce_budget (float64 bits), counts[E_max]]``; plan entry: ``[begin, end, M, plan_ns,
moves[M_max, 4]]``; a header ``[shutdown, scheduler_pid, heartbeat]`` comes first.
"""
from __future__ import annotations

import argparse
import ctypes
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np

from deepspeed_feplb.migrate.segments import (PeerTimeoutError, PeerWatch, cleanup, open_segment, process_alive,
                                               unlink_quietly, wait_until)
from deepspeed_feplb.planner.policy import Plan, PlanConstraints, plan_node

RING = 4
STARTUP_WAIT_S = 10.0
E_MAX = 1024
_SLOT_META = 8
_PLAN_META = 4
_HEADER = 8
_SHUTDOWN, _PID, _HEARTBEAT, _STARTING = range(4)


def max_moves(ranks: int) -> int:
    """Upper bound of plan rows the plan ring can hold for a domain of ``ranks``."""
    return ranks * 64 * 8


@dataclass(frozen=True)
class MailboxLayout:
    ranks: int

    @property
    def slot_words(self) -> int:
        return _SLOT_META + E_MAX

    @property
    def plan_words(self) -> int:
        return _PLAN_META + 4 * max_moves(self.ranks)

    @property
    def words(self) -> int:
        return _HEADER + self.ranks * RING * self.slot_words + RING * self.plan_words


class Mailbox:
    """A domain's mailbox in shared memory; rank 0 of the domain creates and unlinks it."""

    def __init__(self, name: str, ranks: int, create: bool):
        self.name, self.ranks, self.layout = name, ranks, MailboxLayout(ranks)
        self._shm = open_segment(name, self.layout.words * 8, create=create)
        self._owner = create
        words = np.ndarray((self.layout.words, ), dtype=np.int64, buffer=self._shm.buf)
        if create:
            words[:] = 0
            words[_HEADER:] = -1
        self.header = words[:_HEADER]
        end_slots = _HEADER + ranks * RING * self.layout.slot_words
        self.slots = words[_HEADER:end_slots].reshape(ranks, RING, self.layout.slot_words)
        self.plans = words[end_slots:].reshape(RING, self.layout.plan_words)
        self._meta, self._constraints = None, None

    # ---------------------------------------------------------------- counts
    def publish(self, rank: int, seq: int, counts: np.ndarray, constraints: PlanConstraints) -> None:
        """Rank ``rank`` publishes its counts ``int64 [E_local]`` for micro-batch step ``seq``."""
        if counts.shape[0] > E_MAX:
            raise ValueError(f"FEPLB supports at most {E_MAX} local experts per rank, got {counts.shape[0]}")
        slot = self.slots[rank, seq % RING]
        slot[0] = -1
        slot[2:_SLOT_META] = (counts.shape[0], constraints.dynamic_experts, constraints.max_helpers,
                              constraints.chunk_align, constraints.expert_bytes, 0)
        slot[7:8].view(np.float64)[0] = constraints.ce_budget_bytes
        slot[_SLOT_META:_SLOT_META + counts.shape[0]] = counts
        slot[1] = seq
        slot[0] = seq

    def read_counts(self, seq: int) -> tuple[np.ndarray, PlanConstraints] | None:
        """All ranks' counts ``int64 [G, E_local]`` for ``seq`` and rank 0's constraints, or None if incomplete."""
        entries = self.slots[:, seq % RING]
        if not self._complete(entries, seq):
            return None
        meta = entries[0, 2:_SLOT_META].tolist()
        counts = entries[:, _SLOT_META:_SLOT_META + meta[0]].copy()
        if not self._complete(entries, seq):
            return None  # overwritten while we copied
        if meta != self._meta:  # the constraints rarely change: build them once per change
            local_experts, D, helpers, align, expert_bytes, budget_bits = meta
            budget = float(np.int64(budget_bits).view(np.float64))  # from the checked copy, not re-read
            self._constraints = PlanConstraints(D, helpers, align, budget, expert_bytes)
            self._meta = meta
        return counts, self._constraints

    @staticmethod
    def _complete(entries, seq: int) -> bool:
        return all(begin == seq and end == seq for begin, end in entries[:, :2].tolist())  # cheaper than numpy here

    def missing_ranks(self, seq: int) -> list[int]:
        entries = self.slots[:, seq % RING]
        return [r for r in range(self.ranks) if entries[r, 0] != seq or entries[r, 1] != seq]

    # ---------------------------------------------------------------- plans
    def write_plan(self, seq: int, plan: Plan, plan_ns: int) -> None:
        moves = plan.moves.reshape(-1)
        if moves.size > 4 * max_moves(self.ranks):
            return  # cannot happen within the documented bounds; ranks then plan in-process
        entry = self.plans[seq % RING]
        entry[0] = -1
        entry[2], entry[3] = plan.moves.shape[0], plan_ns
        entry[_PLAN_META:_PLAN_META + moves.size] = moves
        entry[1] = seq
        entry[0] = seq

    def read_plan(self, seq: int, ranks: int) -> tuple[np.ndarray, int] | None:
        """The scheduler's moves ``int64 [M, 4]`` for ``seq`` and its planning time (ns), or None."""
        entry = self.plans[seq % RING]
        if entry[0] != seq or entry[1] != seq:
            return None
        count, plan_ns = int(entry[2]), int(entry[3])
        moves = entry[_PLAN_META:_PLAN_META + 4 * count].copy().reshape(count, 4)
        if entry[0] != seq or entry[1] != seq:
            return None
        return moves, plan_ns

    def close(self) -> None:
        del self.header, self.slots, self.plans
        self._shm.close()
        if self._owner:
            unlink_quietly(self._shm)


# -------------------------------------------------------------------- the scheduler process
def _prctl(option: int, arg) -> None:
    try:
        ctypes.CDLL(None).prctl(option, arg, 0, 0, 0)
    except Exception:
        pass


def serve(mailbox: Mailbox, parent_pid: int, poll_s: float = 0.002) -> None:
    """Plan every complete step until shutdown is requested or the parent process is gone.

    For ``poll_s`` after each plan the loop polls without sleeping (yielding the core to anything
    else runnable), then it sleeps 0.2 ms between polls, and 2 ms once idle for 0.1 s."""
    seq, last_plan = 0, time.monotonic()
    while mailbox.header[_SHUTDOWN] == 0:
        ready = mailbox.read_counts(seq)
        if ready is not None:
            counts, constraints = ready
            start = time.perf_counter_ns()
            plan = plan_node(counts, constraints)
            mailbox.write_plan(seq, plan, time.perf_counter_ns() - start)
            seq += 1
            last_plan = time.monotonic()
            continue
        idle = time.monotonic() - last_plan
        if idle < poll_s:
            os.sched_yield()
            continue
        # ranks may have skipped ahead (e.g. we were stopped); follow the newest complete step
        newest = int(mailbox.slots[:, :, 1].min(axis=0).max())
        if newest > seq:
            seq = newest
            continue
        if idle > 0.5:
            if os.getppid() != parent_pid:
                # our rank was killed and cannot clean up: the domain is broken, remove its segments
                cleanup(mailbox.name[:-len("mbox")])
                return
            mailbox.header[_HEARTBEAT] = int(time.time())
        time.sleep(0.0002 if idle < 0.1 else 0.002)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="FEPLB per-node scheduler process (started by the layer)")
    parser.add_argument("--mailbox", required=True)
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--poll-ms", type=float, default=2.0)
    args = parser.parse_args(argv)
    _prctl(15, b"feplb-sched")  # PR_SET_NAME: what `ps -o comm` and pkill see
    _prctl(29, 1000)  # PR_SET_TIMERSLACK 1 µs (default 50 µs): its 0.2 ms sleeps end on time
    try:
        mailbox = Mailbox(args.mailbox, args.ranks, create=False)
    except FileNotFoundError:
        return  # started just as the job shut down: nothing to serve
    mailbox.header[_PID] = os.getpid()
    mailbox.header[_STARTING] = 0
    try:
        serve(mailbox, args.parent, args.poll_ms / 1e3)
    finally:
        mailbox.close()


# -------------------------------------------------------------------- the ranks' side
class SchedulerClient:
    """What a rank uses: publish counts, then get the domain's plan for the same step.

    Rank 0 of the domain owns the mailbox and, in ``mode="process"``, the scheduler process.
    ``plan_timeout_s`` bounds the wait for the process before the rank plans in-process (the
    same plan every rank computes); a scheduler that is gone is not waited for at all; the owner
    restarts a dead one, and kills and restarts one that missed `STALLED_AFTER` plans in a row.
    ``peer_timeout_s`` bounds the wait for the other ranks' counts; ``watch`` fails fast when
    one of them died.
    """

    STALLED_AFTER = 3
    LIVENESS_AFTER_S = 0.001

    def __init__(self, name: str, local_rank: int, ranks: int, *, mode: str, plan_timeout_s: float,
                 peer_timeout_s: float, restart: bool, create: bool, poll_s: float = 0.002,
                 watch: PeerWatch | None = None):
        self.local_rank, self.ranks, self.mode, self.watch, self.poll_s = local_rank, ranks, mode, watch, poll_s
        self.plan_timeout_s, self.peer_timeout_s, self.restart = plan_timeout_s, peer_timeout_s, restart
        self.mailbox = Mailbox(name, ranks, create=create)
        self.process: subprocess.Popen | None = None
        self.fallbacks = self.late_in_a_row = 0
        if create and mode == "process":
            self._start_process()
            try:  # a cold Python needs a moment to import numpy; until it is up, ranks plan in-process
                wait_until(lambda: self.mailbox.header[_PID] > 0 or self.process.poll() is not None,
                           min(peer_timeout_s, STARTUP_WAIT_S), "the feplb-sched process to start")
            except PeerTimeoutError:
                pass

    def _start_process(self) -> None:
        self.mailbox.header[_PID] = 0  # never a sentinel pid: os.kill(-1, ...) would signal every process
        self.mailbox.header[_STARTING] = 1
        self.process = subprocess.Popen(
            [sys.executable, "-m", "deepspeed_feplb.planner.service", "--mailbox", self.mailbox.name, "--ranks",
             str(self.ranks), "--parent", str(os.getpid()), "--poll-ms", repr(self.poll_s * 1e3)],
            stdin=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def scheduler_pid(self) -> int:
        """Pid of the running scheduler process; 0 while none runs (inline mode, starting, or dead)."""
        return int(self.mailbox.header[_PID])

    def _scheduler_alive(self) -> bool:
        return process_alive(self.scheduler_pid())

    def publish(self, seq: int, counts: np.ndarray, constraints: PlanConstraints) -> None:
        self.mailbox.publish(self.local_rank, seq, counts, constraints)

    def plan(self, seq: int) -> tuple[np.ndarray, np.ndarray, float, bool]:
        """Moves ``[M, 4]``, node counts ``[G, E_local]``, planning time (s) and whether this rank planned itself."""
        counts, constraints = self._wait_counts(seq)
        if self.mode == "process":
            got = self._scheduler_plan(seq)
            if got is not None:
                self.late_in_a_row = 0
                return got[0], counts, got[1] * 1e-9, False
            if not self.mailbox.header[_STARTING]:
                self._on_late_scheduler()
        start = time.perf_counter()
        plan = plan_node(counts, constraints)
        return plan.moves, counts, time.perf_counter() - start, self.mode == "process"

    def _scheduler_plan(self, seq: int) -> tuple[np.ndarray, int] | None:
        """The scheduler's plan for ``seq``; None if none runs, or it is dead, or later than
        ``plan_timeout_s``. Whether it is alive (a /proc read: tens of µs on a VM) is checked only
        once the plan is `LIVENESS_AFTER_S` late, not on every step."""
        if self.scheduler_pid() <= 0:
            return None  # inline mode, or starting
        read = lambda: self.mailbox.read_plan(seq, self.ranks)  # noqa: E731
        first = min(self.plan_timeout_s, self.LIVENESS_AFTER_S)
        try:
            return _poll(read, first, "the scheduler process")
        except PeerTimeoutError:
            pass
        if first >= self.plan_timeout_s or not self._scheduler_alive():
            return None
        try:
            return _poll(read, self.plan_timeout_s - first, "the scheduler process")
        except PeerTimeoutError:
            return None

    def _wait_counts(self, seq: int):
        try:
            return _poll(lambda: self.mailbox.read_counts(seq), self.peer_timeout_s, "counts",
                         self.watch.check if self.watch else None)
        except PeerTimeoutError as error:
            missing = self.mailbox.missing_ranks(seq)
            if self.watch is not None:
                missing = [self.watch.ranks[r] for r in missing]
            raise type(error)(
                f"FEPLB: rank(s) {missing} did not publish step {seq} within feplb.scheduler.peer_timeout_s="
                f"{self.peer_timeout_s:g} s ({error})") from None

    def _on_late_scheduler(self) -> None:
        self.fallbacks += 1
        self.late_in_a_row += 1
        if self.fallbacks == 1:
            import warnings
            warnings.warn("FEPLB: the scheduler process did not answer in time; ranks plan in-process "
                          "(same plan on every rank)", RuntimeWarning, stacklevel=3)
        if self.process is None or not self.restart:
            return
        if self.process.poll() is None and self.late_in_a_row >= self.STALLED_AFTER:
            self.process.kill()  # stalled: a fresh one is cheaper than waiting on it every step
            self.process.wait()
        if self.process.poll() is not None:
            self._start_process()
            self.late_in_a_row = 0

    def close(self) -> None:
        if self.process is not None:
            self.mailbox.header[_SHUTDOWN] = 1
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None
        self.mailbox.close()


def _poll(read, timeout_s: float, what: str, watch=None):
    """Call ``read()`` until it returns something other than None (see `wait_until`); return that."""
    got = None

    def ready() -> bool:
        nonlocal got
        got = read()
        return got is not None

    wait_until(ready, timeout_s, what, watch)
    return got


def ce_budget_bytes(configured: float | str, gbps: float, static_seconds: float) -> float:
    """Weight bytes one rank may move per micro-batch: configured, or CE bandwidth x static-compute time."""
    if configured != "auto":
        return float(configured)
    return math.inf if static_seconds <= 0 else gbps * 1e9 * static_seconds


if __name__ == "__main__":
    main()
