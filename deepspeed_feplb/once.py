"""What a process says once (a warning, a notice), by topic: a job that builds many layers or runs
many micro-batches says each thing one time."""
from __future__ import annotations

from typing import Hashable

__all__ = ["first_time", "forget"]

_said: set = set()


def first_time(topic: Hashable) -> bool:
    """True the first time this process asks about ``topic``, False ever after."""
    if topic in _said:
        return False
    _said.add(topic)
    return True


def forget(topic: Hashable) -> None:
    """Let ``topic`` be said again (tests that check a warning)."""
    _said.discard(topic)
