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

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from deepspeed_feplb.plan import replicas

__all__ = ["balanced_packing", "replicate_experts", "rebalance_experts", "place_experts", "node_loads", "holdings",
           "slot_holdings", "transfer_us", "placement_rows", "improve_placement", "CrossNodePlacer"]


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


def holdings(expert_to_rank: np.ndarray, ranks: int) -> np.ndarray:
    """expert_to_rank int64 [E] -> bool [ranks, E]: which rank holds which expert (EPLB's slots:
    :func:`slot_holdings`)."""
    e2r = np.asarray(expert_to_rank, dtype=np.int64)
    out = np.zeros((ranks, e2r.shape[0]), dtype=bool)
    out[e2r, np.arange(e2r.shape[0])] = True
    return out


def slot_holdings(phy2log: np.ndarray, ranks: int, experts: int) -> np.ndarray:
    """EPLB's phy2log int64 [P] (slot ``i`` on rank ``i // (P / ranks)``) -> bool [ranks, experts]."""
    phy2log = np.asarray(phy2log, dtype=np.int64)
    out = np.zeros((ranks, experts), dtype=bool)
    out[np.arange(phy2log.shape[0]) // (phy2log.shape[0] // ranks), phy2log] = True
    return out


def transfer_us(old: np.ndarray, new: np.ndarray, ranks_per_node: int, state_bytes: float,
                net_gbps: float, intra_gbps: float = math.inf) -> float:
    """Wall time (µs) of the expert-state transfers that turn placement ``old`` into ``new``.

    old, new: bool [R, E]: which rank holds which expert before and after. Every expert a rank
    newly holds arrives with ``state_bytes`` (weights and the optimizer state that lives with
    them) from a rank that held it before: one of the receiver's node if any (the lowest id;
    intra-node link, ``intra_gbps``), else the lowest-id holder (inter-node link, ``net_gbps``);
    an expert nobody held costs nothing. Every rank has its own links, used in parallel: a rank's
    time is ``max(max(cross in, cross out) * state_bytes / net, max(intra in, intra out) *
    state_bytes / intra)`` and the transfer takes the slowest rank's time (the inter-node and the
    intra-node links of a rank also work side by side). GB/s are 1e9 bytes/s."""
    old = np.asarray(old, dtype=bool)
    new = np.asarray(new, dtype=bool)
    R = old.shape[0]
    node = np.arange(R) // ranks_per_node
    cross_in = np.zeros(R)
    cross_out = np.zeros(R)
    intra_in = np.zeros(R)
    intra_out = np.zeros(R)
    for r, e in zip(*np.nonzero(new & ~old)):
        holders = np.flatnonzero(old[:, e])
        if holders.size == 0:
            continue
        near = holders[node[holders] == node[r]]
        if near.size:
            intra_in[r] += 1
            intra_out[near[0]] += 1
        else:
            cross_in[r] += 1
            cross_out[holders[0]] += 1

    def per_us(gbps):
        return 0.0 if math.isinf(gbps) else state_bytes / (gbps * 1e3)

    t = np.maximum(np.maximum(cross_in, cross_out) * per_us(net_gbps),
                   np.maximum(intra_in, intra_out) * per_us(intra_gbps))
    return float(t.max()) if R else 0.0


def _rank_terms(w: np.ndarray, expert_to_rank: np.ndarray, ranks: int, dynamic_experts: int) -> np.ndarray:
    """float [R]: each rank's load minus its D largest expert loads (what its dynamic experts
    cannot shed), under loads w [E]."""
    order = np.lexsort((-w, expert_to_rank))  # by rank, then heaviest first
    per = w.shape[0] // ranks
    sw = w[order].reshape(ranks, per)
    return sw[:, min(dynamic_experts, per):].sum(axis=1)


def placement_rows(w: np.ndarray, expert_to_rank: np.ndarray, num_nodes: int, ranks_per_node: int,
                   dynamic_experts: int = 0) -> float:
    """The predicted busiest rank's rows of one micro-batch under placement ``expert_to_rank``
    int64 [E] and expected loads ``w`` float [E]: the lower bound of intra-node balancing taken
    over the nodes, ``max_n max(mean rank load of node n, max_{r in n} (load_r - its D largest
    expert loads))``. D = 0: node mean only. Each rank's D hottest, as where ranks do not know
    their domain's mean; where they do (the torch dispatcher) a rank may choose up to 2D
    (`plan.hottest`, `plan.policy.lower_bound`) and intra-node balancing reaches lower than this
    predicts."""
    w = np.asarray(w, dtype=np.float64)
    R = num_nodes * ranks_per_node
    node = node_loads(w, expert_to_rank, num_nodes, ranks_per_node).max() / ranks_per_node
    if dynamic_experts <= 0:
        return float(node)
    return float(max(node, _rank_terms(w, expert_to_rank, R, dynamic_experts).max()))


def _swap_sequence(w: np.ndarray, e2r: np.ndarray, num_nodes: int, G: int, D: int,
                   max_swaps: int) -> list:
    """Greedy expert swaps from placement e2r int64 [E]: first between the heaviest and the
    lightest node (the pair that lowers the heavier of the two most), then inside a node between
    the rank with the largest ``load - D largest`` and another rank of its node (while that lowers
    it). Returns the placements after 1, 2, ... swaps (a list of int64 [E])."""
    out = []
    e2r = e2r.copy()
    E = w.shape[0]
    R = num_nodes * G
    for _ in range(max_swaps if num_nodes > 1 else 0):
        tot = node_loads(w, e2r, num_nodes, G)
        hi, lo = int(np.argmax(tot)), int(np.argmin(tot))
        a = np.flatnonzero(e2r // G == hi)
        b = np.flatnonzero(e2r // G == lo)
        d = w[a][:, None] - w[b][None, :]
        new_max = np.where(d > 0, np.maximum(tot[hi] - d, tot[lo] + d), np.inf)
        i, j = divmod(int(np.argmin(new_max)), len(b))
        if not new_max[i, j] < tot[hi] - 1e-9:
            break
        e2r[a[i]], e2r[b[j]] = e2r[b[j]], e2r[a[i]]
        out.append(e2r.copy())
    if D <= 0:
        return out
    per = E // R
    keep = per - min(D, per)  # the coldest experts of a rank that stay home
    for _ in range(max_swaps):
        terms = _rank_terms(w, e2r, R, D)
        mean = np.repeat(node_loads(w, e2r, num_nodes, G) / G, G)
        score = np.maximum(terms, mean)
        p = int(np.argmax(score))
        if terms[p] <= mean[p] + 1e-9:
            break  # the worst rank is bounded by its node's mean: nothing inside the node helps
        xp = np.flatnonzero(e2r == p)
        best = (terms[p], None)
        for q in range(p // G * G, p // G * G + G):
            if q == p:
                continue
            xq = np.flatnonzero(e2r == q)
            # rank p gives xp[i] and takes xq[j]; q the reverse: [per, per, per] loads after the swap
            lp = np.broadcast_to(w[xp], (per, per, per)).copy()
            lq = np.broadcast_to(w[xq], (per, per, per)).copy()
            ii, jj = np.meshgrid(np.arange(per), np.arange(per), indexing="ij")
            lp[ii, jj, ii] = w[xq][jj]
            lq[ii, jj, jj] = w[xp][ii]
            tp = np.sort(lp, axis=-1)[..., :keep].sum(-1)
            tq = np.sort(lq, axis=-1)[..., :keep].sum(-1)
            worst = np.maximum(tp, tq)
            k = int(np.argmin(worst))
            if worst.flat[k] < best[0] - 1e-9:
                best = (worst.flat[k], (xp[k // per], xq[k % per]))
        if best[1] is None:
            break
        x, y = best[1]
        e2r[x], e2r[y] = e2r[y], e2r[x]
        out.append(e2r.copy())
    return out


def _candidates(w: np.ndarray, cur: np.ndarray, N: int, G: int, D: int,
                max_swaps: Optional[int] = None) -> list:
    """[(expert_to_rank int64 [E], placement_rows)] of the re-placements `improve_placement`
    weighs (those that differ from ``cur``)."""
    cands = _swap_sequence(w, cur, N, G, D, w.shape[0] if max_swaps is None else max_swaps)
    cands.append(place_experts(w, N, G, cur))
    return [(c, placement_rows(w, c, N, G, D)) for c in cands if not np.array_equal(c, cur)]


def improve_placement(w: np.ndarray, expert_to_rank: np.ndarray, num_nodes: int, ranks_per_node: int,
                      dynamic_experts: int, us_per_token: float, horizon: float, state_bytes: float,
                      net_gbps: float, intra_gbps: float = math.inf,
                      max_swaps: Optional[int] = None) -> tuple[np.ndarray, float, float]:
    """The re-placement with the largest net gain over ``horizon`` micro-batches.

    w float [E]: expected per-expert loads (rows per micro-batch); expert_to_rank int64 [E]: the
    current placement. Candidates: every prefix of the greedy swap sequence (:func:`_swap_sequence`:
    node-balancing swaps across nodes, then swaps inside a node that spread its hot experts so that
    the D dynamic experts of every rank can take its excess) and the full re-packing
    :func:`place_experts`. A candidate's gain is ``(placement_rows(current) - placement_rows(it))
    * us_per_token * horizon`` (µs over the horizon), its cost :func:`transfer_us`. Returns
    ``(expert_to_rank int64 [E], gain_us, cost_us)`` of the best candidate with ``gain > cost``,
    or the current placement with ``(0, 0)`` when none pays."""
    w = np.asarray(w, dtype=np.float64)
    cur = np.asarray(expert_to_rank, dtype=np.int64)
    G, N = ranks_per_node, num_nodes
    R = G * N
    D = dynamic_experts
    base = placement_rows(w, cur, N, G, D)
    old = holdings(cur, R)
    best = (cur, 0.0, 0.0)
    best_net = 0.0
    for c, rows in _candidates(w, cur, N, G, D, max_swaps):
        gain = (base - rows) * us_per_token * horizon
        if gain <= best_net:
            continue
        cost = transfer_us(old, holdings(c, R), G, state_bytes, net_gbps, intra_gbps)
        if gain - cost > best_net:
            best, best_net = (c, float(gain), float(cost)), gain - cost
    return best


RECENT_SAMPLES = 16  # micro-batches the replica choice is judged on
# micro-batches seen before replicas alone are first chosen (`CrossNodePlacer.replicas_due_mid_step`): the
# fewest on which `replicas.choose` judges a choice on micro-batches it was not made from
FIRST_REPLICAS_AFTER = 2


@dataclass
class CrossNodePlacer:
    """Periodic, cost-accounted cross-node re-placement for one MoE layer.

    experts, num_nodes, ranks_per_node: the EP group.
    interval:        observations (micro-batches) between re-placement decisions.
    decay:           weight of the newest observation in the exponential moving average of loads.
    expert_state_bytes: bytes that move with an expert that changes rank (weights and the
                     optimizer state that lives with them).
    net_gbps:        cross-node bandwidth per GPU (GB/s).
    us_per_token:    expert time per token-expert pair (forward + backward), for the gain.
    dynamic_experts: D of the intra-node planner: the gain is judged by `placement_rows` (the
                     bound of intra-node balancing with D dynamic experts per rank); 0: by the
                     node loads alone (each node's mean rank load).
    horizon:         micro-batches over which a re-placement's gain is counted against its cost;
                     None: measured, ``interval / (1 - retention)`` (``interval`` until a retention
                     is known; at most ``max_retention`` in it), see below.
    intra_gbps:      intra-node bandwidth per GPU (GB/s) for experts that change rank inside a
                     node (inf: free).
    warmup:          observations before the first decision (None: ``interval``); replicas alone
                     come sooner (`replicas_due_mid_step`).
    redundant:       replica slots per rank (`plan.replicas`): each decision, and every optimizer
                     step between them (`review_replicas`), chooses which hot experts get a
                     replica on another node (`replicas.choose`, on the last `RECENT_SAMPLES`
                     micro-batches), where the gain pays for their gradient exchange at every
                     optimizer step (``micro_batches_per_step`` micro-batches: its gradient sum,
                     ``grad_bytes`` (None: ``weight_bytes``), goes home and the weights come
                     back, a new replica's first ones among them).
    max_rows_over_mean: the bound on rows before time (``feplb.max_rows_over_mean``; 0: none):
                     the replicas chosen are those that bring the predicted busiest rank closest
                     to it, the fastest among equals (`replicas.choose`).
    replica_fixed_us: what holding any replica costs per micro-batch beyond its modelled exchange
                     (the host's work on them; measured by a runtime, 0 in the simulator), added
                     to the price of every replica set that `replicas.choose` weighs.
    move_experts:    whether a decision may give an expert another home (False: every expert
                     keeps its home slot and decisions choose replicas only, so no slot's contents
                     ever change: ``feplb.placement.enabled`` false with replica slots).

    A decision (`refresh`) takes the candidate of `improve_placement` with the largest
    ``gain - cost`` (none when nothing pays); ``last_cost_us`` is the transfer time of the last
    decision (0 when nothing moved), ``migration_us`` their sum.

    Retention: how much of a gain predicted from the moving average the following micro-batches
    actually show (their loads are noisy and drift). Every decision also keeps its largest-gain
    candidate (adopted or not) and the gain predicted for it; each later observation evaluates
    that pair on its own loads (`placement_rows` of both), and the next decision averages those
    (``realised / predicted``, clipped to [0, 1]) into ``retention`` (equal weights with the
    previous value). A gain that keeps a fraction ``rho``
    per interval is worth ``interval * (1 + rho + rho^2 + ...) = interval / (1 - rho)``
    micro-batches: persistent skew (a fixed router bias) earns long horizons, fast drift short ones.
    """

    experts: int
    num_nodes: int
    ranks_per_node: int
    interval: int = 50
    decay: float = 0.1
    expert_state_bytes: float = 0.0
    net_gbps: float = 50.0
    us_per_token: float = 0.0
    dynamic_experts: int = 0
    horizon: Optional[int] = None
    intra_gbps: float = math.inf
    warmup: Optional[int] = None
    max_retention: float = 0.95
    redundant: int = 0
    weight_bytes: float = 0.0
    grad_bytes: Optional[float] = None
    micro_batches_per_step: int = 1
    max_rows_over_mean: float = 0.0
    move_experts: bool = True
    replica_fixed_us: float = 0.0
    expert_to_rank: np.ndarray = field(init=False)
    replica_at: np.ndarray = field(init=False)
    ema: Optional[np.ndarray] = field(init=False, default=None)
    seen: int = field(init=False, default=0)
    migrated_experts: int = field(init=False, default=0)
    migration_us: float = field(init=False, default=0.0)
    refreshes: int = field(init=False, default=0)
    decisions: int = field(init=False, default=0)
    last_cost_us: float = field(init=False, default=0.0)
    replica_changes: int = field(init=False, default=0)  # `review_replicas` that changed the replicas
    replica_drops: int = field(init=False, default=0)  # of them, those that left none
    retention: Optional[float] = field(init=False, default=None)
    _decided_at: int = field(init=False, default=0, repr=False)
    _probe: Optional[tuple] = field(init=False, default=None, repr=False)
    _recent: deque = field(init=False, repr=False)
    replica_choice: Optional[replicas.Choice] = field(init=False, default=None)  # the last decision's

    def __post_init__(self):
        R = self.num_nodes * self.ranks_per_node
        self.expert_to_rank = np.arange(self.experts, dtype=np.int64) // (self.experts // R)
        self.replica_at = np.full((R, self.redundant), -1, np.int64)
        self._recent = deque(maxlen=RECENT_SAMPLES)

    @property
    def slots(self) -> np.ndarray:
        """int64 [R, E / R + redundant]: each rank's primary experts (ascending), then its replicas
        (-1: an empty slot)."""
        return replicas.slot_experts(self.expert_to_rank, self.replica_at)

    def observe(self, loads: np.ndarray, refresh: bool = True) -> None:
        """Feed one micro-batch's per-expert loads (int [E]); re-place when `due`
        (``refresh=False``: the caller calls `refresh` when `due`, e.g. at an optimizer step)."""
        loads = np.asarray(loads, dtype=np.float64)
        self.ema = loads.copy() if self.ema is None else (1 - self.decay) * self.ema + self.decay * loads
        if self.redundant:  # replicas are judged on recent micro-batches as they were (`replicas.choose`)
            self._recent.append(loads)
        self.seen += 1
        if self._probe is not None:
            old, cand, _, acc = self._probe
            G, N, D = self.ranks_per_node, self.num_nodes, self.dynamic_experts
            acc[0] += placement_rows(loads, old, N, G, D) - placement_rows(loads, cand, N, G, D)
            acc[1] += 1
        if refresh and self.due:
            self.refresh()

    @property
    def due(self) -> bool:
        """Whether a decision is due: ``warmup`` observations before the first, ``interval`` since
        the last one (it stays due until `refresh` is called, so a caller may wait for its
        optimizer step)."""
        if self.seen == 0:
            return False
        if self.decisions == 0:
            return self.seen >= (self.interval if self.warmup is None else max(1, self.warmup))
        return self.seen - self._decided_at >= self.interval

    def refresh(self) -> bool:
        """Re-place from the moving average if the predicted gain over the next ``horizon``
        micro-batches pays for the moves (`improve_placement`). Returns whether the placement
        changed; ``last_cost_us`` is what the moves take (µs)."""
        self.last_cost_us = 0.0
        if self.ema is None:
            return False
        self.decisions += 1
        self._decided_at = self.seen
        new, cost_us = self.expert_to_rank, 0.0
        if self.move_experts:
            self._measure_retention()
            new, _, cost_us = improve_placement(
                self.ema, self.expert_to_rank, self.num_nodes, self.ranks_per_node, self.dynamic_experts,
                self.us_per_token, self.effective_horizon, self.expert_state_bytes, self.net_gbps, self.intra_gbps)
        moved = not np.array_equal(new, self.expert_to_rank)
        if moved:
            self.migrated_experts += int(np.sum(new != self.expert_to_rank))
            self.expert_to_rank = new
        # homes kept: the replicas held stay unless a new set does better, as between decisions
        replicated = self.redundant and self._choose_replicas(keep_if_as_good=not moved)
        if not (moved or replicated):
            return False
        self.migration_us += cost_us
        self.last_cost_us += cost_us
        self.refreshes += 1
        return True

    @property
    def replicas_due_mid_step(self) -> bool:
        """Whether the first decision is due now, between two micro-batches of an optimizer step,
        without waiting for ``warmup``: replicas alone (no expert moves, so nothing of the optimizer's
        changes hands, and a replica that joins mid-step sends home the gradient sum of the
        micro-batches it computed, with every replica's, at the step's end), none decided yet and
        `FIRST_REPLICAS_AFTER` micro-batches seen. The caller (a runtime where the next forward
        begins, the simulator after a micro-batch that ends no step) then calls `refresh`: the rest
        of the first step is balanced across nodes too."""
        return bool(self.redundant and not self.move_experts and self.decisions == 0
                    and self.seen >= FIRST_REPLICAS_AFTER)

    @property
    def holds_replicas(self) -> bool:
        """Whether any replica slot holds an expert."""
        return bool((self.replica_at >= 0).any())

    def review_replicas(self) -> bool:
        """At an optimizer step between decisions: choose the replicas again for the primaries held,
        on the recent micro-batches (`replicas.choose`, as a decision does). A hot set that drifts
        gets its replicas at the next step instead of the next decision, and replicas that stopped
        paying go: a new replica's first weights come with the step's exchange, which every held
        replica takes anyway, and a drop moves nothing. Returns whether the replicas changed
        (``replica_changes`` counts them, ``replica_drops`` those that left none).
        `review_choice` then `take_review` do the same in two halves (one rank weighs, every rank
        takes)."""
        return self.take_review(self.review_choice())

    @property
    def reviews_replicas(self) -> bool:
        """Whether `review_replicas` weighs a choice now (a replica slot, and micro-batches seen)."""
        return bool(self.redundant and self._recent)

    def review_choice(self) -> Optional[replicas.Choice]:
        """The choice `review_replicas` takes, weighed (no state changes); None where it weighs none
        (`reviews_replicas`)."""
        return self._weigh_replicas(keep_if_as_good=True) if self.reviews_replicas else None

    def take_review(self, choice: Optional[replicas.Choice]) -> bool:
        """Take a `review_choice` (None: nothing); returns whether the replicas changed."""
        if choice is None:
            return False
        held = self.holds_replicas
        if not self._take_replicas(choice):
            return False
        self.replica_changes += 1
        self.replica_drops += held and not self.holds_replicas
        return True

    @property
    def _replica_prices(self) -> dict:
        """What `replicas.choose` weighs replicas with."""
        return dict(dynamic_experts=self.dynamic_experts, us_per_row=self.us_per_token,
                    micro_batches_per_step=self.micro_batches_per_step, weight_bytes=self.weight_bytes,
                    net_gbps=self.net_gbps, grad_bytes=self.grad_bytes, intra_gbps=self.intra_gbps,
                    fixed_us=self.replica_fixed_us)

    def exchange_us_per_micro_batch(self) -> float:
        """The modelled exchange of the replicas held, per micro-batch of the step (µs): all of it,
        as a host that waits for each relay (gloo) spends it, the early half included."""
        return replicas.exchange_per_micro_batch(self.slots, self.experts // len(self.replica_at),
                                                 self.ranks_per_node, self.micro_batches_per_step,
                                                 self.weight_bytes, self.grad_bytes, self.net_gbps, self.intra_gbps)

    def _choose_replicas(self, keep_if_as_good: bool = False) -> bool:
        """The replicas for the (new) primaries (`replicas.choose`; their first weights come with the
        step's exchange, which the caller prices); ``keep_if_as_good``: those held stay unless a
        new set does better. Returns whether they changed."""
        return self._take_replicas(self._weigh_replicas(keep_if_as_good))

    def _weigh_replicas(self, keep_if_as_good: bool) -> replicas.Choice:
        return replicas.choose(np.array(self._recent), self.expert_to_rank, self.ranks_per_node, self.redundant,
                               max_rows_over_mean=self.max_rows_over_mean,
                               held=self.replica_at if keep_if_as_good else None, **self._replica_prices)

    def _take_replicas(self, choice: replicas.Choice) -> bool:
        self.replica_choice = choice
        if np.array_equal(choice.replica_at, self.replica_at):
            return False
        self.replica_at = choice.replica_at
        return True

    @property
    def effective_horizon(self) -> float:
        """Micro-batches the next decision counts a gain over (``horizon`` or the measured one)."""
        if self.horizon is not None:
            return float(self.horizon)
        rho = min(self.retention or 0.0, self.max_retention)
        return self.interval / (1.0 - rho)

    def _measure_retention(self) -> None:
        """Turn the gain the previous decision's largest-gain candidate showed on the micro-batches
        observed since into ``retention``, and keep this decision's candidate for the next one."""
        G, N, D = self.ranks_per_node, self.num_nodes, self.dynamic_experts
        if self._probe is not None and self._probe[3][1] > 0:
            _, _, predicted, (realised, n) = self._probe
            r = float(np.clip(realised / n / predicted, 0.0, 1.0))
            self.retention = r if self.retention is None else 0.5 * (self.retention + r)
        self._probe = None
        base = placement_rows(self.ema, self.expert_to_rank, N, G, D)
        cands = _candidates(self.ema, self.expert_to_rank, N, G, D)
        if cands:
            c, rows = min(cands, key=lambda cr: cr[1])
            if base - rows > 1e-9:
                self._probe = (self.expert_to_rank.copy(), c, base - rows, [0.0, 0])
