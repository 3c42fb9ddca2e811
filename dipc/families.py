"""Model families: the instance layout and the loss reduction a model's config and graph imply.

:func:`_auto_instances` reads Hugging Face vision-language configs by their processors' conventions (placeholder
tokens per image, patch-packed or per-sample padded pixels); :func:`_loss_from_form` completes the user's ``loss=``
from the reduction :mod:`dipc.passes.lossform` reads off the graph.
"""
from __future__ import annotations

from typing import Mapping

import torch

from .batch import BatchError, Instances, LossReduction

__all__ = []


def _auto_instances(model: torch.nn.Module, batch: Mapping[str, torch.Tensor],
                    sub_size: Mapping[str, int] | None) -> list[Instances]:
    """Instances of a Hugging Face vision-language model, from its config and its processor's conventions:

    * LLaVA / PaliGemma / Gemma3: ``pixel_values [N, 3, H, W]`` tied by ``image_token_id``, tokens per image
      ``mm_tokens_per_image`` (Gemma3), ``text_config.num_image_tokens`` (PaliGemma), ``tokens_per_image``, else
      the vision tower's patch grid (``+1`` with the "full" feature strategy);
    * Idefics3 / SmolVLM: per-sample padded ``pixel_values [B, max_images, 3, H, W]`` (+ ``pixel_attention_mask``),
      ``(image_size / patch)^2 / scale_factor^2`` tokens per image (it drops padding images itself, so a
      microbatch without images passes none); Idefics2 alike, with ``perceiver_config.resampler_n_latents``
      tokens per image (its perceiver resamples every image to them);
    * InternVL: ``pixel_values [tiles, 3, H, W]``, each tile ``(image_size / patch)^2 * downsample_ratio^2``
      tokens (sizes given as ints or ``[h, w]`` pairs);
    * Mllama: per-sample padded ``pixel_values``, ``aspect_ratio_ids``, ``aspect_ratio_mask``,
      ``cross_attention_mask``, one ``<|image|>`` token per image (the text cross-attends to the images, padding
      slots included, so a microbatch without images keeps its keys);
    * Qwen2-VL / Qwen2.5-VL: patch-packed ``pixel_values [patches, C*T*P*P]`` with ``image_grid_thw [N, 3]``,
      ``prod(grid) / spatial_merge_size^2`` tokens per image; videos alike (``pixel_values_videos``,
      ``video_grid_thw``, Qwen2.5-VL's ``second_per_grid_ts``; ``video_token_id``) as a second instance kind of the
      vision modality.

    Returns ``[]`` for other models (no instances: images, if any, are cut with their samples).

    Raises:
        BatchError: LLaVA-NeXT-style models, whose tokens per image depend on each image's size: the error asks
            for ``instances=[dipc.Instances(..., tokens_per_instance=fn)]``; a non-square patch grid (names the
            config fields and the declaration to write).
    """
    cfg = getattr(model, "config", None)
    if cfg is not None and getattr(cfg, "model_type", "") in ("qwen2_vl", "qwen2_5_vl"):
        return _qwen_instances(cfg, batch, int((sub_size or {}).get("vision", Instances.sub_microbatch_size)))
    if cfg is None or "pixel_values" not in batch:
        return []
    kind = getattr(cfg, "model_type", "")
    token_id = getattr(cfg, "image_token_id", None)
    if token_id is None:
        token_id = getattr(cfg, "image_token_index", None)
    vc = getattr(cfg, "vision_config", None)
    b = int((sub_size or {}).get("vision", Instances.sub_microbatch_size))
    if token_id is None:
        return []
    present = lambda *keys: tuple(k for k in keys if k in batch)  # noqa: E731
    if kind in ("mllama",):
        return [Instances("vision", present("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask",
                                            "cross_attention_mask"),
                          int(token_id), 1, per_sample=True, sub_microbatch_size=b)]
    if kind in ("idefics3", "smolvlm", "idefics2") and vc is not None:
        perceiver = getattr(cfg, "perceiver_config", None)
        if kind == "idefics2" and getattr(perceiver, "resampler_n_latents", None):  # the perceiver resamples
            tpi = int(perceiver.resampler_n_latents)  # every image to its latents
        else:  # pixel shuffle by scale_factor
            scale = int(getattr(cfg, "scale_factor", 1) or 1)
            tpi = _grid(vc, "image_size", "patch_size") ** 2 // (scale * scale)
        return [Instances("vision", present("pixel_values", "pixel_attention_mask"), int(token_id), tpi,
                          per_sample=True, drop_when_empty=True, sub_microbatch_size=b)]
    if kind in ("llava_next", "llava_next_video", "llava_onevision"):
        raise BatchError(
            f"{type(model).__name__} gives each image a number of placeholder tokens that depends on its size "
            "(image_sizes); declare it: instances=[dipc.Instances('vision', ('pixel_values', 'image_sizes'), "
            f"token_id={token_id}, tokens_per_instance=lambda batch: <tokens of each image>, drop_when_empty=True)]")
    tpi = getattr(cfg, "mm_tokens_per_image", None) or getattr(cfg, "tokens_per_image", None)
    if tpi is None and getattr(cfg, "text_config", None) is not None:
        tpi = getattr(cfg.text_config, "num_image_tokens", None)
    if tpi is None and kind == "internvl" and vc is not None:  # each tile: (size / patch)^2 features, pixel-shuffled
        ratio = float(getattr(cfg, "downsample_ratio", 1.0) or 1.0)  # by downsample_ratio (the processor's
        tpi = int(round(_grid(vc, "image_size", "patch_size") ** 2 * ratio * ratio))  # image_seq_length)
    if tpi is None and vc is not None and hasattr(vc, "image_size") and hasattr(vc, "patch_size"):
        tpi = _grid(vc, "image_size", "patch_size") ** 2
        if getattr(cfg, "vision_feature_select_strategy", "default") == "full":
            tpi += 1
    if tpi is None:
        return []
    hf = hasattr(cfg, "to_dict") and bool(kind)  # Hugging Face models take pixel_values=None without images
    return [Instances(modality="vision", keys=("pixel_values",), token_id=int(token_id),
                      tokens_per_instance=int(tpi), sub_microbatch_size=b, drop_when_empty=hf)]


def _grid(vc, size: str, patch: str) -> int:
    """Patches per side of a vision config: ``image_size // patch_size``, either given as an int or as a
    ``[height, width]`` pair (InternVL); a non-square pair is refused naming the fields."""
    a, b = getattr(vc, size), getattr(vc, patch)
    pair = lambda v: tuple(v) if isinstance(v, (list, tuple)) else (v, v)  # noqa: E731
    (h, w), (ph, pw) = pair(a), pair(b)
    if h // ph != w // pw:
        raise BatchError(f"vision_config.{size}={a!r} with {patch}={b!r} gives a {h // ph}x{w // pw} patch grid: dipc "
                         "reads tokens per image from square grids only; declare them: instances=[dipc.Instances("
                         "'vision', ('pixel_values',), token_id=<image token id>, tokens_per_instance=<tokens>)]")
    return int(h // ph)


def _loss_from_form(loss: LossReduction | str | None, form) -> LossReduction:
    """The batch reduction: the user's, completed from the graph's :class:`dipc.passes.lossform.LossForm` (target
    key, ignore index, shift), or the form itself."""
    if isinstance(loss, LossReduction):
        return loss
    kind = loss or form.kind
    if kind == "token_mean":
        if form.kind != "token_mean":
            raise BatchError(f"loss='token_mean' but the model's loss is not a mean cross-entropy over a batch key "
                             f"({form.note}); pass dipc.LossReduction('token_mean', labels_key=..., shift=...)")
        return LossReduction("token_mean", labels_key=form.labels_key, ignore_index=form.ignore_index,
                             shift=form.shift)
    return LossReduction(kind)


def _qwen_instances(cfg, batch: Mapping, b: int) -> list[Instances]:
    """Qwen2-VL / Qwen2.5-VL: images and videos, patch-packed, each a kind of "vision" instance (the same vision
    tower encodes both); ``prod(grid) / spatial_merge_size^2`` placeholder tokens per image or video."""
    vc = cfg.vision_config
    merge = int(getattr(vc, "spatial_merge_size", 2)) ** 2
    out = []
    for keys, grid, token in ((("pixel_values", "image_grid_thw"), "image_grid_thw", cfg.image_token_id),
                              (("pixel_values_videos", "video_grid_thw", "second_per_grid_ts"), "video_grid_thw",
                               cfg.video_token_id)):
        if keys[0] not in batch:
            continue
        out.append(Instances("vision", tuple(k for k in keys if k in batch), int(token),
                             lambda bt, g=grid, m=merge: bt[g].long().prod(-1) // m, row_counts=grid,
                             drop_when_empty=True, sub_microbatch_size=b))
    return out
