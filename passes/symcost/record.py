"""The cost record of one node (:class:`SymCost`), its numeric :data:`FIELDS` and :func:`recompute`.

Units: FLOPs (a multiply-add counts 2) and bytes, as sympy expressions in the capture's size symbols; the cost model
is DIP's (shared/PAPER.md §2.6; recompute: §2.5).  See the package docstring (:mod:`dipc.passes.symcost`) for the
rules.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import sympy

from .shapes import _ZERO

#: numeric fields of :class:`SymCost`, in order.
FIELDS = ("flops_fwd", "flops_bwd", "bytes_read", "bytes_written", "bytes_bwd", "activation_bytes")


@dataclasses.dataclass(frozen=True)
class SymCost:
    """Cost of one node, symbolic in the capture's input-size symbols (DIP §2.6).

    Attributes:
        family: op family, one of :data:`FAMILIES`.
        flops_fwd: forward FLOPs (matmul, attention and conv only; multiply-add = 2).
        flops_bwd: backward FLOPs (gradients of the operands that need one).
        bytes_read: bytes the forward reads (tensor inputs, parameters included).
        bytes_written: bytes the forward writes (its outputs).
        bytes_bwd: bytes the backward moves (grad_out read, operand gradients written, saved tensors read).
        activation_bytes: bytes this node makes autograd keep for the backward (sum of ``saved``).
        saved: ``(storage key, bytes)`` of each saved activation; the key names the base value (views followed
            back), so a node list counts a tensor kept by several nodes once (see :func:`compile_costs`).
    """

    family: str
    flops_fwd: sympy.Expr = _ZERO
    flops_bwd: sympy.Expr = _ZERO
    bytes_read: sympy.Expr = _ZERO
    bytes_written: sympy.Expr = _ZERO
    bytes_bwd: sympy.Expr = _ZERO
    activation_bytes: sympy.Expr = _ZERO
    saved: tuple[tuple[str, sympy.Expr], ...] = ()

    def evaluate(self, bindings: Mapping[Any, int]) -> dict[str, float]:
        """The numeric fields at concrete sizes (slow path, sympy substitution: for inspection and tests; use
        :func:`compile_costs` in loops).  ``bindings`` maps symbols (or their names) to ints."""
        by_name = {str(k): v for k, v in bindings.items()}
        out = {}
        for f in FIELDS:
            e = sympy.sympify(getattr(self, f))
            e = e.xreplace({s: by_name[str(s)] for s in e.free_symbols if str(s) in by_name})
            out[f] = float(e)
        return out


def recompute(cost: Mapping[str, Any], input_bytes: Any = None) -> dict[str, Any]:
    """The costs of a chunk under activation recomputation, from its keep-everything costs.

    The backward re-runs the forward from the stashed chunk inputs, then runs the ordinary backward::

        flops_bwd        -> flops_fwd + flops_bwd
        bytes_bwd        -> bytes_bwd + bytes_read + bytes_written
        activation_bytes -> input_bytes        (bytes of the chunk's non-parameter inputs)

    Works on floats (a :class:`CompiledCost` result, which holds ``input_bytes``) or sympy expressions.

    Args:
        cost: mapping with at least the :data:`FIELDS`; ``input_bytes`` read from it when not given.
        input_bytes: bytes of the chunk's inputs (overrides ``cost["input_bytes"]``).

    Returns:
        a new dict with the three fields replaced (others copied).
    """
    out = dict(cost)
    ib = cost.get("input_bytes") if input_bytes is None else input_bytes
    if ib is None:
        raise ValueError("recompute needs the chunk's input bytes (cost['input_bytes'] or input_bytes=)")
    out["flops_bwd"] = cost["flops_fwd"] + cost["flops_bwd"]
    out["bytes_bwd"] = cost["bytes_bwd"] + cost["bytes_read"] + cost["bytes_written"]
    out["activation_bytes"] = ib
    return out


_recompute = recompute
