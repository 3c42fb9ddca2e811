"""A zoo of small models nobody shaped for dipc, and their batches (importable by spawned ranks, like
``pipeline_cases``).

Every model is tiny (widths 8-16, 4-8 layers), deterministic, and returns a scalar loss whose batch mean separates
per sample (no batch statistics):

* cross-entropy of next-token prediction with integer ``labels`` (``logits[:, :-1]`` against ``labels[:, 1:]``,
  ignore -100): dipc's default token-mean (``LossReduction("token_mean", shift=True)``);
* MSE against a float target ``y`` of the input's shape: every sample has the same number of elements, so the mean
  is dipc's default sample-mean.

Models (``CASES`` names them for the tests):

* ``named``: named top-level layers ``emb, l1 .. l5, head`` (no ModuleList);
* ``sequential``: ``nn.Sequential`` stacks (a stem, a body of nested Sequentials, a head);
* ``unet``: U-Net skips: down blocks, a mid block, up blocks concatenating the down blocks' outputs (the first
  down block's output is consumed by the last up block, several chunks later);
* ``shared``: one block held by every layer (``layers.i.shared`` is the same module): its weight is read by chunks
  on several ranks and has one name per layer;
* ``mask``: an in-place mask write (``mask = ones(B, S, 1); mask[:, -2:] = 0``);
* ``checkpoint``: a reentrant activation checkpoint per layer after an input projection (so the checkpoint's input
  requires grad);
* ``lengths``: a Python list ``lengths`` (one int per sample) in the batch, building a padding mask;
* ``owner``: images tied to samples by an owner index (``pixel [N, P]``, ``owner [N]``; see :class:`OwnerVLM`).

Batches (:func:`batches`): an example batch (B=4, S=5) for compilation, then 3 steps with different batch sizes
(4-6) and sequence lengths (6, 9, 7), in order ``"fwd"`` or reversed (``"rev"``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

D = 12      #: hidden width
DIN = 8     #: input / target width of the MSE models
V = 40      #: vocabulary of the token models
PIX = 10    #: per-image feature width of the owner-index model


class Block(nn.Module):
    """A residual Linear + tanh block."""

    def __init__(self, d: int = D):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


def next_token_ce(logits, labels):
    """Mean cross-entropy of next-token prediction over labelled tokens (dipc's token-mean with shift)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                           ignore_index=-100)


# --------------------------------------------------------------------------------------------- models
class NamedLayers(nn.Module):
    """Named layers, no ModuleList: ``emb, l1 .. l5, head``; token cross-entropy."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.l1 = Block()
        self.l2 = Block()
        self.l3 = Block()
        self.l4 = Block()
        self.l5 = Block()
        self.head = nn.Linear(D, V)

    def forward(self, input_ids, labels):
        h = self.emb(input_ids)
        h = self.l1(h)
        h = self.l2(h)
        h = self.l3(h)
        h = self.l4(h)
        h = self.l5(h)
        return next_token_ce(self.head(h), labels)


class SequentialStack(nn.Module):
    """``nn.Sequential`` stacks: stem (Linear, Tanh), body (6 x Sequential(Linear, GELU)), head; MSE."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(DIN, D), nn.Tanh())
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(D, D), nn.GELU()) for _ in range(6)])
        self.head = nn.Sequential(nn.Linear(D, DIN))

    def forward(self, x, y):
        return ((self.head(self.body(self.stem(x))) - y) ** 2).mean()


class Down(nn.Module):
    def __init__(self, i: int, o: int):
        super().__init__()
        self.lin = nn.Linear(i, o)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Up(nn.Module):
    """Concatenates the skip connection, then Linear + tanh."""

    def __init__(self, i: int, skip: int, o: int):
        super().__init__()
        self.lin = nn.Linear(i + skip, o)

    def forward(self, x, skip):
        return torch.tanh(self.lin(torch.cat([x, skip], dim=-1)))


class UNet(nn.Module):
    """U-Net skips on the feature axis: inp, down 8->12->16->16, mid, up (cat skip) 16->16->12->8, out; MSE."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIN, DIN)
        self.down = nn.ModuleList([Down(8, 12), Down(12, 16), Down(16, 16)])
        self.mid = Down(16, 16)
        self.up = nn.ModuleList([Up(16, 16, 16), Up(16, 16, 12), Up(12, 12, 8)])
        self.out = nn.Linear(8, DIN)

    def forward(self, x, y):
        h = self.inp(x)
        skips = []
        for blk in self.down:
            h = blk(h)
            skips.append(h)
        h = self.mid(h)
        for blk, skip in zip(self.up, reversed(skips)):
            h = blk(h, skip)
        return ((self.out(h) - y) ** 2).mean()


class SharedMixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class SharedLayer(nn.Module):
    """A layer with its own Linear that also calls the one block every layer shares."""

    def __init__(self, shared: SharedMixer):
        super().__init__()
        self.own = nn.Linear(D, D)
        self.shared = shared

    def forward(self, x):
        x = x + torch.tanh(self.own(x))
        return x + 0.5 * self.shared(x)


class SharedBlock(nn.Module):
    """6 layers holding the same ``SharedMixer`` (``layers.0.shared`` is ``layers.5.shared``); MSE."""

    def __init__(self):
        super().__init__()
        shared = SharedMixer()
        self.inp = nn.Linear(DIN, D)
        self.layers = nn.ModuleList([SharedLayer(shared) for _ in range(6)])
        self.out = nn.Linear(D, DIN)

    def forward(self, x, y):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return ((self.out(h) - y) ** 2).mean()


class InPlaceMask(nn.Module):
    """``mask = ones(B, S, 1); mask[:, -2:] = 0`` gates every layer's update; token cross-entropy."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.layers = nn.ModuleList([Block() for _ in range(4)])
        self.head = nn.Linear(D, V)

    def forward(self, input_ids, labels):
        B, S = input_ids.shape
        mask = torch.ones(B, S, 1)
        mask[:, -2:] = 0
        h = self.emb(input_ids)
        for layer in self.layers:
            h = h + (layer(h) - h) * mask
        return next_token_ce(self.head(h), labels)


class ReentrantCheckpoint(nn.Module):
    """``proj`` then ``checkpoint(layer, h, use_reentrant=True)`` per layer (h requires grad), head; MSE."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIN, D)
        self.layers = nn.ModuleList([Block() for _ in range(4)])
        self.head = nn.Linear(D, DIN)

    def forward(self, x, y):
        h = self.proj(x)
        for layer in self.layers:
            h = checkpoint(layer, h, use_reentrant=True)
        return ((self.head(h) - y) ** 2).mean()


class LengthsMask(nn.Module):
    """A Python list ``lengths`` (one int per sample) builds a padding mask; padded positions are zeroed and every
    layer adds the sample's masked mean over its real tokens; token cross-entropy (padding labelled -100)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.layers = nn.ModuleList([Block() for _ in range(4)])
        self.head = nn.Linear(D, V)

    def forward(self, input_ids, labels, lengths):
        B, S = input_ids.shape
        lens = torch.tensor(lengths, dtype=torch.long)
        mask = (torch.arange(S).unsqueeze(0) < lens.unsqueeze(1)).to(torch.float32).unsqueeze(-1)  # [B, S, 1]
        h = self.emb(input_ids) * mask
        for layer in self.layers:
            h = layer(h) * mask
            pooled = h.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True)
            h = h + 0.1 * pooled * mask
        return next_token_ce(self.head(h), labels)


class VisionTower(nn.Module):
    """``vision_tower.layers``: Linear + tanh blocks (dipc's default rule labels them vision)."""

    def __init__(self, n_layers: int = 4):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(PIX if i == 0 else D, D), nn.Tanh())
                                     for i in range(n_layers)])

    def forward(self, pixel):
        h = pixel
        for layer in self.layers:
            h = layer(h)
        return h


class LanguageModel(nn.Module):
    """``language_model``: embedding, image features added to their owner's first token, 4 blocks, head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList([Block() for _ in range(4)])
        self.head = nn.Linear(D, V)

    def forward(self, input_ids, feats, owner):
        h = self.embed(input_ids)
        h = h.index_put((owner, torch.zeros_like(owner)), feats, accumulate=True)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class OwnerVLM(nn.Module):
    """Images tied to samples by an owner index: ``pixel [N, PIX]`` image features (N may be 0 in a microbatch),
    ``owner [N]`` (long, sorted ascending) the sample each image belongs to; the vision tower encodes ``pixel``,
    each image's feature is added to its owner's first token (``index_put`` with accumulation), then the language
    model and a token cross-entropy."""

    def __init__(self):
        super().__init__()
        self.vision_tower = VisionTower()
        self.language_model = LanguageModel()

    def forward(self, input_ids, labels, pixel, owner):
        feats = self.vision_tower(pixel)
        return next_token_ce(self.language_model(input_ids, feats, owner), labels)


def named():
    return NamedLayers()


def sequential():
    return SequentialStack()


def unet():
    return UNet()


def shared():
    return SharedBlock()


def mask():
    return InPlaceMask()


def reentrant_checkpoint():
    return ReentrantCheckpoint()


def lengths():
    return LengthsMask()


def owner():
    return OwnerVLM()


# --------------------------------------------------------------------------------------------- batches
#: (batch size, sequence length) of the 3 training steps, order "fwd"
STEPS = [(4, 6), (5, 9), (6, 7)]
#: the example batch: 4 samples, so the debug check's 2-microbatch run of it (DIPC_CHECK=1) has microbatches of 2
#: samples, not of 1 (a size torch.export specialises, which would cost one more capture per model and rank)
EXAMPLE = (4, 5)
#: ``lengths`` of the padding-mask model cycle through these (all <= the shortest sequence)
LENGTHS = (5, 3, 4)
#: images per sample of the owner-index model for B = 4, 5, 6: with 2 microbatches (near-equal, larger first) every
#: batch has a microbatch without images, and B = 5, 6 one with 3 images (2 sub-microbatches at B_i = 2)
IMAGES = {4: [0, 0, 2, 1], 5: [1, 2, 0, 0, 0], 6: [0, 0, 0, 1, 0, 2]}


def _ids(B, S, g):
    ids = torch.randint(0, V, (B, S), generator=g)
    labels = ids.clone()
    labels[:, -1] = -100  # some ignored positions; every sample keeps labelled tokens after the shift
    return ids, labels


def batch(kind: str, B: int, S: int, seed: int) -> dict:
    """One batch of ``B`` samples of ``S`` positions for a model kind ("ids", "float", "lengths", "owner")."""
    g = torch.Generator().manual_seed(seed)
    if kind == "float":
        return {"x": torch.randn(B, S, DIN, generator=g), "y": torch.randn(B, S, DIN, generator=g)}
    ids, labels = _ids(B, S, g)
    if kind == "ids":
        return {"input_ids": ids, "labels": labels}
    if kind == "lengths":
        # a cycle of 3 values: microbatches get lengths [5, 3], [4, 5] or [5, 3, 4] (each distinct list is one
        # capture, the trace being specialised to Python values; the example's microbatches are the first two),
        # and the two microbatches of a 4- or 5-sample step differ, so lengths given to the wrong samples change
        # the loss
        lens = [LENGTHS[b % len(LENGTHS)] for b in range(B)]
        assert max(lens) <= S
        for b, n in enumerate(lens):
            labels[b, n:] = -100
        return {"input_ids": ids, "labels": labels, "lengths": lens}
    if kind == "owner":
        counts = IMAGES[B]
        owner_idx = torch.tensor([b for b, k in enumerate(counts) for _ in range(k)], dtype=torch.long)
        return {"input_ids": ids, "labels": labels, "pixel": torch.randn(len(owner_idx), PIX, generator=g),
                "owner": owner_idx}
    raise ValueError(kind)


KIND = {"named": "ids", "sequential": "float", "unet": "float", "shared": "float", "mask": "ids",
        "checkpoint": "float", "lengths": "lengths", "owner": "owner"}


def batches(case: str, order: str = "fwd") -> list[dict]:
    """The example batch, then the 3 steps (``STEPS``, reversed for ``order="rev"``)."""
    kind = KIND[case]
    steps = STEPS if order == "fwd" else STEPS[::-1]
    return [batch(kind, *EXAMPLE, 0)] + [batch(kind, B, S, 1 + i) for i, (B, S) in enumerate(steps)]


def owner_instances():
    """The owner-index model's instance declaration (``Instances.owner_key``)."""
    import dipc
    return [dipc.Instances(modality="vision", keys=("pixel", "owner"), owner_key="owner")]


# --------------------------------------------------------------------------------------------- cases
#: name -> (model function, state dict checked at the end). The state dict check costs a gather and one more step,
#: so it runs for the models whose parameter names are unusual (named layers, nested Sequentials, one weight
#: under six names, two modality modules).
CASES = {
    "named": ("named", True),
    "sequential": ("sequential", True),
    "unet": ("unet", False),
    "shared": ("shared", True),
    "mask": ("mask", False),
    "checkpoint": ("reentrant_checkpoint", False),
    "lengths": ("lengths", False),
    "owner": ("owner", True),
}


def compile_kwargs(case: str, world: int) -> dict:
    """Options of ``dipc.compile`` per case and pipeline size: several chunks per rank on 2 ranks (and for the
    U-Net on 3), so chunks of one module meet on a rank and skips cross several chunks."""
    kw: dict = {}
    if case == "owner":
        kw["instances"] = owner_instances()
        kw["sub_microbatch_size"] = {"vision": 2}
        if world == 2:
            kw["chunks_per_rank"] = {"vision": 1, "text": 2}
        return kw
    if world == 2 and case in ("named", "sequential", "unet", "shared", "lengths"):
        kw["chunks_per_rank"] = {"text": 2}
    if world == 3 and case == "unet":
        kw["chunks_per_rank"] = {"text": 2}
    return kw
