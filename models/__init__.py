"""Reference multimodal models for dipc: the paper's component sizes (DIP, PAPER.md §3.1 Tables 2-3) and tiny
test sizes, plus generated training batches.

* :class:`ReferenceVLM` / :class:`VLMConfig`: LLaVA-like ViT + projector + LLM, next-token loss.
* :class:`ReferenceT2V` / :class:`T2VConfig`: LM text encoder + MovieGen-style DiT, rectified-flow loss.
* :mod:`dipc.models.configs`: ``vit_5b`` ... ``dit_30b``, ``vlm_s`` ... ``t2v_l``, :func:`build_on_meta`.
* :mod:`dipc.models.data`: :func:`vlm_batches`, :func:`t2v_batches`, :func:`llava_batches`.
* :mod:`dipc.models.hf`: a tiny Hugging Face LLaVA (imports ``transformers`` lazily; not imported here).
"""

from .configs import (
    COMPONENTS,
    MODELS,
    NOMINAL_PARAMS,
    build_on_meta,
    component_params,
    dit_5b,
    dit_30b,
    llama3_8b,
    qwen2_32b,
    qwen2_72b,
    t2v_l,
    t2v_s,
    vit_5b,
    vit_22b,
    vlm_l,
    vlm_m,
    vlm_s,
)
from .data import llava_batches, t2v_batches, vlm_batches
from .diffusion import DiT, DiTConfig, ReferenceT2V, T2VConfig
from .language import RotaryEmbedding, TextConfig, TextTransformer
from .vlm import ReferenceVLM, VisionConfig, VisionTower, VLMConfig, scatter_image_features

__all__ = [
    "COMPONENTS",
    "DiT",
    "DiTConfig",
    "MODELS",
    "NOMINAL_PARAMS",
    "ReferenceT2V",
    "ReferenceVLM",
    "RotaryEmbedding",
    "T2VConfig",
    "TextConfig",
    "TextTransformer",
    "VLMConfig",
    "VisionConfig",
    "VisionTower",
    "build_on_meta",
    "component_params",
    "dit_30b",
    "dit_5b",
    "llama3_8b",
    "llava_batches",
    "qwen2_32b",
    "qwen2_72b",
    "scatter_image_features",
    "t2v_batches",
    "t2v_l",
    "t2v_s",
    "vit_22b",
    "vit_5b",
    "vlm_batches",
    "vlm_l",
    "vlm_m",
    "vlm_s",
]
