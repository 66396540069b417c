"""What FEPLB adds to each rank's device memory, known and checked at `deepspeed_feplb.initialize`.

docs/GPU.md ("Memory per rank") has the table and a worked example. For the FEPLB layers of one
expert-parallel group on one rank (``L`` layers, experts of ``P`` parameter bytes in ``n_t``
tensors, a kept copy ``c`` bytes: weights and an fp32 weight-gradient), with ``G`` ranks per
NVLink domain and ``D`` dynamic experts per rank (`GroupMemory`):

* receive slots (``transport: cuda_ce``): ``(G - 1)`` inbound rings of a slot ``S``; ``S`` is
  ``transport_slot_mb``, or for "auto" D chunks with their weights, ``D · (P + 256 · (n_t + 2))``,
  plus a rank's mean rows, which only the first balanced micro-batch tells: that part is checked
  when the domain opens (`migrate.cuda_ce.preflight_problems`);
* weight copies held from forward to backward: ``L · min(2D · (G - 1) · P, ce_budget)`` (a rank
  over its domain's mean chooses up to 2D dynamic experts: `plan.hottest`);
* the DeepEP buffer of the group (``ep_backend: deepep``): DeepEP's NVLink size hint, plus its RDMA
  size hint for a group that spans hosts;
* kept copies (``weight_residency: "step"``): at most ``L · max_resident_experts · c``, and at
  most ``resident_budget_mb``; for "auto", `AUTO_FREE_SHARE` of what the rest leaves free
  (`plan.residency.resident_budget_bytes`), the least over the domain's ranks;
* replica slots (``placement.redundant_experts_per_rank`` ``r`` on an EP group that spans
  domains): ``L · r · (c + g + h)``, each slot's weights (allocated when the layer is built: at its
  first forward for a DeepSpeed MoE layer, at install for an AutoEP one), the fp32 sum of its
  gradient while a step accumulates, ``g``, one more fp32 gradient for bf16/fp16 experts (0
  for fp32 ones): the early half of a replica's sum, which the expert's home holds through the
  step's last micro-batch, and ``h = c`` for a DeepSpeed MoE layer (0 for an AutoEP one): an
  expert's gradient of that micro-batch, which every rank holds back to the backward's end for
  as many experts as it has slots, and a replica's arrived sum; what a layer has allocated
  already is not counted again (`replica_bytes`).

`check_at_initialize` measures each rank's free memory once DeepSpeed has built the engine (its
weights, gradients and optimizer states are then in place), refuses on every rank of an EP group
alike, with the figures and the keys to change, where a rank cannot hold what is bounded above
(the kept copies counted only where ``resident_budget_mb`` sets their budget), and records each
domain's kept-copy budget, which its `domain.DomainRuntime` then takes. Experts in host memory
(CPU) have no device budget.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from deepspeed_feplb.config import FEPLBConfig, FEPLBConfigError
from deepspeed_feplb.migrate.arena import slot_bytes, transport_bytes_per_rank
from deepspeed_feplb.plan.residency import resident_budget_bytes

__all__ = ["ExpertSizes", "GroupMemory", "LayerMemoryFacts", "group_memory", "memory_problems", "check_at_initialize",
           "device_free_bytes", "kept_budget_of", "replica_bytes"]

MiB = 2**20


@dataclass(frozen=True)
class ExpertSizes:
    """One FEPLB layer's expert, as its memory needs see it: ``expert_bytes`` (P), ``tensors``
    (its parameters, n_t), ``copy_bytes`` (c), ``row_bytes`` (hidden x element size)."""
    expert_bytes: int
    tensors: int
    copy_bytes: int
    row_bytes: int

    @classmethod
    def of(cls, expert_params: Sequence[torch.Tensor], hidden: int) -> "ExpertSizes":
        from deepspeed_feplb.migrate.resident import copy_bytes
        return cls(sum(p.numel() * p.element_size() for p in expert_params), len(expert_params),
                   copy_bytes(expert_params), hidden * expert_params[0].element_size())

    def receive_slot(self, config: FEPLBConfig, rows: float) -> int:
        """Bytes of the receive slot a domain opens with for these experts: ``transport_slot_mb``,
        or for "auto" one forward message to a helper in one part, D chunks with their parameters
        and a buffer or two each, plus ``rows`` (a rank's mean rows; a bound:
        `messages.rows_to_helper`)."""
        if config.transport_slot_mb != "auto":
            return int(config.transport_slot_mb * MiB)
        return slot_bytes(config.dynamic_experts_per_rank, self.expert_bytes, self.tensors + 2, rows, self.row_bytes)


def replica_bytes(expert_params: Sequence[torch.Tensor], slots: int, allocated: bool, held_back: bool = True) -> int:
    """Device bytes ``slots`` replica slots of one layer still add (experts of ``expert_params``):
    each slot holds what a kept copy does (`migrate.resident.copy_bytes`: the weights and an fp32
    gradient sum), less its weights where ``allocated`` already, and, for weights narrower than
    fp32, one fp32 gradient sum more: the early half of a replica's sum, which its expert's home
    holds from the step's one-but-last backward to its last (`integration.replicas.ReplicaSlots`
    sends early, for each home, only as many replicas' sums as it has slots). With ``held_back``
    (a DeepSpeed MoE layer, whose ranks hold the gradients of a step's last micro-batch of at
    most as many of their experts as they have slots back to the backward's end, and a home as
    many replicas' arrived sums: `plan.replicas.held_back_locals`), a kept copy's bytes more per
    slot: that gradient and that sum (at most an fp32 one)."""
    from deepspeed_feplb.migrate.resident import copy_bytes
    weights = sum(p.numel() * p.element_size() for p in expert_params) if allocated else 0
    narrow = all(p.element_size() < 4 for p in expert_params)
    early = sum(p.numel() for p in expert_params) * 4 if narrow else 0
    return slots * (copy_bytes(expert_params) * (2 if held_back else 1) - weights + early)


@dataclass(frozen=True)
class GroupMemory:
    """Device bytes the FEPLB layers of one EP group add on one rank (module docstring):
    ``slots``, ``in_flight`` (copies held forward to backward), ``deepep``, ``replicas`` (replica
    slots not allocated yet and their gradient sums) and ``kept_most`` (the most kept copies can
    take: L x max_resident_experts x c)."""
    slots: int = 0
    in_flight: int = 0
    deepep: int = 0
    kept_most: int = 0
    replicas: int = 0

    @property
    def fixed(self) -> int:
        """What the rank must hold whatever the kept copies' budget."""
        return self.slots + self.in_flight + self.deepep + self.replicas

    def kept_set(self, config: FEPLBConfig) -> float:
        """Bytes of the kept copies' budget the config sets (``resident_budget_mb``), at most what
        they can take; 0 for "auto", which takes what the rest leaves."""
        return 0 if config.resident_budget_mb == "auto" else min(config.resident_budget_mb * MiB, self.kept_most)


def group_memory(config: FEPLBConfig, ep_size: int, domain: int, layers: Sequence[ExpertSizes], ce_transport: bool,
                 deepep_bytes: int = 0, replica_slots_bytes: int = 0) -> GroupMemory:
    """`GroupMemory` of ``layers`` (this rank's FEPLB layers of one EP group of ``ep_size`` ranks,
    ``domain`` per NVLink domain); ``ce_transport``: phase 2 on the CUDA CE transport (its slots
    are device memory); ``deepep_bytes``: the group's DeepEP buffer (0: torch dispatch);
    ``replica_slots_bytes``: what the layers' replica slots still add (`replica_bytes`)."""
    D = config.dynamic_experts_per_rank
    if not layers or ep_size <= 1 or domain <= 1 or D <= 0:
        return GroupMemory(deepep=deepep_bytes, replicas=replica_slots_bytes)
    peers = domain - 1
    ce_budget = math.inf if config.ce_budget == "auto" else float(config.ce_budget)
    in_flight = sum(int(min(2 * D * peers * layer.expert_bytes, ce_budget)) for layer in layers)
    # with an "auto" slot, its weights' share: the rows' share is checked when the domain opens
    slots = transport_bytes_per_rank(domain, max(layer.receive_slot(config, 0) for layer in layers)) \
        if ce_transport else 0
    keep = config.max_resident_experts if config.weight_residency == "step" else 0
    kept_most = len(layers) * keep * max(layer.copy_bytes for layer in layers)
    return GroupMemory(slots, in_flight, deepep_bytes, kept_most, replica_slots_bytes)


def memory_problems(rank: int, free_bytes: int, need: GroupMemory, config: FEPLBConfig) -> list[str]:
    """What keeps global rank ``rank`` (``free_bytes`` of device memory free) from holding ``need``:
    one line with each share and the keys that lower it, or none. A kept-copy budget the config
    sets counts (at most what the copies can take); "auto" takes what is left."""
    kept = need.kept_set(config)
    total = need.fixed + kept
    if total <= free_bytes:
        return []
    shares = [(need.slots, "phase-2 receive slots", "feplb.transport_slot_mb, dynamic_experts_per_rank"),
              (need.in_flight, "weight copies held from forward to backward",
               "feplb.ce_budget, dynamic_experts_per_rank"),
              (need.deepep, "the DeepEP buffer", "feplb.ep_backend \"torch\""),
              (need.replicas, "replica slots", "feplb.placement.redundant_experts_per_rank"),
              (kept, "kept weight copies", "feplb.resident_budget_mb, max_resident_experts")]
    said = "; ".join(f"{what} {nbytes / MiB:,.0f} MiB ({keys})" for nbytes, what, keys in shares if nbytes)
    return [f"rank {rank} has {free_bytes / MiB:,.0f} MiB of device memory free after deepspeed.initialize and its "
            f"FEPLB layers need {total / MiB:,.0f} MiB: {said}; lower those keys"]


def device_free_bytes(device: Optional[torch.device]) -> Optional[int]:
    """Bytes ``device`` can still give this process: the driver's free memory plus the blocks torch
    has cached but not handed out (None: host memory, or no device)."""
    if device is None or torch.device(device).type != "cuda":
        return None
    device = torch.device(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(torch.cuda.mem_get_info(device)[0] + cached)


_KEPT_BUDGETS: dict[tuple, float] = {}  # (EP group's global ranks, domain size) -> kept-copy budget, bytes per rank


def kept_budget_of(ep_ranks: Sequence[int], domain: int) -> Optional[float]:
    """The kept-copy budget `check_at_initialize` recorded for this EP group (None: not checked)."""
    return _KEPT_BUDGETS.get((tuple(ep_ranks), domain))


@dataclass
class LayerMemoryFacts:
    """What a FEPLB layer tells `check_at_initialize`: its EP group and size, ranks per NVLink
    domain (`domain.domain_size`), one expert's parameters, the hidden size, what its replica
    slots still add (`replica_bytes`), and whether it moves rows inside its domains
    (`domain.moves_in_domains`: only then has it receive slots)."""
    ep_group: object
    ep_size: int
    domain_size: int
    expert_params: list
    hidden: int
    replica_bytes: int = 0
    moves_in_domains: bool = True


def check_at_initialize(layers: Sequence[LayerMemoryFacts], config: FEPLBConfig,
                        free_bytes: Optional[Callable[[torch.device], Optional[int]]] = None) -> dict:
    """Collective over each EP group of ``layers`` (every rank's FEPLB layers, in model order): refuse
    with `FEPLBConfigError` where a rank cannot hold its `group_memory` (every rank of the group
    alike), and record each group's kept-copy budget (`kept_budget_of`). ``free_bytes``: a
    device's free bytes, None for host memory (default: `device_free_bytes`). Returns {EP ranks:
    (this rank's `GroupMemory`, its domain's budget)} for the groups on device memory."""
    import torch.distributed as dist

    from deepspeed_feplb.collectives import gather_small
    from deepspeed_feplb.dispatch import dispatcher_kind
    from deepspeed_feplb.migrate import transport_kind

    free_bytes = free_bytes or device_free_bytes
    groups: dict[tuple, list[LayerMemoryFacts]] = {}
    for layer in layers:
        if layer.ep_size > 1:
            groups.setdefault(tuple(dist.get_process_group_ranks(layer.ep_group)), []).append(layer)
    figures = {}
    for ranks, members in groups.items():
        first = members[0]
        device = first.expert_params[0].device
        free = free_bytes(device)
        G = first.domain_size
        need = GroupMemory()
        if free is not None:
            deepep = 0
            if dispatcher_kind(config, first.ep_size, first.expert_params, first.hidden, ranks)[0] == "deepep":
                import deep_ep

                from deepspeed_feplb.dispatch.deepep import buffer_bytes
                deepep = sum(buffer_bytes(deep_ep, max(m.hidden for m in members),
                                          first.expert_params[0].element_size(), first.ep_size))
            need = group_memory(config, first.ep_size, G, [ExpertSizes.of(m.expert_params, m.hidden) for m in members],
                                first.moves_in_domains and transport_kind(config, first.expert_params) == "cuda_ce",
                                deepep,
                                sum(m.replica_bytes for m in members))
        problems = memory_problems(dist.get_rank(), free, need, config) if free is not None else []
        mine = (free, need.fixed, need.kept_most, problems)
        everyone = gather_small(mine, group=first.ep_group, device=device)
        problems = [p for theirs in everyone for p in theirs[3]]
        if problems:
            raise FEPLBConfigError("FEPLB's device memory does not fit: " + "; ".join(problems))
        if free is None:
            continue
        here = ranks.index(dist.get_rank()) // G * G
        domain = everyone[here:here + G]
        budget = resident_budget_bytes(config.resident_budget_mb, [f - fixed for f, fixed, _, _ in domain],
                                       max(most for _, _, most, _ in domain))
        _KEPT_BUDGETS[(ranks, G)] = budget
        figures[ranks] = (need, budget)
    return figures

