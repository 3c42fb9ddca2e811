"""What dipc sends between ranks besides activations: JSON text and raw tensor bytes, never pickle.

``torch.distributed.broadcast_object_list`` / ``all_gather_object`` unpickle whatever a peer sends, so a process
that can reach the rendezvous store could make every rank run code.  dipc's plans, step headers, traces and gathered
state travel instead as UTF-8 JSON in a ``uint8`` tensor (its length first, in an ``int64 [1]`` tensor) or as the
bytes of tensors whose names, dtypes and shapes every rank already knows (DESIGN.md "Runtime"; issue "Faults",
point 4).  Every wait has the caller's timeout, and a timed-out wait raises :class:`WireTimeout` naming what it
waited for.
"""
from __future__ import annotations

import datetime
import json
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["WireTimeout", "broadcast_json", "all_gather_json", "encode_json", "decode_json", "sum_over_ranks", "wait_work"]


#: the shortest timeout a distributed wait of dipc takes (a runtime's ``timeout``, ``dipc.launch.spawn``'s), seconds:
#: a shorter one times out on a healthy pipeline, and a timed-out wait leaves the process group unusable
MIN_TIMEOUT = 1.0


class WireTimeout(RuntimeError):
    """A collective of :mod:`dipc.wire` did not complete within its timeout (the message names what it waited
    for, from which rank, and the timeout in seconds)."""


def encode_json(obj: Any) -> bytes:
    """``obj`` as compact UTF-8 JSON (``TypeError`` for what JSON cannot hold)."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=True).encode("utf-8")


def decode_json(data: bytes) -> Any:
    """The inverse of :func:`encode_json`."""
    return json.loads(data.decode("utf-8"))


def wait_work(work, timeout: float, what: str) -> None:
    """Wait for a ``torch.distributed`` work handle at most ``timeout`` seconds.

    Raises:
        WireTimeout: the wait timed out or the collective failed (``what`` names what was awaited).
    """
    try:
        work.wait(datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        raise WireTimeout(f"timed out or failed after at most {timeout:g} s waiting for {what}: {e}") from e


def _global(group, r: int) -> int:
    return dist.get_global_rank(group, r) if group is not None else r


def broadcast_json(obj: Any, src: int, group=None, device: torch.device | None = None, timeout: float = 300.0,
                   what: str = "a message") -> Any:
    """Broadcast a JSON-able ``obj`` from ``src`` (a rank of ``group``) to every rank of ``group``; returns it on
    every rank (``obj`` is ignored on the others).  ``device``: where the byte tensors live (CUDA for NCCL).

    Raises:
        WireTimeout: the length or the bytes did not arrive within ``timeout`` seconds.
    """
    device = device or torch.device("cpu")
    me = dist.get_rank(group)
    data = encode_json(obj) if me == src else b""
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    wait_work(dist.broadcast(n, src=_global(group, src), group=group, async_op=True), timeout,
          f"the length of {what} from rank {src}")
    size = int(n.item())
    if me == src:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if size else \
            torch.empty(0, dtype=torch.uint8, device=device)
    else:
        buf = torch.empty(size, dtype=torch.uint8, device=device)
    if size:
        wait_work(dist.broadcast(buf, src=_global(group, src), group=group, async_op=True), timeout,
              f"{what} ({size} bytes) from rank {src}")
    return obj if me == src else decode_json(bytes(buf.cpu().numpy().tobytes()))


def all_gather_json(obj: Any, group=None, device: torch.device | None = None, timeout: float = 300.0,
                    what: str = "a message") -> list:
    """Every rank's JSON-able ``obj``, in rank order, on every rank of ``group``.

    Raises:
        WireTimeout: a length or the bytes did not arrive within ``timeout`` seconds.
    """
    device = device or torch.device("cpu")
    world = dist.get_world_size(group)
    data = encode_json(obj)
    mine = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    wait_work(dist.all_gather(sizes, mine, group=group, async_op=True), timeout, f"the lengths of every rank's {what}")
    lens = [int(s.item()) for s in sizes]
    top = max(lens)
    buf = torch.zeros(top, dtype=torch.uint8, device=device)
    if data:
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    parts = [torch.empty(top, dtype=torch.uint8, device=device) for _ in range(world)]
    if top:
        wait_work(dist.all_gather(parts, buf, group=group, async_op=True), timeout, f"every rank's {what}")
    return [decode_json(bytes(p[:n].cpu().numpy().tobytes())) for p, n in zip(parts, lens)]


#: the point-to-point tag of :func:`sum_over_ranks` (the executor's activation messages use their own tags)
SUM_TAG = 0x7E5


def sum_over_ranks(tensor: torch.Tensor, ranks, group=None, timeout: float = 300.0, what: str = "a sum") -> None:
    """Sum ``tensor`` in place over ``ranks`` (sorted ranks of ``group``, this rank among them) by point-to-point
    messages: every rank sends its tensor to every other and adds all of them in rank order, so every rank ends
    with the same bits.  For two ranks (a weight tied across the first and last stage) each link carries the tensor
    once in each direction, as a ring all-reduce's would; k ranks send it k - 1 times.

    It needs no process group of its own.  ``torch.distributed.new_group(..., use_local_synchronization=True)``
    names a group by how many groups each member already joined, so two such groups over different rank sets
    (weights tied across ranks (0, 3) and (0, 1, 2)) get different names on different ranks and never form.  Call
    it for several rank sets in the same order on every rank (e.g. the model's parameter order): no cycle of waits
    can form.

    Raises:
        WireTimeout: a message did not arrive within ``timeout`` seconds (names ``what`` and the peer).
    """
    ranks = list(ranks)
    me = dist.get_rank(group)
    peers = [r for r in ranks if r != me]
    got = {r: torch.empty_like(tensor) for r in peers}
    recvs = [(r, dist.irecv(got[r], src=_global(group, r), group=group, tag=SUM_TAG)) for r in peers]
    sends = [(r, dist.isend(tensor, dst=_global(group, r), group=group, tag=SUM_TAG)) for r in peers]
    for r, w in recvs:
        wait_work(w, timeout, f"{what} from rank {r}")
    for r, w in sends:
        wait_work(w, timeout, f"{what} to rank {r}")
    total = tensor if ranks[0] == me else got[ranks[0]]  # (g0 + g1) + g2 ... on every rank: the same bits
    for r in ranks[1:]:
        total.add_(tensor if r == me else got[r])
    if total is not tensor:
        tensor.copy_(total)
