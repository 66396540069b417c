"""Phase 1 on DeepEP (`deep_ep.Buffer`), with the interface of `dispatch.torch_a2a.TorchDispatcher`.

`DeepEPDispatcher.dispatch(x, expert_ids)` returns the rows grouped by local expert (then by
source rank), the counts ``int64 [ep_size, E_local]`` (numpy) and a handle; `combine(rows, gates,
handle)` returns ``[S, H]``: exactly what `TorchDispatcher` returns, so the layer and phase 2 are
unchanged.

How. DeepEP's ``combine`` sums what comes back for a token *without weights*, and the gates are
not known at dispatch in our interface, so the adapter dispatches one *route* per DeepEP token:
route ``(j, t)`` (flat index ``j * S + t``, as `TorchDispatcher` numbers routes) is token
``x[t]`` with the single expert ``expert_ids[j, t]``. Every route then lands on exactly one rank,
combine returns each route's expert output unchanged, and the gate-weighted sum happens at home in
fp32, exactly as `TorchDispatcher.combine` computes it. The traffic equals the torch backend's
(one row per route). Received rows (ordered by source rank, then route) are grouped by local
expert with a stable counting sort (`kernels.expert_positions`) and a row permutation
(`kernels.gather_rows`). Autograd: dispatch's backward is a combine, combine's backward a cached
dispatch (DeepEP's own pairing), permutations invert.

`ReferenceBuffer` implements the intranode contract of ``deep_ep.Buffer`` (v1.2.1:
``get_dispatch_layout``, ``dispatch``, ``combine``) with ``torch.distributed.all_to_all_single``,
so the adapter is tested on CPU: receive order by source rank then token, **local** expert ids in
``recv_topk_idx`` with -1 for experts elsewhere and zeroed weights there, per-local-expert
receive counts, unweighted combine summed over ranks in fp32, cached re-dispatch from a handle.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from deepspeed_feplb.collectives import gather_counts
from deepspeed_feplb.dispatch.dispatched import Dispatched, GroupFacts
from deepspeed_feplb.kernels import cuda as kernels

# What the adapter supports of DeepEP (v1.2.1): its intranode (NVLink) kernels, whose configurations
# cover EP groups of these sizes within a host; its internode (RDMA + NVLink) kernels, which take
# hosts of `DEEPEP_NVL_PEERS` GPUs and have configurations and kernels for groups of these sizes
# (`dispatch.deepep_unsupported`).
DEEPEP_EP_SIZES = (2, 4, 8)
DEEPEP_NVL_PEERS = 8
DEEPEP_INTERNODE_EP_SIZES = (16, 32, 64, 128, 144, 160)


class _EventOverlap:
    """DeepEP's ``EventOverlap`` as DeepEP returns it: with ``async_finish=False`` it holds no event
    and ``current_stream_wait()`` asserts (the call already ordered the current stream after it);
    with ``async_finish=True`` it holds one (here: the work is done, waiting is a no-op)."""

    def __init__(self, async_finish: bool):
        self.event = object() if async_finish else None

    def current_stream_wait(self) -> None:
        assert self.event is not None


class ReferenceBuffer:
    """CPU (any device) implementation of DeepEP's ``Buffer`` contract over ``group``: the intranode
    one, and for a group over hosts of 8 ranks the internode layout's tokens per host (its receive
    order, by global source rank then token, is the same; its handle differs, and the adapter
    never looks into a handle).

    Handle (as DeepEP's intranode handle, 6 entries): ``(rank_prefix_matrix int32 [R, R],
    channel_prefix_matrix int32 [R, 1], recv_channel_prefix_matrix int32 [R, 1], recv_src_idx
    int32 [N_recv], is_token_in_rank bool [T, R], send_head int32 [T, R])`` where
    ``rank_prefix_matrix[i, j]`` = tokens that ranks ``0..i`` send to rank ``j`` and
    ``send_head[t, r]`` = the row of token ``t`` in rank ``r``'s receive buffer, or -1.
    """

    def __init__(self, group=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 **_):
        if low_latency_mode:
            raise NotImplementedError("the reference implements the normal (intranode) mode only")
        self.group = group
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.group_size = dist.get_world_size(group) if dist.is_initialized() else 1

    # -------------------------------------------------------------------- helpers
    def _all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        out = send.new_empty((sum(recv_splits), *send.shape[1:]))
        if self.group_size == 1:
            return out.copy_(send)
        dist.all_to_all_single(out, send.contiguous(), recv_splits, send_splits, group=self.group)
        return out

    def _exchange_counts(self, per_rank: torch.Tensor) -> torch.Tensor:
        """[R] counts this rank sends -> [R, R] matrix m[i, j] = tokens rank i sends to rank j."""
        if self.group_size == 1:
            return per_rank.view(1, 1).clone()
        gathered = [torch.empty_like(per_rank) for _ in range(self.group_size)]
        dist.all_gather(gathered, per_rank.contiguous(), group=self.group)
        return torch.stack(gathered)

    # -------------------------------------------------------------------- DeepEP API
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """topk_idx int64 ``[T, K]`` (-1: none) -> (tokens per rank int32 [R], tokens per host int32
        [R / 8] for a group over hosts of 8 (None within one), tokens per expert int32 [E],
        is_token_in_rank bool [T, R], event)."""
        experts_per_rank = num_experts // self.group_size
        valid = topk_idx >= 0
        per_expert = torch.bincount(topk_idx[valid].long(), minlength=num_experts).to(torch.int32)
        dest = torch.where(valid, topk_idx // experts_per_rank, torch.full_like(topk_idx, -1))
        in_rank = torch.zeros((topk_idx.shape[0], self.group_size), dtype=torch.bool, device=topk_idx.device)
        rows, cols = torch.nonzero(valid, as_tuple=True)
        in_rank[rows, dest[rows, cols]] = True
        per_host = None
        if self.group_size > DEEPEP_NVL_PEERS:  # DeepEP's internode layout: a token counts once per host
            per_host = in_rank.view(len(in_rank), -1, DEEPEP_NVL_PEERS).any(-1).sum(0).to(torch.int32)
        return in_rank.sum(0).to(torch.int32), per_host, per_expert, in_rank, _EventOverlap(async_finish)

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, is_token_in_rank=None,
                 num_tokens_per_expert=None, topk_idx=None, topk_weights=None, expert_alignment: int = 1,
                 num_worst_tokens: int = 0, config=None, previous_event=None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """Send token ``t`` once to every rank ``r`` with ``is_token_in_rank[t, r]`` (see DeepEP).

        Returns ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
        handle, event)``; with ``handle`` (cached layout) only ``recv_x`` is computed and the
        next four entries are None.
        """
        if isinstance(x, tuple):
            raise NotImplementedError("the reference does not implement fp8 dispatch")
        if handle is not None:
            in_rank = handle[4]
        else:
            in_rank = is_token_in_rank
        send_tokens = [torch.nonzero(in_rank[:, r]).squeeze(1) for r in range(self.group_size)]
        order = torch.cat(send_tokens) if send_tokens else torch.zeros(0, dtype=torch.long)
        send_splits = [int(s.numel()) for s in send_tokens]
        if handle is not None:
            matrix = handle[0].long()
            recv_splits = torch.diff(matrix[:, self.rank], prepend=matrix.new_zeros(1)).tolist()
            return (self._all_to_all(x.index_select(0, order), send_splits, recv_splits), None, None, None, None,
                    _EventOverlap(async_finish))

        counts = self._exchange_counts(torch.tensor(send_splits, dtype=torch.long, device=x.device))
        recv_splits = counts[:, self.rank].tolist()
        recv_x = self._all_to_all(x.index_select(0, order), send_splits, recv_splits)
        recv_src_idx = self._all_to_all(order.to(torch.int32), send_splits, recv_splits)
        experts_per_rank = num_tokens_per_expert.numel() // self.group_size if num_tokens_per_expert is not None \
            else None
        recv_idx = recv_weights = None
        expert_list: list[int] = []
        if topk_idx is not None:
            if experts_per_rank is None:
                raise ValueError("dispatch with topk_idx needs num_tokens_per_expert")
            # per destination, topk ids made local to it (-1 where the expert lives elsewhere)
            send_idx = topk_idx.index_select(0, order).long()
            dest_of_row = torch.repeat_interleave(torch.arange(self.group_size, device=x.device),
                                                  torch.tensor(send_splits, device=x.device))
            local = send_idx - dest_of_row[:, None] * experts_per_rank
            mine = (send_idx >= 0) & (local >= 0) & (local < experts_per_rank)
            local = torch.where(mine, local, torch.full_like(local, -1))
            recv_idx = self._all_to_all(local, send_splits, recv_splits)
            if topk_weights is not None:
                weights = torch.where(mine, topk_weights.index_select(0, order),
                                      torch.zeros_like(local, dtype=topk_weights.dtype))
                recv_weights = self._all_to_all(weights, send_splits, recv_splits)
            per_local = torch.bincount(recv_idx[recv_idx >= 0], minlength=experts_per_rank)[:experts_per_rank]
            expert_list = [int(-(-int(c) // expert_alignment) * expert_alignment) for c in per_local]
        send_head = torch.full(in_rank.shape, -1, dtype=torch.int32, device=x.device)
        for r, tokens in enumerate(send_tokens):  # where each of our tokens lands in rank r's buffer
            before = int(counts[:self.rank, r].sum())
            send_head[tokens, r] = torch.arange(before, before + tokens.numel(), dtype=torch.int32, device=x.device)
        prefix = torch.cumsum(counts, 0).to(torch.int32)
        zeros = torch.zeros((self.group_size, 1), dtype=torch.int32, device=x.device)
        new_handle = (prefix, zeros, zeros.clone(), recv_src_idx, in_rank, send_head)
        return recv_x, recv_idx, recv_weights, expert_list, new_handle, _EventOverlap(async_finish)

    def combine(self, x: torch.Tensor, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Return every received row to its source and sum per token over ranks, without weights.

        x ``[N_recv, H]`` in the receive order of ``handle`` -> ``([T, H], combined weights or None, event)``.
        """
        matrix, in_rank = handle[0].long(), handle[4]
        recv_splits_of_dispatch = torch.diff(matrix[:, self.rank], prepend=matrix.new_zeros(1)).tolist()
        send_splits_of_dispatch = in_rank.sum(0).tolist()
        back = self._all_to_all(x, recv_splits_of_dispatch, send_splits_of_dispatch)
        back_w = self._all_to_all(topk_weights, recv_splits_of_dispatch, send_splits_of_dispatch) \
            if topk_weights is not None else None
        tokens = torch.cat([torch.nonzero(in_rank[:, r]).squeeze(1) for r in range(self.group_size)])
        out = torch.zeros((in_rank.shape[0], x.shape[1]), dtype=torch.float32, device=x.device)
        start = 0
        for r in range(self.group_size):  # rank order, fp32 accumulation, one rounding
            n = int(send_splits_of_dispatch[r])
            out.index_add_(0, tokens[start:start + n], back[start:start + n].float())
            start += n
        if bias is not None:
            for b in (bias if isinstance(bias, tuple) else (bias, )):
                if b is not None:
                    out += b.float()
        combined_w = None
        if back_w is not None:
            combined_w = torch.zeros((in_rank.shape[0], back_w.shape[1]), dtype=back_w.dtype, device=x.device)
            combined_w.index_add_(0, tokens, back_w)
        return out.to(x.dtype), combined_w, _EventOverlap(async_finish)


# ------------------------------------------------------------------------------ autograd pieces
class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, buffer, layout, topk_idx, weights, box):
        per_rank, per_rdma, per_expert, in_rank = layout
        recv_x, recv_idx, _, _, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=weights)
        ctx.buffer, ctx.handle = buffer, handle
        ctx.mark_non_differentiable(recv_idx)
        box["handle"] = handle
        return recv_x, recv_idx

    @staticmethod
    def backward(ctx, grad_x, _):
        grad, _, _ = ctx.buffer.combine(grad_x.contiguous(), ctx.handle)
        return grad, None, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, buffer, handle):
        out, _, _ = buffer.combine(x.contiguous(), handle)
        ctx.buffer, ctx.handle = buffer, handle
        return out

    @staticmethod
    def backward(ctx, grad):
        recv, *_ = ctx.buffer.dispatch(grad.contiguous(), handle=ctx.handle)
        return recv, None, None


class _Permute(torch.autograd.Function):
    """``out = x[index]`` for a permutation ``index``; backward applies the inverse permutation."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return kernels.gather_rows(x, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse, ) = ctx.saved_tensors
        return kernels.gather_rows(grad.contiguous(), inverse), None, None


class DeepEPHandle:
    """What `DeepEPDispatcher.combine` needs: DeepEP's handle, the grouping permutation and the
    buffer that dispatched (the group's shared buffer may be replaced by a larger one meanwhile)."""

    def __init__(self, deepep_handle, position: torch.Tensor, grouped_from: torch.Tensor, k: int, num_tokens: int,
                 buffer=None):
        self.deepep_handle, self.position, self.grouped_from = deepep_handle, position, grouped_from
        self.k, self.num_tokens, self.buffer = k, num_tokens, buffer


def _config_hint(deep_ep_module, hint: str, hidden_bytes: int, num_ranks: int) -> int:
    """The larger of DeepEP's dispatch and combine configs' ``hint`` (a buffer-size hint method)."""
    buffer_cls = deep_ep_module.Buffer
    return int(max(getattr(config(num_ranks), hint)(hidden_bytes, num_ranks)
                   for config in (buffer_cls.get_dispatch_config, buffer_cls.get_combine_config)))


def rdma_bytes_hint(deep_ep_module, hidden_bytes: int, num_ranks: int) -> int:
    """RDMA buffer bytes DeepEP asks for (its own config hints) for a group of ``num_ranks`` that
    spans hosts; 0 within one host, where its intranode kernels need none."""
    if num_ranks <= DEEPEP_NVL_PEERS:
        return 0
    return _config_hint(deep_ep_module, "get_rdma_buffer_size_hint", hidden_bytes, num_ranks)


def internode_missing() -> Optional[str]:
    """Why the installed ``deep_ep`` has no internode kernels, or None. A build without NVSHMEM
    raises where its configs size an RDMA buffer: asked here once, before any buffer exists, so
    every rank of a group (one install) decides alike."""
    import deep_ep
    try:
        rdma_bytes_hint(deep_ep, 4096, DEEPEP_INTERNODE_EP_SIZES[0])
    except Exception as error:  # noqa: BLE001 - DeepEP's host assertions raise RuntimeError
        return (f"the installed deep_ep has no internode kernels ({type(error).__name__}: {error}); build it with "
                "NVSHMEM (docs/GPU.md)")
    return None


def nvl_bytes_hint(deep_ep_module, hidden_bytes: int, num_ranks: int) -> int:
    """NVLink buffer bytes DeepEP asks for (its own config hints)."""
    return _config_hint(deep_ep_module, "get_nvl_buffer_size_hint", hidden_bytes, num_ranks)


def buffer_bytes(deep_ep_module, hidden: int, element_size: int, num_ranks: int) -> tuple[int, int]:
    """(NVLink bytes, RDMA bytes) of the DeepEP buffer of a group of ``num_ranks`` whose tokens
    hold ``hidden`` values of ``element_size`` bytes (DeepEP sizes for at least 2 bytes each)."""
    hidden_bytes = hidden * max(element_size, 2)
    return (nvl_bytes_hint(deep_ep_module, hidden_bytes, num_ranks),
            rdma_bytes_hint(deep_ep_module, hidden_bytes, num_ranks))


_SHARED: dict = {}  # EP group -> (its DeepEP buffer, (NVLink bytes, RDMA bytes))


def shared_buffer(group, nvl_bytes: int, rdma_bytes: int = 0):
    """The process's one DeepEP buffer for ``group``, shared by every layer that dispatches over it
    (each buffer holds its own NVLink memory, a few hundred MB, and across hosts its RDMA memory):
    created at the first request, replaced by a larger one only when a layer asks for more bytes
    than it has."""
    buffer, (nvl_held, rdma_held) = _SHARED.get(group, (None, (0, 0)))
    if buffer is None or nvl_held < nvl_bytes or rdma_held < rdma_bytes:
        import deep_ep
        nvl_bytes, rdma_bytes = max(nvl_bytes, nvl_held), max(rdma_bytes, rdma_held)
        buffer = deep_ep.Buffer(group, nvl_bytes, rdma_bytes)
        _SHARED[group] = (buffer, (nvl_bytes, rdma_bytes))
    return buffer


class DeepEPDispatcher:
    """Expert-parallel dispatch through DeepEP over ``group`` (``ep_size`` ranks, ``num_local_experts`` each).

    Args:
        buffer: a ``deep_ep.Buffer`` (or `ReferenceBuffer`); default: the group's `shared_buffer`,
            sized at the first dispatch by DeepEP's NVLink (and, across hosts, RDMA) buffer-size
            hints for the hidden size seen.
    """

    def __init__(self, group, ep_size: int, num_local_experts: int, buffer=None):
        self.group, self.ep_size, self.num_local_experts = group, ep_size, num_local_experts
        self.buffer = buffer

    def _buffer(self, x: torch.Tensor):
        buffer = self.buffer
        if buffer is None:
            import deep_ep
            buffer = shared_buffer(self.group, *buffer_bytes(deep_ep, x.shape[1], x.element_size(), self.ep_size))
        if not isinstance(buffer, ReferenceBuffer) and x.dtype != torch.bfloat16:
            raise TypeError(f"DeepEP dispatches bf16 tokens; got {x.dtype} (use ep_backend \"torch\" for other dtypes)")
        return buffer

    def dispatch(self, x: torch.Tensor, expert_ids: torch.Tensor, announce=()):
        """As `TorchDispatcher.dispatch`: x ``[S, H]``, expert_ids ``[k, S]`` (-1: not taken) ->
        `Dispatched`. DeepEP's layout tells a rank only what it sends; one all-gather of every
        rank's routes per expert and ``announce`` values, read on the host once, gives the
        `GroupFacts` (every rank's received rows: the skip rule) and this rank's counts per source."""
        buffer = self._buffer(x)
        k, num_tokens = expert_ids.shape
        routes = expert_ids.reshape(-1, 1).long().contiguous()  # route j * S + t
        x_routes = x.repeat(k, 1) if k > 1 else x
        # synchronous calls (async_finish=False): DeepEP orders the current stream after its work and
        # returns an EventOverlap without an event, whose current_stream_wait() would assert
        per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(
            routes, self.ep_size * self.num_local_experts)
        # the one copy to the host of phase 1: every rank's routes per expert and announced values
        sent, announced, seconds = gather_counts(per_expert, announce, self.group, self.ep_size)  # [sources, E]
        facts = GroupFacts(sent.sum(axis=0).reshape(self.ep_size, self.num_local_experts), announced, seconds)
        first = buffer_rank(buffer, self.group) * self.num_local_experts
        counts = np.ascontiguousarray(sent[:, first:first + self.num_local_experts])  # [sources, E_local]
        weights = torch.ones(routes.shape, dtype=torch.float32, device=x.device)
        box: dict = {}
        recv_x, recv_idx = _Dispatch.apply(x_routes, buffer, (per_rank, per_rdma, per_expert, in_rank), routes,
                                           weights, box)
        local = recv_idx.reshape(-1)
        _, position = kernels.expert_positions(local, self.num_local_experts)
        grouped_from = torch.empty_like(position)
        grouped_from[position] = torch.arange(position.numel(), device=position.device)
        rows = _Permute.apply(recv_x, grouped_from, position)
        if int(counts.sum()) != local.numel():  # both known on the host
            raise RuntimeError(f"DeepEP delivered {local.numel()} routes where the group's layouts sent "
                               f"{int(counts.sum())} to this rank's experts")
        handle = DeepEPHandle(box["handle"], position, grouped_from, k, num_tokens, buffer)
        return Dispatched(rows, counts, handle, facts)

    def combine(self, rows: torch.Tensor, gates: torch.Tensor, handle: DeepEPHandle) -> torch.Tensor:
        """As `TorchDispatcher.combine`: rows ``[N, H]`` (grouped), gates ``[k, S]`` -> ``[S, H]``."""
        back = _Permute.apply(rows, handle.position, handle.grouped_from)  # receive order
        routed = _Combine.apply(back, handle.buffer, handle.deepep_handle)  # [k * S, H], one row per route
        k, num_tokens = gates.shape
        routed = routed.view(k, num_tokens, -1)
        return (routed * gates.unsqueeze(-1)).sum(0).to(rows.dtype)


def buffer_rank(buffer, group) -> int:
    if isinstance(buffer, ReferenceBuffer):
        return buffer.rank
    return getattr(buffer, "rank", dist.get_rank(group) if dist.is_initialized() else 0)
