"""Compilation of summed costs: :class:`CompiledCost` (a ``sympy.lambdify``-generated function per node list,
memoised per size tuple, vectorised with numpy), :func:`compile_costs` (one chunk or segment) and
:func:`compile_groups` (one per chunk), with the printers that inline torch's integer-division sympy functions.

Outputs are FLOPs and bytes (floats) at concrete sizes; DIP reuses a stage's cost per input shape (shared/PAPER.md
§2.6).
"""
from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping
from typing import Any, Callable

import sympy
import torch
import torch.fx
from sympy.printing.pycode import PythonCodePrinter

from .record import FIELDS, SymCost, _recompute
from .shapes import _bytes, _is_tensor

# --------------------------------------------------------------------------------------------- compilation
def _py_funcs() -> dict[str, Callable]:
    def floordiv(a, b):
        return a // b

    def ceildiv(a, b):
        return -(-a // b)

    def where(c, a, b):
        return a if c else b

    return {
        "FloorDiv": floordiv, "CleanDiv": floordiv, "CeilDiv": ceildiv, "IntTrueDiv": operator.truediv,
        "FloatTrueDiv": operator.truediv, "PythonMod": operator.mod, "Mod": operator.mod,
        "ModularIndexing": lambda base, div, mod: (base // div) % mod, "Where": where,
        "CeilToInt": math.ceil, "FloorToInt": math.floor, "TruncToInt": math.trunc, "TruncToFloat": math.trunc,
        "RoundToInt": round, "RoundDecimal": round, "ToFloat": float, "FloatPow": operator.pow,
        "PowByNatural": operator.pow, "Identity": lambda x: x, "LShift": operator.lshift,
        "RShift": operator.rshift, "Max": max, "Min": min,
    }


class _ZeroTerm(Exception):
    """A product divided by a 0 size (its tensor has no element)."""


def at_zero(expr, at: Mapping[Any, int]) -> float:
    """``expr`` at the sizes ``at`` where some divisor is 0: a quotient or remainder of sizes by 0 is 0, and a
    product with a factor ``x ** -k`` at ``x = 0`` is 0 (each belongs to a tensor with no element, as the captured
    graph computes its sizes: :func:`dipc.capture.size_floordiv`); the message shapes use it too
    (``codegen.stage._size``).

    Raises:
        KeyError: a symbol of ``expr`` has no value in ``at``."""
    def ev(e):
        if e.is_Symbol:
            return at[e]
        if e.is_Number:
            return float(e)
        name = type(e).__name__
        if e.is_Add:
            out = 0.0
            for a in e.args:
                try:
                    out += ev(a)
                except _ZeroTerm:
                    pass
            return out
        if e.is_Mul:
            out = 1.0
            for a in e.args:
                out *= ev(a)
            return out
        if e.is_Pow:
            base, exp = ev(e.args[0]), ev(e.args[1])
            if base == 0 and exp < 0:
                raise _ZeroTerm
            return base ** exp
        args = [ev(a) for a in e.args]
        if name in ("FloorDiv", "CleanDiv", "CeilDiv", "IntTrueDiv", "FloatTrueDiv", "Mod", "PythonMod"):
            if args[1] == 0:
                return 0.0
            a, b = args
            return {"FloorDiv": a // b, "CleanDiv": a // b, "CeilDiv": -(-a // b), "IntTrueDiv": a / b,
                    "FloatTrueDiv": a / b, "Mod": a % b, "PythonMod": a % b}[name]
        fn = _py_funcs().get(name)
        if fn is not None:
            return fn(*args)
        return float(e.func(*[sympy.Float(a) for a in args]))
    try:
        return ev(expr)
    except _ZeroTerm:
        return 0.0


class _Printer(PythonCodePrinter):
    """Python printer that inlines torch's integer-division sympy functions (``FloorDiv(a, b)`` -> ``a // b``)."""

    def _print_FloorDiv(self, e):
        return f"(({self._print(e.args[0])}) // ({self._print(e.args[1])}))"

    _print_CleanDiv = _print_FloorDiv

    def _print_CeilDiv(self, e):
        return f"(-((-({self._print(e.args[0])})) // ({self._print(e.args[1])})))"


def _np_funcs() -> dict[str, Callable]:
    import numpy as np

    return {
        "FloorDiv": np.floor_divide, "CleanDiv": np.floor_divide, "CeilDiv": lambda a, b: -np.floor_divide(-a, b),
        "IntTrueDiv": np.true_divide, "FloatTrueDiv": np.true_divide, "PythonMod": np.mod, "Mod": np.mod,
        "ModularIndexing": lambda base, div, mod: np.mod(np.floor_divide(base, div), mod),
        "Where": np.where, "CeilToInt": np.ceil, "FloorToInt": np.floor, "TruncToInt": np.trunc,
        "TruncToFloat": np.trunc, "RoundToInt": np.round, "ToFloat": lambda x: np.asarray(x, dtype=float),
        "FloatPow": np.power, "PowByNatural": np.power, "Identity": lambda x: x,
        "Max": np.maximum, "Min": np.minimum,
    }


class CompiledCost:
    """Costs of a node list (a chunk, a segment, a whole graph) compiled to a plain Python function.

    ``cost(bindings)`` returns ``{field: float}`` for the :data:`FIELDS` plus

    * ``input_bytes``: bytes of the list's non-state inputs (batch tensors and values made outside the list): what
      a chunk stashes under recomputation and receives from other chunks;
    * ``flops_fwd:<family>`` (matmul, attention, conv) and ``bytes:<family>`` (forward bytes read + written) for
      each family present: per-family terms for a calibrated roofline;
    * any ``extra`` expression given to :func:`compile_costs`.

    ``activation_bytes`` counts each saved storage once over the whole list.  Evaluation is one call of a
    ``sympy.lambdify``-generated function with common subexpressions eliminated and integer divisions inlined (a
    few microseconds), memoised per distinct size tuple (DIP's reuse of a stage's cost per input shape, §2.6:
    a repeated shape costs a dict lookup); the sympy expressions stay available in :attr:`exprs`.

    Attributes:
        symbols: the size symbols the costs depend on, sorted by name (argument order of :meth:`values`).
        fields: output names, in order.
        exprs: field -> sympy expression.
    """

    def __init__(self, exprs: Mapping[str, sympy.Expr]):
        self.exprs = {k: sympy.sympify(v) for k, v in exprs.items()}
        self.fields = tuple(self.exprs)
        syms = set()
        for e in self.exprs.values():
            syms |= e.free_symbols
        self.symbols = tuple(sorted(syms, key=str))
        self._names = tuple(str(s) for s in self.symbols)
        self._fn = sympy.lambdify(self.symbols, [self.exprs[f] for f in self.fields],
                                  modules=[_py_funcs(), "math"], printer=_Printer, cse=True)
        self._np_fn = None
        n = len(self.symbols)
        if n == 0:  # constant costs (every size static, e.g. a model that fixes its image count)
            self._get = lambda b: ()
        elif n == 1:
            get = operator.itemgetter(self.symbols[0])
            self._get = lambda b: (get(b),)
        else:
            self._get = operator.itemgetter(*self.symbols)
        self._cache: dict[tuple, dict[str, float]] = {}
        self.cache_size = 1 << 16

    def cache_clear(self) -> None:
        """Forget the memoised results."""
        self._cache.clear()

    def _args(self, bindings: Mapping[Any, Any]) -> tuple:
        try:
            return self._get(bindings)
        except KeyError:
            by_name = {str(k): v for k, v in bindings.items()}
            missing = [n for n in self._names if n not in by_name]
            if missing:
                raise KeyError(f"costs depend on size symbol(s) {missing} that the bindings do not give "
                               f"(given: {sorted(by_name)})") from None
            return tuple(by_name[n] for n in self._names)

    def values(self, *args) -> list:
        """Raw outputs (in :attr:`fields` order) for positional symbol values (in :attr:`symbols` order)."""
        return self._fn(*args)

    def __call__(self, bindings: Mapping[Any, int], *, recompute: bool = False) -> dict[str, float]:
        """Evaluate at concrete sizes.

        Args:
            bindings: symbol (or symbol name) -> int, e.g. ``program.bind(microbatch)``; extra keys are ignored.
            recompute: return the activation-recompute variant (see :func:`recompute`).

        Raises:
            KeyError: a symbol the costs depend on is not bound.
        """
        key = self._args(bindings)
        hit = self._cache.get(key)
        if hit is None:
            try:
                hit = dict(zip(self.fields, map(float, self._fn(*key))))
            except ZeroDivisionError:  # a size divided by a 0 size: an instance kind fed as 0 instances
                at = dict(zip(self.symbols, key))
                hit = {f: float(at_zero(self.exprs[f], at)) for f in self.fields}
            if len(self._cache) >= self.cache_size:
                self._cache.clear()
            self._cache[key] = hit
        return _recompute(hit) if recompute else hit.copy()

    def many(self, columns: Mapping[Any, Any]) -> dict[str, Any]:
        """Vectorised evaluation: ``columns`` maps each symbol (or name) to a 1-D array of values (one per
        microbatch); returns field -> numpy array."""
        import numpy as np

        if self._np_fn is None:
            self._np_fn = sympy.lambdify(self.symbols, [self.exprs[f] for f in self.fields],
                                         modules=[_np_funcs(), "numpy"], cse=True)
        args = [np.asarray(a, dtype=np.float64) for a in self._args(columns)]
        n = max((a.size for a in args), default=1)
        res = self._np_fn(*args)
        return {f: np.broadcast_to(np.asarray(r, dtype=np.float64), (n,)) for f, r in zip(self.fields, res)}

    def __repr__(self) -> str:
        return f"CompiledCost(symbols={list(self._names)}, fields={list(self.fields)})"


def compile_costs(nodes: Iterable[torch.fx.Node], *,
                  extra: Mapping[str, Callable[[SymCost], sympy.Expr]] | None = None,
                  per_node: Mapping[str, Callable[[SymCost, torch.fx.Node], sympy.Expr]] | None = None,
                  kept_share: Callable[[str], Any] | None = None) -> CompiledCost:
    """Sum the :class:`SymCost` of ``nodes`` (e.g. one chunk's) and compile the sums for fast evaluation.

    Args:
        nodes: nodes of a graph annotated by :func:`annotate_symbolic_cost` (nodes without a cost, e.g.
            placeholders, are skipped: a placeholder the list reads counts as an input).
        extra: name -> per-node expression (from its :class:`SymCost`) to sum and compile as well, e.g. a roofline
            latency ``lambda c: sympy.Max(c.flops_fwd / F, (c.bytes_read + c.bytes_written) / B)``.
        per_node: as ``extra``, from the :class:`SymCost` and the node (e.g. a tensor-parallel split per node).
        kept_share: a saved storage's node name -> the share of its bytes to count (default 1; e.g. 1/T for a
            tensor-parallel rank's shard): applied to ``activation_bytes``.

    Returns:
        a :class:`CompiledCost`; ``compile_costs(nodes)(program.bind(microbatch))`` -> ``{field: float}``.
    """
    nodes = [n for n in nodes if "dipc_symcost" in n.meta]  # placeholders and outputs are not costed
    inside = set(nodes)
    terms: dict[str, list] = {f: [] for f in FIELDS if f != "activation_bytes"}
    fam_flops: dict[str, list] = {}
    fam_bytes: dict[str, list] = {}
    extras: dict[str, list] = {k: [] for k in [*(extra or {}), *(per_node or {})]}
    saved: dict[str, sympy.Expr] = {}
    inputs: dict[str, sympy.Expr] = {}
    for n in nodes:
        c = n.meta.get("dipc_symcost")
        if c is None:
            continue
        for f in terms:
            terms[f].append(getattr(c, f))
        if c.family in ("matmul", "attention", "conv"):
            fam_flops.setdefault(c.family, []).append(c.flops_fwd)
        if c.family != "view":
            fam_bytes.setdefault(c.family, []).append(c.bytes_read + c.bytes_written)
        for key, b in c.saved:
            saved.setdefault(key, b)
        for k, fn in (extra or {}).items():
            extras[k].append(fn(c))
        for k, fn in (per_node or {}).items():
            extras[k].append(fn(c, n))
        for a in n.all_input_nodes:
            if a in inside or a.name in inputs:
                continue
            if a.op == "placeholder" and a.meta.get("dipc_symcost_state", False):
                continue
            if a.op in ("placeholder", "call_function") and _is_tensor(a.meta.get("val")):
                inputs[a.name] = _bytes(a.meta["val"])
    exprs: dict[str, sympy.Expr] = {f: sympy.Add(*terms[f]) for f in terms}
    exprs["activation_bytes"] = sympy.Add(*(b * kept_share(k.split("[")[0]) if kept_share else b
                                            for k, b in saved.items()))
    exprs = {f: exprs[f] for f in FIELDS}
    exprs["input_bytes"] = sympy.Add(*inputs.values())
    for fam in sorted(fam_flops):
        exprs[f"flops_fwd:{fam}"] = sympy.Add(*fam_flops[fam])
    for fam in sorted(fam_bytes):
        exprs[f"bytes:{fam}"] = sympy.Add(*fam_bytes[fam])
    for k, ts in extras.items():
        exprs[k] = sympy.Add(*ts)
    return CompiledCost(exprs)


def compile_groups(graph: torch.fx.Graph, key: str | Callable[[torch.fx.Node], Any] = "dipc_chunk",
                   **kwargs) -> dict[Any, CompiledCost]:
    """One :class:`CompiledCost` per group of ``call_function`` nodes: by ``node.meta[key]`` (default: the chunk
    index the partition pass sets) or by ``key(node)``; nodes whose group is ``None`` are skipped."""
    groups: dict[Any, list[torch.fx.Node]] = {}
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        g = key(n) if callable(key) else n.meta.get(key)
        if g is not None:
            groups.setdefault(g, []).append(n)
    try:
        order = sorted(groups)
    except TypeError:
        order = list(groups)
    return {g: compile_costs(groups[g], **kwargs) for g in order}
