"""deepspeed_feplb: per-micro-batch MoE load balancing for DeepSpeed (FEPLB, arXiv 2604.19654).

Light to import: the planner, simulator and config need no torch; the layer and the engine
helpers (which import DeepSpeed) load on first use.
"""
from deepspeed_feplb.config import FEPLBConfig, FEPLBConfigError, FEPLBModelError, load_config

__all__ = ["FEPLBConfig", "FEPLBConfigError", "FEPLBModelError", "load_config", "MoE", "convert", "initialize",
           "init_distributed", "shutdown", "canonical_experts", "weights_changed"]
__version__ = "0.1.0"

_LAZY = {"MoE": "deepspeed_feplb.integration.deepspeed_moe", "convert": "deepspeed_feplb.integration.engine",
         "initialize": "deepspeed_feplb.integration.engine", "init_distributed": "deepspeed_feplb.integration.engine",
         "shutdown": "deepspeed_feplb.domain", "canonical_experts": "deepspeed_feplb.integration.placement_engine",
         "weights_changed": "deepspeed_feplb.weight_watch"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'deepspeed_feplb' has no attribute {name!r}")
