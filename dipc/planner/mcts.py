"""DIP's searcher phase 1 (shared/PAPER.md §2.3): Monte Carlo tree search over the order of pipeline-segment groups.

Every stage belongs to one *group* - (microbatch, modality, direction), the paper's pruning rule: the segments of
one modality in one microbatch share a priority and keep their fixed order - and a *permutation* of the groups
gives the group at position i the priority ``n - i``; the interleaver (phase 2) and the memory optimisation
(phase 3) then turn the priorities into a schedule whose simulated iteration time is the permutation's score.

The tree: a node at depth d fixes the groups at positions 0 .. d-1.  One iteration:

1. **select**: from the root, move to the child maximising ``UCB = s^alpha + beta * sqrt(ln N_parent / N_child)``
   (``s``: the best score seen below the child, ``T_ref / T_iter`` with ``T_ref`` the first rollout's time, so
   larger is better and about 1; ``alpha`` sharpens it, ``beta`` weighs exploration; the paper gives no values:
   ``alpha = 1``, ``beta = sqrt(2)``, the UCB1 constant, by default) while the node has no untried child;
2. **expand**: add one untried child (the next group at the next position);
3. **roll out**: ``rollouts`` times (the paper's 10), fill the remaining positions at random and score the
   permutation;
4. **backpropagate**: the best rollout score to every node on the path (``s = max``), visit counts + 1.

It stops when ``budget_s`` seconds have passed, ``max_iterations`` iterations have run, or the whole tree is
explored (every leaf scored: then the result is the exhaustive optimum).  Deterministic for a seed when the budget
does not cut it (``max_iterations`` bounds it instead).

Parallel workers (§2.3: "parallel workers sharing the statistics", at most half the host's cores): with
``workers`` > 1 an expansion's rollouts are scored by that many forked processes at once (leaf parallelism: the
tree and its statistics stay in this process, so every worker's score reaches the same tree), and the
permutations are drawn here, so a seeded search finds the same result with any number of workers.

Pure: the score is a callable; :func:`dipc.planner.make_plan` supplies the interleaver + memory ILP.
"""
from __future__ import annotations

import dataclasses
import math
import random
import time
from typing import Callable, Hashable, Sequence

__all__ = ["SearchResult", "mcts", "max_workers"]


@dataclasses.dataclass
class SearchResult:
    """What a search found.

    Attributes:
        order: the best permutation of the groups (position 0: highest priority).
        time: its score, seconds (the simulated iteration time).
        rollouts: permutations scored.
        iterations: tree iterations run.
        exhausted: True when the whole tree was explored (``order`` is then optimal).
        history: ``[seconds since the start, best time so far]`` at every improvement (lists: the plan carries
            them in :attr:`dipc.plan.Plan.simulated` and reads them back from JSON alike).
        seconds: wall time of the search.
        improved: set by the caller when it takes ``order`` over its own schedule.
    """

    order: list
    time: float
    rollouts: int = 0
    iterations: int = 0
    exhausted: bool = False
    history: list = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    improved: bool = False


class _Node:
    __slots__ = ("prefix", "children", "untried", "n", "best", "done")

    def __init__(self, prefix: tuple, remaining: Sequence, rnd: random.Random):
        self.prefix = prefix
        self.children: list[_Node] = []
        self.untried = list(remaining)
        rnd.shuffle(self.untried)
        self.n = 0
        self.best = 0.0
        self.done = not self.untried  # a leaf: every position fixed


def max_workers() -> int:
    """Search workers this host allows: half its cores (at least 1)."""
    import os

    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, n // 2)


_SCORE = None  # the score of the search the forked workers serve (inherited at fork, never pickled)


def _score_in_worker(perm):
    return _SCORE(perm)


def mcts(groups: Sequence[Hashable], score: Callable[[list], float], *, budget_s: float = 1.0, seed: int = 0,
         alpha: float = 1.0, beta: float = math.sqrt(2.0), rollouts: int = 10, max_iterations: int | None = None,
         start: Sequence[Hashable] | None = None, workers: int = 1) -> SearchResult:
    """Search the permutation of ``groups`` that minimises ``score`` (seconds), as described in the module
    docstring.

    Args:
        groups: the items to order (distinct, hashable).
        score: permutation -> seconds (lower is better); called once per rollout, never twice for one permutation.
        budget_s: wall-clock seconds (> 0) the search may take (checked between rollouts).
        seed: seeds the random expansion and rollouts.
        alpha, beta: the UCB exponent and exploration weight.
        rollouts: random completions per expansion.
        max_iterations: stop after this many iterations (deterministic runs).
        start: a permutation scored first (e.g. the interleaver's default order): the reference time, and the
            result if nothing better is found.
        workers: processes scoring an expansion's rollouts at once (capped at :func:`max_workers`; 1: in this
            process).  ``score`` then runs in forked children: what it records on the side stays there (the
            caller scores ``order`` again to get it).

    Raises:
        ValueError: repeated groups, ``budget_s`` <= 0, ``rollouts`` < 1, ``workers`` < 1, or ``start`` not a
            permutation of ``groups``.
    """
    groups = list(groups)
    if len(set(groups)) != len(groups):
        raise ValueError("groups must be distinct")
    if not budget_s > 0:
        raise ValueError(f"budget_s must be > 0, got {budget_s!r}")
    if rollouts < 1:
        raise ValueError(f"rollouts must be >= 1, got {rollouts!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    workers = min(workers, max_workers())
    if workers > 1:
        import multiprocessing

        global _SCORE
        _SCORE = score
        pool = multiprocessing.get_context("fork").Pool(workers)
        try:
            return _mcts(groups, score, budget_s, seed, alpha, beta, rollouts, max_iterations, start, pool)
        finally:
            pool.terminate()
            pool.join()
            _SCORE = None
    return _mcts(groups, score, budget_s, seed, alpha, beta, rollouts, max_iterations, start, None)


def _mcts(groups, score, budget_s, seed, alpha, beta, rollouts, max_iterations, start, pool) -> SearchResult:
    if start is not None and sorted(map(repr, start)) != sorted(map(repr, groups)):
        raise ValueError("start must be a permutation of groups")
    t0 = time.perf_counter()
    rnd = random.Random(seed)
    seen: dict[tuple, float] = {}
    res = SearchResult(order=list(start) if start is not None else list(groups), time=math.inf)

    def record(perm: list, t: float) -> None:
        seen[tuple(perm)] = t
        res.rollouts += 1
        if t < res.time:
            res.order, res.time = list(perm), t
            res.history.append([time.perf_counter() - t0, res.time])  # a list: as it reads back from JSON

    def evaluate(perm: list) -> float:
        key = tuple(perm)
        if key not in seen:
            record(perm, score(perm))
        return seen[key]

    def evaluate_many(perms: list[list]) -> list[float]:
        """Score ``perms`` (in order, as :func:`evaluate` would one by one) on the worker pool."""
        todo, keys = [], set()
        for p in perms:
            k = tuple(p)
            if k not in seen and k not in keys:
                keys.add(k)
                todo.append(p)
        for p, t in zip(todo, pool.map(_score_in_worker, todo)):
            record(p, t)
        return [seen[tuple(p)] for p in perms]

    t_ref = evaluate(list(start) if start is not None else list(groups))
    if not math.isfinite(t_ref) or t_ref <= 0:
        t_ref = 1.0
    root = _Node((), groups, rnd)
    n_total = math.factorial(len(groups)) if len(groups) <= 20 else None
    while True:
        if time.perf_counter() - t0 >= budget_s or (max_iterations is not None and res.iterations >= max_iterations):
            break
        if root.done:
            res.exhausted = True
            break
        # select
        path = [root]
        node = root
        while not node.untried and node.children:
            live = [c for c in node.children if not c.done]
            if not live:
                node.done = True
                break
            ln = math.log(max(node.n, 1))
            node = max(live, key=lambda c: c.best ** alpha + beta * math.sqrt(ln / max(c.n, 1)))
            path.append(node)
        if node.done and node is not root:
            for p in reversed(path):  # propagate completion upwards
                if p.untried or any(not c.done for c in p.children):
                    break
                p.done = True
            continue
        if node.done:
            continue
        # expand
        g = node.untried.pop()
        used = set(node.prefix) | {g}
        child = _Node(node.prefix + (g,), [x for x in groups if x not in used], rnd)
        node.children.append(child)
        path.append(child)
        # roll out
        best = 0.0
        rest = [x for x in groups if x not in used]
        if pool is None:
            for _ in range(1 if child.done else rollouts):
                rnd.shuffle(rest)
                t = evaluate(list(child.prefix) + rest)
                best = max(best, t_ref / t if t > 0 else 0.0)
                if time.perf_counter() - t0 >= budget_s:
                    break
        else:  # the same permutations, drawn here, scored at once
            perms = []
            for _ in range(1 if child.done else rollouts):
                rnd.shuffle(rest)
                perms.append(list(child.prefix) + rest)
            for t in evaluate_many(perms):
                best = max(best, t_ref / t if t > 0 else 0.0)
        # backpropagate
        for p in path:
            p.n += 1
            p.best = max(p.best, best)
        if child.done:
            for p in reversed(path):
                if p.untried or any(not c.done for c in p.children):
                    break
                p.done = True
        res.iterations += 1
        if n_total is not None and len(seen) >= n_total:
            res.exhausted = True
            break
    res.seconds = time.perf_counter() - t0
    return res
