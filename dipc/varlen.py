"""Packed (variable-length) attention and per-instance metadata as torch custom ops, so one ``torch.export`` trace
serves every instance count of a patch-packed VLM (issue "Capture once" §2-3; DESIGN.md "Capture once").

Qwen2-VL packs the patches of all its images into one ``pixel_values [sum of patches, C*T*P*P]`` and reads the
*values* of ``image_grid_thw [N, 3]`` three times: the vision rotary position ids (a Python loop over the grids),
the attention's segments (``torch.split(q, lengths.tolist())``: each frame attends only to itself) and the text's
M-RoPE positions (``get_rope_index``: a loop over samples with ``itertools.groupby``).  torch.export cannot keep
those symbolic.  Each is here an opaque custom op whose *output shape* depends only on its inputs' shapes and
whose values are computed eagerly, on the real tensors, every time the chunk runs (for every microbatch and every
sub-microbatch, from that (sub-)microbatch's own grids, so nothing of one leaks into another):

* ``dipc::metadata(name, inputs) -> Tensor``: a registered host function (:func:`register_metadata`) with a shape
  function; no gradient (integer outputs).
* ``dipc::packed_attention(q, k, v, segments, scale, impl) -> [1, P, H, D]``: attention of ``q, k, v [1, H, P, D]``
  within each run of equal ``segments [P]`` values, one call of the model's own attention function per run (the
  model's ``attn_implementation``: "sdpa" or "eager"), so the values are the model's to the bit.  Its backward
  (registered autograd, run eagerly) recomputes each run's attention and differentiates it (like a checkpointed
  attention core): activation memory is q, k and v, not the ``[H, P_i, P_i]`` weights.

The cost model (:mod:`dipc.passes.symcost`) prices ``packed_attention`` as attention over runs of equal length
``P / n_segments``; the metadata ops cost nothing on the device.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Callable

import torch

__all__ = ["MetadataFunction", "register_metadata", "metadata", "packed_attention", "run_lengths"]


@dataclasses.dataclass(frozen=True)
class MetadataFunction:
    """A host function of ``dipc::metadata``.

    Attributes:
        compute: ``fn(*inputs) -> Tensor`` on real tensors (may read values, loop in Python).
        shape: ``fn(*inputs) -> Tensor`` on fake tensors: an empty tensor of the output's shape and dtype, computed
            from the inputs' shapes only.
    """

    compute: Callable[..., torch.Tensor]
    shape: Callable[..., torch.Tensor]


_METADATA: dict[str, MetadataFunction] = {}


def register_metadata(name: str, compute: Callable[..., torch.Tensor], shape: Callable[..., torch.Tensor]) -> str:
    """Register (or replace) the host function ``name`` of :func:`metadata`; returns ``name``.  Names carry every
    constant the function reads (e.g. ``"qwen2_vl.rope_index:merge=2:image=151655"``), so the same name means the
    same function in every process that registers it."""
    _METADATA[name] = MetadataFunction(compute, shape)
    return name


def _lookup(name: str) -> MetadataFunction:
    try:
        return _METADATA[name]
    except KeyError:
        raise RuntimeError(f"dipc::metadata {name!r} is not registered in this process (registered: "
                           f"{sorted(_METADATA)}); it is registered when the model's capture recipe is made "
                           "(dipc.recipes.recipe_for)") from None


@torch.library.custom_op("dipc::metadata", mutates_args=())
def metadata(name: str, inputs: list[torch.Tensor]) -> torch.Tensor:
    """Run the registered host function ``name`` on ``inputs`` (real values).

    Raises:
        RuntimeError: ``name`` is not registered in this process.
    """
    out = _lookup(name).compute(*inputs)
    return out.clone() if any(out.data_ptr() == i.data_ptr() for i in inputs if i.numel()) else out


@metadata.register_fake
def _metadata_fake(name, inputs):
    return _lookup(name).shape(*inputs)


def run_lengths(segments: torch.Tensor) -> list[int]:
    """Lengths of the runs of equal consecutive values of ``segments [P]`` (``[]`` for ``P == 0``)."""
    if segments.numel() == 0:
        return []
    _, counts = torch.unique_consecutive(segments, return_counts=True)
    return counts.tolist()


def _attention_function(impl: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.qwen2_vl.modeling_qwen2_vl import eager_attention_forward

    return ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager_attention_forward)


# what the model's attention function reads from its module: one KV group, not causal, no dropout
_ATTENTION_MODULE = types.SimpleNamespace(num_key_value_groups=1, is_causal=False, training=False)


def _packed_forward(q, k, v, segments, scale: float, impl: str) -> torch.Tensor:
    fn = _attention_function(impl)
    if q.dtype != v.dtype or k.dtype != v.dtype:  # autocast: q and k leave the fp32 rotary, v its bf16 projection;
        q, k = q.to(v.dtype), k.to(v.dtype)  # the attention runs in v's dtype, as autocast casts SDPA's inputs
        # (inside a dispatch mode, e.g. selective checkpointing, autocast is off within the op)
    lengths = run_lengths(segments)
    if not lengths:
        return q.new_empty(q.shape[0], 0, q.shape[1], q.shape[3])
    outs = [fn(_ATTENTION_MODULE, a, b, c, attention_mask=None, scaling=scale, dropout=0.0, is_causal=False)[0]
            for a, b, c in zip(*(torch.split(t, lengths, dim=2) for t in (q, k, v)))]
    return torch.cat(outs, dim=1)


@torch.library.custom_op("dipc::packed_attention", mutates_args=())
def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor, scale: float,
                     impl: str) -> torch.Tensor:
    """Attention of ``q, k, v [1, H, P, D]`` within each run of equal ``segments [P]`` values (DIP's vision
    encoders attend per image or per frame), with the Hugging Face attention function ``impl``; returns
    ``[1, P, H, D]`` (the layout of Hugging Face's attention functions' output) in ``v``'s dtype (q and k are cast to
    it where they differ, as autocast casts SDPA's inputs)."""
    return _packed_forward(q, k, v, segments, scale, impl)


@packed_attention.register_fake
def _packed_attention_fake(q, k, v, segments, scale, impl):
    return v.new_empty(q.shape[0], q.shape[2], q.shape[1], v.shape[3])


def _packed_attention_grads(grad, q, k, v, segments, scale: float, impl: str):
    """Gradients of :func:`packed_attention` with respect to ``q, k, v``: each run's attention recomputed and
    differentiated by autograd (runs eagerly in the backward; it is never traced)."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out = _packed_forward(*leaves, segments, scale, impl)
        if out.numel() == 0:
            return tuple(torch.zeros_like(t) for t in (q, k, v))
        grads = torch.autograd.grad(out, leaves, grad, allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, (q, k, v)))


def _setup_context(ctx, inputs, output):
    q, k, v, segments, scale, impl = inputs
    ctx.save_for_backward(q, k, v, segments)
    ctx.scale, ctx.impl = scale, impl


def _backward(ctx, grad):
    q, k, v, segments = ctx.saved_tensors
    dq, dk, dv = _packed_attention_grads(grad, q, k, v, segments, ctx.scale, ctx.impl)
    return dq, dk, dv, None, None, None


packed_attention.register_autograd(_backward, setup_context=_setup_context)
