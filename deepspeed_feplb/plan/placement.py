"""History-based expert placement: DeepSeek EPLB's policy and FEPLB's cross-node layer.

Per-micro-batch balancing (:mod:`.policy`) moves work only inside a node, so it cannot remove
imbalance *between* nodes. The cross-node layer fixes that on a slower clock: every ``interval``
steps it re-places experts across nodes from their moving-average load so that every node carries
the same expected load, and within a node it spreads hot experts over ranks (which gives each
rank's dynamic experts room to absorb the micro-batch noise). A re-placement is only adopted when
the predicted gain over the next interval pays for moving the experts' weights and optimizer
state (:class:`CrossNodePlacer`).

EPLB (``deepseek-ai/EPLB``, re-implemented here in numpy from its description; verified against
its README golden vector in tests): hierarchical replication and packing of redundant experts,
:func:`rebalance_experts`.

All functions are pure numpy and deterministic.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

__all__ = ["balanced_packing", "replicate_experts", "rebalance_experts", "place_experts",
           "node_loads", "CrossNodePlacer"]


# ----------------------------------------------------------------------------------------------
# EPLB


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack n weighted items into num_packs packs of exactly n / num_packs items each, heaviest
    item first into the lightest pack that still has room (ties: lower pack id).

    weight: float [X, n]. Returns (pack_index int64 [X, n], rank_in_pack int64 [X, n])."""
    weight = np.asarray(weight, dtype=np.float64)
    X, n = weight.shape
    if n % num_packs:
        raise ValueError(f"{n} items cannot be packed evenly into {num_packs} packs")
    per = n // num_packs
    if per == 1:
        idx = np.broadcast_to(np.arange(n, dtype=np.int64), (X, n)).copy()
        return idx, np.zeros((X, n), dtype=np.int64)
    pack_index = np.empty((X, n), dtype=np.int64)
    rank_in_pack = np.empty((X, n), dtype=np.int64)
    for x in range(X):
        w = weight[x]
        packs_w = np.zeros(num_packs)
        packs_n = np.zeros(num_packs, dtype=np.int64)
        for item in np.argsort(-w, kind="stable"):
            open_w = np.where(packs_n < per, packs_w, np.inf)
            p = int(np.argmin(open_w))
            pack_index[x, item] = p
            rank_in_pack[x, item] = packs_n[p]
            packs_w[p] += w[item]
            packs_n[p] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Give n logical experts num_phy >= n physical slots, each extra slot to the expert with the
    largest load per replica (water-filling; ties: lower expert id).

    weight: float [X, n]. Returns (phy2log int64 [X, num_phy], replica rank int64 [X, num_phy],
    logcnt int64 [X, n])."""
    weight = np.asarray(weight, dtype=np.float64)
    X, n = weight.shape
    if num_phy < n:
        raise ValueError(f"{num_phy} physical slots cannot hold {n} experts")
    phy2log = np.empty((X, num_phy), dtype=np.int64)
    rank = np.zeros((X, num_phy), dtype=np.int64)
    phy2log[:, :n] = np.arange(n)
    logcnt = np.ones((X, n), dtype=np.int64)
    rows = np.arange(X)
    for i in range(n, num_phy):
        red = np.argmax(weight / logcnt, axis=-1)
        phy2log[:, i] = red
        rank[:, i] = logcnt[rows, red]
        logcnt[rows, red] += 1
    return phy2log, rank, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


def rebalance_experts(weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """EPLB: place ``num_replicas`` physical experts (logical ones plus redundant copies) on
    ``num_gpus`` GPUs in ``num_nodes`` nodes from the historical load ``weight``.

    Hierarchical when ``num_groups % num_nodes == 0``: pack expert groups onto nodes, replicate
    inside each node, pack the replicas onto the node's GPUs; otherwise the same with one group
    and one node (global policy).

    weight: [layers, num_logical]. Returns (phy2log int64 [layers, num_replicas],
    log2phy int64 [layers, num_logical, max_replicas] padded with -1, logcnt int64 [layers,
    num_logical])."""
    weight = np.asarray(weight, dtype=np.float64)
    L, E = weight.shape
    if num_groups % num_nodes == 0:
        phy2log, phyrank, logcnt = _hierarchical(weight, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log, phyrank, logcnt = _hierarchical(weight, num_replicas, 1, 1, num_gpus)
    maxcnt = int(logcnt.max())
    log2phy = np.full((L, E, maxcnt), -1, dtype=np.int64)
    slots = np.broadcast_to(np.arange(num_replicas), (L, num_replicas))
    layer = np.broadcast_to(np.arange(L)[:, None], (L, num_replicas))
    log2phy[layer, phy2log, phyrank] = slots
    return phy2log, log2phy, logcnt


def _hierarchical(weight, num_phy, num_groups, num_nodes, num_gpus):
    L, E = weight.shape
    if E % num_groups or num_groups % num_nodes or num_gpus % num_nodes or num_phy % num_gpus:
        raise ValueError("EPLB needs experts % groups == 0, groups % nodes == 0, gpus % nodes == 0, "
                         "replicas % gpus == 0")
    group_size = E // num_groups
    groups_per_node = num_groups // num_nodes
    per_gpu = num_phy // num_gpus
    # 1. expert groups -> nodes
    group_w = weight.reshape(L, num_groups, group_size).sum(-1)
    gpack, grank = balanced_packing(group_w, num_nodes)
    log2mlog = (((gpack * groups_per_node + grank) * group_size)[:, :, None]
                + np.arange(group_size)).reshape(L, E)
    mlog2log = _inverse(log2mlog)
    # 2. replicate inside each node
    mlog_w = np.take_along_axis(weight, mlog2log, axis=-1).reshape(L * num_nodes, E // num_nodes)
    phy2mlog, phyrank, mlogcnt = replicate_experts(mlog_w, num_phy // num_nodes)
    # 3. replicas -> GPUs of the node
    phy_w = np.take_along_axis(mlog_w / mlogcnt, phy2mlog, axis=-1)
    pack, rank_in_pack = balanced_packing(phy_w, num_gpus // num_nodes)
    phy2pphy = pack * per_gpu + rank_in_pack
    pphy2phy = _inverse(phy2pphy)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=-1)
    offset = np.arange(0, E, E // num_nodes)[None, :, None]
    pphy2mlog = (pphy2mlog.reshape(L, num_nodes, -1) + offset).reshape(L, -1)
    pphy2log = np.take_along_axis(mlog2log, pphy2mlog, axis=-1)
    pphyrank = np.take_along_axis(phyrank, pphy2phy, axis=-1).reshape(L, -1)
    logcnt = np.take_along_axis(mlogcnt.reshape(L, -1), log2mlog, axis=-1)
    return pphy2log, pphyrank, logcnt


# ----------------------------------------------------------------------------------------------
# FEPLB cross-node layer


def node_loads(loads: np.ndarray, expert_to_rank: np.ndarray, num_nodes: int, ranks_per_node: int) -> np.ndarray:
    """loads float/int [..., E], expert_to_rank int64 [E] -> [..., num_nodes] summed loads."""
    node = np.asarray(expert_to_rank) // ranks_per_node
    onehot = np.zeros((loads.shape[-1], num_nodes))
    onehot[np.arange(loads.shape[-1]), node] = 1.0
    return loads @ onehot


def _refine_swaps(w: np.ndarray, node: np.ndarray, num_nodes: int, max_iter: int = 64) -> np.ndarray:
    """Pairwise swaps between the heaviest and the lightest node while they lower the heavier
    of the two. w float [E], node int64 [E] (equal counts per node, kept)."""
    node = node.copy()
    for _ in range(max_iter):
        tot = np.bincount(node, weights=w, minlength=num_nodes)
        hi, lo = int(np.argmax(tot)), int(np.argmin(tot))
        gap = tot[hi] - tot[lo]
        if gap <= 0:
            break
        a = np.flatnonzero(node == hi)
        b = np.flatnonzero(node == lo)
        d = w[a][:, None] - w[b][None, :]  # load that moves from hi to lo by swapping a <-> b
        new_max = np.maximum(tot[hi] - d, tot[lo] + d)
        new_max = np.where(d > 0, new_max, np.inf)
        k = int(np.argmin(new_max))
        i, j = divmod(k, len(b))
        if not new_max[i, j] < tot[hi] - 1e-9:
            break
        node[a[i]], node[b[j]] = lo, hi
    return node


def _match_labels(new: np.ndarray, old: np.ndarray, n: int) -> np.ndarray:
    """Relabel the groups 0..n-1 of ``new`` so that as many items as possible keep their ``old``
    group (greedy on the overlap matrix). Returns the relabelled int64 array."""
    overlap = np.zeros((n, n), dtype=np.int64)
    np.add.at(overlap, (new, old), 1)
    mapping = np.full(n, -1, dtype=np.int64)
    taken = np.zeros(n, dtype=bool)
    for k in np.argsort(-overlap, axis=None, kind="stable"):
        i, j = divmod(int(k), n)
        if mapping[i] < 0 and not taken[j]:
            mapping[i] = j
            taken[j] = True
    return mapping[new]


def place_experts(history: np.ndarray, num_nodes: int, ranks_per_node: int,
                  previous: Optional[np.ndarray] = None) -> np.ndarray:
    """Cross-node placement from historical per-expert load.

    history:  float [E]: moving-average load of each expert.
    previous: int64 [E] or None: the current expert -> global rank map; the result keeps as many
              experts as it can where they are (node and rank labels are matched to it).
    Returns expert_to_rank int64 [E] with E / (num_nodes * ranks_per_node) experts per rank:
    node loads balanced (packing + pairwise swaps), hot experts spread over each node's ranks."""
    w = np.asarray(history, dtype=np.float64)
    E = w.shape[0]
    R = num_nodes * ranks_per_node
    if E % R:
        raise ValueError(f"{E} experts cannot be placed evenly on {R} ranks")
    node = balanced_packing(w[None], num_nodes)[0][0] if num_nodes > 1 else np.zeros(E, dtype=np.int64)
    if num_nodes > 1:
        node = _refine_swaps(w, node, num_nodes)
        if previous is not None:
            node = _match_labels(node, np.asarray(previous) // ranks_per_node, num_nodes)
    out = np.empty(E, dtype=np.int64)
    for n in range(num_nodes):
        members = np.flatnonzero(node == n)
        local = balanced_packing(w[members][None], ranks_per_node)[0][0]
        if previous is not None:
            prev_local = np.asarray(previous)[members] - n * ranks_per_node
            ok = (prev_local >= 0) & (prev_local < ranks_per_node)
            if ok.all():
                local = _match_labels(local, prev_local, ranks_per_node)
        out[members] = n * ranks_per_node + local
    return out


@dataclass
class CrossNodePlacer:
    """Periodic, cost-accounted cross-node re-placement for one MoE layer.

    experts, num_nodes, ranks_per_node: the EP group.
    interval:        steps between re-placement decisions.
    decay:           weight of the newest step in the exponential moving average of loads.
    expert_state_bytes: bytes that move with an expert that changes node (weights, gradients
                     buffers and optimizer state that live with it).
    net_gbps:        cross-node bandwidth per GPU (GB/s); intra-node moves are not charged.
    us_per_token:    expert time per token-expert pair (forward + backward), for the gain.
    """

    experts: int
    num_nodes: int
    ranks_per_node: int
    interval: int = 50
    decay: float = 0.1
    expert_state_bytes: float = 0.0
    net_gbps: float = 50.0
    us_per_token: float = 0.0
    expert_to_rank: np.ndarray = field(init=False)
    ema: Optional[np.ndarray] = field(init=False, default=None)
    seen: int = field(init=False, default=0)
    migrated_experts: int = field(init=False, default=0)
    migration_us: float = field(init=False, default=0.0)
    refreshes: int = field(init=False, default=0)

    def __post_init__(self):
        R = self.num_nodes * self.ranks_per_node
        self.expert_to_rank = np.arange(self.experts, dtype=np.int64) // (self.experts // R)

    def observe(self, loads: np.ndarray, refresh: bool = True) -> None:
        """Feed one step's per-expert loads (int [E]); re-place at the end of every interval
        (``refresh=False``: the caller calls `refresh` when `due`, e.g. at an optimizer step)."""
        loads = np.asarray(loads, dtype=np.float64)
        self.ema = loads.copy() if self.ema is None else (1 - self.decay) * self.ema + self.decay * loads
        self.seen += 1
        if refresh and self.due:
            self.refresh()

    @property
    def due(self) -> bool:
        """Whether the last observation ended an interval."""
        return self.seen > 0 and self.seen % self.interval == 0

    def refresh(self) -> bool:
        """Re-place from the moving average if the gain over the next interval pays for the
        cross-node moves. Returns whether the placement changed."""
        if self.ema is None:
            return False
        new = place_experts(self.ema, self.num_nodes, self.ranks_per_node, self.expert_to_rank)
        old_max = node_loads(self.ema, self.expert_to_rank, self.num_nodes, self.ranks_per_node).max()
        new_max = node_loads(self.ema, new, self.num_nodes, self.ranks_per_node).max()
        cross = int(np.sum(new // self.ranks_per_node != self.expert_to_rank // self.ranks_per_node))
        cost_us = cross * self.expert_state_bytes / (self.net_gbps * 1e3)
        gain_us = (old_max - new_max) * self.us_per_token * self.interval
        if np.array_equal(new, self.expert_to_rank) or (cross and gain_us <= cost_us):
            return False
        self.migrated_experts += cross
        self.migration_us += cost_us
        self.refreshes += 1
        self.expert_to_rank = new
        return True
