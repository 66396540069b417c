"""The `feplb-sched` process: one per NVLink domain, it plans every balanced micro-batch.

Started by the domain's rank 0 (`client.ProcessScheduler`) as ``python -m
deepspeed_feplb.scheduler.process``, or before the domain opens as a spare (``--spare``,
`client.start_spare`) that reads its domain's mailbox from stdin. It imports numpy, numba's compiled
planner and the mailbox, never torch (up in ~0.7 s of CPU on a 2-core VM, most of it numba).
It waits until every rank published micro-batch ``seq`` (sleeping on the mailbox's counts bell
meanwhile), calls `plan_domain` and writes the `Plan` into the mailbox's plan ring; it exits on
the mailbox's shutdown word, or removes the domain's segments and exits when its parent rank died.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

from deepspeed_feplb.plan.policy import plan_domain
from deepspeed_feplb.scheduler.mailbox import HEARTBEAT, PID, SERVED, SHUTDOWN, STARTING, Mailbox
from deepspeed_feplb.segments import cleanup, futex_wait


def _prctl(option: int, arg) -> None:
    try:
        ctypes.CDLL(None).prctl(option, arg, 0, 0, 0)
    except Exception:
        pass


IDLE_CHECK_S = 0.5


def serve(mailbox: Mailbox, parent_pid: int) -> None:
    """Plan every complete micro-batch until shutdown is requested or the parent process is gone.

    Between micro-batches the process sleeps on the mailbox's ``counts_bell`` (no CPU): each
    rank's publish wakes it, and it plans once the micro-batch is complete. Every `IDLE_CHECK_S`
    without one it checks that its parent rank lives and updates its heartbeat."""
    bell = mailbox.counts_bell
    seq = 0
    while mailbox.header[SHUTDOWN] == 0:
        seen = bell.seen()
        ready = mailbox.read_counts(seq)
        if ready is not None and mailbox.has_plan(seq):
            seq += 1  # the domain's first rank answered it before we were up: its plan stands
            continue
        if ready is not None:
            start = time.perf_counter_ns()
            plan = plan_domain(ready.counts, ready.constraints, ready.resident, ready.dynamic)
            mailbox.write_plan(seq, plan, time.perf_counter_ns() - start)
            seq += 1
            continue
        # ranks may have skipped ahead (e.g. we were stopped); follow the newest complete micro-batch
        newest = mailbox.newest_complete()
        if newest > seq:
            seq = newest
            continue
        before = time.monotonic()
        futex_wait(bell.address, seen, IDLE_CHECK_S)
        if time.monotonic() - before >= IDLE_CHECK_S:
            if os.getppid() != parent_pid:
                # our rank was killed and cannot clean up: the domain is broken, remove its segments
                cleanup(mailbox.name[:-len("mbox")])
                return
            mailbox.header[HEARTBEAT] = int(time.time())


def warm_planner() -> None:
    """Plan two small domains, with and without a row bound, under a time model, with kept copies:
    a first call is slow (numba's typing of its first arrays imports parts of numpy: 10-17 ms on a
    2-core VM, more on a busy host), which made the process's first real plan late (a rank then
    plans itself, loading the planner into the training process: 0.6 s)."""
    import numpy as np

    from deepspeed_feplb.plan.hottest import dynamic_candidates
    from deepspeed_feplb.plan.policy import PlanConstraints, no_residents
    from deepspeed_feplb.plan.time_model import TimeModel
    counts = np.array([[400, 300, 20, 10], [10, 20, 30, 40]], np.int64)
    resident = no_residents(*counts.shape)
    resident[0, 1, 0] = 2  # rank 1 keeps a copy of rank 0's expert 1
    model = TimeModel(1, 5.0, 100.0, 50.0, 50.0, 0.1, message_us=20.0)
    for bound in (0.0, 1.05):
        constraints = PlanConstraints(dynamic_experts=2, max_helpers=1, chunk_align=8, expert_bytes=1 << 20,
                                      ce_budget_bytes=float(1 << 20), model=model, keep_copies=True,
                                      max_rows_over_mean=bound)
        plan_domain(counts, constraints, resident, dynamic_candidates(counts, 2))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="FEPLB scheduler process of one NVLink domain (started by the layer)")
    parser.add_argument("--mailbox")
    parser.add_argument("--ranks", type=int)
    parser.add_argument("--spare", action="store_true",
                        help="load the planner, then read 'MAILBOX RANKS' from stdin (end of input: exit)")
    parser.add_argument("--parent", type=int, required=True)
    args = parser.parse_args(argv)
    if not args.spare and (args.mailbox is None or args.ranks is None):
        parser.error("--mailbox and --ranks are required without --spare")
    _prctl(15, b"feplb-sched")  # PR_SET_NAME: what `ps -o comm` and pkill see
    _prctl(29, 1000)  # PR_SET_TIMERSLACK 1 µs (default 50 µs): a wake-up is not deferred
    warm_planner()  # the compiled passes, loaded before we say we are up
    if args.spare:
        domain = sys.stdin.readline().split()
        if len(domain) != 2:
            return  # our rank exited, or stopped us, before any domain needed us
        args.mailbox, args.ranks = domain[0], int(domain[1])
    try:
        mailbox = Mailbox(args.mailbox, args.ranks, create=False)
    except FileNotFoundError:
        return  # started just as the job shut down: nothing to serve
    mailbox.header[PID] = os.getpid()
    mailbox.header[SERVED] = 1  # from now on, a plan a rank makes itself is a fallback
    mailbox.header[STARTING] = 0
    try:
        serve(mailbox, args.parent)
    finally:
        mailbox.close()



if __name__ == "__main__":
    main()
