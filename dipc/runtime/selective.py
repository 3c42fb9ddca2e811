"""Op-selective recompute in the executor (issue "Memory strategies" §1; Megatron-LM's ``--recompute-granularity
selective``; DIP §2.5's per-layer strategies, shared/PAPER.md): a forward at the "selective" strategy runs as one
non-reentrant activation checkpoint under torch's selective checkpointing policy
(:func:`torch.utils.checkpoint.create_selective_checkpoint_contexts`): the outputs of matmuls, attention and
convolutions (:data:`dipc.passes.symcost.SELECTIVE_SAVED_FAMILIES`, by op name) are kept, every other op (activation
functions and gates, norms, dropout, elementwise) runs again in the backward.  The RNG state of the forward is
restored for that rerun (the checkpoint's ``preserve_rng_state``), so dropout masks are the forward's.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..passes.symcost import SELECTIVE_SAVED_FAMILIES, op_name_family
from ..plan import offloads
from .offload import run_offloaded

__all__ = ["run_selective", "saves_output", "kept_bytes"]


@functools.lru_cache(maxsize=None)
def saves_output(op) -> bool:
    """Whether selective recompute keeps ``op``'s output (an ``OpOverload`` as the dispatcher sees it)."""
    packet = getattr(op, "overloadpacket", None)
    name = getattr(packet, "__name__", None) or getattr(op, "__name__", str(op))
    return op_name_family(name.split(".")[-1]) in SELECTIVE_SAVED_FAMILIES


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if saves_output(op) else CheckpointPolicy.PREFER_RECOMPUTE


def _contexts():
    return create_selective_checkpoint_contexts(_policy)


def run_selective(module: Callable[..., Any], kwargs: Mapping[str, Any]) -> Any:
    """``module(**kwargs)`` as one activation checkpoint under the selective policy (module docstring), with
    autograd on; its backward reruns the ops whose outputs were not kept."""
    with torch.enable_grad():
        return checkpoint(module, use_reentrant=False, context_fn=_contexts, **kwargs)


def kept_bytes(module: Callable[..., Any], kwargs: Mapping[str, Any], strategy: str = "keep",
               forward: Callable[..., Any] | None = None) -> tuple[int, Any, int]:
    """Bytes a forward of ``module(**kwargs)`` really keeps for its backward under ``strategy`` ("keep",
    "selective" or "offload"), measured: every storage its ops allocate, and its inputs (copies, each requiring a gradient where
    the given one does, as the executor's received values do), is followed with torch's weak storage references;
    after the forward, with the inputs dropped, the storages still alive other than the outputs' are what
    autograd and the checkpoint hold (saved tensors, the selective policy's cache, the inputs they keep).
    Parameters and buffers are not counted.  ``forward``: what runs the forward instead (``forward(**inputs)``,
    e.g. the chunk with its first layers under activation checkpoints for a "recompute:k/g" strategy), with
    ``module``'s weights still not counted, nor their copies ``torch.autocast`` caches (step state:
    :meth:`dipc.costing.CostingMixin.autocast_copy_bytes`).  Under an offloading strategy
    (:func:`dipc.plan.offloads`) the host copies (:class:`dipc.runtime.offload.HostActivations`) are not the
    device's: they are counted apart.  Returns
    ``(bytes kept on the device, outputs, bytes kept in host memory)``.

    Raises:
        ValueError: ``strategy`` is none of "keep", "selective" and "offload", and no ``forward`` is given."""
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    if forward is None and strategy not in ("keep", "selective", "offload") and not offloads(strategy):
        raise ValueError(f"kept_bytes runs 'keep', 'selective' and 'offload' itself, got {strategy!r} without a "
                         "forward")
    refs: dict[int, tuple[Any, int]] = {}
    weights = {t.untyped_storage()._cdata for t in (*module.parameters(), *module.buffers())} \
        if isinstance(module, torch.nn.Module) else set()
    casts: set[int] = set()  # torch.autocast's copies of the weights: its cache holds them for the step, as state

    def follow(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            refs[s._cdata] = (StorageWeakRef(s), s.nbytes())

    class _Allocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kw=None):
            out = func(*args, **(kw or {}))
            cast = func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor) and \
                args[0].untyped_storage()._cdata in weights
            for t in tree_leaves(out):
                follow(t)
                if cast and isinstance(t, torch.Tensor):
                    casts.add(t.untyped_storage()._cdata)
            return out

    inputs = {k: (v.detach().clone().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v)
              for k, v in kwargs.items()}
    for v in inputs.values():
        follow(v)
    host = None
    with _Allocations():
        if offloads(strategy):
            out, host = run_offloaded(forward or module, inputs)
        elif forward is not None:
            out = forward(**inputs)
        else:
            out = run_selective(module, inputs) if strategy == "selective" else module(**inputs)
    del inputs
    gc.collect()
    skip = {t.untyped_storage()._cdata for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
    skip |= weights | casts  # weights (and their transposed views, and autocast's copies) are not activations
    on_host = host.host_storages if host is not None else set()
    alive = {cdata: n for cdata, (ref, n) in refs.items() if cdata not in skip and not ref.expired()}
    return sum(n for cdata, n in alive.items() if cdata not in on_host), out, host.host_bytes if host else 0
