"""Reference text-to-image/video diffusion model: LM text encoder + MovieGen-style DiT, rectified-flow loss.

This is the T2V model of DIP (PAPER.md §3.1): Table 3's T2V-S/L combine an LLM used as the text encoder (Llama3 8B,
Qwen2 32B) with a DiT video decoder (Table 2: DiT 5B, DiT 30B, "MovieGen-style").

Module tree (names are a contract with the compiler's modality rules)::

    ReferenceT2V
      text_encoder   TextTransformer (bidirectional, key-padding mask): embed_tokens, rotary_emb, layers[i], norm
      transformer    DiT: patch_embed, pos_embed_{t,h,w}, time_embed, time_modulation, text_proj, blocks[i],
                     final_norm, final_scale_shift, proj_out

The DiT works on a latent video ``[B, C, F, H, W]`` (the output of a frozen autoencoder, which is not modelled).
It cuts the latent into ``pt x ph x pw`` patches (a Linear over each flattened patch), adds factorised learned
positional embeddings (time, height, width), and runs ``n_layers`` blocks of
``self-attention -> cross-attention to the text -> MLP``. The timestep conditions every block through adaLN
modulation (shift/scale/gate).

adaLN variant (document of a deliberate choice): we use the *shared* modulation of PixArt-alpha ("adaLN-single"):
one ``time_modulation`` MLP maps the timestep embedding to 6 x D values once per forward, and each block adds its own
learned ``scale_shift_table`` ``[6, D]``. A per-block ``Linear(D, 6D)`` (original DiT adaLN-zero) would add
``6 D^2`` parameters per block, i.e. 7.1B instead of 4.9B for the 5B DiT of Table 2, whereas the shared form keeps
both Table 2 DiTs within 2% of their nominal sizes. The shared modulation ``[B, 6D]`` is computed once and read by
every block, like the RoPE table of the LLM.

Initialisation: adaLN-*zero* initialises the gates (and the output projection) to zero so that every block starts as
the identity. Then the block weights get exactly zero gradient at step 0, which makes gradient checks of a pipeline
vacuous. We therefore initialise the ``scale_shift_table`` with N(0, 0.02) and ``time_modulation``/``proj_out`` with
the default N(0, 0.02) of :func:`~dipc.models.language.init_weights`, so all parameters get non-trivial gradients.

The forward, loss included, is traceable by ``torch.export.export(..., strict=False)`` with ``B`` (batch) and ``L``
(text length) dynamic; the latent sizes ``C, F, H, W`` are treated as static.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .language import TextConfig, TextTransformer, init_weights, normal_init_

__all__ = [
    "DiTConfig",
    "T2VConfig",
    "timestep_embedding",
    "TimestepEmbedding",
    "CrossAttention",
    "DiTMLP",
    "DiTBlock",
    "DiT",
    "ReferenceT2V",
]


@dataclass
class DiTConfig:
    """Size of the DiT (one row of PAPER.md Table 2) and the latent-video geometry.

    Attributes:
        dim: DiT width D.
        n_layers: number of DiT blocks.
        n_heads: attention heads (plain MHA in Table 2).
        ffn_dim: GELU MLP hidden width.
        in_channels: latent channels C.
        patch_size: ``(pt, ph, pw)`` latent patch; the latent ``F, H, W`` must be multiples of it.
        max_latent_size: ``(F, H, W)`` upper bounds for the factorised positional embeddings; also the latent
            shape the data generator uses (see :attr:`T2VConfig.latent_shape`).
        freq_dim: width of the sinusoidal timestep features.
        norm_eps: LayerNorm epsilon.
    """

    dim: int = 32
    n_layers: int = 2
    n_heads: int = 2
    ffn_dim: int = 64
    in_channels: int = 4
    patch_size: tuple[int, int, int] = (1, 2, 2)
    max_latent_size: tuple[int, int, int] = (2, 4, 4)
    freq_dim: int = 32
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        self.patch_size = tuple(self.patch_size)
        self.max_latent_size = tuple(self.max_latent_size)
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        for size, patch in zip(self.max_latent_size, self.patch_size):
            if size % patch:
                raise ValueError(f"max_latent_size {self.max_latent_size} is not a multiple of {self.patch_size}")

    @property
    def patch_volume(self) -> int:
        pt, ph, pw = self.patch_size
        return pt * ph * pw


@dataclass
class T2VConfig:
    """Configuration of :class:`ReferenceT2V`.

    Attributes:
        text: the text encoder (:class:`~dipc.models.language.TextConfig`; its ``n_kv_heads`` etc. as in the LM).
        dit: the DiT (:class:`DiTConfig`).
        pad_token_id: padding id of the captions; padded keys are masked in the encoder and the cross-attention.
        bos_token_id: first token of every caption in the generated data.
        max_text_len: longest caption the data generator produces.

    Derived: ``latent_shape`` = ``(C, F, H, W)`` used by the data generator; ``vocab_size``.
    """

    text: TextConfig = field(default_factory=TextConfig)
    dit: DiTConfig = field(default_factory=DiTConfig)
    pad_token_id: int = 0
    bos_token_id: int = 1
    max_text_len: int = 32

    def __post_init__(self) -> None:
        for name in ("pad_token_id", "bos_token_id"):
            if not 0 <= getattr(self, name) < self.text.vocab_size:
                raise ValueError(f"{name} is outside the vocabulary")
        if self.pad_token_id == self.bos_token_id:
            raise ValueError("pad_token_id and bos_token_id must differ")

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        return (self.dit.in_channels, *self.dit.max_latent_size)

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @classmethod
    def tiny(cls) -> "T2VConfig":
        """Test size: text encoder 32-wide x 2 layers (vocab 128), DiT 32-wide x 2 blocks, latent
        ``[4, 2, 4, 4]`` with patch ``(1, 2, 2)`` -> 8 video tokens, captions up to 32 tokens."""
        return cls(
            text=TextConfig(vocab_size=128, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64),
            dit=DiTConfig(dim=32, n_layers=2, n_heads=2, ffn_dim=64, in_channels=4, patch_size=(1, 2, 2),
                          max_latent_size=(2, 4, 4), freq_dim=32),
            max_text_len=32,
        )


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0, scale: float = 1000.0) -> torch.Tensor:
    """Sinusoidal features of the diffusion time.

    Args:
        t: ``[B]`` float in (0, 1); multiplied by ``scale`` (1000) so the frequencies match the usual DDPM range.
        dim: even feature width.

    Returns:
        ``[B, dim]`` = ``[cos(t*w_0..), sin(t*w_0..)]``.
    """
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = (t.float() * scale)[:, None] * freqs[None]  # [B, dim/2]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TimestepEmbedding(nn.Module):
    """``linear_2(silu(linear_1(sinusoid(t))))``: ``[B]`` -> ``[B, D]``."""

    def __init__(self, freq_dim: int, dim: int) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.linear_1 = nn.Linear(freq_dim, dim)
        self.act = nn.SiLU()
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        # the sinusoid in fp32, then the module's dtype (a bf16 model stays bf16)
        emb = timestep_embedding(t, self.freq_dim).to(self.linear_1.weight.dtype)
        return self.linear_2(self.act(self.linear_1(emb)))


class CrossAttention(nn.Module):
    """Multi-head attention from queries ``x [B, Tq, D]`` to a context ``[B, Tk, D]``.

    Used for self-attention (context = x) and text cross-attention (context = projected text states with a
    key-padding mask). Submodules ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``. Returns ``[B, Tq, D]``.
    """

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, context: torch.Tensor, key_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``key_mask``: optional bool broadcastable to ``[B, heads, Tq, Tk]`` (True = attend)."""
        b, tq, d = x.shape
        tk = context.shape[1]
        q = self.q_proj(x).view(b, tq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(context).view(b, tk, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(context).view(b, tk, self.n_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        return self.out_proj(out.transpose(1, 2).reshape(b, tq, d))


class DiTMLP(nn.Module):
    """``fc2(gelu_tanh(fc1(x)))``: ``[..., D] -> [..., D]`` via ``ffn_dim``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN: ``x * (1 + scale) + shift`` with ``x [B, T, D]`` and ``shift``/``scale`` ``[B, 1, D]``."""
    return x * (1 + scale) + shift


class DiTBlock(nn.Module):
    """One DiT block with adaLN modulation (shared-modulation form, see the module docstring).

    ``x = x + gate_msa * self_attn(modulate(norm1(x), shift_msa, scale_msa))``
    ``x = x + cross_attn(norm_cross(x), text)``
    ``x = x + gate_mlp * mlp(modulate(norm2(x), shift_mlp, scale_mlp))``

    where ``(shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp) = scale_shift_table + modulation``.

    Shapes: ``x [B, T, D]``, ``modulation [B, 6, D]``, ``text [B, L, D]``, ``text_mask [B, 1, 1, L]`` bool.
    """

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        d = config.dim
        self.norm1 = nn.LayerNorm(d, eps=config.norm_eps, elementwise_affine=False)
        self.self_attn = CrossAttention(d, config.n_heads)
        self.norm_cross = nn.LayerNorm(d, eps=config.norm_eps)
        self.cross_attn = CrossAttention(d, config.n_heads)
        self.norm2 = nn.LayerNorm(d, eps=config.norm_eps, elementwise_affine=False)
        self.mlp = DiTMLP(d, config.ffn_dim)
        self.scale_shift_table = nn.Parameter(torch.zeros(6, d))

    def forward(
        self, x: torch.Tensor, modulation: torch.Tensor, text: torch.Tensor, text_mask: torch.Tensor
    ) -> torch.Tensor:
        mod = self.scale_shift_table[None] + modulation  # [B, 6, D]
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mod.chunk(6, dim=1)  # each [B, 1, D]
        h = _modulate(self.norm1(x), shift_msa, scale_msa)
        x = x + gate_msa * self.self_attn(h, h)
        x = x + self.cross_attn(self.norm_cross(x), text, text_mask)
        h = _modulate(self.norm2(x), shift_mlp, scale_mlp)
        return x + gate_mlp * self.mlp(h)


class DiT(nn.Module):
    """MovieGen-style diffusion transformer on latent video, conditioned on text states and the timestep.

    Submodules: ``patch_embed`` (Linear over a flattened ``C*pt*ph*pw`` patch), ``pos_embed_t/h/w`` (factorised
    learned positions, summed), ``time_embed`` (:class:`TimestepEmbedding`), ``time_modulation`` (SiLU + Linear
    ``D -> 6D``, shared by all blocks), ``text_proj`` (Linear text width -> D), ``blocks`` (``nn.ModuleList`` of
    :class:`DiTBlock`), ``final_norm`` + ``final_scale_shift`` (final adaLN, Parameter ``[2, D]``), ``proj_out``
    (Linear ``D -> C*pt*ph*pw``).
    """

    def __init__(self, config: DiTConfig, text_dim: int) -> None:
        super().__init__()
        self.config = config
        d = config.dim
        c = config.in_channels
        pt, ph, pw = config.patch_size
        ft, fh, fw = config.max_latent_size
        self.patch_embed = nn.Linear(c * config.patch_volume, d)
        self.pos_embed_t = nn.Parameter(torch.zeros(ft // pt, d))
        self.pos_embed_h = nn.Parameter(torch.zeros(fh // ph, d))
        self.pos_embed_w = nn.Parameter(torch.zeros(fw // pw, d))
        self.time_embed = TimestepEmbedding(config.freq_dim, d)
        self.time_modulation = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        self.text_proj = nn.Linear(text_dim, d)
        self.blocks = nn.ModuleList(DiTBlock(config) for _ in range(config.n_layers))
        self.final_norm = nn.LayerNorm(d, eps=config.norm_eps, elementwise_affine=False)
        self.final_scale_shift = nn.Parameter(torch.zeros(2, d))
        self.proj_out = nn.Linear(d, c * config.patch_volume)

    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, C, F, H, W]`` -> ``[B, (F/pt)(H/ph)(W/pw), C*pt*ph*pw]`` (tokens in t, h, w row-major order).

        Raises:
            RuntimeError: ``F``, ``H`` or ``W`` not divisible by the patch size (``torch._check``).
        """
        b, c, f, h, w = x.shape
        pt, ph, pw = self.config.patch_size
        # the latent must tile into patches; stated as checks, torch.export's shape reasoning gets them as facts
        # instead of deriving them from the reshape (about 1.5 s less per capture of a dynamic latent size)
        torch._check(f % pt == 0, lambda: f"latent frames {f} not divisible by the patch size {pt}")
        torch._check(h % ph == 0, lambda: f"latent height {h} not divisible by the patch size {ph}")
        torch._check(w % pw == 0, lambda: f"latent width {w} not divisible by the patch size {pw}")
        x = x.reshape(b, c, f // pt, pt, h // ph, ph, w // pw, pw)
        x = x.permute(0, 2, 4, 6, 1, 3, 5, 7)  # [B, F', H', W', C, pt, ph, pw]
        return x.reshape(b, (f // pt) * (h // ph) * (w // pw), c * pt * ph * pw)

    def unpatchify(self, x: torch.Tensor, latent_shape: torch.Size) -> torch.Tensor:
        """Inverse of :meth:`patchify`: ``[B, T, C*pt*ph*pw]`` -> ``[B, C, F, H, W]``."""
        b = x.shape[0]
        _, c, f, h, w = latent_shape
        pt, ph, pw = self.config.patch_size
        x = x.reshape(b, f // pt, h // ph, w // pw, c, pt, ph, pw)
        x = x.permute(0, 4, 1, 5, 2, 6, 3, 7)  # [B, C, F', pt, H', ph, W', pw]
        return x.reshape(b, c, f, h, w)

    def positions(self, f: int, h: int, w: int) -> torch.Tensor:
        """Factorised positional embedding for a ``f x h x w`` token grid: ``[f*h*w, D]``."""
        pos = self.pos_embed_t[:f, None, None] + self.pos_embed_h[None, :h, None] + self.pos_embed_w[None, None, :w]
        return pos.reshape(f * h * w, -1)

    def forward(
        self, x_t: torch.Tensor, timesteps: torch.Tensor, text_states: torch.Tensor, text_mask: torch.Tensor
    ) -> torch.Tensor:
        """Predict the rectified-flow velocity.

        Args:
            x_t: noisy latent ``[B, C, F, H, W]``.
            timesteps: ``[B]`` float in (0, 1).
            text_states: text-encoder output ``[B, L, Dtext]``.
            text_mask: ``[B, L]`` bool, True = real caption token.

        Returns:
            velocity prediction ``[B, C, F, H, W]``.
        """
        _, _, f, h, w = x_t.shape
        pt, ph, pw = self.config.patch_size
        tokens = self.patch_embed(self.patchify(x_t))  # [B, T, D]
        tokens = tokens + self.positions(f // pt, h // ph, w // pw)
        t_emb = self.time_embed(timesteps)  # [B, D]
        modulation = self.time_modulation(t_emb).unflatten(-1, (6, -1))  # [B, 6, D], shared by all blocks
        text = self.text_proj(text_states)  # [B, L, D]
        key_mask = text_mask[:, None, None, :]  # [B, 1, 1, L]
        for block in self.blocks:
            tokens = block(tokens, modulation, text, key_mask)
        shift, scale = (self.final_scale_shift[None] + t_emb[:, None]).chunk(2, dim=1)  # each [B, 1, D]
        out = self.proj_out(_modulate(self.final_norm(tokens), shift, scale))  # [B, T, C*pt*ph*pw]
        return self.unpatchify(out, x_t.shape)


class ReferenceT2V(nn.Module):
    """Text-to-video diffusion model with a rectified-flow (flow-matching) loss (PAPER.md §3.1, T2V rows).

    Args:
        config: :class:`T2VConfig`.

    Call ``model(input_ids, latents, noise, timesteps)`` (or ``model(**batch)``) to get the loss.
    """

    def __init__(self, config: T2VConfig) -> None:
        super().__init__()
        self.config = config
        self.text_encoder = TextTransformer(config.text, causal=False)
        self.transformer = DiT(config.dit, text_dim=config.text.dim)
        self.apply(init_weights)
        dit = self.transformer
        for p in (dit.pos_embed_t, dit.pos_embed_h, dit.pos_embed_w, dit.final_scale_shift):
            normal_init_(p, 0.02)
        for block in dit.blocks:
            normal_init_(block.scale_shift_table, 0.02)  # non-zero: see the module docstring

    def forward(
        self,
        input_ids: torch.Tensor,
        latents: torch.Tensor,
        noise: torch.Tensor,
        timesteps: torch.Tensor,
    ) -> torch.Tensor:
        """Rectified-flow loss.

        Args:
            input_ids: ``[B, L]`` int64 captions, right-padded with ``config.pad_token_id`` (padding is masked in
                the encoder and the cross-attention; every row needs at least one non-pad token).
            latents: ``[B, C, F, H, W]`` clean latent video.
            noise: ``[B, C, F, H, W]`` standard normal noise.
            timesteps: ``[B]`` float in (0, 1).

        Returns:
            0-dim loss ``mean((v_pred - (noise - latents))**2)`` with ``x_t = (1 - t) * latents + t * noise``.
        """
        text_mask = input_ids != self.config.pad_token_id  # [B, L]
        text_states = self.text_encoder(input_ids=input_ids, attention_mask=text_mask)  # [B, L, Dtext]
        t = timesteps.to(latents.dtype).view(-1, 1, 1, 1, 1)
        x_t = (1 - t) * latents + t * noise
        target = noise - latents
        pred = self.transformer(x_t, timesteps, text_states, text_mask)
        return F.mse_loss(pred.float(), target.float(), reduction="mean")
