"""Planning one step (:func:`make_plan`), in named steps: the activation budget per rank (:func:`activation_budget`),
the template's order under those budgets (DIP's memory-aware dual-queue interleaver, shared/PAPER.md §2.4, with the
memory ILP, §2.5; or a fixed template fitted by recompute), MCTS over the groups' priorities (§2.3) and the gap
filling after it, then lowering to a checked :class:`dipc.plan.Plan`.  The candidates are built in
:mod:`dipc.planner.candidates`.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import time

from ..codegen.templates import Template, encoder_first_edges, fixed_order, template
from ..plan import Plan, PlanError, offloads, recompute_layout, stage_key
from ..validation import validate
from ..stages import Edge
from .candidates import (comm_seconds, copy_stages, encoder_first_order, fill_gaps, group_policies, interleave,
                         rebuild_policies, take, virtual_stages)
from .fitting import fit_by_recompute, timed_schedule
from .lowering import lower
from .memory import apply_option, optimize_memory
from .schedule import list_schedule
from .workload import StepWorkload, gc_paused
from .options import _input_bytes, memory_options

__all__ = ["make_plan", "activation_budget", "check_memory_limit", "check_memory_headroom", "headroom_bytes",
           "with_plan_strategies", "SEARCH_SHARE", "MEMORY_ATTEMPTS", "DEFAULT_HEADROOM"]

#: share of ``budget_s`` MCTS gets under a memory limit; the rest fills the busiest rank's gaps
#: (:func:`dipc.planner.candidates.fill_gaps`)
SEARCH_SHARE = 0.7

#: plans :func:`make_plan` makes under a limit until the simulated one (transients and buffers timed) fits
MEMORY_ATTEMPTS = 6


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
    if isinstance(memory_limit, bool) or not isinstance(memory_limit, numbers.Real) \
            or not math.isfinite(memory_limit) or memory_limit <= 0:
        raise ValueError(f"memory_limit must be a finite number of bytes per device > 0 (or None for the device "
                         f"profile's capacity), got {memory_limit!r}")
    return float(memory_limit)


#: the share of a device profile's ``memory_capacity`` plans leave free by default (DIP §2.5 plans to the device's
#: memory; the allocator's fragmentation, the CUDA context and NCCL's buffers take a few GB of an 80 GB GPU)
DEFAULT_HEADROOM = 0.05


def check_memory_headroom(memory_headroom) -> float | None:
    """``memory_headroom`` as a float, or None.

    Raises:
        ValueError: not None and not a finite number >= 0 of bytes (names the value).
    """
    if memory_headroom is None:
        return None
    if isinstance(memory_headroom, bool) or not isinstance(memory_headroom, numbers.Real) \
            or not math.isfinite(memory_headroom) or memory_headroom < 0:
        raise ValueError(f"memory_headroom must be a finite number of bytes per device >= 0 (or None for the "
                         f"default), got {memory_headroom!r}")
    return float(memory_headroom)


def headroom_bytes(compiled, memory_limit: float | None = None) -> float:
    """Bytes per device a plan leaves free under its limit: ``compiled.memory_headroom`` when set, else
    :data:`DEFAULT_HEADROOM` of the device profile's ``memory_capacity`` when the limit is that capacity
    (``memory_limit`` None), else 0 (an explicit ``memory_limit`` is what the plan may use).

    Raises:
        ValueError: a bad ``compiled.memory_headroom`` (:func:`check_memory_headroom`).
    """
    given = check_memory_headroom(getattr(compiled, "memory_headroom", None))
    if given is not None:
        return given
    dev = compiled.device
    if memory_limit is None and dev is not None and dev.memory_capacity is not None:
        return DEFAULT_HEADROOM * dev.memory_capacity
    return 0.0


#: the suffix of a rebuild policy planned with no offloading strategy offered (:meth:`Planner.schedule_under_budgets`)
NO_OFFLOAD = " without offload"


def activation_budget(compiled, memory_limit: float | None = None, optimizer_states: int = 2,
                      static_bytes=None) -> list[float | None]:
    """Per rank, the bytes of activations a plan may keep live: ``memory_limit`` (bytes per device; default the
    device profile's ``memory_capacity``) less the headroom left free (:func:`headroom_bytes`) and less the rank's
    static bytes (parameters, gradients and ``optimizer_states`` optimizer tensors per parameter,
    :meth:`dipc.CompiledPipeline.rank_state_bytes`; the runtime budgets for AdamW's 2; ``static_bytes``: per rank,
    given instead); ``None`` per rank when neither limit is known.

    Raises:
        ValueError: a bad ``memory_limit`` (:func:`check_memory_limit`), ``memory_headroom`` or ``optimizer_states``
            (not an int >= 0).
        PlanError: a rank's static bytes and the headroom alone exceed the limit.
    """
    dev = compiled.device
    memory_limit = check_memory_limit(memory_limit)
    if isinstance(optimizer_states, bool) or not isinstance(optimizer_states, int) or optimizer_states < 0:
        raise ValueError(f"optimizer_states must be an int >= 0 (tensors per parameter), got {optimizer_states!r}")
    cap = memory_limit if memory_limit is not None else (dev.memory_capacity if dev is not None else None)
    if cap is None:
        return [None] * compiled.pp_size
    room = headroom_bytes(compiled, memory_limit)
    static = list(static_bytes) if static_bytes is not None else compiled.rank_state_bytes(optimizer_states)
    out = []
    for r, st in enumerate(static):
        if st + room > cap:
            extra = f" and keeps {room:.6g} bytes free (memory_headroom)" if room else ""
            raise PlanError(f"rank {r} holds {st:.6g} bytes of parameters, gradients and optimizer states{extra}, "
                            f"over the memory limit of {cap:.6g} bytes before any activation")
        out.append(cap - room - st)
    return out


@gc_paused
def make_plan(compiled, workload: StepWorkload, step: int, *, check: bool = True,
              memory_limit: float | None = None, schedule: str | Template = "dip", optimizer_states: int = 2,
              budget_s: float = 0.0, seed: int = 0, memory_opt: str = "ilp", static_bytes=None,
              search_workers: int = 1) -> Plan:
    """Schedule a step and lower it to a plan, checked with :func:`dipc.validation.validate` unless ``check`` is False
    (for callers that validate it themselves).

    ``schedule``: a template of :func:`dipc.schedules` (:mod:`dipc.codegen.templates`), by name or as the resolved
    :class:`dipc.codegen.templates.Template`.  "dip" (default) is the
    dual-queue list scheduler (DIP §2.4); under each rank's activation budget (:func:`activation_budget`) the
    fastest simulated of several memory-feasible candidates (:func:`dipc.planner.candidates.interleave`).  The static templates fix
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
    with later forwards (:func:`dipc.planner.candidates.fill_gaps`, dipc's own local search); the progress of both is in
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
    t = schedule if isinstance(schedule, Template) else template(schedule)
    if budget_s > 0 and not t.searches:
        raise ValueError(f"budget_s (the MCTS search) applies to schedule 'dip' only, not to the fixed template "
                         f"{t.name!r}")
    if static_bytes is None:  # with the step's autocast copies of the weights
        static_bytes = compiled.rank_state_bytes(optimizer_states, workload.amp)
    planner = _StepPlanner(compiled, workload, step, t, memory_limit=memory_limit, optimizer_states=optimizer_states,
                           static_bytes=static_bytes, ilp=memory_opt == "ilp", searching=budget_s > 0)
    sched = planner.schedule_under_budgets()
    search = gap_fill = None
    if t.searches and budget_s > 0:
        t_search = time.perf_counter()
        sched, search = planner.search(sched, budget_s, seed, search_workers)
        if planner.limited:  # the rest of the budget: the busiest rank's gaps
            sched, gap_fill = planner.fill_gaps(sched, t_search + budget_s)
    plan = planner.lower(sched, search, gap_fill)
    if check:
        validate(plan)
        plan._validated = plan.digest()  # given back to PipelineRuntime.step unchanged, it is not validated again
    return plan


class _StepPlanner:
    """One step's planning state: the stage graph being planned (its strategies, latencies and priorities change
    as candidates are tried), the untouched copy candidates start from (``pristine``), each rank's activation
    budget and the memory strategies each forward may take under the chosen reserve policy.  The named steps are
    :meth:`schedule_under_budgets`, :meth:`search`, :meth:`fill_gaps` and :meth:`lower`."""

    def __init__(self, compiled, workload: StepWorkload, step: int, t: Template, *, memory_limit, optimizer_states,
                 static_bytes, ilp: bool, searching: bool):
        self.compiled, self.workload, self.step, self.t, self.ilp = compiled, workload, step, t, ilp
        self.chunk_ranks = [c.rank for c in compiled.partition.chunks]
        dev = compiled.device
        T = compiled.message_shards  # with sequence parallelism each GPU sends its shard over its own link
        self.comm = comm_seconds(dev, T) if dev is not None else None
        self.limits = activation_budget(compiled, memory_limit, optimizer_states, static_bytes)
        room = headroom_bytes(compiled, memory_limit) if any(x is not None for x in self.limits) else 0.0
        self.headroom_note = f" and the {room:.4g} bytes memory_headroom keeps free" if room else ""
        self.static = list(static_bytes) if static_bytes is not None else compiled.rank_state_bytes(optimizer_states)
        self.graph = workload.graph
        self.P = compiled.pp_size
        self.limited = any(x is not None for x in self.limits)
        self.budgets = list(self.limits)
        # forward -> its memory strategies (DIP §2.5's candidates), and those its rank allows under the reserve policy
        self.options = {k: memory_options(workload, k) for k, st in self.graph.stages.items()
                        if st.kind == "F" and st.strategy == "keep"} if self.limited else {}
        self.allowed: dict[str, tuple] = {}
        self.inputs: dict[str, float] = {}
        self.least: dict[str, tuple | None] = {}  # forward -> its least-memory allowed option (cleared with allowed)
        # bytes of offloaded activations a rank may hold (the profile's host memory per GPU), on every forward: the
        # memory ILP keeps each rank's choice within it (dipc.planner.host_memory)
        self.host_limit = dev.host_memory if workload.host_bandwidth and self.limited else None
        if self.host_limit is not None:
            for st in self.graph.stages.values():
                if st.kind == "F":
                    st.host_limit = self.host_limit
        # the stages as they came: each candidate, and MCTS, starts from them
        self.pristine = copy_stages(self.graph) if self.limited or searching else None
        self.hint: dict = {}  # the interleaver's best window candidate: the family MCTS's rollouts are scored in
        self.tried_plans = 0  # list schedules + memory optimisations made (policies x re-plans under smaller budgets)
        self.tol = 1e-9 * max((x or 0.0 for x in self.budgets), default=0.0)

    def recompute_cost(self, st):
        """The least-memory recompute the forward's rank allows (ties: the least backward seconds)."""
        v = self.least.get(st.key, False)
        if v is False:
            # (offloading strategies are the ILP's to choose: it bounds their host bytes per rank, host_memory.py)
            opts = [o for o in self.allowed.get(st.key, ()) if o[0] != "keep" and not offloads(o[0])]
            if opts:
                how, kept, extra, rebuild = min(opts, key=lambda o: (o[1], o[2]))
                v = (kept, extra, how, rebuild)
            else:
                v = None
            self.least[st.key] = v
        if v is not None:
            return v
        if st.key not in self.inputs:
            self.inputs[st.key] = _input_bytes(self.workload, st.key)
        return self.inputs[st.key], st.latency

    def plan_once(self, limits):
        """The template's schedule of the graph under ``limits`` (activation bytes per rank)."""
        t, graph, P, comm = self.t, self.graph, self.P, self.comm
        self.tried_plans += 1
        if t.kind == "interleave" and not self.limited:  # the common path: one list schedule
            return list_schedule(graph, P, comm_time=comm)
        chunk_order, encoders = virtual_stages(self.compiled)
        if t.kind == "interleave":
            first = [Edge(src=a, dst=b) for a, b in encoder_first_edges(graph.stages, P, encoders, chunk_order)]
            seeds = [fixed_order(n, graph.stages, P, encoders, chunk_order) for n in ("1f1b", "mimo")]
            return interleave(graph, P, comm, limits, self.recompute_cost, first, seeds, ilp=self.ilp,
                              info=self.hint)
        if t.kind == "fixed":
            order = fixed_order(t.name, graph.stages, P, encoders, chunk_order)
        else:  # encoder_first: the list scheduler on the graph with the precedence edges, no limit
            extra = [Edge(src=a, dst=b) for a, b in encoder_first_edges(graph.stages, P, encoders, chunk_order)]
            order = encoder_first_order(graph, P, comm, extra)
        if self.limited:  # the recompute its users turn on: per chunk for all microbatches (Optimus: per pair)
            fit_by_recompute(graph, order, limits, self.recompute_cost, uniform=t.kind == "fixed")  # whole chunks
            if self.ilp:
                optimize_memory(graph, order, limits, uniform=t.kind == "fixed")  # the fewest layers that fit
        return timed_schedule(graph, order, comm_time=comm)

    def over_limit(self, sched) -> list[float]:
        """Per rank, bytes the simulated plan (transients and buffers timed) is over its limit."""
        from ..sim.simulate import simulate_workload

        plan = lower(self.graph, sched, self.chunk_ranks, step=self.step)
        res = simulate_workload(self.compiled, self.workload, plan, static_bytes=self.static)
        return [0.0 if self.budgets[r] is None else res.peak_memory[r] - self.static[r] - self.budgets[r]
                for r in range(self.P)]

    def plan_under(self, limits):
        """Plan, then re-plan under smaller budgets until the simulated plan fits (transients and buffers timed)."""
        sched = self.plan_once(limits)
        for attempt in range(MEMORY_ATTEMPTS if self.limited else 0):  # checked in the simulator, re-made smaller
            over = self.over_limit(sched)
            if max(over) <= self.tol:
                break
            r = max(range(self.P), key=lambda r: over[r])
            # each retry takes more off: the planner's own estimate may have had slack the overshoot did not show
            limits = [None if x is None else x - 1.05 * (2 ** attempt) * max(over[q], 0.0)
                      for q, x in enumerate(limits)]
            if attempt == MEMORY_ATTEMPTS - 1 or any(x is not None and x <= 0 for x in limits):
                raise PlanError(f"rank {r}'s plan stays {over[r]:.4g} bytes over its memory limit once its stages' "
                                f"transients and message buffers are counted ({attempt + 1} plans tried)")
            take(self.graph, self.pristine)
            sched = self.plan_once(limits)
        return sched, limits

    def schedule_under_budgets(self):
        """DIP §2.4-2.5: the template's schedule under each rank's activation budget.  Transients, message buffers
        and a recomputing backward's rebuild come out of the budget (DESIGN.md "Memory"); the rebuild's share
        depends on the strategies offered: each reserve policy is planned and the fastest plan that fits kept, the
        group policies only when no other fits.

        Raises:
            PlanError: no policy fits (the first error met).
        """
        graph, P, budgets, options, allowed = self.graph, self.P, self.budgets, self.options, self.allowed
        if not self.limited:
            sched, _ = self.plan_under(self.limits)
            return sched
        best, errors = None, []
        policies = rebuild_policies(self.workload, P, options, budgets)
        if self.host_limit is not None:  # offload's exposure is an estimate: each policy is planned without it too,
            # and the fastest plan kept, so offering offload never leaves a step slower than not offering it
            policies += [(name + NO_OFFLOAD, v) for name, v in policies]
        tried, grouped = 0, False
        while True:
            if tried == len(policies) and best is None and not grouped:
                # neither a whole nor a one-layer rebuild fits: checkpoints of several layers (Megatron's uniform
                # recompute) trade kept inputs for a larger rebuild; their reserves are sized on the stages as
                # they came (the failed policies' plans switched some to recompute, which hid them from the sizing)
                take(graph, self.pristine)
                policies += group_policies(self.workload, P, options, budgets)
                grouped = True
            if tried == len(policies) or (grouped and best is not None):
                break  # every policy planned, or the first group size that fits
            policy, (reserve, rebuild) = policies[tried]
            tried += 1
            allowed.clear()
            self.least.clear()
            for k, opts in options.items():  # what rebuilds more than its rank keeps free for it is not an option
                r = graph.stages[k].rank
                allowed[k] = tuple(o for o in opts if (o[0] == "keep" or o[3] <= rebuild[r] * (1 + 1e-9))
                                   and not (policy.endswith(NO_OFFLOAD) and offloads(o[0])))
            net = [None if x is None else x - reserve[r] for r, x in enumerate(budgets)]
            short = [r for r, x in enumerate(net) if x is not None and x <= 0]
            if short:
                r = short[0]
                errors.append(PlanError(
                    f"rank {r} has no memory left for activations: its budget of {budgets[r]:.4g} bytes (the memory "
                    f"limit less its static state{self.headroom_note}) is under the {reserve[r]:.4g} bytes its "
                    "largest stage's transient, the activations a recomputing backward rebuilds and its message "
                    f"buffers need: raise the memory limit by at least {reserve[r] - budgets[r]:.4g} bytes, or use "
                    "more ranks or smaller microbatches"))
                continue
            take(graph, self.pristine)
            for k in options:
                graph.stages[k].options = allowed[k] if self.ilp else ()
            self.hint.clear()
            try:
                sched, limits = self.plan_under(net)
            except PlanError as e:
                text = ", ".join(f"rank {r}: {net[r]:.4g}" for r in range(P) if net[r] is not None)
                errors.append(PlanError(f"{e} [activation budgets net of each rank's reserve for transients and "
                                        f"message buffers: {text} bytes]"))
                continue
            if best is None or sched.iteration_time < best[0].iteration_time * (1 - 1e-9):
                best = (sched, limits, copy_stages(graph), dict(allowed), dict(self.hint))
        if best is None:
            raise errors[0]
        sched, self.limits, g, kept_allowed, kept_hint = best
        take(graph, g)
        for k, st in g.stages.items():
            graph.stages[k].options = st.options
        allowed.clear()
        self.least.clear()
        allowed.update(kept_allowed)
        self.hint.clear()
        self.hint.update(kept_hint)
        for k in options:  # the search starts from the stages as they were, with the chosen policy's options
            self.pristine.stages[k].options = allowed[k] if self.ilp else ()
        return sched

    def search(self, sched, budget_s: float, seed: int, workers: int):
        """DIP §2.3: MCTS over the groups' priorities, once; its plan replaces ``sched`` only when really faster
        (not a rounding difference of the same schedule) and, under a limit, when it fits once simulated with its
        transients and buffers.  Returns ``(schedule, the search's record)``."""
        from .search import search_priorities

        graph = self.graph
        found, search = search_priorities(self.pristine or copy_stages(graph), self.P, self.comm,
                                          self.limits if self.limited else None, self.recompute_cost,
                                          budget_s * (SEARCH_SHARE if self.limited else 1.0), seed, ilp=self.ilp,
                                          workers=workers, window=self.hint.get("window"))
        if found is not None and found[0].iteration_time < sched.iteration_time * (1 - 1e-9):
            kept = copy_stages(graph)
            take(graph, found[1])
            if self.limited and max(self.over_limit(found[0])) > self.tol:
                take(graph, kept)
            else:
                sched = found[0]
                search.improved = True
        return sched, search

    def fill_gaps(self, sched, deadline: float):
        """The busiest rank's idle gaps filled with later forwards until ``deadline`` (``time.perf_counter()``
        seconds; :func:`dipc.planner.candidates.fill_gaps`), kept only if it fits once simulated.  Returns
        ``(schedule, {"moves", "seconds", "before_s", "after_s"})``."""
        t_fill = time.perf_counter()
        filled = fill_gaps(self.graph, sched, self.P, self.comm, self.limits, deadline, self.ilp)
        gap_fill = {"moves": 0, "seconds": 0.0, "before_s": sched.iteration_time, "after_s": sched.iteration_time}
        if filled[0].iteration_time < sched.iteration_time * (1 - 1e-9):
            kept = copy_stages(self.graph)
            take(self.graph, filled[1])
            if max(self.over_limit(filled[0])) > self.tol:  # as the search's: kept only if it fits once simulated
                take(self.graph, kept)
            else:
                sched = filled[0]
                gap_fill["moves"], gap_fill["after_s"] = filled[2], sched.iteration_time
        gap_fill["seconds"] = time.perf_counter() - t_fill
        return sched, gap_fill

    def lower(self, sched, search, gap_fill) -> Plan:
        """The schedule as a plan (:func:`dipc.planner.lowering.lower`), with what planning found in its
        ``simulated`` record."""
        graph = self.graph
        plan = lower(graph, sched, self.chunk_ranks, step=self.step,
                     microbatches=[mb.meta() for mb in self.workload.microbatches])
        plan.simulated["schedule"] = self.t.name
        plan.simulated["plans_tried"] = self.tried_plans
        if search is not None:
            plan.simulated["search"] = {"rollouts": search.rollouts, "iterations": search.iterations,
                                        "exhausted": search.exhausted, "seconds": search.seconds,
                                        "best_over_time": search.history, "improved": bool(search.improved)}
            if gap_fill is not None:
                plan.simulated["search"]["gap_fill"] = gap_fill
        plan.simulated["recomputed"] = sum(1 for s in graph.stages.values() if s.kind == "F" and s.strategy != "keep")
        plan.simulated["recomputed_partly"] = sum(1 for s in graph.stages.values()
                                                  if s.kind == "F" and s.strategy.startswith("recompute:"))
        return plan


def with_plan_strategies(w: StepWorkload, plan: Plan) -> StepWorkload:
    """``w`` with every forward-backward pair at the memory strategy ``plan`` gives its forward (bytes kept,
    backward seconds and rebuild from :func:`dipc.planner.options.memory_options`), for simulating a plan on a
    workload other than the one it was made on: a rank that received its plan built its own workload, whose
    stages are still at "keep", so its step report read the plan's peak memory as if nothing recomputed.  Returns
    ``w`` itself when its stages already agree; else a copy (``w`` is not changed).  A pair whose stage is not at
    "keep" here (a forced strategy) or whose strategy is not among its options is left as it is."""
    want = {stage_key("F", a.chunk, a.mb, a.sub): a.strategy for _, a in plan.compute_actions() if a.kind == "F"}
    fix = [k for k, s in want.items() if k in w.graph.stages and w.graph.stages[k].strategy != s
           and w.graph.stages[k].strategy == "keep"]
    if not fix:
        return w
    g = copy_stages(w.graph)
    for k in fix:
        layout = recompute_layout(want[k])
        opt = next((o for o in memory_options(w, k) if o[0] == want[k] or (recompute_layout(o[0]) == layout
                                                                       and offloads(o[0]) == offloads(want[k]))),
                   None)
        if opt is not None:
            apply_option(g, k, opt)
    return dataclasses.replace(w, graph=g)
