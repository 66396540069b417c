"""Phase 2: rows and weights of dynamic experts to helper ranks of the NVLink domain, and back.

* `phase2`: the autograd function that runs one micro-batch's plan (forward and backward) over a
  `Transport`; it knows nothing about how bytes move.
* `shm.ShmTransport` (CPU: a shared-memory arena and a copy thread) and
  `cuda_ce.CudaCETransport` (CUDA IPC peer rings, ``cudaMemcpyAsync`` on copy streams ordered by
  flag words the streams wait on: the host enqueues and never waits for the device) are the
  two transports; `transport_class` picks one from ``feplb.transport``.
* `wire`: how a message's tensors are described (dtype codes, shapes), shared by both.

To add a transport: implement `Transport` (constructor and three methods, below), keep its
message semantics (per-pair FIFO, tag check, private copies on receive), and select it in
`transport_class`. `tests/test_mailbox.py`-style protocol tests run any transport on CPU ranks.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Callable, Optional, Protocol

import torch

from deepspeed_feplb.config import FEPLBConfig, FEPLBConfigError

# into(descriptions) -> tensors: where a received message's tensors go; ``descriptions`` its
# tensors' (shape, dtype) in order, the result one contiguous tensor of that shape and dtype each
Into = Callable[[list], list]


class Transport(Protocol):
    """Moves lists of tensors between the ranks of one NVLink domain.

    Constructed as ``cls(name, local_rank, size, timeout_s, create, watch, device=device,
    slot_bytes=slot_bytes)``:
    ``name`` is the domain's unique segment prefix (starts with ``feplb-``), ``local_rank`` in
    ``[0, size)``; the rank with ``create=True`` (local rank 0) is constructed first (the caller's
    barrier); waits longer than ``timeout_s`` raise `segments.PeerTimeoutError`, and ``watch``
    (a `segments.PeerWatch`) makes them fail fast, naming the rank, once a peer died; ``device``
    is where this rank's experts live (the CUDA transport's slots and streams go there);
    ``slot_bytes`` is the size of each receive slot (`arena.slot_bytes`), which a device transport
    allocates once and sends larger messages through in parts. Before any rank constructs one,
    each calls ``cls.preflight(device, slot_bytes, local_rank, ranks, devices)`` (``devices``: every
    domain rank's ``cls.device_id(device)``) and the domain opens only when no rank of the EP group
    reports a problem (a list of strings naming ranks, bytes and settings).

    Messages between one ordered pair of ranks arrive in the order they were sent; every message
    carries a ``tag`` (micro-batch step and phase) that the receiver checks.
    """

    closed: bool
    # one-way latency of a small message (µs), which the time model prices: the class's prior until
    # the domain measures it on the open transport (`latency.measure_message_us`) and sets it
    message_us: float

    @staticmethod
    def device_id(device) -> object:
        """What tells the domain's other ranks which device this rank's messages live on (picklable)."""

    @staticmethod
    def preflight(device, slot_bytes: int, local_rank: int, ranks: list[int], devices: list) -> list[str]:
        """What keeps this rank from opening the transport (empty: nothing)."""

    def mark(self) -> object:
        """A ready point: the caller's work queued so far (CUDA: an event on the current stream;
        None where the host executes in order). Hand it to `send` as ``after``; `release` it once
        every such send's future is done."""

    def release(self, mark: object) -> None:
        """Forget a `mark` (its sends are queued; the device may still be waiting on it)."""

    def send(self, dst: int, tag: int, tensors: list[torch.Tensor], after: object = None) -> Future:
        """Queue ``tensors`` (any of `wire.DTYPES`, at most `wire.MAX_DIMS` dims) for local rank
        ``dst``; returns at once with a future that is done once they are written (a stream-ordered
        transport returns it done: its copies are enqueued, or queued on the host for a free slot). The tensors
        must not be modified until then. Their copies start once the caller's work queued before
        the call is done, or, with ``after`` (a `mark`), once the work queued before that mark is:
        rows ready before later work was queued need not wait for it."""

    def recv(self, src: int, tag: int, into: Optional[Into] = None) -> list[torch.Tensor]:
        """Block until the next message from ``src`` arrives; raise if its tag is not ``tag``;
        return tensors this rank owns (the sender may reuse its buffer at once): new ones, or the
        ones ``into`` returns for the message's (shape, dtype) list (views into buffers the caller
        laid out, such as stacked weights), which are then written and returned."""

    def close(self) -> None:
        """Stop copying, unmap and free what this rank owns (idempotent; also after a peer died)."""


def cuda_available() -> bool:
    """True when torch sees a CUDA device and CuPy can use it (what `CudaCETransport` needs)."""
    try:
        if not torch.cuda.is_available():
            return False
        import cupy
        return bool(cupy.cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken CuPy install means "not available"
        return False


def transport_kind(config: FEPLBConfig, expert_params) -> str:
    """The transport ``feplb.transport`` gives these (already placed) expert parameters: "shm" (host
    memory: CPU experts) or "cuda_ce" (CUDA IPC and the copy engine: CUDA experts). "auto" picks by
    where the experts live. `FEPLBConfigError` names what is missing for ``cuda_ce``, and refuses
    CUDA experts on ``shm`` (its messages are host memory)."""
    params = list(expert_params)
    on_cuda = bool(params) and all(p.is_cuda for p in params)
    kind = config.transport if config.transport != "auto" else ("cuda_ce" if on_cuda else "shm")
    if kind == "cuda_ce" and not cuda_available():
        missing = "CuPy (the gpu or gpu-cuda13 extra, docs/GPU.md)" if on_cuda else "a CUDA device and CuPy"
        fix = "install CuPy" if on_cuda else "use \"auto\" or \"shm\""
        raise FEPLBConfigError(f"feplb.transport: \"{config.transport}\" with experts on "
                               f"{'CUDA' if on_cuda else 'the CPU'} needs the cuda_ce transport, which needs "
                               f"{missing}; {fix}")
    if kind == "shm" and on_cuda:
        raise FEPLBConfigError("feplb.transport: \"shm\" moves host memory and the experts are on CUDA; use \"auto\" "
                               "or \"cuda_ce\" (with CuPy installed)")
    return kind


def validate_transport(config: FEPLBConfig, expert_params) -> None:
    """`FEPLBConfigError` where ``feplb.transport`` cannot move these experts (`transport_kind`)."""
    transport_kind(config, expert_params)


def transport_class(config: FEPLBConfig, expert_params) -> type:
    """The `Transport` class of `transport_kind`."""
    if transport_kind(config, expert_params) == "cuda_ce":
        from deepspeed_feplb.migrate.cuda_ce import CudaCETransport
        return CudaCETransport
    from deepspeed_feplb.migrate.shm import ShmTransport
    return ShmTransport


__all__ = ["Into", "Transport", "cuda_available", "transport_class", "transport_kind", "validate_transport"]
