"""The `feplb-sched` process: one per NVLink domain, it plans every micro-batch step.

Started by the domain's rank 0 (`client.ProcessScheduler`) as ``python -m
deepspeed_feplb.scheduler.process``; it imports numpy, numba's compiled planner and the mailbox,
never torch, so it is up in a fraction of a second. It waits until every rank published step
``seq``, calls `plan_domain` and writes the `Plan` into the mailbox's plan ring; it exits on the
mailbox's shutdown word, or removes the domain's segments and exits when its parent rank died.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import time

from deepspeed_feplb.plan.policy import plan_domain
from deepspeed_feplb.scheduler.mailbox import HEARTBEAT, PID, SHUTDOWN, STARTING, Mailbox
from deepspeed_feplb.segments import cleanup


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
    while mailbox.header[SHUTDOWN] == 0:
        ready = mailbox.read_counts(seq)
        if ready is not None:
            counts, constraints = ready
            start = time.perf_counter_ns()
            plan = plan_domain(counts, constraints)
            mailbox.write_plan(seq, plan, time.perf_counter_ns() - start)
            seq += 1
            last_plan = time.monotonic()
            continue
        idle = time.monotonic() - last_plan
        if idle < poll_s:
            os.sched_yield()
            continue
        # ranks may have skipped ahead (e.g. we were stopped); follow the newest complete step
        newest = mailbox.newest_complete()
        if newest > seq:
            seq = newest
            continue
        if idle > 0.5:
            if os.getppid() != parent_pid:
                # our rank was killed and cannot clean up: the domain is broken, remove its segments
                cleanup(mailbox.name[:-len("mbox")])
                return
            mailbox.header[HEARTBEAT] = int(time.time())
        time.sleep(0.0002 if idle < 0.1 else 0.002)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="FEPLB scheduler process of one NVLink domain (started by the layer)")
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
    mailbox.header[PID] = os.getpid()
    mailbox.header[STARTING] = 0
    try:
        serve(mailbox, args.parent, args.poll_ms / 1e3)
    finally:
        mailbox.close()



if __name__ == "__main__":
    main()
