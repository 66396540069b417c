"""Phase 2: compute the dynamic experts of one micro-batch where the plan says, exactly.

For one layer and micro-batch, `DynamicExperts` takes the rows of this rank's dynamic experts
(the hottest local experts, `plan.hottest`) and the parameters of those experts, and returns their outputs.
Following the plan, the home keeps the first rows of each dynamic expert and ships the rest in
chunks, together with a copy of the expert's weights, to helper ranks of its NVLink domain;
at the same time it serves as a helper for other homes. Helpers compute with a functional copy
of the expert (their own expert module as a template, the weights bound into it for the call:
`ExpertSpec.call`).

Backward mirrors forward: output-gradients go to the helpers, which return input-gradients
and weight-gradients; the weight-gradients are returned by the autograd function for the
home's real parameters, so autograd accumulates them into ``.grad`` (and DeepSpeed's gradient
hooks and expert-data-parallel reduction see the full gradient).

Weight residency (`migrate.resident`, ``feplb.weight_residency: "step"``): a helper that keeps
an expert's copy for the step gets the weights only with the first chunk (or again when the
home's parameters changed: each chunk says whether it carries weights), and keeps that copy's
weight-gradients; in the backward of the step's last micro-batch every helper sends the
accumulated gradients of its copies home, where the autograd function returns them for the
home's parameters, before DeepSpeed reduces gradients: a copy that a chunk of that micro-batch
uses with the chunk's results, every other one as the backward starts (message ``FLUSH``,
`plan.residency.step_end_returns`).

A helper computes one home's chunks in parts (``feplb.serve_parts``) and sends each part's
results as soon as it is computed (`messages.served_parts`).

Every message of a step is tagged ``(seq, phase, part)``; every rank of the domain enters every step,
so the exchange is deadlock-free (sends are asynchronous, receives follow a fixed order).
"""
from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from deepspeed_feplb.experts import ExpertSpec
from deepspeed_feplb.kernels.cuda import cuda_index
from deepspeed_feplb.migrate import Transport, messages
from deepspeed_feplb.migrate.resident import HeldCopy, LayerResidency
from deepspeed_feplb.plan.policy import serves_on_arrival
from deepspeed_feplb.plan.residency import step_end_returns, used_at_step_end
from deepspeed_feplb.plan.time_model import serve_parts
from deepspeed_feplb.stats import StageTimes

FWD_TOKENS, FWD_RESULTS, BWD_GRADS, BWD_RESULTS, FLUSH, REFRESH = range(1, 7)


def served_stream(device: torch.device) -> Optional[torch.cuda.Stream]:
    """Where a rank serves its homes' chunks with ``feplb.serve_on_arrival``: on a CUDA device, one
    stream per device and process, of the highest priority (its kernels take the SMs as they free
    up, ahead of the compute stream's); None on host memory (the served work runs in the caller's
    order)."""
    if device.type != "cuda":
        return None
    return _served_stream(cuda_index(device))


def serving_stream(setting, device: torch.device) -> Optional[torch.cuda.Stream]:
    """`served_stream` where ``feplb.serve_on_arrival`` (``setting``) serves on arrival on ``device``,
    else None (the caller's stream)."""
    return served_stream(device) if serves_on_arrival(setting, device.type == "cuda") else None


def on_stream(stream: Optional[torch.cuda.Stream]):
    """A context that queues work on ``stream`` (None: the caller's stream, as it is)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


@functools.lru_cache(maxsize=None)
def _served_stream(index: int) -> torch.cuda.Stream:
    _, greatest = torch.cuda.Stream.priority_range()
    return torch.cuda.Stream(device=index, priority=greatest)


def tag(seq: int, phase: int, part: int = 0) -> int:
    """A message's tag: micro-batch (``seq``), ``phase`` and, for results sent part by part
    (`messages.served_parts`), the part (4 bits: `config.SERVE_PARTS_MAX` bounds
    ``feplb.serve_parts``)."""
    return (seq << 8) | (part << 4) | phase


@dataclass
class _GroupedCall:
    """Several pieces computed in one grouped call (`ExpertSpec.grouped`): its leaves ``x`` ``[N, H]``
    (the pieces' rows, concatenated) and ``params`` (per parameter, the pieces' stacked ``[k, ...]``),
    its output ``y`` ``[N, H_out]`` (graph kept for backward); ``sizes``: rows per piece."""
    x: torch.Tensor
    params: list[torch.Tensor]
    y: torch.Tensor
    sizes: list[int]


@dataclass
class _Piece:
    """One computed block: its differentiable leaves and output (graph kept for backward; views of
    its ``call``'s when computed with others in one grouped call); ``held``: the kept copy whose
    weight-gradients stay with this helper (None: they go home now)."""
    x: torch.Tensor
    params: list[torch.Tensor]
    y: torch.Tensor
    held: Optional[HeldCopy] = None
    call: Optional[_GroupedCall] = None


@dataclass(frozen=True)
class RankView:
    """One rank's part of a plan, derived once per micro-batch (forward and backward use it).

    outgoing:  {helper: [(index into ``dynamic``, row offset in that expert's rows, tokens, move), ...]},
               helpers ascending, chunks in plan order (``move``: the row of the plan);
    home_rows: rows ``[D']`` each dynamic expert computes at home (its first rows);
    incoming:  {home: [(local expert of the home, move), ...]} of the chunks this rank serves,
               homes ascending;
    starts:    int ``[D' + 1]``: first row of each dynamic expert in ``dyn_x``.
    """
    outgoing: dict
    home_rows: list
    incoming: dict
    starts: np.ndarray

    @classmethod
    def of(cls, moves: np.ndarray, local_rank: int, dynamic: list[int], row_counts: list[int]) -> "RankView":
        position = {e: i for i, e in enumerate(dynamic)}
        home_rows = list(row_counts)
        outgoing: dict[int, list] = {}
        incoming: dict[int, list] = {}
        rows = moves.tolist()
        for _, expert, _, tokens in (row for row in rows if row[0] == local_rank):
            home_rows[position[expert]] -= tokens
        offsets = list(home_rows)  # the moved chunks follow the home rows
        for m, (home, expert, helper, tokens) in enumerate(rows):
            if home == local_rank:
                i = position[expert]
                outgoing.setdefault(helper, []).append((i, offsets[i], tokens, m))
                offsets[i] += tokens
            if helper == local_rank:
                incoming.setdefault(home, []).append((expert, m))
        starts = np.concatenate([[0], np.cumsum(row_counts)]).astype(int)
        return cls(dict(sorted(outgoing.items())), home_rows, dict(sorted(incoming.items())), starts)


@dataclass
class Phase2MicroBatch:
    """Everything one rank does in phase 2 for one layer and micro-batch.

    moves: int64 [M, 4] (home, local_expert, helper, tokens), domain-local ranks, plan order.
    dynamic: local expert ids ``[D']`` of this rank's dynamic experts, in row order of ``dyn_x``.
    row_counts: rows ``[D']`` of each dynamic expert in ``dyn_x``.
    residency: this layer's `LayerResidency` (None: every chunk carries weights, gradients go
    home at once); step_ends: this micro-batch is the last of its optimizer step, so (with
    gradients) the kept copies' gradients go home in its backward.
    grad_experts: the local experts whose parameters the autograd function takes, the dynamic
    ones first, then those only a helper's kept copy has gradients for (the caller's
    `grad_experts`, taken before the plan: at a step's end its admission keeps nothing new).
    ready: the transport's `mark` of when the rows were ready (right after phase 1): forward's
    sends wait for it, not for whatever the caller queued since (the static experts).
    serve_parts, serve_part_rows: a helper computes one home's chunks in parts
    (`plan.time_model.serve_parts`, `messages.served_parts`) and sends each part's results (outputs;
    in backward input-gradients, with a chunk's weight-gradients in the part where it ends) as soon
    as it is computed, so only the last part's return follows the helper's compute.
    mark: marks "now" for the timed forward calls (`expert_costs.ComputeTimes.clock`: host
    seconds, or CUDA events); ``timed`` receives (k pieces, n rows, start, end) per forward call,
    and ``wait_s`` the host seconds spent blocked on a peer (receives, sends to finish).
    resent: chunks that carried weights to a helper that keeps a copy because the home's weights
    changed since (`LayerResidency.stamp`; this rank's, as a home).
    serve_early: ``feplb.serve_on_arrival``: this rank serves its homes' chunks before its own
    dynamic experts' rows, not after them; served_stream: a high-priority CUDA stream the served
    work runs on, forward and backward, beside the rank's own experts, each chunk once its message
    is in (`served_stream`; None: the caller's stream). The served work reads nothing the
    caller's stream computes; the caller's stream waits for it at the end of each direction
    (`_join`), before a kept copy's gradient sum can be read there.
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
    grad_experts: list[int]
    stage_times: Optional[StageTimes] = None  # receives compute and communication host time
    residency: Optional[LayerResidency] = None
    step_ends: bool = True
    ready: object = None
    mark: Callable[[], object] = time.perf_counter
    serve_parts: int = 1
    serve_part_rows: int = 1
    serve_early: bool = False
    served_stream: Optional[torch.cuda.Stream] = None
    home_pieces: list[_Piece] = field(default_factory=list)
    served: dict = field(default_factory=dict)  # home -> per part, (its pieces' (chunk, first row, rows), _Piece's)

    def __post_init__(self):
        self.view = RankView.of(self.moves, self.local_rank, self.dynamic, self.row_counts)
        self.returns = {helper: self._returns(chunks) for helper, chunks in self.view.outgoing.items()}
        self._compute_s = 0.0
        self.wait_s = 0.0
        self._forward_sends: Optional[list] = None  # `send_forward`'s futures
        self.timed: list = []
        self.resent = 0
        M = self.moves.shape[0]
        if self.residency is not None:
            self.residency.unpark()  # parked copies no refresh took are forgotten (`LayerResidency.park`)
        if self.residency is not None and self.needs_grad:
            self.fresh, self.copy_kept = self.residency.table.admit(self.moves, keep_new=not self.step_ends)
            self.residency.pending |= bool(self.copy_kept.any())
        else:
            # a forward without gradients (an evaluation, which may run on weights swapped in through
            # ``p.data`` and out again before training resumes: unseen) neither uses nor keeps a copy
            self.fresh, self.copy_kept = np.ones(M, np.bool_), np.zeros(M, np.bool_)
        self.flushing = self.residency is not None and self.step_ends and self.needs_grad
        # a step that ends without gradients (evaluation, or the no-grad first pass of reentrant
        # checkpointing) forgets its copies, unless some hold gradients that a later backward returns
        self.forgetting = (self.residency is not None and self.step_ends and not self.needs_grad
                           and not self.residency.pending)
        self.flush_entries, self.flush_held = np.zeros((0, 3), np.int64), {}
        # at the step's end: which moves return their kept copy's step gradients with their results,
        # and the kept copies no move uses, whose gradients go home at the backward's start
        self.with_results, self.flush_early = np.zeros(M, np.bool_), np.zeros((0, 3), np.int64)
        self._sends: list = []  # backward: the futures `backward_home` leaves to `backward_rest`

    def _carries_weights(self, m: int, expert: int, helper: int, params: list[torch.Tensor]) -> bool:
        """Whether chunk ``m`` to ``helper`` carries ``expert``'s weights (``params``): unless the helper
        keeps a copy it received earlier in the step and the weights' stamp did not change since."""
        if not self.copy_kept[m]:
            return True
        now = self.residency.stamp(params)
        carry = bool(self.fresh[m]) or self.residency.sent.get((expert, helper)) != now
        self.resent += int(carry and not self.fresh[m])
        self.residency.sent[(expert, helper)] = now
        return carry

    def _report(self, direction: str, start: float) -> None:
        """Split the host time since ``start`` into expert compute and communication (the rest)."""
        if self.stage_times is not None:
            total = time.perf_counter() - start
            self.stage_times.add(f"phase-2{direction} compute", self._compute_s)
            self.stage_times.add(f"phase-2{direction} comm", total - self._compute_s)
        self._compute_s = 0.0

    # ------------------------------------------------------------------ forward
    def send_forward(self, dyn_x: torch.Tensor, params: list[list[torch.Tensor]]) -> None:
        """Send the moved chunks (rows, and weights unless the helper keeps a copy) to their helpers,
        once: as soon as the plan is in hand, while the caller still computes its static experts
        (`balanced.BalancedMicroBatch` looks for the plan between them); `forward` sends them if
        nobody did. dyn_x ``[N_dyn, H]``, params: per dynamic expert (no gradient is taken here)."""
        if self._forward_sends is not None:
            return
        starts, sends = self.view.starts, []
        for helper, chunks in self.view.outgoing.items():
            carries = [self._carries_weights(m, self.dynamic[i], helper, params[i]) for i, _, _, m in chunks]
            layout = messages.rows_to_helper(carries, len(self.spec.param_names), len(self.spec.buffer_names))
            parts = [{"weights": params[i], "buffers": self.spec.buffers(self.experts[self.dynamic[i]]),
                      "rows": [dyn_x[starts[i] + offset:starts[i] + offset + tokens]]}
                     for i, offset, tokens, _ in chunks]
            payload = [_flags_tensor(carries, dyn_x), *layout.pack(parts)]
            sends.append(self.transport.send(helper, tag(self.seq, FWD_TOKENS), payload, after=self.ready))
        self._forward_sends = sends

    def _serving(self):
        """Where served work is queued: ``served_stream``, or the caller's stream."""
        return on_stream(self.served_stream)

    def _join(self) -> None:
        """The caller's stream waits for the served work queued so far (no host wait)."""
        if self.served_stream is not None:
            torch.cuda.current_stream(self.served_stream.device).wait_stream(self.served_stream)

    def _read_here(self, held: HeldCopy) -> HeldCopy:
        """A kept copy whose gradients the served stream summed, about to be read on the caller's
        stream (after a `_join`): their memory must not go back to the served stream's pool before
        that read ran (`Tensor.record_stream`)."""
        if self.served_stream is not None and held.grads is not None:
            stream = torch.cuda.current_stream(self.served_stream.device)
            for g in held.grads:
                g.record_stream(stream)
        return held

    def forward(self, dyn_x: torch.Tensor, params: list[list[torch.Tensor]]) -> torch.Tensor:
        """dyn_x ``[N_dyn, H]`` rows of the dynamic experts -> their outputs ``[N_dyn, H_out]``."""
        start = time.perf_counter()
        home_rows, starts = self.view.home_rows, self.view.starts
        self.row_width = dyn_x.shape[1]  # the input-gradient's, also where no dynamic expert is here
        self.device = dyn_x.device  # where received messages land
        self.send_forward(dyn_x, params)
        sends = self._forward_sends

        with torch.enable_grad():
            if self.serve_early:
                with self._serving():
                    sends += self._serve_forward(dyn_x.device)
            self.home_pieces = self._compute([(self.experts[e], params[i], self.spec.buffers(self.experts[e]),
                                               dyn_x[starts[i]:starts[i] + home_rows[i]])
                                              for i, e in enumerate(self.dynamic)])
            if not self.serve_early:
                sends += self._serve_forward(dyn_x.device)

        # the helpers' outputs land in their rows of the output (no copy after the receive)
        out = None
        if self.home_pieces:
            first = self.home_pieces[0].y
            out = first.new_empty((int(starts[-1]), first.shape[1]))
        for helper, parts in self.returns.items():
            for k, pieces in enumerate(parts):
                places = [[out[at:at + rows]] for _, at, rows, _, _ in pieces]
                self._recv_into(helper, tag(self.seq, FWD_RESULTS, k), messages.outputs_to_home(len(pieces)),
                                "outputs", places, out.device, "forward results")
        self._settle(sends)
        self._join()
        self.transport.release(self.ready)  # every send that waits for it is queued
        if self.flushing:  # the step ends: its copies leave the table now and go home in backward
            self.flush_entries, self.flush_held = self.residency.end_step()
            self.with_results, self.flush_early = step_end_returns(self.flush_entries, self.moves, self.copy_kept)
            if self.residency.carries_over:  # the copies this micro-batch used, for the next step
                used = used_at_step_end(self.moves, self.with_results)
                self.residency.park(used, {(h, e): self.flush_held[(h, e)] for h, e, j in used.tolist()
                                           if j == self.local_rank})
        elif self.forgetting:
            self.residency.end_step()
        for i, piece in enumerate(self.home_pieces):
            out[starts[i]:starts[i] + home_rows[i]] = piece.y.detach()
        self._report("", start)
        return out if out is not None else dyn_x.new_zeros((0, dyn_x.shape[1]))

    def _parts(self, sizes: list[int]) -> list[list[tuple[int, int, int]]]:
        """The parts one home's chunks of ``sizes`` rows are served in (`messages.served_parts`)."""
        return messages.served_parts(sizes, serve_parts(sum(sizes), self.serve_parts, self.serve_part_rows))

    def _returns(self, chunks: list) -> list[list[tuple]]:
        """The parts a helper's results for this home's ``chunks`` (`RankView.outgoing`) come back in:
        per piece (index into ``dynamic``, first row in ``dyn_x``, rows, the move, whether the piece
        ends its chunk)."""
        starts = self.view.starts
        return [[(chunks[c][0], int(starts[chunks[c][0]]) + chunks[c][1] + first, rows, chunks[c][3],
                  first + rows == chunks[c][2]) for c, first, rows in part]
                for part in self._parts([tokens for _, _, tokens, _ in chunks])]

    def _recv_into(self, src: int, message_tag: int, layout: messages.MessageLayout, name: str, places: list,
                   device: torch.device, what: str) -> list[dict]:
        """Receive a message of ``layout`` whose part ``name`` of chunk c lands in ``places[c]``
        (`MessageLayout.receive_into`; a tensor that did not fit its place is copied there); returns
        the message unpacked (``what`` names it in errors)."""
        parts = layout.unpack(self._recv(src, message_tag, layout.receive_into(name, places, device)), what)
        for place, part in zip(places, parts):
            for target, got in zip(place, part[name]):
                if got is not target:
                    target.copy_(got)
        return parts

    def _recv(self, src: int, message_tag: int, into=None) -> list[torch.Tensor]:
        """Receive a message (into one buffer per dtype where ``into`` is None: `messages.message_buffers`)."""
        start = time.perf_counter()
        if into is None:
            into = functools.partial(messages.message_buffers, device=self.device)
        try:
            return self.transport.recv(src, message_tag, into)
        finally:
            self.wait_s += time.perf_counter() - start

    def _settle(self, sends: list) -> None:
        start = time.perf_counter()
        for future in sends:
            future.result()
        self.wait_s += time.perf_counter() - start

    def _compute(self, pieces: list[tuple]) -> list[_Piece]:
        """Compute ``pieces`` ``(module, params, buffers, x [n, H])``: those with rows in one grouped
        call (`ExpertSpec.grouped`) where each parameter of theirs already lies stacked in one
        buffer (weights received so, `_stacked_weights`, or neighbours in the layer's stacked
        parameters): a stacked copy would stay alive from forward to backward. Otherwise, and for
        pieces without rows, one functional call each. One timed sample per call."""
        with_rows = [i for i, (*_, x) in enumerate(pieces) if len(x)]
        stacked = None
        if self.spec.grouped is not None and with_rows:
            stacked = [stacked_view([pieces[i][1][j].detach() for i in with_rows])
                       for j in range(len(self.spec.param_names))]
        if stacked is None or any(w is None for w in stacked):
            return [self._compute_one(*piece) for piece in pieces]
        start, began = time.perf_counter(), self.mark()
        sizes = [len(pieces[i][3]) for i in with_rows]
        rows = [pieces[i][3].detach() for i in with_rows]
        x = stacked_view(rows, join=True)
        x = (torch.cat(rows) if x is None else x).requires_grad_(self.needs_grad)
        params = [w.requires_grad_(self.needs_grad) for w in stacked]
        with torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is):  # as in `_compute_one`
            y = self.spec.grouped(params, x, sizes)
        if not self.needs_grad:
            y = y.detach()
        self.timed.append((len(sizes), len(x), began, self.mark()))
        self._compute_s += time.perf_counter() - start
        call = _GroupedCall(x, params, y, sizes)
        out = [None if len(piece[3]) else self._compute_one(*piece) for piece in pieces]
        for k, (i, x_k, y_k) in enumerate(zip(with_rows, x.split(sizes), y.split(sizes))):
            out[i] = _Piece(x_k, [w[k] for w in params], y_k, call=call)
        return out

    def _compute_one(self, module, params, buffers, x) -> _Piece:
        start, began = time.perf_counter(), self.mark()
        x = x.detach().requires_grad_(self.needs_grad)
        leaves = [p.detach().requires_grad_(self.needs_grad) for p in params]
        # keep what the piece's graph saves even under activation checkpointing's saved-tensor hooks:
        # our backward differentiates the piece itself, and a dropped tensor would make PyTorch
        # recompute the whole layer (collectives and messages) from inside phase 2's backward
        with torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is):
            y = self.spec.call(module, leaves, buffers, x)
        if not self.needs_grad:
            y = y.detach()
        if len(x):
            self.timed.append((1, len(x), began, self.mark()))
        self._compute_s += time.perf_counter() - start
        return _Piece(x, leaves, y)

    def _held_copy(self, home: int, expert: int, m: int, params: Optional[list]) -> Optional[HeldCopy]:
        """The copy this helper keeps for chunk ``m`` (updated with ``params`` when the chunk
        carries weights), or None when the chunk's gradients go home at once."""
        if not self.copy_kept[m]:
            if params is None:
                raise RuntimeError(f"FEPLB residency out of step: expert {expert} of local rank {home} came "
                                   f"without weights to local rank {self.local_rank}, which keeps no copy of it")
            return None
        key = (home, expert)
        if params is not None:
            old = self.residency.held.get(key)
            self.residency.held[key] = HeldCopy(list(params), old.grads if old is not None else None)
        elif key not in self.residency.held:
            raise RuntimeError(f"FEPLB residency out of step: local rank {self.local_rank} holds no copy of expert "
                               f"{expert} of local rank {home}")
        return self.residency.held[key]

    def _vjp(self, pieces: list[_Piece], grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Per piece, the gradients of its rows and parameters from ``grads[i]`` (its output's
        gradient); pieces of one grouped call come together, and its backward runs once."""
        start = time.perf_counter()
        out: list = [None] * len(pieces)
        calls: dict = {}
        for i, (piece, grad) in enumerate(zip(pieces, grads)):
            if piece.call is None:
                out[i] = _vjp(piece.y, [piece.x, *piece.params], grad)
            else:
                calls.setdefault(id(piece.call), []).append(i)
        for members in calls.values():
            call = pieces[members[0]].call
            if len(members) != len(call.sizes):
                raise RuntimeError("FEPLB phase 2: a grouped call's backward needs all its pieces' gradients")
            gx, *gp = _vjp(call.y, [call.x, *call.params], torch.cat([grads[i] for i in members]))
            for k, (i, gx_k) in enumerate(zip(members, gx.split(call.sizes))):
                out[i] = [gx_k, *[g[k] for g in gp]]
        self._compute_s += time.perf_counter() - start
        return out

    def _serve_forward(self, device: torch.device):
        template = self.experts[0]
        n_params, n_buffers = len(self.spec.param_names), len(self.spec.buffer_names)
        sends = []
        for home, experts in self.view.incoming.items():
            into = _stacked_weights(len(experts), n_params, n_buffers, device)
            message = self._recv(home, tag(self.seq, FWD_TOKENS), into)
            carries = _read_flags(message[0], len(experts))
            parts = messages.rows_to_helper(carries, n_params, n_buffers).unpack(message[1:], "forward rows")
            # a kept copy may hold on to the message's stacked weights only if every copy in them is kept
            whole = all(self.copy_kept[m] for (_, m), carry in zip(experts, carries) if carry)
            held = [self._held_copy(home, expert, m, None if not carry else part["weights"] if whole or not
                                    self.copy_kept[m] else [w.clone() for w in part["weights"]])
                    for (expert, m), carry, part in zip(experts, carries, parts)]
            chunks = [(template, part["weights"] if carry else h.params, part["buffers"], part["rows"][0])
                      for h, carry, part in zip(held, carries, parts)]
            served = []
            for k, members in enumerate(self._parts([len(chunk[3]) for chunk in chunks])):
                pieces = self._compute([(*chunks[c][:3], chunks[c][3][first:first + rows])
                                        for c, first, rows in members])
                for piece, (c, _, _) in zip(pieces, members):
                    piece.held = held[c]
                served.append((members, pieces))
                results = messages.outputs_to_home(len(pieces)).pack([{"outputs": [p.y.detach()]} for p in pieces])
                sends.append(self.transport.send(home, tag(self.seq, FWD_RESULTS, k), results))
            if self.needs_grad:
                self.served[home] = served
        return sends

    # ------------------------------------------------------------------ backward
    def backward_home(self, grad_y: torch.Tensor):
        """The half of backward that waits for no rank (`DynamicExperts`): output-gradients to the
        helpers, the home rows' gradients. grad_y ``[N_dyn, H_out]`` -> (grad of dyn_x ``[N_dyn,
        H]`` with the helpers' rows still zero, the home rows' parameter grads per dynamic
        expert)."""
        start = time.perf_counter()
        outgoing, home_rows, starts = self.view.outgoing, self.view.home_rows, self.view.starts
        for helper, chunks in outgoing.items():
            grads = [{"output_grads": [grad_y[starts[i] + offset:starts[i] + offset + tokens]]}
                     for i, offset, tokens, _ in chunks]
            payload = messages.output_grads_to_helper(len(chunks)).pack(grads)
            self._sends.append(self.transport.send(helper, tag(self.seq, BWD_GRADS), payload))
        self._sends += self._flush_early()

        grad_x = torch.zeros((int(starts[-1]), self.row_width), dtype=grad_y.dtype, device=grad_y.device)
        grad_params = []
        home_grads = self._vjp(self.home_pieces, [grad_y[starts[i]:starts[i] + home_rows[i]]
                                                  for i in range(len(self.home_pieces))])
        for i, (gx, *gp) in enumerate(home_grads):
            grad_x[starts[i]:starts[i] + home_rows[i]] = gx
            grad_params.append(gp)
        self.home_pieces = []
        self._report(" bwd", start)
        return grad_x, grad_params

    def backward_rest(self, grad_x: torch.Tensor, grad_params: list):
        """The half of backward that waits for the domain (`Phase2Anchor`, after the static experts'
        backward is queued): serve the helpers' chunks of other homes (on ``served_stream`` where
        given: beside the static experts' backward), take this rank's helpers' results into
        ``grad_x`` (in place) and ``grad_params``, and the step's kept-copy gradients. Returns
        (grad of dyn_x, parameter grads per expert of ``grad_experts``, None: none)."""
        start = time.perf_counter()
        sends, self._sends = self._sends, []
        with self._serving():
            sends += self._serve_backward()
        n_params = len(self.spec.param_names)
        grad_params = list(grad_params) + [None] * (len(self.grad_experts) - len(grad_params))
        early = [(e, j) for h, e, j in self.flush_early.tolist() if h == self.local_rank]
        for helper in sorted({*self.returns, *(j for _, j in early)}):
            self._receive_flushed(helper, [e for e, j in early if j == helper], grad_params)
            for k, pieces in enumerate(self.returns.get(helper, [])):
                # a chunk's weight-gradients come with its last piece, unless its helper keeps the copy
                # (then, at the step's end, with the last move that uses it: the step's sum)
                layout = messages.grads_to_home([(not self.copy_kept[m] or self.with_results[m]) and ends
                                                 for _, _, _, m, ends in pieces], n_params)
                # their rows' gradients land in grad_x (no copy after the receive)
                places = [[grad_x[at:at + rows]] for _, at, rows, _, _ in pieces]
                parts = self._recv_into(helper, tag(self.seq, BWD_RESULTS, k), layout, "input_grads", places,
                                        grad_x.device, "backward results")
                for (i, *_), part in zip(pieces, parts):
                    if part["weight_grads"]:
                        grad_params[i] = [a + b for a, b in zip(grad_params[i], part["weight_grads"])]
        self._settle(sends)
        self._join()
        self.flush_held = {}
        if self.flushing and self.residency.parked is not None:  # their sums went home: not held through the step
            for copy in self.residency.parked[1].values():
                copy.grads = None
        self._report(" bwd", start)
        return grad_x, grad_params

    def _serve_backward(self) -> list:
        """Serve this rank's homes' chunks backward: their output-gradients in, input- and weight-gradients
        home part by part (a kept copy's at the step's end only). Returns the sends' futures."""
        sends = []
        n_params = len(self.spec.param_names)
        for home, served in self.served.items():
            chunks = len(self.view.incoming[home])
            grads = messages.output_grads_to_helper(chunks).unpack(
                self._recv(home, tag(self.seq, BWD_GRADS)), "backward output-gradients")
            summed: list = [None] * chunks  # a chunk's weight-gradients over its pieces, until its last
            for k, (members, pieces) in enumerate(served):
                vjps = self._vjp(pieces, [grads[c]["output_grads"][0][first:first + rows]
                                          for c, first, rows in members])
                parts, goes_home = [], []
                for (c, first, rows), piece, (gx, *gp) in zip(members, pieces, vjps):
                    last = first + rows == len(grads[c]["output_grads"][0])
                    if piece.held is not None:  # goes home once, at the step's end
                        piece.held.accumulate(gp)
                        ends = last and bool(self.with_results[self.view.incoming[home][c][1]])
                        weight_grads = piece.held.gradients() if ends else []
                    else:  # in fp32 over parts: one rounding at the end, as one call over the chunk has
                        summed[c] = gp if summed[c] is None else [a.float() + b for a, b in zip(summed[c], gp)]
                        ends = last
                        weight_grads = [a.to(b.dtype) for a, b in zip(summed[c], gp)] if ends else []
                    parts.append({"input_grads": [gx], "weight_grads": weight_grads})
                    goes_home.append(ends)
                layout = messages.grads_to_home(goes_home, n_params)
                sends.append(self.transport.send(home, tag(self.seq, BWD_RESULTS, k), layout.pack(parts)))
        self.served = {}
        return sends

    def _flush_early(self) -> list:
        """The step's end, as the backward starts: send the gradients of the copies this rank kept
        that no chunk of this micro-batch uses (final already) to their homes, one message per home."""
        entries = [(h, e) for h, e, j in self.flush_early.tolist() if j == self.local_rank]
        sends = []
        for home in sorted({h for h, _ in entries}):
            copies = [{"weight_grads": self._read_here(self.flush_held[(h, e)]).gradients()}
                      for h, e in entries if h == home]
            payload = messages.flushed_to_home(len(copies), len(self.spec.param_names)).pack(copies)
            sends.append(self.transport.send(home, tag(self.seq, FLUSH), payload))
        return sends

    def _receive_flushed(self, helper: int, experts: list[int], grad_params: list) -> None:
        """Add the step's gradients of ``experts``' copies that ``helper`` kept and sent at the
        backward's start (`_flush_early`) to ``grad_params`` (indexed like ``grad_experts``)."""
        if not experts:
            return
        position = {e: k for k, e in enumerate(self.grad_experts)}
        parts = messages.flushed_to_home(len(experts), len(self.spec.param_names)).unpack(
            self._recv(helper, tag(self.seq, FLUSH)), "kept-copy gradients")
        for e, part in zip(experts, parts):
            k, gp = position[e], part["weight_grads"]
            grad_params[k] = list(gp) if grad_params[k] is None else [a + b for a, b in zip(grad_params[k], gp)]


def _as_is(t: torch.Tensor) -> torch.Tensor:
    return t


def _flags_tensor(flags: list[bool], like: torch.Tensor) -> torch.Tensor:
    """Per-chunk flags as an *empty* tensor whose second dimension is their bit mask: its shape
    travels in the transport's host-side description, so the receiver reads the flags without
    a device copy or synchronisation (on the CUDA transport too)."""
    return like.new_empty((0, sum(1 << k for k, flag in enumerate(flags) if flag)))


def _read_flags(t: torch.Tensor, n: int) -> list[bool]:
    return _flags_of(int(t.shape[1]), n)


def _flags_of(mask: int, n: int) -> list[bool]:
    return [bool((mask >> k) & 1) for k in range(n)]


def _stacked_weights(chunks: int, n_params: int, n_buffers: int, device: torch.device):
    """A `Transport.recv` ``into`` for a forward-rows message of ``chunks`` chunks: the weights of the
    chunks that carry them land in one buffer, each parameter's stacked ``[k, *shape]`` in chunk
    order, and the chunks' rows in another, joined ``[sum n, H]``, so that a grouped call computes
    from them without another copy (`stacked_view`), and a kept weight copy does not keep the rows."""
    def into(descriptions: list) -> list[torch.Tensor]:
        carries = _flags_of(int(descriptions[0][0][1]), chunks)
        layout = messages.rows_to_helper(carries, n_params, n_buffers)
        at, weights, rows = 1, [[] for _ in range(n_params)], []  # message positions, per parameter and of rows
        for chunk in layout.parts:
            for name, count in chunk:
                if name == "weights":
                    for j in range(count):
                        weights[j].append(at + j)
                elif name == "rows":
                    rows.append(at)
                at += count
        return messages.message_buffers(descriptions, device, groups=[*weights, rows], apart=rows)
    return into


def stacked_view(tensors: list[torch.Tensor], join: bool = False) -> Optional[torch.Tensor]:
    """``torch.stack(tensors)`` ``[k, ...]`` (``join``: ``torch.cat``, ``[sum n, ...]``) as a view, where
    they already lie back to back in one storage, in order (received so, `_stacked_weights`, or
    neighbours in a layer's stacked parameters); None where that would take a copy."""
    first = tensors[0]
    at = first.storage_offset()
    for t in tensors:
        if (not t.is_contiguous() or t.shape[1:] != first.shape[1:] or (not join and t.shape != first.shape)
                or t.dtype != first.dtype or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or t.storage_offset() != at):
            return None
        at += t.numel()
    if join:
        return first.as_strided((sum(len(t) for t in tensors), *first.shape[1:]), first.stride())
    return first.as_strided((len(tensors), *first.shape), (first.numel(), *first.stride()))


def _vjp(y: torch.Tensor, leaves: list[torch.Tensor], grad: torch.Tensor) -> list[torch.Tensor]:
    """Gradients of ``y`` w.r.t. ``leaves`` given ``grad``; zeros for unused leaves."""
    grads = torch.autograd.grad(y, leaves, grad, allow_unused=True)
    return [torch.zeros_like(leaf) if g is None else g for leaf, g in zip(leaves, grads)]


def grad_experts(residency: Optional[LayerResidency], local_rank: int, dynamic: list[int], step_ends: bool,
                 needs_grad: bool) -> list[int]:
    """The local experts whose parameters phase 2 returns gradients for: the ``dynamic`` ones, then,
    in the backward that ends a step, those whose only gradients this micro-batch are what helpers
    kept (known before the plan: a step's last micro-batch keeps no new copy)."""
    if residency is None or not (step_ends and needs_grad):
        return list(dynamic)
    kept_here = {e for home, e, _ in residency.table.entries().tolist() if home == local_rank}
    return [*dynamic, *sorted(kept_here - set(dynamic))]


# A FEPLB layer's backward exchanges gradients between the ranks (phase 2's rows and kept copies,
# replica slots' sums) once per forward: a second backward through the same graph
# (``retain_graph=True``) would find them spent.
ONE_BACKWARD = ("FEPLB: this MoE layer's micro-batch was back-propagated already; its backward exchanges "
                "gradients between the ranks and runs once per forward. Take every gradient you need in one "
                "backward (torch.autograd.backward(..., inputs=...) or torch.autograd.grad of several outputs at "
                "once), or run the forward again for the second one")


class Phase2Anchor(torch.autograd.Function):
    """Identity on ``(dyn_x, *params)`` (the ``grad_experts``' parameters), applied before the static
    experts' forward: autograd runs later nodes first, so its backward, where phase 2 waits for the
    domain (`Phase2MicroBatch.backward_rest`), comes after the static experts' backward was queued,
    and the home's device is not idle while its host waits for helpers. ``box["step"]`` is the
    micro-batch's `Phase2MicroBatch`, set once the plan is known."""

    @staticmethod
    def forward(ctx, box: dict, params_per_expert: int, dyn_x: torch.Tensor, *params):
        ctx.box, ctx.params_per_expert = box, params_per_expert
        return (dyn_x.view_as(dyn_x), *[p.view_as(p) for p in params])

    @staticmethod
    def backward(ctx, grad_x, *grad_params):
        step, n = ctx.box.pop("step", None), ctx.params_per_expert
        if step is None:
            raise RuntimeError(ONE_BACKWARD)
        grouped = [None if grad_params[i] is None else list(grad_params[i:i + n])
                   for i in range(0, len(grad_params), n)]
        grad_x, grouped = step.backward_rest(grad_x, grouped)
        return (None, None, grad_x, *[g for gp in grouped for g in (gp if gp is not None else [None] * n)])


class DynamicExperts(torch.autograd.Function):
    """Autograd boundary of a `Phase2MicroBatch`: ``(dyn_x, *params) -> dyn_y``; ``params``: those of the
    step's ``grad_experts`` in order (the dynamic experts' first). Its backward does only what waits
    for no rank (`Phase2MicroBatch.backward_home`); the rest is `Phase2Anchor`'s."""

    @staticmethod
    def forward(ctx, step: Phase2MicroBatch, params_per_expert: int, dyn_x: torch.Tensor, *params):
        ctx.step, ctx.param_count = step, len(params)
        grouped = [list(params[i:i + params_per_expert]) for i in range(0, len(params), params_per_expert)]
        return step.forward(dyn_x, grouped)

    @staticmethod
    def backward(ctx, grad_y):
        if ctx.step is None:
            raise RuntimeError(ONE_BACKWARD)
        grad_x, grad_params = ctx.step.backward_home(grad_y.contiguous())
        ctx.step = None
        flat = [g for gp in grad_params for g in gp]
        return (None, None, grad_x, *flat, *[None] * (ctx.param_count - len(flat)))  # none yet for kept copies' experts
