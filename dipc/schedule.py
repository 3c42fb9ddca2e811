"""Default schedule: DIP's greedy dual-queue stage interleaver, and lowering of a schedule into a plan.

:func:`list_schedule` follows shared/PAPER.md §2.4 (searcher phase 2), without the MCTS priorities (phase 1; every
stage's priority here favours earlier microbatches) and without the memory ILP (phase 3):

* per rank: ``t_last`` (end of its last stage), a forward queue and a backward queue of ready stages;
* repeatedly pick the rank whose queued stages can start earliest; if both a forward and a backward are ready by
  ``t_last``, alternate with the kind of the rank's last stage (Megatron-style 1F1B); otherwise take the stage that
  can start earliest; schedule it at ``max(t_last, t_start)`` and release its successors, adding the transfer time
  of edges that cross ranks;
* optional memory limit: while a rank's live activations exceed it, its forward queue is blocked.

:func:`lower` turns the per-rank order into a :class:`dipc.plan.Plan`: a ``SEND`` right after the stage that
produces a message, and the matching ``RECV`` posted on the receiver one compute action ahead of the first stage
that needs it (``recv_lookahead``), in the sender's order (so the plan is valid under in-order matching too).
"""
from __future__ import annotations

import dataclasses
import heapq
from collections import defaultdict
from typing import Callable

from .plan import Action, Plan, TensorSpec, stage_key

__all__ = ["Stage", "Edge", "StageGraph", "Schedule", "list_schedule", "lower"]


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
        strategy: memory strategy ("keep" or "recompute", :data:`dipc.plan.STRATEGIES`); with "recompute" the
            forward keeps only its inputs (``activation_bytes`` should count those) and the backward's ``latency``
            includes the forward run again.
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

    @property
    def key(self) -> str:
        return stage_key(self.kind, self.chunk, self.mb, self.sub)


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
        p = defaultdict(list)
        for e in self.edges:
            p[e.dst].append(e)
        return p

    def succs(self) -> dict[str, list[Edge]]:
        s = defaultdict(list)
        for e in self.edges:
            s[e.src].append(e)
        return s


@dataclasses.dataclass
class Schedule:
    """Result of list scheduling: per rank the stage keys in order, with simulated start/end (seconds)."""

    order: list[list[str]]
    start: dict[str, float]
    end: dict[str, float]

    @property
    def iteration_time(self) -> float:
        return max(self.end.values(), default=0.0)


def list_schedule(graph: StageGraph, n_ranks: int, *, comm_time: Callable[[Edge], float] | None = None,
                  memory_limit: float | None = None) -> Schedule:
    """Greedy dual-queue list scheduling of every stage (see the module docstring).

    Args:
        graph: the step's stages and dependencies (must be acyclic).
        n_ranks: P.
        comm_time: seconds an edge between ranks adds to its consumer's earliest start (default 0).
        memory_limit: bytes of live forward activations above which a rank's forward queue is blocked.

    Returns:
        a :class:`Schedule`.

    Raises:
        ValueError: the graph has a cycle (some stage never becomes ready).
    """
    comm_time = comm_time or (lambda e: 0.0)
    preds, succs = graph.preds(), graph.succs()
    remaining = {k: len(preds[k]) for k in graph.stages}
    t_start = {k: 0.0 for k in graph.stages}
    t_last = [0.0] * n_ranks
    last_kind = ["B"] * n_ranks
    live = [0.0] * n_ranks
    queues = [{"F": [], "B": []} for _ in range(n_ranks)]
    order: list[list[str]] = [[] for _ in range(n_ranks)]
    start, end = {}, {}

    def push(k):
        s = graph.stages[k]
        heapq.heappush(queues[s.rank][s.kind], (-s.priority, s.mb, s.sub, s.chunk, k))

    for k, n in remaining.items():
        if n == 0:
            push(k)
    done = 0
    while done < len(graph.stages):
        best = None
        for r in range(n_ranks):
            kinds = ["B"] if memory_limit is not None and live[r] > memory_limit and queues[r]["B"] else ["F", "B"]
            cands = [t_start[e[-1]] for kd in kinds for e in queues[r][kd]]
            if cands:
                tm = min(cands)
                if best is None or tm < best[0]:
                    best = (tm, r, kinds)
        if best is None:
            raise ValueError("the stage graph has a cycle: "
                             f"{[k for k, n in remaining.items() if n > 0][:5]} never become ready")
        _, r, kinds = best
        ready = {kd: [e for e in queues[r][kd] if t_start[e[-1]] <= t_last[r]] for kd in kinds}
        if all(ready.get(kd) for kd in ("F", "B")):
            kd = "B" if last_kind[r] == "F" else "F"
            pick = min(ready[kd])
        else:
            pick = min((e for kd in kinds for e in queues[r][kd]), key=lambda e: (t_start[e[-1]], e))
        k = pick[-1]
        s = graph.stages[k]
        queues[r][s.kind].remove(pick)
        heapq.heapify(queues[r][s.kind])
        st = max(t_last[r], t_start[k])
        start[k], end[k] = st, st + s.latency
        t_last[r] = end[k]
        last_kind[r] = s.kind
        live[r] += s.activation_bytes if s.kind == "F" else -s.activation_bytes
        order[r].append(k)
        done += 1
        for e in succs[k]:
            d = graph.stages[e.dst]
            delay = comm_time(e) if d.rank != s.rank else 0.0
            t_start[e.dst] = max(t_start[e.dst], end[k] + delay)
            remaining[e.dst] -= 1
            if remaining[e.dst] == 0:
                push(e.dst)
    return Schedule(order=order, start=start, end=end)


def lower(graph: StageGraph, schedule: Schedule, chunk_ranks: list[int], *, step: int = 0,
          microbatches: list[dict] | None = None, recv_lookahead: int = 1) -> Plan:
    """Turn a schedule into a plan with explicit sends and receives (see the module docstring).

    ``recv_lookahead``: a rank posts the receives of its next ``recv_lookahead`` compute actions before running the
    current one (0: just before the consumer), so that a peer's send finds its receive posted and the transfer
    overlaps the current action (gloo and NCCL move data only once both sides are posted); each posted receive
    holds its buffer from then on.  Receives from one peer stay in that peer's send order.

    Raises:
        ValueError: ``recv_lookahead`` is not an int >= 0.
    """
    if isinstance(recv_lookahead, bool) or not isinstance(recv_lookahead, int) or recv_lookahead < 0:
        raise ValueError(f"recv_lookahead must be an int >= 0, got {recv_lookahead!r}")
    n_ranks = len(schedule.order)
    preds = graph.preds()
    # messages: one per cross-rank edge that carries tensors, numbered in the sender's order
    out_msgs: dict[str, list[Edge]] = defaultdict(list)
    for e in graph.edges:
        if graph.stages[e.src].rank != graph.stages[e.dst].rank and e.tensors:
            out_msgs[e.src].append(e)
    msg_id: dict[tuple[str, str], int] = {}
    ranks: list[list[Action]] = [[] for _ in range(n_ranks)]
    # receives per (sender, receiver) in sender order
    pending: dict[tuple[int, int], list[tuple[int, Edge]]] = defaultdict(list)
    for r in range(n_ranks):
        for k in schedule.order[r]:
            for e in sorted(out_msgs[k], key=lambda e: (graph.stages[e.dst].rank, schedule.start[e.dst], e.dst)):
                msg_id[(e.src, e.dst)] = len(msg_id)
                pending[(r, graph.stages[e.dst].rank)].append((msg_id[(e.src, e.dst)], e))
    posted: set[int] = set()

    def comm_action(kind: str, here: Stage, there: Stage, m: int, tensors) -> Action:
        return Action(kind=kind, chunk=here.chunk, mb=here.mb, sub=here.sub, peer_rank=there.rank,
                      peer_chunk=there.chunk, peer_sub=there.sub, msg=m, tensors=tuple(tensors))

    def post_receives(r: int, k: str) -> None:
        for e in preds[k]:
            src = graph.stages[e.src]
            if (e.src, e.dst) not in msg_id:
                continue
            m = msg_id[(e.src, e.dst)]
            if m in posted:
                continue
            queue = pending[(src.rank, r)]
            while queue:
                mm, ee = queue.pop(0)
                posted.add(mm)
                ranks[r].append(comm_action("RECV_" + ee.src[0], graph.stages[ee.dst], graph.stages[ee.src],
                                            mm, ee.tensors))
                if mm == m:
                    break

    for r in range(n_ranks):
        order = schedule.order[r]
        for i, k in enumerate(order):
            s = graph.stages[k]
            for j in range(i, min(i + recv_lookahead, len(order) - 1) + 1):
                post_receives(r, order[j])
            ranks[r].append(Action(kind=s.kind, chunk=s.chunk, mb=s.mb, sub=s.sub, strategy=s.strategy))
            for e in sorted(out_msgs[k], key=lambda e: msg_id[(e.src, e.dst)]):
                ranks[r].append(comm_action("SEND_" + s.kind, s, graph.stages[e.dst], msg_id[(e.src, e.dst)],
                                            e.tensors))
    deps = {k: sorted({e.src for e in preds[k]}) for k in graph.stages if preds[k]}
    sim = {"iteration_time": schedule.iteration_time,
           "start": schedule.start, "end": schedule.end}
    return Plan(step=step, chunk_ranks=list(chunk_ranks), ranks=ranks, deps=deps,
                microbatches=list(microbatches or []), simulated=sim)
