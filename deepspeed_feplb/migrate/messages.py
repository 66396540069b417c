"""What each phase-2 message holds, described once for its sender and its receiver.

A message is a list of tensors (`Transport.send`). Its layout is a `MessageLayout`: per chunk,
named parts of a fixed number of tensors. Both sides build the layout with the same function
from what they both know (the plan, the residency flags that travel first), so neither counts
positions by hand, and a message of the wrong length fails naming itself instead of shifting
every tensor after the first mistake.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class MessageLayout:
    """parts[c]: the (name, tensor count) parts of chunk ``c``, in message order."""
    parts: tuple[tuple[tuple[str, int], ...], ...]

    def pack(self, chunks: Sequence[dict]) -> list:
        """Per chunk ``{name: [tensors]}`` -> the message's flat tensor list."""
        if len(chunks) != len(self.parts):
            raise ValueError(f"phase-2 message: {len(chunks)} chunks, the layout has {len(self.parts)}")
        out: list = []
        for layout, chunk in zip(self.parts, chunks):
            for name, count in layout:
                if count:
                    tensors = list(chunk[name])
                    if len(tensors) != count:
                        raise ValueError(f"phase-2 message part {name!r}: {len(tensors)} tensors, "
                                         f"the layout says {count}")
                    out += tensors
        return out

    def unpack(self, message: Sequence, what: str) -> list[dict]:
        """The flat tensor list -> per chunk ``{name: [tensors]}`` (empty lists for parts of 0);
        ``what`` names the message in the error when its length does not match."""
        expected = sum(count for layout in self.parts for _, count in layout)
        if len(message) != expected:
            raise RuntimeError(f"FEPLB phase 2: a {what} message holds {len(message)} tensors, its layout {expected}")
        out, at = [], 0
        for layout in self.parts:
            chunk = {}
            for name, count in layout:
                chunk[name] = list(message[at:at + count])
                at += count
            out.append(chunk)
        return out

    def receive_into(self, name: str, places: Sequence, device: torch.device):
        """A `Transport.recv` ``into`` that lands part ``name`` of chunk ``c`` in ``places[c]`` (its
        tensors: views of the caller's buffers, so no copy follows the receive) where the message's
        tensor has that place's shape and dtype, and every other tensor in a new one on ``device``.
        The caller copies a tensor that did not land in its place (``is not``) itself."""
        def into(descriptions: list) -> list[torch.Tensor]:
            out = []
            for c, layout in enumerate(self.parts):
                for part, count in layout:
                    for k in range(count):
                        shape, dtype = descriptions[len(out)]
                        place = places[c][k] if part == name else None
                        fits = place is not None and list(place.shape) == list(shape) and place.dtype == dtype \
                            and place.is_contiguous()
                        out.append(place if fits else None)
            return message_buffers(descriptions, device, given=out)
        return into


ALIGN_BYTES = 256  # where each tensor (or group of tensors) of a received message starts in its buffer


def message_buffers(descriptions: Sequence, device: torch.device, given: Sequence = (),
                    groups: Sequence[Sequence[int]] = (), apart: Sequence[int] = ()) -> list[torch.Tensor]:
    """Receive buffers for a message's ``descriptions`` ((shape, dtype) each, `Transport.recv`):
    ``given[i]`` where it is a tensor, else a view of one allocation per dtype (one allocator call
    for the message, where a tensor each took one per tensor). The tensors of each group in
    ``groups`` (lists of indices) lie back to back in it, in order, so that `phase2.stacked_view`
    takes a group as one tensor; each group, and each other tensor, starts at a multiple of
    `ALIGN_BYTES` (what a grouped GEMM's operands and vectorised kernels need). The tensors in
    ``apart`` (indices) get allocations of their own per dtype, so that one kept part (a weight
    copy a helper keeps for the step) does not keep the others' memory (the rows)."""
    given = list(given) + [None] * (len(descriptions) - len(given))
    grouped = {i for group in groups for i in group}
    runs = [list(group) for group in groups if group] + [[i] for i in range(len(descriptions)) if i not in grouped]
    apart = set(apart)
    layout: dict = {}  # (dtype, apart) -> ([(index, offset in elements)], elements)
    for run in runs:
        run = [i for i in run if given[i] is None]
        if not run:
            continue
        dtype = descriptions[run[0]][1]
        key = (dtype, run[0] in apart)
        places, at = layout.setdefault(key, ([], 0))
        align = max(ALIGN_BYTES // dtype.itemsize, 1)
        at = -(-at // align) * align
        for i in run:
            shape, kind = descriptions[i]
            if kind != dtype or (i in apart) != key[1]:
                raise ValueError(f"phase-2 message: a group mixes {dtype} and {kind}, or kept and apart tensors")
            places.append((i, at))
            at += math.prod(shape)
        layout[key] = (places, at)
    out = list(given)
    for (dtype, _), (places, total) in layout.items():
        flat = torch.empty(total, dtype=dtype, device=device)
        for i, at in places:
            shape = descriptions[i][0]
            out[i] = flat[at:at + math.prod(shape)].view(shape)
    return out


def served_parts(sizes: Sequence[int], parts: int) -> list[list[tuple[int, int, int]]]:
    """How a helper computes one home's chunks of ``sizes`` rows in ``parts`` parts
    (`plan.time_model.serve_parts`), each part's results one message: the chunks' rows, back to
    back, cut into ``parts`` near-equal runs. Per part, its pieces ``(chunk, first row in the chunk,
    rows)`` in chunk order; a chunk of no rows is a piece of the part where it would start; no
    chunks, no parts."""
    if not sizes:
        return []
    total = sum(sizes)
    bounds = [total * p // parts for p in range(parts + 1)]
    out: list = [[] for _ in range(parts)]
    p, at = 0, 0
    for c, n in enumerate(sizes):
        first = 0
        while True:
            while p + 1 < parts and bounds[p + 1] <= at + first:
                p += 1
            end = min(n, bounds[p + 1] - at) if p + 1 < parts else n
            out[p].append((c, first, end - first))
            first = end
            if first >= n:
                break
        at += n
    return out


def rows_to_helper(carries: Sequence[bool], n_params: int, n_buffers: int) -> MessageLayout:
    """Home -> helper, forward (after a flags tensor): per chunk the expert's weights (when it
    carries them), its buffers, and its rows."""
    return MessageLayout(tuple((("weights", n_params if carry else 0), ("buffers", n_buffers), ("rows", 1))
                               for carry in carries))


def outputs_to_home(chunks: int) -> MessageLayout:
    """Helper -> home, forward: per chunk its output rows."""
    return MessageLayout(((("outputs", 1), ), ) * chunks)


def output_grads_to_helper(chunks: int) -> MessageLayout:
    """Home -> helper, backward: per chunk the gradient of its output rows."""
    return MessageLayout(((("output_grads", 1), ), ) * chunks)


def grads_to_home(goes_home: Sequence[bool], n_params: int) -> MessageLayout:
    """Helper -> home, backward: per chunk the gradient of its rows, and its weight-gradients
    unless the helper keeps the copy (they go home at the step's end, `flushed_to_home`)."""
    return MessageLayout(tuple((("input_grads", 1), ("weight_grads", n_params if home else 0)) for home in goes_home))


def flushed_to_home(copies: int, n_params: int) -> MessageLayout:
    """Helper -> home at the step's end: per kept copy its accumulated weight-gradients."""
    return MessageLayout(((("weight_grads", n_params), ), ) * copies)
