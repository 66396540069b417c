"""Counting the aten operations a piece of code runs (`count_ops`).

On a GPU every non-view aten operation is at least one kernel launch (or a copy) that the host must
issue: a count taken on the CPU, where the code runs the same operators, says how much the host
has to issue per layer before the GPU is anywhere near busy.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

from torch.utils._python_dispatch import TorchDispatchMode

_VIEWISH = {"detach", "alias", "lift_fresh", "_unsafe_view"}  # no kernel, no copy


def _is_view(func) -> bool:
    schema = func._schema
    if func._overloadpacket.__name__ in _VIEWISH:
        return True
    # a view returns an alias of an input without writing it (``Tensor(a)`` out, no ``!``)
    return bool(schema.returns) and all(r.alias_info is not None and not r.alias_info.is_write
                                        for r in schema.returns)


@dataclass
class OpCount:
    """Aten operations run inside a `count_ops` block: ``ops`` (every one), ``non_view`` (those that
    launch work: not views), ``by_name`` (non-view, per operator)."""
    ops: int = 0
    non_view: int = 0
    by_name: Counter = field(default_factory=Counter)

    def top(self, n: int = 8) -> dict:
        return dict(self.by_name.most_common(n))


class _Counting(TorchDispatchMode):
    def __init__(self, into: OpCount):
        super().__init__()
        self.into = into

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.into.ops += 1
        if not _is_view(func):
            self.into.non_view += 1
            self.into.by_name[func._overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_ops():
    """``with count_ops() as count:`` every aten operation that this thread dispatches inside the
    block, forward and (when ``backward()`` runs inside it) the autograd engine's backward ops, which
    run in this thread on the CPU. Yields an `OpCount`, filled when the block ends."""
    count = OpCount()
    with _Counting(count):
        yield count
