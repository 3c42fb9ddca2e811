"""Reference vision-language model (LLaVA-like): ViT encoder + MLP projector + causal LLM.

This is the VLM of DIP (PAPER.md §3.1): Table 3's VLM-S/M/L combine a Qwen2-VL-style ViT (Table 2: ViT 5B, ViT 22B)
with an LLM backbone (Llama3 8B, Qwen2 32B, Qwen2 72B). Images are resized to one size (728 px in the paper) and cut
into patches (14 px); a spatial merge of ``m x m`` neighbouring patches (m = 4 in the paper) gives
``tokens_per_image = (image_size // patch_size // m) ** 2`` (169 in the paper) features per image, which replace
the same number of ``image_token_id`` placeholder tokens in the text sequence (PAPER.md §1.2, §3.2).

Module tree (the names are a contract with the compiler's modality rules)::

    ReferenceVLM
      vision_tower            VisionTower: patch_embed (Conv2d, stride = patch), pos_embed, layers[i], norm
      multi_modal_projector   VLMProjector: (spatial merge) linear_1, act (GELU), linear_2
      language_model          TextTransformer (causal): embed_tokens, rotary_emb, layers[i], norm
      lm_head                 Linear(text dim, vocab, bias=False), optionally tied to embed_tokens

The whole forward, loss included, is traceable by ``torch.export.export(model, (), batch, strict=False)`` with the
batch size ``B``, the sequence length ``S`` and the number of images ``N`` all dynamic: no tensor size or value is
ever turned into a Python int and nothing branches on ``N == 0``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .language import TextConfig, TextTransformer, init_weights, normal_init_

__all__ = [
    "VisionConfig",
    "VLMConfig",
    "VisionAttention",
    "VisionMLP",
    "VisionBlock",
    "VisionTower",
    "VLMProjector",
    "ReferenceVLM",
    "scatter_image_features",
]


@dataclass
class VisionConfig:
    """Size of the ViT (one row of PAPER.md Table 2, plus the image geometry of §3.2).

    Attributes:
        image_size: square input resolution in pixels (728 in the paper).
        patch_size: patch side in pixels (14 in the paper); ``image_size % patch_size == 0``.
        dim: ViT width.
        n_layers: number of ViT blocks.
        n_heads: attention heads (the ViTs of Table 2 use plain MHA).
        ffn_dim: GELU MLP hidden width.
        spatial_merge_size: ``m``; ``m x m`` neighbouring patch features are concatenated into one image token
            by the projector (Qwen2-VL's patch merger). 1 = no merge.
        norm_eps: LayerNorm epsilon.
    """

    image_size: int = 16
    patch_size: int = 8
    dim: int = 32
    n_layers: int = 4
    n_heads: int = 2
    ffn_dim: int = 64
    spatial_merge_size: int = 1
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        if self.grid_size % self.spatial_merge_size:
            raise ValueError(f"patch grid {self.grid_size} is not a multiple of merge {self.spatial_merge_size}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")

    @property
    def grid_size(self) -> int:
        """Patches per image side: ``image_size // patch_size``."""
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        """Patches per image (ViT sequence length): ``grid_size ** 2``."""
        return self.grid_size**2

    @property
    def tokens_per_image(self) -> int:
        """Image tokens per image in the LLM sequence: ``(grid_size // spatial_merge_size) ** 2``."""
        return (self.grid_size // self.spatial_merge_size) ** 2


@dataclass
class VLMConfig:
    """Configuration of :class:`ReferenceVLM`.

    Attributes:
        vision: the ViT (:class:`VisionConfig`).
        text: the LLM (:class:`~dipc.models.language.TextConfig`).
        image_token_id: placeholder token id for one image token; must be inside the vocabulary.
        pad_token_id: token id used for right padding by the data generators (its label is -100).
        bos_token_id: token id the data generators start every sequence with.
        eos_token_id: token id the data generators end every sequence with (a real target, so every sequence has
            at least one non-ignored label).
        tie_word_embeddings: if True, ``lm_head.weight`` is the same Parameter as
            ``language_model.embed_tokens.weight``.

    Derived (read-only): ``tokens_per_image``, ``vocab_size``, ``image_size``.
    """

    vision: VisionConfig = field(default_factory=VisionConfig)
    text: TextConfig = field(default_factory=TextConfig)
    image_token_id: int = 127
    pad_token_id: int = 0
    bos_token_id: int = 1
    eos_token_id: int = 2
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        special = {"image_token_id": self.image_token_id, "pad_token_id": self.pad_token_id,
                   "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id}
        for name, value in special.items():
            if not 0 <= value < self.text.vocab_size:
                raise ValueError(f"{name}={value} is outside the vocabulary [0, {self.text.vocab_size})")
        if len(set(special.values())) != len(special):
            raise ValueError(f"special token ids must differ: {special}")

    @property
    def tokens_per_image(self) -> int:
        """Placeholder tokens (and projected features) per image."""
        return self.vision.tokens_per_image

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @property
    def image_size(self) -> int:
        return self.vision.image_size

    @classmethod
    def tiny(cls, tie_word_embeddings: bool = False) -> "VLMConfig":
        """Test size: 16 px images, 8 px patches (4 tokens/image), ViT 32-wide x 4 layers, LLM 32-wide x 4 layers
        with 4 query / 2 kv heads, vocabulary 128, image token 127. Forward+backward takes milliseconds on CPU."""
        return cls(
            vision=VisionConfig(image_size=16, patch_size=8, dim=32, n_layers=4, n_heads=2, ffn_dim=64),
            text=TextConfig(vocab_size=128, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64),
            image_token_id=127,
            tie_word_embeddings=tie_word_embeddings,
        )


class VisionAttention(nn.Module):
    """Bidirectional multi-head self-attention (no mask, no position encoding; ``pos_embed`` is added once).

    Submodules ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` (all with bias). ``[N, T, Dv] -> [N, T, Dv]``.
    """

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:  # [N, T, Dv] -> [N, heads, T, Dv/heads]
            return y.view(n, t, self.n_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)))
        return self.out_proj(out.transpose(1, 2).reshape(n, t, d))


class VisionMLP(nn.Module):
    """``fc2(gelu(fc1(x)))``: ``[..., Dv] -> [..., Dv]`` via the ViT's ``ffn_dim``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    """Pre-norm ViT block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))`` (LayerNorm). ``[N, T, Dv]``."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.attn = VisionAttention(config.dim, config.n_heads)
        self.norm2 = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.mlp = VisionMLP(config.dim, config.ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTower(nn.Module):
    """ViT image encoder.

    Submodules: ``patch_embed`` (``Conv2d(3, Dv, kernel=stride=patch_size)``), ``pos_embed`` (learned Parameter
    ``[1, P, Dv]`` with ``P = num_patches``), ``layers`` (``nn.ModuleList`` of :class:`VisionBlock`), ``norm``
    (LayerNorm).

    Shapes: ``pixel_values [N, 3, image_size, image_size]`` -> patch features ``[N, P, Dv]`` in row-major patch
    order. ``N`` may be 0.
    """

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = nn.Conv2d(3, config.dim, kernel_size=config.patch_size, stride=config.patch_size)
        self.pos_embed = nn.Parameter(torch.zeros(1, config.num_patches, config.dim))
        self.layers = nn.ModuleList(VisionBlock(config) for _ in range(config.n_layers))
        self.norm = nn.LayerNorm(config.dim, eps=config.norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(pixel_values)  # [N, Dv, g, g]
        x = x.flatten(2).transpose(1, 2)  # [N, P, Dv]
        x = x + self.pos_embed
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class VLMProjector(nn.Module):
    """Vision-to-text adapter: optional ``m x m`` spatial merge, then ``linear_2(gelu(linear_1(x)))``.

    The merge concatenates the features of each ``m x m`` block of neighbouring patches (Qwen2-VL's patch merger;
    PAPER.md §3.2 uses m = 4 to get 169 tokens from a 52 x 52 patch grid). It is a pure reshape/permute with
    static sizes except ``N``.

    Shapes: ``[N, P, Dv]`` -> ``[N, tokens_per_image, Dt]``, where ``P = g*g`` and
    ``tokens_per_image = (g/m)**2``.
    """

    def __init__(self, vision: VisionConfig, text_dim: int) -> None:
        super().__init__()
        self.grid_size = vision.grid_size
        self.merge = vision.spatial_merge_size
        in_dim = vision.dim * self.merge**2
        self.linear_1 = nn.Linear(in_dim, text_dim)
        self.act = nn.GELU()
        self.linear_2 = nn.Linear(text_dim, text_dim)

    def spatial_merge(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, g*g, Dv]`` -> ``[N, (g/m)**2, m*m*Dv]`` (row-major over merged blocks)."""
        m = self.merge
        if m == 1:  # static: depends on the config only
            return x
        n, _, d = x.shape
        g = self.grid_size
        x = x.reshape(n, g // m, m, g // m, m, d).permute(0, 1, 3, 2, 4, 5)
        return x.reshape(n, (g // m) ** 2, m * m * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.spatial_merge(x))))


def scatter_image_features(
    inputs_embeds: torch.Tensor, image_mask: torch.Tensor, image_features: torch.Tensor
) -> torch.Tensor:
    """Put image features at the image-placeholder positions of the text embeddings.

    The k-th placeholder in row-major (batch, seq) order receives row k of ``image_features``; other positions keep
    their text embedding. Implemented as a gather: ``index = cumsum(mask) - 1`` selects the feature row for each
    placeholder, and ``torch.where`` keeps the text embedding elsewhere. A zero row is appended to the features so
    the gather is valid when there are no images (``N = 0``; non-placeholder positions point at that row).
    Every size involved is symbolic (``B``, ``S``, ``N``) and, unlike ``masked_scatter``, the backward
    (an index_put/scatter-add into ``[N*T + 1, D]``) has no data-dependent output size either.

    Args:
        inputs_embeds: ``[B, S, D]`` text embeddings.
        image_mask: ``[B, S]`` bool, True at placeholder positions; must contain exactly ``N*T`` True values.
        image_features: ``[N, T, D]`` (or ``[N*T, D]``) projected image features, image-major.

    Returns:
        ``[B, S, D]``.
    """
    d = inputs_embeds.shape[-1]
    feats = image_features.reshape(-1, d).to(inputs_embeds.dtype)  # [N*T, D]
    feats = torch.cat([feats, feats.new_zeros(1, d)], dim=0)  # [N*T + 1, D]; last row = "no image"
    flat_mask = image_mask.reshape(-1)  # [B*S]
    order = torch.cumsum(flat_mask.long(), dim=0) - 1  # k for the k-th placeholder
    index = torch.where(flat_mask, order, torch.full_like(order, -1))  # -1 -> the appended zero row
    gathered = feats[index].view_as(inputs_embeds)  # [B, S, D]
    return torch.where(image_mask.unsqueeze(-1), gathered, inputs_embeds)


class ReferenceVLM(nn.Module):
    """LLaVA-like VLM with a next-token cross-entropy loss (PAPER.md §3.1, VLM rows of Tables 2-3).

    Args:
        config: :class:`VLMConfig`.

    Call ``model(input_ids, pixel_values, labels)`` (or ``model(**batch)``) to get the loss.
    """

    def __init__(self, config: VLMConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = VisionTower(config.vision)
        self.multi_modal_projector = VLMProjector(config.vision, config.text.dim)
        self.language_model = TextTransformer(config.text, causal=True)
        self.lm_head = nn.Linear(config.text.dim, config.text.vocab_size, bias=False)
        self.apply(init_weights)
        normal_init_(self.vision_tower.pos_embed, 0.02)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.language_model.embed_tokens.weight

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, 3, H, W]`` -> projected features ``[N, tokens_per_image, Dt]``."""
        return self.multi_modal_projector(self.vision_tower(pixel_values))

    def _check_placeholders(self, image_mask: torch.Tensor, n_features: int) -> None:
        # Eager-only sanity check (needs a device sync); skipped while torch.export / torch.compile trace.
        if torch.compiler.is_compiling():
            return
        n_placeholders = int(image_mask.sum())
        if n_placeholders != n_features:
            raise ValueError(
                f"input_ids hold {n_placeholders} image tokens (id {self.config.image_token_id}) but pixel_values "
                f"give {n_features} features ({self.config.tokens_per_image} per image)"
            )

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Token-mean next-token cross-entropy.

        Args:
            input_ids: ``[B, S]`` int64. Holds exactly ``N * tokens_per_image`` tokens equal to
                ``config.image_token_id``; the k-th image's features fill placeholders
                ``k*T .. (k+1)*T - 1`` in row-major (batch, seq) order.
            pixel_values: ``[N, 3, image_size, image_size]`` float; ``N`` may be 0.
            labels: ``[B, S]`` int64; -100 = ignored (padding, image placeholders).

        Returns:
            0-dim loss: ``cross_entropy(logits[:, :-1], labels[:, 1:], ignore_index=-100)``, mean over the
            non-ignored tokens of the whole batch.
        """
        image_mask = input_ids == self.config.image_token_id  # [B, S]
        features = self.image_features(pixel_values)  # [N, T, Dt]
        self._check_placeholders(image_mask, features.shape[0] * features.shape[1])
        inputs_embeds = self.language_model.embed_tokens(input_ids)  # [B, S, Dt]
        inputs_embeds = scatter_image_features(inputs_embeds, image_mask, features)
        hidden = self.language_model(inputs_embeds=inputs_embeds)  # [B, S, Dt]
        logits = self.lm_head(hidden)  # [B, S, V]
        # Next-token targets: position s predicts labels[:, s + 1]; the last position gets -100 (ignored). Same
        # loss as logits[:, :-1] vs labels[:, 1:], but no tensor of length S - 1 is made: slicing adds an
        # export guard S - 1 != 1 (i.e. S >= 3), which a user-given Dim("seq") with min 2 would violate.
        positions = torch.arange(labels.shape[1], device=labels.device)
        targets = torch.roll(labels, shifts=-1, dims=1)  # [B, S]; the last column wrapped around
        targets = targets.masked_fill(positions == labels.shape[1] - 1, -100)
        return F.cross_entropy(
            logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="mean"
        )
