"""One rank's parameters in a :class:`dipc.runtime.PipelineRuntime` (a mixin): materialising a meta-device model's
chunks on this rank (``init``), the parameter list the optimizer takes, train/eval mode, ``zero_grad`` and
``clip_grad_norm_`` over the whole model (the norm the unsplit model's ``torch.nn.utils.clip_grad_norm_`` gives, the
same on every rank; tied weights counted once).
"""
from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist

__all__ = ["ParametersMixin"]


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A reduction of a DTensor gradient as a plain tensor (its value over the whole tensor-parallel group)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _abs_max(g: torch.Tensor) -> torch.Tensor:
    """``max |g|`` of a whole gradient as a float64 scalar (0 for an empty one).  A DTensor's is its shards' maximum
    (a collective over its mesh): a shard may be empty (FSDP's last replicas of a tensor with fewer rows than the
    data-parallel size), where ``max()`` has no identity."""
    from torch.distributed.tensor import DTensor, Partial

    loc = g.to_local() if isinstance(g, DTensor) else g
    m = loc.detach().abs().max().to(torch.float64) if loc.numel() else \
        torch.zeros((), dtype=torch.float64, device=loc.device)
    if not isinstance(g, DTensor):
        return m
    return DTensor.from_local(m, g.device_mesh, [Partial("max")] * g.device_mesh.ndim, run_check=False).full_tensor()


def swap_parameters(mod: torch.nn.Module, table: dict) -> None:
    """In every module under ``mod``, replace each parameter whose id is in ``table`` by ``table[id]`` (in place:
    the modules' ``_parameters``, so attribute reads and a GraphModule's ``get_attr`` see the new one)."""
    for m in mod.modules():
        for k, v in list(m._parameters.items()):
            if v is not None and id(v) in table:
                m._parameters[k] = table[id(v)]


def swap_in_model_and_state(compiled, table: dict) -> None:
    """:func:`swap_parameters` in the compiled model and its state dict (``compiled._state``)."""
    swap_parameters(compiled.model, table)
    for k, v in list(compiled._state.items()):
        if id(v) in table:
            compiled._state[k] = table[id(v)]


def keep_trace_model(compiled) -> None:
    """Before the runtime swaps the model's parameters for DTensors (tensor parallelism, FSDP2): later captures
    trace a meta-device copy of the model kept now (its tensors' shapes and dtypes only), and are not compared with
    the eager model (:mod:`dipc.check`), which then holds shards, as those of a meta-device model are not; the
    pipeline's steps are what the tests compare with the unsplit model."""
    import copy

    model = compiled.model
    if getattr(compiled, "_trace_model", None) is None:
        memo = {}
        for t in list(model.parameters()) + list(model.buffers()):
            e = torch.empty_like(t, device="meta")
            memo[id(t)] = torch.nn.Parameter(e, requires_grad=t.requires_grad) \
                if isinstance(t, torch.nn.Parameter) else e
        compiled._trace_model = copy.deepcopy(model, memo)
    compiled.check = False


class ParametersMixin:
    """The runtime's parameter methods (:mod:`dipc.runtime.parameters`)."""

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

    def train(self, mode: bool = True) -> "ParametersMixin":
        """Set the model's mode, as ``nn.Module.train``: the chunks of later steps run the graphs captured in that
        mode (a model with dropout, :attr:`dipc.compiler.CompiledPipeline.mode_dependent`, is captured once per
        mode and shape on first use; others run the same graphs in both).  Whether a step runs backward follows
        the grad mode or the call (:meth:`eval_step`), not this.  Call it on every rank alike (a rank in the
        other mode traces another graph: the plan check raises on every rank).  Returns this runtime."""
        if not isinstance(mode, bool):
            raise ValueError(f"train(mode): mode must be a bool, got {mode!r}")
        self.compiled.model.train(mode)
        return self

    def eval(self) -> "ParametersMixin":
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
        from ..wire import wait_work

        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm >= 0:
            raise ValueError(f"max_norm must be a number >= 0, got {max_norm!r}")
        if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type > 0:
            raise ValueError(f"norm_type must be a number > 0 (or math.inf), got {norm_type!r}")
        p_ = float(norm_type)
        counted = [self._param_obj[pid].grad for pid in self.local_param_ids
                   if self._param_obj[pid].grad is not None and min(self._ranks_by_id[pid]) == self.rank]
        if p_ == math.inf:
            local = max((_abs_max(g) for g in counted), default=torch.zeros((), dtype=torch.float64))
            op = dist.ReduceOp.MAX
        else:  # a tensor-parallel gradient's norm is its whole tensor's (DTensor reduces over the group)
            local = sum((_whole(torch.linalg.vector_norm(g.detach().to(torch.float64), p_)) ** p_ for g in counted),
                        torch.zeros((), dtype=torch.float64))
            op = dist.ReduceOp.SUM
        total = local.reshape(1).to(self.device)
        wait_work(dist.all_reduce(total, op=op, group=self.group, async_op=True), self.timeout,
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

















    # -- step
