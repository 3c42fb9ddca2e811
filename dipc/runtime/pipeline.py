"""PipelineRuntime: one rank's view of a compiled pipeline in a training loop - plan delivery and checks, the
executor, failure propagation, evaluation, checkpoints, data parallelism - and its step report.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from collections import defaultdict
import logging
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from ..batch import BatchError, Microbatch
from ..capture import is_meta
from ..plan import Plan, PlanError, validate
from ..wire import sum_over_ranks

from .transport import _DistTransport, TransportError
from ..planner.workload import StepWorkload, autocast_state, build_workload, check_matches, check_strategies, set_recompute, step_digest, split_for, float_digest
from ..planner.planning import check_memory_limit, make_plan
from .executor import _PeerFailed, StepFailed, Executor, _modules_of, zero_unreached_grads


log = logging.getLogger("dipc")

#: the shortest ``timeout`` a runtime takes, seconds
MIN_TIMEOUT = 1.0
#: data-parallel sizes up to this name their failed replicas (a float64 bit mask in the step headers)
_DP_MASK_BITS = 50


#: the file in a checkpoint directory holding its shards' checksums (:meth:`PipelineRuntime.save_checkpoint`)
CHECKSUMS = "dipc_checksums.json"


def _file_digest(path: str) -> str:
    """BLAKE2b of a file's bytes, read in 8 MiB pieces."""
    import hashlib

    h = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(8 << 20), b""):
            h.update(piece)
    return h.hexdigest()


def _copy_into(dst, src) -> None:
    """Write ``src``'s values into ``dst`` (same nested mappings): tensors in place, other values by key."""
    for k, v in src.items():
        if isinstance(v, torch.Tensor) and isinstance(dst[k], torch.Tensor):
            dst[k].copy_(v)
        elif isinstance(v, Mapping) and isinstance(dst[k], Mapping):
            _copy_into(dst[k], v)
        else:
            dst[k] = v


# ---------------------------------------------------------------------------------------------------- runtime
class PipelineRuntime:
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
                 simulate_steps: bool = True, planner_cpus=None):
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
        self.last_timing: dict = {}
        self.last_report: StepReport | None = None
        self.fallbacks = 0  # steps whose background plan missed its deadline, failed or died (DIP §2.2)
        self._broken = ""  # where the process group broke (a StepFailed with usable=False)
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
        self._setup_params()
        if self.dp_size > 1:
            self._dp_check_layout()
            self._dp_broadcast_state()

    # -- parameters
    def _materialize(self, init) -> None:
        """A meta-device model: this rank's parameters and buffers (those its chunks read; rank 0 also keeps the
        parameters no chunk reads) become uninitialised tensors on this rank's device (``to_empty``), in the model,
        in the compiled state and in every chunk module; then ``init(module)`` runs for each module that owns one
        (e.g. the model's weight init and RoPE's table: non-persistent buffers are not in any checkpoint), and a
        checkpoint (:meth:`load_checkpoint`) gives them their values.  The other ranks' parameters stay on the
        meta device, so this rank holds only its share.  Later captures trace an all-meta copy of the model
        (:meth:`dipc.compiler.CompiledPipeline._tracer`)."""
        import copy

        comp = self.compiled
        model = comp.model
        if getattr(comp, "_trace_model", None) is None:
            comp._trace_model = copy.deepcopy(model)  # no storage to copy: every tensor is on the meta device
        mine: set[str] = set()
        reached: set[int] = set()
        for c in comp.partition.chunks:
            for n in comp.chunk_params(c.index):
                reached.add(id(comp._state[n]))
            if c.rank == self.rank and c.index in comp.program.chunks:
                mine.update(comp.program.chunks[c.index].state_names)
        entries = list(model.named_parameters(remove_duplicate=False)) + \
            list(model.named_buffers(remove_duplicate=False))
        if self.rank == 0:  # parameters the loss does not reach live on rank 0 (as _setup_params keeps them)
            mine.update(n for n, t in entries if isinstance(t, torch.nn.Parameter) and id(t) not in reached)
        ids_mine = {id(t) for n, t in entries if n in mine}
        new_of: dict[int, torch.Tensor] = {}
        owners: dict[int, torch.nn.Module] = {}
        for name, t in entries:
            if id(t) not in ids_mine or not t.is_meta:
                continue
            if id(t) not in new_of:  # NaN until init or a checkpoint sets it: unset values are found, not used
                real = torch.empty_like(t, device=self.device)
                if real.is_floating_point():
                    real.fill_(math.nan)
                new_of[id(t)] = torch.nn.Parameter(real, requires_grad=t.requires_grad) \
                    if isinstance(t, torch.nn.Parameter) else real
            prefix, _, field = name.rpartition(".")
            mod = model.get_submodule(prefix) if prefix else model
            table = mod._parameters if isinstance(t, torch.nn.Parameter) else mod._buffers
            table[field] = new_of[id(t)]
            comp._state[name] = new_of[id(t)]
            owners[id(mod)] = mod
        for prog in comp.programs:  # the chunk modules hold the tensors themselves: swap them there too
            for cm in prog.chunks.values():
                if cm.gm is None:
                    continue
                for m in cm.gm.modules():
                    for table in (m._parameters, m._buffers):
                        for k, v in list(table.items()):
                            if v is not None and id(v) in new_of:
                                table[k] = new_of[id(v)]
        if init is not None:
            with torch.no_grad():
                for mod in owners.values():
                    init(mod)
        persistent = set(model.state_dict(keep_vars=True))
        made = {id(v) for v in new_of.values()}
        unset = [n for n, t in model.named_buffers(remove_duplicate=False)
                 if n not in persistent and id(t) in made and t.is_floating_point() and bool(t.isnan().any())]
        if unset:  # no checkpoint holds these: only init can
            raise ValueError(f"rank {self.rank}: the non-persistent buffer(s) {unset[:5]} of the meta-device model "
                             "are not initialised: no checkpoint holds them, so the runtime's init= must compute them "
                             "(e.g. RotaryEmbedding.reset_inv_freq() for RoPE tables)")
        self._unchecked = list(new_of.values())  # checked for unset values at the first step
        self.materialized_bytes = sum(t.numel() * t.element_size() for t in new_of.values())

    def _setup_params(self):
        comp = self.compiled
        names_by_id: dict[int, list[str]] = defaultdict(list)
        for n, p in comp.model.named_parameters(remove_duplicate=False):
            names_by_id[id(p)].append(n)
        self._param_obj = {id(p): p for p in comp.model.parameters()}
        ranks_by_id: dict[int, set] = defaultdict(set)
        for c in comp.partition.chunks:
            for n in comp.chunk_params(c.index):
                ranks_by_id[id(comp._state[n])].add(c.rank)
        for pid in self._param_obj:  # parameters the loss does not reach live on rank 0 (kept for state_dict)
            if not ranks_by_id[pid]:
                ranks_by_id[pid].add(0)
        self._names_by_id = names_by_id
        self._ranks_by_id = ranks_by_id
        self.local_param_ids = [pid for pid in self._param_obj if self.rank in ranks_by_id[pid]]
        # weights tied across ranks, (parameter id, its sorted pipeline ranks) in model order on every rank: their
        # gradients are summed point to point (dipc.wire.sum_over_ranks), with no subgroup to agree on
        self._tied: list[tuple[int, tuple[int, ...]]] = [(pid, tuple(sorted(ranks_by_id[pid])))
                                                         for pid in self.local_param_ids if len(ranks_by_id[pid]) > 1]
        buf_ids = set()
        for c in comp.partition.chunks:
            if c.rank == self.rank and c.index in comp.program.chunks:
                for n in comp.program.chunks[c.index].state_names:
                    buf_ids.add(n)
        self._local_state_names = buf_ids

    def parameters(self):
        """This rank's parameters (each once), for the optimizer."""
        return [self._param_obj[pid] for pid in self.local_param_ids]

    def named_parameters(self):
        """``(original fully qualified name, parameter)`` for this rank's parameters."""
        return [(self._names_by_id[pid][0], self._param_obj[pid]) for pid in self.local_param_ids]

    @property
    def training(self) -> bool:
        """The model's mode (``nn.Module.training``)."""
        return self.compiled.model.training

    def train(self, mode: bool = True) -> "PipelineRuntime":
        """Set the model's mode, as ``nn.Module.train``: the chunks of later steps run the graphs captured in that
        mode (a model with dropout, :attr:`dipc.compiler.CompiledPipeline.mode_dependent`, is captured once per
        mode and shape on first use; others run the same graphs in both).  Whether a step runs backward follows
        the grad mode or the call (:meth:`eval_step`), not this.  Call it on every rank alike (a rank in the
        other mode traces another graph: the plan check raises on every rank).  Returns this runtime."""
        if not isinstance(mode, bool):
            raise ValueError(f"train(mode): mode must be a bool, got {mode!r}")
        self.compiled.model.train(mode)
        return self

    def eval(self) -> "PipelineRuntime":
        """``train(False)``."""
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear this rank's parameters' gradients (as ``torch.nn.Module.zero_grad``)."""
        for p in self.parameters():
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
                        ) -> torch.Tensor:
        """Clip the whole pipeline's gradients by their global norm, as ``torch.nn.utils.clip_grad_norm_`` does on
        the unsplit model (a collective: call it on every rank, after ``step``).

        Each rank adds its parameters' ``|g|^p`` (a tied weight, whose gradient every holding rank has after the
        step, is counted once, by its lowest rank; ``norm_type=inf``: the largest ``|g|``), one all-reduce gives the
        global norm, and every rank scales its gradients by the same ``min(1, max_norm / (norm + 1e-6))``.  Calling
        ``torch.nn.utils.clip_grad_norm_(pipe.parameters(), ...)`` instead clips each rank by its own part's norm:
        the ranks then clip by different factors and training differs from the unsplit model.

        Returns:
            the global gradient norm (0-dim float32 tensor), the same on every rank.

        Raises:
            ValueError: ``max_norm`` is not a number >= 0, or ``norm_type`` not a number > 0.
            RuntimeError: ``error_if_nonfinite`` and the norm is NaN or infinite (on every rank, before any
                gradient changes).
        """
        from ..wire import _wait

        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm >= 0:
            raise ValueError(f"max_norm must be a number >= 0, got {max_norm!r}")
        if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type > 0:
            raise ValueError(f"norm_type must be a number > 0 (or math.inf), got {norm_type!r}")
        p_ = float(norm_type)
        counted = [self._param_obj[pid].grad for pid in self.local_param_ids
                   if self._param_obj[pid].grad is not None and min(self._ranks_by_id[pid]) == self.rank]
        if p_ == math.inf:
            local = max((g.detach().abs().max().to(torch.float64) for g in counted if g.numel()),
                        default=torch.zeros((), dtype=torch.float64))
            op = dist.ReduceOp.MAX
        else:
            local = sum((torch.linalg.vector_norm(g.detach().to(torch.float64), p_) ** p_ for g in counted),
                        torch.zeros((), dtype=torch.float64))
            op = dist.ReduceOp.SUM
        total = local.reshape(1).to(self.device)
        _wait(dist.all_reduce(total, op=op, group=self.group, async_op=True), self.timeout,
              "every rank's gradient norm")
        norm = (total[0] if p_ == math.inf else total[0] ** (1.0 / p_)).to(torch.float32).cpu()
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"the total norm of order {norm_type} of the pipeline's gradients is {float(norm)}: "
                               "non-finite, so clip_grad_norm_ cannot clip them (error_if_nonfinite=True)")
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in self.parameters():
            if p.grad is not None:
                p.grad.detach().mul_(coef.to(p.grad.device, p.grad.dtype))
        return norm

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Load this rank's parameters and buffers from ``state_dict`` under the original names (e.g. a full
        checkpoint of the unsplit model, or :meth:`state_dict` of this rank); entries of other ranks are ignored.
        Copies in place (the optimizer keeps its parameter objects).

        Raises:
            KeyError: ``strict`` and one of this rank's entries is missing (all of them named), or a name is not the
                model's.
            ValueError: an entry's shape differs from the model's (named), before anything is copied.
        """
        mine = self.state_dict_names()
        known = set(self.compiled.model.state_dict(keep_vars=True))
        unknown = sorted(set(state_dict) - known)
        missing = sorted(n for n in mine if n not in state_dict)
        if strict and (unknown or missing):
            raise KeyError(f"load_state_dict(strict=True): missing {missing[:10]}{'...' if len(missing) > 10 else ''}"
                           f", unexpected {unknown[:10]}{'...' if len(unknown) > 10 else ''}")
        targets = dict(self.compiled.model.state_dict(keep_vars=True))
        for n, t in mine.items():
            if n in state_dict and tuple(state_dict[n].shape) != tuple(t.shape):
                raise ValueError(f"{n}: the state dict holds shape {tuple(state_dict[n].shape)}, the model "
                                 f"{tuple(t.shape)}")
        with torch.no_grad():
            for n in mine:
                if n in state_dict:
                    targets[n].copy_(state_dict[n].to(targets[n].device, targets[n].dtype))

    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load this rank's part of a full state dict (:meth:`full_state_dict`, or the unsplit model's
        ``state_dict()``) that must hold every entry of the model, not only this rank's.

        Raises:
            KeyError: an entry of the model is missing or a name is not the model's (named).
            ValueError: an entry's shape differs from the model's (named), before anything is copied.
        """
        want = set(self.compiled.model.state_dict(keep_vars=True))
        missing, unknown = sorted(want - set(state_dict)), sorted(set(state_dict) - want)
        if missing or unknown:
            raise KeyError(f"load_full_state_dict: the state dict misses {missing[:10]}"
                           f"{'...' if len(missing) > 10 else ''} and has unexpected {unknown[:10]}"
                           f"{'...' if len(unknown) > 10 else ''} (a full state dict holds every rank's entries)")
        self.load_state_dict(state_dict, strict=True)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """``optimizer``'s state (an optimizer over :meth:`parameters`) keyed by the original parameter names, in
        torch.distributed.checkpoint's flattened form (``state.<name>.exp_avg``, ``param_groups.<name>.lr``):
        ``get_optimizer_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))``
        on the whole model, so the unsplit model's optimizer and one at any pp size read it alike (a tied weight's
        ranks hold the same state under the same name).

        Raises:
            ValueError: ``optimizer`` holds a parameter that is not this rank's.
        """
        return self._flat_optimizer(optimizer, init=False)

    def _flat_optimizer(self, optimizer, init: bool) -> dict:
        """:meth:`optimizer_state_dict`.  torch initialises an optimizer without state by a step at lr 0 (AdamW's
        step count becomes 1, SGD's momentum buffer weight_decay x the weight), but only when no parameter has a
        ``.grad``: ``init`` False keeps the optimizer as it is (one zero ``.grad`` stands in meanwhile), True lets
        it make the state tensors a checkpoint's state is loaded into (the ``.grad`` step aside meanwhile)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        self._check_optimizer(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        grads = [(p, p.grad) for p in params]
        if not optimizer.state and params:
            if init:
                for p in params:
                    p.grad = None
            elif all(g is None for _, g in grads):
                params[0].grad = torch.zeros_like(params[0])
        groups = optimizer.param_groups
        optimizer.param_groups = [g for g in groups if g["params"]]  # torch's flattening trips on an empty group
        try:
            return get_optimizer_state_dict(self.compiled.model, optimizer,
                                            options=StateDictOptions(flatten_optimizer_state_dict=True))
        finally:
            optimizer.param_groups = groups
            for p, g in grads:
                p.grad = g

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: Mapping) -> None:
        """Load :meth:`optimizer_state_dict`'s form (this rank's names, or a superset) into ``optimizer``.

        Raises:
            ValueError: ``optimizer`` holds a parameter that is not this rank's.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        self._check_optimizer(optimizer)
        groups = optimizer.param_groups  # a group with none of this rank's parameters (per-module learning rates)
        kept = [g for g in groups if g["params"]]
        optimizer.param_groups = list(kept)
        try:
            set_optimizer_state_dict(self.compiled.model, optimizer, dict(state_dict),
                                     options=StateDictOptions(flatten_optimizer_state_dict=True))
            for old, new in zip(kept, optimizer.param_groups):  # load_state_dict made new group dicts: the loaded
                old.update({k: v for k, v in new.items() if k != "params"})  # hyperparameters go to the user's
        finally:
            optimizer.param_groups = groups

    def _check_optimizer(self, optimizer) -> None:
        mine = {id(p) for p in self.parameters()}
        for g in optimizer.param_groups:
            for p in g["params"]:
                if id(p) not in mine:
                    raise ValueError(f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not one of "
                                     f"rank {self.rank}'s (build it from pipe.parameters())")

    def checkpoint_state(self, optimizer: torch.optim.Optimizer | None = None) -> dict:
        """What :meth:`save_checkpoint` writes: ``{"model": this rank's state dict entries (the tensors, no copy),
        "optim": optimizer_state_dict(optimizer)}`` ("optim" only with an optimizer)."""
        out = {"model": self.state_dict_names()}
        if optimizer is not None:
            out["optim"] = self.optimizer_state_dict(optimizer)
        return out

    def save_checkpoint(self, checkpoint_id, optimizer: torch.optim.Optimizer | None = None,
                        extra: Mapping | None = None) -> None:
        """Write a torch.distributed.checkpoint (DCP) checkpoint of the model (and ``optimizer``) under the
        original names: every rank writes its own entries, a tied weight once (a collective over the pipeline's
        ranks).  The keys are ``model.<name>`` and ``optim.state.<name>.<field>`` / ``optim.param_groups.<name>.<key>``,
        so an unsplit model loads it with ``sd = {"model": model.state_dict()}; dcp.load(sd, checkpoint_id=path,
        no_dist=True); model.load_state_dict(sd["model"])`` (its optimizer likewise, through
        ``get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))``),
        and a pipeline of any pp size with :meth:`load_checkpoint`.

        Args:
            checkpoint_id: the checkpoint's directory (as ``torch.distributed.checkpoint.save``).
            optimizer: this rank's optimizer, or None.
            extra: more entries under their own keys (e.g. ``{"step": torch.tensor(step)}``, a scheduler's
                ``state_dict()``): the same on every rank.
        """
        import torch.distributed.checkpoint as dcp

        sd = self.checkpoint_state(optimizer)
        if extra:
            if set(extra) & set(sd):
                raise ValueError(f"extra may not use the keys {sorted(set(extra) & set(sd))}")
            sd.update(extra)
        if self.dp_size == 1:
            dcp.save(sd, checkpoint_id=checkpoint_id, process_group=self.group)
            self._write_checksums(checkpoint_id)
            return
        from ..wire import _wait

        failed = torch.zeros(1, device=self.device)
        err = None
        try:  # data parallel: the first replica writes it, the others return once it is written
            if dist.get_rank(self.dp_group) == 0:
                dcp.save(sd, checkpoint_id=checkpoint_id, process_group=self.group)
                self._write_checksums(checkpoint_id)
        except BaseException as e:  # noqa: BLE001 - the other replicas must hear of it, not wait
            failed += 1
            err = e
        _wait(dist.all_reduce(failed, group=self.dp_group, async_op=True), self.timeout,
              "the data-parallel replicas after writing a checkpoint")
        if err is not None:
            raise err
        if float(failed) > 0:
            raise RuntimeError(f"the first data-parallel replica could not write the checkpoint {checkpoint_id!r}")

    def _write_checksums(self, checkpoint_id) -> None:
        """After a DCP save: each rank hashes the shard files it wrote (``__<rank>_*.distcp``, BLAKE2b) and rank 0
        writes them all to ``dipc_checksums.json`` in the checkpoint (JSON), which :meth:`load_checkpoint`
        checks (a collective over the pipeline's ranks)."""
        import glob
        import os

        from ..wire import all_gather_json

        mine = {os.path.basename(f): _file_digest(f) for f in
                sorted(glob.glob(os.path.join(str(checkpoint_id), f"__{self.rank}_*.distcp")))}
        every = all_gather_json(mine, self.group, self.device, self.timeout, "every rank's shard checksums")
        if self.rank == 0:
            table = {k: v for part in every for k, v in part.items()}
            with open(os.path.join(str(checkpoint_id), CHECKSUMS), "w") as f:
                json.dump({"blake2b": table}, f, indent=0, sort_keys=True)

    def _bad_shards(self, checkpoint_id) -> list[str]:
        """The shard files of a checkpoint whose BLAKE2b differs from ``dipc_checksums.json`` (or that are gone);
        each rank checks every P-th file, so each file is read once.  ``[]`` without that file."""
        import os

        path = os.path.join(str(checkpoint_id), CHECKSUMS)
        if not os.path.exists(path):
            return []
        with open(path) as f:
            table = json.load(f)["blake2b"]
        bad = []
        for i, name in enumerate(sorted(table)):
            if i % self.world == self.rank:
                f = os.path.join(str(checkpoint_id), name)
                if not os.path.exists(f) or _file_digest(f) != table[name]:
                    bad.append(name)
        return bad

    def load_checkpoint(self, checkpoint_id, optimizer: torch.optim.Optimizer | None = None,
                        extra: Mapping | None = None) -> None:
        """Load a DCP checkpoint written by :meth:`save_checkpoint` at any pp size, or by the unsplit model under
        ``{"model": model.state_dict(), "optim": ...}``: this rank reads its own entries (and ``optimizer``'s
        state); ``extra``'s tensors are loaded in place as ``dcp.load`` does.  Round trips are exact.

        A checkpoint written by :meth:`save_checkpoint` carries a checksum per shard file (``dipc_checksums.json``),
        checked first (the ranks share the files): a damaged shard is refused on every rank by name.  All or
        nothing: DCP reads into copies, the ranks then agree that every one of them read its part, and only
        then are the parameters, the optimizer and ``extra`` written; a rank that failed leaves every rank's state as
        it was (an optimizer without state that this call initialised to read into is cleared again).

        Raises:
            torch.distributed.checkpoint.api.CheckpointException (a ``BaseException``, from DCP) or
                FileNotFoundError: an entry this rank needs is not in the checkpoint, its shape differs, or there
                is no checkpoint at ``checkpoint_id``.
            RuntimeError: another rank could not read its part (names the ranks); nothing was loaded here either.
            ValueError: a shard does not match its checksum (names it), on every rank before anything is read.
            dipc.wire.WireTimeout: a rank did not report within the runtime's timeout; nothing was loaded.
        """
        import torch.distributed.checkpoint as dcp
        from torch.utils._pytree import tree_map

        had_state = optimizer is not None and bool(optimizer.state)
        failure: BaseException | None = None
        try:
            bad = self._bad_shards(checkpoint_id)
            if bad:
                raise ValueError(f"the checkpoint {checkpoint_id!r} is damaged: shard(s) {bad} do not match their "
                                 f"checksums in {CHECKSUMS} (written by save_checkpoint)")
        except Exception as e:  # noqa: BLE001 - every rank hears of it before DCP's collectives start
            failure = e
        failed = self._ranks_failing(failure is not None, f"every rank's check of the checkpoint {checkpoint_id!r}")
        if failed:
            if failure is not None:
                raise failure
            raise ValueError(f"rank(s) {failed} found the checkpoint {checkpoint_id!r} damaged (their error names the "
                             "shards); nothing was loaded")
        try:
            sd = {"model": {n: t.detach().clone() for n, t in self.state_dict_names().items()}}
            if optimizer is not None:
                # state tensors to load into only when the checkpoint holds state for this rank's parameters (an
                # optimizer saved before its first step holds none: this one then starts without state too)
                keys = set(dcp.FileSystemReader(str(checkpoint_id)).read_metadata().state_dict_metadata)
                names = {n for n, _ in self.named_parameters()}
                has_state = any(k.startswith("optim.state.") and any(k.startswith(f"optim.state.{n}.") for n in names)
                                for k in keys)
                flat = self._flat_optimizer(optimizer, init=has_state and not had_state)
                if not has_state:  # loaded as an optimizer without state: its entries are hyperparameters only
                    flat = {k: v for k, v in flat.items() if not k.startswith("state.")}
                # read into copies: the optimizer's own tensors change only once every rank has read its part
                full_optim = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in flat.items()}
                # parameters the checkpoint holds no state for (no gradient before it was saved) keep none either
                missing = {k for k in full_optim if k.startswith("state.") and f"optim.{k}" not in keys}
                stateless = [p for n, p in self.named_parameters() if any(k.startswith(f"state.{n}.") for k in missing)]
                sd["optim"] = {k: v for k, v in full_optim.items() if k not in missing}
            if extra:
                sd.update(tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, dict(extra)))
            dcp.load(sd, checkpoint_id=checkpoint_id, process_group=self.group)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            failure = e
        failed = self._ranks_failing(failure is not None, f"every rank's load of the checkpoint {checkpoint_id!r}")
        if failed:
            if optimizer is not None and not had_state:
                optimizer.state.clear()  # initialised above to read into
            if failure is not None:
                raise failure
            raise RuntimeError(f"rank(s) {failed} could not load the checkpoint {checkpoint_id!r} (their error says "
                               f"why); nothing was loaded on rank {self.rank} either")
        self.load_state_dict(sd["model"], strict=False)
        if optimizer is not None:
            if not has_state:
                optimizer.state.clear()
            full_optim.update(sd["optim"])
            self.load_optimizer_state_dict(optimizer, full_optim)
            for p in stateless:
                optimizer.state.pop(p, None)
        if extra:
            _copy_into(extra, {k: sd[k] for k in extra})

    def _ranks_failing(self, failed: bool, what: str) -> list[int]:
        """The pipeline ranks for which ``failed`` is true (a collective: every rank says whether it failed)."""
        from ..wire import _wait

        flags = torch.zeros(self.world, dtype=torch.int32, device=self.device)
        flags[self.rank] = int(failed)
        _wait(dist.all_reduce(flags, group=self.group, async_op=True), self.timeout, what)
        return [r for r, f in enumerate(flags.tolist()) if f]

    def state_dict_names(self) -> dict[str, torch.Tensor]:
        """This rank's entries of the state dict, name -> the model's tensor (no copy)."""
        out = {}
        for pid in self.local_param_ids:
            for n in self._names_by_id[pid]:
                out[n] = self._param_obj[pid]
        persistent = set(self.compiled.model.state_dict(keep_vars=True))
        for n, b in self.compiled.model.named_buffers(remove_duplicate=False):
            if n in persistent and (n in self._local_state_names or self.rank == 0):
                out[n] = b
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and persistent buffers under every original name (tied weights under each alias);
        buffers no chunk reads are kept by rank 0.  Copies (:meth:`state_dict_names` gives the tensors)."""
        return {n: t.detach().clone() for n, t in self.state_dict_names().items()}

    def _owners(self) -> list[tuple[int, str, torch.Tensor]]:
        """``(owner rank, name, tensor)`` for every entry of the full state dict, in model order: a parameter's
        lowest holding rank, a buffer's lowest reading rank (rank 0 for buffers no chunk reads)."""
        comp = self.compiled
        readers: dict[str, set] = defaultdict(set)
        for c in comp.partition.chunks:
            if c.index in comp.program.chunks:
                for n in comp.program.chunks[c.index].state_names:
                    readers[n].add(c.rank)
        out = []
        for pid, p in self._param_obj.items():
            for n in self._names_by_id[pid]:
                out.append((min(self._ranks_by_id[pid]), n, p))
        persistent = set(comp.model.state_dict(keep_vars=True))
        for n, b in comp.model.named_buffers(remove_duplicate=False):
            if n in persistent:
                out.append((min(readers[n]) if readers.get(n) else 0, n, b))
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict gathered from all ranks, under the original names (a collective).

        Each rank broadcasts the bytes of the tensors it owns as one buffer; every rank knows their names, dtypes and
        shapes from its copy of the model, so nothing but tensor bytes travels (no pickle).

        Raises:
            dipc.wire.WireTimeout: a rank's tensors did not arrive within the runtime's timeout.
        """
        from ..wire import _wait

        owned: dict[int, list] = defaultdict(list)
        for r, n, t in self._owners():
            owned[r].append((n, t))
        out: dict[str, torch.Tensor] = {}
        for r in range(self.world):
            items = owned.get(r, [])
            sizes = [t.numel() * t.element_size() for _, t in items]
            total = sum(sizes)
            if not total:
                for n, t in items:
                    out[n] = t.detach().clone()
                continue
            if r == self.rank:
                buf = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8).to(self.device)
                                 for _, t in items if t.numel()])
            else:
                buf = torch.empty(total, dtype=torch.uint8, device=self.device)
            src = dist.get_global_rank(self.group, r) if self.group is not None else r
            _wait(dist.broadcast(buf, src=src, group=self.group, async_op=True), self.timeout,
                  f"rank {r}'s {len(items)} state tensors ({total} bytes)")
            off = 0
            for (n, t), size in zip(items, sizes):
                piece = buf[off:off + size].clone()
                out[n] = piece.view(t.dtype).reshape(t.shape).to(t.device) if size else t.detach().clone()
                off += size
        return out

    # -- step
    def trace_events(self) -> list[dict]:
        """Every rank's measured actions of the last step, as trace events for :mod:`dipc.trace` (a collective:
        call it on every rank; JSON on the wire).  Times are seconds from each rank's start of execution (after
        plan delivery)."""
        from ..wire import all_gather_json

        mod_of = {c.index: c.modality for c in self.compiled.partition.chunks}
        mine = []
        for a, s, e, _ in self.last_timeline:
            mine.append({"rank": self.rank, "start": s, "end": e, "name": str(a), "kind": a.kind,
                         "modality": mod_of.get(a.chunk, "")})
        parts = all_gather_json(mine, self.group, self.device, self.timeout, what="trace events")
        return [e for p in parts for e in p]

    def _make(self, w: StepWorkload, schedule: str, forward_only: bool = False) -> Plan:
        from ..codegen.templates import template

        if forward_only:  # evaluation: the template's order without its backwards (no memory to plan for)
            from ..plan import forward_only as drop_backwards

            plan = drop_backwards(make_plan(self.compiled, w, self.step_index, schedule=schedule, check=False))
        else:
            plan = make_plan(self.compiled, w, self.step_index, memory_limit=self.memory_limit, schedule=schedule,
                             budget_s=self.budget_s if template(schedule).kind == "interleave" else 0.0,
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
        if self.rank == 0:
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
        header = broadcast_json(header, src, self.group, self.device, self.timeout,
                                what=f"the plan of step {self.step_index}")
        step, theirs = header["step"], header["digest"]
        if "error" in header:
            if self.rank == 0 and early is not None:
                raise early  # rank 0's own bad input keeps its type (BatchError, ValueError)
            if early is not None and header["error"] == f"{type(early).__name__}: {early}":
                raise early  # every rank refused the batch alike
            raise PlanError(f"step {step}: rank 0 could not plan it: {header['error']}")
        if header.get("source") != "fallback" and header.get("schedule") != name and local_err is None:
            local_err = (f"PlanError: this rank asked for schedule {name!r}, rank 0 for {header.get('schedule')!r} "
                         "(every rank must step with the same schedule)")
        if self.rank != 0 and local_err is None:
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
        from ..wire import _wait

        # one all-reduce tells every rank whether all built the step, agree on its index and on its digest
        bits = int(torch.tensor([loss_scale], dtype=torch.float64).view(torch.int64).item())  # the GradScaler's
        floats_differ = "floats" in header and header["floats"] != floats
        same = torch.tensor([1 if mine == theirs and not floats_differ else 0, self.step_index, -self.step_index,
                             0 if local_err else 1, bits, -bits], dtype=torch.int64, device=self.device)
        _wait(dist.all_reduce(same, op=dist.ReduceOp.MIN, group=self.group, async_op=True), self.timeout,
              f"every rank's check of step {self.step_index}'s plan")
        if int(same[3].item()) == 0:  # some rank failed alone: the lowest one tells every rank what happened
            bits = torch.tensor([float(2 ** self.rank) if local_err else 0.0], dtype=torch.float64,
                                device=self.device)
            _wait(dist.all_reduce(bits, group=self.group, async_op=True), self.timeout,
                  f"every rank's failure flags of step {self.step_index}")
            b = int(bits.item())
            origin = (b & -b).bit_length() - 1
            text = broadcast_json(local_err if self.rank == origin else None, origin, self.group, self.device,
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
                   f"0's {header['floats'][:12]})" if floats_differ else "another rank's digest differs from this one's")
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
                :func:`dipc.runtime.make_plan`; rank 0's is used, checked against the step's stages, validated
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
        if self.dp_size == 1:
            return self._step(batch, n_microbatches, schedule, next_batch, plan, scale)

        def run():
            self._dp_begin_step(batch, training=True, scale=scale)
            return self._step(batch, n_microbatches, schedule, next_batch, plan, scale)
        return self._dp_guard(run)

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
        if self.rank == 0 and next_batch is not None:  # planned while this step runs
            self._submit(next_batch, n, schedule)
        t1 = time.perf_counter()
        # this step's gradients accumulate into fresh .grad tensors; those of earlier steps (accumulation over steps)
        # are added back once the step succeeded, and restored untouched when it raises (nothing half-accumulated)
        stash = [(p, p.grad) for p in self.parameters()]
        for p, _ in stash:
            p.grad = None
        try:
            ex = Executor(self.rank, w, plan, self.transport, _modules_of(w, {self.rank}, self.device), self.device,
                          yield_after_post=dist.get_backend(self.group) == "gloo")
            ex.loss_scale = scale
            buckets = self._dp_buckets if self.dp_size > 1 else None
            if buckets is not None:  # data parallel: a bucket's all-reduce starts once its last backward ran
                buckets.schedule(plan, self.rank, self._dp_reads(w))
                ex.after_action = buckets.after
            failure = None
            try:
                ex.run()
                ex.finish()
            except BaseException as e:  # drained (Executor.run): every rank now learns of it in the status exchange
                failure = e
            local = torch.zeros((), dtype=torch.float64)
            if failure is None:
                local = sum((mbs[m].weight * l.detach().to(torch.float64) for m, l in ex.losses.items()
                             if mbs[m].weight), local)  # a weight-0 microbatch's loss is 0/0
            try:
                loss = self._exchange_status(ex, failure, local).to(torch.float32)
            except StepFailed as e:
                if not e.usable:
                    self._broken = f"step {self.step_index} ({e})"
                if failure is not None and not isinstance(failure, Exception):
                    raise failure from None  # KeyboardInterrupt, SystemExit: the peers got StepFailed, this rank
                raise                        # gets what it raised

            zero_unreached_grads(self.compiled, w, {self.rank})

            if self.dp_size > 1:  # the data-parallel replicas' gradients, as on their concatenated batch
                loss = self._dp_finish(loss, grads=True)
            for pid, rs in self._tied:  # a tied weight's ranks sum this step's gradients (linear: after the
                p = self._param_obj[pid]  # data-parallel sum as well as before it)
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                sum_over_ranks(p.grad, rs, self.group, self.timeout,
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
        self.last_timeline = ex.timeline
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

    def eval_step(self, batch: Mapping[str, torch.Tensor], n_microbatches: int | None = None,
                  schedule: str | None = None, outputs: Sequence[str] | str | None = None):
        """The loss of ``batch`` by a forward-only pipeline (Megatron's ``forward_only=True``): each rank runs its
        forwards in the order of ``schedule``'s plan (default "1f1b"; :func:`dipc.schedules`) with the backwards
        dropped (:func:`dipc.plan.forward_only`), without autograd (nothing is kept for a backward; an output is
        freed after its last reader), and sends activations only.  No gradient, optimizer state or step counter
        changes; the background planner's look-ahead for the next training step stays valid.  ``pipe.step`` under
        ``torch.no_grad()`` or ``torch.inference_mode()`` runs this.

        The chunks run as the model was captured: a model compiled in training mode runs its dropout (dipc's
        models are deterministic; compile a model with dropout in ``eval()`` mode for evaluation numbers).

        Args:
            batch: as for :meth:`step`.  With ``outputs``, a token-mean model's labels may be left out (an
                evaluation for a metric or for generation): they are filled with the loss's ignore index, which only
                its loss reads (checked: an output computed from the labels is refused), and no loss is returned.
            n_microbatches: default the runtime's.
            schedule: whose forward order to follow; default "1f1b" (no sub-microbatches, no planning search).
            outputs: model output keys to hand back besides the loss, e.g. ``["logits"]``
                (:attr:`CompiledPipeline.outputs` lists those the model has): each microbatch's values are sent to
                the pipeline's last rank and concatenated there in sample order along dim 0 (``logits`` ``[B, S,
                vocab]`` for the whole ``batch``; 0-dim values are stacked, ``[n_microbatches]``).  Under data
                parallelism each pipeline's last rank gets its own batch's.

        Returns:
            without ``outputs``: the batch loss (0-dim float32), identical on every rank and equal to the unsplit
            model's under ``torch.no_grad()`` up to float rounding.  With ``outputs``: ``(loss, values)``, ``loss``
            None when the labels were left out, ``values`` a dict key -> tensor on the last rank and None on the
            others.

        Raises:
            ValueError: an unknown output key, labels left out without ``outputs``, or an asked-for output that
                reads the labels (on every rank, before any activation moves).
            as :meth:`step` (on every rank, before any activation moves, for bad input or ranks that disagree,
            including one rank evaluating while another trains or asking for other outputs); ``StepFailed`` for a
            failure inside the plan.
        """
        if self.dp_size == 1:
            return self._eval_step(batch, n_microbatches, schedule, outputs)

        def run():
            self._dp_begin_step(batch, training=False)
            res = self._eval_step(batch, n_microbatches, schedule, outputs)
            if outputs is None:
                return self._dp_finish(res, grads=False)
            loss, values = res
            if loss is None:  # no labels: nothing to average, but the replicas still check each other
                self._dp_finish(torch.zeros(()), grads=False)
                return None, values
            return self._dp_finish(loss, grads=False), values
        return self._dp_guard(run)

    def _eval_request(self, batch, outputs) -> tuple[tuple[str, ...], Mapping, bool]:
        """``(output keys, batch, labelled)`` for :meth:`eval_step`: the keys checked, and a batch without labels
        given labels of the ignore index (``labelled`` False).

        Raises:
            ValueError: see :meth:`eval_step`."""
        comp = self.compiled
        if outputs is None:
            keys: tuple[str, ...] = ()
        else:
            keys = (outputs,) if isinstance(outputs, str) else tuple(outputs)
            if not keys or not all(isinstance(k, str) for k in keys) or len(set(keys)) != len(keys):
                raise ValueError(f"outputs must be output keys (distinct strings), got {outputs!r}")
            have = comp.outputs
            bad = [k for k in keys if k not in have]
            if bad:
                dropped = comp.program.capture.dropped_outputs
                raise ValueError(f"outputs {bad}: {type(comp.model).__name__} returns {sorted(have) or 'no output'} "
                                 "besides the loss that an evaluation can hand back"
                                 + (f" ({list(dropped)} are not computed on the way to the loss, so they are not in "
                                    "the captured graph)" if dropped else ""))
        spec = comp.batch_spec.loss
        if not isinstance(batch, Mapping) or spec.kind != "token_mean" or not spec.labels_key or \
                spec.labels_key in batch:
            return keys, batch, True
        if not keys:
            raise ValueError(f"the batch has no {spec.labels_key!r}: an evaluation without labels computes no loss; "
                             "ask for outputs=[...] (e.g. 'logits')")
        ref = batch.get("input_ids")
        if not isinstance(ref, torch.Tensor):
            raise ValueError(f"the batch has no {spec.labels_key!r} and no 'input_ids' to shape labels after")
        reading = [k for k in keys if comp.output_reads(k, spec.labels_key)]
        if reading:
            raise ValueError(f"outputs {reading} of {type(comp.model).__name__} are computed from "
                             f"{spec.labels_key!r}: they cannot be evaluated without labels")
        batch = dict(batch)
        batch[spec.labels_key] = torch.full_like(ref, spec.ignore_index)
        return keys, batch, False

    def _eval_step(self, batch: Mapping[str, torch.Tensor], n_microbatches: int | None = None,
                   schedule: str | None = None, outputs=None):
        """The body of :meth:`eval_step` (one pipeline)."""
        schedule = "1f1b" if schedule is None else schedule
        try:
            keys, batch, labelled = self._eval_request(batch, outputs)
            refused = None
        except ValueError as e:
            keys, labelled, refused = (), True, e
        # planning may capture a new program: that is a training trace, whatever grad mode the caller is in
        with torch.inference_mode(False), torch.enable_grad():
            batch, mbs, early, n = self._split(batch, n_microbatches, schedule, not labelled, refused)
            w, plan = self.plan_step(mbs, schedule, batch, early=early, forward_only=True,
                                     tag=f"|outputs:{','.join(keys)}" if keys else "")
        mbs = w.microbatches
        ex = Executor(self.rank, w, plan, self.transport, _modules_of(w, {self.rank}, self.device), self.device,
                      yield_after_post=dist.get_backend(self.group) == "gloo")
        ex.want_outputs = frozenset(keys)
        failure = None
        try:
            with torch.no_grad():
                ex.run()
                ex.finish()
        except BaseException as e:  # noqa: BLE001 - drained: every rank learns of it in the status exchange
            failure = e
        local = torch.zeros((), dtype=torch.float64)
        if failure is None and labelled:
            local = sum((mbs[m].weight * l.to(torch.float64) for m, l in ex.losses.items() if mbs[m].weight), local)
        try:
            loss = self._exchange_status(ex, failure, local).to(torch.float32)
        except StepFailed as e:
            if not e.usable:
                self._broken = f"evaluation at step {self.step_index} ({e})"
            if failure is not None and not isinstance(failure, Exception):
                raise failure from None
            raise
        if outputs is None:
            return loss
        try:
            values = self._gather_outputs(ex, w, keys)
        except TransportError as e:
            self._broken = f"evaluation at step {self.step_index} ({e})"
            raise
        return (loss if labelled else None), values

    _OUTPUTS_TAG = 1 << 30  # message tag of the evaluation outputs sent to the last rank (after every plan message)

    def _gather_outputs(self, ex: Executor, w: StepWorkload, keys) -> dict[str, torch.Tensor] | None:
        """The evaluation outputs ``keys`` of every microbatch, on the last rank of the pipeline: each rank that
        computed some sends a JSON header (key, microbatch, sub-microbatch, shape, dtype per tensor) and the
        tensors; the last rank concatenates them in microbatch (then sub-microbatch) order.  Returns None on the
        other ranks.

        Raises:
            TransportError: a message did not arrive within the runtime's timeout."""
        from ..wire import decode_json, encode_json

        dst = self.world - 1
        owners, computed = set(), set()
        for k, st in w.graph.stages.items():
            have = [x for x in keys if st.kind == "F" and x in w.programs[k].chunks[st.chunk].extra]
            if have:
                owners.add(st.rank)
                computed.update(have)
        empty = {x: self._empty_output(w, x) for x in keys if x not in computed}  # e.g. image features, no image
        tag = self._OUTPUTS_TAG
        if self.rank != dst:
            if self.rank in owners:
                items = sorted(ex.extra.items())
                head = torch.frombuffer(bytearray(encode_json(
                    [[k, m, s, list(t.shape), str(t.dtype).removeprefix("torch.")] for (k, m, s), t in items])),
                    dtype=torch.uint8).to(self.device)
                works = [self.transport.isend(torch.tensor([head.numel()], device=self.device), dst, tag),
                         self.transport.isend(head, dst, tag + 1)]
                works += [self.transport.isend(t.contiguous(), dst, tag + 2) for _, t in items]
                for wk in works:
                    self.transport.wait(wk, "the evaluation outputs' transfer to the last rank")
            return None
        got = dict(ex.extra)
        for r in sorted(owners - {dst}):
            n = torch.zeros(1, dtype=torch.int64, device=self.device)
            self.transport.wait(self.transport.irecv(n, r, tag), f"the evaluation outputs' header from rank {r}")
            head = torch.empty(int(n.item()), dtype=torch.uint8, device=self.device)
            self.transport.wait(self.transport.irecv(head, r, tag + 1), f"the evaluation outputs' header from rank {r}")
            for k, m, s, shape, dtype in decode_json(bytes(head.cpu().numpy().tobytes())):
                t = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
                self.transport.wait(self.transport.irecv(t, r, tag + 2), f"evaluation output {k!r} from rank {r}")
                got[(k, m, s)] = t
        values = dict(empty)
        for key in keys:
            if key in empty:
                continue
            parts = [t for (k, _, _), t in sorted(got.items(), key=lambda kv: kv[0][1:]) if k == key]
            values[key] = torch.stack(parts) if parts[0].dim() == 0 else torch.cat(parts)
        return values

    def _empty_output(self, w: StepWorkload, key: str) -> torch.Tensor:
        """The value of output ``key`` when no stage of the step computes it (an encoder's output for a batch
        without images): an empty tensor, 0 in dim 0 and the other dims as the capture has them.

        Raises:
            ValueError: those dims depend on the batch (on every rank: they all see the same step)."""
        from ..planner.workload import autocast_dtypes

        for prog in self.compiled.programs:
            for cm in prog.chunks.values():
                meta = cm.extra_meta.get(key)
                if meta is None:
                    continue
                data = w.microbatches[0].data if w.microbatches else {}
                bind = {sym: int(data[k].shape[d]) for sym, k, d in prog.bindings
                        if isinstance(data.get(k), torch.Tensor) and d < data[k].dim()}
                rest = []
                for d in meta.shape[1:]:
                    d = d if isinstance(d, int) else d.xreplace(bind)
                    rest.append(int(d) if isinstance(d, int) or d.is_number else None)
                if None in rest or not meta.shape:
                    raise ValueError(f"output {key!r} is computed by no stage of this batch (e.g. an encoder's "
                                     f"output and no image) and its shape {list(meta.shape)} depends on the batch: "
                                     "dipc cannot make it empty")
                dtype = autocast_dtypes(prog, w.amp).get(prog.capture.outputs.get(key), meta.dtype)
                return torch.empty([0, *rest], dtype=dtype, device=self.device)
        raise ValueError(f"output {key!r} is computed by no chunk")

    # -- data parallelism
    def _dp_layout(self) -> dict:
        """What the data-parallel replicas must share: the partition (chunk, rank, modality, blocks), this rank's
        parameters and buffers (names, shapes, dtypes: the broadcast and the gradient buckets follow them) and the
        bucket size."""
        import hashlib

        from ..wire import encode_json

        comp = self.compiled
        chunks = [[c.index, c.rank, c.modality, list(c.blocks)] for c in comp.partition.chunks]
        state = [[n, list(t.shape), str(t.dtype)] for n, t in self.state_dict_names().items()]
        return {"chunks": hashlib.sha256(encode_json(chunks)).hexdigest()[:16],
                "state": hashlib.sha256(encode_json(state)).hexdigest()[:16], "bucket_bytes": self.bucket_bytes}

    def _dp_check_layout(self) -> None:
        """Before any weight moves between replicas: every replica compiled the same partition, holds the same
        tensors on this pipeline rank and buckets gradients alike (else the broadcast and the all-reduces would pair
        unlike tensors).  One all-gather over the data-parallel group, then one all-reduce over the pipeline, so
        that every rank of every replica raises alike.

        Raises:
            ValueError: the replicas differ (names what differs: compiled from other example batches or options,
                another ``bucket_mb``)."""
        from ..wire import _wait, all_gather_json

        mine = self._dp_layout()
        every = all_gather_json(mine, self.dp_group, self.device, self.timeout,
                                what="data-parallel replicas' layouts")
        diff = sorted({k for o in every for k in o if o[k] != mine[k]})
        bad = torch.tensor([1.0 if diff else 0.0], dtype=torch.float64, device=self.device)
        _wait(dist.all_reduce(bad, group=self.group, async_op=True), self.timeout,
              "the pipeline's agreement on the data-parallel layout")
        if diff or float(bad.item()) > 0:
            what = {"chunks": "the partition (compile every replica from the same example batch and options)",
                    "state": "the parameters and buffers of this pipeline rank",
                    "bucket_bytes": "bucket_mb"}
            detail = "; ".join(what[k] for k in diff) if diff else "another pipeline rank's replicas differ"
            raise ValueError(f"rank {self.rank}: the data-parallel replicas were built differently: {detail}; "
                             "every replica must compile the same model, example batch and options and pass the "
                             f"same bucket_mb (this rank: {mine})")

    def _dp_broadcast_state(self) -> None:
        """Every data-parallel replica starts from the first replica's parameters and buffers (as DDP does)."""
        from ..wire import _wait

        src = dist.get_global_rank(self.dp_group, 0)
        with torch.no_grad():
            for n, t in self.state_dict_names().items():
                _wait(dist.broadcast(t.data, src=src, group=self.dp_group, async_op=True), self.timeout,
                      f"the data-parallel broadcast of {n}")

    def _dp_count(self, batch) -> float:
        """This replica's share of the concatenated batch's loss normaliser (labelled tokens, samples, ...)."""
        spec = self.compiled.batch_spec
        if spec.loss.kind == "sum":
            return 1.0
        try:
            key = spec.sample_key
            n = int(batch[key].shape[0]) if key and isinstance(batch.get(key), torch.Tensor) else 1
            return float(spec.loss.numerator(batch, n))
        except Exception:  # noqa: BLE001 - a bad batch (or one without labels): the step refuses it on every rank
            return 0.0

    def _dp_guard(self, run):
        """Run one pipeline's step under data parallelism; when it raises before every replica heard of it, tell
        them (which then raise too) before raising here, so that no replica waits in an all-reduce until the
        timeout: before the step's first header (:meth:`_dp_start`) that header says "failed"; after it, the
        gradient buckets still owed are all-reduced (zeros) and the second header says "failed"."""
        self._dp_phase, self._dp_buckets = 0, None
        try:
            return run()
        except BaseException as e:
            if not getattr(e, "_dipc_dp_told", False):
                error = f"{type(e).__name__}: {e}"[:4000]  # what the other replicas' StepFailed will say
                try:
                    if self._dp_phase == 0:
                        self._dp_start(0.0, training=False, failed=True, error=error)
                    elif self._dp_phase == 1:
                        if self._dp_buckets is not None:
                            self._dp_buckets.launch_rest()
                        self._dp_end(True, 0.0, None, error=error)
                except Exception:  # noqa: BLE001 - the other replicas then meet their own timeout
                    pass
                if self._dp_buckets is not None:
                    self._dp_buckets.drain()
            raise
        finally:
            self._dp_buckets = None

    def _dp_allreduce(self, h: torch.Tensor, what: str) -> torch.Tensor:
        from ..wire import _wait

        h = h.to(self.device)
        _wait(dist.all_reduce(h, group=self.dp_group, async_op=True), self.timeout, what)
        return h.cpu()

    def _dp_failed(self, why: str) -> StepFailed:
        e = StepFailed(f"step {self.step_index}: {why}; every replica stopped it and its .grad is as before it",
                       step=self.step_index, usable=True)
        e._dipc_dp_told = True
        return e

    def _dp_failure(self, mask: float, error: str) -> str:
        """After a header whose first entry (``mask``: the sum of ``2 ** replica`` over the failed replicas) is not
        0: the lowest failed replica's ``error`` reaches every replica (JSON over the data-parallel group, a
        collective), and the text every replica's :class:`StepFailed` gives: which replicas failed and why."""
        from ..wire import broadcast_json

        bits = int(mask)
        failed = [r for r in range(self.dp_size) if bits >> r & 1] if self.dp_size <= _DP_MASK_BITS else []
        if not failed:
            return f"{bits} data-parallel replica(s) failed this step"
        me = dist.get_rank(self.dp_group)
        text = broadcast_json(error if me == failed[0] else None, failed[0], self.dp_group, self.device, self.timeout,
                              f"the error of data-parallel replica {failed[0]}")
        return f"data-parallel replica(s) {failed} failed this step; replica {failed[0]}: {text}"

    def _dp_flag(self, failed: bool) -> float:
        """This replica's entry in a header's failure mask (``2 ** replica``; a count past 50 replicas)."""
        if not failed:
            return 0.0
        return float(2 ** dist.get_rank(self.dp_group)) if self.dp_size <= _DP_MASK_BITS else 1.0

    def _dp_start(self, count: float, training: bool, failed: bool = False, scale: float = 1.0,
                  error: str = "") -> float:
        """The step's first header, one float64 all-reduce (sum) over the data-parallel group before any activation
        moves: [failed replicas, loss normaliser (``count``), replicas that train (not evaluate), step index, its
        square, log2 of the gradient scaler's scale, its square].  Returns the normaliser's sum (the concatenated
        batch's).

        Raises:
            StepFailed: a replica failed before its step began, evaluates while this one trains (or the reverse),
                is at another step or has another gradient scale (every rank of every replica raises)."""
        D = self.dp_size
        ls = math.log2(scale) if 0 < scale < math.inf else 0.0
        h = self._dp_allreduce(torch.tensor([self._dp_flag(failed), count, float(training), float(self.step_index),
                                             float(self.step_index) ** 2, ls, ls * ls], dtype=torch.float64),
                               f"the data-parallel replicas' status before step {self.step_index}")
        self._dp_phase = 1
        why = ""
        if h[0] > 0:
            why = self._dp_failure(float(h[0]), error)
        elif float(h[2]) not in (0.0, float(D)):
            why = (f"{int(h[2])} of the {D} data-parallel replicas trained while the others evaluated (every "
                   "replica must call step() or eval_step() alike)")
        elif float(h[4]) * D != float(h[3]) ** 2:
            why = (f"the data-parallel replicas are at different steps (this one at step {self.step_index}): every "
                   "replica must call step() for every batch")
        elif abs(float(h[6]) * D - float(h[5]) ** 2) > 1e-9 * max(1.0, float(h[6]) * D):
            why = (f"the data-parallel replicas' gradient scalers disagree (this one's scale is {scale!r}): use one "
                   "scaler whose inf check spans every rank (ShardedGradScaler with process_group = all ranks)")
        if why:
            self._dp_phase = 2
            raise self._dp_failed(why)
        return float(h[1])

    def _dp_end(self, failed: bool, weighted_loss: float, flags, error: str = "") -> tuple[torch.Tensor, str]:
        """The step's second header, after its plan ran: [failed replicas' mask, sum of count-weighted losses, per
        local parameter whether it has a gradient]; returns it and, when a replica failed, why
        (:meth:`_dp_failure`, "" otherwise)."""
        n = len(self.local_param_ids)
        h = torch.zeros(2 + n, dtype=torch.float64)
        h[0], h[1] = self._dp_flag(failed), weighted_loss
        if flags is not None:
            h[2:] = flags
        h = self._dp_allreduce(h, f"the data-parallel replicas' status after step {self.step_index}")
        self._dp_phase = 2
        return h, (self._dp_failure(float(h[0]), error) if h[0] > 0 else "")

    def _dp_begin_step(self, batch, training: bool, count: float | None = None, scale: float = 1.0) -> None:
        """The data-parallel part of a step's start (:meth:`_dp_start`); a training step also gets its gradient
        buckets (:class:`dipc.runtime.data_parallel.GradBuckets`, all-reduced as its backwards finish them)."""
        from .data_parallel import GradBuckets

        count = self._dp_count(batch) if count is None else count
        total = self._dp_start(count, training, scale=scale)
        self._dp_count_now, self._dp_total = count, total
        if training:
            scale = 1.0 if self.compiled.batch_spec.loss.kind == "sum" else (count / total if total else 0.0)
            self._dp_buckets = GradBuckets(self.parameters(), self.bucket_bytes, self.dp_group, scale, self.timeout)

    def _dp_reads(self, w: StepWorkload):
        """action -> ids of the parameters its chunk reads (for :meth:`GradBuckets.schedule`)."""
        from ..plan import stage_key

        memo: dict = {}

        def reads(a):
            fk = stage_key("F", a.chunk, a.mb, a.sub)
            prog = w.programs[fk]
            k = (id(prog), a.chunk)
            if k not in memo:
                memo[k] = {id(self.compiled._state[n]) for n in prog.chunks[a.chunk].state_names
                           if isinstance(self.compiled._state.get(n), torch.nn.Parameter)}
            return memo[k]
        return reads

    def _dp_finish(self, loss: torch.Tensor, grads: bool) -> torch.Tensor:
        """The data-parallel part of a step's end: the loss (and, with ``grads``, this step's gradients) as on the
        replicas' concatenated batch.  Replica r's loss weighs ``count_r / sum(count)`` (labelled tokens for a
        token-mean loss, samples for a sample mean; 1 for a summed loss) and so do its gradients, summed by the
        buckets' all-reduces that started during the step (``bucket_mb`` MiB per bucket).  A parameter no replica
        reached keeps no gradient, as in the unsplit model.

        Raises:
            StepFailed: another replica's step failed (every rank of every replica raises; the gradients are as
                before the step)."""
        params = self.parameters()
        flags = None
        b = self._dp_buckets
        if grads:
            b.launch_rest()
            flags = torch.tensor([0.0 if p.grad is None else 1.0 for p in params], dtype=torch.float64)
        count, total = self._dp_count_now, self._dp_total
        h, why = self._dp_end(False, float(loss) * count if count else 0.0, flags)
        if why:
            if b is not None:
                b.drain()
            raise self._dp_failed(why)
        if grads:
            b.wait(f"the data-parallel gradient all-reduce of step {self.step_index}")
            spec = self.compiled.batch_spec.loss
            if spec.kind == "token_mean" and not total:  # every replica raises this, and .grad stays as before
                raise BatchError(f"step {self.step_index}: no data-parallel replica's batch has a labelled token in "
                                 f"{spec.labels_key!r}: the concatenated batch's token-mean loss is undefined")
            b.copy_back({id(p) for p, f in zip(params, h[2:].tolist()) if f > 0})
            # after which of the rank's actions each bucket's all-reduce started (n_actions: after the plan)
            self.last_dp_buckets = {"started_after": list(b.launched_at), "n_actions": b.n_actions}
        out = float(h[1]) if self.compiled.batch_spec.loss.kind == "sum" else (float(h[1]) / total if total else 0.0)
        return torch.tensor(out, dtype=torch.float32)

    def _exchange_status(self, ex: Executor, failure: BaseException | None, local_loss: torch.Tensor) -> torch.Tensor:
        """After the plan ran (or was drained after a failure), one all-reduce sums the ranks' loss shares (float64;
        returned, 0-dim) and tells every rank whether any rank failed; the first failing rank then broadcasts its
        action and exception (JSON) and every rank raises the same :class:`StepFailed` (issue "Faults", point 1).

        Raises:
            StepFailed: some rank failed (``usable`` False when a wait timed out or a connection broke, or the
                exchange itself failed: a rank died or hangs)."""
        from ..wire import WireTimeout, _wait, broadcast_json

        own = failure is not None and not isinstance(failure, _PeerFailed)
        flag = torch.stack([torch.tensor(float(2 ** self.rank) if own else 0.0, dtype=torch.float64),
                            torch.tensor(1.0 if isinstance(failure, TransportError) else 0.0, dtype=torch.float64),
                            local_loss.to("cpu", torch.float64)]).to(self.device)
        mine = ""
        if failure is not None:
            a = ex.failure[0] if ex.failure else "the step's last sends"
            mine = f"this rank (rank {self.rank}) failed in {a}: {type(failure).__name__}: {failure}; "
        try:
            _wait(dist.all_reduce(flag, group=self.group, async_op=True), self.timeout,
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
        origin = (bits & -bits).bit_length() - 1  # the lowest failing rank speaks for all
        text = None
        if self.rank == origin:
            a = ex.failure[0] if ex.failure else "the step's last sends"
            text = {"action": str(a), "error": f"{type(failure).__name__}: {failure}"}
        text = broadcast_json(text, origin, self.group, self.device, self.timeout,
                              what=f"rank {origin}'s failure report of step {self.step_index}")
        others = [r for r in range(self.world) if bits >> r & 1 and r != origin]
        more = f" (ranks {others} failed too)" if others else ""
        state = ("the process group cannot run further steps (a wait timed out or a connection broke; gloo closes "
                 "such a pair)" if broken else "the process group can run further steps")
        raise StepFailed(f"step {self.step_index}: rank {origin} failed in {text['action']}: {text['error']}{more}; "
                         f"every rank stopped the step and its .grad is as before it; {state}", origin=origin,
                         action=text["action"], step=self.step_index, usable=not broken) from failure

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
        budget = self.budget_s if template(schedule).kind == "interleave" else 0.0
        try:  # never raises: this rank's peers already run the step
            if not isinstance(next_batch, Mapping):
                raise TypeError(f"next_batch must be a mapping like the batch, got {type(next_batch).__name__}")
            self._planner.submit(self.step_index + 1, next_batch, n, schedule, budget, self.seed + self.step_index + 1,
                                 autocast_state(self.device), simulate=self.simulate_steps)
        except Exception as e:  # noqa: BLE001 - not sendable: the next step plans synchronously
            self._planner.submitted = None
            log.warning("dipc: step %d's next batch cannot go to the background planner (%s: %s); it will be "
                        "planned synchronously", self.step_index, type(e).__name__, e)

    def close(self) -> None:
        """Stop this rank's background planner, if any (idempotent; the process also exits with this one)."""
        if self._planner is not None:
            self._planner.close()
            self._planner = None


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
            from ..planner.background import _summary

            self.simulation = _summary(self._pipe.compiled, self._workload, self._plan,
                                       self._pipe.compiled.rank_state_bytes())
        return self.simulation

    def summary(self) -> str:
        """One line: the schedule and where its plan came from, planning time on the training thread and in the
        background planner, predicted vs measured seconds, the simulated bubble ratio when known, fallbacks."""
        parts = [f"step {self.step}", f"{self.schedule} ({self.plan_source})",
                 f"plan {self.plan_s * 1e3:.1f} ms"]
        if self.planner_s is not None:
            parts.append(f"planner {self.planner_s * 1e3:.1f} ms ({self.planner_cpu_s * 1e3:.1f} ms CPU)")
        if self.predicted_s is not None:
            parts.append(f"predicted {self.predicted_s * 1e3:.3f} ms")
        parts.append(f"measured {self.execute_s * 1e3:.1f} ms")
        if self._fetch() is not None:
            parts.append(f"bubble {self.simulation['bubble_ratio']:.1%}")
        if self.search:
            parts.append(f"search {self.search.get('rollouts', 0)} rollouts")
        parts.append(f"fallbacks {self.fallbacks}")
        return "  ".join(parts)


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
