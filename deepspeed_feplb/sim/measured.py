"""The time model against a real run: a recorded trace's own plans replayed through `plan.timeline`.

A trace that FEPLB recorded (`trace.record`) holds, per micro-batch and layer, the routes, the
runtime's plan (``plan_moves``) and each rank's measured expert-stage time (``stage_us``: forward
and backward, and the piece and row costs its planner had fitted). For every (micro-batch, layer,
domain) where every rank of the domain was measured, `compare_measured` predicts the domain's
makespan with the time model (`timeline.rank_finish_us`: the same evaluation the planner
minimises) and sets it beside the measured one: the slowest rank's forward stage time plus the
slowest rank's backward stage time (each ends in an all-to-all that waits for every rank).
The compute costs come from the cost profile (what the simulator uses for other machines), or,
with ``recorded_costs``, from the domain's own fits as its planner had them at that micro-batch
(`expert_costs.ComputeTimes.fitted_us`: the costs of a piece and of a row, forward and backward,
fitted from earlier micro-batches; the medians over the domain's ranks), the plan's latency of
the micro-batch before (what the runtime knew then; with ``own_plan_latency`` its own), the
message latency the domain's transport
measured (traces with a 7th column) and the forward's share of the stage its planner had measured
(an 8th): the check then tests how the model composes them.
``sends_after_static``: the run's homes sent their chunks only after their static experts
(`TimeModel.sends_after_static`: a grouped static call on CPU ranks); otherwise as soon as the
plan was in hand, which is what the runtime does between its static experts' calls.
This is what "how far to trust the simulator" rests on.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import numpy as np

from deepspeed_feplb.plan.timeline import TimeModel, makespan_us, rank_finish_us
from deepspeed_feplb.trace.format import Trace

__all__ = ["compare_measured", "cpu_share", "errors", "over_ideal", "predicted_and_measured"]

MESSAGE_US, FORWARD_SHARE = 6, 7  # columns of a recorded trace's ``stage_us`` (`trace.format`)


def predicted_and_measured(trace: Trace, model: TimeModel, ranks_per_node: int, skip_steps: int = 1,
                           recorded_costs: bool = False, sends_after_static: bool = False,
                           dynamic_experts: int = 0, recorded_message_us: bool = True,
                           own_plan_latency: bool = False) -> np.ndarray:
    """float64 [K, 7] = (micro_batch, layer, domain, predicted µs, measured µs, ideal µs, measured mean
    µs) for every domain of every
    measured micro-batch after the first ``skip_steps`` (whose stages pay first calls and
    allocations). ``ranks_per_node``: the recorded run's domain size; ``recorded_costs``: the costs
    of a piece and of a row are the domain's recorded fits, the plan's latency the previous
    micro-batch's, and (``recorded_message_us``) the message latency the domain's transport
    measured where the trace holds it (module docstring); the rest is ``model``'s;
    ``own_plan_latency``: the plan arrives when it did in that micro-batch, not when the previous
    one's did (the planner's view): this leaves out how far one micro-batch's plan latency foretells
    the next one's, so that only the model's composition is checked. ``dynamic_experts``: the run's D
    (each rank's D hottest experts wait for the plan; where its ranks at or below their domain's mean
    chose none, `PlanConstraints.senders_only`, those ranks ran every expert at once, which the
    makespan does not see: its slowest rank is above the mean). A trace recorded before 2026-12-02 (5
    columns of ``stage_us``) has a probe's cost where the fitted piece cost is now and the planning
    time where the plan's arrival is: its pieces cost nothing and its plan latency is 0, as its
    planner had them. The ideal (`over_ideal`) is the domain's rows computed at home, spread evenly
    over its ranks, under the same costs; the measured mean is the mean over its ranks of each
    rank's forward + backward stage time."""
    if trace.stage_us is None or trace.plan_moves is None:
        raise ValueError("the trace holds no runtime record (plan_moves, stage_us): record it with a FEPLB run's "
                         "feplb.stats.record_trace")
    ranks, experts = trace.src_ranks, trace.experts
    if ranks % ranks_per_node or experts % ranks:
        raise ValueError(f"{ranks} recorded ranks, {experts} experts: --ranks-per-node {ranks_per_node} must divide "
                         "the ranks, and the ranks the experts")
    per_rank = experts // ranks
    forward, backward = trace.stage_us[..., 0], trace.stage_us[..., 1]  # [micro_batches, layers, ranks]
    moves = trace.plan_moves
    model = replace(model, sends_after_static=sends_after_static)
    current = trace.stage_us.shape[-1] >= 6  # an older record means other things by columns 2 and 3
    out = []
    for step in range(skip_steps, trace.steps):
        for layer in range(trace.layers):
            received = trace.counts[step, layer].sum(axis=0).reshape(ranks, per_rank)
            here = moves[(moves[:, 0] == step) & (moves[:, 1] == layer)]
            for domain, first in enumerate(range(0, ranks, ranks_per_node)):
                ranks_here = slice(first, first + ranks_per_node)
                measured = np.stack([forward[step, layer, ranks_here], backward[step, layer, ranks_here]])
                if not np.isfinite(measured).all():
                    continue
                here_model = model
                if recorded_costs:
                    piece_us, row_us = np.median(trace.stage_us[step, layer, ranks_here, 3:5], axis=0)
                    piece_us = piece_us if current else 0.0
                    if not np.isfinite(row_us) or not np.isfinite(piece_us):
                        continue
                    plan_step = step if own_plan_latency else step - 1
                    plan_us = np.median(trace.stage_us[plan_step, layer, ranks_here, 2]) \
                        if plan_step >= 0 and current else 0
                    here_model = replace(model, tile_rows=1, piece_us=float(piece_us), row_us=float(row_us),
                                         piece_floor_us=0.0,  # the runtime's fit has none
                                         plan_us=float(plan_us) if np.isfinite(plan_us) else 0.0)
                    message_us = _recorded(trace.stage_us[step, layer, ranks_here], MESSAGE_US) \
                        if recorded_message_us else None
                    if message_us is not None:
                        here_model = replace(here_model, message_us=message_us)
                    share = _recorded(trace.stage_us[step, layer, ranks_here], FORWARD_SHARE)
                    if share is not None:
                        here_model = replace(here_model, forward_share=share)
                mine = here[(here[:, 3] >= first) & (here[:, 3] < first + ranks_per_node)]
                local = np.column_stack([mine[:, 3] - first, mine[:, 2] % per_rank, mine[:, 4] - first,
                                         mine[:, 5]]).astype(np.int64).reshape(-1, 4)
                finish = rank_finish_us(received[ranks_here], local, here_model,
                                        fresh=mine[:, 6].astype(bool), dynamic_experts=dynamic_experts)
                at_home = rank_finish_us(received[ranks_here], np.zeros((0, 4), np.int64), here_model)
                out.append((step, layer, domain, makespan_us(finish), makespan_us(measured),
                            float(at_home.sum(axis=0).mean()), float(measured.sum(axis=0).mean())))
    return np.array(out, np.float64).reshape(-1, 7)


def over_ideal(rows: np.ndarray) -> dict:
    """A recorded run's expert-stage time over the ideal, measured, from `predicted_and_measured`
    rows ``[K, 7]`` (means over them, µs): ``measured_time_us`` (the slowest rank's forward plus the
    slowest's backward), ``ideal_time_us`` (every rank at the domain's mean rows, computed at home
    under the rows' costs: no pieces split, no transfer), ``time_over_ideal``, and the measured
    excess split into ``imbalance_us`` (the measured time less the ranks' mean stage time: what
    the slowest rank took longer) and ``rest_us`` (that mean less the ideal: extra pieces, copies
    and messages not hidden, the stage's host work)."""
    if not len(rows):
        raise ValueError("no micro-batch of the trace has every rank's stage time measured")
    measured, ideal, mean = rows[:, 4].mean(), rows[:, 5].mean(), rows[:, 6].mean()
    return {"measured_time_us": float(measured), "ideal_time_us": float(ideal),
            "time_over_ideal": float(measured / ideal) if ideal > 0 else float("nan"),
            "imbalance_us": float(measured - mean), "rest_us": float(mean - ideal), "micro_batches": int(len(rows))}


def compare_measured(trace: Trace, model: TimeModel, ranks_per_node: int, skip_steps: int = 1,
                     recorded_costs: bool = False, sends_after_static: bool = False, dynamic_experts: int = 0,
                     recorded_message_us: bool = True, own_plan_latency: bool = False) -> dict:
    """``{"median_abs_rel_error", "p90_abs_rel_error", "median_rel_error", "micro_batches"}`` of the
    predicted against the measured makespan (`predicted_and_measured`); the signed median says
    whether the model runs fast (< 0) or slow."""
    return errors(predicted_and_measured(trace, model, ranks_per_node, skip_steps, recorded_costs,
                                         sends_after_static, dynamic_experts, recorded_message_us,
                                         own_plan_latency))


def errors(rows: np.ndarray) -> dict:
    """`compare_measured`'s figures of `predicted_and_measured` rows ``[K, 7]``."""
    if not len(rows):
        raise ValueError("no micro-batch of the trace has every rank's stage time measured")
    relative = (rows[:, 3] - rows[:, 4]) / rows[:, 4]
    return {"median_abs_rel_error": float(np.median(np.abs(relative))),
            "p90_abs_rel_error": float(np.percentile(np.abs(relative), 90)),
            "median_rel_error": float(np.median(relative)), "micro_batches": int(len(rows))}


def _recorded(stage_us: np.ndarray, column: int) -> Optional[float]:
    """The median over a domain's ranks at one micro-batch (``stage_us`` ``[G, C]``) of a figure each
    recorded (`MESSAGE_US`: alike on every rank; `FORWARD_SHARE`: each rank's own, as the piece and
    row costs), or None where the trace lacks the column or no rank has it."""
    if stage_us.shape[-1] <= column:
        return None
    figures = stage_us[:, column][np.isfinite(stage_us[:, column])]
    return float(np.median(figures)) if figures.size else None


def cpu_share(trace: Trace, skip_steps: int = 1) -> Optional[float]:
    """The median over ranks and measured micro-batches (after the first ``skip_steps``) of the
    CPU time a rank's process used during its stage over the stage's wall time, or None when the
    trace does not hold it. About 1 where each rank had its own core; on an oversubscribed host
    (more busy threads than cores) well below: the ranks then did not run side by side, which the
    time model assumes (each rank owns its processor, as each GPU does)."""
    if trace.stage_us is None or trace.stage_us.shape[-1] < 6:
        return None
    stage = trace.stage_us[skip_steps:]
    share = stage[..., 5] / (stage[..., 0] + stage[..., 1])
    share = share[np.isfinite(share)]
    return float(np.median(share)) if share.size else None
