"""Language-model building blocks shared by the reference models.

A Llama/Qwen2-style transformer: RMSNorm, self-attention with grouped-query attention (GQA) and rotary position
embedding (RoPE), SwiGLU MLP. The same :class:`TextTransformer` is

* the LLM backbone of :class:`dipc.models.ReferenceVLM` (causal, ``language_model``), and
* the text encoder of :class:`dipc.models.ReferenceT2V` (bidirectional with a key-padding mask, ``text_encoder``).

The component sizes follow DIP (PAPER.md §3.1, Table 2: Llama3 8B, Qwen2 32B, Qwen2 72B); see
:mod:`dipc.models.configs`.

Export contract: nothing here turns a tensor size or value into a Python int. The batch size ``B`` and the sequence
length ``S`` stay symbolic under ``torch.export.export(..., strict=False)``.

Shape letters used in the docstrings: ``B`` batch, ``S`` sequence length, ``D`` model width, ``H`` query heads,
``Hkv`` key/value heads, ``Dh`` head width (``D // H``), ``F`` MLP hidden width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "TextConfig",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rotary",
    "TextAttention",
    "SwiGLU",
    "TextBlock",
    "TextTransformer",
    "init_weights",
    "normal_init_",
]


@dataclass
class TextConfig:
    """Size of a Llama/Qwen2-style transformer (one row of PAPER.md Table 2).

    Attributes:
        vocab_size: number of token ids (Llama3: 128256, Qwen2: 152064).
        dim: model width D.
        n_layers: number of transformer blocks.
        n_heads: query heads H; ``dim % n_heads == 0``.
        n_kv_heads: key/value heads (GQA groups); ``n_heads % n_kv_heads == 0``. Equal to ``n_heads`` is plain MHA.
        ffn_dim: SwiGLU hidden width F.
        rope_theta: RoPE base frequency.
        norm_eps: RMSNorm epsilon.
        attention_bias: bias on the q/k/v projections (Qwen2 has it, Llama does not).
    """

    vocab_size: int = 128
    dim: int = 32
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    attention_bias: bool = False

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError("RoPE needs an even head width")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def normal_init_(tensor: torch.Tensor, std: float = 0.02) -> None:
    """``nn.init.normal_(tensor, 0, std)``, skipped for meta tensors (nothing to fill; on meta ``normal_`` runs a
    slow Python reference implementation, which would make building the paper-size models take seconds)."""
    if not tensor.is_meta:
        nn.init.normal_(tensor, mean=0.0, std=std)


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """GPT-style init used by all reference models: Linear/Embedding/Conv weights ~ N(0, std), biases 0.

    Norm layers keep their default (weight 1, bias 0). Meant for ``model.apply(init_weights)``; does nothing on
    the meta device.
    """
    if isinstance(module, (nn.Linear, nn.Conv2d, nn.Conv3d)):
        normal_init_(module.weight, std)
        if module.bias is not None and not module.bias.is_meta:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        normal_init_(module.weight, std)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (no mean subtraction, no bias): ``x / rms(x) * weight``.

    Shapes: ``x`` ``[..., D]`` -> ``[..., D]``.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding table (RoPE, Su et al.).

    Holds ``inv_freq`` ``[Dh/2]`` as a *non-persistent* buffer (it is derived from the config, so it is not in the
    state dict). :meth:`forward` builds the cos/sin table for positions ``0..S-1``; the owning
    :class:`TextTransformer` calls it once per forward and hands the same table to every layer.

    Note: a model built on the meta device has a meta ``inv_freq``; call :meth:`reset_inv_freq` after
    ``to_empty()`` to recompute it.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        # Computed on the CPU and moved to the default device (meta inside build_on_meta): torch.arange on the meta
        # device would run a slow Python reference implementation.
        inv_freq = self._compute_inv_freq(torch.device("cpu")).to(torch.get_default_device())
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _compute_inv_freq(self, device: torch.device | None = None) -> torch.Tensor:
        """``[Dh/2]``: ``theta ** (-2i / Dh)`` for ``i = 0 .. Dh/2 - 1``."""
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        return 1.0 / (self.theta**exponent)

    @torch.no_grad()
    def reset_inv_freq(self) -> None:
        """Recompute ``inv_freq`` in place (e.g. after ``model.to_empty(device=...)``)."""
        self.inv_freq.copy_(self._compute_inv_freq(torch.device("cpu")))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Build the table for a sequence.

        Args:
            x: any tensor ``[B, S, ...]``; only its sequence length ``S`` (symbolic under export), device and dtype
                are used.

        Returns:
            ``(cos, sin)``, each ``[S, Dh]`` in ``x.dtype``.
        """
        seq_len = x.shape[1]
        positions = torch.arange(seq_len, device=x.device, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq)  # [S, Dh/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [S, Dh]
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, heads, S, Dh]`` by the table ``cos``/``sin`` ``[S, Dh]``; returns ``[B, heads, S, Dh]``."""
    return x * cos + _rotate_half(x) * sin


class TextAttention(nn.Module):
    """Multi-head self-attention with GQA and RoPE, computed by ``F.scaled_dot_product_attention``.

    Submodules: ``q_proj`` ``[D -> H*Dh]``, ``k_proj``/``v_proj`` ``[D -> Hkv*Dh]``, ``o_proj`` ``[H*Dh -> D]``.
    The ``Hkv`` key/value heads are repeated ``H / Hkv`` times (expand + reshape, no data-dependent sizes).
    """

    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def _repeat_kv(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv, S, Dh]`` -> ``[B, H, S, Dh]`` (each kv head serves ``H / Hkv`` consecutive query heads)."""
        n_rep = self.n_heads // self.n_kv_heads
        if n_rep == 1:  # static: depends on the config only
            return x
        b, hkv, s, d = x.shape
        return x[:, :, None].expand(b, hkv, n_rep, s, d).reshape(b, hkv * n_rep, s, d)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        causal: bool,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """
        Args:
            x: ``[B, S, D]``.
            cos, sin: RoPE table ``[S, Dh]`` (shared by all layers).
            causal: causal (decoder) or bidirectional (encoder) attention. A Python bool fixed by the module.
            attn_mask: optional boolean key mask broadcastable to ``[B, H, S, S]`` (True = attend); only for
                ``causal=False``.

        Returns:
            ``[B, S, D]``.
        """
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        k, v = self._repeat_kv(k), self._repeat_kv(v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal)  # [B, H, S, Dh]
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))


class SwiGLU(nn.Module):
    """SwiGLU MLP: ``down_proj(silu(gate_proj(x)) * up_proj(x))``; ``[..., D] -> [..., D]`` via width ``F``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TextBlock(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    Submodules: ``input_layernorm``, ``self_attn`` (:class:`TextAttention`), ``post_attention_layernorm``,
    ``mlp`` (:class:`SwiGLU`). Shapes ``[B, S, D] -> [B, S, D]``.
    """

    def __init__(self, config: TextConfig, causal: bool) -> None:
        super().__init__()
        self.causal = causal
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.self_attn = TextAttention(config)
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = SwiGLU(config.dim, config.ffn_dim)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, self.causal, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class TextTransformer(nn.Module):
    """Token embedding + a stack of :class:`TextBlock` + final RMSNorm.

    Used as the VLM's ``language_model`` (``causal=True``: decoder, no padding mask needed because padding is on
    the right and causal attention never looks right) and as the T2V ``text_encoder`` (``causal=False``:
    bidirectional, with a key-padding mask).

    Submodules: ``embed_tokens`` (``nn.Embedding(vocab, D)``), ``rotary_emb`` (:class:`RotaryEmbedding`),
    ``layers`` (``nn.ModuleList`` of :class:`TextBlock`), ``norm`` (:class:`RMSNorm`).

    The RoPE cos/sin table is built once per :meth:`forward` and every layer reads that same table.
    """

    def __init__(self, config: TextConfig, causal: bool = True) -> None:
        super().__init__()
        self.config = config
        self.causal = causal
        # Pass the (uninitialised) weight in: nn.Embedding's own N(0, 1) init would run the slow Python
        # reference of normal_ on the meta device. The owner model initialises it with init_weights.
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.dim, _weight=torch.empty(config.vocab_size, config.dim)
        )
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)
        self.layers = nn.ModuleList(TextBlock(config, causal) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """
        Args:
            input_ids: ``[B, S]`` int64, or None when ``inputs_embeds`` is given.
            inputs_embeds: ``[B, S, D]`` (e.g. text embeddings with image features scattered in), or None.
            attention_mask: optional ``[B, S]`` bool/int, 1 = real token, 0 = padding. Only for the bidirectional
                encoder (``causal=False``); it masks padded *keys*.

        Returns:
            hidden states ``[B, S, D]`` after the final norm.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        key_mask = None
        if attention_mask is not None:
            if self.causal:
                raise ValueError("the causal language model takes no attention_mask (pad on the right)")
            key_mask = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, S]
        cos, sin = self.rotary_emb(inputs_embeds)  # built once, shared by all layers
        x = inputs_embeds
        for layer in self.layers:
            x = layer(x, cos, sin, key_mask)
        return self.norm(x)
