"""The planning pass of `policy.plan_domain`, compiled by numba (``cache=True``: a process loads the
machine code from the cache next to this file; the first process on a machine compiles it).

Water-filling toward a level (the algorithm is described in `policy`). Loaded on a process's
first plan, not on import of `policy`: a rank that always gets its plans from the scheduler
process never loads it (the process loads it before it says it is up).
"""
from __future__ import annotations

import numpy as np
from numba import from_dtype, njit
from numba import types as nt

from deepspeed_feplb.plan.time_model import MODEL_DTYPE, serve_parts

# The time model as the passes take it: `timeline.TimeModel.record`, read by field name (length
# 0: no model, rows only). Its fields are part of the compiled signatures, so numba's cache never
# serves code compiled for another layout.
MODEL = nt.Array(from_dtype(MODEL_DTYPE), 1, "C")

# Per-rank state of one water-filling pass, rows of an int64 [5, G] array (numba compiles no
# closures, so the pass's functions share their state through it).
_FINAL, _ROOM, _RECV, _SEND, _GAVE = range(5)
# Scalar state, an int64 [3] array: receivers with room left, moves written so far, and whether a
# receiver takes chunks only up to the level (not up to the slack above it) where that leaves it a
# whole chunk of room (a "tight" pass: donors then spread over more receivers).
_OPEN, _MOVES, _TIGHT = range(3)
# What _push returns while its loop is not finished: the rows it needs a receiver to make room for.
_DONE = -1
# _push's `forced` receiver: none (pick one), or "making room failed: take the roomiest".
_PICK, _ROOMIEST = -1, -2
# A plan with fewer weight copies per rank replaces a faster one if its makespan is at most this
# much longer (copies cost memory bandwidth and energy that the time model does not see).
_FEWER_COPIES_SLACK = 0.005
# When a chunk that no receiver takes whole makes a receiver make room: never; only the last
# chunk the helper or send limit allows; any such chunk (a whole expert then moves as one chunk,
# which saves weight copies when the Copy-Engine budget binds).
_NO_CHAIN, _CHAIN_LAST, _CHAIN_ANY = 0, 1, 2


@njit("boolean(int64[:, :, ::1], int64, int64, int64)", cache=True)
def holds(resident, r, e, j):
    """Whether helper j holds a copy of rank r's expert e: bit ``j % 64`` of word ``j // 64`` of
    ``resident[r, e]`` (int64 [G, E, W], W = ceil(G / 64))."""
    return (resident[r, e, j >> 6] >> (j & 63)) & 1 == 1


@njit("boolean(int64[:, :, ::1], int64, int64)", cache=True)
def _any_holder(resident, r, e):
    for w in range(resident.shape[2]):
        if resident[r, e, w] != 0:
            return True
    return False


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


@njit("UniTuple(int64[:, ::1], 2)(int64[:, ::1], int64[:, ::1])", cache=True)
def _candidates(counts, dynamic):
    """The ranks' published dynamic experts as the passes walk them: (top_e, top_n) int64 [G, D],
    each rank's experts hottest first (ties to the lower id) and their rows; a rank that published
    fewer than D (-1 in ``dynamic``) has rows 0 there, where every pass stops."""
    G, D = dynamic.shape
    top_e = np.full((G, D), -1, np.int64)
    top_n = np.zeros((G, D), np.int64)
    for r in range(G):
        k = 0
        for i in range(D):
            e = dynamic[r, i]
            if e < 0:
                continue
            j = k  # insertion: more rows first, then the lower id
            while j > 0 and (top_n[r, j - 1] < counts[r, e] or top_n[r, j - 1] == counts[r, e] and top_e[r, j - 1] > e):
                top_e[r, j], top_n[r, j] = top_e[r, j - 1], top_n[r, j - 1]
                j -= 1
            top_e[r, j], top_n[r, j] = e, counts[r, e]
            k += 1
    return top_e, top_n


@njit("UniTuple(int64, 2)(int64, int64, boolean[::1], int64, int64, int64[:, ::1], int64[:, ::1], "
      "int64[::1], int64[:, ::1])", cache=True)
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


@njit("int64(int64, int64, int64[::1], boolean[::1], int64, int64, int64, int64, int64, int64, "
      "int64[:, ::1], int64[:, ::1], int64[::1], int64[:, ::1], int64[:, :, ::1])", cache=True)
def _push(r, e, ps, used, forced, chain, stop, cap, max_helpers, align, counts, s, sc, out, resident):
    """Move rows of rank r's expert e to receivers, one chunk per receiver, at most ``max_helpers``.

    ps:      int64 [4] = (rows the home still holds, rows still needed, moved, chunks): the loop's
             state, so that a caller can resume the loop after a receiver made room;
    used:    bool [G]: ranks this expert may not go to (updated);
    forced:  the receiver of the next chunk, or _PICK / _ROOMIEST;
    stop:    stop once at most ``stop`` rows are still needed; cap: the most a receiver may hold.
    resident: int64 [G, E, W] bit masks (`holds`): helper j already holds a copy of the
             expert's weights (a chunk to it costs no copy).
    Each chunk goes to the receiver that holds the weights and has the most room, else to the
    receiver with the least room that takes it whole (ties: lower rank), else the roomiest one
    (ties: higher rank); when chaining and no receiver can take any, through a rank above the
    level (:func:`_relay`). Writes (r, e, helper, rows) rows to ``out``.
    Returns _DONE, or (per ``chain``) the rows of a chunk that no receiver takes whole: the
    caller lets a receiver make room and resumes with it ``forced``."""
    G = s.shape[1]
    final, room, recv, send = s[_FINAL], s[_ROOM], s[_RECV], s[_SEND]
    left, need, moved, chunks = ps[0], ps[1], ps[2], ps[3]
    holders = _any_holder(resident, r, e)
    while (need > stop and left > 0 and chunks < max_helpers and (send[r] > 0 or holders)
           and (sc[_OPEN] > 0 or chain != _NO_CHAIN)):
        want = need if need < left else left
        j = forced if forced >= 0 else -1
        big = -1
        if j < 0 and holders:
            rc = 0
            for i in range(G):
                if room[i] > rc and not used[i] and holds(resident, r, e, i):
                    j, rc = i, room[i]
        if j < 0 and send[r] <= 0:
            break  # out of copies: only helpers that hold the weights could take more
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
                    chunks == max_helpers - 1 or send[r] == 1)):
                ps[0], ps[1], ps[2], ps[3] = left, need, moved, chunks
                return want
            if j < 0:
                j = big
        free = holders and j >= 0 and holds(resident, r, e, j)
        if j >= 0:  # a receiver takes the chunk
            forced = _PICK
            c = room[j]
            amt = want if want < c else c
            below = c - (align - 1)  # the receiver's room up to the level itself
            if sc[_TIGHT] and align > 1 and amt < left and amt > below >= align:
                amt = below - below % align
            elif align > 1 and amt < left and amt % align:
                amt = _chunk(amt, left, c, final[r] - moved - final[j], align, stop > 0 and amt == need)
                if amt <= 0:
                    break
            if not free:
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
        if not free:
            send[r] -= 1
    final[r] -= moved
    ps[0], ps[1], ps[2], ps[3] = left, need, moved, chunks
    return _DONE


@njit("int64(int64, boolean[::1], int64, int64, int64, int64[:, ::1], int64[:, ::1], int64[:, ::1], "
      "int64[:, ::1], int64[::1], int64[:, ::1], int64[:, :, ::1])", cache=True)
def _make_room(want, banned, cap, max_helpers, align, counts, top_e, top_n, s, sc, out, resident):
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
        _push(j, top_e[j, i], ps, banned.copy(), _PICK, _NO_CHAIN, 0, cap, max_helpers, align, counts, s, sc, out,
              resident)
        extra -= ps[2]
    c = cap - final[j]
    if c <= 0 or recv[j] <= 0:
        return -1
    room[j] = c
    sc[_OPEN] += 1
    return j


@njit("Tuple((int64[:, ::1], int64[::1]))(int64, int64, int64[::1], int64[:, ::1], int64[:, ::1], "
      "int64[:, ::1], int64[:, ::1], int64, int64, int64, int64, int64[:, :, ::1], boolean)", cache=True)
def _fill(level, slack, loads, counts, top_e, top_n, s, max_helpers, align, copies, chain, resident, tight):
    """One water-filling pass toward ``level``: ranks more than ``slack`` above ``level``
    ("donors", largest excess first, ties to the lower rank) push their excess, hottest candidate
    first, to ranks at or below it ("receivers"), which may end at most ``slack`` rows above
    ``level``; a donor stops once it is within ``slack`` of ``level``. ``chain`` (_NO_CHAIN,
    _CHAIN_LAST, _CHAIN_ANY): when an expert's last allowed chunk (or any chunk) fits no receiver
    whole, one receiver first makes room by pushing its own dynamic experts to the others (a
    chain of two moves beats a helper or copy limit); with chaining, a chunk that no receiver
    can take at all goes through a rank above the level (:func:`_relay`).

    loads int64 [G]; counts int64 [G, E]; top_e / top_n int64 [G, D] (`_candidates`); s int64
    [5, G]: the state rows;
    copies: weight copies one rank may send, and one may receive (a chunk to a helper that holds
    the weights, per ``resident`` (see :func:`_push`), needs none).
    Returns (moves int64 [M, 4] in the order the rows are taken, final int64 [G])."""
    G = loads.shape[0]
    D = top_e.shape[1]
    cap = level + slack
    final, room = s[_FINAL], s[_ROOM]
    final[:] = loads
    s[_RECV, :] = copies
    s[_SEND, :] = copies
    s[_GAVE, :] = 0
    sc = np.zeros(3, np.int64)
    sc[_TIGHT] = tight
    for j in range(G):
        x = loads[j]
        room[j] = cap - x if x <= level and cap > x else 0
        if room[j] > 0:
            sc[_OPEN] += 1
    # each (rank, expert) moves at most once, in <= max_helpers chunks
    out = np.empty((G * D * max_helpers, 4), np.int64)
    ps = np.zeros(4, np.int64)
    for r in np.argsort(-loads, kind="mergesort"):
        if loads[r] <= cap:
            break
        s[_GAVE, r] = 1
        for i in range(D):
            left = top_n[r, i]
            need = final[r] - level
            if need <= slack or left <= 0 or sc[_OPEN] == 0 and chain == _NO_CHAIN:
                break  # candidates are sorted hottest first
            if s[_SEND, r] <= 0 and not _any_holder(resident, r, top_e[r, i]):
                continue  # out of copies: only experts whose weights a helper holds can move
            ps[0], ps[1], ps[2], ps[3] = left, need, 0, 0
            used = np.zeros(G, np.bool_)
            forced = _PICK
            while True:
                want = _push(r, top_e[r, i], ps, used, forced, chain, slack, cap, max_helpers, align, counts, s, sc,
                             out, resident)
                if want == _DONE:
                    break
                banned = used.copy()
                banned[r] = True
                forced = _make_room(want, banned, cap, max_helpers, align, counts, top_e, top_n, s, sc, out, resident)
                if forced < 0:
                    forced = _ROOMIEST
    return out[:sc[_MOVES]], final.copy()


@njit("int64[::1](int64[:, ::1], int64[:, ::1], int64, int64, int64, int64[:, :, ::1], boolean, int64, boolean)",
      cache=True)
def plan_pass(counts, dynamic, max_helpers, align, copies, resident, chain, floor, tight):
    """The row-balancing plan. counts int64 [G, E] (C order); dynamic int64 [G, D]: the experts
    each rank published as dynamic, the only ones whose rows move (-1: none); copies: weight copies per
    rank (an int; the caller maps "unlimited" to G * D * max_helpers); resident int64 [G, E, W]: bit masks of
    the helpers that hold each expert's weights (`holds`); chain: when the limits bind, bisect
    over chaining passes (False: the one water-filling pass, a cheaper, coarser plan); floor: the
    level balances no lower than this many rows (a row cap, `policy.PlanConstraints.row_cap`;
    0: down to the lower bound); tight: a receiver takes chunks up to the level, not up to the
    slack above it, where it has a whole chunk of room below the level (`_TIGHT`).
    Returns int64 [G + 4 M]: rank_tokens [G], then the moves [M, 4] sorted by (home,
    local_expert), flat (one array: each array returned to Python costs ~1 µs); empty for
    negative counts or a dynamic expert out of range (the caller raises)."""
    G, E = counts.shape
    D = dynamic.shape[1]
    loads = np.zeros(G, np.int64)
    for r in range(G):
        for e in range(E):
            if counts[r, e] < 0:
                return np.zeros(0, np.int64)
            loads[r] += counts[r, e]
        for i in range(D):
            if dynamic[r, i] < -1 or dynamic[r, i] >= E:
                return np.zeros(0, np.int64)
    if G <= 1 or D <= 0 or max_helpers <= 0 or copies <= 0 and not resident.any():
        return loads
    top_load = loads.max()
    level = max(-(-loads.sum() // G), floor)
    slack = align - 1
    if top_load <= level + slack:  # also all-zero counts
        return loads
    top_e, top_n = _candidates(counts, dynamic)
    s = np.zeros((5, G), np.int64)
    for r in range(G):
        level = max(level, loads[r] - top_n[r].sum())
    if top_load <= level + slack:
        return loads

    moves, final = _fill(level, slack, loads, counts, top_e, top_n, s, max_helpers, align, copies, _NO_CHAIN, resident,
                         tight)
    best_max = final.max()
    if chain and best_max > level + slack:
        # The helper or Copy-Engine limits bind: let receivers make room by chaining moves (for
        # the last allowed chunk, or for any chunk that fits no receiver whole), and bisect the
        # level between the lower bound and the best result so far, keeping the plan with the
        # smallest maximum, to within the slack of one chunk that the plans' maxima carry anyway
        # (exactly with chunks of one row).
        lo, hi = level, best_max - 1
        while lo <= hi and (lo == level or hi - lo >= slack):
            mid = (lo + hi) // 2 if lo > level else level
            for chain in (_CHAIN_LAST, _CHAIN_ANY):
                m, f = _fill(mid, slack, loads, counts, top_e, top_n, s, max_helpers, align, copies, chain, resident,
                             tight)
                fmax = f.max()
                if fmax < best_max:
                    moves, final, best_max = m, f, fmax
                if best_max <= mid + slack:
                    break  # this level is reached: the bisection goes lower
            if best_max <= mid + slack:  # a lower level must aim below the best maximum so far
                hi = min(mid, best_max - slack) - 1
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


@njit("boolean[:, ::1](int64[:, ::1], int64[:, ::1])", cache=True)
def dynamic_mask(counts, dynamic):
    """bool [G, E]: each rank's dynamic experts (``dynamic`` int64 [G, D], -1: none), the ones it
    computes after the plan."""
    G, E = counts.shape
    mask = np.zeros((G, E), np.bool_)
    for r in range(G):
        for i in range(dynamic.shape[1]):
            if dynamic[r, i] >= 0:
                mask[r, dynamic[r, i]] = True
    return mask


@njit(nt.float64(nt.int64, MODEL), cache=True)
def _piece_us(n, model):
    if n <= 0:
        return 0.0
    m = model[0]
    tile = max(1, int(m.tile_rows))
    return max(m.piece_floor_us, m.piece_us + ((n + tile - 1) // tile) * tile * m.row_us)


_serve_parts = njit(cache=True)(serve_parts)


@njit(nt.int64(nt.float64, MODEL), cache=True)
def _parts(rows, model):
    """The parts a helper computes a message of ``rows`` rows in (`time_model.serve_parts`)."""
    return _serve_parts(int(rows), int(model[0].serve_parts), int(model[0].serve_part_rows))


@njit(nt.float64(nt.float64, nt.float64, nt.int64, nt.float64, nt.float64), cache=True)
def _returned(start, cost, parts, part_copy_us, link_free):
    """When the last of a served message's ``parts`` results has left its helper: part p is
    computed by ``start + cost * (p + 1) / parts`` and its results (``part_copy_us``) follow on the
    helper's outgoing link, free from ``link_free``, one part at a time."""
    link = link_free
    for p in range(parts):
        link = max(link, start + cost * (p + 1) / parts) + part_copy_us
    return link


@njit(nt.float64(nt.float64[::1], nt.int64, nt.float64, nt.float64), cache=True)
def _served_from(lane, j, arrival, cost):
    """With `serves_on_arrival`: when helper j starts a chunk of ``cost`` µs that arrives at
    ``arrival``: once it is in and the chunks before it are served, whatever its own rows (they
    wait: the rank's total work is unchanged); ``lane[j]`` moves to the chunk's end."""
    start = max(lane[j], arrival)
    lane[j] = start + cost
    return start


@njit(nt.Tuple((nt.int64[:, ::1], nt.float64[:, ::1]))(nt.int64[:, ::1], nt.boolean[::1], nt.boolean[::1], nt.int64,
                                                        MODEL), cache=True)
def _messages(moves, fresh, grads_back, G, model):
    """The plan's chunks as the runtime sends them: one message per (home, helper) pair, ordered by
    home, then helper (a home sends to its helpers in ascending order; a helper serves its homes
    so). Returns (int64 [K, 2] = (home, helper), float64 [K, 4] = (rows, weight copies, gradient
    returns, the chunks' pieces' forward + backward cost µs: one more piece per part after the
    first, `_parts`))."""
    M = moves.shape[0]
    key = moves[:, 0] * G + moves[:, 2]
    order = np.argsort(key, kind="mergesort")
    pairs = np.empty((M, 2), np.int64)
    sizes = np.zeros((M, 4))
    K = -1
    for i in range(M):
        m = order[i]
        if i == 0 or key[m] != key[order[i - 1]]:
            K += 1
            pairs[K, 0], pairs[K, 1] = moves[m, 0], moves[m, 2]
        sizes[K, 0] += moves[m, 3]
        sizes[K, 1] += fresh[m]
        sizes[K, 2] += grads_back[m]
        sizes[K, 3] += _piece_us(moves[m, 3], model)
    for k in range(K + 1):  # a part boundary inside a chunk splits it into one more piece
        sizes[k, 3] += (_parts(sizes[k, 0], model) - 1) * model[0].piece_us
    return pairs[:K + 1], sizes[:K + 1]


@njit(nt.UniTuple(nt.float64[::1], 2)(nt.int64[:, ::1], nt.int64[:, ::1], MODEL, nt.boolean[:, ::1]), cache=True)
def _own_us(counts, moves, model, dynamic):
    """What each rank computes of its own rows after the plan ``moves`` (µs, forward + backward):
    (static experts float64 [G], the experts computed once the plan is there float64 [G])."""
    G, E = counts.shape
    M = moves.shape[0]
    home_rows = counts.copy()
    after_plan = dynamic.copy()
    for m in range(M):
        home_rows[moves[m, 0], moves[m, 1]] -= moves[m, 3]
        after_plan[moves[m, 0], moves[m, 1]] = True
    static = np.zeros(G)  # the static experts first, then, once the plan is there, the dynamic ones
    later = np.zeros(G)
    for r in range(G):
        for e in range(E):
            if after_plan[r, e]:
                later[r] += _piece_us(home_rows[r, e], model)
            else:
                static[r] += _piece_us(home_rows[r, e], model)
    return static, later


@njit(nt.float64(nt.float64[::1], nt.float64[::1], nt.int64, nt.int64, nt.float64), cache=True)
def _link_copy(link_out, link_in, h, j, length):
    """One copy of ``length`` µs from rank h to rank j, each link one copy at a time (``link_out``,
    ``link_in``: when each rank's outgoing and incoming links are free, updated); returns its end."""
    end = max(link_out[h], link_in[j]) + length
    link_out[h], link_in[j] = end, end
    return end


@njit(nt.void(nt.float64[::1], nt.float64[::1], nt.int64[:, ::1], nt.float64[:, ::1], MODEL, nt.float64[::1]),
      cache=True)
def _forward(static, later, pairs, sizes, model, out):
    """The forward row of `finish_us` into ``out`` float64 [G], from the ranks' own work (`_own_us`)
    and the plan's messages (`_messages`). The messages leave once the plan is there (with
    `sends_after_static`, a grouped static call on the CPU, once the home computed its static
    experts); a helper serves them after its own rows, homes in message order, or with
    `serves_on_arrival` each as soon as it is in, ahead of its own rows (``lane``: when the served
    work is done so far); either way the rank finishes when all its work is (``t``). Plain loops
    over ranks and messages: a plan is timed several times, and array temporaries cost more than
    the arithmetic here."""
    G, K = static.shape[0], pairs.shape[0]
    tm = model[0]
    wcopy, rcopy = tm.weight_copy_us, tm.row_copy_us
    latency, plan_ready, forward = tm.message_us, tm.plan_us, tm.forward_share
    ranks = np.zeros((3, G))
    link_out = ranks[0]  # each rank's outgoing copy-engine link, free from
    link_in = ranks[1]  # each rank's incoming link, free from
    lane = ranks[2]
    t = out  # when each rank is free to compute
    on_arrival = tm.serves_on_arrival > 0
    for r in range(G):
        link_out[r] = plan_ready
        if tm.sends_after_static > 0:
            link_out[r] = max(plan_ready, forward * static[r])
        t[r] = max(forward * static[r], plan_ready) + forward * later[r]
    back = np.empty(K)  # when each message's results are home
    for k in range(K):
        h, j = pairs[k, 0], pairs[k, 1]
        arrival = _link_copy(link_out, link_in, h, j, sizes[k, 1] * wcopy + sizes[k, 0] * rcopy) + latency
        cost = forward * sizes[k, 3]
        t[j] = max(t[j], arrival) + cost
        start = _served_from(lane, j, arrival, cost) if on_arrival else t[j] - cost
        parts = _parts(sizes[k, 0], model)  # the outputs go home, part by part
        back[k] = _returned(start, cost, parts, sizes[k, 0] / parts * rcopy, 0.0) + latency
    for k in range(K):
        out[pairs[k, 0]] = max(out[pairs[k, 0]], back[k])


@njit(nt.void(nt.float64[::1], nt.float64[::1], nt.int64[:, ::1], nt.float64[:, ::1], nt.int64[:, ::1], MODEL,
              nt.float64[::1]), cache=True)
def _backward(static, later, pairs, sizes, flush, model, out):
    """The backward row of `finish_us` into ``out`` float64 [G] (it does not depend on the forward:
    each stage starts when the all-to-all before it ends). The output-gradients leave at once, one
    copy at a time per link; a helper serves its homes after its own experts' backward (the
    runtime's order: `DynamicExperts`, the static experts, `Phase2Anchor`), or with
    `serves_on_arrival` as they arrive."""
    G, K = static.shape[0], pairs.shape[0]
    tm = model[0]
    gcopy, rcopy, latency = tm.grad_copy_us, tm.row_copy_us, tm.message_us
    backward = 1.0 - tm.forward_share
    ranks = np.zeros((4, G))
    link_out, link_in, lane, flushed = ranks[0], ranks[1], ranks[2], ranks[3]
    t = out
    on_arrival = tm.serves_on_arrival > 0
    for r in range(G):
        t[r] = backward * (static[r] + later[r])
    messages = np.empty((2, K))
    arrive, back = messages[0], messages[1]
    for k in range(K):
        arrive[k] = _link_copy(link_out, link_in, pairs[k, 0], pairs[k, 1], sizes[k, 0] * rcopy) + latency
    # the step's end: a helper's kept copies that no chunk of this micro-batch uses hold their final
    # gradients already, and go home once its output-gradients have left, before anything it serves
    for f in range(flush.shape[0]):
        h, j = flush[f, 0], flush[f, 1]
        link_out[j] += gcopy
        flushed[h] = max(flushed[h], link_out[j] + latency)
    for k in range(K):  # a home's input-gradients part by part, the last with the weight-gradients
        h, j = pairs[k, 0], pairs[k, 1]
        cost = backward * sizes[k, 3]
        t[j] = max(t[j], arrive[k]) + cost
        start = _served_from(lane, j, arrive[k], cost) if on_arrival else t[j] - cost
        parts = _parts(sizes[k, 0], model)
        link_out[j] = _returned(start, cost, parts, sizes[k, 0] / parts * rcopy, link_out[j]) + sizes[k, 2] * gcopy
        back[k] = link_out[j] + latency
    for r in range(G):
        out[r] = max(t[r], flushed[r])
    for k in range(K):
        out[pairs[k, 0]] = max(out[pairs[k, 0]], back[k])


@njit(nt.float64[:, ::1](nt.float64[::1], nt.float64[::1], nt.int64[:, ::1], nt.float64[:, ::1], nt.int64[:, ::1],
                        MODEL), cache=True)
def _timeline(static, later, pairs, sizes, flush, model):
    """`finish_us` from the ranks' own work (`_own_us`) and the plan's messages (`_messages`)."""
    out = np.empty((2, static.shape[0]))
    _forward(static, later, pairs, sizes, model, out[0])
    _backward(static, later, pairs, sizes, flush, model, out[1])
    return out


@njit(nt.float64[:, ::1](nt.int64[:, ::1], nt.int64[:, ::1], nt.boolean[::1], nt.boolean[::1], nt.int64[:, ::1], MODEL,
                        nt.boolean[:, ::1]), cache=True)
def finish_us(counts, moves, fresh, grads_back, flush, model, dynamic):
    """Each rank's forward and backward finish time (µs) under the model.

    counts int64 [G, E]: rows per (rank, local expert) before the plan; moves int64 [M, 4] =
    (home, local_expert, helper, rows), plan order; fresh bool [M]: the move carries the expert's
    weights (the helper holds no copy); grads_back bool [M]: the helper returns the chunk's
    weight-gradients this micro-batch (at a step's end also a kept copy's: the step's sum); flush
    int64 [F, 2] = (home, helper): kept weight copies that no move uses, whose accumulated
    gradients go home at the start of this micro-batch's backward (a step's end); model: `MODEL`
    (`timeline.TimeModel.record`); dynamic bool [G, E]: each rank's dynamic experts, computed
    once the plan is there (an expert with moves always is). Returns float64 [2, G]: row 0 from
    the forward stage's start, row 1 from the backward stage's start. The model is described in
    `timeline`."""
    static, later = _own_us(counts, moves, model, dynamic)
    pairs, sizes = _messages(moves, fresh, grads_back, counts.shape[0], model)
    return _timeline(static, later, pairs, sizes, flush, model)


@njit("float64(float64[:, ::1])", cache=True)
def makespan(finish):
    """The stage's time of `finish_us`'s ``[2, G]``: the slowest rank's forward plus the slowest
    rank's backward (each ends in an all-to-all that waits for every rank)."""
    return finish[0].max() + finish[1].max()


@njit(nt.int64[:, ::1](nt.int64[:, ::1], nt.int64[:, :, ::1]), cache=True)
def _unused_copies(moves, resident):
    """int64 [F, 2] = (home, helper): the held copies (``resident``) that no move (int64 [M, 4])
    uses, which send their step's gradients home at the backward's start of its last micro-batch."""
    G, E = resident.shape[0], resident.shape[1]
    out = np.empty((G * E * G, 2), np.int64)
    F = 0
    for h in range(G):
        for e in range(E):
            if not _any_holder(resident, h, e):
                continue
            for j in range(G):
                if not holds(resident, h, e, j):
                    continue
                used = False
                for m in range(moves.shape[0]):
                    if moves[m, 0] == h and moves[m, 1] == e and moves[m, 2] == j:
                        used = True
                        break
                if not used:
                    out[F, 0], out[F, 1] = h, j
                    F += 1
    return out[:F]


@njit(nt.float64(nt.int64[:, ::1], nt.int64[::1], nt.int64[:, :, ::1], nt.boolean, nt.int64, MODEL,
                 nt.boolean[:, ::1]), cache=True)
def _makespan(counts, flat, resident, keep, later, model, dynamic):
    """What a `plan_pass` result ``flat`` costs (µs): its makespan (`makespan`: the slowest forward
    plus the slowest backward of `finish_us`), where copies are kept (``keep``) plus, for the
    ``later`` micro-batches of the step still to come, the makespan of the same moves with every
    copy already held (a copy made now serves them: the rows seldom change much from one
    micro-batch to the next), the last of them returning the step's gradients. At the step's end
    (``keep`` and ``later`` 0) every move returns weight-gradients (a held copy the step's sum) and
    the held copies that no move uses send theirs at the backward's start, as the runtime does.
    Not seen: a helper that can keep no more copies (``max_resident_experts``, the kept-copy
    budget) returns a new copy's gradients at once and needs it copied again; the plan is priced
    as if it kept it."""
    G = counts.shape[0]
    moves = np.ascontiguousarray(flat[G:].reshape(-1, 4))
    M = moves.shape[0]
    fresh = np.empty(M, np.bool_)
    for m in range(M):
        fresh[m] = not holds(resident, moves[m, 0], moves[m, 1], moves[m, 2])
    no_flush = np.zeros((0, 2), np.int64)
    if not keep:
        t = makespan(finish_us(counts, moves, fresh, fresh, no_flush, model, dynamic))
    elif later == 0:
        t = makespan(finish_us(counts, moves, fresh, np.ones(M, np.bool_), _unused_copies(moves, resident), model,
                               dynamic))
    elif M == 0:  # no moves: every micro-batch of the step alike
        t = (1.0 + later) * makespan(finish_us(counts, moves, fresh, fresh, no_flush, model, dynamic))
    else:  # one evaluation of the ranks' own work, and each stage only as often as it differs
        static, own_later = _own_us(counts, moves, model, dynamic)
        pairs, sizes = _messages(moves, fresh, np.ones(M, np.bool_), G, model)
        chunks = sizes[:, 2].copy()
        sizes[:, 2] = 0.0  # until the step's end the copies keep their gradients
        finish = np.empty(G)
        _forward(static, own_later, pairs, sizes, model, finish)
        forward = finish.max()
        _backward(static, own_later, pairs, sizes, no_flush, model, finish)
        backward = finish.max()
        t = forward + backward
        if fresh.any():
            sizes[:, 1] = 0.0  # every copy held: no weights travel
            _forward(static, own_later, pairs, sizes, model, finish)
            forward = finish.max()
        t_held = forward + backward
        sizes[:, 2] = chunks  # the step's last: every chunk returns the step's gradients
        _backward(static, own_later, pairs, sizes, no_flush, model, finish)
        t += (later - 1) * t_held + (forward + finish.max())
    return t


@njit("int64(int64[:, ::1], int64[::1], int64[:, :, ::1])", cache=True)
def _most_copies(counts, flat, resident):
    """The most weight copies one rank sends or receives in a `plan_pass` result ``flat``."""
    G = counts.shape[0]
    sent = np.zeros(G, np.int64)
    got = np.zeros(G, np.int64)
    for k in range((flat.shape[0] - G) // 4):
        h, e, j = flat[G + 4 * k], flat[G + 4 * k + 1], flat[G + 4 * k + 2]
        if not holds(resident, h, e, j):
            sent[h] += 1
            got[j] += 1
    return max(sent.max(), got.max())


@njit("boolean(int64[::1], int64[::1])", cache=True)
def _received_above_mean(before, after):
    """Whether a rank that received rows (``after`` > ``before``, int64 [G] each) ended above the
    mean: only then can a tight pass (`_TIGHT`) give a different plan."""
    mean = -(-before.sum() // before.shape[0])
    for r in range(before.shape[0]):
        if after[r] > before[r] and after[r] > mean:
            return True
    return False


@njit(nt.int64[::1](nt.int64[:, ::1], nt.int64[:, ::1], nt.int64, nt.int64, nt.int64, nt.int64[:, :, ::1], MODEL,
                   nt.boolean, nt.int64, nt.int64), cache=True)
def plan_timed(counts, dynamic, max_helpers, align, copies, resident, model, keep, later, row_cap):
    """The compiled body of `policy.plan_domain`: `plan_pass` results for fewer and fewer weight
    copies per rank (``copies``, then halving the most the plan used, down to 1, or to 0 when
    helpers hold weights: then only they take rows) and no moves at all, judged by the time model
    (``model``: `MODEL`; length 0: rows only, one pass), with chunks of more than a row also the
    plan whose receivers stop at the level (``tight``, which the plans with fewer copies then
    follow where it was faster); returns the one with the smallest
    makespan, except that a plan with fewer copies wins when it is at most `_FEWER_COPIES_SLACK`
    slower. Stops once fewer copies cost more than that. ``keep``: weight copies stay on their
    helpers for the rest of the step (gradients return at its end, not with this micro-batch);
    ``later``: the step's micro-batches after this one, which a copy kept now also serves (0: this
    one ends the step), both priced by `_makespan`.
    ``row_cap`` > 0 bounds rows before time: a plan is a candidate only if its busiest rank stays
    within the cap (up to ``align - 1`` rows over it, as the row plan's receivers may end), or
    within what the first, row-balancing pass reached where the cap is out of reach; the pass
    that balances only down to the cap (its ``floor``: fewer rows move) is one more candidate.
    Without a time model the plan balances down to the cap where that pass gets within it, else as
    far as the limits allow. Returns `plan_pass`'s layout."""
    G = counts.shape[0]
    if model.shape[0] == 0 and row_cap > 0:  # rows only: balance down to the cap where that gets there
        capped = plan_pass(counts, dynamic, max_helpers, align, copies, resident, True, row_cap, False)
        if capped.shape[0] < G or capped[:G].max() <= row_cap + align - 1:
            return capped
    best = plan_pass(counts, dynamic, max_helpers, align, copies, resident, True, 0, False)
    if model.shape[0] == 0 or best.shape[0] == G:
        return best
    limit = max(row_cap + align - 1, best[:G].max()) if row_cap > 0 else np.iinfo(np.int64).max
    after_plan = dynamic_mask(counts, dynamic)
    stay = np.empty(G, np.int64)
    for r in range(G):
        stay[r] = counts[r].sum()
    no_moves = _makespan(counts, stay, resident, keep, later, model, after_plan)
    best_t = _makespan(counts, best, resident, keep, later, model, after_plan)
    tight = False
    if align > 1 and _received_above_mean(stay, best[:G]):
        # receivers filled to the level only: rows closer to it, in more chunks (more weight copies)
        cand = plan_pass(counts, dynamic, max_helpers, align, copies, resident, False, 0, True)
        if cand.shape[0] > G and cand[:G].max() <= limit:
            t = _makespan(counts, cand, resident, keep, later, model, after_plan)
            if t < best_t:
                best, best_t, tight = cand, t, True
    if row_cap > 0:
        capped = plan_pass(counts, dynamic, max_helpers, align, copies, resident, True, row_cap, False)
        if capped.shape[0] > G and capped[:G].max() <= limit:
            t = _makespan(counts, capped, resident, keep, later, model, after_plan)
            if t <= best_t:
                best, best_t = capped, t
    k = _most_copies(counts, best, resident)
    while k > 1 or k == 1 and resident.any():  # with k = 0 only helpers that hold weights take rows
        k //= 2
        cand = plan_pass(counts, dynamic, max_helpers, align, k, resident, False, 0, tight)
        if cand[:G].max() > limit:
            continue
        t = _makespan(counts, cand, resident, keep, later, model, after_plan)
        if t > best_t * (1 + _FEWER_COPIES_SLACK):
            break
        best, best_t = cand, min(t, best_t)
    if no_moves <= best_t and stay.max() <= limit:
        return stay
    return best
