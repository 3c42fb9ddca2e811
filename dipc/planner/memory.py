"""DIP's per-rank memory optimisation (shared/PAPER.md §2.5, searcher phase 3): one memory strategy per
forward-backward stage pair, chosen by a small ILP per pipeline rank.

* **Candidates.** A pair's strategies are "keep", "recompute:k" (each of the chunk's first k layers its own
  checkpoint: the per-layer strategy, Megatron's ``--recompute-method block``) and "recompute" (the whole chunk as
  one region), each with the bytes its forward keeps until the backward, the seconds the backward grows by (the
  forward of what it recomputes) and the bytes it rebuilds at once.  :func:`prune_options` keeps at most ``S`` of
  them (the paper's S = 10): the fastest, the most memory-efficient, and in each of S - 2 equal buckets of the memory range between them the fastest (a pair's
  strategies form one chain - more recompute, less memory - so the paper's multiple-choice knapsack per bucket is
  a pick along it).
* **ILP per rank** (:func:`optimize_memory`): variables ``o[i, j]`` in {0, 1} (pair i takes candidate j), each
  pair exactly one; minimise ``sum lat[i, j] * o[i, j]``; for every forward that opens a peak (followed by a
  backward in the rank's order, or last), the pairs live there (forward at or before it, backward after it) keep
  at most the rank's activation budget: ``sum mem[i, j] * o[i, j] <= M``.  The memory is counted on the rank's
  order, as :func:`dipc.schedule.order_peaks` and the simulator count it, so the chosen strategies fit whatever
  the latencies do to the timeline; the caller then re-times the fixed order with the chosen latencies.  Solved by
  HiGHS through ``scipy.optimize.milp`` with a 5% relative gap and a time limit.  scipy gives HiGHS no starting
  solution, so the greedy warm start of the paper is the fallback instead: a rank the solver leaves without a
  solution in time keeps what the greedy recompute fit (:func:`dipc.schedule.fit_by_recompute`) gave it.
* ``uniform``: one strategy per chunk for all its microbatches (a static schedule's user sets recompute once per
  chunk, as Megatron's flags do); the variables are then per (chunk, candidate).

Pure: works on a :class:`dipc.schedule.StageGraph` and per-rank orders; no process group.
"""
from __future__ import annotations

import functools
import time
from typing import Sequence

import numpy as np

from ..plan import PlanError
from ..schedule import StageGraph, fit_by_recompute, relax_recompute

__all__ = ["prune_options", "optimize_memory", "apply_option", "fit_order", "S_DEFAULT"]

S_DEFAULT = 10  #: candidates kept per stage pair (the paper's example)


def prune_options(options: Sequence[tuple[str, float, float]], S: int = S_DEFAULT) -> list[tuple[str, float, float]]:
    """At most ``S`` (>= 2) of a pair's ``(strategy, bytes, extra seconds)`` candidates, most bytes first: the
    Pareto front (no candidate both keeps more and is slower than another), then the fastest, the most
    memory-efficient and the fastest in each of ``S - 2`` equal buckets of the memory range between them.

    Raises:
        ValueError: ``S`` < 2 or no options.
    """
    if S < 2:
        raise ValueError(f"S must be >= 2, got {S}")
    if not options:
        raise ValueError("a stage pair needs at least one memory strategy")
    return list(_pruned(tuple(options), S))


@functools.lru_cache(maxsize=1 << 16)
def _pruned(options: tuple, S: int) -> tuple:
    """:func:`prune_options` of checked arguments, cached: a step's pairs keep their candidates over the search's
    rollouts, and each rollout prunes every pair of every rank again (28 ms of each 180 ms memory optimisation at
    VLM-S / 64 microbatches)."""
    front: list[tuple[str, float, float]] = []
    for o in sorted(options, key=lambda o: (-o[1], o[2])):
        if front and o[1] == front[-1][1]:
            continue  # as much memory and not faster
        while front and o[2] <= front[-1][2]:
            front.pop()  # o keeps less and is no slower
        front.append(o)
    if len(front) <= S:
        return tuple(front)
    hi, lo = front[0][1], front[-1][1]
    width = (hi - lo) / (S - 2)
    out = [front[0]]
    for b in range(S - 2, 0, -1):  # bucket (lo + (b-1) w, lo + b w]: its fastest is its largest
        top = lo + b * width
        pick = next((o for o in front if lo + (b - 1) * width < o[1] <= top and o not in out), None)
        if pick is not None:
            out.append(pick)
    if front[-1] not in out:
        out.append(front[-1])
    return tuple(out)


class _Candidates:
    """One pair's candidates for :func:`optimize_memory`: ``opts`` (most bytes first), their bytes ``mem`` and
    extra backward seconds ``extra`` as arrays, the least and most bytes, the fastest candidate's index (the least
    extra, then the most bytes) and the indices on the lower convex hull (:func:`_lower_hull`)."""

    __slots__ = ("opts", "mem", "extra", "least", "most", "fastest", "hull")

    def __init__(self, opts: tuple):
        self.opts = opts
        self.mem = np.fromiter((o[1] for o in opts), np.float64, len(opts))
        self.extra = np.fromiter((o[2] for o in opts), np.float64, len(opts))
        self.least, self.most = float(self.mem.min()), float(self.mem.max())
        self.fastest = min(range(len(opts)), key=lambda j: (opts[j][2], -opts[j][1]))
        self.hull = _lower_hull(tuple((o[1], o[2]) for o in opts))


@functools.lru_cache(maxsize=1 << 16)
def _table(options: tuple, S: int, prune: bool) -> _Candidates:
    return _Candidates(tuple(prune_options(options, S)) if prune else options)


def _candidates(st, S: int, uniform: bool) -> _Candidates:
    """The candidates of forward ``st``'s pair: its ``options`` pruned to ``S`` (all of them with ``uniform``), or
    its current strategy alone; cached on the options, which a pair keeps over a search's rollouts (the per-pair
    work was half of each memory optimisation at VLM-L / 64 microbatches)."""
    own = tuple(st.options) or ((st.strategy, st.activation_bytes, st.recompute_extra, st.rebuild_bytes),)
    return _table(own, S, not uniform)


def apply_option(graph: StageGraph, fk: str, option: tuple[str, float, float]) -> None:
    """Give forward ``fk`` and its backward the candidate ``option = (strategy, bytes, extra seconds[, rebuilt
    bytes])``: both count its bytes, the backward's latency is its "keep" latency plus ``extra`` and it rebuilds
    the given bytes while it runs (``Stage.rebuild_bytes``; without: all the forward did not keep); the forward
    remembers its "keep" bytes and the extra (``keep_bytes``, ``recompute_extra``) so that later passes can undo
    it."""
    st = graph.stages[fk]
    b = graph.stages["B" + fk[1:]]
    strategy, nbytes, extra = option[:3]
    keep = st.keep_bytes if st.keep_bytes is not None else st.activation_bytes
    b.latency += extra - st.recompute_extra
    st.recompute_extra = extra
    st.keep_bytes = None if strategy == "keep" else keep
    st.rebuild_bytes = option[3] if len(option) > 3 and strategy != "keep" else None
    for x in (st, b):
        x.strategy = strategy
        x.activation_bytes = nbytes


def optimize_memory(graph: StageGraph, order: Sequence[Sequence[str]], limits: Sequence[float | None], *,
                    uniform: bool = False, S: int = S_DEFAULT, gap: float = 0.05,
                    time_limit: float = 2.0) -> dict:
    """Choose every forward-backward pair's memory strategy on each rank with a limit (see the module docstring),
    least total recompute seconds under the rank's activation budget ``limits[r]`` (bytes) at every peak of its
    ``order``; writes the choice into ``graph``'s stages (:func:`apply_option`).  A forward's candidates are its
    ``options`` (none: its current strategy, fixed).

    Args:
        uniform: one candidate per chunk for all its microbatches (strategies matched by name).
        S: candidates kept per pair (:func:`prune_options`; not applied with ``uniform``).
        gap: the solver's relative optimality gap (the paper's 5%).
        time_limit: seconds the solver may take per rank.

    Returns:
        ``{"seconds": wall time, "solved": ranks the solver chose for, "unsolved": ranks left as they were,
        "pairs": pairs considered, "extra_s": sum of the chosen backward extras}``.

    Raises:
        PlanError: a rank's pairs exceed its budget at some peak even with every pair at its least memory (names
            the rank, the stage, the bytes and the budget).
    """
    from scipy.optimize import LinearConstraint
    from scipy.sparse import coo_matrix

    t0 = time.perf_counter()
    stats = {"seconds": 0.0, "solved": [], "unsolved": [], "pairs": 0, "extra_s": 0.0}
    for r, ks in enumerate(order):
        M = limits[r] if r < len(limits) else None
        if M is None or not ks:
            continue
        pos = {k: i for i, k in enumerate(ks)}
        pairs = [k for k in ks if graph.stages[k].kind == "F"]
        if not pairs:
            continue
        # each pair's candidates (most bytes first) as arrays, kept over a search's rollouts (_candidates)
        tabs = [_candidates(graph.stages[k], S, uniform) for k in pairs]
        n_of = np.fromiter((len(t.opts) for t in tabs), np.int64, len(tabs))
        if uniform:  # variables per (chunk, candidate): the strategies every pair of the chunk has
            names: dict[int, list[str]] = {}
            for k, t in zip(pairs, tabs):
                c = graph.stages[k].chunk
                here = [x[0] for x in t.opts]
                names[c] = here if c not in names else [n for n in names[c] if n in here]
            base_of, n_var = {}, 0
            for c in sorted(names):
                base_of[c] = n_var
                n_var += len(names[c])
            sel = []  # per pair: the indices of its candidates that are variables
            var_l = []
            for k, t in zip(pairs, tabs):
                c = graph.stages[k].chunk
                j_of = {x[0]: j for j, x in enumerate(t.opts)}
                sel.append(np.asarray([j_of[n] for n in names[c]], dtype=np.int64))
                var_l.append(base_of[c] + np.arange(len(names[c])))
            least_p = np.asarray([t.mem[j].min() for t, j in zip(tabs, sel)])
            most_p = np.asarray([t.mem[j].max() for t, j in zip(tabs, sel)])
        else:
            least_p = np.fromiter((t.least for t in tabs), np.float64, len(tabs))
            most_p = np.fromiter((t.most for t in tabs), np.float64, len(tabs))
        # peak rows: forwards followed by a backward (or last); pair i is live at row positions lo_i <= p < hi_i
        rows = [p for p, k in enumerate(ks) if k[0] == "F" and (p + 1 == len(ks) or ks[p + 1][0] == "B")]
        rows_a = np.asarray(rows, dtype=np.int64)
        lo = np.fromiter((pos[k] for k in pairs), np.int64, len(pairs))
        hi = np.fromiter((pos["B" + k[1:]] for k in pairs), np.int64, len(pairs))
        ra = np.searchsorted(rows_a, lo, side="left")
        rb = np.searchsorted(rows_a, hi, side="left")

        def levels(per_pair):
            d = np.zeros(len(rows) + 1)
            np.add.at(d, ra, per_pair)
            np.add.at(d, rb, -per_pair)
            return np.cumsum(d)[:-1]

        least, most = levels(least_p), levels(most_p)
        if len(rows) and least.max() > M * (1 + 1e-9):  # infeasible orders are refused before the solver
            p = int(np.argmax(least))
            raise PlanError(f"rank {r} keeps {least[p]:.4g} bytes of activations at {ks[rows[p]]} with every pair "
                            f"live there at its least memory, over its activation budget of {M:.4g} bytes (the "
                            "memory limit less the rank's parameters, gradients and optimizer states); give the "
                            "pipeline more memory, more ranks, or smaller microbatches")
        # a row that holds even with every pair at its most memory cannot bind: drop it; a pair live in no binding
        # row takes its fastest candidate outright (most of a rank, usually: the solver sees only the peaks)
        binding = most > M * (1 + 1e-9)
        keep_row = np.flatnonzero(binding)
        first_binding = np.concatenate([[0], np.cumsum(binding)])  # binding rows before each row index
        ra, rb = first_binding[ra], first_binding[rb]  # the binding rows each pair is live in
        free = rb == ra
        if uniform:  # a chunk is free only if every one of its pairs is
            busy = {graph.stages[pairs[i]].chunk for i in np.flatnonzero(~free)}
            free &= np.fromiter((graph.stages[k].chunk not in busy for k in pairs), bool, len(pairs))
        for i in np.flatnonzero(free):
            t = tabs[i]
            j = t.fastest if not uniform else min(sel[i], key=lambda q: (t.extra[q], -t.mem[q]))
            apply_option(graph, pairs[i], t.opts[j])
            stats["extra_s"] += t.opts[j][2]
        active = np.flatnonzero(~free)
        if not len(active):
            stats["pairs"] += len(pairs)
            stats["solved"].append(r)
            continue
        n_rows = len(keep_row)
        # the active pairs' variables: each pair's candidates in a run of columns (uniform: its chunk's run,
        # renumbered over the chunks of active pairs); ent_*: one entry per (active pair, candidate)
        if uniform:
            used = np.unique(np.concatenate([var_l[i] for i in active]))
            vmap = np.full(n_var, -1, dtype=np.int64)
            vmap[used] = np.arange(len(used))
            n_var = len(used)
            ent_var = np.concatenate([vmap[var_l[i]] for i in active])
            ent_mem = np.concatenate([tabs[i].mem[sel[i]] for i in active])
            ent_extra = np.concatenate([tabs[i].extra[sel[i]] for i in active])
            per = np.asarray([len(sel[i]) for i in active])
            starts = np.asarray(sorted({int(vmap[var_l[i][0]]) for i in active}), dtype=np.int64)
        else:
            per = n_of[active]
            n_var = int(per.sum())
            ent_var = np.arange(n_var)
            ent_mem = np.concatenate([tabs[i].mem for i in active])
            ent_extra = np.concatenate([tabs[i].extra for i in active])
            starts = np.concatenate([[0], np.cumsum(per)[:-1]]).astype(np.int64)
        c = np.zeros(n_var)
        np.add.at(c, ent_var, ent_extra)
        ent_ra = np.repeat(ra[active], per)
        ent_live = np.repeat(rb[active] - ra[active], per)
        nz = (ent_live > 0) & (ent_mem != 0)
        ri = ci = vals = None
        if nz.any():
            lens = ent_live[nz]
            within = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
            ri = np.repeat(ent_ra[nz], lens) + within
            ci = np.repeat(ent_var[nz], lens)
            vals = np.repeat(ent_mem[nz], lens)
        cons = []
        ends = np.concatenate([starts[1:], [n_var]])
        a_choice = coo_matrix((np.ones(n_var), (np.repeat(np.arange(len(starts)), ends - starts), np.arange(n_var))),
                              shape=(len(starts), n_var)).tocsr()
        cons.append(LinearConstraint(a_choice, 1, 1))
        if ri is not None:
            a_mem = coo_matrix((vals, (ri, ci)), shape=(n_rows, n_var)).tocsr()  # duplicates (uniform) sum
            cons.append(LinearConstraint(a_mem, -np.inf, M))
        t_solve = time.perf_counter()
        base = sum(graph.stages[pairs[i]].latency + graph.stages["B" + pairs[i][1:]].latency
                   - graph.stages[pairs[i]].recompute_extra for i in active)  # the pairs' "keep" seconds
        hull = None
        if not uniform:  # a pair's candidate has one byte count in every row it is live in
            hull = np.sort(np.concatenate([s0 + np.asarray(tabs[i].hull, dtype=np.int64)
                                          for s0, i in zip(starts, active)]))
        x, status, bound = _solve(c, cons, starts, M, gap, time_limit, base, hull)
        stats.setdefault("instances", []).append({"rank": r, "pairs": len(active), "variables": n_var,
                                                  "rows": n_rows, "seconds": time.perf_counter() - t_solve,
                                                  "how": status, "lower_bound_s": bound})
        stats["pairs"] += len(pairs)
        if x is None:
            stats["unsolved"].append(r)
            continue
        at = 0
        for i, n_i in zip(active, per):
            t, js = tabs[i], (sel[i] if uniform else None)
            vs = ent_var[at:at + n_i]
            at += n_i
            on = np.flatnonzero(x[vs])
            if len(on):
                j = int(on[0]) if js is None else int(js[on[0]])
            else:  # numerically ambiguous: take the least memory, always feasible
                cand = range(len(t.opts)) if js is None else js
                j = min(cand, key=lambda q: t.mem[q])
            apply_option(graph, pairs[i], t.opts[j])
            stats["extra_s"] += t.opts[j][2]
        stats["solved"].append(r)
    stats["seconds"] = time.perf_counter() - t0
    return stats


@functools.lru_cache(maxsize=1 << 16)
def _lower_hull(points: tuple) -> tuple:
    """Indices of a pair's candidates ``points = ((bytes, seconds), ...)`` on their lower convex hull, from the
    least memory to the fastest (cached: a pair keeps its candidates over a search's rollouts).  A pair's
    candidate adds the same bytes to every row the pair is live in, so any mix of its candidates in the LP
    relaxation can be replaced by a mix of hull points with no more bytes and no more seconds: the relaxation over
    the hull has the same optimum with fewer variables (at VLM-S / 64 microbatches, 10 -> ~4 per pair, and one
    rank's instance 20-30 ms -> 11-14 ms)."""
    pts = sorted(range(len(points)), key=lambda j: points[j])
    front: list[int] = []
    for j in pts:  # the Pareto front: each step to more memory must be faster
        if not front or points[j][1] < points[front[-1]][1]:
            front.append(j)
    hull: list[int] = []
    for j in front:
        (m, t) = points[j]
        while len(hull) >= 2:
            (ma, ta), (mb, tb) = points[hull[-2]], points[hull[-1]]
            if (mb - ma) * (t - ta) - (tb - ta) * (m - ma) <= 0:
                hull.pop()  # the middle point lies on or above the segment between its neighbours
            else:
                break
        hull.append(j)
    return tuple(hull)


def _solve(c, cons, starts, M, gap, time_limit, base=0.0, hull=None):
    """One rank's ILP: the LP relaxation first (a lower bound), rounded to integers by giving each group with a
    fractional choice its least-memory candidate used (every row then holds: memory only goes down), then greedy
    upgrades to faster candidates where every row still holds; when that is within ``gap`` of the bound it is
    taken (the common case, milliseconds), else HiGHS's branch and bound runs under ``time_limit`` and the better of
    the two is kept.  As in the paper the objective is the pairs' whole latency, ``base`` (their "keep" seconds)
    plus the recompute seconds ``c @ x``, and the gap is relative to it.  A group (a pair, or a chunk with
    ``uniform``) is a run of variables from ``starts[g]`` to the next start, its candidates ordered from the most
    memory to the least.  ``hull``: the variables the relaxation needs (each pair's lower hull,
    :func:`_lower_hull`; None: all).  Returns
    ``(x as bools or None, "lp-rounded" | "milp" | "none", lower bound)``."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    n = len(c)
    sub = hull if hull is not None else np.arange(n)  # the relaxation over each pair's lower hull: the same optimum
    # the memory rows in units of the budget (bytes of 1e9-1e10 beside the choice rows' ones): without presolve
    # the relaxation then takes 14 ms instead of 25 at VLM-L / 64 microbatches (presolve only when that fails)
    unit = M if M > 0 else 1.0
    lp_cons = [LinearConstraint(k.A[:, sub] / (unit if i else 1.0), k.lb, k.ub / (unit if i else 1.0))
               for i, k in enumerate(cons)]
    lp_x = None
    for presolve in (False, True):
        lp = milp(c[sub], constraints=lp_cons, integrality=np.zeros(len(sub)), bounds=Bounds(0, 1),
                  options={"presolve": presolve})
        if lp.x is not None:
            lp_x = np.zeros(n)
            lp_x[sub] = lp.x
            break
    if lp_x is None:
        return None, "none", float("nan")
    bound = float(lp.fun)
    ends = np.concatenate([starts[1:], [n]])
    idx = np.arange(n)
    last_used = np.maximum.reduceat(np.where(lp_x > 1e-9, idx, -1), starts)  # each group's least memory used
    cur = np.where(last_used >= 0, last_used, ends - 1)
    x = np.zeros(n, dtype=bool)
    x[cur] = True
    if len(cons) > 1:
        a_mem = cons[1].A.toarray()  # binding rows x variables: small (peaks x candidates), dense is fastest
        level = a_mem @ x
        cap = M * (1 + 1e-9)
        gain = c[cur] - np.minimum.reduceat(c, starts)
        for gi in np.argsort(-gain, kind="stable"):  # the largest saving first
            if gain[gi] <= 0:
                break
            v0 = cur[gi]
            g = np.arange(starts[gi], ends[gi])
            g = g[np.argsort(c[g], kind="stable")]  # fastest first
            g = g[c[g] < c[v0]]
            fits = ((level[:, None] + a_mem[:, g] - a_mem[:, [v0]]) <= cap).all(axis=0)
            if fits.any():
                v = g[int(np.argmax(fits))]
                level = level + a_mem[:, v] - a_mem[:, v0]
                x[v0], x[v] = False, True
    value = float(c @ x)
    if value + base <= (bound + base) * (1 + gap) + 1e-9:
        return x, "lp-rounded", bound
    rel = gap * (bound + base) / max(bound, 1e-12)  # HiGHS's gap is relative to c @ x alone
    res = milp(c, constraints=cons, integrality=np.ones(n), bounds=Bounds(0, 1),
               options={"mip_rel_gap": min(rel, 1.0), "time_limit": time_limit})
    if res.x is not None and float(res.fun) < value:
        return np.round(res.x).astype(bool), "milp", bound
    return x, "lp-rounded", bound


def copy_strategies(graph: StageGraph, source: StageGraph) -> None:
    """Give ``graph``'s stages ``source``'s memory strategies, bytes and latencies (not their priorities)."""
    for k, st in source.stages.items():
        o = graph.stages[k]
        o.strategy, o.activation_bytes, o.latency = st.strategy, st.activation_bytes, st.latency
        o.keep_bytes, o.recompute_extra, o.rebuild_bytes = st.keep_bytes, st.recompute_extra, st.rebuild_bytes


def fit_order(graph: StageGraph, order: Sequence[Sequence[str]], limits: Sequence[float | None], recompute_cost,
              pristine: StageGraph, *, ilp: bool = True) -> None:
    """Give a fixed per-rank order's pairs memory strategies under ``limits`` (bytes per rank): the per-rank ILP
    (:func:`optimize_memory`) alone when it solves every rank - its choice does not depend on the strategies the
    pairs had - else, as before it, the greedy fit (:func:`dipc.schedule.fit_by_recompute`, then
    :func:`dipc.schedule.relax_recompute`) with the ILP over it, the greedy's choice kept on the ranks the ILP
    leaves unsolved.  ``pristine``: the stages as they were (``graph``'s are restored from it before the greedy);
    ``ilp`` False: the greedy only.  Skipping the greedy when the ILP solves saves a fifth of a search rollout at
    VLM-L / 64 microbatches.

    Raises:
        PlanError: the order cannot fit, even with every pair at its least memory."""
    if ilp:
        if not optimize_memory(graph, order, limits)["unsolved"]:
            return
        copy_strategies(graph, pristine)  # the greedy starts where the pairs started
    fit_by_recompute(graph, order, limits, recompute_cost)
    relax_recompute(graph, order, limits)
    if ilp:
        optimize_memory(graph, order, limits)
