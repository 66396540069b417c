"""`deepspeed_feplb.MoE`: a drop-in for `deepspeed.moe.layer.MoE` that balances every micro-batch.

Stages of `FEPLBMOELayer.forward` (one micro-batch, tokens ``[S, H]``):

1. gate (DeepSpeed's own `TopKGate`, dropless; or sigmoid top-k with aux-loss-free bias, `gate/`);
2. phase 1: routes to the experts' home ranks, rows grouped by local expert (`dispatch/`);
3. `balance.run_experts`: publish the per-expert counts to the domain's scheduler
   (`scheduler/`, which runs `plan/`), compute the static experts (all but this rank's D hottest)
   meanwhile, then phase 2: dynamic experts computed where the plan says, weights and rows moved
   inside the NVLink domain (`migrate/`), gradients brought home in backward;
   or, when the domain cannot gain this micro-batch (``feplb.fixed_costs: "measured"``: nothing
   timed yet, or a time spread below one expert piece plus one message,
   `plan.policy.balancing_may_pay`), `balance.run_local`: every expert here, nothing exchanged.
   Phase 1's count exchange carries each rank's measured costs, so every rank of the EP group takes
   that decision alike; the domain runtime (scheduler, transport, shared memory) is set up at the
   first micro-batch that balances, so a run that never gains never pays for it;
4. phase 1 in reverse and the gate-weighted combine.

Parameter names and the state_dict layout are DeepSpeed's, so checkpoints move both ways.
"""
from __future__ import annotations

import hashlib
import warnings
from collections import OrderedDict
from datetime import timedelta
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.moe import layer as ds_layer
from deepspeed.moe.sharded_moe import MOELayer, TopKGate

from deepspeed_feplb.balance import ComputeTimes, functional_calls, run_experts, run_local
from deepspeed_feplb.config import FEPLBConfig, FEPLBConfigError, FEPLBModelError, load_config
from deepspeed_feplb.dispatch import make_dispatcher
from deepspeed_feplb.domain import DomainRuntime, domain_size, get_runtime, install_exit_handlers
from deepspeed_feplb.gate import SigmoidTopKGate
from deepspeed_feplb.integration import seams
from deepspeed_feplb.integration.monitor import gather_small
from deepspeed_feplb.integration.placement import adopt_loaded_order, check_expert_order, record_expert_order
from deepspeed_feplb.migrate import transport_class
from deepspeed_feplb.migrate.phase2 import ExpertSpec
from deepspeed_feplb.migrate.placement import ExpertPlacement, state_bytes_per_expert
from deepspeed_feplb.migrate.resident import LayerResidency
from deepspeed_feplb.plan.policy import balancing_may_pay, rows_bound
from deepspeed_feplb.stats import StageTimes, layer_stats, recomputing
from deepspeed_feplb.trace.record import get_recorder


def _resolve(config) -> Optional[FEPLBConfig]:
    if config is None or isinstance(config, FEPLBConfig):
        return config
    return load_config({"feplb": config} if isinstance(config, dict) and "feplb" not in config else config)


class FEPLBMOELayer(MOELayer):
    """DeepSpeed's `MOELayer` with FEPLB's two-phase dispatch (module docstring)."""

    feplb_config: Optional[FEPLBConfig]

    def feplb_setup(self, config=None) -> None:
        """Turn a DeepSpeed `MOELayer` (class already swapped) into a FEPLB one; attach lazily."""
        self.feplb_config = _resolve(config)
        self.feplb_stats: dict = {}
        self._feplb_ready = False
        self.compute_times = ComputeTimes()
        self.stage_times = StageTimes()  # host time per stage (forward and backward), see `stats.StageTimes`
        self.domain: Optional[DomainRuntime] = None  # set up at the first micro-batch that balances
        self.residency: Optional[LayerResidency] = None  # weight residency, with a domain
        self._decisions: OrderedDict[bytes, bool] = OrderedDict()  # routes digest -> `_balances_now`, for recomputes
        self.placement: Optional[ExpertPlacement] = None  # cross-node placement (feplb.placement), EP > 1
        self.loaded_expert_order: Optional[list[int]] = None  # a placement-order state dict's, loaded before attach
        if not getattr(self, "_feplb_state_hooks", False):  # feplb_setup may run twice (MoE, then convert)
            self._feplb_state_hooks = True
            self.register_state_dict_post_hook(record_expert_order)
            self._register_load_state_dict_pre_hook(check_expert_order, with_module=True)
        if not hasattr(self, "step_ends"):
            self.step_ends = _every_micro_batch  # replaced by the engine's, see `seams.step_ends`

    # ------------------------------------------------------------------ runtime attach
    def _attach(self) -> None:
        if self.feplb_config is None:
            self.feplb_config = FEPLBConfig()
        config = self.feplb_config
        self.recorder = get_recorder(config.stats.record_trace)
        self._feplb_ready = True
        if self.ep_size > 1 and dist.is_initialized():
            self._check_ep_group_agrees(config)
        if not config.enabled:
            adopt_loaded_order(self)  # refuses a state dict in placement order
            return
        install_exit_handlers()
        refuse_stateful_experts(self.experts.deepspeed_experts[0], self.gate.wg.in_features,
                                migrating=config.dynamic_experts_per_rank > 0 and self.ep_size > 1)
        if getattr(self.gate, "drop_tokens", False):
            _warn_dropless_once()
        self.gate.drop_tokens = False  # FEPLB is dropless
        if config.gating.score == "sigmoid" and not isinstance(self.gate, SigmoidTopKGate):
            self.gate = SigmoidTopKGate.from_topk_gate(self.gate, config.gating)
        group = self.ep_group if self.ep_size > 1 else None
        experts = list(self.experts.deepspeed_experts)
        expert_params = list(experts[0].parameters())
        self.expert_spec = ExpertSpec.of(experts[0])
        self.expert_bytes = sum(p.numel() * p.element_size() for p in expert_params)
        self.row_bytes = self.gate.wg.in_features * expert_params[0].element_size()  # one token row (time model)
        self.transport_cls = transport_class(config, expert_params)  # checks the configured backends exist here
        self.balances = (self.ep_size > 1 and config.dynamic_experts_per_rank > 0
                         and domain_size(config, self.ep_size) > 1)
        if config.placement.enabled and self.ep_size > 1:
            self.placement = _make_placement(self, config, expert_params)
        adopt_loaded_order(self)
        self.dispatcher = make_dispatcher(config, group, self.ep_size, self.num_local_experts, expert_params,
                                          hidden=self.gate.wg.in_features, on_error=self._check_peers,
                                          stage_times=self.stage_times)

    def _open_domain(self) -> None:
        """Set up the domain runtime (collective over the EP group: every rank calls it at the same forward)."""
        self.domain = get_runtime(self.ep_group, self.feplb_config, self.transport_cls)
        self.residency = LayerResidency.create(self.domain.size, self.num_local_experts, self.feplb_config)

    def _check_peers(self) -> None:
        """After a failed collective: raise naming a dead domain peer, if one is known."""
        if self.domain is not None:
            self.domain.watch.check()

    def _check_ep_group_agrees(self, config: FEPLBConfig) -> None:
        """Collective over the EP group at the first forward: every rank must have built the same
        layer and ``"feplb"`` section; `FEPLBConfigError` names the first setting that differs
        (instead of a gloo size error or a hang in a later collective)."""
        facts = {"num_experts": self.ep_size * self.num_local_experts, "top-k": getattr(self.gate, "k", None),
                 "hidden size": self.gate.wg.in_features, "feplb.enabled": config.enabled,
                 "feplb.dynamic_experts_per_rank": config.dynamic_experts_per_rank,
                 "feplb.nvlink_domain_size": config.nvlink_domain_size, "feplb.transport": config.transport,
                 "feplb.fixed_costs": config.fixed_costs,
                 "feplb.weight_residency": config.weight_residency,
                 "feplb.max_rows_over_mean": config.max_rows_over_mean,
                 "expert order of the loaded state dict": getattr(self, "loaded_expert_order", None)}
        ranks = dist.get_process_group_ranks(self.ep_group)
        if dist.get_backend(self.ep_group) == "gloo":  # bounded, and it names who is missing
            timeout_s = config.scheduler.peer_timeout_s
            try:
                dist.monitored_barrier(group=self.ep_group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
            except RuntimeError as error:
                raise RuntimeError(f"FEPLB: not every rank of expert-parallel group {ranks} ran this MoE layer's first "
                                   f"forward within feplb.scheduler.peer_timeout_s={timeout_s:g} s; every rank must run "
                                   f"the same forwards of the layer ({error})") from None
            everyone = gather_small(facts, group=self.ep_group)  # one collective where all_gather_object takes two
        else:
            everyone = [None] * self.ep_size
            dist.all_gather_object(everyone, facts, group=self.ep_group)
        for key in facts:
            values = [f[key] for f in everyone]
            if any(v != values[0] for v in values):
                raise FEPLBConfigError(
                    f"MoE layer: {key} differs across the ranks of its expert-parallel group ("
                    + ", ".join(f"rank {r}: {v}" for r, v in zip(ranks, values))
                    + "); every rank must build the same layer with the same \"feplb\" section")

    # ------------------------------------------------------------------ forward
    def forward(self, *input: torch.Tensor, **kwargs) -> torch.Tensor:
        if not self._feplb_ready:
            self._attach()
        if not self.feplb_config.enabled:
            return MOELayer.forward(self, *input, **kwargs)
        try:
            return self._forward(*input)
        except RuntimeError:
            self._check_peers()  # a collective failed: a dead peer is the likely cause, name it
            raise

    def _forward(self, *input: torch.Tensor) -> torch.Tensor:
        d_model = input[0].shape[-1]
        x = input[0].reshape(-1, d_model)
        used_token = input[1] if len(input) > 1 else None
        timed = self.stage_times.measure
        with timed("gate"):
            self.l_aux, _, _, expert_ids, _, gates, self.exp_counts = self._route(x, used_token)
        if self.recorder is not None and not recomputing():
            self.recorder.record(self, expert_ids)  # logical experts: a trace replays under any placement
        if self.placement is not None:
            if self.training and torch.is_grad_enabled() and not recomputing():
                self.placement.record(expert_ids)
            expert_ids = self.placement.route(expert_ids)
        with timed("dispatch"):
            rows, counts_by_source, handle = self.dispatcher.dispatch(x, expert_ids, self._announce())
        out = self._experts(rows, counts_by_source.sum(0), handle)
        with timed("combine"):
            return self.dispatcher.combine(out, gates, handle).reshape(input[0].shape)

    def _route(self, x: torch.Tensor, used_token: Optional[torch.Tensor]):
        """The gate's sparse routes. DeepSpeed's dropless `TopKGate` all-reduces its largest expert
        count over the EP group, to size the dense dispatch of DeepSpeed's own layer; FEPLB sends
        exact splits and never reads it, so the gate runs without its EP group here: one collective
        less per forward, the same routes, gates and aux loss."""
        gate = self.gate
        if type(gate) is not TopKGate:
            return gate(x, used_token, True, False)
        group, gate.ep_group = gate.ep_group, None
        try:
            return gate(x, used_token, True, False)
        finally:
            gate.ep_group = group

    def _announce(self) -> tuple[float, ...]:
        """What phase 1 tells the EP group for `_balances_now`: this rank's (piece_us, row_us) (a
        one-row call, and the fitted cost per row; NaN before anything was timed) and how long its
        previous count exchange took (µs)."""
        if not self.balances or self.feplb_config.fixed_costs == "ignore":
            return ()
        exchange_us = getattr(self.dispatcher, "exchange_seconds", float("nan")) * 1e6
        return (*(self.compute_times.fitted_us() or (float("nan"), float("nan"))), exchange_us)

    def _balances_now(self, handle) -> bool:
        """Whether this micro-batch goes through the domain (plan and phase 2). Every rank of the EP
        group decides from the same data: the routes and costs phase 1 gathered. Opens the domain at
        the first micro-batch that any domain of the group balances. A forward that activation
        checkpointing recomputes takes the decision of its original forward (its routes are the
        same; its saved tensors must be too), and never opens the domain inside backward."""
        if not self.balances:
            return False
        routes, fits = getattr(handle, "routes", None), getattr(handle, "announced", None)
        if self.feplb_config.fixed_costs == "ignore" or routes is None or fits is None or fits.shape[1] != 3:
            if self.domain is None:
                self._open_domain()
            return True  # the planner alone decides
        key = hashlib.blake2b(routes.tobytes(), digest_size=16).digest()
        if recomputing():
            return self._decisions.get(key, False) and self.domain is not None
        G = domain_size(self.feplb_config, self.ep_size)
        loads = self._received(routes)
        row_cap = rows_bound(self.feplb_config.max_rows_over_mean, self._mean_rows(handle))
        if row_cap:  # the planner leaves a rank up to one chunk less a row over the cap
            row_cap += self.feplb_config.chunk_align_tokens - 1
        pays = [balancing_may_pay(loads[d:d + G], *_typical(fits[d:d + G, :2]), self._message_us(fits[d:d + G, 2]),
                                  row_cap)
                for d in range(0, self.ep_size, G)]
        if self.domain is None and any(pays):
            self._open_domain()
        kept = self.residency is not None and bool(self.residency.table.resident.any())  # their gradients go home in phase 2
        decided = self.domain is not None and (pays[dist.get_rank(self.ep_group) // G] or kept)
        self._decisions[key] = decided
        while len(self._decisions) > _DECISIONS_KEPT:
            self._decisions.popitem(last=False)
        return decided

    def _mean_rows(self, handle) -> float:
        """Rows per rank over the EP group, from phase 1's gathered routes (0: not known, as with
        the DeepEP dispatcher; the planner then takes its domain's mean)."""
        routes = getattr(handle, "routes", None)
        return float(routes.sum()) / self.ep_size if routes is not None else 0.0

    def _received(self, routes: np.ndarray) -> np.ndarray:
        """Phase 1's gathered routes int64 [ep_size, E] -> rows each rank of the EP group received
        per local expert, int64 [ep_size, E_local]."""
        return routes.sum(axis=0).reshape(self.ep_size, self.num_local_experts)

    def _message_us(self, exchange_us: np.ndarray) -> float:
        """One message's latency between ranks of a domain: the transport's figure, or, when larger
        and the EP group is that one domain, the shortest of the ranks' last count exchanges
        (float64 [G] µs; the rank that arrived last waited for nobody, so its exchange took about the
        group's latency; on an oversubscribed host this includes waiting for a core, as a phase-2
        message would). An exchange over several domains would add the network's latency."""
        measured = exchange_us[np.isfinite(exchange_us)]
        if not measured.size or domain_size(self.feplb_config, self.ep_size) != self.ep_size:
            return self.transport_cls.message_us
        return max(self.transport_cls.message_us, float(measured.min()))

    def _experts(self, rows: torch.Tensor, counts: np.ndarray, handle=None) -> torch.Tensor:
        """rows ``[N, H]`` grouped by local expert, counts ``int64 [E_local]`` -> outputs ``[N, H]``."""
        experts = self.experts.deepspeed_experts
        if not self._balances_now(handle):
            if self.balances and dist.get_world_size() > self.ep_size:
                # expert-data-parallel replicas in other EP groups may balance this micro-batch: the
                # gradients must become ready in the balancing path's order (`ExpertGradOrder`)
                call = functional_calls(experts, self._expert_params(), self.expert_spec)
            else:
                call = lambda e, x: _call(experts[e], x)  # noqa: E731
            # timed for the fit and for the placement's time per token; a recompute is not a micro-batch
            timed = (self.balances or self.placement is not None) and not recomputing()
            probe = self.balances and self.feplb_config.fixed_costs == "measured"
            out = run_local(rows, counts, call, self.compute_times if timed else None, self.stage_times, probe)
            if self.feplb_config.stats.enabled:
                self.feplb_stats = self._local_stats(counts, handle)
            return out
        out, stats = run_experts(rows, counts, experts, self._expert_params(), self.expert_spec, self.domain,
                                 self.feplb_config, self.expert_bytes, self.compute_times, self.stage_times,
                                 residency=self.residency, step_ends=self.step_ends(),
                                 mean_rows=self._mean_rows(handle))
        if stats is not None:
            self.feplb_stats = stats
        return out

    def _local_stats(self, counts: np.ndarray, handle) -> dict:
        """Stats of a micro-batch computed without balancing: over the domain when phase 1 told
        every rank's counts, else over this rank."""
        routes = getattr(handle, "routes", None)
        if not self.balances or routes is None:
            return layer_stats(counts[None], np.zeros((0, 4), np.int64), 0.0, False, [0])
        G = domain_size(self.feplb_config, self.ep_size)
        first = dist.get_rank(self.ep_group) // G * G
        domain_counts = self._received(routes)[first:first + G]
        ranks = dist.get_process_group_ranks(self.ep_group)[first:first + G]
        return layer_stats(domain_counts, np.zeros((0, 4), np.int64), 0.0, False, ranks)

    def _expert_params(self) -> list[list[torch.Tensor]]:
        """Every local expert's parameters, routed through `ExpertGradOrder` when gradients flow."""
        params = [list(expert.parameters()) for expert in self.experts.deepspeed_experts]
        flat = [p for group in params for p in group]
        if not (torch.is_grad_enabled() and any(p.requires_grad for p in flat)):
            return params
        aliases = iter(ExpertGradOrder.apply(*flat))
        return [[next(aliases) for _ in group] for group in params]


def _make_placement(layer: "FEPLBMOELayer", config: FEPLBConfig, expert_params) -> ExpertPlacement:
    """The layer's `ExpertPlacement` over its EP group (nodes of ``nvlink_domain_size`` ranks) and its
    expert-data-parallel replicas."""
    from deepspeed.utils import groups
    dp_group = None
    try:
        dp_group = groups._get_expert_data_parallel_group(f"ep_size_{layer.ep_size}")
    except (KeyError, AssertionError, RuntimeError):
        pass  # the layer's groups were made outside DeepSpeed's registry: no replicas to agree with
    placement = config.placement
    if layer.ep_size <= domain_size(config, layer.ep_size) and not _warned.get("one-node placement"):
        _warned["one-node placement"] = True
        warnings.warn(f"feplb.placement.enabled: the expert-parallel group ({layer.ep_size} ranks) is one NVLink domain "
                      "(feplb.nvlink_domain_size), so placement has no node to balance against another and will not "
                      "move experts; per-micro-batch balancing inside the domain does the work", UserWarning,
                      stacklevel=5)
    return ExpertPlacement(layer.ep_size * layer.num_local_experts, layer.ep_group, layer.ep_size,
                           domain_size(config, layer.ep_size), placement.interval_steps, placement.history_decay,
                           placement.network_gbps, state_bytes_per_expert(expert_params),
                           dynamic_experts=config.dynamic_experts_per_rank, intra_gbps=config.copy_engine_gbps,
                           dp_group=dp_group, device=layer.gate.wg.weight.device)


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


_warned: dict = {}  # warnings said once per process, by topic


def _warn_dropless_once() -> None:
    if _warned.get("dropless"):
        return
    _warned["dropless"] = True
    warnings.warn("FEPLB computes every routed token: a MoE layer built with drop_tokens=True (DeepSpeed's default) "
                  "drops the tokens above its capacity in DeepSpeed's MoE but none with FEPLB enabled, so the two "
                  "compute different outputs. Build the layer with drop_tokens=False to make them agree, or set "
                  "feplb.enabled to false to keep DeepSpeed's dropping.", UserWarning, stacklevel=4)


class ExpertGradOrder(torch.autograd.Function):
    """Identity on all local expert parameters whose backward releases their gradients together.

    Which experts are dynamic, and so when each expert's gradient is ready, differs between
    ranks and micro-batches. ZeRO-2 reduces gradients in buckets as they become ready and
    needs the same order on every data-parallel rank; this autograd node makes that order the fixed
    parameter order again (and gives every expert a gradient, zeros if it got no tokens,
    as DeepSpeed's capacity buffer does).
    """

    @staticmethod
    def forward(ctx, *params):
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads):
        return grads


_DECISIONS_KEPT = 256  # forwards whose recompute may still come (pipeline schedules keep several in flight)


def _typical(fits: np.ndarray) -> tuple[float, float]:
    """A domain's (piece_us, row_us) from its ranks' fits (float64 [G, 2], NaN: a rank that has
    timed nothing yet, e.g. one that received no rows): the medians over the timed ranks, so that
    one rank's noisy fit (a timed call that lost its core) does not decide; NaN if none is timed."""
    timed = fits[np.isfinite(fits).all(axis=1)]
    if not len(timed):
        return float("nan"), float("nan")
    piece_us, row_us = np.median(timed, axis=0)
    return float(piece_us), float(row_us)


def _call(expert: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = expert(x)
    return out[0] if isinstance(out, tuple) else out


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
        """Stats of the last forward: see `deepspeed_feplb.stats.layer_stats`."""
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
        if self.deepspeed_moe.feplb_config is None and engine is not None:
            self.deepspeed_moe.feplb_config = load_config(seams.engine_feplb_section(engine))
        if engine is not None and self.deepspeed_moe.feplb_config.placement.enabled:
            from deepspeed_feplb.integration.placement import install as install_placement
            install_placement(engine)

    @classmethod
    def from_deepspeed(cls, module: ds_layer.MoE, feplb_config=None) -> "MoE":
        """Turn a `deepspeed.moe.layer.MoE` into this class in place (weights and names kept)."""
        seams.become(module, cls)
        seams.become(module.deepspeed_moe, FEPLBMOELayer)
        module.deepspeed_moe.feplb_setup(feplb_config)
        return module
