"""Shared-memory segments, waiting with a deadline, and peer liveness: FEPLB's torch-free plumbing.

The scheduler process imports only this (and numpy), so it starts in a fraction of a second.
"""
from __future__ import annotations

import os
import time
from multiprocessing import resource_tracker, shared_memory

SEGMENT_PREFIX = "feplb-"
class PeerTimeoutError(RuntimeError):
    """A peer rank did not answer within the configured timeout (it died or hangs)."""


def open_segment(name: str, size: int = 0, create: bool = False) -> shared_memory.SharedMemory:
    """Create or attach a POSIX shared-memory segment whose lifetime FEPLB manages itself.

    Python's resource tracker would unlink a segment when *any* attaching process exits (and
    ranks spawned by one parent share a tracker), so segments are untracked; the creator
    unlinks with `unlink_quietly`, and `cleanup` removes what a SIGKILL left behind.
    """
    shm = shared_memory.SharedMemory(name=name, create=create, size=size)
    try:
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
    except Exception:
        pass
    return shm


def unlink_quietly(shm: shared_memory.SharedMemory | None) -> None:
    if shm is None:
        return
    try:
        os.unlink(os.path.join("/dev/shm", shm.name))
    except FileNotFoundError:
        pass


class PeerDiedError(PeerTimeoutError):
    """A peer process of the domain is gone (killed or crashed)."""


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (a zombie, killed but not yet reaped, does not)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def describe_rank(watch: "PeerWatch | None", local_rank: int) -> str:
    """How error messages name a domain peer: its global rank when known."""
    return f"rank {watch.ranks[local_rank]}" if watch else f"local rank {local_rank}"


def peer_check(watch: "PeerWatch | None", local_rank: int):
    """A `wait_until` watch that raises once ``local_rank`` died (None without a `PeerWatch`)."""
    return None if watch is None else (lambda: watch.check([local_rank]))


class PeerWatch:
    """Liveness of a domain's rank processes, which share this host: fail fast, naming the rank.

    pids: process id of each local rank; ranks: their global ranks (for messages).
    """

    def __init__(self, pids: list[int], ranks: list[int]):
        self.pids, self.ranks = list(pids), list(ranks)

    def alive(self, local_rank: int) -> bool:
        return process_alive(self.pids[local_rank])

    def check(self, local_ranks=None) -> None:
        for r in range(len(self.pids)) if local_ranks is None else local_ranks:
            if not self.alive(r):
                raise PeerDiedError(f"FEPLB: rank {self.ranks[r]} (pid {self.pids[r]}) of this NVLink domain died")


def wait_until(predicate, timeout_s: float, what: str, watch=None) -> None:
    """Spin briefly, then yield the core between polls, then back off with sleeps (2 cores serve
    several ranks in tests). Yielding, not ``time.sleep(0)``: that costs ~40 µs on a VM.

    ``watch``, if given, is called every ~50 ms and raises when a peer is known to be dead.
    """
    deadline = time.monotonic() + timeout_s
    next_watch = time.monotonic() + 0.05
    spins = 0
    while not predicate():
        spins += 1
        if spins < 200:
            continue
        now = time.monotonic()
        if now > deadline:
            raise PeerTimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        if watch is not None and now > next_watch:
            watch()
            next_watch = now + 0.05
        if spins < 2000:
            os.sched_yield()
        else:
            time.sleep(0.0002)


def leftover_segments(prefix: str = SEGMENT_PREFIX) -> list[str]:
    """Names of shared-memory segments in /dev/shm that start with ``prefix``."""
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    except FileNotFoundError:
        return []


def cleanup(prefix: str = SEGMENT_PREFIX) -> list[str]:
    """Remove FEPLB segments left behind by killed jobs; returns the removed names."""
    removed = []
    for name in leftover_segments(prefix):
        try:
            os.unlink(os.path.join("/dev/shm", name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("cleanup", help="remove /dev/shm segments left by killed FEPLB jobs")
    parser.add_argument("--prefix", default=SEGMENT_PREFIX, help="segment name prefix (default: %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="only list what would be removed")

    def run(args):
        names = leftover_segments(args.prefix) if args.dry_run else cleanup(args.prefix)
        verb = "would remove" if args.dry_run else "removed"
        print(f"{verb} {len(names)} segment(s)" + "".join(f"\n  /dev/shm/{n}" for n in names))

    parser.set_defaults(func=run)
