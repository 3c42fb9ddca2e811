"""Plan delivery of a :class:`dipc.runtime.PipelineRuntime` (a mixin): rank 0 makes or takes each step's plan
(synchronously, from the background planner, or given), sends it with the step index and the step's digests, and
every rank checks it before any activation moves (DIP §2.2, §2.8)."""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Mapping

import torch
import torch.distributed as dist

from ..batch import Microbatch
from ..plan import Plan, PlanError
from ..validation import validate
from ..planner.planning import make_plan
from ..planner.workload import (StepWorkload, autocast_state, build_workload, check_matches, check_strategies,
                                float_digest, split_for, step_digest)
from ..planner.options import set_recompute

log = logging.getLogger("dipc")


class PlanDeliveryMixin:
    """The runtime's plan-delivery methods (:mod:`dipc.runtime.delivery`)."""

    def _make(self, w: StepWorkload, schedule: str, forward_only: bool = False) -> Plan:
        from ..codegen.templates import template

        if forward_only:  # evaluation: the template's order without its backwards (no memory to plan for)
            from ..plan import forward_only as drop_backwards

            plan = drop_backwards(make_plan(self.compiled, w, self.step_index, schedule=schedule, check=False))
        else:
            t = template(schedule)
            plan = make_plan(self.compiled, w, self.step_index, memory_limit=self.memory_limit, schedule=t,
                             budget_s=self.budget_s if t.searches else 0.0,
                             seed=self.seed + self.step_index, check=False)
        validate(plan)  # plan_step writes its JSON text once, and marks it validated by that text's digest
        return plan

    def _workload(self, microbatches: list[Microbatch], amp=None) -> StepWorkload:
        w = build_workload(self.compiled, microbatches, amp)
        if self.recompute:
            set_recompute(w, True)
        return w

    def plan_step(self, microbatches: list[Microbatch] | None, schedule: str | None = None,
                  batch: Mapping[str, torch.Tensor] | None = None, given: Plan | None = None,
                  early: BaseException | None = None, forward_only: bool = False,
                  loss_scale: float = 1.0, tag: str = "") -> tuple[StepWorkload, Plan]:
        """Build this step's workload and receive (rank 0: make, or take from the background planner) its plan;
        checks step and digest on every rank.

        ``microbatches`` must be split as ``schedule`` (default the runtime's) needs (:func:`split_for`); ``batch``
        (the step's batch) lets a rank re-split it when rank 0 falls back to a template that splits otherwise.  Rank
        0 sends a JSON header (step, schedule, workload digest, the plan's JSON and digest, where the plan came from)
        by :func:`dipc.wire.broadcast_json`: no pickle, and the runtime's timeout.

        ``forward_only``: an evaluation plan (:func:`dipc.plan.forward_only`, :meth:`eval_step`); the digest every
        rank checks says so, so a rank evaluating while another trains raises on every rank.  ``tag`` is added to
        the digest (what else every rank must agree on: the outputs an evaluation gathers).

        Raises:
            PlanError: rank 0 could not plan the step (on every rank), the ranks disagree on the step's batch or
                microbatch count, or the plan arrived for another step.
            dipc.wire.WireTimeout: the plan did not arrive within the runtime's timeout.
        """
        from ..codegen.templates import template
        from ..wire import broadcast_json

        name = self.schedule if schedule is None else schedule
        amp = autocast_state(self.device)  # the caller's torch.autocast: the chunks run under it
        local_err: str | None = None  # a failure on this rank only: every rank learns of it before raising
        w, mine, floats = None, "(this rank could not build the step)", ""
        if early is not None:  # the batch or an argument was refused before this rank could split the batch
            local_err = f"{type(early).__name__}: {early}"
        else:
            try:
                w = (build_workload(self.compiled, microbatches, amp) if forward_only
                     else self._workload(microbatches, amp))
                mine = step_digest(self.compiled, w, forward_only) + tag
                floats = float_digest(microbatches)
            except Exception as e:  # noqa: BLE001
                local_err = f"{type(e).__name__}: {e}"
        n = len(microbatches) if microbatches is not None else -1
        info: dict[str, Any] = {"source": "sync", "schedule": name, "planner_s": None,
                                "why": ""}
        header = None
        if self.plan_rank == 0:
            try:
                if local_err is not None:
                    raise PlanError(f"building the step failed: {local_err}") if early is None else early
                plan = None
                if given is not None:  # made beforehand: validated (unless it was, unchanged since), then checked
                    given_text = given.to_json()  # against this step's stage graph
                    if getattr(given, "_validated", None) != Plan.text_digest(given_text):
                        validate(given)
                    check_matches(self.compiled, w, given)
                    check_strategies(w, given)
                    plan = dataclasses.replace(given, step=self.step_index)
                    info["source"] = "given"
                elif self._planner is not None and self._planner.submitted == self.step_index and not forward_only:
                    reply, why = self._planner.take(self.step_index, self.plan_wait_s)
                    if reply is not None and (reply.get("schedule"), reply.get("n_microbatches")) != (name, n):
                        reply, why = None, (f"the look-ahead was planned with schedule {reply.get('schedule')!r} "
                                            f"and {reply.get('n_microbatches')} microbatches, this step asks for "
                                            f"{name!r} and {n}")
                    elif reply is not None and (tuple(reply["amp"]) if reply.get("amp") else None) != amp:
                        reply, why = None, (f"the look-ahead was planned under torch.autocast {reply.get('amp')}, "
                                            f"this step runs under {list(amp) if amp else None}")
                    elif reply is not None and reply["digest"] != mine:
                        reply, why = None, ("the batch given as next_batch is not the one this step got (its "
                                            "digest differs)")
                    if reply is not None:
                        plan = Plan.from_json(reply["plan"])
                        info.update(source="async", planner_s=reply["seconds"], planner_cpu_s=reply["cpu_seconds"])
                    elif "needs a capture" in why or "autocast" in why:  # this process captures it now (it must,
                        # to run the step), or the caller switched autocast: plan it now
                        log.info("dipc: step %d: %s; planning it now", self.step_index, why)
                        info["why"] = why
                    elif "look-ahead" in why or "next_batch" in why:  # the user's look-ahead was wrong: plan it now
                        log.warning("dipc: step %d: %s; planning it now", self.step_index, why)
                        info["why"] = why
                    elif "failed" in why:  # the planner raised: plan this batch now; the template only if that fails
                        try:
                            plan = self._make(w, name)
                            log.warning("dipc: step %d: %s; planned it now", self.step_index, why)
                            info["why"] = why
                        except Exception as e:  # noqa: BLE001
                            why = f"{why}; planning it now failed too ({type(e).__name__}: {e})"
                    if plan is None and reply is None and not info["why"]:
                        # late, died, or failed here too: the fallback template, planned now (DIP §2.2)
                        fb = self.fallback_schedule
                        log.warning("dipc: step %d: %s; running the %r template instead (%d fallbacks so far)",
                                    self.step_index, why, fb, self.fallbacks + 1)
                        info.update(source="fallback", schedule=fb, why=why)
                        if template(fb).sub_microbatches != template(name).sub_microbatches:
                            microbatches = split_for(self.compiled, batch, n, fb)
                            w = self._workload(microbatches, amp)
                            mine = step_digest(self.compiled, w)
                        name = fb
                if plan is None:
                    plan = self._make(w, name, forward_only)
                if info["source"] == "async":
                    text = reply["plan"]
                elif info["source"] == "given" and given.step == self.step_index:
                    text = given_text
                else:
                    text = plan.to_json()
                text_digest = Plan.text_digest(text)
                plan._validated = text_digest  # validated here, by _make or by the background planner
                header = {"step": self.step_index, "schedule": name, "n_microbatches": n, "digest": mine,
                          "plan": text, "plan_digest": text_digest, "source": info["source"],
                          "why": info["why"], "floats": floats}
            except Exception as e:  # every rank raises it, instead of waiting for a plan
                header = {"step": self.step_index, "error": f"{type(e).__name__}: {e}", "digest": mine}
        src = 0
        header = broadcast_json(header, src, self.plan_group, self.device, self.timeout,
                                what=f"the plan of step {self.step_index}")
        step, theirs = header["step"], header["digest"]
        if "error" in header:
            if self.plan_rank == 0 and early is not None:
                raise early  # rank 0's own bad input keeps its type (BatchError, ValueError)
            if early is not None and header["error"] == f"{type(early).__name__}: {early}":
                raise early  # every rank refused the batch alike
            raise PlanError(f"step {step}: rank 0 could not plan it: {header['error']}")
        if header.get("source") != "fallback" and header.get("schedule") != name and local_err is None:
            local_err = (f"PlanError: this rank asked for schedule {name!r}, rank 0 for {header.get('schedule')!r} "
                         "(every rank must step with the same schedule)")
        if self.plan_rank != 0 and local_err is None:
            try:
                got = Plan.text_digest(header["plan"])
                if got != header["plan_digest"]:
                    raise PlanError(f"the plan arrived damaged (digest {got[:12]}, rank 0 sent "
                                    f"{header['plan_digest'][:12]})")
                plan = Plan.from_json(header["plan"])
                info.update(source=header["source"], schedule=header["schedule"], why=header.get("why", ""))
                if header["schedule"] != name:  # rank 0 fell back to another template
                    if template(header["schedule"]).sub_microbatches != template(name).sub_microbatches:
                        microbatches = split_for(self.compiled, batch, n, header["schedule"])
                        w = self._workload(microbatches, amp)
                        mine = step_digest(self.compiled, w)
            except Exception as e:  # noqa: BLE001
                local_err = f"{type(e).__name__}: {e}"
        from ..wire import wait_work

        # one all-reduce tells every rank whether all built the step, agree on its index and on its digest
        bits = int(torch.tensor([loss_scale], dtype=torch.float64).view(torch.int64).item())  # the GradScaler's
        floats_differ = "floats" in header and header["floats"] != floats
        same = torch.tensor([1 if mine == theirs and not floats_differ else 0, self.step_index, -self.step_index,
                             0 if local_err else 1, bits, -bits], dtype=torch.int64, device=self.device)
        wait_work(dist.all_reduce(same, op=dist.ReduceOp.MIN, group=self.plan_group, async_op=True), self.timeout,
              f"every rank's check of step {self.step_index}'s plan")
        if int(same[3].item()) == 0:  # some rank failed alone: the lowest one tells every rank what happened
            bits = torch.tensor([float(2 ** self.plan_rank) if local_err else 0.0], dtype=torch.float64,
                                device=self.device)
            wait_work(dist.all_reduce(bits, group=self.plan_group, async_op=True), self.timeout,
                  f"every rank's failure flags of step {self.step_index}")
            b = int(bits.item())
            origin = (b & -b).bit_length() - 1
            text = broadcast_json(local_err if self.plan_rank == origin else None, origin, self.plan_group, self.device,
                                  self.timeout, what=f"rank {origin}'s failure of step {self.step_index}")
            if early is not None and text == local_err:
                raise early  # this rank's own bad input, or the same as the first failing rank's
            raise PlanError(f"step {self.step_index}: rank {origin} could not build the step: {text} (every rank "
                            "stopped before any activation moved)")
        if header.get("source") == "fallback":  # counted on every rank, after every rank has the plan
            self.fallbacks += 1
        lo, hi = int(same[1].item()), -int(same[2].item())
        if lo != hi:  # every rank raises, before any activation moves
            raise PlanError(f"the ranks are at different steps (from step {lo} to step {hi}; this rank, rank "
                            f"{self.rank}, is at step {self.step_index}): every rank must call step() for every "
                            "batch (a rank that skipped or repeated a step leaves the pipeline out of step)")
        if int(same[4].item()) != -int(same[5].item()):
            raise PlanError(f"step {self.step_index}: the ranks' gradient scalers disagree (this rank's scale is "
                            f"{loss_scale!r}): use one scaler whose inf check spans every rank (ShardedGradScaler "
                            "with process_group = all ranks), so every rank skips or takes the same steps")
        if int(same[0].item()) == 0:
            who = (f"this rank's digest {mine[:12]} differs from rank 0's {theirs[:12]}" if mine != theirs else
                   f"this rank's batch holds other floating-point values than rank 0's (digest {floats[:12]}, rank "
                   f"0's {header['floats'][:12]})" if floats_differ else
                   "another rank's digest differs from this one's")
            if header.get("n_microbatches", n) != n:
                who += f"; rank 0 split the batch into {header['n_microbatches']} microbatches, this rank into {n}"
            if str(mine).partition("|")[2] != str(theirs).partition("|")[2]:  # the tag: e.g. the evaluation's outputs
                who += (f"; rank 0 asked for {str(theirs).partition('|')[2] or 'no outputs'}, this rank for "
                        f"{str(mine).partition('|')[2] or 'no outputs'}")
            raise PlanError(
                f"step {self.step_index}: the ranks disagree on the step ({who}; the digests cover the stage graph "
                "and the batch's values). Either they were given different batches (every rank of a "
                "pipeline must get the same batch), or they traced the model differently: a forward that iterates "
                "a Python set of strings (Hugging Face Gemma3: set(config.layer_types)) follows the hash seed, so "
                "start every rank with the same PYTHONHASHSEED (dipc.launch.spawn sets 0; under torchrun: "
                "PYTHONHASHSEED=0 torchrun ...)")
        self._plan_info = info
        w.microbatches = microbatches
        return w, plan

    def _unresponsive(self, wait_s: float = 3.0) -> str:
        """After a broken exchange: which ranks of the pipeline still answer through the rendezvous store (each
        survivor writes a key and looks for the others' for ``wait_s`` seconds).  The store is hosted by global
        rank 0, so when that rank died the store is gone too, and the message says so."""
        try:
            store = dist.distributed_c10d._get_default_store()
            key = f"dipc/alive/{id(self.compiled)}/{self.step_index}"
            store.set(f"{key}/{self.rank}", "1")
            deadline = time.monotonic() + wait_s
            missing = list(range(self.world))
            while missing and time.monotonic() < deadline:
                missing = [r for r in range(self.world) if not store.check([f"{key}/{r}"])]
                if missing:
                    time.sleep(0.05)
        except Exception as e:  # noqa: BLE001
            root = dist.get_global_rank(self.group, 0) if self.group is not None else 0
            return (f"the rendezvous store does not answer either ({type(e).__name__}): global rank 0, which hosts "
                    f"it, is probably gone" + (f" (pipeline rank 0 is global rank {root})" if root else ""))
        if not missing:
            return "every rank answers through the store, so a rank hangs or its connection broke"
        return f"rank(s) {missing} do not answer within {wait_s:g} s: died or hang"

    def _submit(self, next_batch, n: int, schedule: str) -> None:
        from ..codegen.templates import template
        from ..planner.background import BackgroundPlanner

        if self._planner is None:
            import weakref

            self._planner = BackgroundPlanner(self.compiled, {"memory_limit": self.memory_limit,
                                                              "recompute": self.recompute,
                                                              "cpus": self.planner_cpus})
            weakref.finalize(self, self._planner.close)  # a runtime dropped without close() stops its planner
        budget = self.budget_s if template(schedule).searches else 0.0
        try:  # never raises: this rank's peers already run the step
            if not isinstance(next_batch, Mapping):
                raise TypeError(f"next_batch must be a mapping like the batch, got {type(next_batch).__name__}")
            self._planner.submit(self.step_index + 1, next_batch, n, schedule, budget, self.seed + self.step_index + 1,
                                 autocast_state(self.device), simulate=self.simulate_steps)
        except Exception as e:  # noqa: BLE001 - not sendable: the next step plans synchronously
            self._planner.submitted = None
            log.warning("dipc: step %d's next batch cannot go to the background planner (%s: %s); it will be "
                        "planned synchronously", self.step_index, type(e).__name__, e)
