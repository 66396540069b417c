"""An expert's whole state, read and written one expert at a time: what cross-node placement moves.

An expert moves with its parameters, their fp32 master copy and their optimizer state: ZeRO 1/2
and the bf16 optimizer keep those in flat partitions that DeepSpeed's ``safe_get/set_full_*``
fragment API reads and writes per parameter (collective over the expert-data-parallel group);
ZeRO 0 keeps them in the torch optimizer's per-parameter state. `ModuleExperts` holds a DeepSpeed
MoE layer's experts (one module each), `StackedExperts` AutoEP's stacked weights (expert ``i`` is
row ``i`` of each); both also give the gradient norms per expert that clipping in DeepSpeed's
layout needs (`placement_engine.canonical_grad_norms`).
"""
from __future__ import annotations

import torch

from deepspeed_feplb.config import FEPLBConfigError
from deepspeed_feplb.integration import seams


def hp_state_keys(optimizer) -> list[str]:
    """Optimizer-state keys kept in DeepSpeed's flat fp32 partitions (e.g. exp_avg, exp_avg_sq), with
    every parameter's fragments of them linked (`seams.relink_optimizer_fragments`). Once per move:
    relinking walks every parameter group."""
    seams.relink_optimizer_fragments(optimizer)
    inner = getattr(optimizer, "optimizer", optimizer)
    for state in inner.state.values():
        return sorted(k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0)
    return []


def _torch_state(optimizer, param: torch.Tensor) -> dict:
    """A torch optimizer's state of ``param``: empty for an optimizer that keeps none for any parameter
    (SGD without momentum: an expert then moves with its values alone)."""
    states = getattr(optimizer, "state", None)
    state = None if states is None else states.get(param)
    if state is not None:
        return state
    if states is not None and not any(states.values()):
        return {}
    raise RuntimeError(f"FEPLB placement: optimizer {type(optimizer).__name__} keeps state for some parameters but "
                       "none for an expert parameter, so experts cannot move with their optimizer state; placement "
                       "supports ZeRO stage 0 in fp32 and ZeRO stages 1-2 in fp32, bf16 or fp16")


def expert_state(params: list[torch.Tensor], optimizer, keys: list[str]) -> list[torch.Tensor]:
    """Everything that moves with one expert, in a fixed order: for each parameter its value, then
    (ZeRO 1/2, bf16 optimizer) its fp32 master and optimizer states ``keys`` (`hp_state_keys`), or
    (ZeRO 0) its torch optimizer state entries in key order. Collective over the
    expert-data-parallel group under ZeRO 1/2 (DeepSpeed assembles partitioned fragments with an
    all-reduce)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    out = []
    for p in params:
        out.append(p.detach().clone())
        if seams.has_fp32_fragments(p):
            out.append(safe_get_full_fp32_param(p))
            out.extend(safe_get_full_optimizer_state(p, key) for key in keys)
        elif optimizer is not None:
            state = _torch_state(optimizer, p)
            out.extend(state[k].detach().clone() if torch.is_tensor(state[k]) else torch.tensor(state[k])
                       for k in sorted(state))
    return out


def load_expert_state(params: list[torch.Tensor], optimizer, keys: list[str], tensors: list[torch.Tensor]) -> None:
    """Write what `expert_state` read (of another expert) into ``params`` and their optimizer state."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
    values = iter(tensors)
    with torch.no_grad():
        for p in params:
            p.copy_(next(values))
            if seams.has_fp32_fragments(p):
                safe_set_full_fp32_param(p, next(values))
                for key in keys:
                    safe_set_full_optimizer_state(p, next(values), key)
            elif optimizer is not None:
                state = _torch_state(optimizer, p)
                for k in sorted(state):
                    value = next(values)
                    if torch.is_tensor(state[k]):
                        state[k].copy_(value)
                    else:
                        state[k] = type(state[k])(value.item())


def state_bytes_per_expert(params: list[torch.Tensor], optimizer_states: int = 2) -> int:
    """Bytes one expert's move carries: its parameters, an fp32 master copy when they are not fp32,
    and ``optimizer_states`` fp32 tensors of their size (Adam's two moments)."""
    numel = sum(p.numel() for p in params)
    own = sum(p.numel() * p.element_size() for p in params)
    master = 0 if all(p.dtype == torch.float32 for p in params) else 4 * numel
    return own + master + 4 * numel * optimizer_states


class ModuleExperts:
    """A layer's local experts as DeepSpeed MoE holds them, each with its own parameters
    (``params`` ``[E_local][n]``): what `ExpertPlacement` moves and whose gradient norms it
    reorders. One part (`parts`): the experts' whole state, read and written per expert."""

    def __init__(self, params: list[list[torch.Tensor]], optimizer):
        self.params, self.optimizer = params, optimizer

    def parts(self):
        keys = hp_state_keys(self.optimizer)
        yield (lambda j: expert_state(self.params[j], self.optimizer, keys),
               lambda i, tensors: load_expert_state(self.params[i], self.optimizer, keys, tensors))

    def norm_table(self, norms: dict) -> torch.Tensor:
        """float32 [E_local, n]: each local expert's parameters' gradient norms (``norms``: param ->
        0-dim norm, where it has one)."""
        return torch.stack([torch.stack([norms[p] if p in norms else p.new_zeros((), dtype=torch.float32)
                                         for p in expert]) for expert in self.params])

    def set_norms(self, table: torch.Tensor, norms: dict) -> None:
        """Write per-expert norms ``table`` [E_local, n] back into ``norms`` (param -> norm)."""
        for i, expert in enumerate(self.params):
            for j, p in enumerate(expert):
                if p in norms:
                    norms[p] = table[i, j]


class StackedExperts:
    """A layer's local experts stacked in parameters ``[E_local, ...]`` (AutoEP's ``w1, w2, w3``):
    expert ``i`` is row ``i`` of each. One part per parameter (`parts`), so that a move holds one
    parameter's full state at a time: its value, and its fp32 master and optimizer states (ZeRO 1/2
    and the bf16 optimizer through DeepSpeed's ``safe_get/set_full_*``; ZeRO 0 the torch
    optimizer's per-parameter state, whose entries shaped like the parameter move by row; scalar
    ones such as Adam's step count are the parameter's, shared by its rows, and stay)."""

    def __init__(self, stacked: list[torch.Tensor], optimizer):
        self.stacked, self.optimizer = stacked, optimizer

    def parts(self):
        from deepspeed.utils import (
            safe_get_full_fp32_param,
            safe_get_full_optimizer_state,
            safe_set_full_fp32_param,
            safe_set_full_optimizer_state,
        )
        keys = hp_state_keys(self.optimizer)
        for p in self.stacked:
            if seams.has_fp32_fragments(p):
                full = [p.detach().clone(), safe_get_full_fp32_param(p),
                        *(safe_get_full_optimizer_state(p, key) for key in keys)]
            else:
                state = _torch_state(self.optimizer, p) if self.optimizer is not None else {}
                odd = [k for k, v in state.items() if torch.is_tensor(v) and v.dim() and v.shape != p.shape]
                if odd:
                    raise FEPLBConfigError(
                        f"feplb.placement: optimizer {type(self.optimizer).__name__} keeps state {odd} of a stacked "
                        f"expert parameter {tuple(p.shape)} in another shape, which cannot move with its experts' "
                        "rows; use Adam(W) or SGD, or set feplb.placement.enabled to false")
                full = [p.data, *(state[k] for k in sorted(state) if torch.is_tensor(state[k]) and state[k].dim())]

            def read(j, full=full):
                return [t[j].detach().clone() for t in full]

            def write(i, tensors, full=full):
                with torch.no_grad():
                    for t, value in zip(full, tensors):
                        t[i].copy_(value)

            yield read, write
            if seams.has_fp32_fragments(p):
                with torch.no_grad():
                    p.copy_(full[0])
                safe_set_full_fp32_param(p, full[1])
                for key, value in zip(keys, full[2:]):
                    safe_set_full_optimizer_state(p, value, key)

    def norm_table(self, norms: dict) -> torch.Tensor:
        """float32 [E_local, n]: each row's gradient norm of each stacked parameter."""
        return torch.stack([p.grad.detach().float().flatten(1).norm(2, dim=1) if p in norms
                            else p.new_zeros(p.shape[0], dtype=torch.float32) for p in self.stacked], dim=1)

    def set_norms(self, table: torch.Tensor, norms: dict) -> None:
        """Each stacked parameter's norm from its rows' ``table`` [E_local, n]."""
        for j, p in enumerate(self.stacked):
            if p in norms:
                norms[p] = table[:, j].pow(2).sum().sqrt()
