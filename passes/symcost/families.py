"""Op families (:data:`FAMILIES`): the op-name sets of each family, :func:`op_family`, and the tests that tell a
view (or a no-op cast) from a copy by the fake tensors' storages.

Each family gets one calibrated alpha in the roofline of DIP §2.6 (shared/PAPER.md); the families table is in the
package docstring (:mod:`dipc.passes.symcost`).
"""
from __future__ import annotations

import torch
import torch.fx

from .shapes import _is_tensor, _val

FAMILIES = ("matmul", "attention", "conv", "embedding", "elementwise", "reduction", "norm", "softmax", "loss",
            "view", "other")
"""Op family names (``SymCost.family``); profiles calibrate one alpha per family."""

# ------------------------------------------------------------------------------------------------ op families
_MATMUL = {"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "einsum",
           "_scaled_mm"}
_ATTENTION = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
              "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward",
              "_efficient_attention_forward", "packed_attention"}
_PACKED_ATTENTION = "packed_attention"  # dipc::packed_attention (dipc.varlen): attention within runs of segments
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
           "rand_like", "randn_like", "randint_like", "empty_strided", "linspace", "eye", "tensor",
           "metadata"}  # dipc::metadata (dipc.varlen): computed on the host from its inputs' values
# saved-tensor rules of pointwise ops
_SAVE_OUTPUT = {"exp", "tanh", "sigmoid", "rsqrt", "sqrt", "relu", "reciprocal", "elu", "hardtanh"}
_SAVE_NOTHING = {"add", "sub", "rsub", "neg", "clone", "contiguous", "copy", "_to_copy", "to", "type_as", "eq",
                 "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "logical_xor",
                 "bitwise_and", "bitwise_or", "bitwise_not", "isnan", "isinf", "isfinite", "fill", "zero",
                 "floor", "ceil", "round", "trunc", "sign"}
_SAVE_OPERANDS = {"mul", "div", "outer", "true_divide", "maximum", "minimum", "atan2", "max", "min", "hypot"}
_SAVE_MASK = {"where": 0, "masked_fill": 1}  # which argument is the boolean mask
_VIEW_BASE = {"view", "_unsafe_view", "reshape", "transpose", "t", "permute", "unsqueeze", "squeeze", "expand",
              "expand_as", "slice", "select", "alias", "detach", "flatten", "unflatten", "view_as", "as_strided",
              "split", "split_with_sizes", "chunk", "unbind", "narrow", "diagonal", "movedim", "lift_fresh_copy",
              "unfold"}


#: the families whose outputs op-selective recompute keeps (Megatron's selective recompute keeps the matmuls'
#: and attention's outputs and recomputes the cheap, memory-heavy ops between them)
SELECTIVE_SAVED_FAMILIES = ("matmul", "attention", "conv")


def op_name_family(name: str) -> str:
    """The family of an op by its name alone (``"addmm"``, ``"_scaled_dot_product_flash_attention_for_cpu"``,
    ``"convolution"``...): "matmul", "attention", "conv", or "other" for every other name (the dispatcher-level
    view torch's selective checkpointing policies get; :func:`op_family` also tells views and copies apart)."""
    if name in _MATMUL:
        return "matmul"
    if name in _ATTENTION:
        return "attention"
    if name in _CONV:
        return "conv"
    return "other"


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
    compute = op_name_family(name)
    if compute != "other":
        return compute
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
