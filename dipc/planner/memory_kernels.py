"""The per-rank memory ILP's inner loops on arrays, compiled with numba (DIP §2.5): the ILP's rows per rank
(:func:`rank_rows`), the inputs of its LP relaxation (:func:`relax_inputs`), an interval-cover LP solved as a
min-cost flow (:func:`interval_cover_lp`), and the rounding of its solution (:func:`hull_steps`, :func:`round_up`).
:func:`dipc.planner.memory.optimize_memory` and :class:`dipc.planner.rollout.Rollouts` call them; like
:mod:`dipc.planner.kernels` they do their float operations in the order the Python loops they replaced did.  Units:
bytes and seconds.  Compiled on first use and cached on disk (numba's ``cache=True``).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from .kernels import _hpop, _hpush  # the binary heaps (interval_cover_lp's Dijkstra)

__all__ = ["rank_rows", "relax_inputs", "interval_cover_lp", "hull_steps", "round_up"]

_INF = math.inf


# ------------------------------------------------------------------------------------ memory ILP (one rank)
@njit(cache=True)
def _levels(n_rows, ra, rb, x):
    """Bytes in each of ``n_rows`` rows when item ``i`` holds ``x[i]`` in rows ``ra[i] <= row < rb[i]``."""
    d = np.zeros(n_rows + 1)
    for i in range(ra.shape[0]):
        d[ra[i]] += x[i]
    for i in range(rb.shape[0]):
        d[rb[i]] += -x[i]
    return np.cumsum(d)[:-1]


@njit(cache=True)
def rank_rows(ks, is_b, pair_of, n_all, least_p, most_p, M):
    """One rank's peak rows (DIP §2.5, :func:`dipc.planner.memory.optimize_memory`): ``ks`` its order (stage
    indices; ``pair_of[i]``: the pair of forward or backward ``i``, ``n_all`` pairs in all, ``least_p`` /
    ``most_p`` each pair's least and most bytes).  A row is a forward followed by a backward (or last); a pair is
    live from its forward to its backward.  Returns ``(status, pairs, ra, rb, n_rows, bad, bad_bytes)``: ``pairs``
    in the order of their forwards, each live in binding rows ``ra <= row < rb`` (a row binds when its pairs at
    their most bytes are over ``M``; ``n_rows`` of them); status 1 when a row is over ``M`` with every pair at its
    least memory (``bad``: its position in ``ks``, ``bad_bytes`` its bytes then), else 0."""
    L = ks.shape[0]
    n_pairs = 0
    n_all_rows = 0
    for p in range(L):
        if not is_b[ks[p]]:
            n_pairs += 1
            if p + 1 == L or is_b[ks[p + 1]]:
                n_all_rows += 1
    pairs = np.empty(n_pairs, np.int64)
    lo = np.empty(n_pairs, np.int64)
    rows = np.empty(n_all_rows, np.int64)
    where = np.full(n_all, -1, np.int64)  # pair -> position of its backward in ks
    a = 0
    q = 0
    for p in range(L):
        i = ks[p]
        if is_b[i]:
            where[pair_of[i]] = p
        else:
            pairs[a] = pair_of[i]
            lo[a] = p
            a += 1
            if p + 1 == L or is_b[ks[p + 1]]:
                rows[q] = p
                q += 1
    hi = np.empty(n_pairs, np.int64)
    for a in range(n_pairs):
        hi[a] = where[pairs[a]]
    ra = np.searchsorted(rows, lo)
    rb = np.searchsorted(rows, hi)
    least = _levels(n_all_rows, ra, rb, least_p[pairs])
    most = _levels(n_all_rows, ra, rb, most_p[pairs])
    if n_all_rows and least.max() > M * (1 + 1e-9):
        return 1, pairs, ra, rb, 0, rows[np.argmax(least)], least.max()
    cap = M * (1 + 1e-9)
    first_binding = np.zeros(n_all_rows + 1, np.int64)
    for q in range(n_all_rows):
        first_binding[q + 1] = first_binding[q] + (1 if most[q] > cap else 0)
    for a in range(n_pairs):
        ra[a] = first_binding[ra[a]]
        rb[a] = first_binding[rb[a]]
    return 0, pairs, ra, rb, first_binding[n_all_rows], -1, 0.0


@njit(cache=True)
def relax_inputs(act, ra, rb, n_rows, path_ptr, path, c_ptr, c_mem, c_extra, seg_ptr, seg_cost, seg_save, M):
    """The LP relaxation of one rank's instance in incremental form (:func:`dipc.planner.memory._relax`): pairs
    ``act`` (live in binding rows ``ra <= row < rb``) start at their fastest lower-hull point (``path[path_ptr[p]]``,
    a candidate of ``c_mem`` / ``c_extra`` from ``c_ptr[p]``) and may move along their hull's segments (``seg_cost``
    seconds, ``seg_save`` bytes from ``seg_ptr[p]``).  Returns ``(has_lp, fastest points' extra seconds, rows,
    each row's bytes to save, each segment's first row, its end row, its seconds, its bytes, its pair (position in
    act))``, as :func:`interval_cover_lp` takes them: the rows those over ``M`` at the fastest points (renumbered
    from 0), bytes in units of ``M``; ``has_lp`` False when no row is over or no pair has a segment."""
    n_act = act.shape[0]
    n_seg = np.empty(n_act, np.int64)
    fast_mem = np.empty(n_act)
    fast_extra = 0.0
    for a in range(n_act):
        pr = act[a]
        n_seg[a] = seg_ptr[pr + 1] - seg_ptr[pr]
        j0 = path[path_ptr[pr]]
        fast_mem[a] = c_mem[c_ptr[pr] + j0]
        fast_extra += c_extra[c_ptr[pr] + j0]
    need = _levels(n_rows, ra, rb, fast_mem) - M  # bytes each row must save
    tight = need > M * 1e-9
    n_s = n_seg.sum()
    e_f = np.empty(0)
    e_i = np.empty(0, np.int64)
    if not tight.any() or n_s == 0:
        return False, fast_extra, 0, e_f, e_i, e_i, e_f, e_f, e_i
    first = np.zeros(n_rows + 1, np.int64)  # tight rows before each row
    for q in range(n_rows):
        first[q + 1] = first[q] + (1 if tight[q] else 0)
    m = first[n_rows]
    row_need = np.empty(m)
    for q in range(n_rows):
        if tight[q]:
            row_need[first[q]] = need[q] / M
    owner = np.empty(n_s, np.int64)
    lo = np.empty(n_s, np.int64)
    hi = np.empty(n_s, np.int64)
    cost = np.empty(n_s)
    save = np.empty(n_s)
    s = 0
    for a in range(n_act):
        pr = act[a]
        for g in range(seg_ptr[pr], seg_ptr[pr + 1]):
            owner[s] = a
            cost[s] = seg_cost[g]
            save[s] = seg_save[g] / M
            lo[s] = first[ra[a]]
            hi[s] = first[rb[a]]
            s += 1
    return True, fast_extra, m, row_need, lo, hi, cost, save, owner


@njit(cache=True)
def _residual(x, tail, head, cap, flow, rate):
    """Residual arc ``x`` of :func:`interval_cover_lp` (``2 e``: along arc ``e``, ``2 e + 1``: against it): ``(the
    node it leads to, capacity left, cost a unit)``."""
    e = x >> 1
    if x & 1:
        return tail[e], flow[e], -rate[e]
    return head[e], cap[e] - flow[e], rate[e]


@njit(cache=True)
def interval_cover_lp(m, need, lo, hi, cost, save):
    """``min sum(cost * z)`` subject to ``sum(save[s] * z[s] for s with lo[s] <= q < hi[s]) >= need[q]`` for each
    row ``q`` of ``m`` and ``0 <= z <= 1``: the memory ILP's relaxation (DIP §2.5; :meth:`dipc.planner.memory.
    CandidateTable.relax`), each segment covering an interval of rows.  Such a matrix is a network matrix (its
    columns have consecutive ones), so the LP is a min-cost flow: with a surplus ``w_q >= 0`` per row and each row
    minus the one before, segment ``s`` is an arc ``hi[s] -> lo[s]`` (capacity ``save[s]``, ``cost[s] / save[s]``
    seconds a unit), ``w_q`` an arc ``q -> q + 1`` (free, unbounded), node ``q`` of ``0..m`` wanting
    ``need[q] - need[q - 1]`` (``need[-1] = need[m] = 0``).  Solved by successive shortest paths with potentials
    (Dijkstra from the remaining supplies; costs are >= 0), every other shortest path then filled depth-first over
    the arcs of reduced cost 0 before the next Dijkstra (most paths tie: ~30 Dijkstras for ~280 augmentations at
    VLM-L / 64 microbatches, ~1 ms against HiGHS's simplex ~1.7 ms through highspy on the same instances).
    ``cost`` >= 0, ``save`` >= 0 (a segment saving nothing, or covering no row, stays at 0).  Returns
    ``(status, z, objective)``: status 0 at an optimum, 1 when no ``z`` fits (a row needs more than its
    segments save)."""
    ns = lo.shape[0]
    T = m + 1  # the sink; the source is implicit (the nodes with supply left start at distance -pot)
    V = m + 2
    E = m + ns
    tail = np.empty(E, np.int64)
    head = np.empty(E, np.int64)
    rate = np.zeros(E)
    cap = np.zeros(E)
    flow = np.zeros(E)
    for q in range(m):
        tail[q] = q
        head[q] = q + 1
        cap[q] = np.inf
    for s in range(ns):
        e = m + s
        tail[e] = hi[s]
        head[e] = lo[s]
        if hi[s] > lo[s] and save[s] > 0:
            cap[e] = save[s]
            rate[e] = cost[s] / save[s]
    deg = np.zeros(V + 1, np.int64)  # each node's arcs: 2 * e leaving by e, 2 * e + 1 leaving against e
    for e in range(E):
        deg[tail[e] + 1] += 1
        deg[head[e] + 1] += 1
    for v in range(V):
        deg[v + 1] += deg[v]
    inc = np.empty(2 * E, np.int64)
    fill = deg[:-1].copy()
    for e in range(E):
        inc[fill[tail[e]]] = 2 * e
        fill[tail[e]] += 1
        inc[fill[head[e]]] = 2 * e + 1
        fill[head[e]] += 1
    sup = np.zeros(V)
    dem = np.zeros(V)
    left = 0.0
    prev = 0.0
    for q in range(m + 1):
        cur_need = need[q] if q < m else 0.0
        d = cur_need - prev
        prev = cur_need
        if d > 0:
            dem[q] = d
            left += d
        else:
            sup[q] = -d
    eps = 1e-12 * max(left, 1.0)
    pot = np.zeros(V)
    dist = np.empty(V)
    done = np.zeros(V, np.bool_)
    pe = np.empty(V, np.int64)
    mark = np.zeros(V, np.int64)
    cur = np.empty(V, np.int64)
    path = np.empty(V + 1, np.int64)
    hk = np.empty((1, 2 * E + 2 * V + 2))  # one heap of (distance, node) (:func:`_hpush`), stale entries skipped
    hv = np.empty((1, 2 * E + 2 * V + 2), np.int64)
    hs = np.zeros(1, np.int64)
    while True:
        wanted = False  # a demand left above eps (the paths below serve even the smaller ones they reach)
        for v in range(m + 1):
            if dem[v] > eps:
                wanted = True
                break
        if not wanted:
            break
        # Dijkstra on reduced costs from the supplies left (a supply node's distance: -pot, the implicit source's
        # arc to it), to the sink through the nodes with demand left
        hs[0] = 0
        for v in range(V):
            dist[v] = np.inf
            done[v] = False
            pe[v] = -1
        for v in range(m + 1):
            if sup[v] > 0:
                dist[v] = -pot[v]
                _hpush(hk, hv, hs, 0, dist[v], v)
        while True:
            u = -1
            while hs[0] > 0:
                d0, u0 = _hpop(hk, hv, hs, 0)
                if not done[u0] and d0 <= dist[u0]:
                    u = u0
                    break
            if u < 0:
                return 1, np.zeros(ns), 0.0  # the sink is out of reach: a row's need cannot be met
            done[u] = True
            if u == T:
                break
            du = dist[u]
            if dem[u] > 0:
                nd = du + pot[u] - pot[T]
                if nd < dist[T]:
                    dist[T] = nd
                    pe[T] = -2 - u
                    _hpush(hk, hv, hs, 0, nd, T)
            for k in range(deg[u], deg[u + 1]):
                x = inc[k]
                v, r, c = _residual(x, tail, head, cap, flow, rate)
                if r <= eps or done[v]:
                    continue
                nd = du + c + pot[u] - pot[v]
                if nd < dist[v]:
                    dist[v] = nd
                    pe[v] = x
                    _hpush(hk, hv, hs, 0, nd, v)
        dT = dist[T]
        for v in range(V):
            pot[v] += dist[v] if (done[v] and dist[v] < dT) else dT
        # the shortest path found
        t = -2 - pe[T]
        b = dem[t]
        v = t
        while pe[v] >= 0:
            x = pe[v]
            e = x >> 1
            if x & 1:
                r = flow[e]
                v = head[e]
            else:
                r = cap[e] - flow[e]
                v = tail[e]
            b = min(b, r)
        b = min(b, sup[v])
        s0 = v
        v = t
        while pe[v] >= 0:
            x = pe[v]
            e = x >> 1
            if x & 1:
                flow[e] -= b
                v = head[e]
            else:
                flow[e] += b
                v = tail[e]
        sup[s0] -= b
        dem[t] -= b
        left -= b
        # every other path of reduced cost 0: depth first from the supplies left over the arcs of reduced cost 0,
        # each node's current arc kept, a node without a way on dead until the next Dijkstra
        for v in range(V):
            cur[v] = deg[v]
            mark[v] = 0  # 1 on the path, 2 dead
        for s in range(m + 1):
            while sup[s] > eps and mark[s] == 0 and left > eps:
                n_p = 0
                u = s
                mark[s] = 1
                while dem[u] <= eps:
                    moved = False
                    while cur[u] < deg[u + 1]:
                        x = inc[cur[u]]
                        v, r, c = _residual(x, tail, head, cap, flow, rate)
                        # reduced cost 0 up to rounding, relative to the terms (one global tolerance let a
                        # segment saving next to nothing at a high cost make real differences look like ties)
                        if r > eps and mark[v] == 0 and c + pot[u] - pot[v] <= 1e-12 * (abs(c) + abs(pot[u])
                                                                                          + abs(pot[v])):
                            path[n_p] = x
                            n_p += 1
                            u = v
                            mark[v] = 1
                            moved = True
                            break
                        cur[u] += 1
                    if not moved:
                        mark[u] = 2
                        if n_p == 0:
                            break
                        n_p -= 1
                        x = path[n_p]
                        e = x >> 1
                        u = head[e] if x & 1 else tail[e]
                        cur[u] += 1
                if dem[u] <= eps:
                    break  # s is dead
                b = min(sup[s], dem[u])
                for i in range(n_p):
                    x = path[i]
                    e = x >> 1
                    b = min(b, flow[e] if x & 1 else cap[e] - flow[e])
                for i in range(n_p):
                    x = path[i]
                    e = x >> 1
                    if x & 1:
                        flow[e] -= b
                        mark[head[e]] = 0
                    else:
                        flow[e] += b
                        mark[tail[e]] = 0
                mark[u] = 0
                sup[s] -= b
                dem[u] -= b
                left -= b
    z = np.zeros(ns)
    obj = 0.0
    for s in range(ns):
        if cap[m + s] > 0:
            z[s] = min(1.0, flow[m + s] / cap[m + s])
            obj += cost[s] * z[s]
    return 0, z, obj


@njit(cache=True)
def hull_steps(n_act, z, owner, save):
    """Each pair's hull steps from its fastest point in the LP solution ``z`` (the bytes it saves, then its
    segments filled in order; a segment counts as used above 1e-9 of it)."""
    steps = np.zeros(n_act, np.int64)
    saved = np.zeros(n_act)
    for s in range(owner.shape[0]):
        saved[owner[s]] += save[s] * z[s]
    excl = np.cumsum(save) - save  # bytes of the segments before each one, over all pairs
    begin = np.full(n_act, -1, np.int64)  # each pair's first segment (a pair's segments are contiguous)
    for s in range(owner.shape[0]):
        if begin[owner[s]] < 0:
            begin[owner[s]] = s
    for s in range(owner.shape[0]):
        a = owner[s]
        if saved[a] - (excl[s] - excl[begin[a]]) > 1e-9 * save[s]:
            steps[a] += 1
    return steps


@njit(cache=True)
def round_up(act, ra, rb, n_rows, steps, path_ptr, path, c_ptr, c_mem, c_extra, bs_order, M, choice):
    """:func:`dipc.planner.memory._solve_pairs`' rounding and upgrades: each pair of ``act`` at the hull point
    ``steps`` from its fastest (every row then holds: memory only goes down), then, the largest saving first, the
    fastest candidate (``bs_order``: a pair's candidates fastest first) that its rows still hold.  Writes the
    candidates (indices within each pair) to ``choice[act]``; returns their extra seconds summed."""
    n_act = act.shape[0]
    js = np.empty(n_act, np.int64)
    mem = np.empty(n_act)
    gain = np.empty(n_act)
    for a in range(n_act):
        pr = act[a]
        j = path[path_ptr[pr] + steps[a]]
        js[a] = j
        mem[a] = c_mem[c_ptr[pr] + j]
        gain[a] = c_extra[c_ptr[pr] + j] - c_extra[c_ptr[pr] + bs_order[c_ptr[pr]]]
    level = _levels(n_rows, ra, rb, mem)
    cap = M * (1 + 1e-9)
    for a in np.argsort(-gain, kind="mergesort"):  # the largest saving first (stable)
        if gain[a] <= 0:
            break
        pr, j0 = act[a], js[a]
        c0 = c_ptr[pr]
        lo, hi = ra[a], rb[a]
        mx = 0.0
        if hi > lo:
            mx = level[lo]
            for q in range(lo + 1, hi):
                if level[q] > mx:
                    mx = level[q]
        room = cap - mx + c_mem[c0 + j0]
        for q in range(c0, c_ptr[pr + 1]):  # fastest first
            j = bs_order[q]
            if c_extra[c0 + j] >= c_extra[c0 + j0]:
                break
            if c_mem[c0 + j] <= room:
                up = c_mem[c0 + j] - c_mem[c0 + j0]
                for q2 in range(lo, hi):
                    level[q2] += up
                js[a] = j
                break
    value = 0.0
    for a in range(n_act):
        choice[act[a]] = js[a]
        value += c_extra[c_ptr[act[a]] + js[a]]
    return value
