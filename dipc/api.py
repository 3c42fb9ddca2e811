"""The public API bound above every layer (DESIGN.md "Layout", 7): what ``dipc.simulate`` runs.

``dipc.compile`` and :class:`dipc.CompiledPipeline` live in :mod:`dipc.compiler`; this module holds the entry points
that combine the planner and the simulator.
"""
from __future__ import annotations

from .plan import Plan
from .planner.planning import make_plan
from .planner.options import set_recompute
from .planner.workload import autocast_state, build_workload, split_for
from .sim.simulate import SimResult, simulate_workload

__all__ = ["simulate"]


def simulate(compiled, batch, n_microbatches: int, *, comm_time=None, static_bytes=None,
             optimizer_states: int = 2, recompute=False, memory_limit: float | None = None,
             schedule: str = "dip", budget_s: float = 0.0, seed: int = 0,
             memory_opt: str = "ilp", search_workers: int = 1) -> tuple[SimResult, Plan]:
    """Plan one step of ``batch`` for ``compiled`` and simulate it with the pipeline's cost estimate (under
    ``torch.autocast`` the plan's messages carry autocast's dtypes, as ``pipe.step`` under it does).

    Stage latencies and activation bytes are those the planner used: with a device profile
    (``dipc.compile(..., device=...)``) the symbolic cost of each (chunk, sub-microbatch shape) on that device and
    P2P time from its bandwidth and latency; without one the first, nominal estimate (no transfer time).  Each
    rank's static memory defaults to :meth:`dipc.CompiledPipeline.rank_state_bytes` (parameters, gradients and
    ``optimizer_states`` optimizer tensors per parameter, buffers), so ``peak_memory`` adds live activations to it.

    With a device profile the step also pays what the runtime does around the plan: posting each SEND/RECV action
    (:meth:`dipc.sim.device.DeviceProfile.post_time`), a transfer starts only once its receive is posted (plus ``p2p_latency`` for the ready
    notice, as gloo and NCCL move data when both sides are posted), and after the last action the profile's
    ``step_overhead``, the exchange of each tied parameter's gradient among its k ranks (each sends it to the k - 1
    others: :func:`dipc.wire.sum_over_ranks`; :meth:`dipc.CompiledPipeline.tied_params`) and the loss all-reduce over the pipeline
    (:meth:`dipc.sim.device.DeviceProfile.allreduce_time`).

    ``memory_limit``: bytes per device (default: the device profile's ``memory_capacity``; none without it); the
    plan keeps each rank's static bytes (with ``optimizer_states``, as ``static_bytes`` defaults to) plus live
    activations under it (:func:`dipc.planner.activation_budget`).

    ``recompute``: the stages that recompute their forward in their backward (``True``: all; a predicate on the
    forward :class:`dipc.stages.Stage`): they keep only their inputs and their backward costs the forward again.

    ``schedule``: a template of :func:`dipc.schedules` ("dip", "gpipe", "1f1b", "mimo", "optimus"); each is held to
    the same ``memory_limit``, the static ones by recomputing stages until they fit (``result.recomputed``).

    ``budget_s``: seconds of DIP's MCTS segment reordering (§2.3) on top of the interleaver (0: the interleaver
    alone), deterministic under ``seed`` when the budget does not cut it; ``memory_opt``: "ilp" (DIP's per-rank
    memory ILP over keep / op-selective / per-layer / full recompute / activation offload, §2.5) or "greedy" (whole chunks); ``search_workers``:
    processes scoring the search's rollouts in parallel (capped at half the host's cores).  See
    :func:`dipc.planner.make_plan`.

    Returns:
        ``(result, plan)``; ``plan.simulated["search"]`` holds the search's progress when ``budget_s`` > 0.

    Raises:
        ValueError: unknown ``schedule`` or ``memory_opt``, ``budget_s`` < 0.
        PlanError: a rank cannot fit the limit even with its stages recomputed.
    """
    import torch

    mbs = split_for(compiled, batch, n_microbatches, schedule)
    # under torch.autocast the step's messages carry autocast's dtypes: plan them so (a plan made here runs there)
    amp = autocast_state(torch.device("cuda")) or autocast_state(torch.device("cpu"))
    w = build_workload(compiled, mbs, amp)
    if recompute:
        set_recompute(w, recompute)
    plan = make_plan(compiled, w, 0, memory_limit=memory_limit, schedule=schedule, optimizer_states=optimizer_states,
                     budget_s=budget_s, seed=seed, memory_opt=memory_opt, static_bytes=static_bytes,
                     search_workers=search_workers)
    return simulate_workload(compiled, w, plan, comm_time=comm_time, static_bytes=static_bytes,
                             optimizer_states=optimizer_states), plan
