"""Default schedule: DIP's greedy dual-queue stage interleaver.

:func:`list_schedule` follows shared/PAPER.md §2.4 (searcher phase 2), without the MCTS priorities (phase 1; every
stage's priority here favours earlier microbatches) and without the memory ILP (phase 3):

* per rank: ``t_last`` (end of its last stage), a forward queue and a backward queue of ready stages;
* repeatedly pick the rank whose queued stages can start earliest; if both a forward and a backward are ready by
  ``t_last``, alternate with the kind of the rank's last stage (Megatron-style 1F1B); otherwise take the stage that
  can start earliest; schedule it at ``max(t_last, t_start)`` and release its successors, adding the transfer time
  of edges that cross ranks;
* among stages ready by ``t_last`` the highest priority runs (the oldest microbatch by default); the paper's step 4
  takes the smallest ``t_start``, which made every encoder forward of a batch run before the backbone;
* memory limit per rank (bytes of activations kept from forwards to backwards, DESIGN.md "Memory"): a forward of
  microbatch ``m`` is admitted only if the rank stays under its limit while keeping room for the forwards every
  older unfinished microbatch still has to run there (at their recomputed size when ``recompute_cost`` is given),
  so microbatches can always complete in order and their backwards free memory (no deadlock however early encoder
  forwards are ready); a rank's oldest queued forward that does not fit switches to the "recompute" strategy if
  that fits, and when nothing is admissible anywhere the oldest microbatch's next forward does, else
  :class:`dipc.plan.PlanError` names the rank, the bytes needed and the activation budget;
* ``window``: at most that many microbatches in flight per rank (1F1B's bound; DIP's planner tries several).

Fixed orders (the schedule templates) are timed and fitted to memory in :mod:`dipc.planner.fitting`; a schedule
becomes a plan in :mod:`dipc.planner.lowering`.
"""
from __future__ import annotations

import dataclasses
import heapq
from collections import defaultdict
from typing import TYPE_CHECKING, Callable, Sequence

from ..plan import backward_key
from ..stages import Edge, Schedule, Stage, StageGraph

if TYPE_CHECKING:
    import numpy as np

__all__ = ["list_schedule", "recompute_option", "switch_to_recompute", "graph_arrays", "GraphArrays"]


def recompute_option(recompute_cost: Callable[[Stage], tuple], st: Stage) -> tuple[float, float, str, float | None]:
    """``(kept bytes, extra backward seconds, strategy, rebuilt bytes)`` of the least-memory recompute a
    ``recompute_cost`` callback offers for forward ``st``: the callback returns ``(kept, extra)`` (the whole chunk,
    "recompute") or ``(kept, extra, strategy, rebuilt bytes)`` (e.g. "recompute:k", rebuilt one block at a
    time).  A forward already at that strategy, or whose strategy was asked for (``forced``), is offered as it
    is."""
    if st.forced:  # asked for (set_recompute): the planner leaves it as it is
        return st.activation_bytes, st.recompute_extra, st.strategy, st.rebuild_bytes
    c = recompute_cost(st)
    c = (c[0], c[1], "recompute", None) if len(c) == 2 else tuple(c)
    if c[2] == st.strategy:  # already there
        return st.activation_bytes, st.recompute_extra, st.strategy, st.rebuild_bytes
    return c


def list_schedule(graph: StageGraph, n_ranks: int, *, comm_time: Callable[[Edge], float] | None = None,
                  memory_limit: float | Sequence[float | None] | None = None,
                  recompute_cost: Callable[[Stage], tuple] | None = None,
                  window: int | None = None) -> Schedule:
    """Greedy dual-queue list scheduling of every stage (see the module docstring).

    Args:
        graph: the step's stages and dependencies (must be acyclic).
        n_ranks: P.
        comm_time: seconds an edge between ranks adds to its consumer's earliest start (default 0).
        memory_limit: bytes of forward activations a rank may keep live (one number, or one per rank; ``None``:
            no limit).
        recompute_cost: forward stage -> (bytes it keeps under "recompute", seconds its backward grows by), or
            ``(kept, extra, strategy, rebuilt bytes)`` for another strategy (:func:`recompute_option`): lets
            the scheduler switch a stage to recompute when nothing else fits.  The stage and its backward are
            updated in ``graph``.
        window: at most this many microbatches in flight per rank: a forward of microbatch ``m`` waits until every
            microbatch before ``m - window + 1`` has finished on its rank (``None``: no window).  1F1B's in-flight
            bound; DIP's planner tries several (:func:`dipc.planner.make_plan`).

    Returns:
        a :class:`Schedule`.

    Raises:
        ValueError: the graph has a cycle (some stage never becomes ready).
        dipc.plan.PlanError: a rank cannot hold the oldest microbatch's next forward under its limit, even
            recomputed (names the rank, the bytes needed and the limit).
    """
    from ..plan import PlanError

    comm_time = comm_time or _no_comm
    limits = list(memory_limit) if isinstance(memory_limit, (list, tuple)) else [memory_limit] * n_ranks
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be an int >= 1 or None, got {window!r}")
    if all(x is None for x in limits) and not _GENERAL:
        return _list_schedule_unlimited(graph, n_ranks, comm_time, window)
    preds, succs = graph.preds(), graph.succs()
    stages = graph.stages
    remaining = {k: len(preds[k]) for k in graph.stages}
    t_start = {k: 0.0 for k in graph.stages}
    t_last = [0.0] * n_ranks
    last_kind = ["B"] * n_ranks
    live = [0.0] * n_ranks
    queues = [{"F": [], "B": []} for _ in range(n_ranks)]
    order: list[list[str]] = [[] for _ in range(n_ranks)]
    start, end = {}, {}
    # forward bytes each microbatch still has to keep on each rank (at least: recomputed where that is cheaper),
    # and the microbatches not yet finished
    need: list[dict[int, float]] = [defaultdict(float) for _ in range(n_ranks)]
    open_stages: dict[int, int] = defaultdict(int)
    least_of: dict[str, float] = {}
    for st in graph.stages.values():
        open_stages[st.mb] += 1
        if st.kind == "F":
            least = st.activation_bytes
            if recompute_cost is not None and limits[st.rank] is not None:
                least = min(least, recompute_option(recompute_cost, st)[0])
            least_of[st.key] = least
            need[st.rank][st.mb] += least

    # each rank's queued forwards also by microbatch: an admission scan walks the microbatches oldest first and
    # stops at the first whose older microbatches' reserve alone is over the limit (reserves grow with the
    # microbatch while every need is >= 0), not at the end of a queue that holds every microbatch's encoder forwards
    by_mb: list[dict[int, list]] = [{} for _ in range(n_ranks)]
    negative = [any(v < 0 for v in need[r].values()) for r in range(n_ranks)]  # a need below 0 (rounding, or a
    # negative size): reserves may then shrink with the microbatch, so the scans go through every microbatch

    def push(k):
        s = graph.stages[k]
        e = (-s.priority, s.mb, s.sub, s.chunk, k)
        heapq.heappush(queues[s.rank][s.kind], e)
        if s.kind == "F":
            by_mb[s.rank].setdefault(s.mb, []).append(e)

    reserves: dict[tuple[int, int], float] = {}  # (rank, mb) -> bytes older microbatches still need there

    def reserve_of(r: int, mb: int) -> float:
        v = reserves.get((r, mb))
        if v is None:
            v = reserves[(r, mb)] = sum(need[r][m] for m in open_stages if m < mb)
        return v

    left_on = [defaultdict(int) for _ in range(n_ranks)]  # (rank) -> mb -> stages not yet scheduled there
    for st in graph.stages.values():
        left_on[st.rank][st.mb] += 1
    first_open = [min(d, default=0) for d in left_on]

    def admissible(r: int, e) -> bool:
        st = graph.stages[e[-1]]
        if st.kind == "F" and window is not None and st.mb >= first_open[r] + window:
            return False
        if st.kind == "B" or limits[r] is None:
            return True
        # what older microbatches still have to keep here stays free, so they complete in order
        return live[r] + st.activation_bytes + reserve_of(r, st.mb) <= limits[r]

    def recompute_to_fit(r: int) -> bool:
        """Rank r has nothing it may run: rather than wait for a backward to free memory, recompute its oldest
        queued forward that then fits."""
        lim, lv = limits[r], live[r]
        for m in sorted(by_mb[r]):
            res = reserve_of(r, m)
            if lv + res > lim and not negative[r]:  # then no forward of this or a younger microbatch fits
                break
            for e in sorted(by_mb[r][m]):
                st = graph.stages[e[-1]]
                kept, extra, how, rebuild = recompute_option(recompute_cost, st)
                if kept < st.activation_bytes and lv + kept + res <= lim:
                    switch_to_recompute(graph, st, kept, extra, how, rebuild)
                    return True
        return False

    for k, n in remaining.items():
        if n == 0:
            push(k)
    done = 0
    # a rank's earliest admissible start changes only when its queue, live bytes, reserves or window change: it is
    # recomputed for those ranks only ("dirty"), which keeps a step linear in the ranks touched, not in P
    earliest: list[float | None] = [None] * n_ranks
    adm_of: list[dict] = [{"F": [], "B": []} for _ in range(n_ranks)]  # each rank's admissible queued stages
    dirty = set(range(n_ranks))
    while done < len(graph.stages):
        best = None
        for r in sorted(dirty):
            again = False
            if recompute_cost is not None and limits[r] is not None and queues[r]["F"]:
                # the oldest queued forward does not fit: recompute it rather than run younger work past it (the
                # reserve already counted it at its recomputed bytes)
                oldest = min(by_mb[r][min(by_mb[r])])
                if not admissible(r, oldest):
                    again = recompute_to_fit(r)  # it changed a stage: look at this rank again next time
            if limits[r] is None:  # only the window holds forwards back (a queued entry's [1] is its microbatch)
                q = queues[r]["F"]
                adm = adm_of[r] = {"F": q if window is None else [e for e in q if e[1] < first_open[r] + window],
                                   "B": queues[r]["B"]}
            else:  # admissible() inlined (a third of a VLM-L / 64-microbatch admission schedule): backwards always
                lim, lv, a_f = limits[r], live[r], []
                thr = first_open[r] + window if window is not None else None
                for m in sorted(by_mb[r]):
                    if thr is not None and m >= thr:
                        break
                    res = reserve_of(r, m)
                    if lv + res > lim and not negative[r]:  # nor can any younger microbatch's forward
                        break
                    for e in by_mb[r][m]:
                        if lv + stages[e[-1]].activation_bytes + res <= lim:
                            a_f.append(e)
                adm = adm_of[r] = {"F": a_f, "B": list(queues[r]["B"])}
            earliest[r] = min((t_start[e[-1]] for kd in ("F", "B") for e in adm[kd]), default=None)
            if not again:
                dirty.discard(r)
        for r in range(n_ranks):
            tm = earliest[r]
            if tm is not None and (best is None or tm < best[0]):
                best = (tm, r)
        if best is None:
            if not any(queues[r][kd] for r in range(n_ranks) for kd in ("F", "B")):
                raise ValueError("the stage graph has a cycle: "
                                 f"{[k for k, n in remaining.items() if n > 0][:5]} never become ready")
            _make_room(graph, queues, limits, live, need, min(open_stages), recompute_cost, PlanError)
            reserves.clear()
            dirty = set(range(n_ranks))
            continue
        _, r = best
        ok = adm_of[r]  # what rank r may run: unchanged since it was last looked at (else it would be dirty)
        ready = {kd: [e for e in ok[kd] if t_start[e[-1]] <= t_last[r]] for kd in ("F", "B")}
        if ready["F"] and ready["B"]:
            kd = "B" if last_kind[r] == "F" else "F"
            pick = min(ready[kd])
        elif ready["F"] or ready["B"]:  # every ready stage starts at t_last (no bubble): the highest priority
            pick = min(ready["F"] or ready["B"])
        else:
            pick = min((e for kd in ("F", "B") for e in ok[kd]), key=lambda e: (t_start[e[-1]], e))
        k = pick[-1]
        s = graph.stages[k]
        queues[r][s.kind].remove(pick)
        heapq.heapify(queues[r][s.kind])
        dirty.add(r)
        if s.kind == "F":
            bucket = by_mb[r][s.mb]
            bucket.remove(pick)
            if not bucket:
                del by_mb[r][s.mb]
            need[r][s.mb] -= least_of[k]
            if need[r][s.mb] < 0:
                negative[r] = True
            for key in [key for key in reserves if key[0] == r]:
                del reserves[key]
        open_stages[s.mb] -= 1
        if not open_stages[s.mb]:
            del open_stages[s.mb]
            reserves.clear()  # every rank's reserves count open microbatches only
            dirty = set(range(n_ranks))
        left_on[r][s.mb] -= 1
        if not left_on[r][s.mb]:
            del left_on[r][s.mb]
            if s.mb == first_open[r]:
                first_open[r] = min(left_on[r], default=first_open[r] + 1)
        st = max(t_last[r], t_start[k])
        start[k], end[k] = st, st + s.latency
        t_last[r] = end[k]
        last_kind[r] = s.kind
        live[r] += s.activation_bytes if s.kind == "F" else -s.activation_bytes
        order[r].append(k)
        done += 1
        for e in succs[k]:
            d = graph.stages[e.dst]
            delay = comm_time(e) if d.rank != s.rank else 0.0
            t_start[e.dst] = max(t_start[e.dst], end[k] + delay)
            remaining[e.dst] -= 1
            if remaining[e.dst] == 0:
                push(e.dst)
                dirty.add(d.rank)
    return Schedule(order=order, start=start, end=end)


_GENERAL = False  # tests set it to run the general loop without a limit, against _list_schedule_unlimited

_ARRAYS: dict[int, tuple] = {}  # id(edges) -> (edges, len(edges), stage keys, ranks, {id(comm_time): GraphArrays})


def _no_comm(e: Edge) -> float:
    return 0.0


@dataclasses.dataclass
class GraphArrays:
    """A stage graph numbered for the planner's kernels (:mod:`dipc.planner.kernels`): stage ``i`` is the
    ``i``-th of ``graph.stages``.

    Attributes:
        keys, at: the stage keys, and key -> index.
        rank, mb, is_b: each stage's rank, microbatch and kind (int64, int64, bool arrays ``[n]``).
        tie: each stage's position among all in ``(mb, sub, chunk, key)`` order, the list scheduler's tie-break
            after the priority; ``by_tie``: the stage at each position.
        succ_ptr, succ_idx, succ_delay: each stage's successors in CSR form, with the seconds from its end to
            their earliest start (``comm_time`` of an edge between ranks, else 0); ``pred_*`` the same for its
            predecessors; ``n_pred`` their counts.
    """

    keys: list
    at: dict
    rank: "np.ndarray"
    mb: "np.ndarray"
    is_b: "np.ndarray"
    tie: "np.ndarray"
    by_tie: "np.ndarray"
    succ_ptr: "np.ndarray"
    succ_idx: "np.ndarray"
    succ_delay: "np.ndarray"
    pred_ptr: "np.ndarray"
    pred_idx: "np.ndarray"
    pred_delay: "np.ndarray"
    n_pred: "np.ndarray"

    def priority_keys(self, priority) -> "np.ndarray":
        """Per stage, its priority tuple ``(-priority, mb, sub, chunk, key)`` as one int64 that orders alike
        (``priority``: per stage, larger first); ``key % n`` is the stage's :attr:`tie`."""
        import numpy as np

        _, rank_of = np.unique(-np.asarray(priority, np.float64), return_inverse=True)
        return rank_of.astype(np.int64).reshape(-1) * len(self.keys) + self.tie


def graph_arrays(graph: StageGraph, comm_time=None) -> GraphArrays:
    """``graph`` numbered in its order (:class:`GraphArrays`), built once per edge list, stage layout and
    ``comm_time`` (a search's copies of a step's graph share all three; building it is ~10 ms at VLM-L / 64
    microbatches)."""
    import numpy as np

    comm_time = comm_time or _no_comm
    keys = list(graph.stages)
    ranks = [st.rank for st in graph.stages.values()]
    hit = _ARRAYS.get(id(graph.edges))
    if not (hit is not None and hit[0] is graph.edges and hit[1] == len(graph.edges) and hit[2] == keys
            and hit[3] == ranks):
        if len(_ARRAYS) >= 16:
            _ARRAYS.pop(next(iter(_ARRAYS)))
        hit = _ARRAYS[id(graph.edges)] = (graph.edges, len(graph.edges), keys, ranks, {})
    by_comm = hit[4]
    got = by_comm.get(id(comm_time))
    if got is not None and got[0] is comm_time:  # the entry holds comm_time itself: its id is not reused
        return got[1]
    n = len(keys)
    at = {k: i for i, k in enumerate(keys)}
    stages = list(graph.stages.values())
    src = np.fromiter((at[e.src] for e in graph.edges), np.int64, len(graph.edges))
    dst = np.fromiter((at[e.dst] for e in graph.edges), np.int64, len(graph.edges))
    rank = np.asarray(ranks, np.int64).reshape(-1)
    delay = np.fromiter((comm_time(e) if ranks[s] != ranks[d] else 0.0
                         for e, s, d in zip(graph.edges, src.tolist(), dst.tolist())), np.float64, len(src))

    def csr(a, b):  # the edges grouped by a, in edge order within a group
        o = np.argsort(a, kind="stable")
        ptr = np.zeros(n + 1, np.int64)
        np.cumsum(np.bincount(a, minlength=n), out=ptr[1:])
        return ptr, b[o], delay[o]

    by_tie = sorted(range(n), key=lambda i: (stages[i].mb, stages[i].sub, stages[i].chunk, keys[i]))
    tie = np.empty(n, np.int64)
    tie[by_tie] = np.arange(n)
    sp, si, sd = csr(src, dst)
    pp, pi, pd = csr(dst, src)
    arrays = GraphArrays(keys=keys, at=at, rank=rank, mb=np.asarray([st.mb for st in stages], np.int64).reshape(-1),
                         is_b=np.asarray([st.kind == "B" for st in stages], np.bool_).reshape(-1), tie=tie,
                         by_tie=np.asarray(by_tie, np.int64).reshape(-1), succ_ptr=sp, succ_idx=si, succ_delay=sd,
                         pred_ptr=pp, pred_idx=pi, pred_delay=pd, n_pred=np.diff(pp))
    if len(by_comm) >= 4:
        by_comm.pop(next(iter(by_comm)))
    by_comm[id(comm_time)] = (comm_time, arrays)
    return arrays


def _list_schedule_unlimited(graph: StageGraph, n_ranks: int, comm_time, window) -> Schedule:
    """:func:`list_schedule` without a memory limit (its window, if any, the only admission rule), by
    :func:`dipc.planner.kernels.list_kernel` on :func:`graph_arrays`: the same schedule as the general loop
    (tests check it), ~20x faster than it was in Python (the search's rollouts and the interleaver's window
    candidates run one per order).

    Per rank and kind, ready stages (``t_start <= t_last``) wait in a heap by priority, the others in a heap by
    ``(t_start, priority)``; a heap of every admissible stage's ``t_start`` (stale entries skipped) gives the rank
    its earliest start; forwards beyond the window wait in a heap by microbatch until the rank's oldest open
    microbatch moves up."""
    import numpy as np

    from ..plan import PlanError
    from .kernels import list_kernel

    A = graph_arrays(graph, comm_time)
    stages = graph.stages.values()
    n = len(A.keys)
    if n and (A.rank.min() < 0 or A.rank.max() >= n_ranks):
        raise ValueError(f"stage ranks must be in [0, {n_ranks}), got {sorted(set(A.rank.tolist()))[:8]}")
    mb0 = int(A.mb.min()) if n else 0  # microbatch numbers from 0 (the window counts differences only)
    lat = np.fromiter((st.latency for st in stages), np.float64, n)
    status, order, olen, start, end, seq = list_kernel(
        n_ranks, A.rank, A.is_b, A.mb - mb0, A.priority_keys([st.priority for st in stages]), A.by_tie,
        A.succ_ptr, A.succ_idx, A.succ_delay, A.n_pred, lat, -1 if window is None else window,
        int(A.mb.max()) - mb0 + 1 if n else 1)
    keys = A.keys
    if status == 1:
        raise PlanError(f"the window of {window} microbatches deadlocks: every rank's queued forwards are beyond "
                        "it and nothing else is ready")
    if status == 2:
        done = {i for r in range(n_ranks) for i in order[r, :olen[r]].tolist()}
        raise ValueError("the stage graph has a cycle: "
                         f"{[keys[i] for i in range(n) if i not in done][:5]} never become ready")
    sl, el = start.tolist(), end.tolist()
    seq_l = seq.tolist()
    return Schedule(order=[[keys[i] for i in order[r, :olen[r]].tolist()] for r in range(n_ranks)],
                    start={keys[i]: sl[i] for i in seq_l}, end={keys[i]: el[i] for i in seq_l})



def _make_room(graph: StageGraph, queues, limits, live, need, oldest: int, recompute_cost, error) -> int:
    """Nothing is admissible: switch the oldest microbatch's first queued forward (on a rank where it does not fit)
    to "recompute", or raise ``error`` naming the rank, the bytes needed and the limit."""
    cands = [(e, r) for r in range(len(queues)) for e in queues[r]["F"] if graph.stages[e[-1]].mb == oldest]
    for e, r in sorted(cands, key=lambda x: x[0]):
        st = graph.stages[e[-1]]
        if recompute_cost is not None:
            kept, extra, how, rebuild = recompute_option(recompute_cost, st)
            if kept < st.activation_bytes and live[r] + kept <= limits[r]:
                switch_to_recompute(graph, st, kept, extra, how, rebuild)
                return r
    if cands:
        e, r = min(cands, key=lambda x: x[0])
        st = graph.stages[e[-1]]
        least = st.activation_bytes
        if recompute_cost is not None:
            least = min(least, recompute_option(recompute_cost, st)[0])
        raise error(f"rank {r} cannot keep {st.key}: it needs {least:.4g} bytes of activations even recomputed "
                    f"({st.activation_bytes:.4g} kept whole) on top of {live[r]:.4g} live, over its activation "
                    f"budget of {limits[r]:.4g} bytes (the memory limit less the rank's parameters, gradients and "
                    "optimizer states); give the pipeline more memory, more ranks, or smaller microbatches")
    r = next(r for r in range(len(queues)) if queues[r]["F"])
    raise error(f"rank {r} is over its activation budget of {limits[r]:.4g} bytes (the memory limit less its "
                f"static bytes) with {live[r]:.4g} live and no backward to free it")


def switch_to_recompute(graph: StageGraph, st: Stage, kept: float, extra: float, strategy: str = "recompute",
                        rebuild: float | None = None) -> None:
    """Give forward ``st`` and its backward the ``strategy`` ("recompute", or "recompute:k"): both count ``kept``
    bytes, the backward grows by ``extra`` seconds and rebuilds ``rebuild`` bytes while it runs (``None``: all the
    forward did not keep); the forward remembers its "keep" bytes for :func:`relax_recompute`."""
    b = graph.stages[backward_key(st.key)]
    keep = st.keep_bytes if st.keep_bytes is not None else st.activation_bytes
    b.latency += extra - st.recompute_extra  # from another option (per-layer recompute), the difference
    st.keep_bytes, st.recompute_extra, st.rebuild_bytes = keep, extra, rebuild
    for x in (st, b):
        x.strategy = strategy
        x.activation_bytes = kept
