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
    other saved tensor is copied to host memory once (a tensor autograd saves twice, the same view of the same
    storage, has one copy).  :attr:`host_bytes` counts the copies' bytes; :attr:`host_storages` their storages (for
    measurement).
    """

    def __init__(self, keep: Iterable[torch.Tensor] = ()):
        self._keep = {t.untyped_storage()._cdata for t in keep if isinstance(t, torch.Tensor) and
                      t.device.type != "meta"}
        self._entries: list[list[Any]] = []  # [host copy | None, device tensor | None, device, event | None]
        self._seen: dict[tuple, tuple[StorageWeakRef, int]] = {}
        self._stream = None
        self.host_bytes = 0
        self.host_storages: set[int] = set()

    # -- the hooks
    def _side_stream(self, device: torch.device):
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    def _pack(self, t: torch.Tensor):
        if t.device.type == "meta" or t.layout != torch.strided or t.numel() == 0:
            return t
        s = t.untyped_storage()
        if s._cdata in self._keep:
            return t
        key = (s._cdata, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        hit = self._seen.get(key)
        if hit is not None and not hit[0].expired():
            return hit[1]
        cuda = t.device.type == "cuda"
        host = torch.empty_like(t, device="cpu", pin_memory=cuda)
        event = None
        if cuda:
            side = self._side_stream(t.device)
            side.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(side):
                host.copy_(t, non_blocking=True)
            t.record_stream(side)  # the allocator does not reuse t's memory before the copy is done
            event = torch.cuda.Event()
            event.record(side)
        else:
            host.copy_(t)
        self._entries.append([host, None, t.device, event])
        self.host_bytes += host.untyped_storage().nbytes()
        self.host_storages.add(host.untyped_storage()._cdata)
        self._seen[key] = (StorageWeakRef(s), len(self._entries) - 1)
        return len(self._entries) - 1

    def _unpack(self, x):
        if isinstance(x, torch.Tensor):
            return x
        e = self._entries[x]
        if e[1] is None:
            self._fetch(e)
        if e[3] is not None:  # the copy back ran on the side stream
            torch.cuda.current_stream(e[2]).wait_event(e[3])
        return e[1]

    def _fetch(self, e) -> None:
        host, _, device, event = e
        if device.type == "cuda":
            side = self._side_stream(device)
            with torch.cuda.stream(side):
                if event is not None:
                    side.wait_event(event)  # its copy out is done
                e[1] = host.to(device, non_blocking=True)
            e[3] = torch.cuda.Event()
            e[3].record(side)
        else:
            e[1] = host.clone()
        e[0] = None  # the host copy goes once the tensor is back

    def saving(self):
        """The context a forward runs in so that what it saves comes here."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def prefetch(self) -> None:
        """Bring every saved tensor back to its device (on CUDA asynchronously on the side stream; the backward's
        unpack waits for it)."""
        for e in self._entries:
            if e[1] is None:
                self._fetch(e)


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
