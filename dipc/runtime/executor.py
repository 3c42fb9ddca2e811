"""The executor of one rank's plan (forwards, backwards, recompute, sends and receives; a failure drains the rest of
the plan, issue "Faults"), and :func:`run_local`, every rank's plan in one process.
"""
from __future__ import annotations

import contextlib
import os
import time
from collections import defaultdict
from typing import Callable, Mapping

import torch

from ..codegen.stage import EXTRA_PREFIX, recompute_prefix, rewrite_graphs, with_outputs
from ..plan import RECVS, SENDS, Plan, PlanError, offloads, recompute_layout, stage_key
from ..validation import validate
from ..stages import Stage

from .messages import _layout, _pack, _status, _unpack
from .transport import _completed, _LocalTransport
from ..planner.workload import (StepWorkload, autocast_state, build_workload, check_matches, check_strategies, dtype_name,
                                split_for)
from ..planner.options import set_recompute
from .offload import run_offloaded
from .selective import kept_bytes, run_selective
from ..planner.planning import make_plan


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


# ---------------------------------------------------------------------------------------------------- executor
class Executor:
    """Runs one rank's actions of a plan.

    The chunk modules it runs are taken from the step's programs; forward outputs and the detached inputs that
    receive gradients are kept per stage until its backward.  Every action's ``(action, start, end, wait)`` in seconds
    since the step began (``wait``: the part of a compute action spent waiting for its messages) is recorded in
    :attr:`timeline` for traces and calibration, and every wait on a message, ``(receive action, start, end)``
    (``None`` for the wait on this rank's sends at the end of the step), in :attr:`waits` for traces.
    """

    def __init__(self, rank: int, workload: StepWorkload, plan: Plan, transport, chunk_modules: dict,
                 device: torch.device | None = None, yield_after_post: bool = False, tp=None):
        self.rank = rank
        #: this rank's :class:`dipc.runtime.tensor_parallel.TensorParallel`, or None: chunks run on the group's
        #: DTensors (inputs in, whole outputs out) under its context, and so do the backwards
        self.tp = tp
        self._tp_ctx = tp.context if tp is not None else contextlib.nullcontext
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
        self.offloaded: dict = {}  # offload stages: F key -> its HostActivations until the backward
        # offload stages: compute action (by id) -> the F key whose activations come back while it runs (the
        # rank's next compute action is that stage's backward)
        self.prefetch_at: dict[int, str] = {}
        last = None
        for a in plan.ranks[rank] if not plan.forward_only else ():
            if a.kind not in ("F", "B"):
                continue
            if a.kind == "B" and offloads(a.strategy) and last is not None:
                self.prefetch_at[id(last)] = stage_key("F", a.chunk, a.mb, a.sub)
            last = a
        self.measure: dict | None = None  # run_local(measure=): F key -> (strategy, bytes kept, measured)
        self.grads: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)   # F key -> output name -> grad
        self.out_grads: dict[tuple[str, str], dict[str, torch.Tensor]] = {}  # (F key, producer F key) -> grads
        self.recv: dict[int, tuple[list, list]] = {}
        self.inbox: dict[str, list[int]] = defaultdict(list)  # stage key -> message ids destined to it
        self.received: dict[str, dict[str, dict[str, torch.Tensor]]] = defaultdict(dict)  # stage -> peer -> tensors
        self.sends: list = []
        self.losses: dict[int, torch.Tensor] = {}
        self.timeline: list[tuple] = []  # (action, start, end, seconds of it spent waiting for messages)
        self.wait_s: dict[str, float] = {}
        self.waits: list[tuple] = []  # (receive action, or None for the sends at finish(), start, end)
        self.posted: set[int] = set()  # message ids sent or whose receive is posted
        self.failure = None
        self.statuses: list[tuple] = []  # CUDA: (status word, action) of received messages, read at finish()
        self.loss_scale = 1.0  # a GradScaler's scale: the loss's gradient seed is multiplied by it
        self.uses: dict[str, int] = {}  # forward-only plans: F key -> reads of its outputs still to come on this rank
        #: forward-only plans: model output keys to keep (``logits``) and what this rank computed of them,
        #: (key, microbatch, sub-microbatch) -> tensor
        self.want_outputs: frozenset = frozenset()
        self.extra: dict[tuple[str, int, int], torch.Tensor] = {}
        #: called with each action's index in this rank's plan after it ran (-1 before the first): data
        #: parallelism starts gradient all-reduces there (:class:`dipc.runtime.data_parallel.GradBuckets`)
        self.after_action: Callable[[int], None] | None = None
        if plan.forward_only:
            for a in plan.ranks[rank]:
                if a.kind == "SEND_F":
                    k = stage_key("F", a.chunk, a.mb, a.sub)
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
        if self.after_action is not None:
            self.after_action(-1)
        for i, a in enumerate(acts):
            try:
                self.do(a)
                if self.after_action is not None:
                    self.after_action(i)
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
        ahead = self.prefetch_at.get(id(a))
        if ahead is not None and ahead in self.offloaded:  # the next backward's activations come back meanwhile
            self.offloaded[ahead].prefetch()
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
        fk = stage_key("F", a.chunk, a.mb, a.sub)
        if a.kind == "SEND_F":
            src = self.outputs[fk]
            if self.plan.forward_only:
                self._used(fk)
        else:
            src = self.out_grads.pop((fk, stage_key("F", a.peer_chunk, a.mb, a.peer_sub)))
        tensors = []
        for spec in a.tensors:
            t = src[spec.name].detach()
            if tuple(t.shape) != spec.shape or dtype_name(t.dtype) != spec.dtype:
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
            w0 = time.perf_counter()
            self.tr.wait(work, f"{a} from rank {a.peer_rank}")
            self.waits.append((a, w0 - self.t0, time.perf_counter() - self.t0))
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
        fk = stage_key("F", a.chunk, a.mb, a.sub)
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
        plain = kwargs
        if self.tp is not None:
            kwargs = self.tp.inputs(kwargs)
        if self.plan.forward_only:  # evaluation: no autograd graph; outputs live until their last reader here
            keys = {k: v for k, v in cm.extra.items() if k in self.want_outputs}
            if keys:
                mod = self._outputs_module(prog, a.chunk, keys)
            with torch.no_grad(), self._tp_ctx():
                out = mod(**kwargs)
            if self.tp is not None:
                out = self.tp.outputs(out)
            for k in keys:
                self.extra[(k, a.mb, a.sub)] = out.pop(EXTRA_PREFIX + k)
            if cm.loss is not None:
                self.losses[a.mb] = out[cm.loss].detach()
            self.received.pop(fk, None)
            self.outputs[fk] = out
            self._used(fk, 0)
            return
        layout = recompute_layout(a.strategy)
        prefix = self._prefix_module(prog, a.chunk, *layout) if layout is not None and layout[0] > 0 else None
        if self.measure is not None and a.strategy != "recompute":  # what the forward keeps, measured
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []), \
                    torch.enable_grad():
                kept, _, host = kept_bytes(mod, kwargs, a.strategy, forward=prefix)
                self.measure[fk] = (a.strategy, kept, host) if offloads(a.strategy) else (a.strategy, kept)
        with self._tp_ctx():
            if a.strategy == "recompute":  # keep the inputs only; the backward runs the chunk again
                self.saved[fk] = (plain, _rng_state(self.device))
                with torch.no_grad():
                    out = mod(**kwargs)
            elif a.strategy == "selective":  # one checkpoint keeping the matmul / attention / conv outputs
                out = run_selective(mod, kwargs)
            elif offloads(a.strategy):  # what it saves (outside its checkpoints) waits in host memory until the
                out, self.offloaded[fk] = run_offloaded(prefix or mod, kwargs)  # backward
            elif a.strategy != "keep":  # "recompute:k/g": the first k layers under checkpoints of g layers each
                with torch.enable_grad():
                    out = prefix(**kwargs)
            else:
                with torch.enable_grad():
                    out = mod(**kwargs)
        if self.tp is not None:
            out = self.tp.outputs(out)
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
        fk = stage_key("F", a.chunk, a.mb, a.sub)
        bk = stage_key("B", a.chunk, a.mb, a.sub)
        self._collect(bk)
        prog = self.w.programs[fk]
        cm = prog.chunks[a.chunk]
        out = self.outputs.pop(fk)
        if a.strategy == "recompute":
            kwargs, rng = self.saved.pop(fk)
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []), \
                    torch.enable_grad(), self._tp_ctx():
                _set_rng_state(rng, self.device)
                if self.tp is not None:
                    out = self.tp.outputs(self.mods[(id(prog), a.chunk)](**self.tp.inputs(kwargs)))
                else:
                    out = self.mods[(id(prog), a.chunk)](**kwargs)
        g = self.grads.pop(fk, {})
        for tensors in self.received.pop(bk, {}).values():
            for name, t in tensors.items():
                g[name] = g[name] + t if name in g else t
        tensors, grads = [], []
        # a microbatch without a labelled token weighs 0: its token-mean loss is 0/0, so it seeds no gradient
        # (the unsplit model's tokens there add nothing either)
        if cm.loss is not None and out[cm.loss].requires_grad and self.w.microbatches[a.mb].weight != 0:
            mb = self.w.microbatches[a.mb]
            tensors.append(out[cm.loss])
            grads.append(torch.full_like(out[cm.loss], mb.weight * self.loss_scale))
        for name, t in out.items():
            if name in g and isinstance(t, torch.Tensor) and t.requires_grad:
                tensors.append(t)
                grads.append(g[name])
        host = self.offloaded.pop(fk, None)
        if host is not None:
            host.prefetch()  # (a no-op when the action before brought them back)
        if tensors:
            with self._tp_ctx():
                torch.autograd.backward(tensors, grads)
        del host
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

    def _outputs_module(self, prog, chunk: int, nodes: Mapping[str, str]):
        """The chunk's module returning ``nodes`` too (:func:`dipc.codegen.stage.with_outputs`), built on first use
        and kept with the chunk modules."""
        gm = self.mods[(id(prog), chunk)]
        cache = gm.__dict__.setdefault("_dipc_with_outputs", {})
        k = tuple(sorted(nodes.items()))
        if k not in cache:
            cache[k] = with_outputs(gm, nodes)
        return cache[k]

    def _prefix_module(self, prog, chunk: int, k: int, g: int = 1):
        """The chunk's module with its first ``k`` layers in checkpoints of ``g`` layers
        (:func:`dipc.codegen.stage.recompute_prefix`),
        built on first use and kept with the chunk modules."""
        gm = self.mods[(id(prog), chunk)]
        cache = gm.__dict__.setdefault("_dipc_recompute_prefix", {})
        if (k, g) not in cache:
            cache[(k, g)] = recompute_prefix(gm, k, g)
        return cache[(k, g)]

    def _meta(self, pk, pname):
        return self.w.programs[pk].chunks[self.w.graph.stages[pk].chunk].output_meta[pname]

    def outputs_shape(self, pk, pname):
        return self._meta(pk, pname).concrete_shape(self.w.bindings[pk])

    def finish(self):
        """Wait for this rank's sends; on CUDA, check the status words of the step's messages (one device wait).

        Raises:
            _PeerFailed: a message was an abort message (CUDA: its data was garbage and so is this step's)."""
        w0 = time.perf_counter()
        for work, _ in self.sends:
            self.tr.wait(work, "a send")
        if self.sends:
            self.waits.append((None, w0 - self.t0, time.perf_counter() - self.t0))
        self.sends.clear()
        if self.statuses:
            codes = torch.cat([st for st, _ in self.statuses]).cpu().tolist()
            bad = [(c, a) for c, (_, a) in zip(codes, self.statuses) if c]
            self.statuses.clear()
            if bad:
                raise _PeerFailed(bad[0][0] - 1, bad[0][1])


def _modules_of(workload: StepWorkload, ranks, device: torch.device | None = None, tp=None, fsdp=None) -> dict:
    """(program id, chunk) -> the chunk module, for the stages of ``ranks``; a program traced on the meta device
    (a meta-device model) first gets its graph's ``device=meta`` constants set to ``device`` (:func:`_on_device`);
    under tensor parallelism (``tp``) its graph is prepared for DTensors
    (:meth:`dipc.runtime.tensor_parallel.TensorParallel.prepare`); under sharded data parallelism (``fsdp``) it
    reads the unsharded parameters (:meth:`dipc.runtime.fsdp.FullyShardedParameters.prepare`)."""
    mods = {}
    for k, prog in workload.programs.items():
        st = workload.graph.stages[k]
        if st.rank in ranks:
            gm = prog.module(st.chunk)
            if gm is None:
                raise PlanError(f"chunk {st.chunk} has no module built in this process")
            if getattr(prog, "meta_trace", False):
                _on_device(gm, device or torch.device("cpu"))
            if tp is not None:
                tp.prepare(gm)
            if fsdp is not None:
                fsdp.prepare(gm)
            mods[(id(prog), st.chunk)] = gm
    return mods


def _on_device(gm: torch.fx.GraphModule, device: torch.device) -> None:
    """Replace every ``torch.device("meta")`` argument of ``gm``'s graph (and of its nested graphs: ``torch.cond``
    branches, checkpointed regions) by ``device``: the factory ops (``arange``, ``zeros``, ``full``) and copies
    (``_to_copy``, ``to``) that a trace of a meta-device model recorded.  Done once per module and device."""
    if gm.__dict__.get("_dipc_device") == device:
        return
    from torch.utils._pytree import tree_map

    def fix(a):
        return device if isinstance(a, torch.device) and a.type == "meta" else a

    def edit(m: torch.fx.GraphModule) -> bool:
        changed = False
        for n in m.graph.nodes:
            args, kwargs = tree_map(fix, n.args), tree_map(fix, n.kwargs)
            if args != n.args or kwargs != n.kwargs:
                n.args, n.kwargs = args, kwargs
                changed = True
        return changed

    rewrite_graphs(gm, edit)
    gm.__dict__["_dipc_device"] = device


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
              schedule: str = "dip", measure: dict | None = None, **planning):
    """Execute one step of every rank in this process and return ``(loss, plan)``.

    Gradients accumulate into the model's parameters exactly as the distributed pipeline's would (tied weights
    included, since every rank's chunks share the model's parameter objects here).  ``recompute``: the stages
    that recompute (:func:`set_recompute`); ``memory_limit``: bytes per device the plan stays under
    (:func:`make_plan`); ``schedule``: a template of :func:`dipc.schedules`; ``planning``: the other options of
    :func:`make_plan` (``budget_s``, ``seed``, ``memory_opt``).  Under ``torch.autocast("cpu", ...)`` the chunks run
    under it and the messages carry its dtypes.  ``measure``: a dict that gets, per forward stage at any strategy
    but "recompute" (which keeps its inputs by construction), ``(strategy, bytes it keeps for its backward)``
    measured on a copy of its inputs (:func:`dipc.runtime.selective.kept_bytes`; "offload": ``(strategy, bytes
    kept on the device, bytes kept in host memory)``), and ``measure["workload"]`` the step's workload (its
    :func:`dipc.planner.options.memory_options` are the model's figures).
    """
    meta = [n for n, t in compiled._state.items() if isinstance(t, torch.Tensor) and t.is_meta]
    if meta:
        raise PlanError(f"run_local runs every rank's chunks in this process, but {len(meta)} tensor(s) of the model "
                        f"are on the meta device (e.g. {meta[:3]}: a meta-device model materialised per rank holds "
                        "only its own chunks' weights); use the distributed runtime")
    mbs = split_for(compiled, batch, n_microbatches, schedule)
    w = build_workload(compiled, mbs, autocast_state(torch.device("cpu")))
    if recompute:
        set_recompute(w, recompute)
    given = plan is not None
    plan = plan or make_plan(compiled, w, 0, check=False, memory_limit=memory_limit, schedule=schedule, **planning)
    order = validate(plan)
    if given:  # a plan made for another batch or microbatch count, or one short of a message, runs wrong or fails
        check_matches(compiled, w, plan)  # deep in the executor
    check_strategies(w, plan)
    tr = _LocalTransport()
    ex = [Executor(r, w, plan, tr.bind(r), _modules_of(w, {r})) for r in range(compiled.pp_size)]
    if measure is not None:
        measure["workload"] = w
        for e in ex:
            e.measure = measure
    for r, i in order:
        ex[r].do(plan.ranks[r][i])
    for e in ex:
        e.finish()
    zero_unreached_grads(compiled, w, set(range(compiled.pp_size)))
    loss = sum((mb.weight * l for e in ex for m, l in e.losses.items() for mb in [mbs[m]] if mb.weight),
               torch.zeros(()))
    return loss.detach(), plan
