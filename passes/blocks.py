"""Candidate cut points of a modality module: the tree of module calls in graph order, and the blocks between cuts.

DIP (shared/PAPER.md §2.1) cuts each modality module on its own into contiguous chunks.  A cut may fall at any
module boundary in graph order, not only between the children of one ``nn.ModuleList``: named layers (``l1``,
``l2``, ``head``), ``nn.Sequential`` stacks, several block lists in one modality (Flux's double and single blocks),
embeddings and heads are all candidates.

The call tree of a modality is read off ``nn_module_stack``: every entry is one *call* of a module (torch.export
numbers repeated calls of one module, ``shared@1``, so a block shared by every layer gives one call per layer).  A
call is a run of consecutive nodes of the modality (graph order) whose stack holds that call; its children are the
calls one level down.  A **block** is a call on the current *frontier* (a sequence of calls covering the modality);
nodes outside every frontier call (glue: masks, position ids, the loss, a module's own ops between its children)
join the next block in graph order, else the last.  :func:`expand` replaces a call by its children, refining the
frontier where the partition needs more or smaller blocks.

Pure: reads ``node.meta`` (``nn_module_stack``, ``dipc_modality``), writes nothing.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Sequence

import torch
import torch.fx

__all__ = ["Call", "call_tree", "call_chain", "assign", "expand", "crossing_bytes", "value_bytes"]


@dataclasses.dataclass(eq=False)
class Call:
    """One call of a module in a modality's graph.

    Attributes:
        key: torch.export's id of the call (``nn_module_stack`` key, e.g. ``L__self___shared@1``); stable across
            captures of the same model structure.
        path: the module's path with the call number of repeated calls (``language_model.layers.3``,
            ``shared@2``).
        module_type: the module's class (qualified name).
        children: the calls one level down, in graph order.
        nodes: every node of the modality inside this call (its subtree), graph order.
        parent: the enclosing call (``None`` at the top).
    """

    key: str
    path: str
    module_type: str
    children: list["Call"] = dataclasses.field(default_factory=list)
    nodes: list[torch.fx.Node] = dataclasses.field(default_factory=list)
    parent: "Call | None" = None

    @property
    def module(self) -> str:
        """The module's path without the call number."""
        return self.path.split("@")[0]

    def __repr__(self) -> str:
        return f"Call({self.path}, {len(self.nodes)} nodes, {len(self.children)} children)"


def call_chain(node: torch.fx.Node) -> list[tuple[str, str, str]]:
    """``(key, path, type)`` of every module call holding ``node``, outermost first; the model's root call and
    torch.export's placeholder stacks are left out."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for key, v in stack.items():
        path, typ = (v[0], v[1]) if isinstance(v, tuple) else (str(v), "")
        if not path or key.startswith("_empty_nn_module_stack"):
            continue
        num = key.rsplit("@", 1)[1] if "@" in key else ""
        out.append((key, f"{path.split('@')[0]}@{num}" if num else path.split("@")[0], str(typ)))
    return out


def call_tree(nodes: Sequence[torch.fx.Node]) -> list[Call]:
    """The top-level calls of ``nodes`` (one modality's compute nodes, graph order), each with its subtree.

    A call interrupted by a node outside it and resumed later becomes two calls (runs), so every call is contiguous
    in the modality's order up to glue nodes."""
    top: list[Call] = []
    open_: list[Call] = []  # the chain of the previous node's calls
    for n in nodes:
        chain = call_chain(n)
        depth = 0
        while depth < len(chain) and depth < len(open_) and open_[depth].key == chain[depth][0]:
            depth += 1
        del open_[depth:]
        for key, path, typ in chain[depth:]:
            parent = open_[-1] if open_ else None
            c = Call(key=key, path=path, module_type=typ, parent=parent)
            (parent.children if parent is not None else top).append(c)
            open_.append(c)
        if not chain:
            open_.clear()
        for c in open_:
            c.nodes.append(n)
    return top


def expand(frontier: list[Call], call: Call) -> list[Call]:
    """``frontier`` with ``call`` replaced by its children (its own ops become glue of the next child)."""
    i = frontier.index(call)
    return frontier[:i] + list(call.children) + frontier[i + 1:]


def assign(nodes: Sequence[torch.fx.Node], block_keys: Sequence[str]) -> list[int]:
    """Block index (into ``block_keys``) of every node of ``nodes`` (one modality, graph order).

    A node joins the deepest frontier call holding it.  Glue (a node in no frontier call) joins the next block in
    graph order, except a call's trailing ops (a layer's last residual add once the layer is expanded), which stay
    with the previous block inside that call; glue after the last block joins the last block.  The result is
    monotone in graph order, so a modality's chunks only feed later chunks."""
    index = {k: i for i, k in enumerate(block_keys)}
    chains = [[k for k, _, _ in call_chain(n)] for n in nodes]
    raw: list[int | None] = []
    inside: dict[int, set] = {}  # block -> the calls enclosing it (keys)
    for chain in chains:
        b = next((index[k] for k in reversed(chain) if k in index), None)
        raw.append(b)
        if b is not None and b not in inside:
            inside[b] = set(chain[:chain.index(block_keys[b])])
    nxt: list[int | None] = [None] * len(nodes)
    after = None
    for i in range(len(nodes) - 1, -1, -1):
        nxt[i] = after
        if raw[i] is not None:
            after = raw[i]
    out: list[int] = []
    prev = None
    for i, b in enumerate(raw):
        if b is None:
            own = chains[i][-1] if chains[i] else None
            nb = nxt[i]
            if nb is None or (own is not None and prev is not None and own not in inside[nb]
                              and own in inside[prev]):
                b = prev if prev is not None else (nb if nb is not None else 0)
            else:
                b = nb
        else:
            prev = b
        out.append(b)
    hi = 0
    for i, b in enumerate(out):
        hi = max(hi, b)
        out[i] = hi
    return out


def value_bytes(v) -> float:
    """Bytes of a node's value at the example's sizes (0 for non-tensors)."""
    if not isinstance(v, torch.Tensor):
        return 0.0
    n = 1
    for s in v.shape:
        n *= int(s.node.hint) if isinstance(s, torch.SymInt) and s.node.hint is not None else int(s) if \
            not isinstance(s, torch.SymInt) else 1
    return float(n * v.element_size())


def crossing_bytes(nodes: Sequence[torch.fx.Node], blocks: Sequence[int], n_blocks: int,
                   size: Callable[[torch.fx.Node], float] | None = None) -> list[float]:
    """``out[j]``: bytes of the values a cut before block ``j`` would send (values made in blocks ``< j`` and read
    by this modality's nodes in blocks ``>= j``), at the example's sizes; ``out[0] = 0``."""
    size = size or (lambda n: value_bytes(n.meta.get("val")))
    block_of = {n: b for n, b in zip(nodes, blocks)}
    diff = [0.0] * (n_blocks + 1)
    for n, b in zip(nodes, blocks):
        last = max((block_of[u] for u in n.users if u in block_of), default=b)
        if last > b:
            s = size(n)
            diff[b + 1] += s
            diff[last + 1] -= s
    out, acc = [], 0.0
    for j in range(n_blocks):
        acc += diff[j]
        out.append(acc)
    return out


def walk(calls: Iterable[Call]):
    """Every call of the trees under ``calls``, pre-order."""
    for c in calls:
        yield c
        yield from walk(c.children)
