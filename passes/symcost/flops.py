"""FLOP rules of the families that do arithmetic (DIP §2.6, shared/PAPER.md; counted as
``torch.utils.flop_counter``: a multiply-add = 2 FLOPs): matmul and einsum, attention (flash-style backward, optional
causal fraction), convolution (plain and transposed).  The other families count 0 FLOPs (memory-bound).
"""
from __future__ import annotations

import sympy
import torch.fx

from .families import _ATTENTION_BSHD, _PACKED_ATTENTION, _name
from .shapes import _ZERO, _e, _numel, _prod, _shape, _val

# ----------------------------------------------------------------------------------------------- FLOP rules
def _matmul_flops(node: torch.fx.Node, name: str) -> tuple[sympy.Expr, list]:
    """Forward FLOPs and the operand nodes whose gradients cost F each."""
    args = node.args
    out = node.meta.get("val")
    if name == "linear":
        x, w = args[0], args[1]
        return 2 * _numel(out) * _e(_shape(w)[-1]), [x, w]
    if name in ("mm", "bmm", "matmul", "mv", "_scaled_mm"):
        a, b = args[0], args[1]
        sa = _shape(a)
        k = sa[-1] if sa else 1
        return 2 * _numel(out) * _e(k), [a, b]
    if name in ("addmm", "baddbmm", "addmv"):
        a, b = args[1], args[2]
        return 2 * _numel(out) * _e(_shape(a)[-1]), [a, b]
    if name == "addbmm":  # sum_b A_b @ B_b
        a, b = args[1], args[2]
        sa = _shape(a)
        return 2 * _numel(out) * _e(sa[0]) * _e(sa[-1]), [a, b]
    if name in ("dot", "vdot"):
        a, b = args[0], args[1]
        return 2 * _e(_shape(a)[0]), [a, b]
    if name == "einsum":
        eq, ops = args[0], list(args[1])
        return _einsum_flops(eq, ops), ops
    return _ZERO, []


def _einsum_flops(eq: str, ops: list) -> sympy.Expr:
    """2 x product of the sizes of all distinct indices (torch runs einsum as batched matmuls)."""
    lhs = eq.replace(" ", "").split("->")[0]
    sizes: dict[str, sympy.Expr] = {}
    for term, op in zip(lhs.split(","), ops):
        shape = _shape(op)
        if "..." in term:
            pre, post = term.split("...")
            n_ell = len(shape) - len(pre) - len(post)
            letters = list(pre) + [f"...{i}" for i in range(n_ell)] + list(post)
        else:
            letters = list(term)
        for letter, size in zip(letters, shape):
            sizes.setdefault(letter, _e(size))
    return 2 * _prod(sizes.values())


def _attention_flops(node: torch.fx.Node, name: str, causal_fraction: float) -> tuple[sympy.Expr, sympy.Expr]:
    q, k, v = (_val(a) for a in node.args[:3])
    if name in _ATTENTION_BSHD:  # [B, S, H, D]
        bh = _e(q.shape[0]) * _e(q.shape[2])
        sq, sk, dq, dv = _e(q.shape[1]), _e(k.shape[1]), _e(q.shape[-1]), _e(v.shape[-1])
    else:  # [..., H, S, D]
        bh = _prod(q.shape[:-2])
        sq, sk, dq, dv = _e(q.shape[-2]), _e(k.shape[-2]), _e(q.shape[-1]), _e(v.shape[-1])
    if name == _PACKED_ATTENTION:  # runs of P / n_segments rows attend within themselves; the backward recomputes
        sk = sk / _segment_count(node.args[3])
        fwd = 2 * bh * sq * sk * dq + 2 * bh * sq * sk * dv
        return fwd, fwd + 2 * bh * sq * sk * (3 * dq + 2 * dv)
    fwd = 2 * bh * sq * sk * dq + 2 * bh * sq * sk * dv
    bwd = 2 * bh * sq * sk * (3 * dq + 2 * dv)
    if _is_causal(node, name) and causal_fraction != 1:
        frac = sympy.nsimplify(causal_fraction)
        fwd, bwd = frac * fwd, frac * bwd
    return fwd, bwd


def _segment_count(segments) -> sympy.Expr:
    """Segments of a ``dipc::packed_attention``: the rows (dim 0) of the first input of the ``dipc::metadata`` op
    that made its segment ids (the instances' grid: one segment per image; a video's frames count as one, which
    overestimates its cost), else 1 (one dense segment)."""
    if isinstance(segments, torch.fx.Node) and _name(segments) == "metadata" and len(segments.args) > 1:
        first = segments.args[1][0] if segments.args[1] else None
        v = _val(first) if isinstance(first, torch.fx.Node) else None
        if v is not None and v.dim() > 0:
            return sympy.Max(_e(v.shape[0]), 1)
    return sympy.Integer(1)


def _is_causal(node: torch.fx.Node, name: str) -> bool:
    pos = {"scaled_dot_product_attention": 5, "_scaled_dot_product_flash_attention": 4,
           "_scaled_dot_product_flash_attention_for_cpu": 4, "_scaled_dot_product_efficient_attention": 6,
           "_scaled_dot_product_cudnn_attention": 6, "_flash_attention_forward": 8}.get(name)
    if "is_causal" in node.kwargs:
        return bool(node.kwargs["is_causal"])
    if pos is not None and len(node.args) > pos:
        return bool(node.args[pos])
    return False


def _conv_flops(node: torch.fx.Node, name: str) -> sympy.Expr:
    x, w, out = _val(node.args[0]), _val(node.args[1]), node.meta.get("val")
    if name in ("convolution", "_convolution", "convolution_overrideable"):
        transposed = bool(node.args[6]) if len(node.args) > 6 else bool(node.kwargs.get("transposed", False))
    else:
        transposed = name.startswith("conv_transpose")
    batched = x.dim() == w.dim()
    batch = _e(x.shape[0]) if batched else sympy.Integer(1)
    ref = x if transposed else out
    spatial = ref.shape[2:] if batched else ref.shape[1:]
    return 2 * batch * _e(w.shape[0]) * _e(w.shape[1]) * _prod(w.shape[2:]) * _prod(spatial)

