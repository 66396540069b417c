"""Per-rank runtime of one NVLink domain: the transport, the scheduler, the step counter.

A domain is ``nvlink_domain_size`` consecutive ranks of an expert-parallel group that share a
host (on GPUs: an NVLink / copy-engine domain); phase 2 moves work only inside a domain.
All FEPLB layers that share an EP group share its domain runtime; it is created on first use
(collectively over the EP group) and closed at exit, on SIGTERM, or by `shutdown()`.
"""
from __future__ import annotations

import atexit
import itertools
import os
import secrets
import signal
import socket
import sys
import threading
import time
from typing import Optional

import torch.distributed as dist

from deepspeed_feplb import exits
from deepspeed_feplb.collectives import gather_small
from deepspeed_feplb.config import FEPLBConfig, FEPLBConfigError
from deepspeed_feplb.memory import device_free_bytes, kept_budget_of
from deepspeed_feplb.migrate import Transport
from deepspeed_feplb.migrate.arena import transport_bytes_per_rank
from deepspeed_feplb.migrate.latency import measure_message_us
from deepspeed_feplb.migrate.shm import ShmTransport
from deepspeed_feplb.plan.cache import planner_cached
from deepspeed_feplb.plan.residency import KeptBytes, resident_budget_bytes
from deepspeed_feplb.scheduler import Scheduler, make_scheduler
from deepspeed_feplb.scheduler.client import start_spare, stop_spare
from deepspeed_feplb.segments import (
    PeerWatch,
    cleanup,
    launcher_tells_ranks_per_host,
    learnt_ranks_per_host,
    ranks_per_host,
)

_RUNTIMES: dict[tuple, "DomainRuntime"] = {}
_LOCK = threading.Lock()


def domain_size(config: FEPLBConfig, ep_size: int) -> int:
    """Ranks per NVLink domain for an EP group of ``ep_size`` ranks ("auto" = local world size)."""
    size = config.nvlink_domain_size
    if size == "auto":
        size = min(ranks_per_host(ep_size), ep_size)
        while ep_size % size:  # the largest divisor of the EP size that fits in one host
            size -= 1
    if ep_size % size:
        raise FEPLBConfigError(f"feplb.nvlink_domain_size: {size} does not divide the expert-parallel size {ep_size}; "
                               f"use a divisor of {ep_size} or \"auto\"")
    return size


def moves_in_domains(config: FEPLBConfig, ep_size: int) -> bool:
    """Whether a layer of an EP group of ``ep_size`` ranks balances inside its NVLink domains (phase
    2: a transport, a scheduler): more than one rank per domain and dynamic experts to move. Only
    such a layer needs its transport, and so, on CUDA, CuPy."""
    return ep_size > 1 and config.dynamic_experts_per_rank > 0 and domain_size(config, ep_size) > 1


def validate_domain_size(config: FEPLBConfig, ep_size: int) -> None:
    """`FEPLBConfigError` naming ``feplb.nvlink_domain_size`` where it does not divide ``ep_size``, or
    where a domain of that size would span hosts (more ranks than a host has, as far as the launcher
    or `learn_ranks_per_host` told)."""
    size = domain_size(config, ep_size)
    per_host = ranks_per_host(0)
    if per_host and (size > per_host or per_host % size):
        raise FEPLBConfigError(f"feplb.nvlink_domain_size: {size} ranks per domain, but there are {per_host} ranks per "
                               f"host, so a domain would span hosts; use a divisor of {per_host}, or \"auto\"")


def learn_ranks_per_host() -> Optional[int]:
    """Ranks per host from every rank's hostname, where the launcher does not tell them (srun,
    mpirun: no ``LOCAL_WORLD_SIZE`` or ``LOCAL_SIZE``); a collective over the world, run by
    `deepspeed_feplb.initialize` on every rank. Domains are runs of consecutive ranks on one host,
    so the ranks must lie host by host (every launcher's default; with srun,
    ``--distribution=block``): `FEPLBConfigError` otherwise, at initialize and not at the first
    balanced micro-batch. Hosts with different rank counts give the smallest. Returns the figure
    (None where the launcher tells it or there is no process group)."""
    if launcher_tells_ranks_per_host() or not dist.is_initialized():
        return None
    hosts = gather_small(socket.gethostname())
    runs = [(host, len(list(ranks))) for host, ranks in itertools.groupby(hosts)]
    if len({host for host, _ in runs}) != len(runs):
        order = ", ".join(f"{host} x{n}" for host, n in runs[:8]) + (", ..." if len(runs) > 8 else "")
        raise FEPLBConfigError(f"feplb.nvlink_domain_size: the ranks are not placed host by host (hosts in rank "
                               f"order: {order}); FEPLB's NVLink domains are consecutive ranks of one host: launch "
                               "the ranks host by host (srun --distribution=block), or set feplb.nvlink_domain_size "
                               "to 1 (no balancing)")
    per_host = min(n for _, n in runs)
    learnt_ranks_per_host(per_host)
    return per_host


def reclaim_leftovers(min_age_s: float = 10.0) -> list[str]:
    """Remove the ``feplb-`` segments that killed jobs left in /dev/shm (no live process maps them,
    and they are older than ``min_age_s``: another job's that is starting up may not map its own
    yet), saying so once; returns their names. A domain's first rank calls it before creating its
    own, so a SIGKILLed job's memory is reclaimed by the next job."""
    names = cleanup(keep_in_use=True, min_age_s=min_age_s)
    if names:
        print(f"deepspeed_feplb: removed {len(names)} shared-memory segment(s) that killed FEPLB jobs left in "
              "/dev/shm", flush=True)
    return names


class DomainRuntime:
    """This rank's view of its domain: ``local_rank`` in ``[0, size)``, ``ranks`` (global ranks),
    ``transport`` (a `migrate.Transport`), ``scheduler`` (a `scheduler.Scheduler`), ``watch``,
    ``kept_bytes`` (the `plan.residency.KeptBytes` its layers' kept copies share)."""

    transport: Transport
    scheduler: Scheduler

    def __init__(self, ep_group, config: FEPLBConfig, transport_cls: type = ShmTransport, device=None,
                 slot_bytes: int = 0):
        ep_ranks = dist.get_process_group_ranks(ep_group)
        ep_rank = ep_ranks.index(dist.get_rank())
        self.size = domain_size(config, len(ep_ranks))
        self.local_rank = ep_rank % self.size
        first = ep_rank - self.local_rank
        self.ranks = ep_ranks[first:first + self.size]  # global ranks of the domain
        self.config = config
        self.seq = 0

        # Agree on segment names and check that a domain never spans hosts.
        info = gather_small((secrets.token_hex(4), socket.gethostname(), os.getpid(),
                             transport_cls.device_id(device), device_free_bytes(device)), group=ep_group, device=device)
        hosts = {info[first + i][1] for i in range(self.size)}
        if len(hosts) > 1:
            raise FEPLBConfigError(f"feplb.nvlink_domain_size: domain of ranks {self.ranks} spans hosts "
                                   f"{sorted(hosts)}; set it to the number of ranks per host")
        # every rank refuses alike what any rank of the group cannot open (peer access, memory)
        problems = transport_cls.preflight(device, slot_bytes, self.local_rank, self.ranks,
                                           [info[first + i][3] for i in range(self.size)])
        problems = [p for rank_problems in gather_small(problems, group=ep_group, device=device) for p in rank_problems]
        if problems:
            raise FEPLBConfigError(f"FEPLB cannot open the phase-2 transport ({transport_cls.__name__}) of its "
                                   "domains: " + "; ".join(problems))
        self.name = f"feplb-{info[first][0]}"
        budget = kept_budget_of(ep_ranks, self.size)  # known at `deepspeed_feplb.initialize`
        if budget is None:  # a layer used without it: the same rule on what is free now, beside the slots
            slots = transport_bytes_per_rank(self.size, slot_bytes)
            budget = resident_budget_bytes(config.resident_budget_mb,
                                           [None if info[first + i][4] is None else info[first + i][4] - slots
                                            for i in range(self.size)])
        self.kept_bytes = KeptBytes(self.size, budget)
        if self.local_rank == 0 and not planner_cached():
            print("deepspeed_feplb: first use on this machine: numba compiles the planner once, in the scheduler "
                  "process (15-40 s on a slow 2-core machine; training goes on unbalanced meanwhile); later runs load "
                  "it from numba's cache", flush=True)
        sched = config.scheduler
        leader = self.local_rank == 0
        self.watch = PeerWatch([info[first + i][2] for i in range(self.size)], self.ranks)
        if leader:
            reclaim_leftovers()
            self._open(transport_cls, sched, create=True, device=device, slot_bytes=slot_bytes)
        dist.barrier(group=ep_group)
        if not leader:
            self._open(transport_cls, sched, create=False, device=device, slot_bytes=slot_bytes)
        self.closed = False
        dist.barrier(group=ep_group)  # every transport of the domain is open
        # the planner prices each message at what this transport measures here, not at a constant
        try:
            self.transport.message_us = measure_message_us(self.transport, self.local_rank, self.size, device)
        except BaseException:
            self.close()
            raise

    def _open(self, transport_cls: type, sched, create: bool, device, slot_bytes: int) -> None:
        self.transport = transport_cls(self.name, self.local_rank, self.size, sched.peer_timeout_s, create=create,
                                       watch=self.watch, device=device, slot_bytes=slot_bytes)
        self.scheduler = make_scheduler(sched, f"{self.name}-mbox", self.local_rank, self.size, create, self.watch,
                                        moves_at_once=moves_at_once(self.config))

    def next_seq(self) -> int:
        seq, self.seq = self.seq, self.seq + 1
        return seq

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.scheduler.close()  # first: the leader's transport close removes every segment of the domain
            self.transport.close()
            if self.local_rank != 0 and not self.watch.alive(0):
                # the leader died before removing them: no rank can use the domain any more (its names
                # are this job's own), and a rank that still maps one keeps its memory until it unmaps
                cleanup(prefix=f"{self.name}-")


def moves_at_once(config: FEPLBConfig) -> bool:
    """Whether a domain's first plans may move rows before its scheduler process serves (costs
    not measured, or a row bound to keep): then a rank plans itself meanwhile (`make_scheduler`)."""
    return config.fixed_costs == "ignore" or config.max_rows_over_mean is not None


def start_planner_early(config: FEPLBConfig, ep_group) -> None:
    """Where this rank will lead a domain of ``ep_group`` whose scheduler process starts with the
    domain (mode "process", measured costs), start that process now, while DeepSpeed builds the
    engine (`scheduler.client.start_spare`): the domain opens once the experts are timed (the
    second micro-batch), and its first plan then finds the planner loaded. A rank that never opens
    a domain stops the spare at exit (`shutdown`). Called where a layer learns its EP group."""
    if not (config.enabled and config.dynamic_experts_per_rank > 0 and config.scheduler.mode == "process"):
        return
    if moves_at_once(config) and config.scheduler.start_after_steps > 0 and planner_cached():
        return  # the process starts after `start_after_steps`: short runs never pay for it
    ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
    try:
        size = domain_size(config, ep_size)
    except FEPLBConfigError:
        return  # said where the layer checks its domain (`validate_domain_size`), not here
    if ep_size > 1 and size > 1 and dist.get_rank(ep_group) % size == 0:
        install_exit_handlers()
        start_spare()


def get_runtime(ep_group, config: FEPLBConfig, transport_cls: type = ShmTransport, device=None,
                slot_bytes: int = 0) -> DomainRuntime:
    """This rank's runtime for ``ep_group`` (created collectively over the group on first use);
    ``device``: where this rank's experts live (the transport's buffers and streams go there);
    ``slot_bytes``: each receive slot's size (`migrate.arena.slot_bytes`), fixed when it opens."""
    key = (tuple(dist.get_process_group_ranks(ep_group)), domain_size(config, dist.get_world_size(ep_group)),
           transport_cls, str(device))
    with _LOCK:
        runtime = _RUNTIMES.get(key)
        if runtime is None or runtime.closed:
            install_exit_handlers()
            runtime = _RUNTIMES[key] = DomainRuntime(ep_group, config, transport_cls, device, slot_bytes)
        return runtime


def dead_peers(wait_s: float = 0.0) -> list[str]:
    """``"rank R (pid P)"`` of every domain peer of this process that is no longer alive, waiting
    up to ``wait_s`` for one to be seen dead (a killed peer's sockets close while its process is
    still being torn down, so a collective can fail a moment before the peer looks dead)."""
    with _LOCK:
        watches = [runtime.watch for runtime in _RUNTIMES.values() if not runtime.closed]
    deadline = time.monotonic() + wait_s
    while True:
        dead = sorted({f"rank {w.ranks[r]} (pid {w.pids[r]})" for w in watches for r in range(len(w.pids))
                       if not w.alive(r)})
        if dead or not watches or time.monotonic() >= deadline:
            return dead
        time.sleep(0.05)


def shutdown() -> None:
    """Stop scheduler processes and remove this rank's shared memory (idempotent)."""
    global _shutting_down
    _shutting_down = True
    try:
        with _LOCK:
            for runtime in _RUNTIMES.values():
                runtime.close()
            _RUNTIMES.clear()
            stop_spare()
    finally:
        _shutting_down = False


_installed = False
_shutting_down = False
_exiting = False


def _at_exit() -> None:
    global _exiting
    _exiting = True  # from here on the interpreter only exits: see `_on_sigterm`
    shutdown()
    _let_gloo_workers_settle()


def _let_gloo_workers_settle(timeout_s: float = 0.5) -> None:
    """Sleep (releasing the GIL) at least twice, until no gloo worker thread (``pt_gloo_runloop``)
    is running, so that a worker still finishing its last collective does it before finalization.

    Nothing destroys the process groups at exit (DeepSpeed and the model hold them), so their
    workers live into interpreter finalization. A worker that still holds its last collective's
    tensors then takes the GIL to free them, and Python 3.11 ends such a thread with pthread_exit
    inside a noexcept destructor: "terminate called without an active exception" (SIGABRT) after
    the program's last line (PyTorch PR 179291). A mitigation, not a proof: a worker waiting for
    the GIL looks asleep here (it gets the GIL during these sleeps). Linux only (it reads
    /proc/self/task); elsewhere, and after ``timeout_s``, it returns."""
    deadline, calm = time.monotonic() + timeout_s, 0
    while calm < 2 and time.monotonic() < deadline:
        time.sleep(0.005)  # without the GIL: a worker waiting for it finishes now
        try:
            tasks = os.listdir("/proc/self/task")
        except OSError:
            return
        busy = False
        for tid in tasks:
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            name, state = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2]
            busy |= name == "pt_gloo_runloop" and state not in "SD"
        calm = 0 if busy else calm + 1


def _on_sigterm(signum, frame) -> None:
    """Exit normally, so that the exit handlers remove the segments. A SIGTERM that arrives after a
    Ctrl-C (the launcher sends one), or while exit handlers run, is ignored: the process is
    exiting already, and raising in an exit handler would print a traceback and skip cleanup."""
    if not (_shutting_down or _exiting or exits.interrupted()):
        sys.exit(128 + signum)


def install_exit_handlers() -> None:
    """One line instead of a traceback per rank on a Ctrl-C or a configuration mistake (`exits`),
    and every domain runtime closed at exit or on SIGTERM; idempotent. A FEPLB layer installs it
    at its first forward, before it has a domain (it may never need one)."""
    global _installed
    if _installed:
        return
    _installed = True
    exits.install(dead_peers)
    atexit.register(_at_exit)
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        # default SIGTERM kills without running atexit; exit normally instead so segments are removed
        signal.signal(signal.SIGTERM, _on_sigterm)
