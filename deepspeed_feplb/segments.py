"""Shared-memory segments, waiting on shared words with a deadline, and peer liveness: FEPLB's
torch-free plumbing.

The scheduler process imports only this (and numpy), so it starts in a fraction of a second.
"""
from __future__ import annotations

import ctypes
import os
import platform
import sys
import threading
import time
from multiprocessing import resource_tracker, shared_memory

import numpy as np

SEGMENT_PREFIX = "feplb-"
_TRACKER_LOCK = threading.Lock()
class PeerTimeoutError(RuntimeError):
    """A peer rank did not answer within the configured timeout (it died or hangs)."""


def open_segment(name: str, size: int = 0, create: bool = False) -> shared_memory.SharedMemory:
    """Create or attach a POSIX shared-memory segment whose lifetime FEPLB manages itself.

    Python's resource tracker would unlink a segment when *any* attaching process exits (and
    ranks spawned by one parent share a tracker), so segments are never registered with it (not
    registered and unregistered: ranks attaching the same name at once make the shared tracker
    print a KeyError traceback); the creator unlinks with `unlink_quietly`, and `cleanup`
    removes what a SIGKILL left behind.
    """
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, create=create, size=size, track=False)
    with _TRACKER_LOCK:  # SharedMemory registers through the module attribute: skip it for this call
        register = resource_tracker.register
        resource_tracker.register = lambda res, rtype: None if rtype == "shared_memory" else register(res, rtype)
        try:
            return shared_memory.SharedMemory(name=name, create=create, size=size)
        finally:
            resource_tracker.register = register


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


_LEARNT_RANKS_PER_HOST: list[int] = []  # from the ranks' hostnames, at initialize (`domain.learn_ranks_per_host`)


def ranks_per_host(default: int) -> int:
    """Ranks the launcher started on this host (``LOCAL_WORLD_SIZE``, or ``LOCAL_SIZE``), else what
    the ranks' hostnames said (`domain.learn_ranks_per_host`), else ``default``."""
    told = os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE"))
    if told is not None:
        return int(told)
    return _LEARNT_RANKS_PER_HOST[-1] if _LEARNT_RANKS_PER_HOST else default


def launcher_tells_ranks_per_host() -> bool:
    return "LOCAL_WORLD_SIZE" in os.environ or "LOCAL_SIZE" in os.environ


def learnt_ranks_per_host(n: int) -> None:
    _LEARNT_RANKS_PER_HOST[:] = [n]


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) that process ``pid`` of this host used so far; 0 if gone."""
    if pid <= 0:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15


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


class Word:
    """An int64 word of a shared-memory array that other processes (and threads) can sleep on.

    Waiting uses a Linux futex on the word's low 32 bits (the word's own address, little endian):
    a waiter sleeps until the word changes from the value it saw and its writer calls `notify`,
    with no CPU used meanwhile. Where futexes are unavailable, waiters poll with short sleeps.
    array: a numpy int64 array mapping shared memory; index: the word's index in it.
    """

    def __init__(self, array: np.ndarray, index):
        if array.dtype != np.int64 or not array.flags.c_contiguous:
            raise ValueError("a Word lives in a C-contiguous int64 array (a futex needs the word's own address)")
        self.array, self.index = array, index
        flat = int(np.ravel_multi_index(index, array.shape)) if isinstance(index, tuple) else int(index)
        self._low = array.reshape(-1).view(np.int32)[2 * flat:2 * flat + 1]  # little-endian low half
        self.address = self._low.ctypes.data

    def seen(self) -> int:
        """The value a waiter compares against (the low 32 bits, signed)."""
        return int(self._low[0])

    def notify(self) -> None:
        """Wake every waiter of this word (call after changing it)."""
        futex_wake(self.address)


class Words:
    """The `Word` of each index of one shared array, built on first use (a channel's header words)."""

    def __init__(self, array: np.ndarray):
        self.array, self._words = array, {}

    def __getitem__(self, index) -> Word:
        word = self._words.get(index)
        if word is None:
            word = self._words[index] = Word(self.array, index)
        return word

    def release(self) -> None:
        """Drop every view of the array (before its shared memory is closed)."""
        self._words.clear()
        self.array = None


# Linux system call numbers (other systems have no futex: waiters poll)
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "ppc64le": 221, "s390x": 238}.get(
    platform.machine().lower()) if sys.platform.startswith("linux") else None
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
# a wake with its argument types declared once: ctypes then converts plain ints (a third cheaper per call)
_futex_wake_call = ctypes.CDLL(None, use_errno=True).syscall
_futex_wake_call.restype = ctypes.c_long
_futex_wake_call.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                             ctypes.c_void_p, ctypes.c_int]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def futex_wait(address: int, seen: int, timeout_s: float) -> None:
    """Sleep until the 32-bit word at ``address`` is woken, its value is no longer ``seen``, or
    ``timeout_s`` passed (a signal may also end it early: callers re-check their condition)."""
    if _SYS_FUTEX is None:
        time.sleep(min(timeout_s, 0.0002))
        return
    timeout_s = max(timeout_s, 0.0)
    ts = _Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
    _libc.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(address), ctypes.c_int(_FUTEX_WAIT),
                  ctypes.c_int(seen), ctypes.byref(ts), None, ctypes.c_int(0))


def futex_wake(address: int) -> None:
    if _SYS_FUTEX is not None:
        _futex_wake_call(_SYS_FUTEX, address, _FUTEX_WAKE, 2**31 - 1, None, None, 0)


WATCH_EVERY_S = 0.05
SPIN_CHECKS = 50
# Ranks usually wait for a peer that is about to answer; when cores are shared (more ranks than
# cores), yielding the core for this long first lets that peer run now instead of after a wake-up.
YIELD_S = 0.0002


def wait_until(predicate, timeout_s: float, what: str, watch=None, word: Word | None = None,
               yield_s: float = YIELD_S) -> None:
    """Wait until ``predicate()`` holds, at most ``timeout_s`` (then `PeerTimeoutError`).

    ``word``: the shared word whose writer calls `Word.notify` when the condition may have become
    true; the wait then sleeps in the kernel (no CPU) in slices of `WATCH_EVERY_S`, after a few
    (`SPIN_CHECKS`) immediate checks and at most ``yield_s`` of yielding the core (`YIELD_S`) for
    an answer that is already on its way. Without a word,
    it polls with 0.2 ms sleeps (for conditions nobody signals, such as a process starting).
    ``watch``, if given, is called every `WATCH_EVERY_S` and raises when a peer is known to be dead.
    """
    for _ in range(SPIN_CHECKS):
        if predicate():
            return
    if word is not None and yield_s > 0:  # hand the core to the peer we wait for, briefly, before sleeping
        until = time.monotonic() + min(yield_s, timeout_s)
        while time.monotonic() < until:
            os.sched_yield()
            if predicate():
                return
    deadline = time.monotonic() + timeout_s
    next_watch = time.monotonic() + WATCH_EVERY_S
    while True:
        seen = word.seen() if word is not None else 0
        if predicate():
            return
        now = time.monotonic()
        if now > deadline:
            raise PeerTimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        if watch is not None and now > next_watch:
            watch()
            next_watch = now + WATCH_EVERY_S
        if word is None:
            time.sleep(0.0002)
        else:
            futex_wait(word.address, seen, min(deadline - now, next_watch - now, WATCH_EVERY_S))


def leftover_segments(prefix: str = SEGMENT_PREFIX) -> list[str]:
    """Names of shared-memory segments in /dev/shm that start with ``prefix``."""
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    except FileNotFoundError:
        return []


def segments_in_use(prefix: str = SEGMENT_PREFIX) -> dict[str, list[int]]:
    """``{segment name: pids}`` of the ``prefix`` segments that a live process of this host maps
    (read from ``/proc/<pid>/maps``; processes we may not inspect are not seen)."""
    used: dict[str, list[int]] = {}
    marker = "/dev/shm/" + prefix
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/maps") as f:
                names = {line.split("/dev/shm/", 1)[1].split()[0] for line in f if marker in line}
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        for name in names:
            used.setdefault(name, []).append(int(entry))
    return used


def cleanup(prefix: str = SEGMENT_PREFIX, keep_in_use: bool = False, min_age_s: float = 0.0) -> list[str]:
    """Remove FEPLB segments left behind by killed jobs; returns the removed names.

    ``keep_in_use``: skip segments a live process still maps (a running job's). The command
    line and new domains use it; a domain's own teardown does not (its peers may still be
    unmapping). ``min_age_s``: skip segments younger than this (a job that is starting may not
    have mapped them yet; a new domain's automatic reclaim uses it). The names are listed before
    the mappings are read, so a segment created meanwhile is never taken for a leftover."""
    removed = []
    names = leftover_segments(prefix)
    in_use = segments_in_use(prefix) if keep_in_use and names else {}  # reading every process's maps costs
    now = time.time()
    for name in names:
        if name in in_use or now - _changed_at(name) < min_age_s:
            continue
        try:
            os.unlink(os.path.join("/dev/shm", name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def _changed_at(name: str) -> float:
    try:
        return os.stat(os.path.join("/dev/shm", name)).st_ctime
    except FileNotFoundError:
        return time.time()


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "cleanup", help="remove /dev/shm segments left by killed FEPLB jobs",
        description="Remove the /dev/shm segments that FEPLB jobs killed with SIGKILL left behind. Segments "
                    "that a running process still maps (a live job's) are kept and listed.")
    parser.add_argument("--prefix", default=SEGMENT_PREFIX, help="segment name prefix (default: %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="only list what would be removed")

    def run(args):
        in_use = segments_in_use(args.prefix)
        if args.dry_run:
            names = [n for n in leftover_segments(args.prefix) if n not in in_use]
        else:
            names = cleanup(args.prefix, keep_in_use=True)
        verb = "would remove" if args.dry_run else "removed"
        print(f"{verb} {len(names)} segment(s)" + "".join(f"\n  /dev/shm/{n}" for n in names))
        kept = sorted(n for n in leftover_segments(args.prefix) if n in in_use)
        if kept:
            print(f"kept {len(kept)} segment(s) a running process maps" +
                  "".join(f"\n  /dev/shm/{n} (pid {', '.join(map(str, in_use[n]))})" for n in kept))

    parser.set_defaults(func=run)
