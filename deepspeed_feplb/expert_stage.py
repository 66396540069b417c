"""One layer's expert stage, shared by both layer kinds (DeepSpeed MoE and AutoEP).

Between phase 1's dispatch and combine, `ExpertStage.run` computes a micro-batch's local experts:

1. `ExpertStage.balances_now`, the skip rule: whether this micro-batch goes through the domain.
   Every rank of the EP group decides alike, from phase 1's `GroupFacts` (each rank's received
   rows and its announced costs); the domain runtime opens at the first micro-batch that any
   domain of the group balances, so a run that never gains never pays for it; a forward that
   activation checkpointing recomputes takes its original forward's decision.
2. Balanced: `run_experts` publishes the counts to the domain's scheduler, computes the static
   experts (all but this rank's D hottest) meanwhile, then runs the dynamic experts through
   `migrate.phase2` (rows and weights to helpers of the domain, results and gradients home).
   Not balanced: `run_local`, every expert here, each call timed for the cost fit.
3. `ComputeTimes` (`expert_costs`) and `StageTimes` record what it cost; ``stats`` what it did.

A layer kind adapts only its gate and dispatch (or AutoEP's seam) and says how to compute its
experts (`LocalExperts`).
"""
from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from datetime import timedelta
from functools import partial
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from deepspeed_feplb.collectives import gather_counts, gather_small
from deepspeed_feplb.config import FEPLBConfig, FEPLBConfigError
from deepspeed_feplb.dispatch import GroupFacts
from deepspeed_feplb.domain import DomainRuntime, domain_size, get_runtime
from deepspeed_feplb.expert_costs import ComputeTimes
from deepspeed_feplb.migrate import transport_class
from deepspeed_feplb.migrate.arena import slot_bytes
from deepspeed_feplb.migrate.phase2 import (
    DynamicExperts,
    ExpertSpec,
    Phase2Anchor,
    Phase2MicroBatch,
    bound,
    grad_experts,
    tensor_slots,
)
from deepspeed_feplb.migrate.resident import LayerResidency, copy_bytes
from deepspeed_feplb.plan.policy import PlanConstraints, balancing_may_pay, dynamic_candidates, rows_bound
from deepspeed_feplb.stats import (
    MicroBatchStats,
    StageTimes,
    layer_stats,
    recomputing,
    residency_stats,
    unbalanced_stats,
)

# static_fn(rows, blocks, static) -> outputs of the experts in ``static`` (local ids, ascending),
# concatenated in expert order; ``rows`` ``[N, H]`` the micro-batch's rows grouped by expert,
# ``blocks[e]`` ``[n_e, H]`` expert e's (one split of ``rows``: its backward is one concatenation,
# where a slice per expert would zero-fill a full-size gradient each). A layer kind's
# `LocalExperts.static_fn` takes this forward's parameters first (`LocalExperts.static`).
StaticFn = Callable[[torch.Tensor, list, list], torch.Tensor]
ExpertCall = Callable[[int, torch.Tensor], torch.Tensor]

_DECISIONS_KEPT = 256  # forwards whose recompute may still come (pipeline schedules keep several in flight)


@dataclass
class LocalExperts:
    """How a layer kind computes its ``E_local`` experts.

    modules: one module per local expert, run functionally as a template (`ExpertSpec.call`);
    params: per local expert, its parameters in ``spec.param_names`` order (they may be aliases
        that route gradients, `deepspeed_moe.ExpertGradOrder`);
    direct: ``call(e, x)`` as the model itself runs expert e (``modules[e]``, each its own), for
        experts computed at home: with `calls`, on ``params`` bound as the modules' parameters
        (None: functionally);
    static_fn: ``static_fn(params, rows, blocks, static)`` computes a set of experts at once on
        ``params`` (AutoEP's grouped GEMM, a known MLP's `grouped_mlp.StackedMLP`), or None.
    """
    modules: Sequence[torch.nn.Module]
    params: Callable[[], list[list[torch.Tensor]]]
    spec: ExpertSpec
    direct: Optional[ExpertCall] = None
    static_fn: Optional[Callable[..., torch.Tensor]] = None

    def __post_init__(self):
        if self.direct is not None and len({id(m) for m in self.modules}) != len(self.modules):
            raise ValueError("direct calls need one module per local expert; shared templates run functionally")

    def static(self, params: Optional[list[list[torch.Tensor]]]) -> Optional[StaticFn]:
        """`static_fn` on ``params`` (None: the modules' own parameters, for direct calls)."""
        if self.static_fn is None:
            return None
        if params is None:
            params = [list(m.parameters()) for m in self.modules]
        return partial(self.static_fn, params)

    @contextmanager
    def calls(self, params: list[list[torch.Tensor]]):
        """``call(e, x)``: expert e on rows x ``[n, H]`` with ``params[e]``. With `direct`, the modules
        themselves, ``params`` bound as their parameters until the block ends (`phase2.bound`: once
        per forward for all experts, where functional calls bind around each); else functionally."""
        if self.direct is None:
            yield functional_calls(self.modules, params, self.spec)
            return
        # where each module keeps its parameters, looked up now: a submodule replaced since is bound too
        with bound([tensor_slots(m) for m in self.modules], params):
            yield self.direct


def check_group_agrees(config: FEPLBConfig, ep_group, layer_facts: dict) -> None:
    """Collective over the EP group at the first forward: every rank must have built the same
    layer (``layer_facts``: name -> value) and ``"feplb"`` section; `FEPLBConfigError` names the
    first setting that differs (instead of a size error or a hang in a later collective)."""
    facts = {**layer_facts, "feplb.enabled": config.enabled,
             "feplb.dynamic_experts_per_rank": config.dynamic_experts_per_rank,
             "feplb.nvlink_domain_size": config.nvlink_domain_size, "feplb.transport": config.transport,
             "feplb.fixed_costs": config.fixed_costs, "feplb.weight_residency": config.weight_residency,
             "feplb.max_rows_over_mean": config.max_rows_over_mean}
    ranks = dist.get_process_group_ranks(ep_group)
    if dist.get_backend(ep_group) == "gloo":  # bounded, and it names who is missing
        timeout_s = config.scheduler.peer_timeout_s
        try:
            dist.monitored_barrier(group=ep_group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
        except RuntimeError as error:
            raise RuntimeError(f"FEPLB: not every rank of expert-parallel group {ranks} ran this MoE layer's first "
                               f"forward within feplb.scheduler.peer_timeout_s={timeout_s:g} s; every rank must run "
                               f"the same forwards of the layer ({error})") from None
    everyone = gather_small(facts, group=ep_group)
    for key in facts:
        values = [f[key] for f in everyone]
        if any(v != values[0] for v in values):
            raise FEPLBConfigError(
                f"MoE layer: {key} differs across the ranks of its expert-parallel group ("
                + ", ".join(f"rank {r}: {v}" for r, v in zip(ranks, values))
                + "); every rank must build the same layer with the same \"feplb\" section")


class ExpertStage:
    """One FEPLB layer's expert stage over its EP group (``ep_size`` ranks, ``num_local_experts``
    each); ``expert_params``: one expert's parameters (sizes, device, transport choice)."""

    def __init__(self, config: FEPLBConfig, ep_group, ep_size: int, num_local_experts: int,
                 expert_params: Sequence[torch.Tensor], hidden: int):
        self.config, self.ep_group, self.ep_size, self.num_local_experts = config, ep_group, ep_size, num_local_experts
        self.domain_size = domain_size(config, ep_size)
        self.balances = ep_size > 1 and config.dynamic_experts_per_rank > 0 and self.domain_size > 1
        self.expert_bytes = sum(p.numel() * p.element_size() for p in expert_params)
        self.expert_tensors = len(expert_params)
        self.copy_bytes = copy_bytes(expert_params)  # one kept copy: weights and fp32 weight-gradient
        self.row_bytes = hidden * expert_params[0].element_size()  # one row (time model)
        self.transport_cls = transport_class(config, expert_params)  # checks the configured backends exist here
        self.device = expert_params[0].device  # the transport's, not torch's current device
        self.compute_times = ComputeTimes()
        self.stage_times = StageTimes()  # host time per stage (forward and backward)
        self.domain: Optional[DomainRuntime] = None  # set up at the first micro-batch that balances
        self.residency: Optional[LayerResidency] = None  # weight residency, with a domain
        self.times_every_call = False  # a placement reads the time per row even where nothing balances
        self.stats: MicroBatchStats | dict = {}
        self._decisions: OrderedDict[bytes, bool] = OrderedDict()  # received digest -> decision, for recomputes
        self._exchange_us = float("nan")  # this rank's last count exchange
        self._rows_here = 0  # this rank's rows in the current micro-batch
        self.records = False  # a trace recorder reads `last` (`trace.record`)
        self.last: Optional[dict] = None  # with `records`: what the last micro-batch did (`_measure`)

    # ------------------------------------------------------------------ group facts
    def announce(self) -> tuple[float, ...]:
        """What phase 1 tells the EP group for `balances_now`: this rank's (piece_us, row_us) (a
        one-row call, and the fitted cost per row; NaN before anything was timed) and how long its
        previous count exchange took (µs)."""
        if not self.balances or self.config.fixed_costs == "ignore":
            return ()
        return (*(self.compute_times.fitted_us() or (float("nan"), float("nan"))), self._exchange_us)

    def exchange(self, counts: torch.Tensor) -> tuple[np.ndarray, GroupFacts]:
        """For a layer kind whose dispatch does not tell the group's counts (AutoEP): every rank's
        received rows (``counts`` ``[E_local]``, integer, on the group's device: CUDA for NCCL) and
        `announce` values, in one all-gather and one copy to the host (this rank's counts come back
        with the others'). Returns (this rank's counts, int64 ``[E_local]``; the `GroupFacts`)."""
        received, announced, seconds = gather_counts(counts, self.announce(), self.ep_group, self.ep_size)
        here = dist.get_rank(self.ep_group) if self.ep_group is not None else 0
        return received[here].copy(), GroupFacts(received, announced, seconds)

    # ------------------------------------------------------------------ the skip rule
    def balances_now(self, facts: GroupFacts) -> bool:
        """Whether this micro-batch goes through the domain (plan and phase 2), decided alike on
        every rank of the EP group from ``facts``; opens the domain at the first micro-batch that
        any domain of the group balances, never inside backward."""
        if not self.balances:
            return False
        received, fits = facts.received, facts.announced
        if self.config.fixed_costs == "ignore" or received is None or fits is None or fits.shape[1] != 3:
            if self.domain is None:
                self._open_domain(facts)
            return True  # the planner alone decides
        key = hashlib.blake2b(received.tobytes(), digest_size=16).digest()
        if recomputing():
            return self._decisions.get(key, False) and self.domain is not None
        G = self.domain_size
        row_cap = rows_bound(self.config.max_rows_over_mean, float(received.sum()) / self.ep_size)
        if row_cap:  # the planner leaves a rank up to one chunk less a row over the cap
            row_cap += self.config.chunk_align_tokens - 1
        pays = [balancing_may_pay(received[d:d + G], *_typical(fits[d:d + G, :2]), self._message_us(fits[d:d + G, 2]),
                                  row_cap)
                for d in range(0, self.ep_size, G)]
        if self.domain is None and any(pays):
            self._open_domain(facts)
        # their gradients go home in phase 2
        kept = self.residency is not None and bool(self.residency.table.resident.any())
        decided = self.domain is not None and (pays[dist.get_rank(self.ep_group) // G] or kept)
        self._decisions[key] = decided
        while len(self._decisions) > _DECISIONS_KEPT:
            self._decisions.popitem(last=False)
        return decided

    def _message_us(self, exchange_us: np.ndarray) -> float:
        """One message's latency between ranks of a domain: what the domain's transport measured
        when it opened (before that, the transport class's prior), or, when larger and the EP group
        is that one domain, the shortest of the ranks' last count exchanges (float64 [G] µs; the
        rank that arrived last waited for nobody, so its exchange took about the group's latency;
        on an oversubscribed host this includes waiting for a core, as a phase-2 message would). An
        exchange over several domains would add the network's latency."""
        figure = (self.domain.transport if self.domain is not None else self.transport_cls).message_us
        measured = exchange_us[np.isfinite(exchange_us)]
        if not measured.size or self.domain_size != self.ep_size:
            return figure
        return max(figure, float(measured.min()))

    def _open_domain(self, facts: GroupFacts) -> None:
        """Set up the domain runtime (collective over the EP group: every rank calls it at the same
        forward), its receive slots sized for this layer's shapes and this micro-batch's rows."""
        slot = self.config.transport_slot_mb
        if slot == "auto":
            # per chunk: the parameters, a buffer or two, the rows (a bound: `messages.rows_to_helper`)
            rows = self._mean_rows(facts) or self._rows_here  # a backend that tells no other rank's rows
            slot = slot_bytes(self.config.dynamic_experts_per_rank, self.expert_bytes, self.expert_tensors + 2, rows,
                              self.row_bytes)
        else:
            slot = int(slot * 2**20)
        self.domain = get_runtime(self.ep_group, self.config, self.transport_cls, self.device, slot)
        self.residency = LayerResidency.create(self.domain.size, self.num_local_experts, self.config,
                                               self.domain.kept_bytes, self.copy_bytes)

    def check_peers(self) -> None:
        """After a failed collective: raise naming a dead domain peer, if one is known."""
        if self.domain is not None:
            self.domain.watch.check()

    # ------------------------------------------------------------------ one micro-batch
    def run(self, rows: torch.Tensor, counts: np.ndarray, experts: LocalExperts, facts: GroupFacts,
            step_ends: bool = True) -> torch.Tensor:
        """rows ``[N, H]`` grouped by local expert, counts ``int64 [E_local]`` -> outputs ``[N, H]``;
        ``step_ends``: this micro-batch is the last of its optimizer step (weight residency)."""
        self._rows_here = int(counts.sum())
        if not math.isnan(facts.exchange_seconds):  # a backend that exchanged nothing leaves the last figure
            self._exchange_us = facts.exchange_seconds * 1e6
        config = self.config
        # measured (`_measure`): a training micro-batch of a balancing layer, or any with a recorder
        measured = (self.balances or self.records) and torch.is_grad_enabled() and not recomputing()
        record = {} if measured else None
        if self.records and record is not None and not rows.requires_grad:
            # the recorded backward ends at the rows' gradient: a layer fed without gradients (a test's
            # first layer; a model's hidden states have them) computes that gradient when recording
            rows = rows.detach().requires_grad_()
        self.compute_times.calls = (0, 0)
        balanced = self.balances_now(facts)  # may open the domain: a one-off, not part of the stage
        start, cpu_start = time.perf_counter(), time.process_time()
        if self.records and record is not None:
            if self.device.type == "cuda":
                record["events"] = [_device_mark(), None, None, None]  # the recorded stage times on the device's clock
            record["fit_us"] = self.compute_times.fitted_us(balanced)  # what this micro-batch's path was priced at
            record["forward_share"] = self.compute_times.forward_share(balanced)
        if balanced:
            params = experts.params()
            with experts.calls(params) as call:
                out, stats = run_experts(rows, counts, experts.modules, params, experts.spec, self.domain, config,
                                         self.expert_bytes, self.compute_times, self.stage_times,
                                         experts.static(params),
                                         self.residency, step_ends, self._mean_rows(facts), record, call)
            if stats is not None:
                self.stats = stats
            return self._measure(record, rows, out, start, cpu_start)
        # expert-data-parallel replicas in other EP groups may balance this micro-batch: the gradients
        # must become ready in the balancing path's order (`ExpertGradOrder`'s aliases); else the
        # model's own experts as they are
        aliased = experts.direct is None or (self.balances and dist.get_world_size() > self.ep_size)
        # timed for the fit and for the placement's time per row; a recompute is not a micro-batch
        timed = (self.balances or self.times_every_call) and not recomputing()
        probe = self.balances and config.fixed_costs == "measured"
        params = experts.params() if aliased else None
        with experts.calls(params) if aliased else nullcontext(experts.direct) as call:
            out = run_local(rows, counts, call, self.compute_times if timed else None, self.stage_times, probe,
                            experts.static(params))
        if config.stats.enabled and not recomputing():
            self.stats = self._local_stats(counts, facts)
        return self._measure(record, rows, out, start, cpu_start)

    def _measure(self, record: Optional[dict], rows: torch.Tensor, out: torch.Tensor, start: float,
                 cpu_start: float) -> torch.Tensor:
        """Time the stage's forward (from ``start``) and, through two gradient hooks, its backward
        (from the output's gradient to the rows'). Once the backward ran, the stage's busy time (both,
        less the waits for the plan and the domain) goes to `ComputeTimes.stage_done` (host clock
        only: on CUDA the host's time is not the device's). With a trace recorder, `last` keeps what
        this micro-batch did: ``moves`` int64 [M, 5] = (home EP rank, local expert, helper EP rank,
        rows, fresh) of its domain's plan, ``plan_us`` (when the plan was in hand, from the stage's
        start, host clock; NaN: not balanced), ``fit_us`` (the fitted piece and row cost of the path
        it took, as they were before it: `ComputeTimes.fitted_us`), ``forward_share`` (the share of
        the stage's busy time its planner gave the forward, `StageFactor`), the stage's time, ``forward_us``
        now and ``backward_us`` once its backward ran (host clock; on CUDA also CUDA events, which
        `recorded` reads), ``cpu_us``, the CPU time this process used meanwhile (all its threads:
        on an oversubscribed host far less than the two; NaN until the backward ran), and
        ``message_us``, the message latency the planner priced (the domain transport's measured
        figure; NaN: no domain yet). Returns ``out``."""
        if record is None:
            return out
        forward_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
        events = record.get("events")
        if events is not None:
            events[1] = _device_mark()
        calls = self.compute_times.calls  # (0, 0) on CUDA: only host-timed calls are counted (`finish`)
        phase2, plan_wait_s = record.get("phase2"), record.get("plan_wait_s", 0.0)
        phase2_forward_waits_s = phase2.wait_s if phase2 is not None else 0.0  # its backward adds its own
        last = None
        if self.records:
            first = dist.get_rank(self.ep_group) // self.domain_size * self.domain_size if self.ep_group else 0
            moves = record.get("moves", np.zeros((0, 4), np.int64))
            fresh = record.get("fresh", np.ones(len(moves), np.bool_))
            last = self.last = {
                "moves": np.column_stack([moves[:, 0] + first, moves[:, 1], moves[:, 2] + first, moves[:, 3],
                                          fresh]).astype(np.int64).reshape(-1, 5),
                "plan_us": (record["plan_in_hand"] - start) * 1e6 if "plan_in_hand" in record else float("nan"),
                "fit_us": record["fit_us"] or (float("nan"), float("nan")),
                "forward_share": record["forward_share"],
                "forward_us": forward_s * 1e6, "backward_us": float("nan"), "cpu_us": float("nan"),
                "message_us": self.domain.transport.message_us if self.domain is not None else float("nan")}
            if events is not None:
                last["events"] = events
        if not (out.requires_grad and rows.requires_grad) or (last is None and not calls[0]):
            return out
        begun, times = [], self.compute_times

        def backward_begins(grad):
            begun.extend((time.perf_counter(), time.process_time()))
            if events is not None:
                events[2] = _device_mark()

        def backward_ends(grad):
            if not begun:
                return
            backward_s = time.perf_counter() - begun[0]
            if last is not None:
                last["backward_us"] = backward_s * 1e6
                last["cpu_us"] = (cpu_s + time.process_time() - begun[1]) * 1e6
                if events is not None:
                    events[3] = _device_mark()
            if calls[0]:
                backward_waits_s = phase2.wait_s - phase2_forward_waits_s if phase2 is not None else 0.0
                times.stage_done(forward_s - plan_wait_s - phase2_forward_waits_s, backward_s - backward_waits_s,
                                 calls, balanced=phase2 is not None)

        out.register_hook(backward_begins)
        rows.register_hook(backward_ends)
        return out

    def recorded(self) -> Optional[dict]:
        """`last` for a trace recorder: on CUDA its forward and backward times on the device's clock
        (the stage's CUDA events, waited for: only a recording run pays that), else as it is."""
        last = self.last
        if last is None or "events" not in last:
            return last
        return _device_times(last)

    def _mean_rows(self, facts: GroupFacts) -> float:
        """Rows per rank over the EP group (0: not known, with a dispatcher that tells no `GroupFacts`; the
        planner then takes its domain's mean)."""
        return float(facts.received.sum()) / self.ep_size if facts.received is not None else 0.0

    def _local_stats(self, counts: np.ndarray, facts: GroupFacts) -> MicroBatchStats:
        """Stats of a micro-batch computed without balancing: over the domain when phase 1 told
        every rank's counts, else over this rank."""
        if not self.balances or facts.received is None:
            return unbalanced_stats(counts[None], [dist.get_rank() if dist.is_initialized() else 0])
        G = self.domain_size
        first = dist.get_rank(self.ep_group) // G * G
        ranks = dist.get_process_group_ranks(self.ep_group)[first:first + G]
        return unbalanced_stats(facts.received[first:first + G], ranks)


def _device_mark():
    """A CUDA event recorded now on the current stream."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _device_times(last: dict) -> dict:
    """``last`` without its ``events`` (stage begin, forward end, backward begin, backward end; None:
    not reached), with ``forward_us`` and ``backward_us`` read from them where they were reached."""
    begin, forward_end, backward_begin, backward_end = last["events"]
    out = {key: value for key, value in last.items() if key != "events"}
    if forward_end is not None:
        forward_end.synchronize()
        out["forward_us"] = begin.elapsed_time(forward_end) * 1e3
    if backward_end is not None:
        backward_end.synchronize()
        out["backward_us"] = backward_begin.elapsed_time(backward_end) * 1e3
    return out


def _typical(fits: np.ndarray) -> tuple[float, float]:
    """A domain's (piece_us, row_us) from its ranks' fits (float64 [G, 2], NaN: a rank that has
    timed nothing yet, e.g. one that received no rows): the medians over the timed ranks, so that
    one rank's noisy fit (a timed call that lost its core) does not decide; NaN if none is timed."""
    timed = fits[np.isfinite(fits).all(axis=1)]
    if not len(timed):
        return float("nan"), float("nan")
    piece_us, row_us = np.median(timed, axis=0)
    return float(piece_us), float(row_us)


def functional_calls(modules: Sequence[torch.nn.Module], params: list[list[torch.Tensor]],
                     spec: ExpertSpec) -> ExpertCall:
    """``call(e, x)``: local expert e on rows x, run functionally with ``params[e]`` and its own buffers."""
    return lambda e, x: spec.call(modules[e], params[e], spec.buffers(modules[e]), x)


def timed_pieces(rows: torch.Tensor, blocks: list, experts: Sequence[int], mark: Callable[[], object],
                 call: ExpertCall, static_fn: Optional[StaticFn] = None, pieces: Optional[list] = None,
                 between: Optional[Callable[[], Optional[Callable[[], None]]]] = None) -> list[torch.Tensor]:
    """Outputs of ``experts`` (local ids, ascending) on their rows (``blocks[e]`` ``[n_e, H]``, a
    split of ``rows``): ``call(e, x)`` each, or ``static_fn`` for all at once. Appends samples
    (k pieces with rows, n rows, start mark, end mark) of the calls to ``pieces``: one for them all
    (the fit ``t = k * piece + n * row`` holds for a sum of calls as for one, and one pair of marks
    per stage, CUDA events on a GPU, costs the host less than a pair per expert), split where
    ``between()``, asked after each call (after the grouped one), returns work to do there (phase
    2's sends, once the plan is in hand): that work is not expert compute."""
    sizes = [len(blocks[e]) for e in experts]
    timed = pieces is not None and sum(sizes) > 0
    k = n = 0
    start = mark() if timed else None

    def called(pieces_with_rows: int, rows_: int) -> None:
        nonlocal k, n, start
        k, n = k + pieces_with_rows, n + rows_
        work = between() if between is not None else None
        if work is None:
            return
        if timed and n:
            pieces.append((k, n, start, mark()))
        work()
        k = n = 0
        if timed:
            start = mark()

    if static_fn is not None:
        outs = list(static_fn(rows, blocks, list(experts)).split(sizes))
        called(sum(size > 0 for size in sizes), sum(sizes))
    else:
        outs = []
        for e, size in zip(experts, sizes):
            outs.append(call(e, blocks[e]))
            called(int(size > 0), size)
    if timed and n:
        pieces.append((k, n, start, mark()))
    return outs


def run_local(rows: torch.Tensor, counts: np.ndarray, call: ExpertCall, times: Optional[ComputeTimes],
              stage_times: StageTimes, probe: bool = False, static_fn: Optional[StaticFn] = None) -> torch.Tensor:
    """rows ``[N, H]`` grouped by local expert, counts ``int64 [E_local]`` -> outputs ``[N, H]``, every
    expert computed here (no balancing) by ``call(e, x)`` or ``static_fn``. Each call is timed
    into ``times`` (None: not timed); ``probe``: also time a one-row call once (`ComputeTimes.probe`)."""
    mark = times.clock(rows.device) if times is not None else (lambda: 0.0)
    pieces: list = []
    if times is not None and probe:
        times.probe(rows, counts, call, mark)
    begin = mark()
    with stage_times.measure("static experts"):
        outs = timed_pieces(rows, list(rows.split(counts.tolist())), range(len(counts)), mark, call, static_fn,
                            pieces=pieces if times else None)
    if times is not None:
        end = mark()
        times.finish(begin, end, end, int(counts.sum()), pieces)
    return torch.cat(outs) if outs else rows


def run_experts(rows: torch.Tensor, counts: np.ndarray, modules: Sequence[torch.nn.Module],
                params: list[list[torch.Tensor]], spec: ExpertSpec, domain: DomainRuntime, config: FEPLBConfig,
                expert_bytes: int, times: ComputeTimes, stage_times: Optional[StageTimes] = None,
                static_fn: Optional[StaticFn] = None, residency: Optional[LayerResidency] = None,
                step_ends: bool = True, mean_rows: float = 0.0, record: Optional[dict] = None,
                call: Optional[ExpertCall] = None) -> tuple[torch.Tensor, Optional[MicroBatchStats]]:
    """rows ``[N, H]`` grouped by local expert, counts ``int64 [E_local]`` -> (outputs ``[N, H]``,
    stats or None when ``config.stats`` is off), balanced over ``domain``.

    modules[e] runs expert e functionally with ``params[e]`` (named ``spec.param_names``) and its
    own buffers; ``call(e, x)``, if given, computes the static experts (`LocalExperts.calls`);
    ``times`` holds the previous micro-batch's compute times and is updated; ``stage_times``
    receives the host time of each stage (forward now, phase 2's backward later); ``residency`` is
    the layer's weight residency (None: none) and ``step_ends`` says whether this micro-batch is
    the last of its optimizer step (`migrate.resident`); ``mean_rows``: rows per rank over the
    whole EP group, for ``config.max_rows_over_mean`` (0: the domain's mean); ``record``: a dict
    that receives the plan's ``moves``, their ``fresh`` flags, the micro-batch's `Phase2MicroBatch`
    (``phase2``), how long the plan was waited for (``plan_wait_s``) and when it was in hand
    (``plan_in_hand``, host seconds), for `ExpertStage._measure`. A forward that activation
    checkpointing recomputes in backward leaves residency alone and returns no stats.
    """
    stage_times = stage_times if stage_times is not None else StageTimes()
    recompute = recomputing()
    if recompute:  # activation checkpointing re-runs this forward in backward: not a new micro-batch
        residency, step_ends = None, True
    mark = times.clock(rows.device)
    call = call or functional_calls(modules, params, spec)
    if config.fixed_costs == "measured":
        times.probe(rows, counts, call, mark)
    begin = mark()
    blocks = list(rows.split(counts.tolist()))
    seq = domain.next_seq()
    row_bytes = rows.shape[1] * rows.element_size()
    # a grouped static call on the CPU leaves no point to send from before it ends (`timed_pieces`)
    model = times.model(config, expert_bytes, row_bytes, domain.transport.message_us,
                        sends_after_static=static_fn is not None and rows.device.type != "cuda")
    constraints = replace(PlanConstraints.from_config(config, expert_bytes, model), mean_rows=float(mean_rows))
    if model is None and config.fixed_costs == "measured" and not config.max_rows_over_mean:
        constraints = replace(constraints, dynamic_experts=0)  # nothing timed yet: no move is known to pay
    resident_row = residency.table.resident[domain.local_rank] if residency is not None else None
    domain.scheduler.publish(seq, counts, constraints, resident_row)

    dynamic = [int(e) for e in dynamic_candidates(counts[None], config.dynamic_experts_per_rank)[0]]
    static = [e for e in range(len(modules)) if e not in dynamic]
    needs_grad = torch.is_grad_enabled() and (rows.requires_grad or any(p.requires_grad for p in params[0]))
    # phase 2's inputs are taken before the static experts start: its waiting half of backward
    # (`Phase2Anchor`) then runs after their backward was queued, and its copies of the rows wait for
    # phase 1 only (`Transport.mark`), not for the static experts queued after it
    dyn_x = torch.cat([blocks[e] for e in dynamic]) if dynamic else rows[:0]
    with_grads = grad_experts(residency, domain.local_rank, dynamic, step_ends, needs_grad)
    dyn_params = [p for e in with_grads for p in params[e]]
    box: dict = {}
    if needs_grad:
        dyn_x, *dyn_params = Phase2Anchor.apply(box, len(spec.param_names), dyn_x, *dyn_params)
    ready = domain.transport.mark()
    row_counts = [int(counts[e]) for e in dynamic]
    got: dict = {}  # the plan once in hand: "planned", "phase2", "at" (host seconds)

    def take(planned) -> None:
        """Phase 2 of this plan, its chunks sent now (static experts may still be computing)."""
        got["at"] = time.perf_counter()
        phase2 = Phase2MicroBatch(domain.transport, seq, domain.local_rank, planned.plan.moves, dynamic, row_counts,
                                  list(modules), spec, needs_grad, with_grads, stage_times, residency, step_ends,
                                  ready, mark)
        phase2.send_forward(dyn_x.detach(), [[p.detach() for p in params[e]] for e in dynamic])
        got.update(planned=planned, phase2=phase2)

    def poll():  # between static experts: send as soon as the plan is there, as the time model has it
        if got or not domain.scheduler.plan_ready(seq):
            return None
        return lambda: take(domain.scheduler.plan(seq))

    outs: list = [None] * len(modules)
    pieces: list = []
    with stage_times.measure("static experts"):
        for e, y in zip(static, timed_pieces(rows, blocks, static, mark, call, static_fn, pieces, between=poll)):
            outs[e] = y
    static_done = mark()

    waited = time.perf_counter()
    if not got:
        with stage_times.measure("plan wait"):
            take(domain.scheduler.plan(seq))
    plan_wait_s = max(0.0, got["at"] - waited)
    planned, phase2 = got["planned"], got["phase2"]
    box["step"] = phase2
    if record is not None:
        record.update(moves=planned.plan.moves, fresh=phase2.fresh, phase2=phase2, plan_wait_s=plan_wait_s,
                      plan_in_hand=got["at"])
    dyn_y = DynamicExperts.apply(phase2, len(spec.param_names), dyn_x, *dyn_params)
    for e, y in zip(dynamic, dyn_y.split(row_counts)):
        outs[e] = y
    stats = None
    if config.stats.enabled and not recompute:
        stats = layer_stats(planned.counts, planned.plan.moves, planned.seconds, planned.fallback, domain.ranks,
                            residency_stats(phase2.fresh, phase2.copy_kept, len(phase2.flush_entries),
                                            expert_bytes, phase2.resent), seq)
    if not recompute:
        times.finish(begin, static_done, mark(), int(counts.sum()), pieces + phase2.timed)
    return torch.cat(outs), stats
