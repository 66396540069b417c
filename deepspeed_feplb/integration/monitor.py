"""FEPLB statistics per MoE layer and training step, for DeepSpeed's monitor and for JSON lines.

`StatsCollector` watches every MoE layer of a model (FEPLB layers, and DeepSpeed's own
`MOELayer`, whose expert compute it times as well). For every training forward of a layer it
keeps one record per micro-batch on this rank:

* the layer's ``feplb_stats`` (tokens per rank before/after balancing for the ranks
  of its NVLink domain, migrated tokens, moves, plan latency, fallback);
* the measured **expert-compute wall time** of this rank: the time spent inside the layer's
  expert modules (forward hooks on each expert), i.e. the static experts, the kept part of the
  dynamic experts and whatever this rank computed as a helper for other ranks (helpers run the
  expert module functionally, so its hooks fire too). Communication and waiting are excluded.

`flush(step)` is collective over the world (one all-gather of the step's records, `gather_small`);
every rank gets the same per-layer summary, and global rank 0 writes it to DeepSpeed's monitor
(TensorBoard, CSV, W&B, Comet: whatever ``ds_config["monitor"...]`` enables) as events
``FEPLB/<layer>/<metric>``:

* ``token_straggler_before`` / ``token_straggler_after``: ``max_r T_r - mean_r T_r`` over the
  ranks of a domain (tokens), mean over the step's micro-batches and the layer's domains;
* ``gemm_straggler_ms``: ``max_r t_r - mean_r t_r`` of the measured expert-compute wall time
  ``t_r`` over the ranks of a domain, same average; ``gemm_max_ms`` the mean of ``max_r t_r``;
* ``migrated_tokens``: token-expert rows computed by a helper, summed over micro-batches and
  domains; ``migrated_bytes``: what the transport moved for them, forward (rows there and
  results back, the weight copies) plus, in training, backward (output-grads there, input-grads
  back, the weight-gradients that went home): ``rows * H * elem * (2 fwd + 2 bwd) + weight_bytes
  + grad_bytes``;
* ``weight_bytes``: expert weights copied to helpers (one expert per copy; a helper that kept a
  copy from earlier in the step needs none, ``feplb.weight_residency: "step"``),
  ``weight_copies`` their number (re-sends after the home's weights changed within the step
  included), ``resident_hits`` chunks served from a kept copy,
  ``flushed_copies`` kept copies whose accumulated gradients went home at the step's end, and
  ``grad_bytes`` the weight-gradients sent home (per chunk, or once per kept copy); sums;
* ``plan_latency_us``: mean planning time; ``fallbacks``: micro-batches planned in-process
  because the scheduler process was late or dead (summed);
* ``placement_refreshes``, ``placement_moved_experts``, ``placement_bytes`` (``feplb.placement``):
  re-placements made at this step's end, the experts they moved between ranks and the bytes
  those carried (parameters, fp32 master copies, optimizer state), over the layer's EP group;
  ``placement_replicas``: replicas of hot experts the layer's EP group holds after the step
  (``placement.redundant_experts_per_rank``);
* ``warm_start_token_straggler`` (pipeline engine only): the token straggler the plan computed
  ahead of time from the previous micro-batch's counts would have left on this micro-batch.

The same summary is ``collector.last`` (a dict, see `summarize`), which the examples print as
one JSON line per step and `python -m deepspeed_feplb report` plots.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, TypedDict

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.moe.sharded_moe import MOELayer

from deepspeed_feplb.collectives import gather_small
from deepspeed_feplb.stats import recomputing, straggler

EVENT_PREFIX = "FEPLB"
METRICS = ("token_straggler_before", "token_straggler_after", "gemm_straggler_ms", "gemm_max_ms", "migrated_tokens",
           "migrated_bytes", "weight_bytes", "weight_copies", "resident_hits", "flushed_copies", "grad_bytes",
           "plan_latency_us", "fallbacks")
# and, for layers with feplb.placement, per step (summed over layers in the totals):
PLACEMENT = ("placement_refreshes", "placement_moved_experts", "placement_bytes", "placement_replicas")
TRAFFIC = ("weight_bytes", "weight_copies", "resident_hits", "flushed_copies", "grad_bytes")  # summed stats


class PlacementStepStats(TypedDict, total=False):
    """The keys a layer with ``feplb.placement`` adds to its `LayerStepStats` (module docstring)."""
    placement_refreshes: int
    placement_moved_experts: int
    placement_bytes: int
    placement_replicas: int


class LayerStepStats(PlacementStepStats):
    """One FEPLB layer's entry in `StepStats` ``layers``: every key always present (zeros where
    nothing happened), the placement keys with ``feplb.placement`` (without it they would be
    zeros in every monitor). A layer without FEPLB stats (DeepSpeed's own `MOELayer`, or
    ``feplb.stats.enabled`` false) has the two GEMM keys only; the pipeline engine adds
    ``warm_start_token_straggler``. Definitions: the module docstring."""
    gemm_straggler_ms: float
    gemm_max_ms: float
    token_straggler_before: float
    token_straggler_after: float
    migrated_tokens: int
    migrated_bytes: int
    plan_latency_us: float
    fallbacks: int
    weight_bytes: int
    weight_copies: int
    resident_hits: int
    flushed_copies: int
    grad_bytes: int


class StepStats(TypedDict, total=False):
    """``collector.last`` (``engine.feplb_monitor.last``): one optimizer step over all its
    micro-batches. ``step``, ``micro_batches`` and ``layers`` (``{layer name: LayerStepStats}``)
    are always there; with any FEPLB layer so are the totals over layers: the means of the token
    and GEMM stragglers and the sums of the summed metrics (`LayerStepStats` keys)."""
    step: int
    micro_batches: int
    layers: dict
    token_straggler_before: float
    token_straggler_after: float
    gemm_straggler_ms: float
    migrated_tokens: int
    migrated_bytes: int
    fallbacks: int


@dataclass
class Record:
    """One MoE layer, one micro-batch, this rank."""
    rank: int
    stats: dict
    expert_seconds: float
    hidden: int
    elem_bytes: int
    expert_bytes: int
    training: bool
    extra: dict = field(default_factory=dict)

    SUMMARY_STATS = ("ranks", "token_straggler_before", "token_straggler_after", "plan_latency_us", "fallback",
                     "migrated_tokens", "moves", "weight_bytes", "weight_copies", "resident_hits", "weight_resends",
                     "flushed_copies", "grad_bytes")

    def lean(self) -> "Record":
        """This record with only the stats that `summarize` reads (what every step gathers)."""
        return Record(self.rank, {k: self.stats[k] for k in self.SUMMARY_STATS if k in self.stats}, self.expert_seconds,
                      self.hidden, self.elem_bytes, self.expert_bytes, self.training, self.extra)


def layer_name(module_name: str) -> str:
    """``"3.moe.deepspeed_moe"`` -> ``"3.moe"``: the name of the user's MoE module."""
    return module_name.removesuffix(".deepspeed_moe").removesuffix("deepspeed_moe") or "moe"


class StatsCollector:
    """Per-micro-batch FEPLB records of every MoE layer of ``model`` on this rank (module docstring).

    micro_batch: the id of the micro-batch being computed; the pipeline engine sets it before
    every forward. When it is None, a layer's n-th forward since the last `flush` is micro-batch n.
    """

    def __init__(self, model: torch.nn.Module):
        self.layers: dict[str, MOELayer] = {layer_name(n): m for n, m in model.named_modules()
                                            if isinstance(m, MOELayer)}
        self.micro_batch: Optional[int] = None
        self.records: dict[int, dict[str, Record]] = {}  # micro-batch -> layer -> record
        self.latest: dict[str, Record] = {}  # the newest record of each layer (for warm starts)
        self.last: Optional[dict] = None
        self._forwards: dict[str, int] = {}
        self._seconds: dict[str, float] = {}
        self._started: dict[str, float] = {}
        self._hooks = []
        for name, layer in self.layers.items():
            self._hooks.append(layer.register_forward_pre_hook(self._layer_start(name)))
            self._hooks.append(layer.register_forward_hook(self._layer_end(name)))
            for expert in layer.experts.deepspeed_experts:
                self._hooks.append(expert.register_forward_pre_hook(self._expert_start(name)))
                self._hooks.append(expert.register_forward_hook(self._expert_end(name)))

    # ------------------------------------------------------------------ hooks
    def _layer_start(self, name):
        def hook(module, inputs):
            self._seconds[name] = 0.0
            x = inputs[0]
            self._input = (x.shape[-1], x.element_size())
        return hook

    def _expert_start(self, name):
        def hook(module, inputs):
            self._started[name] = time.perf_counter()
        return hook

    def _expert_end(self, name):
        def hook(module, inputs, output):
            self._seconds[name] = self._seconds.get(name, 0.0) + time.perf_counter() - self._started.pop(name)
        return hook

    def _layer_end(self, name):
        def hook(module, inputs, output):
            if not module.training or recomputing():  # a checkpointing recompute is not a micro-batch
                return
            mb = self.micro_batch
            if mb is None:
                mb = self._forwards.get(name, 0)
                self._forwards[name] = mb + 1
            hidden, elem = self._input
            stage = getattr(module, "stage", None)
            record = Record(dist.get_rank() if dist.is_initialized() else 0,
                            dict(getattr(module, "feplb_stats", {}) or {}), self._seconds.get(name, 0.0), hidden, elem,
                            int(getattr(stage, "expert_bytes", 0)),
                            torch.is_grad_enabled())
            self.records.setdefault(mb, {})[name] = record
            self.latest[name] = record
        return hook

    def _add_placement(self, summary: dict) -> None:
        """Each placed layer's refreshes, experts moved and their bytes since the last flush (the same
        on every rank of its EP group), and their totals."""
        for name, layer in self.layers.items():
            placement = getattr(layer, "placement", None)
            if placement is not None:
                summary["layers"].setdefault(name, {}).update(placement.take_report())
        for key in PLACEMENT:
            values = [entry[key] for entry in summary["layers"].values() if key in entry]
            if values:
                summary[key] = int(sum(values))

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ------------------------------------------------------------------ per step
    def take(self) -> dict[int, dict[str, Record]]:
        """This rank's records of the step (and forget them)."""
        records, self.records, self._forwards = self.records, {}, {}
        return records

    def flush(self, step: int, monitor=None) -> dict:
        """Collective over the world: summarise the step's records of all ranks; rank 0 writes events.

        Returns the summary (the same on every rank), also kept as ``self.last``.
        """
        mine = {mb: {name: record.lean() for name, record in layers.items()} for mb, layers in self.take().items()}
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = gather_small(mine)
        else:
            everyone = [mine]
        self.last = summarize(everyone, step)
        self._add_placement(self.last)
        if monitor is not None and getattr(monitor, "enabled", False) and self.last["layers"]:
            if not dist.is_initialized() or dist.get_rank() == 0:
                monitor.write_events(events(self.last))
        return self.last


def summarize(records_by_rank: list[dict[int, dict[str, Record]]], step: int) -> StepStats:
    """Per-layer metrics of one step from every rank's records (module docstring for definitions).

    Returns ``{"step": step, "micro_batches": n, "layers": {layer: {metric: value, ...}}, **totals}``
    where totals are the means over layers of the stragglers and the sums of migrated tokens and
    bytes and of fallbacks.
    """
    by_layer: dict[str, dict[int, list[Record]]] = {}
    for records in records_by_rank:
        for mb, layers in records.items():
            for name, record in layers.items():
                by_layer.setdefault(name, {}).setdefault(mb, []).append(record)
    layers = {}
    micro_batches = 0
    for name in sorted(by_layer):
        s_before, s_after, gemm, gemm_max, latency, warm = [], [], [], [], [], []
        migrated_tokens = migrated_bytes = fallbacks = 0
        traffic = dict.fromkeys(TRAFFIC, 0)
        for mb, records in sorted(by_layer[name].items()):
            micro_batches = max(micro_batches, mb + 1)
            for _ranks, members in _domains(records):
                seconds = np.array([r.expert_seconds for r in members]) * 1e3
                gemm.append(float(seconds.max() - seconds.mean()))
                gemm_max.append(float(seconds.max()))
                lead = members[0]
                st = lead.stats
                if "token_straggler_before" not in st:
                    continue
                s_before.append(st["token_straggler_before"])
                s_after.append(st["token_straggler_after"])
                latency.append(st.get("plan_latency_us", 0.0))
                # each rank waits for the scheduler on its own: a micro-batch is a fallback of the
                # domain when any of its ranks planned in-process (every rank sums the same records)
                fallbacks += int(any(r.stats.get("fallback", False) for r in members))
                tokens, moves = int(st.get("migrated_tokens", 0)), int(st.get("moves", 0))
                migrated_tokens += tokens
                passes = 2 if lead.training else 1
                counted = {key: int(st.get(key, 0)) for key in TRAFFIC}
                # stats without weight traffic (recorded before residency existed): one copy per move each way
                counted["weight_bytes"] = int(st.get("weight_bytes", moves * lead.expert_bytes))
                # a home that sent weights again (they changed within the step) alone knows it: every home's, summed
                resent = sum(int(r.stats.get("weight_resends", 0)) for r in members)
                counted["weight_copies"] += resent
                counted["resident_hits"] -= resent
                counted["weight_bytes"] += resent * lead.expert_bytes
                counted["grad_bytes"] = int(st.get("grad_bytes", moves * lead.expert_bytes)) if lead.training else 0
                migrated_bytes += (passes * 2 * tokens * lead.hidden * lead.elem_bytes + counted["weight_bytes"]
                                   + counted["grad_bytes"])
                for key in TRAFFIC:
                    traffic[key] += counted[key]
                if "warm_start_token_straggler" in lead.extra:
                    warm.append(lead.extra["warm_start_token_straggler"])
        entry = {"gemm_straggler_ms": _mean(gemm), "gemm_max_ms": _mean(gemm_max)}
        if s_before:
            entry.update(token_straggler_before=_mean(s_before), token_straggler_after=_mean(s_after),
                         migrated_tokens=migrated_tokens, migrated_bytes=migrated_bytes,
                         plan_latency_us=_mean(latency), fallbacks=fallbacks, **traffic)
        if warm:
            entry["warm_start_token_straggler"] = _mean(warm)
        layers[name] = entry
    summary = {"step": step, "micro_batches": micro_batches, "layers": layers}
    if layers:
        for key in ("token_straggler_before", "token_straggler_after", "gemm_straggler_ms"):
            values = [v[key] for v in layers.values() if key in v]
            if values:
                summary[key] = _mean(values)
        for key in ("migrated_tokens", "migrated_bytes", "fallbacks", *TRAFFIC):
            values = [v[key] for v in layers.values() if key in v]
            if values:
                summary[key] = int(sum(values))
    return summary


def _domains(records: list[Record]):
    """Group one layer's records of one micro-batch by NVLink domain: [(ranks, records in rank order)]."""
    groups: dict[tuple, list[Record]] = {}
    for r in records:
        ranks = tuple(r.stats.get("ranks", ()))
        if len(ranks) <= 1 or r.rank not in ranks:  # no domain (EP 1, D 0, or DeepSpeed's own layer): the EP
            ranks = ("ep", r.rank)                   # group is unknown here, so every rank is its own group
        groups.setdefault(ranks, []).append(r)
    if all(key[0] == "ep" for key in groups):  # layers without domains: the straggler is over all ranks that ran it
        members = sorted(records, key=lambda r: r.rank)
        return [(tuple(r.rank for r in members), members)]
    return [(k, sorted(v, key=lambda r: r.rank)) for k, v in sorted(groups.items(), key=lambda kv: str(kv[0]))]


def _mean(values) -> float:
    return float(np.mean(values)) if len(values) else 0.0


def events(summary: dict) -> list[tuple[str, float, int]]:
    """DeepSpeed monitor events ``(name, value, step)`` of a `summarize` result."""
    out = []
    for name, entry in summary["layers"].items():
        for metric, value in entry.items():
            out.append((f"{EVENT_PREFIX}/{name}/{metric}", float(value), summary["step"]))
    return out


def warm_start_straggler(domain_counts: np.ndarray, moves: np.ndarray) -> float:
    """Token straggler left on ``domain_counts int64 [G, E_local]`` by a plan made for other counts.

    moves ``int64 [M, 4]`` (home, local_expert, helper, tokens); a move takes at most the rows
    its home still holds of that expert.
    """
    counts = np.array(domain_counts, dtype=np.int64, copy=True)
    tokens = counts.sum(axis=1)
    for home, expert, helper, n in np.asarray(moves, dtype=np.int64).reshape(-1, 4).tolist():
        if home >= counts.shape[0] or helper >= counts.shape[0] or expert >= counts.shape[1]:
            continue
        n = min(n, counts[home, expert])
        counts[home, expert] -= n
        tokens[home] -= n
        tokens[helper] += n
    return straggler(tokens)[0]
