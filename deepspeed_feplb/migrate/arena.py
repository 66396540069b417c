"""Peer-memory arenas: one plain ``cudaMalloc`` per rank, shared with the domain by CUDA IPC handles.

Why not torch tensors: a caching-allocator tensor is an offset inside a bigger block (IPC exports
whole blocks) and expandable segments break legacy IPC (docs/GPU.md). An arena owns its
allocation; peers open its handle once, and the owner frees it only after every peer closed it.

Layout of a message in an arena or transport slot (`message_layout`): tensors back to back, each
starting on a 256-byte boundary (the allocation itself is 256-byte aligned, so 16-byte vector
loads in the kernels always apply).

Memory per rank (`transport_bytes_per_rank`), for a domain of ``G`` ranks whose slots hold ``S``
bytes: the `CudaCETransport` owns one inbound allocation per peer, ``(G - 1) * S`` bytes of
device memory (``S`` split into a ring of `RING_SLOTS` slots of ``S / RING_SLOTS``, each rounded up
to 256 bytes: `ring_capacity`), allocated once when the domain opens, plus host control
memory (page-locked: it holds the flags) of ``G * G * 8 * (32 + 4 * (4 + 7 * T))`` bytes per domain
(T = most tensors per message). ``S`` is
`slot_bytes`: one forward message to a helper in one part, that is D chunks with their expert's
weights (``P`` bytes, ``n_t`` tensors) and a rank's mean rows ``N`` of ``row_bytes`` each:
``D * (P + n_t * 256) + N * row_bytes`` (backward's result message, input-gradients and
weight-gradients, has the same size); larger messages travel in parts.
"""
from __future__ import annotations

import math
import weakref

import numpy as np
import torch

ALIGN = 256
RING_SLOTS = 4  # slots of an inbound ring: a sender runs up to this many message parts ahead of its receiver


def align_up(n: int, alignment: int = ALIGN) -> int:
    return (int(n) + alignment - 1) // alignment * alignment


def nbytes_of(dtype: torch.dtype, shape) -> int:
    return int(math.prod(shape)) * dtype.itemsize


def message_layout(specs) -> tuple[list[int], int]:
    """specs: ``[(dtype, shape), ...]`` -> (byte offset of each tensor, total bytes), 256-byte aligned."""
    offsets, offset = [], 0
    for dtype, shape in specs:
        offsets.append(offset)
        offset = align_up(offset + nbytes_of(dtype, shape))
    return offsets, offset


def slot_bytes(dynamic_experts: int, expert_bytes: int, tensors_per_chunk: int, rows: float, row_bytes: int) -> int:
    """Bytes of a phase-2 slot that holds one forward message to a helper in one part (module docstring)."""
    return align_up(dynamic_experts * (expert_bytes + tensors_per_chunk * ALIGN) + math.ceil(rows) * row_bytes)


def ring_capacity(slot: int) -> int:
    """Bytes of one ring slot of an inbound allocation whose ring holds ``slot`` bytes (`RING_SLOTS` of them)."""
    return align_up(-(-align_up(slot) // RING_SLOTS))


def inbound_bytes(slot: int) -> int:
    """Device bytes of one inbound allocation: its ring."""
    return RING_SLOTS * ring_capacity(slot)


def transport_bytes_per_rank(domain_size: int, slot: int) -> int:
    """Device bytes one rank's `CudaCETransport` holds: an inbound allocation per peer."""
    return (domain_size - 1) * inbound_bytes(slot)


class PeerArena:
    """One rank's arena plus mapped views of its peers' arenas.

    Args:
        backend: `CudaBackend` or `HostBackend`.
        nbytes: size of this rank's arena (peers may differ).

    `exchange(group)` is collective: it all-gathers ``(handle, nbytes)`` with
    ``torch.distributed.all_gather_object`` and opens every peer's handle once. `close(group)`
    closes the peers' mappings, waits on ``group`` until every rank did, then frees (freeing while a
    peer still maps the memory is undefined behaviour in CUDA). Without a group (a peer died),
    `close` frees after closing its own mappings.
    """

    def __init__(self, backend, nbytes: int):
        self.backend, self.nbytes = backend, align_up(nbytes)
        self.ptr = backend.malloc(self.nbytes)
        self.peers: dict[int, tuple[int, int]] = {}  # rank in group -> (ptr, nbytes)
        self.rank: int | None = None
        self.closed = False
        self._views: weakref.WeakSet = weakref.WeakSet()

    def exchange(self, group=None) -> None:
        import torch.distributed as dist
        self.rank = dist.get_rank(group)
        info = [None] * dist.get_world_size(group)
        dist.all_gather_object(info, (self.backend.ipc_handle(self.ptr), self.nbytes), group=group)
        for rank, (handle, nbytes) in enumerate(info):
            if rank != self.rank and rank not in self.peers:
                self.peers[rank] = (self.backend.ipc_open(handle), nbytes)

    def ptr_of(self, rank: int) -> int:
        if rank == self.rank or rank is None:
            return self.ptr
        return self.peers[rank][0]

    def size_of(self, rank: int) -> int:
        return self.nbytes if rank == self.rank else self.peers[rank][1]

    def tensor(self, rank: int, offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
        """A torch view of ``rank``'s arena at ``offset`` (no copy). Writes through it are peer writes."""
        size = nbytes_of(dtype, shape)
        if offset < 0 or offset + size > self.size_of(rank):
            raise ValueError(f"view [{offset}, {offset + size}) outside arena of rank {rank} "
                             f"({self.size_of(rank)} bytes)")
        if self.closed:
            raise RuntimeError("PeerArena is closed: its memory is freed")
        view = wrap_pointer(self.backend, self.ptr_of(rank) + offset, shape, dtype, owner=self)
        self._views.add(view._base if view._base is not None else view)  # derived views keep their base alive
        return view

    def live_views(self) -> int:
        """Views from `tensor` still referenced (their memory must outlive them)."""
        return len(self._views)

    def close(self, group=None) -> None:
        """Unmap the peers, wait for them (``group``), free. Refuses while views from `tensor` live:
        freeing under them would let later writes land in memory CUDA may hand out again."""
        if self.closed:
            return
        if self._views:
            raise RuntimeError(f"PeerArena.close: {len(self._views)} view(s) from tensor() are still referenced; "
                               "drop them first")
        self.closed = True
        for ptr, _ in self.peers.values():
            self.backend.ipc_close(ptr)
        self.peers.clear()
        if group is not None:
            import torch.distributed as dist
            dist.barrier(group=group)
        self.backend.free(self.ptr)


def wrap_pointer(backend, ptr: int, shape, dtype: torch.dtype, owner=None) -> torch.Tensor:
    """Torch tensor over raw memory: CuPy ``UnownedMemory`` -> DLPack on CUDA, ctypes on the host."""
    size = nbytes_of(dtype, shape)
    if backend.name == "cuda":
        import cupy
        memory = cupy.cuda.UnownedMemory(ptr, size, owner, device_id=backend.index)
        raw = cupy.ndarray((size, ), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
        return torch.from_dlpack(raw).view(dtype).view(tuple(shape))
    import ctypes
    raw = (ctypes.c_uint8 * max(size, 1)).from_address(ptr)
    return torch.frombuffer(raw, dtype=torch.uint8, count=size).view(dtype).view(tuple(shape))


def plan_arena_offsets(sizes: np.ndarray) -> tuple[np.ndarray, int]:
    """Aligned offsets of consecutive regions of ``sizes`` bytes -> (int64 offsets, total bytes)."""
    aligned = np.array([align_up(int(s)) for s in sizes], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(aligned)[:-1]]).astype(np.int64) if len(aligned) else aligned
    return offsets, int(aligned.sum())
