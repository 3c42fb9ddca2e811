"""DIP's search (shared/PAPER.md §2.3-2.5) on a step's stage graph: MCTS over the priorities of the
(microbatch, modality) groups, each rollout scored by the interleaver (phase 2) and the memory optimisation
(phase 3).

A group is every stage of one modality in one microbatch, forward and backward: the paper's pruning rule (the
segments of one modality in one microbatch share a priority).  Its direction is not a separate group here: the
interleaver's forward and backward queues never compare priorities across directions, so one permutation orders
both.  A permutation gives group i the priority ``n - i``; a rollout schedules the graph with them - under a
memory limit as the interleaver's fastest window candidate (the list schedule with W microbatches in flight, fitted
by recompute and :func:`dipc.planner.memory.optimize_memory`), or else by the memory-aware admission of
:func:`dipc.planner.schedule.list_schedule` and the ILP - re-timed, and scores its iteration time.
The search starts from the interleaver's own priorities (oldest microbatch first).
"""
from __future__ import annotations

import math

from ..plan import PlanError
from ..stages import StageGraph, copy_stage
from .fitting import timed_schedule
from .schedule import list_schedule
from .mcts import SearchResult, mcts
from .memory import fit_order, optimize_memory

__all__ = ["search_priorities", "score_permutation", "groups_of"]


def groups_of(graph: StageGraph) -> list[tuple[int, str]]:
    """The (microbatch, modality) groups of a stage graph, oldest microbatch first (the interleaver's default
    priority), encoders before the backbone within a microbatch (their forwards come first)."""
    first: dict[str, float] = {}
    for st in graph.stages.values():  # a modality's rank in the dataflow: its smallest chunk index is a fair proxy
        first[st.modality] = min(first.get(st.modality, math.inf), st.chunk)
    return sorted({(st.mb, st.modality) for st in graph.stages.values()}, key=lambda g: (g[0], first[g[1]], g[1]))


def _copy(graph: StageGraph, priority: dict) -> StageGraph:
    stages = {}
    for k, st in graph.stages.items():
        stages[k] = c = copy_stage(st)
        c.priority = priority[(st.mb, st.modality)]
    return StageGraph(stages=stages, edges=graph.edges)


def score_permutation(graph: StageGraph, perm, P: int, comm, limits, recompute_cost, *, ilp: bool = True,
                      window: int | None = None):
    """One rollout on stage objects: ``perm`` (the groups, highest priority first) scheduled as
    :func:`search_priorities` describes.  Returns ``(iteration seconds, schedule, stage graph)``, or ``(inf, None,
    None)`` when it cannot fit (:class:`dipc.plan.PlanError`).  The array rollouts
    (:class:`dipc.planner.rollout.Rollouts`) give the same seconds; this builds the schedule too."""
    n = len(perm)
    limited = limits is not None and any(x is not None for x in limits)
    g = _copy(graph, {grp: float(n - i) for i, grp in enumerate(perm)})
    try:
        if not limited:
            sched = list_schedule(g, P, comm_time=comm)
        elif window is not None:
            order = list_schedule(g, P, comm_time=comm, window=window).order
            fit_order(g, order, limits, recompute_cost, graph, ilp=ilp)
            sched = timed_schedule(g, order, comm_time=comm)
        else:
            sched = list_schedule(g, P, comm_time=comm, memory_limit=limits, recompute_cost=recompute_cost)
            if ilp and optimize_memory(g, sched.order, limits)["solved"]:
                sched = timed_schedule(g, sched.order, comm_time=comm)
    except PlanError:
        return math.inf, None, None
    return sched.iteration_time, sched, g


def search_priorities(graph: StageGraph, P: int, comm, limits, recompute_cost, budget_s: float, seed: int = 0, *,
                      ilp: bool = True, window: int | None = None, arrays: bool = True, **mcts_options):
    """MCTS over the group priorities of ``graph`` (its stages at their "keep" strategy) for ``budget_s`` seconds.

    Args:
        graph: the step's stage graph; not modified.
        P: pipeline ranks.
        comm: edge -> transfer seconds (or None).
        limits: per-rank activation budgets in bytes (None: no limit).
        recompute_cost: as :func:`dipc.planner.schedule.list_schedule` takes it.
        budget_s, seed: the search's time budget (seconds, > 0) and seed.
        ilp: phase 3 by the memory ILP (else the admission's, or the greedy fit's, recompute only).
        window: under a limit, score each permutation as the interleaver's window candidate with this many
            microbatches in flight per rank (the list schedule without a limit, then fitted by recompute - greedy,
            relaxed, then the ILP - and re-timed: :func:`dipc.planner.candidates.interleave`); None: by the
            memory-aware admission.  At VLM-M / 16 microbatches the admission is the interleaver's slowest
            candidate (9.64 s against 8.32 s), so a search in it found nothing; in the window family a 20 s search
            finds 8.17 s.
        arrays: score rollouts on arrays (:class:`dipc.planner.rollout.Rollouts`: the same seconds, ~7x faster
            at VLM-L / 64 microbatches) where they apply - no limit, or a limit with a window and the ILP - and
            by :func:`score_permutation` elsewhere and for the permutations they leave to it; the best
            permutation's schedule is always rebuilt by :func:`score_permutation`.
        mcts_options: passed to :func:`dipc.planner.mcts.mcts` (``alpha``, ``beta``, ``rollouts``,
            ``max_iterations``, ``workers``: parallel rollout processes).

    Returns:
        ``((schedule, stage graph with the chosen priorities and strategies) or None if no rollout fit,
        SearchResult)``; the result has ``improved = False`` (the caller sets it when it takes the schedule).
    """
    import numpy as np

    groups = groups_of(graph)
    limited = limits is not None and any(x is not None for x in limits)
    fast = None
    if arrays and (not limited or (window is not None and ilp)):
        from .rollout import Rollouts

        fast = Rollouts(graph, P, comm, limits if limited else None, window, groups)
        where = {grp: x for x, grp in enumerate(groups)}

    def score(perm) -> float:
        if fast is not None:
            pos = np.empty(len(perm), np.int64)
            pos[[where[grp] for grp in perm]] = np.arange(len(perm))
            t = fast.score(pos)
            if t is not None:
                return t
        return score_permutation(graph, perm, P, comm, limits, recompute_cost, ilp=ilp, window=window)[0]

    res: SearchResult = mcts(groups, score, budget_s=budget_s, seed=seed, start=groups, **mcts_options)
    if not math.isfinite(res.time):
        return None, res
    # the best permutation's schedule and strategies (the scores kept only its seconds)
    t, sched, g = score_permutation(graph, res.order, P, comm, limits, recompute_cost, ilp=ilp, window=window)
    return (sched, g) if sched is not None else None, res
