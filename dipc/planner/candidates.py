"""The candidates DIP's planner chooses among for one step (shared/PAPER.md §2.4-2.5), and the pieces
:func:`dipc.planner.planning.make_plan` assembles them from: the memory-aware interleaver's candidates
(:func:`interleave`: the memory-aware admission, in-flight windows, the encoder-first order and template seeds, each
fitted to the ranks' activation budgets), the reserve each rank keeps for transients, message buffers and a
recomputing backward's rebuild (:func:`buffer_reserve`, :func:`rebuild_policies`, :func:`group_policies`), the gap
filling after MCTS (:func:`fill_gaps`) and transfer seconds per edge (:func:`comm_seconds`).  Units: seconds and
bytes.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Sequence

from ..plan import PlanError, recompute_layout
from ..stages import Edge, StageGraph, copy_stage
from .fitting import order_peaks, timed_schedule
from .memory import copy_strategies, fit_order, optimize_memory
from .schedule import list_schedule
from .workload import StepWorkload
from .options import _input_bytes, group_rebuild_need, rebuild_need

__all__ = ["virtual_stages", "encoder_first_order", "fill_gaps", "comm_seconds", "copy_stages", "buffer_reserve",
           "rebuild_policies", "group_policies", "take", "interleave", "WINDOWS", "REBUILD_POLICIES"]


def virtual_stages(compiled) -> tuple[list[int], list[str]]:
    """(chunks in topological order, the encoder modalities: every one but the loss chunk's)."""
    chunk_order = compiled.chunk_order()
    backbone = compiled.partition.chunks[chunk_order[-1]].modality
    return chunk_order, [m for m in compiled.partition.modalities if m != backbone]


def encoder_first_order(graph: StageGraph, P: int, comm, extra: list[Edge]) -> list[list[str]]:
    """Per-rank order of the list scheduler (no limit) on ``graph`` plus the precedence edges ``extra``
    (:func:`dipc.codegen.templates.encoder_first_edges`: Optimus' coarse order)."""
    return list_schedule(StageGraph(stages=graph.stages, edges=graph.edges + extra), P, comm_time=comm).order


def fill_gaps(graph: StageGraph, sched, P: int, comm, limits, deadline: float, ilp: bool = True,
               candidates: int = 2, lookahead: int = 64):
    """Local search after MCTS (dipc's own, not in the paper): the busiest rank's idle gaps filled with forwards
    from later in its order.  For each gap (in time order) the first ``candidates`` forwards among the next
    ``lookahead`` stages whose inputs are there when the gap opens are tried there in turn: that rank's memory
    strategies chosen again by its ILP (more live activations may need more recompute; the other ranks keep
    theirs), the order re-timed, and the first that shortens the iteration kept; then again from the start, until
    no move helps or ``time.perf_counter()`` passes ``deadline``.  The memory-feasible orders the interleaver and
    MCTS give stall the busiest rank where its memory is full and the backward it waits for is a pipeline round
    trip away (VLM-M / 16 microbatches: 0.84 s of rank-0 waits); a forward moved into the gap runs while it waits
    and pays in recompute (VLM-M / 16: 7.93 -> 7.71 s; VLM-M / 32: 15.47 -> 14.89 s).

    Returns ``(schedule, stage graph, moves)``: the best found (``sched`` and a copy of ``graph`` when nothing
    helped) and how many moves it took.
    """
    best_s, best_g = sched, copy_stages(graph)
    moves = 0
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        order, start, end = best_s.order, best_s.start, best_s.end
        preds = best_g.preds()
        busy = [0.0] * P
        for st in best_g.stages.values():
            busy[st.rank] += st.latency
        r = max(range(P), key=lambda q: busy[q])
        only_r = [limits[q] if q == r else None for q in range(P)]
        ks = order[r]
        for i in range(1, len(ks)):
            if start[ks[i]] - end[ks[i - 1]] <= 1e-9 * max(end[ks[i - 1]], 1.0):
                continue
            opened = end[ks[i - 1]]
            cands = []
            for j in range(i + 1, min(len(ks), i + 1 + lookahead)):
                if best_g.stages[ks[j]].kind != "F":
                    continue
                if all(e.src in end and end[e.src] + (comm(e) if comm is not None and
                                                      best_g.stages[e.src].rank != r else 0.0) <= opened * (1 + 1e-12)
                       for e in preds[ks[j]]):
                    cands.append(j)
                    if len(cands) >= candidates:
                        break
            for j in cands:
                if time.perf_counter() >= deadline:
                    break
                new = [list(o) for o in order]
                new[r].insert(i, new[r].pop(j))
                g = copy_stages(best_g)
                try:
                    if ilp:
                        if optimize_memory(g, new, only_r)["unsolved"]:
                            continue
                    elif order_peaks(g, new)[r][0] > limits[r]:
                        continue
                    ts = timed_schedule(g, new, comm_time=comm)
                except PlanError:
                    continue
                if ts.iteration_time < best_s.iteration_time * (1 - 1e-9):
                    best_s, best_g, improved = ts, g, True
                    moves += 1
                    break
            if improved or time.perf_counter() >= deadline:
                break
    return best_s, best_g, moves


def comm_seconds(dev, T: int):
    """Edge -> seconds its tensors take between ranks on ``dev`` (each of a stage's ``T`` GPUs sends its shard over
    its own link), remembered per edge: the planner's list schedules ask for every edge again (12 ms a rollout at
    VLM-S / 64 microbatches)."""
    memo: dict[int, tuple] = {}

    def comm(e):
        hit = memo.get(id(e))
        if hit is None or hit[0] is not e:
            hit = memo[id(e)] = (e, dev.p2p_time(sum(t.nbytes for t in e.tensors) / T))
        return hit[1]
    return comm


def copy_stages(graph: StageGraph) -> StageGraph:
    return StageGraph(stages={k: copy_stage(st) for k, st in graph.stages.items()}, edges=graph.edges)


#: in-flight windows DIP's planner tries under a memory limit, in multiples of P
WINDOWS = (1.5, 2, 3, 4)


#: rebuild policies of :func:`buffer_reserve` (besides "group:<g>", g >= 2)
REBUILD_POLICIES = ("whole", "layer")


def _group_size(policy: str) -> int:
    """g of a rebuild policy: 1 for "layer", g for "group:<g>", 0 for "whole".

    Raises:
        ValueError: not a known policy."""
    if policy == "whole":
        return 0
    if policy == "layer":
        return 1
    if isinstance(policy, str) and policy.startswith("group:"):
        g = policy[len("group:"):]
        if g.isascii() and g.isdigit() and g == str(int(g)) and int(g) >= 2:
            return int(g)
    raise ValueError(f"unknown rebuild policy {policy!r}; known: {REBUILD_POLICIES} and 'group:<g>' (g >= 2)")


def buffer_reserve(w: StepWorkload, P: int, options: dict | None = None,
                    budgets: Sequence[float | None] | None = None,
                    policy: str = "whole") -> tuple[list[float], list[float]]:
    """Per rank, ``(bytes per GPU kept out of the activation budget, of which the allowance for a recomputing
    backward's rebuild)``: the reserve is for what lives only around a stage - the largest stage's transient plus
    the messages it receives, the activations a recomputing backward rebuilds, another stage's receives (posted one
    action ahead) and two sends' packed copies in flight (DESIGN.md "Memory"; the simulator then checks the plan
    with every buffer timed).

    The rebuild allowance: any pair may be made to recompute, so the largest rebuild offered is kept free.
    ``policy`` "whole": a whole chunk rebuilt at once ("recompute" keeps only the chunk's inputs, its backward
    rebuilds all it did not keep), on every rank where that leaves activation memory (``budgets``: the limit less
    the static state, bytes); "layer" (and "whole" where a whole rebuild does not fit): the largest
    one-layer-at-a-time rebuild (per-layer recompute of every layer, :func:`dipc.planner.options.rebuild_need`);
    "group:<g>": the largest rebuild of all layers in checkpoints of g
    (:func:`dipc.planner.options.group_rebuild_need`, Megatron's uniform method); only strategies rebuilding at
    most the allowance are offered (``options``: forward -> :func:`dipc.planner.options.memory_options`; without
    them, the "whole" allowance).

    Raises:
        ValueError: ``policy`` is not "whole", "layer" or "group:<g>" with g >= 2."""
    g = _group_size(policy)
    T = w.message_shards
    recv: dict[str, float] = defaultdict(float)
    send: dict[str, float] = defaultdict(float)
    for e in w.graph.edges:
        if e.tensors:
            nb = sum(t.nbytes for t in e.tensors) / T
            recv[e.dst] += nb
            send[e.src] += nb
    out, allowance = [], []
    for r in range(P):
        ks = [k for k, st in w.graph.stages.items() if st.rank == r]
        top = max((w.graph.stages[k].transient_bytes + recv[k] for k in ks), default=0.0)
        fwd = [k for k in ks if w.graph.stages[k].kind == "F" and w.graph.stages[k].strategy == "keep"]
        whole = max((w.graph.stages[k].activation_bytes - _input_bytes(w, k) for k in fwd), default=0.0)
        forced = max((w.graph.stages[k].keep_bytes - w.graph.stages[k].activation_bytes for k in ks
                      if w.graph.stages[k].kind == "F" and w.graph.stages[k].keep_bytes is not None), default=0.0)
        base = top + max((recv[k] for k in ks), default=0.0) + 2 * max((send[k] for k in ks), default=0.0)
        again = max(whole, 0.0)
        if options is not None:
            one_layer = max((rebuild_need(options[k]) for k in fwd if k in options), default=0.0)
            again = max(again, one_layer)
            budget = None if budgets is None else budgets[r]
            if g >= 2:
                again = max((group_rebuild_need(options[k], g) for k in fwd if k in options), default=0.0)
            elif g == 1 or (budget is not None and base + max(again, forced) >= budget):
                again = one_layer
        allowance.append(again)
        out.append(base + max(again, forced, 0.0))
    return out, allowance


def rebuild_policies(w: StepWorkload, P: int, options: dict, budgets) -> list[tuple[str, tuple]]:
    """The rebuild policies of :func:`buffer_reserve` worth planning, each with its reserve and allowance:
    "whole", and "layer" where it frees more than 5% of some rank's activation budget."""
    whole = buffer_reserve(w, P, options, budgets, "whole")
    layer = buffer_reserve(w, P, options, budgets, "layer")
    if any(b is not None and whole[0][r] - layer[0][r] > 0.05 * b for r, b in enumerate(budgets)):
        return [("whole", whole), ("layer", layer)]
    return [("whole", whole)]


def group_policies(w: StepWorkload, P: int, options: dict, budgets) -> list[tuple[str, tuple]]:
    """The rebuild policies "group:<g>" (g = 2, 4, 8, ... below the most layers a chunk has), each with its
    reserve and allowance (:func:`buffer_reserve`): tried, in this order, when neither "whole" nor "layer"
    fits - checkpoints of g layers keep a g-th of the per-layer inputs for a g times larger rebuild."""
    most = max((recompute_layout(o[0])[0] for opts in options.values() for o in opts if o[0] != "recompute"),
               default=0)
    out, g = [], 2
    while g < most:
        out.append((f"group:{g}", buffer_reserve(w, P, options, budgets, f"group:{g}")))
        g *= 2
    return out


def take(graph: StageGraph, g: StageGraph) -> None:
    """Copy the strategies, latencies and priorities a planning candidate ``g`` chose into ``graph``."""
    copy_strategies(graph, g)
    for k, st in g.stages.items():
        graph.stages[k].priority = st.priority


def interleave(graph: StageGraph, P: int, comm, limits, recompute_cost, encoder_first=None, seeds=(), *,
                ilp: bool = True, info: dict | None = None):
    """DIP's dual-queue interleaving (§2.4) under the ranks' activation budgets (without one, :func:`make_plan`
    runs one list schedule): the best simulated of a few candidates (a first, fixed search over orders; the MCTS
    priorities and the memory ILP are the next issue's): the memory-aware admission (forwards wait for memory; the
    oldest recomputes when it does not fit), and orders made without a limit - each window W in :data:`WINDOWS`
    (W x P microbatches in flight per rank), the encoder-first order (``encoder_first``: the extra precedence
    edges, Optimus' coarse order) and ``seeds`` (fixed per-rank orders: the 1F1B and MIMO templates' orders on
    these sub-microbatched stages) - whose stages then recompute until they fit
    (:func:`dipc.planner.fitting.fit_by_recompute`) and go back to "keep" where memory is left
    (:func:`dipc.planner.fitting.relax_recompute`, a greedy phase 3).  The chosen candidate's strategies and latencies are
    written into ``graph``.

    ``info`` (a dict) receives ``"window"``: the in-flight window (microbatches per rank) of the fastest window
    candidate, the family MCTS scores its rollouts in (its priorities matter there; the seeds' fixed orders ignore
    them).

    Raises:
        PlanError: no candidate fits (the first error met).
    """
    cands, errs = [], []
    by_window: list[tuple[float, int]] = []
    g = copy_stages(graph)
    try:
        first = list_schedule(g, P, comm_time=comm, memory_limit=limits, recompute_cost=recompute_cost)
        if ilp and optimize_memory(g, first.order, limits)["solved"]:
            first = timed_schedule(g, first.order, comm_time=comm)
        cands.append((first, g))
    except PlanError as e:
        errs.append(e)
    orders = [dict(window=max(1, round(w * P))) for w in WINDOWS]
    if encoder_first:
        orders.append(dict(extra=encoder_first))
    orders += [dict(fixed=s) for s in seeds]
    for o in orders:
        g = copy_stages(graph)
        if "fixed" in o:
            order = o["fixed"]
        elif "extra" in o:
            order = encoder_first_order(g, P, comm, o["extra"])
        else:
            order = list_schedule(g, P, comm_time=comm, window=o["window"]).order
        try:  # a candidate that cannot fit, or a seed that deadlocks on these stages, is skipped
            fit_order(g, order, limits, recompute_cost, graph, ilp=ilp)  # the ILP; the greedy where it has none
            cands.append((timed_schedule(g, order, comm_time=comm), g))
            if "window" in o:
                by_window.append((cands[-1][0].iteration_time, o["window"]))
        except PlanError as e:
            errs.append(e)
    if info is not None and by_window:
        info["window"] = min(by_window)[1]
    if not cands:
        raise errs[0]
    sched, g = min(cands, key=lambda c: c[0].iteration_time)
    take(graph, g)
    return sched
