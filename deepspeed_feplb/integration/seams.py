"""Every place where FEPLB reaches into DeepSpeed without a supported extension point, in one file.

DeepSpeed 0.19 offers no hook for any of these; each function says what it relies on, so a
DeepSpeed upgrade that breaks one breaks it here (and `tests/test_dropin.py`,
`tests/test_pipeline*.py`, `tests/test_autoep.py` and `tests/test_monitor.py` catch it).

* `engine_feplb_section`: a layer under a plain ``deepspeed.initialize`` finds the engine's
  ``"feplb"`` section while the engine configures it (DeepSpeed passes no config to modules).
* `become`: turn an existing module into a FEPLB subclass in place (DeepSpeed builds its MoE and
  AutoEP modules itself; replacing them would lose parameter identity, names and ZeRO hooks).
* `pipeline_engine_class`: make ``deepspeed.initialize`` build our `PipelineEngine` subclass
  (it looks the class up as ``deepspeed.PipelineEngine`` at call time and takes no argument).
* `after_step`: run a callback after every ``engine.step()`` (DeepSpeed has no step hook).
"""
from __future__ import annotations

import contextlib
import inspect
import threading
from typing import Callable, Optional

_ENGINE_LOCK = threading.Lock()


def engine_feplb_section(depth: int = 4) -> Optional[dict]:
    """``{"feplb": section}`` of the DeepSpeed engine that is configuring the caller, or None.

    Relies on `DeepSpeedEngine._configure_distributed_model` calling
    ``module.set_deepspeed_parallelism()`` on every MoE module, with the engine (whose ``config``
    is the user's ds_config dict) a few frames up the stack.
    """
    frame = inspect.currentframe()
    try:
        for _ in range(depth):
            frame = frame.f_back
            if frame is None:
                return None
            engine = frame.f_locals.get("self")
            config = getattr(engine, "config", None)
            if type(engine).__name__.endswith("Engine") and isinstance(config, dict):
                return {"feplb": config.get("feplb", {})}
        return None
    finally:
        del frame


def become(module, cls: type):
    """Make ``module`` an instance of ``cls`` (a subclass of its class that adds no ``__init__``
    state; the caller sets that up) without touching its parameters, buffers or hooks."""
    if not isinstance(module, cls.__mro__[1]):
        raise TypeError(f"{type(module).__name__} cannot become {cls.__name__}")
    module.__class__ = cls
    return module


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
