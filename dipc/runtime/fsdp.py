"""Sharded data parallelism on the mesh's "dp" dim with FSDP2 (``torch.distributed.fsdp.fully_shard``), driven by
the pipeline's executor (issue 37 scope 3; the ZeRO-3 layout of Rajbhandari et al., SC 2020, as torch ships it).

Each chunk of this rank is one FSDP parameter group: its parameters (those no earlier chunk of the rank claimed:
a weight two of the rank's chunks read is in the first one's group) become ``Shard(0)`` DTensors over the
data-parallel group, so a replica keeps ``1/D`` of the parameters, of their gradients and of the optimizer's states.
dipc's chunk modules are ``torch.fx`` graphs that read parameters as attributes, not module calls, so FSDP's
forward hooks never fire; the runtime calls FSDP's own steps at fixed points of the step instead, as
``torch.distributed.pipelining`` does for its stages:

* after the step's first data-parallel header, every group is all-gathered (``FSDPModule.unshard``), in chunk
  order on every replica.  The chunks run on FSDP's unsharded parameters (one ``nn.Parameter`` per parameter,
  stable across steps: its storage is freed when resharded and refilled by the next all-gather);
* the step's backwards accumulate into the unsharded parameters' ``.grad`` over every microbatch;
* after the step's second header (no replica failed), each group's gradients are weighted by this replica's
  share of the loss normaliser (as the bucketed all-reduce weighs them, :mod:`dipc.runtime.data_parallel`) and
  reduce-scattered, summed (``FSDPParamGroup.post_backward``), into the sharded parameters' ``.grad``, which also
  reshards them.

Reshard after forward: off.  A pipeline runs many microbatches' forwards and backwards of one chunk interleaved;
resharding after each forward would all-gather a chunk's parameters again before each of its actions (torchtitan
turns it off under pipeline parallelism for the same reason).  So a rank holds its chunks' whole parameters (and
their gradients, during the backwards) for the length of a step, and ``1/D`` of them between steps; the optimizer's
states are always sharded.  Every collective of a step runs at a point all replicas reach whatever their plans
(the headers), so none waits on another replica's pipeline messages (on gloo FSDP's collectives block).
"""
from __future__ import annotations

import torch

from .parameters import swap_parameters

__all__ = ["FullyShardedParameters"]


class FullyShardedParameters:
    """One rank's FSDP2 groups (one per chunk of the rank) and the swaps that let its chunk modules read them.

    Args:
        mesh: the 1-D ``DeviceMesh`` of this rank's data-parallel group (:func:`dipc.runtime.mesh.sub_mesh`, whose
            collectives time out after the runtime's ``timeout``).
    """

    def __init__(self, mesh):
        self.mesh = mesh
        self.holders: list[torch.nn.Module] = []  # one per group, in chunk order (the collectives' order)
        self.unsharded: dict[int, torch.nn.Parameter] = {}  # id(original or sharded parameter) -> unsharded one
        self._pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []  # (sharded, unsharded)

    # -- set up
    def shard(self, compiled, rank: int) -> None:
        """Shard every parameter that a chunk of pipeline rank ``rank`` reads (``fully_shard`` per chunk, from
        this replica's copy: the runtime broadcast the first replica's before), then put the sharded parameters in
        the model and the compiled state (what the optimizer, checkpoints and ``state_dict`` see) and the
        unsharded ones in every chunk module built (:meth:`prepare` does it for modules built later).  Parameters
        no chunk reads stay whole (rank 0 keeps them; they get no gradient).  A collective over the data-parallel
        group: every replica calls it alike.

        Under tensor parallelism the parameters are already DTensors on the "tp" slice of the same 2-D mesh
        (:func:`dipc.runtime.mesh.dp_tp_meshes`): FSDP shards them further, and the unsharded parameters the
        chunks read are those DTensors again.
        """
        from torch.distributed.fsdp import fully_shard

        from .parameters import keep_trace_model, swap_in_model_and_state

        keep_trace_model(compiled)  # later captures trace a meta copy of the model, not its shards
        seen: set[int] = set()
        old_of: dict[int, torch.nn.Parameter] = {}  # id(sharded) -> original
        for c in compiled.partition.chunks:
            if c.rank != rank:
                continue
            params = []
            for n in compiled.chunk_params(c.index):
                p = compiled._state[n]
                if isinstance(p, torch.nn.Parameter) and id(p) not in seen and not p.is_meta:
                    seen.add(id(p))
                    params.append(p)
            if not params:
                continue
            holder = torch.nn.Module()
            for i, p in enumerate(params):
                box = torch.nn.Module()
                box.register_parameter("w", p)
                holder.add_module(f"p{i}", box)
            fully_shard(holder, mesh=self.mesh, reshard_after_forward=False)
            holder.set_gradient_divide_factor(1.0)  # a sum: each replica weighs its own share first
            holder.set_force_sum_reduction_for_comms(True)  # ReduceOp.SUM (gloo has no PREMUL_SUM)
            fully_shard.state(holder)._lazy_init()
            group = fully_shard.state(holder)._fsdp_param_group
            boxes = [getattr(holder, f"p{i}") for i in range(len(params))]
            shards = [box.w for box in boxes]
            fps = {id(fp._module_info.module): fp for fp in group.fsdp_params}
            holder.unshard()  # the unsharded parameters exist from the first all-gather on
            for p, box, sharded in zip(params, boxes, shards):
                fp = fps[id(box)]
                self.unsharded[id(p)] = self.unsharded[id(sharded)] = fp.unsharded_param
                old_of[id(sharded)] = p
                self._pairs.append((sharded, fp.unsharded_param))
            holder.reshard()
            self.holders.append(holder)
        new_of = {id(old_of[id(s)]): s for s, _ in self._pairs}

        swap_in_model_and_state(compiled, new_of)
        for prog in compiled.programs:
            for cm in prog.chunks.values():
                if cm.gm is not None:
                    self.prepare(cm.gm)

    def prepare(self, gm: torch.nn.Module) -> None:
        """Make ``gm`` (a chunk module, or one derived from it) read the unsharded parameters: those of its
        parameters that are an original or a sharded parameter are replaced in place.  Idempotent."""
        if gm.__dict__.get("_dipc_fsdp") is self:
            return
        swap_parameters(gm, self.unsharded)
        gm.__dict__["_dipc_fsdp"] = self

    # -- a step
    def unshard(self) -> None:
        """All-gather every group (in chunk order: a collective over the data-parallel group), with no gradient on
        the unsharded parameters."""
        for _, u in self._pairs:
            u.grad = None
        for h in self.holders:
            h.unshard()

    def unsharded_parameters(self) -> list[torch.nn.Parameter]:
        """The unsharded parameters the chunks read, in group order (tensor-parallel DTensors under TP)."""
        return [u for _, u in self._pairs]

    def reached(self, p: torch.nn.Parameter) -> bool:
        """Whether this replica's step gave sharded parameter ``p`` a gradient (on its unsharded parameter, or a
        zero one that :func:`dipc.runtime.executor.zero_unreached_grads` set)."""
        u = self.unsharded.get(id(p))
        return p.grad is not None or (u is not None and u.grad is not None)

    def weigh(self, scale: float) -> None:
        """Weight every unsharded gradient by ``scale`` (this replica's share of the loss normaliser); a parameter
        this replica did not reach gets zeros, so every replica reduces the same tensors.  Local: done before the
        step's second header, so that a failure here (out of memory) reaches every replica through it."""
        with torch.no_grad():
            for _, u in self._pairs:
                if u.grad is None:
                    u.grad = torch.zeros_like(u)
                elif scale != 1.0:
                    u.grad.mul_(scale)

    def reduce(self) -> None:
        """Reduce-scatter (sum) every group's weighted gradients (:meth:`weigh`) into the sharded parameters'
        ``.grad`` (added to a gradient already there), and reshard.  A collective over the data-parallel group."""
        from torch.distributed.fsdp import fully_shard

        for h in self.holders:
            state = fully_shard.state(h)
            state._fsdp_param_group.post_backward()
            state._root_post_backward_final_callback()

    def release(self) -> None:
        """Reshard every group and drop the unsharded gradients (after a failed step, or an evaluation)."""
        for _, u in self._pairs:
            u.grad = None
        for h in self.holders:
            h.reshard()
