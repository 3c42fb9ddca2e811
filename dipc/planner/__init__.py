"""Per-batch planning (DESIGN.md layout): :mod:`dipc.planner.workload` (a step's stage graph),
:mod:`dipc.planner.planning` (``make_plan``: templates, the interleaver's candidates, lowering),
:mod:`dipc.planner.memory` (DIP's per-rank memory ILP, shared/PAPER.md §2.5), :mod:`dipc.planner.mcts` and
:mod:`dipc.planner.search` (MCTS, §2.3), :mod:`dipc.planner.background` (asynchronous planning, §2.2); the
list scheduler itself lives in :mod:`dipc.schedule` for now.  The runtime imports these (re-exported from
:mod:`dipc.runtime` under their old names); nothing here imports the runtime."""
from .memory import apply_option, optimize_memory, prune_options

__all__ = ["apply_option", "optimize_memory", "prune_options"]
