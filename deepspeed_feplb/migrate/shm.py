"""CPU transport for phase 2: a per-domain shared-memory arena and a copy thread.

This is the CPU analogue of the GPU transport (`cuda_ce`): every local rank maps the same
shared memory ("peer pointers"), and a dedicated copy thread ("the Copy Engine") writes a
rank's outgoing messages straight into the receiver's buffers while the main thread computes.
A small message whose channel is free is written by the sender itself (no thread wake-up).

Layout. One control segment per NVLink domain holds, for every ordered pair of local ranks
``src -> dst``, a channel header ``[seq, ack, generation, nbytes]`` (int64). The payload of a
channel lives in a data segment owned by ``src``; when a message does not fit, ``src`` creates a
larger segment under a new generation, so a channel never blocks on size. A channel carries
one message at a time: the producer waits until the consumer acknowledged the previous message
(``ack == seq``) before it writes the next, and only the copy thread ever waits for that. Waits
sleep on the header word they wait for (`segments.Word`); its writer wakes them.

A message is a list of tensors. Its payload starts with its description (`wire.message_words`:
tag, tensor count, bytes, then each tensor's dtype code, byte offset and shape), so the receiver
checks that it got the message it expects (the tag names micro-batch, layer and phase).
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from multiprocessing import shared_memory

import numpy as np
import torch

from deepspeed_feplb.migrate import arena, wire
from deepspeed_feplb.migrate.link import Link
from deepspeed_feplb.segments import (
    PeerWatch,
    Word,
    Words,
    cleanup,
    describe_rank,
    open_segment,
    peer_check,
    unlink_quietly,
    wait_until,
)

_HEADER_FIELDS = 4  # seq, ack, generation, nbytes
_SEQ, _ACK, _GEN, _NBYTES = range(_HEADER_FIELDS)
_ALIGN = 64
INLINE_BYTES = 1 << 20  # larger messages always go to the copy thread, which copies while the sender computes


def _pack_layout(tag: int, tensors: list[torch.Tensor]) -> tuple[np.ndarray, list[int], int]:
    offset = _round_up(wire.description_words(len(tensors)) * 8)
    offsets = []
    for t in tensors:
        offsets.append(offset)
        offset = _round_up(offset + t.numel() * t.element_size())
    return np.array(wire.message_words(tag, tensors, offsets, offset), dtype=np.int64), offsets, offset


def _round_up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class ShmTransport:
    """Moves lists of tensors between the ranks of one NVLink domain through shared memory.

    Args:
        name: unique prefix of this domain's segments (starts with ``feplb-``).
        local_rank: this rank's index in the domain, ``0 <= local_rank < size``.
        size: ranks in the domain.
        timeout_s: how long to wait for a peer before raising `PeerTimeoutError`.

    The domain's rank 0 must construct its transport (which creates the control segment)
    before the others construct theirs; `create_control` / attach order is the caller's barrier.
    """

    # One-way latency of a small message (µs) before the domain measures it on the open transport
    # (`latency.measure_message_us`): a 2-core VM's figure (53 µs with inline sends, idle cores).
    message_us = 50.0

    def __init__(self, name: str, local_rank: int, size: int, timeout_s: float, create: bool,
                 watch: PeerWatch | None = None, device: torch.device | None = None, slot_bytes: int = 0):
        """``device``: the experts' (CPU: host memory is all this transport moves); ``slot_bytes``:
        the first size of each channel's segment (host memory, which grows to its largest message)."""
        self._first_bytes = max(int(slot_bytes), 1 << 16)
        self.name, self.local_rank, self.size, self.timeout_s = name, local_rank, size, timeout_s
        self.watch = watch
        control_bytes = size * size * _HEADER_FIELDS * 8
        self._control_shm = open_segment(f"{name}-ctl", control_bytes, create=create)
        self._owns_control = create
        self._control = np.ndarray((size, size, _HEADER_FIELDS), dtype=np.int64, buffer=self._control_shm.buf)
        if create:
            self._control[:] = 0
        self._outgoing: dict[int, shared_memory.SharedMemory] = {}  # dst -> segment we own
        self._incoming: dict[int, tuple[int, shared_memory.SharedMemory]] = {}  # src -> (generation, segment)
        self._expected = np.zeros(size, dtype=np.int64)  # messages received so far, per src
        self._words = Words(self._control)
        self._jobs: queue.Queue = queue.Queue()
        self._link = Link()  # a message is written by the copy thread or, small and unhindered, inline
        self.closed = False
        self._copy_thread = threading.Thread(target=self._copy_loop, name="feplb-copy", daemon=True)
        self._copy_thread.start()

    @staticmethod
    def device_id(device) -> None:
        """Host memory: no device to tell the domain."""
        return None

    @staticmethod
    def preflight(device, slot: int, local_rank: int, ranks, devices) -> list[str]:
        """Nothing to check before opening: host segments grow as messages need."""
        return []

    # ---------------------------------------------------------------- producer side
    def mark(self) -> None:
        """The host runs in order: every tensor is ready when `send` is called."""
        return None

    def release(self, mark) -> None:
        pass

    def send(self, dst: int, tag: int, tensors: list[torch.Tensor], after=None) -> Future:
        """Queue ``tensors`` for ``dst`` on the copy thread; returns a future done once written.

        The tensors must not be modified until the future is done (``after``: see `mark`).
        """
        if dst == self.local_rank:
            raise ValueError("a rank does not send to itself")
        wire.check(tensors)
        future: Future = Future()
        tensors = [t.detach().contiguous() for t in tensors]
        job = (dst, tag, tensors, future, _pack_layout(tag, tensors))
        if self._link.write_inline(lambda: self._channel_free(dst, job[4][2]), lambda: self._run(job)):
            return future
        self._link.enqueued()
        self._jobs.put(job)
        return future

    def _channel_free(self, dst: int, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` to ``dst`` is small (at most `INLINE_BYTES`: larger ones
        are copied by the thread while the sender computes) and can be written without waiting: the
        receiver has read the previous one and the segment is large enough."""
        channel = self._control[self.local_rank, dst]
        segment = self._outgoing.get(dst)
        return (nbytes <= INLINE_BYTES and channel[_ACK] == channel[_SEQ] and segment is not None
                and segment.size >= nbytes)

    def _run(self, job) -> None:
        dst, tag, tensors, future, layout = job
        try:
            self._write(dst, tensors, layout)
            future.set_result(None)
        except BaseException as exc:  # the waiting main thread re-raises it
            future.set_exception(exc)

    def _copy_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._link.thread_writes():
                self._run(job)

    def _write(self, dst: int, tensors: list[torch.Tensor], layout: tuple[np.ndarray, list[int], int]) -> None:
        channel = self._control[self.local_rank, dst]
        # closing: a peer that is exiting too will never read again, so do not wait out the timeout
        wait_until(lambda: channel[_ACK] == channel[_SEQ] or self.closed, self.timeout_s,
                   f"{describe_rank(self.watch, dst)} of domain {self.name} to read the previous message",
                   peer_check(self.watch, dst), word=self._word(self.local_rank, dst, _ACK))
        if self.closed:
            raise RuntimeError(f"FEPLB transport {self.name} closed before a message to local rank {dst} was sent")
        header, offsets, nbytes = layout
        segment = self._outgoing.get(dst)
        if segment is None or segment.size < nbytes:
            generation = int(channel[_GEN]) + 1
            new = open_segment(f"{self.name}-{self.local_rank}to{dst}-g{generation}",
                               max(nbytes, 2 * (segment.size if segment else 0), self._first_bytes), create=True)
            if segment is not None:
                segment.close()
                unlink_quietly(segment)
            segment = self._outgoing[dst] = new
            channel[_GEN] = generation
        buf = torch.frombuffer(segment.buf, dtype=torch.uint8, count=nbytes)
        buf[:header.nbytes].copy_(torch.from_numpy(header.view(np.uint8)))
        for t, offset in zip(tensors, offsets):
            size = t.numel() * t.element_size()
            buf[offset:offset + size].view(t.dtype).view(t.shape).copy_(t)
        del buf
        channel[_NBYTES] = nbytes
        channel[_SEQ] += 1  # publish last: the consumer waits on seq
        self._word(self.local_rank, dst, _SEQ).notify()

    # ---------------------------------------------------------------- consumer side
    def recv(self, src: int, tag: int, into=None) -> list[torch.Tensor]:
        """Block until the next message from ``src`` arrives; return private copies of its tensors
        (in the tensors ``into`` gives, if given: `Transport.recv`)."""
        channel = self._control[src, self.local_rank]
        expected = self._expected[src] + 1
        wait_until(lambda: channel[_SEQ] >= expected, self.timeout_s,
                   f"{describe_rank(self.watch, src)} of domain {self.name} (message tag {tag:#x})",
                   peer_check(self.watch, src), word=self._word(src, self.local_rank, _SEQ))
        generation = int(channel[_GEN])
        cached = self._incoming.get(src)
        if cached is None or cached[0] != generation:
            if cached is not None:
                cached[1].close()
            cached = self._incoming[src] = (generation,
                                            open_segment(f"{self.name}-{src}to{self.local_rank}-g{generation}"))
        buf = torch.frombuffer(cached[1].buf, dtype=torch.uint8, count=int(channel[_NBYTES]))
        count = int(buf[:wire.HEAD * 8].view(torch.int64)[wire.COUNT])
        header = buf[:wire.description_words(count) * 8].view(torch.int64).numpy()
        found = wire.read_message(header, tag, src)
        sources = [buf[offset:offset + arena.nbytes_of(dtype, shape)].view(dtype).view(shape)
                   for dtype, offset, shape in found]
        if into is None:
            tensors = [source.clone() for source in sources]
        else:
            tensors = wire.checked_into(into, [(shape, dtype) for dtype, _, shape in found], "cpu")
            for out, source in zip(tensors, sources):
                out.copy_(source)
        del buf, header, sources
        self._expected[src] = expected
        channel[_ACK] = expected
        self._word(src, self.local_rank, _ACK).notify()
        return tensors

    def _word(self, src: int, dst: int, field: int) -> Word:
        """The header word ``field`` of channel ``src -> dst``, to sleep on or to ring."""
        return self._words[src, dst, field]

    # ---------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Stop the copy thread, unmap everything and unlink the segments this rank owns."""
        if self.closed:
            return
        self.closed = True
        self._jobs.put(None)
        for dst in range(self.size):  # a copy thread waiting for an ack re-checks `closed` at once
            if dst != self.local_rank:
                self._word(self.local_rank, dst, _ACK).notify()
        self._copy_thread.join(timeout=self.timeout_s)
        for segment in self._outgoing.values():
            segment.close()
            unlink_quietly(segment)
        for _, segment in self._incoming.values():
            segment.close()
        self._outgoing.clear()
        self._incoming.clear()
        self._words.release()
        del self._control
        self._control_shm.close()
        if self._owns_control:
            unlink_quietly(self._control_shm)
            cleanup(f"{self.name}-")  # segments of ranks that died without cleaning up
