"""Phase-2 transport on the Copy Engine: stream-ordered messages through CUDA IPC peer rings.

Same interface and message semantics as `deepspeed_feplb.migrate.shm.ShmTransport`
(``send(dst, tag, tensors) -> Future``, ``recv(src, tag) -> list[Tensor]``, ``close()``), so
`migrate.phase2` runs on it unchanged.

Design (docs/ARCHITECTURE.md "Phase 2"; docs/GPU.md): the host *enqueues* a message and never waits
for the device; the streams order themselves on flag words.

* **Push into peer memory.** Every rank owns one inbound allocation per peer (a plain
  ``cudaMalloc``, fixed for the transport's life): 256 bytes of flags, then a *ring* of
  `arena.RING_SLOTS` slots. The sender opens it by its IPC handle once and writes each part of a
  message into the next ring slot with one ``cudaMemcpyAsync(kind=Default)`` per tensor piece (an
  expert's weights and its token chunk are each one contiguous copy). Between two GPUs that copy
  runs on the Copy Engine, using no SM.
* **Sequence flags and credits, on the streams.** Parts are numbered per link (n = 1, 2, ...).
  The sender's copy stream for that link waits until the receiver's credit word (``ACK``, in the
  sender's own memory) says part ``n - RING_SLOTS`` was read (``cuStreamWaitValue32``, cyclic GEQ:
  32-bit numbers wrap), copies part n into ring slot ``(n - 1) % RING_SLOTS``, writes n into a
  local staging word (``cuStreamWriteValue32``) and copies those 4 bytes into the receiver's
  ``SEQ`` word. The receiver's stream for that link waits until its ``SEQ`` reached n, copies the
  part out into the caller's tensors, and returns the credit the same way (staging word, 4-byte
  copy into the sender's ``ACK``). The compute stream only waits (an event) for that copy-out.
  Local words only are waited on and written by the stream (since CUDA 13.1 a write-value does
  not reach another GPU), as NCCL's copy-engine collectives do.
* **Descriptions on the host.** What a message holds (tag, tensor dtypes, shapes and offsets) is
  published in a per-domain shared-memory control block when the send is *enqueued*: the
  receiver's host reads it without waiting for the device (only for the sender's host to have
  reached its send), allocates the destination tensors and enqueues its waits. The control block
  keeps `MESSAGES` descriptions per link; a sender's host waits only when its receiver's host
  has not yet reached the message `MESSAGES` earlier.
* **Memory of sent tensors** stays referenced, with an event recorded after their copies, until a
  later send (or `close`) finds that event complete: the caching allocator cannot hand it out
  while a copy still reads it. The receiver's copy-out waits for the caller's stream first, since
  the caller allocated the destination tensors on it.
* **Slots are fixed**: allocated when the domain opens, never grown or freed until `close`, so no
  step pays a ``cudaMalloc``, a ``cudaFree`` (a device-wide sync) or a new IPC handle. A message
  larger than a ring slot travels in parts, all enqueued at once; the ring pipelines them.
* **A dead peer is an error, not a hung GPU.** With a `segments.PeerWatch`, a watchdog thread
  (off the critical path) checks the peers' processes; when one died it writes this rank's own
  flags for that peer far ahead, so no stream of ours waits for it forever, and the next call of
  the transport raises `segments.PeerDiedError` naming the rank. `close` does the same for waits
  that can no longer be met.
* **Teardown**: drain our streams, close every peer mapping, announce it, wait (bounded) until the
  peers did the same, then free (CUDA leaves freeing a still-mapped allocation undefined).

The device work goes through a backend (`backend.CudaBackend`); `backend.HostBackend` runs the
identical protocol on host shared memory, streams as threads, which is how CPU machines test
this module.
"""
from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from deepspeed_feplb.migrate import wire
from deepspeed_feplb.migrate.arena import FLAG_BYTES, RING_SLOTS, inbound_bytes, message_layout, ring_capacity
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
# description the sender published / the receiver read; GEN is 1 once the receiver published its
# inbound allocation (handle at RING_H, 8 words), CAP its ring slots' bytes; descriptions from ENTRIES
POSTED, TAKEN, GEN, CAP = range(4)
RING_H = 8
ENTRIES = 16
TAG, COUNT, NBYTES = range(3)  # an entry's words, then its tensors' descriptions from word 4
# the diagonal channel (r, r) carries rank r's state
ALIVE, IMPORTS_CLOSED = 0, 1
# byte offsets of the flag words at the head of an inbound allocation (of rank X for peer Y):
# SEQ: parts of Y -> X written (Y writes it); ACK: parts of X -> Y read (Y writes it, X's credits);
# STAGE_SEQ / STAGE_ACK: X's staging words for the flags it copies into Y's allocation
SEQ, ACK, STAGE_SEQ, STAGE_ACK = 0, 64, 128, 192
RELEASE = 1 << 30  # a flag this far ahead meets every wait queued before it (cyclic comparison)

def part_ranges(nbytes: int | None, capacity: int):
    """The byte ranges ``[lo, hi)`` of a message of ``nbytes`` that travel as parts through a slot of
    ``capacity`` bytes (one part for an empty message; ``nbytes`` None: endless, for a receiver that
    learns the size at the first part)."""
    part = 0
    while True:
        lo = part * capacity
        hi = lo + capacity if nbytes is None else min(nbytes, lo + capacity)
        yield lo, hi
        part += 1
        if nbytes is not None and hi >= nbytes:
            return


def overlap(offset: int, size: int, lo: int, hi: int) -> list[tuple[int, int]]:
    """The bytes of a tensor at ``[offset, offset + size)`` of a message that lie in the part
    ``[lo, hi)``: ``[(start within the tensor, length)]``, empty when none."""
    start, end = max(offset, lo), min(offset + size, hi)
    return [(start - offset, end - start)] if end > start else []


def preflight_problems(me: int, ranks: Sequence[int], devices: Sequence[str], slot: int, free_bytes: int,
                       ordinal: Callable[[str], Optional[int]], can_access: Callable[[int, int], bool]) -> list[str]:
    """What keeps local rank ``me`` of a domain (global ``ranks``, their GPUs' UUIDs ``devices``)
    from opening its CE transport: a peer's GPU it does not see (``ordinal(uuid)`` None) or cannot
    reach by peer access, or ``(G - 1)`` inbound rings of ``slot`` bytes (`arena.inbound_bytes`)
    beyond its ``free_bytes``; each
    problem names the ranks or the bytes and what to change. Ranks on one GPU need no peer access."""
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


def entry_words(max_tensors: int) -> int:
    """Words of one message description: tag, count, bytes, a spare word, then each tensor's."""
    return 4 + max_tensors * wire.FIELDS


def channel_words(max_tensors: int) -> int:
    return ENTRIES + MESSAGES * entry_words(max_tensors)


def _put_handle(words: np.ndarray, at: int, handle: bytes) -> None:
    words[at:at + 8] = np.frombuffer(bytes(handle).ljust(64, b"\0")[:64], dtype=np.int64)


def _get_handle(words: np.ndarray, at: int) -> bytes:
    return words[at:at + 8].copy().tobytes()


class CudaCETransport:
    """Moves lists of tensors between the ranks of one NVLink domain by stream-ordered Copy-Engine copies.

    Args (the first five as `ShmTransport`'s):
        name: unique prefix of this domain's host control segment (starts with ``feplb-``).
        local_rank: this rank's index in the domain.
        size: ranks in the domain.
        timeout_s: how long a host waits for a peer's host before raising `PeerTimeoutError`.
        create: True on the domain's rank 0, which creates the control block; it must be
            constructed before the others (the caller's barrier), as with `ShmTransport`.
        watch: a `segments.PeerWatch`: host waits fail fast, naming the rank, when a peer died, and a
            watchdog releases this rank's streams from waits on it (module docstring).
        device: the CUDA device of this rank's experts, where slots and streams go (default:
            torch's current device).
        backend: a `CudaBackend` (default: on ``device``) or `HostBackend`.
        slot_bytes: bytes of each inbound ring (`arena.inbound_bytes`), fixed for the transport's
            life (`arena.slot_bytes`); larger messages travel in parts.
        max_tensors: most tensors in one message.
        first_flag: the flags' value before the first part (every rank of the domain passes the
            same); a value near 2**32 makes the 32-bit sequence numbers wrap early (tests).
    """

    # One-way latency of a small message (µs), for the planner's time model before the transport
    # measured its own (`calibrate`): the host-handshake transport's figure on an H200 machine
    # (228 µs, docs/GPU.md); this data plane's is not measured on a GPU yet.
    message_us = 230.0

    def __init__(self, name: str, local_rank: int, size: int, timeout_s: float, create: bool, watch=None, *,
                 device=None, backend=None, slot_bytes: int = DEFAULT_SLOT_BYTES,
                 max_tensors: int = DEFAULT_MAX_TENSORS, first_flag: int = 0):
        if backend is None:
            from deepspeed_feplb.migrate.backend import CudaBackend
            backend = CudaBackend(device)
        self.name, self.local_rank, self.size, self.timeout_s = name, local_rank, size, timeout_s
        self.backend, self.max_tensors, self.watch = backend, max_tensors, watch
        self._first_flag = int(first_flag)
        self._entry = entry_words(max_tensors)
        self._control_shm = open_segment(f"{name}-cectl", size * size * channel_words(max_tensors) * 8, create=create)
        self._owns_control = create
        self._control = np.ndarray((size, size, channel_words(max_tensors)), dtype=np.int64,
                                   buffer=self._control_shm.buf)
        if create:
            self._control[:] = 0
        self.closed = False
        self._failure: Optional[BaseException] = None
        self._words = Words(self._control)
        self._peers = [r for r in range(size) if r != local_rank]
        self._parts_sent = dict.fromkeys(self._peers, 0)  # per link: parts enqueued (n of the last)
        self._parts_read = dict.fromkeys(self._peers, 0)  # per link: parts whose copy-out is enqueued
        self._posted = dict.fromkeys(self._peers, 0)  # messages whose description we published, per destination
        self._taken = dict.fromkeys(self._peers, 0)  # messages whose description we read, per source
        self._extra_parts = dict.fromkeys(self._peers, 0)
        self._capacity = ring_capacity(slot_bytes)
        self._inbound: dict[int, int] = {}  # peer -> our allocation for it (flags, ring)
        setup = backend.stream_create()
        try:
            for peer in self._peers:
                ptr = self._inbound[peer] = backend.malloc(inbound_bytes(slot_bytes))
                for word in (SEQ, ACK, STAGE_SEQ, STAGE_ACK):
                    backend.stream_write_value32(setup, ptr + word, self._flag(0))
            backend.stream_synchronize(setup)
        finally:
            backend.stream_destroy(setup)
        for peer in self._peers:
            channel = self._control[peer, local_rank]
            _put_handle(channel, RING_H, backend.ipc_handle(self._inbound[peer]))
            channel[CAP] = self._capacity
            channel[GEN] = 1  # publish last: the peer maps the allocation once it sees this
            self._notify(peer, local_rank, GEN)
        self._mapped: dict[int, int] = {}  # peer -> its inbound allocation for us, opened
        self._streams = {dst: backend.stream_create() for dst in self._peers}  # copies to dst
        self._recv_streams = {src: backend.stream_create() for src in self._peers}  # copy-outs from src
        self._in_flight = {dst: collections.deque() for dst in self._peers}  # (copied event, tensors)
        self._caller_at = {src: backend.event_create() for src in self._peers}  # recv: the caller's stream, now
        self._done = {src: backend.event_create() for src in self._peers}  # recv: the copy-out, done
        self._lock = threading.Lock()  # the watchdog's flag writes against close
        self._stop = threading.Event()
        self._watchdog = None
        if watch is not None:
            self._watchdog = threading.Thread(target=self._watch_peers, name=f"feplb-ce-watch-{local_rank}",
                                              daemon=True)
            self._watchdog.start()
        self._control[local_rank, local_rank, ALIVE] = 1

    @staticmethod
    def device_id(device: torch.device) -> str:
        """The UUID of ``device``'s GPU, by which the ranks of a domain tell each other their GPUs."""
        return str(torch.cuda.get_device_properties(torch.device(device)).uuid)

    @staticmethod
    def preflight(device: torch.device, slot: int, local_rank: int, ranks: Sequence[int],
                  devices: Sequence[str]) -> list[str]:
        """`preflight_problems` of this rank on ``device``, and whether its driver runs stream flags.
        Torch's cached free blocks go back to the driver first when the rings would not fit beside them."""
        from deepspeed_feplb.migrate.backend import CudaBackend
        free = torch.cuda.mem_get_info(device)[0]
        if (len(ranks) - 1) * inbound_bytes(slot) > free:
            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info(device)[0]
        uuids = {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}
        problems = preflight_problems(local_rank, ranks, devices, slot, free, uuids.get,
                                      torch.cuda.can_device_access_peer)
        flags = CudaBackend(device).probe_flags()
        if flags:
            problems.append(f"rank {ranks[local_rank]} cannot use CUDA stream memory operations "
                            f"(cuStreamWaitValue32_v2, CUDA 11.7+ drivers): {flags}; update the NVIDIA driver")
        return problems

    def _flag(self, n: int) -> int:
        """The 32-bit flag value of part number ``n`` of a link (0: none yet)."""
        return (self._first_flag + n) & 0xFFFFFFFF

    def _word(self, src: int, dst: int, field: int) -> Word:
        """Word ``field`` of channel ``src -> dst`` (``src == dst``: that rank's state) to sleep on."""
        return self._words[src, dst, field]

    def _notify(self, src: int, dst: int, field: int) -> None:
        self._word(src, dst, field).notify()

    def _check_open(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self.closed:
            raise RuntimeError(f"FEPLB transport {self.name} is closed")

    def _map(self, peer: int) -> int:
        """``peer``'s inbound allocation for us (its ring for our messages, and our credits' flag), opened once."""
        if peer not in self._mapped:
            channel = self._control[self.local_rank, peer]
            wait_until(lambda: channel[GEN] >= 1, self.timeout_s,
                       f"{describe_rank(self.watch, peer)} of domain {self.name} to start",
                       peer_check(self.watch, peer), word=self._word(self.local_rank, peer, GEN))
            self._mapped[peer] = self.backend.ipc_open(_get_handle(channel, RING_H))
        return self._mapped[peer]

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
        """Enqueue ``tensors`` for ``dst``; returns a future that is already done (the copies are queued).

        The copies start when the caller's current stream reaches this call, or the `mark`
        ``after``, and once the receiver has read the part that used the same ring slot; the host
        never waits for the device. The tensors' memory is kept from reuse until the copies ran;
        they must not be modified afterwards on another stream.
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
        backend, stream = self.backend, self._streams[dst]
        channel = self._control[self.local_rank, dst]
        message = self._posted[dst] + 1
        wait_until(lambda: channel[TAKEN] >= message - MESSAGES, self.timeout_s,
                   f"{describe_rank(self.watch, dst)} of domain {self.name} to read message {message - MESSAGES}",
                   peer_check(self.watch, dst), word=self._word(self.local_rank, dst, TAKEN))
        peer, own, capacity = self._map(dst), self._inbound[dst], int(channel[CAP])
        ready = after if after is not None else self.mark()
        backend.stream_wait_event(stream, ready)
        if after is None:
            backend.event_destroy(ready)
        for part, (lo, hi) in enumerate(part_ranges(nbytes, capacity)):
            n = self._parts_sent[dst] + 1
            if n > RING_SLOTS:  # the ring slot's previous part was read
                backend.stream_wait_value32(stream, own + ACK, self._flag(n - RING_SLOTS))
            slot = peer + FLAG_BYTES + (n - 1) % RING_SLOTS * capacity
            for t, offset in zip(tensors, offsets):
                for at, length in overlap(offset, t.numel() * t.element_size(), lo, hi):
                    backend.memcpy_async(slot + offset + at - lo, t.data_ptr() + at, length, stream)
            backend.stream_write_value32(stream, own + STAGE_SEQ, self._flag(n))
            backend.memcpy_async(peer + SEQ, own + STAGE_SEQ, 4, stream)
            self._parts_sent[dst] = n
            self._extra_parts[dst] += part > 0
        entry = channel[ENTRIES + (message - 1) % MESSAGES * self._entry:][:self._entry]
        entry[TAG], entry[COUNT], entry[NBYTES] = tag, len(tensors), nbytes
        for i, (t, offset) in enumerate(zip(tensors, offsets)):
            wire.describe(entry[4 + i * wire.FIELDS:4 + (i + 1) * wire.FIELDS], t, offset)
        self._posted[dst] = message
        channel[POSTED] = message  # publish last: the receiver's host waits on it
        self._notify(self.local_rank, dst, POSTED)
        self._release_copied(dst, wait=False)  # earlier messages' tensors whose copies ran
        copied = backend.event_create()
        backend.event_record(copied, stream)
        self._in_flight[dst].append((copied, tensors))  # memory kept from the allocator until the copies ran
        future: Future = Future()
        future.set_result(None)
        return future

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
            self.backend.event_destroy(copied)

    # ---------------------------------------------------------------- consumer side
    def recv(self, src: int, tag: int, into=None) -> list[torch.Tensor]:
        """Return the next message from ``src``: tensors this rank owns (or the ones ``into`` gives:
        `Transport.recv`), which the caller's current stream may use at once.

        The host waits only for ``src``'s host to have enqueued the message (its description); the
        copy out of the ring runs on this source's receive stream once the parts arrived, and the
        caller's stream waits for it (an event), not the host.
        """
        self._check_open()
        channel = self._control[src, self.local_rank]
        message = self._taken[src] + 1
        wait_until(lambda: channel[POSTED] >= message, self.timeout_s,
                   f"{describe_rank(self.watch, src)} of domain {self.name} (message tag {tag:#x})",
                   peer_check(self.watch, src), word=self._word(src, self.local_rank, POSTED))
        entry = channel[ENTRIES + (message - 1) % MESSAGES * self._entry:][:self._entry]
        wire.check_tag(tag, entry[TAG], src)
        nbytes, count = int(entry[NBYTES]), int(entry[COUNT])
        found = [wire.read(row) for row in entry[4:4 + count * wire.FIELDS].reshape(count, wire.FIELDS).tolist()]
        self._taken[src] = message
        channel[TAKEN] = message  # the description is read: the sender may reuse its entry
        self._notify(src, self.local_rank, TAKEN)
        backend, stream = self.backend, self._recv_streams[src]
        # the tensors below are allocated on the caller's stream, whose earlier work may still use that memory
        backend.event_record(self._caller_at[src], backend.current_stream())
        backend.stream_wait_event(stream, self._caller_at[src])
        tensors = [backend.empty(shape, dtype) for dtype, _, shape in found] if into is None else \
            wire.checked_into(into, [(shape, dtype) for dtype, _, shape in found], backend.device.type)
        own, peer, capacity = self._inbound[src], self._map(src), self._capacity
        for lo, hi in part_ranges(nbytes, capacity):
            n = self._parts_read[src] + 1
            backend.stream_wait_value32(stream, own + SEQ, self._flag(n))
            slot = own + FLAG_BYTES + (n - 1) % RING_SLOTS * capacity
            for out, (_, offset, _) in zip(tensors, found):
                for at, length in overlap(offset, out.numel() * out.element_size(), lo, hi):
                    backend.memcpy_async(out.data_ptr() + at, slot + offset + at - lo, length, stream)
            backend.stream_write_value32(stream, own + STAGE_ACK, self._flag(n))
            backend.memcpy_async(peer + ACK, own + STAGE_ACK, 4, stream)  # the sender's credit
            self._parts_read[src] = n
        backend.event_record(self._done[src], stream)
        backend.stream_wait_event(backend.current_stream(), self._done[src])  # the caller sees the data
        return tensors

    # ---------------------------------------------------------------- a peer that dies
    def _watch_peers(self) -> None:
        self.backend.bind_thread()
        while not self._stop.wait(WATCH_EVERY_S):
            dead = [p for p in self._peers if not self.watch.alive(p)]
            if dead:
                self._failure = PeerDiedError(f"FEPLB transport {self.name}: {describe_rank(self.watch, dead[0])} "
                                              "died; this rank's copies to and from it are abandoned")
                self._release_waits(dead)
                return

    def _release_waits(self, peers) -> None:
        """Write this rank's own flags for ``peers`` far ahead: every stream wait of ours on them is met."""
        with self._lock:
            if not self._inbound:
                return
            backend = self.backend
            stream = backend.stream_create()
            try:
                for peer in peers:
                    own = self._inbound[peer]
                    backend.stream_write_value32(stream, own + SEQ, self._flag(self._parts_read[peer] + RELEASE))
                    backend.stream_write_value32(stream, own + ACK, self._flag(self._parts_sent[peer] + RELEASE))
                backend.stream_synchronize(stream)
            finally:
                backend.stream_destroy(stream)

    # ---------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Drain the streams, close every peer mapping, wait for the peers to do so, free."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.join(timeout=self.timeout_s)
        backend = self.backend
        self._drain()
        for dst in self._peers:
            self._release_copied(dst, wait=True)
        for peer in list(self._mapped):
            backend.ipc_close(self._mapped.pop(peer))
        me = self._control[self.local_rank, self.local_rank]
        me[IMPORTS_CLOSED] = 1
        self._notify(self.local_rank, self.local_rank, IMPORTS_CLOSED)
        deadline = time.monotonic() + self.timeout_s
        for peer in self._peers:  # a peer that never started or died holds no mapping of ours
            def unmapped(state=self._control[peer, peer], p=peer) -> bool:  # bound now: called within this turn
                return bool(state[IMPORTS_CLOSED] or not state[ALIVE]
                            or (self.watch is not None and not self.watch.alive(p)))
            try:
                wait_until(unmapped, max(0.0, deadline - time.monotonic()),
                           f"{describe_rank(self.watch, peer)} of domain {self.name} to unmap our rings",
                           word=self._word(peer, peer, IMPORTS_CLOSED))
            except PeerTimeoutError:
                pass  # a dead peer's mappings went with its process
        for stream in [*self._streams.values(), *self._recv_streams.values()]:
            backend.stream_destroy(stream)
        with self._lock:
            for ptr in self._inbound.values():
                backend.free(ptr)
            self._inbound.clear()
        for event in [*self._caller_at.values(), *self._done.values()]:
            backend.event_destroy(event)
        self._streams.clear()
        self._recv_streams.clear()
        self._words.release()
        del me, self._control
        self._control_shm.close()
        if self._owns_control:
            unlink_quietly(self._control_shm)

    def _drain(self) -> None:
        """Let every stream of ours run what it was given. Waits that are not met within
        ``timeout_s`` (a peer that stopped reading or writing) are released (`_release_waits`) first."""
        backend = self.backend
        marks = []
        for stream in [*self._streams.values(), *self._recv_streams.values()]:
            marks.append(backend.event_create())
            backend.event_record(marks[-1], stream)
        deadline = time.monotonic() + self.timeout_s
        while not all(backend.event_query(m) for m in marks) and time.monotonic() < deadline:
            if self.watch is not None and not all(self.watch.alive(p) for p in self._peers):
                break
            time.sleep(0.001)
        if not all(backend.event_query(m) for m in marks):
            self._release_waits(self._peers)
        for mark in marks:
            backend.event_synchronize(mark)
            backend.event_destroy(mark)

    @property
    def extra_parts(self) -> int:
        """Parts sent beyond each message's first (messages larger than a ring slot), to every peer."""
        return sum(self._extra_parts.values())

    def capacities(self) -> dict[int, int]:
        """Bytes of each inbound ring, per source rank (device bytes held: their sum, plus flags)."""
        return {src: RING_SLOTS * self._capacity for src in self._inbound}
