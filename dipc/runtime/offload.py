"""Activation offload in the executor (issue "Memory strategies" §1; DIP §2.5 names checkpointing and offloading as the
per-layer strategies, shared/PAPER.md; in the spirit of Megatron-LM's fine-grained activation offloading and
PipeOffload): a forward at the "offload" strategy runs under :func:`torch.autograd.graph.saved_tensors_hooks` whose
pack hook copies every tensor autograd saves for the backward to host memory, except the chunk's weights and its
inputs (the executor keeps those until the backward anyway), and whose unpack hook hands the backward the copy
brought back.  The executor calls :meth:`HostActivations.prefetch` one compute action ahead of the backward, so the
copy back overlaps that action.

On CUDA the copies run on a side stream (device to host after the producing kernel, through pinned host buffers;
host to device on :meth:`~HostActivations.prefetch`), each ordered with CUDA events, so the forward and the
preceding action do not wait for the link.  On CPU, where host memory is device memory, the same hooks run as plain
copies into new storages, so the tests exercise the whole path (what the device keeps is then measured apart from
the host copies, :func:`dipc.runtime.selective.kept_bytes`).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["HostActivations", "run_offloaded"]


class HostActivations:
    """What one forward saves for its backward, held in host memory between them.

    ``keep``: tensors whose storages stay where they are (the chunk's parameters and buffers, its inputs).  Every
    other saved tensor's *storage* is copied to host memory once, and the tensor is rebuilt on the fetched storage
    with its own offset, size and strides: views keep their layout (a checkpoint's recompute sees the strides its
    forward saw), an expanded view costs its base only, and several views of one storage share one copy - what
    "keep" would hold on the device, byte for byte (a storage written after its copy is copied again).  :attr:`host_bytes` counts the copies' bytes;
    :attr:`host_storages` their storages (for measurement).
    """

    def __init__(self, keep: Iterable[torch.Tensor] = ()):
        self._keep = {_local(t).untyped_storage()._cdata for t in keep if isinstance(t, torch.Tensor) and
                      t.device.type != "meta"}
        self._entries: list[list[Any]] = []  # per storage: [host bytes | None, device bytes | None, device, event]
        # device storage -> (its weak ref, entry, the version of its data when copied)
        self._seen: dict[int, tuple[StorageWeakRef, int, int]] = {}
        self._stream = None
        self.host_bytes = 0
        self.host_storages: set[int] = set()

    # -- the hooks
    def _side_stream(self, device: torch.device):
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    def _pack(self, t: torch.Tensor):
        if _is_dtensor(t):  # tensor parallelism: this rank's shard goes to host memory, the DTensor is rebuilt on it
            return "dtensor", self._pack(t._local_tensor), t.device_mesh, tuple(t.placements), tuple(t.shape), \
                tuple(t.stride())
        if t.device.type == "meta" or t.layout != torch.strided or t.numel() == 0:
            return t
        s = t.untyped_storage()
        if s._cdata in self._keep:
            return t
        hit = self._seen.get(s._cdata)
        if hit is not None and not hit[0].expired() and hit[2] == t._version:
            i = hit[1]
        else:  # a new storage, or one written since its copy (views share their base's version counter)
            i = self._copy_out(t, s)
        return i, t.dtype, t.storage_offset(), tuple(t.shape), tuple(t.stride())

    def _copy_out(self, t: torch.Tensor, s) -> int:
        """A host copy of ``t``'s whole storage ``s``; returns its entry."""
        cuda = t.device.type == "cuda"
        with torch.no_grad():
            raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(s, 0, (s.nbytes(),), (1,))
            host = torch.empty(s.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=cuda)
            event = None
            if cuda:
                side = self._side_stream(t.device)
                side.wait_stream(torch.cuda.current_stream(t.device))
                with torch.cuda.stream(side):
                    host.copy_(raw, non_blocking=True)
                raw.record_stream(side)  # the allocator does not reuse the storage before the copy is done
                event = torch.cuda.Event()
                event.record(side)
            else:
                host.copy_(raw)
        self._entries.append([host, None, t.device, event])
        self.host_bytes += host.untyped_storage().nbytes()
        self.host_storages.add(host.untyped_storage()._cdata)
        self._seen[s._cdata] = (StorageWeakRef(s), len(self._entries) - 1, t._version)
        return len(self._entries) - 1

    def _unpack(self, x):
        if isinstance(x, torch.Tensor):
            return x
        if x[0] == "dtensor":
            from torch.distributed.tensor import DTensor

            _, inner, mesh, placements, shape, stride = x
            with torch.no_grad():
                return DTensor.from_local(self._unpack(inner), mesh, placements, run_check=False, shape=shape,
                                          stride=stride)
        i, dtype, offset, shape, stride = x
        e = self._entries[i]
        if e[1] is None:
            self._fetch(e)
        if e[3] is not None:  # the copy back ran on the side stream
            current = torch.cuda.current_stream(e[2])
            current.wait_event(e[3])
            e[1].record_stream(current)  # its memory is not reused before the backward's kernels are done
        with torch.no_grad():
            return torch.empty(0, dtype=dtype, device=e[2]).set_(e[1].untyped_storage(), offset, shape, stride)

    def _fetch(self, e) -> None:
        host, _, device, event = e
        if device.type == "cuda":
            side = self._side_stream(device)
            side.wait_stream(torch.cuda.current_stream(device))  # after what the compute stream did with memory
            with torch.cuda.stream(side):
                if event is not None:
                    side.wait_event(event)  # its copy out is done
                e[1] = host.to(device, non_blocking=True)
            e[3] = torch.cuda.Event()
            e[3].record(side)
        else:
            e[1] = host.clone()
        e[0] = None  # the host copy goes once the storage is back

    def saving(self):
        """The context a forward runs in so that what it saves comes here."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def prefetch(self) -> None:
        """Bring every saved storage back to its device (on CUDA asynchronously on the side stream; the backward's
        unpack waits for it)."""
        for e in self._entries:
            if e[1] is None:
                self._fetch(e)


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (whose storage is what the rank holds), else ``t``."""
    return t._local_tensor if _is_dtensor(t) else t


def run_offloaded(module: Callable[..., Any], kwargs: Mapping[str, Any]) -> tuple[Any, HostActivations]:
    """``module(**kwargs)`` with autograd on and what it saves for the backward in host memory
    (:class:`HostActivations`; the module's parameters and buffers, and ``kwargs``' tensors, stay).  Returns
    ``(outputs, the host activations)``: keep the latter until the backward has run."""
    keep = [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
    if isinstance(module, torch.nn.Module):
        keep += [*module.parameters(), *module.buffers()]
    acts = HostActivations(keep)
    with torch.enable_grad(), acts.saving():
        out = module(**kwargs)
    return out, acts
