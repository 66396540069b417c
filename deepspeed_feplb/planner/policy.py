"""The FEPLB planner: one node's per-expert token counts -> a plan of Copy-Engine moves.

A pure, deterministic function (numpy plus a few small Python loops; no torch, no I/O). The
runtime layer, the per-node scheduler process, the in-process fallback and the simulator all
call :func:`plan_node`, so every rank of a node that reads the same counts gets the same plan.

Problem (DESIGN §2). A node has ``G`` ranks; rank ``r`` received ``counts[r, e]`` token-expert
pairs for its local expert ``e``. Each rank may offload up to ``D`` of its hottest local experts
("dynamic candidates", :func:`dynamic_candidates`); the tokens of an offloaded expert may be
split between its home and up to ``max_helpers`` helper ranks of the same node, which receive
one copy of the expert's weights each. Goal: minimise the largest per-rank token count. No plan
can beat the lower bound ``max(ceil(node mean), max_r(static_r))`` where ``static_r`` is what
rank ``r`` holds outside its ``D`` hottest experts (:func:`lower_bound`).

Algorithm: water-filling toward a level ``W`` that starts at the lower bound. Ranks above ``W``
("donors", largest excess first) push their excess from their hottest candidates to ranks below
``W`` ("receivers"); each chunk goes to the receiver whose spare capacity fits the chunk most
tightly, or to the one with the most spare capacity when none fits it whole, which keeps the
number of chunks (and weight copies) small. Chunks are multiples of ``chunk_align`` tokens except
one that takes all the rows the home still holds. If the helper or Copy-Engine limits leave a
donor above ``W``, the level is raised by bisection until every donor fits.
"""
from __future__ import annotations

import math
from bisect import bisect_left, insort
from dataclasses import dataclass

import numpy as np

__all__ = ["PlanConstraints", "Plan", "dynamic_candidates", "lower_bound", "plan_node", "empty_plan"]


@dataclass(frozen=True)
class PlanConstraints:
    """Limits every plan obeys.

    dynamic_experts:  D: at most D experts per rank may be offloaded (its D hottest).
    max_helpers:      at most this many helper ranks per offloaded expert.
    chunk_align:      every moved chunk is a multiple of this many tokens, except a chunk that
                      ends the expert's rows (one that leaves the home with none of its rows).
    ce_budget_bytes:  weight bytes one rank may send, and one rank may receive, per micro-batch.
    expert_bytes:     bytes of one expert's weights (each helper of an expert receives one copy);
                      0 means weights are free and only ``max_helpers`` limits the copies.
    """

    dynamic_experts: int
    max_helpers: int = 2
    chunk_align: int = 1
    ce_budget_bytes: float = math.inf
    expert_bytes: int = 0

    def copies_per_rank(self) -> float:
        """How many expert-weight copies one rank may send (and receive) per micro-batch."""
        if self.expert_bytes <= 0 or math.isinf(self.ce_budget_bytes):
            return math.inf
        return max(0, math.floor(self.ce_budget_bytes / self.expert_bytes))


@dataclass(frozen=True)
class Plan:
    """moves:       int64 [M, 4] = (home, local_expert, helper, tokens), node-local rank ids,
                    tokens > 0, sorted by (home, local_expert); for one (home, local_expert) with
                    n rows the home keeps the first n - sum(moved) rows and the moves take the
                    following rows in the order they appear here.
    rank_tokens:    int64 [G]: tokens each rank of the node computes after the plan."""

    moves: np.ndarray
    rank_tokens: np.ndarray


def empty_plan(counts: np.ndarray) -> Plan:
    """The plan that moves nothing. counts int64 [G, E_local]."""
    counts = np.asarray(counts, dtype=np.int64)
    return Plan(np.zeros((0, 4), dtype=np.int64), counts.sum(axis=1) if counts.ndim == 2 else np.zeros(0, np.int64))


def dynamic_candidates(counts: np.ndarray, D: int) -> np.ndarray:
    """counts int64 [G, E_local] -> int64 [G, min(D, E_local)]: each rank's D hottest local
    experts, hottest first, ties to the lower expert id (stable)."""
    counts = np.asarray(counts, dtype=np.int64)
    d = max(0, min(int(D), counts.shape[1]))
    if d == 0:
        return np.zeros((counts.shape[0], 0), dtype=np.int64)
    return np.argsort(-counts, axis=1, kind="stable")[:, :d].astype(np.int64, copy=False)


def lower_bound(counts: np.ndarray, D: int) -> int:
    """counts int64 [G, E_local] -> the DESIGN §2 lower bound on the largest per-rank load of any
    plan that offloads at most D experts per rank: max(ceil(mean), max_r static_r)."""
    counts = np.asarray(counts, dtype=np.int64)
    G = counts.shape[0]
    if G == 0:
        return 0
    loads = counts.sum(axis=1)
    cand = dynamic_candidates(counts, D)
    static = loads - np.take_along_axis(counts, cand, axis=1).sum(axis=1)
    return int(max(-(-int(loads.sum()) // G), int(static.max())))


def _fill(level, slack, loads, tops, rows, D, G, H, align, copies, chain):
    """One water-filling pass toward ``level``: ranks above ``level`` ("donors", largest excess
    first) push their excess, hottest candidate first, to ranks at or below it ("receivers"),
    which may end at most ``slack`` tokens above ``level``. Each chunk goes to the receiver with
    the least spare room that takes it whole (best fit), else to the roomiest one. With ``chain``,
    when an expert's last allowed chunk fits no receiver, one receiver first makes room by pushing
    its own dynamic experts to the others (a chain of two moves beats a helper limit).

    loads:  list [G] of per-rank tokens; rows: list [G] of lists [E_local] (the counts).
    tops:   {rank: [(local_expert, tokens), ...] hottest first} for every rank above ``level``
            (filled in lazily for receivers that make room).
    copies: weight copies one rank may send, and one may receive.
    Returns (groups, final): groups = [(home, expert, [(helper, tokens), ...])] in the order
    the rows are taken, and final = list [G] of per-rank tokens after the moves. Pure Python
    over small lists: at this size it beats numpy's per-call overhead."""
    room = sorted((level + slack - x, j) for j, x in enumerate(loads) if x <= level and level + slack > x)
    final = list(loads)
    recv = [copies] * G
    send = [copies] * G
    groups = []
    made_room = set()

    def push(r, e, left, need, banned, may_chain):
        """Move up to ``need`` of the ``left`` rows of (r, e) in at most H chunks; returns the
        tokens moved."""
        chunks = []
        used = banned
        moved = 0
        while need > 0 and left > 0 and len(chunks) < H and send[r] > 0 and room:
            want = need if need < left else left
            k = bisect_left(room, (want, -1))
            n_room = len(room)
            while k < n_room and room[k][1] in used:
                k += 1
            if k == n_room:  # nobody takes it whole
                k = -1
                if may_chain and (len(chunks) == H - 1 or send[r] == 1):
                    k = make_room(want, used + (r,))
                if k < 0:  # the roomiest receiver
                    k = len(room) - 1
                    while k >= 0 and room[k][1] in used:
                        k -= 1
                    if k < 0:
                        break
            c, j = room[k]
            amt = want if want < c else c
            if amt < left and align > 1 and amt % align:
                up = amt - amt % align + align
                gap = final[r] - final[j]  # a chunk must leave the receiver below the donor
                if up < left and up <= c and up < gap:
                    amt = up
                elif up >= left and left <= c and left < gap:
                    amt = left  # the chunk that ends the expert's rows may be unaligned
                else:
                    amt = up - align
                    if amt <= 0:
                        break
            del room[k]
            if c > amt and recv[j] > 1:
                insort(room, (c - amt, j))
            recv[j] -= 1
            chunks.append((j, amt))
            used += (j,)
            left -= amt
            need -= amt
            moved += amt
            final[j] += amt
            send[r] -= 1
        if chunks:
            final[r] -= moved
            groups.append((r, e, chunks))
        return moved

    def make_room(want, banned):
        """Let the receiver with the most room plus movable dynamic load push its own dynamic
        experts elsewhere until it can take ``want``; returns its index in ``room`` or -1."""
        best = None
        for k, (c, j) in enumerate(room):
            if j in banned or j in made_room or send[j] <= 0:
                continue
            if j not in tops:
                row = rows[j]
                tops[j] = [(e, row[e]) for e in sorted(range(len(row)), key=row.__getitem__, reverse=True)[:D]]
            free = c + sum(n for _, n in tops[j])
            if best is None or free > best[0]:
                best = (free, k, c, j)
        if best is None or best[0] < want:
            return -1
        _, k, c, j = best
        made_room.add(j)
        del room[k]
        extra = want - c
        for e, n in tops[j]:
            if extra <= 0 or n <= 0:
                break
            extra -= push(j, e, n, extra, banned, False)
        c = level + slack - final[j]
        if c <= 0 or recv[j] <= 0:
            return -1
        insort(room, (c, j))
        return bisect_left(room, (c, j))

    donors = sorted((r for r in range(G) if loads[r] > level), key=lambda r: (level - loads[r], r))
    for r in donors:
        made_room.add(r)
        for e, left in tops[r]:
            need = final[r] - level
            if need <= 0 or send[r] <= 0 or left <= 0 or not room:
                break  # candidates are sorted hottest first
            push(r, e, left, need, (), chain)
    return groups, final


def plan_node(counts: np.ndarray, constraints: PlanConstraints) -> Plan:
    """Plan one node (one NVLink domain).

    counts:       int64 [G, E_local]: tokens (token-expert pairs) that each of the node's G ranks
                  received for each of its local experts.
    constraints:  :class:`PlanConstraints`.
    Returns a :class:`Plan`; moves touch only ``dynamic_candidates(counts, D)[home]``, never move
    more than an expert has, respect ``max_helpers``, ``chunk_align`` and the Copy-Engine budget,
    and are deterministic. Degenerate inputs (G <= 1, D == 0, all-zero counts) give no moves.
    The largest per-rank load is the lower bound plus at most ``chunk_align - 1`` whenever the
    helper and Copy-Engine limits allow it.
    """
    counts = np.asarray(counts, dtype=np.int64)
    if counts.ndim != 2:
        raise ValueError(f"counts must be [G, E_local], got shape {counts.shape}")
    G, E = counts.shape
    D = min(int(constraints.dynamic_experts), E)
    H = int(constraints.max_helpers)
    align = max(1, int(constraints.chunk_align))
    copies = constraints.copies_per_rank()
    rows = counts.tolist()
    loads = [sum(row) for row in rows]
    if G <= 1 or D <= 0 or H <= 0 or copies <= 0 or max(loads) == 0:
        return Plan(np.zeros((0, 4), dtype=np.int64), np.array(loads, dtype=np.int64).reshape(G))
    mean_ceil = -(-sum(loads) // G)
    over = [r for r in range(G) if loads[r] > mean_ceil]
    if not over:
        return Plan(np.zeros((0, 4), dtype=np.int64), np.array(loads, dtype=np.int64))
    # Only ranks above the mean can set the static part of the lower bound or give tokens away.
    tops = {}
    level = mean_ceil
    for r in over:
        row = rows[r]
        if min(row) < 0:
            raise ValueError("counts must be non-negative")
        ids = sorted(range(E), key=row.__getitem__, reverse=True)[:D]  # stable: ties to lower id
        top = tops[r] = [(e, row[e]) for e in ids]
        static = loads[r]
        for _, n in top:
            static -= n
        if static > level:
            level = static
    if max(loads) <= level:
        return Plan(np.zeros((0, 4), dtype=np.int64), np.array(loads, dtype=np.int64))
    copies = G * D * H if math.isinf(copies) else int(copies)
    slack = align - 1

    groups, final = _fill(level, slack, loads, dict(tops), rows, D, G, H, align, copies, False)
    best_max = max(final)
    if best_max > level + slack:
        # The helper or Copy-Engine limits bind: let receivers make room by chaining moves, and
        # bisect the level between the lower bound and the best result so far, keeping the plan
        # with the smallest maximum.
        lo, hi = level, best_max - 1
        while lo <= hi:
            mid = (lo + hi) // 2 if lo > level else level
            g, f = _fill(mid, slack, loads, dict(tops), rows, D, G, H, align, copies, True)
            fmax = max(f)
            if fmax < best_max:
                groups, final, best_max = g, f, fmax
            if fmax <= mid + slack:
                hi = mid - 1
            else:
                lo = mid + 1
    if not groups or best_max >= max(loads):
        return Plan(np.zeros((0, 4), dtype=np.int64), np.array(loads, dtype=np.int64))
    groups.sort(key=_group_key)
    flat = []
    for r, e, chunks in groups:
        for j, amt in chunks:
            flat += (r, e, j, amt)
    return Plan(np.array(flat, dtype=np.int64).reshape(-1, 4), np.array(final, dtype=np.int64))


def _group_key(group):
    return group[0], group[1]
