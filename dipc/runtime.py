"""Runtime: per-step stage graph, plan delivery and the executor.

For every ``step(batch)`` on every rank of the pipeline group (DESIGN.md "Data flow"):

1. the batch is validated and split into microbatches and sub-microbatches (:mod:`dipc.batch`); a bad batch raises
   on every rank before any communication;
2. the stage graph of the step is built: a forward and a backward stage per (chunk, microbatch, sub-microbatch),
   with the named tensors every cross-rank edge carries (shapes evaluated from the capture's symbolic shapes);
3. rank 0 of the group schedules it (:func:`dipc.schedule.list_schedule`, DIP §2.4), lowers it to a
   :class:`dipc.plan.Plan`, checks it (:func:`dipc.plan.validate`) and delivers it to every rank through
   ``torch.distributed`` with the step number and a SHA-256 digest that every rank checks (DIP §2.8);
4. each rank executes its action list with non-blocking point-to-point sends and receives (gloo on CPU, NCCL on GPU:
   the plan posts receives in the order a peer sends); every wait has a timeout;
5. gradients of weights that live on several ranks (tied input embedding / LM head) are summed over those ranks, and
   the batch loss (microbatch losses weighted by :attr:`dipc.batch.Microbatch.weight`) is broadcast to every rank.

:func:`run_local` executes a plan for all ranks in one process (no process group) in the order the plan's dry run
found; it is the same executor with an in-memory transport.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import os
import time
from collections import defaultdict
import logging
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from .batch import Microbatch
from .codegen.stage import recompute_prefix
from .plan import RECVS, SENDS, Plan, PlanError, TensorSpec, recomputed_blocks, stage_key, validate
from .planner.memory import optimize_memory
from .schedule import (Edge, Stage, StageGraph, fit_by_recompute, list_schedule, lower, relax_recompute,
                       timed_schedule)

__all__ = ["PipelineRuntime", "StepWorkload", "StepReport", "StepFailed", "TransportError", "build_workload", "run_local", "Executor",
           "set_recompute", "memory_options", "prefetch"]

log = logging.getLogger("dipc")

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


class _PeerFailed(Exception):
    """A message of this step came as an abort message: rank ``origin`` failed first (raised inside the executor;
    the runtime turns it into :class:`StepFailed`)."""

    def __init__(self, origin: int, action):
        super().__init__(f"rank {origin} failed (seen in {action})")
        self.origin = origin


class StepFailed(RuntimeError):
    """A pipeline step failed on some rank; every rank of the pipeline raises it, naming the rank that failed
    first, its action (e.g. ``3B1.0``), the step and the original exception.  Every ``.grad`` is as before the
    step.  ``origin``: that rank; ``action``: its action's text; ``step``: the step index; ``usable``: whether the
    process group can run further steps (False after a timed-out or broken connection: gloo closes such a pair)."""

    def __init__(self, message: str, origin: int | None = None, action: str = "", step: int = -1,
                 usable: bool = True):
        super().__init__(message)
        self.origin, self.action, self.step, self.usable = origin, action, step, usable


def _rng_state(device: torch.device):
    """The RNG state a recomputed forward must start from (CPU, and the device's on CUDA)."""
    return (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _set_rng_state(state, device: torch.device) -> None:
    cpu, dev = state
    torch.set_rng_state(cpu)
    if dev is not None:
        torch.cuda.set_rng_state(dev, device)


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


@dataclasses.dataclass
class StepWorkload:
    """Everything about one step that every rank derives identically from the batch.

    Attributes:
        microbatches: the step's microbatches.
        programs: stage key (F and B share one) -> the program whose chunk module runs it.
        data: stage key -> the inputs view (microbatch or sub-microbatch) it runs on.
        wiring: forward stage key -> input name -> list of (producer forward stage key, producer value name);
            several producers mean a concatenation along dim 0 (sub-microbatch outputs of an encoder).
        empty: forward stage key -> input name -> (shape, dtype) of a 0-instance input (no producer).
        graph: the stage graph (stages, edges with tensors).
        amp: ``(device type, dtype name)`` of the ``torch.autocast`` the step runs under (its message dtypes are
            the ones autocast produces, :func:`autocast_dtypes`), or None.
    """

    microbatches: list[Microbatch]
    programs: dict
    data: dict
    bindings: dict
    wiring: dict
    empty: dict
    graph: StageGraph
    tp_size: int = 1
    amp: tuple[str, str] | None = None  # (device type, dtype) of the torch.autocast the step runs under


def _fkey(c, m, s):
    return stage_key("F", c, m, s)


def autocast_state(device: torch.device) -> tuple[str, str] | None:
    """``(device type, dtype name)`` of the ``torch.autocast`` enabled here for ``device``'s type, or None."""
    kind = device.type
    if not torch.is_autocast_enabled(kind):
        return None
    return kind, _dtype_name(torch.get_autocast_dtype(kind))


def autocast_dtypes(prog, amp: tuple[str, str] | None) -> dict[str, torch.dtype]:
    """Dtype of every value of ``prog``'s capture when it runs under ``torch.autocast(*amp)`` (empty for None):
    the capture's graph interpreted once on its own fake tensors under that autocast (autocast acts on each ATen
    op, so a chunk module running those ops under it produces the same dtypes).  Cached on the program.
    Issue "A citizen of any torch training loop", point 4: message dtypes follow what autocast produces."""
    if amp is None:
        return {}
    cache = prog.__dict__.setdefault("_dipc_autocast_dtypes", {})
    if amp in cache:
        return cache[amp]
    gm = prog.capture.graph_module
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = next((v.fake_mode for v in vals if hasattr(v, "fake_mode")), None)
    out: dict[str, torch.dtype] = {}

    class _Dtypes(torch.fx.Interpreter):
        def run_node(self, n):
            r = super().run_node(n)
            if isinstance(r, torch.Tensor):
                out[n.name] = r.dtype
            return r

    import contextlib

    with fake_mode if fake_mode is not None else contextlib.nullcontext(), \
            torch.autocast(amp[0], dtype=getattr(torch, amp[1])):
        _Dtypes(gm).run(*vals)
    cache[amp] = out
    return out


def build_workload(compiled, microbatches: list[Microbatch], amp: tuple[str, str] | None = None) -> StepWorkload:
    """Build the stage graph of a step (see the module docstring) for ``compiled``'s chunks; ``amp``: the
    ``torch.autocast`` it runs under (:func:`autocast_state`), whose dtypes its messages carry.

    Raises:
        dipc.codegen.stage.CodegenError: a crossing tensor's shape cannot be evaluated.
        PlanError: programs of a microbatch and its sub-microbatches disagree on their boundary values.
    """
    part = compiled.partition
    mod_of = {c.index: c.modality for c in part.chunks}
    rank_of = {c.index: c.rank for c in part.chunks}
    inst_of = {i.modality: i for i in compiled.batch_spec.instances}
    ex_units: dict[str, float] = {}  # filled on first use (only the no-device estimate needs it)
    stages: dict[str, Stage] = {}
    mb_forwards: list[str] = []
    programs, data, bindings = {}, {}, {}
    wiring: dict[str, dict[str, list]] = {}
    empty: dict[str, dict] = {}
    edges: dict[tuple[str, str], list[TensorSpec]] = {}

    def add_stage(c, m, s, prog, view, units):
        bind = prog.bind(view)
        cost = prog.stage_cost(c, bind)
        if cost is not None:  # symbolic cost on the device profile, at this stage's own sizes
            tp = compiled.tp_comm_seconds(prog, c, bind) if compiled.tp_size > 1 else 0.0
            lat = {"F": cost["latency_f"] + tp, "B": cost["latency_b"] + tp}
            act = cost["activation_bytes"] / compiled.tp_size
            # the largest op's output while the forward runs; the backward holds its gradient and its input's
            op = cost.get("op_peak_bytes", 0.0) / compiled.tp_size
            transient = {"F": op, "B": 2 * op}
        else:  # first estimate: the example's cost scaled by tokens / instances, backward = 2 x forward
            if not ex_units:
                ex_units.update(_example_units(compiled))
            ratio = units / max(ex_units[mod_of[c]], 1e-12)
            lat = {"F": compiled.chunk_latency(c) * ratio, "B": 2 * compiled.chunk_latency(c) * ratio}
            act = part.chunks[c].cost.activation_bytes * ratio
            transient = {"F": 0.0, "B": 0.0}  # the nominal estimate does not size ops
        prio = -m
        for kind in ("F", "B"):
            st = Stage(kind=kind, chunk=c, mb=m, sub=s, rank=rank_of[c], latency=lat[kind], priority=prio,
                       activation_bytes=act, modality=mod_of[c], transient_bytes=transient[kind])
            stages[st.key] = st
        k = _fkey(c, m, s)
        mb_forwards.append(k)
        programs[k] = prog
        data[k] = view
        bindings[k] = bind
        edges[(k, stage_key("B", c, m, s))] = []

    for mb in microbatches:
        m = mb.index
        mb_forwards.clear()
        prog = compiled.program_for(mb.data)
        sub_progs = {}
        for mod, inst in inst_of.items():
            for j in range(len(mb.subs[mod])):
                view = mb.sub_view(inst, j)
                sp = compiled.program_for(view, whole=False)
                sub_progs[(mod, j)] = sp
                for c in sorted(sp.chunks):
                    if mod_of[c] == mod:
                        add_stage(c, m, j, sp, view, view[inst.keys[0]].shape[0])
        units = _units(compiled, mb.data)
        for c in sorted(prog.chunks):
            if mod_of[c] not in inst_of:
                add_stage(c, m, -1, prog, mb.data, units)
        # wiring
        for key in mb_forwards:
            st = stages[key]
            p = programs[key]
            cm = p.chunks[st.chunk]
            w = wiring.setdefault(key, {})
            for inp in cm.inputs:
                if inp.kind != "value":
                    continue
                src_mod = mod_of[inp.src_chunk]
                if src_mod == st.modality or src_mod not in inst_of:
                    w[inp.name] = [(_fkey(inp.src_chunk, m, st.sub if src_mod == st.modality else -1), inp.name)]
                    continue
                # a value from a sub-microbatched modality: concatenate its sub-microbatches' outputs
                k_idx = p.boundary[src_mod].index(inp.name)
                producers = []
                for j in range(len(mb.subs[src_mod])):
                    sp = sub_progs[(src_mod, j)]
                    if len(sp.boundary.get(src_mod, [])) != len(p.boundary[src_mod]):
                        raise PlanError(f"the capture for sub-microbatch {j} of microbatch {m} hands "
                                        f"{sp.boundary.get(src_mod)} from {src_mod} to the backbone, the microbatch's "
                                        f"capture expects {p.boundary[src_mod]}")
                    name = sp.boundary[src_mod][k_idx]
                    src_chunk = next(c for c, cmj in sp.chunks.items() if name in cmj.outputs)
                    producers.append((_fkey(src_chunk, m, j), name))
                w[inp.name] = producers
                if not producers:
                    meta = p.chunks[inp.src_chunk].output_meta[inp.name]
                    dt = autocast_dtypes(p, amp).get(inp.name, meta.dtype)
                    empty.setdefault(key, {})[inp.name] = (meta.concrete_shape(bindings[key]), dt)
    for key, w in wiring.items():
        for name, producers in w.items():
            for pk, pname in producers:
                pst = stages[pk]
                meta = programs[pk].chunks[pst.chunk].output_meta[pname]
                dt = autocast_dtypes(programs[pk], amp).get(pname, meta.dtype)
                spec = TensorSpec(pname, meta.concrete_shape(bindings[pk]), _dtype_name(dt))
                lst = edges.setdefault((pk, key), [])
                if spec not in lst:
                    lst.append(spec)
                if pst.rank == stages[key].rank:  # the consumer reads the producer's outputs: they live until then
                    edges.setdefault((key, "B" + pk[1:]), [])
                if meta.requires_grad:
                    bk = "B" + key[1:]
                    bpk = "B" + pk[1:]
                    lst_b = edges.setdefault((bk, bpk), [])
                    if spec not in lst_b:
                        lst_b.append(spec)
    edge_list = [Edge(src=s, dst=d, tensors=tuple(t) if stages[s].rank != stages[d].rank else ())
                 for (s, d), t in edges.items()]
    return StepWorkload(microbatches=microbatches, programs=programs, data=data, bindings=bindings, wiring=wiring,
                        empty=empty, graph=StageGraph(stages=stages, edges=edge_list), tp_size=compiled.tp_size,
                        amp=amp)


def set_recompute(w: StepWorkload, which: Callable[[Stage], bool] | bool = True) -> int:
    """Give the forward-backward stage pairs ``which`` selects (a predicate on the forward :class:`Stage`, or all)
    the "recompute" memory strategy: the forward then keeps only its inputs (their bytes become its
    ``activation_bytes``) and the backward runs it again (its latency grows by the forward's).  Megatron's
    ``--recompute-granularity full``, per stage.  Returns how many pairs changed."""
    n = 0
    for k, st in w.graph.stages.items():
        if st.kind != "F" or st.strategy == "recompute" or not (which is True or (callable(which) and which(st))):
            continue
        b = w.graph.stages["B" + k[1:]]
        kept = _input_bytes(w, k)
        st.keep_bytes, st.recompute_extra, st.forced = st.activation_bytes, st.latency, True
        for x in (st, b):
            x.strategy = "recompute"
            x.activation_bytes = kept
        b.latency += st.latency
        n += 1
    return n


def memory_options(w: StepWorkload, fk: str) -> list[tuple[str, float, float]]:
    """The memory strategies forward ``fk``'s pair may take (DESIGN.md "Memory"; DIP §2.5's per-layer
    candidates): ``(strategy, bytes per GPU its forward keeps until the backward, seconds its backward grows by)``
    for "keep", "recompute:k" for every k in 1 .. blocks - 1 (the chunk's first k blocks recompute: their saved
    bytes are replaced by the chunk's inputs, their forward seconds join the backward) and "recompute" (the whole
    chunk, the inputs only).  Per-block seconds and bytes come from the compiled per-block costs on the device
    profile (:meth:`dipc.program.Program.block_costs`); without a profile the chunk's estimate is split evenly
    over its blocks.  The forward must still be at "keep"."""
    st = w.graph.stages[fk]
    if st.strategy != "keep":
        raise PlanError(f"memory options of {fk} are taken from its 'keep' costs; it is at {st.strategy!r}")
    prog = w.programs[fk]
    cm = prog.chunks[st.chunk]
    keep, f_lat = st.activation_bytes, st.latency
    inputs = _input_bytes(w, fk)
    out = [("keep", keep, 0.0)]
    blocks = prog.block_costs(st.chunk, w.bindings[fk])
    if blocks is None:
        n = max(cm.n_blocks, 1)
        blocks = [(1.0 / n, keep / n)] * n
    total_f = sum(f for f, _ in blocks) or 1.0
    done_f, kept_after = 0.0, sum(a for _, a in blocks)
    for k in range(1, len(blocks)):
        done_f += blocks[k - 1][0]
        kept_after -= blocks[k - 1][1]
        out.append((f"recompute:{k}", min(keep, inputs + max(kept_after, 0.0)), f_lat * done_f / total_f))
    if inputs < keep:
        out.append(("recompute", inputs, f_lat))
    return out


def _input_bytes(w: StepWorkload, fk: str) -> float:
    """Bytes per GPU of a forward stage's inputs: the values it receives and the batch keys it reads (divided by
    the cost model's ``tp_size``: with sequence parallelism each GPU of a stage keeps its shard)."""
    prog = w.programs[fk]
    st = w.graph.stages[fk]
    cm = prog.chunks[st.chunk]
    total = 0.0
    for inp in cm.inputs:
        if inp.kind == "batch":
            v = w.data[fk][inp.key]
            total += v.numel() * v.element_size()
        elif inp.kind == "value":
            for pk, pname in w.wiring[fk][inp.name]:
                meta = w.programs[pk].chunks[w.graph.stages[pk].chunk].output_meta[pname]
                n = 1
                for d in meta.concrete_shape(w.bindings[pk]):
                    n *= d
                total += n * meta.dtype.itemsize
    return total / w.tp_size


def workload_digest(w: StepWorkload) -> str:
    """SHA-256 of a step: every edge of its stage graph with the names, shapes and dtypes of the tensors it
    carries, and a position-weighted sum of each microbatch's integer tensors.  Ranks that traced the model alike
    and were given the same batch agree on it."""
    import hashlib

    h = hashlib.sha256()
    for e in sorted(w.graph.edges, key=lambda e: (e.src, e.dst)):
        h.update(f"{e.src}>{e.dst}:{[(t.name, t.shape, t.dtype) for t in e.tensors]};".encode())
    for mb in w.microbatches:  # and the batch: integer tensors (tokens, labels) by a position-weighted sum
        for k in sorted(mb.data):
            v = mb.data[k]
            if isinstance(v, torch.Tensor) and not v.is_floating_point() and v.numel():
                flat = v.reshape(-1).long().cpu()
                h.update(f"{k}:{int((flat * (torch.arange(flat.numel()) % 7919 + 1)).sum())};".encode())
    return h.hexdigest()


def step_digest(compiled, w: StepWorkload, forward_only: bool = False) -> str:
    """What every rank compares before a step runs: :func:`workload_digest` (with the autocast dtypes of its
    messages), marked for an evaluation plan and, for a model with dropout, with the model's mode."""
    mode = ("train-mode:" if compiled.model.training else "eval-mode:") if compiled.mode_dependent else ""
    return ("eval:" if forward_only else "") + mode + workload_digest(w)


def _units(compiled, data) -> float:
    """Work units of a whole-microbatch stage: elements of the first per-sample key (tokens for text)."""
    key = compiled.batch_spec.sample_key
    return float(data[key].numel()) if key else 1.0


def _example_units(compiled) -> dict[str, float]:
    ex = compiled.program.capture
    out = {}
    inst_of = {i.modality: i for i in compiled.batch_spec.instances}
    shapes = {}
    for n in ex.graph.nodes:
        if n.op == "placeholder" and n.name in ex.input_keys:
            v = n.meta.get("val")
            shapes[ex.input_keys[n.name]] = [int(s.node.hint) if isinstance(s, torch.SymInt) else int(s)
                                             for s in v.shape]
    key = compiled.batch_spec.sample_key
    tokens = 1
    for s in (shapes[key] if key in shapes else ()):
        tokens *= s
    for m in compiled.partition.modalities:
        if m in inst_of:
            out[m] = float(shapes[inst_of[m].keys[0]][0])
        else:
            out[m] = float(tokens)
    return out


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


# ---------------------------------------------------------------------------------------------------- executor
class Executor:
    """Runs one rank's actions of a plan.

    The chunk modules it runs are taken from the step's programs; forward outputs and the detached inputs that
    receive gradients are kept per stage until its backward.  Every action's ``(action, start, end, wait)`` in seconds
    since the step began (``wait``: the part of a compute action spent waiting for its messages) is recorded in
    :attr:`timeline` for traces and calibration.
    """

    def __init__(self, rank: int, workload: StepWorkload, plan: Plan, transport, chunk_modules: dict,
                 device: torch.device | None = None, yield_after_post: bool = False):
        self.rank = rank
        # gloo on CPU moves data on a background thread that competes with this rank's compute for its core: giving
        # the core away after posting lets it push the message out now instead of after the next OS time slice
        self.yield_after_post = yield_after_post and hasattr(os, "sched_yield")
        self.device = device or torch.device("cpu")
        self.w = workload
        self.plan = plan
        self.tr = transport
        self.mods = chunk_modules  # (program id, chunk) -> GraphModule
        self.outputs: dict[str, dict[str, torch.Tensor]] = {}
        self.leaves: dict[str, dict[str, torch.Tensor]] = {}
        self.saved: dict[str, tuple] = {}  # recompute stages: F key -> (inputs, RNG state at the forward)
        self.grads: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)   # F key -> output name -> grad
        self.out_grads: dict[tuple[str, str], dict[str, torch.Tensor]] = {}  # (F key, producer F key) -> grads
        self.recv: dict[int, tuple[list, list]] = {}
        self.inbox: dict[str, list[int]] = defaultdict(list)  # stage key -> message ids destined to it
        self.received: dict[str, dict[str, dict[str, torch.Tensor]]] = defaultdict(dict)  # stage -> peer -> tensors
        self.sends: list = []
        self.losses: dict[int, torch.Tensor] = {}
        self.timeline: list[tuple] = []  # (action, start, end, seconds of it spent waiting for messages)
        self.wait_s: dict[str, float] = {}
        self.posted: set[int] = set()  # message ids sent or whose receive is posted
        self.failure = None
        self.statuses: list[tuple] = []  # CUDA: (status word, action) of received messages, read at finish()
        self.uses: dict[str, int] = {}  # forward-only plans: F key -> reads of its outputs still to come on this rank
        if plan.forward_only:
            for a in plan.ranks[rank]:
                if a.kind == "SEND_F":
                    k = _fkey(a.chunk, a.mb, a.sub)
                    self.uses[k] = self.uses.get(k, 0) + 1
                elif a.kind == "F":
                    self.uses.setdefault(a.stage, 0)
                    for producers in workload.wiring.get(a.stage, {}).values():
                        for pk, _ in producers:
                            if workload.graph.stages[pk].rank == rank:
                                self.uses[pk] = self.uses.get(pk, 0) + 1
        self.t0 = time.perf_counter()

    def run(self, actions=None):
        """Run this rank's actions (default: all of its plan).  When one raises - here, or as an abort message from
        a peer that failed - the rest of the plan is drained before the exception goes on: every send still to come
        goes out as an abort message of the planned size (status = the first failing rank + 1, no data) and every
        receive still to come is posted and awaited, so that every peer either sees the abort in its next message
        from this rank or completes its own plan, and no operation is left unmatched in the process group
        (issue "Faults": a failure reaches every rank at once, not at the timeout).  ``self.failure`` keeps
        ``(action, exception)`` of the first failure."""
        acts = self.plan.ranks[self.rank] if actions is None else actions
        for i, a in enumerate(acts):
            try:
                self.do(a)
            except BaseException as e:
                origin = e.origin if isinstance(e, _PeerFailed) else self.rank
                self.failure = (a, e)
                self._drain(acts[i:], origin)
                raise

    def _drain(self, rest, origin: int) -> None:
        """After a failure: abort messages for the sends of ``rest`` not made yet, receives of ``rest`` posted, then
        every posted receive and send awaited (errors here are dropped: the first failure is what is reported)."""
        for a in rest:
            try:
                if a.kind in SENDS and a.msg not in self.posted:
                    buf = _pack([], a.tensors, self.device, status=origin + 1)
                    self.sends.append((self.tr.isend(buf, a.peer_rank, a.msg), buf))
                    self.posted.add(a.msg)
                elif a.kind in RECVS and a.msg not in self.posted:
                    self._recv(a)
            except Exception:  # noqa: BLE001 - a dead peer: its connection is gone
                pass
        for msg in list(self.recv):
            buf, work, a = self.recv.pop(msg)
            try:
                self.tr.wait(work, f"{a} (draining after a failure)")
            except Exception:  # noqa: BLE001
                pass
        self.inbox.clear()
        for work, _ in self.sends:
            try:
                self.tr.wait(work, "a send (draining after a failure)")
            except Exception:  # noqa: BLE001
                pass
        self.sends.clear()

    def do(self, a):
        t = time.perf_counter()
        if a.kind == "F":
            self._forward(a)
        elif a.kind == "B":
            self._backward(a)
        elif a.kind in SENDS:
            self._send(a)
            if self.yield_after_post:
                os.sched_yield()
        elif a.kind in RECVS:
            self._recv(a)
            if self.yield_after_post:
                os.sched_yield()
        else:
            raise PlanError(f"unknown action {a}")
        self.timeline.append((a, t - self.t0, time.perf_counter() - self.t0,
                              self.wait_s.get(a.stage, 0.0) if a.kind in ("F", "B") else 0.0))

    # -- communication
    def _send(self, a):
        fk = _fkey(a.chunk, a.mb, a.sub)
        if a.kind == "SEND_F":
            src = self.outputs[fk]
            if self.plan.forward_only:
                self._used(fk)
        else:
            src = self.out_grads.pop((fk, _fkey(a.peer_chunk, a.mb, a.peer_sub)))
        tensors = []
        for spec in a.tensors:
            t = src[spec.name].detach()
            if tuple(t.shape) != spec.shape or _dtype_name(t.dtype) != spec.dtype:
                raise PlanError(f"{a}: tensor {spec.name} is {tuple(t.shape)} {t.dtype}, the plan says {spec.shape} "
                                f"{spec.dtype}")
            tensors.append(t)
        buf = _pack(tensors, a.tensors, self.device)
        # a send's packed copy is freed once the transport has delivered it (not only at the end of the step)
        self.sends = [(w, b) for w, b in self.sends if not _completed(w)]
        self.sends.append((self.tr.isend(buf, a.peer_rank, a.msg), buf))
        self.posted.add(a.msg)

    def _recv(self, a):
        _, total = _layout(a.tensors)
        buf = torch.empty(total, dtype=torch.uint8, device=self.device)
        self.recv[a.msg] = (buf, self.tr.irecv(buf, a.peer_rank, a.msg), a)
        self.posted.add(a.msg)
        self.inbox[a.stage].append(a.msg)

    def _collect(self, stage: str):
        t = time.perf_counter()
        for msg in self.inbox.pop(stage, []):
            buf, work, a = self.recv.pop(msg)
            self.tr.wait(work, f"{a} from rank {a.peer_rank}")
            st = _status(buf)
            if buf.device.type == "cpu":  # an abort message: the peer (or one before it) failed
                code = int(st.item())
                if code:
                    raise _PeerFailed(code - 1, a)
            else:  # reading it now would wait for the device: checked at the end of the step
                self.statuses.append((st, a))
            self.received[stage][a.peer_stage] = _unpack(buf, a.tensors)
        self.wait_s[stage] = time.perf_counter() - t

    # -- compute
    def _forward(self, a):
        fk = _fkey(a.chunk, a.mb, a.sub)
        self._collect(fk)
        prog = self.w.programs[fk]
        cm = prog.chunks[a.chunk]
        view = self.w.data[fk]
        bind = self.w.bindings[fk]
        kwargs, leaves = {}, {}
        for inp in cm.inputs:
            if inp.kind == "batch":
                kwargs[inp.name] = view[inp.key]
            elif inp.kind == "sym":
                kwargs[inp.name] = int(inp.expr.xreplace(bind))
            else:
                parts, needs_grad = [], False
                for pk, pname in self.w.wiring[fk][inp.name]:
                    needs_grad |= self._meta(pk, pname).requires_grad
                    pr = self.w.graph.stages[pk].rank
                    parts.append(self.outputs[pk][pname] if pr == self.rank else self.received[fk][pk][pname])
                    if pr == self.rank and self.plan.forward_only:
                        self._used(pk)
                if not parts:
                    shape, dtype = self.w.empty[fk][inp.name]
                    t = torch.zeros(shape, dtype=dtype, device=self.device)
                else:
                    t = parts[0] if len(parts) == 1 else torch.cat([p.detach() for p in parts], dim=0)
                t = t.detach()
                if needs_grad and t.is_floating_point() and not self.plan.forward_only:  # no gradient for RoPE tables, masks, ...: autograd
                    t.requires_grad_(True)                 # then keeps nothing for them either
                    leaves[inp.name] = t
                kwargs[inp.name] = t
        mod = self.mods[(id(prog), a.chunk)]
        if self.plan.forward_only:  # evaluation: no autograd graph; outputs live until their last reader here
            with torch.no_grad():
                out = mod(**kwargs)
            if cm.loss is not None:
                self.losses[a.mb] = out[cm.loss].detach()
            self.received.pop(fk, None)
            self.outputs[fk] = out
            self._used(fk, 0)
            return
        if a.strategy == "recompute":  # keep the inputs only; the backward runs the chunk again
            self.saved[fk] = (kwargs, _rng_state(self.device))
            with torch.no_grad():
                out = mod(**kwargs)
        elif a.strategy != "keep":  # "recompute:k": the first k blocks under activation checkpointing
            with torch.enable_grad():
                out = self._prefix_module(prog, a.chunk, recomputed_blocks(a.strategy))(**kwargs)
        else:
            with torch.enable_grad():
                out = mod(**kwargs)
        self.outputs[fk] = out
        self.leaves[fk] = leaves
        if cm.loss is not None:
            self.losses[a.mb] = out[cm.loss].detach()
        self.received.pop(fk, None)

    def _used(self, fk: str, n: int = 1) -> None:
        """Forward-only plans: one read of ``fk``'s outputs is done; they are dropped after the last one."""
        left = self.uses.get(fk, 0) - n
        self.uses[fk] = left
        if left <= 0:
            self.outputs.pop(fk, None)

    def _backward(self, a):
        fk = _fkey(a.chunk, a.mb, a.sub)
        bk = stage_key("B", a.chunk, a.mb, a.sub)
        self._collect(bk)
        prog = self.w.programs[fk]
        cm = prog.chunks[a.chunk]
        out = self.outputs.pop(fk)
        if a.strategy == "recompute":
            kwargs, rng = self.saved.pop(fk)
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []), \
                    torch.enable_grad():
                _set_rng_state(rng, self.device)
                out = self.mods[(id(prog), a.chunk)](**kwargs)
        g = self.grads.pop(fk, {})
        for tensors in self.received.pop(bk, {}).values():
            for name, t in tensors.items():
                g[name] = g[name] + t if name in g else t
        tensors, grads = [], []
        if cm.loss is not None and out[cm.loss].requires_grad:
            mb = self.w.microbatches[a.mb]
            tensors.append(out[cm.loss])
            grads.append(torch.full_like(out[cm.loss], mb.weight))
        for name, t in out.items():
            if name in g and isinstance(t, torch.Tensor) and t.requires_grad:
                tensors.append(t)
                grads.append(g[name])
        if tensors:
            torch.autograd.backward(tensors, grads)
        leaves = self.leaves.pop(fk)
        for name, leaf in leaves.items():
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            producers = self.w.wiring[fk][name]
            sizes = [self.outputs_shape(pk, pname)[0] for pk, pname in producers] if len(producers) > 1 else None
            pieces = torch.split(grad, sizes, dim=0) if sizes else [grad]
            for (pk, pname), piece in zip(producers, pieces):
                pr = self.w.graph.stages[pk].rank
                if pr == self.rank:
                    d = self.grads[pk]
                    d[pname] = d[pname] + piece if pname in d else piece
                else:
                    self.out_grads.setdefault((fk, pk), {})[pname] = piece

    def _prefix_module(self, prog, chunk: int, k: int):
        """The chunk's module with its first ``k`` blocks checkpointed (:func:`dipc.codegen.stage.recompute_prefix`),
        built on first use and kept with the chunk modules."""
        gm = self.mods[(id(prog), chunk)]
        cache = gm.__dict__.setdefault("_dipc_recompute_prefix", {})
        if k not in cache:
            cache[k] = recompute_prefix(gm, k)
        return cache[k]

    def _meta(self, pk, pname):
        return self.w.programs[pk].chunks[self.w.graph.stages[pk].chunk].output_meta[pname]

    def outputs_shape(self, pk, pname):
        return self._meta(pk, pname).concrete_shape(self.w.bindings[pk])

    def finish(self):
        """Wait for this rank's sends; on CUDA, check the status words of the step's messages (one device wait).

        Raises:
            _PeerFailed: a message was an abort message (CUDA: its data was garbage and so is this step's)."""
        for work, _ in self.sends:
            self.tr.wait(work, "a send")
        self.sends.clear()
        if self.statuses:
            codes = torch.cat([st for st, _ in self.statuses]).cpu().tolist()
            bad = [(c, a) for c, (_, a) in zip(codes, self.statuses) if c]
            self.statuses.clear()
            if bad:
                raise _PeerFailed(bad[0][0] - 1, bad[0][1])


# ---------------------------------------------------------------------------------------------------- planning
def check_memory_limit(memory_limit) -> float | None:
    """``memory_limit`` as a float, or None.

    Raises:
        ValueError: not None and not a finite number > 0 (a bool, a list, a string, NaN, infinity, <= 0), naming
            the value.
    """
    import math

    if memory_limit is None:
        return None
    if isinstance(memory_limit, bool) or not isinstance(memory_limit, (int, float)) \
            or not math.isfinite(memory_limit) or memory_limit <= 0:
        raise ValueError(f"memory_limit must be a finite number of bytes per device > 0 (or None for the device "
                         f"profile's capacity), got {memory_limit!r}")
    return float(memory_limit)


def activation_budget(compiled, memory_limit: float | None = None, optimizer_states: int = 2,
                      static_bytes=None) -> list[float | None]:
    """Per rank, the bytes of activations a plan may keep live: ``memory_limit`` (bytes per device; default the
    device profile's ``memory_capacity``) less the rank's static bytes (parameters, gradients and
    ``optimizer_states`` optimizer tensors per parameter, :meth:`dipc.CompiledPipeline.rank_state_bytes`; the
    runtime budgets for AdamW's 2; ``static_bytes``: per rank, given instead); ``None`` per rank when neither is
    known.

    Raises:
        ValueError: a bad ``memory_limit`` (:func:`check_memory_limit`) or ``optimizer_states`` (not an int >= 0).
        PlanError: a rank's static bytes alone exceed the limit.
    """
    dev = compiled.device
    memory_limit = check_memory_limit(memory_limit)
    if isinstance(optimizer_states, bool) or not isinstance(optimizer_states, int) or optimizer_states < 0:
        raise ValueError(f"optimizer_states must be an int >= 0 (tensors per parameter), got {optimizer_states!r}")
    cap = memory_limit if memory_limit is not None else (dev.memory_capacity if dev is not None else None)
    if cap is None:
        return [None] * compiled.pp_size
    static = list(static_bytes) if static_bytes is not None else compiled.rank_state_bytes(optimizer_states)
    out = []
    for r, st in enumerate(static):
        if st > cap:
            raise PlanError(f"rank {r} holds {st:.4g} bytes of parameters, gradients and optimizer states, over the "
                            f"memory limit of {cap:.4g} bytes before any activation")
        out.append(cap - st)
    return out


def make_plan(compiled, workload: StepWorkload, step: int, *, check: bool = True,
              memory_limit: float | None = None, schedule: str = "dip", optimizer_states: int = 2,
              budget_s: float = 0.0, seed: int = 0, memory_opt: str = "ilp", static_bytes=None) -> Plan:
    """Schedule a step and lower it to a plan, checked with :func:`dipc.plan.validate` unless ``check`` is False
    (for callers that validate it themselves).

    ``schedule``: a template of :func:`dipc.schedules` (:mod:`dipc.codegen.templates`).  "dip" (default) is the
    dual-queue list scheduler (DIP §2.4); under each rank's activation budget (:func:`activation_budget`) the
    fastest simulated of several memory-feasible candidates (:func:`_interleave`).  The static templates fix
    each rank's order first (Optimus: encoder forwards first, then the list scheduler without a limit), then switch
    stages to recompute until every rank fits its budget (:func:`dipc.schedule.fit_by_recompute`).  The plan's
    ``simulated`` records ``schedule`` and ``recomputed`` (the forward-backward pairs that recompute).  The workload
    must have been split as the template needs (:func:`split_for`).

    ``memory_opt``: under a limit, how the pairs' memory strategies are chosen: "ilp" (default: DIP's per-rank
    ILP over keep / per-layer / full recompute, :func:`dipc.planner.memory.optimize_memory`) or "greedy" (whole
    chunks recompute at each peak, then go back to keep where memory is left: the previous planner, for the
    ablation).  ``budget_s`` > 0 (DIP only): then MCTS reorders the (microbatch, modality) groups' priorities for
    up to that many seconds (:func:`dipc.planner.search.search_priorities`, DIP §2.3, deterministic under ``seed``
    when the budget does not cut it), and the plan is the better of the search's and the interleaver's; its
    progress is in ``plan.simulated["search"]``.

    Raises:
        ValueError: unknown ``schedule`` or ``memory_opt``, ``budget_s`` < 0.
        PlanError: a rank cannot fit its stages even recomputed, or the plan is invalid.
    """
    if memory_opt not in ("ilp", "greedy"):
        raise ValueError(f"memory_opt must be 'ilp' or 'greedy', got {memory_opt!r}")
    if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or not 0 <= budget_s < math.inf:
        raise ValueError(f"budget_s must be a number >= 0 (seconds), got {budget_s!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    from .codegen.templates import encoder_first_edges, fixed_order, template

    t = template(schedule)
    if budget_s > 0 and t.kind != "interleave":
        raise ValueError(f"budget_s (the MCTS search) applies to schedule 'dip' only, not to the fixed template "
                         f"{schedule!r}")
    chunk_ranks = [c.rank for c in compiled.partition.chunks]
    dev = compiled.device
    T = compiled.tp_size  # each of a stage's T GPUs sends its shard over its own link
    comm = (lambda e: dev.p2p_time(sum(t.nbytes for t in e.tensors) / T)) if dev is not None else None
    limits = activation_budget(compiled, memory_limit, optimizer_states, static_bytes)
    static = list(static_bytes) if static_bytes is not None else compiled.rank_state_bytes(optimizer_states)
    graph = workload.graph
    P = compiled.pp_size

    inputs: dict[str, float] = {}

    def recompute_cost(st):
        if st.key not in inputs:
            inputs[st.key] = _input_bytes(workload, st.key)
        return inputs[st.key], st.latency

    limited = any(x is not None for x in limits)
    ilp = memory_opt == "ilp"
    if limited and ilp:  # the candidates of DIP's memory optimisation (§2.5), per forward-backward pair
        for k, st in graph.stages.items():
            if st.kind == "F" and st.strategy == "keep":
                st.options = tuple(memory_options(workload, k))
    budgets = list(limits)
    if limited:  # transients and message buffers come out of the activation budget (DESIGN.md "Memory")
        reserve = _buffer_reserve(workload, P)
        limits = [None if x is None else x - reserve[r] for r, x in enumerate(limits)]
        for r, x in enumerate(limits):
            if x is not None and x <= 0:
                raise PlanError(f"rank {r} has no memory left for activations: its budget of {budgets[r]:.4g} bytes "
                                f"(the memory limit less its static state) is under the {reserve[r]:.4g} bytes its "
                                "largest stage's transient, the activations a recomputing backward rebuilds and its "
                                "message buffers need")
    pristine = _copy_stages(graph) if limited or budget_s > 0 else None
    search = None

    def plan_once(limits):
        if t.kind == "interleave" and not limited:  # the common path: one list schedule
            sched = list_schedule(graph, P, comm_time=comm)
        elif t.kind == "interleave":
            chunk_order, encoders = _virtual_stages(compiled)
            first = [Edge(src=a, dst=b) for a, b in encoder_first_edges(graph.stages, P, encoders, chunk_order)]
            seeds = [fixed_order(n, graph.stages, P, encoders, chunk_order) for n in ("1f1b", "mimo")]
            sched = _interleave(graph, P, comm, limits, recompute_cost, first, seeds, ilp=ilp)
        else:
            chunk_order, encoders = _virtual_stages(compiled)
            if t.kind == "fixed":
                order = fixed_order(t.name, graph.stages, P, encoders, chunk_order)
            else:  # encoder_first: the list scheduler on the graph with the precedence edges, no limit
                extra = [Edge(src=a, dst=b) for a, b in encoder_first_edges(graph.stages, P, encoders, chunk_order)]
                order = _encoder_first_order(graph, P, comm, extra)
            if limited:  # the recompute its users turn on: per chunk for all microbatches (Optimus: per pair)
                fit_by_recompute(graph, order, limits, recompute_cost, uniform=t.kind == "fixed")  # whole chunks
                if ilp:
                    optimize_memory(graph, order, limits, uniform=t.kind == "fixed")  # the fewest layers that fit
            sched = timed_schedule(graph, order, comm_time=comm)
        return sched

    def over_limit(sched) -> list[float]:
        """Per rank, bytes the simulated plan (transients and buffers timed) is over its limit."""
        from .simulate import simulate_workload

        res = simulate_workload(compiled, workload, lower(graph, sched, chunk_ranks, step=step),
                                static_bytes=static)
        return [0.0 if budgets[r] is None else res.peak_memory[r] - static[r] - budgets[r] for r in range(P)]

    tol = 1e-9 * max((x or 0.0 for x in budgets), default=0.0)
    try:
        sched = plan_once(limits)
        for attempt in range(MEMORY_ATTEMPTS if limited else 0):  # checked in the simulator, re-made smaller
            over = over_limit(sched)
            if max(over) <= tol:
                break
            r = max(range(P), key=lambda r: over[r])
            # each retry takes more off: the planner's own estimate may have had slack the overshoot did not show
            limits = [None if x is None else x - 1.05 * (2 ** attempt) * max(over[q], 0.0)
                      for q, x in enumerate(limits)]
            if attempt == MEMORY_ATTEMPTS - 1 or any(x is not None and x <= 0 for x in limits):
                raise PlanError(f"rank {r}'s plan stays {over[r]:.4g} bytes over its memory limit once its stages' "
                                f"transients and message buffers are counted ({attempt + 1} plans tried)")
            _take(graph, pristine)
            sched = plan_once(limits)
    except PlanError as e:
        if not limited:
            raise
        net = ", ".join(f"rank {r}: {limits[r]:.4g}" for r in range(P) if limits[r] is not None)
        raise PlanError(f"{e} [activation budgets net of each rank's reserve for transients and message buffers: "
                        f"{net} bytes]") from None
    if t.kind == "interleave" and budget_s > 0:  # DIP §2.3: MCTS over the groups' priorities, once, verified
        from .planner.search import search_priorities

        found, search = search_priorities(pristine or _copy_stages(graph), P, comm, limits if limited else None,
                                          recompute_cost, budget_s, seed, ilp=ilp)
        # the search's plan only when it is really faster (not a rounding difference of the same schedule) and,
        # under a limit, fits once simulated with its transients and buffers; else the interleaver's stays
        if found is not None and found[0].iteration_time < sched.iteration_time * (1 - 1e-9):
            kept = _copy_stages(graph)
            _take(graph, found[1])
            if limited and max(over_limit(found[0])) > tol:
                _take(graph, kept)
            else:
                sched = found[0]
                search.improved = True
    plan = lower(graph, sched, chunk_ranks, step=step,
                 microbatches=[mb.meta() for mb in workload.microbatches])
    plan.simulated["schedule"] = t.name
    if search is not None:
        plan.simulated["search"] = {"rollouts": search.rollouts, "iterations": search.iterations,
                                    "exhausted": search.exhausted, "seconds": search.seconds,
                                    "best_over_time": search.history, "improved": bool(search.improved)}
    plan.simulated["recomputed"] = sum(1 for s in graph.stages.values() if s.kind == "F" and s.strategy != "keep")
    plan.simulated["recomputed_partly"] = sum(1 for s in graph.stages.values()
                                              if s.kind == "F" and s.strategy.startswith("recompute:"))
    if check:
        validate(plan)
        plan._validated = plan.digest()  # given back to PipelineRuntime.step unchanged, it is not validated again
    return plan


def _virtual_stages(compiled) -> tuple[list[int], list[str]]:
    """(chunks in topological order, the encoder modalities: every one but the loss chunk's)."""
    chunk_order = compiled.chunk_order()
    backbone = compiled.partition.chunks[chunk_order[-1]].modality
    return chunk_order, [m for m in compiled.partition.modalities if m != backbone]


def _encoder_first_order(graph: StageGraph, P: int, comm, extra: list[Edge]) -> list[list[str]]:
    """Per-rank order of the list scheduler (no limit) on ``graph`` plus the precedence edges ``extra``
    (:func:`dipc.codegen.templates.encoder_first_edges`: Optimus' coarse order)."""
    return list_schedule(StageGraph(stages=graph.stages, edges=graph.edges + extra), P, comm_time=comm).order


def _copy_stages(graph: StageGraph) -> StageGraph:
    return StageGraph(stages={k: dataclasses.replace(st) for k, st in graph.stages.items()}, edges=graph.edges)


#: plans :func:`make_plan` makes under a limit until the simulated one (transients and buffers timed) fits
MEMORY_ATTEMPTS = 6

#: in-flight windows DIP's planner tries under a memory limit, in multiples of P
WINDOWS = (1.5, 2, 3, 4)


def _buffer_reserve(w: StepWorkload, P: int) -> list[float]:
    """Per rank, bytes per GPU kept out of the activation budget for what lives only around a stage: the largest
    stage's transient plus the messages it receives, the largest activations a recomputing backward rebuilds,
    another stage's receives (posted one action ahead) and two sends' packed copies in flight (DESIGN.md "Memory";
    the simulator then checks the plan with every buffer timed)."""
    T = w.tp_size
    recv: dict[str, float] = defaultdict(float)
    send: dict[str, float] = defaultdict(float)
    for e in w.graph.edges:
        if e.tensors:
            nb = sum(t.nbytes for t in e.tensors) / T
            recv[e.dst] += nb
            send[e.src] += nb
    out = []
    for r in range(P):
        ks = [k for k, st in w.graph.stages.items() if st.rank == r]
        top = max((w.graph.stages[k].transient_bytes + recv[k] for k in ks), default=0.0)
        # a backward that recomputes holds again what its forward did not keep (at most the chunk's activations
        # less its inputs): any pair may be made to recompute, so the largest is kept free
        again = max((w.graph.stages[k].activation_bytes - _input_bytes(w, k) for k in ks
                     if w.graph.stages[k].kind == "F" and w.graph.stages[k].strategy == "keep"), default=0.0)
        forced = max((w.graph.stages[k].keep_bytes - w.graph.stages[k].activation_bytes for k in ks
                      if w.graph.stages[k].kind == "F" and w.graph.stages[k].keep_bytes is not None), default=0.0)
        out.append(top + max(again, forced, 0.0) + max((recv[k] for k in ks), default=0.0)
                   + 2 * max((send[k] for k in ks), default=0.0))
    return out


def _take(graph: StageGraph, g: StageGraph) -> None:
    """Copy the strategies and latencies a planning candidate ``g`` chose into ``graph``."""
    for k, st in g.stages.items():
        o = graph.stages[k]
        o.strategy, o.activation_bytes, o.latency = st.strategy, st.activation_bytes, st.latency
        o.keep_bytes, o.recompute_extra, o.priority = st.keep_bytes, st.recompute_extra, st.priority


def _interleave(graph: StageGraph, P: int, comm, limits, recompute_cost, encoder_first=None, seeds=(), *,
                ilp: bool = True):
    """DIP's dual-queue interleaving (§2.4) under the ranks' activation budgets (without one, :func:`make_plan`
    runs one list schedule): the best simulated of a few candidates (a first, fixed search over orders; the MCTS
    priorities and the memory ILP are the next issue's): the memory-aware admission (forwards wait for memory; the
    oldest recomputes when it does not fit), and orders made without a limit - each window W in :data:`WINDOWS`
    (W x P microbatches in flight per rank), the encoder-first order (``encoder_first``: the extra precedence
    edges, Optimus' coarse order) and ``seeds`` (fixed per-rank orders: the 1F1B and MIMO templates' orders on
    these sub-microbatched stages) - whose stages then recompute until they fit
    (:func:`dipc.schedule.fit_by_recompute`) and go back to "keep" where memory is left
    (:func:`dipc.schedule.relax_recompute`, a greedy phase 3).  The chosen candidate's strategies and latencies are
    written into ``graph``.

    Raises:
        PlanError: no candidate fits (the first error met).
    """
    cands, errs = [], []
    g = _copy_stages(graph)
    try:
        first = list_schedule(g, P, comm_time=comm, memory_limit=limits, recompute_cost=recompute_cost)
        if ilp and optimize_memory(g, first.order, limits)["solved"]:
            first = timed_schedule(g, first.order, comm_time=comm)
        cands.append((first, g))
    except PlanError as e:
        errs.append(e)
    orders = [dict(window=max(1, round(w * P))) for w in WINDOWS]
    if encoder_first:
        orders.append(dict(extra=encoder_first))
    orders += [dict(fixed=s) for s in seeds]
    for o in orders:
        g = _copy_stages(graph)
        if "fixed" in o:
            order = o["fixed"]
        elif "extra" in o:
            order = _encoder_first_order(g, P, comm, o["extra"])
        else:
            order = list_schedule(g, P, comm_time=comm, window=o["window"]).order
        try:  # a candidate that cannot fit, or a seed that deadlocks on these stages, is skipped
            fit_by_recompute(g, order, limits, recompute_cost)  # the greedy fit: kept where the ILP finds nothing
            relax_recompute(g, order, limits)
            if ilp:
                optimize_memory(g, order, limits)
            cands.append((timed_schedule(g, order, comm_time=comm), g))
        except PlanError as e:
            errs.append(e)
    if not cands:
        raise errs[0]
    sched, g = min(cands, key=lambda c: c[0].iteration_time)
    _take(graph, g)
    return sched


def split_for(compiled, batch, n_microbatches: int, schedule: str = "dip") -> list[Microbatch]:
    """``compiled.batch_spec.split`` as ``schedule`` needs it: sub-microbatches for DIP, the encoders on each
    microbatch whole for the static templates.

    Raises:
        ValueError: unknown ``schedule``.
        dipc.batch.BatchError: see :meth:`dipc.batch.BatchSpec.split`.
    """
    from .codegen.templates import template

    whole = not template(schedule).sub_microbatches
    return compiled.batch_spec.split(batch, n_microbatches, whole_instances=whole)


def _modules_of(workload: StepWorkload, ranks) -> dict:
    mods = {}
    for k, prog in workload.programs.items():
        st = workload.graph.stages[k]
        if st.rank in ranks:
            gm = prog.chunks[st.chunk].gm
            if gm is None:
                raise PlanError(f"chunk {st.chunk} has no module built in this process")
            mods[(id(prog), st.chunk)] = gm
    return mods


def zero_unreached_grads(compiled, w: StepWorkload, ranks) -> None:
    """Parameters of ``ranks``' chunks in this step's captures get a zero gradient when no stage reached them
    (e.g. the encoder of a step without images, which the unsplit model runs on an empty tensor), as autograd gives
    the unsplit model; parameters outside those captures keep ``None``, as there (e.g. HF LLaVA's vision tower
    when ``pixel_values`` is None)."""
    seen = set()
    for prog in w.programs.values():
        if id(prog) in seen:
            continue
        seen.add(id(prog))
        for c, cm in prog.chunks.items():
            if compiled.partition.chunks[c].rank not in ranks:
                continue
            for name in cm.state_names:
                t = compiled._state.get(name)
                if (name in prog.loss_params and isinstance(t, torch.nn.Parameter) and t.requires_grad
                        and t.grad is None):
                    t.grad = torch.zeros_like(t)


def run_local(compiled, batch: Mapping[str, torch.Tensor], n_microbatches: int, plan: Plan | None = None,
              recompute: Callable[[Stage], bool] | bool = False, memory_limit: float | None = None,
              schedule: str = "dip", **planning):
    """Execute one step of every rank in this process and return ``(loss, plan)``.

    Gradients accumulate into the model's parameters exactly as the distributed pipeline's would (tied weights
    included, since every rank's chunks share the model's parameter objects here).  ``recompute``: the stages
    that recompute (:func:`set_recompute`); ``memory_limit``: bytes per device the plan stays under
    (:func:`make_plan`); ``schedule``: a template of :func:`dipc.schedules`; ``planning``: the other options of
    :func:`make_plan` (``budget_s``, ``seed``, ``memory_opt``).  Under ``torch.autocast("cpu", ...)`` the chunks run
    under it and the messages carry its dtypes.
    """
    mbs = split_for(compiled, batch, n_microbatches, schedule)
    w = build_workload(compiled, mbs, autocast_state(torch.device("cpu")))
    if recompute:
        set_recompute(w, recompute)
    if plan is not None:  # a plan made for another batch or microbatch count would fail deep in the executor
        want = {k for k in w.graph.stages}
        have = {a.stage for _, a in plan.compute_actions()}
        if want != have:
            missing, extra = sorted(want - have)[:3], sorted(have - want)[:3]
            raise PlanError(f"the plan is not for this batch split into {n_microbatches} microbatches: its stages "
                            f"miss {missing} and have {extra} this step does not")
    plan = plan or make_plan(compiled, w, 0, check=False, memory_limit=memory_limit, schedule=schedule, **planning)
    order = validate(plan)
    tr = _LocalTransport()
    ex = [Executor(r, w, plan, tr.bind(r), _modules_of(w, {r})) for r in range(compiled.pp_size)]
    for r, i in order:
        ex[r].do(plan.ranks[r][i])
    for e in ex:
        e.finish()
    zero_unreached_grads(compiled, w, set(range(compiled.pp_size)))
    loss = sum(mb.weight * l for e in ex for m, l in e.losses.items() for mb in [mbs[m]])
    return loss, plan


# ---------------------------------------------------------------------------------------------------- runtime
class PipelineRuntime:
    """One rank's view of a compiled pipeline: its chunk modules, the planner and the executor.

    Use ``pipe.parameters()`` for the optimizer and ``loss = pipe.step(batch)`` per training step; the loss is the
    whole batch's (same value on every rank) and the gradients are in this rank's parameters' ``.grad``.

    Raises (constructor):
        RuntimeError: torch.distributed is not initialised or the group size is not ``pp_size``.
    """

    def __init__(self, compiled, group=None, n_microbatches: int | None = None, timeout: float = 300.0,
                 recompute: bool = False, memory_limit: float | None = None, schedule: str = "dip",
                 budget_s: float = 0.0, seed: int = 0, fallback_schedule: str = "1f1b", plan_wait_s: float = 1.0):
        from .codegen.templates import template

        template(schedule)  # unknown names, bad limits and budgets raise here, on every rank
        template(fallback_schedule)
        if isinstance(plan_wait_s, bool) or not isinstance(plan_wait_s, (int, float)) or \
                not 0 <= plan_wait_s < math.inf:
            raise ValueError(f"plan_wait_s must be a finite number of seconds >= 0, got {plan_wait_s!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
        if n_microbatches is not None and (isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int)
                                           or n_microbatches < 1):
            raise ValueError(f"n_microbatches must be an int >= 1, got {n_microbatches!r}")
        self.fallback_schedule, self.plan_wait_s = fallback_schedule, float(plan_wait_s)
        memory_limit = check_memory_limit(memory_limit)
        if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or not 0 <= budget_s < math.inf:
            raise ValueError(f"budget_s must be a finite number of seconds >= 0, got {budget_s!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.budget_s, self.seed = float(budget_s), seed
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("dipc runtime needs an initialised process group: call "
                               "torch.distributed.init_process_group('gloo') (or 'nccl') first; torchrun sets the "
                               "environment it reads, dipc.launch.spawn also initialises it. Compiling and inspecting "
                               "need no process group")
        self.compiled = compiled
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if self.world != compiled.pp_size:
            raise RuntimeError(f"the process group has {self.world} ranks but the pipeline was compiled for "
                               f"pp_size={compiled.pp_size}")
        self.n_microbatches = 2 * compiled.pp_size if n_microbatches is None else n_microbatches
        self.timeout = timeout
        self.recompute = recompute
        self.memory_limit = memory_limit
        self.schedule = schedule
        self.transport = _DistTransport(group, timeout)
        # NCCL moves CUDA tensors: receive buffers and batches go to this process's current CUDA device
        self.device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl"
                       else torch.device("cpu"))
        self.step_index = 0
        self.last_plan: Plan | None = None
        self.last_timeline: list = []
        self.last_timing: dict = {}
        self.last_report: StepReport | None = None
        self.fallbacks = 0  # steps whose background plan missed its deadline, failed or died (DIP §2.2)
        self._broken = ""  # where the process group broke (a StepFailed with usable=False)
        self._planner = None  # rank 0's BackgroundPlanner, started by the first step given a next batch
        self._plan_info: dict = {}
        self._setup_params()

    # -- parameters
    def _setup_params(self):
        comp = self.compiled
        names_by_id: dict[int, list[str]] = defaultdict(list)
        for n, p in comp.model.named_parameters(remove_duplicate=False):
            names_by_id[id(p)].append(n)
        self._param_obj = {id(p): p for p in comp.model.parameters()}
        ranks_by_id: dict[int, set] = defaultdict(set)
        for c in comp.partition.chunks:
            for n in comp.chunk_params(c.index):
                ranks_by_id[id(comp._state[n])].add(c.rank)
        for pid in self._param_obj:  # parameters the loss does not reach live on rank 0 (kept for state_dict)
            if not ranks_by_id[pid]:
                ranks_by_id[pid].add(0)
        self._names_by_id = names_by_id
        self._ranks_by_id = ranks_by_id
        self.local_param_ids = [pid for pid in self._param_obj if self.rank in ranks_by_id[pid]]
        self._tied: list[tuple[list[int], object]] = []
        groups = {}
        for pid in self._param_obj:  # same order on every rank (model order)
            rs = tuple(sorted(ranks_by_id[pid]))
            if len(rs) > 1 and rs not in groups:
                # only the member ranks create it, so pipelines inside a larger world (DP x PP) do not wait on
                # each other
                groups[rs] = dist.new_group([dist.get_global_rank(self.group, r) if self.group else r for r in rs],
                                            use_local_synchronization=True)
        self._tied = [(pid, groups[tuple(sorted(ranks_by_id[pid]))]) for pid in self.local_param_ids
                      if len(ranks_by_id[pid]) > 1]
        buf_ids = set()
        for c in comp.partition.chunks:
            if c.rank == self.rank and c.index in comp.program.chunks:
                for n in comp.program.chunks[c.index].state_names:
                    buf_ids.add(n)
        self._local_state_names = buf_ids

    def parameters(self):
        """This rank's parameters (each once), for the optimizer."""
        return [self._param_obj[pid] for pid in self.local_param_ids]

    def named_parameters(self):
        """``(original fully qualified name, parameter)`` for this rank's parameters."""
        return [(self._names_by_id[pid][0], self._param_obj[pid]) for pid in self.local_param_ids]

    @property
    def training(self) -> bool:
        """The model's mode (``nn.Module.training``)."""
        return self.compiled.model.training

    def train(self, mode: bool = True) -> "PipelineRuntime":
        """Set the model's mode, as ``nn.Module.train``: the chunks of later steps run the graphs captured in that
        mode (a model with dropout, :attr:`dipc.compiler.CompiledPipeline.mode_dependent`, is captured once per
        mode and shape on first use; others run the same graphs in both).  Whether a step runs backward follows
        the grad mode or the call (:meth:`eval_step`), not this.  Call it on every rank alike (a rank in the
        other mode traces another graph: the plan check raises on every rank).  Returns this runtime."""
        if not isinstance(mode, bool):
            raise ValueError(f"train(mode): mode must be a bool, got {mode!r}")
        self.compiled.model.train(mode)
        return self

    def eval(self) -> "PipelineRuntime":
        """``train(False)``."""
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear this rank's parameters' gradients (as ``torch.nn.Module.zero_grad``)."""
        for p in self.parameters():
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
                        ) -> torch.Tensor:
        """Clip the whole pipeline's gradients by their global norm, as ``torch.nn.utils.clip_grad_norm_`` does on
        the unsplit model (a collective: call it on every rank, after ``step``).

        Each rank adds its parameters' ``|g|^p`` (a tied weight, whose gradient every holding rank has after the
        step, is counted once, by its lowest rank; ``norm_type=inf``: the largest ``|g|``), one all-reduce gives the
        global norm, and every rank scales its gradients by the same ``min(1, max_norm / (norm + 1e-6))``.  Calling
        ``torch.nn.utils.clip_grad_norm_(pipe.parameters(), ...)`` instead clips each rank by its own part's norm:
        the ranks then clip by different factors and training differs from the unsplit model.

        Returns:
            the global gradient norm (0-dim float32 tensor), the same on every rank.

        Raises:
            ValueError: ``max_norm`` is not a number >= 0, or ``norm_type`` not a number > 0.
            RuntimeError: ``error_if_nonfinite`` and the norm is NaN or infinite (on every rank, before any
                gradient changes).
        """
        from .wire import _wait

        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm >= 0:
            raise ValueError(f"max_norm must be a number >= 0, got {max_norm!r}")
        if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type > 0:
            raise ValueError(f"norm_type must be a number > 0 (or math.inf), got {norm_type!r}")
        p_ = float(norm_type)
        counted = [self._param_obj[pid].grad for pid in self.local_param_ids
                   if self._param_obj[pid].grad is not None and min(self._ranks_by_id[pid]) == self.rank]
        if p_ == math.inf:
            local = max((g.detach().abs().max().to(torch.float64) for g in counted if g.numel()),
                        default=torch.zeros((), dtype=torch.float64))
            op = dist.ReduceOp.MAX
        else:
            local = sum((torch.linalg.vector_norm(g.detach().to(torch.float64), p_) ** p_ for g in counted),
                        torch.zeros((), dtype=torch.float64))
            op = dist.ReduceOp.SUM
        total = local.reshape(1).to(self.device)
        _wait(dist.all_reduce(total, op=op, group=self.group, async_op=True), self.timeout,
              "every rank's gradient norm")
        norm = (total[0] if p_ == math.inf else total[0] ** (1.0 / p_)).to(torch.float32).cpu()
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"the total norm of order {norm_type} of the pipeline's gradients is {float(norm)}: "
                               "non-finite, so clip_grad_norm_ cannot clip them (error_if_nonfinite=True)")
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in self.parameters():
            if p.grad is not None:
                p.grad.detach().mul_(coef.to(p.grad.device, p.grad.dtype))
        return norm

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Load this rank's parameters and buffers from ``state_dict`` under the original names (e.g. a full
        checkpoint of the unsplit model, or :meth:`state_dict` of this rank); entries of other ranks are ignored.
        Copies in place (the optimizer keeps its parameter objects).

        Raises:
            KeyError: ``strict`` and one of this rank's entries is missing (all of them named), or a name is not the
                model's.
            ValueError: an entry's shape differs from the model's (named), before anything is copied.
        """
        mine = self.state_dict_names()
        known = set(self.compiled.model.state_dict(keep_vars=True))
        unknown = sorted(set(state_dict) - known)
        missing = sorted(n for n in mine if n not in state_dict)
        if strict and (unknown or missing):
            raise KeyError(f"load_state_dict(strict=True): missing {missing[:10]}{'...' if len(missing) > 10 else ''}"
                           f", unexpected {unknown[:10]}{'...' if len(unknown) > 10 else ''}")
        targets = dict(self.compiled.model.state_dict(keep_vars=True))
        for n, t in mine.items():
            if n in state_dict and tuple(state_dict[n].shape) != tuple(t.shape):
                raise ValueError(f"{n}: the state dict holds shape {tuple(state_dict[n].shape)}, the model "
                                 f"{tuple(t.shape)}")
        with torch.no_grad():
            for n in mine:
                if n in state_dict:
                    targets[n].copy_(state_dict[n].to(targets[n].device, targets[n].dtype))

    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load this rank's part of a full state dict (:meth:`full_state_dict`, or the unsplit model's
        ``state_dict()``) that must hold every entry of the model, not only this rank's.

        Raises:
            KeyError: an entry of the model is missing or a name is not the model's (named).
            ValueError: an entry's shape differs from the model's (named), before anything is copied.
        """
        want = set(self.compiled.model.state_dict(keep_vars=True))
        missing, unknown = sorted(want - set(state_dict)), sorted(set(state_dict) - want)
        if missing or unknown:
            raise KeyError(f"load_full_state_dict: the state dict misses {missing[:10]}"
                           f"{'...' if len(missing) > 10 else ''} and has unexpected {unknown[:10]}"
                           f"{'...' if len(unknown) > 10 else ''} (a full state dict holds every rank's entries)")
        self.load_state_dict(state_dict, strict=True)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """``optimizer``'s state (an optimizer over :meth:`parameters`) keyed by the original parameter names, in
        torch.distributed.checkpoint's flattened form (``state.<name>.exp_avg``, ``param_groups.<name>.lr``):
        ``get_optimizer_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))``
        on the whole model, so the unsplit model's optimizer and one at any pp size read it alike (a tied weight's
        ranks hold the same state under the same name).

        Raises:
            ValueError: ``optimizer`` holds a parameter that is not this rank's.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        self._check_optimizer(optimizer)
        return get_optimizer_state_dict(self.compiled.model, optimizer,
                                        options=StateDictOptions(flatten_optimizer_state_dict=True))

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: Mapping) -> None:
        """Load :meth:`optimizer_state_dict`'s form (this rank's names, or a superset) into ``optimizer``.

        Raises:
            ValueError: ``optimizer`` holds a parameter that is not this rank's.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        self._check_optimizer(optimizer)
        set_optimizer_state_dict(self.compiled.model, optimizer, dict(state_dict),
                                 options=StateDictOptions(flatten_optimizer_state_dict=True))

    def _check_optimizer(self, optimizer) -> None:
        mine = {id(p) for p in self.parameters()}
        for g in optimizer.param_groups:
            for p in g["params"]:
                if id(p) not in mine:
                    raise ValueError(f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not one of "
                                     f"rank {self.rank}'s (build it from pipe.parameters())")

    def checkpoint_state(self, optimizer: torch.optim.Optimizer | None = None) -> dict:
        """What :meth:`save_checkpoint` writes: ``{"model": this rank's state dict entries (the tensors, no copy),
        "optim": optimizer_state_dict(optimizer)}`` ("optim" only with an optimizer)."""
        out = {"model": self.state_dict_names()}
        if optimizer is not None:
            out["optim"] = self.optimizer_state_dict(optimizer)
        return out

    def save_checkpoint(self, checkpoint_id, optimizer: torch.optim.Optimizer | None = None,
                        extra: Mapping | None = None) -> None:
        """Write a torch.distributed.checkpoint (DCP) checkpoint of the model (and ``optimizer``) under the
        original names: every rank writes its own entries, a tied weight once (a collective over the pipeline's
        ranks).  The keys are ``model.<name>`` and ``optim.state.<name>.<field>`` / ``optim.param_groups.<name>.<key>``,
        so an unsplit model loads it with ``sd = {"model": model.state_dict()}; dcp.load(sd, checkpoint_id=path,
        no_dist=True); model.load_state_dict(sd["model"])`` (its optimizer likewise, through
        ``get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))``),
        and a pipeline of any pp size with :meth:`load_checkpoint`.

        Args:
            checkpoint_id: the checkpoint's directory (as ``torch.distributed.checkpoint.save``).
            optimizer: this rank's optimizer, or None.
            extra: more entries under their own keys (e.g. ``{"step": torch.tensor(step)}``, a scheduler's
                ``state_dict()``): the same on every rank.
        """
        import torch.distributed.checkpoint as dcp

        sd = self.checkpoint_state(optimizer)
        if extra:
            if set(extra) & set(sd):
                raise ValueError(f"extra may not use the keys {sorted(set(extra) & set(sd))}")
            sd.update(extra)
        dcp.save(sd, checkpoint_id=checkpoint_id, process_group=self.group)

    def load_checkpoint(self, checkpoint_id, optimizer: torch.optim.Optimizer | None = None,
                        extra: Mapping | None = None) -> None:
        """Load a DCP checkpoint written by :meth:`save_checkpoint` at any pp size, or by the unsplit model under
        ``{"model": model.state_dict(), "optim": ...}``: this rank reads its own entries (and ``optimizer``'s
        state); ``extra``'s tensors are loaded in place as ``dcp.load`` does.  Round trips are exact.

        Raises:
            RuntimeError (from DCP): an entry this rank needs is not in the checkpoint, or its shape differs.
        """
        import torch.distributed.checkpoint as dcp

        sd = {"model": {n: t.detach().clone() for n, t in self.state_dict_names().items()}}
        if optimizer is not None:
            # a fresh optimizer has no state tensors to load into: torch initialises them (a step at lr 0), but only
            # when no parameter has a .grad, so the gradients step aside meanwhile
            grads = [(p, p.grad) for p in self.parameters()]
            if not optimizer.state:
                for p, _ in grads:
                    p.grad = None
            try:
                sd["optim"] = self.optimizer_state_dict(optimizer)
            finally:
                for p, g in grads:
                    p.grad = g
        if extra:
            sd.update(extra)
        dcp.load(sd, checkpoint_id=checkpoint_id, process_group=self.group)
        self.load_state_dict(sd["model"], strict=False)
        if optimizer is not None:
            self.load_optimizer_state_dict(optimizer, sd["optim"])

    def state_dict_names(self) -> dict[str, torch.Tensor]:
        """This rank's entries of the state dict, name -> the model's tensor (no copy)."""
        out = {}
        for pid in self.local_param_ids:
            for n in self._names_by_id[pid]:
                out[n] = self._param_obj[pid]
        persistent = set(self.compiled.model.state_dict(keep_vars=True))
        for n, b in self.compiled.model.named_buffers(remove_duplicate=False):
            if n in persistent and (n in self._local_state_names or self.rank == 0):
                out[n] = b
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and persistent buffers under every original name (tied weights under each alias);
        buffers no chunk reads are kept by rank 0.  Copies (:meth:`state_dict_names` gives the tensors)."""
        return {n: t.detach().clone() for n, t in self.state_dict_names().items()}

    def _owners(self) -> list[tuple[int, str, torch.Tensor]]:
        """``(owner rank, name, tensor)`` for every entry of the full state dict, in model order: a parameter's
        lowest holding rank, a buffer's lowest reading rank (rank 0 for buffers no chunk reads)."""
        comp = self.compiled
        readers: dict[str, set] = defaultdict(set)
        for c in comp.partition.chunks:
            if c.index in comp.program.chunks:
                for n in comp.program.chunks[c.index].state_names:
                    readers[n].add(c.rank)
        out = []
        for pid, p in self._param_obj.items():
            for n in self._names_by_id[pid]:
                out.append((min(self._ranks_by_id[pid]), n, p))
        persistent = set(comp.model.state_dict(keep_vars=True))
        for n, b in comp.model.named_buffers(remove_duplicate=False):
            if n in persistent:
                out.append((min(readers[n]) if readers.get(n) else 0, n, b))
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict gathered from all ranks, under the original names (a collective).

        Each rank broadcasts the bytes of the tensors it owns as one buffer; every rank knows their names, dtypes and
        shapes from its copy of the model, so nothing but tensor bytes travels (no pickle).

        Raises:
            dipc.wire.WireTimeout: a rank's tensors did not arrive within the runtime's timeout.
        """
        from .wire import _wait

        owned: dict[int, list] = defaultdict(list)
        for r, n, t in self._owners():
            owned[r].append((n, t))
        out: dict[str, torch.Tensor] = {}
        for r in range(self.world):
            items = owned.get(r, [])
            sizes = [t.numel() * t.element_size() for _, t in items]
            total = sum(sizes)
            if not total:
                for n, t in items:
                    out[n] = t.detach().clone()
                continue
            if r == self.rank:
                buf = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8).to(self.device)
                                 for _, t in items if t.numel()])
            else:
                buf = torch.empty(total, dtype=torch.uint8, device=self.device)
            src = dist.get_global_rank(self.group, r) if self.group is not None else r
            _wait(dist.broadcast(buf, src=src, group=self.group, async_op=True), self.timeout,
                  f"rank {r}'s {len(items)} state tensors ({total} bytes)")
            off = 0
            for (n, t), size in zip(items, sizes):
                piece = buf[off:off + size].clone()
                out[n] = piece.view(t.dtype).reshape(t.shape).to(t.device) if size else t.detach().clone()
                off += size
        return out

    # -- step
    def trace_events(self) -> list[dict]:
        """Every rank's measured actions of the last step, as trace events for :mod:`dipc.trace` (a collective:
        call it on every rank; JSON on the wire).  Times are seconds from each rank's start of execution (after
        plan delivery)."""
        from .wire import all_gather_json

        mod_of = {c.index: c.modality for c in self.compiled.partition.chunks}
        mine = []
        for a, s, e, _ in self.last_timeline:
            mine.append({"rank": self.rank, "start": s, "end": e, "name": str(a), "kind": a.kind,
                         "modality": mod_of.get(a.chunk, "")})
        parts = all_gather_json(mine, self.group, self.device, self.timeout, what="trace events")
        return [e for p in parts for e in p]

    def _make(self, w: StepWorkload, schedule: str, forward_only: bool = False) -> Plan:
        from .codegen.templates import template

        if forward_only:  # evaluation: the template's order without its backwards (no memory to plan for)
            from .plan import forward_only as drop_backwards

            plan = drop_backwards(make_plan(self.compiled, w, self.step_index, schedule=schedule, check=False))
            validate(plan)
            plan._validated = plan.digest()
            return plan
        return make_plan(self.compiled, w, self.step_index, memory_limit=self.memory_limit, schedule=schedule,
                         budget_s=self.budget_s if template(schedule).kind == "interleave" else 0.0,
                         seed=self.seed + self.step_index)

    def _workload(self, microbatches: list[Microbatch], amp=None) -> StepWorkload:
        w = build_workload(self.compiled, microbatches, amp)
        if self.recompute:
            set_recompute(w, True)
        return w

    def plan_step(self, microbatches: list[Microbatch] | None, schedule: str | None = None,
                  batch: Mapping[str, torch.Tensor] | None = None, given: Plan | None = None,
                  early: BaseException | None = None, forward_only: bool = False) -> tuple[StepWorkload, Plan]:
        """Build this step's workload and receive (rank 0: make, or take from the background planner) its plan;
        checks step and digest on every rank.

        ``microbatches`` must be split as ``schedule`` (default the runtime's) needs (:func:`split_for`); ``batch``
        (the step's batch) lets a rank re-split it when rank 0 falls back to a template that splits otherwise.  Rank
        0 sends a JSON header (step, schedule, workload digest, the plan's JSON and digest, where the plan came from)
        by :func:`dipc.wire.broadcast_json`: no pickle, and the runtime's timeout.

        ``forward_only``: an evaluation plan (:func:`dipc.plan.forward_only`, :meth:`eval_step`); the digest every
        rank checks says so, so a rank evaluating while another trains raises on every rank.

        Raises:
            PlanError: rank 0 could not plan the step (on every rank), the ranks disagree on the step's batch or
                microbatch count, or the plan arrived for another step.
            dipc.wire.WireTimeout: the plan did not arrive within the runtime's timeout.
        """
        from .codegen.templates import template
        from .wire import broadcast_json

        name = self.schedule if schedule is None else schedule
        amp = autocast_state(self.device)  # the caller's torch.autocast: the chunks run under it
        local_err: str | None = None  # a failure on this rank only: every rank learns of it before raising
        w, mine = None, "(this rank could not build the step)"
        if early is not None:  # the batch or an argument was refused before this rank could split the batch
            local_err = f"{type(early).__name__}: {early}"
        else:
            try:
                w = (build_workload(self.compiled, microbatches, amp) if forward_only
                     else self._workload(microbatches, amp))
                mine = step_digest(self.compiled, w, forward_only)
            except Exception as e:  # noqa: BLE001
                local_err = f"{type(e).__name__}: {e}"
        n = len(microbatches) if microbatches is not None else -1
        info: dict[str, Any] = {"source": "sync", "schedule": name, "planner_s": None,
                                "why": ""}
        header = None
        if self.rank == 0:
            try:
                if local_err is not None:
                    raise PlanError(f"building the step failed: {local_err}") if early is None else early
                plan = None
                if given is not None:  # made beforehand: checked against this step's stages, then validated
                    have = {a.stage for _, a in given.compute_actions()}
                    if have != set(w.graph.stages):
                        missing, extra = sorted(set(w.graph.stages) - have)[:3], sorted(have - set(w.graph.stages))[:3]
                        raise PlanError(f"the given plan is not for this batch split into {n} microbatches: its "
                                        f"stages miss {missing} and have {extra} this step does not")
                    if getattr(given, "_validated", None) != given.digest():  # validated, and not changed since
                        validate(given)
                    plan = dataclasses.replace(given, step=self.step_index)
                    info["source"] = "given"
                elif self._planner is not None and self._planner.submitted == self.step_index and not forward_only:
                    reply, why = self._planner.take(self.step_index, self.plan_wait_s)
                    if reply is not None and (reply.get("schedule"), reply.get("n_microbatches")) != (name, n):
                        reply, why = None, (f"the look-ahead was planned with schedule {reply.get('schedule')!r} "
                                            f"and {reply.get('n_microbatches')} microbatches, this step asks for "
                                            f"{name!r} and {n}")
                    elif reply is not None and reply["digest"] != mine:
                        reply, why = None, ("the batch given as next_batch is not the one this step got (its "
                                            "digest differs)")
                    if reply is not None:
                        plan = Plan.from_json(reply["plan"])
                        info.update(source="async", planner_s=reply["seconds"], planner_cpu_s=reply["cpu_seconds"])
                    elif "needs a capture" in why:  # this process captures it now (it must, to run the step)
                        log.info("dipc: step %d: %s; planning it now", self.step_index, why)
                        info["why"] = why
                    elif "look-ahead" in why or "next_batch" in why:  # the user's look-ahead was wrong: plan it now
                        log.warning("dipc: step %d: %s; planning it now", self.step_index, why)
                        info["why"] = why
                    elif "failed" in why:  # the planner raised: plan this batch now; the template only if that fails
                        try:
                            plan = self._make(w, name)
                            log.warning("dipc: step %d: %s; planned it now", self.step_index, why)
                            info["why"] = why
                        except Exception as e:  # noqa: BLE001
                            why = f"{why}; planning it now failed too ({type(e).__name__}: {e})"
                    if plan is None and reply is None and not info["why"]:
                        # late, died, or failed here too: the fallback template, planned now (DIP §2.2)
                        fb = self.fallback_schedule
                        log.warning("dipc: step %d: %s; running the %r template instead (%d fallbacks so far)",
                                    self.step_index, why, fb, self.fallbacks + 1)
                        info.update(source="fallback", schedule=fb, why=why)
                        if template(fb).sub_microbatches != template(name).sub_microbatches:
                            microbatches = split_for(self.compiled, batch, n, fb)
                            w = self._workload(microbatches, amp)
                            mine = step_digest(self.compiled, w)
                        name = fb
                if plan is None:
                    plan = self._make(w, name, forward_only)
                text = reply["plan"] if info["source"] == "async" else plan.to_json()
                text_digest = Plan.text_digest(text)
                if info["source"] == "async":
                    plan._validated = text_digest
                header = {"step": self.step_index, "schedule": name, "n_microbatches": n, "digest": mine,
                          "plan": text, "plan_digest": text_digest, "source": info["source"],
                          "why": info["why"]}
            except Exception as e:  # every rank raises it, instead of waiting for a plan
                header = {"step": self.step_index, "error": f"{type(e).__name__}: {e}", "digest": mine}
        src = 0
        header = broadcast_json(header, src, self.group, self.device, self.timeout,
                                what=f"the plan of step {self.step_index}")
        step, theirs = header["step"], header["digest"]
        if "error" in header:
            if self.rank == 0 and early is not None:
                raise early  # rank 0's own bad input keeps its type (BatchError, ValueError)
            if early is not None and header["error"] == f"{type(early).__name__}: {early}":
                raise early  # every rank refused the batch alike
            raise PlanError(f"step {step}: rank 0 could not plan it: {header['error']}")
        if header.get("source") != "fallback" and header.get("schedule") != name and local_err is None:
            local_err = (f"PlanError: this rank asked for schedule {name!r}, rank 0 for {header.get('schedule')!r} "
                         "(every rank must step with the same schedule)")
        if self.rank != 0 and local_err is None:
            try:
                got = Plan.text_digest(header["plan"])
                if got != header["plan_digest"]:
                    raise PlanError(f"the plan arrived damaged (digest {got[:12]}, rank 0 sent "
                                    f"{header['plan_digest'][:12]})")
                plan = Plan.from_json(header["plan"])
                info.update(source=header["source"], schedule=header["schedule"], why=header.get("why", ""))
                if header["schedule"] != name:  # rank 0 fell back to another template
                    if template(header["schedule"]).sub_microbatches != template(name).sub_microbatches:
                        microbatches = split_for(self.compiled, batch, n, header["schedule"])
                        w = self._workload(microbatches, amp)
                        mine = step_digest(self.compiled, w)
            except Exception as e:  # noqa: BLE001
                local_err = f"{type(e).__name__}: {e}"
        from .wire import _wait

        # one all-reduce tells every rank whether all built the step, agree on its index and on its digest
        same = torch.tensor([1 if mine == theirs else 0, self.step_index, -self.step_index,
                             0 if local_err else 1], dtype=torch.int64, device=self.device)
        _wait(dist.all_reduce(same, op=dist.ReduceOp.MIN, group=self.group, async_op=True), self.timeout,
              f"every rank's check of step {self.step_index}'s plan")
        if int(same[3].item()) == 0:  # some rank failed alone: the lowest one tells every rank what happened
            bits = torch.tensor([float(2 ** self.rank) if local_err else 0.0], dtype=torch.float64,
                                device=self.device)
            _wait(dist.all_reduce(bits, group=self.group, async_op=True), self.timeout,
                  f"every rank's failure flags of step {self.step_index}")
            b = int(bits.item())
            origin = (b & -b).bit_length() - 1
            text = broadcast_json(local_err if self.rank == origin else None, origin, self.group, self.device,
                                  self.timeout, what=f"rank {origin}'s failure of step {self.step_index}")
            if early is not None and text == local_err:
                raise early  # this rank's own bad input, or the same as the first failing rank's
            raise PlanError(f"step {self.step_index}: rank {origin} could not build the step: {text} (every rank "
                            "stopped before any activation moved)")
        if header.get("source") == "fallback":  # counted on every rank, after every rank has the plan
            self.fallbacks += 1
        lo, hi = int(same[1].item()), -int(same[2].item())
        if lo != hi:  # every rank raises, before any activation moves
            raise PlanError(f"the ranks are at different steps (from step {lo} to step {hi}; this rank, rank "
                            f"{self.rank}, is at step {self.step_index}): every rank must call step() for every "
                            "batch (a rank that skipped or repeated a step leaves the pipeline out of step)")
        if int(same[0].item()) == 0:
            who = (f"this rank's digest {mine[:12]} differs from rank 0's {theirs[:12]}" if mine != theirs else
                   "another rank's digest differs from this one's")
            if header.get("n_microbatches", n) != n:
                who += f"; rank 0 split the batch into {header['n_microbatches']} microbatches, this rank into {n}"
            raise PlanError(
                f"step {self.step_index}: the ranks disagree on the step ({who}; the digest covers the stage graph "
                "and the batch's integer tensors). Either they were given different batches (every rank of a "
                "pipeline must get the same batch), or they traced the model differently: a forward that iterates "
                "a Python set of strings (Hugging Face Gemma3: set(config.layer_types)) follows the hash seed, so "
                "start every rank with the same PYTHONHASHSEED (dipc.launch.spawn sets 0; under torchrun: "
                "PYTHONHASHSEED=0 torchrun ...)")
        self._plan_info = info
        w.microbatches = microbatches
        return w, plan

    def step(self, batch: Mapping[str, torch.Tensor], n_microbatches: int | None = None,
             schedule: str | None = None, next_batch: Mapping[str, torch.Tensor] | None = None,
             plan: Plan | None = None) -> torch.Tensor:
        """Run forward and backward of ``batch`` through the pipeline; gradients accumulate into ``.grad``.

        Args:
            batch: a dict with the example batch's keys (e.g. ``input_ids [B, S]``, ``pixel_values [N, 3, H, W]``,
                ``labels [B, S]``).  A batch yielded by :func:`prefetch` brings its successor as ``next_batch``.
            n_microbatches: overrides the runtime's microbatch count for this step.
            schedule: overrides the runtime's schedule template for this step (:func:`dipc.schedules`).
            next_batch: the batch of the next step (same keys; best on the CPU): rank 0's background planner makes
                its plan while this step runs (DIP §2.2 asynchronous planning), with this step's microbatch count
                and schedule.  At the next step a plan that is not ready ``plan_wait_s`` seconds after the step
                began, failed, or whose planner died is replaced by ``fallback_schedule``'s plan made then (a
                warning on the ``dipc`` logger; counted in :attr:`fallbacks` and the step report); a ``next_batch``
                that is not the batch the next step gets is planned again then.  Other ranks ignore it.
            plan: a plan made beforehand for this batch split this way (e.g. by :func:`dipc.simulate` or
                :func:`dipc.runtime.make_plan`; rank 0's is used, checked against the step's stages, validated
                unless the background planner made it); the report's ``plan_source`` is then "given".

        Returns:
            the batch loss (0-dim float tensor), identical on every rank.  :attr:`last_report` describes the step
            (:class:`StepReport`).

        Raises:
            dipc.batch.BatchError: the batch is invalid (raised on every rank before any communication).
            ValueError: unknown ``schedule``, or a bad ``n_microbatches`` (on every rank, before any communication).
            dipc.plan.PlanError: plan delivery or execution is inconsistent.
            RuntimeError: a distributed wait exceeded the timeout.
        """
        if not torch.is_grad_enabled():  # under torch.no_grad() / inference_mode(): the forward-only plan
            if next_batch is not None or plan is not None:
                raise ValueError("pipe.step under torch.no_grad() runs the forward-only evaluation plan "
                                 "(pipe.eval_step), which takes no next_batch or plan")
            return self.eval_step(batch, n_microbatches, schedule)
        t0 = time.perf_counter()
        if next_batch is None:
            next_batch = getattr(batch, "next_batch", None)
        schedule = self.schedule if schedule is None else schedule
        batch, mbs, early, n = self._split(batch, n_microbatches, schedule)
        w, plan = self.plan_step(mbs, schedule, batch, given=plan, early=early)
        mbs = w.microbatches
        info = self._plan_info
        if self.rank == 0 and next_batch is not None:  # planned while this step runs
            self._submit(next_batch, n, schedule)
        t1 = time.perf_counter()
        # this step's gradients accumulate into fresh .grad tensors; those of earlier steps (accumulation over steps)
        # are added back once the step succeeded, and restored untouched when it raises (nothing half-accumulated)
        stash = [(p, p.grad) for p in self.parameters()]
        for p, _ in stash:
            p.grad = None
        try:
            ex = Executor(self.rank, w, plan, self.transport, _modules_of(w, {self.rank}), self.device,
                          yield_after_post=dist.get_backend(self.group) == "gloo")
            failure = None
            try:
                ex.run()
                ex.finish()
            except BaseException as e:  # drained (Executor.run): every rank now learns of it in the status exchange
                failure = e
            local = torch.zeros((), dtype=torch.float64)
            if failure is None:
                local = sum((mbs[m].weight * l.detach().to(torch.float64) for m, l in ex.losses.items()), local)
            try:
                loss = self._exchange_status(ex, failure, local).to(torch.float32)
            except StepFailed as e:
                if not e.usable:
                    self._broken = f"step {self.step_index} ({e})"
                if failure is not None and not isinstance(failure, Exception):
                    raise failure from None  # KeyboardInterrupt, SystemExit: the peers got StepFailed, this rank
                raise                        # gets what it raised

            zero_unreached_grads(self.compiled, w, {self.rank})
            from .wire import _wait

            for pid, grp in self._tied:  # a tied weight's ranks sum this step's gradients
                p = self._param_obj[pid]
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                _wait(dist.all_reduce(p.grad, group=grp, async_op=True), self.timeout,
                      f"step {self.step_index}'s gradient all-reduce of a tied weight")
        except BaseException:
            for p, g in stash:
                p.grad = g
            raise
        for p, g in stash:
            if g is not None:
                p.grad = g if p.grad is None else g.add_(p.grad)
        t2 = time.perf_counter()
        self.last_plan = plan
        self.last_timeline = ex.timeline
        self.last_workload = w
        self.last_timing = {"plan_s": t1 - t0, "execute_s": t2 - t1, "step_s": t2 - t0}
        self.last_microbatches = mbs
        self.last_report = StepReport(
            step=self.step_index, schedule=info.get("schedule", schedule), plan_source=info.get("source", "sync"),
            fallbacks=self.fallbacks, fallback_reason=info.get("why", ""), plan_s=t1 - t0, execute_s=t2 - t1,
            planner_s=info.get("planner_s"), planner_cpu_s=info.get("planner_cpu_s"), predicted_s=plan.simulated.get("iteration_time"),
            search=plan.simulated.get("search"), simulation=None, _pipe=self, _plan=plan,
            _workload=w)
        self.step_index += 1
        return loss

    def _split(self, batch, n_microbatches, schedule: str):
        """The step's arguments checked and its batch split: ``(batch, microbatches, None, n)``, or
        ``(batch, None, the exception, n)`` when they are refused (raised by :meth:`plan_step` on every rank, after
        telling the others: a rank alone would desync them).

        Raises:
            RuntimeError: the process group broke at an earlier step."""
        if self._broken:
            raise RuntimeError(f"this pipeline's process group broke at {self._broken}: no further step can run "
                               "on it (start the processes, or a new process group and runtime, again)")
        n = self.n_microbatches if n_microbatches is None else n_microbatches
        try:
            from .codegen.templates import template
            template(schedule)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"n_microbatches must be an int >= 1, got {n!r}")
            if self.device.type != "cpu":
                batch = {k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                         for k, v in batch.items()}
            return batch, split_for(self.compiled, batch, n, schedule), None, n
        except Exception as e:  # noqa: BLE001
            return batch, None, e, n

    def eval_step(self, batch: Mapping[str, torch.Tensor], n_microbatches: int | None = None,
                  schedule: str | None = None) -> torch.Tensor:
        """The loss of ``batch`` by a forward-only pipeline (Megatron's ``forward_only=True``): each rank runs its
        forwards in the order of ``schedule``'s plan (default "1f1b"; :func:`dipc.schedules`) with the backwards
        dropped (:func:`dipc.plan.forward_only`), without autograd (nothing is kept for a backward; an output is
        freed after its last reader), and sends activations only.  No gradient, optimizer state or step counter
        changes; the background planner's look-ahead for the next training step stays valid.  ``pipe.step`` under
        ``torch.no_grad()`` or ``torch.inference_mode()`` runs this.

        The chunks run as the model was captured: a model compiled in training mode runs its dropout (dipc's
        models are deterministic; compile a model with dropout in ``eval()`` mode for evaluation numbers).

        Args:
            batch: as for :meth:`step` (the loss needs its labels).
            n_microbatches: default the runtime's.
            schedule: whose forward order to follow; default "1f1b" (no sub-microbatches, no planning search).

        Returns:
            the batch loss (0-dim float32), identical on every rank and equal to the unsplit model's under
            ``torch.no_grad()`` up to float rounding.

        Raises:
            as :meth:`step` (on every rank, before any activation moves, for bad input or ranks that disagree,
            including one rank evaluating while another trains); ``StepFailed`` for a failure inside the plan.
        """
        schedule = "1f1b" if schedule is None else schedule
        # planning may capture a new program: that is a training trace, whatever grad mode the caller is in
        with torch.inference_mode(False), torch.enable_grad():
            batch, mbs, early, n = self._split(batch, n_microbatches, schedule)
            w, plan = self.plan_step(mbs, schedule, batch, early=early, forward_only=True)
        mbs = w.microbatches
        ex = Executor(self.rank, w, plan, self.transport, _modules_of(w, {self.rank}), self.device,
                      yield_after_post=dist.get_backend(self.group) == "gloo")
        failure = None
        try:
            with torch.no_grad():
                ex.run()
                ex.finish()
        except BaseException as e:  # noqa: BLE001 - drained: every rank learns of it in the status exchange
            failure = e
        local = torch.zeros((), dtype=torch.float64)
        if failure is None:
            local = sum((mbs[m].weight * l.to(torch.float64) for m, l in ex.losses.items()), local)
        try:
            return self._exchange_status(ex, failure, local).to(torch.float32)
        except StepFailed as e:
            if not e.usable:
                self._broken = f"evaluation at step {self.step_index} ({e})"
            if failure is not None and not isinstance(failure, Exception):
                raise failure from None
            raise

    def _exchange_status(self, ex: Executor, failure: BaseException | None, local_loss: torch.Tensor) -> torch.Tensor:
        """After the plan ran (or was drained after a failure), one all-reduce sums the ranks' loss shares (float64;
        returned, 0-dim) and tells every rank whether any rank failed; the first failing rank then broadcasts its
        action and exception (JSON) and every rank raises the same :class:`StepFailed` (issue "Faults", point 1).

        Raises:
            StepFailed: some rank failed (``usable`` False when a wait timed out or a connection broke, or the
                exchange itself failed: a rank died or hangs)."""
        from .wire import WireTimeout, _wait, broadcast_json

        own = failure is not None and not isinstance(failure, _PeerFailed)
        flag = torch.stack([torch.tensor(float(2 ** self.rank) if own else 0.0, dtype=torch.float64),
                            torch.tensor(1.0 if isinstance(failure, TransportError) else 0.0, dtype=torch.float64),
                            local_loss.to("cpu", torch.float64)]).to(self.device)
        mine = ""
        if failure is not None:
            a = ex.failure[0] if ex.failure else "the step's last sends"
            mine = f"this rank (rank {self.rank}) failed in {a}: {type(failure).__name__}: {failure}; "
        try:
            _wait(dist.all_reduce(flag, group=self.group, async_op=True), self.timeout,
                  f"every rank's status after step {self.step_index}")
        except (WireTimeout, RuntimeError) as e:
            gone = self._unresponsive()
            raise StepFailed(f"step {self.step_index}: {mine}the status exchange with the other ranks failed ({e}): "
                             f"{gone}; the process group cannot run further steps", origin=None,
                             step=self.step_index, usable=False) from (failure or e)
        bits, broken = int(flag[0].item()), flag[1].item() > 0
        if not bits:
            if failure is not None:  # an abort message but no rank says it failed: cannot happen with dipc's peers
                raise StepFailed(f"step {self.step_index}: {mine}no rank reported the failure",
                                 step=self.step_index, usable=False) from failure
            return flag[2].cpu()
        origin = (bits & -bits).bit_length() - 1  # the lowest failing rank speaks for all
        text = None
        if self.rank == origin:
            a = ex.failure[0] if ex.failure else "the step's last sends"
            text = {"action": str(a), "error": f"{type(failure).__name__}: {failure}"}
        text = broadcast_json(text, origin, self.group, self.device, self.timeout,
                              what=f"rank {origin}'s failure report of step {self.step_index}")
        others = [r for r in range(self.world) if bits >> r & 1 and r != origin]
        more = f" (ranks {others} failed too)" if others else ""
        state = ("the process group cannot run further steps (a wait timed out or a connection broke; gloo closes "
                 "such a pair)" if broken else "the process group can run further steps")
        raise StepFailed(f"step {self.step_index}: rank {origin} failed in {text['action']}: {text['error']}{more}; "
                         f"every rank stopped the step and its .grad is as before it; {state}", origin=origin,
                         action=text["action"], step=self.step_index, usable=not broken) from failure

    def _unresponsive(self, wait_s: float = 3.0) -> str:
        """After a broken exchange: which ranks of the pipeline still answer through the rendezvous store (each
        survivor writes a key and looks for the others' for ``wait_s`` seconds).  The store is hosted by global
        rank 0, so when that rank died the store is gone too, and the message says so."""
        try:
            store = dist.distributed_c10d._get_default_store()
            key = f"dipc/alive/{id(self.compiled)}/{self.step_index}"
            store.set(f"{key}/{self.rank}", "1")
            deadline = time.monotonic() + wait_s
            missing = list(range(self.world))
            while missing and time.monotonic() < deadline:
                missing = [r for r in range(self.world) if not store.check([f"{key}/{r}"])]
                if missing:
                    time.sleep(0.05)
        except Exception as e:  # noqa: BLE001
            root = dist.get_global_rank(self.group, 0) if self.group is not None else 0
            return (f"the rendezvous store does not answer either ({type(e).__name__}): global rank 0, which hosts "
                    f"it, is probably gone" + (f" (pipeline rank 0 is global rank {root})" if root else ""))
        if not missing:
            return "every rank answers through the store, so a rank hangs or its connection broke"
        return f"rank(s) {missing} do not answer within {wait_s:g} s: died or hang"

    def _submit(self, next_batch, n: int, schedule: str) -> None:
        from .codegen.templates import template
        from .planner.background import BackgroundPlanner

        if self._planner is None:
            import weakref

            self._planner = BackgroundPlanner(self.compiled, {"memory_limit": self.memory_limit,
                                                              "recompute": self.recompute})
            weakref.finalize(self, self._planner.close)  # a runtime dropped without close() stops its planner
        budget = self.budget_s if template(schedule).kind == "interleave" else 0.0
        try:  # never raises: this rank's peers already run the step
            if not isinstance(next_batch, Mapping):
                raise TypeError(f"next_batch must be a mapping like the batch, got {type(next_batch).__name__}")
            self._planner.submit(self.step_index + 1, next_batch, n, schedule, budget, self.seed + self.step_index + 1,
                                 autocast_state(self.device))
        except Exception as e:  # noqa: BLE001 - not sendable: the next step plans synchronously
            self._planner.submitted = None
            log.warning("dipc: step %d's next batch cannot go to the background planner (%s: %s); it will be "
                        "planned synchronously", self.step_index, type(e).__name__, e)

    def close(self) -> None:
        """Stop this rank's background planner, if any (idempotent; the process also exits with this one)."""
        if self._planner is not None:
            self._planner.close()
            self._planner = None


@dataclasses.dataclass
class StepReport:
    """What :meth:`PipelineRuntime.step` did (``pipe.last_report``; DIP's plan report, §2.2/§2.4).

    Attributes:
        step: the step index.
        schedule: the template that ran ("dip" or a fallback).
        plan_source: "async" (made by the background planner while the previous step ran), "sync" (made by rank 0
            at the start of the step), "given" (``step(plan=...)``) or "fallback" (the background plan missed its
            deadline, failed or its process died: ``schedule`` is the fallback template's).
        fallbacks: steps of this runtime that fell back so far.
        fallback_reason: why this step did not get its background plan ("" when it did, or none was asked for).
        plan_s: seconds of the training thread from the step's start to the plan's delivery (splitting, the
            workload, planning when synchronous, the header broadcast and digest check).
        execute_s: seconds of the plan's execution and the step's all-reduces.
        planner_s: wall seconds the background planner took for this plan, waiting for idle cores included (None
            when it did not make it); ``planner_cpu_s`` its CPU seconds.
        predicted_s: the plan's simulated iteration time in seconds (the device profile's, or the first estimate).
        search: the MCTS progress of ``plan.simulated["search"]`` (rollouts, best score over time), or None.
        simulation: the simulated step's ``iteration_time``, ``bound``, ``bubble_ratio``, ``bubble_causes`` (per
            rank: busy, fill, waits, drain, posting seconds) and ``peak_memory`` (bytes per rank); made by the
            background planner after the plan (read when asked for), or on first use of :meth:`simulate`.
    """

    step: int
    schedule: str
    plan_source: str
    fallbacks: int
    fallback_reason: str
    plan_s: float
    execute_s: float
    planner_s: float | None
    planner_cpu_s: float | None
    predicted_s: float | None
    search: dict | None
    simulation: dict | None
    _pipe: Any = dataclasses.field(default=None, repr=False)
    _plan: Any = dataclasses.field(default=None, repr=False)
    _workload: Any = dataclasses.field(default=None, repr=False)

    def _fetch(self) -> dict | None:
        planner = getattr(self._pipe, "_planner", None)
        if self.simulation is None and self.plan_source == "async" and planner is not None:
            self.simulation = planner.simulation(self.step)  # sent after the plan; never waits
        return self.simulation

    def simulate(self) -> dict:
        """:attr:`simulation`: the background planner's when it sent it, else made now (on this rank)."""
        if self._fetch() is None:
            from .planner.background import _summary

            self.simulation = _summary(self._pipe.compiled, self._workload, self._plan,
                                       self._pipe.compiled.rank_state_bytes())
        return self.simulation

    def summary(self) -> str:
        """One line: the schedule and where its plan came from, planning time on the training thread and in the
        background planner, predicted vs measured seconds, the simulated bubble ratio when known, fallbacks."""
        parts = [f"step {self.step}", f"{self.schedule} ({self.plan_source})",
                 f"plan {self.plan_s * 1e3:.1f} ms"]
        if self.planner_s is not None:
            parts.append(f"planner {self.planner_s * 1e3:.1f} ms ({self.planner_cpu_s * 1e3:.1f} ms CPU)")
        if self.predicted_s is not None:
            parts.append(f"predicted {self.predicted_s * 1e3:.3f} ms")
        parts.append(f"measured {self.execute_s * 1e3:.1f} ms")
        if self._fetch() is not None:
            parts.append(f"bubble {self.simulation['bubble_ratio']:.1%}")
        if self.search:
            parts.append(f"search {self.search.get('rollouts', 0)} rollouts")
        parts.append(f"fallbacks {self.fallbacks}")
        return "  ".join(parts)


class _Lookahead(dict):
    """A batch (a plain dict) that also carries the next one (``next_batch``, None for the last)."""

    next_batch: Mapping[str, torch.Tensor] | None = None


def prefetch(iterable):
    """Yield the batches of ``iterable`` one ahead: each is a dict carrying its successor as ``.next_batch``, which
    :meth:`PipelineRuntime.step` hands to the background planner (DIP §2.2 asynchronous planning)::

        for batch in dipc.prefetch(loader):
            loss = pipe.step(batch)

    Reads one batch ahead of what it yields (the first ``next`` reads two).

    Raises:
        TypeError: a batch is not a mapping (raised when it is reached)."""
    end = object()
    it = iter(iterable)
    cur = next(it, end)
    i = 0
    while cur is not end:
        if not isinstance(cur, Mapping):
            raise TypeError(f"dipc.prefetch: batch {i} is a {type(cur).__name__}; batches must be mappings (dicts of "
                            "tensors)")
        nxt = next(it, end)
        out = _Lookahead(cur)
        out.next_batch = None if nxt is end else nxt
        yield out
        cur, i = nxt, i + 1
