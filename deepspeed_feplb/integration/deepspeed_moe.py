"""`deepspeed_feplb.MoE`: a drop-in for `deepspeed.moe.layer.MoE` that balances every micro-batch.

`FEPLBMOELayer.forward`, one micro-batch of tokens ``[S, H]``:

1. gate: DeepSpeed's own `TopKGate` (dropless) or sigmoid top-k with aux-loss-free bias (`gate/`);
   a cross-node placement (`integration.placement`) maps the routes to the experts' slots;
2. phase 1: rows to their experts' home ranks, grouped by local expert (`dispatch/`), with the
   group's facts (`dispatch.GroupFacts`);
3. the expert stage (`expert_stage.ExpertStage`): balanced inside the NVLink domain, or not;
4. phase 1 in reverse and the gate-weighted combine.

Parameter names and the state_dict layout are DeepSpeed's, so checkpoints move both ways.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.distributed as dist
from deepspeed.moe import layer as ds_layer
from deepspeed.moe.sharded_moe import MOELayer, TopKGate

from deepspeed_feplb.config import FEPLBConfig, FEPLBModelError, load_config
from deepspeed_feplb.dispatch import make_dispatcher
from deepspeed_feplb.domain import domain_size, install_exit_handlers, moves_in_domains, start_planner_early
from deepspeed_feplb.expert_stage import ExpertStage, check_group_agrees
from deepspeed_feplb.experts import ExpertSpec, LocalExperts, on_graph, run_expert
from deepspeed_feplb.gate import SigmoidTopKGate
from deepspeed_feplb.gate.top1 import DroplessTop1Gate
from deepspeed_feplb.grouped_mlp import StackedMLP, empty_groups_zeroed
from deepspeed_feplb.integration import seams
from deepspeed_feplb.integration.expert_order import adopt_loaded_order, keep_expert_order
from deepspeed_feplb.integration.expert_state import ModuleExperts
from deepspeed_feplb.integration.placement import (
    ExpertPlacement,
    copies_stale,
    places,
    replica_slots_per_rank,
    say_if_replicas_idle,
)
from deepspeed_feplb.integration.replicas import with_sum
from deepspeed_feplb.memory import LayerMemoryFacts, replica_bytes
from deepspeed_feplb.migrate.phase2 import ONE_BACKWARD
from deepspeed_feplb.once import first_time
from deepspeed_feplb.stats import recomputing
from deepspeed_feplb.trace.record import get_recorder


def _resolve(config) -> Optional[FEPLBConfig]:
    if config is None or isinstance(config, FEPLBConfig):
        return config
    return load_config({"feplb": config} if isinstance(config, dict) and "feplb" not in config else config)


class FEPLBMOELayer(MOELayer):
    """DeepSpeed's `MOELayer` with FEPLB's expert stage (module docstring)."""

    feplb_config: Optional[FEPLBConfig]

    def feplb_setup(self, config=None) -> None:
        """Turn a DeepSpeed `MOELayer` (class already swapped) into a FEPLB one; attach lazily."""
        self.feplb_config = _resolve(config)
        self._feplb_ready = False
        self.stage: Optional[ExpertStage] = None  # at the first forward
        self.placement: Optional[ExpertPlacement] = None  # cross-node placement (feplb.placement), EP > 1
        # a placement-order state dict's, loaded before attach: kept by a second setup (`convert` in
        # `deepspeed_feplb.initialize` of a model built with `deepspeed_feplb.MoE` and loaded before it)
        self.loaded_expert_order: Optional[list[int]] = getattr(self, "loaded_expert_order", None)
        keep_expert_order(self)  # feplb_setup may run twice (MoE, then convert)
        if not hasattr(self, "step_ends"):
            self.step_ends = _every_micro_batch  # replaced by the engine's, see `seams.step_ends`
        if not hasattr(self, "later_micro_batches"):
            self.later_micro_batches = _none_later  # likewise, `seams.later_micro_batches`
        if not hasattr(self, "in_engine_backward"):
            self.in_engine_backward = _no_engine_epilogue  # likewise, `seams.in_engine_backward`

    @property
    def feplb_stats(self) -> dict:
        """Stats of the last forward (`stats.MicroBatchStats`; empty before the first)."""
        return self.stage.stats if self.stage is not None else {}

    def feplb_weights_changed(self) -> None:
        """`weight_watch.weights_changed` for this layer."""
        copies_stale(self.stage, self.placement)

    def memory_facts(self) -> Optional[LayerMemoryFacts]:
        """What `memory.check_at_initialize` needs of this layer (None: FEPLB off, or no EP group yet)."""
        config = self.feplb_config
        if config is None or not config.enabled or self.ep_size <= 1 or getattr(self, "ep_group", None) is None:
            return None
        params = list(self.experts.deepspeed_experts[0].parameters())
        placement = getattr(self, "placement", None)  # made at the first forward
        return LayerMemoryFacts(self.ep_group, self.ep_size, domain_size(config, self.ep_size), params,
                                self.gate.wg.in_features,
                                replica_bytes(params, replica_slots_per_rank(config, self.ep_size),
                                              allocated=placement is not None and placement.replicas is not None),
                                moves_in_domains(config, self.ep_size))

    # ------------------------------------------------------------------ runtime attach
    def _attach(self) -> None:
        if self.feplb_config is None:
            self.feplb_config = FEPLBConfig()
        config = self.feplb_config
        self.recorder = get_recorder(config.stats.record_trace)
        self._feplb_ready = True
        experts = list(self.experts.deepspeed_experts)
        expert_params = list(experts[0].parameters())
        hidden = self.gate.wg.in_features
        if self.ep_size > 1 and dist.is_initialized():
            check_group_agrees(config, self.ep_group, self._layer_facts())
        if not config.enabled:
            adopt_loaded_order(self)  # refuses a state dict in placement order
            return
        placed = places(config, self.ep_size)
        redundant = replica_slots_per_rank(config, self.ep_size)
        say_if_replicas_idle(config, self.ep_size)
        local_slots = self.num_local_experts + redundant  # the primary slots, then the replica slots
        self.stage = ExpertStage(config, self.ep_group if self.ep_size > 1 else None, self.ep_size, local_slots,
                                 expert_params, hidden)
        self.stage.records = self.recorder is not None  # the trace carries what the stage did
        install_exit_handlers()
        refuse_stateful_experts(experts[0], hidden, migrating=config.dynamic_experts_per_rank > 0 and self.ep_size > 1)
        if redundant and any(True for _ in experts[0].buffers()):
            raise FEPLBModelError(
                f"feplb.placement.redundant_experts_per_rank={redundant}: the MoE expert has buffers "
                f"({', '.join(n for n, _ in experts[0].named_buffers())}), and a replica slot holds an expert's "
                "parameters only; use experts without buffers, or set redundant_experts_per_rank to 0")
        if getattr(self.gate, "drop_tokens", False):
            _warn_dropless_once()
        seams.dropless(self.gate)
        if config.gating.score == "sigmoid" and not isinstance(self.gate, SigmoidTopKGate):
            self.gate = SigmoidTopKGate.from_topk_gate(self.gate, config.gating, seams.data_parallel_group())
        if DroplessTop1Gate.accepts(self.gate):
            seams.make_dropless_top1(self.gate)  # DeepSpeed's routes without its host sync
        if placed:
            self.placement = _make_placement(self, config, expert_params, redundant)
            if self.placement.replicas is not None:  # experts are parameters apiece: their gradients may wait
                self.placement.replicas.holds_back = True
                self.placement.replicas.in_engine_backward = self.in_engine_backward
            self.stage.times_every_call = True
        adopt_loaded_order(self)
        # a known MLP computes any set of its experts in one grouped GEMM per projection
        self.stacked_mlp = StackedMLP.of(experts[0])
        spec = ExpertSpec.of(experts[0], self.stacked_mlp.grouped if self.stacked_mlp is not None else None)
        # replica slots are computed functionally on their weights, and every rank of the EP group
        # must run their gradient exchange (`ExpertGradOrder`): no direct calls then; nor for a known
        # MLP, whose experts without rows stay out of the grouped call and get their zero gradients
        # from `ExpertGradOrder` (as DeepSpeed's capacity buffer gives them)
        direct = None if redundant or self.stacked_mlp is not None else (lambda e, x: run_expert(experts[e], x))
        self.local_experts = LocalExperts(experts + [experts[0]] * redundant, self._expert_params, spec, direct=direct,
                                          static_fn=self._static if self.stacked_mlp is not None else None)
        self._linked_params: Optional[list[list[torch.Tensor]]] = None  # this forward's, with replica slots
        self.dispatcher = make_dispatcher(config, self.stage.ep_group, self.ep_size, local_slots,
                                          expert_params, hidden=hidden, on_error=self.stage.check_peers,
                                          stage_times=self.stage.stage_times)

    def _layer_facts(self) -> dict:
        """What every rank of the EP group must have built alike (`expert_stage.check_group_agrees`)."""
        return {"num_experts": self.ep_size * self.num_local_experts, "top-k": getattr(self.gate, "k", None),
                "feplb.placement": self.feplb_config.placement.model_dump() if self.feplb_config else None,
                "hidden size": self.gate.wg.in_features,
                "expert order of the loaded state dict": self.loaded_expert_order}

    # ------------------------------------------------------------------ forward
    def forward(self, *input: torch.Tensor, **kwargs) -> torch.Tensor:
        if not self._feplb_ready:
            self._attach()
        if not self.feplb_config.enabled:
            return MOELayer.forward(self, *input, **kwargs)
        try:
            return self._forward(*input)
        except RuntimeError:
            self.stage.check_peers()  # a collective failed: a dead peer is the likely cause, name it
            raise

    def _forward(self, *input: torch.Tensor) -> torch.Tensor:
        d_model = input[0].shape[-1]
        x = input[0].reshape(-1, d_model)
        used_token = input[1] if len(input) > 1 else None
        timed = self.stage.stage_times.measure
        replicas = self.placement.replicas if self.placement is not None else None
        with timed("gate"):
            self.l_aux, _, _, expert_ids, _, gates, self.exp_counts = self._route(x, used_token)
        if self.recorder is not None and not recomputing():
            self.recorder.record(self, expert_ids)  # logical experts: a trace replays under any placement
        if self.placement is not None:
            if self.training and not recomputing():  # a reentrant checkpoint's first forward runs without grad
                self.placement.record(expert_ids)
            expert_ids = self.placement.route(expert_ids)
        primary = None
        if replicas is not None:  # collective; after the route, which may find them stale
            primary = self._primary_params()  # walked once for this forward: the write marks and the link
            replicas.keep_current(self._primary_params, self.step_ends(), [p for group in primary for p in group])
        with timed("dispatch"):
            rows, counts_by_source, handle, facts = self.dispatcher.dispatch(x, expert_ids, self.stage.announce())
        if replicas is not None:
            rows = self._link_replicas(rows, replicas, primary)
        out = self.stage.run(rows, counts_by_source.sum(0), self.local_experts, facts, self.step_ends(),
                             self.later_micro_batches())
        with timed("combine"):
            return self.dispatcher.combine(out, gates, handle).reshape(input[0].shape)

    def _route(self, x: torch.Tensor, used_token: Optional[torch.Tensor]):
        """The gate's sparse routes. DeepSpeed's dropless `TopKGate` all-reduces its largest expert
        count over the EP group, to size the dense dispatch of DeepSpeed's own layer; FEPLB sends
        exact splits and never reads it, so the gate runs without its EP group here: one collective
        less per forward, the same routes, gates and aux loss. (A top-1 gate is a `DroplessTop1Gate`
        by now: no host sync either.)"""
        gate = self.gate
        if type(gate) not in (TopKGate, DroplessTop1Gate):
            return gate(x, used_token, True, False)
        with seams.gate_without_ep_group(gate):
            return gate(x, used_token, True, False)

    def _static(self, params: list[list[torch.Tensor]], rows: torch.Tensor, blocks: list,
                static: list) -> torch.Tensor:
        """The experts ``static`` (ascending; rows ``blocks[e]``, a split of ``rows``) with ``params``
        in one grouped call (`StackedMLP`): ``[sum n_e, H]`` in their order. Experts without rows join
        it where the grouped GEMM zeroes their weight-gradients (`empty_groups_zeroed`): every
        expert then gets a view of one stacked gradient, as DeepSpeed's capacity buffer gives each a
        gradient; elsewhere they stay out, and `ExpertGradOrder` gives them zeros."""
        zeroed = empty_groups_zeroed(rows.device)
        members = static if zeroed else [e for e in static if len(blocks[e])]
        sizes = [len(blocks[e]) for e in members]
        if not sum(sizes):
            return on_graph(rows[:0], [p for e in static for p in params[e]], always=True)
        # all the rows: no copy; else one (whose backward hands each block a view, where a slice of
        # ``rows`` would zero-fill a full-size gradient)
        x = rows if sum(sizes) == len(rows) else torch.cat([blocks[e] for e in members])
        mlp = self.stacked_mlp
        if zeroed and len(params) == len(blocks):  # every expert's weights as they lie (no copy), others rowless
            static_set = set(static)
            weights = mlp.in_place(params, [e not in static_set for e in range(len(blocks))])
            if weights is not None:
                return mlp.grouped(weights, x, [len(blocks[e]) if e in static_set else 0 for e in range(len(blocks))])
        return mlp.grouped(mlp.stack([params[e] for e in members]), x, sizes)

    def _primary_params(self) -> list[list[torch.Tensor]]:
        return [list(expert.parameters()) for expert in self.experts.deepspeed_experts]

    def expert_states(self, optimizer) -> ModuleExperts:
        """The local experts as placement moves them (with ``optimizer``'s state)."""
        return ModuleExperts(self._primary_params(), optimizer)

    def _expert_params(self) -> list[list[torch.Tensor]]:
        """Every local expert's parameters, routed through `ExpertGradOrder` when gradients flow; with
        replica slots, this forward's (`_link_replicas`)."""
        if self._linked_params is not None:
            return self._linked_params
        params = self._primary_params()
        flat = [p for group in params for p in group]
        if not (torch.is_grad_enabled() and any(p.requires_grad for p in flat)):
            return params
        aliases = iter(ExpertGradOrder.apply(None, *flat))
        return [[next(aliases) for _ in group] for group in params]

    def _link_replicas(self, rows: torch.Tensor, replicas, primary: list[list[torch.Tensor]]) -> torch.Tensor:
        """This forward's local expert parameters with replica slots (primaries, then the replicas'
        weights; `_expert_params` returns them), and ``rows`` through the same `ExpertGradOrder`
        node: its backward, which sends the replicas' gradients home (collective over the EP group),
        then runs on every rank after the expert stage's backward and before the dispatch's. At a
        step's last micro-batch the node takes the experts at `ReplicaSlots.held_back_locals` (the
        same local indices on every rank) as detached stand-ins, so that their gradients reach the
        parameters only with the replicas' sums, when the backward ends
        (`ReplicaSlots.at_backward_end`). ``primary``: this forward's `_primary_params`."""
        params = primary + replicas.weights
        flat = [p for group in params for p in group]
        if not (torch.is_grad_enabled() and any(p.requires_grad for p in flat)):
            self._linked_params = params
            return rows
        later = self.later_micro_batches()
        late = {i: params[i] for i in (replicas.held_back_locals() if later == 0 else [])}
        link = _ReplicaLink(replicas, later, self.num_local_experts, len(params[0]), late)
        inputs = [[p.detach().requires_grad_() for p in group] if i in late else group
                  for i, group in enumerate(params)]
        rows, *aliases = ExpertGradOrder.apply(link, rows, *(p for group in inputs for p in group))
        aliases = iter(aliases)
        self._linked_params = [[next(aliases) for _ in group] for group in params]
        return rows


def _make_placement(layer: "FEPLBMOELayer", config: FEPLBConfig, expert_params, redundant: int) -> ExpertPlacement:
    """The layer's `ExpertPlacement` over its EP group (nodes of ``nvlink_domain_size`` ranks) and its
    expert-data-parallel replicas, with ``redundant`` replica slots per rank."""
    if layer.ep_size <= domain_size(config, layer.ep_size) and first_time("one-node placement"):
        if dist.get_rank() == 0:  # one line per job, not a warning per rank
            print(f"deepspeed_feplb: feplb.placement.enabled: the expert-parallel group ({layer.ep_size} ranks) is one "
                  "NVLink domain (feplb.nvlink_domain_size), so placement has no node to balance against another and "
                  "will not move experts; per-micro-batch balancing inside the domain does the work", flush=True)
    return ExpertPlacement.of(config, layer.ep_size * layer.num_local_experts, layer.ep_group, layer.ep_size,
                              expert_params, layer.gate.wg.weight.device, redundant)


def refuse_stateful_experts(expert: torch.nn.Module, hidden: int, migrating: bool) -> None:
    """Raise `FEPLBConfigError` for experts whose math FEPLB would change.

    FEPLB computes each expert on exactly its rows (DeepSpeed pads every expert to the capacity)
    and, when migrating, computes moved rows with a helper's copy of the expert: so an expert with
    batch statistics (BatchNorm) is refused, and, when migrating, one whose forward updates a
    buffer (found by running a copy of the expert on two rows in training mode)."""
    import copy

    for name, module in expert.named_modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            raise FEPLBModelError(
                f"the MoE expert contains a {type(module).__name__} ({name or 'the expert itself'}): its batch "
                "statistics depend on which rows it sees together, and FEPLB computes each expert on exactly its "
                "rows (DeepSpeed pads them to the capacity) and may split them over ranks; use LayerNorm or RMSNorm "
                "in the expert, or set feplb.enabled to false")
    buffers = dict(expert.named_buffers())
    if not migrating or not buffers:
        return
    probe = copy.deepcopy(expert).train()
    param = next(probe.parameters(), None)
    x = torch.randn(2, hidden, dtype=param.dtype if param is not None else torch.float32,
                    device=param.device if param is not None else "cpu")
    with torch.no_grad():
        probe(x)
    changed = sorted(n for n, b in probe.named_buffers() if not torch.equal(b, buffers[n]))
    if changed:
        raise FEPLBModelError(
            f"the MoE expert updates buffer(s) {', '.join(changed)} in its forward: FEPLB computes moved rows with "
            "a helper's copy of the expert, whose buffer updates would not reach the expert's home; set "
            "feplb.dynamic_experts_per_rank to 0 to keep every expert's rows at home")


def _every_micro_batch() -> bool:
    """Without an engine that says otherwise, every micro-batch ends its optimizer step."""
    return True


def _no_engine_epilogue() -> bool:
    """Without an engine, no reduction waits at the backward's end before FEPLB's callbacks
    (`seams.in_engine_backward`)."""
    return True


def _none_later() -> int:
    """Without an engine that says otherwise, no micro-batch of the step follows (`_every_micro_batch`)."""
    return 0


def _warn_dropless_once() -> None:
    if not first_time("dropless"):
        return
    warnings.warn("FEPLB computes every routed token: a MoE layer built with drop_tokens=True (DeepSpeed's default) "
                  "drops the tokens above its capacity in DeepSpeed's MoE but none with FEPLB enabled, so the two "
                  "compute different outputs. Build the layer with drop_tokens=False to make them agree, or set "
                  "feplb.enabled to false to keep DeepSpeed's dropping.", UserWarning, stacklevel=4)


class ExpertGradOrder(torch.autograd.Function):
    """Identity on all local expert parameters whose backward releases their gradients together:
    ``(link, *tensors) -> tensors``.

    Which experts are dynamic, and so when each expert's gradient is ready, differs between
    ranks and micro-batches. ZeRO-2 reduces gradients in buckets as they become ready and
    needs the same order on every data-parallel rank; this autograd node makes that order the fixed
    parameter order again (and gives every expert a gradient, zeros if it got no tokens,
    as DeepSpeed's capacity buffer does). With replica slots, ``link`` (a `_ReplicaLink`) sends
    their gradients home in the backward.
    """

    @staticmethod
    def forward(ctx, link, *tensors):
        ctx.link, ctx.link_ran = link, False
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.link is None:
            return (None, *grads)
        if ctx.link_ran:  # a second backward through the graph: the replicas' sums went home in the first
            raise RuntimeError(ONE_BACKWARD)
        ctx.link_ran = True
        return (None, *ctx.link.backward(grads))


class _ReplicaLink:
    """What `ExpertGradOrder` carries with replica slots: its tensors are ``rows``, the primary
    experts' parameters (``primaries`` x ``n``), then the replica slots' weights; ``late``: at a
    step's end, {local index: parameters} of the experts whose gradients wait for the backward's
    end (the node took stand-ins for them: `ReplicaSlots.held_back_locals`)."""

    def __init__(self, replicas, later: int, primaries: int, n: int, late: dict):
        self.replicas, self.later, self.primaries, self.n, self.late = replicas, later, primaries, n, late

    def backward(self, grads: tuple) -> list:
        rows, flat = grads[0], list(grads[1:])
        groups = [flat[i:i + self.n] for i in range(0, len(flat), self.n)]
        homes = groups[:self.primaries]
        late = sorted(self.late)
        self.replicas.backward(groups[self.primaries:], self.later, late)
        for local, sums in (self.replicas.sums_here() if self.later == 0 else []):
            homes[local] = with_sum(homes[local], sums)
        if late:
            self.replicas.at_backward_end([self.late[i] for i in late], [homes[i] for i in late], late)
            for i in late:
                homes[i] = [None] * self.n
        return [rows, *(g for group in homes for g in group), *([None] * (len(flat) - self.primaries * self.n))]


class MoE(ds_layer.MoE):
    """Drop-in `deepspeed.moe.layer.MoE` with FEPLB balancing (same arguments, returns, state_dict).

    Extra keyword-only argument:
        feplb_config: a `FEPLBConfig`, a ``"feplb"`` section dict, or a whole ds_config (dict or
            path). Default: the ``"feplb"`` section of the DeepSpeed engine that wraps the model,
            or the defaults.
    """

    def __init__(self, hidden_size: int, expert: torch.nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: Optional[str] = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True, *, feplb_config=None) -> None:
        super().__init__(hidden_size, expert, num_experts, ep_size, k, capacity_factor, eval_capacity_factor,
                         min_capacity, use_residual, noisy_gate_policy, drop_tokens, use_rts, use_tutel,
                         enable_expert_tensor_parallelism, top2_2nd_expert_sampling)
        seams.become(self.deepspeed_moe, FEPLBMOELayer)
        self.deepspeed_moe.feplb_setup(feplb_config)

    @property
    def feplb_stats(self) -> dict:
        """Stats of the last forward (`stats.MicroBatchStats`; empty before the first)."""
        return self.deepspeed_moe.feplb_stats

    def extra_repr(self) -> str:
        """``print(model)`` shows a FEPLB layer as such (its class is called MoE, as DeepSpeed's)."""
        config = self.deepspeed_moe.feplb_config
        if config is None:
            return "FEPLB (the engine's \"feplb\" section, or the defaults, at the first forward)"
        if not config.enabled:
            return "FEPLB disabled (DeepSpeed's MoE layer)"
        return f"FEPLB, dynamic_experts_per_rank={config.dynamic_experts_per_rank}"

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        super().set_deepspeed_parallelism(use_data_before_expert_parallel_)
        engine = seams.configuring_engine()
        if engine is not None:
            self.deepspeed_moe.step_ends = seams.step_ends(engine)
            self.deepspeed_moe.later_micro_batches = seams.later_micro_batches(engine)
            self.deepspeed_moe.in_engine_backward = seams.in_engine_backward(engine)
        if self.deepspeed_moe.feplb_config is None and engine is not None:
            self.deepspeed_moe.feplb_config = load_config(seams.engine_feplb_section(engine))
        config = self.deepspeed_moe.feplb_config
        if engine is not None and config.enabled:
            from deepspeed_feplb.integration.placement_engine import cross_node_layer, resolve_auto, with_replica_slots
            from deepspeed_feplb.integration.placement_engine import install as install_placement
            config = resolve_auto(config, getattr(engine, "module", None), engine.config, [self.ep_size])
            if config.placement.redundant_experts_per_rank == "auto":
                # decided by deepspeed_feplb.initialize alone (`engine.resolve_replica_slots`), which
                # measures the memory the built engine leaves and then hands its layers their config
                config = with_replica_slots(config, 0)
            self.deepspeed_moe.feplb_config = config
            if cross_node_layer(config, [self.ep_size]):
                install_placement(engine)
        if config is not None and self.ep_size > 1:
            start_planner_early(config, self.deepspeed_moe.ep_group)

    @classmethod
    def from_deepspeed(cls, module: ds_layer.MoE, feplb_config=None) -> "MoE":
        """Turn a `deepspeed.moe.layer.MoE` into this class in place (weights and names kept)."""
        seams.become(module, cls)
        seams.become(module.deepspeed_moe, FEPLBMOELayer)
        module.deepspeed_moe.feplb_setup(feplb_config)
        return module
