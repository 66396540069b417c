"""Phase 2: compute the dynamic experts of one micro-batch where the plan says, exactly.

For one layer and micro-batch, `DynamicExperts` takes the rows of this rank's dynamic experts
(the D hottest local experts) and the parameters of those experts, and returns their outputs.
Following the plan, the home keeps the first rows of each dynamic expert and ships the rest in
chunks, together with a copy of the expert's weights, to helper ranks of its NVLink domain;
at the same time it serves as a helper for other homes. Helpers compute with a functional copy
of the expert (`torch.func.functional_call` on their own expert module as a template).

Backward mirrors forward: output-gradients go to the helpers, which return input-gradients
and weight-gradients; the weight-gradients are returned by the autograd function for the
home's real parameters, so autograd accumulates them into ``.grad`` (and DeepSpeed's gradient
hooks and expert-data-parallel reduction see the full gradient).

Every message of a step is tagged ``(seq, phase)``; every rank of the domain enters every step,
so the exchange is deadlock-free (sends are asynchronous, receives follow a fixed order).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
from torch.func import functional_call

from deepspeed_feplb.migrate import Transport
from deepspeed_feplb.stats import StageTimes

FWD_TOKENS, FWD_RESULTS, BWD_GRADS, BWD_RESULTS = range(1, 5)


def tag(seq: int, phase: int) -> int:
    return (seq << 4) | phase


@dataclass
class ExpertSpec:
    """How to run any local expert functionally: its module and parameter/buffer names."""
    param_names: list[str]
    buffer_names: list[str]

    @classmethod
    def of(cls, expert: torch.nn.Module) -> "ExpertSpec":
        return cls([n for n, _ in expert.named_parameters()], [n for n, _ in expert.named_buffers()])

    @staticmethod
    def buffers(module: torch.nn.Module) -> list[torch.Tensor]:
        return [b for _, b in module.named_buffers()]

    def call(self, module, params, buffers, x):
        out = functional_call(module, {**dict(zip(self.param_names, params)), **dict(zip(self.buffer_names, buffers))},
                              (x, ))
        return out[0] if isinstance(out, tuple) else out


@dataclass
class _Piece:
    """One computed block: its differentiable leaves and output (graph kept for backward)."""
    x: torch.Tensor
    params: list[torch.Tensor]
    y: torch.Tensor


@dataclass(frozen=True)
class RankView:
    """One rank's part of a plan, derived once per micro-batch (forward and backward use it).

    outgoing:  {helper: [(index into ``dynamic``, row offset in that expert's rows, tokens), ...]},
               helpers ascending, chunks in plan order;
    kept:      rows ``[D']`` each dynamic expert keeps at home (its first rows);
    incoming:  {home: [local expert of the home, ...]} of the chunks this rank serves, homes ascending;
    starts:    int ``[D' + 1]``: first row of each dynamic expert in ``dyn_x``.
    """
    outgoing: dict
    kept: list
    incoming: dict
    starts: np.ndarray

    @classmethod
    def of(cls, moves: np.ndarray, local_rank: int, dynamic: list[int], row_counts: list[int]) -> "RankView":
        mine = moves[moves[:, 0] == local_rank].tolist()
        position = {e: i for i, e in enumerate(dynamic)}
        kept = list(row_counts)
        for _, expert, _, tokens in mine:
            kept[position[expert]] -= tokens
        offsets = list(kept)  # the moved chunks follow the rows the home keeps
        outgoing: dict[int, list] = {}
        for _, expert, helper, tokens in mine:
            i = position[expert]
            outgoing.setdefault(helper, []).append((i, offsets[i], tokens))
            offsets[i] += tokens
        incoming: dict[int, list] = {}
        for home, expert, _, _ in moves[moves[:, 2] == local_rank].tolist():
            incoming.setdefault(home, []).append(expert)
        starts = np.concatenate([[0], np.cumsum(row_counts)]).astype(int)
        return cls(dict(sorted(outgoing.items())), kept, dict(sorted(incoming.items())), starts)


@dataclass
class Phase2Step:
    """Everything one rank does in phase 2 for one layer and micro-batch.

    moves: int64 [M, 4] (home, local_expert, helper, tokens), domain-local ranks, plan order.
    dynamic: local expert ids ``[D']`` of this rank's dynamic experts, in row order of ``dyn_x``.
    row_counts: rows ``[D']`` of each dynamic expert in ``dyn_x``.
    """
    transport: Transport
    seq: int
    local_rank: int
    moves: np.ndarray
    dynamic: list[int]
    row_counts: list[int]
    experts: list[torch.nn.Module]
    spec: ExpertSpec
    needs_grad: bool
    stage_times: Optional[StageTimes] = None  # receives compute and communication host time
    kept: list[_Piece] = field(default_factory=list)
    served: dict = field(default_factory=dict)  # src -> list[_Piece]

    def __post_init__(self):
        self.view = RankView.of(self.moves, self.local_rank, self.dynamic, self.row_counts)
        self._compute_s = 0.0

    def _report(self, direction: str, start: float) -> None:
        """Split the host time since ``start`` into expert compute and communication (the rest)."""
        if self.stage_times is not None:
            total = time.perf_counter() - start
            self.stage_times.add(f"phase-2{direction} compute", self._compute_s)
            self.stage_times.add(f"phase-2{direction} comm", total - self._compute_s)
        self._compute_s = 0.0

    # ------------------------------------------------------------------ forward
    def forward(self, dyn_x: torch.Tensor, params: list[list[torch.Tensor]]) -> torch.Tensor:
        """dyn_x ``[N_dyn, H]`` rows of the dynamic experts -> their outputs ``[N_dyn, H_out]``."""
        start = time.perf_counter()
        outgoing, kept_rows, starts = self.view.outgoing, self.view.kept, self.view.starts
        sends = []
        for helper, chunks in outgoing.items():
            payload = []
            for i, offset, tokens in chunks:
                expert = self.experts[self.dynamic[i]]
                payload += [*params[i], *self.spec.buffers(expert), dyn_x[starts[i] + offset:starts[i] + offset + tokens]]
            sends.append(self.transport.send(helper, tag(self.seq, FWD_TOKENS), payload))

        with torch.enable_grad():
            for i, expert_id in enumerate(self.dynamic):
                self.kept.append(self._compute(self.experts[expert_id], params[i], self.spec.buffers(self.experts[expert_id]),
                                               dyn_x[starts[i]:starts[i] + kept_rows[i]]))
            sends += self._serve_forward()

        results = {helper: self.transport.recv(helper, tag(self.seq, FWD_RESULTS)) for helper in outgoing}
        for future in sends:
            future.result()
        blocks = [(int(starts[i]), piece.y.detach()) for i, piece in enumerate(self.kept)]
        for helper, chunks in outgoing.items():
            blocks += [(int(starts[i] + offset), y) for (i, offset, _), y in zip(chunks, results[helper])]
        self._report("", start)
        if not blocks:
            return dyn_x.new_zeros((0, dyn_x.shape[1]))
        return torch.cat([y for _, y in sorted(blocks, key=lambda block: block[0])])

    def _compute(self, module, params, buffers, x) -> _Piece:
        start = time.perf_counter()
        x = x.detach().requires_grad_(self.needs_grad)
        leaves = [p.detach().requires_grad_(self.needs_grad) for p in params]
        y = self.spec.call(module, leaves, buffers, x)
        if not self.needs_grad:
            y = y.detach()
        self._compute_s += time.perf_counter() - start
        return _Piece(x, leaves, y)

    def _vjp(self, piece: "_Piece", grad: torch.Tensor) -> list[torch.Tensor]:
        start = time.perf_counter()
        grads = _vjp(piece, grad)
        self._compute_s += time.perf_counter() - start
        return grads

    def _serve_forward(self):
        template = self.experts[0]
        n_params, n_buffers = len(self.spec.param_names), len(self.spec.buffer_names)
        stride = n_params + n_buffers + 1
        sends = []
        for home, experts in self.view.incoming.items():
            message = self.transport.recv(home, tag(self.seq, FWD_TOKENS))
            pieces = []
            for j in range(len(experts)):
                part = message[j * stride:(j + 1) * stride]
                pieces.append(self._compute(template, part[:n_params], part[n_params:n_params + n_buffers], part[-1]))
            if self.needs_grad:
                self.served[home] = pieces
            sends.append(self.transport.send(home, tag(self.seq, FWD_RESULTS), [p.y.detach() for p in pieces]))
        return sends

    # ------------------------------------------------------------------ backward
    def backward(self, grad_y: torch.Tensor):
        """grad_y ``[N_dyn, H_out]`` -> grad of dyn_x ``[N_dyn, H]`` and per-expert parameter grads."""
        start = time.perf_counter()
        outgoing, kept_rows, starts = self.view.outgoing, self.view.kept, self.view.starts
        sends = []
        for helper, chunks in outgoing.items():
            payload = [grad_y[starts[i] + offset:starts[i] + offset + tokens] for i, offset, tokens in chunks]
            sends.append(self.transport.send(helper, tag(self.seq, BWD_GRADS), payload))

        grad_x = torch.zeros((int(starts[-1]), self.kept[0].x.shape[1] if self.kept else 0), dtype=grad_y.dtype,
                             device=grad_y.device)
        grad_params = []
        for i, piece in enumerate(self.kept):
            gx, *gp = self._vjp(piece, grad_y[starts[i]:starts[i] + kept_rows[i]])
            grad_x[starts[i]:starts[i] + kept_rows[i]] = gx
            grad_params.append(gp)

        for home, pieces in self.served.items():
            grads = self.transport.recv(home, tag(self.seq, BWD_GRADS))
            payload = [g for piece, grad in zip(pieces, grads) for g in self._vjp(piece, grad)]
            sends.append(self.transport.send(home, tag(self.seq, BWD_RESULTS), payload))

        stride = 1 + len(self.spec.param_names)
        for helper, chunks in outgoing.items():
            message = self.transport.recv(helper, tag(self.seq, BWD_RESULTS))
            for j, (i, offset, tokens) in enumerate(chunks):
                gx, *gp = message[j * stride:(j + 1) * stride]
                grad_x[starts[i] + offset:starts[i] + offset + tokens] = gx
                grad_params[i] = [a + b for a, b in zip(grad_params[i], gp)]
        for future in sends:
            future.result()
        self.kept, self.served = [], {}
        self._report(" bwd", start)
        return grad_x, grad_params


def _vjp(piece: _Piece, grad: torch.Tensor) -> list[torch.Tensor]:
    """Gradients of ``piece`` w.r.t. its input rows and parameters; zeros for unused leaves."""
    leaves = [piece.x, *piece.params]
    grads = torch.autograd.grad(piece.y, leaves, grad, allow_unused=True)
    return [torch.zeros_like(leaf) if g is None else g for leaf, g in zip(leaves, grads)]


class DynamicExperts(torch.autograd.Function):
    """Autograd boundary of a `Phase2Step`: ``(dyn_x, *params) -> dyn_y``."""

    @staticmethod
    def forward(ctx, step: Phase2Step, params_per_expert: int, dyn_x: torch.Tensor, *params):
        ctx.step, ctx.params_per_expert = step, params_per_expert
        grouped = [list(params[i:i + params_per_expert]) for i in range(0, len(params), params_per_expert)]
        return step.forward(dyn_x, grouped)

    @staticmethod
    def backward(ctx, grad_y):
        grad_x, grad_params = ctx.step.backward(grad_y.contiguous())
        ctx.step = None
        return (None, None, grad_x, *[g for gp in grad_params for g in gp])
