"""PipelineRuntime: one rank's view of a compiled pipeline in a training loop, and its step (split the batch, get
the plan, run it, sum tied gradients, report).  Its collaborators, mixed in, live in their own modules and never
import this one: plan delivery (:mod:`dipc.runtime.delivery`), evaluation (:mod:`dipc.runtime.evaluation`),
parameters, modes and gradient clipping (:mod:`dipc.runtime.parameters`), state dicts and checkpoints
(:mod:`dipc.runtime.checkpoints`), data parallelism (:mod:`dipc.runtime.data_parallel`), running a plan and the fault exchange (:mod:`dipc.runtime.faults`: one routine for
the step and evaluation); the step report and :func:`prefetch` are :mod:`dipc.runtime.report`'s.
"""
from __future__ import annotations

import math
import time
import logging
from typing import Callable, Mapping

import torch
import torch.distributed as dist

from ..capture import is_meta
from ..plan import Plan
from ..wire import MIN_TIMEOUT, sum_over_ranks

from .transport import _DistTransport
from ..planner.workload import split_for
from ..planner.planning import check_memory_limit
from .executor import Executor, zero_unreached_grads
from .checkpoints import CheckpointsMixin
from .data_parallel import DataParallelMixin
from .delivery import PlanDeliveryMixin
from .evaluation import EvaluationMixin
from .faults import FaultExchangeMixin
from .parameters import ParametersMixin
from .report import StepReport, measured_events
from .tensor_parallel import local_tensor


log = logging.getLogger("dipc")



class PipelineRuntime(ParametersMixin, PlanDeliveryMixin, EvaluationMixin, CheckpointsMixin, DataParallelMixin,
                      FaultExchangeMixin):
    """One rank's view of a compiled pipeline: its chunk modules, the planner and the executor.

    Use ``pipe.parameters()`` for the optimizer and ``loss = pipe.step(batch)`` per training step; the loss is the
    whole batch's (same value on every rank) and the gradients are in this rank's parameters' ``.grad``.

    Raises (constructor):
        RuntimeError: torch.distributed is not initialised or the group size is not ``pp_size``.
    """

    def __init__(self, compiled, group=None, n_microbatches: int | None = None, timeout: float = 300.0,
                 recompute: bool = False, memory_limit: float | None = None, schedule: str = "dip",
                 budget_s: float = 0.0, seed: int = 0, fallback_schedule: str = "1f1b", plan_wait_s: float = 1.0,
                 dp_group=None, bucket_mb: float = 25.0, init: Callable[[torch.nn.Module], None] | None = None,
                 simulate_steps: bool = True, planner_cpus=None, tp_mesh=None, plan_group=None,
                 dp_mesh=None):
        from ..codegen.templates import template

        template(schedule)  # unknown names, bad limits and budgets raise here, on every rank
        template(fallback_schedule)
        if isinstance(plan_wait_s, bool) or not isinstance(plan_wait_s, (int, float)) or \
                not 0 <= plan_wait_s < math.inf:
            raise ValueError(f"plan_wait_s must be a finite number of seconds >= 0, got {plan_wait_s!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not MIN_TIMEOUT <= timeout < math.inf:
            raise ValueError(f"timeout must be a finite number of seconds >= {MIN_TIMEOUT:g}, got {timeout!r} (a "
                             "distributed wait shorter than that times out on a healthy pipeline, and a timed-out "
                             "wait leaves the process group unusable)")
        if n_microbatches is not None and (isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int)
                                           or n_microbatches < 1):
            raise ValueError(f"n_microbatches must be an int >= 1, got {n_microbatches!r}")
        self.fallback_schedule, self.plan_wait_s = fallback_schedule, float(plan_wait_s)
        memory_limit = check_memory_limit(memory_limit)
        if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or not 0 <= budget_s < math.inf:
            raise ValueError(f"budget_s must be a finite number of seconds >= 0, got {budget_s!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.budget_s, self.seed = float(budget_s), seed
        if not isinstance(simulate_steps, bool):
            raise ValueError(f"simulate_steps must be a bool, got {simulate_steps!r}")
        self.simulate_steps = simulate_steps
        if planner_cpus is not None:
            from ..launch import check_cpus

            planner_cpus = set(check_cpus(planner_cpus, "planner_cpus"))
        self.planner_cpus = planner_cpus
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("dipc runtime needs an initialised process group: call "
                               "torch.distributed.init_process_group('gloo') (or 'nccl') first; torchrun sets the "
                               "environment it reads, dipc.launch.spawn also initialises it. Compiling and inspecting "
                               "need no process group")
        self.compiled = compiled
        self.group = group
        # plans are made once per pipeline and tensor-parallel group: its first rank plans, every rank checks the
        # step's digests over it (ranks of one tensor-parallel group must run the same plan on the same batch)
        self.plan_group = plan_group if plan_group is not None else group
        self.plan_rank = dist.get_rank(self.plan_group)
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if self.world != compiled.pp_size:
            raise RuntimeError(f"the process group has {self.world} ranks but the pipeline was compiled for "
                               f"pp_size={compiled.pp_size}")
        self.n_microbatches = 2 * compiled.pp_size if n_microbatches is None else n_microbatches
        self.timeout = timeout
        self.recompute = recompute
        self.memory_limit = memory_limit
        self.schedule = schedule
        self.transport = _DistTransport(group, timeout)
        # NCCL moves CUDA tensors: receive buffers and batches go to this process's current CUDA device
        self.device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl"
                       else torch.device("cpu"))
        self.step_index = 0
        self.last_plan: Plan | None = None
        self.last_timeline: list = []
        self.last_waits: list = []  # the executor's waits on messages (Executor.waits)
        self.last_timing: dict = {}
        self.last_report: StepReport | None = None
        self.fallbacks = 0  # steps whose background plan missed its deadline, failed or died (DIP §2.2)
        self._broken = ""  # where the process group broke (a StepFailed with usable=False)
        self._last_failed = False  # the last step or evaluation raised (close() then does not wait for peers)
        self._closed = False
        self._planner = None  # rank 0's BackgroundPlanner, started by the first step given a next batch
        self._plan_info: dict = {}
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not 0 < bucket_mb < math.inf:
            raise ValueError(f"bucket_mb must be a number of MiB > 0, got {bucket_mb!r}")
        self.dp_group, self.bucket_bytes = dp_group, int(bucket_mb * 2 ** 20)
        self.dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
        self._dp_phase, self._dp_buckets = 2, None  # where a data-parallel step is (_dp_guard) and its buckets
        if init is not None and not callable(init):
            raise ValueError(f"init must be a function of a module, got {init!r}")
        self.materialized_bytes = None
        self._unchecked: list[torch.Tensor] = []
        # this rank generates (and keeps) only its own chunks' modules; another chunk's is built if asked for
        compiled.build_only({c.index for c in compiled.partition.chunks if c.rank == self.rank})
        if is_meta(compiled.model):
            self._materialize(init)
        self.tp = None  # tensor parallelism (dipc.runtime.tensor_parallel), with a mesh's "tp" dim
        if tp_mesh is not None:
            from .tensor_parallel import TensorParallel

            self.tp = TensorParallel(tp_mesh, compiled.tensor_parallel_plan(tp_mesh.size()), self.device)
            self.tp.shard(compiled)
        self.fsdp = None  # sharded data parallelism (dipc.runtime.fsdp), with a "dp" mesh and data_parallel="fsdp"
        self._setup_params()
        if self.dp_size > 1:
            self._dp_check_layout(fsdp=dp_mesh is not None)
            self._dp_broadcast_state()
        if dp_mesh is not None and self.dp_size > 1:
            from .fsdp import FullyShardedParameters

            self.fsdp = FullyShardedParameters(dp_mesh)
            self.fsdp.shard(compiled, self.rank)
            self._setup_params()  # the sharded parameters are this rank's now

    # -- parameters
    def trace_events(self) -> list[dict]:
        """Every rank's measured actions of the last step, and its waits on messages, as trace events for
        :mod:`dipc.sim.trace` (:func:`dipc.runtime.report.measured_events`; a collective: call it on every rank;
        JSON on the wire).  Times are seconds from each rank's start of execution (after plan delivery)."""
        from ..wire import all_gather_json

        mine = measured_events(self.rank, self.last_timeline, self.last_waits,
                               {c.index: c.modality for c in self.compiled.partition.chunks})
        parts = all_gather_json(mine, self.group, self.device, self.timeout, what="trace events")
        return [e for p in parts for e in p]

    def step(self, batch: Mapping[str, torch.Tensor], n_microbatches: int | None = None,
             schedule: str | None = None, next_batch: Mapping[str, torch.Tensor] | None = None,
             plan: Plan | None = None, scaler=None) -> torch.Tensor:
        """Run forward and backward of ``batch`` through the pipeline; gradients accumulate into ``.grad``.

        Under ``torch.no_grad()`` or ``torch.inference_mode()`` this is :meth:`eval_step` (forward only).  Under
        ``torch.autocast`` the chunks run under it and the messages carry its dtypes.  With a data-parallel mesh
        (``compiled.runtime(mesh=...)``) ``batch`` is this replica's and the loss and gradients are those of the
        replicas' batches concatenated (:meth:`_dp_finish`; the gradient buckets' all-reduces start as the step's
        last backwards finish them).

        Args:
            batch: a dict with the example batch's keys (e.g. ``input_ids [B, S]``, ``pixel_values [N, 3, H, W]``,
                ``labels [B, S]``).  A batch yielded by :func:`prefetch` brings its successor as ``next_batch``.
            n_microbatches: overrides the runtime's microbatch count for this step.
            schedule: overrides the runtime's schedule template for this step (:func:`dipc.schedules`).
            next_batch: the batch of the next step (same keys; best on the CPU): rank 0's background planner makes
                its plan while this step runs (DIP §2.2 asynchronous planning), with this step's microbatch count
                and schedule.  At the next step a plan that is not ready ``plan_wait_s`` seconds after the step
                began, failed, or whose planner died is replaced by ``fallback_schedule``'s plan made then (a
                warning on the ``dipc`` logger; counted in :attr:`fallbacks` and the step report); a ``next_batch``
                that is not the batch the next step gets is planned again then.  Other ranks ignore it.
            plan: a plan made beforehand for this batch split this way (e.g. by :func:`dipc.simulate` or
                :func:`dipc.planner.make_plan`; rank 0's is used, checked against the step's stages, validated
                unless the background planner made it); the report's ``plan_source`` is then "given".
            scaler: a gradient scaler for fp16 (``torch.amp.GradScaler`` API): the backward starts from the loss
                times the scale (``scaler.scale(loss).backward()`` of the unsplit model); the returned
                loss is unscaled.  Use ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`` with
                ``process_group`` = every rank of the job, whose ``unscale_`` all-reduces the inf check, so that
                every rank skips or takes ``scaler.step(opt)`` alike; the ranks check that their scales agree.

        Returns:
            the batch loss (0-dim float tensor), identical on every rank.  :attr:`last_report` describes the step
            (:class:`StepReport`).

        Raises:
            dipc.batch.BatchError: the batch is invalid (raised on every rank before any communication).
            ValueError: unknown ``schedule``, or a bad ``n_microbatches`` (on every rank, before any communication).
            dipc.plan.PlanError: plan delivery or execution is inconsistent.
            StepFailed: a rank (or, data parallel, a replica) failed inside the step; every ``.grad`` is as before it.
            RuntimeError: a distributed wait exceeded the timeout.
        """
        if not torch.is_grad_enabled():  # under torch.no_grad() / inference_mode(): the forward-only plan
            if next_batch is not None or plan is not None:
                raise ValueError("pipe.step under torch.no_grad() runs the forward-only evaluation plan "
                                 "(pipe.eval_step), which takes no next_batch or plan")
            return self.eval_step(batch, n_microbatches, schedule)
        # scaler.scale() of a one is the scale (and starts the scaler, as scaler.scale(loss) would)
        scale = 1.0 if scaler is None else float(scaler.scale(torch.ones((), device=self.device)))
        if not 0 < scale < math.inf:
            raise ValueError(f"the scaler's scale must be a finite number > 0, got {scale!r}")
        def run():
            if self.dp_size > 1:
                self._dp_begin_step(batch, training=True, scale=scale)
            return self._step(batch, n_microbatches, schedule, next_batch, plan, scale)
        return self._tracked(run if self.dp_size == 1 else lambda: self._dp_guard(run))

    def _tracked(self, fn):
        """``fn()``, remembering whether it raised (:meth:`close` does not wait for peers after a failed step: a
        peer may never come) and that the runtime is in use again after a :meth:`close`."""
        self._closed = False
        try:
            out = fn()
        except BaseException:
            self._last_failed = True
            raise
        self._last_failed = False
        return out

    def _step(self, batch, n_microbatches, schedule, next_batch, plan, scale: float = 1.0) -> torch.Tensor:
        t0 = time.perf_counter()
        if next_batch is None:
            next_batch = getattr(batch, "next_batch", None)
        schedule = self.schedule if schedule is None else schedule
        # a data-parallel replica's batch may have no labelled token when another replica's has (checked then)
        batch, mbs, early, n = self._split(batch, n_microbatches, schedule, allow_unlabelled=self.dp_size > 1)
        w, plan = self.plan_step(mbs, schedule, batch, given=plan, early=early, loss_scale=scale)
        mbs = w.microbatches
        info = self._plan_info
        if self.plan_rank == 0 and next_batch is not None:  # planned while this step runs
            self._submit(next_batch, n, schedule)
        t1 = time.perf_counter()
        # this step's gradients accumulate into fresh .grad tensors; those of earlier steps (accumulation over steps)
        # are added back once the step succeeded, and restored untouched when it raises (nothing half-accumulated)
        stash = [(p, p.grad) for p in self.parameters()]
        for p, _ in stash:
            p.grad = None
        try:
            def configure(ex: Executor) -> None:
                ex.loss_scale = scale
                buckets = self._dp_buckets if self.dp_size > 1 else None
                if buckets is not None:  # data parallel: a bucket's all-reduce starts once its last backward ran
                    buckets.schedule(plan, self.rank, self._dp_reads(w))
                    ex.after_action = buckets.after

            ex, loss = self._run_plan(w, plan, f"step {self.step_index}", configure)
            if self.tp is not None:  # every gradient in its parameter's placement
                self.tp.settle(self.parameters() if self.fsdp is None else self.fsdp.unsharded_parameters())

            zero_unreached_grads(self.compiled, w, {self.rank})

            if self.dp_size > 1:  # the data-parallel replicas' gradients, as on their concatenated batch
                loss = self._dp_finish(loss, grads=True)
            for pid, rs in self._tied:  # a tied weight's ranks sum this step's gradients (linear: after the
                p = self._param_obj[pid]  # data-parallel sum as well as before it)
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                sum_over_ranks(local_tensor(p.grad), rs, self.group, self.timeout,
                               f"step {self.step_index}'s gradient of the tied weight {self._names_by_id[pid][0]!r}")
        except BaseException:
            for p, g in stash:
                p.grad = g
            raise
        for p, g in stash:
            if g is not None:
                p.grad = g if p.grad is None else g.add_(p.grad)
        t2 = time.perf_counter()
        self.last_plan = plan
        self.last_timeline, self.last_waits = ex.timeline, ex.waits
        self.last_workload = w
        self.last_timing = {"plan_s": t1 - t0, "execute_s": t2 - t1, "step_s": t2 - t0}
        self.last_microbatches = mbs
        self.last_report = StepReport(
            step=self.step_index, schedule=info.get("schedule", schedule), plan_source=info.get("source", "sync"),
            fallbacks=self.fallbacks, fallback_reason=info.get("why", ""), plan_s=t1 - t0, execute_s=t2 - t1,
            planner_s=info.get("planner_s"), planner_cpu_s=info.get("planner_cpu_s"), predicted_s=plan.simulated.get("iteration_time"),
            search=plan.simulated.get("search"), simulation=None, _pipe=self, _plan=plan,
            _workload=w)
        self.step_index += 1
        return loss

    def _split(self, batch, n_microbatches, schedule: str, allow_unlabelled: bool = False,
               early: BaseException | None = None):
        """The step's arguments checked and its batch split: ``(batch, microbatches, None, n)``, or
        ``(batch, None, the exception, n)`` when they are refused (raised by :meth:`plan_step` on every rank, after
        telling the others: a rank alone would desync them).

        Raises:
            RuntimeError: the process group broke at an earlier step."""
        if self._broken:
            raise RuntimeError(f"this pipeline's process group broke at {self._broken}: no further step can run "
                               "on it (start the processes, or a new process group and runtime, again)")
        n = self.n_microbatches if n_microbatches is None else n_microbatches
        try:
            if early is not None:
                raise early
            if self._unchecked:  # the first step of a materialised model: every value was set by init or a checkpoint
                names = {id(t): n for n, t in self.state_dict_names().items()}
                unset = [names.get(id(t), "?") for t in self._unchecked if t.is_floating_point() and
                         bool(t.isnan().any())]
                if unset:
                    raise ValueError(f"rank {self.rank}: {len(unset)} tensor(s) of the meta-device model were "
                                     f"materialised but never set (e.g. {unset[:3]}): give compiled.runtime(init=...) "
                                     "or load a checkpoint (pipe.load_checkpoint) before the first step")
                self._unchecked = []
            from ..codegen.templates import template
            template(schedule)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"n_microbatches must be an int >= 1, got {n!r}")
            if self.device.type != "cpu":
                batch = {k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                         for k, v in batch.items()}
            return batch, split_for(self.compiled, batch, n, schedule, allow_unlabelled), None, n
        except Exception as e:  # noqa: BLE001
            return batch, None, e, n

    _OUTPUTS_TAG = 1 << 30  # message tag of the evaluation outputs sent to the last rank (after every plan message)

    #: seconds :meth:`close` waits for the other ranks of the pipeline at most
    CLOSE_WAIT_S = 60.0

    def close(self) -> None:
        """Stop this rank's background planner, if any, then wait until every rank of the pipeline has closed too
        (at most :attr:`CLOSE_WAIT_S` seconds, or the runtime's ``timeout`` if shorter), so that no rank tears its
        process group down (``destroy_process_group``, or its exit) while a peer is still closing: like
        ``destroy_process_group``, call it on every rank.  The wait is skipped when the last step or evaluation
        raised (a peer may never come) or the process group broke; a wait that fails or times out is logged, not
        raised.  Idempotent; a step after it uses the runtime again (and a later ``close()`` waits again)."""
        if self._planner is not None:
            self._planner.close()
            self._planner = None
        if self._closed:
            return
        self._closed = True
        if self._broken or self._last_failed or not dist.is_initialized() or self.world == 1:
            return
        from ..wire import WireTimeout, wait_work

        try:
            wait_work(dist.barrier(group=self.group, async_op=True), min(self.timeout, self.CLOSE_WAIT_S),
                      "every rank's close()")
        except (WireTimeout, RuntimeError) as e:
            log.warning("dipc: rank %d: close() did not meet every rank of the pipeline: %s", self.rank, e)
