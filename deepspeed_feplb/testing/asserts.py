"""Assertions for multi-rank MoE tests (call them on every rank: they communicate).

* `assert_same_on_all_ranks(value)` -- a tensor / number / nested dict or list is identical (or
  within tolerance) on every rank, e.g. replicated weights after a step, or stats of a domain.
* `assert_equal_to_unbalanced(model, *inputs)` -- one forward + backward of ``model`` (which holds
  FEPLB layers) equals the same model with balancing off (``against="unbalanced"``: FEPLB with 0
  dynamic experts, every expert computed at home) or DeepSpeed's own MoE layer
  (``against="deepspeed"``, dropless): outputs, input gradients and every parameter gradient.
* `experts_in_one_buffer(experts)` -- lay experts' parameters out as ZeRO 1/2's flat buffers do.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["assert_same_on_all_ranks", "assert_equal_to_unbalanced", "relative_error", "distinct_experts"]


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy() if value.dtype != torch.bfloat16 else value.detach().float().cpu().numpy()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value) if isinstance(value, list) else tuple(_plain(v) for v in value)
    return value


def _difference(a: Any, b: Any, path: str, rtol: float, atol: float) -> Optional[str]:
    """None if ``a`` and ``b`` agree, else where and how they differ."""
    if isinstance(a, dict) or isinstance(b, dict):
        if not (isinstance(a, dict) and isinstance(b, dict)) or set(a) != set(b):
            return f"{path}: keys {sorted(map(str, a)) if isinstance(a, dict) else type(a).__name__} vs " \
                   f"{sorted(map(str, b)) if isinstance(b, dict) else type(b).__name__}"
        for key in a:
            diff = _difference(a[key], b[key], f"{path}[{key!r}]", rtol, atol)
            if diff:
                return diff
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and not _numeric_list(a):
        if len(a) != len(b):
            return f"{path}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            diff = _difference(x, y, f"{path}[{i}]", rtol, atol)
            if diff:
                return diff
        return None
    if isinstance(a, (np.ndarray, np.generic, int, float, list, tuple)) and not isinstance(a, bool):
        x, y = np.asarray(a), np.asarray(b)
        if x.shape != y.shape:
            return f"{path}: shape {x.shape} vs {y.shape}"
        if x.dtype.kind in "fc" or y.dtype.kind in "fc":
            if not np.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True):
                worst = np.abs(x.astype(np.float64) - y.astype(np.float64))
                return f"{path}: max abs difference {np.nanmax(worst) if worst.size else 0:.3g}"
            return None
        if not np.array_equal(x, y):
            return f"{path}: {x.tolist() if x.size <= 16 else 'values'} vs {y.tolist() if y.size <= 16 else 'values'}"
        return None
    return None if a == b else f"{path}: {a!r} vs {b!r}"


def _numeric_list(value) -> bool:
    return all(isinstance(v, (int, float, np.number)) and not isinstance(v, bool) for v in value)


def assert_same_on_all_ranks(value: Any, name: str = "value", *, rtol: float = 0.0, atol: float = 0.0,
                             group=None) -> None:
    """Raise `AssertionError` on every rank unless ``value`` agrees with rank 0's on all ranks of ``group``.

    ``value``: tensor, numpy array, number, string or a nested dict/list/tuple of them. Floats are
    compared with ``numpy.allclose(rtol, atol)`` (exact by default). Collective: call on all ranks.
    """
    values = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, _plain(value), group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(values)))
    problems = [f"rank {ranks[i]} vs rank {ranks[0]}: {diff}" for i in range(1, len(values))
                if (diff := _difference(values[i], values[0], name, rtol, atol))]
    if problems:
        raise AssertionError(f"{name} is not the same on all ranks:\n  " + "\n  ".join(problems))


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64 (``||a - b||`` when ``b`` is zero)."""
    a, b = a.detach().double(), b.detach().double()
    denominator = b.norm().item()
    return float((a - b).norm().item() / denominator) if denominator > 0 else float((a - b).norm().item())


def experts_in_one_buffer(experts) -> torch.Tensor:
    """Lay ``experts``' parameters in one buffer, one expert after the other, each parameter a view
    of it, as ZeRO 1/2's flat buffers (which a run with a DeepSpeed engine has) hold them; returns
    the buffer. Values are kept."""
    params = [p for e in experts for p in e.parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    at = 0
    for p in params:
        p.data = flat[at:at + p.numel()].view_as(p)
        at += p.numel()
    return flat


@torch.no_grad()
def distinct_experts(model: torch.nn.Module, seed: int = 0) -> None:
    """Give every expert of every MoE layer in ``model`` its own weights.

    DeepSpeed builds all experts as copies of one module, so right after construction every
    expert computes the same function and a test cannot notice tokens computed by the wrong
    expert (or with the wrong weights after a migration). Each parameter is redrawn from a normal
    distribution with its current mean absolute value as scale, seeded by ``(seed, layer,
    global expert id, parameter)``: the same expert gets the same weights on every replica.
    Call on every rank, before the optimizer is built.
    """
    from deepspeed.moe.sharded_moe import MOELayer
    layers = [m for m in model.modules() if isinstance(m, MOELayer)]
    for index, layer in enumerate(layers):
        group = getattr(layer, "ep_group", None)
        ep_rank = dist.get_rank(group) if dist.is_initialized() and group is not None else 0
        experts = list(layer.experts.deepspeed_experts)
        for local, expert in enumerate(experts):
            global_id = ep_rank * len(experts) + local
            for number, p in enumerate(expert.parameters()):
                g = torch.Generator().manual_seed(((seed * 1009 + index) * 65_537 + global_id) * 257 + number)
                scale = p.detach().float().abs().mean().clamp_min(1e-2).item()
                p.copy_((torch.randn(p.shape, generator=g) * scale).to(p.dtype))


# ------------------------------------------------------------------------------ equal to unbalanced
def _feplb_layers(model: torch.nn.Module) -> list:
    from deepspeed_feplb.integration.deepspeed_moe import FEPLBMOELayer
    return [m for m in model.modules() if isinstance(m, FEPLBMOELayer)]


def _twin(model: torch.nn.Module, against: str) -> torch.nn.Module:
    """A deep copy of ``model`` whose FEPLB layers compute without balancing / as DeepSpeed's MoE."""
    from deepspeed.moe import layer as ds_layer
    from deepspeed.moe.sharded_moe import MOELayer, TopKGate

    from deepspeed_feplb.config import FEPLBConfig
    from deepspeed_feplb.gate.top1 import DroplessTop1Gate
    from deepspeed_feplb.integration import seams
    from deepspeed_feplb.integration.deepspeed_moe import MoE as FEPLBMoE
    from deepspeed_feplb.testing.routing import RoutedGate, _arm

    memo: dict = {}
    objects = list(model.modules())
    objects += [m.inner for m in objects if isinstance(m, RoutedGate)]
    feplb = {id(layer) for layer in _feplb_layers(model)}
    for obj in objects:
        for key, value in vars(obj).items():
            if isinstance(value, dist.ProcessGroup) or (id(obj) in feplb and key == "dispatcher"):
                memo[id(value)] = value  # shared, not copied: process groups, phase 1
            elif id(obj) in feplb and key == "stage" and value is not None and value.domain is not None:
                memo[id(value.domain)] = value.domain  # the domain's runtime (processes, shared memory) is shared
            elif isinstance(value, torch.Tensor) and value.grad_fn is not None:
                memo[id(value)] = value.detach()  # results of the last forward (l_aux) cannot be deep-copied
    twin = copy.deepcopy(model, memo)
    for module in twin.modules():
        if against == "deepspeed" and isinstance(module, FEPLBMoE):
            seams.back_to(module, ds_layer.MoE)
    for layer in _feplb_layers(twin):
        if against == "unbalanced":
            config = layer.feplb_config or FEPLBConfig()
            layer.feplb_config = config.model_copy(update={"dynamic_experts_per_rank": 0})
            layer._feplb_ready = False
            _arm(layer)
        else:
            seams.back_to(layer, MOELayer)
            inner = layer.gate.inner if isinstance(layer.gate, RoutedGate) else layer.gate
            seams.dropless(inner)
            if type(inner) is DroplessTop1Gate:
                seams.back_to(inner, TopKGate)  # DeepSpeed's own top-1, the independent reference
    return twin


def _flat_tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat_tensors(v)]
    return []


def _probe(shape, seed: int, index: int) -> torch.Tensor:
    rank = dist.get_rank() if dist.is_initialized() else 0
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed * 1_000_003 + rank * 1009 + index),
                       dtype=torch.float64)


def _forward_backward(model, inputs, loss_fn, seed):
    params = dict(model.named_parameters())
    saved = {name: p.grad for name, p in params.items()}
    for p in params.values():
        p.grad = None
    inputs = [x.detach().clone().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x
              for x in inputs]
    try:
        out = model(*inputs)
        outputs = _flat_tensors(out)
        if loss_fn is not None:
            loss = loss_fn(out)
        else:  # a fixed random projection of every differentiable output (l_aux included)
            terms = [(t.double() * _probe(t.shape, seed, i)).sum() for i, t in enumerate(outputs)
                     if t.is_floating_point() and t.requires_grad]
            if not terms:
                raise ValueError("assert_equal_to_unbalanced: the model returned no differentiable tensor")
            loss = torch.stack(terms).sum()
        loss.backward()
        grads = {name: p.grad.clone() for name, p in params.items() if p.grad is not None}
        input_grads = [x.grad.clone() for x in inputs if isinstance(x, torch.Tensor) and x.grad is not None]
        return [t.detach().clone() for t in outputs], input_grads, grads
    finally:
        for name, p in params.items():
            p.grad = saved[name]


def assert_equal_to_unbalanced(model: torch.nn.Module, *inputs, against: str = "unbalanced", rtol: float = 1e-5,
                               atol: float = 1e-7, loss: Optional[Callable[[Any], torch.Tensor]] = None,
                               seed: int = 0) -> dict:
    """Check that balancing changes nothing: ``model(*inputs)`` and its gradients equal a reference.

    The reference is a deep copy of ``model`` made now (same weights, same routing override and
    step) whose FEPLB layers are switched to ``against``: ``"unbalanced"`` (FEPLB with
    ``dynamic_experts_per_rank=0``) or ``"deepspeed"`` (DeepSpeed's own dropless MoE layer). Both
    run one forward and backward of ``loss(output)`` (default: a fixed random projection of every
    floating-point output, ``l_aux`` included). Compared: every output tensor, the gradient of
    every floating-point input and of every parameter, by relative error ``<= rtol`` (or absolute
    ``<= atol``). ``model``'s own ``.grad`` are left as they were; its routing steps advance by one.

    Collective: call on every rank. Returns ``{"errors": {what: relative error}, "stats":
    [feplb_stats of each FEPLB layer of model after the forward]}``.
    """
    if against not in ("unbalanced", "deepspeed"):
        raise ValueError(f"against must be 'unbalanced' or 'deepspeed', not {against!r}")
    layers = _feplb_layers(model)
    if not layers:
        raise ValueError(f"assert_equal_to_unbalanced: no FEPLB layer in {type(model).__name__} "
                         "(use deepspeed_feplb.MoE or deepspeed_feplb.convert)")
    for layer in layers:  # attach first: the attach may swap the gate (sigmoid scoring), the twin must see that
        if not layer._feplb_ready:
            layer._attach()
    reference = _twin(model, against)
    ref_out, ref_dx, ref_grads = _forward_backward(reference, inputs, loss, seed)
    out, dx, grads = _forward_backward(model, inputs, loss, seed)
    rank = dist.get_rank() if dist.is_initialized() else 0
    problems, errors = [], {}
    if set(grads) != set(ref_grads):
        problems.append(f"parameters with gradients differ: only in FEPLB {sorted(set(grads) - set(ref_grads))}, "
                        f"only in the {against} layer {sorted(set(ref_grads) - set(grads))}")
    pairs = [(f"output[{i}]", a, b) for i, (a, b) in enumerate(zip(out, ref_out))]
    pairs += [(f"input_grad[{i}]", a, b) for i, (a, b) in enumerate(zip(dx, ref_dx))]
    pairs += [(f"grad[{name}]", grads[name], ref_grads[name]) for name in sorted(set(grads) & set(ref_grads))]
    if len(out) != len(ref_out) or len(dx) != len(ref_dx):
        problems.append(f"{len(out)} outputs / {len(dx)} input grads vs {len(ref_out)} / {len(ref_dx)}")
    for what, a, b in pairs:
        if a.shape != b.shape:
            problems.append(f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
            continue
        if not a.is_floating_point():
            if not torch.equal(a, b):
                problems.append(f"{what}: {a.tolist()} vs {b.tolist()}")
            continue
        err = relative_error(a, b)
        errors[what] = err
        if err > rtol and (a.double() - b.double()).abs().max().item() > atol:
            problems.append(f"{what} differs by {err:.2e} relative (rtol {rtol:g})")
    if problems:
        raise AssertionError(f"rank {rank}: the FEPLB model is not equal to the {against} one:\n  " +
                             "\n  ".join(problems))
    return {"errors": errors, "stats": [copy.deepcopy(layer.feplb_stats) for layer in layers]}
