"""Phase-2 transport on the Copy Engine: CUDA IPC peer slots, ``cudaMemcpyAsync`` on copy streams.

Same interface and message semantics as `deepspeed_feplb.migrate.shm.ShmTransport`
(``send(dst, tag, tensors) -> Future``, ``recv(src, tag) -> list[Tensor]``, ``close()``), so
`migrate.phase2` runs on it unchanged.

Design (docs/ARCHITECTURE.md "Phase 2"; docs/GPU.md):

* **Push into peer memory.** Every rank owns one inbound *slot* per peer, a plain ``cudaMalloc``.
  The sender opens the receiver's slot by its IPC handle once and writes a message into it with
  one ``cudaMemcpyAsync(kind=Default)`` per tensor (an expert's weights and its token chunk are
  each one contiguous copy: batched per (expert, destination), never per token). Between two
  GPUs that copy runs on the Copy Engine, using no SM.
* **One copy stream and one thread per destination.** A send records an event on the caller's
  current (compute) stream; the destination's copy stream waits for it, so copies start exactly
  when the data is ready and overlap whatever the compute stream does next. Per-destination
  threads mean a channel that waits for its receiver never delays messages to other ranks.
  When nothing is queued for a destination and the receiver has read the previous message, the
  sender enqueues the copies itself (nothing to wait for), sparing the copy thread's wake-up.
* **Ordering across processes with IPC events**, and host-side sequence numbers in a per-domain
  shared-memory control block (as in `ShmTransport`): the sender records its *ready* event after
  the copies, then publishes ``seq``; the receiver, having seen ``seq``, makes its receive stream
  for that source wait on the ready event, copies the message out of the slot into private
  tensors there (not on the compute stream, which only waits for the copy), records its
  *consumed* event and publishes ``ack``; the sender's copy stream waits on the consumed event
  before it overwrites the slot with the next message. No host thread waits for the device on
  this path: a send's future completes once its copies are queued, and events are created with
  ``BlockingSync``.
* **Memory of sent tensors** stays referenced by the copy thread, with an event recorded after
  their copies, until a later send (or `close`) finds that event complete: the caching allocator
  cannot hand it out while a copy still reads it. (``Tensor.record_stream`` on the copy stream
  would do the same, but the allocator then records events on that stream whenever the tensor is
  freed, which fails once `close` destroyed the stream.) The receiver's copy-out waits for the
  caller's stream first, since the caller allocated the destination tensors on it.
* **Slots are fixed.** Each slot is allocated once, when the domain opens, at the size the
  caller gives (`arena.slot_bytes`: from the layer's shapes and the config), and is neither grown
  nor freed until `close`, so no step pays a ``cudaMalloc``, a ``cudaFree`` (a device-wide sync) or
  a new IPC handle. A message larger than its slot travels in *parts* through it: the sender
  writes the bytes ``[part * capacity, (part + 1) * capacity)`` of the message's layout, publishes
  ``seq`` with the part's index, and writes the next part once the receiver acknowledged this one;
  the receiver copies each part into the private tensors it allocated at the first part. Only
  the copy thread waits for those acknowledgements (a message that needs parts is never written
  inline), and an extra part costs one more round trip, not memory.
* **Teardown**: close every peer mapping and opened event, announce it, wait (bounded) until the
  peers did the same, then free (CUDA leaves freeing a still-mapped allocation undefined).

The device work goes through a backend (`backend.CudaBackend`); `backend.HostBackend` runs the
identical protocol on host shared memory, which is how CPU machines test this module.
"""
from __future__ import annotations

import collections
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from deepspeed_feplb.migrate import wire
from deepspeed_feplb.migrate.arena import align_up, message_layout
from deepspeed_feplb.migrate.link import Link
from deepspeed_feplb.segments import (
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

# words of a channel (src -> dst) in the control block; handles take 8 words (64 bytes); GEN is 1
# once the receiver published its slot; PART is the index of the part of the message in the slot
SEQ, ACK, NBYTES, GEN, CAP, PART, TAG, COUNT = range(8)
SLOT_H, READY_H, DONE_H = 8, 16, 24
META = 32
# the diagonal channel (r, r) carries rank r's state
ALIVE, IMPORTS_CLOSED = 0, 1


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
    reach by peer access, or ``(G - 1)`` slots of ``slot`` bytes beyond its ``free_bytes``; each
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
    need = (len(ranks) - 1) * slot
    if need > free_bytes:
        problems.append(f"rank {ranks[me]} has {free_bytes / 2**20:,.0f} MiB of device memory free and its phase-2 "
                        f"slots need {len(ranks) - 1} x {slot / 2**20:,.1f} = {need / 2**20:,.0f} MiB; lower "
                        "feplb.transport_slot_mb (larger messages then travel in parts) or "
                        "feplb.dynamic_experts_per_rank")
    return problems


def channel_words(max_tensors: int) -> int:
    return META + max_tensors * wire.FIELDS


def _put_handle(words: np.ndarray, at: int, handle: bytes) -> None:
    words[at:at + 8] = np.frombuffer(bytes(handle).ljust(64, b"\0")[:64], dtype=np.int64)


def _get_handle(words: np.ndarray, at: int) -> bytes:
    return words[at:at + 8].copy().tobytes()


class CudaCETransport:
    """Moves lists of tensors between the ranks of one NVLink domain by Copy-Engine peer copies.

    Args (the first five as `ShmTransport`'s):
        name: unique prefix of this domain's host control segment (starts with ``feplb-``).
        local_rank: this rank's index in the domain.
        size: ranks in the domain.
        timeout_s: how long to wait for a peer before raising `PeerTimeoutError`.
        create: True on the domain's rank 0, which creates the control block; it must be
            constructed before the others (the caller's barrier), as with `ShmTransport`.
        device: the CUDA device of this rank's experts, where slots and streams go (default:
            torch's current device).
        backend: a `CudaBackend` (default: on ``device``) or `HostBackend`.
        slot_bytes: size of each inbound slot, fixed for the transport's life (`arena.slot_bytes`);
            larger messages travel in parts.
        max_tensors: most tensors in one message.
        watch: a `segments.PeerWatch`: waits fail fast, naming the rank, when a peer died.
    """

    # One-way latency of a small message (µs), for the planner's time model: measured on an H200
    # machine with `tests/gpu/bench_transport.py` (228 µs with inline sends; docs/GPU.md).
    message_us = 230.0

    def __init__(self, name: str, local_rank: int, size: int, timeout_s: float, create: bool, watch=None, *,
                 device=None, backend=None, slot_bytes: int = DEFAULT_SLOT_BYTES,
                 max_tensors: int = DEFAULT_MAX_TENSORS):
        if backend is None:
            from deepspeed_feplb.migrate.backend import CudaBackend
            backend = CudaBackend(device)
        self.name, self.local_rank, self.size, self.timeout_s = name, local_rank, size, timeout_s
        self.backend, self.max_tensors, self.watch = backend, max_tensors, watch
        words = channel_words(max_tensors)
        self._control_shm = open_segment(f"{name}-cectl", size * size * words * 8, create=create)
        self._owns_control = create
        self._control = np.ndarray((size, size, words), dtype=np.int64, buffer=self._control_shm.buf)
        if create:
            self._control[:] = 0
        self.closed = False
        self._words = Words(self._control)
        self._peers = [r for r in range(size) if r != local_rank]
        self._extra_parts = dict.fromkeys(self._peers, 0)  # per destination: each copy thread counts its own

        # receiver side: one inbound slot and one consumed event per peer
        self._slots: dict[int, tuple[int, int]] = {}  # src -> (ptr, capacity)
        self._done: dict[int, int] = {}  # src -> consumed event (ours, interprocess)
        self._expected = np.zeros(size, dtype=np.int64)
        self._ready_peer: dict[int, int] = {}  # src -> the sender's ready event, opened
        for src in self._peers:
            channel = self._control[src, local_rank]
            self._slots[src] = self._allocate_slot(channel, align_up(slot_bytes))
            self._done[src] = backend.event_create(interprocess=True)
            _put_handle(channel, DONE_H, backend.event_handle(self._done[src]))
            channel[GEN] = 1  # publish last: the sender waits for it
            self._notify(src, local_rank, GEN)
        # sender side: one copy stream, ready event, thread and job queue per destination
        self._streams = {dst: backend.stream_create() for dst in self._peers}
        self._recv_streams = {src: backend.stream_create() for src in self._peers}
        self._ready = {dst: backend.event_create(interprocess=True) for dst in self._peers}
        for dst in self._peers:
            _put_handle(self._control[local_rank, dst], READY_H, backend.event_handle(self._ready[dst]))
        self._mapped: dict[int, int] = {}  # dst -> the peer's slot, opened; copy thread only
        self._in_flight = {dst: collections.deque() for dst in self._peers}  # (copied event, tensors); copy thread only
        self._caller_at = {src: backend.event_create() for src in self._peers}  # recv: the caller's stream, now
        self._done_peer: dict[int, int] = {}  # dst -> the receiver's consumed event, opened; copy thread only
        self._jobs = {dst: queue.Queue() for dst in self._peers}
        self._link = {dst: Link() for dst in self._peers}  # a message is written by the copy thread or inline
        self._threads = {dst: threading.Thread(target=self._copy_loop, args=(dst, ), name=f"feplb-ce-{dst}",
                                               daemon=True)
                         for dst in self._peers}
        for thread in self._threads.values():
            thread.start()
        self._control[local_rank, local_rank, ALIVE] = 1

    @staticmethod
    def device_id(device: torch.device) -> str:
        """The UUID of ``device``'s GPU, by which the ranks of a domain tell each other their GPUs."""
        return str(torch.cuda.get_device_properties(torch.device(device)).uuid)

    @staticmethod
    def preflight(device: torch.device, slot: int, local_rank: int, ranks: Sequence[int],
                  devices: Sequence[str]) -> list[str]:
        """`preflight_problems` of this rank on ``device``. Torch's cached free blocks go back to the
        driver first when the slots would not fit beside them."""
        free = torch.cuda.mem_get_info(device)[0]
        if (len(ranks) - 1) * slot > free:
            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info(device)[0]
        uuids = {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}
        return preflight_problems(local_rank, ranks, devices, slot, free, uuids.get, torch.cuda.can_device_access_peer)

    def _word(self, src: int, dst: int, field: int) -> Word:
        """Word ``field`` of channel ``src -> dst`` (``src == dst``: that rank's state) to sleep on."""
        return self._words[src, dst, field]

    def _notify(self, src: int, dst: int, field: int) -> None:
        self._word(src, dst, field).notify()

    # ---------------------------------------------------------------- slots (receiver-owned)
    def _allocate_slot(self, channel: np.ndarray, capacity: int) -> tuple[int, int]:
        ptr = self.backend.malloc(capacity)
        _put_handle(channel, SLOT_H, self.backend.ipc_handle(ptr))
        channel[CAP] = capacity
        return ptr, capacity

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
        """Queue ``tensors`` for ``dst``; returns a future done once the copies are *enqueued*.

        The copies start when the caller's current stream reaches this call (an event), or the
        `mark` ``after``, so the tensors may come straight from the compute stream; the host never
        waits for them. Their memory is kept from reuse until the copies completed (the copy thread
        holds them); they must not be modified afterwards on another stream.
        """
        if dst == self.local_rank:
            raise ValueError("a rank does not send to itself")
        if dst not in self._jobs:
            raise ValueError(f"no local rank {dst} in a domain of {self.size}")
        if len(tensors) > self.max_tensors:
            raise ValueError(f"a message holds at most {self.max_tensors} tensors, got {len(tensors)}")
        wire.check(tensors)
        if after is not None and not all(t.is_contiguous() for t in tensors):
            after = None  # their contiguous copies are queued now, after the mark
        tensors = [t.detach().contiguous() for t in tensors]
        if after is None:
            ready = self.backend.event_create()
            self.backend.event_record(ready, self.backend.current_stream())
        else:
            ready = after
        future: Future = Future()
        job = (tag, tensors, ready, after is None, future, message_layout([(t.dtype, t.shape) for t in tensors]))
        if self._link[dst].write_inline(lambda: self._slot_free(dst, job[5][1]), lambda: self._run(dst, job)):
            return future
        self._link[dst].enqueued()
        self._jobs[dst].put(job)
        return future

    def _slot_free(self, dst: int, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` to ``dst`` can be written without waiting: the receiver has
        read the previous one and it fits its slot in one part."""
        channel = self._control[self.local_rank, dst]
        return channel[ACK] == channel[SEQ] and channel[GEN] >= 1 and nbytes <= channel[CAP]

    def _run(self, dst: int, job) -> None:
        tag, tensors, ready, owned, future, layout = job
        try:
            self._write(dst, tag, tensors, ready, layout)
            future.set_result(None)  # enqueued: the receiver orders itself after _ready[dst]
        except BaseException as exc:  # the waiting caller re-raises it
            future.set_exception(exc)
        finally:
            if owned:  # a mark is the caller's to release
                self.backend.event_destroy(ready)

    def _copy_loop(self, dst: int) -> None:
        bound = False
        while True:
            job = self._jobs[dst].get()
            if job is None:
                return
            if not bound:
                self.backend.bind_thread()
                bound = True
            with self._link[dst].thread_writes():
                self._run(dst, job)

    def _write(self, dst: int, tag: int, tensors: list[torch.Tensor], ready: int,
               layout: tuple[list[int], int]) -> None:
        backend, stream = self.backend, self._streams[dst]
        channel = self._control[self.local_rank, dst]
        self._release_copied(dst, wait=False)
        me, check = self.local_rank, peer_check(self.watch, dst)
        wait_until(lambda: channel[GEN] >= 1, self.timeout_s,
                   f"{describe_rank(self.watch, dst)} of domain {self.name} to start",
                   check, word=self._word(me, dst, GEN))
        peer = self._map(dst, channel)
        offsets, nbytes = layout
        capacity = int(channel[CAP])
        backend.stream_wait_event(stream, ready)
        for part, (lo, hi) in enumerate(part_ranges(nbytes, capacity)):
            wait_until(lambda: channel[ACK] == channel[SEQ], self.timeout_s,
                       f"{describe_rank(self.watch, dst)} of domain {self.name} to read the previous message", check,
                       word=self._word(me, dst, ACK))
            if channel[SEQ] > 0:  # the receiver's copy-out of the previous part must finish first
                if dst not in self._done_peer:
                    self._done_peer[dst] = backend.event_open(_get_handle(channel, DONE_H))
                backend.stream_wait_event(stream, self._done_peer[dst])
            for t, offset in zip(tensors, offsets):
                for at, length in overlap(offset, t.numel() * t.element_size(), lo, hi):
                    backend.memcpy_async(peer + offset + at - lo, t.data_ptr() + at, length, stream)
            backend.event_record(self._ready[dst], stream)
            if part == 0:  # the whole message's description, read by the receiver at its first part
                meta = channel[META:META + len(tensors) * wire.FIELDS].reshape(len(tensors), wire.FIELDS)
                for row, t, offset in zip(meta, tensors, offsets):
                    wire.describe(row, t, offset)
                channel[TAG], channel[COUNT], channel[NBYTES] = tag, len(tensors), nbytes
            channel[PART] = part
            self._extra_parts[dst] += part > 0
            channel[SEQ] += 1  # publish last: the receiver waits on seq
            self._notify(me, dst, SEQ)
        copied = backend.event_create()
        backend.event_record(copied, stream)
        self._in_flight[dst].append((copied, tensors))  # memory kept from the allocator until the copies ran

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

    def _map(self, dst: int, channel: np.ndarray) -> int:
        if dst not in self._mapped:
            self._mapped[dst] = self.backend.ipc_open(_get_handle(channel, SLOT_H))
        return self._mapped[dst]

    def _unmap(self, dst: int) -> None:
        ptr = self._mapped.pop(dst, None)
        if ptr is not None:
            self.backend.ipc_close(ptr)

    # ---------------------------------------------------------------- consumer side
    def recv(self, src: int, tag: int, into=None) -> list[torch.Tensor]:
        """Block until the next message from ``src`` arrives; return private copies of its tensors
        (in the tensors ``into`` gives, if given: `Transport.recv`).

        The copy out of the slot runs on this source's receive stream (after the sender's copies),
        not on the caller's compute stream, which only waits for it; the returned tensors can be
        used on the caller's current stream at once.
        """
        channel = self._control[src, self.local_rank]
        backend, stream = self.backend, self._recv_streams[src]
        slot, capacity = self._slots[src]
        tensors, offsets = [], []
        for part, (lo, hi) in enumerate(part_ranges(None, capacity)):
            expected = self._expected[src] + 1
            wait_until(lambda due=expected: channel[SEQ] >= due, self.timeout_s,
                       f"{describe_rank(self.watch, src)} of domain {self.name} (message tag {tag:#x})",
                       peer_check(self.watch, src), word=self._word(src, self.local_rank, SEQ))
            if int(channel[PART]) != part:
                raise RuntimeError(f"FEPLB transport {self.name}: part {int(channel[PART])} from local rank {src} "
                                   f"where part {part} of a message was due")
            if part == 0:
                wire.check_tag(tag, channel[TAG], src)
                nbytes, count = int(channel[NBYTES]), int(channel[COUNT])
                # the tensors below are allocated on the caller's stream, whose earlier work may still use that memory
                backend.event_record(self._caller_at[src], backend.current_stream())
                backend.stream_wait_event(stream, self._caller_at[src])
                if src not in self._ready_peer:
                    self._ready_peer[src] = backend.event_open(_get_handle(channel, READY_H))
                found = [wire.read(row) for row in channel[META:META + count * wire.FIELDS].reshape(
                    count, wire.FIELDS).tolist()]
                offsets = [offset for _, offset, _ in found]
                tensors = [backend.empty(shape, dtype) for dtype, _, shape in found] if into is None else \
                    wire.checked_into(into, [(shape, dtype) for dtype, _, shape in found],
                                      backend.device.type)
            backend.stream_wait_event(stream, self._ready_peer[src])
            for out, offset in zip(tensors, offsets):
                for at, length in overlap(offset, out.numel() * out.element_size(), lo, hi):
                    backend.memcpy_async(out.data_ptr() + at, slot + offset + at - lo, length, stream)
            backend.event_record(self._done[src], stream)  # consumed: the sender may overwrite the slot
            self._expected[src] = expected
            channel[ACK] = expected
            self._notify(src, self.local_rank, ACK)
            if hi >= nbytes:
                break
        backend.stream_wait_event(backend.current_stream(), self._done[src])  # the caller sees the data
        return tensors

    # ---------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Stop the copy threads, close every peer mapping, wait for the peers to do so, free."""
        if self.closed:
            return
        self.closed = True
        for dst in self._peers:
            self._jobs[dst].put(None)
        for thread in self._threads.values():
            thread.join(timeout=self.timeout_s)
        stuck = [dst for dst, thread in self._threads.items() if thread.is_alive()]
        if stuck:  # a copy may still run into these buffers: leak them rather than free (or unmap) under it
            import warnings
            warnings.warn(f"FEPLB: copy thread(s) to local rank(s) {stuck} of domain {self.name} did not stop within "
                          f"{self.timeout_s:g} s; their device buffers are not freed", RuntimeWarning, stacklevel=2)
            if self._owns_control:
                unlink_quietly(self._control_shm)  # the name only: the mapping stays valid for the thread
            return
        backend = self.backend
        for dst in self._peers:  # copies still running into a peer's slot must end before we unmap it
            backend.event_synchronize(self._ready[dst])
            self._release_copied(dst, wait=True)
        for dst in list(self._mapped):
            self._unmap(dst)
        for event in [*self._done_peer.values(), *self._ready_peer.values()]:
            backend.event_close(event)
        self._done_peer.clear()
        self._ready_peer.clear()
        me = self._control[self.local_rank, self.local_rank]
        me[IMPORTS_CLOSED] = 1
        self._notify(self.local_rank, self.local_rank, IMPORTS_CLOSED)
        deadline = time.monotonic() + self.timeout_s
        for peer in self._peers:  # a peer that never started or died holds no mapping of ours
            def unmapped(state=self._control[peer, peer], p=peer) -> bool:  # bound now: called within this turn
                return bool(state[IMPORTS_CLOSED] or not state[ALIVE]
                            or (self.watch is not None and not self.watch.alive(p)))
            try:
                wait_until(unmapped,
                           max(0.0, deadline - time.monotonic()),
                           f"{describe_rank(self.watch, peer)} of domain {self.name} to unmap our slots",
                           word=self._word(peer, peer, IMPORTS_CLOSED))
            except PeerTimeoutError:
                pass  # a dead peer's mappings went with its process
        for stream in [*self._streams.values(), *self._recv_streams.values()]:
            backend.stream_destroy(stream)
        for src, (ptr, _) in self._slots.items():
            backend.event_synchronize(self._done[src])
            backend.free(ptr)
        for event in [*self._done.values(), *self._ready.values(), *self._caller_at.values()]:
            backend.event_destroy(event)
        self._slots.clear()
        self._streams.clear()
        self._recv_streams.clear()
        self._words.release()
        del me, self._control
        self._control_shm.close()
        if self._owns_control:
            unlink_quietly(self._control_shm)

    @property
    def extra_parts(self) -> int:
        """Parts sent beyond each message's first (messages larger than their slot), to every peer."""
        return sum(self._extra_parts.values())

    def capacities(self) -> dict[int, int]:
        """Current inbound slot size per source rank (device bytes held: their sum)."""
        return {src: capacity for src, (_, capacity) in self._slots.items()}
