"""Multi-rank cases shared by the layer tests: run inside `run_distributed` workers.

Every case builds DeepSpeed's own MoE (dropless, deterministic gating) and the FEPLB layer with
the same weights, skews the gate so that one rank's experts are hot, and compares outputs and
all gradients.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE as DeepSpeedMoE

import deepspeed_feplb

HIDDEN = 16
TOKENS = 48


def make_expert(hidden: int = HIDDEN) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(hidden, 2 * hidden), torch.nn.GELU(), torch.nn.Linear(2 * hidden, hidden))


def skew_gate(gate_weight: torch.Tensor, strength: float = 3.0) -> None:
    """Zipf-like skew for inputs with a positive mean; the hot experts are spread over the ranks."""
    with torch.no_grad():
        experts, hidden = gate_weight.shape
        popularity = (1.0 / torch.arange(1, experts + 1)).sqrt()
        order = torch.randperm(experts, generator=torch.Generator().manual_seed(7))
        gate_weight.mul_(0.3)
        gate_weight += strength / hidden * popularity[order][:, None]


def build_pair(num_experts: int, ep_size: int, k: int, feplb: dict, seed: int = 0):
    """(DeepSpeed MoE, FEPLB MoE) with identical weights; the gate favours the first rank's experts."""
    torch.manual_seed(seed)
    kwargs = dict(hidden_size=HIDDEN, expert=make_expert(), num_experts=num_experts, ep_size=ep_size, k=k,
                  min_capacity=0, drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False)
    reference = DeepSpeedMoE(**kwargs)
    skew_gate(reference.deepspeed_moe.gate.wg.weight)
    ours = deepspeed_feplb.MoE(**kwargs, feplb_config=feplb)
    ours.load_state_dict(reference.state_dict())
    for layer in (reference, ours):
        layer.set_deepspeed_parallelism()
    return reference, ours


def run_layer(layer, x: torch.Tensor, out_weight: torch.Tensor):
    x = x.clone().requires_grad_(True)
    out, l_aux, _ = layer(x)
    (out * out_weight).sum().add(l_aux).backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), x.grad.clone(), grads


def rank_inputs(seed: int):
    g = torch.Generator().manual_seed(1000 + seed * 97 + dist.get_rank())
    x = torch.randn(TOKENS, HIDDEN, generator=g) + 1.0
    out_weight = torch.randn(TOKENS, HIDDEN, generator=g)
    return x, out_weight


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def equivalence_case(ep_size: int, domain: int, k: int, num_experts: int = 16, dynamic: int = 2) -> dict:
    """Forward+backward of both layers on this rank; returns errors and FEPLB stats."""
    feplb = {"nvlink_domain_size": domain, "dynamic_experts_per_rank": dynamic, "chunk_align_tokens": 1,
             "max_helpers_per_expert": 4}
    reference, ours = build_pair(num_experts, ep_size, k, feplb, seed=k)
    x, w = rank_inputs(k)
    ref_out, ref_dx, ref_grads = run_layer(reference, x, w)
    out, dx, grads = run_layer(ours, x, w)
    assert set(grads) == set(ref_grads), (sorted(grads), sorted(ref_grads))
    errors = {"output": relative_error(out, ref_out), "input_grad": relative_error(dx, ref_dx)}
    errors.update({name: relative_error(grads[name], ref_grads[name]) for name in ref_grads})
    return {"errors": errors, "stats": copy.deepcopy(ours.feplb_stats)}


class TinyMoEModel(torch.nn.Module):
    """Dense -> MoE -> dense, returning (prediction, l_aux)."""

    def __init__(self, moe: torch.nn.Module):
        super().__init__()
        self.inp, self.moe, self.out = torch.nn.Linear(HIDDEN, HIDDEN), moe, torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        y, l_aux, _ = self.moe(self.inp(x) + 1.0)
        return self.out(y), l_aux


def ds_config(zero_stage: int, feplb: dict) -> dict:
    world = dist.get_world_size()
    return {"train_batch_size": world, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
            "zero_optimization": {"stage": zero_stage}, "feplb": feplb}


def param_groups(model):
    """ZeRO 1/2 need the expert parameters in their own 'moe' groups, as in DeepSpeed's tests."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    return split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "p"})


def training_case(zero_stage: int, ep_size: int = 2, domain: int = 2, k: int = 2, steps: int = 3) -> dict:
    """Train DeepSpeed's MoE and FEPLB (through deepspeed_feplb.initialize) side by side."""
    import deepspeed

    feplb = {"nvlink_domain_size": domain, "dynamic_experts_per_rank": 2, "chunk_align_tokens": 1}

    def make_model():  # twice from one seed: deepcopy would lose DeepSpeed's expert-param marks
        torch.manual_seed(11)
        model = TinyMoEModel(DeepSpeedMoE(hidden_size=HIDDEN, expert=make_expert(), num_experts=8, ep_size=ep_size,
                                          k=k, min_capacity=0, drop_tokens=False, use_rts=False,
                                          top2_2nd_expert_sampling=False))
        skew_gate(model.moe.deepspeed_moe.gate.wg.weight)
        return model

    reference_model, feplb_model = make_model(), make_model()
    reference, *_ = deepspeed.initialize(model=reference_model, model_parameters=param_groups(reference_model),
                                         config=ds_config(zero_stage, feplb))
    ours, *_ = deepspeed_feplb.initialize(model=feplb_model, model_parameters=param_groups(feplb_model),
                                          config=ds_config(zero_stage, feplb))
    assert isinstance(ours.module.moe, deepspeed_feplb.MoE)
    losses, migrated = {"reference": [], "feplb": []}, 0
    for step in range(steps):
        x, target = rank_inputs(100 + step)
        for name, engine in (("reference", reference), ("feplb", ours)):
            prediction, l_aux = engine(x)
            loss = ((prediction - target)**2).mean() + 0.01 * l_aux
            engine.backward(loss)
            engine.step()
            losses[name].append(loss.item())
        migrated += ours.module.moe.feplb_stats["migrated_tokens"]
    params = {n: relative_error(p.detach(), dict(reference.module.named_parameters())[n].detach())
              for n, p in ours.module.named_parameters()}
    return {"losses": losses, "param_errors": params, "migrated": migrated}
