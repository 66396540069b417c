"""Exact MILP oracle for one node's plan (HiGHS via ``highspy``), to measure how close the greedy
planner gets to optimal. Small instances only (variables grow as G * D * (G - 1)).

Model (same limits as :class:`deepspeed_feplb.plan.policy.PlanConstraints`, without chunk
alignment, so its optimum is a lower bound for any aligned plan)::

    minimise t
    x[r,d,j] integer in [0, c[r,d]]  tokens of rank r's d-th hottest expert computed on rank j != r
    y[r,d,j] binary                  rank j helps that expert (receives one weight copy)
    sum_j x[r,d,j] <= c[r,d];  x[r,d,j] <= c[r,d] * y[r,d,j];  sum_j y[r,d,j] <= max_helpers
    sum_{d,j} y[r,d,j] <= copies;  sum_{r,d} y[r,d,j] <= copies     (Copy-Engine budget)
    T_j - sum_{d,k} x[j,d,k] + sum_{r,d} x[r,d,j] <= t
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from deepspeed_feplb.plan.hottest import chosen_rows
from deepspeed_feplb.plan.policy import PlanConstraints

__all__ = ["OracleResult", "optimal_max_load", "require_highspy"]

# highspy is in the package's `test` extra; the package is installed from its checkout.
HIGHSPY_INSTALL = "pip install highspy (or pip install -e '.[test]' in the repository checkout)"


def require_highspy():
    """The ``highspy`` module; an ImportError that names the install command if it is missing."""
    try:
        import highspy
    except ImportError:
        raise ImportError(f"the MILP oracle needs highspy, which is not installed: {HIGHSPY_INSTALL}") from None
    return highspy


@dataclass(frozen=True)
class OracleResult:
    """max_load: best plan's largest rank load found; bound: proven lower bound on it (equal to
    max_load when ``optimal``); optimal: solved to proven optimality within the time limit."""

    max_load: float
    bound: float
    optimal: bool


def optimal_max_load(counts: np.ndarray, constraints: PlanConstraints, time_limit: float = 10.0) -> OracleResult:
    """counts int64 [G, E_local] -> the optimal largest per-rank load of any plan under
    ``constraints`` (alignment ignored)."""
    highspy = require_highspy()

    counts = np.asarray(counts, dtype=np.int64)
    G, E = counts.shape
    loads = counts.sum(axis=1).astype(np.float64)
    D = min(constraints.dynamic_experts, E)
    copies = constraints.copies_per_rank()
    if G <= 1 or D <= 0 or constraints.max_helpers <= 0 or copies <= 0 or loads.max() == 0:
        top = float(loads.max()) if G else 0.0
        return OracleResult(top, top, True)
    cand = constraints.chosen(counts)  # what the ranks publish: their D hottest, more above the mean
    c = chosen_rows(counts, cand).astype(np.float64)
    pairs = [(r, d, j) for r in range(G) for d in range(cand.shape[1]) for j in range(G) if j != r and c[r, d] > 0]
    P = len(pairs)
    n_col = 2 * P + 1  # x[0..P), y[P..2P), t
    t_col = 2 * P
    cost = np.zeros(n_col)
    cost[t_col] = 1.0
    lower = np.zeros(n_col)
    upper = np.empty(n_col)
    for k, (r, d, _) in enumerate(pairs):
        upper[k] = c[r, d]
        upper[P + k] = 1.0
    upper[t_col] = float(loads.max())
    rows = []  # (lower, upper, [(col, value)])
    by_rd = {}
    for k, (r, d, _) in enumerate(pairs):
        by_rd.setdefault((r, d), []).append(k)
        rows.append((-math.inf, 0.0, [(k, 1.0), (P + k, -c[r, d])]))
    for (r, d), ks in by_rd.items():
        rows.append((-math.inf, c[r, d], [(k, 1.0) for k in ks]))
        rows.append((-math.inf, float(constraints.max_helpers), [(P + k, 1.0) for k in ks]))
    if not math.isinf(copies):
        for g in range(G):
            rows.append((-math.inf, float(copies), [(P + k, 1.0) for k, p in enumerate(pairs) if p[0] == g]))
            rows.append((-math.inf, float(copies), [(P + k, 1.0) for k, p in enumerate(pairs) if p[2] == g]))
    for g in range(G):
        entries = [(k, -1.0) for k, p in enumerate(pairs) if p[0] == g]
        entries += [(k, 1.0) for k, p in enumerate(pairs) if p[2] == g]
        entries.append((t_col, -1.0))
        rows.append((-math.inf, -loads[g], entries))

    lp = highspy.HighsLp()
    lp.num_col_ = n_col
    lp.num_row_ = len(rows)
    lp.col_cost_ = cost
    lp.col_lower_ = lower
    lp.col_upper_ = upper
    lp.row_lower_ = np.array([r[0] for r in rows])
    lp.row_upper_ = np.array([r[1] for r in rows])
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    starts, index, value = [0], [], []
    for _, _, entries in rows:
        for col, v in entries:
            index.append(col)
            value.append(v)
        starts.append(len(index))
    lp.a_matrix_.start_ = np.array(starts, dtype=np.int32)
    lp.a_matrix_.index_ = np.array(index, dtype=np.int32)
    lp.a_matrix_.value_ = np.array(value)
    lp.integrality_ = [highspy.HighsVarType.kInteger] * (2 * P) + [highspy.HighsVarType.kContinuous]
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("threads", 1)
    h.setOptionValue("mip_rel_gap", 0.0)
    h.passModel(lp)
    h.run()
    status = h.getModelStatus()
    info = h.getInfo()
    best = float(info.objective_function_value) if info.primal_solution_status else float(loads.max())
    bound = float(info.mip_dual_bound)
    optimal = status == highspy.HighsModelStatus.kOptimal
    if optimal:
        bound = best
    return OracleResult(best, min(bound, best), optimal)
