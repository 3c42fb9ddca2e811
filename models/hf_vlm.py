"""Tiny Hugging Face vision-language models beyond LLaVA, with processor-shaped training batches, for probing dipc.

One ``tiny_<name>_config()``, ``tiny_<name>(seed=0)`` and ``<name>_batch(counts, seq, seed)`` per model:

========================  =====================================  ==============================================
name                      class                                  image inputs of a batch
========================  =====================================  ==============================================
``qwen2_vl``              ``Qwen2VLForConditionalGeneration``    ``pixel_values [sum patches, C*T*P*P]``,
                                                                 ``image_grid_thw [N, 3]``, ``mm_token_type_ids``
``paligemma``             ``PaliGemmaForConditionalGeneration``  ``pixel_values [N, 3, H, W]``, ``token_type_ids``
``gemma3``                ``Gemma3ForConditionalGeneration``     ``pixel_values [N, 3, H, W]``, ``token_type_ids``
``idefics3``              ``Idefics3ForConditionalGeneration``   ``pixel_values [B, max_images, 3, H, W]``,
                                                                 ``pixel_attention_mask [B, max_images, H, W]``
``llava_next``            ``LlavaNextForConditionalGeneration``  ``pixel_values [N, max_patches, 3, H, W]``,
                                                                 ``image_sizes [N, 2]``
``mllama``                ``MllamaForConditionalGeneration``     ``pixel_values [B, max_images, max_tiles, 3, H,
                                                                 W]``, ``aspect_ratio_ids``, ``aspect_ratio_mask``,
                                                                 ``cross_attention_mask [B, S, max_images, tiles]``
``llava_onevision``       ``LlavaOnevisionForConditionalGeneration`` ``pixel_values [N, max_tiles, 3, H, W]``,
                                                                 ``image_sizes [N, 2]``, ``batch_num_images [B]``
========================  =====================================  ==============================================

``N`` = images in the batch, ``B`` = samples, ``S`` = ``seq``.  Common to every builder:

* models: float32, train mode, ``attn_implementation="sdpa"`` on the top config and every sub-config,
  ``use_cache=False``, every dropout 0 (so a forward is deterministic), random init under
  ``torch.random.fork_rng`` + ``torch.manual_seed(seed)`` (the global RNG is left untouched);
* batches: ``counts[b]`` = images of sample ``b`` (0 allowed, all-zero allowed), every row exactly ``seq`` tokens
  (no padding, so no ``attention_mask``), ``input_ids``/``labels [B, S]`` int64, random text ids from
  ``[3, first special id)``, ``bos`` (id 1) first (PaliGemma: after the image tokens, as its processor does),
  image blocks at seeded random places in the text; ``labels`` = ``input_ids`` with every image placeholder and
  image wrapper token (begin/end-of-image, vision start/end, fake-around-image, global-image tag) set to -100;
  PaliGemma also masks its prefix (``token_type_ids == 0``, its processor's ``suffix`` labels).  Pixel values
  are standard normal (never all-zero: Idefics3 drops all-zero images as padding).  A batch with no image at all
  leaves the pixel-side keys out (each ``*_batch`` docstring says which), which is what the HF models take for
  text-only input (``pixel_values=None``).
* ``ValueError`` when ``seq`` is too short for the images asked for.

``transformers`` is imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import math
from typing import Sequence

__all__ = [
    "tiny_qwen2_vl_config", "tiny_qwen2_vl", "qwen2_vl_batch", "qwen2_vl_tokens_per_image",
    "tiny_paligemma_config", "tiny_paligemma", "paligemma_batch",
    "tiny_gemma3_config", "tiny_gemma3", "gemma3_batch",
    "tiny_idefics3_config", "tiny_idefics3", "idefics3_batch", "idefics3_tokens_per_image",
    "tiny_llava_next_config", "tiny_llava_next", "llava_next_batch", "llava_next_tokens_per_image",
    "llava_next_num_patches",
    "tiny_mllama_config", "tiny_mllama", "mllama_batch", "MLLAMA_GATE_VALUE",
    "tiny_llava_onevision_config", "tiny_llava_onevision", "llava_onevision_batch",
    "llava_onevision_tokens_per_image", "llava_onevision_instances",
    "IDEFICS3_FAKE_TOKEN", "IDEFICS3_GLOBAL_IMG", "BUILDERS",
]

PAD, BOS, EOS = 0, 1, 2
FIRST_TEXT_ID = 3

#: value every Mllama gate (cross-attention and vision tile/position gates) is set to after init
MLLAMA_GATE_VALUE = 0.5


# ----------------------------------------------------------------------------------------------------- helpers
def _finish_config(config, attn: str):
    """``attn`` on the config and all its sub-configs, ``use_cache=False``, dropouts 0."""
    subs = [config]
    for name in ("vision_config", "text_config"):
        sub = getattr(config, name, None)
        if sub is not None:
            subs.append(sub)
    for cfg in subs:
        cfg._attn_implementation = attn
        if hasattr(cfg, "use_cache"):
            cfg.use_cache = False
        for k in ("attention_dropout", "dropout", "hidden_dropout", "activation_dropout", "resid_pdrop",
                  "embd_pdrop", "attn_pdrop"):
            if getattr(cfg, k, None):
                setattr(cfg, k, 0.0)
    return config


def _build(cls, config, seed: int, after=None):
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
        if after is not None:
            after(model)
    return model.float().train()


def _gen(seed: int):
    import torch

    return torch.Generator().manual_seed(int(seed))


def _text(g, n: int, hi: int):
    import torch

    return torch.randint(FIRST_TEXT_ID, hi, (n,), generator=g).tolist()


def _interleave(g, blocks: list[list[int]], n_text: int, hi: int) -> list[int]:
    """``n_text`` random text ids with the ``blocks`` put at seeded random places (in order)."""
    import torch

    k = len(blocks)
    if k == 0:
        return _text(g, n_text, hi)
    # k+1 gaps summing to n_text
    cuts = sorted(torch.randint(0, n_text + 1, (k,), generator=g).tolist())
    gaps = [b - a for a, b in zip([0] + cuts, cuts + [n_text])]
    out: list[int] = []
    for i, blk in enumerate(blocks):
        out += _text(g, gaps[i], hi) + blk
    return out + _text(g, gaps[-1], hi)


def _rows(counts, seq, seed, make_blocks, hi, bos_first=True):
    """One row per sample: [bos] + text interleaved with that sample's image blocks; every row ``seq`` long."""
    g = _gen(seed)
    rows = []
    img = 0
    for b, c in enumerate(counts):
        blocks = [make_blocks(img + i) for i in range(int(c))]
        img += int(c)
        need = sum(len(x) for x in blocks) + (1 if bos_first else 0)
        if need > seq:
            raise ValueError(f"sample {b}: {c} image(s) need {need} tokens but seq={seq}")
        rows.append(([BOS] if bos_first else []) + _interleave(g, blocks, seq - need, hi))
    return rows, g


def _labels(input_ids, masked_ids):
    lab = input_ids.clone()
    for t in masked_ids:
        lab[input_ids == t] = -100
    return lab


def _check_counts(counts: Sequence[int]):
    counts = [int(c) for c in counts]
    if not counts or any(c < 0 for c in counts):
        raise ValueError(f"counts must be a non-empty list of non-negative ints, got {counts}")
    return counts


# ----------------------------------------------------------------------------------------------------- Qwen2-VL
def _qwen_text_and_ids(vocab_size: int) -> dict:
    """The text model and token ids the tiny Qwen2-VL and Qwen2.5-VL configs share."""
    return dict(text_config=dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                  "mrope_section": [2, 1, 1]},
                                 bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, use_cache=False,
                                 attention_dropout=0.0),
                image_token_id=vocab_size - 1, video_token_id=vocab_size - 2, vision_start_token_id=vocab_size - 3,
                vision_end_token_id=vocab_size - 4, tie_word_embeddings=False)


def tiny_qwen2_vl_config(attn_implementation: str = "sdpa", vocab_size: int = 128):
    """A ``Qwen2VLConfig``: vision ViT depth 2, embed 32, 2 heads, patch 4, temporal patch 2, spatial merge 2,
    out (merger) 32; text Qwen2 width 32, 2 layers, 4 heads / 2 KV heads (head_dim 8, ``mrope_section [2, 1, 1]``),
    vocabulary 128.  Ids: ``image_token_id = 127``, ``video_token_id = 126``, ``vision_start_token_id = 125``,
    ``vision_end_token_id = 124``; text ids are drawn below 124."""
    from transformers import Qwen2VLConfig

    config = Qwen2VLConfig(
        vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=4,
                           temporal_patch_size=2, spatial_merge_size=2, in_channels=3),
        **_qwen_text_and_ids(vocab_size))
    return _finish_config(config, attn_implementation)


def tiny_qwen2_vl(seed: int = 0, config=None):
    """``Qwen2VLForConditionalGeneration`` from :func:`tiny_qwen2_vl_config`.

    Tokens per image: ``t * h * w // spatial_merge_size**2`` from the image's row of ``image_grid_thw`` (grid in
    patch units: ``t = 1`` for an image, ``h = H // patch_size``, ``w = W // patch_size``); it varies with the
    image size (``config.vision_config.patch_size``, ``.spatial_merge_size``).  A 16x16 image: grid (1, 4, 4),
    16 rows of ``pixel_values``, 4 placeholder tokens; 16x24: 6 tokens; 24x32: 12 tokens.

    What the forward does with images (data-dependent): the vision tower reads ``grid_thw`` values to build
    rotary position ids and ``cu_seqlens`` (``repeat_interleave`` by ``t``, ``cumsum``), the SDPA path splits
    q/k/v by ``lengths.tolist()``; ``get_image_features`` splits the merged features by
    ``(grid_thw.prod(-1) // merge**2).tolist()``; ``masked_scatter`` into the placeholders; M-RoPE positions
    (``get_rope_index``) loop over samples in Python with ``mm_token_type_ids[b].tolist()``,
    ``itertools.groupby`` and ``grid_thw[i].item()``, and store ``self.rope_deltas`` on the module.  With
    ``image_grid_thw`` present, ``mm_token_type_ids`` is required (ValueError otherwise).

    torch.export (non-strict, torch 2.13): fails with ``GuardOnDataDependentSymNode: Eq(u16, 0)`` at
    ``torch.split(tensor, lengths.tolist(), dim=2)`` in the vision attention (sdpa/eager path), even with static
    shapes and ``image_grid_thw`` held as a constant tensor.
    """
    from transformers import Qwen2VLForConditionalGeneration

    return _build(Qwen2VLForConditionalGeneration, config or tiny_qwen2_vl_config(), seed)


def tiny_qwen2_5_vl_config(attn_implementation: str = "sdpa", vocab_size: int = 128):
    """A ``Qwen2_5_VLConfig`` with the geometry of :func:`tiny_qwen2_vl_config` (patch 4, temporal patch 2, spatial
    merge 2, the same token ids) and Qwen2.5-VL's windowed vision attention: vision depth 3, width 32, SwiGLU MLP
    64, ``window_size = 16`` px (windows of 2 x 2 merged patches: a 24x32 image has 4 windows, some padded) and
    full attention in block 1 only (``fullatt_block_indexes = [1]``); out (merger) 32; text as Qwen2-VL's."""
    from transformers import Qwen2_5_VLConfig

    config = Qwen2_5_VLConfig(
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                           temporal_patch_size=2, spatial_merge_size=2, in_channels=3, window_size=16,
                           fullatt_block_indexes=[1], out_hidden_size=32, tokens_per_second=2),
        **_qwen_text_and_ids(vocab_size))
    return _finish_config(config, attn_implementation)


def tiny_qwen2_5_vl(seed: int = 0, config=None):
    """``Qwen2_5_VLForConditionalGeneration`` from :func:`tiny_qwen2_5_vl_config`; batches from
    :func:`qwen2_vl_batch` (same processor layout).  Beyond Qwen2-VL's data-dependent code, its vision tower permutes
    the patch rows into windows (``get_vision_window_index``: a Python loop over the grids) and attends within
    windows in every block but the full-attention ones."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    return _build(Qwen2_5_VLForConditionalGeneration, config or tiny_qwen2_5_vl_config(), seed)


def qwen2_vl_tokens_per_image(config, height: int, width: int) -> int:
    v = config.vision_config
    return (height // v.patch_size) * (width // v.patch_size) // v.spatial_merge_size ** 2


def qwen2_vl_batch(counts, seq, seed, config=None, image_hw=((16, 16),), videos=None, video_fhw=((4, 16, 16),)):
    """A Qwen2-VL (or Qwen2.5-VL, with its ``config``) batch as ``Qwen2VLProcessor`` makes it.

    Image ``k`` of the batch (in sample order) has size ``image_hw[k % len(image_hw)]`` (pixels, multiples of
    ``patch_size * spatial_merge_size`` = 8); default all 16x16 -> 4 tokens each.  Per image the text holds
    ``<|vision_start|> <|image_pad|> * tokens <|vision_end|>``.  ``videos``: videos per sample (default none);
    video ``k`` has ``video_fhw[k % len(video_fhw)]`` = (frames, height, width) (frames a multiple of
    ``temporal_patch_size`` = 2): grid ``(frames / 2, h / patch, w / patch)``, ``t * h * w / merge**2`` tokens of
    ``<|video_pad|>`` between the same start / end tokens (a 4-frame 16x16 video: grid (2, 4, 4), 8 tokens).  A
    sample's images come before its videos in its text.

    Keys: ``input_ids [B, S]``, ``labels [B, S]``, ``mm_token_type_ids [B, S]`` (1 at ``<|image_pad|>``, 2 at
    ``<|video_pad|>``, else 0; per-sample), and when the batch has an image: ``pixel_values [sum_k t*h*w, 3*2*4*4 =
    96]`` float32 (dim 0 = patches of all images, image after image: NOT one row per image) and ``image_grid_thw
    [N, 3]`` int64 (dim 0 = images); with a video: ``pixel_values_videos [sum_k t*h*w, 96]`` and ``video_grid_thw
    [V, 3]`` (and for Qwen2.5-VL ``second_per_grid_ts [V]``, 0.5, 1 or 1.5 s).  A batch without images (videos) has
    no image (video) keys.  ``labels`` mask the pad, start and end
    tokens.
    """
    import torch

    counts = _check_counts(counts)
    videos = _check_counts(videos) if videos is not None else [0] * len(counts)
    if len(videos) != len(counts):
        raise ValueError(f"videos has {len(videos)} samples, counts {len(counts)}")
    config = config or tiny_qwen2_vl_config()
    v = config.vision_config
    hw = [image_hw[k % len(image_hw)] for k in range(sum(counts))]
    fhw = [video_fhw[k % len(video_fhw)] for k in range(sum(videos))]
    merge = v.spatial_merge_size ** 2
    img_grids = [(1, h // v.patch_size, w // v.patch_size) for h, w in hw]
    vid_grids = [(f // v.temporal_patch_size, h // v.patch_size, w // v.patch_size) for f, h, w in fhw]
    img, vid = config.image_token_id, config.video_token_id
    vs, ve = config.vision_start_token_id, config.vision_end_token_id
    blocks, i, j = [], 0, 0
    for c, n in zip(counts, videos):
        for _ in range(c):
            t, a, b = img_grids[i]
            blocks.append([vs] + [img] * (t * a * b // merge) + [ve])
            i += 1
        for _ in range(n):
            t, a, b = vid_grids[j]
            blocks.append([vs] + [vid] * (t * a * b // merge) + [ve])
            j += 1
    rows, g = _rows([c + n for c, n in zip(counts, videos)], seq, seed, lambda k: blocks[k], ve)
    input_ids = torch.tensor(rows, dtype=torch.long)
    batch = {"input_ids": input_ids, "labels": _labels(input_ids, (img, vid, vs, ve)),
             "mm_token_type_ids": (input_ids == img).long() + 2 * (input_ids == vid).long()}
    per_row = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    if hw:
        batch["pixel_values"] = torch.randn(sum(t * a * b for t, a, b in img_grids), per_row, generator=g)
        batch["image_grid_thw"] = torch.tensor(img_grids, dtype=torch.long)
    if fhw:
        batch["pixel_values_videos"] = torch.randn(sum(t * a * b for t, a, b in vid_grids), per_row, generator=g)
        batch["video_grid_thw"] = torch.tensor(vid_grids, dtype=torch.long)
        if config.model_type == "qwen2_5_vl":  # seconds per temporal patch (the processor's fps): 0.5 s, 1 s, ...
            batch["second_per_grid_ts"] = torch.tensor([0.5 * (1 + k % 3) for k in range(len(vid_grids))])
    return batch


# ----------------------------------------------------------------------------------------------------- PaliGemma
def tiny_paligemma_config(attn_implementation: str = "sdpa", vocab_size: int = 128):
    """A ``PaliGemmaConfig``: SigLIP vision 16 px, patch 4 (16 tokens), width 32, 2 layers; Gemma text width 32,
    2 layers, 4 heads / 1 KV head, head_dim 8, vocabulary 128, tied embeddings (as the real model);
    ``image_token_index = 127``; ``projection_dim = 32``."""
    from transformers import GemmaConfig, PaliGemmaConfig, SiglipVisionConfig

    vision = SiglipVisionConfig(image_size=16, patch_size=4, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=2, vision_use_head=False)
    text = GemmaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=8, max_position_embeddings=2048,
                       pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, use_cache=False)
    config = PaliGemmaConfig(vision_config=vision, text_config=text, image_token_index=vocab_size - 1,
                             vocab_size=vocab_size, projection_dim=32, hidden_size=32)
    return _finish_config(config, attn_implementation)


def tiny_paligemma(seed: int = 0, config=None):
    """``PaliGemmaForConditionalGeneration`` from :func:`tiny_paligemma_config`.

    Tokens per image: ``config.text_config.num_image_tokens`` = ``(vision image_size // patch_size) ** 2`` (16 here;
    SigLIP has no CLS, every patch is a token).

    Forward: SigLIP on ``pixel_values [N, 3, H, W]``, linear projector, ``masked_scatter`` into the placeholders
    (count checked by ``torch_compilable_check``); the attention mask is causal OR'ed with a block overlay from
    ``token_type_ids`` (``block_sequence_ids = where(token_type_ids == 0, 0, -1)``: the prefix - images, bos, prompt -
    is bidirectional, the suffix causal), built with a vmap'd mask function (``create_causal_mask``); positions
    1-based.  No ``.tolist()`` / Python loop over images.

    torch.export: traces with the image count symbolic; the placeholder-count check (``torch_compilable_check`` ->
    ``_is_all_true(...).item()`` -> ``_assert_scalar``) links the text and vision sides in the graph (set
    ``TRANSFORMERS_DISABLE_TORCH_CHECK=1`` to leave it out of the trace).
    """
    from transformers import PaliGemmaForConditionalGeneration

    return _build(PaliGemmaForConditionalGeneration, config or tiny_paligemma_config(), seed)


def paligemma_batch(counts, seq, seed, config=None, prefix_len: int = 4):
    """A PaliGemma batch as ``PaliGemmaProcessor(images, text, suffix=...)`` makes it.

    Row: ``<image> * 16 * n_images, <bos>, prompt (prefix_len random ids, the last one standing for "\\n"),
    suffix (random ids to length seq)`` - images first, before bos, as the processor does.

    Keys: ``input_ids [B, S]``, ``labels [B, S]`` (-100 on the whole prefix: images, bos, prompt),
    ``token_type_ids [B, S]`` (0 prefix, 1 suffix; per-sample), and when the batch has an image
    ``pixel_values [N, 3, 16, 16]`` (dim 0 = images, sample order).  Text-only batch: no ``pixel_values``.
    """
    import torch

    counts = _check_counts(counts)
    config = config or tiny_paligemma_config()
    img = config.image_token_id
    tpi = config.text_config.num_image_tokens
    g = _gen(seed)
    rows, types = [], []
    for b, c in enumerate(counts):
        pre = [img] * (tpi * c) + [BOS] + _text(g, prefix_len, img)
        if len(pre) >= seq:
            raise ValueError(f"sample {b}: {c} image(s) + prompt need {len(pre) + 1} tokens but seq={seq}")
        rows.append(pre + _text(g, seq - len(pre), img))
        types.append([0] * len(pre) + [1] * (seq - len(pre)))
    input_ids = torch.tensor(rows, dtype=torch.long)
    token_type_ids = torch.tensor(types, dtype=torch.long)
    batch = {"input_ids": input_ids, "labels": input_ids.masked_fill(token_type_ids == 0, -100),
             "token_type_ids": token_type_ids}
    n = sum(counts)
    if n:
        s = config.vision_config.image_size
        batch["pixel_values"] = torch.randn(n, 3, s, s, generator=g)
    return batch


# ----------------------------------------------------------------------------------------------------- Gemma 3
def tiny_gemma3_config(attn_implementation: str = "sdpa", vocab_size: int = 128,
                       layer_types=("sliding_attention", "full_attention")):
    """A ``Gemma3Config``: SigLIP vision 16 px, patch 4, width 32, 2 layers; ``mm_tokens_per_image = 4`` (the
    projector average-pools the 4x4 patch grid to 2x2); Gemma 3 text width 32, 2 layers (``layer_types``
    sliding, full by default; ``sliding_window 8``), 4 heads / 2 KV heads, head_dim 8, vocabulary 128, tied embeddings.
    Ids: ``image_token_index = 127``, ``boi_token_index = 126``, ``eoi_token_index = 125``."""
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    vision = SiglipVisionConfig(image_size=16, patch_size=4, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=2, vision_use_head=False)
    text = Gemma3TextConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8,
                            sliding_window=8, layer_types=list(layer_types),
                            max_position_embeddings=2048, pad_token_id=PAD, bos_token_id=BOS,
                            eos_token_id=EOS, use_cache=False)
    config = Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=4,
                          image_token_index=vocab_size - 1, boi_token_index=vocab_size - 2,
                          eoi_token_index=vocab_size - 3)
    return _finish_config(config, attn_implementation)


def tiny_gemma3(seed: int = 0, config=None):
    """``Gemma3ForConditionalGeneration`` from :func:`tiny_gemma3_config`.

    After HF init, ``model.model.multi_modal_projector.mm_input_projection_weight`` (which HF initialises to
    zeros, making every vision gradient zero) is re-drawn ``N(0, 0.02)`` with the same seed.

    Tokens per image: ``config.mm_tokens_per_image`` (4 here), NOT ``(image_size // patch_size) ** 2`` (16): the
    projector average-pools the patch grid to ``sqrt(mm_tokens_per_image)`` per side.

    Forward: SigLIP on ``pixel_values [N, 3, H, W]``, avg-pool + RMSNorm + matmul projector, ``masked_scatter`` into
    the placeholders; masks: ``token_type_ids`` (1 at image tokens) -> block ids (``cumsum`` of image-run starts,
    each image bidirectional within itself) OR'ed into the causal mask for the full layers and AND'ed with the
    sliding window for the sliding layers (vmap'd mask functions).  Without ``token_type_ids`` the mask is plain
    causal.  No ``.tolist()`` / Python loop over images.

    torch.export: traces with the image count symbolic; the sliding-window layer's mask is built by ``vmap`` over an
    indexing mask function, which shows up in the graph as ``_vmap_increment_nesting`` / ``_add_batch_dim`` /
    ``flat_apply`` (with ``get_attr`` constants) / ``_remove_batch_dim`` / ``_vmap_decrement_nesting``; with
    ``layer_types=("full_attention",) * 2`` there is no vmap.  Same placeholder-count check as PaliGemma.
    """
    import torch
    from transformers import Gemma3ForConditionalGeneration

    def after(model):
        with torch.no_grad():
            w = model.model.multi_modal_projector.mm_input_projection_weight
            w.copy_(torch.randn(w.shape) * 0.02)

    return _build(Gemma3ForConditionalGeneration, config or tiny_gemma3_config(), seed, after)


def gemma3_batch(counts, seq, seed, config=None):
    """A Gemma 3 batch as ``Gemma3Processor`` makes it: per image
    ``"\\n\\n" <start_of_image> <image_soft_token> * mm_tokens_per_image <end_of_image> "\\n\\n"`` (the two
    newline pairs are random text ids here), so 2 + 4 = 6 ids per image block.

    Keys: ``input_ids [B, S]``, ``labels [B, S]`` (-100 at soft image tokens, boi, eoi), ``token_type_ids [B, S]``
    (1 at soft image tokens; per-sample; always present, all zero for text-only rows), and when the batch has an
    image ``pixel_values [N, 3, 16, 16]`` (dim 0 = images).  Text-only batch: no ``pixel_values``.
    """
    import torch

    counts = _check_counts(counts)
    config = config or tiny_gemma3_config()
    img, boi, eoi = config.image_token_id, config.boi_token_id, config.eoi_token_id
    tpi = config.mm_tokens_per_image
    rows, g = _rows(counts, seq, seed, lambda k: [boi] + [img] * tpi + [eoi], eoi)
    input_ids = torch.tensor(rows, dtype=torch.long)
    batch = {"input_ids": input_ids, "labels": _labels(input_ids, (img, boi, eoi)),
             "token_type_ids": (input_ids == img).long()}
    n = sum(counts)
    if n:
        s = config.vision_config.image_size
        batch["pixel_values"] = torch.randn(n, 3, s, s, generator=g)
    return batch


# ----------------------------------------------------------------------------------------------------- Idefics3
def tiny_idefics3_config(attn_implementation: str = "sdpa", vocab_size: int = 128):
    """An ``Idefics3Config``: vision (SigLIP-like, ``Idefics3VisionConfig``) 16 px, patch 4, width 32, 2 layers;
    ``scale_factor 2`` (pixel shuffle 16 patches -> 4 tokens); Llama text width 32, 2 layers, 4 heads / 2 KV heads,
    vocabulary 128.  Ids: ``image_token_id = 127``; ``<fake_token_around_image>`` = 126 and ``<global-img>`` = 125
    (tokenizer-only tokens, see :func:`idefics3_batch`)."""
    from transformers import Idefics3Config

    config = Idefics3Config(
        vision_config=dict(image_size=16, patch_size=4, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2),
        text_config=dict(model_type="llama", vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
                         use_cache=False, tie_word_embeddings=False),
        image_token_id=vocab_size - 1, scale_factor=2, use_cache=False, tie_word_embeddings=False,
    )
    return _finish_config(config, attn_implementation)


IDEFICS3_FAKE_TOKEN = 126   # <fake_token_around_image> for vocab 128
IDEFICS3_GLOBAL_IMG = 125   # <global-img>


def idefics3_tokens_per_image(config) -> int:
    v = config.vision_config
    return ((v.image_size // v.patch_size) ** 2) // (config.scale_factor ** 2)


def tiny_idefics3(seed: int = 0, config=None):
    """``Idefics3ForConditionalGeneration`` from :func:`tiny_idefics3_config`.

    Tokens per image (per image *entry* of ``pixel_values``): ``((image_size // patch_size) ** 2) //
    scale_factor ** 2`` (4 here) - the processor's ``image_seq_len``; not on the model config.

    Forward: ``pixel_values [B, max_images, 3, H, W]`` is flattened to ``B * max_images`` images and the padding
    images are dropped by a data-dependent boolean index (``real_images_inds = (pixel_values == 0).sum(...) !=
    numel``; all-zero images are padding), same for ``pixel_attention_mask``; patch mask by ``unfold``; vision
    embeddings bucketize fractional patch coords per image (``torch.bucketize``, ``torch.where`` on the patch
    mask); connector pixel-shuffle + linear; features split per sample by ``num_real_images_per_batch.tolist()``,
    concatenated, ``masked_scatter`` into the placeholders.

    torch.export: traces; the real-image count is an unbacked size ``u0`` (from the boolean index) that the image
    features carry into the text side; the per-sample split sizes are unbacked too; ``pixel_values.shape[0]`` comes
    out static.
    """
    from transformers import Idefics3ForConditionalGeneration

    return _build(Idefics3ForConditionalGeneration, config or tiny_idefics3_config(), seed)


def idefics3_batch(counts, seq, seed, config=None):
    """An Idefics3 batch as ``Idefics3Processor(..., do_image_splitting=False)`` makes it: per image
    ``<fake_token_around_image> <global-img> <image> * 4 <fake_token_around_image>`` (7 ids).

    Keys: ``input_ids [B, S]``, ``labels [B, S]`` (-100 at image, fake-around-image and global-img tokens), and
    when the batch has an image ``pixel_values [B, max(counts), 3, 16, 16]`` (dim 0 = SAMPLES, dim 1 = image slot;
    sample b's images in slots ``< counts[b]``, the other slots all-zero padding) and ``pixel_attention_mask
    [B, max(counts), 16, 16]`` bool (True on real images, False on padding slots).  Both pixel keys are
    per-sample (dim 0 = B) but their dim 1 is the batch's max image count.  Text-only batch: no pixel keys.
    """
    import torch

    counts = _check_counts(counts)
    config = config or tiny_idefics3_config()
    img = config.image_token_id
    fake, glob = config.text_config.vocab_size - 2, config.text_config.vocab_size - 3
    tpi = idefics3_tokens_per_image(config)
    rows, g = _rows(counts, seq, seed, lambda k: [fake, glob] + [img] * tpi + [fake], glob)
    input_ids = torch.tensor(rows, dtype=torch.long)
    batch = {"input_ids": input_ids, "labels": _labels(input_ids, (img, fake, glob))}
    m = max(counts)
    if m:
        s = config.vision_config.image_size
        pv = torch.zeros(len(counts), m, 3, s, s)
        mask = torch.zeros(len(counts), m, s, s, dtype=torch.bool)
        for b, c in enumerate(counts):
            if c:
                pv[b, :c] = torch.randn(c, 3, s, s, generator=g)
                mask[b, :c] = True
        batch["pixel_values"] = pv
        batch["pixel_attention_mask"] = mask
    return batch


# ----------------------------------------------------------------------------------------------------- LLaVA-NeXT
def tiny_llava_next_config(attn_implementation: str = "sdpa", vocab_size: int = 128):
    """A ``LlavaNextConfig``: CLIP vision 16 px, patch 8 (2x2 patches + CLS per crop), width 32, 3 layers (features
    from layer -2, CLS dropped: ``vision_feature_select_strategy="default"``); ``image_grid_pinpoints [[16, 32],
    [32, 16], [32, 32]]``; Llama text width 32, 2 layers, 4 heads / 2 KV heads, vocabulary 128;
    ``image_token_index = 127``."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig

    vision = CLIPVisionConfig(image_size=16, patch_size=8, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=3, num_attention_heads=2, projection_dim=32)
    text = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                       pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, use_cache=False,
                       tie_word_embeddings=False)
    config = LlavaNextConfig(vision_config=vision, text_config=text, image_token_index=vocab_size - 1,
                             vision_feature_select_strategy="default", vision_feature_layer=-2,
                             image_grid_pinpoints=[[16, 32], [32, 16], [32, 32]], tie_word_embeddings=False)
    return _finish_config(config, attn_implementation)


def _best_resolution(h, w, pinpoints):
    from transformers.image_processing_utils import select_best_resolution

    return select_best_resolution((h, w), pinpoints)


def llava_next_num_patches(config, height: int, width: int) -> int:
    """Crops of an image of original size ``(height, width)``: the best pinpoint's grid + 1 base crop."""
    bh, bw = _best_resolution(height, width, config.image_grid_pinpoints)
    s = config.vision_config.image_size
    return math.ceil(bh / s) * math.ceil(bw / s) + 1


def llava_next_tokens_per_image(config, height: int, width: int) -> int:
    """Placeholder tokens of an image of original size ``(height, width)`` (the model's ``pack_image_features``):
    base crop ``p*p`` (``p = image_size // patch_size``; +1 with the "full" strategy per crop) plus the unpadded
    anyres grid ``rows * cols`` plus one ``image_newline`` per row."""
    if config.vision_feature_select_strategy == "full":  # "full" keeps CLS: pack_image_features would not line up
        raise NotImplementedError("vision_feature_select_strategy='full' is not supported by this helper")
    return _anyres_tokens(config, height, width)


def _anyres_tokens(config, height: int, width: int, max_tiles: int | None = None) -> int:
    """Tokens of an "anyres" image with ``p*p`` features per tile: the base tile, the unpadded grid of the best
    pinpoint's tiles, one ``image_newline`` per grid row; with ``max_tiles`` (LLaVA-OneVision's ``anyres_max_<n>``)
    a grid larger than ``1.1**2 * max_tiles`` tiles is down-scaled by its ratio, as ``LlavaOnevisionProcessor``
    counts it."""
    v = config.vision_config
    p = v.image_size // v.patch_size
    bh, bw = _best_resolution(height, width, config.image_grid_pinpoints)
    cur_h, cur_w = (bh // v.image_size) * p, (bw // v.image_size) * p
    if width / height > cur_w / cur_h:
        new_h = int(round(height * (cur_w / width), 7))
        cur_h -= 2 * ((cur_h - new_h) // 2)
    else:
        new_w = int(round(width * (cur_h / height), 7))
        cur_w -= 2 * ((cur_w - new_w) // 2)
    ratio = math.sqrt(cur_h * cur_w / (max_tiles * p * p)) if max_tiles else 0.0
    if ratio > 1.1:
        cur_h, cur_w = int(cur_h // ratio), int(cur_w // ratio)
    return p * p + cur_h * cur_w + cur_h


def tiny_llava_next(seed: int = 0, config=None):
    """``LlavaNextForConditionalGeneration`` from :func:`tiny_llava_next_config`.

    Tokens per image depend on the image's original size (``image_sizes``), NOT ``(image_size // patch) ** 2``:
    :func:`llava_next_tokens_per_image` (16x32 -> 3 crops, 4 + 2*4 + 2 = 14 tokens; 32x32 -> 5 crops, 4 + 4*4 + 4
    = 24; 24x16 -> 3 crops, 16; 16x16 -> 3 crops (best pinpoint 16x32), 10).  ``config.image_seq_length`` is not it
    either.

    Forward: per image, ``image_size_to_num_patches(image_sizes[i].tolist(), ...)`` in a Python list
    comprehension (``select_best_resolution`` on Python ints), ``pixel_values[i][:num_patches]`` then ``cat``;
    CLIP on all crops; ``torch.split`` by those Python counts; ``pack_image_features`` loops over images in
    Python: view to the crop grid, ``unpad_image`` (``image_sizes[i].tolist()``, Python float rounding decides
    the slice), concatenates ``image_newline``; ``masked_scatter`` into the placeholders.
    ``pixel_values.size(0) > 0`` is checked before the vision tower.

    torch.export: fails (``GuardOnDataDependentSymNode`` on ``IntTrueDiv(16, u0) < IntTrueDiv(32, u1)`` in
    ``select_best_resolution``) because ``image_sizes`` values become unbacked ints; it traces when ``image_sizes``
    is given as a Python list of ``[h, w]`` (the model accepts lists), which fixes the image count.
    """
    from transformers import LlavaNextForConditionalGeneration

    return _build(LlavaNextForConditionalGeneration, config or tiny_llava_next_config(), seed)


def llava_next_batch(counts, seq, seed, config=None, image_hw=((16, 32),)):
    """A LLaVA-NeXT batch as ``LlavaNextProcessor`` makes it.

    Image ``k`` (sample order) has original size ``image_hw[k % len(image_hw)]`` (default all 16x32: 3 crops,
    14 tokens each); its text is ``<image> * llava_next_tokens_per_image(config, h, w)``.

    Keys: ``input_ids [B, S]``, ``labels [B, S]`` (-100 at ``<image>``), and when the batch has an image
    ``pixel_values [N, max_crops, 3, 16, 16]`` (dim 0 = images; crops beyond an image's own count are zero padding,
    as the processor's ``do_pad``) and ``image_sizes [N, 2]`` int64 ``(height, width)`` (dim 0 = images).
    Text-only batch: no ``pixel_values`` / ``image_sizes``.
    """
    import torch

    counts = _check_counts(counts)
    config = config or tiny_llava_next_config()
    img = config.image_token_id
    hw = [image_hw[k % len(image_hw)] for k in range(sum(counts))]
    tpi = [llava_next_tokens_per_image(config, h, w) for h, w in hw]
    rows, g = _rows(counts, seq, seed, lambda k: [img] * tpi[k], img)
    input_ids = torch.tensor(rows, dtype=torch.long)
    batch = {"input_ids": input_ids, "labels": _labels(input_ids, (img,))}
    if hw:
        s = config.vision_config.image_size
        crops = [llava_next_num_patches(config, h, w) for h, w in hw]
        pv = torch.zeros(len(hw), max(crops), 3, s, s)
        for i, c in enumerate(crops):
            pv[i, :c] = torch.randn(c, 3, s, s, generator=g)
        batch["pixel_values"] = pv
        batch["image_sizes"] = torch.tensor(hw, dtype=torch.long)
    return batch


# ----------------------------------------------------------------------------------------------------- LLaVA-OneVision
def tiny_llava_onevision_config(attn_implementation: str = "sdpa", vocab_size: int = 128):
    """A ``LlavaOnevisionConfig``: SigLIP vision 16 px, patch 8 (2x2 patches per tile, no CLS: the "full" feature
    strategy), width 32, 3 layers (features from the last); ``image_grid_pinpoints [[16, 32], [32, 16], [32, 32]]``,
    ``vision_aspect_ratio="anyres_max_9"``; Qwen2 text width 32, 2 layers, 4 heads / 2 KV heads, vocabulary 128;
    ``image_token_id = 127``."""
    from transformers import LlavaOnevisionConfig, Qwen2Config, SiglipVisionConfig

    vision = SiglipVisionConfig(image_size=16, patch_size=8, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=3, num_attention_heads=2)
    text = Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                       pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, use_cache=False,
                       tie_word_embeddings=False)
    config = LlavaOnevisionConfig(vision_config=vision, text_config=text, image_token_index=vocab_size - 1,
                                  vision_feature_select_strategy="full", vision_feature_layer=-1,
                                  image_grid_pinpoints=[[16, 32], [32, 16], [32, 32]],
                                  vision_aspect_ratio="anyres_max_9", tie_word_embeddings=False)
    return _finish_config(config, attn_implementation)


def llava_onevision_tokens_per_image(config, height: int, width: int, single: bool) -> int:
    """Placeholder tokens of an image of original size ``(height, width)`` as ``LlavaOnevisionProcessor`` counts
    them: the only image of its sample (``single``) is tiled "anyres" like LLaVA-NeXT
    (:func:`llava_next_tokens_per_image`, down-scaled past ``anyres_max_<n>`` tiles: the tiny sizes never reach
    ``anyres_max_9``, a config with ``anyres_max_1`` does); each image
    of a multi-image sample is its base tile alone, ``p*p`` features plus one ``image_newline``."""
    v = config.vision_config
    p = v.image_size // v.patch_size
    if not single:
        return p * p + 1
    return _anyres_tokens(config, height, width, int(str(config.vision_aspect_ratio).strip("anyres_max_")))


def llava_onevision_instances(config=None, sub_microbatch_size: int = 12):
    """The ``dipc.Instances`` a LLaVA-OneVision user declares: ``pixel_values`` and ``image_sizes`` per image,
    placeholder tokens per image from :func:`llava_onevision_tokens_per_image`, which reads each image's sample
    image count from the per-sample ``batch_num_images [B]``."""
    import torch

    import dipc

    config = config or tiny_llava_onevision_config()

    def tokens(batch):
        sizes = batch["image_sizes"].tolist()
        single = [int(n) == 1 for n in batch["batch_num_images"].tolist() for _ in range(int(n))]
        return torch.tensor([llava_onevision_tokens_per_image(config, h, w, one)
                             for (h, w), one in zip(sizes, single)], dtype=torch.long)

    return [dipc.Instances("vision", ("pixel_values", "image_sizes"), config.image_token_id, tokens,
                           drop_when_empty=True, sub_microbatch_size=sub_microbatch_size)]


def tiny_llava_onevision(seed: int = 0, config=None):
    """``LlavaOnevisionForConditionalGeneration`` from :func:`tiny_llava_onevision_config`.

    Forward: ``need_patching = [n == 1 for n in batch_num_images for _ in range(n)]`` (a per-sample count read in
    Python), then per image ``image_size_to_num_patches(image_sizes[i])`` tiles when patched, else 1; those Python
    counts pick ``pixel_values[i][:tiles]`` and split the projected features, and ``pack_image_features`` unpads
    each image's grid (``image_sizes[i]``) and adds ``image_newline``.  With the default tiny sizes a 32x32 image
    alone in its sample is 5 tiles and 24 tokens; an image of a multi-image sample 1 tile and 5 tokens.
    """
    from transformers import LlavaOnevisionForConditionalGeneration

    return _build(LlavaOnevisionForConditionalGeneration, config or tiny_llava_onevision_config(), seed)


def llava_onevision_batch(counts, seq, seed, config=None, image_hw=((32, 32),)):
    """A LLaVA-OneVision batch as ``LlavaOnevisionProcessor`` lays it out.

    Image ``k`` (sample order) has original size ``image_hw[k % len(image_hw)]``; its text is ``<image>`` times
    :func:`llava_onevision_tokens_per_image` (anyres tiles when it is its sample's only image).

    Keys: ``input_ids [B, S]``, ``labels [B, S]`` (-100 at ``<image>``), ``batch_num_images [B]`` int64 (images of
    each sample), and when the batch has an image ``pixel_values [N, max_tiles, 3, 16, 16]`` (tiles beyond an
    image's own count are zero padding, as the processor pads) and ``image_sizes [N, 2]`` int64
    ``(height, width)``.  Text-only batch: no ``pixel_values`` / ``image_sizes``.
    """
    import torch

    counts = _check_counts(counts)
    config = config or tiny_llava_onevision_config()
    img = config.image_token_id
    hw = [image_hw[k % len(image_hw)] for k in range(sum(counts))]
    single = [c == 1 for c in counts for _ in range(c)]
    tpi = [llava_onevision_tokens_per_image(config, h, w, one) for (h, w), one in zip(hw, single)]
    rows, g = _rows(counts, seq, seed, lambda k: [img] * tpi[k], img)
    input_ids = torch.tensor(rows, dtype=torch.long)
    batch = {"input_ids": input_ids, "labels": _labels(input_ids, (img,)),
             "batch_num_images": torch.tensor(counts, dtype=torch.long)}
    if hw:
        s = config.vision_config.image_size
        tiles = [llava_next_num_patches(config, h, w) if one else 1 for (h, w), one in zip(hw, single)]
        pv = torch.zeros(len(hw), max(llava_next_num_patches(config, h, w) for h, w in hw), 3, s, s)
        for i, c in enumerate(tiles):
            pv[i, :c] = torch.randn(c, 3, s, s, generator=g)
        batch["pixel_values"] = pv
        batch["image_sizes"] = torch.tensor(hw, dtype=torch.long)
    return batch


# ----------------------------------------------------------------------------------------------------- Mllama
def tiny_mllama_config(attn_implementation: str = "sdpa", vocab_size: int = 128):
    """A ``MllamaConfig``: vision 16 px, patch 8 (4 patches + CLS = 5, padded to 8 inside), width 32, 2 local layers
    + 1 global (gated) layer, ``intermediate_layers_indices [1]`` (``vision_output_dim = 32 * 2 = 64``),
    ``max_num_tiles 2``, ``supported_aspect_ratios [[1, 1], [1, 2], [2, 1]]``; text Llama-like width 32, 3 layers
    with layer 1 a gated cross-attention layer, 4 heads / 2 KV heads, vocabulary 128 (embedding has 128 + 8 rows);
    ``image_token_index = 128`` (outside the LM-head vocabulary, inside the embedding, as the real model)."""
    from transformers import MllamaConfig

    config = MllamaConfig(
        vision_config=dict(image_size=16, patch_size=8, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_global_layers=1, attention_heads=2,
                           intermediate_layers_indices=[1], vision_output_dim=64, max_num_tiles=2,
                           supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]]),
        text_config=dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, cross_attention_layers=[1],
                         max_position_embeddings=2048, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
                         use_cache=False, dropout=0.0),
        image_token_index=vocab_size,
    )
    return _finish_config(config, attn_implementation)


def tiny_mllama(seed: int = 0, config=None, gate: float = MLLAMA_GATE_VALUE):
    """``MllamaForConditionalGeneration`` from :func:`tiny_mllama_config`.

    HF initialises the cross-attention gates (``cross_attn_attn_gate``, ``cross_attn_mlp_gate``) and the vision
    gates (``gated_positional_embedding.gate``, ``pre/post_tile_positional_embedding.gate``) to zero, so the image
    would not reach the loss at all (tanh(0) = 0: zero vision gradients, a vacuous gradient check).  After init,
    every parameter whose name ends in ``gate`` or ``_gate`` of those modules is filled with ``gate`` (0.5).  (The
    global vision layers' ``gate_attn``/``gate_ffn`` are already non-zero: pi/4 or N(0, std).)

    No placeholder tokens per patch: one ``<|image|>`` token per image marks where the image sits, and the text
    cross-attends (in the cross-attention layers only) to all ``max_images * max_num_tiles * num_patches`` vision
    tokens of its own sample, masked by ``cross_attention_mask`` (a text token attends to the images from its most
    recent ``<|image|>`` group on; ``num_patches = (image_size // patch_size) ** 2 + 1``).

    Forward: vision on ``pixel_values [B, max_images, max_tiles, 3, H, W]`` reshaped to ``B * max_images *
    max_tiles`` tiles (padding images and tiles included: all are encoded), tile/position embeddings gathered by
    ``aspect_ratio_ids``, padding tiles masked via ``aspect_ratio_mask``; projector; ``cross_attention_mask``
    ``repeat_interleave``'d to vision tokens and inverted.  With ``pixel_values`` absent (and no cache) the
    cross-attention layers are skipped by a Python ``continue``.  In-place ops in the trace: ``attention_mask[:, :,
    -pad_patches:] = 0`` (``aten.fill_``) and ``cross_attention_mask *= full_text_row_masked_out_mask``
    (``aten.mul_``).

    Caveat for splitting: a text token with no image to attend to (text before the first ``<|image|>``, or every
    token of a sample without image in a batch that has images) gets an all-zero mask row, which Mllama turns into
    *uniform* attention over its sample's (padding) vision tokens; only the MLP half is zeroed.  So a sample's loss
    depends on whether its batch carries pixel keys: slicing a batch along dim 0 (all keys are per-sample) keeps
    every sample's loss exactly, but giving an image-less sub-batch without pixel keys (as its own processor call
    would) changes it (by ~4e-5 relative in the tiny model).
    """
    import torch
    from transformers import MllamaForConditionalGeneration

    def after(model):
        with torch.no_grad():
            for name, p in model.named_parameters():
                leaf = name.rsplit(".", 1)[-1]
                if leaf in ("cross_attn_attn_gate", "cross_attn_mlp_gate") or (
                        leaf == "gate" and ("positional_embedding" in name)):
                    p.fill_(gate)

    return _build(MllamaForConditionalGeneration, config or tiny_mllama_config(), seed, after)


def mllama_batch(counts, seq, seed, config=None, aspect_ratios=((1, 2), (1, 1))):
    """An Mllama batch as ``MllamaProcessor`` makes it: one ``<|image|>`` token per image at seeded random places.

    Image ``k`` (sample order) is tiled as ``aspect_ratios[k % len]`` (rows, cols) - default alternately 2 tiles
    (1x2) and 1 tile; its ``aspect_ratio_id`` is its 1-based index in ``supported_aspect_ratios``.

    Keys: ``input_ids [B, S]``, ``labels [B, S]`` (-100 at ``<|image|>``), and when the batch has an image:
    ``pixel_values [B, max(counts), max_num_tiles=2, 3, 16, 16]`` (dim 0 = SAMPLES; padding tiles and padding image
    slots zero), ``aspect_ratio_ids [B, max(counts)]`` int64 (0 on padding slots), ``aspect_ratio_mask
    [B, max(counts), 2]`` int64 (1 on real tiles; tile 0 of every slot is 1, padding slots included, as the image
    processor does), ``cross_attention_mask [B, S, max(counts), 2]`` int64 (processor's
    ``get_cross_attention_token_mask``: image i of a sample is attended from its token up to the next image token
    - consecutive image tokens share the later end - the last to the end of the row; only on its real tiles).  All
    keys are per-sample (dim 0 = B).  Text-only batch: only ``input_ids`` and ``labels``.
    """
    import torch

    counts = _check_counts(counts)
    config = config or tiny_mllama_config()
    img = config.image_token_index
    v = config.vision_config
    ratios = [tuple(r) for r in v.supported_aspect_ratios]
    n = sum(counts)
    ar = [tuple(aspect_ratios[k % len(aspect_ratios)]) for k in range(n)]
    rows, g = _rows(counts, seq, seed, lambda k: [img], config.text_config.vocab_size)
    input_ids = torch.tensor(rows, dtype=torch.long)
    batch = {"input_ids": input_ids, "labels": _labels(input_ids, (img,))}
    m = max(counts)
    if m:
        B, T, s = len(counts), v.max_num_tiles, v.image_size
        pv = torch.zeros(B, m, T, 3, s, s)
        ids = torch.zeros(B, m, dtype=torch.long)
        amask = torch.zeros(B, m, T, dtype=torch.long)
        amask[:, :, 0] = 1
        cmask = torch.zeros(B, seq, m, T, dtype=torch.long)
        k = 0
        for b, c in enumerate(counts):
            locs = [i for i, t in enumerate(rows[b]) if t == img]
            spans = [[a, e] for a, e in zip(locs[:-1], locs[1:])] + ([[locs[-1], seq]] if locs else [])
            last = spans[-1][1] if spans else seq
            for sp in reversed(spans):  # consecutive image tokens attend to all the text after the group
                if sp[0] == sp[1] - 1:
                    sp[1] = last
                last = sp[1]
            for i in range(c):
                r = ar[k]
                nt = r[0] * r[1]
                if nt > T or r not in ratios:
                    raise ValueError(f"aspect ratio {r} not supported by {ratios} / max_num_tiles {T}")
                pv[b, i, :nt] = torch.randn(nt, 3, s, s, generator=g)
                ids[b, i] = ratios.index(r) + 1
                amask[b, i, :nt] = 1
                cmask[b, spans[i][0]:spans[i][1], i, :nt] = 1
                k += 1
        batch.update(pixel_values=pv, aspect_ratio_ids=ids, aspect_ratio_mask=amask, cross_attention_mask=cmask)
    return batch


#: name -> (model builder, batch builder)
BUILDERS = {
    "qwen2_vl": (tiny_qwen2_vl, qwen2_vl_batch),
    "paligemma": (tiny_paligemma, paligemma_batch),
    "gemma3": (tiny_gemma3, gemma3_batch),
    "idefics3": (tiny_idefics3, idefics3_batch),
    "llava_next": (tiny_llava_next, llava_next_batch),
    "mllama": (tiny_mllama, mllama_batch),
    "llava_onevision": (tiny_llava_onevision, llava_onevision_batch),
}
