"""The fault exchange (DESIGN.md "Faults"): after a plan ran, or was drained after a failure, every rank of the
pipeline learns in one all-reduce whether any rank failed, and the first failing rank's action and exception reach
them all; every rank then raises the same :class:`dipc.runtime.StepFailed`.  :meth:`FaultExchangeMixin._run_plan` is
the one "run the plan, exchange status" routine of a training step and of an evaluation.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist

from ..plan import Plan
from ..planner.workload import StepWorkload
from .executor import Executor, StepFailed, _modules_of, _PeerFailed
from .transport import TransportError

__all__ = ["FaultExchangeMixin"]


def _collective_error(e: BaseException | None) -> bool:
    """Whether ``e`` came out of a collective or its transport (a timeout, a closed connection) rather than the
    model's code."""
    if e is None:
        return False
    if isinstance(e, dist.DistError):
        return True
    text = str(e)
    return any(k in text for k in ("gloo/", "NCCL", "Connection closed", "Timed out", "timed out"))


class FaultExchangeMixin:
    """Running a plan and exchanging every rank's status (mixed into :class:`dipc.runtime.PipelineRuntime`)."""

    def _run_plan(self, w: StepWorkload, plan: Plan, what: str, configure: Callable[[Executor], None] | None = None,
                  *, grad: bool = True, labelled: bool = True) -> tuple[Executor, torch.Tensor]:
        """Execute this rank's actions of ``plan`` (under ``torch.no_grad()`` unless ``grad``), then exchange every
        rank's status and loss share.  ``configure`` sets up the executor before it runs; ``what`` names the step in
        the runtime's broken-group note ("step 3", "evaluation at step 3").

        Returns:
            the executor (its timeline, losses and outputs) and the batch loss (float32, 0-dim: the microbatch
            losses weighted by :attr:`dipc.batch.Microbatch.weight`, summed over the ranks; 0 when not
            ``labelled``).

        Raises:
            StepFailed: some rank failed; the failure's own exception on this rank when it was not an
                ``Exception`` (KeyboardInterrupt, SystemExit: the peers get StepFailed).
        """
        mbs = w.microbatches
        ex = Executor(self.rank, w, plan, self.transport, _modules_of(w, {self.rank}, self.device, self.tp,
                                                                      self.fsdp),
                      self.device, yield_after_post=dist.get_backend(self.group) == "gloo", tp=self.tp)
        if configure is not None:
            configure(ex)
        failure = None
        try:
            with contextlib.nullcontext() if grad else torch.no_grad():
                ex.run()
                ex.finish()
        except BaseException as e:  # noqa: BLE001 - drained (Executor.run): every rank learns of it below
            failure = e
        local = torch.zeros((), dtype=torch.float64)
        if failure is None and labelled:
            local = sum((mbs[m].weight * l.detach().to(torch.float64) for m, l in ex.losses.items()
                         if mbs[m].weight), local)  # a weight-0 microbatch's loss is 0/0
        try:
            loss = self._exchange_status(ex, failure, local).to(torch.float32)
        except StepFailed as e:
            if not e.usable:
                self._broken = f"{what} ({e})"
            if failure is not None and not isinstance(failure, Exception):
                raise failure from None  # KeyboardInterrupt, SystemExit: the peers got StepFailed, this rank gets
            raise                        # what it raised
        return ex, loss

    def _exchange_status(self, ex: Executor, failure: BaseException | None, local_loss: torch.Tensor) -> torch.Tensor:
        """After the plan ran (or was drained after a failure), one all-reduce sums the ranks' loss shares (float64;
        returned, 0-dim) and tells every rank whether any rank failed; the first failing rank then broadcasts its
        action and exception (JSON) and every rank raises the same :class:`StepFailed` (issue "Faults", point 1).

        Raises:
            StepFailed: some rank failed (``usable`` False when a wait timed out or a connection broke, or the
                exchange itself failed: a rank died or hangs)."""
        from ..wire import WireTimeout, wait_work, broadcast_json

        own = failure is not None and not isinstance(failure, _PeerFailed)
        # under tensor parallelism every rank of the pipeline and of its tensor-parallel groups (the plan group)
        # learns of a failure; a rank whose collective inside a stage failed (its peer failed before joining it)
        # leaves that group unusable
        broken = isinstance(failure, TransportError) or (self.tp is not None and _collective_error(failure))
        me = self.plan_rank
        flag = torch.stack([torch.tensor(float(2 ** me) if own else 0.0, dtype=torch.float64),
                            torch.tensor(1.0 if broken else 0.0, dtype=torch.float64),
                            # each pipeline rank's loss share once: its tensor-parallel rank 0's
                            local_loss.to("cpu", torch.float64) * (self._tp_rank() == 0),
                            # the ranks whose own code failed (not a collective a failed peer left)
                            torch.tensor(float(2 ** me) if own and not _collective_error(failure) else 0.0,
                                         dtype=torch.float64)]).to(self.device)
        mine = ""
        if failure is not None:
            a = ex.failure[0] if ex.failure else "the step's last sends"
            mine = f"this rank ({self._who(me)}) failed in {a}: {type(failure).__name__}: {failure}; "
        try:  # a tensor-parallel peer may first wait out its stage's collective (up to the timeout)
            wait_work(dist.all_reduce(flag, group=self.plan_group, async_op=True),
                      self.timeout * (2 if self.tp is not None else 1),
                      f"every rank's status after step {self.step_index}")
        except (WireTimeout, RuntimeError) as e:
            gone = self._unresponsive()
            raise StepFailed(f"step {self.step_index}: {mine}the status exchange with the other ranks failed ({e}): "
                             f"{gone}; the process group cannot run further steps", origin=None,
                             step=self.step_index, usable=False) from (failure or e)
        bits, broken = int(flag[0].item()), flag[1].item() > 0
        if not bits:
            if failure is not None:  # an abort message but no rank says it failed: cannot happen with dipc's peers
                raise StepFailed(f"step {self.step_index}: {mine}no rank reported the failure",
                                 step=self.step_index, usable=False) from failure
            return flag[2].cpu()
        first = int(flag[3].item()) or bits  # the lowest rank whose own code failed speaks for all
        origin = (first & -first).bit_length() - 1
        text = None
        if me == origin:
            a = ex.failure[0] if ex.failure else "the step's last sends"
            text = {"action": str(a), "error": f"{type(failure).__name__}: {failure}", "rank": self.rank,
                    "who": self._who(me)}
        text = broadcast_json(text, origin, self.plan_group, self.device, self.timeout,
                              what=f"{self._who(origin)}'s failure report of step {self.step_index}")
        size = dist.get_world_size(self.plan_group)
        others = [self._who(r) for r in range(size) if first >> r & 1 and r != origin]
        waited = [self._who(r) for r in range(size) if bits >> r & 1 and not first >> r & 1 and r != origin]
        more = (f" ({', '.join(others)} failed too)" if others else "") + \
            (f" ({', '.join(waited)} then failed waiting on it in a collective)" if waited else "")
        state = ("the process group cannot run further steps (a wait timed out or a connection broke; gloo closes "
                 "such a pair)" if broken else "the process group can run further steps")
        raise StepFailed(f"step {self.step_index}: {text['who']} failed in {text['action']}: {text['error']}"
                         f"{more}; every rank stopped the step and its .grad is as before it; {state}",
                         origin=text["rank"], action=text["action"], step=self.step_index,
                         usable=not broken) from failure

    def _tp_rank(self) -> int:
        return self.tp.mesh.get_local_rank() if self.tp is not None else 0

    def _who(self, plan_rank: int) -> str:
        """A rank of the plan group: its pipeline rank (and under tensor parallelism, for this rank, its
        tensor-parallel rank; for any rank its global rank)."""
        if self.tp is None:
            return f"rank {plan_rank}"
        glob = dist.get_global_rank(self.plan_group, plan_rank)
        if plan_rank == self.plan_rank:
            return f"rank {self.rank} (tensor-parallel rank {self._tp_rank()}, global rank {glob})"
        return f"global rank {glob}"

