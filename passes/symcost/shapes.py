"""Sympy helpers on the capture's fake tensors: sizes as sympy expressions, element counts, bytes (element count x
dtype itemsize) and storage bytes (an expanded dim counts once), for the cost rules of DIP §2.6
(shared/PAPER.md).
"""
from __future__ import annotations

import sympy
import torch
import torch.fx

_ZERO = sympy.Integer(0)


def _e(x) -> sympy.Expr:
    """A size as a sympy expression."""
    if isinstance(x, torch.SymInt):
        return x.node.expr
    if isinstance(x, (int, bool)):
        return sympy.Integer(int(x))
    if isinstance(x, sympy.Basic):
        return x
    return sympy.Integer(int(x))


def _prod(xs) -> sympy.Expr:
    out = sympy.Integer(1)
    for x in xs:
        out = out * _e(x)
    return out


def _val(a):
    return a.meta.get("val") if isinstance(a, torch.fx.Node) else None


def _is_tensor(v) -> bool:
    return isinstance(v, torch.Tensor)


def _numel(v: torch.Tensor) -> sympy.Expr:
    return _prod(v.shape)


def _bytes(v) -> sympy.Expr:
    """Bytes of a tensor value (or a list/tuple of them): numel x itemsize."""
    if _is_tensor(v):
        return _numel(v) * v.element_size()
    if isinstance(v, (list, tuple)):
        return sympy.Add(*[_bytes(x) for x in v]) if v else _ZERO
    return _ZERO


def _storage_bytes(v) -> sympy.Expr:
    """Bytes of the distinct elements of a tensor: dims with stride 0 (expanded) count once."""
    if not _is_tensor(v):
        return _bytes(v)
    try:
        strides = v.stride()
    except Exception:  # noqa: BLE001 - sparse / nested tensors have no strides
        return _bytes(v)
    n = sympy.Integer(1)
    for size, st in zip(v.shape, strides):
        if _e(st) == 0:
            continue
        n = n * _e(size)
    return n * v.element_size()


def _floating(v) -> bool:
    if _is_tensor(v):
        return v.dtype.is_floating_point or v.dtype.is_complex
    if isinstance(v, (list, tuple)):
        return any(_floating(x) for x in v)
    return False


def _tensor_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Distinct tensor-valued input nodes, in argument order."""
    out = []
    for a in node.all_input_nodes:
        if a not in out and (_is_tensor(_val(a)) or isinstance(_val(a), (list, tuple))):
            out.append(a)
    return out


def _shape(a) -> tuple:
    v = _val(a)
    return tuple(v.shape) if _is_tensor(v) else ()
