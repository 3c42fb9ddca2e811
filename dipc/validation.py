"""Checking a plan (DESIGN.md "Plan IR"; DIP §2.8 verifies every plan before it runs): :func:`validate` (types,
every stage's inputs arrive before it runs, every send has its receive, forwards before their backwards, memory
strategies agree, the plan completes) through a dry run of every rank's list (:func:`dry_run`, :func:`replay`), and
the message bookkeeping the simulator and executor share (:func:`stage_keys`, :func:`incoming_messages`).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

from .plan import (COMPUTE, RECVS, SENDS, Action, Plan, PlanError, check_types, forward_key, paired_key,
                   offloads, recompute_layout, stage_key)

__all__ = ["validate", "dry_run", "replay", "stage_keys", "incoming_messages"]


def validate(plan: Plan, types: bool = True) -> list[tuple[int, int]]:
    """Check ``plan`` (see the module docstring) and return a feasible global execution order.

    ``types=False`` leaves out :func:`check_types`, for a plan built by dipc's own lowering whose JSON text every
    rank reads with :meth:`Plan.from_json`, which checks them before the plan runs (the background planner).  It
    trusts the fields' types: a plan with a field of the wrong type may then fail with a ``TypeError`` or
    ``IndexError`` instead of a :class:`PlanError`, or pass.

    Returns:
        ``[(rank, action index), ...]``: an interleaving of all ranks' lists that the dry run executed; running the
        actions in this order in one process is a faithful single-process execution of the plan.

    Raises:
        PlanError: naming the first problem found (a field of the wrong type, :func:`check_types`; unmatched
            send/receive, tensor mismatch, out-of-order messages between a rank pair, missing/duplicate/misplaced
            stage, broken dependency, deadlock, an incomplete plan: a forward without its backward or the other way
            round, a microbatch without stages; a backward in a forward-only plan).
    """
    if types:
        check_types(plan)
    # each action's stage key, made once (validate reads them several times per action)
    keys = stage_keys(plan)
    sends: dict[int, tuple[int, int, Action]] = {}
    recvs: dict[int, tuple[int, int, Action]] = {}
    where: dict[str, tuple[int, int]] = {}
    n_chunks = len(plan.chunk_ranks)
    for r, acts in enumerate(plan.ranks):
        ks = keys[r]
        for i, a in enumerate(acts):
            if plan.forward_only and a.kind in ("B", "SEND_B", "RECV_B"):
                raise PlanError(f"{a} on rank {r}: a forward-only plan has no backward actions")
            if a.kind in COMPUTE:
                st = ks[i]
                if st in where:
                    raise PlanError(f"stage {a} appears twice (rank {where[st][0]} and rank {r})")
                if not 0 <= a.chunk < n_chunks or plan.chunk_ranks[a.chunk] != r:
                    raise PlanError(f"stage {a} is on rank {r} but chunk {a.chunk} lives on rank "
                                    f"{plan.chunk_ranks[a.chunk] if 0 <= a.chunk < n_chunks else '?'}")
                where[st] = (r, i)
            elif a.kind in SENDS or a.kind in RECVS:
                table = sends if a.kind in SENDS else recvs
                if a.msg in table:
                    raise PlanError(f"message {a.msg} has two {a.kind} actions ({table[a.msg][2]} and {a})")
                if a.peer_rank == r or not 0 <= a.peer_rank < plan.n_ranks:
                    raise PlanError(f"{a} on rank {r} has invalid peer rank {a.peer_rank}")
                table[a.msg] = (r, i, a)
            else:
                raise PlanError(f"unknown action kind {a.kind!r} on rank {r}")
    # a message's two ends name each other's stages: the receive's peer is the send's stage and the other way round
    first_recv: dict[tuple[int, str, str], int] = {}  # (rank, stage, producer): the stage's first receive from it
    for msg, (r, i, s) in sends.items():
        if msg not in recvs:
            raise PlanError(f"send {s} on rank {r} (message {msg}) has no matching receive on rank {s.peer_rank}")
        rr, ri, v = recvs[msg]
        if rr != s.peer_rank or v.peer_rank != r:
            raise PlanError(f"message {msg}: {s} on rank {r} targets rank {s.peer_rank} but {v} is on rank {rr} "
                            f"expecting rank {v.peer_rank}")
        s_stage, v_stage = keys[r][i], keys[rr][ri]
        if s.kind[-1] != v.kind[-1] or s_stage != v.peer_stage or v_stage != s.peer_stage:
            raise PlanError(f"message {msg}: {s} (rank {r}) and {v} (rank {rr}) name different stages")
        if s.tensors != v.tensors:
            raise PlanError(f"message {msg}: {s} sends {[(t.name, t.shape, t.dtype) for t in s.tensors]} but {v} "
                            f"expects {[(t.name, t.shape, t.dtype) for t in v.tensors]}")
        fk = (rr, v_stage, s_stage)
        if first_recv.get(fk, ri) >= ri:
            first_recv[fk] = ri
    for msg, (r, _, v) in recvs.items():
        if msg not in sends:
            raise PlanError(f"receive {v} on rank {r} (message {msg}) has no matching send on rank {v.peer_rank}")
    # per rank pair, receives are posted in send order
    order_s: dict[tuple[int, int], list[int]] = defaultdict(list)
    order_r: dict[tuple[int, int], list[int]] = defaultdict(list)
    for r, acts in enumerate(plan.ranks):
        for a in acts:
            if a.kind in SENDS:
                order_s[(r, a.peer_rank)].append(a.msg)
            elif a.kind in RECVS:
                order_r[(a.peer_rank, r)].append(a.msg)
    for pair, msgs in order_s.items():
        if order_r[pair] != msgs:
            raise PlanError(f"messages from rank {pair[0]} to rank {pair[1]} are sent in order {msgs} but received "
                            f"in order {order_r[pair]}")
    # dependencies: a cross-rank one needs a receive from it before the stage (first receive per pair of stages)
    for st, deps in plan.deps.items():
        if st not in where:
            raise PlanError(f"stage {st} has dependencies but no action")
        r, i = where[st]
        for d in deps:
            if d not in where:
                raise PlanError(f"stage {st} depends on {d}, which no rank runs")
            dr, di = where[d]
            if dr == r:
                if di >= i:
                    raise PlanError(f"on rank {r}, {plan.ranks[r][i]} runs before its dependency "
                                    f"{plan.ranks[dr][di]}")
            else:
                if first_recv.get((r, st, d), i) >= i:
                    raise PlanError(f"{plan.ranks[r][i]} on rank {r} depends on {plan.ranks[dr][di]} on rank {dr} "
                                    "but receives nothing from it before running")
    layouts: dict[str, Any] = {}  # strategy -> its recompute layout (a handful of distinct strategies per plan)
    for st, (r, i) in where.items():
        a = plan.ranks[r][i]
        lay = layouts.get(a.strategy, layouts)
        if lay is layouts:
            try:
                lay = layouts[a.strategy] = recompute_layout(a.strategy)
            except PlanError as e:
                raise PlanError(f"{a.kind} of chunk {a.chunk}, microbatch {a.mb} on rank {r}: {e}") from None
        if a.kind == "B" and forward_key(st) in where:
            fr, fi = where[forward_key(st)]
            if fi >= i:
                raise PlanError(f"on rank {r}, {a} runs before its forward")
            fs = plan.ranks[fr][fi].strategy
            if recompute_layout(fs) != lay or offloads(fs) != offloads(a.strategy):  # "k" is "k/1"
                raise PlanError(f"{plan.ranks[fr][fi]} has memory strategy {plan.ranks[fr][fi].strategy!r} but its "
                                f"backward {a} has {a.strategy!r}")
    order = dry_run(plan, keys)
    # complete: every forward has its backward and the other way round, every microbatch has stages
    for st, (r, i) in ([] if plan.forward_only else where.items()):
        other = paired_key(st)
        if other not in where:
            a = plan.ranks[r][i]
            raise PlanError(f"the plan is incomplete: {a} on rank {r} has no {'backward' if a.kind == 'F' else 'forward'}"
                            f" ({other})")
    if plan.microbatches:
        have = {a.mb for acts in plan.ranks for a in acts if a.kind in COMPUTE}
        missing = sorted(set(range(len(plan.microbatches))) - have)
        if missing:
            raise PlanError(f"the plan is incomplete: microbatch(es) {missing[:5]} of {len(plan.microbatches)} have "
                            "no stage")
    return order


def stage_keys(plan: Plan) -> list[list[str]]:
    """Per rank, each action's :attr:`Action.stage` (computed once, for passes that read them many times)."""
    return [[stage_key(a.kind[-1], a.chunk, a.mb, a.sub) for a in acts] for acts in plan.ranks]


def incoming_messages(plan: Plan, keys: list[list[str]] | None = None) -> dict[str, list[int]]:
    """Stage key -> ids of the messages its compute action waits for.  ``keys``: :func:`stage_keys` of ``plan``,
    when the caller has them."""
    incoming: dict[str, list[int]] = defaultdict(list)
    for r, acts in enumerate(plan.ranks):
        for i, a in enumerate(acts):
            if a.kind in RECVS:
                incoming[keys[r][i] if keys is not None else a.stage].append(a.msg)
    return incoming


def replay(plan: Plan, visit: Callable[[int, int, "Action"], None], keys: list[list[str]] | None = None) -> None:
    """Run the plan's semantics symbolically and call ``visit(rank, index, action)`` for each action in an order
    that respects them: sends never block; a compute action runs once every message addressed to its stage has
    been sent and its receive posted.  Shared by :func:`dry_run` and the simulator.  ``keys``: :func:`stage_keys`
    of ``plan``, when the caller has them.

    Raises:
        PlanError: deadlock, naming each blocked rank's action and the messages it waits on.
    """
    if keys is None:
        keys = stage_keys(plan)
    incoming = incoming_messages(plan, keys)
    sent: set[int] = set()
    posted: set[int] = set()
    pc = [0] * plan.n_ranks
    left = sum(len(a) for a in plan.ranks)
    while left:
        progressed = False
        for r, acts in enumerate(plan.ranks):
            ks = keys[r]
            while pc[r] < len(acts):
                a = acts[pc[r]]
                if a.kind in COMPUTE and not all(m in sent and m in posted for m in incoming[ks[pc[r]]]):
                    break
                if a.kind in SENDS:
                    sent.add(a.msg)
                elif a.kind in RECVS:
                    posted.add(a.msg)
                visit(r, pc[r], a)
                pc[r] += 1
                left -= 1
                progressed = True
        if not progressed:
            waits = []
            for r, acts in enumerate(plan.ranks):
                if pc[r] < len(acts):
                    a = acts[pc[r]]
                    missing = [m for m in incoming[a.stage] if m not in sent or m not in posted]
                    waits.append(f"rank {r} at {a} waits on message(s) {missing}")
            raise PlanError("deadlock: " + "; ".join(waits))


def dry_run(plan: Plan, keys: list[list[str]] | None = None) -> list[tuple[int, int]]:
    """Execute the plan symbolically (:func:`replay`; ``keys``: :func:`stage_keys` of ``plan``, when the caller
    has them).

    Returns:
        the global order in which actions ran, ``[(rank, action index), ...]``.

    Raises:
        PlanError: deadlock, naming each blocked rank's action and the messages it waits on.
    """
    order: list[tuple[int, int]] = []
    replay(plan, lambda r, i, a: order.append((r, i)), keys)
    return order
