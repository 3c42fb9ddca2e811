"""The paper's model sizes (PAPER.md §3.1, Tables 2 and 3) as configs, and building them on the meta device.

Components (Table 2: layers / embed dim / FFN hidden / attention heads / KV groups)::

    ViT 5B      63 / 1792 / 15360 / 16 / 16     vit_5b()      VisionConfig
    ViT 22B     48 / 6144 / 24576 / 48 / 48     vit_22b()     VisionConfig
    Llama3 8B   32 / 4096 / 14336 / 32 /  8     llama3_8b()   TextConfig (vocab 128256)
    Qwen2 32B   64 / 5120 / 27648 / 40 /  8     qwen2_32b()   TextConfig (vocab 152064, qkv bias)
    Qwen2 72B   80 / 8192 / 29568 / 64 /  8     qwen2_72b()   TextConfig (vocab 152064, qkv bias)
    DiT 5B      28 / 3584 / 10240 / 28 / 28     dit_5b()      DiTConfig
    DiT 30B     48 / 6144 / 24576 / 48 / 48     dit_30b()     DiTConfig

Combinations (Table 3): ``vlm_s`` (ViT 5B + Llama3 8B), ``vlm_m`` (ViT 5B + Qwen2 32B), ``vlm_l`` (ViT 22B +
Qwen2 72B), ``t2v_s`` (Llama3 8B + DiT 5B), ``t2v_l`` (Qwen2 32B + DiT 30B).

Not in Table 2, chosen here (and stated so): the ViTs use the Qwen2-VL geometry of §3.2 (728 px images, patch 14,
spatial merge 4 -> 169 tokens per image) with a GELU MLP; the LLMs use SwiGLU and RoPE (theta 500000 for Llama3,
1000000 for Qwen2) with untied embeddings; the DiTs assume a 16-channel latent with ``(1, 2, 2)`` patches and a largest latent of
``(32, 48, 80)`` frames x height x width (an assumption; it only sizes the factorised positional embeddings, which
are a negligible share of the parameters).

Parameter counts of these configs (``component_params``) against the nominal sizes in the names:
ViT 5B 4.29B (-14%: Table 2's dims with a standard 2-matrix GELU MLP give 4.3B; the "5B" is the paper's rounding,
and a 3-matrix SwiGLU MLP would overshoot to 6.0B), ViT 22B 21.8B, Llama3 8B 8.03B (with lm_head), Qwen2 32B 32.8B,
Qwen2 72B 72.7B, DiT 5B 5.04B, DiT 30B 29.3B (DiT counts include ``text_proj`` and the shared ``time_modulation``).
The projector adds 0.13B (VLM-S) to 0.87B (VLM-L; its input is 16 merged patches). An LM used as a T2V text
encoder has no lm_head (Llama3 8B: 7.5B, Qwen2 32B: 32.0B).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .diffusion import DiT, DiTConfig, ReferenceT2V, T2VConfig
from .language import TextConfig, TextTransformer
from .vlm import ReferenceVLM, VisionConfig, VisionTower, VLMConfig

__all__ = [
    "vit_5b",
    "vit_22b",
    "llama3_8b",
    "qwen2_32b",
    "qwen2_72b",
    "dit_5b",
    "dit_30b",
    "vlm_s",
    "vlm_m",
    "vlm_l",
    "t2v_s",
    "t2v_l",
    "COMPONENTS",
    "MODELS",
    "NOMINAL_PARAMS",
    "build_on_meta",
    "component_params",
]

LLAMA3_VOCAB = 128256
QWEN2_VOCAB = 152064

# Qwen2-VL image geometry used by the paper (§1.2, §3.2): 728 px, patch 14, spatial merge 4 -> 13 x 13 = 169 tokens.
_QWEN2VL_IMAGE = dict(image_size=728, patch_size=14, spatial_merge_size=4)


# ---- Table 2 components ---------------------------------------------------------------------------------------


def vit_5b() -> VisionConfig:
    """ViT 5B: 63 layers, 1792 wide, FFN 15360, 16 heads."""
    return VisionConfig(dim=1792, n_layers=63, n_heads=16, ffn_dim=15360, **_QWEN2VL_IMAGE)


def vit_22b() -> VisionConfig:
    """ViT 22B: 48 layers, 6144 wide, FFN 24576, 48 heads."""
    return VisionConfig(dim=6144, n_layers=48, n_heads=48, ffn_dim=24576, **_QWEN2VL_IMAGE)


def llama3_8b() -> TextConfig:
    """Llama3 8B: 32 layers, 4096 wide, FFN 14336, 32 heads, 8 KV groups, vocab 128256."""
    return TextConfig(vocab_size=LLAMA3_VOCAB, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                      rope_theta=500000.0, norm_eps=1e-5)


def qwen2_32b() -> TextConfig:
    """Qwen2 32B: 64 layers, 5120 wide, FFN 27648, 40 heads, 8 KV groups, vocab 152064, qkv bias."""
    return TextConfig(vocab_size=QWEN2_VOCAB, dim=5120, n_layers=64, n_heads=40, n_kv_heads=8, ffn_dim=27648,
                      rope_theta=1000000.0, norm_eps=1e-6, attention_bias=True)


def qwen2_72b() -> TextConfig:
    """Qwen2 72B: 80 layers, 8192 wide, FFN 29568, 64 heads, 8 KV groups, vocab 152064, qkv bias."""
    return TextConfig(vocab_size=QWEN2_VOCAB, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=29568,
                      rope_theta=1000000.0, norm_eps=1e-6, attention_bias=True)


_MOVIEGEN_LATENT = dict(in_channels=16, patch_size=(1, 2, 2), max_latent_size=(32, 48, 80), freq_dim=256)


def dit_5b() -> DiTConfig:
    """DiT 5B (MovieGen-style): 28 blocks, 3584 wide, FFN 10240, 28 heads."""
    return DiTConfig(dim=3584, n_layers=28, n_heads=28, ffn_dim=10240, **_MOVIEGEN_LATENT)


def dit_30b() -> DiTConfig:
    """DiT 30B (MovieGen-style): 48 blocks, 6144 wide, FFN 24576, 48 heads."""
    return DiTConfig(dim=6144, n_layers=48, n_heads=48, ffn_dim=24576, **_MOVIEGEN_LATENT)


# ---- Table 3 combinations ---------------------------------------------------------------------------------------


def _vlm(vision: VisionConfig, text: TextConfig) -> VLMConfig:
    # The image placeholder is the last id of the (padded) vocabulary; the real tokenizers reserve such ids.
    return VLMConfig(vision=vision, text=text, image_token_id=text.vocab_size - 1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                     tie_word_embeddings=False)


def vlm_s() -> VLMConfig:
    """VLM-S (12B): ViT 5B + Llama3 8B; TP 4, PP 4 on 16 GPUs in the paper."""
    return _vlm(vit_5b(), llama3_8b())


def vlm_m() -> VLMConfig:
    """VLM-M: ViT 5B + Qwen2 32B; TP 8, PP 4 on 32 GPUs in the paper."""
    return _vlm(vit_5b(), qwen2_32b())


def vlm_l() -> VLMConfig:
    """VLM-L: ViT 22B + Qwen2 72B; TP 8, PP 8 on 64 GPUs in the paper."""
    return _vlm(vit_22b(), qwen2_72b())


def t2v_s() -> T2VConfig:
    """T2V-S (13B): Llama3 8B text encoder + DiT 5B; TP 4, PP 4 on 16 GPUs in the paper."""
    return T2VConfig(text=llama3_8b(), dit=dit_5b(), max_text_len=512)


def t2v_l() -> T2VConfig:
    """T2V-L: Qwen2 32B text encoder + DiT 30B; TP 8, PP 8 on 64 GPUs in the paper."""
    return T2VConfig(text=qwen2_32b(), dit=dit_30b(), max_text_len=512)


COMPONENTS: dict[str, Callable[[], object]] = {
    "vit_5b": vit_5b,
    "vit_22b": vit_22b,
    "llama3_8b": llama3_8b,
    "qwen2_32b": qwen2_32b,
    "qwen2_72b": qwen2_72b,
    "dit_5b": dit_5b,
    "dit_30b": dit_30b,
}
"""Table 2 components by name."""

MODELS: dict[str, Callable[[], VLMConfig | T2VConfig]] = {
    "vlm_s": vlm_s,
    "vlm_m": vlm_m,
    "vlm_l": vlm_l,
    "t2v_s": t2v_s,
    "t2v_l": t2v_l,
}
"""Table 3 combinations by name."""

NOMINAL_PARAMS: dict[str, float] = {
    "vit_5b": 5e9,
    "vit_22b": 22e9,
    "llama3_8b": 8e9,
    "qwen2_32b": 32e9,
    "qwen2_72b": 72e9,
    "dit_5b": 5e9,
    "dit_30b": 30e9,
}
"""Nominal sizes from the component names of Table 2."""


# ---- building -------------------------------------------------------------------------------------------------


def build_on_meta(config: VLMConfig | T2VConfig | VisionConfig | TextConfig | DiTConfig) -> nn.Module:
    """Build the model for ``config`` under ``torch.device("meta")``: shapes only, no memory, no init cost.

    ``VLMConfig`` -> :class:`ReferenceVLM`, ``T2VConfig`` -> :class:`ReferenceT2V`; a component config builds the
    component alone: ``VisionConfig`` -> :class:`VisionTower`, ``TextConfig`` -> causal :class:`TextTransformer`
    (no lm_head), ``DiTConfig`` -> :class:`DiT` (text width = DiT width).

    To materialise later: ``model.to_empty(device=...)``, re-initialise, and call
    ``RotaryEmbedding.reset_inv_freq()`` on the rotary modules (their ``inv_freq`` is a non-persistent buffer).
    """
    with torch.device("meta"):
        if isinstance(config, VLMConfig):
            return ReferenceVLM(config)
        if isinstance(config, T2VConfig):
            return ReferenceT2V(config)
        if isinstance(config, VisionConfig):
            return VisionTower(config)
        if isinstance(config, TextConfig):
            return TextTransformer(config, causal=True)
        if isinstance(config, DiTConfig):
            return DiT(config, text_dim=config.dim)
    raise TypeError(f"unknown config type {type(config).__name__}")


def _count(params: dict[int, nn.Parameter]) -> int:
    return sum(p.numel() for p in params.values())


def component_params(model: nn.Module) -> dict[str, int]:
    """Parameter count per modality module (shared parameters counted once, in the first module that has them).

    * :class:`ReferenceVLM`: ``vision_tower``, ``multi_modal_projector``, ``language_model`` (including
      ``lm_head``; a tied ``lm_head`` adds nothing).
    * :class:`ReferenceT2V`: ``text_encoder``, ``transformer``.
    * anything else: ``{"total": ...}``.
    """
    if isinstance(model, ReferenceVLM):
        groups = {
            "vision_tower": [model.vision_tower],
            "multi_modal_projector": [model.multi_modal_projector],
            "language_model": [model.language_model, model.lm_head],
        }
    elif isinstance(model, ReferenceT2V):
        groups = {"text_encoder": [model.text_encoder], "transformer": [model.transformer]}
    else:
        groups = {"total": [model]}
    seen: set[int] = set()
    counts: dict[str, int] = {}
    for name, modules in groups.items():
        params: dict[int, nn.Parameter] = {}
        for module in modules:
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    params[id(p)] = p
        counts[name] = _count(params)
    return counts
