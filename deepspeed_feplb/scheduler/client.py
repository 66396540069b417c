"""The ranks' side of the scheduler: publish counts, get the domain's plan for the same micro-batch.

Two implementations of `scheduler.Scheduler`:

* `InlineScheduler` (``feplb.scheduler.mode: "inline"``): every rank waits for the domain's
  counts in the mailbox and computes the plan itself. The planner is deterministic, so all ranks
  get the same plan without further communication.
* `ProcessScheduler` (``"process"``, the default): the domain's `feplb-sched` process plans while
  the ranks compute their static experts; a rank reads the plan from the mailbox, and plans
  in-process exactly as `InlineScheduler` does when the process is late, stalled or dead.

Waiting (for the other ranks' counts, for the plan) sleeps on the mailbox's bells: no CPU is
spent while nothing happens, and the process answers in microseconds when something does.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from deepspeed_feplb.plan.cache import planner_cached
from deepspeed_feplb.plan.policy import Plan, PlanConstraints, empty_plan, plan_domain
from deepspeed_feplb.scheduler.mailbox import PID, SERVED, STARTING, DomainCounts, Mailbox
from deepspeed_feplb.segments import PeerTimeoutError, PeerWatch, Word, process_alive, wait_until

_PASSES = "deepspeed_feplb.plan.passes"  # the compiled planning pass, once this process has loaded it

log = logging.getLogger("deepspeed_feplb")  # without logging configured, warnings print as the bare message


@dataclass(frozen=True)
class DomainPlan:
    """The plan of one micro-batch, as a rank receives it.

    plan:      the `Plan` (moves int64 [M, 4], rank_rows int64 [G]);
    counts:    int64 [G, E_local]: every domain rank's counts the plan was made from;
    seconds:   planning time; fallback: True when this rank planned in-process because the
               scheduler process was late, stalled or dead (never in inline mode).
    """
    plan: Plan
    counts: np.ndarray
    seconds: float
    fallback: bool


class InlineScheduler:
    """Every rank plans itself from the mailbox (module docstring).

    name: the mailbox segment; local_rank in ``[0, ranks)``; rank 0 creates (``create=True``)
    and owns the mailbox. ``peer_timeout_s`` bounds the wait for the other ranks' counts;
    ``watch`` fails that wait fast, naming the rank, when one of them died.
    """

    def __init__(self, name: str, local_rank: int, ranks: int, *, peer_timeout_s: float, create: bool,
                 watch: PeerWatch | None = None):
        self.local_rank, self.ranks, self.watch, self.peer_timeout_s = local_rank, ranks, watch, peer_timeout_s
        self.mailbox = Mailbox(name, ranks, create=create)

    def publish(self, seq: int, counts: np.ndarray, constraints: PlanConstraints,
                resident: np.ndarray | None = None, dynamic: np.ndarray | None = None) -> None:
        """This rank's counts ``int64 [E_local]`` for micro-batch ``seq``, the constraints of its
        plan, its row of the layer's residency masks (int64 [E_local, W], `plan.residency`; None:
        none) and the dynamic experts it chose (int64 [<= 2D]; None: its D hottest)."""
        self.mailbox.publish(self.local_rank, seq, counts, constraints, resident, dynamic)

    def plan(self, seq: int) -> DomainPlan:
        """The domain's plan for micro-batch ``seq`` (waits for every rank's counts)."""
        return self._plan_here(self._wait_counts(seq), fallback=False)

    def plan_ready(self, seq: int) -> bool:
        """Every rank's counts for ``seq`` are in: `plan` plans at once."""
        return self.mailbox.has_counts(seq)

    @staticmethod
    def _plan_here(published: DomainCounts, fallback: bool) -> DomainPlan:
        start = time.perf_counter()
        plan = plan_domain(published.counts, published.constraints, published.resident, published.dynamic)
        return DomainPlan(plan, published.counts, time.perf_counter() - start, fallback)

    def _wait_counts(self, seq: int) -> DomainCounts:
        try:
            return _wait_for(lambda: self.mailbox.read_counts(seq), self.mailbox.counts_bell, self.peer_timeout_s,
                             "counts", self.watch.check if self.watch else None)
        except PeerTimeoutError as error:
            missing = self.mailbox.missing_ranks(seq)
            if self.watch is not None:
                missing = [self.watch.ranks[r] for r in missing]
            raise type(error)(
                f"FEPLB: rank(s) {missing} did not publish micro-batch {seq} within feplb.scheduler.peer_timeout_s="
                f"{self.peer_timeout_s:g} s ({error})") from None

    def scheduler_pid(self) -> int:
        """Pid of the running scheduler process; 0 while none runs (inline mode, starting, or dead)."""
        return int(self.mailbox.header[PID])

    def revive(self) -> None:
        """Restart a dead scheduler process now (nothing to do inline)."""

    def close(self) -> None:
        self.mailbox.close()


class ProcessScheduler(InlineScheduler):
    """The `feplb-sched` process plans; ranks fall back to `InlineScheduler`'s plan when it is late.

    Rank 0 of the domain starts and owns the process. ``plan_timeout_s`` bounds the wait for its
    plan; a process that is gone is not waited for at all; with ``restart`` the owner restarts a
    dead one, and kills and restarts one that missed `STALLED_AFTER` plans in a row.
    """

    STALLED_AFTER = 3
    LIVENESS_AFTER_S = 0.001

    def __init__(self, name: str, local_rank: int, ranks: int, *, plan_timeout_s: float, peer_timeout_s: float,
                 restart: bool, create: bool, start_after_steps: int = 0, watch: PeerWatch | None = None,
                 moves_at_once: bool = False):
        super().__init__(name, local_rank, ranks, peer_timeout_s=peer_timeout_s, create=create, watch=watch)
        self.plan_timeout_s, self.restart, self.start_after_steps = plan_timeout_s, restart, start_after_steps
        self.process: subprocess.Popen | None = None
        self.fallbacks = self.late_in_a_row = 0
        self._said_gone = False  # a dead process that is not restarted is reported once
        # numba's cache lacks the planner: the process compiles it, not a training step (`plan.cache`)
        self.compiles_elsewhere = create and not planner_cached()
        self.moves_at_once = moves_at_once
        if create:
            # Until the process is up the domain's first rank plans for all, silently (the mailbox
            # says it is starting). Plans that need not move from the first micro-batch (measured
            # costs) move nothing until the process serves, which starts with the domain: loading the
            # planner (about a second from numba's cache, 15-40 s to compile) never costs a training
            # step, nor this process's CPU. With ``moves_at_once`` the first rank plans itself from the
            # first micro-batch, and the process starts after `start_after_steps` steps, so that short
            # runs never pay for it (a cold Python imports numpy and numba, ~0.5 s); at once when it
            # must compile the planner, and until then plans have no moves.
            self.mailbox.header[STARTING] = 1
            if start_after_steps <= 0 or self.compiles_elsewhere or not moves_at_once:
                self._start_process()

    def _start_process(self) -> None:
        self.mailbox.header[PID] = 0  # never a sentinel pid: os.kill(-1, ...) would signal every process
        self.mailbox.header[STARTING] = 1
        self.process = _hand_spare(self.mailbox.name, self.ranks) or _spawn(f"--mailbox={self.mailbox.name}",
                                                                             f"--ranks={self.ranks}")

    def revive(self) -> None:
        """Restart the process now if it died (only its owner, rank 0 of the domain, can), instead of
        after a plan timeout inside the next forward."""
        if self.process is not None and self.restart and self.process.poll() is not None:
            self._restart(self._exit_reason())

    def plan(self, seq: int) -> DomainPlan:
        """The domain's plan for ``seq``: the process's, or, before it first came up or when it is
        late, this rank's own (``fallback``: the latter, after a process had served the domain)."""
        published = self._wait_counts(seq)
        got = self._scheduler_plan(seq)
        if got is not None:
            self.late_in_a_row = 0
            if got[0] is None:  # too large for the mailbox: the same plan, computed here
                return self._plan_here(published, fallback=False)
            return DomainPlan(got[0], published.counts, got[1] * 1e-9, False)
        if self.process is None and self.mailbox.owner and seq + 1 >= self.start_after_steps:
            self._start_process()  # this job runs long enough to be worth a process
        elif not self.mailbox.header[STARTING] or (self.process is not None and self.process.poll() is not None):
            self._on_late_scheduler()  # late, or (seen by its owner) dead before it came up
        if self.mailbox.header[STARTING] and not self.mailbox.header[SERVED]:
            return self._leader_plan(seq, published)
        # a fallback once a process has served this domain (also while a restarted one comes up);
        # every rank reads the same word, so they agree
        return self._plan_here(published, fallback=bool(self.mailbox.header[SERVED]))

    def plan_ready(self, seq: int) -> bool:
        """The process's (or the domain's first rank's) plan for ``seq`` is published."""
        return self.mailbox.has_plan(seq)

    def _leader_plan(self, seq: int, published: DomainCounts) -> DomainPlan:
        """Before a scheduler process first came up, the domain's first rank (the mailbox owner)
        plans for all and writes the plan where the process would; the others wait for it like for
        a peer's counts (``peer_timeout_s``, failing fast if it died). So in a short run only one
        process per domain loads numba and the compiled planner, instead of every rank."""
        if self.mailbox.owner:
            if not self._plans_itself():
                # the scheduler process compiles or loads the planner: no moves this micro-batch,
                # rather than a step that waits for numba
                planned = DomainPlan(empty_plan(published.counts), published.counts, 0.0, False)
            else:
                planned = self._plan_here(published, fallback=False)
            # the process may have come up and answered this micro-batch meanwhile: the other ranks
            # may have read its plan already, so it is the micro-batch's plan (the process, in turn,
            # never plans a micro-batch that has one). Checked and written apart, not atomically: a narrow window
            # remains in which both publish.
            written = self.mailbox.read_plan(seq)
            if written is None:
                self.mailbox.write_plan(seq, planned.plan, int(planned.seconds * 1e9))
                return planned
        else:
            written = _wait_for(lambda: self.mailbox.read_plan(seq), self.mailbox.plan_bell, self.peer_timeout_s,
                                "the plan of the domain's first rank", self.watch.check if self.watch else None)
        plan, plan_ns = written
        if plan is None:  # too large for the mailbox: the same plan, computed here
            return self._plan_here(published, fallback=False)
        return DomainPlan(plan, published.counts, plan_ns * 1e-9, False)

    def _plans_itself(self) -> bool:
        """Whether the domain's first rank plans itself before the process serves: with the planner
        already loaded, or with ``moves_at_once`` and a planner it can load from numba's cache."""
        return _PASSES in sys.modules or (self.moves_at_once and not self.compiles_elsewhere)

    def _scheduler_plan(self, seq: int) -> tuple[Plan, int] | None:
        """The scheduler's plan for ``seq`` and its planning time (ns); None if none runs, or it is
        dead, or later than ``plan_timeout_s``. Whether it is alive (a /proc read: tens of µs on a
        VM) is checked only once the plan is `LIVENESS_AFTER_S` late, not on every micro-batch."""
        if self.scheduler_pid() <= 0:
            return None  # starting, or restarting
        read = lambda: self.mailbox.read_plan(seq)  # noqa: E731
        bell = self.mailbox.plan_bell
        first = min(self.plan_timeout_s, self.LIVENESS_AFTER_S)
        try:
            return _wait_for(read, bell, first, "the scheduler process")
        except PeerTimeoutError:
            pass
        if first >= self.plan_timeout_s or not process_alive(self.scheduler_pid()):
            return None
        try:
            return _wait_for(read, bell, self.plan_timeout_s - first, "the scheduler process")
        except PeerTimeoutError:
            return None

    def _on_late_scheduler(self) -> None:
        """A micro-batch planned in-process. A late plan alone says nothing (nothing is lost: every
        rank computes the same plan; it counts as a fallback in the stats); the process's owner says
        when the process died or stopped answering, and what it did about it."""
        self.fallbacks += 1
        self.late_in_a_row += 1
        if self.process is None:
            return
        if self.process.poll() is None and self.restart and self.late_in_a_row >= self.STALLED_AFTER:
            self.process.kill()  # stalled: a fresh one is cheaper than waiting on it every micro-batch
            self.process.wait()
            self._restart(f"missed {self.late_in_a_row} plans in a row (feplb.scheduler.plan_timeout_ms="
                          f"{self.plan_timeout_s * 1e3:g}) and was stopped")
        elif self.process.poll() is not None and self.restart:
            self._restart(self._exit_reason())
        elif self.process.poll() is not None and not self._said_gone:
            self._said_gone = True
            log.warning(f"FEPLB: the scheduler process feplb-sched (pid {self.process.pid}) {self._exit_reason()}; "
                        "feplb.scheduler.restart is off, so the ranks of its domain plan in-process from now on "
                        "(the same plan on every rank)")

    def _exit_reason(self) -> str:
        code = self.process.poll()
        return f"exited ({f'signal {-code}' if code < 0 else f'exit code {code}'})"

    def _restart(self, why: str) -> None:
        pid = self.process.pid
        self._start_process()
        self.late_in_a_row = 0
        log.warning(f"FEPLB: the scheduler process feplb-sched (pid {pid}) {why}; restarted it as pid "
                    f"{self.process.pid}; until it serves, the ranks of its domain plan in-process (the same plan "
                    "on every rank)")

    def close(self) -> None:
        if self.process is not None:
            self.mailbox.request_shutdown()
            if self.mailbox.header[STARTING]:
                self.process.kill()  # still importing (it holds nothing yet): do not wait for it to come up
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None
        super().close()


def _spawn(*args: str, stdin=subprocess.DEVNULL) -> subprocess.Popen:
    """A `feplb-sched` process of this rank (``args``: its command line after the module)."""
    return subprocess.Popen([sys.executable, "-m", "deepspeed_feplb.scheduler.process", *args,
                             f"--parent={os.getpid()}"], stdin=stdin, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            start_new_session=True)  # a terminal's Ctrl-C goes to the ranks; it follows its rank's exit


_spare: Optional[subprocess.Popen] = None  # `start_spare`'s process, until a domain takes it


def start_spare() -> None:
    """Start a `feplb-sched` process that loads the planner now and then waits for a domain
    (idempotent while one waits). Starting one takes ~0.7 s of CPU on a 2-core VM (Python,
    numpy, numba's cached planner, a warm-up plan): started when the domain opens, it came up ~12
    toy steps later, and balancing waited for it. The domain that opens first on this rank takes
    it (`ProcessScheduler`) and sends it its mailbox on the spare's stdin; `stop_spare` ends one
    that no domain took, and the spare exits by itself when its rank does (its stdin closes)."""
    global _spare
    if _spare is None or _spare.poll() is not None:
        _spare = _spawn("--spare", stdin=subprocess.PIPE)


def _hand_spare(mailbox: str, ranks: int) -> Optional[subprocess.Popen]:
    """The waiting spare, told to serve ``mailbox`` of ``ranks`` ranks; None when there is none
    (or it died)."""
    global _spare
    spare, _spare = _spare, None
    if spare is None or spare.poll() is not None:
        return None
    try:
        spare.stdin.write(f"{mailbox} {ranks}\n".encode())
        spare.stdin.close()
    except OSError:  # it died just now
        spare.kill()
        spare.wait()
        return None
    return spare


def stop_spare() -> None:
    """End a spare that no domain took (our own child: its pid is > 0 and ours to signal)."""
    global _spare
    spare, _spare = _spare, None
    if spare is not None and spare.pid > 0 and spare.poll() is None:
        spare.kill()
        spare.wait()
    if spare is not None and spare.stdin is not None:
        spare.stdin.close()


def _wait_for(read, bell: Word, timeout_s: float, what: str, watch=None):
    """Call ``read()`` until it returns something other than None, sleeping on ``bell`` in between
    (see `wait_until`); return that."""
    got = None

    def ready() -> bool:
        nonlocal got
        got = read()
        return got is not None

    wait_until(ready, timeout_s, what, watch, word=bell)
    return got
