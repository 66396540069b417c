"""Redundant expert replicas across nodes (``feplb.placement.redundant_experts_per_rank``).

The cross-node placement (`plan.placement`) puts every expert on one rank and moves experts only
at optimizer steps, so all of a hot expert's rows land on one node whatever a micro-batch brings.
A replica of that expert on another node lets each micro-batch split its rows between the nodes:
`split` sends each (source rank, expert) pair of the micro-batch to the holder whose node is
lightest so far, dividing the pair with the next lightest holder node where the whole would
overshoot it; every rank computes it alike from the ranks' all-gathered route counts
(`integration.placement.ExpertPlacement.route`), and `route` gives the rows per slot it makes.
FEPLB then balances inside each node as before. A replica holds the expert's weights only: its gradient is
summed into the expert's before the optimizer step, and the stepped weights come back to it. It
costs a slot on its rank and that exchange with the expert's home at every optimizer step
(`exchange_us`: the gradient sums in two halves, the first hidden behind the step's last
micro-batch; the stepped weights, a new replica's first ones among them, behind the next
forward up to the layer), each transfer
relayed over all the links of the two nodes (`relay_us`); `choose` adds one only where the
predicted gain over the following micro-batches pays for it.

Slots: rank q holds ``slots[q]`` (int64 [R, S]): its primary experts (the placement's, ascending
ids), then its ``redundant`` replica slots (-1: empty). All functions are pure numpy and
deterministic; `split` is one call compiled by numba on first use.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

__all__ = ["Choice", "most_replica_slots", "slot_experts", "Split", "split", "load_split", "route", "expected_counts",
           "predicted_rows", "predicted_rows_many", "RELAY_CHUNK_BYTES", "relay_us", "replica_pairs", "early_sums",
           "held_back_locals", "held_back_sums", "last_half_bytes", "exchange_us", "exchange_per_micro_batch", "choose"]


def most_replica_slots(experts: int, ranks: int, ranks_per_node: int) -> int:
    """The most replica slots per rank that replicas can fill, for ``experts`` over ``ranks`` in
    nodes of ``ranks_per_node``: ``E * (N - 1) / R`` (a whole number: ``E / R`` primaries per rank,
    whatever the placement). `choose` puts a replica only on a node that does not hold the expert
    yet (`_sequence`), so a node holds one copy of an expert at most: the replica slots of a
    node's ``G`` ranks hold distinct experts among the ``E * (N - 1) / N`` whose primaries are on
    the other nodes. A slot beyond it stays empty for good, while it costs an expert's weights and
    a column of the layer's dispatch."""
    nodes = ranks // ranks_per_node
    return experts * (nodes - 1) // ranks if nodes > 1 else 0


def slot_experts(expert_to_rank: np.ndarray, replica_at: np.ndarray) -> np.ndarray:
    """expert_to_rank int64 [E] (primaries, E / R per rank), replica_at int64 [R, redundant] (-1:
    empty) -> slots int64 [R, E / R + redundant]."""
    e2r = np.asarray(expert_to_rank, np.int64)
    replica_at = np.asarray(replica_at, np.int64)
    R = replica_at.shape[0]
    order = np.lexsort((np.arange(e2r.shape[0]), e2r))
    return np.concatenate([order.reshape(R, -1), replica_at], axis=1).astype(np.int64)


def _copies(slots: np.ndarray, experts: int) -> tuple[np.ndarray, np.ndarray]:
    """(held bool [R, S]: the slot holds an expert, copies int64 [E]: each expert's holders)."""
    held = slots >= 0
    return held, np.bincount(slots[held], minlength=experts)


def _split_kernel(src, slots, copies, ranks_per_node, primaries):
    """`split`, compiled whole (`_compiled_split`): src int64/float [R_src, E], slots int64 [R, S],
    copies int64 [E] (each expert's holders, `_copies`).
    Returns (source, expert, rank int64 [K], rows float64 [K]).

    Each replicated expert's holders: its primary first, then its replicas by rank. The pairs of
    replicated experts with rows are listed by expert, then source, and sorted stably by rows
    (largest first). A pair goes to the holder whose node has the fewest rows so far (ties: the
    source's own node, then the lower node, then the earlier holder); when that would lift its node
    above the next lightest node that holds the expert, it is split between the two so that both
    reach the same level (the other one takes the odd row)."""
    Rs, E = src.shape
    R, S = slots.shape
    G = ranks_per_node
    N = R // G
    holders = np.full((E, max(copies.max(), 1)), -1, np.int64)
    count = np.zeros(E, np.int64)
    for first, last in ((0, primaries), (primaries, S)):  # the primaries, then the replicas by rank
        for q in range(R):
            for j in range(first, last):
                e = slots[q, j]
                if e >= 0 and copies[e] > 1:
                    holders[e, count[e]] = q
                    count[e] += 1
    node_rows = np.zeros(N)
    loads = np.zeros(E)
    start = np.zeros(E + 1, np.int64)  # the pairs of expert e: start[e] to start[e + 1], by source
    for r in range(Rs):
        for e in range(E):
            loads[e] += src[r, e]
            start[e + 1] += copies[e] > 1 and src[r, e] > 0
    start = np.cumsum(start)
    pairs = start[E]
    pair_rows = np.empty(pairs)
    pair_expert = np.empty(pairs, np.int64)
    pair_source = np.empty(pairs, np.int64)
    for r in range(Rs):
        for e in range(E):
            if copies[e] > 1 and src[r, e] > 0:
                i = start[e]
                pair_rows[i], pair_expert[i], pair_source[i] = src[r, e], e, r
                start[e] += 1
    for q in range(R):  # the rows of the experts held once
        for j in range(S):
            e = slots[q, j]
            if e >= 0 and copies[e] == 1:
                node_rows[q // G] += loads[e]
    order = np.argsort(-pair_rows, kind="mergesort")  # stable: ties stay by expert, then source
    out_rank = np.full((pairs, 2), -1, np.int64)
    out_rows = np.zeros((pairs, 2))
    for k in range(pairs):
        i = order[k]
        e, s = pair_expert[i], pair_source[i]
        home = s * N // Rs  # the source's node (a trace replayed on R ranks: its share of them)
        a, b = -1, -1  # the best holder and the best on another node
        for h in range(count[e]):
            q = holders[e, h]
            n = q // G
            if a < 0:
                a = q
                continue
            an = a // G
            if node_rows[n] < node_rows[an] or (node_rows[n] == node_rows[an] and (
                    (n == home) > (an == home) or ((n == home) == (an == home) and n < an))):
                if n != an:
                    b = a
                a = q
            elif n != an:
                bn = b // G
                if b < 0 or node_rows[n] < node_rows[bn] or (node_rows[n] == node_rows[bn] and (
                        (n == home) > (bn == home) or ((n == home) == (bn == home) and n < bn))):
                    b = q
        rows = pair_rows[i]
        an = a // G
        out_rank[k, 0] = a
        out_rows[k, 0] = rows
        if b >= 0:
            bn = b // G
            x = np.floor((rows + node_rows[bn] - node_rows[an]) / 2.0)
            if 0 < x < rows:
                out_rows[k, 0] = x
                out_rank[k, 1] = b
                out_rows[k, 1] = rows - x
                node_rows[bn] += rows - x
        node_rows[an] += out_rows[k, 0]
    parts = 0
    for k in range(pairs):
        parts += 1 + (out_rank[k, 1] >= 0)
    source, expert, rank, rows_out = (np.empty(parts, np.int64), np.empty(parts, np.int64),
                                      np.empty(parts, np.int64), np.empty(parts))
    p = 0
    for k in range(pairs):
        for c in range(2):
            if out_rank[k, c] >= 0:
                i = order[k]
                source[p], expert[p], rank[p], rows_out[p] = pair_source[i], pair_expert[i], out_rank[k, c], \
                    out_rows[k, c]
                p += 1
    return source, expert, rank, rows_out


@functools.cache
def _compiled_split():
    """`_split_kernel` compiled by numba (``cache=True``), loaded on first use (`load_split`):
    importing this module (the runtime imports it) loads no compiler."""
    from numba import njit
    return njit(cache=True)(_split_kernel)


def load_split() -> None:
    """Load (or compile) `split` for int64 routes (what the runtime and the simulator pass; float
    routes compile on their first use), `predicted_rows_many` and `relay_us` now: a runtime does it when a
    layer with replica slots attaches, so that no rank compiles inside a collective forward or at
    an optimizer step."""
    slots = np.array([[0, -1], [1, 0]], np.int64)
    split(np.ones((2, 2), np.int64), slots, 1, 1)
    predicted_rows_many(np.ones((1, 2)), slots, 1, 1)
    relay_us(np.array([[0, 1]]), 2, 1, 1.0, 1.0)


@dataclass(frozen=True)
class Split:
    """Where one micro-batch's rows of replicated experts go: part k is ``rows[k]`` of the rows that
    source rank ``source[k]`` sends to expert ``expert[k]``, computed on rank ``rank[k]``; a pair's
    first part comes first (a source sends its first rows of the expert there, the rest to the
    second part's rank). int64 [K] each, rows float64 [K]."""
    source: np.ndarray
    expert: np.ndarray
    rank: np.ndarray
    rows: np.ndarray


def split(src: np.ndarray, slots: np.ndarray, ranks_per_node: int, primaries: int) -> Split:
    """One micro-batch's split of the replicated experts' rows between their holders: src
    int64/float [R_src, E] (rows each source rank sends to each expert), slots int64 [R, S] whose
    first ``primaries`` columns are the primary experts. Experts held once are not in it (all
    their rows go to their one slot).

    The (source, expert) pairs of replicated experts with rows, largest first (ties: lower expert,
    then lower source), are placed greedily on the nodes, each on its lightest holder node so far,
    split with the next lightest where the whole pair would overshoot it (`_split_kernel`), over
    the rows the experts held once put on each node. Deterministic: every rank computes the same
    split from the same all-gathered routes. One compiled call (EP 256, 512 experts: about 0.3 ms,
    benchmarks/bench_replicas.py ``scale``)."""
    src = np.ascontiguousarray(src, np.float64 if np.asarray(src).dtype.kind == "f" else np.int64)
    slots = np.ascontiguousarray(slots, np.int64)
    # the compiled call checks no index: wrong shapes must stop here
    if src.ndim != 2 or slots.ndim != 2 or slots.max(initial=-1) >= src.shape[1] or \
            slots.shape[0] % ranks_per_node or not 0 <= primaries <= slots.shape[1]:
        raise ValueError(f"split: src [R_src, E] {src.shape} and slots [R, S] {slots.shape} (experts < E, R a "
                         f"multiple of {ranks_per_node} ranks per node, {primaries} primaries per rank) do not fit")
    copies = _copies(slots, src.shape[1])[1]
    return Split(*_compiled_split()(src, slots, copies, int(ranks_per_node), int(primaries)))


def route(src: np.ndarray, slots: np.ndarray, ranks_per_node: int, primaries: int) -> np.ndarray:
    """One micro-batch's rows per slot [R, S] (``src``'s dtype): an expert held once gets all its
    rows at its slot; replicated experts' rows as `split` divides them."""
    src = np.asarray(src)
    slots = np.asarray(slots, np.int64)
    R, S = slots.shape
    E = src.shape[1]
    held, copies = _copies(slots, E)
    counts = np.zeros((R, S), dtype=src.dtype)
    single = held & (copies[np.maximum(slots, 0)] == 1)
    counts[single] = src.sum(axis=0)[slots[single]]
    if (copies > 1).any():
        parts = split(src, slots, ranks_per_node, primaries)
        column = np.full((R, E), -1, np.int64)
        q, j = np.nonzero(held)
        column[q, slots[q, j]] = j
        np.add.at(counts, (parts.rank, column[parts.rank, parts.expert]), parts.rows.astype(src.dtype))
    return counts


def expected_counts(w: np.ndarray, slots: np.ndarray, ranks_per_node: int) -> np.ndarray:
    """Rows per slot float [R, S] for expected loads ``w`` float [E]: experts held once at their slot;
    each replicated expert (heaviest first, ties: lower id) split continuously over its holders'
    nodes, filling the lightest first, a node's holders sharing its part evenly (the limit of
    `route` with many small sources; fast enough to weigh candidates)."""
    return _expected_many(np.asarray(w, np.float64)[None], slots, ranks_per_node)[0]


def predicted_rows(w: np.ndarray, slots: np.ndarray, ranks_per_node: int, dynamic_experts: int) -> float:
    """The predicted busiest rank's rows of one micro-batch with expected loads ``w`` float [E]:
    `expected_counts`, then the lower bound of intra-node balancing over the nodes,
    ``max_n max(mean rank rows of node n, max_{r in n} (rows_r - its D largest slots))`` (as
    `plan.placement.placement_rows` without replicas, and like it with each rank's D hottest)."""
    return float(predicted_rows_many(np.asarray(w, np.float64)[None], slots, ranks_per_node, dynamic_experts)[0])


def predicted_rows_many(loads: np.ndarray, slots: np.ndarray, ranks_per_node: int, dynamic_experts: int) -> np.ndarray:
    """`predicted_rows` of each micro-batch of ``loads`` float [K, E] under slot table ``slots`` int64
    [R, S] (float64 [K]), or under each of a batch of them [C, R, S] (float64 [C, K]), in two
    compiled calls (what `choose` weighs its candidates with)."""
    counts = _expected_many(loads, slots, ranks_per_node)  # [(C,) K, R, S]
    batch = counts if counts.ndim == 4 else counts[None]
    rows = _compiled_bound()(batch, int(ranks_per_node), int(dynamic_experts))
    return rows if counts.ndim == 4 else rows[0]


def _bound_kernel(counts, G, D):
    """`predicted_rows_many`'s bound of expected counts float64 [C, K, R, S] (nodes of ``G`` ranks,
    ``D`` dynamic experts per rank), compiled (`_compiled_bound`): float64 [C, K]."""
    C, K, R, S = counts.shape
    out = np.empty((C, K))
    taken = np.zeros(S, np.bool_)
    per_rank = np.zeros(R)
    for c in range(C):
        for k in range(K):
            per_rank[:] = 0.0
            for q in range(R):
                for j in range(S):
                    per_rank[q] += counts[c, k, q, j]
            bound = -np.inf
            for n in range(R // G):
                bound = max(bound, per_rank[n * G:(n + 1) * G].sum() / G)
            if D > 0:
                for q in range(R):  # less its D largest slots, added largest first
                    taken[:] = False
                    top = 0.0
                    for _ in range(min(D, S)):
                        best = -1
                        for j in range(S):
                            if not taken[j] and (best < 0 or counts[c, k, q, j] > counts[c, k, q, best]):
                                best = j
                        taken[best] = True
                        top += counts[c, k, q, best]
                    bound = max(bound, per_rank[q] - top)
            out[c, k] = bound
    return out


@functools.cache
def _compiled_bound():
    """`_bound_kernel` compiled by numba (``cache=True``), loaded on first use (`load_split`)."""
    from numba import njit
    return njit(cache=True)(_bound_kernel)


def _expected_many(loads: np.ndarray, slots: np.ndarray, ranks_per_node: int) -> np.ndarray:
    """`expected_counts` of each micro-batch of ``loads`` float [K, E] under ``slots`` int64 [R, S]:
    float64 [K, R, S]; under each of a batch of slot tables [C, R, S]: float64 [C, K, R, S]."""
    loads = np.ascontiguousarray(np.atleast_2d(loads), np.float64)
    slots = np.ascontiguousarray(slots, np.int64)
    batch = slots if slots.ndim == 3 else slots[None]
    # the compiled call checks no index: wrong shapes must stop here
    if loads.ndim != 2 or batch.ndim != 3 or batch.max(initial=-1) >= loads.shape[1] or ranks_per_node < 1 or \
            batch.shape[1] % ranks_per_node:
        raise ValueError(f"expected loads [K, E] {loads.shape} and slots [(C,) R, S] {slots.shape} (experts < E, R a "
                         f"multiple of {ranks_per_node} ranks per node) do not fit")
    copies = np.stack([_copies(table, loads.shape[1])[1] for table in batch])
    counts = _compiled_expected()(loads, batch, copies, int(ranks_per_node))
    return counts if slots.ndim == 3 else counts[0]


def _expected_kernel(loads, tables, copies_of, G):
    """`_expected_many`, compiled whole (`_compiled_expected`): loads float64 [K, E], slot tables int64
    [C, R, S], copies int64 [C, E] (each expert's holders, `_copies`) -> float64 [C, K, R, S]. Per
    table and micro-batch: the experts held once at their slot, then each replicated expert,
    heaviest first, raises the lightest of its holders' nodes to a common level (water filling),
    and a node's part is shared evenly by its holders."""
    K, E = loads.shape
    C, R, S = tables.shape
    N = R // G
    out = np.zeros((C, K, R, S))
    add = np.zeros(N)
    nodes, ordered, filled = np.empty(N, np.int64), np.empty(N), np.empty(N)
    for c in range(C):
        slots, copies, counts = tables[c], copies_of[c], out[c]
        replicated = np.flatnonzero(copies > 1)
        holders = np.zeros((E, N), np.int64)  # a replicated expert's holders per node
        # each replicated expert's slots (rank, column), in slot order
        first = np.zeros(E + 1, np.int64)
        for q in range(R):
            for j in range(S):
                e = slots[q, j]
                if e >= 0 and copies[e] > 1:
                    holders[e, q // G] += 1
                    first[e + 1] += 1
        for e in range(E):
            first[e + 1] += first[e]
        at_q, at_j, fill = np.empty(first[E], np.int64), np.empty(first[E], np.int64), first[:E].copy()
        for q in range(R):
            for j in range(S):
                e = slots[q, j]
                if e >= 0 and copies[e] > 1:
                    at_q[fill[e]], at_j[fill[e]] = q, j
                    fill[e] += 1
        for k in range(K):
            w = loads[k]
            node_rows = np.zeros(N)
            for q in range(R):
                for j in range(S):
                    e = slots[q, j]
                    if e >= 0 and copies[e] == 1:
                        counts[k, q, j] = w[e]
                        node_rows[q // G] += w[e]
            for e in replicated[np.argsort(-w[replicated], kind="mergesort")]:
                m_all = 0  # its nodes, ascending, and their rows so far
                for n in range(N):
                    if holders[e, n] > 0:
                        nodes[m_all] = n
                        ordered[m_all] = node_rows[n]
                        m_all += 1
                ordered[:m_all].sort()
                total = 0.0
                for m in range(m_all):
                    total += ordered[m]
                    filled[m] = total
                level = ordered[0] + w[e]
                for m in range(m_all, 0, -1):  # the highest level that the amount reaches
                    if (w[e] + filled[m - 1]) / m >= ordered[m - 1]:
                        level = (w[e] + filled[m - 1]) / m
                        break
                for m in range(m_all):
                    n = nodes[m]
                    add[n] = max(level - node_rows[n], 0.0)
                    node_rows[n] += add[n]
                for p in range(first[e], first[e + 1]):
                    q = at_q[p]
                    counts[k, q, at_j[p]] += add[q // G] / holders[e, q // G]
    return out


@functools.cache
def _compiled_expected():
    """`_expected_kernel` compiled by numba (``cache=True``), loaded on first use (`load_split`)."""
    from numba import njit
    return njit(cache=True)(_expected_kernel)


RELAY_CHUNK_BYTES = 4 << 20  # `integration.replicas.relay` moves a shard in pieces of this size, hops pipelined
FORWARD_SHARE = 1 / 3  # of an expert's compute per row, its forward's (the backward's two GEMMs per one)


def relay_us(transfers: np.ndarray, ranks: int, ranks_per_node: int, nbytes: float, net_gbps: float,
             intra_gbps: float = math.inf, chunk_bytes: float = RELAY_CHUNK_BYTES) -> float:
    """Time (µs) to move ``nbytes`` along each of ``transfers`` int64 [T, 2] (source rank,
    destination rank, on different nodes) the way the runtime relays them
    (`integration.replicas.relay`): each is cut into ``ranks_per_node`` shards; shard k goes from
    the source to the k-th rank of its node (hop 0, ``intra_gbps``), over the inter-node link to
    the k-th rank of the destination's node (hop 1, ``net_gbps``), and on to the destination (hop
    2, ``intra_gbps``), so a transfer uses every link of the two nodes. A hop takes as long as its
    busiest rank (sending and receiving at once; all transfers share it). The shards move in C
    pieces of ``chunk_bytes``, piece c crossing hop h in round c + h: the C + 2 rounds each take
    their slowest hop's share (1 / C of it)."""
    transfers = np.ascontiguousarray(np.asarray(transfers, np.int64).reshape(-1, 2))
    if not len(transfers) or not math.isfinite(net_gbps):
        return 0.0
    G = ranks_per_node
    if np.any(transfers[:, 0] // G == transfers[:, 1] // G):
        raise ValueError("relay_us prices transfers between nodes; some source and destination share a node")
    if transfers.min() < 0 or transfers.max() >= ranks:  # the compiled call checks no index
        raise ValueError(f"relay_us: transfers name ranks outside 0..{ranks - 1}")
    shard = nbytes / G
    return float(_compiled_relay()(transfers, int(ranks), int(G), shard, intra_gbps * 1e3, net_gbps * 1e3,
                                   max(1, math.ceil(shard / chunk_bytes))))


def _relay_kernel(transfers, ranks, G, shard, intra_rate, net_rate, C):
    """`relay_us` compiled (`_compiled_relay`): transfers int64 [T, 2] between nodes of ``G`` ranks,
    shards of ``shard`` bytes in ``C`` pieces, rates in bytes per µs. Hop 0 takes a shard to the
    carrying rank of the source's node, hop 1 between the nodes, hop 2 on to the destination."""
    hops = np.zeros((3, 2, ranks))
    for t in range(transfers.shape[0]):
        s, d = transfers[t, 0], transfers[t, 1]
        for k in range(G):  # shard k is carried by the k-th rank of each node
            carry_s, carry_d = s // G * G + k, d // G * G + k
            for h, a, b in ((0, s, carry_s), (1, carry_s, carry_d), (2, carry_d, d)):
                if a != b:
                    hops[h, 0, a] += 1.0
                    hops[h, 1, b] += 1.0
    hop_us = np.zeros(3)  # the busiest rank's shards (sent or received) over the hop's rate
    for h in range(3):
        hop_us[h] = hops[h].max() * shard / (net_rate if h == 1 else intra_rate)
    total = 0.0
    for r in range(C + 2):  # piece c crosses hop h in round c + h: a round takes its slowest hop's piece
        slowest = 0.0
        for h in range(3):
            if 0 <= r - h < C:
                slowest = max(slowest, hop_us[h])
        total += slowest
    return total / C


@functools.cache
def _compiled_relay():
    """`_relay_kernel` compiled by numba (``cache=True``), loaded on first use (`load_split`)."""
    from numba import njit
    return njit(cache=True)(_relay_kernel)


def replica_pairs(slots: np.ndarray, primaries: int) -> np.ndarray:
    """int64 [T, 2]: (home rank, holder rank) of every held replica slot of ``slots`` [R, S], in
    holder-rank then slot order (the runtime's order)."""
    slots = np.asarray(slots, np.int64)
    q, j = np.nonzero(slots[:, primaries:] >= 0)
    e = slots[q, primaries + j]
    home = np.zeros(int(slots.max(initial=-1)) + 1, np.int64)
    home[slots[:, :primaries].ravel()] = np.repeat(np.arange(slots.shape[0]), primaries)
    return np.stack([home[e], q], axis=1)


def early_sums(homes, redundant: int) -> np.ndarray:
    """Which held replicas send their gradient sum home a micro-batch early, where a step's sums go
    in two halves (`integration.replicas.ReplicaSlots`): ``homes`` int [T], each held replica's
    expert's home rank, in holder-rank then slot order -> bool [T], for each home its first
    ``redundant`` (its replica slots: the early sums it holds through the step's last
    micro-batch stay within what `memory.replica_bytes` counts)."""
    homes = np.asarray(homes, np.int64).reshape(-1)
    early = np.zeros(len(homes), np.bool_)
    for home in np.unique(homes):
        early[np.flatnonzero(homes == home)[:redundant]] = True
    return early


def held_back_locals(homes, locals_, ranks: int, redundant: int) -> np.ndarray:
    """The local expert indices whose gradients of a step's last micro-batch every rank of the EP
    group holds back to the backward's end, so that the replicas' sums for the experts there
    travel while the layers below compute (`integration.replicas.ReplicaSlots.held_back_locals`):
    ``homes``, ``locals_`` int [T], each held replica's expert's home rank and local index there,
    of ``ranks`` ranks with ``redundant`` replica slots each -> int64 ascending. Of the local
    indices of replicated experts, those with the most replicas first (ties: the lower), as many as
    a rank has replica slots, each where no home would then wait at the end for more replicas'
    sums than that. Every rank holds back the same indices, an expert's home or not, so DeepSpeed's
    gradient hooks fire in the same order on all of them (ZeRO 2 fills its reduce bucket in hook
    order and flushes it by size); what a rank holds then (that many experts' gradients, a home
    that many replicas' sums) stays within what `memory.replica_bytes` counts."""
    homes, locals_ = np.asarray(homes, np.int64).reshape(-1), np.asarray(locals_, np.int64).reshape(-1)
    if not len(homes) or redundant <= 0:
        return np.zeros(0, np.int64)
    counts = np.bincount(locals_)
    taken, per_home = [], np.zeros(ranks, np.int64)
    for u in sorted(np.flatnonzero(counts), key=lambda u: (-counts[u], u)):
        waiting = per_home + np.bincount(homes[locals_ == u], minlength=ranks)
        if len(taken) < redundant and waiting.max() <= redundant:
            taken.append(u)
            per_home = waiting
    return np.array(sorted(taken), np.int64)


def held_back_sums(slots: np.ndarray, primaries: int) -> np.ndarray:
    """bool [T]: whether each held replica of ``slots`` int64 [R, S] (`replica_pairs` order) sends its
    sum to a home that takes it when the backward ends (`held_back_locals`; the first ``primaries``
    columns hold each rank's experts, in its local order)."""
    slots = np.asarray(slots, np.int64)
    q, j = np.nonzero(slots[:, primaries:] >= 0)
    local = np.zeros(int(slots.max(initial=-1)) + 1, np.int64)
    local[slots[:, :primaries].ravel()] = np.tile(np.arange(primaries), slots.shape[0])
    locals_ = local[slots[q, primaries + j]]
    homes = replica_pairs(slots, primaries)[:, 0]
    return np.isin(locals_, held_back_locals(homes, locals_, slots.shape[0], slots.shape[1] - primaries))


def last_half_bytes(weight_bytes: float, grad_bytes: float, micro_batches_per_step: int) -> float | None:
    """The bytes of the step's last replica gradient where the sums go home in two halves (more
    than one micro-batch per step, weights narrower than the fp32 sums: the last micro-batch's
    gradient travels in the weights' dtype), else None (the sum goes whole)."""
    return weight_bytes if micro_batches_per_step > 1 and weight_bytes < grad_bytes else None


def exchange_us(slots: np.ndarray, primaries: int, ranks_per_node: int, weight_bytes: float, grad_bytes: float,
                net_gbps: float, intra_gbps: float = math.inf, weight_slots: np.ndarray | None = None,
                last_bytes: float | None = None, hidden_us: float = 0.0, weights_hidden_us: float = 0.0,
                held_back: bool = True) -> float:
    """One optimizer step's replica exchange that the step waits for (µs), as the runtime makes it
    (`integration.replicas.ReplicaSlots`), each transfer relayed over every link of the two nodes
    (`relay_us`):

    * every replica's gradient sum (``grad_bytes``: fp32) goes to the expert's home (its primary
      slot, the first ``primaries`` columns of ``slots``): with ``last_bytes`` (a step of several
      micro-batches, gradients narrower than fp32), for each home its first replicas in holder
      order, as many as it has replica slots, send the sum of all but the last micro-batch in the
      one-but-last backward, which the last micro-batch hides up to ``hidden_us``, then the last
      one's gradient alone (``last_bytes``: in the gradients' dtype) in its backward; the others
      (and all without ``last_bytes``) send the sum in it. With ``held_back`` (a DeepSpeed MoE
      layer's runtime), the homes of `held_back_sums` take theirs only when that backward ends, so
      they travel while the layers below compute: within the same ``hidden_us`` as the early
      halves (without ``last_bytes``, within its backward, 1 - `FORWARD_SHARE` of it), after the
      rest, for which the other homes wait in the layer's backward;
    * when the next forward begins the home sends the stepped weights (``weight_bytes``) to the
      replicas of ``weight_slots`` (the table a decision at the step left; default ``slots``),
      which the forward hides up to ``weights_hidden_us``: the layers before each one compute
      meanwhile, every layer's weights travelling at once; per layer of a deep model, about one
      layer's forward, of which the caller passes the expert stage's alone (the first MoE layer
      of a model hides only behind what precedes it).

    The two hidden shares are each layer's in the steady state of a deep model: the simulator and
    `choose` see one layer."""
    R = np.asarray(slots).shape[0]
    pairs = replica_pairs(slots, primaries)
    weight_pairs = pairs if weight_slots is None else replica_pairs(weight_slots, primaries)
    back = pairs[:, ::-1]
    late = held_back_sums(slots, primaries) if held_back else np.zeros(len(pairs), np.bool_)

    def relayed(which: np.ndarray, nbytes: float) -> float:
        return relay_us(back[which], R, ranks_per_node, nbytes, net_gbps, intra_gbps)

    if last_bytes is None:
        sums = max(0.0, relayed(late, grad_bytes) - (1 - FORWARD_SHARE) * hidden_us) + relayed(~late, grad_bytes)
    else:
        early = early_sums(pairs[:, 0], np.asarray(slots).shape[1] - primaries)
        sums = (max(0.0, relayed(early, grad_bytes) + relayed(early & late, last_bytes) - hidden_us)
                + relayed(early & ~late, last_bytes) + relayed(~early & ~late, grad_bytes)
                + max(0.0, relayed(~early & late, grad_bytes) - (1 - FORWARD_SHARE) * hidden_us))
    weights = relay_us(weight_pairs, R, ranks_per_node, weight_bytes, net_gbps, intra_gbps)
    return sums + max(0.0, weights - weights_hidden_us)


@dataclass(frozen=True)
class Choice:
    """What `choose` decided: ``replica_at`` int64 [R, redundant] (-1: empty), its predicted gain and
    cost (µs per micro-batch)."""
    replica_at: np.ndarray
    gain_us: float
    cost_us: float


def choose(samples: np.ndarray, expert_to_rank: np.ndarray, ranks_per_node: int, redundant: int,
           dynamic_experts: int, us_per_row: float, micro_batches_per_step: int, weight_bytes: float,
           net_gbps: float, *, grad_bytes: float | None = None, intra_gbps: float = math.inf,
           max_rows_over_mean: float = 0.0, held: np.ndarray | None = None, fixed_us: float = 0.0) -> Choice:
    """The replicas to hold over the primaries ``expert_to_rank``, judged on ``samples`` float [K, E]:
    the per-expert loads of recent micro-batches (their drift is what a per-micro-batch split
    catches, and what a moving average hides).

    The candidates are the prefixes of two sequences of replicas (`_sequence`): each replica for
    the expert with the largest mean load over the earlier half of the samples, one replica per
    expert (hot experts that change from one micro-batch to the next are best spread), or per
    holder, so that an expert hotter than a node's share gets a replica on several nodes (as EPLB
    replicates by load per replica); each on the node with the fewest expected rows so far that
    does not hold the expert, in its rank with the fewest rows, slots filling level by level
    (every rank's first replica slot before any second, so more slots extend the sequence of
    fewer). The
    prefix with the largest net gain per micro-batch on the later half of the samples is
    returned (held out: drift is what a choice judged on the very samples it was made from would
    hide): gain (`predicted_rows` saved x ``us_per_row``) less what its replicas add to
    the step's exchange (`exchange_us` / ``micro_batches_per_step``, the gradient sums' early half
    hidden up to a micro-batch's compute at the mean rows, the stepped weights up to its forward,
    `FORWARD_SHARE` of it: a new replica's first weights come with the exchange that follows the
    decision, as every step's do); none when no prefix
    pays (`plan.placement.CrossNodePlacer` chooses again at every optimizer step). A replica
    holds the expert's weights only (``weight_bytes``; its gradient sum travels as ``grad_bytes``,
    default ``weight_bytes``): the sum joins the expert's gradient before the optimizer step, and
    the stepped weights reach it with the exchange's return half, both relayed over every link of
    the two nodes (``net_gbps`` between nodes, ``intra_gbps`` inside one). The price leaves out the
    sums homes hold back to the backward's end (`held_back_sums`): that depends on the whole
    table's shape, and pricing it steers the choice to fewer replicas that balance worse (2 nodes
    of 4 at 4k, simulated: 1.096 of the ideal at max/mean 1.063, against 1.098 at 1.049 priced
    without; benchmarks/PLANNER.md).

    ``max_rows_over_mean`` (``feplb.max_rows_over_mean``; 0: none) puts rows before time, as the
    intra-node planner does: the prefix whose predicted busiest rank exceeds that multiple of the
    mean rows per rank by the fewest rows (on the later half, averaged; `ROWS_TIE` of the mean
    apart is a tie) wins, the largest net gain among those, even where it costs time.

    ``fixed_us``: what holding any replica costs per micro-batch beyond its exchange, whatever
    the set (the host's work on them: each forward's all-gather of route counts and split, the
    relays' and refreshes' fixed overhead; measured at runtime, `ExpertPlacement.end_step`).
    Where it exceeds what bringing the busiest rank down to the mean would gain, no candidate is
    weighed.

    ``held`` int64 [R, redundant]: the replicas held now, weighed before the sequences, so that a
    new set must do better than them, not as well (where replicas are chosen at every step, a tie
    would move them for nothing)."""
    samples = np.atleast_2d(np.asarray(samples, np.float64))
    e2r = np.asarray(expert_to_rank, np.int64)
    E = samples.shape[1]
    R = int(e2r.max()) + 1 if E else 0
    G = ranks_per_node
    N = R // G
    none = np.full((R, redundant), -1, np.int64)
    if redundant <= 0 or N <= 1:
        return Choice(none, 0.0, 0.0)
    half = len(samples) // 2
    fit, judge = (samples[:half], samples[half:]) if half else (samples, samples)

    caps = max_rows_over_mean * judge.sum(axis=1) / R if max_rows_over_mean > 0 else np.full(len(judge), np.inf)

    def judged_rows(tables: np.ndarray) -> list[tuple[float, float]]:
        """Per slot table of ``tables`` int64 [C, R, S]: (mean predicted busiest rows, mean rows over
        the bound) on the later half, all in one batch."""
        rows = predicted_rows_many(judge, tables, G, dynamic_experts)
        return [(float(r.mean()), float(np.maximum(r - caps, 0.0).mean())) for r in rows]

    # a micro-batch's compute at the mean rows per rank: what the early half of the gradient
    # exchange hides behind (the step's last micro-batch), and its forward what the stepped
    # weights hide behind (the next step's first)
    micro_batch_us = judge.sum(axis=1).mean() / R * us_per_row

    def cost(replicas: np.ndarray, slots: np.ndarray) -> float:
        """A replica table's price per micro-batch; ``slots``: its `slot_experts`."""
        return fixed_us * bool((replicas >= 0).any()) + exchange_per_micro_batch(
            slots, E // R, G, micro_batches_per_step, weight_bytes, grad_bytes, net_gbps, intra_gbps,
            hidden_us=micro_batch_us, weights_hidden_us=FORWARD_SHARE * micro_batch_us, held_back=False)

    expected = fit.mean(axis=0)
    (base, over), = judged_rows(slot_experts(e2r, none)[None])
    if not max_rows_over_mean > 0 and (base - judge.sum(axis=1).mean() / R) * us_per_row <= fixed_us:
        # no set brings the busiest rank below the mean, and every set with a replica costs at least
        # fixed_us: none pays, so none wins, as weighing every candidate would find (at a fraction
        # of its host time, paid at every optimizer step)
        return Choice(none, 0.0, 0.0)
    candidates = []
    if held is not None and (np.asarray(held) >= 0).any():
        candidates.append(np.asarray(held, np.int64).copy())
    for repeat in (False, True):
        sequence = _sequence(expected, e2r, G, redundant, repeat)
        stride = max(1, len(sequence) // 32)  # at most ~32 prefixes weighed
        candidates += [sequence[k] for k in sorted({*range(stride - 1, len(sequence), stride), len(sequence) - 1}
                                                   - {-1})]
    weighed = [(none, 0.0, 0.0, over)]  # (replica_at, gain, cost, rows over the bound)
    if candidates:
        tables = np.stack([slot_experts(e2r, c) for c in candidates])  # each candidate's, found once
        weighed += [(c, (base - rows) * us_per_row, cost(c, slots), excess)
                    for c, slots, (rows, excess) in zip(candidates, tables, judged_rows(tables))]
    # over the bound by at most ROWS_TIE x the mean rows more than the closest: as close (a
    # prediction is not that exact), and the fastest of those wins
    within = min(w[3] for w in weighed) + ROWS_TIE * judge.sum(axis=1).mean() / R
    best = max((w for w in weighed if w[3] <= within), key=lambda w: w[1] - w[2])  # ties: the earliest
    return Choice(*best[:3])


ROWS_TIE = 0.005  # `choose`: rows over the bound that differ by less than this share of the mean are a tie


def exchange_per_micro_batch(slots: np.ndarray, primaries: int, ranks_per_node: int, micro_batches_per_step: int,
                              weight_bytes: float, grad_bytes: float | None, net_gbps: float,
                              intra_gbps: float, hidden_us: float = 0.0, weights_hidden_us: float = 0.0,
                              held_back: bool = True) -> float:
    """What the replicas of ``slots`` add to each micro-batch (µs): their step's `exchange_us`
    (gradient sums of ``grad_bytes``, default ``weight_bytes``; with more than one micro-batch per
    step and weights narrower than the sums, in two halves: the last micro-batch's gradient as many
    bytes as the weights, the early half hidden up to ``hidden_us``, with ``held_back`` the sums
    that homes take at the backward's end too; the stepped weights hidden up to
    ``weights_hidden_us``) spread over the step."""
    grad = weight_bytes if grad_bytes is None else grad_bytes
    return exchange_us(slots, primaries, ranks_per_node, weight_bytes, grad, net_gbps, intra_gbps,
                       last_bytes=last_half_bytes(weight_bytes, grad, micro_batches_per_step),
                       hidden_us=hidden_us, weights_hidden_us=weights_hidden_us,
                       held_back=held_back) / micro_batches_per_step


def _sequence(expected: np.ndarray, e2r: np.ndarray, G: int, redundant: int, repeat: bool) -> list[np.ndarray]:
    """`choose`'s candidate sequence for expected loads float [E]: replica tables int64 [R, redundant],
    each one replica more than the last. The next replica is for the expert with the largest
    expected rows per holder (``repeat``: it may get several, on different nodes) or per expert
    (one each)."""
    R = int(e2r.max()) + 1
    E = len(expected)
    share = expected.copy()  # expected rows per holder
    holders = np.ones(E)
    full = expected <= 0  # no (further) replica for it: cold, done, or no free slot off its nodes
    sequence, replica_at = [], np.full((R, redundant), -1, np.int64)
    # the slot table, each expert's holders and nodes, and each rank's filled replica slots, kept
    # up to date as replicas are added (`slot_experts`, `_copies`)
    slots = np.ascontiguousarray(slot_experts(e2r, replica_at)[None])
    primaries = slots.shape[2] - redundant
    copies = np.ones((1, E), np.int64)
    nodes_of = [{int(r) // G} for r in e2r]
    used = np.zeros(R, np.int64)
    loads = np.ascontiguousarray(expected, np.float64)[None]
    expected_kernel = _compiled_expected()
    while (replica_at < 0).any() and not full.all():
        e = int(np.argmax(np.where(full, -np.inf, share)))  # ties: the lower id
        rank_rows = expected_kernel(loads, slots, copies, G)[0, 0].sum(axis=1)
        # slots fill level by level (every rank's first, then its second ...): more slots per rank
        # extend the sequence of fewer instead of crowding the nodes that look light now
        for level in range(used.min(), redundant):
            ranks = [r for r in np.flatnonzero(used == level).tolist() if r // G not in nodes_of[e]]
            if ranks:
                break
        else:
            full[e] = True  # slots only fill up: none will be free for it later in the sequence
            continue
        node_rows = rank_rows.reshape(-1, G).sum(axis=1)
        n = min({r // G for r in ranks}, key=lambda n: (node_rows[n], n))
        q = min((r for r in ranks if r // G == n), key=lambda r: (rank_rows[r], r))
        replica_at = replica_at.copy()
        j = int(np.argmax(replica_at[q] < 0))
        replica_at[q, j] = slots[0, q, primaries + j] = e
        copies[0, e] += 1
        nodes_of[e].add(n)
        used[q] += 1
        holders[e] += 1
        share[e] = expected[e] / holders[e]
        full[e] |= not repeat
        sequence.append(replica_at)
    return sequence
