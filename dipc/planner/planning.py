"""Planning one step: the activation budget per rank, the schedule templates and DIP's memory-aware dual-queue
interleaver (PAPER.md §2.4), the memory ILP (§2.5) and MCTS (§2.3), lowered to a checked :class:`dipc.plan.Plan`
(:func:`make_plan`).
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections import defaultdict
from typing import Sequence

from ..plan import Plan, PlanError, recompute_layout, stage_key, validate
from .memory import apply_option, copy_strategies, fit_order, optimize_memory
from ..stages import Edge, StageGraph, copy_stage
from .fitting import fit_by_recompute, order_peaks, timed_schedule
from .lowering import lower
from .schedule import list_schedule

from .workload import StepWorkload, gc_paused, memory_options, rebuild_need, group_rebuild_need, _input_bytes


# ---------------------------------------------------------------------------------------------------- planning
def check_memory_limit(memory_limit) -> float | None:
    """``memory_limit`` as a float, or None.

    Raises:
        ValueError: not None and not a finite number > 0 (a bool, a list, a string, NaN, infinity, <= 0), naming
            the value.
    """
    import math

    if memory_limit is None:
        return None
    if isinstance(memory_limit, bool) or not isinstance(memory_limit, (int, float)) \
            or not math.isfinite(memory_limit) or memory_limit <= 0:
        raise ValueError(f"memory_limit must be a finite number of bytes per device > 0 (or None for the device "
                         f"profile's capacity), got {memory_limit!r}")
    return float(memory_limit)


def activation_budget(compiled, memory_limit: float | None = None, optimizer_states: int = 2,
                      static_bytes=None) -> list[float | None]:
    """Per rank, the bytes of activations a plan may keep live: ``memory_limit`` (bytes per device; default the
    device profile's ``memory_capacity``) less the rank's static bytes (parameters, gradients and
    ``optimizer_states`` optimizer tensors per parameter, :meth:`dipc.CompiledPipeline.rank_state_bytes`; the
    runtime budgets for AdamW's 2; ``static_bytes``: per rank, given instead); ``None`` per rank when neither is
    known.

    Raises:
        ValueError: a bad ``memory_limit`` (:func:`check_memory_limit`) or ``optimizer_states`` (not an int >= 0).
        PlanError: a rank's static bytes alone exceed the limit.
    """
    dev = compiled.device
    memory_limit = check_memory_limit(memory_limit)
    if isinstance(optimizer_states, bool) or not isinstance(optimizer_states, int) or optimizer_states < 0:
        raise ValueError(f"optimizer_states must be an int >= 0 (tensors per parameter), got {optimizer_states!r}")
    cap = memory_limit if memory_limit is not None else (dev.memory_capacity if dev is not None else None)
    if cap is None:
        return [None] * compiled.pp_size
    static = list(static_bytes) if static_bytes is not None else compiled.rank_state_bytes(optimizer_states)
    out = []
    for r, st in enumerate(static):
        if st > cap:
            raise PlanError(f"rank {r} holds {st:.4g} bytes of parameters, gradients and optimizer states, over the "
                            f"memory limit of {cap:.4g} bytes before any activation")
        out.append(cap - st)
    return out


@gc_paused
def make_plan(compiled, workload: StepWorkload, step: int, *, check: bool = True,
              memory_limit: float | None = None, schedule: str = "dip", optimizer_states: int = 2,
              budget_s: float = 0.0, seed: int = 0, memory_opt: str = "ilp", static_bytes=None,
              search_workers: int = 1) -> Plan:
    """Schedule a step and lower it to a plan, checked with :func:`dipc.plan.validate` unless ``check`` is False
    (for callers that validate it themselves).

    ``schedule``: a template of :func:`dipc.schedules` (:mod:`dipc.codegen.templates`).  "dip" (default) is the
    dual-queue list scheduler (DIP §2.4); under each rank's activation budget (:func:`activation_budget`) the
    fastest simulated of several memory-feasible candidates (:func:`_interleave`).  The static templates fix
    each rank's order first (Optimus: encoder forwards first, then the list scheduler without a limit), then switch
    stages to recompute until every rank fits its budget (:func:`dipc.planner.fitting.fit_by_recompute`).  The plan's
    ``simulated`` records ``schedule``, ``recomputed`` (the forward-backward pairs that recompute) and
    ``plans_tried`` (the schedules made: one per reserve policy and per re-plan under smaller budgets when the
    simulated plan was over its limit; each linear in the stages).  The workload
    must have been split as the template needs (:func:`split_for`).

    ``memory_opt``: under a limit, how the pairs' memory strategies are chosen: "ilp" (default: DIP's per-rank
    ILP over keep / per-layer / full recompute, :func:`dipc.planner.memory.optimize_memory`) or "greedy" (whole
    chunks recompute at each peak, then go back to keep where memory is left: the previous planner, for the
    ablation).  ``budget_s`` > 0 (DIP only): then MCTS reorders the (microbatch, modality) groups' priorities for
    up to that many seconds (:func:`dipc.planner.search.search_priorities`, DIP §2.3, deterministic under ``seed``
    when the budget does not cut it), and the plan is the better of the search's and the interleaver's; under a
    memory limit the search has :data:`SEARCH_SHARE` of the budget and the rest fills the busiest rank's idle gaps
    with later forwards (:func:`_fill_gaps`, dipc's own local search); the progress of both is in
    ``plan.simulated["search"]`` (``"gap_fill"``: moves, seconds, and the scheduler's iteration estimate before and
    after, ``before_s`` / ``after_s``: without the simulator's posting costs and epilogue).  ``search_workers``:
    processes scoring its rollouts in parallel (DIP §2.3's parallel workers; at most half the host's cores,
    :func:`dipc.planner.mcts.max_workers`).

    Raises:
        ValueError: unknown ``schedule`` or ``memory_opt``, ``budget_s`` < 0.
        PlanError: a rank cannot fit its stages even recomputed, or the plan is invalid.
    """
    if memory_opt not in ("ilp", "greedy"):
        raise ValueError(f"memory_opt must be 'ilp' or 'greedy', got {memory_opt!r}")
    if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or not 0 <= budget_s < math.inf:
        raise ValueError(f"budget_s must be a number >= 0 (seconds), got {budget_s!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    from ..codegen.templates import encoder_first_edges, fixed_order, template

    t = template(schedule)
    if budget_s > 0 and t.kind != "interleave":
        raise ValueError(f"budget_s (the MCTS search) applies to schedule 'dip' only, not to the fixed template "
                         f"{schedule!r}")
    chunk_ranks = [c.rank for c in compiled.partition.chunks]
    dev = compiled.device
    T = compiled.tp_size  # each of a stage's T GPUs sends its shard over its own link
    comm = _comm_seconds(dev, T) if dev is not None else None
    limits = activation_budget(compiled, memory_limit, optimizer_states, static_bytes)
    static = list(static_bytes) if static_bytes is not None else compiled.rank_state_bytes(optimizer_states)
    graph = workload.graph
    P = compiled.pp_size

    limited = any(x is not None for x in limits)
    ilp = memory_opt == "ilp"
    budgets = list(limits)
    # forward -> its memory strategies (DIP §2.5's candidates), and those its rank allows under the reserve policy
    options = {k: memory_options(workload, k) for k, st in graph.stages.items()
               if st.kind == "F" and st.strategy == "keep"} if limited else {}
    allowed: dict[str, tuple] = {}
    inputs: dict[str, float] = {}

    least: dict[str, tuple | None] = {}  # forward -> its least-memory allowed option (cleared with ``allowed``)

    def recompute_cost(st):
        """The least-memory recompute the forward's rank allows (ties: the least backward seconds)."""
        v = least.get(st.key, False)
        if v is False:
            opts = [o for o in allowed.get(st.key, ()) if o[0] != "keep"]
            if opts:
                how, kept, extra, rebuild = min(opts, key=lambda o: (o[1], o[2]))
                v = (kept, extra, how, rebuild)
            else:
                v = None
            least[st.key] = v
        if v is not None:
            return v
        if st.key not in inputs:
            inputs[st.key] = _input_bytes(workload, st.key)
        return inputs[st.key], st.latency

    pristine = _copy_stages(graph) if limited or budget_s > 0 else None
    search = None
    hint: dict = {}  # the interleaver's best window candidate: the family the search's rollouts are scored in

    tried_plans = [0]  # list schedules + memory optimisations made (policies x re-plans under smaller budgets)

    def plan_once(limits):
        tried_plans[0] += 1
        if t.kind == "interleave" and not limited:  # the common path: one list schedule
            sched = list_schedule(graph, P, comm_time=comm)
        elif t.kind == "interleave":
            chunk_order, encoders = _virtual_stages(compiled)
            first = [Edge(src=a, dst=b) for a, b in encoder_first_edges(graph.stages, P, encoders, chunk_order)]
            seeds = [fixed_order(n, graph.stages, P, encoders, chunk_order) for n in ("1f1b", "mimo")]
            sched = _interleave(graph, P, comm, limits, recompute_cost, first, seeds, ilp=ilp, info=hint)
        else:
            chunk_order, encoders = _virtual_stages(compiled)
            if t.kind == "fixed":
                order = fixed_order(t.name, graph.stages, P, encoders, chunk_order)
            else:  # encoder_first: the list scheduler on the graph with the precedence edges, no limit
                extra = [Edge(src=a, dst=b) for a, b in encoder_first_edges(graph.stages, P, encoders, chunk_order)]
                order = _encoder_first_order(graph, P, comm, extra)
            if limited:  # the recompute its users turn on: per chunk for all microbatches (Optimus: per pair)
                fit_by_recompute(graph, order, limits, recompute_cost, uniform=t.kind == "fixed")  # whole chunks
                if ilp:
                    optimize_memory(graph, order, limits, uniform=t.kind == "fixed")  # the fewest layers that fit
            sched = timed_schedule(graph, order, comm_time=comm)
        return sched

    def over_limit(sched) -> list[float]:
        """Per rank, bytes the simulated plan (transients and buffers timed) is over its limit."""
        from ..sim.simulate import simulate_workload

        res = simulate_workload(compiled, workload, lower(graph, sched, chunk_ranks, step=step),
                                static_bytes=static)
        return [0.0 if budgets[r] is None else res.peak_memory[r] - static[r] - budgets[r] for r in range(P)]

    tol = 1e-9 * max((x or 0.0 for x in budgets), default=0.0)

    def plan_under(limits):
        """Plan, then re-plan under smaller budgets until the simulated plan fits (transients and buffers timed)."""
        sched = plan_once(limits)
        for attempt in range(MEMORY_ATTEMPTS if limited else 0):  # checked in the simulator, re-made smaller
            over = over_limit(sched)
            if max(over) <= tol:
                break
            r = max(range(P), key=lambda r: over[r])
            # each retry takes more off: the planner's own estimate may have had slack the overshoot did not show
            limits = [None if x is None else x - 1.05 * (2 ** attempt) * max(over[q], 0.0)
                      for q, x in enumerate(limits)]
            if attempt == MEMORY_ATTEMPTS - 1 or any(x is not None and x <= 0 for x in limits):
                raise PlanError(f"rank {r}'s plan stays {over[r]:.4g} bytes over its memory limit once its stages' "
                                f"transients and message buffers are counted ({attempt + 1} plans tried)")
            _take(graph, pristine)
            sched = plan_once(limits)
        return sched, limits

    if not limited:
        sched, _ = plan_under(limits)
    else:
        # transients, message buffers and a recomputing backward's rebuild come out of the activation budget
        # (DESIGN.md "Memory"); the rebuild's share depends on the strategies offered: each policy is planned, the
        # fastest plan that fits is kept; the group policies only when no other fits
        best, errors = None, []
        policies = _rebuild_policies(workload, P, options, budgets)
        tried, grouped = 0, False
        while True:
            if tried == len(policies) and best is None and not grouped:
                # neither a whole nor a one-layer rebuild fits: checkpoints of several layers (Megatron's uniform
                # recompute) trade kept inputs for a larger rebuild; their reserves are sized on the stages as
                # they came (the failed policies' plans switched some to recompute, which hid them from the sizing)
                _take(graph, pristine)
                policies += _group_policies(workload, P, options, budgets)
                grouped = True
            if tried == len(policies) or (grouped and best is not None):
                break  # every policy planned, or the first group size that fits
            policy, (reserve, rebuild) = policies[tried]
            tried += 1
            allowed.clear()
            least.clear()
            for k, opts in options.items():  # what rebuilds more than its rank keeps free for it is not an option
                r = graph.stages[k].rank
                allowed[k] = tuple(o for o in opts if o[0] == "keep" or o[3] <= rebuild[r] * (1 + 1e-9))
            net = [None if x is None else x - reserve[r] for r, x in enumerate(budgets)]
            short = [r for r, x in enumerate(net) if x is not None and x <= 0]
            if short:
                r = short[0]
                errors.append(PlanError(
                    f"rank {r} has no memory left for activations: its budget of {budgets[r]:.4g} bytes (the memory "
                    f"limit less its static state) is under the {reserve[r]:.4g} bytes its largest stage's transient, "
                    "the activations a recomputing backward rebuilds and its message buffers need"))
                continue
            _take(graph, pristine)
            for k in options:
                graph.stages[k].options = allowed[k] if ilp else ()
            hint.clear()
            try:
                sched, limits = plan_under(net)
            except PlanError as e:
                text = ", ".join(f"rank {r}: {net[r]:.4g}" for r in range(P) if net[r] is not None)
                errors.append(PlanError(f"{e} [activation budgets net of each rank's reserve for transients and "
                                        f"message buffers: {text} bytes]"))
                continue
            if best is None or sched.iteration_time < best[0].iteration_time * (1 - 1e-9):
                best = (sched, limits, _copy_stages(graph), dict(allowed), dict(hint))
        if best is None:
            raise errors[0]
        sched, limits, g, kept_allowed, kept_hint = best
        _take(graph, g)
        for k, st in g.stages.items():
            graph.stages[k].options = st.options
        allowed.clear()
        least.clear()
        allowed.update(kept_allowed)
        hint.clear()
        hint.update(kept_hint)
        for k in options:  # the search starts from the stages as they were, with the chosen policy's options
            pristine.stages[k].options = allowed[k] if ilp else ()
    if t.kind == "interleave" and budget_s > 0:  # DIP §2.3: MCTS over the groups' priorities, once, verified
        from .search import search_priorities

        t_search = time.perf_counter()
        found, search = search_priorities(pristine or _copy_stages(graph), P, comm, limits if limited else None,
                                          recompute_cost, budget_s * (SEARCH_SHARE if limited else 1.0), seed,
                                          ilp=ilp, workers=search_workers, window=hint.get("window"))
        # the search's plan only when it is really faster (not a rounding difference of the same schedule) and,
        # under a limit, fits once simulated with its transients and buffers; else the interleaver's stays
        if found is not None and found[0].iteration_time < sched.iteration_time * (1 - 1e-9):
            kept = _copy_stages(graph)
            _take(graph, found[1])
            if limited and max(over_limit(found[0])) > tol:
                _take(graph, kept)
            else:
                sched = found[0]
                search.improved = True
    gap_fill = None
    if t.kind == "interleave" and limited and budget_s > 0:  # the rest of the budget: the busiest rank's gaps
        t_fill = time.perf_counter()
        filled = _fill_gaps(graph, sched, P, comm, limits, t_search + budget_s, ilp)
        gap_fill = {"moves": 0, "seconds": 0.0, "before_s": sched.iteration_time, "after_s": sched.iteration_time}
        if filled[0].iteration_time < sched.iteration_time * (1 - 1e-9):
            kept = _copy_stages(graph)
            _take(graph, filled[1])
            if max(over_limit(filled[0])) > tol:  # as the search's: kept only if it fits once simulated
                _take(graph, kept)
            else:
                sched = filled[0]
                gap_fill["moves"], gap_fill["after_s"] = filled[2], sched.iteration_time
        gap_fill["seconds"] = time.perf_counter() - t_fill
    plan = lower(graph, sched, chunk_ranks, step=step,
                 microbatches=[mb.meta() for mb in workload.microbatches])
    plan.simulated["schedule"] = t.name
    plan.simulated["plans_tried"] = tried_plans[0]
    if search is not None:
        plan.simulated["search"] = {"rollouts": search.rollouts, "iterations": search.iterations,
                                    "exhausted": search.exhausted, "seconds": search.seconds,
                                    "best_over_time": search.history, "improved": bool(search.improved)}
        if gap_fill is not None:
            plan.simulated["search"]["gap_fill"] = gap_fill
    plan.simulated["recomputed"] = sum(1 for s in graph.stages.values() if s.kind == "F" and s.strategy != "keep")
    plan.simulated["recomputed_partly"] = sum(1 for s in graph.stages.values()
                                              if s.kind == "F" and s.strategy.startswith("recompute:"))
    if check:
        validate(plan)
        plan._validated = plan.digest()  # given back to PipelineRuntime.step unchanged, it is not validated again
    return plan


def _virtual_stages(compiled) -> tuple[list[int], list[str]]:
    """(chunks in topological order, the encoder modalities: every one but the loss chunk's)."""
    chunk_order = compiled.chunk_order()
    backbone = compiled.partition.chunks[chunk_order[-1]].modality
    return chunk_order, [m for m in compiled.partition.modalities if m != backbone]


def _encoder_first_order(graph: StageGraph, P: int, comm, extra: list[Edge]) -> list[list[str]]:
    """Per-rank order of the list scheduler (no limit) on ``graph`` plus the precedence edges ``extra``
    (:func:`dipc.codegen.templates.encoder_first_edges`: Optimus' coarse order)."""
    return list_schedule(StageGraph(stages=graph.stages, edges=graph.edges + extra), P, comm_time=comm).order


def _fill_gaps(graph: StageGraph, sched, P: int, comm, limits, deadline: float, ilp: bool = True,
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
    best_s, best_g = sched, _copy_stages(graph)
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
                g = _copy_stages(best_g)
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


def with_plan_strategies(w: StepWorkload, plan: Plan) -> StepWorkload:
    """``w`` with every forward-backward pair at the memory strategy ``plan`` gives its forward (bytes kept,
    backward seconds and rebuild from :func:`dipc.planner.workload.memory_options`), for simulating a plan on a
    workload other than the one it was made on: a rank that received its plan built its own workload, whose
    stages are still at "keep", so its step report read the plan's peak memory as if nothing recomputed.  Returns
    ``w`` itself when its stages already agree; else a copy (``w`` is not changed).  A pair whose stage is not at
    "keep" here (a forced strategy) or whose strategy is not among its options is left as it is."""
    want = {stage_key("F", a.chunk, a.mb, a.sub): a.strategy for _, a in plan.compute_actions() if a.kind == "F"}
    fix = [k for k, s in want.items() if k in w.graph.stages and w.graph.stages[k].strategy != s
           and w.graph.stages[k].strategy == "keep"]
    if not fix:
        return w
    g = _copy_stages(w.graph)
    for k in fix:
        layout = recompute_layout(want[k])
        opt = next((o for o in memory_options(w, k) if o[0] == want[k] or recompute_layout(o[0]) == layout), None)
        if opt is not None:
            apply_option(g, k, opt)
    return dataclasses.replace(w, graph=g)


def _comm_seconds(dev, T: int):
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


def _copy_stages(graph: StageGraph) -> StageGraph:
    return StageGraph(stages={k: copy_stage(st) for k, st in graph.stages.items()}, edges=graph.edges)


#: share of ``budget_s`` MCTS gets under a memory limit; the rest fills the busiest rank's gaps (:func:`_fill_gaps`)
SEARCH_SHARE = 0.7


#: plans :func:`make_plan` makes under a limit until the simulated one (transients and buffers timed) fits
MEMORY_ATTEMPTS = 6


#: in-flight windows DIP's planner tries under a memory limit, in multiples of P
WINDOWS = (1.5, 2, 3, 4)


#: rebuild policies of :func:`_buffer_reserve` (besides "group:<g>", g >= 2)
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


def _buffer_reserve(w: StepWorkload, P: int, options: dict | None = None,
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
    one-layer-at-a-time rebuild (per-layer recompute of every layer, :func:`dipc.planner.workload.rebuild_need`);
    "group:<g>": the largest rebuild of all layers in checkpoints of g
    (:func:`dipc.planner.workload.group_rebuild_need`, Megatron's uniform method); only strategies rebuilding at
    most the allowance are offered (``options``: forward -> :func:`dipc.planner.workload.memory_options`; without
    them, the "whole" allowance).

    Raises:
        ValueError: ``policy`` is not "whole", "layer" or "group:<g>" with g >= 2."""
    g = _group_size(policy)
    T = w.tp_size
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


def _rebuild_policies(w: StepWorkload, P: int, options: dict, budgets) -> list[tuple[str, tuple]]:
    """The rebuild policies of :func:`_buffer_reserve` worth planning, each with its reserve and allowance:
    "whole", and "layer" where it frees more than 5% of some rank's activation budget."""
    whole = _buffer_reserve(w, P, options, budgets, "whole")
    layer = _buffer_reserve(w, P, options, budgets, "layer")
    if any(b is not None and whole[0][r] - layer[0][r] > 0.05 * b for r, b in enumerate(budgets)):
        return [("whole", whole), ("layer", layer)]
    return [("whole", whole)]


def _group_policies(w: StepWorkload, P: int, options: dict, budgets) -> list[tuple[str, tuple]]:
    """The rebuild policies "group:<g>" (g = 2, 4, 8, ... below the most layers a chunk has), each with its
    reserve and allowance (:func:`_buffer_reserve`): tried, in this order, when neither "whole" nor "layer"
    fits - checkpoints of g layers keep a g-th of the per-layer inputs for a g times larger rebuild."""
    most = max((recompute_layout(o[0])[0] for opts in options.values() for o in opts if o[0] != "recompute"),
               default=0)
    out, g = [], 2
    while g < most:
        out.append((f"group:{g}", _buffer_reserve(w, P, options, budgets, f"group:{g}")))
        g *= 2
    return out


def _take(graph: StageGraph, g: StageGraph) -> None:
    """Copy the strategies, latencies and priorities a planning candidate ``g`` chose into ``graph``."""
    copy_strategies(graph, g)
    for k, st in g.stages.items():
        graph.stages[k].priority = st.priority


def _interleave(graph: StageGraph, P: int, comm, limits, recompute_cost, encoder_first=None, seeds=(), *,
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
    g = _copy_stages(graph)
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
        g = _copy_stages(graph)
        if "fixed" in o:
            order = o["fixed"]
        elif "extra" in o:
            order = _encoder_first_order(g, P, comm, o["extra"])
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
    _take(graph, g)
    return sched
