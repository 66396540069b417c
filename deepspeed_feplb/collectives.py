"""Small collectives the runtime shares: every rank's small Python object in one all-gather
(`gather_small`); every rank's counts and announced values in one (`gather_counts`), each rank's
row a record (`counts_row`) whose fields are read by name."""
from __future__ import annotations

import pickle
import time
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

GATHER_BYTES = 16 << 10


def gather_small(obj, group=None, device=None) -> list:
    """`dist.all_gather_object` in one collective when every rank's pickle fits `GATHER_BYTES`
    (a step's lean records do), in two otherwise (``all_gather_object`` always takes two). The
    bytes travel on the group's device: CUDA for an NCCL group, which takes no host tensors
    (``device``: this rank's, e.g. its experts'; default torch's current device)."""
    data = pickle.dumps(obj)
    world = dist.get_world_size(group)
    if dist.get_backend(group) != "nccl":
        device = "cpu"
    elif device is None or torch.device(device).type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())

    def gather(size: int) -> list[torch.Tensor]:
        """Every rank's [length (int64), pickle] in ``size`` bytes; the pickle only if it fits."""
        buffer = torch.zeros(size, dtype=torch.uint8)
        buffer[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        if 8 + len(data) <= size:
            buffer[8:8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        buffer = buffer.to(device)
        gathered = [torch.empty_like(buffer) for _ in range(world)]
        dist.all_gather(gathered, buffer, group=group)
        return [g.cpu() for g in gathered]

    gathered = gather(GATHER_BYTES)
    sizes = [int(g[:8].view(torch.int64)) for g in gathered]
    if max(sizes) > GATHER_BYTES - 8:  # every rank sees the same sizes: all take this branch together
        gathered = gather(max(sizes) + 8)
    return [pickle.loads(g[8:8 + n].numpy().tobytes()) for g, n in zip(gathered, sizes)]


@lru_cache(maxsize=64)
def counts_row(counts: int, announced: int, head: tuple[str, ...] = (), tail: tuple[str, ...] = ()) -> np.dtype:
    """One rank's row of a count exchange: int64 fields ``head``, ``counts`` int64 ``[counts]``,
    int64 fields ``tail`` and ``announced`` float64 ``[announced]``. Every field is 8 bytes wide,
    so a row travels as an int64 tensor: the device's part (``head`` and the counts, computed
    there) and the host's (`host_fields`) concatenated; the gathered table is viewed as rows again."""
    return np.dtype([*((name, np.int64) for name in head), ("counts", np.int64, (counts, )),
                     *((name, np.int64) for name in tail), ("announced", np.float64, (announced, ))])


def host_fields(row: np.dtype, **values) -> torch.Tensor:
    """int64 ``[k]``: the fields of ``row`` after ``counts`` (``values`` by name), as one row carries
    them, to follow the device's counts in the exchanged tensor."""
    part = np.zeros((), _host_part(row))
    for name, value in values.items():
        part[name] = value
    return torch.from_numpy(part.reshape(1).view(np.int64).copy())


@lru_cache(maxsize=64)
def _host_part(row: np.dtype) -> np.dtype:
    """The fields of ``row`` after ``counts``, packed (made once per row layout: forwards reuse it)."""
    names = list(row.names)
    return np.dtype([(name, row.fields[name][0]) for name in names[names.index("counts") + 1:]])


def all_gather_flat(mine: torch.Tensor, group, size: int) -> torch.Tensor:
    """Every rank's ``mine`` (``[n]``, the same n everywhere) as ``[size, n]``, gathered into one
    tensor: no list of outputs to allocate and stack (on NCCL a list gather launches a copy per
    rank after the collective)."""
    out = mine.new_empty(size * mine.numel())
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, mine, group=group)
    return out.view(size, -1)


def gather_rows(mine: torch.Tensor, row: np.dtype, group, size: int) -> tuple[np.ndarray, float]:
    """Every rank's ``mine`` (int64 ``[row.itemsize // 8]`` on the group's device) in one all-gather
    and one copy to the host: (the rows, ``row`` ``[size]``; seconds the exchange took)."""
    start = time.perf_counter()
    table = (all_gather_flat(mine, group, size) if size > 1 else mine[None]).cpu().numpy()
    return np.ascontiguousarray(table).view(row)[:, 0], time.perf_counter() - start


def gather_counts(counts: torch.Tensor, announce: Sequence[float], group,
                  size: int) -> tuple[np.ndarray, np.ndarray, float]:
    """Every rank of ``group`` (``size`` ranks) its ``counts`` (integer ``[n]``, on the group's
    device: CUDA for NCCL) and ``announce`` values, in one all-gather and one copy to the host:
    (int64 ``[size, n]``, float64 ``[size, len(announce)]``, seconds the exchange took)."""
    row = counts_row(counts.numel(), len(announce))
    mine = torch.cat([counts.reshape(-1).to(torch.int64),
                      host_fields(row, announced=announce).to(counts.device, non_blocking=True)])
    rows, seconds = gather_rows(mine, row, group, size)
    return np.ascontiguousarray(rows["counts"]), np.ascontiguousarray(rows["announced"]), seconds
