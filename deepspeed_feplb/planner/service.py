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
        if any(begin != seq or end != seq for begin, end in entries[:, :2].tolist()):  # cheaper than numpy here
            return None
        meta = entries[0, :_SLOT_META].copy()
        local_experts = int(meta[2])
        counts = entries[:, _SLOT_META:_SLOT_META + local_experts].copy()
        if any(begin != seq or end != seq for begin, end in entries[:, :2].tolist()):
            return None  # overwritten while we copied
        constraints = PlanConstraints(dynamic_experts=int(meta[3]), max_helpers=int(meta[4]),
                                      chunk_align=int(meta[5]), expert_bytes=int(meta[6]),
                                      ce_budget_bytes=float(meta[7:8].view(np.float64)[0]))
        return counts, constraints

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
def _set_process_name(name: str) -> None:
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME: what `ps -o comm` and pkill see
    except Exception:
        pass


def serve(mailbox: Mailbox, parent_pid: int) -> None:
    """Plan every complete step until shutdown is requested or the parent process is gone."""
    seq, idle_since = 0, time.monotonic()
    while mailbox.header[_SHUTDOWN] == 0:
        ready = mailbox.read_counts(seq)
        if ready is None:
            # ranks may have skipped ahead (e.g. we were stopped); follow the newest complete step
            newest = int(mailbox.slots[:, :, 1].min(axis=0).max())
            if newest > seq:
                seq = newest
                continue
            idle = time.monotonic() - idle_since
            if idle > 0.5:
                if os.getppid() != parent_pid:
                    # our rank was killed and cannot clean up: the domain is broken, remove its segments
                    cleanup(mailbox.name[:-len("mbox")])
                    return
                mailbox.header[_HEARTBEAT] = int(time.time())
            time.sleep(0 if idle < 0.002 else 0.0002 if idle < 0.1 else 0.002)
            continue
        counts, constraints = ready
        start = time.perf_counter_ns()
        plan = plan_node(counts, constraints)
        mailbox.write_plan(seq, plan, time.perf_counter_ns() - start)
        seq += 1
        idle_since = time.monotonic()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="FEPLB per-node scheduler process (started by the layer)")
    parser.add_argument("--mailbox", required=True)
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True)
    args = parser.parse_args(argv)
    _set_process_name("feplb-sched")
    try:
        mailbox = Mailbox(args.mailbox, args.ranks, create=False)
    except FileNotFoundError:
        return  # started just as the job shut down: nothing to serve
    mailbox.header[_PID] = os.getpid()
    mailbox.header[_STARTING] = 0
    try:
        serve(mailbox, args.parent)
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

    def __init__(self, name: str, local_rank: int, ranks: int, *, mode: str, plan_timeout_s: float,
                 peer_timeout_s: float, restart: bool, create: bool, watch: PeerWatch | None = None):
        self.local_rank, self.ranks, self.mode, self.watch = local_rank, ranks, mode, watch
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
             str(self.ranks), "--parent", str(os.getpid())],
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
            got = None
            if self._scheduler_alive():
                try:
                    wait_until(lambda: self.mailbox.read_plan(seq, self.ranks) is not None, self.plan_timeout_s,
                               "the scheduler process")
                    got = self.mailbox.read_plan(seq, self.ranks)
                except PeerTimeoutError:
                    pass
            if got is not None:
                self.late_in_a_row = 0
                return got[0], counts, got[1] * 1e-9, False
            if not self.mailbox.header[_STARTING]:
                self._on_late_scheduler()
        start = time.perf_counter()
        plan = plan_node(counts, constraints)
        return plan.moves, counts, time.perf_counter() - start, self.mode == "process"

    def _wait_counts(self, seq: int):
        ready = []

        def complete() -> bool:
            got = self.mailbox.read_counts(seq)
            if got is not None:
                ready.append(got)
            return got is not None

        try:
            wait_until(complete, self.peer_timeout_s, "counts", self.watch.check if self.watch else None)
        except PeerTimeoutError as error:
            missing = self.mailbox.missing_ranks(seq)
            if self.watch is not None:
                missing = [self.watch.ranks[r] for r in missing]
            raise type(error)(
                f"FEPLB: rank(s) {missing} did not publish step {seq} within feplb.scheduler.peer_timeout_s="
                f"{self.peer_timeout_s:g} s ({error})") from None
        return ready[0]

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


def ce_budget_bytes(configured: float | str, gbps: float, static_seconds: float) -> float:
    """Weight bytes one rank may move per micro-batch: configured, or CE bandwidth x static-compute time."""
    if configured != "auto":
        return float(configured)
    return math.inf if static_seconds <= 0 else gbps * 1e9 * static_seconds


if __name__ == "__main__":
    main()
