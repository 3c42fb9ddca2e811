"""Fitting a fixed order of stages to a memory limit: timing it (:func:`timed_schedule`), finding its peaks
(:func:`order_peaks`), switching forwards to recompute until every rank fits (:func:`fit_by_recompute`) and giving
memory back where it is left (:func:`relax_recompute`): the schedule templates' path (:mod:`dipc.codegen.templates`)
and a greedy stand-in for DIP's per-rank memory ILP (§2.5, :mod:`dipc.planner.memory`).  Units: seconds and bytes.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Sequence

from ..plan import backward_key
from ..stages import Edge, Schedule, Stage, StageGraph
from .schedule import graph_arrays, recompute_option, switch_to_recompute

__all__ = ["timed_schedule", "order_peaks", "fit_by_recompute", "relax_recompute"]


def relax_recompute(graph: StageGraph, order: Sequence[Sequence[str]], limits: Sequence[float | None]) -> int:
    """Switch planner-recomputed stage pairs (:func:`switch_to_recompute`) of a fixed order back to "keep" while
    every rank's live activations stay under its limit: most backward seconds saved per byte first, each checked
    over the positions its activations would be live (a greedy form of DIP's per-rank memory optimisation, PAPER.md
    §2.5; the ILP is the next issue's).  Returns how many pairs went back to "keep"."""
    import numpy as np

    n = 0
    for r, ks in enumerate(order):
        if limits[r] is None or not ks:
            continue
        pos = {k: i for i, k in enumerate(ks)}
        delta = np.zeros(len(ks) + 1)
        for i, k in enumerate(ks):
            s = graph.stages[k]
            if s.kind == "F":
                delta[i] += s.activation_bytes
            else:
                delta[i + 1] -= s.activation_bytes  # freed after the backward (as :func:`order_peaks` counts)
        level = np.cumsum(delta)[:-1]
        cands = []
        for k in ks:
            s = graph.stages[k]
            if s.kind == "F" and s.strategy != "keep" and s.keep_bytes is not None and not s.forced:
                extra_b = s.keep_bytes - s.activation_bytes
                cands.append((-(s.recompute_extra / max(extra_b, 1e-12)), k))
        for _, k in sorted(cands):
            s = graph.stages[k]
            b = graph.stages[backward_key(k)]
            lo, hi = pos[k], pos[b.key]
            add = s.keep_bytes - s.activation_bytes
            if level[lo:hi + 1].max() + add <= limits[r]:
                level[lo:hi + 1] += add
                for x in (s, b):
                    x.strategy = "keep"
                    x.activation_bytes = s.keep_bytes
                b.latency -= s.recompute_extra
                s.keep_bytes, s.recompute_extra, s.rebuild_bytes = None, 0.0, None
                n += 1
    return n


def timed_schedule(graph: StageGraph, order: Sequence[Sequence[str]], *,
                   comm_time: Callable[[Edge], float] | None = None) -> Schedule:
    """Time a fixed per-rank order (a schedule template's): each stage starts when its rank has finished the one
    before it and every stage it depends on has ended (plus ``comm_time`` for an edge between ranks).

    Raises:
        dipc.plan.PlanError: the order is not a permutation of the graph's stages on their ranks, or it deadlocks
            (names each rank's waiting stage and what it waits for).
    """
    import numpy as np

    from ..plan import PlanError
    from .kernels import time_kernel

    A = graph_arrays(graph, comm_time)
    at = A.at
    n = len(at)
    try:
        ids = [[at[k] for k in ks] for ks in order]
    except KeyError:
        ids = None
    seen = [i for ii in ids for i in ii] if ids is not None else None
    if seen is None or len(seen) != n or len(set(seen)) != n:
        flat = [k for ks in order for k in ks]
        missing = sorted(set(graph.stages) - set(flat))[:5]
        counts: dict[str, int] = defaultdict(int)
        for k in flat:
            counts[k] += 1
        extra = sorted(k for k, c in counts.items() if c > 1 or k not in graph.stages)[:5]
        raise PlanError(f"the order does not run every stage once: missing {missing}, unknown or repeated {extra}")
    stages = list(graph.stages.values())
    for r, ii in enumerate(ids):
        wrong = [order[r][p] for p, i in enumerate(ii) if stages[i].rank != r]
        if wrong:
            raise PlanError(f"rank {r}'s order holds stages of other ranks: {wrong[:5]}")
    olen = np.asarray([len(ii) for ii in ids], np.int64).reshape(-1)
    flat_ids = np.full((len(ids), max(olen.max(initial=0), 1)), -1, np.int64)
    for r, ii in enumerate(ids):
        flat_ids[r, :len(ii)] = ii
    lat = np.fromiter((st.latency for st in stages), np.float64, n)
    status, beg, fin, seq = time_kernel(flat_ids, olen, A.pred_ptr, A.pred_idx, A.pred_delay, lat)
    keys = A.keys
    if status:
        end_k = {keys[i] for i in seq.tolist()}
        preds = graph.preds()
        waits = {}
        for r, ks in enumerate(order):
            p = next((p for p, k in enumerate(ks) if k not in end_k), None)
            if p is not None:
                waits[r] = (ks[p], [e.src for e in preds[ks[p]] if e.src not in end_k][:3])
        raise PlanError(f"the order deadlocks: each rank's next stage and what it waits for: {waits}")
    bl, fl, seq_l = beg.tolist(), fin.tolist(), seq.tolist()
    start = {keys[i]: bl[i] for i in seq_l}  # in the order the stages were timed
    end = {keys[i]: fl[i] for i in seq_l}
    return Schedule(order=[list(ks) for ks in order], start=start, end=end)


def order_peaks(graph: StageGraph, order: Sequence[Sequence[str]]) -> list[tuple[float, int]]:
    """Per rank, ``(peak bytes of live forward activations, position in the order where it is reached)``: a
    forward's ``activation_bytes`` are live from its start to the end of its backward (as the simulator counts)."""
    out = []
    for ks in order:
        level, peak, at = 0.0, 0.0, -1
        for i, k in enumerate(ks):
            s = graph.stages[k]
            if s.kind == "F":
                level += s.activation_bytes
                if level > peak:
                    peak, at = level, i
            else:
                level -= s.activation_bytes
        out.append((peak, at))
    return out


def fit_by_recompute(graph: StageGraph, order: Sequence[Sequence[str]], limits: Sequence[float | None],
                     recompute_cost: Callable[[Stage], tuple], *, uniform: bool = False) -> int:
    """Switch forward-backward stage pairs of a fixed order to "recompute" until every rank's live activations
    stay under its limit, as a user of a static schedule turns recompute on to fit (selective: at each rank's peak,
    the pairs live there that save the most bytes per second of recompute go first).  With ``uniform`` a chunk
    recomputes for every microbatch or for none (Megatron's ``--recompute-granularity full``: the same layers for
    all microbatches): at each peak the chunk live there with the most bytes saved per second goes whole.  Updates
    ``graph``'s stages; returns how many pairs changed.

    Raises:
        dipc.plan.PlanError: a rank is over its limit with every live pair already recomputed (names the rank, the
            bytes and the limit).
    """
    from ..plan import PlanError

    n = 0
    while True:
        peaks = order_peaks(graph, order)
        over = [(r, p, at) for r, (p, at) in enumerate(peaks) if limits[r] is not None and p > limits[r]]
        if not over:
            return n
        for r, peak, at in over:
            ks = order[r]
            done_b = {k for k in ks[:at + 1] if graph.stages[k].kind == "B"}
            live = [graph.stages[k] for k in ks[:at + 1] if graph.stages[k].kind == "F"
                    and backward_key(k) not in done_b]
            cands = []
            for st in live:
                opt = recompute_option(recompute_cost, st)
                if opt[0] < st.activation_bytes:
                    cands.append(((st.activation_bytes - opt[0]) / max(opt[1] - st.recompute_extra, 1e-12), st, opt))
            if not cands:
                raise PlanError(f"rank {r} keeps {peak:.4g} bytes of activations at its peak ({ks[at]}) with every "
                                f"stage live there recomputed, over its activation budget of {limits[r]:.4g} bytes "
                                "(the memory limit less the rank's parameters, gradients and optimizer states); give "
                                "the pipeline more memory, more ranks, or smaller microbatches")
            excess = peak - limits[r]
            if uniform:  # the best chunk live at the peak, for all its microbatches
                by_chunk: dict[int, list] = defaultdict(list)
                for st in graph.stages.values():
                    if st.kind == "F" and st.rank == r:
                        opt = recompute_option(recompute_cost, st)
                        if opt[0] < st.activation_bytes:
                            by_chunk[st.chunk].append((st, opt))
                live_chunks = {c[1].chunk for c in cands}
                best = max(live_chunks, key=lambda c: sum(st.activation_bytes - o[0] for st, o in by_chunk[c])
                           / max(sum(o[1] - st.recompute_extra for st, o in by_chunk[c]), 1e-12))
                for st, opt in by_chunk[best]:
                    switch_to_recompute(graph, st, *opt)
                    n += 1
                continue
            for _, st, opt in sorted(cands, key=lambda c: -c[0]):
                excess -= st.activation_bytes - opt[0]
                switch_to_recompute(graph, st, *opt)
                n += 1
                if excess <= 0:
                    break
