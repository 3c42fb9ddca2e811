"""A search rollout on arrays (shared/PAPER.md §2.3-2.5): the interleaver, the per-rank memory ILP and the
re-timing of one MCTS permutation, compiled with numba.

DIP scores every permutation of the (microbatch, modality) groups by the simulated iteration time of its
schedule: the dual-queue list schedule (§2.4), then the memory strategy of every forward-backward pair chosen by
the per-rank ILP (§2.5), then the fixed order timed with the chosen latencies.  :func:`dipc.planner.search.
search_priorities` did that on :class:`dipc.stages.StageGraph` objects: a copy of the step's 6000 stages per
rollout at VLM-L / 64 microbatches, then three Python loops over them (~140 ms a rollout on a 2-core VM).
:class:`Rollouts` numbers the stages once per search and runs the same three steps on arrays:

* the list schedule (the window-only admission, or none) by :func:`dipc.planner.kernels.list_kernel`, a group's
  position in the permutation as every stage's priority;
* per rank, the peak rows (:func:`dipc.planner.kernels.rank_rows`), the pairs bound by none at their fastest
  candidate, the others by the LP relaxation over their lower hulls, rounded and upgraded
  (:meth:`dipc.planner.memory.CandidateTable.solve`);
* the order timed with the chosen latencies by :func:`dipc.planner.kernels.time_kernel`.

These are the kernels the object code calls too (:func:`dipc.planner.schedule.list_schedule`,
:func:`dipc.planner.memory.optimize_memory`, :func:`dipc.planner.fitting.timed_schedule`), so a score is that code's to
the last bit (``tests/planner/test_rollout.py`` compares them on random permutations).  Where the object code would take
another path - the ILP leaves a rank unsolved or misses its 5% gap (the greedy fit, branch and bound) -
:meth:`Rollouts.score` returns None and the caller scores that permutation the object way.  The schedule of the
best permutation is always rebuilt by the object code.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ..plan import backward_key
from .kernels import list_kernel, time_kernel
from .memory_kernels import rank_rows

__all__ = ["Rollouts"]


class Rollouts:
    """One search's rollouts on arrays (see the module docstring): the step's stage graph numbered once, then
    :meth:`score` per permutation of the groups.

    Args:
        graph: the search's stage graph (its stages as the rollouts start from: strategies, latencies, the
            ``options`` each pair may take); not modified.
        P: pipeline ranks.
        comm: edge -> transfer seconds (or None).
        limits: per-rank activation budgets in bytes, or None (no limit: a rollout is one list schedule).
        window: under a limit, the in-flight window of the rollouts' list schedule (microbatches per rank).
        groups: the (microbatch, modality) groups whose permutations are scored.
        S: candidates per pair (:data:`dipc.planner.memory.S_DEFAULT`, as the object code's ILP).

    Raises:
        ValueError: a limit without a window (the memory-aware admission is scored by the object code), or
            stages with a microbatch below 0 or a rank outside [0, P).
    """

    def __init__(self, graph, P: int, comm, limits: Sequence[float | None] | None, window: int | None,
                 groups: Sequence, S: int | None = None):
        from .schedule import graph_arrays
        from .memory import S_DEFAULT, CandidateTable, _candidates

        limited = limits is not None and any(x is not None for x in limits)
        if limited and window is None:
            raise ValueError("array rollouts under a memory limit need the window family (window=None: the "
                             "memory-aware admission, scored by the object code)")
        self.P, self.window, self.limited = P, (window if limited else None), limited
        self.limits = list(limits) if limited else [None] * P
        A = self.arrays = graph_arrays(graph, comm)
        stages = list(graph.stages.values())
        n = self.n = len(stages)
        if n and (A.mb.min() < 0 or A.rank.min() < 0 or A.rank.max() >= P):
            raise ValueError("stages need microbatches >= 0 and ranks in [0, P)")
        self.n_mb = int(A.mb.max()) + 1 if n else 1
        self.lat = np.fromiter((st.latency for st in stages), np.float64, n)
        g_of = {g: x for x, g in enumerate(groups)}
        self.group_of = np.fromiter((g_of[(st.mb, st.modality)] for st in stages), np.int64, n)
        # forward-backward pairs (pair p: the p-th forward) and their candidates, as optimize_memory takes them
        S = S_DEFAULT if S is None else S
        fwd = np.flatnonzero(~A.is_b)
        self.pair_of = np.full(n, -1, np.int64)
        self.pair_of[fwd] = np.arange(len(fwd))
        self.pair_b = np.fromiter((A.at[backward_key(A.keys[i])] for i in fwd.tolist()), np.int64, len(fwd))
        self.pair_of[self.pair_b] = np.arange(len(fwd))
        self.table = CandidateTable([_candidates(stages[i], S, False) for i in fwd.tolist()])
        # each pair's "keep" seconds (the ILP's gap is relative to them plus the extras), its forward's extra
        # seconds and its backward's latency as the rollouts start
        f_st, b_st = [stages[i] for i in fwd.tolist()], [stages[b] for b in self.pair_b.tolist()]
        self.base_p = [f.latency + b.latency - f.recompute_extra for f, b in zip(f_st, b_st)]
        self.rex = np.fromiter((f.recompute_extra for f in f_st), np.float64, len(f_st))
        self.lat_b = np.fromiter((b.latency for b in b_st), np.float64, len(b_st))
        self.fallbacks = 0  # permutations score() left to the object code

    def schedule(self, perm_pos: np.ndarray):
        """The list schedule of the permutation giving group ``x`` the position ``perm_pos[x]`` (position 0: the
        highest priority): ``(status, order, per-rank lengths, start, end, scheduled order)``
        (:func:`dipc.planner.kernels.list_kernel`)."""
        A = self.arrays
        return list_kernel(self.P, A.rank, A.is_b, A.mb, perm_pos[self.group_of] * self.n + A.tie, A.by_tie,
                           A.succ_ptr, A.succ_idx, A.succ_delay, A.n_pred, self.lat,
                           -1 if self.window is None else self.window, self.n_mb)

    def score(self, perm_pos: np.ndarray, gap: float = 0.05) -> float | None:
        """The simulated iteration time (seconds) of the permutation giving group ``x`` the position
        ``perm_pos[x]`` (an int64 array), as :func:`dipc.planner.search.score_permutation` scores it (``inf``: it
        cannot fit, or its window deadlocks), or None where that takes a path not done here (a rank's LP without
        a solution or outside the ILP's ``gap``: the greedy fit or branch and bound).

        Raises:
            ValueError: the stage graph has a cycle."""
        status, order, olen, _, end, _ = self.schedule(perm_pos)
        if status == 1:
            return math.inf  # the window deadlocks (the object code's PlanError)
        if status == 2:
            raise ValueError("the stage graph has a cycle")
        if not self.limited:
            return float(end.max()) if self.n else 0.0
        A, T = self.arrays, self.table
        choice = np.full(len(self.pair_b), -1, np.int64)
        for r in range(self.P):
            M = self.limits[r] if r < len(self.limits) else None
            if M is None or not olen[r]:
                continue
            st, pairs, ra, rb, n_rows, _, _ = rank_rows(order[r, :olen[r]], A.is_b, self.pair_of, len(self.pair_b),
                                                        T.least, T.most, float(M))
            if st:
                return math.inf  # every pair at its least memory is over the budget (the object code's PlanError)
            free = ra == rb
            choice[pairs[free]] = T.fastest[pairs[free]]
            busy = ~free
            if not busy.any():
                continue
            act = pairs[busy]
            base = 0.0
            for i in act.tolist():
                base += self.base_p[i]
            how, _ = T.solve(act, ra[busy], rb[busy], int(n_rows), float(M), gap, base, choice)
            if how != "lp-rounded":
                self.fallbacks += 1
                return None
        lat = self.lat.copy()
        on = np.flatnonzero(choice >= 0)
        lat[self.pair_b[on]] = self.lat_b[on] + (T.c_extra[T.c_ptr[on] + choice[on]] - self.rex[on])
        status, _, fin, _ = time_kernel(order, olen, A.pred_ptr, A.pred_idx, A.pred_delay, lat)
        if status:
            return math.inf
        return float(fin.max()) if self.n else 0.0
