"""Pure policy: what to move, decided from counts. numpy and numba only (no torch, no I/O).

* `policy`: per micro-batch, one NVLink domain's counts -> a `Plan` of moves (`plan_domain`), the
  limits it obeys (`PlanConstraints`, built from the ``"feplb"`` section by `from_config`), the
  dynamic-expert rule (`dynamic_candidates`) and the lower bound.
* `placement`: across domains, which rank hosts which expert (DeepSeek-EPLB-style packing and
  the cross-node placer).
* `timeline`: the time model of a micro-batch (GEMMs, weight and row copies, arrival times),
  shared by the planner (it minimises the makespan) and the simulator.
* `residency`: which helper holds which expert's weights during an optimizer step.
* `cost`: the simulator's hardware profiles and GEMM cost (tile-quantised).
"""
from deepspeed_feplb.plan.policy import Plan, PlanConstraints, dynamic_candidates, empty_plan, lower_bound, plan_domain

__all__ = ["Plan", "PlanConstraints", "dynamic_candidates", "empty_plan", "lower_bound",
           "plan_domain"]
