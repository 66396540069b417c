"""DeepSpeed's dropless top-1 routes without its device-to-host sync.

DeepSpeed's `top1gating` picks each expert's tokens with ``torch.topk(k=capacity)``, and its ``k``
is a device tensor (the largest expert count): on a GPU the host waits there for the gate. A
dropless gate's capacity is at least every expert's count, so that pick keeps every routed
token: the routes are the argmax itself. `dropless_top1` computes DeepSpeed's sparse outputs from
it with the same operations in the same order, and makes the same random draws (the gate's noise,
and the token-selection draw, which DeepSpeed makes even where it keeps every token), so that
whatever runs after the gate sees the same random state. The outputs are DeepSpeed's bit for bit
but for one case: a routed token whose selection draw is exactly 0 (about 2^-24 per route) ties
with the unrouted tokens in DeepSpeed's ``topk``, which may then drop it; here it is kept, as a
dropless gate must. `DroplessTop1Gate` is the gate a FEPLB layer's top-1 `TopKGate` becomes.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from deepspeed.moe import sharded_moe


def dropless_top1(gate: sharded_moe.TopKGate, x: torch.Tensor, used_token: Optional[torch.Tensor] = None) -> tuple:
    """What DeepSpeed's ``gate(x, used_token, sparse_routes=True)`` returns for a top-1 `TopKGate`
    with ``drop_tokens=False``, with no device-to-host sync.

    x ``[S, H]``; used_token ``[S]`` (0: a padding token, routed nowhere) or None. Returns
    (l_aux, capacity, num_experts, expert ids int32 ``[1, S]`` (-1: no expert), locations int32
    ``[1, S]`` (each route's position among its expert's tokens), gate values ``[1, S]``,
    exp_counts ``[E]``). ``capacity`` is the largest expert count, a device tensor: dropless, it
    limits nothing."""
    timed = gate.wall_clock_breakdown
    if timed:
        gate.timers(sharded_moe.TOPK_GATE_TIMER).start()
    x_fp32 = x.float()
    if gate.noisy_gate_policy == "Jitter" and gate.training:
        x_fp32 = sharded_moe.multiplicative_jitter(x_fp32, device=x.device)
    logits = F.linear(x_fp32, weight=gate.wg.weight.float(), bias=None)
    noise = gate.noisy_gate_policy if gate.training else None
    gates = F.softmax(logits, dim=1)
    scores = logits + sharded_moe.gumbel_rsample(logits.shape, device=logits.device) if noise == "RSample" else gates
    ids = torch.argmax(scores, dim=1)
    num_experts = int(gates.shape[1])
    mask = F.one_hot(ids, num_classes=num_experts)
    if used_token is not None:
        mask = sharded_moe.einsum("s,se->se", used_token, mask)
    exp_counts = torch.sum(mask, dim=0).detach()
    l_aux = torch.sum(torch.mean(gates, dim=0) * torch.mean(mask.float(), dim=0)) * num_experts
    if gate.use_rts:  # DeepSpeed's token-selection draw: nothing is selected away, the random state moves on
        _selection_draw(logits.device)(mask.shape)
    if logits.shape[0] < gate.min_capacity:
        raise ValueError(f"the MoE gate has {logits.shape[0]} tokens, fewer than its min_capacity={gate.min_capacity} "
                         "(DeepSpeed refuses this too); set min_capacity to 0 or use larger micro-batches")
    ids = torch.min(ids, mask.sum(dim=1) * num_experts - 1)  # an unused token: -1
    gate_values = (gates * mask).sum(dim=1)
    locations = torch.sum((torch.cumsum(mask, dim=0) - 1) * mask, dim=1)
    if timed:
        gate.timers(sharded_moe.TOPK_GATE_TIMER).stop()
        gate.gate_time = gate.timers(sharded_moe.TOPK_GATE_TIMER).elapsed(reset=False)
    return (l_aux, exp_counts.max(), num_experts, ids.to(torch.int32).unsqueeze(0),
            locations.to(torch.int32).unsqueeze(0), gate_values.unsqueeze(0), exp_counts)


_DRAWS: dict = {}  # device -> the token-selection sampler (DeepSpeed caches its own alike)


def _selection_draw(device: torch.device):
    """DeepSpeed's token-selection sampler on ``device``: uniform on [0, 1), its draws consuming
    the random state as DeepSpeed's cached one does (DeepSpeed's cache is read, never written)."""
    draw = sharded_moe.exp_selection_uniform_map.get(device) or _DRAWS.get(device)
    if draw is None:
        draw = _DRAWS[device] = torch.distributions.uniform.Uniform(low=torch.tensor(0.0, device=device),
                                                                    high=torch.tensor(1.0, device=device)).rsample
    return draw


class DroplessTop1Gate(sharded_moe.TopKGate):
    """DeepSpeed's top-1 `TopKGate`, dropless, whose sparse routes are `dropless_top1`'s when it
    runs without an EP group (as a FEPLB layer runs its gate: FEPLB never reads the capacity). A
    FEPLB layer's top-1 gate becomes one when the layer attaches (`accepts`, then
    `integration.seams.make_dropless_top1`): the same module, so its parameters, state dict keys and
    hooks stay. Every other call is DeepSpeed's, among them a DeepSpeed `MOELayer`'s, whose dense
    dispatch needs the capacity agreed over its EP group."""

    @staticmethod
    def accepts(gate) -> bool:
        """Whether ``gate`` can become one: DeepSpeed's own dropless top-1 `TopKGate`."""
        return type(gate) is sharded_moe.TopKGate and gate.k == 1 and not gate.drop_tokens

    def forward(self, input: torch.Tensor, used_token: Optional[torch.Tensor] = None, sparse_routes: bool = False,
                use_tutel: bool = False):
        if sparse_routes and not use_tutel and not self.drop_tokens and self.ep_group is None:
            return dropless_top1(self, input, used_token)
        return super().forward(input, used_token, sparse_routes, use_tutel)
