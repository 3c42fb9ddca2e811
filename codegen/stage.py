"""Codegen: turn a partitioned capture into one ``torch.fx.GraphModule`` per chunk.

Each chunk module (DESIGN.md, "Chunk / stage module"):

* takes its inputs as keyword arguments named after the values they carry: batch keys (``input_ids``), values
  computed by other chunks (named after the producing node, e.g. ``linear_19``) and symbolic sizes (``sym_size_int_3``)
  that the runtime evaluates from the batch's shapes, so no integer ever travels between ranks;
* returns a dict of the values other chunks consume (and ``loss`` for the chunk that computes it);
* owns the parameters and buffers it reads under their original fully qualified names (the *same*
  ``nn.Parameter`` objects as the model's, so a weight read by two chunks on one rank accumulates one gradient);
* routes values used several chunks later (RoPE tables, masks, position ids, labels, skip connections) explicitly:
  every chunk that reads a value lists it as an input, whichever chunk produced it.

Pure: no process group, no I/O.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Mapping

import sympy
import torch
import torch.fx

from dipc.passes.symcost.compiled import at_zero

__all__ = ["ChunkInput", "ValueMeta", "ChunkModule", "build_chunk_modules", "value_meta", "CodegenError", "chunk_blocks",
           "recompute_prefix", "chunk_layers", "with_outputs", "EXTRA_PREFIX"]


class CodegenError(ValueError):
    """A partitioned graph cannot be turned into chunk modules."""


@dataclasses.dataclass(frozen=True)
class ValueMeta:
    """Shape and dtype of a value crossing chunks.

    Attributes:
        shape: per dim an ``int`` or a sympy expression in the capture's input size symbols.
        dtype: torch dtype.
        requires_grad: True when the value carries a gradient back to its producer.
    """

    shape: tuple
    dtype: torch.dtype
    requires_grad: bool

    def concrete_shape(self, bindings: Mapping[sympy.Symbol, int]) -> tuple[int, ...]:
        """Evaluate the shape for concrete input sizes.

        Raises:
            CodegenError: the shape depends on a symbol the bindings do not give (data-dependent size).
        """
        out = []
        for s in self.shape:
            out.append(s if isinstance(s, int) else _size(s, bindings))
        return tuple(out)


# a size expression's value at given symbol values: the per-batch path (one stage graph per step, planned in the
# background) evaluates the same few expressions at the same few sizes over and over, and sympy's substitution is
# its dearest part.  Keyed by the expression and its free symbols' values; cleared when it grows past a bound.
_SIZES: dict[tuple, int] = {}
_FREE: dict[Any, tuple] = {}
_SIZES_MAX = 1 << 16


def _size(expr, bindings: Mapping[sympy.Symbol, int]) -> int:
    syms = _FREE.get(expr)
    if syms is None:
        syms = _FREE[expr] = tuple(sorted(getattr(expr, "free_symbols", ()), key=str))
    try:
        key = (expr, tuple(bindings[x] for x in syms))
    except KeyError:  # a symbol without a value: the general path says which
        key = None
    if key is not None:
        v = _SIZES.get(key)
        if v is not None:
            return v
    try:
        v = sympy.sympify(expr.xreplace(bindings))
    except ZeroDivisionError:  # a size divided by a 0 size: the tensor is empty (dipc.capture.size_floordiv)
        try:
            v = sympy.Integer(int(at_zero(expr, bindings)))
        except KeyError as e:
            raise CodegenError(f"size {expr} depends on data ({e} unknown); data-dependent shapes cannot cross "
                               "chunks") from None
    if not v.is_number:
        raise CodegenError(f"size {expr} depends on data ({v.free_symbols} unknown); data-dependent shapes "
                           "cannot cross chunks")
    v = int(v)
    if key is not None:
        if len(_SIZES) >= _SIZES_MAX:
            _SIZES.clear()
        _SIZES[key] = v
    return v


@dataclasses.dataclass(frozen=True)
class ChunkInput:
    """One keyword input of a chunk module.

    Attributes:
        name: keyword name.
        kind: "batch" (a batch key), "value" (produced by chunk ``src_chunk``) or "sym" (an integer size).
        key: the batch key (kind "batch").
        src_chunk: producing chunk (kind "value").
        expr: sympy expression of the size (kind "sym").
    """

    name: str
    kind: str
    key: str | None = None
    src_chunk: int | None = None
    expr: Any = None


@dataclasses.dataclass
class ChunkModule:
    """A generated chunk of one capture.

    Attributes:
        chunk: global chunk index (see ``dipc.passes.partition``).
        gm: the chunk's GraphModule, ``gm(**inputs) -> {name: tensor}``; ``None`` when not built on this rank.
        inputs: keyword inputs in order.
        outputs: names of the values returned (consumed by other chunks, or the loss).
        loss: name of the loss output when this chunk computes it.
        output_meta: name -> :class:`ValueMeta` of each output.
        state_names: fully qualified names of the parameters and buffers it reads.
        n_nodes: number of compute nodes.
        n_blocks: number of the partition's blocks it runs (:func:`chunk_blocks`): the units of per-layer
            recompute.
        n_layers: number of layers it runs (:func:`chunk_layers`): the units of per-layer recompute
            ("recompute:k" checkpoints its first k layers, each on its own).
        extra: model output key -> name of the node of this chunk's graph that computes it (``logits``): values
            the module does not return, which forward-only evaluation asks for (:func:`with_outputs`).
        extra_meta: model output key -> its :class:`ValueMeta`.
    """

    chunk: int
    gm: torch.fx.GraphModule | None
    inputs: list[ChunkInput]
    outputs: list[str]
    loss: str | None
    output_meta: dict[str, ValueMeta]
    state_names: list[str]
    n_nodes: int
    n_blocks: int = 1
    n_layers: int = 1
    extra: dict[str, str] = dataclasses.field(default_factory=dict)
    extra_meta: dict[str, ValueMeta] = dataclasses.field(default_factory=dict)


def _expr(s):
    if isinstance(s, torch.SymInt):
        return s.node.expr
    return int(s)


def value_meta(node: torch.fx.Node, requires_grad: bool) -> ValueMeta:
    """:class:`ValueMeta` of a tensor-valued node from its fake value."""
    v = node.meta["val"]
    rg = requires_grad and (v.dtype.is_floating_point or v.dtype.is_complex)
    return ValueMeta(shape=tuple(_expr(s) for s in v.shape), dtype=v.dtype, requires_grad=rg)


def grad_flow(graph: torch.fx.Graph, state_targets: Mapping[str, tuple[str, str]],
              state: Mapping[str, torch.Tensor]) -> set[torch.fx.Node]:
    """Nodes whose value may carry a gradient: floating tensors that depend on a trainable parameter."""
    rg: set[torch.fx.Node] = set()
    for n in graph.nodes:
        if n.op == "placeholder":
            kind, fqn = state_targets.get(n.name, (None, None))
            t = state.get(fqn) if fqn else None
            if kind == "parameter" and t is not None and t.requires_grad:
                rg.add(n)
        elif n.op == "call_function" and any(a in rg for a in n.all_input_nodes):
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor) and (v.dtype.is_floating_point or v.dtype.is_complex):
                rg.add(n)
            elif isinstance(v, (list, tuple)) and n.target is not operator.getitem:
                rg.add(n)  # multi-output op: its getitems decide
    return rg


def _is_sym(node: torch.fx.Node) -> bool:
    v = node.meta.get("val")
    return isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)) and not isinstance(
        v, torch.Tensor)


def _attach_getitems(graph: torch.fx.Graph) -> None:
    """Multi-output ops and their ``getitem`` users stay in one chunk (tuples never cross chunks)."""
    for n in graph.nodes:
        if n.op == "call_function" and n.target is operator.getitem:
            src = n.args[0]
            if isinstance(src, torch.fx.Node) and "dipc_chunk" in src.meta:
                n.meta["dipc_chunk"] = src.meta["dipc_chunk"]


def build_chunk_modules(graph: torch.fx.Graph, state_targets: Mapping[str, tuple[str, str]],
                        input_keys: Mapping[str, str], loss_node: str, state: Mapping[str, torch.Tensor],
                        n_chunks: int, build: set[int] | None = None,
                        data_symbols=(), extra_outputs: Mapping[str, str] = {}) -> dict[int, ChunkModule]:
    """Generate the chunk modules of one capture whose compute nodes carry ``dipc_chunk``.

    Args:
        graph: the partitioned capture graph.
        state_targets: placeholder name -> (kind, fully qualified name) for parameters, buffers and constants.
        input_keys: placeholder name -> batch key for user inputs.
        loss_node: name of the loss node.
        state: fully qualified name -> tensor: the model's own parameters/buffers and the capture's constants.
        n_chunks: total number of chunks of the partition.
        build: chunk indices whose GraphModule to build (others get ``gm=None`` and only their interface);
            ``None`` builds all.
        data_symbols: data-dependent size symbols the runtime computes from the batch
            (:mod:`dipc.passes.datasizes`); sizes in them may cross chunks.
        extra_outputs: model output key -> capture node name of other model outputs (``logits``,
            :attr:`dipc.capture.Capture.outputs`): recorded in the chunk that computes each (``ChunkModule.extra``).

    Returns:
        chunk index -> :class:`ChunkModule` for every chunk that has compute nodes in this capture.

    Raises:
        CodegenError: a symbolic size crossing chunks depends on data.
    """
    _attach_getitems(graph)
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    # symbols bound by the user inputs' sizes
    bound = set()
    for name, key in input_keys.items():
        v = placeholders[name].meta.get("val")
        for s in getattr(v, "shape", ()):
            if isinstance(s, torch.SymInt):
                bound |= s.node.expr.free_symbols
    bound |= set(data_symbols)
    compute = [n for n in graph.nodes if n.op == "call_function"]
    rg = grad_flow(graph, state_targets, state)
    by_chunk: dict[int, list[torch.fx.Node]] = {}
    for n in compute:
        by_chunk.setdefault(n.meta["dipc_chunk"], []).append(n)
    consumers: dict[torch.fx.Node, set[int]] = {}
    for n in compute:
        for a in n.all_input_nodes:
            if a.op == "call_function" and a.meta["dipc_chunk"] != n.meta["dipc_chunk"]:
                consumers.setdefault(a, set()).add(n.meta["dipc_chunk"])

    out: dict[int, ChunkModule] = {}
    for c in sorted(by_chunk):
        nodes = by_chunk[c]
        g = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        inputs: list[ChunkInput] = []
        state_names: list[str] = []
        external: list[torch.fx.Node] = []
        for n in nodes:  # external inputs in order of first use
            for a in n.all_input_nodes:
                if (a.op == "placeholder" or a.meta.get("dipc_chunk") != c) and a not in external:
                    external.append(a)
        attrs, submods = [], []
        for a in external:
            if a.op == "placeholder" and a.name in state_targets:
                attrs.append(a)
                continue
            if a.op == "get_attr":  # the subgraph of a higher-order op (no_grad region, cond, flex attention, ...)
                sub = getattr(graph.owning_module, a.target, None) if graph.owning_module is not None else None
                if not isinstance(sub, torch.nn.Module):
                    users = ", ".join(f"{u.name} ({u.target})" for u in a.users)
                    raise CodegenError(f"chunk {c} reads graph attribute {a.target!r} ({type(sub).__name__}) used by "
                                       f"{users} in module {_module_of(nodes, a)}; dipc can place only submodules "
                                       "of higher-order ops")
                submods.append((a, sub))
                continue
            if a.op == "placeholder":
                ci = ChunkInput(name=input_keys[a.name], kind="batch", key=input_keys[a.name])
            elif _is_sym(a):
                v = a.meta["val"]
                expr = v.node.expr if hasattr(v, "node") else sympy.Integer(int(v))
                if not expr.free_symbols <= bound:
                    raise CodegenError(
                        f"chunk {c} needs the size {a.name} = {expr} computed in chunk {a.meta['dipc_chunk']}, and "
                        f"it depends on data ({expr.free_symbols - bound}); such sizes cannot cross chunks")
                ci = ChunkInput(name=a.name, kind="sym", expr=expr)
            else:
                ci = ChunkInput(name=a.name, kind="value", src_chunk=a.meta["dipc_chunk"])
            ph = g.placeholder(ci.name)
            ph.meta.update({k: v for k, v in a.meta.items() if k in ("val", "tensor_meta")})
            env[a] = ph
            inputs.append(ci)
        for a in attrs:
            _, fqn = state_targets[a.name]
            if fqn not in state_names:
                state_names.append(fqn)
            env[a] = g.get_attr(fqn)
            env[a].meta.update({k: v for k, v in a.meta.items() if k in ("val", "tensor_meta")})
        for a, sub in submods:
            env[a] = g.get_attr(a.target)
            env[a].meta.update(a.meta)
        for n in nodes:
            env[n] = g.node_copy(n, lambda a: env[a])
        outputs: dict[str, torch.fx.Node] = {}
        meta: dict[str, ValueMeta] = {}
        loss = None
        for n in nodes:
            if n in consumers and not _is_sym(n):
                if not isinstance(n.meta.get("val"), torch.Tensor):
                    raise CodegenError(f"value {n.name} ({type(n.meta.get('val')).__name__}) crosses from chunk {c} "
                                       f"to {sorted(consumers[n])}; only tensors and sizes may cross chunks")
                outputs[n.name] = env[n]
                meta[n.name] = value_meta(n, n in rg)
            if n.name == loss_node:
                outputs[n.name] = env[n]
                meta[n.name] = value_meta(n, n in rg)
                loss = n.name
        extra, extra_meta = {}, {}
        for key, name in extra_outputs.items():
            n = next((n for n in nodes if n.name == name), None)
            if n is not None and isinstance(n.meta.get("val"), torch.Tensor):
                extra[key], extra_meta[key] = env[n].name, value_meta(n, False)
        g.output(outputs)
        g.lint()
        gm = None
        if build is None or c in build:
            gm = _make_module(g, state_names, state, {a.target: sub for a, sub in submods})
        out[c] = ChunkModule(chunk=c, gm=gm, inputs=inputs, outputs=list(outputs), loss=loss, output_meta=meta,
                             state_names=state_names, n_nodes=len(nodes),
                             n_blocks=len({n.meta.get("dipc_block") for n in nodes}),
                             n_layers=len(chunk_layers(g)), extra=extra,
                             extra_meta=extra_meta)
    return out


#: prefix of the extra outputs :func:`with_outputs` adds to a chunk module's result (not a valid node name)
EXTRA_PREFIX = "output:"


def rewrite_graphs(gm: torch.fx.GraphModule, edit) -> None:
    """Edit ``gm``'s graph and its nested graphs (``torch.cond`` branches, checkpointed regions) in place:
    ``edit(graph_module)`` returns whether it changed that graph, which is then recompiled; the modules derived from
    ``gm``'s graph (:func:`with_outputs`, :func:`recompute_prefix`, cached on it by the executor) are dropped."""
    for m in gm.modules():
        if isinstance(m, torch.fx.GraphModule) and edit(m):
            m.recompile()
    gm.__dict__.pop("_dipc_recompute_prefix", None)
    gm.__dict__.pop("_dipc_with_outputs", None)


def with_outputs(gm: torch.fx.GraphModule, nodes: Mapping[str, str]) -> torch.fx.GraphModule:
    """A copy of the chunk module ``gm`` (sharing its parameters and submodules) that also returns the values of
    ``nodes`` (output key -> node name in ``gm``'s graph), each under ``EXTRA_PREFIX + key``.

    Raises:
        CodegenError: a node name is not in ``gm``'s graph.
    """
    g = torch.fx.Graph()
    env: dict = {}
    res = g.graph_copy(gm.graph, env)
    by_name = {n.name: env[n] for n in gm.graph.nodes if n in env}
    res = dict(res)
    for key, name in nodes.items():
        if name not in by_name:
            raise CodegenError(f"output {key!r}: node {name!r} is not in the chunk's graph")
        res[EXTRA_PREFIX + key] = by_name[name]
    g.output(res)
    return torch.fx.GraphModule(gm, g)


def _module_of(nodes, attr: torch.fx.Node) -> str:
    """The module path of the first node reading ``attr`` (for error messages)."""
    for u in attr.users:
        stack = u.meta.get("nn_module_stack") or {}
        if stack:
            return repr(list(stack.values())[-1][0] or type(attr.graph.owning_module).__name__)
    return "(unknown)"


def _make_module(g: torch.fx.Graph, names: list[str], state: Mapping[str, torch.Tensor],
                 submodules: Mapping[str, torch.nn.Module] = {}) -> torch.fx.GraphModule:
    root = torch.nn.Module()
    for target, sub in submodules.items():
        root.add_module(target, sub)
    for fqn in names:
        *prefix, field = fqn.split(".")
        mod = root
        for p in prefix:
            if not hasattr(mod, p):
                mod.add_module(p, torch.nn.Module())
            mod = getattr(mod, p)
        t = state[fqn]
        if isinstance(t, torch.nn.Parameter):
            mod.register_parameter(field, t)
        else:
            mod.register_buffer(field, t)
    gm = torch.fx.GraphModule(root, g, class_name="Chunk")
    return gm


class _Checkpointed(torch.nn.Module):
    """Runs ``inner`` under non-reentrant activation checkpointing: its forward keeps only its inputs (and the RNG
    state), the backward runs it again (torch.utils.checkpoint)."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        import torch.utils.checkpoint as cp

        return cp.checkpoint(self.inner, *args, use_reentrant=False)


def _first_seen(gm: torch.fx.GraphModule | torch.fx.Graph, key: str) -> list:
    """Distinct values of ``node.meta[key]`` on a graph's compute nodes, in graph order of their first node."""
    out: list = []
    for n in (gm.graph if isinstance(gm, torch.fx.GraphModule) else gm).nodes:
        v = n.meta.get(key) if n.op == "call_function" else None
        if v is not None and v not in out:
            out.append(v)
    return out


def chunk_blocks(gm: torch.fx.GraphModule | torch.fx.Graph) -> list[int]:
    """The partition's blocks (``node.meta["dipc_block"]``, :mod:`dipc.passes.blocks`) a chunk module runs, in
    graph order."""
    return _first_seen(gm, "dipc_block")


def chunk_layers(gm: torch.fx.GraphModule | torch.fx.Graph) -> list[str]:
    """The layers (``node.meta["dipc_layer"]``, :func:`dipc.passes.partition.layer_of`: a numbered layer such as
    ``language_model.layers.3``, or a block outside any numbered list) a chunk module runs, in graph order of
    their first node: the units of per-layer recompute."""
    return _first_seen(gm, "dipc_layer")


def recompute_prefix(gm: torch.fx.GraphModule, n_layers: int, group: int = 1) -> torch.fx.GraphModule:
    """A module computing what ``gm`` computes with its first ``n_layers`` layers (:func:`chunk_layers`) under
    activation checkpoints of ``group`` consecutive layers each (the last may hold fewer).  ``group=1``: each layer
    its own checkpoint, Megatron's ``--recompute-granularity full --recompute-method block --recompute-num-layers
    n`` for one chunk; ``group=n_layers``: one checkpoint over them.  The forward keeps the inputs of each
    checkpoint (plus what the remaining layers save); the backward re-runs one checkpoint at a time, with the
    forward's RNG state, so at most one checkpoint's activations are rebuilt at once.  A node goes to the region of the latest layer seen in graph
    order (a topological split: regions feed only later ones), cut with ``torch.fx.passes.split_module``;
    parameters stay the model's own objects, so gradients accumulate where ``gm``'s would.

    Raises:
        CodegenError: ``n_layers`` is not in ``1 .. layers`` (the chunk's layer count), or ``group`` not in
            ``1 .. n_layers``.
    """
    from torch.fx.passes.split_module import split_module

    layers = chunk_layers(gm)
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or not 1 <= n_layers <= len(layers):
        raise CodegenError(f"a chunk of {len(layers)} layers cannot recompute its first {n_layers!r}: use 1 .. "
                           f"{len(layers)} (or the 'recompute' strategy for the whole chunk as one region)")
    if isinstance(group, bool) or not isinstance(group, int) or not 1 <= group <= n_layers:
        raise CodegenError(f"checkpoints of {group!r} layers: use 1 .. {n_layers} (the layers recomputed)")
    regions = -(-n_layers // group)
    index = {v: (j // group if j < n_layers else regions) for j, v in enumerate(layers)}
    part: dict[torch.fx.Node, int] = {}
    side = 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.meta.get("dipc_layer") in index:
            side = max(side, index[n.meta["dipc_layer"]])
        part[n] = side
    split = split_module(gm, gm, lambda n: part[n], keep_original_order=True)
    for j in range(regions):
        name = f"submod_{j}"
        if hasattr(split, name):
            setattr(split, name, _Checkpointed(getattr(split, name)))
    return split
