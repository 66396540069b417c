"""Experts that are a known MLP, computed several at once with one grouped GEMM per projection.

DeepSpeed's MoE keeps one module per local expert (state-dict keys ``deepspeed_experts.<e>.<name>``),
and computing them one by one costs the host three to five launches per expert and twice that in
backward. When the expert is a ``Sequential(Linear(H, F), act, Linear(F, H))`` with an elementwise
activation (bias or not), `StackedMLP.of` returns how to compute any set of such experts at once:
each parameter stacked ``[k, ...]`` (one ``stack`` per parameter, whose backward hands each expert a
view of one gradient), ``torch._grouped_mm`` for each projection, the bias added per row. The
parameters, their names and the state dict stay the module's; the math is the module's (a
``Linear``'s ``x @ W.T + b``), with the GEMM's own summation order.

Any other expert (a custom module, dropout inside, an activation that is not elementwise, shapes
the grouped GEMM cannot take, a dtype it has no native kernel for on this GPU: `grouped_mm_runs`)
keeps the per-expert call.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import numpy as np
import torch

# elementwise and stateless: applied to all experts' rows at once, each row gets what its expert gives it
ELEMENTWISE = (torch.nn.GELU, torch.nn.ReLU, torch.nn.SiLU, torch.nn.Tanh, torch.nn.Sigmoid, torch.nn.Identity,
               torch.nn.LeakyReLU, torch.nn.ELU, torch.nn.Mish, torch.nn.ReLU6, torch.nn.Hardswish, torch.nn.Softplus)
_ALIGN_BYTES = 16  # torch._grouped_mm needs every row of its operands to start at a multiple of 16 bytes


@dataclass(frozen=True)
class StackedMLP:
    """How to compute k experts of one ``Sequential(Linear, act, Linear)`` shape at once.

    ``grouped(weights, x, sizes)``: ``weights`` per parameter (``named_parameters`` order: up weight
    ``[k, F, H]``, up bias ``[k, F]``, down weight ``[k, H, F]``, down bias ``[k, H]``; no biases when
    the Linears have none), ``x`` ``[N, H]`` with ``sizes[i]`` rows of expert i -> ``[N, H]``.
    """
    activation: torch.nn.Module
    bias: bool

    @classmethod
    def of(cls, expert: torch.nn.Module) -> Optional["StackedMLP"]:
        """The stacked form of ``expert``, or None where it is not a known MLP."""
        if type(expert) is not torch.nn.Sequential or len(expert) != 3 or any(True for _ in expert.buffers()):
            return None
        up, act, down = expert
        if type(up) is not torch.nn.Linear or type(down) is not torch.nn.Linear or type(act) not in ELEMENTWISE:
            return None
        if up.out_features != down.in_features or (up.bias is None) != (down.bias is None):
            return None
        if any(True for _ in act.parameters()) or getattr(act, "inplace", False):
            return None
        if not grouped_mm_runs(up.weight.device, up.weight.dtype):
            return None
        element = up.weight.element_size()
        if (up.in_features * element) % _ALIGN_BYTES or (up.out_features * element) % _ALIGN_BYTES:
            return None
        return cls(act, up.bias is not None)

    def stack(self, params: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """``params[i]`` (expert i's, ``named_parameters`` order) -> per parameter ``[k, ...]``."""
        return [torch.stack(group) for group in zip(*params)]

    @staticmethod
    def in_place(params: list[list[torch.Tensor]], unused: list[bool]) -> Optional[list[torch.Tensor]]:
        """`stack` without a copy, where every parameter of the k experts lies in one storage, one
        stride apart, in expert order: ZeRO's flat buffers hold a layer's experts so (each expert's
        parameters back to back, so one parameter recurs every expert's size), and `torch.stack`
        copied all the static experts' weights every forward. ``unused[i]``: expert i takes no
        gradient from this call (a dynamic expert, whose rows phase 2 computes): its backward gets
        None, where a zero gradient would be added to phase 2's. None where the parameters do not
        lie so (then `stack` the experts that are used)."""
        views = [strided_stack(list(group)) for group in zip(*params)]
        if any(view is None for view in views):
            return None
        flat = [t for group in params for t in group]
        return list(_InPlace.apply(tuple(unused), len(views), *views, *flat))

    def grouped(self, weights: list[torch.Tensor], x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """k experts on their rows (class docstring): x ``[N, H]`` -> ``[N, H]``."""
        if not grouped_mm_runs(x.device, x.dtype):  # the layer moved to another dtype or device since
            return self._loop(weights, x, sizes)
        k = len(sizes)
        # the group ends (int32, as the GEMM reads them) and, for the biases, the sizes: one host copy
        meta = torch.from_numpy(np.concatenate([np.cumsum(sizes), sizes]).astype(np.int32)).to(x.device,
                                                                                                non_blocking=True)
        ends, counts = meta[:k], meta[k:]
        if self.bias:
            w_up, b_up, w_down, b_down = weights
            expert_of_row = torch.repeat_interleave(counts, output_size=len(x))
        else:
            (w_up, w_down), expert_of_row = weights, None
        h = torch._grouped_mm(_Contiguous.apply(x), w_up.transpose(-2, -1), offs=ends)
        if expert_of_row is not None:
            h = _RowBias.apply(h, b_up, expert_of_row, counts)
        h = self.activation(h)
        y = torch._grouped_mm(h, w_down.transpose(-2, -1), offs=ends)
        if expert_of_row is not None:
            y = _RowBias.apply(y, b_down, expert_of_row, counts)
        return _Contiguous.apply(y)

    def _loop(self, weights: list[torch.Tensor], x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """The same one expert at a time, where this device has no native grouped GEMM for ``x.dtype``."""
        outs = []
        for i, rows in enumerate(x.split(sizes)):
            w = [t[i] for t in weights]
            up = torch.nn.functional.linear(rows, w[0], w[1] if self.bias else None)
            down_w, down_b = (w[2], w[3]) if self.bias else (w[1], None)
            outs.append(torch.nn.functional.linear(self.activation(up), down_w, down_b))
        return torch.cat(outs) if outs else x.new_zeros((0, weights[-1].shape[1]))


def grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` computes ``dtype`` on ``device`` without the host: on the CPU
    always (no device to wait for); on CUDA in bf16 on Hopper and Blackwell, its native kernel.
    Elsewhere torch takes a fallback that reads the group ends on the host (a device-to-host sync
    per call, measured on an H200 in fp32), and the experts are computed one call each instead."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cpu":
        return True
    return device.type == "cuda" and dtype == torch.bfloat16 and _capability_major(device) in (9, 10)


def empty_groups_zeroed(device: torch.device) -> bool:
    """Whether ``torch._grouped_mm``'s backward writes zeros for the weight-gradient of a group without
    rows on ``device``: on the CPU and on Hopper, so experts without rows can join a grouped call
    and get their zero gradients from it; not on Blackwell (pytorch/pytorch#172439: garbage), where
    they stay out of it."""
    return device.type == "cpu" or (device.type == "cuda" and _capability_major(device) == 9)


@lru_cache(maxsize=None)
def _capability_major(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


def strided_stack(tensors: list[torch.Tensor]) -> Optional[torch.Tensor]:
    """``torch.stack(tensors)`` ``[k, ...]`` as a view (of detached tensors), where the tensors,
    contiguous and alike, lie in one storage at one stride apart in order, each start 16-byte
    aligned (what the grouped GEMM needs of every group's operand); None otherwise."""
    first = tensors[0]
    step = tensors[1].storage_offset() - first.storage_offset() if len(tensors) > 1 else first.numel()
    if step < first.numel() or (step * first.element_size()) % _ALIGN_BYTES or first.data_ptr() % _ALIGN_BYTES:
        return None
    storage, start = first.untyped_storage().data_ptr(), first.storage_offset()
    for i, t in enumerate(tensors):
        if (t.shape != first.shape or t.dtype != first.dtype or not t.is_contiguous()
                or t.untyped_storage().data_ptr() != storage or t.storage_offset() != start + i * step):
            return None
    return first.detach().as_strided((len(tensors), *first.shape), (step, *first.stride()))


class _InPlace(torch.autograd.Function):
    """``(unused, n, *views, *params)`` -> the ``n`` views (`strided_stack` of each parameter over
    the experts), on the graph of ``params`` (k experts' parameters, expert by expert): backward
    hands each parameter its expert's slice of its view's gradient (None for ``unused`` experts),
    as `torch.stack`'s backward does."""

    @staticmethod
    def forward(ctx, unused, n, *tensors):
        ctx.unused, ctx.n = unused, n
        return tuple(v.view_as(v) for v in tensors[:n])

    @staticmethod
    def backward(ctx, *grads):
        n, k = ctx.n, len(ctx.unused)
        per_param = [[None if ctx.unused[i] or g is None else g[i] for i in range(k)] for g in grads]
        return (None, None, *([None] * n), *(per_param[j][i] for i in range(k) for j in range(n)))


class _RowBias(torch.autograd.Function):
    """``h + bias[expert_of_row]``: h ``[N, F]``, bias ``[k, F]``, expert_of_row ``int [N]`` (the
    rows grouped by expert, ``counts`` ``int [k]`` of them each). Its backward sums each expert's
    bias gradient in fp32 and rounds once, as a Linear's ``grad.sum(0)`` does (an ``index_add`` in
    bf16 would round after every row), row after row within each expert (``segment_reduce``): the
    same sum every run on a GPU too, where an ``index_add`` adds with atomics in any order. In bf16
    the forward rounds twice (the GEMM's output, then the sum) where a Linear's fused ``addmm``
    rounds once: one bf16 rounding, as DeepSpeed's MoE itself rounds its experts' first Linear when
    it holds several."""

    @staticmethod
    def forward(ctx, h, bias, expert_of_row, counts):
        ctx.save_for_backward(counts)
        ctx.bias_shape, ctx.bias_dtype = bias.shape, bias.dtype
        return h + bias.index_select(0, expert_of_row)

    @staticmethod
    def backward(ctx, grad):
        (counts, ) = ctx.saved_tensors
        # unsafe: the counts are the rows' own grouping; the check would read them on the host
        sums = torch.segment_reduce(grad if grad.dtype == torch.float32 else grad.float(), "sum", lengths=counts,
                                    axis=0, unsafe=True)
        return grad, sums.to(ctx.bias_dtype), None, None


class _Contiguous(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: ``torch._grouped_mm``'s backward refuses
    an expanded one (``out.sum().backward()``); a contiguous gradient passes unchanged, with no copy."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()
