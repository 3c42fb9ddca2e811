"""The tensor-parallel split of a captured model, chosen from its chunks' graphs (Megatron-LM's split: Shoeybi et al.,
2019, §3; DESIGN.md "Mesh").

A pure pass: it reads the chunks' ``torch.fx`` graphs and the parameters' shapes and says, per parameter, how a
tensor-parallel group of ``tp`` ranks holds it; the runtime (:mod:`dipc.runtime.tensor_parallel`) makes the
parameters ``DTensor``s with those placements, and DTensor's sharding propagation runs the chunk's ops on the shards
and issues the collectives.

How a pair is found.  For each ``aten.linear`` (the graph's projections), the pass walks back from its input through
the ops in between (views, transposes, elementwise ops, activation functions, attention: ``scaled_dot_product_attention``
or the eager ``matmul`` / ``softmax`` / ``matmul``) and collects the linears it reaches.  When every path ends at a
linear or at a side input (a placeholder, a buffer, a factory op: the RoPE tables, the attention mask) and none crosses a
normalisation (``mean`` / ``var`` / ``layer_norm`` / ``rms_norm``: a reduction over the hidden dimension, which needs the
whole vector), the linear is **row-parallel** (weight ``[out, in]`` split on ``in``; its output is a partial sum that
DTensor all-reduces where the residual stream needs it) and the linears it reached are **column-parallel** (weight and
bias split on ``out``): attention's q/k/v and output projection, an MLP's gate/up and down projection, a projector's two
linears.  A pair is split only if ``tp`` divides every split dimension and the head count of every view that cuts the
column-parallel outputs into heads (GQA's key/value heads too); otherwise it is replicated, with the reason.  Embedding
tables are split on the vocabulary (**vocab**: Megatron's vocabulary-parallel embedding), and so is a linear that
produces logits over an embedding's vocabulary (the LM head, tied or not: its logits are gathered before the loss).
Everything else (norms, convolutions, biases of row-parallel linears, position tables) is replicated.

Activations inside a chunk are DTensors with the model's global shapes, so the graph's view and reshape ops keep
their head counts: DTensor maps ``[b, s, h * d] -> [b, s, h, d]`` with the features split onto the head dimension
(where torchtitan, whose activations are local tensors, edits each attention module's head count instead).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping

import torch
import torch.fx

__all__ = ["TensorParallelPlan", "plan_tensor_parallel", "split_nodes", "STYLES"]

#: how a parameter is held by a tensor-parallel group: split on its output rows (a column-parallel linear's weight and
#: bias), on its input columns (a row-parallel linear's weight), on the vocabulary (an embedding table, an LM head), or
#: whole on every rank
STYLES = ("colwise", "rowwise", "vocab", "replicate")

_aten = torch.ops.aten
#: reductions over the hidden dimension: a value that crossed one must be whole on every rank
_BARRIERS = {_aten.mean.dim, _aten.mean.default, _aten.var.correction, _aten.var.dim, _aten.var_mean.correction,
             _aten.var_mean.dim, _aten.std.correction, _aten.native_layer_norm.default, _aten.layer_norm.default,
             _aten.rms_norm.default, _aten.group_norm.default, _aten.native_group_norm.default,
             _aten.linalg_vector_norm.default, _aten.norm.ScalarOpt_dim, _aten.sum.dim_IntList,
             _aten._log_softmax.default, _aten.log_softmax.int, _aten.cross_entropy_loss.default}
if hasattr(_aten, "_fused_rms_norm"):
    _BARRIERS.add(_aten._fused_rms_norm.default)
_VIEWS = {_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default}
#: nodes visited per backward walk at most (a walk that goes further crossed into another block: not a pair)
_WALK_LIMIT = 400


@dataclasses.dataclass
class TensorParallelPlan:
    """How each parameter of a model is held by a tensor-parallel group of ``tp`` ranks.

    Attributes:
        tp: ranks per tensor-parallel group.
        styles: parameter name (the original fully qualified name) -> one of :data:`STYLES`; parameters not named
            are replicated.
        replicated: 2-D weights the pass left whole -> why (a projection with no partner, a dimension ``tp`` does
            not divide, a head count it does not divide).
        pairs: ``(column-parallel weights, row-parallel weight)`` per split pair, in graph order.
    """

    tp: int
    styles: dict[str, str] = dataclasses.field(default_factory=dict)
    replicated: dict[str, str] = dataclasses.field(default_factory=dict)
    pairs: list[tuple[tuple[str, ...], str]] = dataclasses.field(default_factory=list)

    def style(self, name: str) -> str:
        """The style of parameter ``name`` ("replicate" when the pass did not split it)."""
        return self.styles.get(name, "replicate")

    def shard_dim(self, name: str, ndim: int) -> int | None:
        """The dimension of parameter ``name`` (of ``ndim`` dims) that is split over the group, or None (whole)."""
        s = self.style(name)
        if s in ("colwise", "vocab"):
            return 0
        if s == "rowwise" and ndim == 2:
            return 1
        return None

    def summary(self) -> str:
        """Lines for ``compiled.describe()``: how many weights each style holds, and the replicated 2-D weights with
        their reasons (at most 8 shown)."""
        counts: dict[str, int] = {}
        for s in self.styles.values():
            counts[s] = counts.get(s, 0) + 1
        lines = [f"tensor parallel (tp={self.tp}): {len(self.pairs)} column/row pair(s); parameters split "
                 + ", ".join(f"{s} {counts.get(s, 0)}" for s in STYLES[:3])
                 + "; every other parameter replicated"]
        for n, why in list(self.replicated.items())[:8]:
            lines.append(f"  replicated {n}: {why}")
        if len(self.replicated) > 8:
            lines.append(f"  ... and {len(self.replicated) - 8} more replicated weight(s)")
        if not self.replicated:
            lines.append("  every 2-D weight is split (norms, biases of row-parallel linears and buffers stay whole)")
        return "\n".join(lines)


def _param(node, names: Mapping[str, str]) -> str | None:
    """The parameter name a graph value is (a ``get_attr`` of a parameter, by target, or an exported program's
    parameter placeholder, by node name), else None."""
    if isinstance(node, torch.fx.Node) and node.op == "get_attr":
        return names.get(node.target)
    if isinstance(node, torch.fx.Node) and node.op == "placeholder":
        return names.get(node.name)
    return None


def _is_linear(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and n.target == _aten.linear.default


def _walk_back(start: torch.fx.Node, names: Mapping[str, str]) -> tuple[list[torch.fx.Node], bool, set]:
    """From ``start`` back to the linears that produce it: ``(linears, clean, visited)``; ``clean`` is False when a
    path crosses a normalisation or the walk grows past :data:`_WALK_LIMIT` nodes."""
    found: list[torch.fx.Node] = []
    seen: set = set()
    todo = [start]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if len(seen) > _WALK_LIMIT:
            return found, False, seen
        if n.op in ("placeholder", "get_attr"):
            continue
        if n.op != "call_function":
            return found, False, seen
        if _is_linear(n):
            if _param(n.args[1], names) is None:
                return found, False, seen
            found.append(n)
            continue
        if n.target in _BARRIERS or n.target == _aten.embedding.default:
            return found, False, seen
        for a in n.all_input_nodes:
            todo.append(a)
    return found, True, seen


def _shape(n) -> tuple | None:
    v = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _head_counts_ok(region: Iterable[torch.fx.Node], tp: int) -> str:
    """"" when every view in ``region`` that cuts a last dimension into ``(heads, head_dim)`` has a head count
    ``tp`` divides; else why not."""
    for n in region:
        if n.op != "call_function" or n.target not in _VIEWS:
            continue
        src, out = _shape(n.args[0]), _shape(n)
        if not src or not out or len(out) <= len(src):
            continue
        last, hd = src[-1], out[-1]
        if not isinstance(last, int) or not isinstance(hd, int) or hd <= 0 or last % hd:
            continue
        heads = last // hd  # one key/value head (GQA) is not split either: Megatron replicates it
        if heads % tp:
            return f"{heads} heads in {n.name} ({list(src)} -> {list(out)}) is not a multiple of tp={tp}"
    return ""


def plan_tensor_parallel(graphs: Iterable[torch.fx.Graph], param_names: Mapping[str, str],
                         shapes: Mapping[str, tuple], tp: int) -> TensorParallelPlan:
    """Choose Megatron's split for the parameters used by ``graphs`` (the module docstring says how).

    Args:
        graphs: the captured model's graph (an exported program's, parameters as placeholders) or its chunks'
            graphs (``get_attr`` nodes for parameters), each chunk once.
        param_names: a parameter placeholder's node name or a ``get_attr`` target -> the parameter's name (the
            original fully qualified name; tied parameters map to one name).
        shapes: parameter name -> its shape (e.g. ``[out_features, in_features]`` for a linear's weight).
        tp: ranks per tensor-parallel group (>= 1).

    Returns:
        the :class:`TensorParallelPlan` (with ``tp=1``: every parameter replicated).

    Raises:
        ValueError: ``tp`` is not an int >= 1.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be an int >= 1, got {tp!r}")
    plan = TensorParallelPlan(tp)
    if tp == 1:
        return plan
    graphs = list(graphs)
    vocab: set[int] = set()
    for g in graphs:  # embedding tables: split on the vocabulary
        for n in g.nodes:
            if n.op == "call_function" and n.target == _aten.embedding.default:
                w = _param(n.args[0], param_names)
                if w is None:
                    continue
                rows = shapes[w][0]
                if rows % tp:
                    plan.replicated[w] = f"vocabulary of {rows} is not a multiple of tp={tp}"
                else:
                    plan.styles[w] = "vocab"
                    vocab.add(rows)
    row_of: dict[str, bool] = {}  # weight -> True: row-parallel, False: column-parallel
    why: dict[str, str] = {}
    for g in graphs:
        for n in g.nodes:
            if not _is_linear(n):
                continue
            w = _param(n.args[1], param_names)
            if w is None or w in row_of or plan.styles.get(w) == "vocab":
                continue
            producers, clean, region = _walk_back(n.args[0], param_names)
            if not producers or not clean:
                continue
            ws = [_param(p.args[1], param_names) for p in producers]
            if any(row_of.get(x) is True for x in ws) or any(plan.styles.get(x) == "vocab" for x in ws):
                why[w] = "its input comes from a linear already split on its input dimension"
                continue
            bad = [x for x in ws if shapes[x][0] % tp]
            if shapes[w][1] % tp or bad:
                why[w] = (f"input features {shapes[w][1]} of {w} or output features of {bad} not a multiple of "
                          f"tp={tp}") if bad else f"input features {shapes[w][1]} not a multiple of tp={tp}"
                continue
            heads = _head_counts_ok(region, tp)
            if heads:
                why[w] = heads
                for x in ws:
                    why.setdefault(x, heads)
                continue
            row_of[w] = True
            for x in ws:
                row_of[x] = False
            plan.pairs.append((tuple(dict.fromkeys(ws)), w))
    for w, row in row_of.items():
        plan.styles[w] = "rowwise" if row else "colwise"
    biases: dict[str, str] = {}
    for g in graphs:  # a column-parallel linear's bias is split with its rows; an LM head over the vocabulary too
        for n in g.nodes:
            if not _is_linear(n):
                continue
            w = _param(n.args[1], param_names)
            if w is None:
                continue
            b = _param(n.args[2], param_names) if len(n.args) > 2 else None
            if w not in plan.styles and shapes[w][0] in vocab and not any(u.target == _aten.linear.default
                                                                           for u in n.users):
                plan.styles[w] = "vocab"  # logits over the vocabulary: gathered where the loss reads them
            if b is not None and plan.styles.get(w) in ("colwise", "vocab"):
                biases[b] = plan.styles[w]
            if w not in plan.styles and len(shapes[w]) == 2:
                plan.replicated.setdefault(w, why.get(w, "no partner: its input crosses a normalisation and no "
                                                         "linear reads its output without one"))
    plan.styles.update(biases)
    return plan


def split_nodes(graph: torch.fx.Graph, plan: TensorParallelPlan, param_names: Mapping[str, str]) -> set[str]:
    """The names of the nodes of ``graph`` whose work ``plan`` divides among the tensor-parallel ranks: every linear
    whose weight is split (column-, row-parallel, an LM head over the vocabulary) and every op between a
    column-parallel linear and its row-parallel partner that reads a column-parallel output (attention, activation
    functions, RoPE on q and k: they run on those outputs' shards).  Everything else - norms, residual adds, an
    embedding lookup (each rank writes the whole output of its rows), the loss, the ops computing RoPE tables or masks
    - runs whole on every rank of the group unless sequence parallelism shards it (Megatron-LM's, Korthikanti et al.,
    2022).

    Args:
        graph: a capture's graph (parameters as placeholders) or a chunk's (``get_attr`` nodes).
        plan: the split (:func:`plan_tensor_parallel`).
        param_names: as :func:`plan_tensor_parallel`'s.
    """
    styles = plan.styles
    out: set[str] = set()
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in graph.nodes:
        if not _is_linear(n):
            continue
        style = styles.get(_param(n.args[1], param_names))
        if style in ("colwise", "rowwise", "vocab"):
            out.add(n.name)
        if style != "rowwise":
            continue
        _, _, region = _walk_back(n.args[0], param_names)
        inside = {m for m in region if _is_linear(m) and styles.get(_param(m.args[1], param_names)) == "colwise"}
        for m in sorted(region, key=order.__getitem__):  # graph order: a node reading a split value is split
            if m not in inside and m.op == "call_function" and any(a in inside for a in m.all_input_nodes):
                inside.add(m)
        out.update(m.name for m in inside)
    return out
