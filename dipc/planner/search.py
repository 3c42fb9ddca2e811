"""DIP's search (shared/PAPER.md §2.3-2.5) on a step's stage graph: MCTS over the priorities of the
(microbatch, modality) groups, each rollout scored by the interleaver (phase 2) and the memory optimisation
(phase 3).

A group is every stage of one modality in one microbatch, forward and backward: the paper's pruning rule (the
segments of one modality in one microbatch share a priority).  Its direction is not a separate group here: the
interleaver's forward and backward queues never compare priorities across directions, so one permutation orders
both.  A permutation gives group i the priority ``n - i``; a rollout schedules the graph with them - under a
memory limit the memory-aware admission of :func:`dipc.schedule.list_schedule`, then
:func:`dipc.planner.memory.optimize_memory` on its order and the order re-timed - and scores its iteration time.
The search starts from the interleaver's own priorities (oldest microbatch first).
"""
from __future__ import annotations

import dataclasses
import math

from ..plan import PlanError
from ..schedule import StageGraph, list_schedule, timed_schedule
from .mcts import SearchResult, mcts
from .memory import optimize_memory

__all__ = ["search_priorities", "groups_of"]


def groups_of(graph: StageGraph) -> list[tuple[int, str]]:
    """The (microbatch, modality) groups of a stage graph, oldest microbatch first (the interleaver's default
    priority), encoders before the backbone within a microbatch (their forwards come first)."""
    first: dict[str, float] = {}
    for st in graph.stages.values():  # a modality's rank in the dataflow: its smallest chunk index is a fair proxy
        first[st.modality] = min(first.get(st.modality, math.inf), st.chunk)
    return sorted({(st.mb, st.modality) for st in graph.stages.values()}, key=lambda g: (g[0], first[g[1]], g[1]))


def _copy(graph: StageGraph, priority: dict) -> StageGraph:
    return StageGraph(stages={k: dataclasses.replace(st, priority=priority[(st.mb, st.modality)])
                              for k, st in graph.stages.items()}, edges=graph.edges)


def search_priorities(graph: StageGraph, P: int, comm, limits, recompute_cost, budget_s: float, seed: int = 0, *,
                      ilp: bool = True, **mcts_options):
    """MCTS over the group priorities of ``graph`` (its stages at their "keep" strategy) for ``budget_s`` seconds.

    Args:
        graph: the step's stage graph; not modified.
        P: pipeline ranks.
        comm: edge -> transfer seconds (or None).
        limits: per-rank activation budgets in bytes (None: no limit).
        recompute_cost: as :func:`dipc.schedule.list_schedule` takes it.
        budget_s, seed: the search's time budget (seconds, > 0) and seed.
        ilp: phase 3 by the memory ILP (else the admission's own recompute only).
        mcts_options: passed to :func:`dipc.planner.mcts.mcts` (``alpha``, ``beta``, ``rollouts``,
            ``max_iterations``, ``workers``: parallel rollout processes).

    Returns:
        ``((schedule, stage graph with the chosen priorities and strategies) or None if no rollout fit,
        SearchResult)``; the result has ``improved = False`` (the caller sets it when it takes the schedule).
    """
    groups = groups_of(graph)
    best: dict = {}
    limited = limits is not None and any(x is not None for x in limits)

    def score(perm) -> float:
        n = len(perm)
        g = _copy(graph, {grp: float(n - i) for i, grp in enumerate(perm)})
        try:
            if not limited:
                sched = list_schedule(g, P, comm_time=comm)
            else:
                sched = list_schedule(g, P, comm_time=comm, memory_limit=limits, recompute_cost=recompute_cost)
                if ilp and optimize_memory(g, sched.order, limits)["solved"]:
                    sched = timed_schedule(g, sched.order, comm_time=comm)
        except PlanError:
            return math.inf
        if sched.iteration_time < best.get("time", math.inf):
            best.update(time=sched.iteration_time, found=(sched, g))
        return sched.iteration_time

    res: SearchResult = mcts(groups, score, budget_s=budget_s, seed=seed, start=groups, **mcts_options)
    if mcts_options.get("workers", 1) > 1 and math.isfinite(res.time):
        best.clear()  # the workers' schedules stayed in them: the best permutation's again, here
        score(res.order)
    return best.get("found"), res
