"""The planner's scheduling loops on arrays, compiled with numba (DIP §2.3-2.4: the interleaver and the timing of a
fixed order; the memory ILP's loops are in :mod:`dipc.planner.memory_kernels`).

A step's stages are numbered once (:func:`dipc.planner.schedule.graph_arrays`); these kernels then run on integer and
float arrays.  :func:`dipc.planner.schedule.list_schedule` (without a memory limit), :func:`dipc.planner.fitting.timed_schedule`
and :func:`dipc.planner.memory.optimize_memory` call them on stage objects; :class:`dipc.planner.rollout.Rollouts`
calls them straight from a permutation of the search's groups.  Each does its float operations in the order the
Python loops they replaced did, so schedules, strategies and times are those loops' to the last bit.

Compiled on first use and cached on disk (numba's ``cache=True``, beside this file or in numba's user cache): ~10
s once per machine, ~0.5 s to load in a new process.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

__all__ = ["list_kernel", "time_kernel"]

_INF = math.inf


# --------------------------------------------------------------------------------------------- binary heaps
# heap h holds size[h] entries (k1[h, :], k2[h, :]), ordered by (k1, k2)


@njit(cache=True)
def _less(a1, a2, b1, b2):
    return a1 < b1 or (a1 == b1 and a2 < b2)


@njit(cache=True)
def _hpush(k1, k2, size, h, a, b):
    j = size[h]
    size[h] = j + 1
    while j > 0:
        p = (j - 1) >> 1
        if _less(a, b, k1[h, p], k2[h, p]):
            k1[h, j] = k1[h, p]
            k2[h, j] = k2[h, p]
            j = p
        else:
            break
    k1[h, j] = a
    k2[h, j] = b


@njit(cache=True)
def _hpop(k1, k2, size, h):
    a, b = k1[h, 0], k2[h, 0]
    n = size[h] - 1
    size[h] = n
    if n > 0:
        x1, x2 = k1[h, n], k2[h, n]
        j = 0
        while True:
            c = 2 * j + 1
            if c >= n:
                break
            if c + 1 < n and _less(k1[h, c + 1], k2[h, c + 1], k1[h, c], k2[h, c]):
                c += 1
            if _less(k1[h, c], k2[h, c], x1, x2):
                k1[h, j] = k1[h, c]
                k2[h, j] = k2[h, c]
                j = c
            else:
                break
        k1[h, j] = x1
        k2[h, j] = x2
    return a, b


# ------------------------------------------------------------------------------------------- list schedule
@njit(cache=True)
def _admit(i, r, b, t_start, t_last, earliest, pkey, k1, k2, size, P):
    _hpush(k1, k2, size, 4 * P + r, t_start[i], i)  # starts: (t_start, i), stale once i ran
    if t_start[i] < earliest[r]:
        earliest[r] = t_start[i]
    if t_start[i] <= t_last[r]:
        _hpush(k1, k2, size, 2 * r + b, 0.0, pkey[i])  # ready: by priority
    else:
        _hpush(k1, k2, size, 2 * P + 2 * r + b, t_start[i], pkey[i])  # later: by (t_start, priority)


@njit(cache=True)
def list_kernel(P, rank, is_b, mbs, pkey, stage_of_key, succ_ptr, succ_idx, succ_delay, n_pred, lat, window,
                n_mb):
    """:func:`dipc.planner.schedule._list_schedule_unlimited` on arrays (one entry per stage ``i``; ``pkey[i]``: its
    priority as one int, smaller first, ``stage_of_key[pkey[i] % n] == i``; successors of ``i`` at
    ``succ_idx[succ_ptr[i]:succ_ptr[i + 1]]`` with the seconds from ``i``'s end to their earliest start;
    ``window`` < 0: none).  Returns ``(status, order [P, max stages per rank], per-rank lengths, start, end, the
    stages in the order they were scheduled)``, status 0, or 1 (the window deadlocks), or 2 (a cycle)."""
    n = rank.shape[0]
    cap = 1
    per = np.zeros(P, np.int64)
    for i in range(n):
        per[rank[i]] += 1
    for r in range(P):
        cap = max(cap, per[r])
    H = 6 * P  # ready (2P), later (2P), starts (P), held (P)
    k1 = np.empty((H, cap), np.float64)
    k2 = np.empty((H, cap), np.int64)
    size = np.zeros(H, np.int64)
    remaining = n_pred.copy()
    t_start = np.zeros(n)
    t_last = np.zeros(P)
    last_b = np.ones(P, np.bool_)
    ran = np.zeros(n, np.bool_)
    left_on = np.zeros((P, n_mb), np.int64)
    for i in range(n):
        left_on[rank[i], mbs[i]] += 1
    first_open = np.zeros(P, np.int64)
    for r in range(P):
        for m in range(n_mb):
            if left_on[r, m] > 0:
                first_open[r] = m
                break
    earliest = np.full(P, _INF)
    order = np.empty((P, cap), np.int64)
    olen = np.zeros(P, np.int64)
    start = np.zeros(n)
    end = np.zeros(n)
    seq = np.empty(n, np.int64)
    for i in range(n):
        if remaining[i] == 0:
            r = rank[i]
            if window >= 0 and not is_b[i] and mbs[i] >= first_open[r] + window:
                _hpush(k1, k2, size, 5 * P + r, float(mbs[i]), i)
            else:
                _admit(i, r, 1 if is_b[i] else 0, t_start, t_last, earliest, pkey, k1, k2, size, P)
    for step in range(n):
        r = 0
        for q in range(1, P):
            if earliest[q] < earliest[r]:
                r = q
        if earliest[r] == _INF:
            for q in range(P):
                if size[5 * P + q] > 0:
                    return 1, order, olen, start, end, seq
            return 2, order, olen, start, end, seq
        tl = t_last[r]
        for b in range(2):  # what became ready by t_last
            h = 2 * P + 2 * r + b
            while size[h] > 0 and k1[h, 0] <= tl:
                _, p = _hpop(k1, k2, size, h)
                _hpush(k1, k2, size, 2 * r + b, 0.0, p)
        h0, h1 = 2 * r, 2 * r + 1
        if size[h0] > 0 and size[h1] > 0:  # both kinds ready: alternate with the rank's last stage (1F1B)
            _, p = _hpop(k1, k2, size, h0 if last_b[r] else h1)
        elif size[h0] > 0:
            _, p = _hpop(k1, k2, size, h0)
        elif size[h1] > 0:
            _, p = _hpop(k1, k2, size, h1)
        else:  # nothing ready: the earliest start, then the highest priority
            w0, w1 = 2 * P + 2 * r, 2 * P + 2 * r + 1
            if size[w0] > 0 and (size[w1] == 0 or _less(k1[w0, 0], k2[w0, 0], k1[w1, 0], k2[w1, 0])):
                _, p = _hpop(k1, k2, size, w0)
            else:
                _, p = _hpop(k1, k2, size, w1)
        i = stage_of_key[p % n]
        ran[i] = True
        hs = 4 * P + r
        while size[hs] > 0 and ran[k2[hs, 0]]:
            _hpop(k1, k2, size, hs)
        earliest[r] = k1[hs, 0] if size[hs] > 0 else _INF
        m = mbs[i]
        left_on[r, m] -= 1
        if left_on[r, m] == 0 and m == first_open[r]:
            nxt = first_open[r] + 1
            for q in range(m + 1, n_mb):
                if left_on[r, q] > 0:
                    nxt = q
                    break
            first_open[r] = nxt
            hh = 5 * P + r
            while size[hh] > 0 and k1[hh, 0] < first_open[r] + window:
                _, j = _hpop(k1, k2, size, hh)
                _admit(j, r, 1 if is_b[j] else 0, t_start, t_last, earliest, pkey, k1, k2, size, P)
        t = tl if tl > t_start[i] else t_start[i]
        e_t = t + lat[i]
        start[i] = t
        end[i] = e_t
        t_last[r] = e_t
        last_b[r] = is_b[i]
        order[r, olen[r]] = i
        olen[r] += 1
        seq[step] = i
        for q in range(succ_ptr[i], succ_ptr[i + 1]):
            d = succ_idx[q]
            arrive = e_t + succ_delay[q]
            if arrive > t_start[d]:
                t_start[d] = arrive
            remaining[d] -= 1
            if remaining[d] == 0:
                rd = rank[d]
                if window >= 0 and not is_b[d] and mbs[d] >= first_open[rd] + window:
                    _hpush(k1, k2, size, 5 * P + rd, float(mbs[d]), d)
                else:
                    _admit(d, rd, 1 if is_b[d] else 0, t_start, t_last, earliest, pkey, k1, k2, size, P)
    return 0, order, olen, start, end, seq


# -------------------------------------------------------------------------------------------------- timing
@njit(cache=True)
def time_kernel(order, olen, pred_ptr, pred_idx, pred_delay, lat):
    """:func:`dipc.planner.fitting.timed_schedule`'s loop on arrays: each rank's ``order[r, :olen[r]]`` timed (a stage
    starts when its rank's previous stage and every predecessor, plus the edge's seconds, have ended).  Returns
    ``(status, start, end, the stages in the order they were timed)``; status 1: the order deadlocks."""
    n = lat.shape[0]
    P = olen.shape[0]
    done = np.zeros(n, np.bool_)
    fin = np.zeros(n)
    beg = np.zeros(n)
    seq = np.empty(n, np.int64)
    ns = 0
    pos = np.zeros(P, np.int64)
    t_last = np.zeros(P)
    left = n
    while left:
        moved = False
        for r in range(P):
            p, t_r = pos[r], t_last[r]
            while p < olen[r]:
                i = order[r, p]
                t = t_r
                ok = True
                for q in range(pred_ptr[i], pred_ptr[i + 1]):
                    j = pred_idx[q]
                    if not done[j]:
                        ok = False
                        break
                    x = fin[j] + pred_delay[q]
                    if x > t:
                        t = x
                if not ok:
                    break
                beg[i] = t
                t_r = t + lat[i]
                fin[i] = t_r
                done[i] = True
                seq[ns] = i
                ns += 1
                p += 1
            if p != pos[r]:
                left -= p - pos[r]
                pos[r] = p
                t_last[r] = t_r
                moved = True
        if not moved:
            return 1, beg, fin, seq[:ns]
    return 0, beg, fin, seq
