"""Tiny Hugging Face / diffusers text-to-image models with their text encoders, as training modules for dipc.

Two wrappers whose ``forward(**batch)`` returns the scalar rectified-flow (flow-matching) training loss, the way the
diffusers training scripts (``examples/dreambooth/train_dreambooth_flux.py``, ``train_dreambooth_sd3.py``) compute
it.  The wrappers only *compose* unmodified modules - ``transformers`` text encoders and a ``diffusers`` transformer -
and compute the loss from their outputs; the prompt encoding follows the pipelines (``FluxPipeline.encode_prompt``,
``StableDiffusion3Pipeline.encode_prompt``) minus the tokenizers (batches carry token ids).  The VAE is not modelled:
batches carry latents.

* :class:`FluxT2I`: ``text_encoder`` (``CLIPTextModel``, pooled output -> ``pooled_projections``), ``text_encoder_2``
  (``T5EncoderModel``, last hidden state -> ``encoder_hidden_states``), ``transformer``
  (``FluxTransformer2DModel``: ``transformer_blocks`` = double-stream blocks, ``single_transformer_blocks`` =
  single-stream blocks).
* :class:`SD3T2I`: ``text_encoder`` (``CLIPTextModelWithProjection``, "CLIP-L"), ``text_encoder_2``
  (``CLIPTextModelWithProjection``, "CLIP-G"), ``text_encoder_3`` (``T5EncoderModel``), ``transformer``
  (``SD3Transformer2DModel``, ``transformer_blocks`` = MMDiT joint blocks).

Submodule names are the pipelines' (``FluxPipeline`` / ``StableDiffusion3Pipeline`` components), so module paths in
a captured graph read like the pipeline's.  Note for dipc's default modality rules: ``text_encoder`` and
``text_encoder_2`` are listed there, ``text_encoder_3`` is not.

**Everything is trained**: the text encoders keep ``requires_grad=True`` (the diffusers scripts freeze them by
default, ``--train_text_encoder`` trains CLIP), so a gradient check covers the encoders too.

Loss (both models), with ``t = timesteps`` in (0, 1) (the scripts' ``sigmas``; weighting scheme "none", i.e. all
weights 1, and no output preconditioning)::

    noisy  = (1 - t) * latents + t * noise
    target = noise - latents
    loss   = mean over samples of mean over elements of (pred - target)^2      # == the mean over all elements

Flux specifics (decisions, see :class:`FluxT2I`): latents are packed into 2x2 patches with
``FluxPipeline._pack_latents`` and the prediction unpacked with ``FluxPipeline._unpack_latents``;
``img_ids`` (``[H/2 * W/2, 3]``) and ``txt_ids`` (``[L_t5, 3]``, zeros) are **computed inside forward from shapes**,
as the pipeline/training script do (``FluxPipeline._prepare_latent_image_ids``); they may also be passed as batch
keys, but then they are tensors **without a batch dimension** (Flux's current API: 3-d ids are deprecated), which a
batch-splitting runtime sees as a per-sample key with a dim 0 that is not the batch.  The timestep is passed as
``t`` (Flux multiplies by 1000 inside); SD3 gets ``t * 1000`` (the scripts pass scheduler timesteps).  Guidance
embedding is **off** by default (``FLUX.1-schnell``-style); ``tiny_flux(guidance_embeds=True)`` builds the
``FLUX.1-dev``-style model, whose forward then passes ``guidance = full([B], guidance_scale)`` built from shapes.

All sizes below are **made up** (tiny test configs, random init, no weights are downloaded); only the structure
(which encoder feeds what, packing, ids, concatenations, loss) follows the real models.

``transformers`` / ``diffusers`` are imported inside the functions (they take seconds to import).

What these models exercise in a tracer/pipeliner (observed with torch 2.13, transformers 5.24, diffusers 0.42):

* in-place ops in the forward: ``FluxPipeline._prepare_latent_image_ids`` writes into slices of a fresh tensor
  (``ids[..., 1] = ...``: ``copy_`` nodes with no users in torch.export's training IR), and T5's relative-position
  bucketing does ``relative_buckets += ...`` (``add_``);
* torch.export specializes the latent channel count (both models) and, for Flux, the latent height and width
  (``_unpack_latents`` calls ``int()`` on them); batch size and text lengths stay symbolic;
* a modality whose module holds two encoders (CLIP + T5) or two block lists (Flux's double and single blocks);
* the example batch should use different CLIP and T5 lengths when the tool groups equal-shaped keys (the builders'
  defaults are equal: pass ``t5_len=7``, say).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["FluxT2I", "SD3T2I", "tiny_flux", "tiny_sd3", "flux_batch", "sd3_batch",
           "FLUX_TINY", "SD3_TINY"]

#: Tiny Flux sizes (made up).  CLIP: vocab 128 (bos 126, eos 127 = pad, as CLIP's tokenizer pads with eos), width
#: 32, 2 layers, 2 heads, 16 positions.  T5 (v1.1-style gated-gelu): vocab 128 (pad 0, eos 1), d_model 32, 2 layers,
#: 2 heads x 16, d_ff 64, 8 relative buckets.  Flux: latent channels 4 (packed 2x2 -> in_channels 16), 2 heads x 16
#: (inner 32), axes_dims_rope (4, 6, 6) (sum = head dim 16), joint_attention_dim = T5 d_model, pooled_projection_dim
#: = CLIP width, 2 double + 2 single blocks.  Latents 4 x 8 x 8 (16 image tokens), text lengths up to 8.
FLUX_TINY = dict(vocab=128, clip_width=32, clip_layers=2, clip_heads=2, clip_positions=16,
                 t5_width=32, t5_layers=2, t5_heads=2, t5_d_kv=16, t5_ff=64,
                 latent_channels=4, heads=2, head_dim=16, axes_dims_rope=(4, 6, 6), double_blocks=2,
                 single_blocks=2, latent_size=8, text_len=8)

#: Tiny SD3 sizes (made up).  CLIP-L: width 16, 2 layers, 2 heads, projection 16, quick_gelu.  CLIP-G: width 32,
#: 2 layers, 2 heads, projection 32, gelu.  Both vocab 128 (bos 126, eos 127 = pad), 16 positions.  T5: vocab 128,
#: d_model 64, 2 layers, 2 heads x 32, d_ff 128.  CLIP hidden states concatenated = 16 + 32 = 48, zero-padded to the
#: T5 width 64 = joint_attention_dim; pooled = 16 + 32 = 48 = pooled_projection_dim.  SD3 transformer: latent
#: channels 4, patch 2, 2 heads x 16 (inner 32 = caption_projection_dim), 2 joint blocks (the last one
#: ``context_pre_only``), sample_size 8, pos_embed_max_size 8.  Latents 4 x 8 x 8 (16 image tokens).
SD3_TINY = dict(vocab=128, clip_l_width=16, clip_g_width=32, clip_layers=2, clip_heads=2, clip_positions=16,
                t5_width=64, t5_layers=2, t5_heads=2, t5_d_kv=32, t5_ff=128,
                latent_channels=4, heads=2, head_dim=16, blocks=2, latent_size=8, text_len=8)


def _flow_matching_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The scripts' ``mean((w * (pred - target)^2).reshape(B, -1), 1).mean()`` with w = 1, in float32."""
    b = target.shape[0]
    return torch.mean(((pred.float() - target.float()) ** 2).reshape(b, -1), 1).mean()


# ------------------------------------------------------------------------------------------------------------ Flux
class FluxT2I(nn.Module):
    """Flux text-to-image training module: CLIP (pooled) + T5 (sequence) -> ``FluxTransformer2DModel``.

    Args:
        text_encoder: ``transformers.CLIPTextModel`` (its ``pooler_output`` [B, Dclip] is ``pooled_projections``).
        text_encoder_2: ``transformers.T5EncoderModel`` (its last hidden state [B, L_t5, Dt5] is
            ``encoder_hidden_states``).
        transformer: ``diffusers.FluxTransformer2DModel`` with ``in_channels = 4 * latent channels``.
        guidance_scale: used only when ``transformer.config.guidance_embeds`` (FLUX.1-dev style).
        vae_scale_factor: the pipeline's VAE factor (8), only to call ``FluxPipeline._unpack_latents`` as the
            training script does (it works in pixel sizes).

    Call ``model(clip_input_ids, t5_input_ids, latents, noise, timesteps)`` (or ``model(**flux_batch(...))``).
    """

    def __init__(self, text_encoder: nn.Module, text_encoder_2: nn.Module, transformer: nn.Module,
                 guidance_scale: float = 3.5, vae_scale_factor: int = 8) -> None:
        super().__init__()
        self.text_encoder = text_encoder
        self.text_encoder_2 = text_encoder_2
        self.transformer = transformer
        self.guidance_scale = float(guidance_scale)
        self.vae_scale_factor = int(vae_scale_factor)

    def forward(self, clip_input_ids: torch.Tensor, t5_input_ids: torch.Tensor, latents: torch.Tensor,
                noise: torch.Tensor, timesteps: torch.Tensor, img_ids: torch.Tensor | None = None,
                txt_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Rectified-flow loss.

        Args:
            clip_input_ids: ``[B, L_clip]`` int64 CLIP token ids, each row holding the eos id (CLIP pools the first
                eos position); no attention mask (the pipeline passes none).
            t5_input_ids: ``[B, L_t5]`` int64 T5 token ids (eos 1, pad 0); no attention mask (as the pipeline).
            latents: ``[B, C, H, W]`` clean VAE latents, H and W even.
            noise: ``[B, C, H, W]`` standard normal.
            timesteps: ``[B]`` float in (0, 1) (the scripts' sigmas; the transformer multiplies by 1000).
            img_ids: optional ``[H/2 * W/2, 3]`` float (**no batch dim**); default: computed here from the latent
                shape with ``FluxPipeline._prepare_latent_image_ids``.
            txt_ids: optional ``[L_t5, 3]`` float (**no batch dim**); default: zeros, as ``FluxPipeline``.

        Returns:
            0-dim float32 loss.
        """
        from diffusers import FluxPipeline

        pooled = self.text_encoder(clip_input_ids, output_hidden_states=False).pooler_output  # [B, Dclip]
        prompt_embeds = self.text_encoder_2(t5_input_ids, output_hidden_states=False)[0]  # [B, L_t5, Dt5]
        b, c, h, w = latents.shape
        dtype = latents.dtype
        if txt_ids is None:
            txt_ids = torch.zeros(prompt_embeds.shape[1], 3).to(device=latents.device, dtype=dtype)
        if img_ids is None:
            img_ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, latents.device, dtype)
        t = timesteps.to(dtype).view(-1, 1, 1, 1)
        noisy = (1.0 - t) * latents + t * noise
        packed = FluxPipeline._pack_latents(noisy, b, c, h, w)  # [B, H/2 * W/2, 4C]
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((b,), self.guidance_scale, device=latents.device, dtype=dtype)
        pred = self.transformer(hidden_states=packed, timestep=timesteps, guidance=guidance,
                                pooled_projections=pooled, encoder_hidden_states=prompt_embeds,
                                txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
        pred = FluxPipeline._unpack_latents(pred, height=h * self.vae_scale_factor, width=w * self.vae_scale_factor,
                                            vae_scale_factor=self.vae_scale_factor)  # [B, C, H, W]
        return _flow_matching_loss(pred, noise - latents)


def _clip_config(width: int, layers: int, heads: int, vocab: int, positions: int, act: str,
                 projection_dim: int | None = None):
    from transformers import CLIPTextConfig

    cfg = CLIPTextConfig(vocab_size=vocab, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                         num_attention_heads=heads, max_position_embeddings=positions, hidden_act=act,
                         projection_dim=projection_dim or width, attention_dropout=0.0, dropout=0.0,
                         bos_token_id=vocab - 2, eos_token_id=vocab - 1, pad_token_id=vocab - 1)
    cfg._attn_implementation = "sdpa"
    return cfg


def _t5_config(width: int, layers: int, heads: int, d_kv: int, ff: int, vocab: int):
    from transformers import T5Config

    cfg = T5Config(vocab_size=vocab, d_model=width, d_kv=d_kv, d_ff=ff, num_layers=layers, num_heads=heads,
                   relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
                   feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                   use_cache=False, is_encoder_decoder=False, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return cfg


def tiny_flux(seed: int = 0, guidance_embeds: bool = False, double_blocks: int | None = None,
              single_blocks: int | None = None) -> FluxT2I:
    """:class:`FluxT2I` with the :data:`FLUX_TINY` sizes (made up), float32, train mode, dropout 0, sdpa attention,
    random init seeded by ``seed`` (the global RNG is left as it was).  169,408 parameters with 2 + 2 blocks
    (CLIP 21,760, T5 24,752, transformer 122,896).  ``double_blocks`` / ``single_blocks`` override the block counts."""
    from diffusers import FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

    s = FLUX_TINY
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        clip = CLIPTextModel(_clip_config(s["clip_width"], s["clip_layers"], s["clip_heads"], s["vocab"],
                                          s["clip_positions"], "quick_gelu"))
        t5 = T5EncoderModel(_t5_config(s["t5_width"], s["t5_layers"], s["t5_heads"], s["t5_d_kv"], s["t5_ff"],
                                       s["vocab"]))
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=4 * s["latent_channels"], num_layers=s["double_blocks"] if double_blocks is None
            else double_blocks, num_single_layers=s["single_blocks"] if single_blocks is None else single_blocks,
            attention_head_dim=s["head_dim"], num_attention_heads=s["heads"], joint_attention_dim=s["t5_width"],
            pooled_projection_dim=s["clip_width"], guidance_embeds=guidance_embeds,
            axes_dims_rope=s["axes_dims_rope"])
        model = FluxT2I(clip, t5, transformer)
    model = model.float().train()
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def _clip_ids(g: torch.Generator, b: int, length: int, vocab: int) -> torch.Tensor:
    """CLIP-tokenizer-like ids ``[b, length]``: bos, random tokens, eos, then eos padding (each row >= 1 token)."""
    bos, eos = vocab - 2, vocab - 1
    ids = torch.full((b, length), eos, dtype=torch.long)
    ids[:, 0] = bos
    for i in range(b):
        n = int(torch.randint(1, length - 1, (1,), generator=g))  # real tokens
        ids[i, 1:1 + n] = torch.randint(2, vocab - 2, (n,), generator=g)
    return ids


def _t5_ids(g: torch.Generator, b: int, length: int, vocab: int) -> torch.Tensor:
    """T5-tokenizer-like ids ``[b, length]``: random tokens, eos (1), then padding (0)."""
    ids = torch.zeros((b, length), dtype=torch.long)
    for i in range(b):
        n = int(torch.randint(1, length, (1,), generator=g))
        ids[i, :n] = torch.randint(2, vocab, (n,), generator=g)
        ids[i, n] = 1
    return ids


def _latent_keys(g: torch.Generator, b: int, c: int, size: int) -> dict[str, torch.Tensor]:
    latents = torch.randn(b, c, size, size, generator=g)
    noise = torch.randn(b, c, size, size, generator=g)
    timesteps = torch.rand(b, generator=g) * 0.98 + 0.01  # in (0, 1)
    return {"latents": latents, "noise": noise, "timesteps": timesteps}


def flux_batch(batch_size: int, seed: int = 0, clip_len: int | None = None, t5_len: int | None = None,
               latent_size: int | None = None, with_ids: bool = False) -> dict[str, torch.Tensor]:
    """One :class:`FluxT2I` batch (sizes from :data:`FLUX_TINY` unless given).

    Keys and shapes (defaults: clip_len = t5_len = 8, latent 4 x 8 x 8)::

        clip_input_ids [B, clip_len] int64     bos 126, tokens in [2, 126), eos 127, eos padding
        t5_input_ids   [B, t5_len]   int64     tokens in [2, 128), eos 1, pad 0
        latents        [B, 4, S, S]  float32   N(0, 1)
        noise          [B, 4, S, S]  float32   N(0, 1)
        timesteps      [B]           float32   U(0.01, 0.99)
        (with_ids=True also) img_ids [S/2 * S/2, 3] float32 and txt_ids [t5_len, 3] float32 - no batch dim

    Seeded by ``seed`` with a private generator.
    """
    s = FLUX_TINY
    clip_len = clip_len or s["text_len"]
    t5_len = t5_len or s["text_len"]
    size = latent_size or s["latent_size"]
    g = torch.Generator().manual_seed(seed)
    batch = {"clip_input_ids": _clip_ids(g, batch_size, clip_len, s["vocab"]),
             "t5_input_ids": _t5_ids(g, batch_size, t5_len, s["vocab"]),
             **_latent_keys(g, batch_size, s["latent_channels"], size)}
    if with_ids:
        from diffusers import FluxPipeline

        batch["img_ids"] = FluxPipeline._prepare_latent_image_ids(batch_size, size // 2, size // 2, "cpu",
                                                                   torch.float32)
        batch["txt_ids"] = torch.zeros(t5_len, 3)
    return batch


# ------------------------------------------------------------------------------------------------------------- SD3
class SD3T2I(nn.Module):
    """Stable Diffusion 3 text-to-image training module: CLIP-L + CLIP-G + T5 -> ``SD3Transformer2DModel``.

    Prompt encoding as ``StableDiffusion3Pipeline.encode_prompt`` (``clip_skip=None``)::

        l = text_encoder(clip_l_ids, output_hidden_states=True);  g = text_encoder_2(clip_g_ids, ...)
        clip  = cat([l.hidden_states[-2], g.hidden_states[-2]], -1)          # [B, L_clip, Dl + Dg]
        clip  = pad(clip, (0, Dt5 - (Dl + Dg)))                              # [B, L_clip, Dt5]
        prompt_embeds = cat([clip, text_encoder_3(t5_ids)[0]], -2)           # [B, L_clip + L_t5, Dt5]
        pooled = cat([l.text_embeds, g.text_embeds], -1)                     # [B, Pl + Pg]

    Args:
        text_encoder, text_encoder_2: ``transformers.CLIPTextModelWithProjection`` (CLIP-L, CLIP-G).
        text_encoder_3: ``transformers.T5EncoderModel``.
        transformer: ``diffusers.SD3Transformer2DModel`` (``joint_attention_dim`` = T5 width,
            ``pooled_projection_dim`` = Pl + Pg).

    Call ``model(clip_l_input_ids, clip_g_input_ids, t5_input_ids, latents, noise, timesteps)``.
    """

    def __init__(self, text_encoder: nn.Module, text_encoder_2: nn.Module, text_encoder_3: nn.Module,
                 transformer: nn.Module) -> None:
        super().__init__()
        self.text_encoder = text_encoder
        self.text_encoder_2 = text_encoder_2
        self.text_encoder_3 = text_encoder_3
        self.transformer = transformer

    def forward(self, clip_l_input_ids: torch.Tensor, clip_g_input_ids: torch.Tensor, t5_input_ids: torch.Tensor,
                latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """Rectified-flow loss.

        Args:
            clip_l_input_ids, clip_g_input_ids: ``[B, L_clip]`` int64 (same length: they are concatenated along
                the width), each row holding the eos id; no attention mask (as the pipeline).
            t5_input_ids: ``[B, L_t5]`` int64.
            latents, noise: ``[B, C, H, W]`` (H, W multiples of the patch size 2).
            timesteps: ``[B]`` float in (0, 1) (sigmas); the transformer gets ``timesteps * 1000``.

        Returns:
            0-dim float32 loss.
        """
        out_l = self.text_encoder(clip_l_input_ids, output_hidden_states=True)
        out_g = self.text_encoder_2(clip_g_input_ids, output_hidden_states=True)
        clip_embeds = torch.cat([out_l.hidden_states[-2], out_g.hidden_states[-2]], dim=-1)
        t5_embeds = self.text_encoder_3(t5_input_ids)[0]
        clip_embeds = torch.nn.functional.pad(clip_embeds, (0, t5_embeds.shape[-1] - clip_embeds.shape[-1]))
        prompt_embeds = torch.cat([clip_embeds, t5_embeds], dim=-2)
        pooled = torch.cat([out_l[0], out_g[0]], dim=-1)  # text_embeds (projected pooled outputs)
        t = timesteps.to(latents.dtype).view(-1, 1, 1, 1)
        noisy = (1.0 - t) * latents + t * noise
        pred = self.transformer(hidden_states=noisy, timestep=timesteps * 1000, encoder_hidden_states=prompt_embeds,
                                pooled_projections=pooled, return_dict=False)[0]
        return _flow_matching_loss(pred, noise - latents)


def tiny_sd3(seed: int = 0, blocks: int | None = None) -> SD3T2I:
    """:class:`SD3T2I` with the :data:`SD3_TINY` sizes (made up), float32, train mode, dropout 0, sdpa attention,
    random init seeded by ``seed`` (the global RNG is left as it was).  199,456 parameters with 2 blocks (CLIP-L 7,040,
    CLIP-G 22,784, T5 90,448, transformer 79,184).

    Known zero gradient (real SD3 behaviour, not a bug): the last joint block is ``context_pre_only``, so its
    ``attn.add_q_proj`` (the text queries) feeds outputs that are discarded - its weight and bias get an all-zero
    (not ``None``) gradient."""
    from diffusers import SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection, T5EncoderModel

    s = SD3_TINY
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        clip_l = CLIPTextModelWithProjection(_clip_config(s["clip_l_width"], s["clip_layers"], s["clip_heads"],
                                                          s["vocab"], s["clip_positions"], "quick_gelu"))
        clip_g = CLIPTextModelWithProjection(_clip_config(s["clip_g_width"], s["clip_layers"], s["clip_heads"],
                                                          s["vocab"], s["clip_positions"], "gelu"))
        t5 = T5EncoderModel(_t5_config(s["t5_width"], s["t5_layers"], s["t5_heads"], s["t5_d_kv"], s["t5_ff"],
                                       s["vocab"]))
        inner = s["heads"] * s["head_dim"]
        transformer = SD3Transformer2DModel(
            sample_size=s["latent_size"], patch_size=2, in_channels=s["latent_channels"],
            num_layers=s["blocks"] if blocks is None else blocks, attention_head_dim=s["head_dim"],
            num_attention_heads=s["heads"], joint_attention_dim=s["t5_width"], caption_projection_dim=inner,
            pooled_projection_dim=s["clip_l_width"] + s["clip_g_width"], out_channels=s["latent_channels"],
            pos_embed_max_size=s["latent_size"])
        model = SD3T2I(clip_l, clip_g, t5, transformer)
    model = model.float().train()
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def sd3_batch(batch_size: int, seed: int = 0, clip_len: int | None = None, t5_len: int | None = None,
              latent_size: int | None = None) -> dict[str, torch.Tensor]:
    """One :class:`SD3T2I` batch (sizes from :data:`SD3_TINY` unless given).

    Keys and shapes (defaults: clip_len = t5_len = 8, latent 4 x 8 x 8; latent_size <= pos_embed_max_size 8)::

        clip_l_input_ids [B, clip_len] int64    bos 126, tokens in [2, 126), eos 127, eos padding
        clip_g_input_ids [B, clip_len] int64    same format, other tokens
        t5_input_ids     [B, t5_len]   int64    tokens in [2, 128), eos 1, pad 0
        latents          [B, 4, S, S]  float32  N(0, 1)
        noise            [B, 4, S, S]  float32  N(0, 1)
        timesteps        [B]           float32  U(0.01, 0.99)

    Seeded by ``seed`` with a private generator.
    """
    s = SD3_TINY
    clip_len = clip_len or s["text_len"]
    t5_len = t5_len or s["text_len"]
    size = latent_size or s["latent_size"]
    g = torch.Generator().manual_seed(seed)
    return {"clip_l_input_ids": _clip_ids(g, batch_size, clip_len, s["vocab"]),
            "clip_g_input_ids": _clip_ids(g, batch_size, clip_len, s["vocab"]),
            "t5_input_ids": _t5_ids(g, batch_size, t5_len, s["vocab"]),
            **_latent_keys(g, batch_size, s["latent_channels"], size)}
