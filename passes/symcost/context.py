"""The per-graph context of the cost pass (:class:`GraphContext`): which placeholders are state, which values carry a
gradient, and the storage (key, bytes) a value lives in, views followed back, so that a tensor kept by several nodes
is counted once in the activation bytes (DIP §2.6, shared/PAPER.md).
"""
from __future__ import annotations

import operator
from collections.abc import Iterable

import sympy
import torch
import torch.fx

from .families import _is_alias
from .shapes import _floating, _storage_bytes, _val


class GraphContext:
    """Per-graph context: gradient flow, state placeholders, storage keys.

    Built once per graph by :func:`annotate_symbolic_cost` (and by :mod:`dipc.costing` for per-layer checkpoint
    sizes); marks each placeholder's ``node.meta["dipc_symcost_state"]``.

    Attributes:
        state: the state placeholders (parameters, buffers, lifted constants).
        rg: the nodes whose value carries a gradient.
    """

    def __init__(self, graph: torch.fx.Graph, inputs: Iterable[str] | None):
        names = set(inputs) if inputs is not None else None
        self.state: set[torch.fx.Node] = set()
        self.rg: set[torch.fx.Node] = set()
        for n in graph.nodes:
            v = n.meta.get("val")
            if n.op == "placeholder":
                if names is not None:
                    is_state = n.name not in names
                else:
                    is_state = n.name.startswith(("p_", "b_", "c_")) or bool(getattr(v, "requires_grad", False))
                n.meta["dipc_symcost_state"] = is_state
                if is_state:
                    self.state.add(n)
                if getattr(v, "requires_grad", False):
                    self.rg.add(n)
            elif n.op == "call_function":
                if n.target is operator.getitem:
                    src = n.args[0]
                    if src in self.rg and _floating(v):
                        self.rg.add(n)
                elif any(a in self.rg for a in n.all_input_nodes) and _floating(v):
                    self.rg.add(n)
        self._base: dict[torch.fx.Node, tuple[str, sympy.Expr, bool]] = {}

    def base(self, node: torch.fx.Node) -> tuple[str, sympy.Expr, bool]:
        """``(storage key, bytes, is_state)`` of the storage ``node``'s value lives in (views followed back)."""
        hit = self._base.get(node)
        if hit is not None:
            return hit
        cur = node
        res = None
        for _ in range(256):
            if cur.op == "placeholder":
                res = (cur.name, _storage_bytes(_val(cur)), cur in self.state)
                break
            if cur.op != "call_function":
                break
            if cur.target is operator.getitem:
                src = cur.args[0]
                if isinstance(src, torch.fx.Node) and src.op == "call_function" and _is_alias(src, cur):
                    cur = src.args[0]
                    continue
                res = (f"{src.name}[{cur.args[1]}]" if isinstance(src, torch.fx.Node) else cur.name,
                       _storage_bytes(_val(cur)), False)
                break
            if _is_alias(cur):
                cur = cur.args[0]
                continue
            break
        if res is None:
            res = (cur.name, _storage_bytes(_val(cur)), False)
        self._base[node] = res
        return res
