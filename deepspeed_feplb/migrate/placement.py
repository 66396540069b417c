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
* **Decision.** After the first optimizer step, then every ``interval_steps`` steps, the policy
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
  canonical checkpoint, so the table becomes the identity (`integration.placement`).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from deepspeed_feplb.plan.placement import CrossNodePlacer, node_loads

__all__ = ["ExpertPlacement", "expert_state", "hp_state_keys", "load_expert_state", "state_bytes_per_expert"]


def hp_state_keys(optimizer) -> list[str]:
    """Optimizer-state keys kept in DeepSpeed's flat fp32 partitions (e.g. exp_avg, exp_avg_sq), with
    every parameter's fragments of them linked (`seams.relink_optimizer_fragments`). Once per move:
    relinking walks every parameter group."""
    from deepspeed_feplb.integration import seams
    seams.relink_optimizer_fragments(optimizer)
    inner = getattr(optimizer, "optimizer", optimizer)
    for state in inner.state.values():
        return sorted(k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0)
    return []


def _torch_state(optimizer, param: torch.Tensor) -> dict:
    """A torch optimizer's state of ``param``: empty for an optimizer that keeps none for any parameter
    (SGD without momentum: an expert then moves with its values alone)."""
    states = getattr(optimizer, "state", None)
    state = None if states is None else states.get(param)
    if state is not None:
        return state
    if states is not None and not any(states.values()):
        return {}
    raise RuntimeError(f"FEPLB placement: optimizer {type(optimizer).__name__} keeps state for some parameters but "
                       "none for an expert parameter, so experts cannot move with their optimizer state; placement "
                       "supports ZeRO stages 0-2 with fp32 or bf16 and the fp16 optimizer only with ZeRO 1 or 2")


def expert_state(params: list[torch.Tensor], optimizer, keys: list[str]) -> list[torch.Tensor]:
    """Everything that moves with one expert, in a fixed order: for each parameter its value, then
    (ZeRO 1/2, bf16 optimizer) its fp32 master and optimizer states ``keys`` (`hp_state_keys`), or
    (ZeRO 0) its torch optimizer state entries in key order. Collective over the
    expert-data-parallel group under ZeRO 1/2 (DeepSpeed assembles partitioned fragments with an
    all-reduce)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    out = []
    for p in params:
        out.append(p.detach().clone())
        if hasattr(p, "_hp_mapping"):
            out.append(safe_get_full_fp32_param(p))
            out.extend(safe_get_full_optimizer_state(p, key) for key in keys)
        elif optimizer is not None:
            state = _torch_state(optimizer, p)
            out.extend(state[k].detach().clone() if torch.is_tensor(state[k]) else torch.tensor(state[k])
                       for k in sorted(state))
    return out


def load_expert_state(params: list[torch.Tensor], optimizer, keys: list[str], tensors: list[torch.Tensor]) -> None:
    """Write what `expert_state` read (of another expert) into ``params`` and their optimizer state."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
    values = iter(tensors)
    with torch.no_grad():
        for p in params:
            p.copy_(next(values))
            if hasattr(p, "_hp_mapping"):
                safe_set_full_fp32_param(p, next(values))
                for key in keys:
                    safe_set_full_optimizer_state(p, next(values), key)
            elif optimizer is not None:
                state = _torch_state(optimizer, p)
                for k in sorted(state):
                    value = next(values)
                    if torch.is_tensor(state[k]):
                        state[k].copy_(value)
                    else:
                        state[k] = type(state[k])(value.item())


def state_bytes_per_expert(params: list[torch.Tensor], optimizer_states: int = 2) -> int:
    """Bytes one expert's move carries: its parameters, an fp32 master copy when they are not fp32,
    and ``optimizer_states`` fp32 tensors of their size (Adam's two moments)."""
    numel = sum(p.numel() for p in params)
    own = sum(p.numel() * p.element_size() for p in params)
    master = 0 if all(p.dtype == torch.float32 for p in params) else 4 * numel
    return own + master + 4 * numel * optimizer_states


class ExpertPlacement:
    """One MoE layer's logical-expert -> slot table, its load history and its moves.

    Args:
        num_experts: E, logical experts of the layer (= slots).
        ep_group: the layer's expert-parallel process group (None: one rank).
        ep_size: ranks in it; ``E / ep_size`` slots each.
        ranks_per_node: consecutive EP ranks that form a node (the NVLink domain).
        interval_steps, decay, network_gbps: `config.PlacementConfig`.
        state_bytes: bytes one expert's move carries (`state_bytes_per_expert`).
        dynamic_experts: D of the intra-node planner (the policy judges placements by the load left
            after D dynamic experts per rank are balanced inside a node).
        intra_gbps: bandwidth of a move inside a node (``copy_engine_gbps``).
        dp_group: the layer's expert-data-parallel group (its replicas must place alike), or None.
        device: where the routing table lives (the gate's device).
    """

    def __init__(self, num_experts: int, ep_group, ep_size: int, ranks_per_node: int, interval_steps: int,
                 decay: float, network_gbps: float, state_bytes: int, dynamic_experts: int = 0,
                 intra_gbps: float = float("inf"), dp_group=None, device: torch.device | str = "cpu"):
        if ep_size % ranks_per_node:
            raise ValueError(f"expert-parallel size {ep_size} is not a multiple of the node size {ranks_per_node}")
        self.num_experts, self.ep_group, self.ep_size, self.dp_group = num_experts, ep_group, ep_size, dp_group
        self.ranks_per_node = ranks_per_node
        self.per_rank = num_experts // ep_size
        self.interval_steps = interval_steps
        # interval and warmup count micro-batches: set at the first step's end, when M is known
        self.placer = CrossNodePlacer(num_experts, ep_size // ranks_per_node, ranks_per_node, interval=interval_steps,
                                      decay=decay, expert_state_bytes=float(state_bytes), net_gbps=network_gbps,
                                      dynamic_experts=dynamic_experts, intra_gbps=intra_gbps, warmup=1)
        self.expert_at = np.arange(num_experts, dtype=np.int64)  # slot -> logical expert
        self.slot_of = torch.arange(num_experts, dtype=torch.long, device=device)  # logical expert -> slot
        self.pending: list[torch.Tensor] = []  # this rank's route counts per training micro-batch, float64 [E]
        self.steps = 0
        self.refreshes = self.moved_experts = self.moved_bytes = 0  # moved_bytes: what this rank sent
        self.bundle_bytes = 0  # bytes one expert's move carries (parameters, master copy, optimizer state)
        self._report = {"placement_refreshes": 0, "placement_moved_experts": 0, "placement_bytes": 0}
        self.last_loads: Optional[np.ndarray] = None  # the agreed loads of the last step, float64 [M, E]
        self._canonical_blocks = 0  # `canonical` blocks now open

    # ---------------------------------------------------------------- every forward
    def route(self, expert_ids: torch.Tensor) -> torch.Tensor:
        """Logical expert ids (any shape; -1 = no route; out-of-range ids pass through for the
        dispatcher to report) -> slot ids."""
        if self.identity:
            return expert_ids
        valid = (expert_ids >= 0) & (expert_ids < self.num_experts)
        return torch.where(valid, self.slot_of[expert_ids.clamp(0, self.num_experts - 1)], expert_ids)

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
        ids = expert_ids.reshape(-1)
        ids = ids[(ids >= 0) & (ids < self.num_experts)]
        self.pending.append(torch.bincount(ids, minlength=self.num_experts).to(torch.float64))

    # ---------------------------------------------------------------- at the optimizer step
    def end_step(self, expert_params: list[list[torch.Tensor]], optimizer, us_per_token: float) -> bool:
        """Collective over the ranks that hold the layer, after the optimizer step: agree on the
        step's loads, feed them to the policy and, every ``interval_steps`` steps, re-place (moving
        the experts' parameters and optimizer state). Returns whether the placement changed."""
        if not self.pending:
            return False
        local = torch.stack(self.pending)  # [M, E]
        self.pending = []
        extra = torch.zeros(local.shape[0], 1, dtype=torch.float64)
        extra[0, 0] = us_per_token
        # on the routing table's device: an NCCL group reduces CUDA tensors only
        both = torch.cat([local.cpu(), extra], dim=1).to(self.slot_of.device)
        ranks = 1
        for group in (self.ep_group, self.dp_group):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(both, group=group)
                ranks *= dist.get_world_size(group)
        both = both.cpu()
        loads = both[:, :-1].numpy()
        self.last_loads = loads
        if self.steps == 0:  # as the simulator: first decision after one step, then every interval_steps steps
            self.placer.interval, self.placer.warmup = self.interval_steps * len(loads), len(loads)
        for row in loads:
            self.placer.observe(row, refresh=False)
        self.steps += 1
        self.placer.us_per_token = float(both[0, -1]) / ranks
        if not self.placer.due:
            return False
        if not self.placer.refresh():
            return False
        moved = self._move_to(self.placer.expert_to_rank, expert_params, optimizer)
        self.refreshes += 1
        self._report["placement_refreshes"] += 1
        self._report["placement_moved_experts"] += moved
        self._report["placement_bytes"] += moved * self.bundle_bytes
        return True

    def take_report(self) -> dict:
        """Refreshes, experts moved and the bytes they carried (whole EP group) since the last call."""
        report, self._report = self._report, dict.fromkeys(self._report, 0)
        return report

    def node_loads(self, loads: np.ndarray, expert_at: Optional[np.ndarray] = None) -> np.ndarray:
        """loads float [..., E] per logical expert -> [..., nodes] under the current placement (or
        under the slot -> expert table ``expert_at``)."""
        expert_at = self.expert_at if expert_at is None else np.asarray(expert_at)
        return node_loads(loads, expert_at.argsort() // self.per_rank, self.ep_size // self.ranks_per_node,
                          self.ranks_per_node)

    @contextlib.contextmanager
    def canonical(self, expert_params: list[list[torch.Tensor]], optimizer):
        """Within the block every expert sits in its original slot (DeepSpeed's layout, for saving);
        afterwards they return. Collective."""
        placed = self.expert_at.copy()
        self._canonical_blocks += 1
        try:
            if self.identity:
                yield
                return
            self._move_slots(np.arange(self.num_experts), expert_params, optimizer)
            try:
                yield
            finally:
                self._move_slots(placed, expert_params, optimizer)
        finally:
            self._canonical_blocks -= 1

    def reset(self) -> None:
        """The slots hold the experts in their original order again (a canonical checkpoint was
        loaded into them): the table becomes the identity, the history stays."""
        self.expert_at = np.arange(self.num_experts, dtype=np.int64)
        self.slot_of.copy_(torch.arange(self.num_experts))
        self.placer.expert_to_rank = np.arange(self.num_experts, dtype=np.int64) // self.per_rank

    def adopt(self, expert_at) -> None:
        """The slots hold the experts in the order ``expert_at`` (slot -> logical expert; a state dict
        saved in placement order was loaded into them before the first forward)."""
        order = np.asarray(expert_at, dtype=np.int64)
        if not np.array_equal(np.sort(order), np.arange(self.num_experts)):
            raise ValueError(f"an expert order must be a permutation of the layer's {self.num_experts} experts, "
                             f"got {order.tolist()}")
        self.expert_at = order
        self.slot_of.copy_(torch.from_numpy(order.argsort()))
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

    def _move_to(self, expert_to_rank: np.ndarray, expert_params: list[list[torch.Tensor]], optimizer) -> int:
        """Move expert contents so that expert e lives on rank ``expert_to_rank[e]`` (`_slots_for`): a
        re-placement, counted in ``moved_experts`` and ``moved_bytes`` (the moves of `canonical` are
        not). Returns the experts moved."""
        expert_to_rank = np.asarray(expert_to_rank, dtype=np.int64)
        moved, sent_bytes = self._move_slots(self._slots_for(expert_to_rank), expert_params, optimizer)
        self.placer.expert_to_rank = expert_to_rank.copy()
        self.moved_experts += moved
        self.moved_bytes += sent_bytes
        return moved

    def _move_slots(self, new_at: np.ndarray, expert_params: list[list[torch.Tensor]], optimizer) -> tuple[int, int]:
        """Move expert contents so that slot s holds expert ``new_at[s]``. Collective over the EP group
        (point to point) and, under ZeRO 1/2, the expert-data-parallel group. Returns (experts moved in
        the EP group, bytes this rank sent)."""
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
        keys = hp_state_keys(optimizer)
        # what one expert carries (every expert has the same tensors): sizes the receive buffers;
        # read on every rank, as expert_state is collective under ZeRO 1/2
        template = expert_state(expert_params[0], optimizer, keys)
        self.bundle_bytes = sum(t.numel() * t.element_size() for t in template)
        # read every outgoing expert before anything is overwritten (a rank sends and receives)
        outgoing = [(rank, expert_state(expert_params[j], optimizer, keys)) for rank, j in sends]
        staying = [(i, expert_state(expert_params[j], optimizer, keys)) for j, i in local]
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
            load_expert_state(expert_params[i], optimizer, keys, tensors)
        moved = int(np.sum(new_at != self.expert_at))
        sent_bytes = sum(t.numel() * t.element_size() for _, tensors in outgoing for t in tensors)
        self.expert_at = np.asarray(new_at, dtype=np.int64).copy()
        self.slot_of.copy_(torch.from_numpy(self.expert_at.argsort()))
        return moved, sent_bytes
