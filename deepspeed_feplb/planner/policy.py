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

Algorithm: water-filling toward a level ``W`` that starts at the lower bound. Ranks more than
``chunk_align - 1`` above ``W`` ("donors", largest excess first) push their excess from their
hottest candidates to ranks below ``W`` ("receivers", which may end up to ``chunk_align - 1``
above it); each chunk goes to the receiver whose spare capacity fits the chunk most tightly, or
to the one with the most spare capacity when none fits it whole, which keeps the number of
chunks (and weight copies) small. Chunks are multiples of ``chunk_align`` tokens except one that
takes all the rows the home still holds; a donor's last chunk is rounded down, so the donor
keeps its remainder (under ``chunk_align`` tokens) and the receivers keep their room for the
donors that follow. If the helper or Copy-Engine limits leave a donor above ``W``, receivers may
make room by chaining their own dynamic experts on, and the level is raised by bisection until
every donor fits.

Speed: the common case is one pass (:func:`_fill_simple`, receivers kept in one sorted list of
int keys); the chaining passes of the bisection (:func:`_fill`) run only when limits bind.
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


def _chunk(amt, left, c, gap, align, final_chunk):
    """Round a chunk of ``amt`` rows (``amt % align != 0``, ``amt < left``) to the alignment.

    left:         rows of the expert the home still holds; c: the receiver's room;
    gap:          donor load minus receiver load (a chunk must leave the receiver below the donor);
    final_chunk:  the chunk would bring the donor exactly to the level: round it down, so the
                  donor keeps fewer than ``align`` rows above the level (within the slack) and
                  the receivers keep their room for the donors that follow.
    Returns the rounded amount, 0 when no aligned chunk fits."""
    down = amt - amt % align
    if final_chunk:
        return down
    up = down + align
    if up < left and up <= c and up < gap:
        return up
    if up >= left and left <= c and left < gap:
        return left  # the chunk that ends the expert's rows may be unaligned
    return down


def _fill_simple(level, slack, loads, tops, G, H, align, copies):
    """The water-filling pass of :func:`_fill` without chaining (the common case), inlined, with
    the receivers in one sorted list of ``room * G + rank`` keys: the best fit is a bisection,
    the roomiest receiver the last key. Same arguments and result as :func:`_fill` with
    ``chain=False``."""
    cap = level + slack
    final = list(loads)
    rl = sorted([(cap - x) * G + j for j, x in enumerate(loads) if x <= level and x < cap])
    recv = [copies] * G
    groups = []
    for _, r in sorted([(level - x, r) for r, x in enumerate(loads) if x > cap]):
        if not rl:
            break
        send = copies
        fr = final[r]
        need = fr - level
        for e, left in tops[r]:
            if left <= 0:
                break  # candidates are sorted hottest first
            chunks = []
            used = 0
            while True:
                want = need if need < left else left
                # best fit: the least room that takes the chunk whole (ties: lower rank), else
                # the most room (ties: higher rank); never a rank this expert already went to
                k = bisect_left(rl, want * G)
                n = len(rl)
                if used:
                    while k < n and used >> rl[k] % G & 1:
                        k += 1
                if k == n:
                    k -= 1
                    while k >= 0 and used >> rl[k] % G & 1:
                        k -= 1
                    if k < 0:
                        break
                key = rl[k]
                c, j = divmod(key, G)
                amt = want if want < c else c
                if align > 1 and amt < left and amt % align:
                    amt = _chunk(amt, left, c, fr - final[j], align, amt == need)
                    if amt <= 0:
                        break
                del rl[k]
                recv[j] -= 1
                if c > amt and recv[j] > 0:
                    insort(rl, key - amt * G)
                chunks.append((j, amt))
                used |= 1 << j
                left -= amt
                need -= amt
                fr -= amt
                final[j] += amt
                send -= 1
                if need <= slack or left <= 0 or len(chunks) >= H or send <= 0 or not rl:
                    break
            if chunks:
                final[r] = fr
                groups.append((r, e, chunks))
            if need <= slack or send <= 0 or not rl:
                break
    return groups, final


def _fill(level, slack, loads, tops, rows, D, G, H, align, copies, chain):
    """One water-filling pass toward ``level``: ranks more than ``slack`` above ``level``
    ("donors", largest excess first) push their excess, hottest candidate first, to ranks at or
    below it ("receivers"), which may end at most ``slack`` tokens above ``level``; a donor stops
    once it is within ``slack`` of ``level``. Each chunk goes to the receiver with the least spare
    room that takes it whole (best fit; ties to the lower rank), else to the roomiest one (ties to
    the higher rank). With ``chain``, when an expert's last allowed chunk fits no receiver, one
    receiver first makes room by pushing its own dynamic experts to the others (a chain of two
    moves beats a helper limit).

    loads:  list [G] of per-rank tokens; rows: list [G] of lists [E_local] (the counts).
    tops:   {rank: [(local_expert, tokens), ...] hottest first} for every rank above ``level``
            (filled in lazily for receivers that make room).
    copies: weight copies one rank may send, and one may receive.
    Returns (groups, final): groups = [(home, expert, [(helper, tokens), ...])] in the order
    the rows are taken, and final = list [G] of per-rank tokens after the moves. Pure Python
    over small lists (G is one node's ranks): at this size a linear scan beats numpy's per-call
    overhead and any ordered structure."""
    if not chain:
        return _fill_simple(level, slack, loads, tops, G, H, align, copies)
    cap = level + slack
    final = list(loads)
    # room[j] > 0: rank j takes more rows (at most room[j]); 0: it takes none (any more)
    room = [cap - x if x <= level and cap > x else 0 for x in loads]
    recvs = [j for j in range(G) if room[j]]
    if not recvs:
        return [], final
    n_open = len(recvs)
    recv = [copies] * G
    send = [copies] * G
    groups = []
    made_room = 0  # bit mask of ranks that gave rows away (donors, receivers that made room)

    def push(r, e, left, need, used, may_chain, stop):
        """Move up to ``need`` of the ``left`` rows of (r, e) in at most H chunks to receivers not
        in the bit mask ``used``, stopping once at most ``stop`` rows are still needed; returns
        the tokens moved."""
        nonlocal n_open
        chunks = []
        moved = 0
        while need > stop and left > 0 and len(chunks) < H and send[r] > 0 and n_open:
            want = need if need < left else left
            j = big = -1
            bc = bg = 0
            for i in recvs:
                c = room[i]
                if c and not used >> i & 1:
                    if c >= want:
                        if j < 0 or c < bc:
                            j, bc = i, c
                    elif c >= bg:
                        big, bg = i, c
            if j < 0:  # nobody takes it whole
                if may_chain and (len(chunks) == H - 1 or send[r] == 1):
                    j = make_room(want, used | 1 << r)
                    if j < 0:  # making room may have changed the rooms: look again
                        big, bg = -1, 0
                        for i in recvs:
                            c = room[i]
                            if c >= bg and c and not used >> i & 1:
                                big, bg = i, c
                if j < 0:  # the roomiest receiver
                    j = big
                    if j < 0:
                        break
            c = room[j]
            amt = want if want < c else c
            if align > 1 and amt < left and amt % align:
                amt = _chunk(amt, left, c, final[r] - moved - final[j], align, stop > 0 and amt == need)
                if amt <= 0:
                    break
            recv[j] -= 1
            if c > amt and recv[j] > 0:
                room[j] = c - amt
            else:
                room[j] = 0
                n_open -= 1
            chunks.append((j, amt))
            used |= 1 << j
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
        experts elsewhere until it can take ``want``; returns that receiver or -1."""
        nonlocal n_open, made_room
        best = -1
        bfree = bc = 0
        for j in recvs:
            c = room[j]
            if not c or banned >> j & 1 or made_room >> j & 1 or send[j] <= 0:
                continue
            top = tops.get(j)
            if top is None:
                top = tops[j] = _top(rows[j], D)
            free = c
            for _, n in top:
                free += n
            if best < 0 or free > bfree or (free == bfree and c < bc):  # ties: less room, lower rank
                best, bfree, bc = j, free, c
        if best < 0 or bfree < want:
            return -1
        j = best
        made_room |= 1 << j
        room[j] = 0
        n_open -= 1
        extra = want - bc
        for e, n in tops[j]:
            if extra <= 0 or n <= 0:
                break
            extra -= push(j, e, n, extra, banned, False, 0)
        c = cap - final[j]
        if c <= 0 or recv[j] <= 0:
            return -1
        room[j] = c
        n_open += 1
        return j

    for _, r in sorted((level - x, r) for r, x in enumerate(loads) if x > cap):
        made_room |= 1 << r
        for e, left in tops[r]:
            need = final[r] - level
            if need <= slack or send[r] <= 0 or left <= 0 or not n_open:
                break  # candidates are sorted hottest first
            push(r, e, left, need, 0, True, slack)
    return groups, final


def _top(row, D):
    """row: list [E_local] -> [(local_expert, tokens), ...] of the D hottest, hottest first, ties
    to the lower id."""
    return [(e, row[e]) for e in sorted(range(len(row)), key=row.__getitem__, reverse=True)[:D]]


def plan_node(counts: np.ndarray, constraints: PlanConstraints) -> Plan:
    """Plan one node (one NVLink domain).

    counts:       int64 [G, E_local]: tokens (token-expert pairs) that each of the node's G ranks
                  received for each of its local experts; negative counts raise ValueError.
    constraints:  :class:`PlanConstraints`.
    Returns a :class:`Plan`; moves touch only ``dynamic_candidates(counts, D)[home]``, never move
    more than an expert has, respect ``max_helpers``, ``chunk_align`` and the Copy-Engine budget,
    and are deterministic. Degenerate inputs (G <= 1, D == 0, all-zero counts) give no moves, and
    so does a node whose largest load is within ``chunk_align - 1`` of the mean.
    The largest per-rank load is the lower bound plus at most ``chunk_align - 1`` whenever the
    helper and Copy-Engine limits allow it.

    Cost: one conversion of ``counts`` to Python ints, a sort of the D hottest experts of each rank
    above the mean, one water-filling pass over the donors' chunks, and a bisection over further
    passes only when the helper or Copy-Engine limits bind. At this size (a node: G ranks,
    E_local experts each) plain Python over small lists beats numpy's per-call overhead.
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
    loads = list(map(sum, rows))
    if G <= 1 or D <= 0 or H <= 0 or copies <= 0:
        return Plan(_NO_MOVES.copy(), np.array(loads, dtype=np.int64).reshape(G))
    top_load = max(loads)
    level = -(-sum(loads) // G)
    slack = align - 1
    if top_load <= level + slack:  # also all-zero counts
        return _no_plan(counts, loads)
    tops = {}
    for r in range(G):
        if loads[r] > level:
            row = rows[r]
            if min(row) < 0:
                raise ValueError("counts must be non-negative")
            top = tops[r] = _top(row, D)
            static = loads[r]
            for _, n in top:
                static -= n
            if static > level:
                level = static
    if top_load <= level + slack:
        return _no_plan(counts, loads)
    copies = G * D * H if copies == math.inf else int(copies)

    groups, final = _fill_simple(level, slack, loads, tops, G, H, align, copies)
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
    if not groups or best_max >= top_load:
        return _no_plan(counts, loads)
    groups.sort()  # by (home, local_expert): each pair appears once
    flat = []
    for r, e, chunks in groups:
        for j, amt in chunks:
            flat += (r, e, j, amt)
    m = len(flat)
    flat += final
    out = np.array(flat, dtype=np.int64)  # one conversion: moves and rank_tokens are views of it
    return Plan(out[:m].reshape(-1, 4), out[m:])


_NO_MOVES = np.zeros((0, 4), dtype=np.int64)


def _no_plan(counts, loads):
    return Plan(_NO_MOVES.copy(), np.array(loads, dtype=np.int64))
