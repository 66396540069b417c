"""Sigmoid top-k gating with aux-loss-free bias balancing (DeepSeek-V3 / GLM style).

Scores are ``sigmoid(x W^T)``; a per-expert bias, which is not a parameter and gets no
gradient, is added to the scores for *choosing* the top-k experts only; the gate values are the
unbiased scores of the chosen experts (renormalised over the k when ``normalize_topk``). After
each training forward the bias moves by ``bias_update_rate`` towards balance: up for experts
below the mean load, down for those above it (loads summed over the data-parallel group, so
every replica keeps the same bias). The gate returns DeepSpeed's sparse-route tuple.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


class SigmoidTopKGate(torch.nn.Module):
    """Drop-in for DeepSpeed's `TopKGate` (same ``wg`` parameter, so state dicts keep their keys).

    forward(x ``[S, H]``, used_token ``[S]`` or None) -> ``(l_aux=0, capacity, E, indices int32 [k, S],
    locations int32 [k, S], gates fp32 [k, S], exp_counts int64 [E])``; ``indices`` is -1 for unused tokens.
    """

    def __init__(self, wg: torch.nn.Linear, k: int, bias_update_rate: float, normalize_topk: bool):
        super().__init__()
        self.wg, self.k = wg, k
        self.bias_update_rate, self.normalize_topk = bias_update_rate, normalize_topk
        self.register_buffer("expert_bias", torch.zeros(wg.out_features, dtype=torch.float32))
        self.ep_group = None
        self.bias_group = None  # the ranks that replicate this gate (None: the whole world)
        self.wall_clock_breakdown, self.gate_time = False, 0.0

    @classmethod
    def from_topk_gate(cls, gate, gating_config, bias_group=None) -> "SigmoidTopKGate":
        """``bias_group``: the ranks that replicate this gate, whose loads the bias update sums
        (the data-parallel group; None: the whole world)."""
        new = cls(gate.wg, gate.k, gating_config.bias_update_rate, gating_config.normalize_topk)
        new.ep_group = gate.ep_group
        new.bias_group = bias_group
        new.train(gate.training)
        return new

    def _set_ep_group(self, ep_group) -> None:
        self.ep_group = ep_group

    def forward(self, x: torch.Tensor, used_token=None, sparse_routes: bool = True, use_tutel: bool = False):
        num_experts = self.wg.out_features
        scores = torch.sigmoid(F.linear(x.float(), self.wg.weight.float()))
        _, chosen = torch.topk(scores.detach() + self.expert_bias, self.k, dim=1)
        gates = scores.gather(1, chosen)
        if self.normalize_topk:
            gates = gates / gates.sum(dim=1, keepdim=True).clamp_min(torch.finfo(gates.dtype).eps)
        if used_token is not None:
            keep = used_token.reshape(-1, 1) > 0
            chosen = torch.where(keep, chosen, torch.full_like(chosen, -1))
            gates = gates * keep
        taken = chosen[chosen >= 0]
        exp_counts = torch.bincount(taken, minlength=num_experts).detach()
        if self.training and self.bias_update_rate > 0:
            self._update_bias(exp_counts)
        capacity = exp_counts.max() if exp_counts.numel() else torch.zeros((), dtype=torch.long)
        locations = torch.zeros_like(chosen, dtype=torch.int32).t().contiguous()
        return (scores.new_zeros(()), capacity, num_experts, chosen.t().contiguous().to(torch.int32), locations,
                gates.t().contiguous(), exp_counts)

    @torch.no_grad()
    def _update_bias(self, exp_counts: torch.Tensor) -> None:
        load = exp_counts.to(torch.float32)
        if dist.is_initialized():
            dist.all_reduce(load, group=self.bias_group)
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)

