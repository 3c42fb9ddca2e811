"""Transports the executor sends and receives through: torch.distributed point-to-point ops with a timeout on
every wait, and the in-memory one of :func:`dipc.runtime.run_local`.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ..plan import PlanError


# ---------------------------------------------------------------------------------------------------- transport
class _DistTransport:
    def __init__(self, group, timeout: float):
        self.group = group
        self.timeout = datetime.timedelta(seconds=timeout)

    def global_rank(self, r: int) -> int:
        return dist.get_global_rank(self.group, r) if self.group is not None else r

    def isend(self, t: torch.Tensor, peer: int, tag: int):
        return dist.isend(t, dst=self.global_rank(peer), group=self.group, tag=tag)

    def irecv(self, t: torch.Tensor, peer: int, tag: int):
        return dist.irecv(t, src=self.global_rank(peer), group=self.group, tag=tag)

    def wait(self, work, what: str = "a message"):
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            raise TransportError(f"rank {dist.get_rank(self.group)} waited up to {self.timeout.total_seconds():g} s "
                                 f"for {what}: {e}") from e


class TransportError(RuntimeError):
    """A point-to-point wait failed: its timeout passed or its connection broke (a peer died).  With gloo the pair
    is then closed for good: the process group cannot run further steps."""


def _completed(work) -> bool:
    """True when a send's work has finished (torch.distributed ``Work.is_completed``); its buffer may go."""
    try:
        return bool(work.is_completed())
    except (AttributeError, RuntimeError):
        return False


class _LocalWork:
    def __init__(self, fn):
        self.fn = fn

    def wait(self, *_):
        self.fn()

    def is_completed(self) -> bool:
        return False


class _LocalTransport:
    """In-memory mailbox for :func:`run_local` (all ranks in one process)."""

    def __init__(self):
        self.box: dict = {}

    def bind(self, rank: int):
        tr = self

        class _View:
            def isend(self, t, peer, tag):
                tr.box[(rank, peer, tag)] = t.detach().clone()
                return _LocalWork(lambda: None)

            def irecv(self, buf, peer, tag):
                def fill():
                    key = (peer, rank, tag)
                    if key not in tr.box:
                        raise PlanError(f"rank {rank} waits for a message (tag {tag}) rank {peer} never sent")
                    buf.copy_(tr.box.pop(key))
                return _LocalWork(fill)

            def wait(self, work, what=None):
                work.wait()
        return _View()
