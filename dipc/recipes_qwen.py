"""The capture recipe of Qwen2-VL (issue "Capture once" §3): the model's own modules and code, with the three places
that read ``image_grid_thw``'s values replaced by dipc's custom ops (:mod:`dipc.varlen`), so one trace serves every
image count, every image size and every sub-microbatch.

What the recipe changes, and nothing else:

* the vision rotary position ids (``get_vision_position_ids``, a Python loop over the grids) come from
  ``dipc::metadata`` and are handed to the vision tower as its ``position_ids`` keyword (Hugging Face's documented
  way to precompute them);
* each vision attention runs its core through ``dipc::packed_attention`` on the frame of each patch row (the
  model's ``torch.split(q, lengths.tolist())`` per frame, the same attention function per frame), by a forward
  set on the tower's attention modules while the recipe runs (q/k/v projection, rotary and output projection are
  the model's own modules and function);
* the text's M-RoPE ``position_ids [3, B, S]`` (``get_rope_index``) come from ``dipc::metadata`` running the model's
  own ``get_rope_index`` on the microbatch's real tokens and grids;
* the image features reach the model's forward through its ``mm_encoder_outputs`` keyword instead of being split
  per image and concatenated again.

A text-only microbatch runs the model's own forward (its trace has no image keys: one more capture, once).  The
recipe's graph also runs with one kind given as 0 instances (``pixel_values_videos [0, C*T*P*P]``,
``video_grid_thw [0, 3]``: every metadata function returns its empty result then), so the compiler has dipc feed
an absent kind that way (``Instances.drop_with_modality``) and one capture serves images, videos and both, in
microbatches and sub-microbatches alike: 2 captures in all.  The compiler checks the recipe against the model's
forward on the example batch, to the bit, before using it.
"""
from __future__ import annotations

import contextlib
import hashlib
import sys
import types
from typing import Callable

import torch

from . import varlen

__all__ = ["qwen2_vl_recipe"]


def _config_tag(cfg) -> str:
    return hashlib.sha1(cfg.to_json_string(use_diff=False).encode()).hexdigest()[:12]


def _frame_segments(grid: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The frame of each packed row ``[P]``: entry ``(t, h, w)`` of ``grid [N, 3]`` owns ``t`` frames of ``h*w``
    rows (Qwen2-VL's vision attention attends within a frame)."""
    g = grid.long()
    per_frame = (g[:, 1] * g[:, 2]).repeat_interleave(g[:, 0])
    seg = torch.repeat_interleave(torch.arange(per_frame.numel(), device=grid.device), per_frame)
    if seg.numel() != rows.shape[0]:
        raise ValueError(f"image_grid_thw {g.tolist()} covers {seg.numel()} patch rows but pixel_values has "
                         f"{rows.shape[0]}")
    return seg


def _rows_shape(cols: int | None):
    def shape(grid, rows):
        size = (rows.shape[0],) if cols is None else (rows.shape[0], cols)
        return torch.empty(size, dtype=torch.long, device=grid.device)
    return shape


def _empty_or(compute: Callable, shape: Callable) -> Callable:
    """``compute``, or the empty result ``shape`` gives where the grids ``[0, 3]`` hold no instance (a kind absent
    from the (sub-)microbatch, fed as zero instances)."""
    def run(grid, *rest):
        return shape(grid, *rest) if grid.shape[0] == 0 else compute(grid, *rest)
    return run


def _packed_vision_attention(impl: str, rotary: Callable):
    """A forward for Qwen2-VL's ``VisionAttention`` whose core is ``dipc::packed_attention``; it takes the rows'
    frame ids where the model's takes ``cu_seqlens``."""
    def forward(self, hidden_states, cu_seqlens, position_embeddings=None, **kwargs):
        seq = hidden_states.shape[0]
        q, k, v = self.qkv(hidden_states).reshape(seq, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        cos, sin = position_embeddings
        q, k = rotary(q, k, cos, sin)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        out = varlen.packed_attention(q, k, v, cu_seqlens, float(self.scaling), impl)
        return self.proj(out.reshape(seq, -1).contiguous())
    return forward


@contextlib.contextmanager
def _attention_through(blocks, forward):
    patched = []
    try:
        for blk in blocks:
            blk.attn.forward = types.MethodType(forward, blk.attn)
            patched.append(blk.attn)
        yield
    finally:
        for attn in patched:
            del attn.forward


def _window_metadata(visual) -> tuple[str, str]:
    """Qwen2.5-VL's window attention: the permutation of merge units into windows ``[P / merge**2]`` and the
    window of each (permuted) patch row ``[P]`` (Hugging Face's ``get_vision_window_index``)."""
    from transformers import vision_utils

    merge, window, patch = int(visual.spatial_merge_size), int(visual.window_size), int(visual.patch_size)
    unit = merge * merge

    def index(grid, rows):
        return vision_utils.get_vision_window_index(grid, merge, window, patch)

    def order(grid, rows):
        return index(grid, rows)[0]

    def segments(grid, rows):
        cu = index(grid, rows)[1].long()
        lengths = cu[1:] - cu[:-1]
        return torch.repeat_interleave(torch.arange(lengths.numel(), device=grid.device), lengths)

    def order_shape(grid, rows):
        return torch.empty((rows.shape[0] // unit,), dtype=torch.long, device=grid.device)

    tag = f"merge={merge}:window={window}:patch={patch}"
    return (varlen.register_metadata(f"qwen2_5_vl.window_index:{tag}", _empty_or(order, order_shape), order_shape),
            varlen.register_metadata(f"qwen2_5_vl.window_segments:{tag}", _empty_or(segments, _rows_shape(None)),
                                     _rows_shape(None)))


def qwen2_vl_recipe(model: torch.nn.Module) -> Callable | None:
    """The recipe of a ``Qwen2VLForConditionalGeneration`` (module docstring), or ``None`` when the model is not the
    layout this recipe knows (its vision tower's attention is not "sdpa" or "eager", e.g. flash attention)."""
    cfg = model.config
    inner = getattr(model, "model", None)
    visual = getattr(inner, "visual", None)
    if visual is None or not hasattr(inner, "get_rope_index") or not hasattr(visual, "blocks"):
        return None
    impl = getattr(visual.config, "_attn_implementation", None) or "eager"
    if impl not in ("sdpa", "eager"):
        return None
    rotary = getattr(sys.modules[type(visual.blocks[0].attn).__module__], "apply_rotary_pos_emb_vision", None)
    if rotary is None:
        return None
    from transformers import vision_utils

    tag = _config_tag(cfg)
    family = cfg.model_type
    merge = int(visual.spatial_merge_size)
    positions = varlen.register_metadata(f"qwen2_vl.vision_positions:merge={merge}",
                                         _empty_or(lambda g, r: vision_utils.get_vision_position_ids(g, merge),
                                                   _rows_shape(2)),
                                         _rows_shape(2))
    frames = varlen.register_metadata("qwen2_vl.frame_segments", _empty_or(_frame_segments, _rows_shape(None)),
                                      _rows_shape(None))
    windows = _window_metadata(visual) if hasattr(visual, "fullatt_block_indexes") else None
    attention = _packed_vision_attention(impl, rotary)
    own_forward = model.forward
    rope_names: dict[tuple, str] = {}
    optional = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts", "attention_mask")

    def rope_index(input_ids, mm_token_type_ids, given: dict):
        present = tuple(k for k in optional if given.get(k) is not None)
        name = rope_names.get(present)
        if name is None:
            def compute(ids, types_, *rest, present=present):
                pos, _ = type(inner).get_rope_index(inner, ids, types_, **dict(zip(present, rest)))
                return pos

            def shape(ids, *rest):
                return torch.empty((3, ids.shape[0], ids.shape[1]), dtype=ids.dtype, device=ids.device)

            name = rope_names[present] = varlen.register_metadata(
                f"{family}.rope_index[{','.join(present)}]:{tag}", compute, shape)
        return varlen.metadata(name, [input_ids, mm_token_type_ids] + [given[k] for k in present])

    def encode(pixels, grid):
        kw = dict(position_ids=varlen.metadata(positions, [grid, pixels]),
                  cu_seqlens=varlen.metadata(frames, [grid, pixels]))
        if windows is not None:
            kw["window_index"] = varlen.metadata(windows[0], [grid, pixels])
            kw["cu_window_seqlens"] = varlen.metadata(windows[1], [grid, pixels])
        with _attention_through(visual.blocks, attention):
            out = visual(pixels.type(visual.dtype), grid_thw=grid, **kw)
        return out.pooler_output

    def qwen2_vl_forward(input_ids=None, pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
                         video_grid_thw=None, mm_token_type_ids=None, attention_mask=None, position_ids=None,
                         inputs_embeds=None, **rest):
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        as_is = dict(input_ids=input_ids, pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                     pixel_values_videos=pixel_values_videos, video_grid_thw=video_grid_thw,
                     mm_token_type_ids=mm_token_type_ids, attention_mask=attention_mask, position_ids=position_ids,
                     inputs_embeds=inputs_embeds, **rest)
        images, videos = pixel_values is not None, pixel_values_videos is not None
        if (not images and not videos) or input_ids is None or mm_token_type_ids is None or position_ids is not None \
                or inputs_embeds is not None or (images and image_grid_thw is None) \
                or (videos and video_grid_thw is None):
            return own_forward(**as_is)  # text only, or a layout the recipe does not rewrite
        encoded = {}
        if images:
            encoded["image"] = BaseModelOutputWithPooling(pooler_output=(encode(pixel_values, image_grid_thw),))
        if videos:
            encoded["video"] = BaseModelOutputWithPooling(
                pooler_output=(encode(pixel_values_videos, video_grid_thw),))
        pos = rope_index(input_ids, mm_token_type_ids, dict(image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
                                                            attention_mask=attention_mask, **rest))
        return own_forward(input_ids=input_ids, mm_token_type_ids=mm_token_type_ids, attention_mask=attention_mask,
                           position_ids=pos, mm_encoder_outputs=encoded, **rest)

    return qwen2_vl_forward
