"""Whether an expert's weights changed since a copy of them was made: one contract for every copy.

A copy of an expert's weights (a helper's kept copy, `migrate.resident`; a replica slot,
`integration.replicas`) must compute with the home's weights as they are when the forward runs,
however they were written: by the optimizer step, in place under ``torch.no_grad()``, through
``p.data``, by ``load_state_dict``, or swapped out and back for an evaluation. Three signals,
cheapest first:

* **Known writes**: the optimizer step and ``load_state_dict`` (the layers' hooks), and the user's
  own declaration, `weights_changed` (for writes through ``p.data`` between the micro-batches of one
  accumulation cycle, the one case nothing else sees).
* **Write marks** (`write_marks`), host only and free: each parameter's storage pointer and version
  counter. The counter advances on every in-place write to the parameter or a view of it
  (``torch.no_grad()`` included, so ``load_state_dict`` too), not on one through ``p.data``, which
  has a counter of its own; replacing ``p.data`` moves the pointer.
* **Content** (`content_hash`), once per accumulation cycle where a copy outlives it (replicas:
  an evaluation between steps with weights swapped in through ``p.data``): a hash of every bit of
  the weights that no structured write can fool. Each parameter's bit patterns ``B`` (``[R, C]``,
  rows the first dimension) are taken as integers modulo the prime ``P = 2^32 + 15`` (so distinct
  patterns stay distinct) and hashed as ``r^T B c mod P`` with random row and column weights
  ``r``, ``c`` drawn from ``[0, 2^30)``, twice. For any change ``D != 0`` that does not depend on
  the weights, ``r^T D c`` is a non-zero polynomial of degree 2 in them, so (Schwartz-Zippel) a
  hash misses it with probability at most ``2 / 2^30``, both with at most ``2^-58``, per changed
  parameter and check. (The row and column sums this replaces missed a 2x2 block scaled by 2 and
  by 1/2 every time.) The weights come from a fixed seed, so every rank hashes alike and a home's
  hash compares with a holder's.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

__all__ = ["content_hash", "weights_changed", "write_marks", "HASH_PRIME"]

HASH_PRIME = 4_294_967_311  # the least prime above 2^32: a bit pattern of up to 32 bits is its own residue
_DRAW = 1 << 30  # weights drawn from [0, 2^30): a weight times a residue < 2^62 fits int64
_HASHES = 2
_SEED = 0xFE91B
_CHUNK = 1 << 21  # elements per pass: the int64 temporary [rows, 2, C] stays within 32 MiB
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def write_marks(params: list[torch.Tensor]) -> tuple:
    """Host-only stamp of ``params``: (storage pointer, version counter) each. It changes with every
    in-place write to a parameter (or a view of it) and with a replaced ``p.data``, but not with a
    write through ``p.data``."""
    return tuple((p.data_ptr(), p._version) for p in params)


def content_hash(params: list[torch.Tensor]) -> torch.Tensor:
    """int64 ``[2 * len(params)]`` on the parameters' device: per parameter two hashes of its bits
    (module docstring; an 8-byte element as its two 32-bit halves).

    Cost per parameter of R x C elements: about 7 operations per pass of `_CHUNK` elements, each
    reading the pass's int64 temporaries once (16 bytes per element)."""
    out = []
    for p in params:
        bits = p.detach().reshape(p.shape[0] if p.dim() else 1, -1)
        if bits.element_size() == 8:  # two 32-bit halves each: a 64-bit pattern is not its own residue
            bits = bits.contiguous().view(torch.int32)
        bits = bits.view(_INT_OF_SIZE[bits.element_size()])
        rows, cols = bits.shape
        r, c = _weights(rows, 0, bits.device), _weights(cols, 1, bits.device)  # [2, R], [2, C]
        total = torch.zeros(_HASHES, dtype=torch.int64, device=bits.device)
        step = max(1, _CHUNK // max(cols, 1))
        for start in range(0, rows, step):
            x = bits[start:start + step].to(torch.int64).remainder_(HASH_PRIME)  # [s, C]
            by_row = (x[:, None, :] * c).remainder_(HASH_PRIME).sum(-1).remainder_(HASH_PRIME)  # [s, 2]
            total += (by_row * r[:, start:start + step].T).remainder_(HASH_PRIME).sum(0)
        out.append(total.remainder_(HASH_PRIME))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)


@lru_cache(maxsize=256)
def _weights(length: int, role: int, device: torch.device) -> torch.Tensor:
    """int64 ``[2, length]`` in ``[0, 2^30)``, the same in every process (``role`` 0: rows, 1: columns)."""
    draw = np.random.default_rng([_SEED, role, length]).integers(0, _DRAW, size=(_HASHES, length), dtype=np.int64)
    return torch.from_numpy(draw).to(device)


def weights_changed(model: torch.nn.Module) -> None:
    """Declare that expert weights of ``model`` (a module, or a DeepSpeed engine) were written through
    ``p.data`` between two micro-batches of one gradient-accumulation cycle: every FEPLB layer's
    copies of its experts' weights (kept copies, replica slots) take them again at the next forward.
    Call it on every rank, after the write and before the next forward. Not needed after the
    optimizer step, ``load_state_dict``, in-place writes under ``torch.no_grad()``, or any write
    between optimizer steps: those are seen (module docstring)."""
    module = getattr(model, "module", model)
    for layer in module.modules():
        declare = getattr(layer, "feplb_weights_changed", None)
        if callable(declare):
            declare()
