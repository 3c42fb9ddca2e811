"""Lowering a schedule (each rank's order of compute stages) into a :class:`dipc.plan.Plan` (DIP §2.4's last step,
DESIGN.md "Plan IR").

:func:`lower` places a ``SEND`` right after the stage that produces a message, and the matching ``RECV`` on the
receiver one compute action ahead of the first stage that needs it (``recv_lookahead``), in the sender's order (so the
plan is valid under in-order matching too).
"""
from __future__ import annotations

from collections import defaultdict, deque

from ..plan import Action, Plan
from ..stages import Edge, Schedule, Stage, StageGraph

__all__ = ["lower"]


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
    stages = graph.stages
    ranks: list[list[Action]] = [[] for _ in range(n_ranks)]
    # receives per (sender, receiver) in sender order
    pending: dict[tuple[int, int], deque[tuple[int, Edge]]] = defaultdict(deque)
    sends: dict[str, list[tuple[int, Edge]]] = {}  # stage -> its messages, numbered in send order
    msg_id: dict[tuple[str, str], int] = {}
    for r in range(n_ranks):
        for k in schedule.order[r]:
            if k not in out_msgs:
                continue
            mine = sends[k] = []
            for e in sorted(out_msgs[k], key=lambda e: (stages[e.dst].rank, schedule.start[e.dst], e.dst)):
                m = msg_id[(e.src, e.dst)] = len(msg_id)
                mine.append((m, e))
                pending[(r, stages[e.dst].rank)].append((m, e))
    # stage -> (message, sender rank) of each message it waits on, in its edges' order
    incoming = {k: [(msg_id[(e.src, e.dst)], stages[e.src].rank) for e in es if (e.src, e.dst) in msg_id]
                for k, es in preds.items()}
    posted: set[int] = set()

    def comm_action(kind: str, here: Stage, there: Stage, m: int, tensors) -> Action:
        return Action(kind, here.chunk, here.mb, here.sub, there.rank, there.chunk, there.sub, m, tuple(tensors))

    def post_receives(r: int, k: str) -> None:
        for m, src_rank in incoming.get(k, ()):  # in the order of the edges into k
            if m in posted:
                continue
            queue = pending[(src_rank, r)]
            while queue:
                mm, ee = queue.popleft()
                posted.add(mm)
                ranks[r].append(comm_action("RECV_" + ee.src[0], stages[ee.dst], stages[ee.src], mm, ee.tensors))
                if mm == m:
                    break

    for r in range(n_ranks):
        order = schedule.order[r]
        last = len(order) - 1
        acts = ranks[r]
        ahead = -1  # the receives of order[: ahead + 1] are posted (a stage's, once posted, are all posted)
        for i, k in enumerate(order):
            s = stages[k]
            for j in range(max(i, ahead + 1), min(i + recv_lookahead, last) + 1):
                post_receives(r, order[j])
                ahead = j
            acts.append(Action(s.kind, s.chunk, s.mb, s.sub, strategy=s.strategy))
            for m, e in sends.get(k, ()):
                acts.append(comm_action("SEND_" + s.kind, s, stages[e.dst], m, e.tensors))
    deps = {k: sorted({e.src for e in preds[k]}) for k in graph.stages if preds[k]}
    # the scheduler's estimate of the step; its per-stage start and end times stay with the schedule: no rank reads
    # them, and they were 40% of the plan's JSON, written, sent, digested and read on every step (the simulator
    # times each action itself, dipc.simulate)
    sim = {"iteration_time": schedule.iteration_time}
    return Plan(step=step, chunk_ranks=list(chunk_ranks), ranks=ranks, deps=deps,
                microbatches=list(microbatches or []), simulated=sim)
