"""Gradient buckets of data parallelism x pipeline parallelism, all-reduced while the step's last backwards run
(DDP's bucketing, Li et al., VLDB 2020, as torch.nn.parallel.DistributedDataParallel does it).

A rank's parameters are cut into buckets of one dtype of about ``bucket_bytes`` in reverse model order (the order
in which a backward pass finishes them), the same on every replica of its data-parallel group.  During the step a
bucket's all-reduce starts as soon as the rank's last backward action reading any of its parameters has run - in
bucket order, so that every replica issues the same collectives in the same order whatever its own plan - and the
rest start when the plan is done.  Each replica's gradients are scaled by its share of the loss normaliser before
the sum (its labelled tokens over all replicas'), so the sum is the concatenated batch's gradient.  Nothing is
written into ``.grad`` until the step succeeded on every replica (:meth:`GradBuckets.copy_back`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..plan import Plan

__all__ = ["GradBuckets"]


class GradBuckets:
    """The gradient buckets of one training step on one rank.

    Args:
        params: this rank's parameters in model order (the same list on every replica of the group).
        bucket_bytes: bytes per bucket (a bucket closes once it holds at least this many).
        group: the data-parallel process group.
        scale: this replica's gradient weight (its share of the loss normaliser; 1 for a summed loss).
        timeout: seconds each all-reduce may take once the step waits for it.
    """

    def __init__(self, params: list[torch.Tensor], bucket_bytes: int, group, scale: float, timeout: float):
        self.group, self.scale, self.timeout = group, scale, timeout
        self.buckets: list[list[torch.Tensor]] = []
        size = 0  # bytes in the last bucket
        for p in reversed(params):
            if not self.buckets or self.buckets[-1][0].dtype != p.dtype or size >= bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self.ready = [-1] * len(self.buckets)  # index of the rank's action after which each bucket is final
        self.flats: list[torch.Tensor] = []
        self.works: list = []
        self.launched_at: list[int] = []  # the action index each bucket's all-reduce started after (-1: before)
        self.n_actions = 0

    def schedule(self, plan: Plan, rank: int, reads) -> None:
        """Set when each bucket is final: after the last "B" action of ``rank``'s plan whose chunk reads one of its
        parameters (``reads(action)``: the ids of the parameters the action's chunk reads)."""
        last: dict[int, int] = {}
        for i, a in enumerate(plan.ranks[rank]):
            if a.kind == "B":
                for pid in reads(a):
                    last[pid] = i
        self.ready = [max([last.get(id(p), -1) for p in b], default=-1) for b in self.buckets]
        self.n_actions = len(plan.ranks[rank])

    def after(self, i: int) -> None:
        """The rank's action ``i`` ran (-1: none yet): start the all-reduces of the next buckets that are final."""
        while len(self.works) < len(self.buckets) and self.ready[len(self.works)] <= i:
            self._launch(i)

    def launch_rest(self) -> None:
        """Start every all-reduce not started yet (the plan is done, or failed and drained: the other replicas
        still expect each one)."""
        while len(self.works) < len(self.buckets):
            self._launch(len(self.ready))

    def _launch(self, i: int) -> None:
        b = self.buckets[len(self.works)]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in b])
        if self.scale != 1.0:
            flat.mul_(self.scale)
        self.flats.append(flat)
        self.works.append(dist.all_reduce(flat, group=self.group, async_op=True))
        self.launched_at.append(i)

    def wait(self, what: str) -> None:
        """Wait for every all-reduce (raises :class:`dipc.wire.WireTimeout` after ``timeout``)."""
        from ..wire import _wait

        for k, wk in enumerate(self.works):
            _wait(wk, self.timeout, f"{what} (gradient bucket {k} of {len(self.works)})")

    def copy_back(self, live: set[int]) -> None:
        """After :meth:`wait`: the summed gradients become ``.grad`` of the parameters in ``live`` (ids: those
        some replica reached); the others keep ``None``, as in the unsplit model."""
        for b, flat in zip(self.buckets, self.flats):
            o = 0
            for p in b:
                n = p.numel()
                if id(p) in live:
                    g = flat[o:o + n].view_as(p)
                    if p.grad is None:
                        p.grad = g.clone()
                    else:
                        p.grad.copy_(g)
                else:
                    p.grad = None
                o += n

    def drain(self) -> None:
        """After a failure: wait for what was started, ignoring errors (the step's gradients are discarded)."""
        import datetime

        for wk in self.works:
            try:
                wk.wait(datetime.timedelta(seconds=self.timeout))
            except Exception:  # noqa: BLE001 - the first failure is what is reported
                pass
