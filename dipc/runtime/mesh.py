"""Reading a ``DeviceMesh`` for a pipeline (DESIGN.md "Mesh"): which dims are pipeline, data and tensor
parallelism, and the process groups a :class:`dipc.runtime.PipelineRuntime` runs on."""
from __future__ import annotations

from typing import Mapping

import torch.distributed as dist

__all__ = ["mesh_dims", "mesh_groups", "runtime_groups"]


def mesh_dims(mesh) -> dict[str, int | None]:
    """``{"pp": dim, "dp": dim or None, "tp": dim or None}`` of a device mesh given to
    :meth:`CompiledPipeline.runtime`, read by the dims' names (any subset of "pp", "dp", "tp" that includes "pp", in
    any order), or by position when the mesh has none (``[dp, pp]``, ``[pp]``).

    Raises:
        ValueError: an unnamed mesh of more than 2 dims, a named mesh without "pp", a repeated name or a dim named
            otherwise, naming the dims.
    """
    names = tuple(mesh.mesh_dim_names or ())
    if not names:
        if mesh.ndim not in (1, 2):
            raise ValueError(f"an unnamed mesh must be [pp] or [dp, pp], got {mesh.ndim} dims: name the dims "
                             "(init_device_mesh(..., mesh_dim_names=('dp', 'pp', 'tp')))")
        return {"pp": 0, "dp": None, "tp": None} if mesh.ndim == 1 else {"pp": 1, "dp": 0, "tp": None}
    if "pp" not in names or len(set(names)) != len(names) or any(n not in ("dp", "pp", "tp") for n in names):
        raise ValueError(f"the mesh's dims must be named from 'pp', 'dp' and 'tp' (each at most once, 'pp' among "
                         f"them), got {names}")
    return {k: (names.index(k) if k in names else None) for k in ("pp", "dp", "tp")}


def plan_group(mesh, dims: Mapping[str, int | None]):
    """The process group of this rank's pipeline and tensor-parallel ranks (one data-parallel index), ordered by
    (pp rank, tp rank): its first rank (pipeline rank 0, tensor-parallel rank 0) plans each step and every rank checks
    the plan's digests over it.  Every rank of the mesh creates every such group (``new_subgroups_by_enumeration``)."""
    t = mesh.mesh
    order = [d for d in (dims["dp"], dims["pp"], dims["tp"]) if d is not None]
    t = t.permute(*order)
    if dims["dp"] is None:
        t = t.unsqueeze(0)
    ranks = [[int(r) for r in row.reshape(-1).tolist()] for row in t]
    mine, _ = dist.new_subgroups_by_enumeration(ranks)
    return mine


def _timed_group(mesh, dims: Mapping[str, int | None], name: str, timeout: float):
    """This rank's process group along the dim ``name`` of ``mesh``, its collectives timing out after ``timeout``
    seconds, and its ranks.  Every rank of the mesh creates every such group, in the same order."""
    import datetime
    import math

    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        timeout = 300.0  # the runtime refuses it by name next
    t = mesh.mesh.movedim(dims[name], -1).reshape(-1, mesh.size(dims[name]))
    ranks = [[int(r) for r in row.tolist()] for row in t]
    mine, _ = dist.new_subgroups_by_enumeration(ranks, timeout=datetime.timedelta(seconds=timeout))
    me = dist.get_rank()
    return mine, next(r for r in ranks if me in r)


def sub_mesh(mesh, dims: Mapping[str, int | None], name: str, timeout: float):
    """This rank's 1-D mesh along the dim ``name`` ("tp" or "dp") of ``mesh``, on a process group of its own whose
    collectives time out after ``timeout`` seconds (the runtime's: a rank whose peer failed is not left in a DTensor
    or FSDP collective for the default group's 30 minutes).  Every rank of the mesh creates every such group."""
    from torch.distributed.device_mesh import DeviceMesh

    mine, row = _timed_group(mesh, dims, name, timeout)
    return DeviceMesh.from_group(mine, mesh.device_type, mesh=row, mesh_dim_names=(name,))


def dp_tp_meshes(mesh, dims: Mapping[str, int | None], timeout: float):
    """``(dp mesh, tp mesh)``: the two 1-D slices of this rank's 2-D ("dp", "tp") mesh (its pipeline rank's ranks),
    built on process groups whose collectives time out after ``timeout`` seconds.  FSDP2 shards a tensor-parallel
    DTensor only over a data-parallel mesh of the same root mesh (``DeviceMesh._concatenate``): hence one 2-D mesh
    rather than two 1-D ones."""
    from torch.distributed.device_mesh import DeviceMesh

    dp_pg, _ = _timed_group(mesh, dims, "dp", timeout)
    tp_pg, _ = _timed_group(mesh, dims, "tp", timeout)
    t = mesh.mesh.permute(dims["pp"], dims["dp"], dims["tp"])
    me = dist.get_rank()
    slab = next(s for s in t if me in s.reshape(-1).tolist())
    both = DeviceMesh.from_group([dp_pg, tp_pg], mesh.device_type, mesh=slab.tolist(), mesh_dim_names=("dp", "tp"))
    return both["dp"], both["tp"]


def mesh_groups(mesh, pp_size: int, tp_size: int, timeout: float = 300.0, fsdp: bool = False):
    """``(pipeline group, data-parallel group or None, tensor-parallel 1-D mesh or None, plan group or None,
    data-parallel 1-D mesh or None)`` of this rank in ``mesh`` (:func:`mesh_dims`; the tensor-parallel mesh:
    :func:`sub_mesh`, its collectives timing out after ``timeout`` seconds; the plan group: :func:`plan_group`;
    both with a "tp" dim only; the data-parallel mesh, for FSDP2, with ``fsdp`` and a "dp" dim only).

    Raises:
        ValueError: the mesh's dims are not named from "pp", "dp", "tp"; its "pp" size is not ``pp_size``; its "tp"
            size (1 without one) is not ``tp_size`` (the cost model would plan another configuration than runs).
    """
    dims = mesh_dims(mesh)
    if mesh.size(dims["pp"]) != pp_size:
        raise ValueError(f"the mesh's pp dim has {mesh.size(dims['pp'])} ranks but the pipeline was compiled for "
                         f"pp_size={pp_size}")
    tp = mesh.size(dims["tp"]) if dims["tp"] is not None else 1
    if tp != tp_size:
        raise ValueError(f"the mesh's tp dim has {tp} rank(s) but the pipeline was compiled with tp_size={tp_size}: "
                         f"compile with dipc.compile(..., tp_size={tp}) so that the cost model plans what runs")
    group = mesh.get_group(dims["pp"])
    dp_group = mesh.get_group(dims["dp"]) if dims["dp"] is not None else None
    if fsdp and dims["dp"] is not None and dims["tp"] is not None:
        dp_mesh, tp = dp_tp_meshes(mesh, dims, timeout)
        return group, dp_group, tp, plan_group(mesh, dims), dp_mesh
    dp_mesh = sub_mesh(mesh, dims, "dp", timeout) if fsdp and dims["dp"] is not None else None
    if dims["tp"] is None:
        return group, dp_group, None, None, dp_mesh
    return group, dp_group, sub_mesh(mesh, dims, "tp", timeout), plan_group(mesh, dims), dp_mesh


def runtime_groups(compiled, group, mesh, data_parallel: str | None, timeout: float) -> dict:
    """The process groups and meshes of :meth:`dipc.compiler.CompiledPipeline.runtime` (keyword arguments of
    :class:`dipc.runtime.PipelineRuntime`: ``group``, ``dp_group``, ``tp_mesh``, ``plan_group``, ``dp_mesh``) from
    its ``group`` or ``mesh`` and ``data_parallel`` (None: "fsdp" when compiled with ``fsdp_size`` > 1, else "ddp").

    Raises:
        ValueError: as :meth:`~dipc.compiler.CompiledPipeline.runtime` says, on every rank before any group is made.
    """
    if data_parallel is None:
        data_parallel = "fsdp" if compiled.fsdp_size > 1 else "ddp"
    if data_parallel not in ("ddp", "fsdp"):
        raise ValueError(f"data_parallel must be 'ddp' or 'fsdp', got {data_parallel!r}")
    if compiled.tp_size > 1 and getattr(compiled, "sequence_parallel", False):
        raise ValueError("the pipeline was compiled with sequence_parallel=True, which the cost model plans but the "
                         "runtime does not run yet: compile with sequence_parallel=False (the default) to train")
    if data_parallel == "ddp" and compiled.fsdp_size > 1:
        raise ValueError(f"the pipeline was compiled with fsdp_size={compiled.fsdp_size} (the memory model plans "
                         "sharded parameters): run it with data_parallel='fsdp', or compile with fsdp_size=1")
    out = {"group": group, "dp_group": None, "tp_mesh": None, "plan_group": None, "dp_mesh": None}
    if mesh is None:
        if compiled.fsdp_size > 1:
            raise ValueError(f"the pipeline was compiled with fsdp_size={compiled.fsdp_size}: give a mesh with a 'dp' "
                             f"dim of {compiled.fsdp_size} ranks (compiled.runtime(mesh=init_device_mesh(..., "
                             "mesh_dim_names=('dp', 'pp'))))")
        if compiled.tp_size != 1:
            raise ValueError(f"the pipeline was compiled with tp_size={compiled.tp_size}: give a mesh with a 'tp' dim "
                             f"of {compiled.tp_size} ranks (compiled.runtime(mesh=init_device_mesh(..., "
                             "mesh_dim_names=('pp', 'tp'))))")
        return out
    if group is not None:
        raise ValueError("give the pipeline's group or a mesh, not both")
    dims = mesh_dims(mesh)
    if dims["dp"] is not None:  # before any group is made: replicas that would make different ones hang
        _replicas_agree(mesh, dims, compiled, data_parallel, timeout)
    if data_parallel == "fsdp":
        dp = mesh.size(dims["dp"]) if dims["dp"] is not None else 1
        if dp != compiled.fsdp_size:
            raise ValueError(f"data_parallel='fsdp' on a mesh whose dp dim has {dp} rank(s), but the pipeline was "
                             f"compiled with fsdp_size={compiled.fsdp_size}: compile with dipc.compile(..., "
                             f"fsdp_size={dp}) so that the memory model plans what runs")
        if mesh.size() != dist.get_world_size():
            raise ValueError(f"data_parallel='fsdp' needs a mesh of every process (its checkpoints are written over "
                             f"the default group): the mesh has {mesh.size()} ranks, the default group "
                             f"{dist.get_world_size()}")
    keys = ("group", "dp_group", "tp_mesh", "plan_group", "dp_mesh")
    return dict(zip(keys, mesh_groups(mesh, compiled.pp_size, compiled.tp_size, timeout,
                                      fsdp=data_parallel == "fsdp")))


def _replicas_agree(mesh, dims, compiled, data_parallel: str, timeout: float) -> None:
    """Every data-parallel replica of this rank runs the same kind of data parallelism with the same compiled
    ``fsdp_size`` and ``tp_size`` (one all-reduce of their values and negatives, MAX, over the mesh's "dp" group,
    waited on at most ``timeout`` seconds): otherwise the replicas would create different process groups and wait
    on each other until the store times out.

    Raises:
        ValueError: the replicas differ, naming this replica's values (on every rank of the group)."""
    import math

    import torch

    from ..wire import wait_work

    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    mine = [float(data_parallel == "fsdp"), float(compiled.fsdp_size), float(compiled.tp_size)]
    t = torch.tensor(mine + [-x for x in mine], dtype=torch.float64, device=device)
    wait = timeout if isinstance(timeout, (int, float)) and 0 < timeout < math.inf else 300.0
    wait_work(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mesh.get_group(dims["dp"]), async_op=True), wait,
              "the data-parallel replicas' agreement on data_parallel, fsdp_size and tp_size")
    n = len(mine)
    if any(float(t[i]) != -float(t[n + i]) for i in range(n)):
        raise ValueError(f"the data-parallel replicas were built differently: this one runs data_parallel="
                         f"{data_parallel!r} with fsdp_size={compiled.fsdp_size} and tp_size={compiled.tp_size}, "
                         "another does not; every replica must compile the same model, example batch and options")
