"""What a step did: :class:`StepReport` (``pipe.last_report``), :func:`measured_events` (a rank's measured actions
as trace events), and :func:`prefetch`, the look-ahead that lets the background planner plan the next batch while
this one runs."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch


@dataclasses.dataclass
class StepReport:
    """What :meth:`PipelineRuntime.step` did (``pipe.last_report``; DIP's plan report, §2.2/§2.4).

    Attributes:
        step: the step index.
        schedule: the template that ran ("dip" or a fallback).
        plan_source: "async" (made by the background planner while the previous step ran), "sync" (made by rank 0
            at the start of the step), "given" (``step(plan=...)``) or "fallback" (the background plan missed its
            deadline, failed or its process died: ``schedule`` is the fallback template's).
        fallbacks: steps of this runtime that fell back so far.
        fallback_reason: why this step did not get its background plan ("" when it did, or none was asked for).
        plan_s: seconds of the training thread from the step's start to the plan's delivery (splitting, the
            workload, planning when synchronous, the header broadcast and digest check).
        execute_s: seconds of the plan's execution and the step's all-reduces.
        planner_s: wall seconds the background planner took for this plan, waiting for idle cores included (None
            when it did not make it); ``planner_cpu_s`` its CPU seconds.
        predicted_s: the plan's simulated iteration time in seconds (the device profile's, or the first estimate).
        search: the MCTS progress of ``plan.simulated["search"]`` (rollouts, best score over time), or None.
        simulation: the simulated step's ``iteration_time``, ``bound``, ``bubble_ratio``, ``bubble_causes`` (per
            rank: busy, fill, waits, drain, posting seconds) and ``peak_memory`` (bytes per rank); made by the
            background planner after the plan (read when asked for), or on first use of :meth:`simulate`.
    """

    step: int
    schedule: str
    plan_source: str
    fallbacks: int
    fallback_reason: str
    plan_s: float
    execute_s: float
    planner_s: float | None
    planner_cpu_s: float | None
    predicted_s: float | None
    search: dict | None
    simulation: dict | None
    _pipe: Any = dataclasses.field(default=None, repr=False)
    _plan: Any = dataclasses.field(default=None, repr=False)
    _workload: Any = dataclasses.field(default=None, repr=False)

    def _fetch(self) -> dict | None:
        planner = getattr(self._pipe, "_planner", None)
        if self.simulation is None and self.plan_source == "async" and planner is not None:
            self.simulation = planner.simulation(self.step)  # sent after the plan; never waits
        return self.simulation

    def simulate(self) -> dict:
        """:attr:`simulation`: the background planner's when it sent it, else made now (on this rank)."""
        if self._fetch() is None:
            from ..planner.background import simulated_summary

            self.simulation = simulated_summary(self._pipe.compiled, self._workload, self._plan,
                                       self._pipe.compiled.rank_state_bytes())
        return self.simulation

    def summary(self) -> str:
        """One line: the schedule and where its plan came from (``sync``: planned on the training thread; ``async``:
        by the background planner while the previous step ran; ``fallback``), planning time on the training thread
        and in the background planner, the plan's predicted step time (the cost model's: nominal 1 TFLOP/s without a
        device profile) and the measured time of executing it, the simulated bubble ratio when known, fallbacks."""
        parts = [f"{self.schedule} plan ({self.plan_source})", f"planning on this thread {self.plan_s * 1e3:.1f} ms"]
        if self.planner_s is not None:
            parts.append(f"in the background {self.planner_s * 1e3:.1f} ms ({self.planner_cpu_s * 1e3:.1f} ms CPU)")
        if self.predicted_s is not None:
            parts.append(f"predicted {self.predicted_s * 1e3:.3f} ms")
        parts.append(f"executed {self.execute_s * 1e3:.1f} ms")
        if self._fetch() is not None:
            parts.append(f"bubble {self.simulation['bubble_ratio']:.1%}")
        if self.search:
            parts.append(f"search {self.search.get('rollouts', 0)} rollouts")
        parts.append(f"fallbacks {self.fallbacks}")
        return "  ".join(parts)


def measured_events(rank: int, timeline, waits, modality_of) -> list[dict]:
    """One rank's measured step as trace events for :mod:`dipc.sim.trace` (seconds since its executor started):
    its actions in plan order (a compute action from the end of its wait for messages to its end; SEND/RECV
    actions their posting), then each wait on a message as a ``WAIT`` event (``wait <receive>``, or ``wait for
    sends`` at the end of the step).  ``timeline`` / ``waits``: the executor's (:class:`dipc.runtime.Executor`);
    ``modality_of``: chunk index -> modality."""
    out = []
    for a, s, e, wait in timeline:
        start = min(s + wait, e) if a.kind in ("F", "B") else s
        out.append({"rank": rank, "start": start, "end": e, "name": str(a), "kind": a.kind,
                    "modality": modality_of.get(a.chunk, "")})
    for a, s, e in waits:
        out.append({"rank": rank, "start": s, "end": e, "name": "wait for sends" if a is None else f"wait {a}",
                    "kind": "WAIT", "modality": "" if a is None else modality_of.get(a.chunk, "")})
    return out


class _Lookahead(dict):
    """A batch (a plain dict) that also carries the next one (``next_batch``, None for the last)."""

    next_batch: Mapping[str, torch.Tensor] | None = None


def prefetch(iterable):
    """Yield the batches of ``iterable`` one ahead: each is a dict carrying its successor as ``.next_batch``, which
    :meth:`PipelineRuntime.step` hands to the background planner (DIP §2.2 asynchronous planning)::

        for batch in dipc.prefetch(loader):
            loss = pipe.step(batch)

    Reads one batch ahead of what it yields (the first ``next`` reads two).

    Raises:
        TypeError: a batch is not a mapping (raised when it is reached)."""
    end = object()
    it = iter(iterable)
    cur = next(it, end)
    i = 0
    while cur is not end:
        if not isinstance(cur, Mapping):
            raise TypeError(f"dipc.prefetch: batch {i} is a {type(cur).__name__}; batches must be mappings (dicts of "
                            "tensors)")
        out = _Lookahead(cur)  # copied before the next read: a loader may refill one dict in place
        nxt = next(it, end)
        out.next_batch = None if nxt is end else nxt
        yield out
        cur, i = nxt, i + 1
