"""Stage-level simulation of a plan: iteration time, per-rank busy intervals, bubbles and peak memory.

DIP's planner scores schedules by simulated iteration time (shared/PAPER.md §2.6, "Timeline"; §2.4 uses the same
stage latencies).  :func:`simulate_plan` replays a :class:`dipc.plan.Plan` exactly as the executor runs it:

* each rank runs its actions in order; ``F`` / ``B`` take their stage latency;
* ``SEND`` and ``RECV`` never block: posting one occupies the rank for ``post_overhead`` seconds (host-side work of
  ``isend``/``irecv``), and a message arrives ``comm_time(tensors)`` seconds after its send is posted, or, with
  ``rendezvous`` set (P2P libraries such as gloo and NCCL move the data only once both sides have posted), after
  ``max(send posted, receive posted + rendezvous)``;
* a compute action starts when its rank is free and every message addressed to its stage has arrived;
* memory: every rank holds ``static_bytes`` (parameters, gradients, optimizer state), each forward stage's
  ``activation_bytes`` from its start until the end of its backward, each stage's ``transient_bytes`` while it
  runs, and (with ``buffer_bytes``) each receive's buffer from its posting to the end of its consumer and each
  send's packed copy until it has arrived; the peak of the sum is reported;
* activation offload (``offload_bytes``, DESIGN.md "Memory"): a forward at "offload" copies what it saves out to
  host memory over its rank's host link once it ends (the copy holds the device bytes until it is done), and its
  backward's copy back starts when the rank begins its previous compute action (the executor's prefetch), or at the
  backward if there is none; the backward starts once it is back.  Each rank's link runs one copy at a time, in
  the order the rank issues them, ``host_time(bytes)`` seconds each; the host bytes are held from the copy out's
  start to the copy back's end (``host_peak``);
* the step ends ``epilogue`` seconds after the last action (end-of-step all-reduces, fixed per-step overhead).

A plan that cannot finish (a receive whose send comes after it on the waiting chain) raises
:class:`dipc.plan.PlanError` naming, for each blocked rank, the action and the messages it waits on.

:func:`dipc.simulate` (:mod:`dipc.api`) is the convenience entry: it splits a batch, builds the step's stages with
the compiled pipeline's cost estimate and schedules it, then simulates that plan (:func:`simulate_workload`).
This module uses only the plan IR and reads the compiled pipeline and the step's stage graph it is handed.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import Callable, Mapping, Sequence

from ..plan import COMPUTE, RECVS, SENDS, Plan, TensorSpec, backward_key, forward_key, offloads
from ..validation import incoming_messages, replay, stage_keys

__all__ = ["SimResult", "simulate_plan", "simulate_workload", "end_of_step_seconds", "fsdp_seconds"]


@dataclasses.dataclass
class SimResult:
    """Simulated step.

    Attributes:
        iteration_time: seconds from the first action to the last one's end, plus ``epilogue``.
        busy: per rank, ``(start, end, token, kind)`` of each compute action, in seconds.
        comm: per rank, ``(start, end, token, kind)`` of each SEND/RECV posting (empty without ``post_overhead``).
        waits: per rank, ``(start, end, "wait <compute token>", "WAIT")`` where the rank was free but the compute
            action due next waited for its messages.
        bubble_ratio: idle share of all ranks over the iteration: ``1 - busy time / (P * iteration_time)``.
        rank_bubble: per rank, its idle share of the iteration.
        peak_memory: per rank, bytes: ``static_bytes`` + the largest sum of live activations.
        memory_timeline: per rank, ``(time, bytes)`` points where its memory changes.
        bound: the bubble-free bound, seconds: the busiest rank's total compute (recompute included, since it is
            in the backwards' latencies), plus ``epilogue``; no schedule of these stages on these ranks is faster.
        critical_path: seconds of the longest chain of dependent stages (the plan's ``deps``, forward to backward;
            transfers not counted), plus ``epilogue``: no schedule on any number of ranks is faster.
        schedule: the template that made the plan (from ``plan.simulated``; "" when unknown).
        recomputed: forward-backward stage pairs that recompute, wholly ("recompute") or their first layers
            ("recompute:k"), or op by op ("selective"); "offload" alone is not counted.
        host_link: per rank, ``(start, end, "D2H <forward key>" | "H2D <backward key>", "D2H" | "H2D")`` of each
            activation-offload copy on its host link (empty without offload).
        host_peak: per rank, the most bytes of offloaded activations it holds in host memory at once.
    """

    iteration_time: float
    busy: list[list[tuple[float, float, str, str]]]
    bubble_ratio: float
    rank_bubble: list[float]
    peak_memory: list[float]
    memory_timeline: list[list[tuple[float, float]]]
    comm: list[list[tuple[float, float, str, str]]] = dataclasses.field(default_factory=list)
    waits: list[list[tuple[float, float, str, str]]] = dataclasses.field(default_factory=list)
    bound: float = 0.0

    def __repr__(self) -> str:
        peaks = ", ".join(f"{b / 2**20:.3g}" for b in self.peak_memory)
        return (f"SimResult(iteration_time={self.iteration_time * 1e3:.4g} ms, bubble_ratio={self.bubble_ratio:.1%}, "
                f"peak_memory=[{peaks}] MiB per rank, ranks={len(self.busy)})")
    critical_path: float = 0.0
    schedule: str = ""
    recomputed: int = 0
    host_link: list[list[tuple[float, float, str, str]]] = dataclasses.field(default_factory=list)
    host_peak: list[float] = dataclasses.field(default_factory=list)

    @property
    def bound_ratio(self) -> float:
        """``iteration_time / bound`` (1.0: no bubble at all on the busiest rank)."""
        return self.iteration_time / self.bound if self.bound > 0 else 1.0

    @property
    def critical_path_ratio(self) -> float:
        """``iteration_time / critical_path``."""
        return self.iteration_time / self.critical_path if self.critical_path > 0 else 1.0

    def bubble_causes(self) -> list[dict]:
        """Per rank, where its idle time goes (seconds): ``fill`` (before its first stage), ``drain`` (after its
        last, to the end of the iteration, epilogue included) and ``waits`` (between stages: dependencies, messages
        and the memory-aware order holding work back), with ``busy`` (compute) and ``posting`` (SEND/RECV posts)."""
        out = []
        for r, spans in enumerate(self.busy):
            posting = sum(e - s for s, e, _, _ in (self.comm[r] if r < len(self.comm) else []))
            if not spans:
                out.append({"busy": 0.0, "posting": posting, "fill": self.iteration_time, "drain": 0.0, "waits": 0.0})
                continue
            busy = sum(e - s for s, e, _, _ in spans)
            first, last = min(s for s, _, _, _ in spans), max(e for _, e, _, _ in spans)
            fill, drain = first, self.iteration_time - last
            waits = max(0.0, (last - first) - busy - posting)
            out.append({"busy": busy, "posting": posting, "fill": fill, "drain": drain, "waits": waits})
        return out

    def report(self, plan: Plan | None = None) -> str:
        """A readable summary (DIP's plan report): iteration time against the bubble-free bound and the critical
        path, the bubble ratio and its causes per rank, peak memory per rank (GB), recomputed pairs, and - given
        the ``plan`` - its pairs by memory strategy, the template and the search's progress (rollouts, best time
        over the search); with offload, the copies on the host links and each rank's host-memory peak."""
        lines = [f"schedule {self.schedule or '?'}: iteration {self.iteration_time:.4g} s, bound {self.bound:.4g} s "
                 f"(x{self.bound_ratio:.3f}), critical path {self.critical_path:.4g} s, bubble ratio "
                 f"{self.bubble_ratio:.1%}, recomputed pairs {self.recomputed}"]
        lines.append("rank  busy s    fill s    waits s   drain s   posting s  peak GB")
        for r, c in enumerate(self.bubble_causes()):
            lines.append(f"{r:<5} {c['busy']:<9.4g} {c['fill']:<9.4g} {c['waits']:<9.4g} {c['drain']:<9.4g} "
                         f"{c['posting']:<10.4g} {self.peak_memory[r] / 1e9:.4g}")
        sim = (plan.simulated or {}) if plan is not None else {}
        if plan is not None:
            used = collections.Counter(a.strategy for _, a in plan.compute_actions() if a.kind == "F")
            if set(used) - {"keep"}:
                lines.append("pairs by memory strategy: " + ", ".join(f"{k} {v}" for k, v in sorted(used.items())))
        if any(self.host_peak):
            copies = sum(len(s) for s in self.host_link)
            lines.append(f"offload: {copies} copies on the host links, host memory peak per rank (GB) "
                         + ", ".join(f"{b / 1e9:.4g}" for b in self.host_peak))
        if sim.get("recomputed_partly"):
            lines.append(f"pairs recomputing part of their chunk (per-layer): {sim['recomputed_partly']}")
        if sim.get("plans_tried", 1) > 1:
            lines.append(f"schedules made to fit memory: {sim['plans_tried']} (reserve policies, and re-plans "
                         "under smaller budgets where the simulated plan was over its limit)")
        search = sim.get("search")
        if search:
            hist = search.get("best_over_time") or []
            prog = ", ".join(f"{t:.2f} s: {v:.4g}" for t, v in hist[:6])
            lines.append(f"search: {search['rollouts']} rollouts, {search['iterations']} iterations in "
                         f"{search['seconds']:.2f} s, {'exhausted, ' if search.get('exhausted') else ''}"
                         f"{'improved on' if search.get('improved') else 'kept'} the interleaver's plan; best over "
                         f"time: {prog}")
            fill = search.get("gap_fill")
            if fill:
                lines.append(f"gap filling: {fill['moves']} forwards moved into the busiest rank's idle gaps in "
                             f"{fill['seconds']:.2f} s (the scheduler's estimate, without posting costs and "
                             f"epilogue: {fill['before_s']:.6g} -> {fill.get('after_s', fill['before_s']):.6g} s)")
        return "\n".join(lines)

    def events(self, modality_of: Mapping[int, str] | None = None) -> list[dict]:
        """Compute actions, SEND/RECV postings and waits for messages as trace events for :mod:`dipc.sim.trace`
        (seconds): ``{"rank", "start", "end", "name", "kind", "modality"}``, per rank in time order."""
        out = []
        for r, spans in enumerate(self.busy):
            mine = list(spans) + list(self.comm[r] if r < len(self.comm) else [])
            mine += self.waits[r] if r < len(self.waits) else []
            for s, e, tok, kind in sorted(mine, key=lambda x: x[0]):
                head = tok.split()[-1]  # "wait 3F1.2" -> "3F1.2"
                digits = head[:len(head) - len(head.lstrip("0123456789"))]
                out.append({"rank": r, "start": s, "end": e, "name": tok, "kind": kind,
                            "modality": (modality_of or {}).get(int(digits) if digits else -1, "")})
        return out


def _check_seconds(name: str, v) -> float:
    f = float(v)
    if not math.isfinite(f) or f < 0:
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {v!r}")
    return f


def simulate_plan(plan: Plan, latency: Mapping[str, float], *,
                  activation_bytes: Mapping[str, float] | None = None,
                  static_bytes: Sequence[float] | None = None,
                  comm_time: Callable[[Sequence[TensorSpec]], float] | None = None,
                  post_overhead: float | Callable[[Sequence[TensorSpec]], float] = 0.0, epilogue: float = 0.0,
                  rendezvous: float | None = None, transient_bytes: Mapping[str, float] | None = None,
                  buffer_bytes: Callable[[Sequence[TensorSpec]], float] | None = None,
                  offload_bytes: Mapping[str, float] | None = None,
                  host_time: Callable[[float], float] | None = None) -> SimResult:
    """Replay ``plan`` with stage latencies (see the module docstring).

    Args:
        plan: the plan.
        latency: stage key (``F:chunk:mb:sub`` / ``B:...``) -> seconds.  A missing stage raises ``KeyError``.
        activation_bytes: forward stage key -> bytes its activations occupy until its backward ends (default 0).
        static_bytes: per rank, bytes held all the time (default 0).
        comm_time: seconds for one message's tensors to arrive after its send is posted (default: instantaneous).
        post_overhead: seconds a rank is busy posting one SEND or RECV action (default 0), or a function of the
            action's tensors.
        epilogue: seconds added after the last action (default 0).
        rendezvous: when set, a transfer starts only once the receive is posted, plus this many seconds (the
            receiver's ready notice); default None: transfers start when the send is posted.
        transient_bytes: stage key -> bytes held while the stage runs (default 0).
        buffer_bytes: message tensors -> bytes of its buffer: a receive's from its posting to the end of the stage
            that consumes it, a send's packed copy from its posting until it has arrived (default: not counted).
        offload_bytes: forward stage key -> bytes its pair offloads to host memory (the "offload" strategy; its
            ``activation_bytes`` are then what stays on the device).
        host_time: bytes -> seconds of one copy over a rank's host link (needed with ``offload_bytes``).

    Returns:
        a :class:`SimResult`.

    Raises:
        PlanError: the plan deadlocks (each blocked rank's action and awaited messages are named).
        ValueError: ``post_overhead``, ``epilogue`` or ``rendezvous`` (or a value ``post_overhead``, ``comm_time`` or
            ``host_time`` returns) is negative or not finite, naming it (and the action); ``offload_bytes`` without
            ``host_time``.
    """
    for name, v in (("post_overhead", None if callable(post_overhead) else post_overhead), ("epilogue", epilogue),
                    ("rendezvous", rendezvous)):
        if v is not None:
            _check_seconds(name, v)
    comm_fn = comm_time or (lambda tensors: 0.0)

    def transfer_time(tensors, a):
        return _check_seconds(f"comm_time for {a}", comm_fn(tensors))

    act = activation_bytes or {}
    n = plan.n_ranks
    static = list(static_bytes) if static_bytes is not None else [0.0] * n
    keys = stage_keys(plan)  # each action's stage key, made once
    incoming = incoming_messages(plan, keys)
    arrive: dict[int, tuple[float, float]] = {}  # message -> (when its send was posted, its transfer time)
    posted: dict[int, float] = {}  # message -> when its receive was posted
    clock = [0.0] * n
    busy: list[list[tuple[float, float, str, str]]] = [[] for _ in range(n)]
    comm: list[list[tuple[float, float, str, str]]] = [[] for _ in range(n)]
    waits: list[list[tuple[float, float, str, str]]] = [[] for _ in range(n)]
    mem_events: list[list[tuple[float, float]]] = [[] for _ in range(n)]

    transient = transient_bytes or {}
    recv_held: dict[tuple[int, str], float] = {}  # (rank, consumer stage) -> receive buffer bytes
    send_held: list[tuple[int, int, float]] = []  # (rank, message, bytes)
    off = {k: v for k, v in (offload_bytes or {}).items() if v > 0}
    if off and host_time is None:
        raise ValueError("offload_bytes needs host_time (seconds of a copy over the host link)")
    link_free = [0.0] * n
    link: list[list[tuple[float, float, str, str]]] = [[] for _ in range(n)]
    host_events: list[list[tuple[float, float]]] = [[] for _ in range(n)]
    out_done: dict[str, float] = {}  # offloaded forward -> when its copy out ends
    back_done: dict[str, float] = {}  # offloaded forward -> when its copy back ends
    prefetch: dict[tuple[int, int], str] = {}  # (rank, compute action index) -> forward whose copy back starts there
    if off:
        for r, acts in enumerate(plan.ranks):
            last = None
            for i, a in enumerate(acts):
                if a.kind in COMPUTE:
                    fk = forward_key(keys[r][i])
                    if a.kind == "B" and fk in off and last is not None:
                        prefetch[(r, last)] = fk
                    last = i

    def copy(r: int, fk: str, at: float, kind: str, label: str) -> float:
        """One copy of ``fk``'s offloaded bytes on rank ``r``'s host link, issued at ``at``; returns its end."""
        start = max(at, link_free[r])
        end = start + _check_seconds(f"host_time for {label}", host_time(off[fk]))
        link_free[r] = end
        link[r].append((start, end, f"{kind} {label}", kind))
        if kind == "D2H":
            host_events[r].append((start, off[fk]))
        else:
            host_events[r].append((end, -off[fk]))
            mem_events[r].append((start, off[fk]))  # back on the device until the backward ends
        return end

    def copy_back(r: int, fk: str, at: float, label: str) -> None:
        back_done[fk] = copy(r, fk, max(at, out_done.get(fk, 0.0)), "H2D", label)

    def visit(r: int, i: int, a) -> None:
        st = keys[r][i]
        if a.kind in SENDS or a.kind in RECVS:
            cost = (_check_seconds(f"post_overhead for {a}", post_overhead(a.tensors)) if callable(post_overhead)
                    else post_overhead)
            if cost:
                comm[r].append((clock[r], clock[r] + cost, str(a), a.kind))
                clock[r] += cost
            nb = buffer_bytes(a.tensors) if buffer_bytes is not None else 0.0
            if a.kind in SENDS:
                arrive[a.msg] = (clock[r], transfer_time(a.tensors, a))
                if nb:
                    mem_events[r].append((clock[r], nb))
                    send_held.append((r, a.msg, nb))
            else:
                posted[a.msg] = clock[r]
                if nb:
                    mem_events[r].append((clock[r], nb))
                    recv_held[(r, st)] = recv_held.get((r, st), 0.0) + nb
        elif a.kind in COMPUTE:
            ready = []
            for m in incoming[st]:
                sent_at, transfer = arrive[m]
                if rendezvous is not None:
                    sent_at = max(sent_at, posted[m] + rendezvous)
                ready.append(sent_at + transfer)
            pf = prefetch.get((r, i))
            if pf is not None:  # the executor brings the next backward's activations back as this action starts
                copy_back(r, pf, max([clock[r]] + ready), backward_key(pf))
            fk = forward_key(st) if off else None
            if a.kind == "B" and fk in off:
                if fk not in back_done:  # nothing ran before it on this rank: it fetches them itself
                    copy_back(r, fk, max([clock[r]] + ready), backward_key(fk))
                ready.append(back_done[fk])
            start = max([clock[r]] + ready)
            if start > clock[r]:
                waits[r].append((clock[r], start, f"wait {a}", "WAIT"))
            end = start + latency[st]
            busy[r].append((start, end, str(a), a.kind))
            clock[r] = end
            if a.kind == "F":
                mem_events[r].append((start, act.get(st, 0.0)))
                if st in off:  # what it saves stays on the device until its copy out is done
                    out_done[st] = copy(r, st, end, "D2H", st)
                    mem_events[r].append((start, off[st]))
                    mem_events[r].append((out_done[st], -off[st]))
            else:
                mem_events[r].append((end, -act.get(forward_key(st), 0.0)))
                if fk in off:
                    mem_events[r].append((end, -off[fk]))
            tb = transient.get(st, 0.0)
            if tb:
                mem_events[r].append((start, tb))
                mem_events[r].append((end, -tb))
            held = recv_held.pop((r, st), 0.0)
            if held:
                mem_events[r].append((end, -held))

    replay(plan, visit, keys)
    for r, m, nb in send_held:  # a send's copy goes once the message has arrived
        sent_at, transfer = arrive[m]
        if rendezvous is not None and m in posted:
            sent_at = max(sent_at, posted[m] + rendezvous)
        mem_events[r].append((sent_at + transfer, -nb))
    it = max([s[1] for spans in busy for s in spans] + clock, default=0.0)
    if it > 0:
        it += epilogue
    busy_time = [sum(e - s for s, e, _, _ in spans) for spans in busy]
    rank_bubble = [1.0 - b / it if it > 0 else 0.0 for b in busy_time]
    bubble = 1.0 - sum(busy_time) / (n * it) if it > 0 else 0.0
    peaks, timelines = [], []
    for r in range(n):
        level, peak, tl = static[r], static[r], [(0.0, static[r])]
        # frees at time t happen after allocations at the same t only if they belong to a later stage; sort so that
        # at equal times frees come first (a backward ending as the next forward starts)
        for t, d in sorted(mem_events[r], key=lambda x: (x[0], x[1] > 0)):
            level += d
            peak = max(peak, level)
            tl.append((t, level))
        peaks.append(peak)
        timelines.append(tl)
    ep = epilogue if it > 0 else 0.0
    bound = max(busy_time, default=0.0) + ep
    critical = _critical_path(plan, latency) + ep
    recomputed = sum(1 for acts in plan.ranks for a in acts
                     if a.kind == "F" and a.strategy not in ("keep", "offload"))
    host_peak = []
    for r in range(n):
        level = top = 0.0
        for _, d in sorted(host_events[r], key=lambda x: (x[0], x[1] > 0)):
            level += d
            top = max(top, level)
        host_peak.append(top)
    return SimResult(iteration_time=it, busy=busy, bubble_ratio=bubble, rank_bubble=rank_bubble, peak_memory=peaks,
                     memory_timeline=timelines, comm=comm, waits=waits, bound=bound, critical_path=critical,
                     schedule=str((plan.simulated or {}).get("schedule", "")), recomputed=recomputed,
                     host_link=link, host_peak=host_peak)


def _critical_path(plan: Plan, latency: Mapping[str, float]) -> float:
    """Longest chain of ``plan.deps`` weighted by stage latency (seconds), by networkx's topological order."""
    import networkx as nx

    g = nx.DiGraph()
    stages = {a.stage for acts in plan.ranks for a in acts if a.kind in COMPUTE}
    g.add_nodes_from(stages)
    g.add_edges_from((d, k) for k, ds in plan.deps.items() for d in ds)
    finish: dict[str, float] = {}
    for k in nx.topological_sort(g):
        finish[k] = max((finish[p] for p in g.predecessors(k)), default=0.0) + latency.get(k, 0.0)
    return max(finish.values(), default=0.0)


def end_of_step_seconds(compiled, dev) -> float:
    """Seconds of the collectives after a step's last action on profile ``dev``: the loss all-reduce over the
    pipeline, each tied weight's gradient exchange among its k ranks (k - 1 messages of its bytes each,
    :func:`dipc.wire.sum_over_ranks`) and, with ``fsdp_size`` > 1, FSDP2's collectives (:func:`fsdp_seconds`)."""
    return (dev.allreduce_time(4, compiled.pp_size)
            + sum((len(rs) - 1) * dev.p2p_time(nb) for _, rs, nb in compiled.tied_params())
            + fsdp_seconds(compiled, dev))


def fsdp_seconds(compiled, dev) -> float:
    """Seconds of a step's FSDP2 collectives on profile ``dev`` (``compiled.fsdp_size`` D > 1; 0 otherwise): each
    rank all-gathers its chunks' parameters after the step's first header and reduce-scatters their gradients
    after its last action, neither overlapped with the pipeline's actions (:mod:`dipc.runtime.fsdp`); a ring
    all-gather or reduce-scatter over D ranks moves half an all-reduce's bytes
    (:meth:`dipc.sim.device.DeviceProfile.allreduce_time`).  The slowest rank's: the step ends with it."""
    D = getattr(compiled, "fsdp_size", 1)
    if D <= 1:
        return 0.0
    # "step" holds the unsharded weights and their gradients, of equal bytes: one all-reduce's worth of either
    return max(dev.allreduce_time(parts["step"] / 2, D) for parts in compiled.rank_state_parts())


def simulate_workload(compiled, w, plan: Plan, *, comm_time=None, static_bytes=None,
                      optimizer_states: int = 2) -> SimResult:
    """Simulate ``plan`` for the step workload ``w`` (:func:`dipc.planner.build_workload`) as :func:`dipc.simulate`
    does: the stages' latencies, activation and transient bytes, message buffers (per GPU under tensor
    parallelism), the runtime's posting overheads and end-of-step epilogue on the compiled pipeline's device."""
    if static_bytes is None:
        static_bytes = compiled.rank_state_bytes(optimizer_states, w.amp)
    if comm_time is None and compiled.device is not None:
        dev = compiled.device
        T = compiled.message_shards  # with sequence parallelism each GPU sends its shard over its own link
        comm_time = lambda tensors: dev.p2p_time(sum(t.nbytes for t in tensors) / T)  # noqa: E731
    lat = {k: s.latency for k, s in w.graph.stages.items()}
    act = {k: s.activation_bytes for k, s in w.graph.stages.items() if s.kind == "F"}
    transient = {k: s.transient_bytes for k, s in w.graph.stages.items() if s.transient_bytes}
    offload = {}
    for k, s in w.graph.stages.items():  # an offloading pair's host bytes go over the host link
        if s.kind == "F" and offloads(s.strategy):
            offload[k] = s.host_bytes
    for k, s in w.graph.stages.items():  # a recomputing backward holds what its forward did not keep, again
        if s.kind == "B" and s.strategy != "keep":  # (less what came back from host memory: the link's)
            f = w.graph.stages[forward_key(k)]
            again = f.rebuild_bytes
            if again is None and f.keep_bytes is not None:
                again = f.keep_bytes - f.activation_bytes
            if again is not None:
                again -= offload.get(forward_key(k), 0.0)
            if again is not None and again > 0:
                transient[k] = transient.get(k, 0.0) + again
    T = compiled.message_shards
    buffers = lambda tensors: sum(t.nbytes for t in tensors) / T  # noqa: E731  (each GPU holds its shard, or all)
    post, epilogue = 0.0, 0.0
    dev = compiled.device
    if dev is not None:
        post = lambda tensors: dev.post_time(sum(t.nbytes for t in tensors) / T)  # noqa: E731
        epilogue = dev.step_overhead + end_of_step_seconds(compiled, dev)
    res = simulate_plan(plan, lat, activation_bytes=act, comm_time=comm_time, static_bytes=static_bytes,
                        post_overhead=post, epilogue=epilogue, rendezvous=None if dev is None else dev.p2p_latency,
                        transient_bytes=transient, buffer_bytes=buffers, offload_bytes=offload,
                        host_time=None if dev is None or dev.host_bandwidth is None else dev.host_time)
    return res
