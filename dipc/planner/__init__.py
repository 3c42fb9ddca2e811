"""Per-batch planning (DESIGN.md layout): the memory-aware dual-queue interleaver lives in :mod:`dipc.schedule`
for now; :mod:`dipc.planner.memory` is DIP's per-rank memory ILP (shared/PAPER.md §2.5)."""
from .memory import apply_option, optimize_memory, prune_options

__all__ = ["apply_option", "optimize_memory", "prune_options"]
