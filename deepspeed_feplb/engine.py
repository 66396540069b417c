"""`convert` and `initialize`: FEPLB for models that use DeepSpeed's MoE layer."""
from __future__ import annotations

import inspect

import deepspeed
from deepspeed.moe.layer import MoE as DeepSpeedMoE

from deepspeed_feplb.config import FEPLBConfig, load_config
from deepspeed_feplb.layer import MoE


def convert(model, feplb_config=None):
    """Swap every `deepspeed.moe.layer.MoE` in ``model`` for `deepspeed_feplb.MoE`, in place.

    Weights, parameter objects and names stay as they are (an optimizer built before keeps
    working). ``feplb_config``: a `FEPLBConfig`, a ``"feplb"`` dict or a ds_config; None lets each
    layer find the engine's section or use the defaults. Returns ``model``.
    """
    for module in model.modules():
        if isinstance(module, DeepSpeedMoE) and not isinstance(module, MoE):
            MoE.from_deepspeed(module, feplb_config)
        elif isinstance(module, MoE) and feplb_config is not None:
            module.deepspeed_moe.feplb_setup(feplb_config)
    return model


def initialize(*args, **kwargs):
    """`deepspeed.initialize` with FEPLB: same arguments, same return.

    Reads and validates the ``"feplb"`` section of the ds_config (`FEPLBConfigError` names a bad
    key), converts the model's MoE layers and hands everything to DeepSpeed.
    """
    bound = inspect.signature(deepspeed.initialize).bind(*args, **kwargs)
    given = bound.arguments
    ds_config = given.get("config") or given.get("config_params")
    if ds_config is None and getattr(given.get("args"), "deepspeed_config", None):
        ds_config = given["args"].deepspeed_config
    if given.get("model") is None:
        raise TypeError("deepspeed_feplb.initialize: a model is required (as for deepspeed.initialize)")
    convert(given["model"], load_config(ds_config) if ds_config is not None else FEPLBConfig())
    return deepspeed.initialize(*bound.args, **bound.kwargs)
