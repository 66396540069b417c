"""The planning pass of `policy.plan_domain`, compiled by numba (``cache=True``: a process loads the
machine code from the cache next to this file; the first process on a machine compiles it).

Water-filling toward a level (the algorithm is described in `policy`). Loaded on a process's
first plan, not on import of `policy`: a rank that always gets its plans from the scheduler
process never loads it (the process loads it before it says it is up).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from deepspeed_feplb.plan.hottest import hottest

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


@njit("void(int64[:, ::1], int64, int64[:, ::1], int64[:, ::1], int64[:, ::1])", cache=True)
def _ensure_top(counts, r, top_e, top_n, s):
    """`hottest` for rank r, once per rank and plan."""
    if s[_TOPPED, r]:
        return
    hottest(counts, r, top_e, top_n)
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
def plan_pass(counts, D, H, align, copies):
    """The compiled body of `policy.plan_domain`. counts int64 [G, E] (C order); D <= E; copies:
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
