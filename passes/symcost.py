"""Symbolic per-node cost pass: FLOPs, bytes and saved activations as sympy expressions in the input sizes.

DIP's simulator (shared/PAPER.md §2.6) prices every operator as
``max(alpha_f * N_fop / F, alpha_mem * N_mem / B_mem, alpha_net * N_net / B_net)`` and sizes activation memory from
the tensors autograd keeps.  The planner re-costs every (chunk, sub-microbatch shape) of every batch, so the costs
here are *symbolic*: each node of a :func:`dipc.capture.capture` graph gets a :class:`SymCost` whose fields are sympy
expressions in the capture's size symbols (the ``s72``, ``s99`` ... of the placeholders' fake tensors: batch,
sequence length, number of images, image height and width, ...).  They are derived from the node's symbolic shapes
by rules per *op family*, never per model, and a chunk's (or segment's) sum is compiled once with
``sympy.lambdify`` (:func:`compile_costs`) so that costing a new shape is a plain Python function call (a few
microseconds; a shape seen before is a dict lookup), with no re-trace and no ``subs``.

Units: FLOPs (a multiply-add counts 2, as ``torch.utils.flop_counter``), bytes (element count x dtype itemsize).

Families and rules (forward F; backward B; "rg" = the operand carries a gradient, see below):

============  ==========================================================  ==========================================
family        forward FLOPs                                               backward FLOPs
============  ==========================================================  ==========================================
matmul        ``linear``/``mm``/``addmm``/``matmul``/``bmm``/``baddbmm``/  F per operand that needs a gradient
              ``mv``/``dot``/``einsum``/``_scaled_mm``: 2*M*N*K, i.e.      (grad_input = grad_out @ W^T, grad_W =
              2 * numel(out) * K (bias adds not counted)                   x^T @ grad_out): 2F when both do, F for
                                                                          a layer whose input carries no gradient
attention     ``scaled_dot_product_attention`` and its ``_flash``/         flop_counter's flash-style count:
              ``_efficient``/``_cudnn``/``_for_cpu`` variants: Q K^T and   2*BH*Sq*Sk*(3*Dq + 2*Dv) (scores are
              P V = 2*BH*Sq*Sk*Dq + 2*BH*Sq*Sk*Dv (BH = batch x query     recomputed; dQ, dK, dV, dP), i.e. 2.5F
              heads; grouped KV heads broadcast)                          for Dq = Dv
conv          ``conv{1,2,3}d``/``convolution``/``conv_transpose*``:        F for grad_input (if rg) + F for grad_W
              2 * N * C_out * C_in/groups * kernel volume * output        (if rg)
              spatial size (input spatial size when transposed)
embedding     0 (a gather; bytes = indices + gathered rows)               0 (scatter-add)
elementwise,  0: these are memory-bound; their latency comes from the     0
reduction,    bytes term of the roofline.  This matches
norm,         ``torch.utils.flop_counter.FlopCounterMode``, which counts
softmax,      only matmul, convolution and attention FLOPs, and the MFU
loss, other   convention; a model of vector FLOP/s would be a separate
              field.
view          0, and 0 bytes: metadata only (view, reshape, transpose,    0
              expand, slice, getitem, sym_size, assertions...); a
              reshape/contiguous/cast that copies (the capture's fake
              tensors tell: e.g. the reshape of a GQA-expanded K) is
              "other" (or "elementwise" for a cast) and moves bytes
============  ==========================================================  ==========================================

Causal attention: flop_counter counts the dense ``Sq x Sk`` score matrix whether or not the attention is causal, and
so does this pass by default; ``annotate_symbolic_cost(graph, causal_fraction=0.5)`` counts the half a causal flash
kernel actually computes (the calibrated alpha of the "attention" family absorbs either choice).

Bytes: ``bytes_read`` = distinct elements of the tensor inputs (an expanded input counts its storage, a parameter
counts: weights are read from memory) x itemsize, except gathers (embedding, index, gather, index_select), which read
the indices and the gathered rows only; ``bytes_written`` = the outputs.  ``bytes_bwd`` (backward memory traffic) =
grad_out read once per operand gradient + the operand gradients written + the saved tensors read.

Activation bytes: what autograd keeps from forward to backward, per op (only when the node's output carries a
gradient): linear/matmul keep the operand the *other* operand's gradient needs (parameters are not activations);
attention keeps q, k, v, out and the fp32 logsumexp (flash layout); norms keep their input and fp32 statistics;
softmax, exp, tanh, sigmoid, rsqrt, sqrt, relu keep their output; other nonlinear pointwise ops (gelu, silu, pow, sin,
...) keep their input; mul/div keep the operands; where/masked_fill keep the mask; gathers keep their indices;
cross-entropy keeps its fp32 log-probabilities and targets; add/sub/neg/casts/views/cat/reductions keep nothing.
Saved tensors are identified by their storage (views are followed back to their base), and :func:`compile_costs`
counts each once per node list: the q, k and v projections that all keep the same normalised input cost one copy.

Recompute (DIP's memory strategies, §2.5): a chunk run with activation recomputation keeps only its inputs, and its
backward first re-runs the forward: ``flops_bwd_recompute = flops_fwd + flops_bwd``,
``activation_bytes_recompute = input_bytes`` (the chunk's inputs from the batch and from other chunks; parameters
excluded), ``bytes_bwd_recompute = bytes_bwd + bytes_read + bytes_written``.  See :func:`recompute`.

Gradient flow ("rg"): a placeholder whose fake value has ``requires_grad`` (a trainable parameter) carries a
gradient, and so does every floating-point value computed from one.  Placeholders are *state* (parameters,
buffers, lifted constants: torch.export names them ``p_*``, ``b_*``, ``c_*``) or *inputs* (the batch); pass
``inputs=capture.input_keys`` to say which explicitly.

Sets ``node.meta["dipc_symcost"]`` (a :class:`SymCost`) on every ``call_function`` node and
``node.meta["dipc_symcost_state"]`` (bool) on every placeholder.  Pure: no process group, no I/O, no weights read
(works on models built on the meta device).
"""
from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Iterable, Mapping
from typing import Any, Callable

import sympy
import torch
import torch.fx
from sympy.printing.pycode import PythonCodePrinter

__all__ = ["SymCost", "FAMILIES", "annotate_symbolic_cost", "op_family", "recompute", "compile_costs",
           "CompiledCost", "compile_groups", "FIELDS"]

FAMILIES = ("matmul", "attention", "conv", "embedding", "elementwise", "reduction", "norm", "softmax", "loss",
            "view", "other")
"""Op family names (``SymCost.family``); profiles calibrate one alpha per family."""

#: numeric fields of :class:`SymCost`, in order.
FIELDS = ("flops_fwd", "flops_bwd", "bytes_read", "bytes_written", "bytes_bwd", "activation_bytes")

_ZERO = sympy.Integer(0)


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

# ------------------------------------------------------------------------------------------------ op families
_MATMUL = {"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "einsum",
           "_scaled_mm"}
_ATTENTION = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
              "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward",
              "_efficient_attention_forward"}
_ATTENTION_BSHD = {"_flash_attention_forward", "_efficient_attention_forward"}  # [B, S, H, D] layout
_CONV = {"conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose1d", "conv_transpose2d",
         "conv_transpose3d", "cudnn_convolution", "_slow_conv2d_forward", "convolution_overrideable"}
_EMBEDDING = {"embedding", "embedding_bag", "_embedding_bag"}
_NORM = {"layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm", "group_norm", "native_group_norm",
         "batch_norm", "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
         "instance_norm"}
_SOFTMAX = {"softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"}
_LOSS = {"cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss_forward", "nll_loss2d", "mse_loss", "l1_loss",
         "smooth_l1_loss", "huber_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div"}
_REDUCTION = {"sum", "mean", "amax", "amin", "prod", "var", "std", "var_mean", "std_mean", "norm",
              "linalg_vector_norm", "logsumexp", "argmax", "argmin", "cumsum", "cumprod", "all", "any",
              "count_nonzero", "max", "min"}
_VIEW = {"view", "_unsafe_view", "reshape", "transpose", "t", "permute", "unsqueeze", "squeeze", "expand",
         "expand_as", "slice", "select", "alias", "detach", "flatten", "unflatten", "view_as", "as_strided",
         "split", "split_with_sizes", "chunk", "unbind", "narrow", "diagonal", "movedim", "lift_fresh_copy",
         "broadcast_tensors", "unfold", "sym_size", "sym_numel", "sym_stride", "sym_storage_offset",
         "_assert_scalar", "_assert_async", "_assert_tensor_metadata", "sym_constrain_range",
         "sym_constrain_range_for_size", "_set_grad_enabled", "sym_float", "sym_int", "sym_max", "sym_min",
         "sym_not", "sym_ite", "sym_sum"}
_GATHER = {"index", "index_select", "gather", "take", "take_along_dim"}  # read indices + gathered elements only
_SCATTER = {"index_put", "scatter", "scatter_add", "scatter_reduce", "index_add", "index_copy", "index_fill",
            "masked_scatter", "_index_put_impl", "slice_scatter", "select_scatter"}
_CREATE = {"arange", "zeros", "ones", "full", "empty", "zeros_like", "ones_like", "full_like", "empty_like",
           "new_zeros", "new_ones", "new_full", "new_empty", "scalar_tensor", "rand", "randn", "randint",
           "rand_like", "randn_like", "randint_like", "empty_strided", "linspace", "eye", "tensor"}
# saved-tensor rules of pointwise ops
_SAVE_OUTPUT = {"exp", "tanh", "sigmoid", "rsqrt", "sqrt", "relu", "reciprocal", "elu", "hardtanh"}
_SAVE_NOTHING = {"add", "sub", "rsub", "neg", "clone", "contiguous", "copy", "_to_copy", "to", "type_as", "eq",
                 "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "logical_xor",
                 "bitwise_and", "bitwise_or", "bitwise_not", "isnan", "isinf", "isfinite", "fill", "zero",
                 "floor", "ceil", "round", "trunc", "sign"}
_SAVE_OPERANDS = {"mul", "div", "outer", "true_divide", "maximum", "minimum", "atan2", "max", "min", "hypot"}
_SAVE_MASK = {"where": 0, "masked_fill": 1}  # which argument is the boolean mask


def _name(node: torch.fx.Node) -> str:
    t = node.target
    packet = getattr(t, "overloadpacket", None)
    if packet is not None:
        return packet.__name__
    return getattr(t, "__name__", str(t))


def _overload(node: torch.fx.Node):
    return node.target if isinstance(node.target, torch._ops.OpOverload) else None


def op_family(node: torch.fx.Node) -> str:
    """The op family (one of :data:`FAMILIES`) of a ``call_function`` node, by op name and torch's op tags."""
    name = _name(node)
    op = _overload(node)
    if op is None:  # operator.getitem, operator.mul on SymInts, math functions ...
        return "view"
    if name in _MATMUL:
        return "matmul"
    if name in _ATTENTION:
        return "attention"
    if name in _CONV:
        return "conv"
    if name in _EMBEDDING:
        return "embedding"
    if name in _NORM:
        return "norm"
    if name in _SOFTMAX:
        return "softmax"
    if name in _LOSS:
        return "loss"
    if name in _VIEW_BASE or name == "contiguous":
        return "view" if _is_alias(node) else "other"  # e.g. reshape of an expanded tensor copies
    if name in _VIEW:
        return "view"
    if name in ("to", "type_as"):
        return "view" if _is_alias(node) else "elementwise"
    if name in ("max", "min") and len(node.args) > 1 and isinstance(node.args[1], torch.fx.Node):
        return "elementwise"  # max.other: pointwise
    if name in _REDUCTION or _REDUCTION_TAG in op.tags:
        return "reduction"
    if name in ("outer",) or torch.Tag.pointwise in op.tags:
        return "elementwise"
    return "other"


def _first_tensor(v):
    if isinstance(v, (list, tuple)):
        return next((x for x in v if _is_tensor(x)), None)
    return v if _is_tensor(v) else None


def _shares_storage(node: torch.fx.Node, out=None) -> bool | None:
    """Whether ``node``'s output (or ``out``, a value taken from it) lives in its first argument's storage, as the
    fake tensors of the capture record it (they keep aliasing); ``None`` when that cannot be told."""
    if not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    a = _first_tensor(_val(node.args[0]))
    b = _first_tensor(node.meta.get("val") if out is None else out.meta.get("val"))
    if a is None or b is None:
        return None
    try:
        return a.untyped_storage()._cdata == b.untyped_storage()._cdata
    except Exception:  # noqa: BLE001 - no storage (e.g. sparse, or a tensor subclass)
        return None


def _is_alias(node: torch.fx.Node, out: torch.fx.Node | None = None) -> bool:
    """``node`` (a view-family op or a no-op cast) returns a view of its first argument, not a copy: by the fake
    tensors' storages when known (``reshape`` of an expanded tensor copies), else by the op name."""
    name = _name(node)
    if not (name in _VIEW_BASE or name in ("to", "type_as", "contiguous")):
        return False
    shared = _shares_storage(node, out)
    if shared is not None:
        return shared
    return name in _VIEW_BASE or _is_noop_cast(node)


_REDUCTION_TAG = getattr(torch.Tag, "reduction", torch.Tag.pointwise)  # (older torch: no reduction tag)


def _is_noop_cast(node: torch.fx.Node) -> bool:
    src = node.args[0] if node.args else None
    a = src.meta.get("val") if isinstance(src, torch.fx.Node) else None
    b = node.meta.get("val")
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.device == b.device


# --------------------------------------------------------------------------------------------- shape helpers
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


_VIEW_BASE = {"view", "_unsafe_view", "reshape", "transpose", "t", "permute", "unsqueeze", "squeeze", "expand",
              "expand_as", "slice", "select", "alias", "detach", "flatten", "unflatten", "view_as", "as_strided",
              "split", "split_with_sizes", "chunk", "unbind", "narrow", "diagonal", "movedim", "lift_fresh_copy",
              "unfold"}


class _Graph:
    """Per-graph context: gradient flow, state placeholders, storage keys."""

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


# ----------------------------------------------------------------------------------------------- FLOP rules
def _shape(a) -> tuple:
    v = _val(a)
    return tuple(v.shape) if _is_tensor(v) else ()


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
    fwd = 2 * bh * sq * sk * dq + 2 * bh * sq * sk * dv
    bwd = 2 * bh * sq * sk * (3 * dq + 2 * dv)
    if _is_causal(node, name) and causal_fraction != 1:
        frac = sympy.nsimplify(causal_fraction)
        fwd, bwd = frac * fwd, frac * bwd
    return fwd, bwd


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
    ctx = _Graph(graph, inputs)
    for n in graph.nodes:
        if n.op == "call_function":
            n.meta["dipc_symcost"] = _node_cost(n, ctx, causal_fraction)
    return graph


def _node_cost(node: torch.fx.Node, ctx: _Graph, causal_fraction: float) -> SymCost:
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
        else:
            saved.extend(a for a in node.args[:3] if isinstance(a, torch.fx.Node))
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
            hit = dict(zip(self.fields, map(float, self._fn(*key))))
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
                  extra: Mapping[str, Callable[[SymCost], sympy.Expr]] | None = None) -> CompiledCost:
    """Sum the :class:`SymCost` of ``nodes`` (e.g. one chunk's) and compile the sums for fast evaluation.

    Args:
        nodes: nodes of a graph annotated by :func:`annotate_symbolic_cost` (nodes without a cost, e.g.
            placeholders, are skipped: a placeholder the list reads counts as an input).
        extra: name -> per-node expression (from its :class:`SymCost`) to sum and compile as well, e.g. a roofline
            latency ``lambda c: sympy.Max(c.flops_fwd / F, (c.bytes_read + c.bytes_written) / B)``.

    Returns:
        a :class:`CompiledCost`; ``compile_costs(nodes)(program.bind(microbatch))`` -> ``{field: float}``.
    """
    nodes = [n for n in nodes if "dipc_symcost" in n.meta]  # placeholders and outputs are not costed
    inside = set(nodes)
    terms: dict[str, list] = {f: [] for f in FIELDS if f != "activation_bytes"}
    fam_flops: dict[str, list] = {}
    fam_bytes: dict[str, list] = {}
    extras: dict[str, list] = {k: [] for k in (extra or {})}
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
        for a in n.all_input_nodes:
            if a in inside or a.name in inputs:
                continue
            if a.op == "placeholder" and a.meta.get("dipc_symcost_state", False):
                continue
            if a.op in ("placeholder", "call_function") and _is_tensor(a.meta.get("val")):
                inputs[a.name] = _bytes(a.meta["val"])
    exprs: dict[str, sympy.Expr] = {f: sympy.Add(*terms[f]) for f in terms}
    exprs["activation_bytes"] = sympy.Add(*saved.values())
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
