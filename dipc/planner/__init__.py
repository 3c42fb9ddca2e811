"""Per-batch planning (DESIGN.md layout): :mod:`dipc.planner.workload` (a step's stage graph),
:mod:`dipc.planner.planning` (``make_plan``: templates, the interleaver's candidates, lowering),
:mod:`dipc.planner.memory` (DIP's per-rank memory ILP, shared/PAPER.md §2.5), :mod:`dipc.planner.mcts` and
:mod:`dipc.planner.search` (MCTS, §2.3), :mod:`dipc.planner.background` (asynchronous planning, §2.2); and
:mod:`dipc.planner.schedule` (DIP's dual-queue list scheduler, §2.4, fitting to memory and ``lower``).  The
stage graph they work on is the IR's (:mod:`dipc.stages`).  The runtime imports these (its public names
re-exported from :mod:`dipc.runtime`); nothing here imports the runtime or the compiler."""
from .memory import apply_option, optimize_memory, prune_options

__all__ = ["apply_option", "optimize_memory", "prune_options"]
