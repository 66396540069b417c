"""Who writes a channel's messages, in order: its copy thread, or the sender itself.

The shared-memory transport (`shm`) hands messages to a copy thread so that a send never waits for a
receiver that has not read the previous message yet. Waking that thread is most of a small
message's latency (docs/GPU.md), so a sender writes the message itself when that cannot wait:
nothing is queued or being written on the link, and the channel is ready for it.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable


class Link:
    """The write order of one link (a channel, or every channel a copy thread serves).

    A sender calls `write_inline`; when that returns False it calls `enqueued` and puts the message
    on the copy thread's queue, which writes it inside `thread_writes`. A message is written inline
    only while nothing is queued or being written, so messages keep their send order.
    """

    def __init__(self):
        self._writing = threading.Lock()  # held by whoever writes: the copy thread or an inline sender
        self._queued = 0  # messages queued for the copy thread or being written by it
        self._count = threading.Lock()

    def write_inline(self, ready: Callable[[], bool], write: Callable[[], None]) -> bool:
        """Call ``write()`` now if nothing is queued or being written and ``ready()`` (the write
        cannot wait); returns whether it did."""
        if not self._writing.acquire(blocking=False):
            return False
        try:
            if self._queued or not ready():
                return False
            write()
            return True
        finally:
            self._writing.release()

    def enqueued(self) -> None:
        """A message was handed to the copy thread (call before putting it on its queue)."""
        with self._count:
            self._queued += 1

    @contextlib.contextmanager
    def thread_writes(self):
        """The copy thread writes one queued message inside this block."""
        with self._writing:
            yield
        with self._count:
            self._queued -= 1
