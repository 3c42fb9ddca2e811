"""Per-batch planning (DESIGN.md layout): :mod:`dipc.planner.workload` (a step's stage graph),
:mod:`dipc.planner.planning` (``make_plan``: templates, the interleaver's candidates, lowering),
:mod:`dipc.planner.memory` (DIP's per-rank memory ILP, shared/PAPER.md §2.5), :mod:`dipc.planner.mcts` and
:mod:`dipc.planner.search` (MCTS, §2.3), :mod:`dipc.planner.background` (asynchronous planning, §2.2); and
:mod:`dipc.planner.schedule` (DIP's dual-queue list scheduler, §2.4), :mod:`dipc.planner.options` (the memory strategies of a pair), :mod:`dipc.planner.fitting` (fixed orders
timed and fitted to memory) and :mod:`dipc.planner.lowering` (a schedule to a plan); the numba loops are in
:mod:`dipc.planner.kernels` and :mod:`dipc.planner.memory_kernels`.  The stage graph they work on is the IR's
(:mod:`dipc.stages`).  The runtime imports these; nothing here imports the runtime or the compiler.
"""
from .memory import apply_option, optimize_memory, prune_options
from .planning import activation_budget, check_memory_limit, make_plan
from .workload import (StepWorkload, autocast_dtypes, autocast_state, build_workload, split_for, step_digest,
                       workload_digest)
from .options import memory_options, set_recompute

__all__ = ["apply_option", "optimize_memory", "prune_options", "activation_budget", "check_memory_limit", "make_plan",
           "StepWorkload", "autocast_dtypes", "autocast_state", "build_workload", "memory_options", "set_recompute",
           "split_for", "step_digest", "workload_digest"]
