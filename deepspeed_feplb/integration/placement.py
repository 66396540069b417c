"""Cross-node expert placement at runtime: which slot (rank, local index) holds each logical expert.

Per-micro-batch balancing moves work inside an NVLink domain only; imbalance *between* domains
(nodes) needs experts to change their home. `ExpertPlacement` keeps one MoE layer's table, fed and
decided by the same policy the simulator replays (`plan.placement.CrossNodePlacer`):

* **Routing.** The gate picks logical experts ``e``; phase 1 sends each route to slot
  ``slot_of[e]`` (slot ``s`` is local expert ``s % E_local`` of EP rank ``s // E_local``). The
  table is identical on every rank that holds the layer, so both dispatchers work unchanged.
* **History.** Every training forward adds this rank's per-expert route counts; at the end of each
  optimizer step the step's counts are summed over the expert-parallel group and its
  expert-data-parallel group (one all-reduce of ``[M, E]`` per layer and step), so every rank
  feeds the policy the same loads, one micro-batch at a time, as the simulator does.
* **Decision.** After the first optimizer step (replicas alone, every home kept: as soon as two
  micro-batches of it were seen, `decide_mid_step`), then every ``interval_steps`` steps, the policy
  looks for a better placement (balanced node loads, hot experts spread over a node's ranks so
  that the dynamic experts can absorb the rest) and adopts the candidate whose predicted gain over
  its horizon most exceeds the time its moves take (``network_gbps`` between nodes,
  ``copy_engine_gbps`` inside one; the time per routed token is the ranks' measured expert time,
  averaged in the same all-reduce). Nothing moves when nothing pays.
* **Moving.** Slots are fixed parameters (names, ZeRO partitions and expert-data-parallel groups
  never change); what moves is their *content*: an expert's parameters, its fp32 master copy and
  its optimizer state (ZeRO 1/2 and the bf16 optimizer through DeepSpeed's ``safe_get/set_full_*``
  fragment API, ZeRO 0 through the torch optimizer's per-parameter state), sent point to point
  over ``torch.distributed`` right after the optimizer step (no gradient is in flight then).
  Experts that stay on their rank keep their slot, arrivals take the freed slots in expert order.
* **Checkpoints** stay canonical: `canonical` moves every expert back to its original slot
  around ``save_checkpoint`` and returns afterwards; after ``load_checkpoint`` the slots hold a
  canonical checkpoint, so the table becomes the identity.

What moves with an expert: `expert_state`. The engine's side (step hooks, checkpoints, gradient
norms in DeepSpeed's layout): `placement_engine`. State dicts in placement order: `expert_order`.
"""
from __future__ import annotations

import contextlib
import time
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from deepspeed_feplb.collectives import all_gather_flat
from deepspeed_feplb.config import FEPLBConfigError
from deepspeed_feplb.domain import domain_size
from deepspeed_feplb.integration import seams
from deepspeed_feplb.integration.expert_state import state_bytes_per_expert
from deepspeed_feplb.integration.replicas import ReplicaSlots
from deepspeed_feplb.once import first_time
from deepspeed_feplb.plan import replicas
from deepspeed_feplb.plan.placement import FIRST_REPLICAS_AFTER, CrossNodePlacer, node_loads


class ExpertPlacement:
    """One MoE layer's logical-expert -> slot table, its load history and its moves.

    Args:
        num_experts: E, logical experts of the layer (= slots).
        ep_group: the layer's expert-parallel process group (None: one rank).
        ep_size: ranks in it; ``E / ep_size`` slots each.
        ranks_per_node: consecutive EP ranks that form a node (the NVLink domain).
        interval_steps, decay, network_gbps: `config.PlacementConfig`.
        expert_params: one expert's parameters (what a move carries, `state_bytes_per_expert`; what
            a replica holds and sends home).
        dynamic_experts: D of the intra-node planner (the policy judges placements by the load left
            after D dynamic experts per rank are balanced inside a node).
        intra_gbps: bandwidth of a move inside a node (``copy_engine_gbps``).
        dp_group: the layer's expert-data-parallel group (its replicas must place alike), or None.
        device: where the routing table lives (the gate's device).
        redundant: replica slots per rank (``redundant_experts_per_rank``): each decision also
            chooses which hot experts get a replica on another node (`plan.replicas.choose`), and
            `route` splits their rows between their holders every micro-batch; the layer's local
            experts are then its ``E / ep_size`` primary slots followed by ``redundant`` replica
            slots (``replicas``, an `integration.replicas.ReplicaSlots`; its weights come at every
            step and its fp32 gradient sum goes home).
        max_rows_over_mean: ``feplb.max_rows_over_mean`` (0: none): replicas are chosen to bring the
            busiest rank within it before time (`plan.replicas.choose`).
        price_host: whether the replica choice prices the host's work on held replicas
            (``feplb.fixed_costs: "measured"``; `end_step`).
        move_experts: whether decisions may give experts other homes (``feplb.placement.enabled``);
            False: every expert keeps its home slot (the table stays as it is: the identity, unless
            a state dict in placement order was loaded; no slot's contents change) and decisions
            choose replicas only.
    """

    def __init__(self, num_experts: int, ep_group, ep_size: int, ranks_per_node: int, interval_steps: int,
                 decay: float, network_gbps: float, expert_params: list[torch.Tensor], dynamic_experts: int = 0,
                 intra_gbps: float = float("inf"), dp_group=None, device: torch.device | str = "cpu",
                 redundant: int = 0, max_rows_over_mean: float = 0.0, move_experts: bool = True,
                 price_host: bool = False):
        if ep_size % ranks_per_node:
            raise ValueError(f"expert-parallel size {ep_size} is not a multiple of the node size {ranks_per_node}")
        most = replicas.most_replica_slots(num_experts, ep_size, ranks_per_node)
        if redundant > most:  # before the slots' weights are allocated (`ReplicaSlots`)
            nodes = ep_size // ranks_per_node
            raise FEPLBConfigError(
                f"feplb.placement.redundant_experts_per_rank: {redundant} replica slots per rank, but a layer of "
                f"{num_experts} experts over {ep_size} ranks ({nodes} node{'s' if nodes > 1 else ''} of "
                f"{ranks_per_node}) fills at most {most}: a node holds one copy of an expert at most, so its ranks' "
                f"replica slots share the {num_experts * (nodes - 1) // nodes} experts of the other nodes, and a "
                f"slot beyond that would hold an expert's weights for nothing; set it to at most {most}")
        self.num_experts, self.ep_group, self.ep_size, self.dp_group = num_experts, ep_group, ep_size, dp_group
        self.ranks_per_node = ranks_per_node
        self.per_rank = num_experts // ep_size
        self.interval_steps = interval_steps
        # interval and warmup count micro-batches: set when M is known (`_count_steps_of`)
        self.placer = CrossNodePlacer(num_experts, ep_size // ranks_per_node, ranks_per_node, interval=interval_steps,
                                      decay=decay, expert_state_bytes=float(state_bytes_per_expert(expert_params)),
                                      net_gbps=network_gbps, dynamic_experts=dynamic_experts, intra_gbps=intra_gbps,
                                      warmup=1, redundant=redundant,
                                      weight_bytes=float(sum(p.numel() * p.element_size() for p in expert_params)),
                                      grad_bytes=float(sum(p.numel() * 4 for p in expert_params)),
                                      max_rows_over_mean=max_rows_over_mean, move_experts=move_experts)
        self.redundant = redundant
        self.local_slots = self.per_rank + redundant  # the layer's local experts: primaries, then replica slots
        self.replicas = ReplicaSlots(self, expert_params, redundant) if redundant else None
        if redundant:
            replicas.load_split()
        self.expert_at = np.arange(num_experts, dtype=np.int64)  # slot -> logical expert
        self.slot_of = torch.arange(num_experts, dtype=torch.long, device=device)  # logical expert -> slot
        self.device = torch.device(device)
        self.slot_ids = torch.from_numpy(self._primary_slot_ids()).to(self.device)  # expert -> its primary's slot id
        self.pending: list[torch.Tensor] = []  # this rank's route counts per training micro-batch, float64 [E]
        self.steps = 0
        self.refreshes = self.moved_experts = self.moved_bytes = 0  # moved_bytes: what this rank sent
        self.bundle_bytes = 0  # bytes one expert's move carries (parameters, master copy, optimizer state)
        self._report = {"placement_refreshes": 0, "placement_moved_experts": 0, "placement_bytes": 0}
        self.last_loads: Optional[np.ndarray] = None  # the agreed loads of the last step, float64 [M, E]
        self._first_loads: Optional[np.ndarray] = None  # the first step's loads agreed by `decide_mid_step`
        self._mid_step_tried = False  # `decide_mid_step` agreed once
        self.price_host = price_host  # the replica choice prices the host's work on replicas (`end_step`)
        self.replica_host_s = 0.0  # this step's host seconds in the replicas' work (`timing_replicas`)
        self._canonical_blocks = 0  # `canonical` blocks now open
        self._review_owner: Optional[int] = None  # EP rank that weighs this step's review (`end_step`)
        self._review_choice = None  # what it weighed (`decide_review`), until `share_review`

    # ---------------------------------------------------------------- every forward
    @classmethod
    def of(cls, config, num_experts: int, ep_group, ep_size: int, expert_params: list[torch.Tensor],
           device: torch.device | str, redundant: int) -> "ExpertPlacement":
        """The placement an `FEPLBConfig` asks for over an EP group (nodes of its NVLink domain size,
        its expert-data-parallel group from DeepSpeed)."""
        placement = config.placement
        say_if_replicas_idle(config, ep_size)
        return cls(num_experts, ep_group, ep_size, domain_size(config, ep_size), placement.interval_steps,
                   placement.history_decay, placement.network_gbps, expert_params,
                   dynamic_experts=config.dynamic_experts_per_rank, intra_gbps=config.copy_engine_gbps,
                   dp_group=seams.expert_data_parallel_group(ep_size), device=device, redundant=redundant,
                   max_rows_over_mean=config.max_rows_over_mean or 0.0,
                   move_experts=config.placement.enabled is True, price_host=config.fixed_costs == "measured")

    def route(self, expert_ids: torch.Tensor) -> torch.Tensor:
        """Logical expert ids (any shape; -1 = no route; out-of-range ids stay out of range for the
        dispatcher to report) -> slot ids: ``rank * local_slots + local index``. With replicas held,
        collective over the EP group (one all-gather of the ranks' per-expert route counts, from
        which every rank computes the same split, `plan.replicas.split`): a replicated expert's
        routes go to the slots of its split's parts, the first ones (in ``expert_ids``' order) to
        the first part."""
        if self.identity and not self.redundant:
            return expert_ids
        valid = (expert_ids >= 0) & (expert_ids < self.num_experts)
        clamped = expert_ids.clamp(0, self.num_experts - 1)
        beyond = expert_ids + (self.ep_size * self.local_slots - self.num_experts)
        invalid = torch.where(expert_ids >= self.num_experts, beyond, expert_ids)  # what an invalid id becomes
        if not self.holds_replicas:
            return torch.where(valid, self.slot_ids[clamped], invalid)
        with self.timing_replicas():
            return self._split_routes(expert_ids, valid, clamped, invalid)

    def _split_routes(self, expert_ids: torch.Tensor, valid: torch.Tensor, clamped: torch.Tensor,
                      invalid: torch.Tensor) -> torch.Tensor:
        """`route` with replicas held: ``valid`` bool, ``clamped`` and ``invalid`` long, each shaped
        like ``expert_ids``."""
        # one copy to the host (the counts) and one back (the table and the split pairs)
        key = torch.where(valid, expert_ids, self.num_experts).reshape(-1).long()  # E: no valid route
        counts = _route_counts(key, self.num_experts)
        table, seconds = self._micro_batch_slots(counts[:self.num_experts])
        first = np.full(self.num_experts, np.iinfo(np.int64).max)  # routes to the first part's slot, per expert
        second = np.zeros(self.num_experts, np.int64)  # the second part's slot
        for e, rows, slot in seconds:
            first[e], second[e] = rows, slot
        # from fresh host memory, not pinned: a non-blocking upload is staged at once and waits for no stream
        both = torch.from_numpy(np.concatenate([table, first, second])).to(self.device, non_blocking=True).view(3, -1)
        slots = torch.where(valid, both[0][clamped], invalid)
        if not seconds:
            return slots
        # a split expert's routes past its first part's rows go to the second part's slot: each
        # route's place among its expert's routes, from a stable sort (on the device, O(routes))
        order = torch.argsort(key, stable=True)
        starts = torch.cumsum(counts, 0) - counts
        place = torch.empty_like(order)
        place[order] = torch.arange(len(key), device=key.device) - starts[key[order]]
        ids = clamped.reshape(-1)
        moved = valid.reshape(-1) & (place >= both[1][ids])
        return torch.where(moved, both[2][ids], slots.reshape(-1)).reshape(slots.shape)

    @property
    def replica_at(self) -> np.ndarray:
        """int64 [ep_size, redundant]: the logical expert each replica slot holds (-1: empty)."""
        return self.placer.replica_at

    @property
    def holds_replicas(self) -> bool:
        """Whether any replica slot holds an expert; not inside a `canonical` block, where the
        experts sit in DeepSpeed's slots and forwards route to them alone."""
        return not self._canonical_blocks and self.placer.holds_replicas

    def slot_experts(self) -> np.ndarray:
        """int64 [ep_size * local_slots]: the logical expert each slot id holds (-1: an empty replica
        slot)."""
        primaries = self.expert_at.reshape(self.ep_size, self.per_rank)
        return np.concatenate([primaries, self.replica_at], axis=1).reshape(-1)

    def home_of(self, expert: int) -> tuple[int, int]:
        """(EP rank, local index) of ``expert``'s primary slot."""
        slot = int(np.flatnonzero(self.expert_at == expert)[0])
        return slot // self.per_rank, slot % self.per_rank

    def _hold(self, expert_at: np.ndarray) -> None:
        """The slots hold the experts in the order ``expert_at`` (slot -> logical expert) now."""
        self.expert_at = expert_at
        self.slot_of.copy_(torch.from_numpy(expert_at.argsort()))
        self.slot_ids.copy_(torch.from_numpy(self._primary_slot_ids()))

    def _primary_slot_ids(self) -> np.ndarray:
        """int64 [E]: each expert's primary slot as a slot id (``rank * local_slots + local``)."""
        slot = self.expert_at.argsort()
        return slot // self.per_rank * self.local_slots + slot % self.per_rank

    @contextlib.contextmanager
    def timing_replicas(self):
        """Count the host time of the block into ``replica_host_s``: the replicas' work (each
        forward's split, their refresh, the relay of their gradient sums)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.replica_host_s += time.perf_counter() - start

    def _micro_batch_slots(self, counts: torch.Tensor) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
        """This rank's slots for one micro-batch, from its route counts per logical expert (long
        [E]): the EP group's counts (with in-place write flags) are all-gathered and split between
        each replicated expert's holders (`plan.replicas.split`, the simulator's split). Returns
        (logical expert -> slot id, int64 [E]: a replicated expert's first part; (expert, rows of
        the first part, slot id of the second) for each expert whose rows from here are split)."""
        # and whether this rank's experts were written in place since its last forward: every rank
        # then refreshes the replicas before they compute (`ReplicaSlots.keep_current`)
        wrote = self.replicas is not None and self.replicas.wrote_in_place()
        counts = torch.cat([counts, counts.new_full((1, ), int(wrote))])  # filled on the device: no upload
        if self.ep_group is not None and self.ep_size > 1:
            src = all_gather_flat(counts, self.ep_group, self.ep_size).cpu().numpy()
        else:
            src = counts.cpu().numpy()[None]
        if src[:, -1].any():
            self._replicas_stale()
        src = src[:, :-1]
        me = dist.get_rank(self.ep_group) if self.ep_group is not None else 0
        parts = replicas.split(src, self.placer.slots, self.ranks_per_node, self.per_rank)
        primary = self._primary_slot_ids()
        table = primary.copy()
        replica_slot = {(int(q), int(self.replica_at[q, j])): q * self.local_slots + self.per_rank + j
                        for q, j in zip(*np.nonzero(self.replica_at >= 0))}
        seconds, first_rows = [], {}
        for e, q, n in zip(*(a[parts.source == me].tolist() for a in (parts.expert, parts.rank, parts.rows))):
            slot = replica_slot.get((q, e), primary[e])  # not a replica on q: the primary
            if e in first_rows:
                seconds.append((e, first_rows[e], int(slot)))
            else:
                first_rows[e] = int(n)
                table[e] = slot
        return table, seconds

    @property
    def identity(self) -> bool:
        """Whether every expert sits in its original slot (routing is then left alone)."""
        return bool(np.array_equal(self.expert_at, np.arange(self.num_experts)))

    def slot_order(self) -> list[int]:
        """slot -> logical expert as the slots hold them now: DeepSpeed's order (the identity)
        inside `canonical` or `expecting_canonical`, else the placement's. What a state dict taken
        now holds, and what one loaded now must hold."""
        return list(range(self.num_experts)) if self._canonical_blocks else self.expert_at.tolist()

    @contextlib.contextmanager
    def expecting_canonical(self):
        """Within the block `slot_order` says DeepSpeed's order without moving anything: for
        ``load_checkpoint``, which loads canonical experts and optimizer state into every slot (the
        table is `reset` after it)."""
        self._canonical_blocks += 1
        try:
            yield
        finally:
            self._canonical_blocks -= 1

    def record(self, expert_ids: torch.Tensor) -> None:
        """Add one training micro-batch's routes (logical ids, -1 = none) to the step's history."""
        self.pending.append(_route_counts(expert_ids, self.num_experts)[:self.num_experts].to(torch.float64))

    # ---------------------------------------------------------------- at the optimizer step
    def end_step(self, experts, us_per_token: float, review_owner: Optional[int] = None) -> bool:
        """Collective over the ranks that hold the layer, after the optimizer step: agree on the
        step's loads, feed them to the policy and, every ``interval_steps`` steps, re-place (moving
        the experts' parameters and optimizer state, unless every expert keeps its home; ``experts``:
        the layer's `ModuleExperts` or `StackedExperts`) and choose replicas. Returns whether the
        placement changed.

        Between decisions the replicas are chosen again (`CrossNodePlacer.review_replicas`); with
        ``review_owner`` (a rank of the EP group) that is left to EP rank ``review_owner`` alone, in
        `decide_review`, and `share_review` gives every rank its choice: an engine spreads its
        layers' reviews over the group's ranks, whose hosts weigh them at once instead of each
        weighing every layer's."""
        self._replicas_stale()  # the step changed the experts' weights
        if self.replicas is not None:
            self.replicas.end_step()
        host_s, self.replica_host_s = self.replica_host_s, 0.0  # the step's work on the replicas
        if not self.pending:
            return False
        held = self.holds_replicas  # the same on every rank: the tables are
        # what this rank's host spent on them beyond their modelled exchange
        host_us = host_s * 1e6 / len(self.pending) - self.placer.exchange_us_per_micro_batch() \
            if held and self.price_host else 0.0
        loads, us_per_token, fixed_us = self._agreed_loads(us_per_token, max(0.0, host_us))
        self.pending = []
        self.last_loads = loads if self._first_loads is None else np.concatenate([self._first_loads, loads])
        self._first_loads = None
        if self.steps == 0 and not self.placer.decisions:  # as the simulator: first decision after one step
            self._count_steps_of(len(loads))
        for row in loads:
            self.placer.observe(row, refresh=False)
        self.steps += 1
        self.placer.us_per_token = us_per_token
        if held and self.price_host:  # kept until replicas are held again: the choice weighs it meanwhile
            self.placer.replica_fixed_us = fixed_us
        if not self.placer.due:  # replicas chosen again: the hot set drifts between decisions
            if review_owner is None or self.ep_group is None or self.ep_size <= 1:
                return self.placer.review_replicas()
            self._review_owner = review_owner if self.placer.reviews_replicas else None
            return False
        changed = self.placer.refresh()
        self._say_what_the_bound_costs(loads)
        if not changed:
            return False
        # replicas alone (every home kept) read no expert's state: under ZeRO 1/2 that read is collective
        moved = self._move_to(self.placer.expert_to_rank, experts) if self.placer.move_experts else 0
        self.refreshes += 1
        self._report["placement_refreshes"] += 1
        self._report["placement_moved_experts"] += moved
        self._report["placement_bytes"] += moved * self.bundle_bytes
        return True

    def _agreed_loads(self, us_per_token: float, host_us: float = 0.0) -> tuple[np.ndarray, float, float]:
        """Collective over the ranks that hold the layer: this step's ``pending`` route counts as one
        EP group's loads, float64 [M, E] (summed over the group, averaged over its
        expert-data-parallel replicas, which place alike: what a placement or a replica gains per
        micro-batch is in one group's rows), and the ranks' mean ``us_per_token`` and ``host_us``,
        in one all-reduce per group."""
        local = torch.stack(self.pending)  # [M, E]
        extra = torch.zeros(local.shape[0], 2, dtype=torch.float64)
        extra[0] = torch.tensor([us_per_token, host_us], dtype=torch.float64)
        # on the routing table's device: an NCCL group reduces CUDA tensors only
        both = torch.cat([local.cpu(), extra], dim=1).to(self.slot_of.device)
        sizes = [dist.get_world_size(g) if g is not None else 1 for g in (self.ep_group, self.dp_group)]
        for group, size in zip((self.ep_group, self.dp_group), sizes):
            if size > 1:
                dist.all_reduce(both, group=group)
        ranks = sizes[0] * sizes[1]
        both = both.cpu()
        return both[:, :-2].numpy() / sizes[1], float(both[0, -2]) / ranks, float(both[0, -1]) / ranks

    def _count_steps_of(self, micro_batches: int) -> None:
        """Decisions every ``interval_steps`` optimizer steps of ``micro_batches`` each, the first at
        the first step's end; a replica's gradient exchange priced once per step."""
        self.placer.interval, self.placer.warmup = self.interval_steps * micro_batches, micro_batches
        self.placer.micro_batches_per_step = micro_batches

    def decide_mid_step(self, us_per_token: float, micro_batches_per_step: int) -> bool:
        """Collective over the ranks that hold the layer, where a training forward of the first
        optimizer step begins: with replicas alone (every home kept) and
        `plan.placement.FIRST_REPLICAS_AFTER` of its ``micro_batches_per_step`` micro-batches seen,
        agree on their loads and make the first decision now (`CrossNodePlacer.replicas_due_mid_step`),
        as the simulator does, so that the step's remaining micro-batches are balanced across nodes
        too. Nothing moves but the new replicas' weights (they go when this forward begins); each
        sends home the sum of the micro-batches it computed at the step's end, with every
        replica's. Tried once, where the measured expert time per row (``us_per_token``, the
        ranks' mean) is known. Returns whether replicas were chosen."""
        if (self._mid_step_tried or self.steps or self.redundant == 0 or self.placer.move_experts
                or not FIRST_REPLICAS_AFTER <= len(self.pending) < micro_batches_per_step):
            return False
        self._mid_step_tried = True
        loads, us_per_token, _ = self._agreed_loads(us_per_token)
        if us_per_token <= 0.0:  # no expert timed yet: the step's end decides, as without
            return False
        self.pending = []
        self._first_loads = loads
        self._count_steps_of(micro_batches_per_step)
        for row in loads:
            self.placer.observe(row, refresh=False)
        self.placer.us_per_token = us_per_token
        if not (self.placer.replicas_due_mid_step and self.placer.refresh()):
            return False
        self._replicas_stale()  # the new replicas' first weights
        self.refreshes += 1
        self._report["placement_refreshes"] += 1
        return True

    def decide_review(self) -> None:
        """The owner's half of a review `end_step` left to one rank: weigh the replicas (no
        collective; every rank calls it, and only the owner works)."""
        if self._review_owner is not None and dist.get_rank(self.ep_group) == self._review_owner:
            self._review_choice = self.placer.review_choice()

    def share_review(self) -> bool:
        """Collective over the EP group (where `end_step` left a review to one rank): the owner's
        choice (replica table, gain, cost) to every rank, taken alike. Returns whether the
        replicas changed."""
        owner, self._review_owner = self._review_owner, None
        if owner is None:
            return False
        table = self.placer.replica_at
        message = torch.zeros(table.size + 2, dtype=torch.float64)
        if dist.get_rank(self.ep_group) == owner:
            choice, self._review_choice = self._review_choice, None
            message[:-2] = torch.from_numpy(choice.replica_at.reshape(-1).astype(np.float64))
            message[-2:] = torch.tensor([choice.gain_us, choice.cost_us], dtype=torch.float64)
        message = message.to(self.slot_of.device)  # an NCCL group broadcasts CUDA tensors only
        dist.broadcast(message, src=dist.get_global_rank(self.ep_group, owner), group=self.ep_group)
        message = message.cpu().numpy()
        choice = replicas.Choice(message[:-2].astype(np.int64).reshape(table.shape), *message[-2:].tolist())
        return self.placer.take_review(choice)

    def _say_what_the_bound_costs(self, loads: np.ndarray) -> None:
        """Once per job (EP rank 0 of the first layer it happens to): where ``max_rows_over_mean``
        made the decision keep replicas whose predicted exchange costs more than a tenth of a
        micro-batch's expert time beyond what they save, say so, with the figures."""
        choice, bound = self.placer.replica_choice, self.placer.max_rows_over_mean
        expert_us = self.placer.us_per_token * float(loads.sum(axis=1).mean()) / self.ep_size
        if choice is None or not bound or choice.cost_us - choice.gain_us <= 0.1 * expert_us:
            return
        if (self.ep_group is None or dist.get_rank(self.ep_group) == 0) and first_time("replicas for the bound"):
            print(f"deepspeed_feplb: feplb.max_rows_over_mean {bound:g} keeps {int((choice.replica_at >= 0).sum())} "
                  f"replica(s) that cost {choice.cost_us - choice.gain_us:.0f} µs per micro-batch more than they save "
                  f"(predicted; the experts take about {expert_us:.0f} µs), to hold the busiest rank's rows near "
                  "the bound; a higher bound, or none, lets time decide", flush=True)

    def take_report(self) -> dict:
        """Refreshes, experts moved and the bytes they carried (whole EP group) since the last call,
        and the replicas held now."""
        report, self._report = self._report, dict.fromkeys(self._report, 0)
        return {**report, "placement_replicas": int((self.replica_at >= 0).sum())}

    def node_loads(self, loads: np.ndarray, expert_at: Optional[np.ndarray] = None) -> np.ndarray:
        """loads float [..., E] per logical expert -> [..., nodes] under the current placement (or
        under the slot -> expert table ``expert_at``)."""
        expert_at = self.expert_at if expert_at is None else np.asarray(expert_at)
        return node_loads(loads, expert_at.argsort() // self.per_rank, self.ep_size // self.ranks_per_node,
                          self.ranks_per_node)

    @contextlib.contextmanager
    def canonical(self, experts):
        """Within the block every expert sits in its original slot (DeepSpeed's layout, for saving);
        afterwards they return (``experts``: the layer's `ModuleExperts` or `StackedExperts`).
        Collective."""
        placed = self.expert_at.copy()
        self._canonical_blocks += 1
        try:
            if self.identity:
                yield
                return
            self._move_slots(np.arange(self.num_experts), experts)
            try:
                yield
            finally:
                self._move_slots(placed, experts)
        finally:
            self._canonical_blocks -= 1
            self._replicas_stale()  # a state dict may have been loaded in the block

    def _replicas_stale(self) -> None:
        """The replicas' weights may differ from their experts' now: the layer's next forward
        refreshes them (`ReplicaSlots.refresh`, collective)."""
        if self.replicas is not None:
            self.replicas.stale = True

    def reset(self) -> None:
        """The slots hold the experts in their original order again (a canonical checkpoint was
        loaded into them): the table becomes the identity, the history stays, replicas are
        dropped (the next decision chooses them again)."""
        self.placer.replica_at[:] = -1
        self._replicas_stale()
        self._hold(np.arange(self.num_experts, dtype=np.int64))
        self.placer.expert_to_rank = np.arange(self.num_experts, dtype=np.int64) // self.per_rank

    def adopt(self, expert_at) -> None:
        """The slots hold the experts in the order ``expert_at`` (slot -> logical expert; a state dict
        saved in placement order was loaded into them before the first forward)."""
        order = np.asarray(expert_at, dtype=np.int64)
        if not np.array_equal(np.sort(order), np.arange(self.num_experts)):
            raise ValueError(f"an expert order must be a permutation of the layer's {self.num_experts} experts, "
                             f"got {order.tolist()}")
        self.placer.replica_at[:] = -1
        self._replicas_stale()
        self._hold(order)
        self.placer.expert_to_rank = order.argsort() // self.per_rank

    # ---------------------------------------------------------------- moving
    def _slots_for(self, expert_to_rank: np.ndarray) -> np.ndarray:
        """The new slot -> expert table: experts that stay on their rank keep their slot, the others
        take the freed slots of their new rank in expert order."""
        old_rank = self.expert_at.argsort() // self.per_rank  # expert -> rank now
        new = np.full(self.num_experts, -1, dtype=np.int64)
        stay = np.flatnonzero(old_rank == expert_to_rank)
        new[self.expert_at.argsort()[stay]] = stay
        for rank in range(self.ep_size):
            free = [s for s in range(rank * self.per_rank, (rank + 1) * self.per_rank) if new[s] < 0]
            arriving = np.flatnonzero((expert_to_rank == rank) & (old_rank != rank))
            if len(free) != len(arriving):
                raise ValueError(f"placement gives rank {rank} {len(arriving) + self.per_rank - len(free)} experts, "
                                 f"it has {self.per_rank} slots")
            new[free] = arriving
        return new

    def _move_to(self, expert_to_rank: np.ndarray, experts) -> int:
        """Move expert contents so that expert e lives on rank ``expert_to_rank[e]`` (`_slots_for`): a
        re-placement, counted in ``moved_experts`` and ``moved_bytes`` (the moves of `canonical` are
        not). Returns the experts moved."""
        expert_to_rank = np.asarray(expert_to_rank, dtype=np.int64)
        moved, sent_bytes = self._move_slots(self._slots_for(expert_to_rank), experts)
        self.placer.expert_to_rank = expert_to_rank.copy()
        self.moved_experts += moved
        self.moved_bytes += sent_bytes
        return moved

    def _move_slots(self, new_at: np.ndarray, experts) -> tuple[int, int]:
        """Move expert contents so that slot s holds expert ``new_at[s]`` (``experts``: the layer's
        `ModuleExperts` or `StackedExperts`). Collective over the EP group (point to point) and,
        under ZeRO 1/2, the expert-data-parallel group. Returns (experts moved in the EP group,
        bytes this rank sent)."""
        old_slot = self.expert_at.argsort()  # expert -> slot now
        me = dist.get_rank(self.ep_group) if self.ep_group is not None else 0
        sends, recvs, local = [], [], []
        for slot in np.flatnonzero(new_at != self.expert_at):
            source = old_slot[new_at[slot]]
            src_rank, dst_rank = source // self.per_rank, slot // self.per_rank
            if src_rank == me and dst_rank == me:
                local.append((source % self.per_rank, slot % self.per_rank))
            elif src_rank == me:
                sends.append((dst_rank, source % self.per_rank))
            elif dst_rank == me:
                recvs.append((src_rank, slot % self.per_rank))
        self.bundle_bytes = sent_bytes = 0
        # part by part (an AutoEP layer's stacked parameters one at a time), every rank alike: reading
        # a part is collective under ZeRO 1/2
        for read, write in experts.parts():
            # what one expert carries of this part (every expert has the same tensors): sizes the
            # receive buffers
            template = read(0)
            self.bundle_bytes += sum(t.numel() * t.element_size() for t in template)
            # read every outgoing expert before anything is overwritten (a rank sends and receives)
            outgoing = [(rank, read(j)) for rank, j in sends]
            staying = [(i, read(j)) for j, i in local]
            incoming = [(rank, i, [torch.empty_like(t) for t in template]) for rank, i in recvs]
            ops = []
            for rank, tensors in outgoing:
                peer = dist.get_global_rank(self.ep_group, int(rank))
                ops += [dist.P2POp(dist.isend, t.contiguous(), peer) for t in tensors]
            for rank, _, tensors in incoming:
                peer = dist.get_global_rank(self.ep_group, int(rank))
                ops += [dist.P2POp(dist.irecv, t, peer) for t in tensors]
            if ops:
                for request in dist.batch_isend_irecv(ops):
                    request.wait()
            for i, tensors in [*staying, *((i, tensors) for _, i, tensors in incoming)]:
                write(i, tensors)
            sent_bytes += sum(t.numel() * t.element_size() for _, tensors in outgoing for t in tensors)
        moved = int(np.sum(new_at != self.expert_at))
        self._hold(np.asarray(new_at, dtype=np.int64).copy())
        return moved, sent_bytes


def places(config, ep_size: int) -> bool:
    """Whether a layer over ``ep_size`` ranks has an `ExpertPlacement`: more than one rank, and
    ``feplb.placement.enabled`` true (``"auto"`` still undecided, as for a layer used without an
    engine, is off: `placement_engine.resolve_auto` decides it) or replica slots
    (`replica_slots_per_rank`; with placement off, every expert keeps its home)."""
    return ep_size > 1 and (config.placement.enabled is True or replica_slots_per_rank(config, ep_size) > 0)


def replica_slots_per_rank(config, ep_size: int) -> int:
    """Replica slots per rank of a layer over ``ep_size`` ranks: ``feplb.placement.
    redundant_experts_per_rank`` where the EP group spans domains (inside one domain, phase 2 does
    their work) and both ``feplb.placement.enabled`` and it are decided (`placement_engine.
    resolve_auto`, `engine.resolve_replica_slots`), else 0; with placement false they are
    the cross-node layer's only work."""
    if "auto" in (config.placement.enabled, config.placement.redundant_experts_per_rank):
        return 0  # undecided, as for a layer used without an engine: none
    spans = ep_size > domain_size(config, ep_size)
    return config.placement.redundant_experts_per_rank if spans else 0


def say_if_replicas_idle(config, ep_size: int) -> None:
    """Once per job (rank 0): ``feplb.placement.redundant_experts_per_rank`` set on a layer whose EP
    group of ``ep_size`` ranks is one NVLink domain, where it has no effect."""
    asked = config.placement.redundant_experts_per_rank
    if asked not in ("auto", 0) and ep_size > 1 and not replica_slots_per_rank(config, ep_size) \
            and first_time("one-node replica slots") \
            and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"deepspeed_feplb: feplb.placement.redundant_experts_per_rank={asked} has no effect: the expert-parallel "
              f"group ({ep_size} ranks) is one NVLink domain (feplb.nvlink_domain_size), so there is no other node to "
              "hold replicas", flush=True)


def copies_stale(stage, placement: Optional["ExpertPlacement"]) -> None:
    """Every copy of one layer's experts' weights takes them again at its next forward
    (`weight_watch.weights_changed`): helpers' kept copies (``stage``: the layer's `ExpertStage`, or
    None) and replica slots (``placement``, or None)."""
    if stage is not None and stage.residency is not None:
        stage.residency.declared += 1
    if placement is not None:
        placement._replicas_stale()


def _route_counts(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routes per logical expert, int64 ``[E + 1]`` (the last: routes not taken or out of range),
    without reading the ids on the host: a mask index or ``bincount`` would (on CUDA, bincount
    sizes its output from the largest id), a device-to-host sync per forward."""
    ids = expert_ids.reshape(-1).long()
    key = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    return torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device).index_add_(0, key, torch.ones_like(key))
