"""Every place where FEPLB reaches into DeepSpeed without a supported extension point, in one file.

DeepSpeed 0.19 offers no hook for any of these; each function says what it relies on, so a
DeepSpeed upgrade that breaks one breaks it here (and `tests/test_dropin.py`,
`tests/test_pipeline*.py`, `tests/test_autoep.py` and `tests/test_monitor.py` catch it).

* `configuring_engine` / `engine_feplb_section`: a layer under a plain ``deepspeed.initialize``
  finds the engine and its ``"feplb"`` section while the engine configures it (DeepSpeed passes
  no config to modules).
* `later_micro_batches`: how many micro-batches of the step follow the current one (the
  planner's price of a kept weight copy).
* `step_ends`: whether the engine's current micro-batch ends the optimizer step (weight
  residency returns gradients then; DeepSpeed tells modules nothing about accumulation).
* `become`: turn an existing module into a FEPLB subclass in place (DeepSpeed builds its MoE and
  AutoEP modules itself; replacing them would lose parameter identity, names and ZeRO hooks);
  `make_dropless_top1` does it to a top-1 `TopKGate`; `back_to` undoes it (the test harness's
  DeepSpeed reference copy); `dropless` sets a gate's token dropping off.
* `gate_without_ep_group`, `counting_slots`: for the length of one call, DeepSpeed's gate without
  its EP group (no all-reduce of a capacity FEPLB never reads) and AutoEP's layer counting
  placement slots instead of experts (both read these attributes at call time, with no argument).
* `pipeline_engine_class`: make ``deepspeed.initialize`` build our `PipelineEngine` subclass
  (it looks the class up as ``deepspeed.PipelineEngine`` at call time and takes no argument).
* `pipeline_instructions`, `deepspeed_instruction`: DeepSpeed's pipeline instruction map
  (instruction -> private engine method), which the FEPLB pipeline engine extends and calls
  into (it also overrides the engine's ``_train_schedule``; `PipelineEngine` has no public way
  to change its schedule).
* `after_step`: run a callback after every ``engine.step()`` (DeepSpeed has no step hook);
  `around_forward`: callbacks when ``engine.forward`` begins, before the model runs, and when it
  has returned (or raised).
* `clip_fp32_gradients_with`: ZeRO 0 (fp32) clips by DeepSpeed's formula with per-parameter norms
  given by the caller (cross-node placement gives each rank the norms of the experts it holds in
  DeepSpeed's layout).
* `has_fp32_fragments`, `relink_optimizer_fragments`: whether DeepSpeed's optimizer keeps a
  parameter's fp32 master and state in its partitions, and make its per-parameter views of
  them current (cross-node placement reads and writes one expert's state through them).
* `around_checkpoints`: run code around ``engine.save_checkpoint`` and
  ``engine.load_checkpoint`` (cross-node placement keeps checkpoints in DeepSpeed's layout).
* `data_parallel_group`, `expert_data_parallel_group`, `expert_parallel_group_names`,
  `create_expert_parallel_groups`: DeepSpeed's process groups (`deepspeed.utils.groups` keeps
  them behind private functions; a pipeline needs every MoE size's groups made eagerly).
* `without_cpu_shm_op`: initialise DeepSpeed's process group on CPU without building its
  shared-memory allreduce op (DeepSpeed has no switch for it).
"""
from __future__ import annotations

import contextlib
import inspect
import threading
import weakref
from typing import Callable, Optional

_ENGINE_LOCK = threading.Lock()


def configuring_engine(depth: int = 5):
    """The DeepSpeed engine that is configuring the caller, or None.

    Relies on `DeepSpeedEngine._configure_distributed_model` calling
    ``module.set_deepspeed_parallelism()`` on every MoE module, with the engine (whose ``config``
    is the user's ds_config dict) a few frames up the stack.
    """
    frame = inspect.currentframe().f_back
    try:
        for _ in range(depth):
            frame = frame.f_back
            if frame is None:
                return None
            engine = frame.f_locals.get("self")
            if type(engine).__name__.endswith("Engine") and isinstance(getattr(engine, "config", None), dict):
                return engine
        return None
    finally:
        del frame


def engine_feplb_section(engine) -> Optional[dict]:
    """``{"feplb": section}`` of ``engine``'s ds_config (a `configuring_engine`), or None."""
    return None if engine is None else {"feplb": engine.config.get("feplb", {})}


def step_ends(engine) -> Callable[[], bool]:
    """A function that says, during a forward, whether ``engine``'s current micro-batch is the last
    of its optimizer step (the gradient-accumulation boundary).

    Relies on `DeepSpeedEngine.is_gradient_accumulation_boundary` being true in the forward of the
    last micro-batch (``(micro_steps + 1) % gradient_accumulation_steps == 0``, micro_steps
    advanced by ``engine.step()``), and wraps ``engine.forward`` to know that a forward runs
    through the engine. A forward outside it (``engine.module(x)``, an activation-checkpoint
    recompute) counts as a step's last: its gradients reach ``.grad`` in its own backward, as
    DeepSpeed's would. Where the engine cannot tell (unmanaged accumulation, ZenFlow, a plain
    `PipelineEngine`, whose boundary is true only inside its reduce instruction), every
    micro-batch counts as the last. `integration.pipeline.FEPLBPipelineEngine` says it itself
    (``feplb_step_ends``). Holds the engine weakly.
    """
    ref = weakref.ref(engine)
    _track_forward(engine)

    def ends() -> bool:
        e = ref()
        if e is None:
            return True
        own = getattr(e, "feplb_step_ends", None)
        if own is not None:
            return bool(own())
        from deepspeed.runtime.pipe.engine import PipelineEngine
        managed = getattr(e, "managed_gradient_accumulation", None)
        if isinstance(e, PipelineEngine) or getattr(e, "zenflow", False) or (managed is not None and not managed()):
            return True
        if not getattr(e, "_feplb_in_forward", False):
            return True
        return bool(e.is_gradient_accumulation_boundary())
    return ends


def later_micro_batches(engine) -> Callable[[], int]:
    """A function that says, during a forward, how many micro-batches of ``engine``'s optimizer
    step follow the current one: 0 where `step_ends` says it is the last, else
    ``gradient_accumulation_steps - 1 - micro_steps % gradient_accumulation_steps`` (at least 1),
    or what the engine says itself (``feplb_later_micro_batches``). The planner prices a weight
    copy kept for the step over them. Holds the engine weakly."""
    ends = step_ends(engine)
    ref = weakref.ref(engine)

    def later() -> int:
        e = ref()
        if e is None or ends():
            return 0
        own = getattr(e, "feplb_later_micro_batches", None)
        if own is not None:
            return max(1, int(own()))
        steps = max(1, int(e.gradient_accumulation_steps()))
        return max(1, steps - 1 - int(e.micro_steps) % steps)
    return later


def in_engine_backward(engine) -> Callable[[], bool]:
    """A function that says, during a backward, whether it runs inside ``engine.backward(loss)``,
    which reduces the gradients once autograd has returned (so a gradient delivered when autograd's
    backward ends is in time), rather than a direct ``loss.backward()``, for which DeepSpeed's ZeRO
    optimizer queued its reduction epilogue as the backward began, to run before any end-of-backward
    callback queued after it. True for an engine without that flag (a DeepSpeed that has no direct
    backward). Holds the engine weakly."""
    ref = weakref.ref(engine)

    def inside() -> bool:
        e = ref()
        return e is None or bool(getattr(e, "_running_engine_backward", True))
    return inside


def _track_forward(engine) -> None:
    """Set ``engine._feplb_in_forward`` while ``engine.forward`` runs (once per engine)."""
    if getattr(engine, "_feplb_forward_tracked", False) or getattr(engine, "feplb_step_ends", None) is not None:
        return
    forward = engine.forward

    def tracked(*args, **kwargs):
        engine._feplb_in_forward = True
        try:
            return forward(*args, **kwargs)
        finally:
            engine._feplb_in_forward = False

    engine.forward = tracked
    engine._feplb_forward_tracked = True


def make_dropless_top1(gate):
    """DeepSpeed's dropless top-1 `TopKGate` becomes a `gate.top1.DroplessTop1Gate` in place
    (`become`); ValueError for any other gate."""
    from deepspeed_feplb.gate.top1 import DroplessTop1Gate
    if not DroplessTop1Gate.accepts(gate):
        raise ValueError(f"a DroplessTop1Gate is made from a dropless top-1 TopKGate, not {gate!r}")
    return become(gate, DroplessTop1Gate)


@contextlib.contextmanager
def gate_without_ep_group(gate):
    """Within the block DeepSpeed's ``TopKGate`` has no EP group: its dropless forward then skips
    the all-reduce of the largest expert count that sizes DeepSpeed's own dense dispatch (the
    gate reads ``ep_group`` at call time and takes no argument for it)."""
    group, gate.ep_group = gate.ep_group, None
    try:
        yield gate
    finally:
        gate.ep_group = group


@contextlib.contextmanager
def counting_slots(layer, num_experts: int, num_local_experts: int):
    """Within the block DeepSpeed's ``AutoEPMoELayer`` counts ``num_experts`` experts,
    ``num_local_experts`` per rank, into a fresh ``tokens_per_expert`` (its forward sizes its
    router, dispatch and counts from these attributes; it takes no argument for them); the
    layer's own attributes come back however the block ends."""
    import torch
    logical = layer.num_experts, layer.num_local_experts, layer.tokens_per_expert
    layer.num_experts, layer.num_local_experts = num_experts, num_local_experts
    layer.tokens_per_expert = torch.zeros(num_experts, dtype=logical[2].dtype, device=logical[2].device)
    try:
        yield
    finally:
        layer.num_experts, layer.num_local_experts, layer.tokens_per_expert = logical


def become(module, cls: type):
    """Make ``module`` an instance of ``cls`` (a subclass of its class that adds no ``__init__``
    state; the caller sets that up) without touching its parameters, buffers or hooks."""
    if not isinstance(module, cls.__mro__[1]):
        raise TypeError(f"{type(module).__name__} cannot become {cls.__name__}")
    module.__class__ = cls
    return module


def back_to(module, cls: type):
    """Undo `become`: ``module``, an instance of a subclass of ``cls``, is a ``cls`` again (the test
    harness's DeepSpeed reference copy of a FEPLB model)."""
    if not isinstance(module, cls):
        raise TypeError(f"{type(module).__name__} is not a {cls.__name__}")
    module.__class__ = cls
    return module


def dropless(gate) -> None:
    """DeepSpeed's ``TopKGate`` computes every routed token (it reads ``drop_tokens`` at call time;
    FEPLB is dropless, and DeepSpeed's dropless mode is the one FEPLB equals)."""
    gate.drop_tokens = False


@contextlib.contextmanager
def pipeline_engine_class(cls: type):
    """Within the block, ``deepspeed.initialize`` builds ``cls`` for a `PipelineModule`."""
    import deepspeed
    with _ENGINE_LOCK:
        saved = deepspeed.PipelineEngine
        deepspeed.PipelineEngine = cls
        try:
            yield
        finally:
            deepspeed.PipelineEngine = saved


def pipeline_instructions(overrides: dict) -> dict:
    """DeepSpeed's `PipelineEngine` instruction map (instruction type -> engine method, called with
    the engine first), updated with ``overrides``."""
    from deepspeed.runtime.pipe.engine import PipelineEngine
    return {**PipelineEngine._INSTRUCTION_MAP, **overrides}


def deepspeed_instruction(engine, instruction: str, *args):
    """Run DeepSpeed's own `PipelineEngine` method of ``instruction`` ("forward_pass",
    "backward_pass", "reduce_grads") on ``engine`` (looked up when called)."""
    from deepspeed.runtime.pipe.engine import PipelineEngine
    return getattr(PipelineEngine, f"_exec_{instruction}")(engine, *args)


def after_step(engine, callback: Callable[[bool], None]) -> None:
    """Call ``callback(was_boundary)`` after each ``engine.step()``; ``was_boundary`` is whether
    that step was a gradient-accumulation boundary (asked before the step, which advances it)."""
    step = engine.step

    def step_then_callback(*args, **kwargs):
        boundary = engine.is_gradient_accumulation_boundary()
        result = step(*args, **kwargs)
        callback(boundary)
        return result

    engine.step = step_then_callback


def around_forward(engine, before: Callable[[], None], after: Callable[[], None]) -> None:
    """Call ``before()`` when each ``engine.forward`` (``engine(...)``) begins, before the model
    runs, and ``after()`` once it has returned or raised. Relies on ``torch.nn.Module.__call__``
    looking ``forward`` up on the instance, as `step_ends` does."""
    forward = engine.forward

    def forward_between_callbacks(*args, **kwargs):
        before()
        try:
            return forward(*args, **kwargs)
        finally:
            after()

    engine.forward = forward_between_callbacks


def clip_fp32_gradients_with(engine, norms: Callable[[list], list]) -> None:
    """Make ``engine.step()`` clip fp32 gradients (ZeRO 0 without fp16/bf16) as DeepSpeed does, but
    with the per-parameter gradient norms ``norms(params)`` returns (0-dim float32 tensors, one per
    parameter of ``params``) in place of each parameter's own.

    Relies on `DeepSpeedEngine._take_model_step` calling ``self.clip_fp32_gradients()`` exactly in
    that case, and mirrors `deepspeed.runtime.utils.clip_grad_norm_` (norm type 2): each rank sums
    the squares of its parameters' norms (with a model-parallel ``mpu``: those of its
    model-parallel rank 0 or model-parallel parameters, summed over the model-parallel group),
    takes the root, and the data-parallel group *averages* these per-rank norms; every gradient is
    scaled by ``min(1, gradient_clipping / (norm + 1e-6))``.
    """
    import deepspeed.comm as ds_dist
    import torch
    from deepspeed.runtime.utils import is_model_parallel_parameter
    from deepspeed.utils import groups

    def clip_fp32_gradients() -> None:
        params = [p for p in engine.module.parameters() if p.grad is not None]
        mpu = engine.mpu
        if mpu is not None:
            counted = [p for p in params if mpu.get_model_parallel_rank() == 0 or is_model_parallel_parameter(p)]
        else:
            counted = params
        if counted:
            total = torch.stack(norms(counted)).pow(2.0).sum().float()
        else:
            total = torch.zeros(1, dtype=torch.float32, device=params[0].device if params else "cpu")
        if mpu is not None:
            ds_dist.all_reduce(total, op=ds_dist.ReduceOp.SUM, group=mpu.get_model_parallel_group())
        group = groups._get_data_parallel_group()
        total = total.pow(0.5) / float(ds_dist.get_world_size(group=group))
        ds_dist.all_reduce(total, group=group)
        if not params:
            return
        coefficient = torch.clamp(engine.gradient_clipping() / (total.to(params[0].device) + 1e-6), max=1.0)
        for p in params:
            p.grad.data.mul_(coefficient)

    engine.clip_fp32_gradients = clip_fp32_gradients


def has_fp32_fragments(param) -> bool:
    """Whether DeepSpeed's ZeRO 1/2 or bf16 optimizer keeps ``param``'s fp32 master and optimizer
    state in its flat partitions (its ``safe_get/set_full_*`` API then reads and writes them;
    else the torch optimizer's per-parameter state holds them). Relies on the private
    ``_hp_mapping`` those optimizers attach to each parameter."""
    return hasattr(param, "_hp_mapping")


def relink_optimizer_fragments(optimizer) -> None:
    """Point every parameter's ``_hp_mapping`` at the optimizer state tensors that exist now.

    Relies on ZeRO 1/2's and the bf16 optimizer's ``_lazy_init_hp_params_optimizer_state``, which
    links the fragments once, after the first step: a parameter group whose state the torch
    optimizer had not created by then (an expert group at its first step), or state that
    ``load_checkpoint`` replaced, leaves views that are missing or stale.
    """
    if hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()


def around_checkpoints(engine, saving: Callable[[], contextlib.AbstractContextManager],
                       loading: Callable[[], contextlib.AbstractContextManager]) -> None:
    """``engine.save_checkpoint(...)`` runs inside the context ``saving()`` returns,
    ``engine.load_checkpoint(...)`` inside the one ``loading()`` returns (both collective, as the
    wrapped calls)."""
    save, load = engine.save_checkpoint, engine.load_checkpoint

    def save_checkpoint(*args, **kwargs):
        with saving():
            return save(*args, **kwargs)

    def load_checkpoint(*args, **kwargs):
        with loading():
            return load(*args, **kwargs)

    engine.save_checkpoint, engine.load_checkpoint = save_checkpoint, load_checkpoint


@contextlib.contextmanager
def without_cpu_shm_op():
    """Within the block, DeepSpeed's CPU backend does not build its shared-memory allreduce op.

    Relies on `deepspeed.comm.torch.TorchBackend.__init__` calling the module-level
    ``build_shm_op()`` (a C++ build of minutes on first use, whose buffers stay in /dev/shm as
    ``deepspeed_allreduce_buffer_*`` after a normal exit); without it, collectives use gloo.
    """
    import importlib
    # `import deepspeed.comm.torch as m` would find torch (deepspeed.comm.torch is torch there)
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    with _ENGINE_LOCK:
        saved = ds_torch.build_shm_op
        ds_torch.build_shm_op = lambda: None
        try:
            yield
        finally:
            ds_torch.build_shm_op = saved


def data_parallel_group():
    """DeepSpeed's data-parallel group, or None before DeepSpeed made its groups (the whole world)."""
    from deepspeed.utils import groups
    try:
        return groups._get_data_parallel_group()
    except Exception:  # no DeepSpeed groups yet
        return None


def expert_data_parallel_group(ep_size: int):
    """The expert-data-parallel group of this rank's EP groups of ``ep_size`` ranks, or None when the
    groups were made outside DeepSpeed's registry."""
    from deepspeed.utils import groups
    try:
        return groups._get_expert_data_parallel_group(f"ep_size_{ep_size}")
    except (KeyError, AssertionError, RuntimeError):
        return None


def expert_parallel_group_names() -> list[str]:
    """The names (``ep_size_<n>``) of the expert-parallel groups DeepSpeed has made on this rank."""
    from deepspeed.utils import groups
    return list(groups._get_expert_parallel_group_dict())


def create_expert_parallel_groups(ep_size: int, pipeline_stages: int) -> None:
    """Make DeepSpeed's expert-parallel and expert-data-parallel groups of ``ep_size`` now (collective)."""
    from deepspeed.utils import groups
    groups._create_expert_and_data_parallel(ep_size, pp_size=pipeline_stages)
