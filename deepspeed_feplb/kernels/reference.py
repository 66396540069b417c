"""Reference implementations (torch, any device) of the contracts of the kernels in ``ops/feplb_kernels.cu``.

These are the specification: the GPU tests compare each kernel with its reference bit for bit
(row movement) or to fp32 rounding (combine), and on a machine without CUDA they *are* the code
path (`deepspeed_feplb.kernels.cuda` falls back to them for CPU tensors).
"""
from __future__ import annotations

import torch


def gather_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``dst[i] = src[index[i]]``, a zero row where ``index[i] < 0``.

    src ``[N_src, ...]``, index int64 ``[N]`` -> ``[N, ...]`` (src's dtype).
    """
    index = index.long()
    padded = torch.cat([src, src.new_zeros((1, *src.shape[1:]))])
    safe = torch.where(index < 0, torch.full_like(index, src.shape[0]), index)
    return padded.index_select(0, safe)


def scatter_rows(src: torch.Tensor, index: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """``dst[index[i]] = src[i]`` for ``index[i] >= 0`` (in place; returns ``dst``).

    src ``[N, ...]``, index int64 ``[N]`` (no repeated non-negative entries), dst ``[N_dst, ...]``.
    """
    index = index.long()
    keep = index >= 0
    dst[index[keep]] = src[keep]
    return dst


def expert_counts(expert_of_route: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 ``[E]``: routes per expert; entries outside ``[0, E)`` are not counted."""
    e = expert_of_route.long()
    valid = (e >= 0) & (e < num_experts)
    return torch.bincount(e[valid], minlength=num_experts)[:num_experts]


def expert_positions(expert_of_route: torch.Tensor, num_experts: int, offsets: torch.Tensor) -> torch.Tensor:
    """Stable counting sort: position of each route in the expert-grouped layout, -1 if not local.

    expert_of_route int64 ``[R]``, offsets int64 ``[E]`` (exclusive prefix of `expert_counts`, or
    any start per expert) -> int64 ``[R]``: ``offsets[e] + #{r' < r with the same expert}``.
    """
    e = expert_of_route.long()
    valid = (e >= 0) & (e < num_experts)
    position = torch.full_like(e, -1)
    order = torch.argsort(torch.where(valid, e, torch.full_like(e, num_experts)), stable=True)
    sorted_e = e[order]
    n_valid = int(valid.sum())
    order, sorted_e = order[:n_valid], sorted_e[:n_valid]
    counts = torch.bincount(sorted_e, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts  # first index of each expert in `order`
    rank_in_expert = torch.arange(n_valid, device=e.device) - starts[sorted_e]
    position[order] = offsets.long()[sorted_e] + rank_in_expert
    return position


def weighted_combine(rows: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j weight[t, j] * rows[slot[t, j]]`` over ``slot[t, j] >= 0``.

    rows ``[N, H]`` (fp32, bf16 or fp16), slot int64 ``[T, k]``, weight fp32 ``[T, k]`` -> ``[T, H]``
    in rows' dtype. Products and the sum over ``j = 0..k-1`` are fp32, rounded once at the end
    (what ``(routed * gates).sum(0).to(dtype)`` in `TorchDispatcher.combine` computes).
    """
    t, k = slot.shape
    if k == 0:
        return rows.new_zeros((t, rows.shape[1]))
    routed = gather_rows(rows, slot.reshape(-1)).view(t, k, rows.shape[1]).float()
    out = routed[:, 0] * weight[:, 0:1].float()
    for j in range(1, k):
        out = out + routed[:, j] * weight[:, j:j + 1].float()
    return out.to(rows.dtype)
