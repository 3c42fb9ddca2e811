"""Errors every layer raises or catches (the IR's layer: nothing here imports another dipc module).

:class:`BatchError` (a batch does not match the compiled pipeline) and :class:`NeedsCapture` (a batch needs a
capture where none may be made) live here so that the batch, instance and planner modules raise them without
importing the modules above them; :class:`dipc.plan.PlanError` stays with the plan IR and
:class:`dipc.capture.CaptureError` with capture.
"""
from __future__ import annotations

__all__ = ["BatchError", "NeedsCapture"]


class BatchError(ValueError):
    """A batch does not match the compiled pipeline (raised on every rank before any communication)."""


class NeedsCapture(RuntimeError):
    """:meth:`dipc.CompiledPipeline.program_for` needs a new capture where captures are not allowed (the background
    planner, :mod:`dipc.planner.background`: the training process makes it, and the planner is forked again)."""
