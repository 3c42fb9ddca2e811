"""Packed point-to-point messages: every tensor of a message in one byte buffer at 64-byte offsets, then an int64
status word (0: data; r + 1: an abort message, rank r failed first; issue "Faults").
"""
from __future__ import annotations

import torch


_ALIGN = 64  # bytes: every tensor of a packed message starts at a multiple of this


def _layout(specs) -> tuple[list[int], int]:
    """Byte offset of each tensor of a message in its packed buffer, and the buffer's size: the tensors, then an
    8-byte-aligned int64 status word (0: data; r + 1: the step failed, first on rank r, and this message carries
    no data, see :meth:`Executor.run`)."""
    offsets, off, end = [], 0, 0
    for spec in specs:
        offsets.append(off)
        end = off + spec.nbytes
        off += -(-spec.nbytes // _ALIGN) * _ALIGN
    return offsets, _status_offset(end) + 8


def _status_offset(end: int) -> int:
    return -(-end // 8) * 8


def _pack(tensors, specs, device, status: int = 0) -> torch.Tensor:
    """One uint8 buffer holding a message's tensors and its status word (one ``isend`` per message, whatever its
    tensor count).  ``tensors`` may be empty for an abort message (``status`` > 0)."""
    offsets, total = _layout(specs)
    buf = (torch.empty if tensors else torch.zeros)(total, dtype=torch.uint8, device=device)
    for t, off, spec in zip(tensors, offsets, specs):
        buf[off:off + spec.nbytes].view(t.dtype).view(t.shape).copy_(t)
    buf[total - 8:].view(torch.int64).fill_(status)
    return buf


def _status(buf: torch.Tensor) -> torch.Tensor:
    """The status word of a packed buffer (an int64 [1] view: reading it on CUDA waits for the device)."""
    return buf[buf.numel() - 8:].view(torch.int64)


def _unpack(buf: torch.Tensor, specs) -> dict[str, torch.Tensor]:
    """Views of a received packed buffer, by tensor name (the inverse of :func:`_pack`)."""
    offsets, _ = _layout(specs)
    return {spec.name: buf[off:off + spec.nbytes].view(getattr(torch, spec.dtype)).view(spec.shape)
            for off, spec in zip(offsets, specs)}
