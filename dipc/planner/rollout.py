"""A search rollout on arrays (shared/PAPER.md §2.3-2.5): the interleaver, the per-rank memory ILP and the
re-timing of one MCTS permutation, compiled with numba.

DIP scores every permutation of the (microbatch, modality) groups by the simulated iteration time of its
schedule: the dual-queue list schedule (§2.4), then the memory strategy of every forward-backward pair chosen by
the per-rank ILP (§2.5), then the fixed order timed with the chosen latencies.  :func:`dipc.planner.search.
search_priorities` did that on :class:`dipc.schedule.StageGraph` objects: a copy of the step's 6000 stages per
rollout at VLM-L / 64 microbatches, then three Python loops over them (~140 ms a rollout on a 2-core VM).
:class:`Rollouts` numbers the stages once per search and runs the same three steps on arrays:

* :func:`list_kernel` is :func:`dipc.schedule._list_schedule_unlimited` (the window-only admission, or none), its
  heaps over ``(float, int)`` keys in preallocated arrays; a stage's priority tuple ``(-priority, mb, sub, chunk,
  key)`` becomes ``rank of -priority * n + rank of (mb, sub, chunk, key)``, which orders alike;
* :func:`_memory_rows` / :func:`_round` are :func:`dipc.planner.memory.optimize_memory`'s non-uniform path per
  rank (peak rows, the pairs bound by none take their fastest candidate, the LP relaxation over the lower hulls
  solved by the same :func:`dipc.planner.memory._lp` (HiGHS), its rounding and greedy upgrades);
* :func:`time_kernel` is :func:`dipc.schedule.timed_schedule`'s loop.

Each step does the same float operations in the same order as the object code, so a score is that code's to the
last bit (``tests/test_rollout.py`` compares them on random permutations).  Where the object code would take
another path - the ILP leaves a rank unsolved or misses its 5% gap (branch and bound), or a memory-aware admission
rollout (no window under a limit) - :meth:`Rollouts.score` returns None and the caller scores that permutation the
old way.  The schedule of the best permutation is always rebuilt by the object code.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from numba import njit

__all__ = ["Rollouts", "list_kernel", "time_kernel"]

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
    """:func:`dipc.schedule._list_schedule_unlimited` on arrays (one entry per stage ``i``; ``pkey[i]``: its
    priority as one int, smaller first, ``stage_of_key[pkey[i] % n] == i``; successors of ``i`` at
    ``succ_idx[succ_ptr[i]:succ_ptr[i + 1]]`` with the seconds from ``i``'s end to their earliest start;
    ``window`` < 0: none).  Returns ``(status, order [P, max stages per rank], per-rank lengths, start, end)``,
    status 0, or 1 (the window deadlocks), or 2 (a cycle)."""
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
    for i in range(n):
        if remaining[i] == 0:
            r = rank[i]
            if window >= 0 and not is_b[i] and mbs[i] >= first_open[r] + window:
                _hpush(k1, k2, size, 5 * P + r, float(mbs[i]), i)
            else:
                _admit(i, r, 1 if is_b[i] else 0, t_start, t_last, earliest, pkey, k1, k2, size, P)
    for _ in range(n):
        r = 0
        for q in range(1, P):
            if earliest[q] < earliest[r]:
                r = q
        if earliest[r] == _INF:
            for q in range(P):
                if size[5 * P + q] > 0:
                    return 1, order, olen, start, end
            return 2, order, olen, start, end
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
    return 0, order, olen, start, end


# -------------------------------------------------------------------------------------------------- timing
@njit(cache=True)
def time_kernel(order, olen, pred_ptr, pred_idx, pred_delay, lat):
    """:func:`dipc.schedule.timed_schedule`'s loop on arrays: each rank's ``order[r, :olen[r]]`` timed (a stage
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


# ------------------------------------------------------------------------------------------ memory per rank
@njit(cache=True)
def _levels(n_rows, ra, rb, x):
    d = np.zeros(n_rows + 1)
    for i in range(ra.shape[0]):
        d[ra[i]] += x[i]
    for i in range(rb.shape[0]):
        d[rb[i]] += -x[i]
    return np.cumsum(d)[:-1]


@njit(cache=True)
def _memory_rows(ks, is_b, pair_of, n_all, least_p, most_p, fastest, path_ptr, path, c_ptr, c_mem, c_extra,
                 seg_ptr, seg_cost, seg_save, M, choice):
    """One rank's instance of :func:`dipc.planner.memory.optimize_memory` (non-uniform) up to the LP: ``ks`` its
    order (stage indices).  Gives each pair bound by no peak row its fastest candidate (``choice[pair]``, a local
    candidate index) and returns ``(status, active pairs, their first and last binding row, binding rows,
    hull steps of a pair with no LP, fastest points' extra seconds summed, LP: cost, column starts, row indices,
    values, rows, right-hand sides; the segments' owners and bytes saved)``; status 0: solved without an LP,
    1: an LP to solve, 2: infeasible (a row over ``M`` with every pair at its least memory; the row's position
    in ``ks`` is returned as the active pairs' first entry)."""
    L = ks.shape[0]
    n_pairs = 0
    for p in range(L):
        if not is_b[ks[p]]:
            n_pairs += 1
    pairs = np.empty(n_pairs, np.int64)
    lo = np.empty(n_pairs, np.int64)
    at = 0
    n_rows_all = 0
    for p in range(L):
        i = ks[p]
        if not is_b[i]:
            pairs[at] = pair_of[i]
            lo[at] = p
            at += 1
            if p + 1 == L or is_b[ks[p + 1]]:
                n_rows_all += 1
    rows = np.empty(n_rows_all, np.int64)
    at = 0
    for p in range(L):
        if not is_b[ks[p]] and (p + 1 == L or is_b[ks[p + 1]]):
            rows[at] = p
            at += 1
    where = np.full(n_all, -1, np.int64)  # pair -> position of its backward in ks
    for p in range(L):
        i = ks[p]
        if is_b[i]:
            where[pair_of[i]] = p
    hi = np.empty(n_pairs, np.int64)
    for a in range(n_pairs):
        hi[a] = where[pairs[a]]
    ra = np.searchsorted(rows, lo)
    rb = np.searchsorted(rows, hi)
    lp_ = np.empty(n_pairs)
    mp_ = np.empty(n_pairs)
    for a in range(n_pairs):
        lp_[a] = least_p[pairs[a]]
        mp_[a] = most_p[pairs[a]]
    least = _levels(n_rows_all, ra, rb, lp_)
    most = _levels(n_rows_all, ra, rb, mp_)
    e_i = np.empty(0, np.int64)
    e_f = np.empty(0)
    if n_rows_all and least.max() > M * (1 + 1e-9):
        bad = np.empty(1, np.int64)
        bad[0] = rows[np.argmax(least)]
        return 2, bad, e_i, e_i, 0, e_i, 0.0, e_f, e_i, e_i, e_f, 0, e_f, e_i, e_f
    cap = M * (1 + 1e-9)
    first_binding = np.zeros(n_rows_all + 1, np.int64)
    for q in range(n_rows_all):
        first_binding[q + 1] = first_binding[q] + (1 if most[q] > cap else 0)
    n_rows = first_binding[n_rows_all]
    n_act = 0
    for a in range(n_pairs):
        ra[a] = first_binding[ra[a]]
        rb[a] = first_binding[rb[a]]
        if rb[a] == ra[a]:
            choice[pairs[a]] = fastest[pairs[a]]
        else:
            n_act += 1
    act = np.empty(n_act, np.int64)
    ra_a = np.empty(n_act, np.int64)
    rb_a = np.empty(n_act, np.int64)
    at = 0
    for a in range(n_pairs):
        if rb[a] != ra[a]:
            act[at] = pairs[a]
            ra_a[at] = ra[a]
            rb_a[at] = rb[a]
            at += 1
    if n_act == 0:
        return 0, act, ra_a, rb_a, n_rows, e_i, 0.0, e_f, e_i, e_i, e_f, 0, e_f, e_i, e_f
    # the relaxation (memory._relax): every active pair at its fastest hull point, the rows' bytes to save
    n_seg = np.empty(n_act, np.int64)
    fast_mem = np.empty(n_act)
    fast_extra = 0.0
    for a in range(n_act):
        pr = act[a]
        n_seg[a] = seg_ptr[pr + 1] - seg_ptr[pr]
        j0 = path[path_ptr[pr]]
        fast_mem[a] = c_mem[c_ptr[pr] + j0]
        fast_extra += c_extra[c_ptr[pr] + j0]
    need = _levels(n_rows, ra_a, rb_a, fast_mem) - M
    tight = need > M * 1e-9
    steps0 = np.zeros(n_act, np.int64)
    if not tight.any() or n_seg.sum() == 0:
        return 0, act, ra_a, rb_a, n_rows, steps0, fast_extra, e_f, e_i, e_i, e_f, 0, e_f, e_i, e_f
    first = np.zeros(n_rows + 1, np.int64)
    for q in range(n_rows):
        first[q + 1] = first[q] + (1 if tight[q] else 0)
    n_s = n_seg.sum()
    owner = np.empty(n_s, np.int64)
    cost = np.empty(n_s)
    save = np.empty(n_s)
    lens = np.empty(n_s, np.int64)
    vals = np.empty(n_s)
    at = 0
    for a in range(n_act):
        pr = act[a]
        for s in range(seg_ptr[pr], seg_ptr[pr + 1]):
            owner[at] = a
            cost[at] = seg_cost[s]
            save[at] = seg_save[s]
            vals[at] = seg_save[s] / M
            lens[at] = first[rb_a[a]] - first[ra_a[a]] if vals[at] != 0 else 0
            at += 1
    col = np.zeros(n_s + 1, np.int64)
    for s in range(n_s):
        col[s + 1] = col[s] + lens[s]
    index = np.empty(col[n_s], np.int64)
    value = np.empty(col[n_s])
    for s in range(n_s):
        base = first[ra_a[owner[s]]]
        for q in range(lens[s]):
            index[col[s] + q] = base + q
            value[col[s] + q] = -vals[s]
    m = first[n_rows]
    b_ub = np.empty(m)
    at = 0
    for q in range(n_rows):
        if tight[q]:
            b_ub[at] = -need[q] / M
            at += 1
    return 1, act, ra_a, rb_a, n_rows, steps0, fast_extra, cost, col, index, value, m, b_ub, owner, save



@njit(cache=True)
def _round(act, ra_a, rb_a, n_rows, steps, z, owner, save, path_ptr, path, c_ptr, c_mem, c_extra, bs_order, M,
           choice):
    """:func:`dipc.planner.memory._relax`'s hull steps from the LP solution ``z`` (when ``z`` is not empty),
    then :func:`dipc.planner.memory._solve_pairs`' rounding and greedy upgrades, written to ``choice``.  Returns
    the chosen candidates' extra seconds summed."""
    n_act = act.shape[0]
    if z.shape[0]:
        saved = np.zeros(n_act)
        for s in range(owner.shape[0]):
            saved[owner[s]] += save[s] * z[s]
        excl = np.cumsum(save) - save
        # each pair's first segment (a pair's segments are contiguous, in pair order)
        cnt = np.zeros(n_act, np.int64)
        for s in range(owner.shape[0]):
            cnt[owner[s]] += 1
        begin = np.zeros(n_act, np.int64)
        at = 0
        for a in range(n_act):
            begin[a] = at
            at += cnt[a]
        for s in range(owner.shape[0]):
            a = owner[s]
            before = excl[s] - excl[begin[a]]
            if saved[a] - before > 1e-9 * save[s]:
                steps[a] += 1
    js = np.empty(n_act, np.int64)
    mem = np.empty(n_act)
    gain = np.empty(n_act)
    for a in range(n_act):
        pr = act[a]
        j = path[path_ptr[pr] + steps[a]]
        js[a] = j
        mem[a] = c_mem[c_ptr[pr] + j]
        gain[a] = c_extra[c_ptr[pr] + j] - c_extra[c_ptr[pr] + bs_order[c_ptr[pr]]]
    level = _levels(n_rows, ra_a, rb_a, mem)
    cap = M * (1 + 1e-9)
    for a in np.argsort(-gain, kind="mergesort"):  # the largest saving first
        if gain[a] <= 0:
            break
        pr, j0 = act[a], js[a]
        c0 = c_ptr[pr]
        lo, hi = ra_a[a], rb_a[a]
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


class Rollouts:
    """One search's rollouts on arrays (see the module docstring): the step's stage graph numbered once, then
    :meth:`score` per permutation of the groups.

    Args:
        graph: the search's stage graph (its stages as the rollouts start from: strategies, latencies, the
            ``options`` each pair may take); not modified.
        P: pipeline ranks.
        comm: edge -> transfer seconds (or None).
        limits: per-rank activation budgets in bytes, or None (no limit: a rollout is one list schedule).
        window: under a limit, the in-flight window of the rollouts' list schedule (microbatches per rank); a
            limit without a window is not supported (ValueError).
        groups: the (microbatch, modality) groups whose permutations are scored.
        S: candidates per pair (:data:`dipc.planner.memory.S_DEFAULT`, as the object code's ILP).
    """

    def __init__(self, graph, P: int, comm, limits: Sequence[float | None] | None, window: int | None,
                 groups: Sequence, S: int | None = None):
        from ..schedule import _indexed, _indexed_preds, _no_comm
        from .memory import S_DEFAULT, _candidates

        comm = comm or _no_comm
        limited = limits is not None and any(x is not None for x in limits)
        if limited and window is None:
            raise ValueError("array rollouts under a memory limit need the window family (window=None: the "
                             "memory-aware admission, scored by the object code)")
        self.P, self.window, self.limited = P, (window if limited else None), limited
        self.limits = list(limits) if limited else [None] * P
        keys, succ, n_pred = _indexed(graph, comm)
        at, pred = _indexed_preds(graph, comm)
        stages = [graph.stages[k] for k in keys]
        n = self.n = len(keys)
        self.rank = np.array([st.rank for st in stages], np.int64)
        self.is_b = np.array([st.kind == "B" for st in stages], np.bool_)
        self.mbs = np.array([st.mb for st in stages], np.int64)
        if n and (self.mbs.min() < 0 or self.rank.min() < 0 or self.rank.max() >= P):
            raise ValueError("stages need microbatches >= 0 and ranks in [0, P)")
        self.n_mb = int(self.mbs.max()) + 1 if n else 1
        self.lat = np.array([st.latency for st in stages], np.float64)
        tie = sorted(range(n), key=lambda i: (stages[i].mb, stages[i].sub, stages[i].chunk, keys[i]))
        self.stage_of_key = np.array(tie, np.int64)
        self.tb = np.empty(n, np.int64)
        self.tb[self.stage_of_key] = np.arange(n)
        g_of = {g: x for x, g in enumerate(groups)}
        self.group_of = np.array([g_of[(st.mb, st.modality)] for st in stages], np.int64)
        self.succ_ptr, self.succ_idx, self.succ_delay = _csr(succ)
        self.pred_ptr, self.pred_idx, self.pred_delay = _csr(pred)
        self.n_pred = np.diff(self.pred_ptr)
        # forward-backward pairs and their candidates, flattened (memory._Candidates of each forward's options)
        S = S_DEFAULT if S is None else S
        fwd = [i for i in range(n) if not self.is_b[i]]
        self.pair_of = np.full(n, -1, np.int64)
        pair_b, tabs = [], []
        for p, i in enumerate(fwd):
            b = at["B" + keys[i][1:]]
            self.pair_of[i] = self.pair_of[b] = p
            pair_b.append(b)
            tabs.append(_candidates(stages[i], S, False))
        self.pair_b = np.array(pair_b, np.int64)
        self.c_ptr = _ptr([len(t.opts) for t in tabs])
        self.c_mem = _cat([t.mem for t in tabs])
        self.c_extra = _cat([t.extra for t in tabs])
        self.bs_order = np.array([j for t in tabs for j in t.by_speed], np.int64)
        self.fastest = np.array([t.fastest for t in tabs], np.int64)
        self.path_ptr = _ptr([len(t.path) for t in tabs])
        self.path = np.array([j for t in tabs for j in t.path], np.int64)
        self.seg_ptr = _ptr([len(t.seg_cost) for t in tabs])
        self.seg_cost = _cat([t.seg_cost for t in tabs])
        self.seg_save = _cat([t.seg_save for t in tabs])
        self.least_p = np.array([t.least for t in tabs], np.float64)
        self.most_p = np.array([t.most for t in tabs], np.float64)
        # each pair's "keep" seconds (the ILP's gap is relative to them plus the extras), its forward's extra
        # seconds and its backward's latency as the rollouts start
        self.base_p = np.array([stages[i].latency + stages[b].latency - stages[i].recompute_extra
                                for i, b in zip(fwd, pair_b)], np.float64)
        self.rex = np.array([stages[i].recompute_extra for i in fwd], np.float64)
        self.lat_b = np.array([stages[b].latency for b in pair_b], np.float64)
        self.pair_rank = np.array([stages[i].rank for i in fwd], np.int64)
        self.fallbacks = 0  # permutations score() left to the object code

    def pkey(self, perm_pos: np.ndarray) -> np.ndarray:
        """Every stage's priority key for groups at positions ``perm_pos`` (position 0: highest priority)."""
        return perm_pos[self.group_of] * self.n + self.tb

    def schedule(self, perm_pos: np.ndarray):
        """The list schedule of a permutation: ``(status, order, per-rank lengths, start, end)``
        (:func:`list_kernel`)."""
        return list_kernel(self.P, self.rank, self.is_b, self.mbs, self.pkey(perm_pos), self.stage_of_key,
                           self.succ_ptr, self.succ_idx, self.succ_delay, self.n_pred, self.lat,
                           -1 if self.window is None else self.window, self.n_mb)

    def score(self, perm_pos: np.ndarray, gap: float = 0.05) -> float | None:
        """The simulated iteration time (seconds) of the permutation giving group ``x`` the position
        ``perm_pos[x]`` (an int array), as :func:`dipc.planner.search.search_priorities` scores it (``inf``:
        it cannot fit, or its window deadlocks), or None where the object code takes a path not done here
        (a rank's LP without a solution or outside the ILP's ``gap``: the greedy fit or branch and bound)."""
        from .memory import _lp

        status, order, olen, _, end = self.schedule(perm_pos)
        if status == 1:
            return _INF
        if status == 2:
            raise ValueError("the stage graph has a cycle")
        if not self.limited:
            return float(end.max()) if self.n else 0.0
        choice = np.full(len(self.pair_b), -1, np.int64)
        for r in range(self.P):
            M = self.limits[r] if r < len(self.limits) else None
            if M is None or not olen[r]:
                continue
            ks = order[r, :olen[r]]
            (st, act, ra_a, rb_a, n_rows, steps, fast_extra, cost, col, index, value, m, b_ub, owner,
             save) = _memory_rows(ks, self.is_b, self.pair_of, len(self.pair_b), self.least_p, self.most_p,
                                  self.fastest, self.path_ptr, self.path, self.c_ptr, self.c_mem, self.c_extra,
                                  self.seg_ptr, self.seg_cost, self.seg_save, float(M), choice)
            if st == 2:
                return _INF  # the object code's PlanError: every pair at its least memory is over the budget
            if not len(act):
                continue
            z = np.empty(0)
            bound = fast_extra
            if st == 1:
                got = _lp(cost, (col, index, value), int(m), b_ub)
                if got is None:
                    self.fallbacks += 1
                    return None
                z, fun = got
                bound = fast_extra + fun
            val = _round(act, ra_a, rb_a, n_rows, steps, z, owner, save, self.path_ptr, self.path, self.c_ptr,
                         self.c_mem, self.c_extra, self.bs_order, float(M), choice)
            base = 0.0
            for x in self.base_p[act].tolist():
                base += x
            if not val + base <= (bound + base) * (1 + gap) + 1e-9:
                self.fallbacks += 1
                return None  # the object code's branch and bound
        lat = self.lat.copy()
        on = np.flatnonzero(choice >= 0)
        lat[self.pair_b[on]] = self.lat_b[on] + (self.c_extra[self.c_ptr[on] + choice[on]] - self.rex[on])
        status, _, fin, _ = time_kernel(order, olen, self.pred_ptr, self.pred_idx, self.pred_delay, lat)
        if status:
            return _INF
        return float(fin.max()) if self.n else 0.0


def _csr(lists):
    """``[[(index, seconds), ...], ...]`` as ``(ptr, index, seconds)`` arrays."""
    ptr = _ptr([len(x) for x in lists])
    idx = np.array([d for x in lists for d, _ in x], np.int64)
    sec = np.array([s for x in lists for _, s in x], np.float64)
    return ptr, idx, sec


def _ptr(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.asarray(lengths, np.int64))]).astype(np.int64)


def _cat(arrays) -> np.ndarray:
    return np.concatenate(arrays).astype(np.float64) if arrays else np.empty(0)
