"""The stage graph of one step (DESIGN.md "Data flow", step 2): a forward and a backward stage per (chunk,
microbatch, sub-microbatch) with the named tensors every cross-rank edge carries, their costs and memory
strategies, and the digest every rank compares before the step runs.
"""
from __future__ import annotations

import dataclasses
import json
import functools
import gc

import torch

from ..batch import Microbatch
from ..plan import PlanError, TensorSpec, backward_key, forward_key, recompute_layout, stage_key
from ..stages import Edge, Stage, StageGraph


def dtype_name(dt: torch.dtype) -> str:
    """The name a plan's :class:`dipc.plan.TensorSpec` gives ``dt`` (``torch.bfloat16`` -> ``"bfloat16"``)."""
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
        host_bandwidth: bytes/s per direction of a GPU's link to host memory (the device profile's), or None:
            activation offload is then not offered (:func:`dipc.planner.options.memory_options`).
        mem_bandwidth: the device memory's bytes/s (the profile's), which offload's copies use too; None without
            a profile.
    """

    microbatches: list[Microbatch]
    programs: dict
    data: dict
    bindings: dict
    wiring: dict
    empty: dict
    graph: StageGraph
    tp_size: int = 1
    #: what stage inputs and messages are divided by per GPU (:attr:`dipc.costing.CostingMixin.message_shards`)
    message_shards: int = 1
    amp: tuple[str, str] | None = None  # (device type, dtype) of the torch.autocast the step runs under
    host_bandwidth: float | None = None
    mem_bandwidth: float | None = None


def autocast_state(device: torch.device) -> tuple[str, str] | None:
    """``(device type, dtype name)`` of the ``torch.autocast`` enabled here for ``device``'s type, or None."""
    kind = device.type
    if not torch.is_autocast_enabled(kind):
        return None
    return kind, dtype_name(torch.get_autocast_dtype(kind))


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
    # a meta-device model's trace (DESIGN "per-rank materialisation"): autocast acts on tensors of its device type
    # only, so the interpretation runs on ``amp``'s device, its graph's device=meta arguments set to that device
    dev = torch.device(amp[0])
    on_meta = any(isinstance(v, torch.Tensor) and v.device.type == "meta" for v in vals)

    def _dev(x):
        return dev if isinstance(x, torch.device) and x.type == "meta" else x

    class _Dtypes(torch.fx.Interpreter):
        def run_node(self, n):
            r = super().run_node(n)
            if isinstance(r, torch.Tensor):
                out[n.name] = r.dtype
            return r

        def call_function(self, target, args, kwargs):
            if on_meta:
                import torch.utils._pytree as pytree
                args, kwargs = pytree.tree_map(_dev, (args, kwargs))
            return super().call_function(target, args, kwargs)

    import contextlib

    try:
        with fake_mode if fake_mode is not None else contextlib.nullcontext(), \
                torch.autocast(amp[0], dtype=getattr(torch, amp[1])):
            if on_meta:
                vals = [v.to(dev) if isinstance(v, torch.Tensor) and v.device.type == "meta" else v for v in vals]
            _Dtypes(gm).run(*vals)
    except Exception as first:  # noqa: BLE001 - e.g. masked_scatter on symbolic sizes: the trace's own sizes then
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        def size(d):
            if isinstance(d, torch.SymInt):
                return int(d.node.hint) if d.node.hint is not None else 1
            return int(d)

        out.clear()
        mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
        try:
            with mode:
                args = [torch.empty([size(d) for d in v.shape], dtype=v.dtype, device=_dev(v.device))
                        if isinstance(v, torch.Tensor) else (size(v) if isinstance(v, torch.SymInt) else v)
                        for v in vals]
            with mode, torch.autocast(amp[0], dtype=getattr(torch, amp[1])):
                _Dtypes(gm).run(*args)
        except Exception as e:  # noqa: BLE001
            raise PlanError(f"cannot tell the dtypes the capture produces under torch.autocast{amp}: the fake-tensor "
                            f"run failed symbolically ({type(first).__name__}: {first}) and at the trace's own sizes "
                            f"({type(e).__name__}: {e})") from e
    cache[amp] = out
    return out


def gc_paused(fn):
    """Run ``fn`` with Python's cyclic garbage collector paused (restored as it was on return, nested calls
    leave it to the outermost): a step's planning allocates ~10^5 objects that live through it (stages,
    candidates, schedules), whose promotion set off generation-2 collections over everything the process holds -
    0.4-0.6 s each, about a fifth of a VLM-L / 64-microbatch plan.  Its garbage is mostly acyclic (freed by
    reference counting as it goes); the rest waits for the next collection after the call."""

    @functools.wraps(fn)
    def paused(*args, **kwargs):
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return paused


@gc_paused
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
    inst_of = {}  # modality -> its (first) instance kind
    for i in compiled.batch_spec.instances:
        inst_of.setdefault(i.modality, i)
    ex_units: dict[str, float] = {}  # filled on first use (only the no-device estimate needs it)
    stages: dict[str, Stage] = {}
    mb_forwards: list[str] = []
    programs, data, bindings = {}, {}, {}
    wiring: dict[str, dict[str, list]] = {}
    empty: dict[str, dict] = {}
    edges: dict[tuple[str, str], list[TensorSpec]] = {}

    bound: dict[tuple[int, int], dict] = {}  # (program, data) -> its bindings: each chunk of a view binds alike
    boundary_kinds: dict[tuple[int, str], dict] = {}  # (program, modality) -> _boundary_kinds, once per step

    def kinds_of(prog, modality, mb):
        hit = boundary_kinds.get((id(prog), modality))
        if hit is None:
            hit = boundary_kinds[(id(prog), modality)] = _boundary_kinds(prog, modality, mb.kinds.get(modality))
        return hit

    def add_stage(c, m, s, prog, view, units):
        bind = bound.get((id(prog), id(view)))  # both live until the workload is built: their ids stay theirs
        if bind is None:
            bind = bound[(id(prog), id(view))] = prog.bind(view)
        cost = prog.stage_cost(c, bind)
        if cost is not None:  # symbolic cost on the device profile, at this stage's own sizes
            tp = compiled.tp_comm_seconds(prog, c, bind) if compiled.tp_size > 1 else 0.0
            lat = {"F": cost["latency_f"] + tp, "B": cost["latency_b"] + tp}
            act = cost["activation_bytes"]  # per GPU already (the tensor-parallel split, dipc.costing._tp_div)
            # the largest op's output while the forward runs; the backward holds its gradient and its input's
            op = cost.get("op_peak_bytes", 0.0)
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
        k = stage_key("F", c, m, s)
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
                kind = mb.sub_kind(mod, j, inst)
                view = mb.sub_view(kind, j)
                sp = compiled.program_for(view, whole=False)
                sub_progs[(mod, j)] = sp
                for c in sorted(sp.chunks):
                    if mod_of[c] == mod:
                        add_stage(c, m, j, sp, view, view[kind.keys[0]].shape[0])
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
                    w[inp.name] = [(stage_key("F", inp.src_chunk, m, st.sub if src_mod == st.modality else -1), inp.name)]
                    continue
                # a value from a sub-microbatched modality: concatenate its sub-microbatches' outputs (of the
                # instance kind the value is made from, where the modality has several)
                kind_of = kinds_of(p, src_mod, mb)
                mine = [n for n in p.boundary[src_mod] if kind_of[n] is kind_of[inp.name]]
                k_idx = mine.index(inp.name)
                producers = []
                for j in range(len(mb.subs[src_mod])):
                    kind = mb.sub_kind(src_mod, j, inst_of[src_mod])
                    if kind_of[inp.name] is not None and kind is not kind_of[inp.name]:
                        continue
                    sp = sub_progs[(src_mod, j)]
                    theirs = [n for n in sp.boundary.get(src_mod, [])
                              if kinds_of(sp, src_mod, mb)[n] is kind_of[inp.name]]
                    if len(theirs) != len(mine):
                        raise PlanError(f"the capture for sub-microbatch {j} of microbatch {m} hands "
                                        f"{sp.boundary.get(src_mod)} from {src_mod} to the backbone, the microbatch's "
                                        f"capture expects {p.boundary[src_mod]}")
                    name = theirs[k_idx]
                    src_chunk = next(c for c, cmj in sp.chunks.items() if name in cmj.outputs)
                    producers.append((stage_key("F", src_chunk, m, j), name))
                w[inp.name] = producers
                if not producers:
                    meta = p.chunks[inp.src_chunk].output_meta[inp.name]
                    dt = autocast_dtypes(p, amp).get(inp.name, meta.dtype)
                    empty.setdefault(key, {})[inp.name] = (meta.concrete_shape(bindings[key]), dt)
    specs: dict[tuple[str, str], tuple[TensorSpec, bool]] = {}  # (producer, value) -> its spec, for every consumer
    for key, w in wiring.items():
        for name, producers in w.items():
            for pk, pname in producers:
                pst = stages[pk]
                got = specs.get((pk, pname))
                if got is None:
                    meta = programs[pk].chunks[pst.chunk].output_meta[pname]
                    dt = autocast_dtypes(programs[pk], amp).get(pname, meta.dtype)
                    got = specs[(pk, pname)] = (TensorSpec(pname, meta.concrete_shape(bindings[pk]),
                                                           dtype_name(dt)), meta.requires_grad)
                spec, requires_grad = got
                lst = edges.setdefault((pk, key), [])
                if spec not in lst:
                    lst.append(spec)
                if pst.rank == stages[key].rank:  # the consumer reads the producer's outputs: they live until then
                    edges.setdefault((key, backward_key(pk)), [])
                if requires_grad:
                    bk = backward_key(key)
                    bpk = backward_key(pk)
                    lst_b = edges.setdefault((bk, bpk), [])
                    if spec not in lst_b:
                        lst_b.append(spec)
    edge_list = [Edge(src=s, dst=d, tensors=tuple(t) if stages[s].rank != stages[d].rank else ())
                 for (s, d), t in edges.items()]
    return StepWorkload(microbatches=microbatches, programs=programs, data=data, bindings=bindings, wiring=wiring,
                        empty=empty, graph=StageGraph(stages=stages, edges=edge_list), tp_size=compiled.tp_size,
                        message_shards=compiled.message_shards,
                        amp=amp, host_bandwidth=_host_bandwidth(compiled.device),
                        mem_bandwidth=getattr(compiled.device, "mem_bandwidth", None))


def check_strategies(w: StepWorkload, plan) -> None:
    """Check that every compute action's memory strategy can run on its chunk as this step captured it: a
    "recompute:k" or "recompute:k/g" recomputes at most the chunk's layers (:attr:`ChunkModule.n_layers`).  Run
    before a step (in run_local; on rank 0 for a plan given to pipe.step), so that a bad strategy fails before
    any gradient accumulates.

    Raises:
        PlanError: a strategy is unknown, or asks for more layers than its chunk has (names the stage)."""
    for r, a in plan.compute_actions():
        layout = recompute_layout(a.strategy)
        if layout is None or layout[0] == 0:
            continue
        prog = w.programs.get(forward_key(a.stage))
        if prog is None:
            continue
        n = max(prog.chunks[a.chunk].n_layers, 1)
        if layout[0] > n:
            raise PlanError(f"{a.kind} of stage {a.stage} on rank {r} has memory strategy {a.strategy!r}, but chunk "
                            f"{a.chunk} runs {n} layer(s) in this step's capture: recompute at most {n}")


def check_matches(compiled, w: StepWorkload, plan) -> None:
    """Check that ``plan`` is a plan of ``compiled``'s step ``w``, beyond what :func:`dipc.validation.validate` checks (the
    plan's consistency with itself): its chunks live on the ranks of ``compiled``'s partition, it has
    every compute stage of the graph and no other, every message carries exactly the tensors (names, shapes, dtypes)
    that its edge of the graph carries, it has a message for every edge that carries tensors between ranks and none
    the graph lacks, and its dependencies include every edge of the graph.  A plan that validates on its own but
    leaves out a gradient message (and its dependency) would run and leave gradients short, silently; one made for
    a batch with other sequence lengths would fail inside the executor.  Run on a plan the caller hands over
    (``pipe.step(batch, plan=p)``, :func:`dipc.runtime.run_local`); dipc's own plans are lowered from the graph.

    Raises:
        PlanError: naming the first difference."""
    from ..plan import SENDS

    chunk_ranks = [c.rank for c in compiled.partition.chunks]
    if list(plan.chunk_ranks) != chunk_ranks:
        raise PlanError(f"the plan puts chunks on ranks {list(plan.chunk_ranks)}, the compiled pipeline on "
                        f"{chunk_ranks}")
    fwd = plan.forward_only
    want = {k for k in w.graph.stages if not fwd or k[0] == "F"}
    have = {a.stage for _, a in plan.compute_actions()}
    if want != have:
        missing, extra = sorted(want - have)[:3], sorted(have - want)[:3]
        raise PlanError(f"the plan is not for this batch split into {len(w.microbatches)} microbatches: its stages "
                        f"miss {missing} and have {extra} this step does not")
    need = {(e.src, e.dst): e.tensors for e in w.graph.edges if e.tensors and (not fwd or e.src[0] == "F")}
    sent: dict[tuple[str, str], tuple] = {}
    for r, acts in enumerate(plan.ranks):
        for a in acts:
            if a.kind in SENDS:
                key = (a.stage, a.peer_stage)
                if key in sent:
                    raise PlanError(f"the plan sends twice from stage {key[0]} to stage {key[1]} (rank {r}); this "
                                    "step's stage graph has one message per edge")
                sent[key] = a.tensors
    for key, tensors in need.items():
        got = sent.get(key)
        if got is None:
            raise PlanError(f"this step's stage graph sends {[t.name for t in tensors]} from stage {key[0]} to stage "
                            f"{key[1]}, but the plan has no message for it")
        if tuple(got) != tuple(tensors):
            raise PlanError(f"the plan's message from stage {key[0]} to stage {key[1]} carries "
                            f"{[(t.name, list(t.shape), t.dtype) for t in got]}, this step's stage graph "
                            f"{[(t.name, list(t.shape), t.dtype) for t in tensors]}")
    extra = sorted(set(sent) - set(need))
    if extra:
        raise PlanError(f"the plan sends from stage {extra[0][0]} to stage {extra[0][1]}, an edge this step's stage "
                        "graph does not have")
    for e in w.graph.edges:
        if (not fwd or e.src[0] == "F") and e.src not in plan.deps.get(e.dst, ()):
            raise PlanError(f"stage {e.dst} depends on stage {e.src} in this step's stage graph, but not in the "
                            "plan's deps")


def workload_digest(w: StepWorkload) -> str:
    """SHA-256 of a step: every edge of its stage graph with the names, shapes and dtypes of the tensors it
    carries, and the values of each microbatch's integer tensors and Python values (flags, scales, lists).  Ranks that traced the model alike
    and were given the same batch agree on it."""
    import hashlib

    h = hashlib.sha256()
    text: dict[tuple, str] = {}  # a forward's message and its gradient's carry the same specs: written once
    parts = []
    for e in sorted(w.graph.edges, key=lambda e: (e.src, e.dst)):
        ids = tuple(map(id, e.tensors))
        specs = text.get(ids)
        if specs is None:
            specs = text[ids] = str([(t.name, t.shape, t.dtype) for t in e.tensors])
        parts.append(f"{e.src}>{e.dst}:{specs};")
    h.update("".join(parts).encode())
    for mb in w.microbatches:  # and the batch: integer tensors (tokens, labels), their values as int64 bytes
        for k in sorted(mb.data):
            v = mb.data[k]
            if not isinstance(v, torch.Tensor):  # a Python value is a constant of the trace: as JSON, the form the
                try:  # background planner receives it in (a tuple reads back as a list)
                    text = json.dumps(v, sort_keys=True)
                except (TypeError, ValueError):
                    text = repr(v)
                h.update(f"{k}={text};".encode())
            elif not v.is_floating_point() and not v.is_complex() and v.numel():
                flat = v.detach().reshape(-1)
                if flat.dtype != torch.int64:
                    flat = flat.long()
                h.update(f"{k}:{flat.numel()}:".encode())
                h.update(flat.cpu().numpy().data)
                h.update(b";")
    return h.hexdigest()


def float_digest(microbatches) -> str:
    """BLAKE2b of the values of every floating-point tensor of the microbatches (pixels, latents, masks), their raw
    bytes: what the ranks compare besides :func:`step_digest`, which the background planner makes from a batch
    without float values.  About 1 GB/s on one core."""
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    for mb in microbatches:
        for k in sorted(mb.data):
            v = mb.data[k]
            if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) and v.numel():
                h.update(f"{k}:{list(v.shape)}:{v.dtype}:".encode())
                h.update(v.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().data)
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
    """Per modality, the work units of the example batch's capture (instances, or tokens for text); kept on the
    compiled pipeline per capture (every step's first estimate reads them)."""
    ex = compiled.program.capture
    memo = compiled.__dict__.get("_dipc_example_units")
    if memo is not None and memo[0] is ex:
        return memo[1]
    out = _count_example_units(compiled, ex)
    compiled.__dict__["_dipc_example_units"] = (ex, out)
    return out


def _boundary_kinds(prog, modality: str, kinds) -> dict:
    """Each value ``prog``'s ``modality`` chunks hand to other modalities -> the instance kind it is made from
    (the kind whose keys it depends on), or ``None`` for every value where the modality has one kind."""
    names = prog.boundary.get(modality, [])
    if not kinds:
        return dict.fromkeys(names)
    out = {}
    for n in names:
        deps = prog.boundary_keys.get(n, frozenset())
        hit = [k for k in kinds if deps & set(k.keys)]
        if len(hit) != 1:
            raise PlanError(f"{modality} value {n!r} depends on the keys of {len(hit)} instance kinds "
                            f"({sorted(deps)}): each value a modality hands on must come from one kind")
        out[n] = hit[0]
    return out


def _count_example_units(compiled, ex) -> dict[str, float]:
    out = {}
    inst_of = {}
    for i in compiled.batch_spec.instances:
        if all(k in ex.input_keys.values() for k in i.keys):
            inst_of.setdefault(i.modality, i)
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


def split_for(compiled, batch, n_microbatches: int, schedule: str = "dip",
              allow_unlabelled: bool = False) -> list[Microbatch]:
    """``compiled.batch_spec.split`` as ``schedule`` needs it: sub-microbatches for DIP, the encoders on each
    microbatch whole for the static templates.

    Raises:
        ValueError: unknown ``schedule``.
        dipc.batch.BatchError: see :meth:`dipc.batch.BatchSpec.split`.
    """
    from ..codegen.templates import template

    whole = not template(schedule).sub_microbatches
    return compiled.batch_spec.split(batch, n_microbatches, whole_instances=whole,
                                     allow_unlabelled=allow_unlabelled)


def _host_bandwidth(dev) -> float | None:
    """A device profile's ``host_bandwidth`` where it also states ``host_memory`` (offload needs both), else None."""
    if dev is None or dev.host_bandwidth is None or dev.host_memory is None:
        return None
    return dev.host_bandwidth
