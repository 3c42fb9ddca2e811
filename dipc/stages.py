"""The stage graph of a step (the IR's): the forward and backward stages of every (chunk, microbatch,
sub-microbatch), the edges between them with the named tensors each carries, and a schedule of them.

:mod:`dipc.planner.workload` builds a step's graph; the planner (:mod:`dipc.planner.schedule`, the search, the
memory ILP) orders its stages per rank into a :class:`Schedule` and lowers that to a :class:`dipc.plan.Plan`; the
simulator and the executor read stage keys (:func:`dipc.plan.stage_key`: ``F3.1`` is the forward of chunk 3,
microbatch 1).  DIP §2.4's "stages" and "segments" are these.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict

from .plan import TensorSpec, stage_key

__all__ = ["Stage", "copy_stage", "Edge", "StageGraph", "Schedule"]


@dataclasses.dataclass
class Stage:
    """One forward or backward of (chunk, microbatch, sub-microbatch).

    Attributes:
        kind: "F" or "B".
        chunk, mb, sub: which chunk and data (``sub = -1``: whole microbatch).
        rank: rank owning the chunk.
        latency: estimated duration in seconds.
        priority: larger runs first among ready stages of one kind.
        activation_bytes: memory a forward keeps until its backward (bytes).
        modality: the chunk's modality (for pictures and reports).
        strategy: memory strategy ("keep", "recompute" or "recompute:k", :func:`dipc.plan.recomputed_blocks`);
            with "recompute" the forward keeps only its inputs (``activation_bytes`` should count those) and the
            backward's ``latency`` includes the forward run again.
        keep_bytes, recompute_extra: set on a forward the planner switched to "recompute"
            (:func:`switch_to_recompute`) or to another option: its bytes under "keep" and the seconds its backward
            grew by, so that :func:`relax_recompute` can switch it back.
        forced: the strategy was asked for (``set_recompute``): the planner does not switch it back to "keep".
        transient_bytes: bytes the stage holds only while it runs (its largest op's working set; DESIGN.md
            "Memory"), on top of the activations live then.
        options: on a forward, the memory strategies its pair may take, ``(strategy, activation bytes, seconds the
            backward grows by[, bytes the backward rebuilds])`` from "keep" (``extra = 0``) to the least memory
            (DIP §2.5's candidates, :func:`dipc.planner.memory.prune_options`); empty: only its current strategy.
        rebuild_bytes: on a recomputing forward, the bytes its backward holds again while it recomputes (a transient
            of the backward); ``None``: all it did not keep (``keep_bytes - activation_bytes``, the whole chunk
            rebuilt at once).
        host_bytes: on a forward at an offloading strategy (:func:`dipc.plan.offloads`), the bytes its pair keeps
            in host memory between the forward and the backward (per GPU).
        host_limit: on a forward, the bytes of offloaded activations its rank may hold in host memory at once
            (:func:`dipc.planner.memory.optimize_memory` keeps the rank's choice within it); None: no bound.
    """

    kind: str
    chunk: int
    mb: int
    sub: int
    rank: int
    latency: float
    priority: float = 0.0
    activation_bytes: float = 0.0
    modality: str = ""
    strategy: str = "keep"
    keep_bytes: float | None = None
    recompute_extra: float = 0.0
    options: tuple = ()
    transient_bytes: float = 0.0
    forced: bool = False
    rebuild_bytes: float | None = None
    host_bytes: float = 0.0
    host_limit: float | None = None

    @property
    def key(self) -> str:
        return stage_key(self.kind, self.chunk, self.mb, self.sub)


def copy_stage(st: Stage) -> Stage:
    """A shallow copy of ``st`` (its ``options`` tuple shared): a new instance given a copy of the attributes,
    a seventh of ``copy.copy``'s time (the search copies a step's 6000 stages per rollout at VLM-L / 64
    microbatches)."""
    c = object.__new__(Stage)
    c.__dict__ = st.__dict__.copy()
    return c


@dataclasses.dataclass
class Edge:
    """``dst`` needs ``src``; ``tensors`` travel when the two stages are on different ranks."""

    src: str
    dst: str
    tensors: tuple[TensorSpec, ...] = ()


@dataclasses.dataclass
class StageGraph:
    stages: dict[str, Stage]
    edges: list[Edge]

    def preds(self) -> dict[str, list[Edge]]:
        """Stage key -> the edges into it (read-only: shared by every graph over the same ``edges`` list)."""
        return _adjacency(self.edges)[0]

    def succs(self) -> dict[str, list[Edge]]:
        """Stage key -> the edges out of it (read-only, shared as :meth:`preds`)."""
        return _adjacency(self.edges)[1]


_ADJACENCY: dict[int, tuple] = {}  # id(edges) -> (edges, len(edges), preds, succs)


def _adjacency(edges: list[Edge]) -> tuple[dict, dict]:
    """Predecessor and successor lists of an edge list, built once per list: the planner's copies of a step's
    graph share its edges, and every list schedule of a search needs both (8 ms a rollout at VLM-S / 64
    microbatches).  The entry holds the list itself, so its id is not reused while cached; a list whose length
    changed is indexed again."""
    hit = _ADJACENCY.get(id(edges))
    if hit is not None and hit[0] is edges and hit[1] == len(edges):
        return hit[2], hit[3]
    p, s = defaultdict(list), defaultdict(list)
    for e in edges:
        p[e.dst].append(e)
        s[e.src].append(e)
    if len(_ADJACENCY) >= 16:
        _ADJACENCY.pop(next(iter(_ADJACENCY)))
    _ADJACENCY[id(edges)] = (edges, len(edges), p, s)
    return p, s


@dataclasses.dataclass
class Schedule:
    """Result of list scheduling: per rank the stage keys in order, with simulated start/end (seconds)."""

    order: list[list[str]]
    start: dict[str, float]
    end: dict[str, float]

    @property
    def iteration_time(self) -> float:
        return max(self.end.values(), default=0.0)
