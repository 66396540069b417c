"""The FEPLB planner: one NVLink domain's per-expert token counts -> a plan of Copy-Engine moves.

A pure, deterministic function (numpy, with the planning pass compiled by numba; no torch, no
I/O). The runtime layer, the domain's scheduler process, the in-process fallback and the
simulator all call :func:`plan_domain`, so every rank of a domain that reads the same counts gets
the same plan.

Problem (docs/ARCHITECTURE.md, "Metrics"). A domain (a "node" in the simulator) has ``G`` ranks;
rank ``r`` received ``counts[r, e]`` token-expert
pairs for its local expert ``e``. Each rank may offload up to ``D`` of its hottest local experts
("dynamic candidates", :func:`dynamic_candidates`); the tokens of an offloaded expert may be
split between its home and up to ``max_helpers`` helper ranks of the same domain, which receive
one copy of the expert's weights each. Goal: minimise the largest per-rank token count. No plan
can beat the lower bound ``max(ceil(domain mean), max_r(static_r))`` where ``static_r`` is what
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
make room by chaining their own dynamic experts on (for a donor's last allowed chunk, or for any
chunk that fits no receiver whole, so that a whole expert moves as one weight copy; both are
tried and the better plan kept), or, when no receiver can take any more copies, through a rank
above the level that already sends to a receiver with room (it takes the donor's rows and sends
as many more of its own along its existing chunk); the level is raised by bisection until every
donor fits.

Speed: the common case is one pass; the chaining passes of the bisection run only when limits
bind. The passes are plain loops over a domain's ranks, compiled by numba (``cache=True``: a
process loads the machine code from the cache next to this file; the first process on a machine
compiles it, a few seconds). Interpreted, one plan of 128 experts x 8 ranks costs ~2,800 Python
bytecodes and numpy calls cost ~1 µs each, which put the planner far from its latency budget.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit

__all__ = ["PlanConstraints", "Plan", "auto_ce_budget", "dynamic_candidates", "lower_bound", "plan_domain", "empty_plan"]


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

    @classmethod
    def from_config(cls, config, expert_bytes: int, static_seconds: float = 0.0,
                    expert_seconds: float = 0.0) -> "PlanConstraints":
        """The limits a ``"feplb"`` section (a `deepspeed_feplb.FEPLBConfig`) sets for experts of
        ``expert_bytes`` weight bytes. ``static_seconds`` / ``expert_seconds``: the static-expert
        and whole expert-compute time that the ``ce_budget: "auto"`` budget hides the copies
        behind (measured on the previous micro-batch at runtime, modelled in the simulator)."""
        budget = config.ce_budget
        if budget == "auto":
            budget = auto_ce_budget(config.copy_engine_gbps, static_seconds, expert_seconds)
        return cls(dynamic_experts=config.dynamic_experts_per_rank, max_helpers=config.max_helpers_per_expert,
                   chunk_align=config.chunk_align_tokens, ce_budget_bytes=float(budget), expert_bytes=int(expert_bytes))

    def copies_per_rank(self) -> float:
        """How many expert-weight copies one rank may send (and receive) per micro-batch."""
        if self.expert_bytes <= 0 or math.isinf(self.ce_budget_bytes):
            return math.inf
        return max(0, math.floor(self.ce_budget_bytes / self.expert_bytes))


@dataclass(frozen=True)
class Plan:
    """moves:       int64 [M, 4] = (home, local_expert, helper, tokens), domain-local rank ids,
                    tokens > 0, sorted by (home, local_expert); for one (home, local_expert) with
                    n rows the home keeps the first n - sum(moved) rows and the moves take the
                    following rows in the order they appear here.
    rank_tokens:    int64 [G]: tokens each rank of the domain computes after the plan."""

    moves: np.ndarray
    rank_tokens: np.ndarray


def auto_ce_budget(gbps: float, static_seconds: float, expert_seconds: float = 0.0) -> float:
    """Weight bytes per rank and micro-batch that hide behind compute: Copy-Engine bandwidth
    ``gbps`` (1e9 bytes/s) times the static-expert time, or, when a rank has no static work, half
    its whole expert time (what it keeps of its own work); unlimited before anything was timed."""
    window = static_seconds if static_seconds > 0 else 0.5 * expert_seconds
    return math.inf if window <= 0 else gbps * 1e9 * window


def empty_plan(counts: np.ndarray) -> Plan:
    """The plan that moves nothing. counts int64 [G, E_local]."""
    counts = np.asarray(counts, dtype=np.int64)
    return Plan(np.zeros((0, 4), dtype=np.int64), counts.sum(axis=1) if counts.ndim == 2 else np.zeros(0, np.int64))


def dynamic_candidates(counts: np.ndarray, D: int) -> np.ndarray:
    """counts int64 [G, E_local] -> int64 [G, min(D, E_local)]: each rank's D hottest local
    experts, hottest first, ties to the lower expert id (the rule of :func:`_hottest`, which the
    planning pass uses too)."""
    counts = np.ascontiguousarray(counts, dtype=np.int64)
    d = max(0, min(int(D), counts.shape[1]))
    top_e = np.zeros((counts.shape[0], d), dtype=np.int64)
    top_n = np.zeros_like(top_e)
    for r in range(counts.shape[0] if d else 0):
        _hottest(counts, r, top_e, top_n)
    return top_e


def lower_bound(counts: np.ndarray, D: int) -> int:
    """counts int64 [G, E_local] -> lower bound on the largest per-rank load of any
    plan that offloads at most D experts per rank: max(ceil(mean), max_r static_r)."""
    counts = np.asarray(counts, dtype=np.int64)
    G = counts.shape[0]
    if G == 0:
        return 0
    loads = counts.sum(axis=1)
    cand = dynamic_candidates(counts, D)
    static = loads - np.take_along_axis(counts, cand, axis=1).sum(axis=1)
    return int(max(-(-int(loads.sum()) // G), int(static.max())))


# ------------------------------------------------------------------ the compiled planning pass
# Per-rank state of one water-filling pass, rows of an int64 [6, G] array (numba compiles no
# closures, so the pass's functions share their state through it).
_FINAL, _ROOM, _RECV, _SEND, _GAVE, _TOPPED = range(6)
# Scalar state, an int64 [2] array: receivers with room left, moves written so far.
_OPEN, _MOVES = range(2)
# What _push returns while its loop is not finished: the rows it needs a receiver to make room for.
_DONE = -1
# _push's `forced` receiver: none (pick one), or "making room failed: take the roomiest".
_PICK, _ROOMIEST = -1, -2
# When a chunk that no receiver takes whole makes a receiver make room: never; only the last
# chunk the helper or send limit allows; any such chunk (a whole expert then moves as one chunk,
# which saves weight copies when the Copy-Engine budget binds).
_NO_CHAIN, _CHAIN_LAST, _CHAIN_ANY = 0, 1, 2


@njit("int64(int64, int64, int64, int64, int64, boolean)", cache=True)
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


@njit("void(int64[:, ::1], int64, int64[:, ::1], int64[:, ::1])", cache=True)
def _hottest(counts, r, top_e, top_n):
    """The one rule for a rank's dynamic experts: fill row ``r`` of top_e / top_n int64 [G, D]
    with rank r's D hottest experts and their tokens, hottest first, ties to the lower id."""
    order = np.argsort(-counts[r], kind="mergesort")
    for i in range(top_e.shape[1]):
        top_e[r, i] = order[i]
        top_n[r, i] = counts[r, order[i]]


@njit("void(int64[:, ::1], int64, int64[:, ::1], int64[:, ::1], int64[:, ::1])", cache=True)
def _ensure_top(counts, r, top_e, top_n, s):
    """`_hottest` for rank r, once per rank and plan."""
    if s[_TOPPED, r]:
        return
    _hottest(counts, r, top_e, top_n)
    s[_TOPPED, r] = 1


@njit("UniTuple(int64, 2)(int64, int64, boolean[::1], int64, int64, int64[:, ::1], int64[:, ::1], int64[::1], int64[:, ::1])", cache=True)
def _relay(r, want, used, cap, align, counts, s, sc, out):
    """A chain through a rank above the level, for when no receiver can take a chunk of rank r
    (all are full, used by this expert, or out of weight copies): rank d, which already sends a
    chunk of its expert e2 to receiver j with room left, takes ``a`` rows of r's expert and sends
    ``a`` more rows of e2 along its existing chunk to j (a new weight copy only from r to d).
    Returns (index of d's move in ``out``, a) for the largest such ``a`` (an aligned amount up to
    ``want``), or (-1, 0)."""
    final, recv = s[_FINAL], s[_RECV]
    m = sc[_MOVES]
    best, best_a = -1, 0
    for k in range(m):
        d, e2, j = out[k, 0], out[k, 1], out[k, 2]
        if d == r or used[d] or recv[d] <= 0 or cap - final[j] <= 0:
            continue
        left = counts[d, e2]
        for i in range(m):
            if out[i, 0] == d and out[i, 1] == e2:
                left -= out[i, 3]
        a = min(want, cap - final[j], left)
        a -= a % align
        if a > best_a:
            best, best_a = k, a
    return best, best_a


@njit("int64(int64, int64, int64[::1], boolean[::1], int64, int64, int64, int64, int64, int64, int64[:, ::1], int64[:, ::1], int64[::1], int64[:, ::1])", cache=True)
def _push(r, e, ps, used, forced, chain, stop, cap, H, align, counts, s, sc, out):
    """Move rows of rank r's expert e to receivers, one chunk per receiver, at most H chunks.

    ps:      int64 [4] = (rows the home still holds, rows still needed, moved, chunks): the loop's
             state, so that a caller can resume the loop after a receiver made room;
    used:    bool [G]: ranks this expert may not go to (updated);
    forced:  the receiver of the next chunk, or _PICK / _ROOMIEST;
    stop:    stop once at most ``stop`` rows are still needed; cap: the most a receiver may hold.
    Each chunk goes to the receiver with the least room that takes it whole (ties: lower rank),
    else the roomiest one (ties: higher rank); when chaining and no receiver can take any, through
    a rank above the level (:func:`_relay`). Writes (r, e, helper, tokens) rows to ``out``.
    Returns _DONE, or (per ``chain``) the rows of a chunk that no receiver takes whole: the
    caller lets a receiver make room and resumes with it ``forced``."""
    G = s.shape[1]
    final, room, recv, send = s[_FINAL], s[_ROOM], s[_RECV], s[_SEND]
    left, need, moved, chunks = ps[0], ps[1], ps[2], ps[3]
    while need > stop and left > 0 and chunks < H and send[r] > 0 and (sc[_OPEN] > 0 or chain != _NO_CHAIN):
        want = need if need < left else left
        j = forced if forced >= 0 else -1
        big = -1
        if j < 0:
            bc = bg = 0
            for i in range(G):
                c = room[i]
                if c > 0 and not used[i]:
                    if c >= want:
                        if j < 0 or c < bc:
                            j, bc = i, c
                    elif c >= bg:
                        big, bg = i, c
            if j < 0 and forced == _PICK and (chain == _CHAIN_ANY or chain == _CHAIN_LAST and (
                    chunks == H - 1 or send[r] == 1)):
                ps[0], ps[1], ps[2], ps[3] = left, need, moved, chunks
                return want
            if j < 0:
                j = big
        if j >= 0:  # a receiver takes the chunk
            forced = _PICK
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
                sc[_OPEN] -= 1
            final[j] += amt
        else:  # none can: through a rank above the level
            if chain == _NO_CHAIN:
                break
            k, amt = _relay(r, want, used, cap, align, counts, s, sc, out)
            if amt <= 0:
                break
            j = out[k, 0]
            out[k, 3] += amt  # j sends amt more of its expert to its receiver ...
            final[out[k, 2]] += amt
            recv[j] -= 1  # ... and computes amt rows of ours: its load is unchanged
        m = sc[_MOVES]
        out[m, 0], out[m, 1], out[m, 2], out[m, 3] = r, e, j, amt
        sc[_MOVES] = m + 1
        chunks += 1
        used[j] = True
        left -= amt
        need -= amt
        moved += amt
        send[r] -= 1
    final[r] -= moved
    ps[0], ps[1], ps[2], ps[3] = left, need, moved, chunks
    return _DONE


@njit("int64(int64, boolean[::1], int64, int64, int64, int64[:, ::1], int64[:, ::1], int64[:, ::1], int64[:, ::1], int64[::1], int64[:, ::1])", cache=True)
def _make_room(want, banned, cap, H, align, counts, top_e, top_n, s, sc, out):
    """Let the receiver with the most room plus movable dynamic load push its own dynamic experts
    to the other receivers (not in ``banned``) until it can take ``want`` rows; returns that
    receiver, or -1."""
    G = s.shape[1]
    final, room, recv, send, gave = s[_FINAL], s[_ROOM], s[_RECV], s[_SEND], s[_GAVE]
    best = -1
    bfree = bc = 0
    for j in range(G):
        c = room[j]
        if c == 0 or banned[j] or gave[j] or send[j] <= 0:
            continue
        _ensure_top(counts, j, top_e, top_n, s)
        free = c + top_n[j].sum()
        if best < 0 or free > bfree or (free == bfree and c < bc):  # ties: less room, lower rank
            best, bfree, bc = j, free, c
    if best < 0 or bfree < want:
        return -1
    j = best
    gave[j] = 1
    room[j] = 0
    sc[_OPEN] -= 1
    extra = want - bc
    ps = np.zeros(4, np.int64)
    for i in range(top_e.shape[1]):
        n = top_n[j, i]
        if extra <= 0 or n <= 0:
            break
        ps[0], ps[1], ps[2], ps[3] = n, extra, 0, 0
        _push(j, top_e[j, i], ps, banned.copy(), _PICK, _NO_CHAIN, 0, cap, H, align, counts, s, sc, out)
        extra -= ps[2]
    c = cap - final[j]
    if c <= 0 or recv[j] <= 0:
        return -1
    room[j] = c
    sc[_OPEN] += 1
    return j


@njit("Tuple((int64[:, ::1], int64[::1]))(int64, int64, int64[::1], int64[:, ::1], int64[:, ::1], int64[:, ::1], int64[:, ::1], int64, int64, int64, int64)", cache=True)
def _fill(level, slack, loads, counts, top_e, top_n, s, H, align, copies, chain):
    """One water-filling pass toward ``level``: ranks more than ``slack`` above ``level``
    ("donors", largest excess first, ties to the lower rank) push their excess, hottest candidate
    first, to ranks at or below it ("receivers"), which may end at most ``slack`` tokens above
    ``level``; a donor stops once it is within ``slack`` of ``level``. ``chain`` (_NO_CHAIN,
    _CHAIN_LAST, _CHAIN_ANY): when an expert's last allowed chunk (or any chunk) fits no receiver
    whole, one receiver first makes room by pushing its own dynamic experts to the others (a
    chain of two moves beats a helper or copy limit); with chaining, a chunk that no receiver
    can take at all goes through a rank above the level (:func:`_relay`).

    loads int64 [G]; counts int64 [G, E]; top_e / top_n int64 [G, D] (filled lazily, see
    :func:`_ensure_top`); s int64 [6, G]: the state rows (only _TOPPED is kept between passes);
    copies: weight copies one rank may send, and one may receive.
    Returns (moves int64 [M, 4] in the order the rows are taken, final int64 [G])."""
    G = loads.shape[0]
    D = top_e.shape[1]
    cap = level + slack
    final, room = s[_FINAL], s[_ROOM]
    final[:] = loads
    s[_RECV, :] = copies
    s[_SEND, :] = copies
    s[_GAVE, :] = 0
    sc = np.zeros(2, np.int64)
    for j in range(G):
        x = loads[j]
        room[j] = cap - x if x <= level and cap > x else 0
        if room[j] > 0:
            sc[_OPEN] += 1
    out = np.empty((G * D * H, 4), np.int64)  # each (rank, expert) moves at most once, in <= H chunks
    ps = np.zeros(4, np.int64)
    for r in np.argsort(-loads, kind="mergesort"):
        if loads[r] <= cap:
            break
        s[_GAVE, r] = 1
        _ensure_top(counts, r, top_e, top_n, s)
        for i in range(D):
            left = top_n[r, i]
            need = final[r] - level
            if need <= slack or s[_SEND, r] <= 0 or left <= 0 or sc[_OPEN] == 0 and chain == _NO_CHAIN:
                break  # candidates are sorted hottest first
            ps[0], ps[1], ps[2], ps[3] = left, need, 0, 0
            used = np.zeros(G, np.bool_)
            forced = _PICK
            while True:
                want = _push(r, top_e[r, i], ps, used, forced, chain, slack, cap, H, align, counts, s, sc, out)
                if want == _DONE:
                    break
                banned = used.copy()
                banned[r] = True
                forced = _make_room(want, banned, cap, H, align, counts, top_e, top_n, s, sc, out)
                if forced < 0:
                    forced = _ROOMIEST
    return out[:sc[_MOVES]], final.copy()


@njit("int64[::1](int64[:, ::1], int64, int64, int64, int64)", cache=True)
def _plan(counts, D, H, align, copies):
    """The compiled body of :func:`plan_domain`. counts int64 [G, E] (C order); D <= E; copies:
    weight copies per rank (an int; the caller maps "unlimited" to G * D * H).
    Returns int64 [G + 4 M]: rank_tokens [G], then the moves [M, 4] sorted by (home,
    local_expert), flat (one array: each array returned to Python costs ~1 µs); empty for
    negative counts (the caller raises)."""
    G, E = counts.shape
    loads = np.zeros(G, np.int64)
    for r in range(G):
        for e in range(E):
            if counts[r, e] < 0:
                return np.zeros(0, np.int64)
            loads[r] += counts[r, e]
    if G <= 1 or D <= 0 or H <= 0 or copies <= 0:
        return loads
    top_load = loads.max()
    level = -(-loads.sum() // G)
    slack = align - 1
    if top_load <= level + slack:  # also all-zero counts
        return loads
    top_e = np.zeros((G, D), np.int64)
    top_n = np.zeros((G, D), np.int64)
    s = np.zeros((6, G), np.int64)
    for r in range(G):
        if loads[r] > level:
            _ensure_top(counts, r, top_e, top_n, s)
            level = max(level, loads[r] - top_n[r].sum())
    if top_load <= level + slack:
        return loads

    moves, final = _fill(level, slack, loads, counts, top_e, top_n, s, H, align, copies, _NO_CHAIN)
    best_max = final.max()
    if best_max > level + slack:
        # The helper or Copy-Engine limits bind: let receivers make room by chaining moves (for
        # the last allowed chunk, or for any chunk that fits no receiver whole), and bisect the
        # level between the lower bound and the best result so far, keeping the plan with the
        # smallest maximum.
        lo, hi = level, best_max - 1
        while lo <= hi:
            mid = (lo + hi) // 2 if lo > level else level
            for chain in (_CHAIN_LAST, _CHAIN_ANY):
                m, f = _fill(mid, slack, loads, counts, top_e, top_n, s, H, align, copies, chain)
                fmax = f.max()
                if fmax < best_max:
                    moves, final, best_max = m, f, fmax
                if best_max <= mid + slack:
                    break  # this level is reached: the bisection goes lower
            if best_max <= mid + slack:
                hi = mid - 1
            else:
                lo = mid + 1
    if moves.shape[0] == 0 or best_max >= top_load:
        return loads
    out = np.empty(G + moves.size, np.int64)
    out[:G] = final
    order = np.argsort(moves[:, 0] * E + moves[:, 1], kind="mergesort")  # rows of one expert keep their order
    for k in range(order.shape[0]):
        out[G + 4 * k:G + 4 * k + 4] = moves[order[k]]
    return out


def plan_domain(counts: np.ndarray, constraints: PlanConstraints) -> Plan:
    """Plan one NVLink domain.

    counts:       int64 [G, E_local]: tokens (token-expert pairs) that each of the domain's G ranks
                  received for each of its local experts; negative counts raise ValueError.
    constraints:  :class:`PlanConstraints`.
    Returns a :class:`Plan`; moves touch only ``dynamic_candidates(counts, D)[home]``, never move
    more than an expert has, respect ``max_helpers``, ``chunk_align`` and the Copy-Engine budget,
    and are deterministic. Degenerate inputs (G <= 1, D == 0, all-zero counts) give no moves, and
    so does a domain whose largest load is within ``chunk_align - 1`` of the mean.
    The largest per-rank load is the lower bound plus at most ``chunk_align - 1`` whenever the
    helper and Copy-Engine limits allow it.

    Cost: one compiled call: the row sums, the D hottest experts of each rank above the mean, one
    water-filling pass, and a bisection over chaining passes only when the helper or Copy-Engine
    limits bind. The first call in a process loads the compiled code from numba's cache (or
    compiles it once, a few seconds, into that cache).
    """
    counts = np.asarray(counts, dtype=np.int64)
    if counts.ndim != 2:
        raise ValueError(f"counts must be [G, E_local], got shape {counts.shape}")
    counts = np.ascontiguousarray(counts)
    G, E = counts.shape
    D = min(int(constraints.dynamic_experts), E)
    H = int(constraints.max_helpers)
    copies = constraints.copies_per_rank()
    copies = G * max(D, 0) * max(H, 0) if copies == math.inf else int(copies)
    out = _plan(counts, D, H, max(1, int(constraints.chunk_align)), copies)
    if out.shape[0] < G:
        raise ValueError("counts must be non-negative")
    return Plan(out[G:].reshape(-1, 4), out[:G])
