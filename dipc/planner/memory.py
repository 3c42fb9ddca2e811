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
  order, as :func:`dipc.planner.fitting.order_peaks` and the simulator count it, so the chosen strategies fit whatever
  the latencies do to the timeline; the caller then re-times the fixed order with the chosen latencies.  Solved
  by its LP relaxation (in incremental form over each pair's lower hull, :meth:`CandidateTable.relax`: a min-cost
  flow, as a pair covers an interval of rows) rounded and greedily improved, and HiGHS's branch and bound
  (``scipy.optimize.milp``) only when that is not within the 5% relative gap of the relaxation's bound
  (:func:`_solve_pairs`), under a time limit.  scipy gives HiGHS no starting
  solution, so the greedy warm start of the paper is the fallback instead: a rank the solver leaves without a
  solution in time keeps what the greedy recompute fit (:func:`dipc.planner.fitting.fit_by_recompute`) gave it.
* ``uniform``: one strategy per chunk for all its microbatches (a static schedule's user sets recompute once per
  chunk, as Megatron's flags do); the variables are then per (chunk, candidate).

Pure: works on a :class:`dipc.stages.StageGraph` and per-rank orders; no process group.
"""
from __future__ import annotations

import collections
import functools
import time
from typing import Sequence

import numpy as np

from ..plan import PlanError, backward_key, forward_key
from ..stages import StageGraph
from .fitting import fit_by_recompute, relax_recompute
from .host_memory import within_host
from .memory_kernels import hull_steps, interval_cover_lp, rank_rows, relax_inputs, round_up

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
    extra, then the most bytes), ``path``: the indices on the lower convex hull (:func:`_lower_hull`) from the
    fastest to the least memory, with ``seg_cost`` / ``seg_save`` the seconds and bytes of each step along it,
    ``by_speed``: every index, fastest first; ``mem_l`` / ``extra_l``: the arrays as lists (scalar reads)."""

    __slots__ = ("opts", "mem", "extra", "least", "most", "fastest", "path", "seg_cost", "seg_save",
                 "by_speed", "mem_l", "extra_l")

    def __init__(self, opts: tuple):
        self.opts = opts
        self.mem = np.fromiter((o[1] for o in opts), np.float64, len(opts))
        self.extra = np.fromiter((o[2] for o in opts), np.float64, len(opts))
        self.mem_l, self.extra_l = self.mem.tolist(), self.extra.tolist()
        self.least, self.most = float(self.mem.min()), float(self.mem.max())
        self.fastest = min(range(len(opts)), key=lambda j: (opts[j][2], -opts[j][1]))
        # the lower hull from its fastest point to its least memory, and the segments between neighbours: the
        # seconds each step adds and the bytes it saves (the incremental form of the relaxation, CandidateTable.relax)
        self.path = _lower_hull(tuple((o[1], o[2]) for o in opts))[::-1]
        p = np.asarray(self.path, dtype=np.int64)
        self.seg_cost, self.seg_save = np.diff(self.extra[p]), -np.diff(self.mem[p])
        self.by_speed = sorted(range(len(opts)), key=lambda j: self.extra_l[j])  # stable: most bytes first on ties


@functools.lru_cache(maxsize=1 << 16)
def _table(options: tuple, S: int, prune: bool) -> _Candidates:
    return _Candidates(tuple(prune_options(options, S)) if prune else options)


def _candidates(st, S: int, uniform: bool) -> _Candidates:
    """The candidates of forward ``st``'s pair: its ``options`` pruned to ``S`` (all of them with ``uniform``), or
    its current strategy alone; cached on the options, which a pair keeps over a search's rollouts (the per-pair
    work was half of each memory optimisation at VLM-L / 64 microbatches)."""
    opts = st.options
    if opts and isinstance(opts, tuple):  # the copies of a stage share its options tuple: found by identity
        hit = _BY_ID.get((id(opts), S, uniform))
        if hit is not None and hit[0] is opts:
            return hit[1]
        if len(_BY_ID) >= 1 << 16:
            _BY_ID.clear()
        t = _BY_ID[(id(opts), S, uniform)] = (opts, _table(opts, S, not uniform))
        return t[1]
    own = tuple(opts) or ((st.strategy, st.activation_bytes, st.recompute_extra, st.rebuild_bytes),)
    return _table(own, S, not uniform)


_BY_ID: dict[tuple, tuple] = {}  # (id(options), S, uniform) -> (options, _Candidates); holds options: ids not reused


def apply_option(graph: StageGraph, fk: str, option: tuple[str, float, float]) -> None:
    """Give forward ``fk`` and its backward the candidate ``option = (strategy, bytes, extra seconds[, rebuilt
    bytes[, host bytes]])``: both count its bytes, the backward's latency is its "keep" latency plus ``extra`` and
    it rebuilds the given bytes while it runs (``Stage.rebuild_bytes``; without: all the forward did not keep); an
    offloading strategy's forward holds the host bytes (``Stage.host_bytes``); the forward remembers its "keep"
    bytes and the extra (``keep_bytes``, ``recompute_extra``) so that later passes can undo it."""
    _apply(graph.stages[fk], graph.stages[backward_key(fk)], option)


def _apply(st, b, option: tuple) -> None:
    """:func:`apply_option` on the forward stage ``st`` and its backward ``b``."""
    strategy, nbytes, extra = option[:3]
    if strategy == "keep" and st.strategy == "keep" and b.strategy == "keep" and st.keep_bytes is None \
            and st.rebuild_bytes is None and st.recompute_extra == extra and st.activation_bytes == nbytes \
            and b.activation_bytes == nbytes:
        return  # already so (most pairs of a rollout): every assignment below would leave it as it is
    st.host_bytes = option[4] if len(option) > 4 else 0.0
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
    t0 = time.perf_counter()
    stats = {"seconds": 0.0, "solved": [], "unsolved": [], "pairs": 0, "extra_s": 0.0}
    for r, ks in enumerate(order):
        M = limits[r] if r < len(limits) else None
        if M is None or not ks:
            continue
        pairs = [k for k in ks if k[0] == "F"]  # a stage's key starts with its kind (dipc.plan.stage_key)
        if not pairs:
            continue
        stages = graph.stages
        fwd = [stages[k] for k in pairs]
        bkeys = [backward_key(k) for k in pairs]
        bwd = [stages[k] for k in bkeys]
        # each pair's candidates (most bytes first) as arrays, kept over a search's rollouts (_candidates; its
        # cache hit inlined: a call per pair was a tenth of a VLM-L / 64-microbatch memory optimisation)
        get, tabs = _BY_ID.get, []
        for st in fwd:
            o = st.options
            hit = get((id(o), S, uniform))
            tabs.append(hit[1] if hit is not None and hit[0] is o else _candidates(st, S, uniform))
        n_of = np.fromiter((len(t.opts) for t in tabs), np.int64, len(tabs))
        if uniform:  # variables per (chunk, candidate): the strategies every pair of the chunk has
            names: dict[int, list[str]] = {}
            for k, t in zip(pairs, tabs):
                c = graph.stages[k].chunk
                here = [x[0] for x in t.opts]
                names[c] = here if c not in names else [n for n in names[c] if n in here]
            # a group's candidates from the most memory to the least (what _solve's rounding assumes): by their
            # bytes over the chunk's pairs, the options' own order kept on ties
            total: dict[tuple[int, str], float] = collections.defaultdict(float)
            for k, t in zip(pairs, tabs):
                c = graph.stages[k].chunk
                for o in t.opts:
                    total[(c, o[0])] += o[1]
            for c in names:
                names[c] = sorted(names[c], key=lambda n, c=c: -total[(c, n)])
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
            least_p = np.asarray([t.mem[j].min() for t, j in zip(tabs, sel)], np.float64)
            most_p = np.asarray([t.mem[j].max() for t, j in zip(tabs, sel)], np.float64)
        else:
            least_p = np.fromiter((t.least for t in tabs), np.float64, len(tabs))
            most_p = np.fromiter((t.most for t in tabs), np.float64, len(tabs))
        # peak rows: forwards followed by a backward (or last); each pair is live in the binding rows ra <= row < rb
        # (the rows that hold even with every pair at its most memory cannot bind and are dropped); the order's
        # stages numbered by their position, each backward given its forward's pair
        at_pair = {k: i for i, k in enumerate(pairs)}
        is_b = np.fromiter((k[0] == "B" for k in ks), np.bool_, len(ks))
        pair_of = np.fromiter((at_pair[k] if k[0] == "F" else at_pair[forward_key(k)] for k in ks), np.int64, len(ks))
        status, _, ra, rb, n_rows, bad, bad_bytes = rank_rows(np.arange(len(ks)), is_b, pair_of, len(pairs),
                                                                least_p, most_p, float(M))
        if status:  # infeasible orders are refused before the solver
            raise PlanError(f"rank {r} keeps {bad_bytes:.4g} bytes of activations at {ks[int(bad)]} with every pair "
                            f"live there at its least memory, over its activation budget of {M:.4g} bytes (the "
                            "memory limit less the rank's parameters, gradients and optimizer states); give the "
                            "pipeline more memory, more ranks, or smaller microbatches")
        # a pair live in no binding row takes its fastest candidate outright (most of a rank, usually: the solver
        # sees only the peaks)
        free = rb == ra
        if uniform:  # a chunk is free only if every one of its pairs is
            busy = {graph.stages[pairs[i]].chunk for i in np.flatnonzero(~free)}
            free &= np.fromiter((graph.stages[k].chunk not in busy for k in pairs), bool, len(pairs))
        active = np.flatnonzero(~free)
        base = sum(fwd[i].latency + bwd[i].latency - fwd[i].recompute_extra
                   for i in active.tolist())  # the pairs' "keep" seconds

        def choose(tabs):
            """Per pair, the index of its chosen candidate in ``tabs[i].opts`` (None: the solver found none)."""
            js_all = [0] * len(pairs)
            for i in np.flatnonzero(free).tolist():
                t = tabs[i]
                js_all[i] = t.fastest if not uniform else min(sel[i], key=lambda q: (t.extra[q], -t.mem[q]))
            if not len(active):
                return js_all
            t_solve = time.perf_counter()
            if uniform:
                js, status, bound, n_used = _solve_uniform([tabs[i] for i in active], [sel[i] for i in active],
                                                           [var_l[i] for i in active], n_var, ra[active],
                                                           rb[active], n_rows, M, gap, time_limit, base)
            else:
                js, status, bound = _solve_pairs([tabs[i] for i in active], ra[active], rb[active], n_rows, M, gap,
                                                 time_limit, base)
                n_used = int(n_of[active].sum())
            stats.setdefault("instances", []).append({"rank": r, "pairs": len(active), "variables": n_used,
                                                      "rows": n_rows, "seconds": time.perf_counter() - t_solve,
                                                      "how": status, "lower_bound_s": bound})
            if js is None:
                return None
            for i, j in zip(active.tolist(), js):
                js_all[i] = j
            return js_all

        js_all = choose(tabs)
        chosen = None if js_all is None else [t.opts[j] for t, j in zip(tabs, js_all)]
        host_M = fwd[0].host_limit
        if chosen is not None and host_M is not None:
            busy_s = sum(f.latency + b.latency - f.recompute_extra for f, b in zip(fwd, bwd))
            chosen = within_host(ks, at_pair, fwd, tabs, js_all, host_M, busy_s, choose,
                                 lambda opts: _table(opts, S, not uniform))
        stats["pairs"] += len(pairs)
        if chosen is None:
            stats["unsolved"].append(r)
            continue
        for i, o in enumerate(chosen):
            _apply(fwd[i], bwd[i], o)
            stats["extra_s"] += o[2]
        stats["solved"].append(r)
    stats["seconds"] = time.perf_counter() - t0
    return stats


def _interval_entries(lo, hi, cols, vals):
    """Sparse entries ``(rows, cols, values)`` of columns ``cols`` that hold ``vals`` in rows ``lo <= row < hi``
    (a pair's bytes in every peak row it is live in)."""
    lens = hi - lo
    k = (lens > 0) & (vals != 0)
    lens, lo, cols, vals = lens[k], lo[k], cols[k], vals[k]
    within = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
    return np.repeat(lo, lens) + within, np.repeat(cols, lens), np.repeat(vals, lens)


def _mckp_constraints(starts, n_var, rows, cols, vals, n_rows, M):
    """The ILP's constraints: one candidate per group (a run of variables from ``starts[g]``), and the memory rows
    ``sum mem * x <= M`` from the entries ``(rows, cols, vals)`` (duplicates sum)."""
    from scipy.optimize import LinearConstraint
    from scipy.sparse import coo_matrix

    ends = np.concatenate([starts[1:], [n_var]])
    a_choice = coo_matrix((np.ones(n_var), (np.repeat(np.arange(len(starts)), ends - starts), np.arange(n_var))),
                          shape=(len(starts), n_var)).tocsr()
    cons = [LinearConstraint(a_choice, 1, 1)]
    if len(rows):
        cons.append(LinearConstraint(coo_matrix((vals, (rows, cols)), shape=(n_rows, n_var)).tocsr(), -np.inf, M))
    return cons


def _solve_uniform(tabs, sel, var_l, n_var, ra, rb, n_rows, M, gap, time_limit, base):
    """The ``uniform`` instance (variables per (chunk, candidate), shared by the chunk's pairs) by :func:`_solve`;
    returns ``(each pair's candidate index or None, how, lower bound, variables)``."""
    used = np.unique(np.concatenate(var_l))
    vmap = np.full(n_var, -1, dtype=np.int64)
    vmap[used] = np.arange(len(used))
    n_var = len(used)
    ent_var = np.concatenate([vmap[v] for v in var_l])
    ent_mem = np.concatenate([t.mem[j] for t, j in zip(tabs, sel)])
    ent_extra = np.concatenate([t.extra[j] for t, j in zip(tabs, sel)])
    per = np.asarray([len(j) for j in sel])
    starts = np.asarray(sorted({int(vmap[v[0]]) for v in var_l}), dtype=np.int64)
    c = np.zeros(n_var)
    np.add.at(c, ent_var, ent_extra)
    rows, cols, vals = _interval_entries(np.repeat(ra, per), np.repeat(rb, per), ent_var, ent_mem)
    cons = _mckp_constraints(starts, n_var, rows, cols, vals, n_rows, M)
    x, status, bound = _solve(c, cons, starts, M, gap, time_limit, base)
    if x is None:
        return None, status, bound, n_var
    js, at = [], 0
    for t, j_sel, n_i in zip(tabs, sel, per):
        on = np.flatnonzero(x[ent_var[at:at + n_i]])
        at += n_i
        # numerically ambiguous (none on): the least memory, always feasible
        js.append(int(j_sel[on[0]]) if len(on) else int(min(j_sel, key=lambda q: t.mem[q])))
    return js, status, bound, n_var


class CandidateTable:
    """Pairs' candidates (:class:`_Candidates`, pair ``p`` the ``p``-th) as the arrays of
    :mod:`dipc.planner.kernels`: candidate ``j`` of pair ``p`` at ``c_ptr[p] + j`` of ``c_mem`` (bytes) and
    ``c_extra`` (seconds); ``bs_order[c_ptr[p]:c_ptr[p + 1]]`` its candidates fastest first; ``fastest[p]``,
    ``least[p]``, ``most[p]``; its lower hull ``path[path_ptr[p]:...]`` from the fastest point and the hull's
    segments ``seg_cost`` / ``seg_save`` from ``seg_ptr[p]``."""

    def __init__(self, tabs: Sequence[_Candidates]):
        def ptr(lengths):
            out = np.zeros(len(tabs) + 1, np.int64)
            np.cumsum(np.fromiter(lengths, np.int64, len(tabs)), out=out[1:])
            return out

        def cat(arrays):
            return np.concatenate(arrays).astype(np.float64) if len(tabs) else np.empty(0)

        self.c_ptr = ptr(len(t.opts) for t in tabs)
        self.c_mem, self.c_extra = cat([t.mem for t in tabs]), cat([t.extra for t in tabs])
        self.bs_order = np.fromiter((j for t in tabs for j in t.by_speed), np.int64, int(self.c_ptr[-1]))
        self.fastest = np.fromiter((t.fastest for t in tabs), np.int64, len(tabs))
        self.least = np.fromiter((t.least for t in tabs), np.float64, len(tabs))
        self.most = np.fromiter((t.most for t in tabs), np.float64, len(tabs))
        self.path_ptr = ptr(len(t.path) for t in tabs)
        self.path = np.fromiter((j for t in tabs for j in t.path), np.int64, int(self.path_ptr[-1]))
        self.seg_ptr = ptr(len(t.seg_cost) for t in tabs)
        self.seg_cost, self.seg_save = cat([t.seg_cost for t in tabs]), cat([t.seg_save for t in tabs])

    def relax(self, act, ra, rb, n_rows: int, M: float):
        """The LP relaxation of pairs ``act`` (live in binding rows ``ra <= row < rb``, ``n_rows`` of them, each
        at most ``M`` bytes) in incremental form (DIP §2.5's ILP, relaxed): each pair starts at its fastest
        lower-hull point and moves along its hull, segment by segment, ``z`` in [0, 1] of each; a segment adds
        ``seg_cost`` seconds and saves ``seg_save`` bytes in every row the pair is live in.  A pair's segments grow
        in seconds per byte saved (a convex hull), so the relaxation fills them in order with no constraint saying
        so, and the one-candidate-per-pair rows of the multiple-choice form are gone: at VLM-L / 64 microbatches
        375 columns and the rows that bind at the fastest points, against 750 columns and 375 more rows.  A
        segment covers the rows of an interval, so the LP is a min-cost flow, solved exactly by
        :func:`dipc.planner.kernels.interval_cover_lp` (memory in units of ``M``).  Returns ``(each pair's number
        of hull steps from its fastest point, lower bound on the extra seconds)`` or ``None`` when the relaxation
        has no solution (a row needs more than its pairs can save)."""
        has_lp, fast_extra, m, need, lo, hi, cost, save, owner = relax_inputs(
            act, ra, rb, n_rows, self.path_ptr, self.path, self.c_ptr, self.c_mem, self.c_extra, self.seg_ptr,
            self.seg_cost, self.seg_save, float(M))
        if not has_lp:
            return np.zeros(len(act), np.int64), fast_extra
        status, z, fun = interval_cover_lp(m, need, lo, hi, cost, save)
        if status:
            return None
        return hull_steps(len(act), z, owner, save), fast_extra + fun

    def solve(self, act, ra, rb, n_rows: int, M: float, gap: float, base: float, choice) -> tuple[str, float]:
        """One rank's ILP over pairs ``act`` (:func:`_solve_pairs`) but its branch and bound: the relaxation
        (:meth:`relax`), each pair at the least-memory hull point its relaxed choice uses (every row then holds:
        memory only goes down), then greedy upgrades to faster candidates, the largest saving first, where the
        pair's rows still hold (:func:`dipc.planner.kernels.round_up`); the candidates written to ``choice[act]``.
        Returns ``(how, lower bound on the extra seconds)``: "lp-rounded" within ``gap`` of the bound (relative to
        the pairs' whole latency, their "keep" seconds ``base`` plus the extras), "gap" outside it (``choice``
        holds the rounding), "none" when the relaxation has no solution."""
        relaxed = self.relax(act, ra, rb, n_rows, M)
        if relaxed is None:
            return "none", float("nan")
        steps, bound = relaxed
        value = round_up(act, ra, rb, n_rows, steps, self.path_ptr, self.path, self.c_ptr, self.c_mem,
                         self.c_extra, self.bs_order, float(M), choice)
        return ("lp-rounded" if value + base <= (bound + base) * (1 + gap) + 1e-9 else "gap"), bound


def _relax(tabs, ra, rb, n_rows, M):
    """:meth:`CandidateTable.relax` of the pairs ``tabs`` (:class:`_Candidates`)."""
    return CandidateTable(tabs).relax(np.arange(len(tabs)), np.asarray(ra, np.int64), np.asarray(rb, np.int64),
                                      int(n_rows), M)


def _solve_pairs(tabs, ra, rb, n_rows, M, gap, time_limit, base):
    """One rank's ILP over its active pairs (``tabs``: their :class:`_Candidates`; pair i is live in peak rows
    ``ra[i] <= row < rb[i]``, ``n_rows`` of them, each at most ``M`` bytes): the relaxation (:meth:`CandidateTable.relax`, a
    lower bound), rounded to integers by giving each pair the least-memory hull point its relaxed choice uses
    (every row then holds: memory only goes down), then greedy upgrades to faster candidates, the largest saving
    first, where the pair's rows still hold.  Within ``gap`` of the bound it is taken (the common case), else
    HiGHS's branch and bound (``scipy.optimize.milp``) runs under ``time_limit`` over every candidate and the
    better of the two is kept.  The gap is relative to the pairs' whole latency, ``base`` (their "keep" seconds)
    plus the extra seconds, as in the paper.  Returns ``(each pair's candidate index or None, "lp-rounded" |
    "milp" | "none", lower bound on the extra seconds)``."""
    ra, rb = np.asarray(ra, np.int64), np.asarray(rb, np.int64)
    choice = np.full(len(tabs), -1, np.int64)
    how, bound = CandidateTable(tabs).solve(np.arange(len(tabs)), ra, rb, int(n_rows), M, gap, base, choice)
    if how == "none":
        return None, "none", bound
    js = choice.tolist()
    if how == "lp-rounded":
        return js, "lp-rounded", bound
    value = float(sum(t.extra_l[j] for t, j in zip(tabs, js)))
    # branch and bound over every candidate: variables per (pair, candidate), most bytes first within a pair
    per = np.fromiter((len(t.opts) for t in tabs), np.int64, len(tabs))
    starts = np.concatenate([[0], np.cumsum(per)[:-1]]).astype(np.int64)
    n_var = int(per.sum())
    ent_mem = np.concatenate([t.mem for t in tabs])
    c = np.concatenate([t.extra for t in tabs])
    rows, cols, vals = _interval_entries(np.repeat(ra, per), np.repeat(rb, per), np.arange(n_var), ent_mem)
    x = _milp(c, _mckp_constraints(starts, n_var, rows, cols, vals, n_rows, M), value, bound, base, gap,
              time_limit)
    if x is None:
        return js, "lp-rounded", bound
    return [int(np.flatnonzero(x[s0:s0 + n])[0]) for s0, n in zip(starts.tolist(), per.tolist())], "milp", bound


def _milp(c, cons, value, bound, base, gap, time_limit):
    """HiGHS's branch and bound (``scipy.optimize.milp``) under ``time_limit`` seconds and ``gap`` (relative to
    the whole latency ``base + c @ x``, as the paper's); its solution as bools if it beats ``value``, else None."""
    from scipy.optimize import Bounds, milp

    rel = gap * (bound + base) / max(bound, 1e-12)  # HiGHS's gap is relative to c @ x alone
    res = milp(c, constraints=cons, integrality=np.ones(len(c)), bounds=Bounds(0, 1),
               options={"mip_rel_gap": min(rel, 1.0), "time_limit": time_limit})
    if res.x is not None and float(res.fun) < value:
        return np.round(res.x).astype(bool)
    return None


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


def _solve(c, cons, starts, M, gap, time_limit, base=0.0):
    """The ``uniform`` ILP (:func:`_solve_uniform`; groups are chunks, a variable in the rows of all the chunk's
    pairs): the LP relaxation first (a lower bound), rounded to integers by giving each group with a fractional
    choice its least-memory candidate used (every row then holds: memory only goes down), then greedy upgrades to
    faster candidates where every row still holds; within ``gap`` of the bound it is taken, else HiGHS's branch
    and bound (:func:`_milp`).  A group is a run of variables from ``starts[g]`` to the next start, its
    candidates ordered from the most memory to the least.  Returns ``(x as bools or None, "lp-rounded" | "milp"
    | "none", lower bound)``."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    n = len(c)
    unit = M if M > 0 else 1.0  # the memory rows in units of the budget (as CandidateTable.relax)
    lp_cons = [LinearConstraint(k.A / (unit if i else 1.0), k.lb, k.ub / (unit if i else 1.0))
               for i, k in enumerate(cons)]
    lp = None
    for presolve in (False, True):
        lp = milp(c, constraints=lp_cons, integrality=np.zeros(n), bounds=Bounds(0, 1),
                  options={"presolve": presolve})
        if lp.x is not None:
            break
    if lp.x is None:
        return None, "none", float("nan")
    lp_x = lp.x
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
    better = _milp(c, cons, value, bound, base, gap, time_limit)
    return (better, "milp", bound) if better is not None else (x, "lp-rounded", bound)


def copy_strategies(graph: StageGraph, source: StageGraph) -> None:
    """Give ``graph``'s stages ``source``'s memory strategies, bytes and latencies (not their priorities)."""
    for k, st in source.stages.items():
        o = graph.stages[k]
        o.strategy, o.activation_bytes, o.latency = st.strategy, st.activation_bytes, st.latency
        o.keep_bytes, o.recompute_extra, o.rebuild_bytes = st.keep_bytes, st.recompute_extra, st.rebuild_bytes
        o.host_bytes = st.host_bytes


def fit_order(graph: StageGraph, order: Sequence[Sequence[str]], limits: Sequence[float | None], recompute_cost,
              pristine: StageGraph, *, ilp: bool = True) -> None:
    """Give a fixed per-rank order's pairs memory strategies under ``limits`` (bytes per rank): the per-rank ILP
    (:func:`optimize_memory`) alone when it solves every rank - its choice does not depend on the strategies the
    pairs had - else, as before it, the greedy fit (:func:`dipc.planner.fitting.fit_by_recompute`, then
    :func:`dipc.planner.fitting.relax_recompute`) with the ILP over it, the greedy's choice kept on the ranks the ILP
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
