"""Expert compute with FEPLB phase 2, shared by every layer kind (DeepSpeed-MoE and AutoEP).

`run_experts` takes one micro-batch's rows grouped by local expert and their counts, publishes
the counts to the domain's scheduler, computes the static experts while it plans, and runs the
dynamic experts through `Phase2Step` / `DynamicExperts` (rows and weights to helpers of the
NVLink domain, gradients home in backward). The caller says how to run one expert
functionally (a module per local expert as template, its parameters, an `ExpertSpec`) and may
give a faster compute for the static experts (e.g. AutoEP's grouped GEMM).
"""
from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from deepspeed_feplb.config import FEPLBConfig
from deepspeed_feplb.migrate.phase2 import DynamicExperts, ExpertSpec, Phase2Step
from deepspeed_feplb.planner.policy import PlanConstraints, dynamic_candidates
from deepspeed_feplb.planner.service import ce_budget_bytes
from deepspeed_feplb.stats import layer_stats

# static_fn(rows, counts, static) -> outputs of the experts in ``static`` (local ids, ascending),
# concatenated in expert order; ``rows``/``counts`` are the whole micro-batch.
StaticFn = Callable[[torch.Tensor, np.ndarray, list], torch.Tensor]


def run_experts(rows: torch.Tensor, counts: np.ndarray, modules: Sequence[torch.nn.Module],
                params: list[list[torch.Tensor]], spec: ExpertSpec, domain, config: FEPLBConfig, expert_bytes: int,
                static_seconds: float, static_fn: Optional[StaticFn] = None) -> tuple[torch.Tensor, Optional[dict], float]:
    """rows ``[N, H]`` grouped by local expert, counts ``int64 [E_local]`` -> (outputs ``[N, H]``,
    stats or None when ``config.stats`` is off, measured static-compute seconds).

    modules[e] runs expert e functionally with ``params[e]`` (named ``spec.param_names``) and its
    own buffers; ``domain`` is this rank's `DomainRuntime`; ``static_seconds`` the previous
    micro-batch's static time (it sizes the copy-engine budget of the plan).
    """
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    seq = domain.next_seq()
    constraints = PlanConstraints(
        dynamic_experts=config.dynamic_experts_per_rank, max_helpers=config.max_helpers_per_expert,
        chunk_align=config.chunk_align_tokens, expert_bytes=expert_bytes,
        ce_budget_bytes=ce_budget_bytes(config.ce_budget, config.copy_engine_gbps, static_seconds))
    domain.scheduler.publish(seq, counts, constraints)

    dynamic = [int(e) for e in dynamic_candidates(counts[None], config.dynamic_experts_per_rank)[0]]
    static = [e for e in range(len(modules)) if e not in dynamic]
    outs: list = [None] * len(modules)
    start = time.perf_counter()
    if static_fn is not None:
        static_y = static_fn(rows, counts, static)
        for e, y in zip(static, static_y.split([int(counts[e]) for e in static])):
            outs[e] = y
    else:
        for e in static:
            outs[e] = spec.call(modules[e], params[e], spec.buffers(modules[e]), rows[starts[e]:starts[e + 1]])
    static_seconds = time.perf_counter() - start

    moves, node_counts, plan_seconds, fallback = domain.scheduler.plan(seq)
    needs_grad = torch.is_grad_enabled() and (rows.requires_grad or any(p.requires_grad for p in params[0]))
    step = Phase2Step(domain.transport, seq, domain.local_rank, moves, dynamic, [int(counts[e]) for e in dynamic],
                      list(modules), spec, needs_grad)
    dyn_x = torch.cat([rows[starts[e]:starts[e + 1]] for e in dynamic]) if dynamic else rows[:0]
    dyn_y = DynamicExperts.apply(step, len(spec.param_names), dyn_x, *[p for e in dynamic for p in params[e]])
    for e, y in zip(dynamic, dyn_y.split([int(counts[e]) for e in dynamic])):
        outs[e] = y
    stats = None
    if config.stats.enabled:
        stats = {**layer_stats(node_counts, moves, plan_seconds, fallback, domain.ranks), "node_counts": node_counts,
                 "seq": seq}
    return torch.cat(outs), stats, static_seconds
