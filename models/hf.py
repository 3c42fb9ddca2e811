"""A tiny Hugging Face LLaVA (``LlavaForConditionalGeneration``) for testing dipc on a third-party model.

``transformers`` is imported inside the functions (importing it takes seconds), so ``import dipc.models`` stays
cheap. Batches come from :func:`dipc.models.data.llava_batches`.

Known torch.export behaviour of LLaVA: its forward turns the image features into a Python list
(``list(image_features)``), so the number of images is specialised to the example's value; export it with a fixed
example (or with only the text dimensions dynamic).
"""

from __future__ import annotations

__all__ = ["tiny_llava_config", "tiny_llava"]


def tiny_llava_config(
    image_size: int = 16,
    patch_size: int = 8,
    vision_layers: int = 3,
    text_layers: int = 2,
    vocab_size: int = 128,
    attn_implementation: str = "sdpa",
):
    """A ``transformers.LlavaConfig`` small enough to run in milliseconds on CPU.

    Vision: CLIP ViT, ``image_size`` 16, patch 8 (so ``(16 // 8) ** 2 = 4`` tokens per image with the default
    feature strategy, which drops CLS), width 32, 3 layers (LLaVA takes features from layer -2, so the loss
    reaches 2 of them), 2 heads. Text: Llama, width 32, 2 layers, 4 heads, 2 KV
    heads, vocabulary 128. ``image_token_id = vocab_size - 1`` (inside the vocabulary), ``pad_token_id`` 0,
    ``bos_token_id`` 1, ``eos_token_id`` 2, ``use_cache=False``. ``attn_implementation="sdpa"`` (plain
    ``torch.nn.functional.scaled_dot_product_attention``) is set on all sub-configs; it traces under
    ``torch.export``.
    """
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(
        image_size=image_size,
        patch_size=patch_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=vision_layers,
        num_attention_heads=2,
        projection_dim=32,
    )
    text = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=text_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        use_cache=False,
        tie_word_embeddings=False,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=vocab_size - 1,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )
    config.use_cache = False
    for cfg in (config, config.vision_config, config.text_config):
        cfg._attn_implementation = attn_implementation
    return config


def tiny_llava(seed: int = 0, config=None):
    """``LlavaForConditionalGeneration`` from :func:`tiny_llava_config` (or ``config``), float32, random init
    seeded by ``seed``, in train mode (no dropout in this config)."""
    import torch
    from transformers import LlavaForConditionalGeneration

    if config is None:
        config = tiny_llava_config()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config)
    return model.float().train()
