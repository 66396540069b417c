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
* **Growing a slot** needs the receiver (it owns the memory): the sender closes its mapping and
  asks for ``want`` bytes; the receiver, inside the `recv` that waits for that very message,
  frees the slot (after its last read finished), allocates ``max(want, 2 * capacity)`` and
  publishes the new handle under a new generation. Nothing else waits for it, so no deadlock.
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

DEFAULT_CAPACITY = 64 << 20
DEFAULT_MAX_TENSORS = 256

# words of a channel (src -> dst) in the control block; handles take 8 words (64 bytes)
SEQ, ACK, NBYTES, GEN, CAP, WANT, TAG, COUNT = range(8)
SLOT_H, READY_H, DONE_H = 8, 16, 24
META = 32
# the diagonal channel (r, r) carries rank r's state
ALIVE, IMPORTS_CLOSED = 0, 1


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
        capacity_bytes: initial size of each inbound slot (`arena.channel_capacity_hint`).
        max_tensors: most tensors in one message.
        watch: a `segments.PeerWatch`: waits fail fast, naming the rank, when a peer died.
    """

    # One-way latency of a small message (µs), for the planner's time model: measured on an H200
    # machine with `tests/gpu/bench_transport.py` (228 µs with inline sends; docs/GPU.md).
    message_us = 230.0

    def __init__(self, name: str, local_rank: int, size: int, timeout_s: float, create: bool, watch=None, *,
                 device=None, backend=None, capacity_bytes: int = DEFAULT_CAPACITY,
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

        # receiver side: one inbound slot and one consumed event per peer
        self._slots: dict[int, tuple[int, int]] = {}  # src -> (ptr, capacity)
        self._done: dict[int, int] = {}  # src -> consumed event (ours, interprocess)
        self._expected = np.zeros(size, dtype=np.int64)
        self._ready_peer: dict[int, int] = {}  # src -> the sender's ready event, opened
        for src in self._peers:
            channel = self._control[src, local_rank]
            self._slots[src] = self._allocate_slot(channel, align_up(capacity_bytes))
            self._done[src] = backend.event_create(interprocess=True)
            _put_handle(channel, DONE_H, backend.event_handle(self._done[src]))
            channel[GEN] = 1  # publish last: the sender waits for a generation
            self._notify(src, local_rank, GEN)
        # sender side: one copy stream, ready event, thread and job queue per destination
        self._streams = {dst: backend.stream_create() for dst in self._peers}
        self._recv_streams = {src: backend.stream_create() for src in self._peers}
        self._ready = {dst: backend.event_create(interprocess=True) for dst in self._peers}
        for dst in self._peers:
            _put_handle(self._control[local_rank, dst], READY_H, backend.event_handle(self._ready[dst]))
        self._mapped: dict[int, tuple[int, int]] = {}  # dst -> (peer slot ptr, generation); copy thread only
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

    def _serve_growth(self, src: int) -> None:
        channel = self._control[src, self.local_rank]
        want = int(channel[WANT])
        if want <= int(channel[CAP]):
            return
        ptr, capacity = self._slots[src]
        self.backend.event_synchronize(self._done[src])  # our last read of the old slot finished
        self.backend.free(ptr)  # the sender closed its mapping before asking
        self._slots[src] = self._allocate_slot(channel, align_up(max(want, 2 * capacity)))
        channel[WANT] = 0
        channel[GEN] += 1  # publish last
        self._notify(src, self.local_rank, GEN)

    # ---------------------------------------------------------------- producer side
    def send(self, dst: int, tag: int, tensors: list[torch.Tensor]) -> Future:
        """Queue ``tensors`` for ``dst``; returns a future done once the copies are *enqueued*.

        The copies start when the caller's current stream reaches this call (an event), so the
        tensors may come straight from the compute stream; the host never waits for them. Their
        memory is kept from reuse until the copies completed (the copy thread holds them); they must
        not be modified afterwards on another stream.
        """
        if dst == self.local_rank:
            raise ValueError("a rank does not send to itself")
        if dst not in self._jobs:
            raise ValueError(f"no local rank {dst} in a domain of {self.size}")
        if len(tensors) > self.max_tensors:
            raise ValueError(f"a message holds at most {self.max_tensors} tensors, got {len(tensors)}")
        wire.check(tensors)
        tensors = [t.detach().contiguous() for t in tensors]
        ready = self.backend.event_create()
        self.backend.event_record(ready, self.backend.current_stream())
        future: Future = Future()
        job = (tag, tensors, ready, future, message_layout([(t.dtype, t.shape) for t in tensors]))
        if self._link[dst].write_inline(lambda: self._slot_free(dst, job[4][1]), lambda: self._run(dst, job)):
            return future
        self._link[dst].enqueued()
        self._jobs[dst].put(job)
        return future

    def _slot_free(self, dst: int, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` to ``dst`` can be written without waiting: the receiver has
        read the previous one and its slot is large enough (no growth to ask for)."""
        channel = self._control[self.local_rank, dst]
        return channel[ACK] == channel[SEQ] and channel[GEN] >= 1 and nbytes <= channel[CAP] and not channel[WANT]

    def _run(self, dst: int, job) -> None:
        tag, tensors, ready, future, layout = job
        try:
            self._write(dst, tag, tensors, ready, layout)
            future.set_result(None)  # enqueued: the receiver orders itself after _ready[dst]
        except BaseException as exc:  # the waiting caller re-raises it
            future.set_exception(exc)
        finally:
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
        wait_until(lambda: channel[ACK] == channel[SEQ], self.timeout_s,
                   f"{describe_rank(self.watch, dst)} of domain {self.name} to read the previous message", check,
                   word=self._word(me, dst, ACK))
        if channel[SEQ] > 0:  # the receiver's copy-out of the previous message must finish first
            if dst not in self._done_peer:
                self._done_peer[dst] = backend.event_open(_get_handle(channel, DONE_H))
            backend.stream_wait_event(stream, self._done_peer[dst])
        offsets, nbytes = layout
        wait_until(lambda: channel[GEN] >= 1, self.timeout_s,
                   f"{describe_rank(self.watch, dst)} of domain {self.name} to start",
                   check, word=self._word(me, dst, GEN))
        if nbytes > channel[CAP]:
            self._unmap(dst)
            generation = int(channel[GEN])
            channel[WANT] = nbytes
            self._notify(me, dst, SEQ)  # the receiver waits on seq: let it see the request
            wait_until(lambda: channel[GEN] > generation, self.timeout_s,
                       f"{describe_rank(self.watch, dst)} of domain {self.name} to grow its slot to {nbytes} bytes",
                       check, word=self._word(me, dst, GEN))
        peer = self._map(dst, channel)
        backend.stream_wait_event(stream, ready)
        for t, offset in zip(tensors, offsets):
            if t.numel() == 0:
                continue  # an empty tensor (e.g. phase 2's chunk flags) travels in its description only
            backend.memcpy_async(peer + offset, t.data_ptr(), t.numel() * t.element_size(), stream)
        copied = backend.event_create()
        backend.event_record(copied, stream)
        self._in_flight[dst].append((copied, tensors))  # memory kept from the allocator until the copies ran
        backend.event_record(self._ready[dst], stream)
        meta = channel[META:META + len(tensors) * wire.FIELDS].reshape(len(tensors), wire.FIELDS)
        for row, t, offset in zip(meta, tensors, offsets):
            wire.describe(row, t, offset)
        channel[TAG], channel[COUNT], channel[NBYTES] = tag, len(tensors), nbytes
        channel[SEQ] += 1  # publish last: the receiver waits on seq
        self._notify(me, dst, SEQ)

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
        generation = int(channel[GEN])
        mapped = self._mapped.get(dst)
        if mapped is None or mapped[1] != generation:
            self._unmap(dst)
            mapped = self._mapped[dst] = (self.backend.ipc_open(_get_handle(channel, SLOT_H)), generation)
        return mapped[0]

    def _unmap(self, dst: int) -> None:
        mapped = self._mapped.pop(dst, None)
        if mapped is not None:
            self.backend.ipc_close(mapped[0])

    # ---------------------------------------------------------------- consumer side
    def recv(self, src: int, tag: int) -> list[torch.Tensor]:
        """Block until the next message from ``src`` arrives; return private copies of its tensors.

        The copy out of the slot runs on this source's receive stream (after the sender's copies),
        not on the caller's compute stream, which only waits for it; the returned tensors can be
        used on the caller's current stream at once.
        """
        channel = self._control[src, self.local_rank]
        expected = self._expected[src] + 1

        def arrived() -> bool:
            if channel[WANT]:
                self._serve_growth(src)
            return channel[SEQ] >= expected

        wait_until(arrived, self.timeout_s,
                   f"{describe_rank(self.watch, src)} of domain {self.name} (message tag {tag:#x})",
                   peer_check(self.watch, src), word=self._word(src, self.local_rank, SEQ))
        wire.check_tag(tag, channel[TAG], src)
        backend, stream = self.backend, self._recv_streams[src]
        # the tensors below are allocated on the caller's stream, whose earlier work may still use that memory
        backend.event_record(self._caller_at[src], backend.current_stream())
        backend.stream_wait_event(stream, self._caller_at[src])
        if src not in self._ready_peer:
            self._ready_peer[src] = backend.event_open(_get_handle(channel, READY_H))
        backend.stream_wait_event(stream, self._ready_peer[src])
        slot = self._slots[src][0]
        tensors = []
        count = int(channel[COUNT])
        for row in channel[META:META + count * wire.FIELDS].reshape(count, wire.FIELDS).tolist():
            dtype, offset, shape = wire.read(row)
            out = backend.empty(shape, dtype)
            if out.numel():
                backend.memcpy_async(out.data_ptr(), slot + offset, out.numel() * out.element_size(), stream)
            tensors.append(out)
        backend.event_record(self._done[src], stream)  # consumed: the sender may overwrite the slot
        backend.stream_wait_event(backend.current_stream(), self._done[src])  # the caller sees the data
        self._expected[src] = expected
        channel[ACK] = expected
        self._notify(src, self.local_rank, ACK)
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

    def capacities(self) -> dict[int, int]:
        """Current inbound slot size per source rank (device bytes held: their sum)."""
        return {src: capacity for src, (_, capacity) in self._slots.items()}
