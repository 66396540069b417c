"""Replay a routing trace through the balancing policies and measure stragglers (docs/ARCHITECTURE.md, "Metrics").

Per (micro-batch, layer) and policy: ``T_r`` tokens each rank computes, token straggler
``max T - mean T``, ``max/mean``, GEMM straggler from the cost model (:mod:`.cost`), and for the
intra-node policies the gap to the lower bound and Copy-Engine time vs static time.

Time (`plan.timeline`, forward + backward): ``expert_time_us`` is the makespan of the expert
stage, the slowest rank's forward plus the slowest rank's backward, with every weight and row
copy, arrival and gradient return the policy causes; ``copy_exposed_us`` what the copies add to
it; ``weight_bytes_per_step`` and ``grad_bytes_per_step`` the expert weights and weight-gradients
copied per optimizer step (``SimSetup.micro_batches_per_step`` micro-batches) and layer.
``expert_time_us`` includes the transfer time of re-placements (EPLB's, feplb's cross-node
layer), added to the micro-batch that ends the step where they happen; ``placement_us`` is that
time alone (mean per micro-batch).

The ideal (`ideal_time_us`, the same for every policy): per micro-batch and layer, the mean over
the EP group of vanilla's per-rank compute time under the time model (`policies.pieces_us`:
every rank computing the mean of the experts' pieces and rows, forward + backward), i.e. a layer
balanced perfectly with no transfer. ``time_over_ideal`` is ``expert_time_us / ideal_time_us``
(ratio of the means), and the excess over the ideal splits into (means, µs):
``excess_pieces_us`` (the policy's mean per-rank compute less the ideal: pieces its splitting
added), ``excess_imbalance_us`` (its slowest rank's compute less the mean: imbalance left),
``copy_exposed_us`` (copies the compute does not hide) and ``excess_other_us`` (the rest: message
latency, gradient returns, forward and backward slowest on different ranks, re-placements).
With more than one micro-batch per step, ``time_over_ideal_by_step_position`` is the same ratio
for each position in the optimizer step (the first makes the step's weight copies; at the last
the kept copies return their gradients).

Averages: every "mean" is over all (micro-batch, layer) pairs; ``reduction_vs_vanilla`` is
``1 - mean straggler(policy) / mean straggler(vanilla)`` (ratio of the means), for tokens and
for GEMM time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Optional

import numpy as np

from deepspeed_feplb.plan.cost import rank_gemm_us
from deepspeed_feplb.trace.format import Trace, fold_sources

from .policies import SimSetup, make_policy, pieces_us

__all__ = ["PolicyRun", "SimResult", "simulate"]

_TIMING_KEYS = ("expert_us", "exposed_us", "weight_bytes", "grad_bytes", "placement_us")  # the rows of PolicyRun's time


@dataclass
class PolicyRun:
    """Per-micro-batch arrays of one policy. rank_rows int64 [micro_batches, layers, R];
    gemm_us float64 [micro_batches, layers, R]; lower_bound float [micro_batches, layers] (nan if none);
    ce_us, exposed_us, static_us float [micro_batches, layers] (nan if none);
    moves int64 [M, 6] = (micro_batch, layer, expert, home, helper, tokens) or None."""

    name: str
    rank_rows: np.ndarray
    gemm_us: np.ndarray
    lower_bound: np.ndarray
    ce_us: np.ndarray
    exposed_us: np.ndarray
    static_us: np.ndarray
    moves: Optional[np.ndarray]
    summary: dict = field(default_factory=dict)
    expert_us: Optional[np.ndarray] = None  # float [micro_batches, layers]: makespan, fwd + bwd with copies
    copy_exposed_us: Optional[np.ndarray] = None  # float [micro_batches, layers]
    weight_bytes: Optional[np.ndarray] = None  # int64 [micro_batches, layers]: weights copied
    grad_bytes: Optional[np.ndarray] = None  # int64 [micro_batches, layers]: weight-gradients copied
    placement_us: Optional[np.ndarray] = None  # float [micro_batches, layers]: re-placement transfers (in expert_us)
    micro_batches_per_step: int = 1
    compute_us: Optional[np.ndarray] = None  # float [micro_batches, layers, R]: each rank's compute, no transfers
    ideal_us: Optional[np.ndarray] = None  # float [micro_batches, layers]: the module docstring's ideal

    def over_ideal(self) -> dict:
        """``ideal_time_us``, ``time_over_ideal`` and the excess split (module docstring; the
        exposed copies are ``copy_exposed_us`` of `metrics`); {} where the run has no expert time."""
        if self.expert_us is None or self.ideal_us is None or self.compute_us is None:
            return {}
        ideal, slowest, mean = self.ideal_us.mean(), self.compute_us.max(axis=-1), self.compute_us.mean(axis=-1)
        out = {"ideal_time_us": float(ideal),
               "time_over_ideal": float(self.expert_us.mean() / ideal) if ideal > 0 else math.nan,
               "excess_pieces_us": float((mean - self.ideal_us).mean()),
               "excess_imbalance_us": float((slowest - mean).mean()),
               "excess_other_us": float((self.expert_us - slowest - self.copy_exposed_us).mean())}
        M = self.micro_batches_per_step
        position = np.arange(self.expert_us.shape[0]) % M
        if M > 1 and ideal > 0:  # a step's first micro-batch makes its copies, its last returns their gradients
            out["time_over_ideal_by_step_position"] = [
                float(self.expert_us[position == p].mean() / self.ideal_us[position == p].mean())
                for p in range(min(M, self.expert_us.shape[0]))]
        return out

    @property
    def token_straggler(self) -> np.ndarray:
        return self.rank_rows.max(axis=-1) - self.rank_rows.mean(axis=-1)

    @property
    def gemm_straggler(self) -> np.ndarray:
        return self.gemm_us.max(axis=-1) - self.gemm_us.mean(axis=-1)

    def metrics(self, vanilla: Optional["PolicyRun"]) -> dict:
        T = self.rank_rows.astype(np.float64)
        mean = T.mean(axis=-1)
        tok = self.token_straggler
        gem = self.gemm_straggler
        out = {
            "token_straggler": float(tok.mean()),
            "token_straggler_p99": float(np.percentile(tok, 99)),
            "token_max_over_mean": float((T.max(axis=-1) / np.maximum(mean, 1e-12)).mean()),
            "gemm_straggler_us": float(gem.mean()),
            "gemm_max_us": float(self.gemm_us.max(axis=-1).mean()),
        }
        if vanilla is not None:
            vt, vg = vanilla.token_straggler.mean(), vanilla.gemm_straggler.mean()
            out["reduction_vs_vanilla"] = float(1 - tok.mean() / vt) if vt > 0 else 0.0
            out["gemm_reduction_vs_vanilla"] = float(1 - gem.mean() / vg) if vg > 0 else 0.0
        if not np.all(np.isnan(self.lower_bound)):
            gap = (T.max(axis=-1) - self.lower_bound) / np.maximum(mean, 1e-12)
            out["lower_bound_gap_pct"] = float(100 * np.nanmean(gap))
            out["within_1pct_of_bound"] = float(np.nanmean(gap <= 0.01))
        if self.expert_us is not None:
            S, L = self.expert_us.shape
            steps = -(-S // self.micro_batches_per_step)
            out["expert_time_us"] = float(self.expert_us.mean())
            out["copy_exposed_us"] = float(self.copy_exposed_us.mean())
            out["weight_bytes_per_step"] = float(self.weight_bytes.sum() / (steps * L))
            out["grad_bytes_per_step"] = float(self.grad_bytes.sum() / (steps * L))
            if self.placement_us is not None:
                out["placement_us"] = float(self.placement_us.mean())
            out.update(self.over_ideal())
        if not np.all(np.isnan(self.ce_us)):
            out["ce_us"] = float(np.nanmean(self.ce_us))
            out["static_us"] = float(np.nanmean(self.static_us))
            out["ce_exposed_us"] = float(np.nanmean(self.exposed_us))
            out["ce_hidden_fraction"] = float(np.nanmean(self.exposed_us <= 0))
        out.update(self.summary)
        return out


@dataclass
class SimResult:
    setup: SimSetup
    runs: dict  # name -> PolicyRun

    def metrics(self) -> dict:
        vanilla = self.runs.get("vanilla")
        return {name: run.metrics(vanilla) for name, run in self.runs.items()}


def simulate(trace: Trace, setup: SimSetup, policies: Iterable[str], progress: bool = False,
             keep_moves: bool = False) -> SimResult:
    """Run every policy over every (micro-batch, layer) of ``trace``. ``vanilla`` is always included
    (reductions are relative to it). ``progress`` shows a tqdm bar."""
    setup.check()
    if trace.experts != setup.experts:
        raise ValueError(f"trace has {trace.experts} experts, setup {setup.experts}")
    names = list(dict.fromkeys(["vanilla", *policies]))
    src = fold_sources(trace.counts, setup.ranks)  # [S, L, R, E]
    S, L, R, _ = src.shape
    objs = {n: make_policy(n, setup, L) for n in names}
    shape = (S, L, R)
    data = {n: {"tok": np.zeros(shape, np.int64), "gemm": np.zeros(shape), "lb": np.full((S, L), np.nan),
                "ce": np.full((S, L), np.nan), "exp": np.full((S, L), np.nan), "st": np.full((S, L), np.nan),
                "moves": [], "time": np.zeros((5, S, L)), "compute": np.zeros(shape)} for n in names}
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=S * L * len(names), desc="simulate", unit="mb", leave=False)
    for s in range(S):
        for layer in range(L):
            x = src[s, layer]
            for n in names:
                res = objs[n].step(s, layer, x)
                d = data[n]
                d["tok"][s, layer] = np.bincount(res.piece_rank, weights=res.piece_tokens, minlength=R).astype(np.int64)
                d["gemm"][s, layer] = rank_gemm_us(res.piece_rank, res.piece_tokens, R, setup.shape, setup.profile)
                d["compute"][s, layer] = pieces_us(res.piece_rank, res.piece_tokens, R, setup.time_model)
                timing = res.timing or {"expert_us": float(d["compute"][s, layer].max())}
                d["time"][:, s, layer] = [timing.get(k, 0) for k in _TIMING_KEYS]
                if res.lower_bound is not None:
                    d["lb"][s, layer] = res.lower_bound
                if res.ce is not None:
                    d["ce"][s, layer] = res.ce["ce_us"]
                    d["exp"][s, layer] = res.ce["exposed_us"]
                    d["st"][s, layer] = res.ce["static_us"]
                if keep_moves and res.moves is not None and len(res.moves):
                    m = res.moves
                    d["moves"].append(np.concatenate([np.full((len(m), 1), s), np.full((len(m), 1), layer), m], axis=1))
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    runs = {}
    ideal = data["vanilla"]["compute"].mean(axis=-1)
    for n in names:
        d = data[n]
        moves = np.concatenate(d["moves"]).astype(np.int64) if d["moves"] else np.zeros((0, 6), np.int64)
        t = d["time"]
        runs[n] = PolicyRun(n, d["tok"], d["gemm"], d["lb"], d["ce"], d["exp"], d["st"],
                            moves if keep_moves else None, objs[n].summary(), t[0], t[1],
                            t[2].astype(np.int64), t[3].astype(np.int64), t[4], setup.micro_batches_per_step,
                            d["compute"], ideal)
    return SimResult(setup, runs)
