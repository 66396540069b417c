"""How a transport message describes itself: one layout for every transport.

A message is a list of tensors. Its description is int64 words: the head (`HEAD`: the message's
tag, its tensor count, its bytes and a spare word, at indices `TAG`, `COUNT`, `NBYTES`), then per
tensor ``(dtype code, byte offset, ndim, shape[MAX_DIMS])`` (`FIELDS` words), the dtype code being
its index in `DTYPES`. `message_words` writes one, `read_message` reads it back.
"""
from __future__ import annotations

import torch

MAX_DIMS = 4
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool)
FIELDS = 3 + MAX_DIMS  # dtype code, offset, ndim, shape
HEAD_NAMES = ("tag", "count", "nbytes", "spare")
TAG, COUNT, NBYTES, _SPARE = range(len(HEAD_NAMES))
HEAD = len(HEAD_NAMES)
_CODES = {dtype: code for code, dtype in enumerate(DTYPES)}
_PAD = [(0, ) * (MAX_DIMS - n) for n in range(MAX_DIMS + 1)]  # the unused shape words of an n-dim tensor


def check(tensors: list[torch.Tensor]) -> None:
    """Raise if a tensor cannot travel: more than `MAX_DIMS` dims or a dtype outside `DTYPES`."""
    for t in tensors:
        if t.dim() > MAX_DIMS:
            raise ValueError(f"transport tensors have at most {MAX_DIMS} dims, got shape {tuple(t.shape)}")
        if t.dtype not in _CODES:
            raise TypeError(f"transport cannot move {t.dtype}")


def description(t: torch.Tensor, offset: int) -> list[int]:
    """The `FIELDS` words that describe ``t`` stored at byte ``offset``."""
    shape = t.shape
    return [_CODES[t.dtype], offset, len(shape), *shape, *_PAD[len(shape)]]


def message_words(tag: int, tensors: list[torch.Tensor], offsets: list[int], nbytes: int) -> list[int]:
    """The description of a message (module docstring): ``tensors`` stored at byte ``offsets`` of
    its ``nbytes``, as `description_words(len(tensors))` ints."""
    words = [tag, len(tensors), nbytes, 0]
    for t, offset in zip(tensors, offsets):
        words += description(t, offset)
    return words


def description_words(count: int) -> int:
    """Words of the description of a message of ``count`` tensors."""
    return HEAD + count * FIELDS


def read_message(words, tag: int, src: int) -> list[tuple[torch.dtype, int, list[int]]]:
    """(dtype, byte offset, shape) per tensor of the message described by ``words`` (a list of ints
    or an int64 array holding at least its description: only the description is read), checked to
    be ``tag`` from local rank ``src`` (`check_tag`)."""
    check_tag(tag, int(words[TAG]), src)
    described = words[HEAD:description_words(int(words[COUNT]))]
    described = described.tolist() if hasattr(described, "tolist") else described
    found = []
    for at in range(0, len(described), FIELDS):
        code, offset, ndim, *shape = described[at:at + FIELDS]
        found.append((DTYPES[code], offset, shape[:ndim]))
    return found


def check_tag(expected: int, got: int, src: int) -> None:
    """Raise if a received message is not the one the protocol expects next from local rank ``src``."""
    if got != expected:
        raise RuntimeError(f"FEPLB transport out of step: expected message {expected:#x} from local rank {src}, "
                           f"got {int(got):#x}")


def checked_into(into, descriptions: list, device_type: str) -> list[torch.Tensor]:
    """The tensors a receiver's ``into`` gives for a message's ``descriptions`` ((shape, dtype) each,
    `Transport.recv`), checked: one contiguous tensor of that shape and dtype per description, on
    a device of ``device_type`` (the transport's: "cpu" or "cuda")."""
    outs = list(into(descriptions))
    if len(outs) != len(descriptions):
        raise RuntimeError(f"FEPLB transport: {len(outs)} receive buffers for a message of {len(descriptions)} tensors")
    for i, (out, (shape, dtype)) in enumerate(zip(outs, descriptions)):
        if (list(out.shape) != list(shape) or out.dtype != dtype or not out.is_contiguous()
                or out.device.type != device_type):
            raise RuntimeError(f"FEPLB transport: receive buffer {i} is {out.dtype} {tuple(out.shape)} on "
                               f"{out.device}{'' if out.is_contiguous() else ' (not contiguous)'}, the message's "
                               f"tensor {dtype} {tuple(shape)} on {device_type}")
    return outs
