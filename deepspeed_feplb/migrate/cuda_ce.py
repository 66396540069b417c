"""Phase-2 transport on the Copy Engine: stream-ordered messages through CUDA IPC peer rings.

Same interface and message semantics as `deepspeed_feplb.migrate.shm.ShmTransport`
(``send(dst, tag, tensors) -> Future``, ``recv(src, tag) -> list[Tensor]``, ``close()``), so
`migrate.phase2` runs on it unchanged.

Design (docs/ARCHITECTURE.md "Phase 2"; docs/GPU.md): the host *enqueues* a message and does not
wait for the device; the receiving stream orders itself on a flag word.

* **Push into peer memory.** Every rank owns one inbound allocation per peer (a plain
  ``cudaMalloc``, fixed for the transport's life): a *ring* of `arena.RING_SLOTS` slots. The
  sender opens it by its IPC handle once and writes each part of a message into the next ring
  slot with one ``cudaMemcpyAsync(kind=Default)`` per tensor piece (an expert's weights and its
  token chunk are each one contiguous copy). Between two GPUs that copy runs on the Copy Engine,
  using no SM.
* **Flags.** Parts are numbered per link (n = 1, 2, ...). Each link has two 32-bit flag words in
  the domain's shared-memory control block, page-locked for the device (`register_host`): ``SEQ``
  (parts written) and ``ACK`` (parts read). After part n's copies the sender's copy stream writes
  n onto ``SEQ`` (``cuStreamWriteValue32``, which fences the stream's earlier writes; host memory
  takes it, where since CUDA 13.1 another GPU's memory would not); the receiver's stream waits
  until ``SEQ`` reached n (``cuStreamWaitValue32``, GEQ: a cyclic comparison, so the numbers
  wrap), copies the part out into the caller's tensors, and writes ``ACK`` the same way. The
  compute stream only waits (an event) for that copy-out.
* **Host flags where the driver lacks stream memory operations** (probed when the transport
  opens; one warning says why): the same protocol, but the host stores a flag once an event
  after the stream's work completed (the background thread polls those events, flag by flag), and
  the receiver's host waits for ``SEQ`` before it enqueues the copy-out: the old handshake's
  cost, with the rings and credits of this one.
* **Credits on the host, waits only for work already enqueued.** A ring slot is reused only when
  the sender's host sees (``ACK``, host memory) that the part before in it was read; until then
  the part waits on the host in a queue that every later call of the transport (and every wait in
  it) advances. The receiver enqueues its wait for part n only once the sender's host enqueued
  part n (``ENQUEUED``). So every stream wait is for device work that was enqueued before it, and
  the copy streams never wait on a peer: no cycle of waits can form, even where CUDA maps several
  streams onto one hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS``). A message that fits the
  free ring slots is enqueued whole by its `send`.
* **Streams within the hardware queues.** Peers share send streams, and receive streams, round
  robin (`copy_streams`): with a side stream, the caller's compute stream and phase 2's served
  stream (`phase2.served_stream`) they fit ``CUDA_DEVICE_MAX_CONNECTIONS`` (8 by default: 2 each
  way; the replica slots' relay stream, `integration.replicas.relay_stream`, which holds the early
  relay's waits, is the eighth), where
  a stream per peer (15 at 8 GPUs) made CUDA map several onto one queue anyway.
* **Descriptions on the host.** What a message holds (tag, tensor dtypes, shapes and offsets) is
  published in the control block (`MESSAGES` entries per link) as soon as its send is called
  and an entry is free; the receiver's host reads it without waiting for the device.
* **Memory of sent tensors** stays referenced, with an event recorded after their copies, until a
  later call finds that event complete: the caching allocator cannot hand it out while a copy
  still reads it. The receiver's copy-out waits for the caller's stream first, since the caller
  allocated the destination tensors on it; a message of more parts than the ring has slots is
  read into a staging buffer of the receive stream's own first, so that its parts are
  acknowledged (and later parts sent) without waiting for the caller's stream: the receiver's
  host never waits for its own GPU.
* **Slots are fixed**: allocated when the domain opens, never grown or freed until `close`, so no
  step pays a ``cudaMalloc``, a ``cudaFree`` (a device-wide sync) or a new IPC handle.
* **A dead peer is an error, not a hung GPU.** With a `segments.PeerWatch`, the transport's
  background thread (off the critical path, the one that also enqueues deferred parts) checks
  the peers' processes; for one that died it keeps this rank's ``SEQ`` flags for it stored far
  ahead (a plain CPU store: the flags are host memory), so no stream of ours waits for it
  forever, and the next call of the transport raises `segments.PeerDiedError` naming the rank.
* **Teardown**: drain our streams, close every peer mapping, announce it, wait (bounded) until the
  peers did the same, then free (CUDA leaves freeing a still-mapped allocation undefined; a peer
  that neither unmapped nor died keeps our memory, with a warning).

The device work goes through a backend (`backend.CudaBackend`); `backend.HostBackend` runs the
identical protocol on host shared memory, streams as threads, which is how CPU machines test
this module.
"""
from __future__ import annotations

import collections
import os
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from deepspeed_feplb.migrate import wire
from deepspeed_feplb.migrate.arena import RING_SLOTS, inbound_bytes, message_layout, ring_capacity
from deepspeed_feplb.migrate.backend import flag_reached
from deepspeed_feplb.once import first_time
from deepspeed_feplb.segments import (
    WATCH_EVERY_S,
    PeerDiedError,
    PeerTimeoutError,
    Word,
    Words,
    describe_rank,
    open_segment,
    peer_check,
    unlink_quietly,
    wait_until,
)

DEFAULT_SLOT_BYTES = 64 << 20
DEFAULT_MAX_TENSORS = 256
MESSAGES = 4  # message descriptions per link in the control block

# words of a channel (src -> dst) in the control block: POSTED / TAKEN count the messages whose
# description the sender published / the receiver read, ENQUEUED the parts the sender enqueued;
# BELL counts the sender's changes to POSTED and ENQUEUED (the one word a receiver's host sleeps
# on: one wake-up per send; nobody sleeps on TAKEN, the sender's host polls it); GEN is 1 once the
# receiver published its inbound allocation (handle at RING_H, 8 words), CAP its ring slots'
# bytes; the flags SEQ_FLAG and ACK_FLAG (low 32 bits; each on a 64-byte line of its own, since
# the device polls them); descriptions from ENTRIES
POSTED, TAKEN, GEN, CAP, ENQUEUED, BELL = range(6)
RING_H = 8
SEQ_FLAG, ACK_FLAG = 16, 24
ENTRIES = 32
# an entry: a message's description (`wire.message_words`)
# the diagonal channel (r, r) carries rank r's state
ALIVE, IMPORTS_CLOSED, HOST_FLAGS = 0, 1, 2
RELEASE = 1 << 30  # a flag this far ahead meets every wait queued before it (cyclic comparison)


def part_ranges(nbytes: int, capacity: int):
    """The byte ranges ``[lo, hi)`` of a message of ``nbytes`` that travel as parts through ring
    slots of ``capacity`` bytes (one part for an empty message). A slot of no bytes is refused:
    it would give empty parts without end (a list of them fills the memory; the peer times out)."""
    if capacity <= 0:
        raise ValueError(f"FEPLB phase-2 transport: ring slots of {capacity} bytes cannot carry a message of {nbytes} "
                         "bytes; feplb.transport_slot_mb must be at least 1/1024 MiB (1 KiB)")
    lo = 0
    while True:
        hi = min(nbytes, lo + capacity)
        yield lo, hi
        if hi >= nbytes:
            return
        lo = hi


def part_copies(pieces: list[tuple[int, int, int]], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """The copies of part ``[lo, hi)`` of a message whose tensors lie at ``pieces`` ((address,
    byte offset in the message, bytes) each): ``[(offset in the part, address, bytes)]``, one per
    tensor with bytes in the part."""
    copies = []
    for ptr, offset, size in pieces:
        start, end = max(offset, lo), min(offset + size, hi)
        if end > start:
            copies.append((start - lo, ptr + start - offset, end - start))
    return copies


def preflight_problems(me: int, ranks: Sequence[int], devices: Sequence[str], slot: int, free_bytes: int,
                       ordinal: Callable[[str], Optional[int]], can_access: Callable[[int, int], bool]) -> list[str]:
    """What keeps local rank ``me`` of a domain (global ``ranks``, their GPUs' UUIDs ``devices``)
    from opening its CE transport: a peer's GPU it does not see (``ordinal(uuid)`` None) or cannot
    reach by peer access, or ``(G - 1)`` inbound rings of ``slot`` bytes (`arena.inbound_bytes`)
    beyond its ``free_bytes``; each problem names the ranks or the bytes and what to change. Ranks
    on one GPU need no peer access."""
    problems = []
    mine = ordinal(devices[me])
    for peer, device in enumerate(devices):
        if device == devices[me]:
            continue
        theirs = ordinal(device)
        if theirs is None:
            problems.append(f"rank {ranks[me]} does not see the GPU of rank {ranks[peer]} ({device}): CUDA IPC "
                            "between them needs every GPU of the domain visible to every rank (CUDA_VISIBLE_DEVICES)")
        elif not can_access(mine, theirs):
            problems.append(f"rank {ranks[me]} (cuda:{mine}) has no peer access to rank {ranks[peer]} (cuda:{theirs}); "
                            "set feplb.nvlink_domain_size to the ranks that share an NVLink domain")
    need = (len(ranks) - 1) * inbound_bytes(slot)
    if need > free_bytes:
        problems.append(f"rank {ranks[me]} has {free_bytes / 2**20:,.0f} MiB of device memory free and its phase-2 "
                        f"slots need {len(ranks) - 1} x {slot / 2**20:,.1f} = {need / 2**20:,.0f} MiB; lower "
                        "feplb.transport_slot_mb (larger messages then travel in parts) or "
                        "feplb.dynamic_experts_per_rank")
    return problems


def hardware_queues() -> int:
    """The hardware queues CUDA maps this process's streams onto: ``CUDA_DEVICE_MAX_CONNECTIONS``
    (CUDA's own variable; 8 when unset, at most 32)."""
    try:
        return min(max(int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8")), 1), 32)
    except ValueError:
        return 8


def copy_streams(peers: int, queues: int) -> int:
    """Send streams of a rank with ``peers`` domain peers (and as many receive streams), so that its
    streams fit CUDA's ``queues`` hardware queues: the transport's 2k + 1 (the side stream) beside
    the caller's compute stream and the stream a helper serves its homes' chunks on
    (`phase2.served_stream`: a served kernel queued behind a copy that waits would wait too), at
    least one each way, at most one per peer. Streams beyond the
    queues share them, and an operation that waits then holds up whatever is queued behind it,
    of every stream; peers that share a stream are ordered no more strictly than that (the
    protocol waits only for work already enqueued, so neither deadlocks). With fewer than 4
    queues the transport still needs its 3 streams; `CudaCETransport` says so once."""
    return max(1, min(peers, (queues - 3) // 2))


def _warn_few_queues(queues: int) -> None:
    if first_time("few hardware queues"):
        warnings.warn(f"FEPLB: CUDA_DEVICE_MAX_CONNECTIONS={queues} leaves fewer hardware queues than phase 2's "
                      "copy streams (a send, a receive and a side stream), its served stream and the compute stream "
                      "need: they share "
                      "queues, so a copy that waits for a peer holds up the compute queued behind it on its queue",
                      RuntimeWarning, stacklevel=3)


def _warn_host_flags(why: str) -> None:
    """Say once per process that phase 2 runs on host flags, and why."""
    if first_time("host flags"):
        warnings.warn(f"FEPLB: this GPU's driver does not run CUDA stream memory operations ({why}); phase 2 "
                      "signals its messages from the host instead, which puts the host on their critical path "
                      "(a background thread polls each message's copies every 0.2 ms). An NVIDIA driver for "
                      "CUDA 11.7 or newer runs them.", RuntimeWarning, stacklevel=3)


_SENT: Future = Future()  # what every `send` returns: done (its copies are enqueued or queued on the host)
_SENT.set_result(None)


def entry_words(max_tensors: int) -> int:
    """Words of one entry: the description of a message of up to ``max_tensors`` tensors."""
    return wire.description_words(max_tensors)


def channel_words(max_tensors: int) -> int:
    return ENTRIES + MESSAGES * entry_words(max_tensors)


def _put_handle(words: np.ndarray, at: int, handle: bytes) -> None:
    words[at:at + 8] = np.frombuffer(bytes(handle).ljust(64, b"\0")[:64], dtype=np.int64)


def _get_handle(words: np.ndarray, at: int) -> bytes:
    return words[at:at + 8].copy().tobytes()


@dataclass
class _Outgoing:
    """A message `send` accepted whose description or parts are not all out yet."""
    tag: int
    tensors: list
    offsets: list
    nbytes: int
    parts: list  # (lo, hi) byte ranges, one per ring slot it takes
    pieces: list  # (address, offset, bytes) of each tensor (`part_copies`)
    ready: Optional[int] = None  # an event to wait for before its first part (queued behind others), ours
    enqueued: int = 0  # parts enqueued on the copy stream so far
    described: int = 0  # its number on the link once its description is published


class CudaCETransport:
    """Moves lists of tensors between the ranks of one NVLink domain by stream-ordered Copy-Engine copies.

    Args (the first five as `ShmTransport`'s):
        name: unique prefix of this domain's host control segment (starts with ``feplb-``).
        local_rank: this rank's index in the domain.
        size: ranks in the domain.
        timeout_s: how long a host waits for a peer's host before raising `PeerTimeoutError`.
        create: True on the domain's rank 0, which creates the control block; it must be
            constructed before the others (the caller's barrier), as with `ShmTransport`.
        watch: a `segments.PeerWatch`: host waits fail fast, naming the rank, when a peer died, and
            the background thread releases this rank's streams from waits on it (module docstring).
        device: the CUDA device of this rank's experts, where rings and streams go (default:
            torch's current device).
        backend: a `CudaBackend` (default: on ``device``) or `HostBackend`.
        slot_bytes: bytes of each inbound ring (`arena.inbound_bytes`), fixed for the transport's
            life (`arena.slot_bytes`); larger messages travel in parts.
        max_tensors: most tensors in one message.
        first_flag: the flags' value before the first part (every rank of the domain passes the
            same); a value near 2**32 makes the 32-bit sequence numbers wrap early (tests).
    """

    # One-way latency of a small message (µs) before the domain measures it on the open transport
    # (`latency.measure_message_us`): the H200 figure of this transport's earlier host handshake
    # (228 µs, docs/GPU.md), a pessimistic prior for deciding whether to open a domain at all.
    message_us = 230.0

    def __init__(self, name: str, local_rank: int, size: int, timeout_s: float, create: bool, watch=None, *,
                 device=None, backend=None, slot_bytes: int = DEFAULT_SLOT_BYTES,
                 max_tensors: int = DEFAULT_MAX_TENSORS, first_flag: int = 0):
        if ring_capacity(slot_bytes) <= 0:  # before any resource: a ring of no bytes carries nothing (`part_ranges`)
            raise ValueError(f"FEPLB phase-2 transport: slot_bytes={slot_bytes} gives ring slots of no bytes; "
                             "feplb.transport_slot_mb must be at least 1/1024 MiB (1 KiB)")
        if backend is None:
            from deepspeed_feplb.migrate.backend import CudaBackend
            backend = CudaBackend(device)
        self.name, self.local_rank, self.size, self.timeout_s = name, local_rank, size, timeout_s
        self.backend, self.max_tensors, self.watch = backend, max_tensors, watch
        self._first_flag = int(first_flag)
        self._entry = entry_words(max_tensors)
        self.closed = False
        self._failure: Optional[BaseException] = None
        self._peers = [r for r in range(size) if r != local_rank]
        self._parts_sent = dict.fromkeys(self._peers, 0)  # per destination: parts enqueued (n of the last)
        self._parts_read = dict.fromkeys(self._peers, 0)  # per source: parts whose copy-out is enqueued
        self._posted = dict.fromkeys(self._peers, 0)  # messages whose description we published, per destination
        self._taken = dict.fromkeys(self._peers, 0)  # messages whose description we read, per source
        self._extra_parts = dict.fromkeys(self._peers, 0)
        self._outgoing = {dst: collections.deque() for dst in self._peers}  # _Outgoing not fully out, in order
        self._in_flight = {dst: collections.deque() for dst in self._peers}  # (copied event, tensors)
        self._capacity = ring_capacity(slot_bytes)
        queues = hardware_queues()
        self.streams_each_way = copy_streams(size - 1, queues)
        self._poison = bool(getattr(self.backend, "poison_released", False))  # `HostBackend`, for ordering tests
        self._lock = threading.RLock()  # the sending side's state: callers and the background thread
        self._stop, self._wake = threading.Event(), threading.Event()
        self._dead: set[int] = set()  # peers found dead (their flags are kept released)
        # resources, released by `_free_local` (also when opening fails halfway)
        self._control_shm = self._control = self._control_ptr = self._words = None
        self._inbound: dict[int, int] = {}  # peer -> our allocation for it (its ring)
        self._mapped: dict[int, int] = {}  # peer -> its inbound allocation for us, opened
        self._streams: dict[int, int] = {}  # dst -> copy stream
        self._recv_streams: dict[int, int] = {}  # src -> receive stream
        self._events: dict[str, dict[int, int]] = {"caller_at": {}, "done": {}, "ready": {}}
        self._spare_events: list[int] = []  # completed events to record again (cheaper than creating one)
        self._peer_capacity: dict[int, int] = {}  # dst -> bytes of its ring slots (its CAP)
        self._side: Optional[int] = None  # a stream that snapshots a send's ready point for deferred parts
        self._signals: dict[tuple, collections.deque] = {}  # host flags: (src, dst, field) -> (event, value)s
        self._owns_control = create
        try:
            if 2 * self.streams_each_way + 3 > queues:
                _warn_few_queues(queues)
            with backend.on_device():
                why = backend.probe_flags()
                self.stream_flags = not why  # False: the host stores and waits for the flags
                if why:
                    _warn_host_flags(why)
                self._open(create, slot_bytes)
        except BaseException:
            self._free_local(rings=True)
            raise
        self._background = threading.Thread(target=self._run_background, name=f"feplb-ce-{local_rank}", daemon=True)
        self._background.start()
        self._control[local_rank, local_rank, HOST_FLAGS] = int(not self.stream_flags)  # before its first part
        self._control[local_rank, local_rank, ALIVE] = 1

    def _open(self, create: bool, slot_bytes: int) -> None:
        backend, size, words = self.backend, self.size, channel_words(self.max_tensors)
        self._control_shm = open_segment(f"{self.name}-cectl", size * size * words * 8, create=create)
        self._control = np.ndarray((size, size, words), dtype=np.int64, buffer=self._control_shm.buf)
        if create:
            self._control[:] = 0
            self._control[:, :, SEQ_FLAG] = self._control[:, :, ACK_FLAG] = self._flag(0)
        self._words = Words(self._control)
        if self.stream_flags:  # whole pages (the mapping has them): the device polls the flags in it
            ptr = self._control.ctypes.data
            try:
                self._control_device = backend.register_host(ptr, -(-self._control.nbytes // 4096) * 4096)
            except Exception as exc:  # noqa: BLE001 - the probe's page registered, this block did not
                self.stream_flags = False
                _warn_host_flags(f"{type(exc).__name__}: {exc}")
            else:
                self._control_ptr = ptr
        for peer in self._peers:
            self._inbound[peer] = backend.malloc(inbound_bytes(slot_bytes))
        for peer in self._peers:
            channel = self._control[peer, self.local_rank]
            _put_handle(channel, RING_H, backend.ipc_handle(self._inbound[peer]))
            channel[CAP] = self._capacity
            channel[GEN] = 1  # publish last: the peer maps the allocation once it sees this
            self._notify(peer, self.local_rank, GEN)
        sending, receiving = ([backend.stream_create() for _ in range(self.streams_each_way)] for _ in range(2))
        for i, peer in enumerate(self._peers):  # peers share a stream round robin (`copy_streams`)
            self._streams[peer] = sending[i % len(sending)]
            self._recv_streams[peer] = receiving[i % len(receiving)]
            self._events["caller_at"][peer] = backend.event_create()  # recv: the caller's stream, now
            self._events["done"][peer] = backend.event_create()  # recv: the copy-out, done
            self._events["ready"][peer] = backend.event_create()  # send: the caller's stream, now
        self._side = backend.stream_create()

    @staticmethod
    def device_id(device: torch.device) -> str:
        """The UUID of ``device``'s GPU, by which the ranks of a domain tell each other their GPUs."""
        return str(torch.cuda.get_device_properties(torch.device(device)).uuid)

    @staticmethod
    def preflight(device: torch.device, slot: int, local_rank: int, ranks: Sequence[int],
                  devices: Sequence[str]) -> list[str]:
        """`preflight_problems` of this rank on ``device``. Torch's cached free blocks go back to the
        driver first when the rings would not fit beside them."""
        free = torch.cuda.mem_get_info(device)[0]
        if (len(ranks) - 1) * inbound_bytes(slot) > free:
            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info(device)[0]
        uuids = {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}
        return preflight_problems(local_rank, ranks, devices, slot, free, uuids.get, torch.cuda.can_device_access_peer)

    def _flag(self, n: int) -> int:
        """The 32-bit flag value of part number ``n`` of a link (0: none yet)."""
        return (self._first_flag + n) & 0xFFFFFFFF

    def _flag_at(self, src: int, dst: int, field: int) -> int:
        """Device address of flag ``field`` (`SEQ_FLAG`, `ACK_FLAG`) of link ``src -> dst``."""
        return self._control_device + ((src * self.size + dst) * self._control.shape[2] + field) * 8

    def _word(self, src: int, dst: int, field: int) -> Word:
        """Word ``field`` of channel ``src -> dst`` (``src == dst``: that rank's state) to sleep on."""
        return self._words[src, dst, field]

    def _notify(self, src: int, dst: int, field: int) -> None:
        self._word(src, dst, field).notify()

    def _signal(self, stream: int, src: int, dst: int, field: int, value: int) -> None:
        """Flag ``field`` of link ``src -> dst`` reaches ``value`` once the work queued on ``stream``
        so far ran: the stream writes it, or (host flags) an event recorded now lets the host store
        it (`_store_signals`)."""
        if self.stream_flags:
            self.backend.stream_write_value32(stream, self._flag_at(src, dst, field), value)
            return
        with self._lock:
            event = self._event()
            self.backend.event_record(event, stream)
            self._signals.setdefault((src, dst, field), collections.deque()).append((event, value))
        self._wake.set()

    def _store_signals(self) -> None:
        """Host flags: store each flag's newest value whose stream work ran. Each flag keeps its own
        order (its values are recorded on one stream); flags never wait for each other."""
        with self._lock:
            for (src, dst, field), queued in self._signals.items():
                value = None
                while queued and self.backend.event_query(queued[0][0]):
                    event, value = queued.popleft()
                    self._spare_events.append(event)
                if value is not None:
                    self._control[src, dst, field] = value
                    if field == SEQ_FLAG:  # a receiver's host sleeps on it; nobody on ACK (its sender polls)
                        self._notify(src, dst, field)

    def _signalling(self) -> bool:
        """Host flags: whether a flag waits for its stream work to run."""
        return any(self._signals.values())

    def _await(self, stream: int, src: int, dst: int, field: int, value: int, what: str, **values) -> None:
        """The work queued on ``stream`` from now on waits until flag ``field`` of link ``src -> dst``
        reached ``value``: on the device, or (host flags) here, on the host."""
        if self.stream_flags:
            self.backend.stream_wait_value32(stream, self._flag_at(src, dst, field), value)
            return
        flags = self._control[src, dst]
        # a peer on stream flags writes the flag from its device, which wakes nobody: poll then
        word = (src, dst, field) if self._control[src, src, HOST_FLAGS] else None
        self._wait(lambda: flag_reached(flags[field], value), src, word, what, **values)

    def _check_open(self) -> None:
        if self._failure is not None:
            raise type(self._failure)(str(self._failure)) from self._failure
        if self.closed:
            raise RuntimeError(f"FEPLB transport {self.name} is closed")

    def _wait(self, condition, peer: int, field: Optional[tuple], what: str, **values) -> None:
        """Wait on the host for a peer's host (``condition()``), moving our own queued messages on
        meanwhile (they may be what the peer waits for); sleeps on the word ``field`` (src, dst,
        index) that the peer rings, or polls without one. ``what.format(**values)`` names the
        wait in a time-out (formatted only then: most waits are met at once)."""
        if condition():
            return
        pending = any(self._outgoing.values())

        def ready() -> bool:
            if pending:
                self._advance()
            return condition()
        # parts of ours waiting for a ring slot are freed by a device write, which wakes nobody: poll then
        wait_until(ready, self.timeout_s, f"{describe_rank(self.watch, peer)} of domain {self.name} "
                   f"{what.format(**values)}",
                   peer_check(self.watch, peer), word=None if pending or field is None else self._word(*field))

    def _map(self, peer: int) -> int:
        """``peer``'s inbound allocation for us (its ring for our messages), opened once."""
        if peer not in self._mapped:
            channel = self._control[self.local_rank, peer]
            self._wait(lambda: channel[GEN] >= 1, peer, (self.local_rank, peer, GEN), "to start")
            self._mapped[peer] = self.backend.ipc_open(_get_handle(channel, RING_H))
            self._peer_capacity[peer] = int(channel[CAP])
        return self._mapped[peer]

    def _event(self) -> int:
        return self._spare_events.pop() if self._spare_events else self.backend.event_create()

    # ---------------------------------------------------------------- producer side
    def mark(self) -> int:
        """An event recorded on the caller's current stream now: `send` with ``after=`` it copies
        once the work queued before it is done (phase 2's rows: right after phase 1, before the
        static experts are queued)."""
        event = self.backend.event_create()
        self.backend.event_record(event, self.backend.current_stream())
        return event

    def release(self, mark: Optional[int]) -> None:
        """Destroy a `mark` once its sends are queued (CUDA frees it when the streams waiting on it pass it)."""
        if mark is not None:
            self.backend.event_destroy(mark)

    def send(self, dst: int, tag: int, tensors: list[torch.Tensor], after: Optional[int] = None) -> Future:
        """Enqueue ``tensors`` for ``dst``; returns a future that is already done.

        The copies start when the caller's current stream reaches this call, or the `mark`
        ``after``. Parts that find no free ring slot (the receiver has not read the parts before
        in it) wait on the host and are enqueued by a later call of the transport or its
        background thread; the host never waits for the device here. The tensors' memory is kept
        from reuse until the copies ran; they must not be modified afterwards, on any stream.
        """
        self._check_open()
        if dst == self.local_rank:
            raise ValueError("a rank does not send to itself")
        if dst not in self._streams:
            raise ValueError(f"no local rank {dst} in a domain of {self.size}")
        if len(tensors) > self.max_tensors:
            raise ValueError(f"a message holds at most {self.max_tensors} tensors, got {len(tensors)}")
        wire.check(tensors)
        if after is not None and not all(t.is_contiguous() for t in tensors):
            after = None  # their contiguous copies are queued now, after the mark
        tensors = [t.detach().contiguous() for t in tensors]
        offsets, nbytes = message_layout([(t.dtype, t.shape) for t in tensors])
        self._map(dst)
        message = _Outgoing(tag, tensors, offsets, nbytes, list(part_ranges(nbytes, self._peer_capacity[dst])),
                            [(t.data_ptr(), offset, t.nbytes) for t, offset in zip(tensors, offsets)])
        backend = self.backend
        with self._lock:
            ready = after
            if ready is None:
                ready = self._events["ready"][dst]
                backend.event_record(ready, backend.current_stream())
            if self._outgoing[dst]:
                # queued behind parts that wait for ring slots: snapshot the ready point on the side
                # stream, so that those earlier parts do not wait for it
                message.ready = self._event()
                backend.stream_wait_event(self._side, ready)
                backend.event_record(message.ready, self._side)
            else:
                backend.stream_wait_event(self._streams[dst], ready)  # a local event: the copies follow the data
            self._outgoing[dst].append(message)
            self._advance()
            if self._outgoing[dst]:
                self._wake.set()  # the background thread moves it on while the caller does other work
        return _SENT

    def _advance(self) -> None:
        """Move every link's queued messages on as far as the receivers allow (parts into free ring
        slots, then descriptions into free entries, in order), and let go of sent tensors whose
        copies ran. A failure here leaves a link out of step: the transport fails."""
        with self._lock:
            try:
                if self._signals:
                    self._store_signals()
                for dst, outgoing in self._outgoing.items():
                    if outgoing:
                        self._advance_link(dst, outgoing)
                    self._release_copied(dst, wait=False)
            except BaseException as exc:
                self._failure = self._failure or RuntimeError(f"FEPLB transport {self.name} failed while "
                                                              f"enqueueing: {exc}")
                raise

    def _advance_link(self, dst: int, outgoing: collections.deque) -> None:
        channel, me = self._control[self.local_rank, dst], self.local_rank
        backend, stream, peer = self.backend, self._streams[dst], self._mapped[dst]
        enqueued, posted = self._parts_sent[dst], self._posted[dst]
        for message in outgoing:
            while message.enqueued < len(message.parts):
                n = self._parts_sent[dst] + 1
                if n > RING_SLOTS and not flag_reached(channel[ACK_FLAG], self._flag(n - RING_SLOTS)):
                    break  # its ring slot's previous part is not read yet
                if message.ready is not None:  # its ready point, snapshot at its send
                    backend.stream_wait_event(stream, message.ready)
                    self._spare_events.append(message.ready)  # recorded again only after this wait was queued
                    message.ready = None
                lo, hi = message.parts[message.enqueued]
                slot = peer + (n - 1) % RING_SLOTS * self._peer_capacity[dst]
                for at, src, length in part_copies(message.pieces, lo, hi):
                    backend.memcpy_async(slot + at, src, length, stream)
                self._signal(stream, me, dst, SEQ_FLAG, self._flag(n))
                self._parts_sent[dst] = n
                self._extra_parts[dst] += message.enqueued > 0
                message.enqueued += 1
            if message.enqueued < len(message.parts):
                break
        if self._parts_sent[dst] > enqueued:
            channel[ENQUEUED] = self._parts_sent[dst]  # the receiver may now wait for them on its device
        # descriptions after the parts enqueued now: a receiver that reads one usually finds its parts
        # enqueued (not when they wait for ring slots: its host then waits for ENQUEUED)
        for message in outgoing:
            if message.described:
                continue
            number = self._posted[dst] + 1
            if channel[TAKEN] < number - MESSAGES:
                break
            words = wire.message_words(message.tag, message.tensors, message.offsets, message.nbytes)
            at = ENTRIES + (number - 1) % MESSAGES * self._entry
            channel[at:at + len(words)] = words
            self._posted[dst] = message.described = number
            channel[POSTED] = number  # publish last: the receiver's host waits on it
        if self._parts_sent[dst] > enqueued or self._posted[dst] > posted:
            channel[BELL] += 1
            self._notify(me, dst, BELL)
        while outgoing and outgoing[0].described and outgoing[0].enqueued == len(outgoing[0].parts):
            self._hold(dst, stream, outgoing.popleft().tensors)

    def _hold(self, peer: int, stream: int, tensors: list) -> None:
        """Keep ``tensors`` from reuse until ``stream`` has run what is queued on it now (an event
        recorded here; `_release_copied` lets them go). Under the lock: the caller's thread and the
        background one both take spare events."""
        copied = self._event()
        self.backend.event_record(copied, stream)
        self._in_flight[peer].append((copied, tensors))

    def _release_copied(self, dst: int, wait: bool) -> None:
        """Drop the sent tensors whose copies to ``dst`` ran (all of them, waiting, with ``wait``)."""
        in_flight = self._in_flight[dst]
        while in_flight:
            copied = in_flight[0][0]
            if wait:
                self.backend.event_synchronize(copied)
            elif not self.backend.event_query(copied):
                return
            in_flight.popleft()
            self._spare_events.append(copied)

    # ---------------------------------------------------------------- consumer side
    def recv(self, src: int, tag: int, into=None) -> list[torch.Tensor]:
        """Return the next message from ``src``: tensors this rank owns (or the ones ``into`` gives:
        `Transport.recv`), which the caller's current stream may use at once.

        The host waits only for ``src``'s host: to have called the send (the description) and
        enqueued its parts; the copy out of the ring runs on this source's receive stream once the
        parts arrived, and the caller's stream waits for it (an event), not the host. (With host
        flags the host also waits for the parts to arrive.)
        """
        self._check_open()
        self._advance()
        channel, me = self._control[src, self.local_rank], self.local_rank
        number = self._taken[src] + 1
        self._wait(lambda: channel[POSTED] >= number, src, (src, me, BELL), "(message tag {tag:#x})", tag=tag)
        at = ENTRIES + (number - 1) % MESSAGES * self._entry
        nbytes = int(channel[at + wire.NBYTES])
        found = wire.read_message(channel[at:at + self._entry], tag, src)
        backend = self.backend
        tensors = [backend.empty(shape, dtype) for dtype, _, shape in found] if into is None else \
            wire.checked_into(into, [(shape, dtype) for dtype, _, shape in found], backend.device.type)
        self._taken[src] = number
        channel[TAKEN] = number  # the description is read: the sender may reuse its entry
        staging = None
        try:
            stream, own, caller = self._recv_streams[src], self._inbound[src], backend.current_stream()
            pieces = [(out.data_ptr(), offset, out.nbytes) for out, (_, offset, _) in zip(tensors, found)]
            parts = list(part_ranges(nbytes, self._capacity))
            # the tensors were allocated on the caller's stream, whose earlier work may still use that
            # memory: the copies into them wait for the caller's stream. A message of more parts than
            # the ring has slots goes through a staging buffer of the receive stream's own, so that
            # reading a part (and freeing its slot for part n + RING_SLOTS) never waits for the
            # caller's stream: the host waits for its peer's host alone, never for its own GPU
            staging = backend.empty_on(stream, nbytes) if len(parts) > RING_SLOTS else None
            if staging is None:
                backend.event_record(self._events["caller_at"][src], caller)
                backend.stream_wait_event(stream, self._events["caller_at"][src])
            targets = pieces if staging is None else [(staging.data_ptr(), 0, nbytes)]
            for lo, hi in parts:
                n = self._parts_read[src] + 1
                self._wait(lambda due=n: channel[ENQUEUED] >= due, src, (src, me, BELL),
                           "to enqueue part {n} (message tag {tag:#x})", n=n, tag=tag)
                self._await(stream, src, me, SEQ_FLAG, self._flag(n), "for part {n} (message tag {tag:#x})", n=n,
                            tag=tag)
                slot = own + (n - 1) % RING_SLOTS * self._capacity
                for at, dst, length in part_copies(targets, lo, hi):
                    backend.memcpy_async(dst, slot + at, length, stream)
                if self._poison:  # a part read from this slot again before it is rewritten shows as NaN
                    backend.memset_async(slot, 0xFF, hi - lo, stream)
                self._signal(stream, src, me, ACK_FLAG, self._flag(n))
                self._parts_read[src] = n
            if staging is not None:
                backend.event_record(self._events["caller_at"][src], caller)
                backend.stream_wait_event(stream, self._events["caller_at"][src])
                for at, dst, length in part_copies(pieces, 0, nbytes):
                    backend.memcpy_async(dst, staging.data_ptr() + at, length, stream)
                if self._poison:
                    backend.memset_async(staging.data_ptr(), 0xFF, nbytes, stream)
                with self._lock:
                    self._hold(src, stream, [staging])
            backend.event_record(self._events["done"][src], stream)
            backend.stream_wait_event(caller, self._events["done"][src])  # the caller sees the data
        except BaseException as exc:  # the message is taken but not read: the link is out of step
            self._hold_while_copying(src, [*tensors, *([staging] if staging is not None else [])])
            # a copy of a peer's death (the raised one holds this frame's tensors); anything else: out of step
            self._failure = self._failure or (
                PeerDiedError(str(exc)) if isinstance(exc, PeerDiedError) else
                RuntimeError(f"FEPLB transport {self.name}: a message from local rank {src} was taken but not read "
                             f"({exc})"))
            raise
        self._check_open()  # a peer that died meanwhile: the tensors were released, not written (host backend)
        return tensors

    def _hold_while_copying(self, src: int, tensors: list) -> None:
        """A `recv` that failed part-way: the copies it queued into ``tensors`` still run (a dead
        peer's waits are released, a live one delivers every part it enqueued), so their memory is
        kept from reuse until the receive stream passed them, as a sent tensor's is; best effort,
        the failure is what the caller hears."""
        stream = self._recv_streams.get(src)
        if stream is None:
            return
        try:
            with self._lock:
                self._hold(src, stream, tensors)
        except Exception:  # noqa: BLE001 - a device that fails here fails the transport anyway
            pass

    # ---------------------------------------------------------------- off the critical path
    def _run_background(self) -> None:
        """Enqueue parts that waited for a ring slot once it is free (the caller may be busy
        elsewhere, or waiting outside the transport), let go of sent tensors whose copies ran, and,
        with a `PeerWatch`, watch the peers: a dead one's flags are kept released (every stream
        wait of ours on it met) and the transport fails, naming it."""
        self.backend.bind_thread()
        watched = time.monotonic()
        while not self._stop.is_set():
            pending = any(self._outgoing.values()) or self._signalling()
            try:
                if pending or any(self._in_flight.values()):
                    self._advance()
                if self.watch is not None and time.monotonic() - watched >= WATCH_EVERY_S:
                    watched = time.monotonic()
                    dead = [p for p in self._peers if not self.watch.alive(p)]
                    if dead and not isinstance(self._failure, PeerDiedError):
                        self._failure = PeerDiedError(f"FEPLB transport {self.name}: "
                                                      f"{describe_rank(self.watch, dead[0])} died; this rank's "
                                                      "messages to and from it are abandoned")
                    self._dead.update(dead)
                    self._release_waits(self._dead)  # again each time: a late device write may have lowered one
            except BaseException:  # noqa: BLE001 - recorded in `_failure` where it matters; the thread goes on
                pass
            if pending and self._failure is None:
                # a ring slot is freed by a device write, and a host flag's stream work ends, waking nobody: poll
                time.sleep(0.0002)
            else:
                self._wake.wait(WATCH_EVERY_S)
                self._wake.clear()

    def _release_waits(self, peers) -> None:
        """Store our ``SEQ`` flags for ``peers`` far ahead (host memory: a CPU store), so every
        stream wait of ours for their parts is met (the copy-outs then read our own ring)."""
        for peer in peers:
            self._control[peer, self.local_rank, SEQ_FLAG] = self._flag(self._parts_read[peer] + RELEASE)

    # ---------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Drain the streams, close every peer mapping, wait for the peers to do so, free. What a
        peer may still use, or a stream may still touch, is kept (with a warning) rather than freed."""
        if self.closed:
            return
        deadline = time.monotonic() + self.timeout_s
        while any(self._outgoing.values()) and self._failure is None and time.monotonic() < deadline:
            time.sleep(0.001)  # the background thread enqueues what the receivers still have room for
        self.closed = True
        self._stop.set()
        self._wake.set()
        self._background.join(timeout=self.timeout_s)
        with self.backend.on_device():
            if self._background.is_alive() or not self._drain():
                # our streams may still copy through our mappings of the peers' rings: keep those too (the
                # peers then keep theirs, warning in turn)
                warnings.warn(f"FEPLB: the phase-2 streams of domain {self.name} did not finish within "
                              f"{self.timeout_s:g} s; their memory is not freed", RuntimeWarning, stacklevel=2)
                self._free_local(rings=False, streams=False)
                return
            try:
                self._store_signals()  # host flags: the last ACKs (the streams ran)
                for dst in self._peers:
                    self._release_copied(dst, wait=True)
                    for message in self._outgoing[dst]:  # parts no receiver will read
                        if message.ready is not None:
                            self._spare_events.append(message.ready)
                    self._outgoing[dst].clear()
            finally:
                self._announce_unmapped()
                still_mapped = self._peers_still_mapping()
                if still_mapped:  # freeing memory a live peer still maps is undefined in CUDA: keep it
                    warnings.warn(f"FEPLB: local rank(s) {still_mapped} of domain {self.name} did not unmap this "
                                  f"rank's phase-2 rings within {self.timeout_s:g} s; they are not freed",
                                  RuntimeWarning, stacklevel=2)
                self._free_local(rings=not still_mapped)

    def _announce_unmapped(self) -> None:
        """Close our mappings of the peers' rings and say so (peers free their rings once all did)."""
        try:
            for peer in list(self._mapped):
                self.backend.ipc_close(self._mapped.pop(peer))
        finally:
            self._control[self.local_rank, self.local_rank, IMPORTS_CLOSED] = 1
            self._notify(self.local_rank, self.local_rank, IMPORTS_CLOSED)

    def _peers_still_mapping(self) -> list[int]:
        """The peers that neither unmapped our rings (bounded wait), nor died, nor ever started."""
        deadline, left = time.monotonic() + self.timeout_s, []
        for peer in self._peers:
            def unmapped(state=self._control[peer, peer], p=peer) -> bool:  # bound now: called within this turn
                return bool(state[IMPORTS_CLOSED] or not state[ALIVE]
                            or (self.watch is not None and not self.watch.alive(p)))
            try:
                wait_until(unmapped, max(0.0, deadline - time.monotonic()),
                           f"{describe_rank(self.watch, peer)} of domain {self.name} to unmap our rings",
                           word=self._word(peer, peer, IMPORTS_CLOSED))
            except PeerTimeoutError:
                left.append(peer)
        return left

    def _free_local(self, rings: bool = True, streams: bool = True) -> None:
        """Release what this rank holds, best effort, each part on its own: ``rings`` (our inbound
        allocations), ``streams`` (streams, events, the control block's registration); the control
        block's mapping goes with the registration, and its name always (the owner's)."""
        backend = self.backend
        steps = []
        if streams:
            for stream in {*self._streams.values(), *self._recv_streams.values(),
                           *([self._side] if self._side is not None else [])}:
                steps.append(lambda s=stream: backend.stream_destroy(s))
            for event in [*(e for kind in self._events.values() for e in kind.values()), *self._spare_events,
                          *(event for queued in self._signals.values() for event, _ in queued)]:
                steps.append(lambda e=event: backend.event_destroy(e))
        if rings:
            for ptr in self._inbound.values():
                steps.append(lambda p=ptr: backend.free(p))
        errors = []
        for step in steps:
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - the rest is still released; the first error is raised
                errors.append(exc)
        if streams:
            self._streams, self._recv_streams, self._side = {}, {}, None
            self._events, self._spare_events = {kind: {} for kind in self._events}, []
            self._signals = {}
        if rings:
            self._inbound = {}
        if streams:  # the device no longer polls the control block: unregister and unmap it
            if self._control_ptr is not None:
                try:
                    backend.unregister_host(self._control_ptr)
                except Exception as exc:  # noqa: BLE001 - as above
                    errors.append(exc)
                self._control_ptr = None
            if self._words is not None:
                self._words.release()
            self._control = None
            if self._control_shm is not None:
                self._control_shm.close()
        if self._control_shm is not None and self._owns_control:
            unlink_quietly(self._control_shm)
        if errors:
            raise errors[0]

    def _drain(self) -> bool:
        """Let every stream of ours run what it was given (bounded by ``timeout_s``); stream waits
        for a dead peer are released (`_release_waits`), and a live peer always delivers what a wait
        was queued for, since waits are queued only for parts it had enqueued. False if the
        streams did not finish."""
        backend = self.backend
        marks = []
        for stream in {*self._streams.values(), *self._recv_streams.values()}:
            marks.append(backend.event_create())
            backend.event_record(marks[-1], stream)
        deadline = time.monotonic() + self.timeout_s
        while not all(backend.event_query(m) for m in marks) and time.monotonic() < deadline:
            if self.watch is not None:
                self._dead.update(p for p in self._peers if not self.watch.alive(p))
                self._release_waits(self._dead)
            time.sleep(0.001)
        finished = all(backend.event_query(m) for m in marks)
        if finished:
            for mark in marks:
                backend.event_destroy(mark)
        return finished

    @property
    def extra_parts(self) -> int:
        """Parts sent beyond each message's first (messages larger than a ring slot), to every peer."""
        return sum(self._extra_parts.values())

    def capacities(self) -> dict[int, int]:
        """Bytes of each inbound ring, per source rank (device bytes held: their sum)."""
        return {src: RING_SLOTS * self._capacity for src in self._inbound}


def on_host(backend: Callable[[str, int], object], slot_bytes: Optional[int] = None) -> type:
    """This transport on host memory, as a layer's transport class (what
    `expert_stage.transport_class` returns): ``backend(prefix, local_rank)`` makes each rank's
    backend (a `backend.HostBackend`, its segments named from ``prefix``); ``slot_bytes`` fixes the
    receive slots (None: as the layer sizes them). It opens as `shm.ShmTransport` does (no device,
    nothing to preflight): the Copy-Engine protocol's code path on CPU, for tests and benchmarks."""
    from deepspeed_feplb.migrate.shm import ShmTransport

    fixed = slot_bytes

    class HostCETransport(CudaCETransport):
        device_id = ShmTransport.device_id
        preflight = ShmTransport.preflight

        def __init__(self, name, local_rank, size, timeout_s, create, watch=None, device=None, slot_bytes=0):
            slots = slot_bytes if fixed is None else fixed
            super().__init__(name, local_rank, size, timeout_s, create, watch,
                             backend=backend(f"{name}-mem", local_rank), slot_bytes=slots)

    return HostCETransport
