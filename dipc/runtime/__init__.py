"""Runtime: per-step stage graph, plan delivery and the executor.

For every ``step(batch)`` on every rank of the pipeline group (DESIGN.md "Data flow"):

1. the batch is validated and split into microbatches and sub-microbatches (:mod:`dipc.batch`); a bad batch raises
   on every rank before any communication;
2. the stage graph of the step is built: a forward and a backward stage per (chunk, microbatch, sub-microbatch),
   with the named tensors every cross-rank edge carries (shapes evaluated from the capture's symbolic shapes);
3. rank 0 of the group schedules it (:func:`dipc.planner.schedule.list_schedule`, DIP §2.4), lowers it to a
   :class:`dipc.plan.Plan`, checks it (:func:`dipc.validation.validate`) and delivers it to every rank through
   ``torch.distributed`` with the step number and a SHA-256 digest that every rank checks (DIP §2.8);
4. each rank executes its action list with non-blocking point-to-point sends and receives (gloo on CPU, NCCL on GPU:
   the plan posts receives in the order a peer sends); every wait has a timeout;
5. gradients of weights that live on several ranks (tied input embedding / LM head) are summed over those ranks, and
   the batch loss (microbatch losses weighted by :attr:`dipc.batch.Microbatch.weight`) is broadcast to every rank.

:func:`run_local` executes a plan for all ranks in one process (no process group) in the order the plan's dry run
found; it is the same executor with an in-memory transport.
"""
from .transport import TransportError
from .executor import Executor, StepFailed, run_local, zero_unreached_grads
from .pipeline import PipelineRuntime
from .report import StepReport, prefetch

__all__ = ["PipelineRuntime", "StepReport", "StepFailed", "TransportError", "run_local", "Executor",
           "zero_unreached_grads", "prefetch"]
