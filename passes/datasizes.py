"""Sizes that depend on data: computed from the batch on every rank, so they may cross chunks.

A multimodal forward often sizes tensors by values of its inputs: the count of real (non-padding) images
(Idefics3: ``pixel_values[real_images_inds]``), ``int(mask.sum())``, ``lengths.tolist()``.  torch.export gives such a
size an *unbacked* symbol (``u0``) defined by the node that produced it (``meta["unbacked_bindings"]``).  When the
ops behind that node read only batch inputs (no parameter, no buffer that training changes), every rank can compute
it from its copy of the batch before any activation moves: :class:`SizeProgram` is those ops, cut out of the
capture, evaluated per microbatch or sub-microbatch, and its values join the input-size bindings that shape every
message.  A data-dependent size behind a parameter (an MoE router's token count) stays an error at codegen.

Pure: reads the graph, builds a small ``torch.fx.GraphModule``; evaluation runs it on CPU tensors of a batch.
"""
from __future__ import annotations

from typing import Any, Mapping

import sympy
import torch
import torch.fx

__all__ = ["SizeProgram", "size_program"]


class SizeProgram:
    """The ops that define a capture's host-computable data-dependent sizes.

    Attributes:
        symbols: the unbacked symbols it computes.
        inputs: placeholder name -> batch key it reads.
    """

    def __init__(self, gm: torch.fx.GraphModule, inputs: dict[str, str], outputs: list[tuple[sympy.Symbol, Any]],
                 guards: list = ()):
        self.gm = gm
        self.inputs = inputs
        self._outputs = outputs
        self.symbols = {s for s, _ in outputs}
        self.guards = list(guards)

    def holds(self, bindings: Mapping[sympy.Symbol, int]) -> bool:
        """True when the trace's runtime assertions on these sizes hold (e.g. ``Ne(u0, 0)``: the trace took the
        branch for a batch with real images); a batch where one fails needs another capture."""
        for g in self.guards:
            v = g.xreplace(dict(bindings))
            if v.free_symbols or not bool(v):
                return False
        return True

    def __call__(self, data: Mapping[str, torch.Tensor]) -> dict[sympy.Symbol, int]:
        """Values of :attr:`symbols` for ``data`` (a microbatch or a sub-microbatch view); symbols whose inputs
        ``data`` lacks are left out."""
        if any(k not in data for k in self.inputs.values()):
            return {}
        with torch.no_grad():
            outs = self.gm(**{name: data[key] for name, key in self.inputs.items()})
        return {sym: int(_follow(out, path)) for (sym, path), out in zip(self._outputs, outs)}


def _follow(value, path):
    """Apply an ``unbacked_bindings`` key path (``.size()[0]``, ``[i]``, ...) to a real value."""
    for key in path:
        name = type(key).__name__
        if name == "CallMethodKey":
            value = getattr(value, key.name)()
        elif name in ("SequenceKey", "MappingKey"):
            value = value[key.idx if name == "SequenceKey" else key.key]
        elif name == "DivideByKey":
            value = value // key.divisor
        elif name == "ConvertIntKey":
            value = int(value)
        else:
            raise TypeError(f"cannot follow key {key!r} of an unbacked size")
    return value.item() if isinstance(value, torch.Tensor) else value


def size_program(graph: torch.fx.Graph, input_keys: Mapping[str, str], state_targets: Mapping[str, tuple[str, str]],
                 constants: Mapping[str, torch.Tensor]) -> SizeProgram | None:
    """Cut the host-computable data-dependent sizes of a capture into a :class:`SizeProgram` (``None`` if the capture
    has none).  A size is host-computable when the ops behind it read only batch inputs and constants."""
    defs = [(n, sym, path) for n in graph.nodes for sym, path in (n.meta.get("unbacked_bindings") or {}).items()]
    if not defs:
        return None
    keep, outputs = [], []
    for n, sym, path in defs:
        anc, stack = set(), [n]
        while stack:
            a = stack.pop()
            if a in anc:
                continue
            anc.add(a)
            stack.extend(a.all_input_nodes)
        reads_state = any(a.op == "placeholder" and a.name in state_targets and state_targets[a.name][0] != "constant"
                          for a in anc)
        if reads_state or any(a.op == "get_attr" for a in anc):
            continue
        keep.append(anc)
        outputs.append((n, sym, path))
    if not outputs:
        return None
    needed = set().union(*keep)
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    inputs: dict[str, str] = {}
    root = torch.nn.Module()
    for n in graph.nodes:
        if n not in needed:
            continue
        if n.op == "placeholder":
            if n.name in input_keys:
                env[n] = g.placeholder(n.name)
                inputs[n.name] = input_keys[n.name]
            else:  # a lifted constant
                fqn = state_targets[n.name][1]
                attr = f"_const{len(env)}"
                root.register_buffer(attr, constants[fqn])
                env[n] = g.get_attr(attr)
        else:
            env[n] = g.node_copy(n, lambda a: env[a])
    g.output(tuple(env[n] for n, _, _ in outputs))
    symbols = {sym for _, sym, _ in outputs}
    guards = []
    for n in graph.nodes:  # runtime assertions of the trace on these sizes
        if n.op == "call_function" and getattr(n.target, "__name__", "") == "_assert_scalar.default" or \
                (n.op == "call_function" and str(n.target) == "aten._assert_scalar.default"):
            v = n.args[0].meta.get("val") if isinstance(n.args[0], torch.fx.Node) else None
            expr = getattr(getattr(v, "node", None), "expr", None)
            if expr is not None and expr.free_symbols & symbols:
                guards.append(expr)
    return SizeProgram(torch.fx.GraphModule(root, g), inputs, [(sym, path) for _, sym, path in outputs], guards)
