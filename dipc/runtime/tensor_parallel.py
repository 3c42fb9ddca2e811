"""Tensor parallelism inside the pipeline's stages, on torch's DTensor (DESIGN.md "Mesh"; Megatron-LM's split, Shoeybi
et al. 2019 §3, chosen per parameter by :func:`dipc.passes.tensor_parallel.plan_tensor_parallel`).

Every rank of a tensor-parallel group runs the same stages of the same plan on the same batch.  Its parameters are
``DTensor``s on the group's 1-D "tp" mesh: column-parallel weights ``Shard(0)``, row-parallel weights ``Shard(1)``,
embedding tables and LM heads ``Shard(0)`` (vocabulary-parallel), the rest ``Replicate()``.  A chunk runs on DTensors
with the model's global shapes: its tensor inputs enter as ``Replicate()`` DTensors, DTensor's sharding propagation
runs each op on the shards and issues the all-reduces and all-gathers the placements need (the row-parallel linear's
partial sums are all-reduced where the residual stream reads them), and its outputs leave as whole local tensors: the
pipeline's messages carry what Megatron's do without sequence parallelism, the whole activation, to the rank of the
same tensor-parallel index in the next stage.

Two things DTensor does not do alone, done here on the chunk's graph once: an op with no sharding strategy
(``masked_scatter``, ``_is_all_true``), one whose backward has none (``avg_pool2d``) or one indexing by a boolean
mask (a data-dependent size) runs on whole tensors (its DTensor inputs gathered, its outputs replicated), and the
output of a vocabulary-parallel embedding is made whole right after the lookup (as Megatron all-reduces it there;
DTensor's masked partial value cannot be read twice).  On CPU, attention runs torch's math kernel (DTensor has no
strategy for the CPU flash kernel).  Parameter gradients are settled to their parameter's placement after the step's
backwards (:meth:`TensorParallel.settle`), so the optimizer, clipping and data parallelism see one layout.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Mapping

import torch

__all__ = ["TensorParallel", "local_tensor"]


def local_tensor(t):
    """This rank's shard of ``t`` when it is a DTensor, else ``t`` itself (the tensor collectives and point-to-point
    sums move)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _supported(op) -> bool:
    """Whether DTensor runs ``op`` on shards: a sharding strategy or rule is registered, or the op decomposes before
    DTensor sees it (a CompositeImplicitAutograd kernel)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(op, torch._ops.OpOverload):
        return True
    d = DTensor._op_dispatcher
    p = d.sharding_propagator
    if (op in p.op_strategy_funcs or op in p.op_to_rules or op in getattr(p, "op_single_dim_strategy_funcs", {})
            or op in d._custom_op_handlers):
        return True
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")


#: indexing ops whose result's shape depends on a boolean mask's values: DTensor's propagation cannot size them
_MASKED = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_", "aten::masked_select"}


#: composite ops whose backward is that of the op they decompose into
_DECOMPOSES_TO = {"aten::group_norm": "native_group_norm", "aten::layer_norm": "native_layer_norm",
                  "aten::batch_norm": "native_batch_norm", "aten::avg_pool1d": "avg_pool2d"}


def _runs_whole(n: torch.fx.Node) -> bool:
    """Whether graph node ``n`` (an ATen op) runs on whole tensors: DTensor has no strategy for it; it indexes by a
    boolean mask (a data-dependent size); or its backward op (``<name>_backward``, ``<name>_backward_data``) has
    none (run whole, the op's backward runs on local tensors too: e.g. ``avg_pool2d``)."""
    op = n.target
    if not _supported(op):
        return True
    name = op._schema.name
    if name in _MASKED:
        idx = n.args[1] if len(n.args) > 1 else ()
        vals = [getattr(i, "meta", {}).get("val") for i in (idx if isinstance(idx, (list, tuple)) else [idx])]
        if any(isinstance(v, torch.Tensor) and v.dtype == torch.bool for v in vals):
            return True
    base = _DECOMPOSES_TO.get(name, name.split("::")[-1])
    for suffix in ("_backward", "_backward_data"):
        packet = getattr(torch.ops.aten, base + suffix, None)
        if packet is not None:
            ops = [getattr(packet, o) for o in packet.overloads()]
            if ops and not any(_supported(o) for o in ops):
                return True
    return False


class _Whole:
    """An op DTensor has no strategy for, run on whole tensors: DTensor arguments are gathered
    (``full_tensor()``, differentiable), the op runs on local tensors, and its tensor results become ``Replicate()``
    DTensors again.  With no DTensor argument it is the op itself."""

    def __init__(self, op):
        self.op = op
        self.__name__ = f"whole_{op.__name__.replace('.', '_')}"
        self.__qualname__ = self.__name__
        self.__module__ = __name__

    def __call__(self, *args, **kwargs):
        from torch.distributed.tensor import DTensor, Replicate
        from torch.utils._pytree import tree_flatten, tree_map

        mesh = next((a.device_mesh for a in tree_flatten((args, kwargs))[0] if isinstance(a, DTensor)), None)
        if mesh is None:
            return self.op(*args, **kwargs)
        a, k = tree_map(lambda x: x.full_tensor() if isinstance(x, DTensor) else x, (args, kwargs))
        out = self.op(*a, **k)
        return tree_map(lambda x: DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)
                        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x, out)

    def __repr__(self) -> str:
        return self.__name__


def _whole(x):
    """A vocabulary-parallel embedding's output made whole (``Replicate()``; an all-reduce of the masked partial
    lookups)."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(x, DTensor):  # whole both ways: its gradient is made whole before it reaches the lookup's backward
        mesh = x.device_mesh   # (DTensor cannot turn a partial gradient into the lookup's masked partial)
        return DTensor.from_local(x.full_tensor(), mesh, [Replicate()] * mesh.ndim, run_check=False)
    return x


class TensorParallel:
    """One rank's tensor parallelism: its "tp" mesh, the split of every parameter, and the conversions around a
    chunk's call.

    Args:
        mesh: the 1-D ``DeviceMesh`` of this rank's tensor-parallel group.
        plan: the split (:meth:`dipc.compiler.CompiledPipeline.tensor_parallel_plan` with ``tp = mesh.size()``).
        device: this rank's device (on CPU attention runs the math kernel).
    """

    def __init__(self, mesh, plan, device: torch.device):
        self.mesh, self.plan, self.device = mesh, plan, device
        self.size = mesh.size()

    # -- parameters
    def placements(self, name: str, ndim: int):
        from torch.distributed.tensor import Replicate, Shard

        d = self.plan.shard_dim(name, ndim)
        return [Replicate()] if d is None else [Shard(d)]

    def shard(self, compiled) -> None:
        """Make every parameter of the model a DTensor with its placement (``distribute_tensor`` from the group's
        first rank, so the group starts from one copy), in the model, in the compiled state and in every chunk
        module built.  Later captures trace a meta-device copy of the model (its tensors' shapes and dtypes only)
        kept before the swap.  A collective over the tensor-parallel group: every rank calls it alike."""
        from torch.distributed.tensor import distribute_tensor

        from .parameters import keep_trace_model, swap_in_model_and_state, swap_parameters

        model = compiled.model
        keep_trace_model(compiled)
        new: dict[int, torch.nn.Parameter] = {}
        names = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), n)
        for n, p in model.named_parameters():  # model order, each parameter once: the same collectives on every rank
            if p.is_meta:  # another pipeline rank's parameter of a meta-device model
                continue
            d = distribute_tensor(p.detach(), self.mesh, self.placements(names[id(p)], p.ndim))
            new[id(p)] = torch.nn.Parameter(d, requires_grad=p.requires_grad)

        swap_in_model_and_state(compiled, new)
        for prog in compiled.programs:
            for cm in prog.chunks.values():
                if cm.gm is not None:
                    swap_parameters(cm.gm, new)

    def settle(self, params) -> None:
        """Each gradient in ``params`` gets its parameter's placement (DTensor's backward may leave a partial sum or
        another split: reduced here, a collective over the group in the parameters' order)."""
        for p in params:
            g = p.grad
            if g is not None and tuple(g.placements) != tuple(p.placements):
                p.grad = g.redistribute(p.device_mesh, p.placements)

    # -- a chunk's call
    def prepare(self, gm: torch.fx.GraphModule) -> None:
        """Rewrite ``gm``'s graph once (and its nested graphs): ops DTensor cannot split run whole (:class:`_Whole`);
        a vocabulary-parallel embedding's output is made whole right after it."""
        from ..codegen.stage import rewrite_graphs

        if gm.__dict__.get("_dipc_tp"):
            return

        def edit(m: torch.fx.GraphModule) -> bool:
            changed = False
            for n in list(m.graph.nodes):
                if n.op != "call_function":
                    continue
                if n.target == torch.ops.aten.embedding.default:
                    with m.graph.inserting_after(n):
                        w = m.graph.call_function(_whole, (n,))
                    n.replace_all_uses_with(w, delete_user_cb=lambda u: u is not w)
                    changed = True
                elif isinstance(n.target, torch._ops.OpOverload) and _runs_whole(n):
                    n.target = _whole_op(n.target)
                    changed = True
            return changed

        rewrite_graphs(gm, edit)
        gm.__dict__["_dipc_tp"] = True

    def inputs(self, kwargs: Mapping) -> dict:
        """A chunk's inputs as the group's DTensors: floating-point tensors become ``Replicate()`` (differentiable:
        their gradient comes back whole); integer tensors stay local (read as replicated)."""
        from torch.distributed.tensor import DTensor, Replicate

        return {k: DTensor.from_local(v, self.mesh, [Replicate()], run_check=False)
                if isinstance(v, torch.Tensor) and v.is_floating_point() and not isinstance(v, DTensor) else v
                for k, v in kwargs.items()}

    def outputs(self, out: Mapping) -> dict:
        """A chunk's outputs as whole local tensors (what the pipeline sends and the loss reads)."""
        from torch.distributed.tensor import DTensor, Replicate

        return {k: v.redistribute(self.mesh, [Replicate()]).to_local() if isinstance(v, DTensor) else v
                for k, v in out.items()}

    @contextlib.contextmanager
    def context(self):
        """Around a chunk's forward and the step's backwards: tensors the graph makes (RoPE tables, masks) are
        read as replicated; on CPU attention runs the math kernel."""
        prev = torch._C._get_dtensor_allow_implicit_replication()
        torch._C._set_dtensor_allow_implicit_replication(True)
        try:
            if self.device.type == "cpu":
                from torch.nn.attention import SDPBackend, sdpa_kernel

                with sdpa_kernel(SDPBackend.MATH):
                    yield
            else:
                yield
        finally:
            torch._C._set_dtensor_allow_implicit_replication(prev)


@functools.lru_cache(maxsize=None)
def _whole_op(op) -> _Whole:
    return _Whole(op)

