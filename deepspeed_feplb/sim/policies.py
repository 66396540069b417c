"""Balancing policies the simulator compares (docs/ARCHITECTURE.md, "Simulator").

Each policy turns one (micro-batch, layer)'s per-source expert counts into the *expert pieces* every rank
computes: ``(piece_rank int64 [P], piece_tokens int64 [P])``; the cost model prices each piece
(tile-quantised GEMM) and the metrics sum them per rank. Stateful policies (EPLB, the cross-node
layer) only look at past steps.

* ``vanilla``     every expert computed at home (contiguous placement).
* ``fastermoe``   FasterMoE dynamic shadowing (PPoPP'22): shadow the globally hottest experts while
                  its cost model says the drop in the hottest expert's latency pays for broadcasting
                  one more expert; a shadowed expert's tokens are computed on their source rank.
* ``eplb``        DeepSeek EPLB: redundant experts placed from a moving average of past loads,
                  refreshed every ``eplb_interval`` steps; a replicated expert's tokens are split
                  evenly over its replicas.
* ``feplb-paper`` the FEPLB paper's planner: whole dynamic experts, greedy most-loaded rank ->
                  its busiest dynamic expert -> least-loaded rank of the node.
* ``feplb``       ours: :func:`deepspeed_feplb.plan.policy.plan_domain` on every node (the very
                  function the runtime calls), plus the cross-node placement layer on multi-node
                  groups.
* ``milp``        the exact MILP oracle per node (small cases only).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Optional

import numpy as np

from deepspeed_feplb.config import FEPLBConfig
from deepspeed_feplb.plan.cost import PROFILES, ExpertShape, GemmProfile, gemm_us
from deepspeed_feplb.plan.placement import CrossNodePlacer, rebalance_experts, slot_holdings, transfer_us
from deepspeed_feplb.plan.policy import PlanConstraints, dynamic_candidates, lower_bound, plan_domain
from deepspeed_feplb.plan.replicas import exchange_us, last_half_bytes, relay_us, replica_pairs, route
from deepspeed_feplb.plan.residency import (
    KeptBytes,
    ResidencyTable,
    resident_budget_bytes,
    step_end_returns,
    used_at_step_end,
)
from deepspeed_feplb.plan.timeline import TimeModel, rank_finish_us

__all__ = ["SimSetup", "StepResult", "POLICIES", "make_policy", "pieces_us"]


@dataclass(frozen=True)
class SimSetup:
    """The simulated EP group and the knobs of every policy.

    ce_budget: hard cap on weight bytes per rank and micro-batch: "auto" / "inf" (none: the
               planner's time model decides), or bytes.
    placement: cross-node layer for ``feplb``: "auto" (on when nodes > 1), "on", "off"; whether
               it moves experts' homes (``feplb.placement.enabled``); with it off, replica slots
               on more than one node still run it, every expert keeping its home (`moves_homes`).
    micro_batches_per_step: M: consecutive micro-batches of the trace form one optimizer step.
    residency: ``feplb``'s weight residency, "step" or "micro_batch" (``feplb.weight_residency``);
               max_resident: copies a rank keeps per layer (``feplb.max_resident_experts``);
               resident_budget_mb: the bytes of copies a rank keeps over all layers
               (``feplb.resident_budget_mb``; "auto": by the runtime's rule,
               `plan.residency.resident_budget_bytes`, from ``profile.free_at_start``), each
               copy counting its weights and an fp32 weight-gradient, as a helper holds them.
    max_rows_over_mean: ``feplb``'s bound on rows before time (``feplb.max_rows_over_mean``; None:
               time alone), relative to the mean over all G x N ranks.
    serve_parts, serve_part_rows: parts a helper computes one home's chunks in, each part's results
               going home once computed (``feplb.serve_parts``, ``feplb.serve_part_rows``).
    serve_on_arrival: a helper serves each chunk as soon as it is in, ahead of its own rows
               (``feplb.serve_on_arrival`` resolved: the CLI's "auto" is on with a GPU profile).
    keep_copies_across_steps: with residency "step", the copies a step's last micro-batch used are
               held again for the next step (``feplb.keep_copies_across_steps``): their weights
               travel after the optimizer step, counted in ``weight_bytes`` but not in expert time
               (they move while the next step's first layers compute, which a one-layer replay has
               not); as the runtime, not over the first step (whose optimizer state may be new), nor
               with the cross-node layer (placement or replica slots).
    redundant_per_rank: replica slots per rank of ``feplb``'s cross-node layer
               (``feplb.placement.redundant_experts_per_rank``, `plan.replicas`): hot experts get
               replicas on other nodes where they pay; each micro-batch splits a replicated
               expert's rows between its holders (`replicas.route`); every optimizer step
               sends their gradient sums (fp32) home and the stepped weights to the replicas its
               decision left, relayed over every link of the two nodes (`replicas.exchange_us`),
               **added to the expert time of the micro-batch that ends the step**
               (``replica_exchange_us``), less what that micro-batch's own expert time hides of
               the sums of the micro-batches before it, which go home during it (experts of 2-byte
               weights, `ExpertShape.dtype_bytes`, as bf16 training has them), and of the last
               sums of experts whose gradients their home holds back to the backward's end
               (`replicas.held_back_sums`: a DeepSpeed MoE layer's runtime; an AutoEP layer's
               homes wait for every sum in the layer's backward), and less what its
               forward's hides of the stepped weights (standing for the next step's first forward,
               at whose start they leave). Without
               ``placement`` every expert keeps its home and decisions choose replicas only.
    replica_host_us: host time per micro-batch that holding any replica costs beyond its
               exchange (a runtime with ``feplb.fixed_costs: "measured"`` measures it): the choice
               prices it (`CrossNodePlacer.replica_fixed_us`) and it is **added to the expert time
               of every micro-batch with replicas held**; 0: none, the GPU figure being unmeasured.

    Re-placements (EPLB's, and the cross-node layer's of ``feplb``) happen at optimizer steps, as
    a runtime does them: at the end of the first step that is at least ``placement_warmup``
    micro-batches (None: one step) into the trace, then at the end of the first step at least
    ``eplb_interval`` / ``placement_interval`` micro-batches after the previous decision. Replicas
    alone (every home kept) are first chosen sooner, as the runtime chooses them: after the
    second micro-batch (`CrossNodePlacer.replicas_due_mid_step`), their first weights priced then,
    less what the next forward hides. Each
    costs the transfer of the experts' state (``expert_state_bytes``, default bf16 weights + fp32
    master, Adam m and v: 14 bytes per parameter) to the ranks that newly hold them, over the
    inter-node link (``profile.net_gbps``) or, inside a node, the copy engine (``profile.ce_gbps``),
    every rank's links in parallel (`plan.placement.transfer_us`); that time is **added to the
    expert time of the micro-batch that ends the step** (the next step starts that much later),
    so ``expert_time_us`` (a mean over micro-batches) carries it amortised.
    placement_horizon: micro-batches over which ``feplb``'s cross-node layer counts a
    re-placement's gain against its cost (None: measured from how much of a predicted gain
    the following micro-batches show, `plan.placement.CrossNodePlacer`).
    """

    ranks_per_node: int
    nodes: int
    experts: int
    dynamic_experts: int = 4
    max_helpers: int = FEPLBConfig.model_fields["max_helpers_per_expert"].default
    chunk_align: int = 1
    shape: ExpertShape = field(default_factory=ExpertShape)
    profile: GemmProfile = PROFILES["h100"]
    ce_budget: str | float = "auto"
    eplb_redundant: Optional[int] = None
    eplb_interval: int = 20
    eplb_decay: float = 0.1
    placement: str = "auto"
    placement_interval: int = 20
    placement_horizon: Optional[int] = None
    placement_warmup: Optional[int] = None
    expert_state_bytes: Optional[float] = None
    oracle_time_limit: float = 10.0
    micro_batches_per_step: int = 1
    residency: str = "step"
    max_resident: int = 8
    resident_budget_mb: str | float = "auto"
    max_rows_over_mean: Optional[float] = None
    redundant_per_rank: int = 0
    replica_host_us: float = 0.0
    serve_parts: int = FEPLBConfig.model_fields["serve_parts"].default
    serve_part_rows: int = FEPLBConfig.model_fields["serve_part_rows"].default
    serve_on_arrival: bool = False
    keep_copies_across_steps: bool = FEPLBConfig.model_fields["keep_copies_across_steps"].default

    @property
    def ranks(self) -> int:
        return self.ranks_per_node * self.nodes

    @cached_property
    def feplb_config(self) -> FEPLBConfig:
        """The ``"feplb"`` section a runtime with these knobs would have (what the planner obeys)."""
        budget = math.inf if self.ce_budget == "inf" else self.ce_budget
        return FEPLBConfig(dynamic_experts_per_rank=self.dynamic_experts, max_helpers_per_expert=self.max_helpers,
                           chunk_align_tokens=self.chunk_align, ce_budget=budget, copy_engine_gbps=self.profile.ce_gbps,
                           weight_residency=self.residency, max_resident_experts=self.max_resident,
                           resident_budget_mb=self.resident_budget_mb, max_rows_over_mean=self.max_rows_over_mean,
                           serve_parts=self.serve_parts, serve_part_rows=self.serve_part_rows,
                           serve_on_arrival=self.serve_on_arrival,
                           keep_copies_across_steps=self.keep_copies_across_steps)

    @cached_property
    def time_model(self) -> TimeModel:
        """The time model of the planner and of ``expert_time_us`` (`plan.timeline`)."""
        return replace(TimeModel.of(self.shape, self.profile), serve_parts=self.serve_parts,
                       serve_part_rows=self.serve_part_rows, serves_on_arrival=self.serve_on_arrival)

    def step_ends(self, step: int) -> bool:
        """Whether micro-batch ``step`` of the trace is the last of its optimizer step."""
        return self.later_micro_batches(step) == 0

    def later_micro_batches(self, step: int) -> int:
        """The micro-batches of ``step``'s optimizer step after it (0: it ends the step)."""
        return self.micro_batches_per_step - 1 - step % self.micro_batches_per_step

    @property
    def moves_homes(self) -> bool:
        """Whether ``feplb``'s cross-node layer may give experts other homes (``placement``)."""
        return self.placement == "on" or (self.placement == "auto" and self.nodes > 1)

    @property
    def cross_node_layer(self) -> bool:
        """Whether ``feplb`` runs its cross-node layer: to move homes, or for replica slots alone."""
        return self.moves_homes or (self.redundant_per_rank > 0 and self.nodes > 1)

    @property
    def warmup(self) -> int:
        """Micro-batches before the first re-placement decision."""
        return self.micro_batches_per_step if self.placement_warmup is None else self.placement_warmup

    @cached_property
    def state_bytes(self) -> float:
        """Bytes that move with an expert that changes rank (``expert_state_bytes``)."""
        if self.expert_state_bytes is not None:
            return float(self.expert_state_bytes)
        return self.shape.weight_bytes / self.shape.dtype_bytes * 14  # bf16 + fp32 master, Adam m, v

    def replacement_us(self, old: np.ndarray, new: np.ndarray) -> float:
        """Transfer time (µs) of a re-placement; old, new bool [R, E]: which rank holds which expert."""
        return transfer_us(old, new, self.ranks_per_node, self.state_bytes, self.profile.net_gbps,
                           self.profile.ce_gbps)

    @property
    def experts_per_rank(self) -> int:
        return self.experts // self.ranks

    def check(self) -> None:
        if self.ranks_per_node < 1 or self.nodes < 1:
            raise ValueError("ranks per node and nodes must be >= 1")
        if self.experts % self.ranks:
            raise ValueError(f"{self.experts} experts cannot be placed evenly on {self.ranks} ranks")
        if self.micro_batches_per_step < 1:
            raise ValueError(f"micro-batches per step must be >= 1, got {self.micro_batches_per_step}")
        if self.residency not in ("step", "micro_batch"):
            raise ValueError(f"residency must be 'step' or 'micro_batch', got {self.residency!r}")
        if not 0 <= self.replica_host_us < math.inf:
            raise ValueError(f"the host time of held replicas must be a finite number of µs >= 0, got "
                             f"{self.replica_host_us}")
        if self.redundant_per_rank < 0:
            raise ValueError(f"redundant replica slots per rank must be >= 0, got {self.redundant_per_rank}")
        if self.redundant_per_rank and self.nodes == 1:
            raise ValueError(f"{self.redundant_per_rank} replica slots per rank need more than one node: replicas go "
                             "to other nodes (inside one, phase 2 does their work)")


@dataclass
class StepResult:
    """piece_rank, piece_tokens int64 [P]: expert pieces and who computes them.
    moves int64 [M, 4] = (expert, home_rank, helper_rank, tokens) (global ids) or None.
    lower_bound: bound (`plan.policy.lower_bound`) on the largest rank load for this step (intra-node policies).
    ce: Copy-Engine figures of this step (µs) or None. extra: other per-step numbers.
    timing: the time model's figures of this micro-batch (`timeline`), for policies that copy
            weights per micro-batch: ``expert_us`` (makespan, forward + backward with copies),
            ``exposed_us`` (what the copies add to it), ``weight_bytes`` and ``grad_bytes`` copied;
            None: the simulator prices the pieces alone (no copies)."""

    piece_rank: np.ndarray
    piece_tokens: np.ndarray
    moves: Optional[np.ndarray] = None
    lower_bound: Optional[float] = None
    ce: Optional[dict] = None
    extra: dict = field(default_factory=dict)
    timing: Optional[dict] = None


def _contiguous(setup: SimSetup) -> np.ndarray:
    return np.arange(setup.experts, dtype=np.int64) // setup.experts_per_rank


class Vanilla:
    name = "vanilla"

    def __init__(self, setup: SimSetup, layers: int):
        self.home = _contiguous(setup)

    def step(self, step: int, layer: int, src: np.ndarray) -> StepResult:
        return StepResult(self.home, src.sum(axis=0))

    def summary(self) -> dict:
        return {}


class FasterMoE:
    """FasterMoE's ``global_policy`` with its cost model, fed the per-expert global load (sum over
    sources, as the paper describes). Hardware constants come from the profile:
    ``bw_mm`` = sustained GEMM rate, ``bw_net`` = the slowest link of the EP group (NVLink within
    one node, the NIC across nodes); the expert is ``shape`` (FasterMoE's alpha·d_model² with
    ``mats`` matrices)."""

    name = "fastermoe"

    def __init__(self, setup: SimSetup, layers: int):
        self.setup = setup
        self.home = _contiguous(setup)
        prof, shape = setup.profile, setup.shape
        bw_net = (prof.ce_gbps if setup.nodes == 1 else prof.net_gbps) * 1e9
        self.send_feature = shape.row_bytes / bw_net
        self.send_model = shape.weight_bytes / bw_net
        self.comp = shape.flops_per_row / (prof.tflops * 1e12)
        self.shadowed_total = 0
        self.steps = 0

    def shadow_mask(self, loads: np.ndarray) -> np.ndarray:
        """loads int64 [E] -> bool [E]: experts to shadow."""
        order = np.argsort(-loads, kind="stable")
        b = loads[order].astype(np.float64)
        per_token = 3 * self.comp + 4 * self.send_feature
        lat_base = per_token * b[0]
        mask = np.zeros(loads.shape[0], dtype=bool)
        shadow_time = 0.0
        for i in range(len(order) - 1):
            shadow_time += self.send_model
            lat_new = per_token * b[i + 1] + shadow_time
            if lat_new < lat_base:
                lat_base = lat_new
                mask[order[i]] = True
            else:
                break
        return mask

    def step(self, step: int, layer: int, src: np.ndarray) -> StepResult:
        loads = src.sum(axis=0)
        mask = self.shadow_mask(loads)
        R = src.shape[0]
        keep = ~mask
        ranks = [self.home[keep]]
        tokens = [loads[keep]]
        if mask.any():
            ranks.append(np.repeat(np.arange(R, dtype=np.int64), int(mask.sum())))
            tokens.append(src[:, mask].reshape(-1))
        n = int(mask.sum())
        self.shadowed_total += n
        self.steps += 1
        bcast_us = n * self.send_model * 1e6
        ranks, tokens = np.concatenate(ranks), np.concatenate(tokens)
        # the broadcast of the shadowed weights precedes their GEMMs (FasterMoE's own cost model)
        busy = pieces_us(ranks, tokens, R, self.setup.time_model)
        timing = {"expert_us": float(busy.max()) + bcast_us, "exposed_us": bcast_us,
                  "weight_bytes": n * (R - 1) * self.setup.shape.weight_bytes, "grad_bytes": 0}
        return StepResult(ranks, tokens, extra={"shadowed_experts": n, "broadcast_us": bcast_us}, timing=timing)

    def summary(self) -> dict:
        return {"shadowed_experts_mean": self.shadowed_total / max(1, self.steps)}


class EPLB:
    """EPLB redundant experts from an exponential moving average of past per-expert loads,
    re-placed at optimizer steps every ``eplb_interval`` micro-batches (hierarchical over nodes
    when nodes > 1; the schedule of `SimSetup`). Before any history exists the placement is
    computed from uniform loads. A re-placement costs the transfer of the state of every expert a
    rank newly holds (`SimSetup.replacement_us`), added to the expert time of the micro-batch that
    ends the step."""

    name = "eplb"

    def __init__(self, setup: SimSetup, layers: int):
        self.setup = setup
        R = setup.ranks
        self.redundant = R if setup.eplb_redundant is None else setup.eplb_redundant
        self.num_phy = setup.experts + self.redundant
        if self.num_phy % R:
            raise ValueError(f"EPLB needs experts + redundant ({self.num_phy}) divisible by ranks ({R})")
        self.ema = [None] * layers
        self.seen = [0] * layers
        self.decided_at = [None] * layers
        self.phy2log = [self._place(np.ones(setup.experts)) for _ in range(layers)]
        self.refreshes = 0
        self.moved = 0
        self.refresh_us = 0.0

    def _place(self, weight: np.ndarray) -> np.ndarray:
        s = self.setup
        groups = s.nodes if s.nodes > 1 else 1
        phy2log, _, _ = rebalance_experts(weight[None], self.num_phy, groups, s.nodes, s.ranks)
        return phy2log[0]

    def step(self, step: int, layer: int, src: np.ndarray) -> StepResult:
        loads = src.sum(axis=0)
        phy2log = self.phy2log[layer]
        per_rank = self.num_phy // self.setup.ranks
        slot_rank = np.arange(self.num_phy, dtype=np.int64) // per_rank
        cnt = np.bincount(phy2log, minlength=self.setup.experts)
        # replica index of every slot among its expert's replicas (in slot order)
        order = np.argsort(phy2log, kind="stable")
        first = np.cumsum(cnt) - cnt
        rep = np.empty(self.num_phy, dtype=np.int64)
        rep[order] = np.arange(self.num_phy) - first[phy2log[order]]
        base = loads[phy2log] // cnt[phy2log]
        tokens = base + (rep < loads[phy2log] - base * cnt[phy2log])
        # learn from this step for later steps
        f = loads.astype(np.float64)
        d = self.setup.eplb_decay
        self.ema[layer] = f if self.ema[layer] is None else (1 - d) * self.ema[layer] + d * f
        self.seen[layer] += 1
        s = self.setup
        last = self.decided_at[layer]
        due = self.seen[layer] >= (s.warmup if last is None else last + s.eplb_interval)
        cost = 0.0
        if due and s.step_ends(step):
            self.decided_at[layer] = self.seen[layer]
            new = self._place(self.ema[layer])
            old_h = slot_holdings(phy2log, s.ranks, s.experts)
            new_h = slot_holdings(new, s.ranks, s.experts)
            if not np.array_equal(old_h, new_h):
                cost = s.replacement_us(old_h, new_h)
                self.refreshes += 1
                self.moved += int((new_h & ~old_h).sum())
                self.refresh_us += cost
            self.phy2log[layer] = new
        busy = pieces_us(slot_rank, tokens, s.ranks, s.time_model)
        timing = {"expert_us": float(busy.max()) + cost, "placement_us": cost}
        return StepResult(slot_rank, tokens, timing=timing)

    def summary(self) -> dict:
        return {"redundant_experts": self.redundant, "placement_refreshes": self.refreshes,
                "placement_migrated_experts": self.moved, "placement_migration_us": self.refresh_us}


def pieces_us(piece_rank: np.ndarray, piece_tokens: np.ndarray, R: int, model: TimeModel) -> np.ndarray:
    """Expert pieces -> float64 [R]: each rank's forward + backward GEMM time (µs) under ``model``."""
    counts = np.asarray(piece_tokens, np.int64).reshape(-1, 1)
    per_piece = rank_finish_us(counts, np.zeros((0, 4), np.int64), model).sum(axis=0)
    return np.bincount(np.asarray(piece_rank, np.int64), weights=per_piece, minlength=R)


def _ce_figures(node_counts: np.ndarray, moves: np.ndarray, static_us: np.ndarray, setup: SimSetup,
                fresh: Optional[np.ndarray] = None) -> dict:
    """Copy-Engine time of one node's plan (forward phase 2), against the static GEMM time it must
    hide behind. node_counts int64 [G, E_local]; moves int64 [M, 4] node-local; static_us [G];
    fresh bool [M]: the move carries the expert's weights (None: every move does; a helper that
    kept a copy from earlier in the step gets rows only)."""
    G = node_counts.shape[0]
    w = setup.shape.weight_bytes
    row = setup.shape.row_bytes
    bw = setup.profile.ce_gbps * 1e3  # bytes per µs
    if len(moves) == 0:
        return {"ce_us": 0.0, "exposed_us": 0.0, "static_us": float(static_us.mean()), "copies": 0}
    carries = np.ones(len(moves)) if fresh is None else np.asarray(fresh, np.float64)
    copies_out = np.bincount(moves[:, 0], weights=carries, minlength=G)
    copies_in = np.bincount(moves[:, 2], weights=carries, minlength=G)
    tok_out = np.bincount(moves[:, 0], weights=moves[:, 3], minlength=G)
    tok_in = np.bincount(moves[:, 2], weights=moves[:, 3], minlength=G)
    in_us = (copies_in * w + tok_in * row) / bw
    out_us = (copies_out * w + tok_out * row) / bw
    ce_us = float(np.maximum(in_us, out_us).max())
    exposed = float(np.maximum(in_us - static_us, 0.0).max())
    return {"ce_us": ce_us, "exposed_us": exposed, "static_us": float(static_us.mean()), "copies": int(carries.sum())}


class _NodePolicy:
    """Shared machinery of the intra-node policies: placement, per-node counts, pieces."""

    name = ""

    def __init__(self, setup: SimSetup, layers: int):
        self.setup = setup
        self.layers = layers
        self.placers = None
        if setup.cross_node_layer and self.uses_placement:
            us_tok = 3 * setup.shape.flops_per_row / (setup.profile.tflops * 1e6)  # fwd + bwd per row
            self.placers = [CrossNodePlacer(setup.experts, setup.nodes, setup.ranks_per_node,
                                            setup.placement_interval, setup.eplb_decay, setup.state_bytes,
                                            setup.profile.net_gbps, us_tok, dynamic_experts=setup.dynamic_experts,
                                            horizon=setup.placement_horizon, intra_gbps=setup.profile.ce_gbps,
                                            warmup=setup.warmup, redundant=setup.redundant_per_rank,
                                            weight_bytes=setup.shape.weight_bytes,
                                            grad_bytes=setup.shape.grad_bytes,
                                            micro_batches_per_step=setup.micro_batches_per_step,
                                            max_rows_over_mean=setup.max_rows_over_mean or 0.0,
                                            move_experts=setup.moves_homes, replica_fixed_us=setup.replica_host_us)
                            for _ in range(layers)]
        self.budget_copies = []
        self.replica_exchange_us = 0.0
        keep = setup.max_resident if setup.residency == "step" and self.uses_residency else 0
        G, E = setup.ranks_per_node, setup.experts_per_rank + (setup.redundant_per_rank if self.placers else 0)
        # a node's kept copies share one byte budget over its layers, as a domain's do at runtime
        budget = resident_budget_bytes(setup.resident_budget_mb, [setup.profile.free_at_start])
        self.kept_bytes = [KeptBytes(G, budget) for _ in range(setup.nodes)]
        copy_bytes = setup.shape.weight_bytes + setup.shape.grad_bytes
        self.residency = [[ResidencyTable(G, E, keep, self.kept_bytes[n], copy_bytes) for n in range(setup.nodes)]
                          for _ in range(layers)]

    uses_placement = False
    uses_residency = False

    def slots(self, layer: int) -> np.ndarray:
        """int64 [R, S]: the global expert id of each rank's local experts (ascending), then, with
        the cross-node layer, its replica slots (-1: empty)."""
        s = self.setup
        if self.placers is None:
            return np.arange(s.experts, dtype=np.int64).reshape(s.ranks, s.experts_per_rank)
        return self.placers[layer].slots

    def constraints(self, node_counts: np.ndarray, mean_rows: float = 0.0,
                    later: int = 0) -> tuple[PlanConstraints, np.ndarray]:
        """The plan's constraints for one node and its ranks' static GEMM time float64 [G];
        ``mean_rows``: rows per rank over the whole group (for the row bound); ``later``: the
        micro-batches of the optimizer step after this one."""
        s = self.setup
        D = min(s.dynamic_experts, node_counts.shape[1])
        cand = dynamic_candidates(node_counts, D)
        t = gemm_us(node_counts, s.shape, s.profile)
        static_us = t.sum(axis=1) - np.take_along_axis(t, cand, axis=1).sum(axis=1)
        # the runtime's rule with the modelled instead of the measured time model
        cons = PlanConstraints.from_config(s.feplb_config, s.shape.weight_bytes, s.time_model)
        return replace(cons, mean_rows=float(mean_rows), later_micro_batches=later), static_us

    def plan(self, node_counts: np.ndarray, cons: PlanConstraints, resident: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def step(self, step: int, layer: int, src: np.ndarray) -> StepResult:
        s = self.setup
        G = s.ranks_per_node
        loads = src.sum(axis=0)
        slots = self.slots(layer)
        replicated = self.placers is not None and s.redundant_per_rank > 0
        host_us = s.replica_host_us if replicated and self.placers[layer].holds_replicas else 0.0
        # [R, S]: with replicas, each micro-batch splits a replicated expert's rows between the nodes
        counts = route(src, slots, G, s.experts_per_rank) if replicated else loads[slots]
        ranks, tokens, moves_out = [], [], []
        lb = 0
        ce = {"ce_us": 0.0, "exposed_us": 0.0, "static_us": 0.0, "copies": 0}
        timing = {"expert_us": 0.0, "exposed_us": 0.0, "weight_bytes": 0, "grad_bytes": 0}
        ends = s.step_ends(step)
        # the runtime carries the copies over its optimizer steps from the second on, where no slot changes
        carry = (ends and s.keep_copies_across_steps and self.placers is None
                 and step >= 2 * s.micro_batches_per_step - 1)
        # each direction ends in an all-to-all over every node: the slowest forward, then the slowest backward
        finish, free = np.zeros(2), np.zeros(2)
        for n in range(s.nodes):
            nc = counts[n * G:(n + 1) * G]
            cons, static_us = self.constraints(nc, counts.sum() / s.ranks, s.later_micro_batches(step))
            table = self.residency[layer][n]
            moves = self.plan(nc, cons, table.resident.copy())
            fresh, node_finish, node_free = self._time(nc, moves, table, ends, timing, carry)
            finish, free = np.maximum(finish, node_finish.max(axis=1)), np.maximum(free, node_free.max(axis=1))
            lb = max(lb, lower_bound(nc, cons.dynamic_experts))
            home_rows = nc.copy()
            if len(moves):
                np.subtract.at(home_rows, (moves[:, 0], moves[:, 1]), moves[:, 3])
                ranks.append(n * G + moves[:, 2])
                tokens.append(moves[:, 3])
                gslots = slots[n * G:(n + 1) * G]
                moves_out.append(np.stack([gslots[moves[:, 0], moves[:, 1]], n * G + moves[:, 0],
                                           n * G + moves[:, 2], moves[:, 3]], axis=1))
            ranks.append(np.repeat(np.arange(n * G, (n + 1) * G, dtype=np.int64), nc.shape[1]))
            tokens.append(home_rows.reshape(-1))
            f = _ce_figures(nc, moves, static_us, s, fresh)
            ce["ce_us"] = max(ce["ce_us"], f["ce_us"])
            ce["exposed_us"] = max(ce["exposed_us"], f["exposed_us"])
            ce["static_us"] += f["static_us"] / s.nodes
            ce["copies"] += f["copies"]
        timing["expert_us"], timing["exposed_us"] = float(finish.sum()) + host_us, float(finish.sum() - free.sum())
        if self.placers is not None:
            placer = self.placers[layer]
            placer.observe(loads, refresh=False)
            if placer.due and ends:  # re-place at the optimizer step; the transfer delays the next one
                placer.refresh()
                timing["expert_us"] += placer.last_cost_us
                timing["placement_us"] = placer.last_cost_us
            elif ends:  # replicas chosen again: the hot set drifts between decisions
                placer.review_replicas()
            elif placer.replicas_due_mid_step and placer.refresh():
                # the first replicas, as the next forward begins: their first weights leave then,
                # hidden by that forward as far as it goes (this one's stands for it)
                pairs = replica_pairs(placer.slots, s.experts_per_rank)
                first_us = max(0.0, relay_us(pairs, s.ranks, G, s.shape.weight_bytes, s.profile.net_gbps,
                                             s.profile.ce_gbps) - float(finish[0]))
                timing["expert_us"] += first_us
                self.replica_exchange_us += first_us
        if replicated and ends:
            # the step's replicas send their gradient sums home (with several micro-batches per step
            # and bf16/fp16 weights, all but the last one's while this one computes, then its own);
            # the stepped weights go to the replicas of the table the step's decision left (a new
            # replica's first weights)
            last = last_half_bytes(s.shape.weight_bytes, s.shape.grad_bytes, s.micro_batches_per_step)
            reduce_us = exchange_us(slots, s.experts_per_rank, G, s.shape.weight_bytes, s.shape.grad_bytes,
                                    s.profile.net_gbps, s.profile.ce_gbps, weight_slots=self.slots(layer),
                                    last_bytes=last, hidden_us=float(finish.sum()),
                                    weights_hidden_us=float(finish[0]))
            timing["expert_us"] += reduce_us
            timing["replica_exchange_us"] = reduce_us
            self.replica_exchange_us += reduce_us
        moves_all = np.concatenate(moves_out) if moves_out else np.zeros((0, 4), dtype=np.int64)
        return StepResult(np.concatenate(ranks), np.concatenate(tokens), moves_all, lb, ce, timing=timing)

    def _time(self, nc: np.ndarray, moves: np.ndarray, table: ResidencyTable, ends: bool, timing: dict,
              carry: bool = False) -> tuple:
        """One node's micro-batch: add its copied bytes to ``timing`` and update its residency table
        (copies kept until the step ends, whose gradients go home then; with ``carry`` those the
        step's last micro-batch used are held again for the next step). Returns (which moves carry
        weights bool [M], each rank's forward and backward finish [2, G] with the copies, and
        without them: `timeline.rank_finish_us`)."""
        model = self.setup.time_model
        fresh, kept = table.admit(moves, keep_new=not ends)
        grads_back, flush, carried = ~kept, None, 0
        if ends:  # the kept copies' gradients go home: with a move's results, or at the backward's start
            with_results, early = step_end_returns(table.flush(), moves, kept)
            grads_back, flush = grads_back | with_results, early[:, [0, 2]]
            if carry:  # held again for the next step, after the optimizer step
                carried = int(table.keep(used_at_step_end(moves, with_results)).sum())
        finish = rank_finish_us(nc, moves, model, fresh, grads_back, flush)
        free = rank_finish_us(nc, moves, replace(model, weight_copy_us=0.0, grad_copy_us=0.0, row_copy_us=0.0))
        w = self.setup.shape.weight_bytes
        timing["weight_bytes"] += (int(fresh.sum()) + carried) * w
        timing["grad_bytes"] += (int(grads_back.sum()) + (0 if flush is None else len(flush))) * w
        return fresh, finish, free

    def summary(self) -> dict:
        if self.placers is None:
            return {}
        out = {"placement_refreshes": sum(p.refreshes for p in self.placers),
               "placement_decisions": sum(p.decisions for p in self.placers),
               "placement_migrated_experts": sum(p.migrated_experts for p in self.placers),
               "placement_migration_us": sum(p.migration_us for p in self.placers)}
        if self.setup.redundant_per_rank:
            out.update(replicas=sum(int((p.replica_at >= 0).sum()) for p in self.placers),
                       replica_changes=sum(p.replica_changes for p in self.placers),
                       replica_drops=sum(p.replica_drops for p in self.placers),
                       replica_exchange_us=self.replica_exchange_us)
        return out


class FEPLB(_NodePolicy):
    name = "feplb"
    uses_placement = True
    uses_residency = True

    def plan(self, node_counts, cons, resident):
        return plan_domain(node_counts, cons, resident).moves


class FEPLBPaper(_NodePolicy):
    """The paper's greedy: whole experts only, one helper each, no token splitting; the weight
    copies of a rank must hide behind the node's mean static (forward) GEMM time at the
    Copy-Engine bandwidth (half its mean GEMM time when it has no static work)."""

    name = "feplb-paper"

    def constraints(self, node_counts, mean_rows=0.0, later=0):
        cons, static_us = super().constraints(node_counts, mean_rows, later)
        s = self.setup
        window_us = float(static_us.mean()) or 0.5 * float(gemm_us(node_counts, s.shape, s.profile).sum(axis=1).mean())
        budget = cons.ce_budget_bytes
        if window_us > 0:
            budget = min(budget, s.profile.ce_gbps * 1e3 * window_us)
        return replace(cons, ce_budget_bytes=budget, model=None), static_us

    def plan(self, node_counts, cons, resident):
        G, E = node_counts.shape
        if G <= 1 or cons.dynamic_experts <= 0:
            return np.zeros((0, 4), dtype=np.int64)
        cand = dynamic_candidates(node_counts, cons.dynamic_experts).tolist()
        rows = node_counts.tolist()
        loads = [sum(r) for r in rows]
        left = [[(e, rows[r][e]) for e in cand[r] if rows[r][e] > 0] for r in range(G)]
        copies = cons.copies_per_rank()
        sent = [0] * G
        got = [0] * G
        moves = []
        while True:
            r = max(range(G), key=lambda i: (loads[i], -i))
            order = sorted(range(G), key=lambda i: (loads[i], i))
            done = True
            for k, (e, n) in enumerate(left[r]):
                j = next((i for i in order if i != r and got[i] < copies), None)
                if j is None or sent[r] >= copies:
                    break
                if loads[j] + n < loads[r]:
                    moves.append((r, e, j, n))
                    loads[r] -= n
                    loads[j] += n
                    sent[r] += 1
                    got[j] += 1
                    del left[r][k]
                    done = False
                    break
            if done:
                break
        moves.sort()
        return np.array(moves, dtype=np.int64).reshape(-1, 4)


class MILPOracle(_NodePolicy):
    """Per-node exact optimum (largest rank load) under the same D / helper / CE limits; the
    pieces assume the optimum's load can be spread as the bound says (token straggler only)."""

    name = "milp"

    def step(self, step, layer, src):
        from .oracle import optimal_max_load

        s = self.setup
        G = s.ranks_per_node
        counts = src.sum(axis=0)[self.slots(layer)]
        ranks, tokens = [], []
        lb = 0
        for n in range(s.nodes):
            nc = counts[n * G:(n + 1) * G]
            cons, _ = self.constraints(nc)
            res = optimal_max_load(nc, cons, s.oracle_time_limit)
            lb = max(lb, lower_bound(nc, cons.dynamic_experts))
            # rank loads of an optimal plan: water-fill the node to the optimum's max load
            loads = nc.sum(axis=1).astype(np.float64)
            top = math.ceil(res.max_load)
            excess = np.maximum(loads - top, 0).sum()
            new = np.minimum(loads, top)
            room = top - new
            order = np.argsort(-room, kind="stable")
            for i in order:
                take = min(room[i], excess)
                new[i] += take
                excess -= take
            ranks.append(np.arange(n * G, (n + 1) * G, dtype=np.int64))
            tokens.append(np.rint(new).astype(np.int64))
        return StepResult(np.concatenate(ranks), np.concatenate(tokens), None, lb)


POLICIES = {p.name: p for p in (Vanilla, FasterMoE, EPLB, FEPLBPaper, FEPLB, MILPOracle)}


def make_policy(name: str, setup: SimSetup, layers: int):
    """A fresh policy object by name (see :data:`POLICIES`)."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r} (one of {', '.join(POLICIES)})")
    return POLICIES[name](setup, layers)
