"""FEPLB for DeepSpeed AutoEP layers (Hugging Face MoE models sharded by ``"expert_parallel"``).

AutoEP replaces every MoE block of a Hugging Face model (Mixtral, Qwen3-MoE, DeepSeek, ...) by
an ``AutoEPMoELayer``. In all its paths (ep=1, the all-to-all comm backend, DeepEP) that layer
calls its ``experts`` module, a ``GroupedExperts`` holding stacked weights
``w1/w3 [E_local, F, H]``, ``w2 [E_local, H, F]``, as ``experts(rows_grouped_by_local_expert,
counts)``. That call is FEPLB's phase-2 seam: `install` swaps the class of each ``experts``
instance for `FEPLBGroupedExperts` after ``deepspeed.initialize``, which keeps the parameter
objects, their names (``...experts.w1`` etc., which DeepSpeed's checkpoints match), the optimizer
state and ZeRO's hooks. Its ``forward`` runs the expert stage (`expert_stage.ExpertStage`), as the
DeepSpeed-MoE layer does: the skip rule on the EP group's counts (one small all-gather, since
AutoEP's dispatch does not tell them), static experts through AutoEP's own grouped GEMM while the
scheduler plans, dynamic experts (per-expert views of the stacked weights) through the phase-2
transport to helpers and back, gradients home. Phase 2 computes its pieces with the same grouped
GEMM where their weights lie stacked (one call per message a helper serves; a home's pieces where
they are neighbours); otherwise, and where AutoEP runs its loop (``use_grouped_mm: false``), one
call per piece through a SwiGLU template module. Where FEPLB
cannot balance (EP 1, no dynamic experts, a domain of one rank) AutoEP's own forward runs.

Counts are the ones AutoEP hands its experts: in the comm path each expert's group is padded to
a multiple of 8 rows (zero rows, zero output, zero gradient), so the planner balances padded
rows, which is the work each rank's GEMM really does.
"""
from __future__ import annotations

import warnings
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from deepspeed_feplb.config import FEPLBConfig, FEPLBConfigError, FEPLBModelError
from deepspeed_feplb.domain import domain_size, moves_in_domains, start_planner_early, validate_domain_size
from deepspeed_feplb.expert_stage import ExpertStage, check_group_agrees
from deepspeed_feplb.experts import ExpertSpec, LocalExperts, on_graph
from deepspeed_feplb.integration import seams
from deepspeed_feplb.integration.deepspeed_moe import ExpertGradOrder
from deepspeed_feplb.integration.expert_order import adopt_loaded_order, keep_expert_order
from deepspeed_feplb.integration.expert_state import StackedExperts
from deepspeed_feplb.integration.placement import (
    ExpertPlacement,
    copies_stale,
    places,
    replica_slots_per_rank,
    say_if_replicas_idle,
)
from deepspeed_feplb.integration.replicas import ReplicaSlots, with_sum
from deepspeed_feplb.memory import LayerMemoryFacts, replica_bytes
from deepspeed_feplb.once import first_time
from deepspeed_feplb.stats import recomputing, unbalanced_stats

try:  # DeepSpeed without AutoEP: nothing to install
    from deepspeed.module_inject.auto_ep_comm import DEEPEP_BACKEND
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    from deepspeed.moe.ep_count import count_tokens_per_expert
    from deepspeed.moe.ep_experts import GroupedExperts, apply_expert_activation
    from deepspeed.moe.ep_router import TokenChoiceTopKRouter
except ImportError:  # pragma: no cover - depends on the DeepSpeed version
    AutoEPMoELayer = GroupedExperts = TokenChoiceTopKRouter = count_tokens_per_expert = DEEPEP_BACKEND = None


class SwiGLUExpert(torch.nn.Module):
    """One expert of a `GroupedExperts`, run functionally on slices ``w1[e], w2[e], w3[e]``.

    Same math as DeepSpeed's reference loop (``_run_experts_for_loop``): the template's own
    parameters live on the meta device and are always replaced by `ExpertSpec.call`.
    """

    def __init__(self, experts: "GroupedExperts"):
        super().__init__()
        for name in ("w1", "w2", "w3"):
            weight = getattr(experts, name)
            setattr(self, name, torch.nn.Parameter(torch.empty(weight.shape[1:], dtype=weight.dtype, device="meta")))
        self.activation = (experts.activation, experts.activation_alpha, experts.activation_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        gate = x @ self.w1.to(dtype).t()
        up = x @ self.w3.to(dtype).t()
        return apply_expert_activation(gate, up, *self.activation, fused=False) @ self.w2.to(dtype).t()


class FEPLBGroupedExperts(GroupedExperts if GroupedExperts is not None else torch.nn.Module):
    """AutoEP's ``GroupedExperts`` with FEPLB's expert stage (module docstring); set up by `install`."""

    # under a cross-node placement, a state dict taken outside `canonical_experts` names the stacked
    # weights so (`integration.expert_order.record_expert_order`)
    feplb_expert_keys = (("w1", "feplb_placed_w1"), ("w2", "feplb_placed_w2"), ("w3", "feplb_placed_w3"))

    def expert_states(self, optimizer) -> StackedExperts:
        """The local experts as placement moves them: rows of ``w1, w2, w3`` (with ``optimizer``'s
        state)."""
        return StackedExperts([self.w1, self.w2, self.w3], optimizer)

    def feplb_setup(self, config: FEPLBConfig, ep_group, ep_size: int, layer_facts: dict, step_ends=None,
                    later=None) -> None:
        """``layer_facts``: what every rank of the EP group must have built alike (top-k, hidden
        size, experts); ``step_ends`` says whether the current micro-batch ends the optimizer step
        (`seams.step_ends`; default: every one does), ``later`` how many micro-batches of the step
        follow it (`seams.later_micro_batches`; default: none)."""
        self.feplb_config = config
        # cross-node placement, set by `install` (feplb.placement); a second install keeps it
        self.placement: Optional[ExpertPlacement] = getattr(self, "placement", None)
        # a placement-order state dict's, loaded before it: kept by a second install
        self.loaded_expert_order: Optional[list[int]] = getattr(self, "loaded_expert_order", None)
        keep_expert_order(self)  # install may run twice on one model
        self.feplb_ep_group = ep_group
        self.feplb_ep_size = ep_size
        self._layer_facts = layer_facts
        self.stage: Optional[ExpertStage] = None
        self._plain_stats: dict = {}
        self._feplb_ready = False
        self.step_ends = step_ends if step_ends is not None else (lambda: True)
        self.later_micro_batches = later if later is not None else (lambda: 0)
        # this forward's stacked weights [w1, w2, w3] and replica slots' weights [S][3]: the
        # parameters and `ReplicaSlots.weights`, or their aliases through `ExpertGradOrder`
        self._weights: Optional[tuple[list[torch.Tensor], list[list[torch.Tensor]]]] = None

    @property
    def feplb_stats(self) -> dict:
        """Stats of the last forward (`stats.MicroBatchStats`; empty before the first)."""
        return self.stage.stats if self.stage is not None else self._plain_stats

    def feplb_weights_changed(self) -> None:
        """`weight_watch.weights_changed` for this layer."""
        copies_stale(self.stage, getattr(self, "placement", None))

    def memory_facts(self) -> Optional[LayerMemoryFacts]:
        """What `memory.check_at_initialize` needs of this layer (None: FEPLB off, or one rank)."""
        config = self.feplb_config
        if not config.enabled or self.feplb_ep_size <= 1:
            return None
        slices = [self.w1[0], self.w2[0], self.w3[0]]
        placement = getattr(self, "placement", None)  # made at install, its replica slots with it
        held = placement.redundant if placement is not None else 0
        return LayerMemoryFacts(self.feplb_ep_group, self.feplb_ep_size, domain_size(config, self.feplb_ep_size),
                                slices, slices[0].shape[1],
                                replica_bytes(slices, held, allocated=True, held_back=False),
                                moves_in_domains(config, self.feplb_ep_size))

    def _feplb_attach(self) -> None:
        adopt_loaded_order(self)  # without a placement, refuses a state dict in placement order
        config = self.feplb_config
        if self.feplb_ep_size > 1 and dist.is_initialized():
            check_group_agrees(config, self.feplb_ep_group, self._layer_facts)
        slices = [self.w1[0], self.w2[0], self.w3[0]]
        # not a submodule: its meta parameters must not join the model's parameters or state_dict
        object.__setattr__(self, "_template", SwiGLUExpert(self))
        slots = self.placement.local_slots if self.placement is not None else self.num_experts
        stage = ExpertStage(config, self.feplb_ep_group, self.feplb_ep_size, slots, slices, hidden=slices[0].shape[1])
        if stage.balances or self.placement is not None:  # otherwise AutoEP's own forward, untouched
            self.stage = stage
            # a placement weighs its moves by the measured time per row, also where nothing balances
            stage.times_every_call = self.placement is not None
            grouped = self._grouped if _runs_grouped(self) else None  # else the loop, as AutoEP's own
            self._local_experts = LocalExperts([self._template] * slots, self._slices,
                                               ExpertSpec.of(self._template, grouped), static_fn=self._static,
                                               current=self._primary_slices)
        self._feplb_ready = True

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if not self._feplb_ready:
            self._feplb_attach()
        stage = self.stage
        if stage is None:
            if self.feplb_config.stats.enabled:
                counts = num_tokens_per_expert.detach().to("cpu", torch.int64).numpy()
                rank = dist.get_rank() if dist.is_initialized() else 0
                self._plain_stats = unbalanced_stats(counts[None], [rank])
            return super().forward(x, num_tokens_per_expert)
        try:
            counts, facts = stage.exchange(num_tokens_per_expert.detach())  # the one copy to the host
            rows = int(counts.sum())
            x = self._link_weights(x)
            out = stage.run(x[:rows], counts, self._local_experts, facts, self.step_ends(), self.later_micro_batches())
        except RuntimeError:
            stage.check_peers()  # a collective failed: a dead peer is the likely cause, name it
            raise
        finally:
            self._weights = None
        if x.shape[0] > rows:  # trailing padding rows of AutoEP's permute: zero output
            out = torch.cat([out, out.new_zeros((x.shape[0] - rows, out.shape[1]))])
        return out

    def _link_weights(self, x: torch.Tensor) -> torch.Tensor:
        """Set this forward's weights (`_weights`). With replica slots: first their weights made the
        experts' homes' (`ReplicaSlots.keep_current`, collective); then the
        rows ``x``, the stacked parameters and the replicas' weights through one `ExpertGradOrder`
        node, whose backward (on every rank, after the expert stage's) sends the replicas'
        gradients home at a step's end and adds those of this rank's experts to their rows of the
        stacked gradients (`_StackedReplicaLink`). Returns ``x`` (or its alias)."""
        stacked = [self.w1, self.w2, self.w3]
        replicas = self.placement.replicas if self.placement is not None else None
        if replicas is None:
            self._weights = stacked, []
            return x
        replicas.keep_current(self._primary_slices, self.step_ends(), stacked)
        flat = [t for group in replicas.weights for t in group]
        if not (torch.is_grad_enabled() and any(p.requires_grad for p in stacked)):
            self._weights = stacked, replicas.weights
            return x
        link = _StackedReplicaLink(replicas, self.later_micro_batches())
        x, *aliases = ExpertGradOrder.apply(link, x, *stacked, *flat)
        n = len(stacked)
        self._weights = aliases[:n], [aliases[i:i + n] for i in range(n, len(aliases), n)]
        return x

    def _slices(self) -> list[list[torch.Tensor]]:
        """Each local slot's weights ``[w1[e], w2[e], w3[e]]``: the primaries' views from one ``unbind``
        per stacked parameter, whose backward assembles that parameter's gradient once (an index per
        expert would zero-fill a full-size ``[E_local, F, H]`` gradient for each expert and
        parameter), then the replica slots'."""
        stacked, replicas = self._weights
        return [list(weights) for weights in zip(*(w.unbind(0) for w in stacked))] + [list(w) for w in replicas]

    def _primary_slices(self) -> list[list[torch.Tensor]]:
        """Each primary slot's weights as they are now, outside a forward (`LocalExperts.current`)."""
        return [list(weights) for weights in zip(*(w.detach().unbind(0) for w in (self.w1, self.w2, self.w3)))]

    def _grouped(self, weights: list[torch.Tensor], x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """k experts at once through the layer's own grouped GEMM (AutoEP's kernel choice and
        activation): weights ``[w1 [k, F, H], w2 [k, H, F], w3 [k, F, H]]``, x ``[N, H]`` with ``sizes[i]``
        rows of expert i -> ``[N, H]``: the pieces of one message a helper serves, or a home's dynamic
        pieces whose weights are neighbours (`phase2.Phase2MicroBatch._compute`)."""
        counts = torch.tensor(sizes, dtype=torch.int64).to(x.device, non_blocking=True)
        return GroupedExperts.forward(_StackedAs(self, weights), x, counts)

    def _static(self, _slices: list, rows: torch.Tensor, blocks: list, static: list) -> torch.Tensor:
        """The slots ``static`` (ascending; their rows ``blocks[e]``, a split of ``rows``) through
        AutoEP's own expert compute (grouped GEMM or its loop): the primaries in one call on this
        forward's stacked weights (not on ``_slices``, their per-slot views), each replica slot in
        its own."""
        stacked, replicas = self._weights
        primaries = [e for e in static if e < self.num_experts]
        sizes = [len(blocks[e]) for e in primaries]
        outs = []
        if sum(sizes):
            static_counts = np.zeros(self.num_experts, np.int64)
            static_counts[primaries] = sizes
            # a prefix of the slots is a prefix of the rows: no copy
            x = rows[:sum(sizes)] if primaries == list(range(len(primaries))) else torch.cat(
                [blocks[e] for e in primaries])
            outs.append(GroupedExperts.forward(_StackedAs(self, stacked), x,
                                               torch.from_numpy(static_counts).to(rows.device, non_blocking=True)))
        for e in static[len(primaries):]:
            if len(blocks[e]):
                outs.append(self._grouped([w.unsqueeze(0) for w in replicas[e - self.num_experts]], blocks[e],
                                          [len(blocks[e])]))
        return torch.cat(outs) if len(outs) > 1 else outs[0] if outs else on_graph(rows[:0], stacked, always=True)


class _StackedReplicaLink:
    """What `ExpertGradOrder` carries for an AutoEP layer with replica slots: its tensors are the
    rows, the stacked ``w1, w2, w3``, then each replica slot's three weights."""

    def __init__(self, replicas: ReplicaSlots, later: int):
        self.replicas, self.later = replicas, later

    def backward(self, grads: tuple) -> list:
        rows, stacked, flat = grads[0], list(grads[1:4]), grads[4:]
        self.replicas.backward([list(flat[i:i + 3]) for i in range(0, len(flat), 3)], self.later)
        arriving = self.replicas.sums_here() if self.later == 0 else []
        if arriving:  # on the home of a replicated expert
            stacked = [g.clone() for g in stacked]
            for local, sums in arriving:
                for g, summed in zip(stacked, with_sum([g[local] for g in stacked], sums)):
                    g[local] = summed
        return [rows, *stacked, *([None] * len(flat))]


class _StackedAs:
    """A `GroupedExperts` as its ``forward`` reads it, with other stacked weights (``w1, w2, w3``)."""

    def __init__(self, layer: "GroupedExperts", weights: list[torch.Tensor]):
        self._layer = layer
        self.w1, self.w2, self.w3 = weights

    def __getattr__(self, name: str):
        return getattr(self._layer, name)


def _runs_grouped(experts: "GroupedExperts") -> bool:
    """Whether AutoEP computes these experts with a grouped GEMM (``torch._grouped_mm`` or Triton's)."""
    return bool(getattr(experts, "use_grouped_mm", False) or getattr(experts, "use_triton_grouped_mm", False))


def autoep_layers(model: torch.nn.Module) -> dict:
    """``{name: AutoEPMoELayer}`` of ``model`` (empty when DeepSpeed has no AutoEP)."""
    if AutoEPMoELayer is None:
        return {}
    return {name: m for name, m in model.named_modules() if isinstance(m, AutoEPMoELayer)}


def install(model: torch.nn.Module, config: FEPLBConfig, engine=None) -> dict:
    """Insert FEPLB phase 2 into every AutoEP layer of ``model`` (after ``deepspeed.initialize``);
    ``engine`` (the DeepSpeed engine, if any) says where optimizer steps end (weight residency).

    Returns ``{name: FEPLBGroupedExperts}``; nothing is changed when ``config.enabled`` is false.
    `FEPLBConfigError` names a setting that does not fit a layer.
    """
    layers = autoep_layers(model)
    if not config.enabled:
        return {}
    installed = {}
    for name, layer in layers.items():
        experts = layer.experts
        if not isinstance(experts, GroupedExperts):
            raise FEPLBModelError(f"AutoEP layer {name}: its experts module is a {type(experts).__name__}, "
                                   "not DeepSpeed's GroupedExperts; FEPLB cannot balance it")
        if config.dynamic_experts_per_rank > layer.num_local_experts:
            raise FEPLBConfigError(
                f"feplb.dynamic_experts_per_rank: {config.dynamic_experts_per_rank} exceeds the "
                f"{layer.num_local_experts} local experts per rank of AutoEP layer {name}; "
                f"use at most {layer.num_local_experts}")
        if layer.ep_size > 1 and layer.ep_group is None:
            raise RuntimeError(f"AutoEP layer {name}: no expert-parallel group yet; call install after "
                               "deepspeed.initialize")
        validate_domain_size(config, layer.ep_size)
        start_planner_early(config, layer.ep_group)
        if type(experts) is not FEPLBGroupedExperts:
            seams.become(experts, FEPLBGroupedExperts)
        facts = {"num_experts": layer.num_experts, "top-k": layer.top_k, "hidden size": layer.hidden_size,
                 "feplb.placement": config.placement.model_dump()}
        experts.feplb_setup(config, layer.ep_group, layer.ep_size, facts,
                            seams.step_ends(engine) if engine is not None else None,
                            seams.later_micro_batches(engine) if engine is not None else None)
        say_if_replicas_idle(config, layer.ep_size)
        if places(config, layer.ep_size):
            _place(name, layer, experts, config)
        installed[name] = experts
    return installed


def _place(name: str, layer, experts: FEPLBGroupedExperts, config: FEPLBConfig) -> None:
    """Cross-node placement for one AutoEP layer (``feplb.placement``): an `ExpertPlacement` on its
    experts (which `integration.placement_engine.install` drives at every optimizer step, moving rows of
    the stacked weights with their optimizer state) and its router's routes sent to the experts'
    slots (`PlacedRouter`)."""
    if experts.placement is not None:  # installed before: it may have moved experts already
        return
    redundant = replica_slots_per_rank(config, layer.ep_size)
    if redundant and getattr(layer, "comm_backend", None) == DEEPEP_BACKEND:
        raise FEPLBConfigError(f"feplb.placement.redundant_experts_per_rank: {redundant} replica slots per rank need "
                               f"AutoEP's all-to-all dispatch, and layer {name} dispatches with DeepEP "
                               "(expert_parallel.comm_backend: deepep); set redundant_experts_per_rank to 0 "
                               "(placement still moves experts between nodes) or use the all-to-all backend")
    folding = getattr(layer, "folding_group_handles", None)
    if redundant and folding is not None and folding.spec.tp_size > 1:  # as AutoEP decides it folds
        raise FEPLBConfigError(f"feplb.placement.redundant_experts_per_rank: {redundant} replica slots per rank do "
                               f"not cover AutoEP layers folded with AutoTP ({name}); set it to 0")
    if getattr(layer.router, "num_expert_groups", None) and first_time("node-limited placement"):
        warnings.warn(f"FEPLB: AutoEP layer {name} routes node-limited (num_expert_groups="
                      f"{layer.router.num_expert_groups}), which assumes that expert groups sit on nodes; "
                      "feplb.placement moves experts between nodes, so a token may reach more nodes than the "
                      "limit (the math is unchanged)", stacklevel=3)
    one_expert = [w[0] for w in (experts.w1, experts.w2, experts.w3)]
    experts.placement = ExpertPlacement.of(config, layer.num_experts, layer.ep_group, layer.ep_size, one_expert,
                                           experts.w1.device, redundant)
    if type(layer) is not PlacedLayer:
        seams.become(layer, PlacedLayer)
    if type(layer.router) is not PlacedRouter:
        seams.become(layer.router, PlacedRouter)
    object.__setattr__(layer.router, "_feplb_layer", layer)  # not a submodule: the layer holds the router


class PlacedLayer(AutoEPMoELayer if AutoEPMoELayer is not None else torch.nn.Module):
    """AutoEP's layer under a cross-node placement, dispatching to slots.

    AutoEP sizes its split plan and its experts' counts by ``num_experts`` and
    ``num_local_experts``. A rank holds ``local_slots`` slots (its ``E_local`` primaries, then its
    replica slots), so for the length of a forward the layer counts slots (``num_experts =
    ep_size * local_slots``; its `PlacedRouter` returns slot ids and per-slot counts). What stays
    logical is ``tokens_per_expert`` (what AutoEP's load-balancing bias update reads): AutoEP adds
    the per-slot counts to a scratch, and each slot's count goes to the expert it held."""

    def forward(self, hidden_states: torch.Tensor):
        placement = self.experts.placement
        with seams.counting_slots(self, placement.ep_size * placement.local_slots, placement.local_slots):
            out = super().forward(hidden_states)
            slot_counts = self.tokens_per_expert
        with torch.no_grad():
            if placement.holds_replicas:  # routing went through the host already: its slot table
                holds = torch.from_numpy(placement.slot_experts()).to(slot_counts.device, non_blocking=True)
                held = holds >= 0
                self.tokens_per_expert.index_add_(0, holds[held], slot_counts[held])
            else:  # each expert in its primary slot alone: a gather on the device, no host copy
                self.tokens_per_expert.add_(slot_counts[placement.slot_ids])
        return out


class PlacedRouter(TokenChoiceTopKRouter if TokenChoiceTopKRouter is not None else torch.nn.Module):
    """AutoEP's router under a cross-node placement: it returns each route's slot id
    (`ExpertPlacement.route`, which splits a replicated expert's routes between its holders) and
    the counts per slot, so that AutoEP's dispatch, its split plan and the experts module see
    slots (`PlacedLayer`), as DeepSpeed's MoE layer does under placement. The scores and the
    router's own bias stay logical. Training micro-batches (not recomputed ones) feed the
    placement's history."""

    def forward(self, x: torch.Tensor, expert_bias: Optional[torch.Tensor] = None):
        top_scores, selected, counts, *rest = super().forward(x, expert_bias)
        placement = self._feplb_layer.experts.placement
        if self.training and not recomputing():
            placement.record(selected)
        if placement.identity and not placement.redundant:
            return (top_scores, selected, counts, *rest)
        slots = placement.route(selected)
        return (top_scores, slots, count_tokens_per_expert(slots, placement.ep_size * placement.local_slots), *rest)


def autoep_stats(model: torch.nn.Module) -> dict:
    """``{layer name: feplb_stats of its last forward}`` for the AutoEP layers FEPLB balances."""
    return {name: layer.experts.feplb_stats for name, layer in autoep_layers(model).items()
            if isinstance(layer.experts, FEPLBGroupedExperts)}

