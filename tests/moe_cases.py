"""Multi-rank cases shared by the layer tests: run inside `run_distributed` workers.

Every case builds DeepSpeed's own MoE (dropless, deterministic gating) and the FEPLB layer with
the same weights, skews the gate so that one rank's experts are hot, and compares outputs and
all gradients.
"""
from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
import time
import warnings
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE as DeepSpeedMoE

import deepspeed_feplb
from deepspeed_feplb.migrate.resident import copy_bytes
from deepspeed_feplb.segments import process_alive

HIDDEN = 16
TOKENS = 48
# helpers serve a home's chunks in parts of 2 rows or more (up to `serve_parts`, 4), so that these
# small layers' equivalence covers results returned part by part (at the default 1024 rows only
# far larger micro-batches are split)
IN_PARTS = {"serve_part_rows": 2}


class UnknownExpert(torch.nn.Sequential):
    """The same MLP under a class FEPLB does not recognise (`grouped_mlp.StackedMLP.of`): the layer
    computes it one call per expert, the path every other expert module takes."""


def make_expert(hidden: int = HIDDEN, known: bool = True) -> torch.nn.Module:
    """Linear-GELU-Linear: a known MLP (grouped compute), or with ``known=False`` an `UnknownExpert`."""
    cls = torch.nn.Sequential if known else UnknownExpert
    return cls(torch.nn.Linear(hidden, 2 * hidden), torch.nn.GELU(), torch.nn.Linear(2 * hidden, hidden))


def skew_gate(gate_weight: torch.Tensor, strength: float = 3.0, spread: bool = True) -> None:
    """Zipf-like skew for inputs with a positive mean; hot experts spread over the ranks, or the
    first rank's experts hottest (``spread=False``)."""
    with torch.no_grad():
        experts, hidden = gate_weight.shape
        popularity = (1.0 / torch.arange(1, experts + 1)).sqrt()
        order = torch.randperm(experts, generator=torch.Generator().manual_seed(7)) if spread else torch.arange(experts)
        gate_weight.mul_(0.3)
        gate_weight += strength / hidden * popularity[order][:, None]


def diversify_experts(moe: torch.nn.Module) -> None:
    """Give every global expert its own weights (DeepSpeed deep-copies one expert into all slots,
    which would hide a token computed by the wrong expert)."""
    layer = moe.deepspeed_moe
    ep_rank = dist.get_rank() % layer.ep_size  # EP groups are consecutive ranks
    with torch.no_grad():
        for i, expert in enumerate(layer.experts.deepspeed_experts):
            g = torch.Generator().manual_seed(10_000 + ep_rank * layer.num_local_experts + i)
            for p in expert.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def build_pair(num_experts: int, ep_size: int, k: int, feplb: dict, seed: int = 0):
    """(DeepSpeed MoE, FEPLB MoE) with identical weights; the gate favours the first rank's experts."""
    torch.manual_seed(seed)
    kwargs = dict(hidden_size=HIDDEN, expert=make_expert(), num_experts=num_experts, ep_size=ep_size, k=k,
                  min_capacity=0, drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False)
    reference = DeepSpeedMoE(**kwargs)
    skew_gate(reference.deepspeed_moe.gate.wg.weight)
    diversify_experts(reference)
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


@contextlib.contextmanager
def published_dynamic():
    """Yields a list that receives (rows, the domain's mean rows, dynamic experts) of every micro-
    batch this rank balances, as it publishes them to its domain's scheduler."""
    from deepspeed_feplb.balanced import BalancedMicroBatch
    published, original = [], BalancedMicroBatch.publish

    def publish(self):
        original(self)
        published.append((int(self.counts.sum()), self.domain_mean, list(self.dynamic)))

    BalancedMicroBatch.publish = publish
    try:
        yield published
    finally:
        BalancedMicroBatch.publish = original


def equivalence_case(ep_size: int, domain: int, k: int, num_experts: int = 16, dynamic: int = 2,
                     ce_budget="auto") -> dict:
    """Forward+backward of both layers on this rank; returns errors, FEPLB stats and what the rank
    published (`published_dynamic`)."""
    feplb = {"nvlink_domain_size": domain, "dynamic_experts_per_rank": dynamic, "chunk_align_tokens": 1,
             "fixed_costs": "ignore", "max_helpers_per_expert": 4, "ce_budget": ce_budget, **IN_PARTS}
    reference, ours = build_pair(num_experts, ep_size, k, feplb, seed=k)
    x, w = rank_inputs(k)
    ref_out, ref_dx, ref_grads = run_layer(reference, x, w)
    with published_dynamic() as published:
        out, dx, grads = run_layer(ours, x, w)
    assert set(grads) == set(ref_grads), (sorted(grads), sorted(ref_grads))
    errors = {"output": relative_error(out, ref_out), "input_grad": relative_error(dx, ref_dx)}
    errors.update({name: relative_error(grads[name], ref_grads[name]) for name in ref_grads})
    return {"errors": errors, "stats": copy.deepcopy(ours.feplb_stats), "published": published}


class TinyMoEModel(torch.nn.Module):
    """Dense -> MoE -> dense, returning (prediction, l_aux); ``recompute``: the MoE layer runs under
    non-reentrant activation checkpointing (its forward runs again in the backward); ``twice``: the
    MoE layer runs a second time on its own output (one layer, two uses in one forward)."""

    def __init__(self, moe: torch.nn.Module, recompute: bool = False, twice: bool = False):
        super().__init__()
        self.inp, self.moe, self.out = torch.nn.Linear(HIDDEN, HIDDEN), moe, torch.nn.Linear(HIDDEN, HIDDEN)
        self.recompute, self.twice = recompute, twice

    def forward(self, x):
        h = self.inp(x) + 1.0
        if self.recompute:
            from torch.utils.checkpoint import checkpoint
            y, l_aux = checkpoint(lambda t: self.moe(t)[:2], h, use_reentrant=False)
        else:
            y, l_aux, _ = self.moe(h)
        if self.twice:
            y, again, _ = self.moe(0.5 * y + h)
            l_aux = l_aux + again
        return self.out(y), l_aux


def train_step(engine, x: torch.Tensor, target: torch.Tensor, backward: str = "engine") -> float:
    """One micro-batch of TinyMoEModel through ``engine``: forward, backward, step; the loss.
    ``backward``: "engine" (``engine.backward``) or "direct" (the loss's own ``loss.backward()``, on
    the loss scaled as ``engine.backward`` would)."""
    prediction, l_aux = engine(x)
    loss = ((prediction - target)**2).mean() + 0.01 * l_aux
    if backward == "direct":
        (loss / engine.gradient_accumulation_steps()).backward()
    else:
        engine.backward(loss)
    engine.step()
    return loss.item()


OPTIMIZERS = {"adam": {"type": "Adam", "params": {"lr": 1e-2, "eps": 1e-6, "torch_adam": True}},
              "sgd-momentum": {"type": "SGD", "params": {"lr": 1e-2, "momentum": 0.9}},
              "sgd": {"type": "SGD", "params": {"lr": 1e-2}}}


def ds_config(zero_stage: int, feplb: dict, optimizer: str = "adam") -> dict:
    """``optimizer``: "adam" (torch's), "sgd-momentum" or "sgd" (stateless)."""
    world = dist.get_world_size()
    # eps 1e-6, not Adam's 1e-8: an expert's first non-zero gradient moves each weight by about
    # lr * g / (|g| + eps), so with eps 1e-8 a gradient entry near 1e-9 turns fp32 rounding (a
    # split expert sums its weight-gradient in another order than one GEMM does) into a 1e-4
    # relative weight difference; the gradients themselves agree to ~1e-7 (see the one-step tests)
    return {"train_batch_size": world, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000,
            "optimizer": OPTIMIZERS[optimizer],
            "zero_optimization": {"stage": zero_stage}, "zero_allow_untested_optimizer": True, "feplb": feplb}


def param_groups(model):
    """ZeRO 1/2 need the expert parameters in their own 'moe' groups, as in DeepSpeed's tests."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    return split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "p"})


def training_case(zero_stage: int, ep_size: int = 2, domain: int = 2, k: int = 2, steps: int = 3,
                  dynamic: int = 2) -> dict:
    """Train DeepSpeed's MoE and FEPLB (through deepspeed_feplb.initialize) side by side."""
    import deepspeed

    feplb = {"nvlink_domain_size": domain, "dynamic_experts_per_rank": dynamic, "chunk_align_tokens": 1,
             "fixed_costs": "ignore", **IN_PARTS}

    def make_model():  # twice from one seed: deepcopy would lose DeepSpeed's expert-param marks
        torch.manual_seed(11)
        model = TinyMoEModel(DeepSpeedMoE(hidden_size=HIDDEN, expert=make_expert(), num_experts=8, ep_size=ep_size,
                                          k=k, min_capacity=0, drop_tokens=False, use_rts=False,
                                          top2_2nd_expert_sampling=False))
        skew_gate(model.moe.deepspeed_moe.gate.wg.weight, spread=False)
        diversify_experts(model.moe)
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
            losses[name].append(train_step(engine, x, target))
        migrated += ours.module.moe.feplb_stats["migrated_tokens"]
    params = {n: relative_error(p.detach(), dict(reference.module.named_parameters())[n].detach())
              for n, p in ours.module.named_parameters()}
    return {"losses": losses, "param_errors": params, "migrated": migrated}


class CheckpointedMoEModel(TinyMoEModel):
    """`TinyMoEModel` whose MoE layer runs inside ``torch.utils.checkpoint``."""

    use_reentrant = False

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        y, l_aux = checkpoint(lambda t: self.moe(t)[:2], self.inp(x) + 1.0, use_reentrant=self.use_reentrant)
        return self.out(y), l_aux


def accumulation_case(zero_stage: int, residency: str, ep_size: int, gas: int = 4, steps: int = 3,
                      max_resident: int = 8, checkpointing: str | None = None, write: str = "no_grad",
                      budget_copies: float | None = None, evaluate: bool = False, extra: dict | None = None) -> dict:
    """Train DeepSpeed's MoE and FEPLB side by side with ``gas`` micro-batches per optimizer step.

    Between steps, and once between two micro-batches of a step, both models' expert weights are
    changed in place the same way (in the step: ``write`` says how: "no_grad" in place under
    ``torch.no_grad()``, "data" through ``p.data`` then declared (`deepspeed_feplb.weights_changed`),
    "data-undeclared" not, "load_state_dict" a scaled state dict): a
    helper that computed with a copy it kept from before the change would make FEPLB's losses and
    weights differ. ``budget_copies``: ``feplb.resident_budget_mb`` as that many kept copies. With
    ``evaluate``, each step is followed by an evaluation forward on other weights swapped in and out
    through ``p.data`` (a kept copy of them must not outlive it). ``extra``: more of the ``"feplb"``
    section. Returns
    the losses, the parameter errors, FEPLB's weight traffic summed over every micro-batch (its
    stats, domain-wide), the most kept-copy bytes any rank held after a micro-batch and, per
    balanced micro-batch, (its index in the step, the later micro-batches its plan was priced for)."""
    import deepspeed

    from deepspeed_feplb.balanced import BalancedMicroBatch

    world = dist.get_world_size()
    feplb = {"nvlink_domain_size": ep_size, "dynamic_experts_per_rank": 2, "chunk_align_tokens": 1,
             "fixed_costs": "ignore",
             "weight_residency": residency, "max_resident_experts": max_resident, **IN_PARTS, **(extra or {})}
    one_copy = copy_bytes(make_expert().parameters())
    if budget_copies is not None:
        feplb["resident_budget_mb"] = budget_copies * one_copy / 2**20

    def make_model():
        torch.manual_seed(11)
        model_cls = TinyMoEModel if checkpointing is None else CheckpointedMoEModel
        model = model_cls(DeepSpeedMoE(hidden_size=HIDDEN, expert=make_expert(), num_experts=4 * ep_size,
                                       ep_size=ep_size, k=2, min_capacity=0, drop_tokens=False, use_rts=False,
                                       top2_2nd_expert_sampling=False))
        model.use_reentrant = checkpointing == "reentrant"
        skew_gate(model.moe.deepspeed_moe.gate.wg.weight, spread=False)
        diversify_experts(model.moe)
        return model

    config = {**ds_config(zero_stage, feplb), "train_batch_size": world * gas, "gradient_accumulation_steps": gas}
    models = {"reference": make_model(), "feplb": make_model()}
    reference, *_ = deepspeed.initialize(model=models["reference"], model_parameters=param_groups(models["reference"]),
                                         config=config)
    ours, *_ = deepspeed_feplb.initialize(model=models["feplb"], model_parameters=param_groups(models["feplb"]),
                                          config=config)
    engines = {"reference": reference, "feplb": ours}

    def perturb(scale: float, write: str = "no_grad"):
        for engine in engines.values():
            if write == "load_state_dict":
                state = engine.module.state_dict()
                engine.module.load_state_dict({k: v * scale if ".experts." in k else v for k, v in state.items()})
                continue
            for expert in engine.module.moe.deepspeed_moe.experts.deepspeed_experts:
                for p in expert.parameters():
                    if write.startswith("data"):
                        p.data.mul_(scale)
                    else:
                        with torch.no_grad():
                            p.mul_(scale)
        if write == "data":
            deepspeed_feplb.weights_changed(ours)

    losses = {name: [] for name in engines}
    traffic = {"weight_copies": 0, "resident_hits": 0, "flushed_copies": 0, "moves": 0}
    most_kept = 0
    priced, now = [], {}
    constraints = BalancedMicroBatch._constraints

    def seen(self):
        out = constraints(self)
        priced.append((now["micro"], out.later_micro_batches))
        return out

    BalancedMicroBatch._constraints = seen
    for step in range(steps):
        for micro in range(gas):
            now["micro"] = micro
            x, target = rank_inputs(100 + step * gas + micro)
            if step == 1 and micro == 2:
                perturb(0.97, write)  # inside a step: kept copies of the changed experts are stale now
            for name, engine in engines.items():
                losses[name].append(train_step(engine, x, target))
            stats = ours.module.moe.feplb_stats
            for key in traffic:
                traffic[key] += stats[key]
            domain = ours.module.moe.deepspeed_moe.stage.domain
            if domain is not None:
                most_kept = max(most_kept, int(domain.kept_bytes.held.max()))
        perturb(1.02)  # between steps
        if evaluate:
            for engine in engines.values():
                experts = [p for e in engine.module.moe.deepspeed_moe.experts.deepspeed_experts for p in e.parameters()]
                saved = [p.detach().clone() for p in experts]
                for p in experts:
                    p.data.mul_(0.9)
                with torch.no_grad():
                    engine(rank_inputs(999)[0])
                for p, kept in zip(experts, saved):
                    p.data.copy_(kept)
    BalancedMicroBatch._constraints = constraints
    params = {n: relative_error(p.detach(), dict(reference.module.named_parameters())[n].detach())
              for n, p in ours.module.named_parameters()}
    stage = ours.module.moe.deepspeed_moe.stage
    domain = stage.domain
    return {"losses": losses, "param_errors": params, "traffic": traffic, "most_kept_bytes": most_kept,
            "refreshed": stage.residency.refreshed if stage.residency is not None else 0,
            "copy_bytes": one_copy, "message_us": domain.transport.message_us if domain is not None else None,
            "priced": priced}


def contiguous_expert_inputs(experts) -> None:
    """Make DeepSpeed's `Experts` module ``experts`` hand each expert its rows as a contiguous tensor.

    DeepSpeed passes each expert a non-contiguous ``[ep_size, capacity, H]`` chunk whenever a rank
    holds several experts and ``ep_size > 1``; for such an input ``torch.nn.functional.linear`` runs
    ``matmul`` and then adds the bias (two bf16 roundings) instead of the fused ``addmm`` (one), as
    DeepSpeed itself does with ``ep_size=1``. FEPLB passes contiguous rows. With this, the two round alike."""
    def forward(inputs: torch.Tensor) -> torch.Tensor:
        outputs = []
        for chunk, expert in zip(inputs.chunk(experts.num_local_experts, dim=1), experts.deepspeed_experts):
            out = expert(chunk.contiguous())
            outputs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outputs, dim=1)
    experts.forward = forward


def equivalence_variant(ep_size: int = 2, k: int = 2, dtype=torch.float32, residual: bool = False,
                        training: bool = True, feplb: dict | None = None, reference_drop_tokens: bool = False,
                        contiguous_reference: bool = False, known_expert: bool = True) -> dict:
    """One forward (and backward when training) of DeepSpeed's MoE and ours; relative errors (and
    ``bitwise``: whether output, input gradient and every gradient are bit-equal). With
    ``contiguous_reference`` DeepSpeed's experts get contiguous rows (`contiguous_expert_inputs`)."""
    feplb = {"dynamic_experts_per_rank": 2, "chunk_align_tokens": 1, "fixed_costs": "ignore", **IN_PARTS,
             **(feplb or {})}
    torch.manual_seed(5)
    kwargs = dict(hidden_size=HIDDEN, num_experts=8, ep_size=ep_size, k=k, min_capacity=0, use_residual=residual,
                  use_rts=False, top2_2nd_expert_sampling=False, drop_tokens=reference_drop_tokens)
    # separate expert modules: with use_residual the layer keeps the passed module as its `mlp`
    reference = DeepSpeedMoE(expert=make_expert(), **kwargs)
    skew_gate(reference.deepspeed_moe.gate.wg.weight, spread=False)
    diversify_experts(reference)
    ours = deepspeed_feplb.MoE(expert=make_expert(known=known_expert), **kwargs, feplb_config=feplb)
    ours.load_state_dict(reference.state_dict())
    if contiguous_reference:
        contiguous_expert_inputs(reference.deepspeed_moe.experts)
    for layer in (reference, ours):
        layer.set_deepspeed_parallelism()
        layer.to(dtype).train(training)
    x, w = rank_inputs(3)
    bitwise = None
    x, w = x.to(dtype), w.to(dtype)
    if training:
        ref_out, ref_dx, ref_grads = run_layer(reference, x, w)
        out, dx, grads = run_layer(ours, x, w)
        errors = {"output": relative_error(out.float(), ref_out.float()),
                  "input_grad": relative_error(dx.float(), ref_dx.float())}
        errors.update({n: relative_error(grads[n].float(), ref_grads[n].float()) for n in ref_grads})
        bitwise = (torch.equal(out, ref_out) and torch.equal(dx, ref_dx)
                   and all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads))
    else:
        with torch.no_grad():
            errors = {"output": relative_error(ours(x)[0].float(), reference(x)[0].float())}
    return {"errors": errors, "stats": copy.deepcopy(ours.feplb_stats), "bitwise": bitwise, "keys_equal":
            list(ours.state_dict()) == list(reference.state_dict())}


def plain_initialize_case() -> dict:
    """A plain deepspeed.initialize (no deepspeed_feplb.initialize): the layer finds the "feplb" section."""
    import deepspeed

    torch.manual_seed(1)
    moe = deepspeed_feplb.MoE(HIDDEN, make_expert(), num_experts=4, ep_size=2, k=1, min_capacity=0, drop_tokens=False)
    model = TinyMoEModel(moe)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model),
                                      config=ds_config(0, {"dynamic_experts_per_rank": 1, "max_helpers_per_expert": 1}))
    x, target = rank_inputs(0)
    prediction, _ = engine(x)
    engine.backward(((prediction - target)**2).mean())
    engine.step()
    config = moe.deepspeed_moe.feplb_config
    return {"D": config.dynamic_experts_per_rank, "helpers": config.max_helpers_per_expert,
            "stats": copy.deepcopy(moe.feplb_stats)}


def sigmoid_gating_case() -> dict:
    """Sigmoid top-k with aux-free bias: migration (D=2) equals no migration (D=0); the bias moves."""
    results = {}
    for dynamic in (2, 0):
        torch.manual_seed(9)
        layer = deepspeed_feplb.MoE(HIDDEN, make_expert(), num_experts=8, ep_size=2, k=2, min_capacity=0,
                                    feplb_config={"dynamic_experts_per_rank": dynamic, "chunk_align_tokens": 1,
                                                  "fixed_costs": "ignore",
                                                  "gating": {"score": "sigmoid", "bias_update_rate": 0.01}})
        skew_gate(layer.deepspeed_moe.gate.wg.weight, spread=False)
        diversify_experts(layer)
        layer.set_deepspeed_parallelism()
        x, w = rank_inputs(4)
        results[dynamic] = run_layer(layer, x, w) + (layer.deepspeed_moe.gate.expert_bias.clone(),
                                                     copy.deepcopy(layer.feplb_stats))
    (out, dx, grads, bias, stats), (ref_out, ref_dx, ref_grads, ref_bias, _) = results[2], results[0]
    errors = {"output": relative_error(out, ref_out), "input_grad": relative_error(dx, ref_dx)}
    errors.update({n: relative_error(grads[n], ref_grads[n]) for n in ref_grads})
    return {"errors": errors, "stats": stats, "bias_moved": bool(bias.abs().sum() > 0),
            "bias_equal": bool(torch.equal(bias, ref_bias))}


def scheduler_fault_case() -> dict:
    """Kill, then stall (SIGSTOP), the scheduler process between steps; every step stays exact."""
    import signal
    import time
    import warnings

    reference, ours = build_pair(8, 2, 2, {"dynamic_experts_per_rank": 2, "chunk_align_tokens": 1,
                                           "fixed_costs": "ignore",
                                           "scheduler": {"start_after_steps": 0}}, seed=2)
    client = None
    result = {"errors": {}, "migrated": 0, "fallback_after_kill": False, "fallback_when_stalled": False,
              "restarted_after_kill": False, "restarted_after_stall": False, "recovered": False}

    def step(name):
        x, w = rank_inputs(len(result["errors"]))
        ref_out, ref_dx, ref_grads = run_layer(reference, x, w)
        out, dx, grads = run_layer(ours, x, w)
        result["errors"][name] = max([relative_error(out, ref_out), relative_error(dx, ref_dx)] +
                                     [relative_error(grads[n], ref_grads[n]) for n in ref_grads])
        result["migrated"] += ours.feplb_stats["migrated_tokens"]
        for p in list(reference.parameters()) + list(ours.parameters()):
            p.grad = None
        return ours.feplb_stats

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("deepspeed_feplb").addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step("warm-up")
        client = ours.deepspeed_moe.stage.domain.scheduler
        leader = client.process is not None
        first = _serving_pid(client) if leader else 0
        if leader:
            os.kill(first, signal.SIGKILL)
            client.process.wait()
        dist.barrier()
        result["fallback_after_kill"] = step("after kill")["fallback"]
        if leader:
            result["restarted_after_kill"] = client.process.pid != first
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not result["recovered"]:
            time.sleep(0.2)
            result["recovered"] = not step(f"recovering {len(result['errors'])}")["fallback"]
        dist.barrier()
        stalled = _serving_pid(client) if leader else 0
        if leader:
            os.kill(stalled, signal.SIGSTOP)
        dist.barrier()
        result["fallback_when_stalled"] = step("stalled")["fallback"]
        for i in range(client.STALLED_AFTER):
            step(f"stalled {i}")
        if leader:
            result["restarted_after_stall"] = client.process.pid != stalled and not process_alive(stalled)
        result["warnings"] = [str(w.message) for w in caught if "scheduler" in str(w.message)]
    logging.getLogger("deepspeed_feplb").removeHandler(handler)
    result["said"] = said
    return result


def _serving_pid(client, timeout: float = 60.0) -> int:
    """The scheduler's pid once it runs; never 0 or -1 (os.kill(-1, ...) signals every process we own)."""
    import time

    deadline = time.monotonic() + timeout
    while client.scheduler_pid() <= 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = client.scheduler_pid()
    assert pid > 0, f"the scheduler process did not start within {timeout:g} s"
    return pid




class FixedRouteGate(torch.nn.Module):
    """A custom router that sends every token to fixed experts (possibly out of range), for bad-input tests."""

    def __init__(self, gate, experts: list[int]):
        super().__init__()
        self.wg, self.experts = gate.wg, experts
        self.ep_group = gate.ep_group

    def forward(self, x, used_token=None, sparse_routes=True, use_tutel=False):
        k, tokens = len(self.experts), x.shape[0]
        logits = torch.nn.functional.linear(x.float(), self.wg.weight.float())
        indices = torch.tensor(self.experts, dtype=torch.int32)[:, None].expand(k, tokens).contiguous()
        safe = indices.long().clamp(0, logits.shape[1] - 1)
        gates = torch.softmax(logits, dim=1).gather(1, safe.t()).t()
        counts = torch.bincount(safe.reshape(-1), minlength=logits.shape[1])
        # slot of each route in its expert's capacity buffer, routes counted k-major as DeepSpeed does
        onehot = torch.nn.functional.one_hot(safe.reshape(-1), logits.shape[1])
        locations = (onehot.cumsum(0) - 1).gather(1, safe.reshape(-1, 1)).view(k, tokens).to(torch.int32)
        return logits.new_zeros(()), counts.max(), logits.shape[1], indices, locations, gates, counts


def bad_input_case(kind: str):
    """Run one bad-input scenario on this rank; returns errors vs DeepSpeed, or the exception text."""
    hidden = 5 if kind == "odd_shapes" else HIDDEN
    tokens = {"odd_shapes": 1, "zero_tokens": 0 if dist.get_rank() == 1 else TOKENS}.get(kind, TOKENS)
    torch.manual_seed(3)
    kwargs = dict(hidden_size=hidden, num_experts=4, ep_size=2, k=2 if kind != "one_expert" else 1, min_capacity=0,
                  use_rts=False, top2_2nd_expert_sampling=False, drop_tokens=False)
    reference = DeepSpeedMoE(expert=make_expert(hidden), **kwargs)
    ours = deepspeed_feplb.MoE(expert=make_expert(hidden), **kwargs,
                               feplb_config={"dynamic_experts_per_rank": 1, "chunk_align_tokens": 1,
                                             "fixed_costs": "ignore"})
    skew_gate(reference.deepspeed_moe.gate.wg.weight, strength=6.0, spread=False)
    diversify_experts(reference)
    ours.load_state_dict(reference.state_dict())
    for layer in (reference, ours):
        layer.set_deepspeed_parallelism()
    if kind == "out_of_range":
        ours.deepspeed_moe.gate = FixedRouteGate(ours.deepspeed_moe.gate, [0, 7 if dist.get_rank() == 1 else 1])
    if kind == "one_expert":
        for layer in (reference, ours):
            layer.deepspeed_moe.gate = FixedRouteGate(layer.deepspeed_moe.gate, [1])
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(tokens, hidden, generator=g) + 1.0
    if kind == "nan_hidden":
        x[3, 2] = float("nan")
        x[5, 0] = float("inf")
    w = torch.randn(tokens, hidden, generator=g)
    if kind == "out_of_range":
        try:
            run_layer(ours, x, w)
        except ValueError as error:
            return {"raised": str(error)}
        return {"raised": None}
    ref_out, ref_dx, ref_grads = run_layer(reference, x, w)
    out, dx, grads = run_layer(ours, x, w)
    if kind == "nan_hidden":
        same = torch.equal(out.isnan(), ref_out.isnan())
        return {"nan_pattern_equal": same, "errors": {"output": relative_error(out.nan_to_num(), ref_out.nan_to_num())},
                "stats": copy.deepcopy(ours.feplb_stats)}
    errors = {"output": relative_error(out, ref_out) if out.numel() else 0.0}
    errors.update({n: relative_error(grads[n], ref_grads[n]) for n in ref_grads if ref_grads[n].norm() > 0})
    return {"errors": errors, "stats": copy.deepcopy(ours.feplb_stats), "shape": tuple(out.shape)}


def checkpointed_case(use_reentrant: bool, ep_size: int = 2, k: int = 2) -> dict:
    """Forward+backward of DeepSpeed's MoE and FEPLB's, each inside ``torch.utils.checkpoint``
    (the recompute in backward re-runs the whole layer, collectives and phase 2 included);
    returns the errors and how many layer forwards FEPLB's stats saw."""
    from torch.utils.checkpoint import checkpoint

    feplb = {"nvlink_domain_size": ep_size, "dynamic_experts_per_rank": 2, "chunk_align_tokens": 1,
             "fixed_costs": "ignore",
             "max_helpers_per_expert": 4}
    from deepspeed_feplb.integration.monitor import StatsCollector

    reference, ours = build_pair(16, ep_size, k, feplb, seed=k)
    ours.train()
    collector = StatsCollector(ours)
    x, w = rank_inputs(k)
    results = []
    for layer in (reference, ours):
        xi = x.clone().requires_grad_(True)
        out = checkpoint(lambda t, layer=layer: layer(t)[0], xi, use_reentrant=use_reentrant)
        (out * w).sum().backward()
        results.append((out.detach(), xi.grad.clone(), {n: p.grad.clone() for n, p in layer.named_parameters()
                                                          if p.grad is not None}))
    (ref_out, ref_dx, ref_grads), (got_out, got_dx, got_grads) = results
    errors = {"output": relative_error(got_out, ref_out), "input_grad": relative_error(got_dx, ref_dx)}
    errors.update({n: relative_error(got_grads[n], ref_grads[n]) for n in ref_grads})
    return {"errors": errors, "migrated": int(ours.feplb_stats["migrated_tokens"]),
            "micro_batches_recorded": len(collector.take())}


def second_backward_case(ep_size: int = 2, k: int = 2) -> dict:
    """A balanced FEPLB layer's output back-propagated twice (``torch.autograd.grad`` with
    ``retain_graph``, then ``backward``): the first gives DeepSpeed's input gradient, the second is
    refused with an error that says why. Returns the first's error against DeepSpeed's MoE, the
    second's error message and whether rows moved."""
    feplb = {"nvlink_domain_size": ep_size, "dynamic_experts_per_rank": 2, "chunk_align_tokens": 1,
             "fixed_costs": "ignore", "max_helpers_per_expert": 4}
    reference, ours = build_pair(16, ep_size, k, feplb, seed=k)
    x, w = rank_inputs(k)
    grads = []
    for layer in (reference, ours):
        xi = x.clone().requires_grad_(True)
        out = layer(xi)[0]
        grads.append(torch.autograd.grad((out * w).sum(), xi, retain_graph=True)[0])
    try:
        (out * w).sum().backward()
        error = ""
    except RuntimeError as exc:
        error = str(exc)
    return {"input_grad_error": relative_error(grads[1], grads[0]), "error": error,
            "migrated": int(ours.feplb_stats["migrated_tokens"])}


def misuse_case(kind: str) -> dict:
    """One misuse on 2 ranks; returns this rank's error message (empty when nothing was raised).

    kind: "experts_differ" (8 experts on rank 0, 16 on rank 1), "row_bound_differs" (a
    ``max_rows_over_mean`` on rank 0 only, whose skip decisions would then differ), "batchnorm" (an expert with
    BatchNorm), "buffer_update" (an expert that counts its rows in a buffer), "plain_buffer" (a
    constant buffer: allowed)."""

    class Counting(torch.nn.Module):
        def __init__(self, update: bool):
            super().__init__()
            self.linear, self.update = torch.nn.Linear(HIDDEN, HIDDEN), update
            self.register_buffer("rows", torch.zeros(()))

        def forward(self, x):
            if self.update and self.training:
                self.rows += x.shape[0]
            return self.linear(x)

    rank = dist.get_rank()
    experts = 8 if kind != "experts_differ" or rank == 0 else 16
    expert = {"batchnorm": lambda: torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.BatchNorm1d(HIDDEN)),
              "buffer_update": lambda: Counting(True), "plain_buffer": lambda: Counting(False)}.get(kind, make_expert)()
    torch.manual_seed(0)
    layer = deepspeed_feplb.MoE(hidden_size=HIDDEN, expert=expert, num_experts=experts, ep_size=2, k=2, min_capacity=0,
                                drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False,
                                # fixed costs measured (the default): nothing is timed at the first
                                # forward, so nothing plans; a rank compiling the planner (cold numba
                                # cache) would outlast the short peer timeout and leave the next kind's
                                # collectives out of step
                                feplb_config={"nvlink_domain_size": 2, "dynamic_experts_per_rank": 2,
                                              "scheduler": {"peer_timeout_s": 3},
                                              "max_rows_over_mean": 1.05 if kind == "row_bound_differs" and rank == 0
                                              else None})
    layer.set_deepspeed_parallelism()
    x = rank_inputs(0)[0]
    try:
        if kind == "first_forward_missing" and rank == 1:
            time.sleep(8)  # never runs the layer (keeps the process group up while rank 0 waits)
            return {"error": ""}
        if kind == "extra_eval_forward" and rank == 0:
            with torch.no_grad():
                layer(x)
        layer(x)
    except (deepspeed_feplb.FEPLBConfigError, RuntimeError) as error:
        return {"error": str(error), "kind": type(error).__name__}
    return {"error": "", "kind": ""}


def _placed_model(num_experts: int, ep_size: int, learn_gate: bool = False, moe_class=DeepSpeedMoE):
    """TinyMoEModel whose gate sends most routes to the experts of the first node (the first half of
    the ranks), several of them about equally hot (so that moving experts can balance the nodes);
    the gate learns with ``learn_gate``, else its loads are stationary."""
    torch.manual_seed(11)
    model = TinyMoEModel(moe_class(hidden_size=HIDDEN, expert=make_expert(), num_experts=num_experts,
                                      ep_size=ep_size, k=2, min_capacity=0, drop_tokens=False, use_rts=False,
                                      top2_2nd_expert_sampling=False))
    with torch.no_grad():
        weight = model.moe.deepspeed_moe.gate.wg.weight
        hot = (torch.arange(num_experts) < num_experts // 2).float() * (1.0 + 0.15 * (torch.arange(num_experts) % 3))
        weight.mul_(0.2)
        weight += 2.0 / HIDDEN * hot[:, None]
    # a router that does not learn: its loads are stationary, so "balanced after placement" is
    # measurable on the steps that follow (drifting loads are the simulator's subject). Its input
    # layer is frozen with it: a learning input layer drifts in its last bits with the reduction
    # order (which differs from DeepSpeed's once experts move), and a near-tied row then picks
    # another expert, a discrete change no tolerance covers (seen with ATEN_CPU_CAPABILITY=default)
    for p in (weight, *model.inp.parameters()):
        p.requires_grad_(learn_gate)
    diversify_experts(model.moe)
    return model


def _placed_inputs(seed: int, tokens: int = 768):
    g = torch.Generator().manual_seed(5000 + seed * 97 + dist.get_rank())
    return torch.randn(tokens, HIDDEN, generator=g) + 1.0, torch.randn(tokens, HIDDEN, generator=g)


def _train(engines: dict, steps, on_step=None) -> dict:
    losses = {name: [] for name in engines}
    for step in steps:
        x, target = _placed_inputs(step)
        for name, engine in engines.items():
            losses[name].append(train_step(engine, x, target))
        if on_step is not None:
            on_step(step)
    return losses


def placement_case(zero_stage: int, steps: int = 20, domain: int = 2, interval: int = 2, settled: int = 6,
                   ep_size: int | None = None, experts_per_rank: int = 4, learn_gate: bool = False,
                   optimizer: str = "adam", gradient_clipping: float = 1.0, enabled=True, redundant=0,
                   free_bytes: Optional[dict] = None) -> dict:
    """Cross-node placement (``feplb.placement.enabled``: ``enabled``, ``redundant_experts_per_rank``:
    ``redundant``; ``free_bytes``: {global rank: the device memory `memory.device_free_bytes` says is
    free there, as if the experts were on a GPU, or None: host memory}) on ``world`` ranks as nodes of
    ``domain`` (``experts_per_rank``, the hot ones on the first node; a learning gate with
    ``learn_gate``, ``optimizer`` one of `OPTIMIZERS`):
    FEPLB with feplb.placement and DeepSpeed's MoE, fed the same logical experts, trained side by
    side. Returns both loss curves, the parameter errors with FEPLB's experts back in DeepSpeed's
    layout, the node loads of the last ``settled`` steps under
    DeepSpeed's placement and under FEPLB's final one, and the placement counters."""
    import deepspeed

    from deepspeed_feplb import memory
    from deepspeed_feplb.integration.expert_state import ModuleExperts
    from deepspeed_feplb.integration.placement_engine import placed_layers
    if free_bytes is not None:  # this process only: `run_distributed` starts a fresh one per rank
        memory.device_free_bytes = lambda device: free_bytes[dist.get_rank()]
    world = dist.get_world_size()
    ep_size = ep_size or world  # below the world size: expert-data-parallel replicas, which must place alike
    feplb = {"nvlink_domain_size": domain, "dynamic_experts_per_rank": 1 if domain > 1 else 0, "chunk_align_tokens": 1,
             "fixed_costs": "ignore",
             "placement": {"enabled": enabled, "interval_steps": interval, "history_decay": 0.5,
                           "redundant_experts_per_rank": redundant}}
    config = {**ds_config(zero_stage, feplb, optimizer), "gradient_clipping": gradient_clipping}
    num_experts = experts_per_rank * world
    models = {name: _placed_model(num_experts, ep_size, learn_gate) for name in ("reference", "feplb")}
    engines = {name: (deepspeed_feplb if name == "feplb" else deepspeed).initialize(
        model=model, model_parameters=param_groups(model), config=config)[0] for name, model in models.items()}
    ours = engines["feplb"]
    recent, placed = [], []  # loads of the settled steps, and node loads under the table each step used
    used = np.arange(num_experts)  # the slot -> expert table of the step being trained
    monitored = dict.fromkeys(("placement_refreshes", "placement_moved_experts", "placement_bytes"), 0)

    def on_step(step):
        nonlocal used
        placement = placed_layers(ours.module)[0].placement
        for key in monitored:
            monitored[key] += ours.feplb_monitor.last.get(key, 0)
        if step >= steps - settled:
            recent.append(placement.last_loads.sum(0))
            placed.append(placement.node_loads(recent[-1], used))
        used = placement.expert_at.copy()

    losses = _train(engines, range(steps), on_step)
    assert ours.feplb_stats is ours.feplb_monitor  # the collector's earlier name stays
    layer = placed_layers(ours.module)[0]
    placement = layer.placement
    loads = np.sum(recent, axis=0)
    nodes = ep_size // domain
    identity_nodes = np.bincount(np.arange(len(loads)) // (len(loads) // nodes), weights=loads, minlength=nodes)
    counters = {"refreshes": placement.refreshes, "moved_experts": placement.moved_experts,
                "replica_slots": placement.redundant,
                "moved_bytes": placement.moved_bytes, "expert_at": placement.expert_at.tolist()}
    params = [list(e.parameters()) for e in layer.experts.deepspeed_experts]
    reference = dict(engines["reference"].module.named_parameters())
    with placement.canonical(ModuleExperts(params, ours.optimizer)):
        errors = {n: relative_error(p.detach(), reference[n].detach()) for n, p in ours.module.named_parameters()}
    return {"losses": losses, "param_errors": errors, "identity_node_loads": identity_nodes.tolist(),
            "placed_node_loads": np.sum(placed, axis=0).tolist(), "expert_loads": loads.tolist(),
            **counters, "monitored": monitored, "bundle_bytes": placement.bundle_bytes}


def _one_hot_expert_model(num_experts: int, ep_size: int, hot: float = 0.5, learn_router: bool = False,
                          recompute: bool = False, twice: bool = False):
    """TinyMoEModel (top-1, ``recompute`` and ``twice`` as there) whose gate sends most tokens to expert 0 (``hot``
    raises its logit; 0.5: about 95% of all rows, far more than a node of 2 of 4 ranks should
    compute, which placement alone cannot split) and spreads the rest; the router and the layer
    before it are frozen unless ``learn_router``."""
    torch.manual_seed(11)
    model = TinyMoEModel(DeepSpeedMoE(hidden_size=HIDDEN, expert=make_expert(), num_experts=num_experts,
                                      ep_size=ep_size, k=1, min_capacity=0, drop_tokens=False, use_rts=False),
                         recompute, twice)
    with torch.no_grad():
        weight = model.moe.deepspeed_moe.gate.wg.weight
        weight.mul_(0.2)
        weight[0] += hot / HIDDEN
    # frozen, the router and its input layer give stationary loads, so "balanced once replicated"
    # is measurable on every micro-batch that follows
    for p in (weight, *model.inp.parameters()):
        p.requires_grad_(learn_router)
    diversify_experts(model.moe)
    return model


def replica_slots_case(zero_stage: int, steps: int = 12, gas: int = 2, redundant: int = 1,
                       learn_router: bool = False, recompute: bool = False, enabled: bool = True,
                       fixed_costs: str = "ignore", bucket: int | None = None, backward: str = "engine",
                       twice: bool = False) -> dict:
    """feplb.placement (``enabled``: homes may move; false: replicas alone, every expert keeping its
    home) with ``redundant`` replica slots per rank, 4 ranks as 2 nodes of 2, one expert
    with most rows (`_one_hot_expert_model`, its router learning if ``learn_router``, the layer
    recomputed in the backward if ``recompute``), ``gas`` micro-batches per step: FEPLB and
    DeepSpeed's MoE trained side by side. Returns both loss curves, the parameter errors (FEPLB's
    experts back in DeepSpeed's layout), each micro-batch's rows per rank before balancing
    (this rank's domain: ``ranks``, ``tokens_before``), the replica table after each step and the
    replicas' refresh and gradient-send counts; with ``fixed_costs`` "measured", the host cost of
    holding replicas measured by each step's end and the price of the replicas chosen there
    (``replica_fixed_us``: (fixed µs per micro-batch, the choice's cost µs) per step); and how many
    reviews of the replicas this rank weighed (``reviews_weighed``). ``bucket``: ZeRO's
    ``reduce_bucket_size`` (None: DeepSpeed's default, larger than the model). ``backward``:
    `train_step`'s, or "alternating" (the steps' backwards the engine's, direct, the engine's,
    ...); ``twice``: the layer runs twice per forward (`TinyMoEModel`)."""
    from deepspeed_feplb.plan.placement import CrossNodePlacer

    weighed = []
    review_choice = CrossNodePlacer.review_choice
    CrossNodePlacer.review_choice = lambda placer: weighed.append(1) or review_choice(placer)
    try:
        return {**_replica_slots_run(zero_stage, steps, gas, redundant, learn_router, recompute, enabled, fixed_costs,
                                     bucket, backward, twice),
                "reviews_weighed": len(weighed)}
    finally:
        CrossNodePlacer.review_choice = review_choice


def _replica_slots_run(zero_stage, steps, gas, redundant, learn_router, recompute, enabled, fixed_costs,
                       bucket, backward, twice) -> dict:
    import deepspeed

    from deepspeed_feplb.integration.expert_state import ModuleExperts
    from deepspeed_feplb.integration.placement_engine import placed_layers
    world = dist.get_world_size()
    feplb = {"nvlink_domain_size": 2, "dynamic_experts_per_rank": 1, "chunk_align_tokens": 1,
             "fixed_costs": fixed_costs, "copy_engine_gbps": 1e6,
             "placement": {"enabled": enabled, "interval_steps": 2, "network_gbps": 1e6,
                           "redundant_experts_per_rank": redundant, **({"history_decay": 0.5} if enabled else {})}}
    config = {**ds_config(zero_stage, feplb), "train_batch_size": world * gas, "gradient_accumulation_steps": gas}
    if bucket is not None:
        config["zero_optimization"] = {**config["zero_optimization"], "reduce_bucket_size": bucket}
    models = {name: _one_hot_expert_model(4 * world, world, learn_router=learn_router, recompute=recompute,
                                          twice=twice)
              for name in ("reference", "feplb")}
    engines = {name: (deepspeed_feplb if name == "feplb" else deepspeed).initialize(
        model=model, model_parameters=param_groups(model), config=config)[0] for name, model in models.items()}
    ours = engines["feplb"]
    forwards = []  # one entry per forward of FEPLB's layer (a recomputed one included)
    ours.module.moe.register_forward_pre_hook(lambda *_: forwards.append(1))
    losses = {name: [] for name in engines}
    micro, replica_at, fixed_us = [], [], []
    for step in range(steps):
        mode = "direct" if backward == "alternating" and step % 2 == 1 else \
            "engine" if backward == "alternating" else backward
        for m in range(gas):
            x, target = _placed_inputs(step * gas + m, 256)
            for name, engine in engines.items():
                losses[name].append(train_step(engine, x, target, mode))
            stats = ours.module.moe.feplb_stats
            micro.append({"ranks": stats["ranks"], "tokens_before": stats["tokens_before"]})
        replica_at.append(placed_layers(ours.module)[0].placement.replica_at.tolist())
        placer = placed_layers(ours.module)[0].placement.placer
        fixed_us.append((placer.replica_fixed_us, placer.replica_choice.cost_us if placer.replica_choice else 0.0))
    layer = placed_layers(ours.module)[0]
    placement = layer.placement
    params = [list(e.parameters()) for e in layer.experts.deepspeed_experts]
    reference = dict(engines["reference"].module.named_parameters())
    with placement.canonical(ModuleExperts(params, ours.optimizer)):
        errors = {n: relative_error(p.detach(), reference[n].detach()) for n, p in ours.module.named_parameters()}
        names = sorted(ours.module.state_dict())
    return {"losses": losses, "param_errors": errors, "micro": micro, "replica_at": replica_at,
            "replica_fixed_us": fixed_us, "refreshes": placement.replicas.refreshes if placement.replicas else 0,
            "ahead_refreshes": placement.replicas.ahead_refreshes if placement.replicas else 0,
            "held_back": placement.replicas.held_back if placement.replicas else 0,
            "forwards": len(forwards),
            "grad_sends": placement.replicas.grad_sends if placement.replicas else 0,
            "expert_at": placement.expert_at.tolist(), "moved_experts": placement.moved_experts,
            "state_dict_keys": names, "reference_keys": sorted(engines["reference"].module.state_dict())}


def replica_backward_cases(zero_stage: int = 2) -> dict:
    """`replica_slots_case` (2 nodes of 2, replicas alone, ZeRO ``zero_stage``) once per way a backward
    may reach the layer's held-back gradients, in one launch: {"direct": every backward
    ``loss.backward()``, 2 micro-batches per step; "alternating": one micro-batch per step, the
    steps' backwards the engine's and direct in turn (a direct one after the engine's: the forward
    held gradients back, its backward cannot wait for the end); "twice": the layer used twice per
    forward, ``engine.backward``, 2 micro-batches per step}."""
    return {"direct": replica_slots_case(zero_stage, 4, 2, enabled=False, backward="direct"),
            "alternating": replica_slots_case(zero_stage, 6, 1, enabled=False, backward="alternating"),
            "twice": replica_slots_case(zero_stage, 4, 2, enabled=False, twice=True)}


def replica_checkpoint_case(tmp: str, zero_stage: int = 0, steps: int = 7, save_at: int = 4) -> dict:
    """`replica_slots_case`'s layer saved with replicas held at step ``save_at``, then loaded into a
    fresh FEPLB job with replica slots and into plain DeepSpeed MoE: all three continue with the
    same losses (the replicas are in no checkpoint; a loaded job makes them again)."""
    import deepspeed

    from deepspeed_feplb.integration.placement_engine import placed_layers
    world = dist.get_world_size()
    feplb = {"nvlink_domain_size": 2, "dynamic_experts_per_rank": 1, "chunk_align_tokens": 1, "fixed_costs": "ignore",
             "placement": {"enabled": True, "interval_steps": 1, "history_decay": 0.5, "network_gbps": 1e6,
                           "redundant_experts_per_rank": 1}}
    config = ds_config(zero_stage, feplb)

    def engine(kind: str):
        model = _one_hot_expert_model(4 * world, world)
        init = deepspeed_feplb.initialize if kind == "feplb" else deepspeed.initialize
        return init(model=model, model_parameters=param_groups(model), config=config)[0]

    def train(e, steps) -> list:
        out = []
        for step in steps:
            x, target = _placed_inputs(step, 256)
            out.append(train_step(e, x, target))
        return out

    first = engine("feplb")
    train(first, range(save_at))
    replicas_at_save = placed_layers(first.module)[0].placement.replica_at.tolist()
    first.save_checkpoint(tmp, tag="mid")
    continued = train(first, range(save_at, steps))
    resumed = {}
    for kind in ("feplb", "deepspeed"):
        e = engine(kind)
        e.load_checkpoint(tmp, tag="mid")
        resumed[kind] = train(e, range(save_at, steps))
    return {"replicas_at_save": replicas_at_save, "continued": continued, "resumed": resumed}


def placement_checkpoint_case(tmp: str, zero_stage: int = 0, steps: int = 10, save_at: int = 6) -> dict:
    """Save a FEPLB run with a non-trivial placement at step ``save_at``, then load the checkpoint into
    a fresh FEPLB run and into plain DeepSpeed MoE: all three continue with the same losses; and
    into DeepSpeed's MoE at half the EP size (model states only): the same first loss. A state
    dict taken directly warns; one taken in `canonical_experts` equals what the checkpoint loads,
    is refused by a re-placed run outside that block and, loaded inside it, gives the saved run's
    next loss."""
    import deepspeed

    world = dist.get_world_size()
    feplb = {"nvlink_domain_size": 2, "dynamic_experts_per_rank": 1, "chunk_align_tokens": 1, "fixed_costs": "ignore",
             "placement": {"enabled": True, "interval_steps": 2, "history_decay": 0.5, "redundant_experts_per_rank": 0}}
    config = ds_config(zero_stage, feplb)

    def engine(kind: str, ep_size: int = world, placement: bool = True):
        model = _placed_model(4 * world, ep_size)
        init = deepspeed_feplb.initialize if kind == "feplb" else deepspeed.initialize
        settings = config if placement else {**config, "feplb": {**feplb, "placement": {
            "enabled": False, "redundant_experts_per_rank": 0}}}
        return init(model=model, model_parameters=param_groups(model), config=settings)[0]

    from deepspeed_feplb.integration.placement_engine import placed_layers
    first = engine("feplb")
    losses = _train({"first": first}, range(save_at))
    placement = placed_layers(first.module)[0].placement
    placed_at_save = placement.expert_at.tolist()
    moved_at_save = placement.moved_experts
    first.save_checkpoint(tmp, tag="mid")
    still_placed = placement.expert_at.tolist()
    warned, canonical = {}, {}
    for where in ("outside", "inside"):  # a state dict taken directly, and in canonical_experts
        with warnings.catch_warnings(record=True) as caught, contextlib.ExitStack() as stack:
            warnings.simplefilter("always")
            if where == "inside":
                stack.enter_context(deepspeed_feplb.canonical_experts(first))
            path = os.path.join(tmp, f"state-{where}-{dist.get_rank()}.pt")
            torch.save(first.module.state_dict(), path)  # keeps the metadata (the recorded expert order)
            canonical[where] = torch.load(path)
        warned[where] = any("re-placed" in str(w.message) for w in caught)
    placed_after_canonical = placement.expert_at.tolist()
    moved_by_saving = placement.moved_experts - moved_at_save  # save_checkpoint and canonical_experts move no expert
    after = _train({"first": first}, range(save_at, steps))["first"]
    resumed, state_errors = {}, {}
    for kind in ("feplb", "deepspeed"):
        e = engine(kind)
        e.load_checkpoint(tmp, tag="mid")
        loaded = e.module.state_dict()
        state_errors[kind] = max(float((loaded[k] - v).abs().max()) for k, v in canonical["inside"].items())
        resumed[kind] = _train({kind: e}, range(save_at, steps))[kind]
    # the canonical state dict into a run whose experts are re-placed: refused outside
    # canonical_experts, loaded inside it, and the run continues with the saved run's loss
    direct = engine("feplb")
    _train({"direct": direct}, range(save_at))
    direct_placement = placed_layers(direct.module)[0].placement
    placed_before_load = direct_placement.expert_at.tolist()
    try:
        direct.module.load_state_dict(canonical["inside"])
        refused = ""
    except RuntimeError as error:
        refused = str(error)
    placed_own = direct.module.state_dict()  # placement order, recorded: loads back while nothing moved
    direct.module.load_state_dict(placed_own)
    with deepspeed_feplb.canonical_experts(direct):
        direct.module.load_state_dict(canonical["inside"])
    placed_after_load = direct_placement.expert_at.tolist()
    resumed["state dict into a placed run"] = _train({"direct": direct}, range(save_at, save_at + 1))["direct"]
    # the state dict taken directly (placement order) into fresh jobs: FEPLB adopts the order before
    # its first forward (the saved run's next loss); plain DeepSpeed and FEPLB without placement refuse
    fresh = engine("feplb")
    fresh.module.load_state_dict(canonical["outside"])
    with torch.no_grad():
        fresh.module.eval()
        fresh(_placed_inputs(save_at)[0])  # the first forward attaches the placement
        fresh.module.train()
    fresh_placed = placed_layers(fresh.module)[0].placement.expert_at.tolist()
    resumed["placement-order state dict into a fresh job"] = _train({"fresh": fresh}, range(save_at,
                                                                                            save_at + 1))["fresh"]
    # the same into a model built with deepspeed_feplb.MoE, loaded before deepspeed_feplb.initialize
    # (whose `convert` sets the layers up again: the loaded order must survive it)
    model = _placed_model(4 * world, world, moe_class=deepspeed_feplb.MoE)
    model.load_state_dict(canonical["outside"])
    early = deepspeed_feplb.initialize(model=model, model_parameters=param_groups(model), config=config)[0]
    resumed["placement-order state dict before initialize"] = _train({"early": early}, range(save_at,
                                                                                            save_at + 1))["early"]
    fresh_refusals = {}
    for kind, placed in (("deepspeed", True), ("feplb without placement", False)):
        other = engine("feplb" if placed is False else kind, placement=placed)
        try:
            other.module.load_state_dict(canonical["outside"])
            _train({kind: other}, range(save_at, save_at + 1))
            fresh_refusals[kind] = ""
        except (RuntimeError, deepspeed_feplb.FEPLBConfigError) as error:
            fresh_refusals[kind] = str(error)
    # DeepSpeed loads experts by their global id at another EP size too (not the optimizer state,
    # which is laid out per EP rank): the first loss after loading must be the saved run's
    other = engine("deepspeed", ep_size=world // 2)
    other.load_checkpoint(tmp, tag="mid", load_optimizer_states=False)
    resumed["deepspeed, half the EP size"] = _train({"other": other}, range(save_at, save_at + 1))["other"]
    return {"placed_at_save": placed_at_save, "placed_after_save": still_placed, "first": losses["first"] + after,
            "continued": after, "resumed": resumed, "warned": warned, "state_errors": state_errors,
            "placed_after_canonical": placed_after_canonical, "placed_before_load": placed_before_load,
            "placed_after_load": placed_after_load, "refused": refused, "fresh_placed": fresh_placed,
            "fresh_refusals": fresh_refusals, "moved_by_saving": moved_by_saving}


def placement_replay_case(trace_path: str, gas: int = 2, interval: int = 2, decay: float = 0.3,
                          redundant: int = 0, max_rows_over_mean: float | None = None,
                          network_gbps: float = 1e6, enabled: bool = True) -> dict:
    """Replay a routing trace (exact counts) through FEPLB with feplb.placement (``enabled``: homes
    may move; ``redundant`` replica slots per rank, ``network_gbps``), ``gas`` micro-batches per
    step, ``feplb.max_rows_over_mean``.
    Returns, per micro-batch, the rows each rank
    received per local expert before balancing (this rank's domain: ``ranks``, ``tokens_before``),
    and after each optimizer step the placement (expert -> rank) and the replica table, the bytes
    per expert move and per replica the policy priced."""
    from deepspeed_feplb.integration.placement_engine import placed_layers
    from deepspeed_feplb.testing import TraceRouting, override_routing

    world = dist.get_world_size()
    routing = TraceRouting(trace_path)
    trace = routing.trace
    feplb = {"nvlink_domain_size": 2, "dynamic_experts_per_rank": 1, "chunk_align_tokens": 1, "fixed_costs": "ignore",
             "copy_engine_gbps": 1e6, "max_rows_over_mean": max_rows_over_mean,
             "placement": {"enabled": enabled, "interval_steps": interval, "history_decay": decay,
                           "network_gbps": network_gbps, "redundant_experts_per_rank": redundant}}
    config = {**ds_config(0, feplb), "train_batch_size": world * gas, "gradient_accumulation_steps": gas}
    torch.manual_seed(3)
    model = TinyMoEModel(deepspeed_feplb.MoE(hidden_size=HIDDEN, expert=make_expert(), num_experts=trace.experts,
                                             ep_size=world, k=trace.top_k, min_capacity=0, drop_tokens=False,
                                             use_rts=False, top2_2nd_expert_sampling=False))
    override_routing(model, routing)
    engine = deepspeed_feplb.initialize(model=model, model_parameters=param_groups(model), config=config)[0]
    tokens = routing.tokens_needed(world)
    # us_per_token: the measured time per row the decisions used, after each micro-batch
    micro, placements, replica_at, us_per_token = [], [], [], []
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for step in range(trace.steps // gas):
            for m in range(gas):
                x, target = _placed_inputs(step * gas + m, tokens)
                train_step(engine, x, target)
                stats = engine.module.moe.feplb_stats
                micro.append({"ranks": stats["ranks"], "tokens_before": stats["tokens_before"]})
                placement = placed_layers(engine.module)[0].placement
                us_per_token.append(placement.placer.us_per_token)  # as of its last decision or step
            placements.append(placement.placer.expert_to_rank.tolist())
            replica_at.append(placement.replica_at.tolist())
    return {"said": [line for line in printed.getvalue().splitlines() if "max_rows_over_mean" in line],
            "micro": micro, "placements": placements, "state_bytes": placement.placer.expert_state_bytes,
            "refreshes": placement.refreshes, "us_per_token": us_per_token, "replica_at": replica_at,
            "weight_bytes": placement.placer.weight_bytes, "grad_bytes": placement.placer.grad_bytes,
            "replica_drops": placement.placer.replica_drops, "replica_changes": placement.placer.replica_changes}


class PacedExpert(torch.nn.Module):
    """An MLP expert whose forward also sleeps ``piece_s + row_s * rows``: expert time that is
    known and far above a loaded machine's noise, without using a core."""

    def __init__(self, hidden: int = HIDDEN, piece_s: float = 0.0, row_s: float = 0.0):
        super().__init__()
        self.net = make_expert(hidden)
        self.piece_s, self.row_s = piece_s, row_s

    def forward(self, x):
        time.sleep(self.piece_s + self.row_s * x.shape[0])
        return self.net(x)


def _round_robin(request) -> torch.Tensor:
    """Routes ``[S, k]``: token t's j-th route to expert (t k + j) mod E, so every expert gets the same rows."""
    routes = torch.arange(request.num_tokens * request.k).view(request.num_tokens, request.k)
    return routes % request.num_experts


def _first_rank_heavy(request) -> torch.Tensor:
    """Routes ``[S, k]``: three tokens in four go to experts 0..k-1 (the first rank's), the rest round
    robin, so every expert gets rows and the first rank most of them."""
    t = torch.arange(request.num_tokens)
    routes = ((t // 4 * request.k)[:, None] + torch.arange(request.k)) % request.num_experts
    routes[t % 4 != 0] = torch.arange(request.k)
    return routes


def _load_the_planner() -> None:
    """As in a process that has planned before: with measured costs the domain's first rank plans
    nothing until its planner is loaded (a second or so, beside training; `test_scheduler.py` pins
    that), longer than these few micro-batches last."""
    import deepspeed_feplb.plan.passes  # noqa: F401 - loaded for its side effect


def fixed_costs_case(piece_s: float, row_s: float, skew: float, micro_batches: int = 5,
                     checkpointed: bool = False, max_rows_over_mean: float | None = None) -> dict:
    """``feplb.fixed_costs: "measured"`` (the default) over 4 ranks, one domain, experts with the
    given paced costs and the first rank's experts hot by ``skew`` (`skew_gate`; 0: every expert
    gets the same rows, round robin; < 0: `_first_rank_heavy`): per micro-batch, whether this rank
    had a domain, the moves, the domain's counts and the errors against DeepSpeed's MoE. ``checkpointed``: FEPLB's layer
    runs inside non-reentrant activation checkpointing (its recompute sees costs timed after the
    original forward, which would decide otherwise); ``max_rows_over_mean``: that bound on rows."""
    from torch.utils.checkpoint import checkpoint

    _load_the_planner()

    from deepspeed_feplb.testing import override_routing
    torch.manual_seed(3)
    kwargs = dict(hidden_size=HIDDEN, expert=PacedExpert(HIDDEN, piece_s, row_s), num_experts=8, ep_size=4, k=2,
                  min_capacity=0, drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False)
    reference = DeepSpeedMoE(**kwargs)
    skew_gate(reference.deepspeed_moe.gate.wg.weight, strength=skew, spread=False)
    diversify_experts(reference)
    ours = deepspeed_feplb.MoE(**kwargs, feplb_config={"nvlink_domain_size": 4, "dynamic_experts_per_rank": 1,
                                                       "chunk_align_tokens": 1,
                                                       "max_rows_over_mean": max_rows_over_mean})
    ours.load_state_dict(reference.state_dict())
    for layer in (reference, ours):
        layer.set_deepspeed_parallelism()
        if skew <= 0:
            override_routing(layer, _round_robin if skew == 0 else _first_rank_heavy)
    steps = []
    before = _feplb_segments()
    for mb in range(micro_batches):
        x, w = rank_inputs(mb)
        ref_out, ref_dx, ref_grads = run_layer(reference, x, w)
        if checkpointed:
            xi = x.clone().requires_grad_(True)
            out, l_aux = checkpoint(lambda t: ours(t)[:2], xi, use_reentrant=False)
            (out * w).sum().add(l_aux).backward()
            out, dx = out.detach(), xi.grad.clone()
            grads = {n: p.grad.clone() for n, p in ours.named_parameters() if p.grad is not None}
        else:
            out, dx, grads = run_layer(ours, x, w)
        errors = [relative_error(out, ref_out), relative_error(dx, ref_dx)]
        errors += [relative_error(grads[name], ref_grads[name]) for name in ref_grads]
        for layer in (reference, ours):
            layer.zero_grad(set_to_none=True)
        stats = ours.feplb_stats
        steps.append({"domain": ours.deepspeed_moe.stage.domain is not None, "moves": stats.get("moves"),
                      "counts": np.asarray(stats["domain_counts"]).tolist() if "domain_counts" in stats else None,
                      "rows_after": stats.get("tokens_after"),
                      "error": max(errors), "fit": ours.deepspeed_moe.stage.compute_times.fitted_us()})
    deepspeed_feplb.shutdown()
    return {"steps": steps, "segments": sorted(_feplb_segments() - before)}


def _feplb_segments() -> set:
    """FEPLB's shared-memory segments on this machine now (another job's too: compare two listings)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith("feplb-")}


def replicas_case(steps: int = 5) -> dict:
    """ZeRO-2, EP=2 on 4 ranks: two EP groups hold replicas of the same experts. Group 0's tokens
    go round robin (its ranks' times are equal: it never balances); group 1's all go to its first
    rank's first two experts (it balances once timed). Losses and parameters against DeepSpeed's
    MoE, and per step whether this rank's layer moved rows."""
    import deepspeed

    from deepspeed_feplb.testing import override_routing

    _load_the_planner()

    def hot(request) -> torch.Tensor:
        return torch.arange(request.k).repeat(request.num_tokens, 1)  # every token to experts 0..k-1

    routing = _round_robin if dist.get_rank() < 2 else hot
    feplb = {"nvlink_domain_size": 2, "dynamic_experts_per_rank": 2, "chunk_align_tokens": 1}

    def make_model():  # twice from one seed: deepcopy would lose DeepSpeed's expert-param marks
        torch.manual_seed(11)
        model = TinyMoEModel(DeepSpeedMoE(hidden_size=HIDDEN, expert=PacedExpert(HIDDEN, 0.0, 0.0004), num_experts=8,
                                          ep_size=2, k=2, min_capacity=0, drop_tokens=False, use_rts=False,
                                          top2_2nd_expert_sampling=False))
        diversify_experts(model.moe)
        return model

    reference_model, feplb_model = make_model(), make_model()
    reference, *_ = deepspeed.initialize(model=reference_model, model_parameters=param_groups(reference_model),
                                         config=ds_config(2, feplb))
    ours, *_ = deepspeed_feplb.initialize(model=feplb_model, model_parameters=param_groups(feplb_model),
                                          config=ds_config(2, feplb))
    for engine in (reference, ours):
        override_routing(engine.module, routing)
    losses, moved = {"reference": [], "feplb": []}, []
    for step in range(steps):
        x, target = rank_inputs(100 + step)
        for name, engine in (("reference", reference), ("feplb", ours)):
            losses[name].append(train_step(engine, x, target))
        moved.append(int(ours.module.moe.feplb_stats.get("moves", 0)))
    params = {n: relative_error(p.detach(), dict(reference.module.named_parameters())[n].detach())
              for n, p in ours.module.named_parameters()}
    deepspeed_feplb.shutdown()
    return {"losses": losses, "param_errors": params, "moved": moved}


class ThreeMoEModel(torch.nn.Module):
    """Dense -> MoE x 3 (EP sizes ``eps``, 2 experts per rank) -> dense, returning (prediction, summed l_aux)."""

    def __init__(self, eps=(2, 4, 2)):
        super().__init__()
        self.inp, self.out = torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Linear(HIDDEN, HIDDEN)
        self.moes = torch.nn.ModuleList(
            DeepSpeedMoE(hidden_size=HIDDEN, expert=make_expert(), num_experts=2 * ep, ep_size=ep, k=2, min_capacity=0,
                         drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False) for ep in eps)

    def forward(self, x):
        h, l_total = self.inp(x) + 1.0, 0.0
        for moe in self.moes:
            h, l_aux, _ = moe(h)
            h, l_total = h + 1.0, l_total + l_aux  # a positive mean, so that each skewed gate stays skewed
        return self.out(h), l_total


def three_layer_case(fault: float = 0.0, steps: int = 4) -> dict:
    """Three MoE layers at EP 2/4/2 on 4 ranks (the EP 2 layers have expert-data-parallel replicas),
    FEPLB migrating in each, trained with Adam beside DeepSpeed. Before every step FEPLB's weights
    are set to DeepSpeed's, so the gradients compared come from the same weights: free-running,
    Adam turns last-bit weight differences into ~1e-6 gradient drift after a few steps, as it does
    between DeepSpeed and itself with the tokens permuted. Returns per step the norm-relative
    gradient difference of each part (``inp``, ``moes.0``..``moes.2``, ``out``; max over this
    rank) and each layer's migrated rows. ``fault``: helpers' weight-gradients come home scaled by
    1 + fault (to show that the comparison sees a small error)."""
    import deepspeed

    from deepspeed_feplb.migrate import phase2
    if fault:
        original = phase2.Phase2MicroBatch._vjp

        def scaled(self, pieces, grads):
            served = [any(piece is q for parts in self.served.values() for _, q_pieces in parts for q in q_pieces)
                      for piece in pieces]
            return [[gx, *[g * (1.0 + fault) for g in gp]] if helper else [gx, *gp]
                    for helper, (gx, *gp) in zip(served, original(self, pieces, grads))]
        phase2.Phase2MicroBatch._vjp = scaled

    def make_model():  # twice from one seed: deepcopy would lose DeepSpeed's expert-param marks
        torch.manual_seed(11)
        model = ThreeMoEModel()
        for moe in model.moes:
            skew_gate(moe.deepspeed_moe.gate.wg.weight, spread=False)
            diversify_experts(moe)
        return model

    # no cross-node placement: its re-placed experts would take DeepSpeed's weights by slot, not by expert
    feplb = {"nvlink_domain_size": 2, "dynamic_experts_per_rank": 1, "chunk_align_tokens": 1, "fixed_costs": "ignore",
             "placement": {"enabled": False, "redundant_experts_per_rank": 0}}
    config = ds_config(0, feplb)
    engines = {}
    for name, init in (("reference", deepspeed.initialize), ("feplb", deepspeed_feplb.initialize)):
        model = make_model()
        engines[name] = init(model=model, model_parameters=param_groups(model), config=config)[0]
    reference, ours = engines["reference"], engines["feplb"]
    parts = ("inp", "moes.0", "moes.1", "moes.2", "out")
    errors, migrated = [], [0, 0, 0]
    for step in range(steps):
        with torch.no_grad():
            theirs = dict(reference.module.named_parameters())
            for n, p in ours.module.named_parameters():
                p.copy_(theirs[n])
        x, target = rank_inputs(100 + step)
        grads = {}
        for name, engine in engines.items():
            prediction, l_aux = engine(x)
            engine.backward(((prediction - target) ** 2).mean() + 0.01 * l_aux)
            grads[name] = {n: p.grad.clone() for n, p in engine.module.named_parameters() if p.grad is not None}
            engine.step()
        assert set(grads["feplb"]) == set(grads["reference"])
        per_part = {}
        for part in parts:
            names = [n for n in grads["reference"] if n.startswith(part + ".")]
            diff = sum(float((grads["feplb"][n].double() - grads["reference"][n].double()).pow(2).sum()) for n in names)
            norm = sum(float(grads["reference"][n].double().pow(2).sum()) for n in names)
            per_part[part] = (diff / max(norm, 1e-30)) ** 0.5
        errors.append(per_part)
        for i, moe in enumerate(ours.module.moes):
            migrated[i] += moe.feplb_stats["migrated_tokens"]
    return {"errors": errors, "migrated": migrated}


def sync_audit_case(placed: bool, redundant: int = 1) -> dict:
    """Host reads of device-side tensors (`testing.sync_audit`, what a GPU would synchronise on) in
    one balanced FEPLB layer's forward and backward, per micro-batch of a step (``gas`` = 2: one
    that does not end the step, one that does). ``placed``: 4 ranks as 2 nodes of 2 with
    feplb.placement and ``redundant`` replica slots per rank, audited once a replica exists (the
    router sends most rows to expert 0); else 2 ranks, one domain. Returns ``{"forward": [...], "backward":
    [...], "migrated": rows, "replicas": whether any replica is held}`` for the audited micro-batches."""
    from deepspeed_feplb.integration.placement_engine import placed_layers
    from deepspeed_feplb.testing.sync_audit import audit_syncs
    world, gas = dist.get_world_size(), 2
    feplb = {"nvlink_domain_size": 2, "dynamic_experts_per_rank": 1, "chunk_align_tokens": 1, "fixed_costs": "ignore",
             "scheduler": {"start_after_steps": 0}}
    if placed:
        feplb.update(copy_engine_gbps=1e6, placement={"enabled": True, "interval_steps": 1, "history_decay": 0.5,
                                                      "network_gbps": 1e6, "redundant_experts_per_rank": redundant})
    config = {**ds_config(0, feplb), "train_batch_size": world * gas, "gradient_accumulation_steps": gas}
    model = _one_hot_expert_model(4 * world, world, hot=0.5 if placed else 0.2)
    engine = deepspeed_feplb.initialize(model=model, model_parameters=param_groups(model), config=config)[0]
    moe = engine.module.moe
    for step in range(3):
        for m in range(gas):
            train_step(engine, *_placed_inputs(step * gas + m, 256))
    out = {"forward": [], "backward": [], "migrated": 0}
    for m in range(gas):
        x, target = _placed_inputs(100 + m, 256)
        params = list(engine.module.parameters())
        with audit_syncs(x, *params) as forward:
            prediction, l_aux = engine(x)
        loss = ((prediction - target)**2).mean() + 0.01 * l_aux
        with audit_syncs(loss, *params) as backward:
            engine.backward(loss)
        engine.step()
        out["forward"].append(forward.reads)
        out["backward"].append(backward.reads)
        out["migrated"] += int(moe.feplb_stats.get("migrated_tokens", 0))
    if placed:
        out["replicas"] = bool((placed_layers(engine.module)[0].placement.replica_at >= 0).any())
    return out


def scale_blocks(p: torch.Tensor) -> None:
    """x2 and x1/2 on the diagonals of each expert's first 2x2 block (through ``p.data``; ``p`` one
    expert's matrix, or AutoEP's stacked ``[E, F, H]``): no row or column sum of bit patterns
    changes, the structured write a row/column-sum fingerprint cannot see."""
    if p.dim() >= 2:
        p.data[..., :2, :2].mul_(torch.tensor([[2.0, 0.5], [0.5, 2.0]], dtype=p.dtype))


def write_in_place(p: torch.Tensor) -> None:
    """An in-place write under ``no_grad`` to each expert's first column (or AutoEP's stacked ``[E, ...]``)."""
    with torch.no_grad():
        p[..., 0].add_(0.05)


def replica_weight_writes_case(zero_stage: int, swaps: bool = True) -> dict:
    """`replica_slots_case`'s layer (replica slots, 2 nodes of 2, 2 micro-batches per step) with
    FEPLB and DeepSpeed's MoE written alike outside the optimizer step, every write one that the
    replicas must follow (`weight_watch`): between steps, evaluation forwards with other weights
    swapped in and out through ``p.data`` (an EMA's, a 2x2 block scaled x2 / x1/2, all x0.98);
    between two micro-batches of a step, an in-place write under ``no_grad`` (seen by the home
    alone, which tells the group), one through ``p.data`` (declared:
    `deepspeed_feplb.weights_changed`) and a ``load_state_dict`` (whose replica refresh a helper's
    kept copy of the replica slot must see). Every write touches every expert alike, so the
    placement (which moves experts) cannot matter. Returns both loss curves (training and
    evaluation), the parameter errors and the replicas' refreshes."""
    import deepspeed

    from deepspeed_feplb.integration.expert_state import ModuleExperts
    from deepspeed_feplb.integration.placement_engine import placed_layers
    world = dist.get_world_size()
    gas = 2
    feplb = {"nvlink_domain_size": 2, "dynamic_experts_per_rank": 1, "chunk_align_tokens": 1, "fixed_costs": "ignore",
             "copy_engine_gbps": 1e6,
             "placement": {"enabled": True, "interval_steps": 1, "history_decay": 0.5, "network_gbps": 1e6,
                           "redundant_experts_per_rank": 1}}
    config = {**ds_config(zero_stage, feplb), "train_batch_size": world * gas, "gradient_accumulation_steps": gas}
    models = {name: _one_hot_expert_model(4 * world, world) for name in ("reference", "feplb")}
    engines = {name: (deepspeed_feplb if name == "feplb" else deepspeed).initialize(
        model=model, model_parameters=param_groups(model), config=config)[0] for name, model in models.items()}
    ours = engines["feplb"]

    def expert_params(engine) -> list:
        return [p for expert in engine.module.moe.deepspeed_moe.experts.deepspeed_experts for p in expert.parameters()]

    def evaluate_with(swap) -> dict:
        """Swap other weights in through ``p.data``, evaluate, swap the training weights back."""
        out = {}
        for name, engine in engines.items():
            saved = [p.detach().clone() for p in expert_params(engine)]
            for p in expert_params(engine):
                swap(p)
            engine.eval()
            with torch.no_grad():
                x, target = _placed_inputs(999, 256)
                prediction, _ = engine(x)
                out[name] = float(((prediction - target)**2).mean())
            engine.train()
            for p, s in zip(expert_params(engine), saved):
                p.data.copy_(s)
        return out

    def mid_step(write: str) -> None:
        for engine in engines.values():
            if write == "load_state_dict":
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # FEPLB's experts are re-placed: it says so
                    state = engine.module.state_dict()
                for k in state:  # in place: the state dict's metadata (the recorded expert order) stays
                    if "expert" in k:
                        state[k] = state[k] * 1.01
                engine.module.load_state_dict(state)
                continue
            for p in expert_params(engine):
                if write == "no_grad":
                    write_in_place(p)
                else:
                    p.data.mul_(0.98)
        if write == "data":
            deepspeed_feplb.weights_changed(ours)

    between = {2: lambda p: p.data.mul_(0.9).add_(0.01), 3: scale_blocks, 4: lambda p: p.data.mul_(0.98)}
    if not swaps:
        between = {k: (lambda p: None) for k in between}
    within = {5: "no_grad", 6: "data", 7: "load_state_dict"}
    losses = {name: [] for name in engines}
    evaluations = []
    for step in range(8):
        if step in between:
            evaluations.append(evaluate_with(between[step]))
        for m in range(gas):
            if m == 1 and step in within:
                mid_step(within[step])
            x, target = _placed_inputs(step * gas + m, 256)
            for name, engine in engines.items():
                losses[name].append(train_step(engine, x, target))
    layer = placed_layers(ours.module)[0]
    placement = layer.placement
    held = bool((placement.replica_at >= 0).any())
    refreshes = placement.replicas.refreshes
    params = [list(e.parameters()) for e in layer.experts.deepspeed_experts]
    reference = dict(engines["reference"].module.named_parameters())
    with placement.canonical(ModuleExperts(params, ours.optimizer)):
        errors = {n: relative_error(p.detach(), reference[n].detach()) for n, p in ours.module.named_parameters()}
    return {"losses": losses, "evaluations": evaluations, "param_errors": errors, "held_replicas": held,
            "refreshes": refreshes}


def frozen_input_case(zero_stage: int, dynamic: int, known: bool, steps: int = 3) -> dict:
    """EP over all ranks, every row routed to expert 0 (the other ranks' experts get none) and the
    layers before the experts frozen, so the MoE layer's input needs no gradient: FEPLB (a known MLP
    grouped or ``known=False`` one call per expert; ``dynamic`` experts per rank balanced in one
    domain) and DeepSpeed's MoE side by side. Returns both loss curves and the parameter errors."""
    import deepspeed
    world = dist.get_world_size()
    feplb = {"nvlink_domain_size": world, "dynamic_experts_per_rank": dynamic, "chunk_align_tokens": 1,
             "fixed_costs": "ignore"}
    config = ds_config(zero_stage, feplb)

    def model():
        torch.manual_seed(11)
        m = TinyMoEModel(DeepSpeedMoE(hidden_size=HIDDEN, expert=make_expert(known=known), num_experts=2 * world,
                                      ep_size=world, k=1, min_capacity=0, drop_tokens=False, use_rts=False))
        with torch.no_grad():
            weight = m.moe.deepspeed_moe.gate.wg.weight
            weight.mul_(0.01)
            weight[0] += 50.0 / HIDDEN  # inputs have a positive mean: every row picks expert 0
        for p in (weight, *m.inp.parameters()):
            p.requires_grad_(False)
        diversify_experts(m.moe)
        return m

    models = {name: model() for name in ("reference", "feplb")}
    engines = {name: (deepspeed_feplb if name == "feplb" else deepspeed).initialize(
        model=m, model_parameters=param_groups(m), config=config)[0] for name, m in models.items()}
    ref_model = models["reference"]
    with torch.no_grad():
        routed = [int(ref_model.moe.deepspeed_moe.gate.wg(ref_model.inp(_placed_inputs(step)[0]) + 1.0).argmax(1).max())
                  for step in range(steps)]
    losses = _train(engines, range(steps))
    reference = dict(engines["reference"].module.named_parameters())
    errors = {n: relative_error(p.detach(), reference[n].detach())
              for n, p in engines["feplb"].module.named_parameters()}
    return {"losses": losses, "param_errors": errors, "highest_expert_routed": max(routed)}


def early_planner_case(steps: int = 3) -> dict:
    """`deepspeed_feplb.initialize` on 2 ranks, one domain: the pid of the spare scheduler process
    each rank holds after initialize, the pid that serves the domain once it opened, and whether
    the spare still lives after `deepspeed_feplb.shutdown`."""
    from deepspeed_feplb.scheduler import client as scheduler_client

    torch.manual_seed(11)
    model = TinyMoEModel(DeepSpeedMoE(hidden_size=HIDDEN, expert=make_expert(), num_experts=8, ep_size=2, k=2,
                                      min_capacity=0, drop_tokens=False))
    skew_gate(model.moe.deepspeed_moe.gate.wg.weight, spread=False)
    feplb = {"nvlink_domain_size": 2, "dynamic_experts_per_rank": 2, "chunk_align_tokens": 1,
             "fixed_costs": "ignore", "scheduler": {"start_after_steps": 0}}
    engine, *_ = deepspeed_feplb.initialize(model=model, model_parameters=param_groups(model),
                                            config=ds_config(0, feplb))
    spare = scheduler_client._spare.pid if scheduler_client._spare is not None else 0
    for step in range(steps):
        train_step(engine, *rank_inputs(200 + step))
    client = engine.module.moe.deepspeed_moe.stage.domain.scheduler
    serving = _serving_pid(client) if client.process is not None else 0
    deepspeed_feplb.shutdown()
    return {"spare": spare, "serving": serving, "spare_alive": spare > 0 and process_alive(spare)}


def zero_in_place_case(zero_stage: int) -> dict:
    """One training step of `TinyMoEModel` with a known MLP through `deepspeed_feplb.initialize`
    at ``zero_stage``, balanced (D = 2); then the aten ops of the next forward's expert stage, by name."""
    from deepspeed_feplb.expert_stage import ExpertStage
    from deepspeed_feplb.testing.op_count import count_ops

    torch.manual_seed(11)
    model = TinyMoEModel(DeepSpeedMoE(hidden_size=HIDDEN, expert=make_expert(), num_experts=8, ep_size=2, k=2,
                                      min_capacity=0, drop_tokens=False))
    skew_gate(model.moe.deepspeed_moe.gate.wg.weight, spread=False)
    feplb = {"nvlink_domain_size": 2, "dynamic_experts_per_rank": 2, "chunk_align_tokens": 1,
             "fixed_costs": "ignore", "scheduler": {"mode": "inline"}}
    engine, *_ = deepspeed_feplb.initialize(model=model, model_parameters=param_groups(model),
                                            config=ds_config(zero_stage, feplb))
    train_step(engine, *rank_inputs(300))
    run, ops = ExpertStage.run, {}

    def counted(self, rows, *args, **kwargs):
        with count_ops() as forward:
            out = run(self, rows, *args, **kwargs)
        ops.update(forward.by_name)
        return out

    ExpertStage.run = counted
    try:
        train_step(engine, *rank_inputs(301))
    finally:
        ExpertStage.run = run
    deepspeed_feplb.shutdown()
    return {"ops": ops, "migrated": engine.module.moe.feplb_stats["migrated_tokens"]}
