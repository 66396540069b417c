"""Testing helpers for users and for our own suite (docs/TESTING.md).

* run code on N CPU ranks with gloo: `run_distributed` (and the pytest plugin
  ``deepspeed_feplb.testing.plugin``: ``@pytest.mark.feplb_ranks(N)``, fixture ``feplb_run``);
* routing overrides: `override_routing` with `TraceRouting`, `zipf_routing`, `dirichlet_routing`,
  `one_hot_expert_routing`, `uniform_routing` or your own function;
* assertions: `assert_same_on_all_ranks`, `assert_equal_to_unbalanced`; `distinct_experts` (DeepSpeed
  starts every expert as a copy of one module: give each its own weights so that tests can see
  a token computed by the wrong expert).

The launcher needs only the standard library; the rest (torch, DeepSpeed) loads on first use.
"""
from deepspeed_feplb.testing.launcher import RankFailed, RankSkipped, free_port, run_distributed

_LAZY = {
    **{name: "deepspeed_feplb.testing.routing" for name in (
        "RouteRequest", "RoutingSource", "TraceRouting", "SampledRouting", "zipf_routing", "dirichlet_routing",
        "one_hot_expert_routing", "uniform_routing", "RoutedGate", "RoutingOverride", "override_routing",
        "assign_counts", "scale_counts", "example_trace_path", "EXAMPLE_TRACE")},
    **{name: "deepspeed_feplb.testing.asserts" for name in (
        "assert_same_on_all_ranks", "assert_equal_to_unbalanced", "relative_error", "distinct_experts",
        "experts_in_one_buffer")},
}

__all__ = ["free_port", "run_distributed", "RankFailed", "RankSkipped", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'deepspeed_feplb.testing' has no attribute {name!r}")
