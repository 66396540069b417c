"""One layer's expert stage, shared by both layer kinds (DeepSpeed MoE and AutoEP).

Between phase 1's dispatch and combine, `ExpertStage.run` computes a micro-batch's local experts:

1. `ExpertStage.balances_now`, the skip rule: whether this micro-batch goes through the domain.
   Every rank of the EP group decides alike, from phase 1's `GroupFacts` (each rank's received
   rows and its announced costs); the domain runtime opens at the first micro-batch that any
   domain of the group balances, so a run that never gains never pays for it; a forward that
   activation checkpointing recomputes takes its original forward's decision.
2. Balanced: `balanced.BalancedMicroBatch`, the paper's stages (publish the counts and the
   dynamic experts, static experts, the plan, dynamic experts through `migrate.phase2`, finish).
   Not balanced: `run_local`, every expert here, each call timed for the cost fit.
3. `ComputeTimes` (`expert_costs`) and `StageTimes` record what it cost; ``stats`` what it did.

A layer kind adapts only its gate and dispatch (or AutoEP's seam) and says how to compute its
experts (`experts.LocalExperts`).
"""
from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict, deque
from contextlib import nullcontext
from datetime import timedelta
from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from deepspeed_feplb.balanced import BalancedMicroBatch
from deepspeed_feplb.collectives import gather_counts, gather_small
from deepspeed_feplb.config import FEPLBConfig, FEPLBConfigError
from deepspeed_feplb.dispatch import GroupFacts
from deepspeed_feplb.domain import DomainRuntime, domain_size, get_runtime, moves_in_domains
from deepspeed_feplb.expert_costs import ComputeTimes, device_mark
from deepspeed_feplb.experts import ExpertCall, LocalExperts, StaticFn, timed_pieces
from deepspeed_feplb.memory import ExpertSizes
from deepspeed_feplb.migrate import transport_class
from deepspeed_feplb.migrate.resident import LayerResidency
from deepspeed_feplb.plan.policy import balancing_may_pay, chunk_align_rows, rows_bound
from deepspeed_feplb.stats import MicroBatchStats, StageTimes, recomputing, unbalanced_stats

_EXCHANGES_KEPT = 8  # count exchanges whose fastest `ExpertStage.announce` tells (a few micro-batches)
_DECISIONS_KEPT = 256  # forwards whose recompute may still come (pipeline schedules keep several in flight)


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
        self.balances = moves_in_domains(config, ep_size)
        self.sizes = ExpertSizes.of(expert_params, hidden)  # weights, a kept copy, a row
        self.expert_bytes = self.sizes.expert_bytes  # what a balanced micro-batch reads (`balanced.BalancingLayer`)
        # checks the configured transport works here, where the layer needs one
        self.transport_cls = transport_class(config, expert_params) if self.balances else None
        self.device = expert_params[0].device  # the transport's, not torch's current device
        self.compute_times = ComputeTimes()
        self.stage_times = StageTimes()  # host time per stage (forward and backward)
        self.domain: Optional[DomainRuntime] = None  # set up at the first micro-batch that balances
        self.residency: Optional[LayerResidency] = None  # weight residency, with a domain
        self.times_every_call = False  # a placement reads the time per row even where nothing balances
        self.stats: MicroBatchStats | dict = {}
        self._decisions: OrderedDict[bytes, bool] = OrderedDict()  # received digest -> decision, for recomputes
        # this rank's recent count exchanges (µs): the fastest stands for the group's latency, so that
        # a rank descheduled during one exchange (a busy host) does not stop balancing for a micro-batch
        self._exchanges_us: deque[float] = deque(maxlen=_EXCHANGES_KEPT)
        self._rows_here = 0  # this rank's rows in the current micro-batch
        self.experts: Optional[LocalExperts] = None  # the last forward's, for `migrate.refresh`
        self.records = False  # a trace recorder reads `last` (`trace.record`)
        self.last: Optional[dict] = None  # with `records`: what the last micro-batch did (`_measure`)

    # ------------------------------------------------------------------ group facts
    def announce(self) -> tuple[float, ...]:
        """What phase 1 tells the EP group for `balances_now`: this rank's (piece_us, row_us) (a
        one-row call, and the fitted cost per row; NaN before anything was timed) and the fastest of
        its last `_EXCHANGES_KEPT` count exchanges (µs)."""
        if not self.balances or self.config.fixed_costs == "ignore":
            return ()
        exchange_us = min(self._exchanges_us, default=float("nan"))
        return (*(self.compute_times.fitted_us() or (float("nan"), float("nan"))), exchange_us)

    def exchanged(self, seconds: float) -> None:
        """This micro-batch's count exchange took ``seconds`` (NaN: a backend that exchanged nothing,
        which leaves the earlier figures); `announce` tells the fastest of the last few."""
        if not math.isnan(seconds):
            self._exchanges_us.append(seconds * 1e6)

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
            row_cap += chunk_align_rows(self.config.chunk_align_tokens, self.device.type == "cuda",
                                        self.config.max_rows_over_mean) - 1
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
        is that one domain, the shortest of the ranks' recent count exchanges (float64 [G] µs, each
        rank's fastest of its last few; the rank that arrived last waited for nobody, so its exchange
        took about the group's latency; on a host that stays oversubscribed this includes waiting
        for a core, as a phase-2 message would). An
        exchange over several domains would add the network's latency."""
        figure = (self.domain.transport if self.domain is not None else self.transport_cls).message_us
        measured = exchange_us[np.isfinite(exchange_us)]
        if not measured.size or self.domain_size != self.ep_size:
            return figure
        return max(figure, float(measured.min()))

    def _open_domain(self, facts: GroupFacts) -> None:
        """Set up the domain runtime (collective over the EP group: every rank calls it at the same
        forward), its receive slots sized for this layer's shapes and this micro-batch's rows."""
        rows = self._mean_rows(facts) or self._rows_here  # a backend that tells no other rank's rows
        slot = self.sizes.receive_slot(self.config, rows)
        self.domain = get_runtime(self.ep_group, self.config, self.transport_cls, self.device, slot)
        self.residency = LayerResidency.create(self.domain.size, self.num_local_experts, self.config,
                                               self.domain.kept_bytes, self.sizes.copy_bytes)

    def check_peers(self) -> None:
        """After a failed collective: raise naming a dead domain peer, if one is known."""
        if self.domain is not None:
            self.domain.watch.check()

    # ------------------------------------------------------------------ one micro-batch
    def run(self, rows: torch.Tensor, counts: np.ndarray, experts: LocalExperts, facts: GroupFacts,
            step_ends: bool = True, later: int = 0) -> torch.Tensor:
        """rows ``[N, H]`` grouped by local expert, counts ``int64 [E_local]`` -> outputs ``[N, H]``;
        ``step_ends``: this micro-batch is the last of its optimizer step (weight residency);
        ``later``: the micro-batches of the step after it (`seams.later_micro_batches`)."""
        self._rows_here = int(counts.sum())
        self.experts = experts
        self.exchanged(facts.exchange_seconds)
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
                # the recorded stage times, on the device's clock
                record["events"] = [device_mark(self.device), None, None, None]
            record["fit_us"] = self.compute_times.fitted_us(balanced)  # what this micro-batch's path was priced at
            record["forward_share"] = self.compute_times.forward_share(balanced)
        if balanced:
            micro_batch = BalancedMicroBatch(self, rows, counts, experts, step_ends, self._mean_rows(facts), record,
                                             self._domain_mean(facts), later)
            out, stats = micro_batch.run()
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
            events[1] = device_mark(self.device)
        calls = self.compute_times.calls  # (0, 0) on CUDA: only host-timed calls are counted (`finish`)
        phase2, plan_wait_s = record.get("phase2"), record.get("plan_wait_s", 0.0)
        phase2_forward_waits_s = phase2.wait_s if phase2 is not None else 0.0  # its backward adds its own
        last = None
        if self.records:
            last = self.last = self._last(record, start, forward_s)
        if not (out.requires_grad and rows.requires_grad) or (last is None and not calls[0]):
            return out
        begun, times = [], self.compute_times

        def backward_begins(grad):
            begun.extend((time.perf_counter(), time.process_time()))
            if events is not None:
                events[2] = device_mark(self.device)

        def backward_ends(grad):
            if not begun:
                return
            backward_s = time.perf_counter() - begun[0]
            if last is not None:
                last["backward_us"] = backward_s * 1e6
                last["cpu_us"] = (cpu_s + time.process_time() - begun[1]) * 1e6
                if events is not None:
                    events[3] = device_mark(self.device)
            if calls[0]:
                backward_waits_s = phase2.wait_s - phase2_forward_waits_s if phase2 is not None else 0.0
                times.stage_done(forward_s - plan_wait_s - phase2_forward_waits_s, backward_s - backward_waits_s,
                                 calls, balanced=phase2 is not None)

        out.register_hook(backward_begins)
        rows.register_hook(backward_ends)
        return out

    def _last(self, record: dict, start: float, forward_s: float) -> dict:
        """`last` of a micro-batch whose forward began at ``start`` and took ``forward_s`` (`_measure`)."""
        first = dist.get_rank(self.ep_group) // self.domain_size * self.domain_size if self.ep_group else 0
        moves = record.get("moves", np.zeros((0, 4), np.int64))
        fresh = record.get("fresh", np.ones(len(moves), np.bool_))
        last = {"moves": np.column_stack([moves[:, 0] + first, moves[:, 1], moves[:, 2] + first, moves[:, 3],
                                          fresh]).astype(np.int64).reshape(-1, 5),
                "plan_us": (record["plan_in_hand"] - start) * 1e6 if "plan_in_hand" in record else float("nan"),
                "fit_us": record["fit_us"] or (float("nan"), float("nan")),
                "forward_share": record["forward_share"],
                "forward_us": forward_s * 1e6, "backward_us": float("nan"), "cpu_us": float("nan"),
                "message_us": self.domain.transport.message_us if self.domain is not None else float("nan")}
        if record.get("events") is not None:
            last["events"] = record["events"]
        return last

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

    def _domain_first(self) -> int:
        """The EP-group rank of this rank's domain's first rank (domains are runs of ``domain_size``)."""
        return dist.get_rank(self.ep_group) // self.domain_size * self.domain_size

    def _domain_mean(self, facts: GroupFacts) -> Optional[float]:
        """Rows per rank over this rank's domain (None: not known, as for `_mean_rows`)."""
        if facts.received is None:
            return None
        first = self._domain_first()
        return float(facts.received[first:first + self.domain_size].sum()) / self.domain_size

    def _local_stats(self, counts: np.ndarray, facts: GroupFacts) -> MicroBatchStats:
        """Stats of a micro-batch computed without balancing: over the domain when phase 1 told
        every rank's counts, else over this rank."""
        if not self.balances or facts.received is None:
            return unbalanced_stats(counts[None], [dist.get_rank() if dist.is_initialized() else 0])
        G, first = self.domain_size, self._domain_first()
        ranks = dist.get_process_group_ranks(self.ep_group)[first:first + G]
        return unbalanced_stats(facts.received[first:first + G], ranks)


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
