"""The cost side of a :class:`dipc.CompiledPipeline` (a mixin): DIP's rules for K_i and B_i (shared/PAPER.md §2.1),
each chunk's symbolic cost compiled for the device profile and evaluated per shape (§2.6, memoised per (chunk,
shape)), per-layer costs for recompute, tensor-parallel communication, and the static bytes per rank
(parameters, gradients, optimizer states)."""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import sympy
import torch
import torch.fx

from .capture import Capture
from .passes.cost import node_latency
from .passes.symcost import (SELECTIVE_SAVED_FAMILIES, CompiledCost, GraphContext, annotate_symbolic_cost,
                              compile_costs)
from .program import Program, _bindings


class CostingMixin:
    """The compiled pipeline's costing methods (:mod:`dipc.costing`)."""

    def _latency_f(self, c, d: int = 1) -> sympy.Expr:
        """A node's forward seconds on the device profile (``c``: its SymCost; FLOPs and bytes ÷ ``d``, what the
        tensor-parallel split divides the node by, :meth:`_tp_div`), built once per node: the chunk and the
        per-block costs share it."""
        memo = self.__dict__.setdefault("_latency_f_memo", {})
        hit = memo.get((id(c), d))
        if hit is None or hit[0] is not c:
            hit = memo[(id(c), d)] = (c, self.device.op_latency_expr(c.family, c.flops_fwd / d,
                                                                     (c.bytes_read + c.bytes_written) / d))
        return hit[1]

    @property
    def message_shards(self) -> int:
        """What a stage's inputs, outputs and pipeline messages are divided by per GPU of its tensor-parallel group:
        ``tp_size`` with ``sequence_parallel`` (each GPU keeps and sends its sequence shard), else 1 (each GPU of the
        group holds and sends the whole value, as the runtime does)."""
        return self.tp_size if getattr(self, "sequence_parallel", False) else 1

    def _latency_b(self, c, d: int = 1) -> sympy.Expr:
        """A node's backward seconds on the device profile, as :meth:`_latency_f`."""
        return self.device.op_latency_expr(c.family, c.flops_bwd / d, c.bytes_bwd / d, backward=True)

    def _tp_div(self, cap: Capture):
        """``node name -> d``: what the tensor-parallel split divides a node's work and outputs by on each GPU of a
        stage: ``tp_size`` for the ops the split divides (:func:`dipc.passes.tensor_parallel.split_nodes`, on the
        split of ``cap``'s own graph) and, with ``sequence_parallel``, for every other op too (Megatron-LM's
        sequence parallelism shards norms, dropout and the residual stream on the sequence); 1 for the others
        without it (they run whole on every GPU of the group, as the runtime runs them).  Memoised per graph."""
        T = self.tp_size
        if T == 1 or getattr(self, "sequence_parallel", False):
            return lambda name: T
        from .passes.tensor_parallel import plan_tensor_parallel, split_nodes

        memo = self.__dict__.setdefault("_tp_split_memo", {})
        hit = memo.get(id(cap.graph))
        if hit is None or hit[0] is not cap.graph:
            names = {n: fqn for n, (kind, fqn) in cap.state_targets.items() if kind == "parameter"}
            shapes = {fqn: tuple(self._state[fqn].shape) for fqn in names.values()}
            hit = memo[id(cap.graph)] = (cap.graph, split_nodes(cap.graph, plan_tensor_parallel(
                [cap.graph], names, shapes, T), names))
        split = hit[1]
        return lambda name: T if name in split else 1

    def _block_costs(self, prog: Program, chunk: int):
        """Per layer of ``chunk`` in ``prog``'s capture (``node.meta["dipc_layer"]``, the units of per-layer
        recompute): ``f<j>`` its forward seconds (the roofline of :meth:`_chunk_costs`), ``a<j>`` the bytes its
        nodes save for the backward (a storage saved by several layers at the last of them) and ``i<j>`` the bytes
        of the values it reads from outside itself (what its activation checkpoint holds; parameters left out, a
        storage counted once, at the first layer reading it),
        all per GPU (:meth:`_tp_div`), j = the layer's position in the chunk; compiled in one ``sympy.lambdify``."""
        div = self._tp_div(prog.capture)
        nodes = [n for n in prog.capture.graph.nodes if n.op == "call_function" and n.meta.get("dipc_chunk") == chunk]
        layers: list = []
        for n in nodes:
            if n.meta.get("dipc_layer") not in layers:
                layers.append(n.meta.get("dipc_layer"))
        ctx = GraphContext(prog.capture.graph, prog.capture.input_keys)
        stashed: set = set()  # storages already held by an earlier layer's checkpoint (one copy in memory)
        # a storage several layers save (a RoPE table, a mask, a residual) is kept while any of them is: it counts
        # once, at the last layer saving it, so the layers after k sum to what "recompute:k" keeps, and all of them
        # to the chunk's own figure
        last: dict[str, tuple[int, sympy.Expr]] = {}
        for n in nodes:
            c = n.meta.get("dipc_symcost")
            for key, nbytes in (c.saved if c is not None else ()):
                first = last.get(key, (None, nbytes))[1]
                last[key] = (layers.index(n.meta.get("dipc_layer")), first)
        kept_by: dict[int, list] = {}
        for key, (j, nbytes) in last.items():
            kept_by.setdefault(j, []).append(nbytes / div(key.split("[")[0]))
        exprs = {}
        for j, v in enumerate(layers):
            fs, acts, ins = [], kept_by.get(j, []), []
            for n in nodes:
                if n.meta.get("dipc_layer") != v:
                    continue
                c = n.meta.get("dipc_symcost")
                if c is not None:
                    fs.append(self._latency_f(c, div(n.name)))
                for a in n.all_input_nodes:
                    if a.op not in ("placeholder", "call_function") or (
                            a.op == "call_function" and a.meta.get("dipc_chunk") == chunk
                            and a.meta.get("dipc_layer") == v):
                        continue
                    key, nbytes, is_state = ctx.base(a)
                    if not is_state and key not in stashed:
                        stashed.add(key)
                        ins.append(nbytes / div(key.split("[")[0]))
            exprs[f"f{j}"] = sympy.Add(*fs)
            exprs[f"a{j}"] = sympy.Add(*acts)
            exprs[f"i{j}"] = sympy.Add(*ins)
        return CompiledCost(exprs)

    def _dip_rules(self, cap: Capture, instances, auto_b: set[str]):
        """DIP §2.1 on the device profile: B_i = the smallest sub-microbatch size keeping >= 95% of module i's peak
        efficiency (instances per second of its forward + backward, sizes 1..64), for instance modalities whose
        B_i was not given; T_i = module i's latency at B_i (other modules: on the example batch), for K_i =
        floor(T_i / T_1); and every node's forward + backward seconds at those sizes, by which the partition
        balances blocks.  Returns (instances, module latency, node seconds)."""
        annotate_symbolic_cost(cap.graph, inputs=cap.input_keys)
        div = self._tp_div(cap)
        per_node = {"latency": lambda c, n: self._latency_f(c, div(n.name)) + self._latency_b(c, div(n.name))}
        by_mod: dict[str, list] = {}
        for n in cap.graph.nodes:
            if n.op == "call_function":
                by_mod.setdefault(n.meta["dipc_modality"], []).append(n)
        costs = {m: compile_costs(ns, per_node=per_node) for m, ns in by_mod.items()}
        binds = _bindings(cap)
        example = {}
        ph = {n.name: n for n in cap.graph.nodes if n.op == "placeholder"}
        for sym, key, d in binds:
            name = next(k for k, v in cap.input_keys.items() if v == key)
            example[sym] = int(ph[name].meta["val"].shape[d].node.hint)
        latency = {m: costs[m](example)["latency"] for m in costs}
        at: dict[str, dict] = {}  # modality -> sizes its T_i is taken at (instance modalities: B_i instances)
        out = []
        for inst in instances:
            sym = next((sym for sym, key, d in binds if key == (inst.row_counts or inst.keys[0]) and d == 0), None)
            if sym is None or inst.modality not in costs:
                self.rule_notes[inst.modality] = "instance count fixed by the model: B_i not derived"
                out.append(inst)
                continue
            at_b = _instances_at(inst, binds, example, sym)
            t = {b: costs[inst.modality](at_b(b))["latency"] for b in range(1, 65)}
            eff = {b: b / t[b] for b in t if t[b] > 0}
            b_i = inst.sub_microbatch_size
            if inst.modality in auto_b and eff:
                peak = max(eff.values())
                b_i = min(b for b, e in eff.items() if e >= 0.95 * peak)
                self.rule_notes[inst.modality] = ("B_i by the DIP rule (>= 95% of peak efficiency on "
                                                  f"{self.device.name})")
                inst = dataclasses.replace(inst, sub_microbatch_size=b_i)
            latency[inst.modality] = t.get(b_i, latency[inst.modality])
            at[inst.modality] = at_b(b_i)
            out.append(inst)
        node_seconds = {}
        for m, ns in by_mod.items():
            values = at.get(m, example)
            seen: dict = {}  # a repeated block's nodes share their expressions: evaluated once each
            for n in ns:
                c = n.meta.get("dipc_symcost")
                if c is not None:
                    e = per_node["latency"](c, n)
                    v = seen.get(e)
                    if v is None:
                        v = seen[e] = float(e.xreplace(values))
                    node_seconds[n.name] = v
        return out, latency, node_seconds

    def _chunk_costs(self, cap: Capture) -> dict:
        """Per chunk, its symbolic cost compiled with the device profile's roofline (DIP §2.6), per GPU: with
        ``tp_size`` T each operator's FLOPs, bytes and kept activations are divided by what the split divides it by
        (:meth:`_tp_div`: Megatron's column/row split, and with ``sequence_parallel`` every op) before the roofline,
        so small per-GPU matrices pay the profile's efficiency curve.  ``op_peak_bytes``: the output bytes of the
        chunk's largest op (chosen at the example's sizes), a stage's transient memory."""
        if not any("dipc_symcost" in n.meta for n in cap.graph.nodes):
            annotate_symbolic_cost(cap.graph, inputs=cap.input_keys)
        div = self._tp_div(cap)
        per_node = {"latency_f": lambda c, n: self._latency_f(c, div(n.name)),
                    "latency_b": lambda c, n: self._latency_b(c, div(n.name)), **self._selective_fields(div)}
        nodes: dict[int, list] = {}
        for n in cap.graph.nodes:
            if n.op == "call_function":
                nodes.setdefault(n.meta["dipc_chunk"], []).append(n)
        out = {}
        for c, ns in nodes.items():
            # the stage's transient: the largest single op output at the example's sizes (the trace's size
            # hints), kept as its symbolic expression
            biggest = None
            for n in ns:
                sc = n.meta.get("dipc_symcost")
                if sc is None:
                    continue
                v = _example_bytes(n.meta.get("val"))
                if biggest is None or v > biggest[0]:
                    biggest = (v, sc)
            pick = biggest[1] if biggest else None
            out[c] = compile_costs(ns, per_node={**per_node, "op_peak_bytes": lambda sc, n, pick=pick:
                                                 sc.bytes_written / div(n.name) if sc is pick else sympy.Integer(0)},
                                   kept_share=lambda name: sympy.Rational(1, div(name)))
        return out

    def _selective_fields(self, div) -> dict:
        """The two costs of op-selective recompute (Megatron's selective recompute, torch's selective activation
        checkpointing keeping :data:`dipc.passes.symcost.SELECTIVE_SAVED_FAMILIES`): ``selective_keep_bytes``, the
        outputs of the matmuls, attention and convolutions that carry a gradient (what the checkpoint caches
        besides the chunk's inputs), and ``selective_recompute_f``, the forward seconds of every other op (what
        the backward runs again); per GPU (``div``: :meth:`_tp_div`), as fields of ``compile_costs(per_node=)``."""
        saved = SELECTIVE_SAVED_FAMILIES
        return {"selective_keep_bytes": lambda sc, n: sc.bytes_written / div(n.name)
                if sc.family in saved and sc.flops_bwd != 0 else sympy.Integer(0),
                "selective_recompute_f": lambda sc, n: sympy.Integer(0) if sc.family in saved
                else self._latency_f(sc, div(n.name))}

    # ------------------------------------------------------------------ inspection
    def chunk_latency(self, chunk: int) -> float:
        """Estimated forward latency (seconds) of ``chunk`` on the example batch (the one cost interface the
        runtime's planner uses; the calibrated cost model replaces it)."""
        return node_latency(self.partition.chunks[chunk].cost)

    def tp_comm_seconds(self, prog: Program, chunk: int, bindings: Mapping) -> float:
        """Seconds of the tensor-parallel collectives one forward (or one backward) of ``chunk`` pays at
        ``bindings``, as the split (:meth:`tensor_parallel_plan`) makes the runtime issue them: one per column/row
        pair whose row-parallel weight the chunk reads (forward: the row-parallel output's all-reduce; backward: the
        column-parallel input's gradient) and one per vocabulary-parallel table or LM head (the lookup's all-reduce,
        the logits' gather), each of the chunk's residual stream, taken as its largest floating-point input or
        output value, a ring over ``tp_size`` GPUs on the profile's ``tp_bandwidth``
        (:meth:`dipc.sim.device.DeviceProfile.tp_allreduce_time`).  0 with ``tp_size`` 1 or no device profile."""
        if self.tp_size == 1 or self.device is None:
            return 0.0
        cm = prog.chunks[chunk]
        split = self.tensor_parallel_plan()
        reads = set(cm.state_names)
        n_collectives = sum(1 for _, row in split.pairs if row in reads) + \
            len({id(self._state[w]) for w, st in split.styles.items() if st == "vocab" and w in reads
                 and self._state[w].ndim == 2})
        metas = list(cm.output_meta.values())
        metas += [prog.chunks[i.src_chunk].output_meta[i.name] for i in cm.inputs
                  if i.kind == "value" and i.src_chunk in prog.chunks and i.name in prog.chunks[i.src_chunk].output_meta]
        payload = 0
        for m in metas:
            if m.dtype.is_floating_point:
                n = m.dtype.itemsize
                for d in m.concrete_shape(bindings):
                    n *= d
                payload = max(payload, n)
        return n_collectives * self.device.tp_allreduce_time(payload, self.tp_size)

    def rank_state_bytes(self, optimizer_states: int = 2, amp: tuple[str, str] | None = None) -> list[float]:
        """Bytes per GPU each rank holds all the time: its parameters, their gradients and ``optimizer_states``
        optimizer tensors per parameter (AdamW: 2), once per distinct tensor (tied weights count on every rank
        holding them), plus its buffers; with ``tp_size`` T a parameter the tensor-parallel split divides
        (:meth:`tensor_parallel_plan`: column/row-parallel weights, vocabulary-parallel tables) counts 1/T, the
        replicated ones (norms, row-parallel biases, convolutions) and the buffers whole, as the runtime holds them.
        A 16-bit parameter counts as mixed-precision training keeps it (Megatron's default): the 16-bit weight plus
        an fp32 gradient, fp32 master weight and fp32 optimizer states (2 + 4 x 4 = 18 bytes with AdamW).  ``amp``:
        the step's ``torch.autocast`` (``(device type, dtype name)``, :attr:`StepWorkload.amp`), whose cache keeps a
        cast copy of every wider weight a matmul or convolution reads for the length of the step
        (:meth:`autocast_copy_bytes`)."""
        out = [sum(parts.values()) for parts in self.rank_state_parts(optimizer_states)]
        if amp is not None:
            out = [a + b for a, b in zip(out, self.autocast_copy_bytes(amp[1]))]
        return out

    def autocast_copy_bytes(self, dtype_name: str) -> list[float]:
        """Per rank, the bytes per GPU of the copies ``torch.autocast`` to ``dtype_name`` caches during a step: each
        floating-point parameter wider than it that a matmul, linear or convolution of the rank's chunks reads (the
        ops autocast runs in that dtype), at that dtype's width, once per parameter (autocast's weight cache lives
        until the autocast context exits); the tensor-parallel split divides a split one."""
        cache = self.__dict__.setdefault("_autocast_copy_bytes", {})
        if dtype_name in cache:
            return list(cache[dtype_name])
        width = torch.empty((), dtype=getattr(torch, dtype_name)).element_size()
        ops = {torch.ops.aten.linear.default, torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
               torch.ops.aten.bmm.default, torch.ops.aten.matmul.default, torch.ops.aten.conv2d.default,
               torch.ops.aten.conv1d.default, torch.ops.aten.conv3d.default, torch.ops.aten.convolution.default}
        cap = self.program.capture
        cast = {fqn for n in cap.graph.nodes if n.op == "call_function" and n.target in ops
                for a in n.all_input_nodes for kind, fqn in [cap.state_targets.get(a.name, (None, None))]
                if kind == "parameter"}
        out = [float(sum(numel * width for name, t, numel, _ in self._rank_tensors(r)
                         if name in cast and t.is_floating_point() and t.element_size() > width))
               for r in range(self.pp_size)]
        cache[dtype_name] = out
        return list(out)

    def rank_state_parts(self, optimizer_states: int = 2) -> list[dict[str, float]]:
        """Per rank, the bytes per GPU of :meth:`rank_state_bytes` by kind:

        * ``"parameters"``, ``"gradients"``, ``"optimizer"`` (``optimizer_states`` tensors per parameter, plus the
          fp32 master weight of a 16-bit parameter): what the rank keeps between steps;
        * ``"buffers"``: its buffers (and frozen parameters), whole;
        * ``"step"``: what a step holds besides: with ``fsdp_size`` D > 1 (FSDP2, :mod:`dipc.runtime.fsdp`) the
          unsharded parameters and their gradients, which the runtime all-gathers at the step's start and frees
          once reduce-scattered at its end (0 otherwise).

        Each distinct tensor of the rank's chunks counts once (a tied weight on every rank holding it).  With
        ``tp_size`` T a parameter the tensor-parallel split divides (:meth:`tensor_parallel_plan`) counts 1/T.
        With D > 1 each parameter's kept kinds count FSDP's largest shard, ``ceil(dim0 / D)`` rows (``Shard(0)``,
        as ``torch.chunk`` splits; the last replicas may hold fewer) of the tensor-parallel shard under TP.  A 16-bit
        parameter counts as mixed-precision training keeps it (Megatron's default): the 16-bit weight plus an fp32
        gradient, fp32 master weight and fp32 optimizer states (2 + 4 x 4 = 18 bytes with AdamW)."""
        cache = self.__dict__.setdefault("_state_parts_cache", {})
        if optimizer_states not in cache:
            cache[optimizer_states] = self._state_parts(optimizer_states)
        return [dict(p) for p in cache[optimizer_states]]

    def _rank_tensors(self, r: int):
        """``(name, tensor, numel per GPU, tensor-parallel shard dim or None)`` of each distinct parameter and buffer
        the chunks of rank ``r`` read (the split divides a split one's elements by ``tp_size``:
        :func:`dipc.passes.tensor_parallel.plan_tensor_parallel` splits only what T divides)."""
        tp = self.tensor_parallel_plan()
        seen: dict[int, tuple[str, torch.Tensor]] = {}
        for c in self.partition.chunks:
            cm = self.program.chunks.get(c.index)
            if c.rank == r and cm is not None:
                for name in cm.state_names:
                    t = self._state.get(name)
                    if t is not None:
                        seen[id(t)] = (name, t)
        for name, t in seen.values():
            sd = tp.shard_dim(name, t.ndim)
            yield name, t, t.numel() // (self.tp_size if sd is not None else 1), sd

    def _state_parts(self, optimizer_states: int) -> list[dict[str, float]]:
        D = getattr(self, "fsdp_size", 1)
        out = []
        for r in range(self.pp_size):
            parts = dict.fromkeys(("parameters", "gradients", "optimizer", "buffers", "step"), 0.0)
            for name, t, numel, sd in self._rank_tensors(r):
                es = t.element_size()
                if not (isinstance(t, torch.nn.Parameter) and t.requires_grad):
                    parts["buffers"] += numel * es
                    continue
                kept = numel
                if D > 1:
                    rows = t.shape[0] if t.ndim else 1
                    if sd == 0:  # FSDP shards the tensor-parallel shard's rows
                        rows //= self.tp_size
                    kept = -(-rows // D) * (numel // rows if rows else 0)
                    parts["step"] += numel * 2 * es  # the unsharded weight and its gradient, in its dtype
                parts["parameters"] += kept * es
                if es < 4:  # mixed precision as Megatron keeps it: fp32 main grad, master weight, states
                    parts["gradients"] += kept * 4
                    parts["optimizer"] += kept * 4 * (1 + optimizer_states)
                else:
                    parts["gradients"] += kept * es
                    parts["optimizer"] += kept * es * optimizer_states
            out.append(parts)
        return out


def _example_bytes(v) -> float:
    """Bytes of a node's value at the trace's example sizes (symbolic dims at their hints; tuples summed)."""
    if isinstance(v, (list, tuple)):
        return sum(_example_bytes(x) for x in v)
    if not isinstance(v, torch.Tensor):
        return 0.0
    n = 1
    for d in v.shape:
        hint = getattr(getattr(d, "node", None), "hint", None)
        n *= int(hint) if hint is not None else (int(d) if not hasattr(d, "node") else 1)
    return float(n * v.element_size())


def _state_weights(cap: Capture, model: torch.nn.Module, tp_size: int, optimizer_states: int = 2) -> dict[str, float]:
    """Node name -> bytes per GPU of the parameters it is the first to read, with their gradients and
    ``optimizer_states`` optimizer tensors as :meth:`CompiledPipeline.rank_state_bytes` counts them (a 16-bit
    parameter: 2 + 4 x (2 + states) bytes, mixed precision), ÷ ``tp_size``."""
    per: dict[str, float] = {}
    for n in cap.graph.nodes:
        kind, fqn = cap.state_targets.get(n.name, (None, None))
        if n.op == "placeholder" and kind == "parameter":
            v = n.meta.get("val")
            if v is None:
                continue
            es = v.element_size()
            b = v.numel() * (es + 4 * (2 + optimizer_states) if es < 4 else es * (2 + optimizer_states))
            per[n.name] = b / tp_size
    out: dict[str, float] = {}
    for n in cap.graph.nodes:
        if n.op == "call_function":
            out[n.name] = sum(per.pop(a.name) for a in n.all_input_nodes if a.name in per)
    return out


def _param_weights(cap: Capture, model: torch.nn.Module) -> dict[str, float]:
    """Node name -> parameter elements it is the first to read (each parameter counted once, at its first
    consumer), so that a partition balanced by these weights splits the model by parameter count."""
    sizes = {}
    for n in cap.graph.nodes:
        kind, fqn = cap.state_targets.get(n.name, (None, None))
        if n.op == "placeholder" and kind == "parameter":
            v = n.meta.get("val")
            sizes[n.name] = float(v.numel()) if v is not None else 0.0
    out: dict[str, float] = {}
    for n in cap.graph.nodes:
        if n.op != "call_function":
            continue
        w = 0.0
        for a in n.all_input_nodes:
            if a.name in sizes:
                w += sizes.pop(a.name)
        out[n.name] = w
    return out


def _instances_at(inst, binds, example: dict, sym) -> Callable[[int], dict]:
    """Sizes of ``b`` instances: ``example`` with the instance count symbol ``sym`` at ``b``; for patch-packed rows
    (``row_counts``), the packed keys' row count scaled with it (the example's mean rows per instance)."""
    rows = [s for s, key, d in binds if d == 0 and inst.row_counts and key in inst.keys and key != inst.row_counts]
    n = example.get(sym, 0)
    per = {s: example[s] / n for s in rows} if n else {}

    def at(b: int) -> dict:
        return {**example, sym: b, **{s: max(1, round(b * p)) for s, p in per.items()}}
    return at
