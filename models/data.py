"""Generated training batches with the shape statistics of the paper's data (no downloads, deterministic per seed).

DIP's whole point is that batches differ (PAPER.md §1.1-1.2): the number of images per packed sequence ranges from 0
to 48 and the text/image mix follows the dataset. These generators produce random token ids and pixels, but with
sequence structure (where images sit, how many, how long the text runs are) drawn from distributions based on the
figures the paper publishes. Figures used, and how they are scaled to small models:

VLM (:func:`vlm_batches`, :func:`llava_batches`), PAPER.md §1.2 and §3.2:

* 169 tokens per image (728 px, patch 14, merge 4) and sequences packed to 8192 tokens, hence at most
  floor(8192 / 169) = 48 images per sequence.
* LAION-2B (image-caption pairs): 16.4 text tokens per image.
* OBELICS (interleaved documents): 0.4 to 3115 text tokens per image.
* Microbatches with 0 images occur (the dynamic-workload experiment of §3.2 drives the per-microbatch image count
  down to 0).

Scaling: one model image is ``T = tokens_per_image`` tokens instead of 169, and every text length is multiplied by
``T / 169``, so text tokens per image *relative to the image's size* match the paper. The default packing length is
``max_seq = round(8192 * T / 169)`` (194 for the tiny config with T = 4), which keeps the paper's cap of 48 images per
sequence. Each row (sample) is one packed sequence ``[bos] + documents + [eos]`` whose documents all come from one
source, drawn per row:

* 15% one text-only document (0 images) of uniform length in [budget / 2, budget];
* 35% LAION-like pairs ``[image][caption]``, caption length = an exponential draw with mean ``16.4 * T / 169``
  tokens, rounded, at least 1 token;
* 50% OBELICS-like documents of 1-8 images, each preceded by a text run of ``round(r * T / 169 * u)`` tokens, with
  ``r`` log-uniform in [0.4, 3115] per document (an assumption: the paper gives only the range; its distribution
  figure is not readable) and ``u`` uniform in [0.5, 1.5].

Documents are packed greedily; a text run that does not fit is cut, an image that does not fit ends the row.
The paper packs every sequence to exactly 8192 tokens; here each *batch* draws its packing length uniformly from
``[max_seq // 2, max_seq]`` so that the compiler sees a different sequence length ``S`` per batch, and rows are
right-padded to the longest row of the batch (pad token, label -100).

Text tokens follow a fixed first-order Markov chain (each token is its predecessor's fixed successor with
probability 0.75, else uniform), so a model can learn something and the training loss falls.

Labels: the token id for text (``bos``, text, ``eos``), -100 for image placeholders and padding. ``eos`` is a real
target, so every row has a non-ignored label after the next-token shift. Images are numbered in row-major
(batch, seq) order of their placeholders, and ``pixel_values`` is ``[N, 3, image_size, image_size]`` standard normal.

T2V (:func:`t2v_batches`), PAPER.md §3.2: videos are at most 16 s at 16 FPS (MovieGen setup). Caption length is
modelled as duration x text rate: duration uniform in [1, 16] s, rate log-uniform in [2, 40] tokens/s (an
assumption: the paper shows tokens-per-second distributions for ShareGPT4Video, InternVid and MMTrail-2M but their
values are not readable), scaled so the longest caption (16 s at 40 tokens/s = 640 tokens) is
``config.max_text_len`` tokens. The paper's grouping of up to 8 short clips per microbatch is not modelled: every
sample is one latent of ``config.latent_shape``.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch

__all__ = [
    "rise_and_fall_bounds",
    "rise_and_fall_trace",
    "paper_vlm_counts_batch",
    "PAPER_MIXES",
    "paper_vlm_batch",
    "PAPER_SEQ_LEN",
    "PAPER_TOKENS_PER_IMAGE",
    "PAPER_MAX_IMAGES",
    "LAION_TEXT_PER_IMAGE",
    "OBELICS_TEXT_PER_IMAGE",
    "default_max_seq",
    "interleaved_batches",
    "vlm_batches",
    "llava_batches",
    "t2v_batches",
]

PAPER_SEQ_LEN = 8192
PAPER_TOKENS_PER_IMAGE = 169
PAPER_MAX_IMAGES = 48  # floor(8192 / 169)
LAION_TEXT_PER_IMAGE = 16.4
OBELICS_TEXT_PER_IMAGE = (0.4, 3115.0)

_SOURCES = (("text", 0.15), ("caption", 0.35), ("interleaved", 0.50))
_OBELICS_MAX_IMAGES_PER_DOC = 8

_VIDEO_SECONDS = (1.0, 16.0)
_CAPTION_TOKENS_PER_SECOND = (2.0, 40.0)

IGNORE_INDEX = -100


def default_max_seq(tokens_per_image: int) -> int:
    """Packing length that scales the paper's 8192 tokens like the image size: ``round(8192 * T / 169)``."""
    return max(1, round(PAPER_SEQ_LEN * tokens_per_image / PAPER_TOKENS_PER_IMAGE))


class _Rng:
    """Small helper over a seeded ``torch.Generator`` (scalar draws as Python numbers)."""

    def __init__(self, seed: int) -> None:
        self.g = torch.Generator().manual_seed(seed)

    def uniform(self, low: float, high: float) -> float:
        return low + (high - low) * torch.rand((), generator=self.g).item()

    def log_uniform(self, low: float, high: float) -> float:
        return math.exp(self.uniform(math.log(low), math.log(high)))

    def randint(self, low: int, high: int) -> int:
        """Uniform integer in ``[low, high]`` (inclusive)."""
        return int(torch.randint(low, high + 1, (), generator=self.g).item())

    def exponential(self, mean: float) -> float:
        return -mean * math.log(1.0 - torch.rand((), generator=self.g).item())

    def choice(self, weighted: tuple[tuple[str, float], ...]) -> str:
        u = torch.rand((), generator=self.g).item() * sum(w for _, w in weighted)
        for name, w in weighted:
            u -= w
            if u < 0:
                return name
        return weighted[-1][0]


def _document(rng: _Rng, source: str, scale: float, budget: int) -> list[tuple[str, int]]:
    """One document as segments ``("text", n_tokens)`` / ``("image", 1)``; ``scale = T / 169``."""
    if source == "text":
        return [("text", rng.randint(max(1, budget // 2), max(1, budget)))]
    if source == "caption":
        caption = max(1, round(rng.exponential(LAION_TEXT_PER_IMAGE * scale)))
        return [("image", 1), ("text", caption)]
    ratio = rng.log_uniform(*OBELICS_TEXT_PER_IMAGE)  # text tokens per image at paper scale
    segments: list[tuple[str, int]] = []
    for _ in range(rng.randint(1, _OBELICS_MAX_IMAGES_PER_DOC)):
        text = round(ratio * scale * rng.uniform(0.5, 1.5))
        if text > 0:
            segments.append(("text", text))
        segments.append(("image", 1))
    return segments


def _pack_row(rng: _Rng, budget: int, tokens_per_image: int, max_images: int,
              sources: tuple[tuple[str, float], ...] = _SOURCES) -> list[tuple[str, int]]:
    """Greedily pack documents of one randomly drawn source into ``budget`` content tokens."""
    source = rng.choice(sources)
    scale = tokens_per_image / PAPER_TOKENS_PER_IMAGE
    row: list[tuple[str, int]] = []
    used, images = 0, 0
    while used < budget:
        progressed = False
        for kind, n in _document(rng, source, scale, budget - used):
            if kind == "image":
                if used + tokens_per_image > budget or images >= max_images:
                    return row
                row.append(("image", 1))
                used += tokens_per_image
                images += 1
            else:
                n = min(n, budget - used)
                if n == 0:
                    return row
                row.append(("text", n))
                used += n
            progressed = True
        if source == "text" or not progressed:
            break  # one text-only document per row
    return row


#: probability that a text token is its predecessor's fixed successor (see :func:`_markov_text`)
MARKOV_FOLLOW = 0.75


def _successor_table(n: int) -> torch.Tensor:
    """A fixed permutation of ``range(n)`` (seed 1234, the same for every generator seed): the "grammar"."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(1234))


def _markov_text(rng: "_Rng", n: int, text_ids: torch.Tensor, successor: torch.Tensor) -> torch.Tensor:
    """``n`` text tokens of a first-order Markov chain: each token is its predecessor's fixed successor with
    probability :data:`MARKOV_FOLLOW`, else uniform.  Token identities mean nothing, but a model can learn the
    chain, so training loss falls below the uniform ``log(V)`` as it would on real text."""
    idx = torch.randint(len(text_ids), (n,), generator=rng.g)
    follow = torch.rand(n, generator=rng.g) < MARKOV_FOLLOW
    for i in range(1, n):
        if follow[i]:
            idx[i] = successor[idx[i - 1]]
    return text_ids[idx]


def interleaved_batches(
    *,
    tokens_per_image: int,
    image_token_id: int,
    vocab_size: int,
    image_size: int,
    n_batches: int,
    batch_size: int,
    seed: int,
    max_seq: int | None = None,
    pad_token_id: int = 0,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
) -> Iterator[dict[str, torch.Tensor]]:
    """Interleaved image-text batches for any LLaVA-like model (see the module docstring for the distributions).

    Yields:
        ``{"input_ids": [B, S] int64, "pixel_values": [N, 3, image_size, image_size] float32,
        "labels": [B, S] int64}`` with exactly ``N * tokens_per_image`` placeholders ``image_token_id``.
    """
    if max_seq is None:
        max_seq = default_max_seq(tokens_per_image)
    if max_seq < 3:
        raise ValueError("max_seq must leave room for bos, one token and eos")
    special = {pad_token_id, bos_token_id, eos_token_id, image_token_id}
    text_ids = torch.tensor([i for i in range(vocab_size) if i not in special], dtype=torch.long)
    if len(text_ids) == 0:
        raise ValueError("no ordinary token ids left in the vocabulary")
    rng = _Rng(seed)
    successor = _successor_table(len(text_ids))
    for _ in range(n_batches):
        content_budget = rng.randint(max(3, max_seq // 2), max_seq) - 2  # minus bos and eos
        rows: list[torch.Tensor] = []
        labels: list[torch.Tensor] = []
        n_images = 0
        for _ in range(batch_size):
            ids = [torch.tensor([bos_token_id])]
            lab = [torch.tensor([bos_token_id])]
            for kind, n in _pack_row(rng, content_budget, tokens_per_image, PAPER_MAX_IMAGES):
                if kind == "image":
                    ids.append(torch.full((tokens_per_image,), image_token_id))
                    lab.append(torch.full((tokens_per_image,), IGNORE_INDEX))
                    n_images += 1
                else:
                    tokens = _markov_text(rng, n, text_ids, successor)
                    ids.append(tokens)
                    lab.append(tokens)
            ids.append(torch.tensor([eos_token_id]))
            lab.append(torch.tensor([eos_token_id]))
            rows.append(torch.cat(ids))
            labels.append(torch.cat(lab))
        seq = max(len(r) for r in rows)
        input_ids = torch.full((batch_size, seq), pad_token_id, dtype=torch.long)
        label_ids = torch.full((batch_size, seq), IGNORE_INDEX, dtype=torch.long)
        for b, (r, lab) in enumerate(zip(rows, labels)):
            input_ids[b, : len(r)] = r
            label_ids[b, : len(lab)] = lab
        pixel_values = torch.randn(n_images, 3, image_size, image_size, generator=rng.g)
        yield {"input_ids": input_ids, "pixel_values": pixel_values, "labels": label_ids}


def vlm_batches(
    config, n_batches: int, batch_size: int, seed: int, max_seq: int | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    """Batches for :class:`~dipc.models.ReferenceVLM` (``model(**batch)``).

    Args:
        config: a :class:`~dipc.models.VLMConfig` (uses ``tokens_per_image``, ``image_token_id``, ``vocab_size``,
            ``image_size`` and the pad/bos/eos ids).
        n_batches: how many batches to yield.
        batch_size: rows per batch ``B``.
        seed: the generator seed; equal seeds give equal batches.
        max_seq: longest packed row; default ``round(8192 * T / 169)``.

    Yields:
        ``{"input_ids": [B, S], "pixel_values": [N, 3, H, W], "labels": [B, S]}``; ``S`` and ``N`` vary per batch.
    """
    return interleaved_batches(
        tokens_per_image=config.tokens_per_image,
        image_token_id=config.image_token_id,
        vocab_size=config.vocab_size,
        image_size=config.image_size,
        n_batches=n_batches,
        batch_size=batch_size,
        seed=seed,
        max_seq=max_seq,
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
    )


def llava_batches(
    hf_config, n_batches: int, batch_size: int, seed: int, max_seq: int | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    """Batches for Hugging Face ``LlavaForConditionalGeneration`` (keys ``input_ids``, ``pixel_values``,
    ``labels``; no ``attention_mask``: padding is on the right and the model is causal).

    A batch without any image has ``pixel_values=None``: LLaVA's vision tower cannot run on an empty
    ``[0, 3, H, W]`` tensor (a reshape with -1 fails), and ``None`` is how LLaVA expects a text-only batch.

    Tokens per image are ``(image_size // patch_size) ** 2`` (``vision_feature_select_strategy="default"`` drops
    the CLS feature; ``"full"`` keeps it, +1). The image token is ``hf_config.image_token_id``; pad/bos/eos come
    from ``hf_config.text_config`` (pad defaults to 0). Same distributions as :func:`vlm_batches`.
    """
    vision = hf_config.vision_config
    text = hf_config.text_config
    tokens_per_image = (vision.image_size // vision.patch_size) ** 2
    if getattr(hf_config, "vision_feature_select_strategy", "default") == "full":
        tokens_per_image += 1

    def token_id(name: str, default: int) -> int:
        value = getattr(text, name, None)
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        return default if value is None else int(value)

    batches = interleaved_batches(
        tokens_per_image=tokens_per_image,
        image_token_id=hf_config.image_token_id,
        vocab_size=text.vocab_size,
        image_size=vision.image_size,
        n_batches=n_batches,
        batch_size=batch_size,
        seed=seed,
        max_seq=max_seq,
        pad_token_id=token_id("pad_token_id", 0),
        bos_token_id=token_id("bos_token_id", 1),
        eos_token_id=token_id("eos_token_id", 2),
    )
    for batch in batches:
        if batch["pixel_values"].shape[0] == 0:
            batch["pixel_values"] = None
        yield batch


def _caption_patterns(vocab_size: int, latent_shape) -> torch.Tensor:
    """One fixed random latent ``[C, F, H, W]`` per token id (seed 4321, the same for every generator seed)."""
    g = torch.Generator().manual_seed(4321)
    return torch.randn((vocab_size, *latent_shape), generator=g) * 2.0


def t2v_batches(config, n_batches: int, batch_size: int, seed: int) -> Iterator[dict[str, torch.Tensor]]:
    """Batches for :class:`~dipc.models.ReferenceT2V` (``model(**batch)``).

    Caption length = duration x text rate (see the module docstring), scaled so the longest is
    ``config.max_text_len``; rows are ``[bos] + caption``, right-padded with ``config.pad_token_id`` to the longest
    row of the batch (the model masks padding).

    Yields:
        ``{"input_ids": [B, L] int64, "latents": [B, C, F, H, W], "noise": [B, C, F, H, W],
        "timesteps": [B] float32 in (0, 1)}``; ``L`` varies per batch. A sample's latent is the mean of fixed
        per-token patterns of its caption plus 0.1 x standard normal noise, so the denoiser can learn to use the text
        (and the training loss falls, as on real captioned video). Timesteps are logit-normal
        (``sigmoid(N(0, 1))``), the usual sampling for rectified-flow training.
    """
    special = {config.pad_token_id, config.bos_token_id}
    text_ids = torch.tensor([i for i in range(config.vocab_size) if i not in special], dtype=torch.long)
    longest = _VIDEO_SECONDS[1] * _CAPTION_TOKENS_PER_SECOND[1]
    max_caption = max(1, config.max_text_len - 1)  # minus bos
    rng = _Rng(seed)
    for _ in range(n_batches):
        rows = []
        for _ in range(batch_size):
            seconds = rng.uniform(*_VIDEO_SECONDS)
            rate = rng.log_uniform(*_CAPTION_TOKENS_PER_SECOND)
            n = min(max_caption, max(1, round(seconds * rate / longest * max_caption)))
            tokens = text_ids[torch.randint(len(text_ids), (n,), generator=rng.g)]
            rows.append(torch.cat([torch.tensor([config.bos_token_id]), tokens]))
        length = max(len(r) for r in rows)
        input_ids = torch.full((batch_size, length), config.pad_token_id, dtype=torch.long)
        for b, r in enumerate(rows):
            input_ids[b, : len(r)] = r
        shape = (batch_size, *config.latent_shape)
        # the "video" a caption describes: the mean of its tokens' fixed patterns, plus a little noise
        patterns = _caption_patterns(config.vocab_size, config.latent_shape)
        latents = torch.stack([patterns[r[1:]].mean(0) for r in rows]) + 0.1 * torch.randn(shape, generator=rng.g)
        noise = torch.randn(shape, generator=rng.g)
        timesteps = torch.sigmoid(torch.randn(batch_size, generator=rng.g))
        yield {"input_ids": input_ids, "latents": latents, "noise": noise, "timesteps": timesteps}


#: source mixes of :func:`paper_vlm_batch`: the module docstring's default mix, LAION-like (caption pairs only) and
#: OBELICS-like (interleaved documents only)
PAPER_MIXES = {"mixed": _SOURCES, "laion": (("caption", 1.0),), "obelics": (("interleaved", 1.0),)}


def paper_vlm_batch(config, n_rows: int, seed: int, mix: str = "mixed", max_images: int = PAPER_MAX_IMAGES,
                    pixels_on_meta: bool = True) -> dict[str, torch.Tensor]:
    """One batch at the paper's scale (PAPER.md §1.2, §3.2) for a paper-size :class:`~dipc.models.VLMConfig`:
    ``n_rows`` sequences each packed greedily to 8192 tokens (``config.tokens_per_image`` = 169 per image at
    728 px, at most ``max_images`` = 48 images per sequence) from the ``mix`` of sources (:data:`PAPER_MIXES`;
    text lengths as in the module docstring, unscaled).  One row is one microbatch in the paper's setup.

    Returns:
        ``{"input_ids": [n_rows, 8192] int64, "pixel_values": [N, 3, H, W], "labels": [n_rows, 8192] int64}``
        with exactly ``N * tokens_per_image`` image placeholders; ``pixel_values`` on the meta device unless
        ``pixels_on_meta`` is False (real pixels would take 6.4 MB per 728 px image).

    Raises:
        ValueError: unknown ``mix``.
    """
    if mix not in PAPER_MIXES:
        raise ValueError(f"unknown mix {mix!r}; one of {sorted(PAPER_MIXES)}")
    T = config.tokens_per_image
    rng = _Rng(seed)
    seq = PAPER_SEQ_LEN
    ids = torch.full((n_rows, seq), config.pad_token_id, dtype=torch.long)
    labels = torch.full((n_rows, seq), IGNORE_INDEX, dtype=torch.long)
    n_images = 0
    for b in range(n_rows):
        pos = 0
        ids[b, pos] = config.bos_token_id
        pos += 1
        for kind, n in _pack_row(rng, seq - 2, T, max_images, PAPER_MIXES[mix]):
            if kind == "image":
                ids[b, pos:pos + T] = config.image_token_id
                n_images += 1
                pos += T
            else:
                toks = torch.randint(3, config.vocab_size, (n,), generator=rng.g)
                toks[toks == config.image_token_id] = 3
                ids[b, pos:pos + n] = toks
                labels[b, pos:pos + n] = toks
                pos += n
        ids[b, pos] = config.eos_token_id
        labels[b, pos] = config.eos_token_id
    size = config.vision.image_size
    shape = (n_images, 3, size, size)
    pixels = torch.empty(shape, device="meta") if pixels_on_meta else torch.randn(shape, generator=rng.g)
    return {"input_ids": ids, "pixel_values": pixels, "labels": labels}


def rise_and_fall_bounds(iteration: int) -> tuple[int, int]:
    """Bounds ``(low, high)`` on the image count per microbatch at ``iteration`` (0-based) of the paper's
    dynamic-workload experiment (PAPER.md §3.2, VLM-S, 40 iterations, two cycles of 20): rise over iterations 1-5
    (the lower bound grows from 0 to 16, the upper bound stays at 32), then fall over iterations 6-20 (both shrink
    to 0).  The linear steps between the published end points are an assumption."""
    j = iteration % 20
    if j < 5:
        return round(16 * j / 4), 32
    frac = (19 - j) / 14
    return round(16 * frac), round(32 * frac)


def paper_vlm_counts_batch(config, counts, seed: int, pixels_on_meta: bool = True) -> dict[str, torch.Tensor]:
    """One packed 8192-token sequence per entry of ``counts`` holding exactly ``counts[b]`` images (169 tokens
    each, <= 48), the rest interleaved text: the images spread evenly through the sequence with text runs between
    them.  Same keys and shapes as :func:`paper_vlm_batch`.

    Raises:
        ValueError: a count outside 0..48.
    """
    T = config.tokens_per_image
    g = torch.Generator().manual_seed(seed)
    seq = PAPER_SEQ_LEN
    ids = torch.full((len(counts), seq), config.pad_token_id, dtype=torch.long)
    labels = torch.full((len(counts), seq), IGNORE_INDEX, dtype=torch.long)
    for b, k in enumerate(counts):
        if not 0 <= k <= PAPER_MAX_IMAGES:
            raise ValueError(f"counts[{b}] = {k}: a packed sequence holds 0..{PAPER_MAX_IMAGES} images")
        text = seq - 2 - k * T
        toks = torch.randint(3, config.vocab_size, (text,), generator=g)
        toks[toks == config.image_token_id] = 3
        ids[b, 0] = config.bos_token_id
        pos, used = 1, 0
        for i in range(k + 1):
            n = (text * (i + 1)) // (k + 1) - used
            ids[b, pos:pos + n] = toks[used:used + n]
            labels[b, pos:pos + n] = toks[used:used + n]
            pos, used = pos + n, used + n
            if i < k:
                ids[b, pos:pos + T] = config.image_token_id
                pos += T
        ids[b, pos] = config.eos_token_id
        labels[b, pos] = config.eos_token_id
    n_images = int(sum(counts))
    size = config.vision.image_size
    shape = (n_images, 3, size, size)
    pixels = torch.empty(shape, device="meta") if pixels_on_meta else torch.randn(shape, generator=g)
    return {"input_ids": ids, "pixel_values": pixels, "labels": labels}


def rise_and_fall_trace(config, n_rows: int, iterations: int = 40, seed: int = 0):
    """The paper's dynamic-workload trace (PAPER.md §3.2): per iteration, ``n_rows`` packed sequences whose image
    counts are uniform in :func:`rise_and_fall_bounds` (iteration); yields ``(iteration, (low, high), batch)``."""
    g = torch.Generator().manual_seed(seed)
    for it in range(iterations):
        lo, hi = rise_and_fall_bounds(it)
        counts = torch.randint(lo, hi + 1, (n_rows,), generator=g).tolist()
        yield it, (lo, hi), paper_vlm_counts_batch(config, counts, seed * 1000 + it)
