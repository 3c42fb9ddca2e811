"""The cost pass: :func:`annotate_symbolic_cost` and the per-node rules (FLOPs forward and backward, bytes read,
written and moved by the backward, saved activations) that give each ``call_function`` node its :class:`SymCost`.

Units: FLOPs and bytes (sympy expressions in the input sizes); the cost model is DIP's (shared/PAPER.md §2.6); the
rules per family are in the package docstring (:mod:`dipc.passes.symcost`).
"""
from __future__ import annotations

from collections.abc import Iterable

import sympy
import torch
import torch.fx

from .context import GraphContext
from .families import (_CREATE, _GATHER, _PACKED_ATTENTION, _SAVE_MASK, _SAVE_NOTHING, _SAVE_OPERANDS, _SAVE_OUTPUT,
                       _SCATTER, _name, op_family)
from .flops import _attention_flops, _conv_flops, _matmul_flops
from .record import SymCost
from .shapes import _ZERO, _bytes, _e, _floating, _is_tensor, _numel, _prod, _storage_bytes, _tensor_args, _val

# ------------------------------------------------------------------------------------------------ the pass
def annotate_symbolic_cost(graph: torch.fx.Graph, *, inputs: Iterable[str] | None = None,
                           causal_fraction: float = 1.0) -> torch.fx.Graph:
    """Attach a :class:`SymCost` to every ``call_function`` node (rules: see the module docstring).

    Args:
        graph: a captured graph (``dipc.capture.capture(...).graph``) whose nodes carry ``meta["val"]`` fake
            values with symbolic sizes.  Weights are never read: a model built on the meta device works.
        inputs: names of the placeholders that are batch inputs (e.g. ``capture.input_keys``); other placeholders
            are state (parameters, buffers, constants).  Default: torch.export's ``p_``/``b_``/``c_`` names.
        causal_fraction: share of the dense score matrix counted for causal attention (1.0 = flop_counter's
            dense count; 0.5 = what a causal flash kernel computes).

    Returns:
        ``graph``, annotated in place (``node.meta["dipc_symcost"]``).
    """
    ctx = GraphContext(graph, inputs)
    for n in graph.nodes:
        if n.op == "call_function":
            n.meta["dipc_symcost"] = _node_cost(n, ctx, causal_fraction)
    return graph


def _node_cost(node: torch.fx.Node, ctx: GraphContext, causal_fraction: float) -> SymCost:
    family = op_family(node)
    if family == "view":
        return SymCost("view")
    name = _name(node)
    out = node.meta.get("val")
    targs = _tensor_args(node)
    written = _bytes(out)
    rg_out = node in ctx.rg
    rg = lambda a: isinstance(a, torch.fx.Node) and a in ctx.rg  # noqa: E731

    # bytes read
    if family == "embedding" or name in _GATHER:
        idx = [a for a in targs if _is_tensor(_val(a)) and not _floating(_val(a))]
        if name == "index" and len(node.args) > 1:
            idx = [a for a in node.args[1] if isinstance(a, torch.fx.Node)]
        read = sympy.Add(*[_storage_bytes(_val(a)) for a in idx]) + written
    elif name in _CREATE:
        read = _ZERO
    else:
        read = sympy.Add(*[_storage_bytes(_val(a)) for a in targs]) if targs else _ZERO

    flops_f, flops_b = _ZERO, _ZERO
    saved: list[torch.fx.Node | tuple[str, sympy.Expr]] = []  # nodes (by storage) or (key, bytes) extras
    grad_operands: list[torch.fx.Node] = [a for a in targs if rg(a)]

    if family == "matmul":
        flops_f, operands = _matmul_flops(node, name)
        need = [a for a in operands if rg(a)]
        flops_b = flops_f * len(need)
        if len(operands) == 2:  # each operand is kept for the other's gradient
            a, b = operands
            if rg(b) and isinstance(a, torch.fx.Node):
                saved.append(a)
            if rg(a) and isinstance(b, torch.fx.Node):
                saved.append(b)
        elif need:
            saved.extend(a for a in operands if isinstance(a, torch.fx.Node))
        grad_operands = need
    elif family == "attention":
        flops_f, flops_b = _attention_flops(node, name, causal_fraction)
        q = _val(node.args[0])
        if not any(rg(a) for a in node.args[:3]):
            flops_b = _ZERO
        elif name == _PACKED_ATTENTION:  # keeps q, k, v and the segment ids; the backward recomputes the rest
            saved.extend(a for a in node.args[:4] if isinstance(a, torch.fx.Node))
        else:
            saved.extend(a for a in node.args[:3] if isinstance(a, torch.fx.Node))
            # an attention mask or bias (a causal mask made dense for padding: [B, 1, S, S]) is kept too; torch
            # turns a boolean mask into an additive one of q's dtype, at its broadcast shape, and keeps that
            for a in (*node.args[3:], *node.kwargs.values()):
                if isinstance(a, torch.fx.Node) and _is_tensor(_val(a)):
                    m = _val(a)
                    saved.append((f"{ctx.base(a)[0]}#additive", _numel(m) * q.element_size())
                                 if m.dtype == torch.bool else a)  # one per mask: the layers share it
            saved.append(node if not isinstance(out, (list, tuple)) else (f"{node.name}[0]", _bytes(out[0])))
            saved.append((f"{node.name}#lse", _prod(q.shape[:-1]) * 4))  # fp32 logsumexp per query row
    elif family == "conv":
        flops_f = _conv_flops(node, name)
        x, w = node.args[0], node.args[1]
        flops_b = flops_f * (int(rg(x)) + int(rg(w)))
        if rg(w):
            saved.append(x)
        if rg(x):
            saved.append(w)
        grad_operands = [a for a in (x, w) if rg(a)]
    elif family == "embedding":
        if rg_out:
            saved.extend(a for a in targs if not _floating(_val(a)))
    elif family == "norm":
        if rg_out:
            x = node.args[0]
            saved.append(x)
            saved.extend(a for a in targs[1:] if a in ctx.state)
            xv = _val(x)
            if name in ("layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm"):
                norm_numel = _prod(node.args[1]) if len(node.args) > 1 else sympy.Integer(1)
                rows = _numel(xv) / norm_numel
                n_stats = 1 if "rms" in name else 2
            elif name in ("group_norm", "native_group_norm"):
                groups = node.args[1] if name == "group_norm" else node.args[6]
                rows = _e(xv.shape[0]) * _e(groups)
                n_stats = 2
            else:  # batch / instance norm: per channel
                rows = _e(xv.shape[1]) if xv.dim() > 1 else sympy.Integer(1)
                n_stats = 2
            saved.append((f"{node.name}#stats", n_stats * rows * 4))
    elif family == "softmax":
        if rg_out:
            saved.append(node)
    elif family == "loss":
        if rg_out:
            if name == "cross_entropy_loss":
                logits = _val(node.args[0])
                saved.append((f"{node.name}#logp", _numel(logits) * max(4, logits.element_size())))
                saved.extend(a for a in targs[1:])
            else:
                saved.extend(targs)
    elif family in ("elementwise", "reduction", "other"):
        if rg_out:
            saved.extend(_saved_generic(node, name, family, targs, rg))

    # bytes of the saved activations (parameters and buffers are not activations)
    items: list[tuple[str, sympy.Expr]] = []
    kept_all = _ZERO
    seen = set()
    for s in saved:
        if isinstance(s, tuple):
            key, b, is_state = s[0], s[1], False
        else:
            key, b, is_state = ctx.base(s)
        if key in seen:
            continue
        seen.add(key)
        kept_all = kept_all + b
        if not is_state:
            items.append((key, b))
    act = sympy.Add(*[b for _, b in items]) if items else _ZERO

    if rg_out and family != "view":
        grads = [a for a in grad_operands if rg(a)]
        n_grads = max(1, len(grads))
        bytes_bwd = n_grads * written + sympy.Add(*[_storage_bytes(_val(a)) for a in grads]) + kept_all
    else:
        bytes_bwd = _ZERO
        flops_b = _ZERO
    return SymCost(family=family, flops_fwd=flops_f, flops_bwd=flops_b, bytes_read=read, bytes_written=written,
                   bytes_bwd=bytes_bwd, activation_bytes=act, saved=tuple(items))


def _saved_generic(node, name, family, targs, rg) -> list:
    """Saved tensors of pointwise, reduction and data-movement ops."""
    if name in _SAVE_MASK:
        i = _SAVE_MASK[name]
        m = node.args[i] if len(node.args) > i else None
        return [m] if isinstance(m, torch.fx.Node) else []
    if name in _GATHER or name in _SCATTER:
        return [a for a in targs if _is_tensor(_val(a)) and not _floating(_val(a))]
    if family == "reduction":
        if name in ("amax", "amin", "max", "min", "prod", "logsumexp", "norm", "linalg_vector_norm"):
            return [targs[0], node] if targs else [node]
        if name in ("var", "std", "var_mean", "std_mean"):
            return targs[:1]
        return []
    if family == "other" or name in _SAVE_NOTHING:
        return []
    if name in _SAVE_OUTPUT:
        return [node]
    if name in _SAVE_OPERANDS:
        nodes = [a for a in node.args[:2] if isinstance(a, torch.fx.Node) and _is_tensor(_val(a))]
        if len(nodes) < 2:  # times / over a scalar: nothing to keep
            return []
        a, b = nodes
        keep = []
        if rg(b):
            keep.append(a)
        if rg(a) or (name in ("div", "true_divide") and rg(b)):
            keep.append(b)
        return keep
    # other pointwise ops (gelu, silu, pow, sin, cos, log, erf, clamp ...) keep their first tensor input
    return targs[:1]
