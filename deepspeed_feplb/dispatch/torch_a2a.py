"""Phase 1 with `torch.distributed.all_to_all_single` and uneven splits (any backend, gloo included).

`dispatch` sends every routed (token, expert) pair to its expert's home rank and returns the
received rows grouped by local expert; `combine` is its exact inverse followed by the gate-weighted
sum over routes, computed like DeepSpeed's `_sparse_decode` (fp32 products, summed over routes).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from deepspeed_feplb.collectives import counts_row, gather_rows, host_fields
from deepspeed_feplb.dispatch.dispatched import Dispatched, GroupFacts


class AllToAllV(torch.autograd.Function):
    """Uneven all-to-all of rows ``[N_send, ...] -> [N_recv, ...]``; backward swaps the splits."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group, on_error=None,
                stage_times=None):
        ctx.splits, ctx.group, ctx.on_error, ctx.stage_times = (send_splits, recv_splits), group, on_error, stage_times
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        _checked(on_error, dist.all_to_all_single, out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        send_splits, recv_splits = ctx.splits
        start = time.perf_counter()
        out = AllToAllV.apply(grad.contiguous(), recv_splits, send_splits, ctx.group, ctx.on_error)
        if ctx.stage_times is not None:
            ctx.stage_times.add("all-to-all bwd", time.perf_counter() - start)
        return out, None, None, None, None, None


def _checked(on_error, collective, *args, **kwargs):
    """Run a collective; when it fails, let ``on_error`` name a dead peer (it raises) before re-raising."""
    try:
        return collective(*args, **kwargs)
    except RuntimeError:
        if on_error is not None:
            on_error()
        raise


@dataclass
class DispatchHandle:
    """What `combine` needs to undo `dispatch`.

    route_order: int64 [N_send] routes sorted by expert; regroup: int64 [N_recv] rows of the
    received buffer in (local expert, source) order; send/recv splits per rank.
    """
    num_routes: int
    route_order: torch.Tensor
    regroup: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]


class TorchDispatcher:
    """Expert-parallel dispatch over ``group`` (``ep_size`` ranks, ``num_local_experts`` each)."""

    def __init__(self, group, ep_size: int, num_local_experts: int, on_error=None, stage_times=None):
        self.group, self.ep_size, self.num_local_experts = group, ep_size, num_local_experts
        self.on_error = on_error  # called when a collective fails; raises if it knows why (a dead peer)
        self.stage_times = stage_times  # a `stats.StageTimes` that backward's all-to-alls report to, or None
        self.forwards = 0  # dispatches so far: every rank of the group must be at the same one

    def dispatch(self, x: torch.Tensor, expert_ids: torch.Tensor, announce: Sequence[float] = ()) -> Dispatched:
        """`Dispatcher.dispatch`: rows to their experts' home ranks; ``announce`` travels with the
        counts, so the `GroupFacts` hold every rank's received rows and announced values."""
        k, num_tokens = expert_ids.shape
        num_experts = self.ep_size * self.num_local_experts
        flat = expert_ids.reshape(-1).long()
        # Nothing before the count exchange waits for the device: routes not taken (-1) or out of
        # range sort last, under the key num_experts, and this rank learns how many routes are
        # valid from its own row of the gathered table (the one device-to-host copy of phase 1).
        valid = (flat >= 0) & (flat < num_experts)
        key = torch.where(valid, flat, num_experts)
        route_order = torch.argsort(key, stable=True)
        per_key = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
        per_key.index_add_(0, key, torch.ones_like(key))
        send_counts = per_key[:num_experts].view(self.ep_size, self.num_local_experts)
        out_of_range = ((flat < -1) | (flat >= num_experts)).sum().reshape(1)
        # every rank gathers every rank's routes per expert (its own receive counts are a column
        # block), plus: its bad routes and which forward it is in (its number, with or without
        # gradients), so that a misuse fails on all ranks together, naming itself, instead of
        # desynchronising the group's later collectives; and the caller's announced values
        row = counts_row(num_experts, len(announce), head=("bad", ), tail=("forward", "grad"))
        host = host_fields(row, forward=self.forwards, grad=int(torch.is_grad_enabled()), announced=announce)
        self.forwards += 1
        mine = torch.cat([out_of_range, send_counts.reshape(-1), host.to(flat.device, non_blocking=True)])
        table, exchange_seconds = _checked(self.on_error, gather_rows, mine, row, self.group, self.ep_size)
        if self.ep_size == 1:
            exchange_seconds = float("nan")  # nothing was exchanged
        bad, forwards, grads = table["bad"].tolist(), table["forward"].tolist(), table["grad"].tolist()
        if any(bad):
            ranks = {self._global_rank(i): n for i, n in enumerate(bad) if n}
            raise ValueError(f"FEPLB: routes to experts outside [-1, {num_experts - 1}] (rank: count {ranks}); "
                             "a custom router must return expert ids in range, or -1 for a route not taken")
        if len(set(forwards)) > 1 or len(set(grads)) > 1:
            where = ", ".join(f"rank {self._global_rank(i)}: forward {n} {'with' if g else 'without'} gradients"
                              for i, (n, g) in enumerate(zip(forwards, grads)))
            raise RuntimeError(f"FEPLB: the ranks of this MoE layer's expert-parallel group are in different forwards "
                               f"({where}); every rank must run the same forwards of the layer, in the same grad mode "
                               "(an evaluation or an extra forward on some ranks only desynchronises the group)")
        routes = np.ascontiguousarray(table["counts"])
        route_order = route_order[:int(routes[self._group_rank()].sum())]  # the valid routes
        send_rows = x.index_select(0, route_order % num_tokens)
        first = self._group_rank() * self.num_local_experts
        recv_np = np.ascontiguousarray(routes[:, first:first + self.num_local_experts])
        announced = np.ascontiguousarray(table["announced"])
        received = routes.sum(axis=0).reshape(self.ep_size, self.num_local_experts)
        send_splits = routes[self._group_rank()].reshape(self.ep_size, -1).sum(1).tolist()  # host: no second copy
        recv_splits = recv_np.sum(1).tolist()
        rows = AllToAllV.apply(send_rows, send_splits, recv_splits, self.group, self.on_error, self.stage_times) \
            if self.ep_size > 1 else send_rows
        regroup = torch.from_numpy(expert_major_order(recv_np)).to(x.device, non_blocking=True)
        handle = DispatchHandle(k * num_tokens, route_order, regroup, send_splits, recv_splits)
        facts = GroupFacts(received, announced, exchange_seconds)
        return Dispatched(rows.index_select(0, regroup), recv_np, handle, facts)

    def _group_rank(self) -> int:
        return dist.get_rank(self.group) if self.ep_size > 1 else 0

    def _global_rank(self, ep_rank: int) -> int:
        if self.ep_size > 1:
            return dist.get_global_rank(self.group, ep_rank)
        return dist.get_rank() if dist.is_initialized() else 0

    def combine(self, rows: torch.Tensor, gates: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Return expert outputs to their tokens and sum them weighted by ``gates [k, S]`` -> ``[S, H]``."""
        source_order = torch.empty_like(handle.regroup)
        source_order[handle.regroup] = torch.arange(handle.regroup.numel(), device=rows.device)
        back = rows.index_select(0, source_order)
        if self.ep_size > 1:
            back = AllToAllV.apply(back, handle.recv_splits, handle.send_splits, self.group, self.on_error,
                                   self.stage_times)
        k, num_tokens = gates.shape
        # one extra zero row for routes not taken, as DeepSpeed's decode does for dropped routes
        slot_of_route = torch.full((handle.num_routes, ), back.shape[0], dtype=torch.long, device=rows.device)
        slot_of_route[handle.route_order] = torch.arange(back.shape[0], device=rows.device)
        padded = torch.cat([back, back.new_zeros(1, back.shape[1])])
        routed = padded.index_select(0, slot_of_route).view(k, num_tokens, back.shape[1])
        return (routed * gates.unsqueeze(-1)).sum(0).to(rows.dtype)


def expert_major_order(counts: np.ndarray) -> np.ndarray:
    """Permutation taking rows laid out (source, expert) to (expert, source).

    counts: ``int64 [sources, experts]`` block sizes of the source-major layout -> ``int64 [sum]``.
    """
    counts = np.asarray(counts, np.int64)
    flat = counts.reshape(-1)
    starts = (np.cumsum(flat) - flat).reshape(counts.shape)  # each block's first row, source-major
    sizes, firsts = counts.T.reshape(-1), starts.T.reshape(-1)  # the blocks in (expert, source) order
    # a row's place in the output, less its block's place there, is its block's offset from its source start
    return np.repeat(firsts - (np.cumsum(sizes) - sizes), sizes) + np.arange(int(flat.sum()), dtype=np.int64)
