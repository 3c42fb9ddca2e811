"""Instances laid out as real multimodal models lay them out (issue 7 §4), in one process against the eager model:
patch-packed rows with a grid and per-image token counts, an owner index, per-sample padded images; each with
sub-microbatches, microbatches without images, and the errors bad layouts raise."""
import dataclasses

import pytest
import torch

import dipc
from dipc.testing import local_check
from dipc.batch import BatchError

D, TOK = 8, 63


class _Stack(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(D, D) for _ in range(n)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class PackedVLM(torch.nn.Module):
    """Qwen2-VL-like: ``pixel [sum of patches, D]``, ``grid [n_images, 2]``; image ``i`` owns ``prod(grid[i])``
    rows and as many placeholder tokens; the tower mixes each image's rows with their mean."""

    def __init__(self):
        super().__init__()
        self.vision_tower = _Stack(2)
        self.embed = torch.nn.Embedding(64, D)
        self.language_model = _Stack(3)
        self.head = torch.nn.Linear(D, 64)

    def forward(self, input_ids, pixel, grid, labels):
        rows = grid.prod(-1)
        seg = torch.repeat_interleave(torch.arange(grid.shape[0]), rows, output_size=pixel.shape[0])
        h = self.vision_tower(pixel)
        mean = torch.zeros(grid.shape[0], D).index_add(0, seg, h) / rows.clamp(min=1).unsqueeze(-1)
        feats = h + mean[seg]
        emb = self.embed(input_ids)
        emb = emb.masked_scatter((input_ids == TOK).unsqueeze(-1), feats)
        logits = self.head(self.language_model(emb))
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64), labels[:, 1:].reshape(-1))


def packed_batch(grids_per_sample, seq, seed):
    g = torch.Generator().manual_seed(seed)
    B = len(grids_per_sample)
    ids = torch.randint(0, TOK, (B, seq), generator=g)
    grids = []
    for b, gs in enumerate(grids_per_sample):
        pos = 1
        for h, w in gs:
            ids[b, pos:pos + h * w] = TOK
            pos += h * w + 1
            grids.append([h, w])
    grid = torch.tensor(grids, dtype=torch.long).reshape(-1, 2)
    rows = int(grid.prod(-1).sum()) if grids else 0
    labels = ids.masked_fill(ids == TOK, -100)
    return {"input_ids": ids, "pixel": torch.randn(rows, D, generator=g), "grid": grid, "labels": labels}


PACKED = dipc.Instances("vision", ("pixel", "grid"), token_id=TOK, tokens_per_instance=lambda b: b["grid"].prod(-1),
                        row_counts="grid", sub_microbatch_size=1)


def test_patch_packed_rows_with_per_image_token_counts():
    torch.manual_seed(0)
    model = PackedVLM()
    ex = packed_batch([[(1, 2)], [(2, 2)], [], [(1, 3)]], 12, 0)
    c = dipc.compile(model, ex, 2, instances=[PACKED], check=True)
    # text-only microbatch first; 3 images of different sizes in one microbatch, cut into sub-microbatches of 1
    b = packed_batch([[], [], [(2, 2), (1, 1)], [(1, 3)]], 14, 1)
    mbs = c.batch_spec.split(b, 2)
    assert [mb.instances["vision"] for mb in mbs] == [0, 3]
    assert mbs[1].data["pixel"].shape[0] == 4 + 1 + 3 and mbs[1].subs["vision"] == [(0, 1), (1, 2), (2, 3)]
    assert mbs[1].sub_view(PACKED, 2)["pixel"].shape[0] == 3  # all rows of the third image
    local_check(model, c, b, 2)
    local_check(model, c, packed_batch([[(1, 1)], [(2, 1)], [(1, 2)], []], 10, 2), 4)
    bad = dict(b, pixel=b["pixel"][:-1])
    with pytest.raises(BatchError, match=r"batch\['pixel'\] holds 7 vision rows but the batch has 3 instance\(s\) or "
                                         r"the 8 rows of 'grid'"):
        c.batch_spec.split(bad, 2)
    odd = dict(b, input_ids=b["input_ids"].clone())
    odd["input_ids"][2, 1] = 5  # sample 2 loses a placeholder: its images no longer end where its tokens do
    with pytest.raises(BatchError, match=r"sample 3 of 'input_ids' ends at placeholder token 7, which is not the end "
                                         r"of a vision instance \(instance token counts \[4, 1, 3\]\)"):
        c.batch_spec.split(odd, 2)


class OwnerVLM(torch.nn.Module):
    """Images tied to samples by ``owner [n_images]``: each image's feature is added to its owner's first token."""

    def __init__(self):
        super().__init__()
        self.vision_tower = _Stack(2)
        self.language_model = _Stack(3)

    def forward(self, tokens, pixel, owner, target):
        feats = self.vision_tower(pixel)
        first = torch.zeros(tokens.shape[0], D).index_add(0, owner, feats)
        x = torch.cat([tokens[:, :1] + first.unsqueeze(1), tokens[:, 1:]], dim=1)
        return ((self.language_model(x) - target) ** 2).mean()


def owner_batch(counts, seq, seed):
    g = torch.Generator().manual_seed(seed)
    B = len(counts)
    owner = torch.tensor([b for b, k in enumerate(counts) for _ in range(k)], dtype=torch.long)
    return {"tokens": torch.randn(B, seq, D, generator=g), "pixel": torch.randn(int(sum(counts)), D, generator=g),
            "owner": owner, "target": torch.randn(B, seq, D, generator=g)}


def test_owner_index_is_rebased_to_each_microbatch():
    torch.manual_seed(0)
    model = OwnerVLM()
    inst = dipc.Instances("vision", ("pixel", "owner"), owner_key="owner", sub_microbatch_size=2)
    c = dipc.compile(model, owner_batch([1, 2, 0, 1], 5, 0), 2, instances=[inst], check=True)
    b = owner_batch([0, 0, 3, 1], 6, 1)
    mbs = c.batch_spec.split(b, 2)
    assert mbs[1].data["owner"].tolist() == [0, 0, 0, 1]  # samples 2 and 3 are 0 and 1 of their microbatch
    local_check(model, c, b, 2)
    local_check(model, c, owner_batch([2, 0, 1, 1], 4, 2), 4)
    with pytest.raises(BatchError, match=r"batch\['owner'\] must be non-decreasing"):
        c.batch_spec.split(dict(b, owner=torch.tensor([2, 3, 2, 2])), 2)
    with pytest.raises(BatchError, match=r"batch\['owner'\] holds sample indices in \[2, 7\] but the batch has 4"):
        c.batch_spec.split(dict(b, owner=torch.tensor([2, 2, 2, 7])), 2)


class PaddedVLM(torch.nn.Module):
    """Mllama-like per-sample padded images ``pixel [B, max_images, D]`` with ``mask [B, max_images]``; one
    placeholder token per image; padding slots are encoded too and masked out afterwards."""

    def __init__(self):
        super().__init__()
        self.vision_tower = _Stack(2)
        self.embed = torch.nn.Embedding(64, D)
        self.language_model = _Stack(3)

    def forward(self, input_ids, pixel, mask, target):
        feats = self.vision_tower(pixel) * mask.unsqueeze(-1)
        x = self.embed(input_ids) + feats.sum(1, keepdim=True)
        return ((self.language_model(x) - target) ** 2).mean()


def padded_batch(counts, seq, seed, max_images=2):
    g = torch.Generator().manual_seed(seed)
    B = len(counts)
    ids = torch.randint(0, TOK, (B, seq), generator=g)
    mask = torch.zeros(B, max_images)
    for b, k in enumerate(counts):
        ids[b, 1:1 + k] = TOK
        mask[b, :k] = 1
    return {"input_ids": ids, "pixel": torch.randn(B, max_images, D, generator=g), "mask": mask,
            "target": torch.randn(B, seq, D, generator=g)}


def test_per_sample_padded_images_are_cut_with_their_samples():
    torch.manual_seed(0)
    model = PaddedVLM()
    inst = dipc.Instances("vision", ("pixel", "mask"), token_id=TOK, tokens_per_instance=1, per_sample=True)
    c = dipc.compile(model, padded_batch([1, 2, 0, 1], 6, 0), 2, instances=[inst], check=True)
    b = padded_batch([0, 0, 2, 1], 7, 1, max_images=3)  # another max image count, a microbatch without images
    mbs = c.batch_spec.split(b, 2)
    assert [mb.instances["vision"] for mb in mbs] == [0, 3] and mbs[0].data["pixel"].shape == (2, 3, D)
    local_check(model, c, b, 2)
    local_check(model, c, padded_batch([1, 1, 1, 0], 5, 2), 4)
    with pytest.raises(BatchError, match=r"must agree in size where the model's trace ties them, but differ here: "
                                         r"\{'input_ids.shape\[0\]': 4, 'pixel.shape\[0\]': 3"):
        c.batch_spec.split(dict(b, pixel=b["pixel"][:3]), 2)


class TiledVLM(torch.nn.Module):
    """LLaVA-OneVision-like: ``pixel [n_images, max_tiles, D]``; the per-sample ``n_images [B]`` is iterated in Python
    (as its ``batch_num_images``, so it is a constant of the trace) and decides each image's tiles: the only image of its sample
    uses ``TILES`` tiles and as many placeholder tokens, an image of a multi-image sample its first tile, one
    token."""

    TILES = 3

    def __init__(self):
        super().__init__()
        self.vision_tower = _Stack(3)
        self.embed = torch.nn.Embedding(64, D)
        self.language_model = _Stack(3)
        self.head = torch.nn.Linear(D, 64)

    def forward(self, input_ids, n_images, labels, pixel=None):
        emb = self.embed(input_ids)
        if pixel is not None:
            single = [n == 1 for n in n_images for _ in range(n)]
            tiles = torch.cat([pixel[i, :self.TILES if one else 1] for i, one in enumerate(single)])
            feats = self.vision_tower(tiles)
            emb = emb.masked_scatter((input_ids == TOK).unsqueeze(-1), feats)
        logits = self.head(self.language_model(emb))
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64), labels[:, 1:].reshape(-1))


def tiled_batch(counts, seq, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TOK, (len(counts), seq), generator=g)
    for b, k in enumerate(counts):
        n_tok = TiledVLM.TILES if k == 1 else k
        ids[b, 1:1 + n_tok] = TOK
    batch = {"input_ids": ids, "n_images": torch.tensor(counts, dtype=torch.long),
             "labels": ids.masked_fill(ids == TOK, -100)}
    if sum(counts):
        batch["pixel"] = torch.randn(sum(counts), TiledVLM.TILES, D, generator=g)
    return batch


def _tiled_tokens(batch):
    return torch.tensor([TiledVLM.TILES if n == 1 else 1 for n in batch["n_images"].tolist() for _ in range(n)])


def test_whole_sample_sub_microbatches_pack_samples_in_order():
    from dipc.batch import whole_sample_subs
    assert whole_sample_subs([1, 2, 1], 2) == ([(0, 1), (1, 3), (3, 4)], [(0, 1), (1, 2), (2, 3)])
    assert whole_sample_subs([1, 2, 1], 3) == ([(0, 3), (3, 4)], [(0, 2), (2, 3)])
    # samples without instances join the sub-microbatch before them (leading ones the first); a sample with more
    # than B_i instances is a sub-microbatch of its own
    assert whole_sample_subs([0, 1, 0, 4, 0], 2) == ([(0, 1), (1, 5)], [(0, 3), (3, 5)])
    assert whole_sample_subs([0, 0], 2) == ([], [])
    assert whole_sample_subs([2, 1, 1], 12) == ([(0, 4)], [(0, 3)])


@pytest.mark.parametrize("pp", [2, 3])
def test_per_sample_values_in_the_trace_are_sliced_with_their_sub_microbatch(pp):
    """Issue 35 §1: a per-sample count that the trace holds as a constant (``for n in n_images``) and that decides
    how each image is encoded must describe each sub-microbatch's own images.  Microbatches with [1, 2, 1] images
    cut into sub-microbatches of 1, 2 and 3 images, a text-only microbatch first and last, equal the unsplit
    model's loss and every gradient (before, images 2 and 3 were encoded with images 0 and 1's tile counts)."""
    torch.manual_seed(0)
    model = TiledVLM()
    inst = dipc.Instances("vision", ("pixel",), token_id=TOK, tokens_per_instance=_tiled_tokens,
                          drop_when_empty=True)
    c = dipc.compile(model, tiled_batch([1, 2, 0, 1], 8, 0), pp, instances=[inst])
    assert c.batch_spec.sample_constants == {"n_images"}
    text_first = tiled_batch([0, 0, 0, 1, 2, 1], 9, 1)
    images_first = tiled_batch([1, 2, 1, 0, 0, 0], 9, 2)
    for size, subs in ((1, [(0, 1), (1, 3), (3, 4)]), (2, [(0, 1), (1, 3), (3, 4)]), (3, [(0, 3), (3, 4)])):
        c.batch_spec.instances = [dataclasses.replace(inst, sub_microbatch_size=size)]
        mbs = c.batch_spec.split(text_first, 2)
        assert mbs[0].subs["vision"] == [] and mbs[1].subs["vision"] == subs
        view = mbs[1].sub_view(c.batch_spec.instances[0], len(subs) - 1)  # the last sample's image, alone
        assert view["n_images"].tolist() == [1] and view["input_ids"].shape[0] == 1 and view["pixel"].shape[0] == 1
        for b in (text_first, images_first):
            local_check(model, c, b, 2)


class TiledAndAudio(TiledVLM):
    """:class:`TiledVLM` with a second instance modality: audio clips, one placeholder token each (``AUDIO``)."""

    AUDIO = 62

    def __init__(self):
        super().__init__()
        self.audio_tower = _Stack(2)

    def forward(self, input_ids, n_images, labels, pixel=None, audio=None):
        emb = self.embed(input_ids)
        if pixel is not None:
            single = [n == 1 for n in n_images for _ in range(n)]
            tiles = torch.cat([pixel[i, :self.TILES if one else 1] for i, one in enumerate(single)])
            emb = emb.masked_scatter((input_ids == TOK).unsqueeze(-1), self.vision_tower(tiles))
        if audio is not None:
            emb = emb.masked_scatter((input_ids == self.AUDIO).unsqueeze(-1), self.audio_tower(audio))
        logits = self.head(self.language_model(emb))
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64), labels[:, 1:].reshape(-1))


def tiled_audio_batch(counts, clips, seq, seed):
    b = tiled_batch(counts, seq, seed)
    g = torch.Generator().manual_seed(seed + 100)
    ids = b["input_ids"]
    ids[ids == TiledAndAudio.AUDIO] = 0  # random text never holds the audio placeholder
    for s, k in enumerate(clips):
        start = 2 + (TiledVLM.TILES if counts[s] == 1 else counts[s])
        ids[s, start:start + k] = TiledAndAudio.AUDIO
    b["labels"] = ids.masked_fill((ids == TOK) | (ids == TiledAndAudio.AUDIO), -100)
    if sum(clips):
        b["audio"] = torch.randn(sum(clips), D, generator=g)
    return b


def test_a_whole_sample_sub_microbatch_cuts_the_other_modalitys_instances_too():
    """An audio sub-microbatch of whole samples is their sub-batch: its view holds those samples' images (or none),
    not the microbatch's, so the trace made for it agrees with its own ``n_images`` (it crashed in capture before:
    an audio view held sample 3's ``n_images = [0]`` with 4 images)."""
    torch.manual_seed(0)
    model = TiledAndAudio()
    vision = dipc.Instances("vision", ("pixel",), token_id=TOK, tokens_per_instance=_tiled_tokens,
                            drop_when_empty=True, sub_microbatch_size=1)
    audio = dipc.Instances("audio", ("audio",), token_id=TiledAndAudio.AUDIO, drop_when_empty=True,
                           sub_microbatch_size=1)
    c = dipc.compile(model, tiled_audio_batch([1, 2, 0, 1], [1, 0, 2, 1], 12, 0), 2, instances=[vision, audio],
                     modalities={"vision": ["vision_tower"], "audio": ["audio_tower"],
                                 "text": ["embed", "language_model", "head"]})
    b = tiled_audio_batch([1, 2, 1, 0], [2, 1, 0, 1], 14, 3)
    mb = c.batch_spec.split(b, 1)[0]
    view = mb.sub_view(audio, 2)  # sample 3: one clip, no image
    assert "pixel" not in view and view["n_images"].tolist() == [0] and view["audio"].shape[0] == 1
    local_check(model, c, b, 1)
    local_check(model, c, tiled_audio_batch([0, 1, 1, 2], [3, 0, 1, 1], 14, 4), 2)


CLIP = 62


class TwoKindVLM(torch.nn.Module):
    """Images ``image [N, D]`` and clips ``clip [M, 2, D]`` (two frames, mean-pooled) encoded by one tower: two
    instance kinds of one modality, each scattered into its own placeholder tokens."""

    def __init__(self):
        super().__init__()
        self.vision_tower = _Stack(3)
        self.embed = torch.nn.Embedding(64, D)
        self.language_model = _Stack(2)
        self.head = torch.nn.Linear(D, 64)

    def forward(self, input_ids, labels, image=None, clip=None):
        emb = self.embed(input_ids)
        if image is not None:
            emb = emb.masked_scatter((input_ids == TOK).unsqueeze(-1), self.vision_tower(image))
        if clip is not None:
            emb = emb.masked_scatter((input_ids == CLIP).unsqueeze(-1), self.vision_tower(clip).mean(1))
        logits = self.head(self.language_model(emb))
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64), labels[:, 1:].reshape(-1))


def two_kind_batch(images, clips, seq, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CLIP, (len(images), seq), generator=g)
    for b, (n, m) in enumerate(zip(images, clips)):
        ids[b, 1:1 + n] = TOK
        ids[b, 2 + n:2 + n + m] = CLIP
    out = {"input_ids": ids, "labels": ids.masked_fill((ids == TOK) | (ids == CLIP), -100)}
    if sum(images):
        out["image"] = torch.randn(sum(images), D, generator=g)
    if sum(clips):
        out["clip"] = torch.randn(sum(clips), 2, D, generator=g)
    return out


def test_two_instance_kinds_of_one_modality_are_cut_kind_by_kind():
    """Issue 35 §3 (videos as a second instance kind): images and clips through one vision tower.  Each
    sub-microbatch holds instances of one kind (the other kind's keys left out of its view); the backbone gets each
    kind's features concatenated over that kind's sub-microbatches; equal to the unsplit model with text-only,
    image-only, clip-only and mixed microbatches in both orders, on one capture per set of kinds present."""
    torch.manual_seed(0)
    model = TwoKindVLM()
    kinds = [dipc.Instances("vision", ("image",), token_id=TOK, drop_when_empty=True, sub_microbatch_size=2),
             dipc.Instances("vision", ("clip",), token_id=CLIP, drop_when_empty=True, sub_microbatch_size=2)]
    c = dipc.compile(model, two_kind_batch([1, 2, 0, 1], [1, 0, 2, 1], 12, 0), 2, instances=kinds, check=True)
    b = two_kind_batch([0, 0, 3, 0], [0, 0, 2, 1], 12, 1)
    mbs = c.batch_spec.split(b, 2)
    assert mbs[0].subs["vision"] == [] and mbs[1].instances["vision"] == 6
    assert mbs[1].subs["vision"] == [(0, 2), (2, 3), (0, 2), (2, 3)]
    assert [k.keys for k in mbs[1].sub_kinds["vision"]] == [("image",)] * 2 + [("clip",)] * 2
    view = mbs[1].sub_view(mbs[1].sub_kind("vision", 3, kinds[0]), 3)
    assert "image" not in view and view["clip"].shape[0] == 1
    for images, clips in (([0, 0, 3, 0], [0, 0, 2, 1]), ([1, 1, 0, 0], [2, 0, 0, 0]), ([0, 0, 0, 0], [1, 2, 1, 1]),
                          ([2, 1, 1, 3], [0, 0, 0, 0]), ([1, 0, 2, 0], [0, 3, 0, 1])):
        local_check(model, c, two_kind_batch(images, clips, 12, sum(images) + 7 * sum(clips)), 2)
    assert len(c.programs) <= 4, len(c.programs)  # {images, clips}, {images}, {clips}, {} whatever the counts
    only_images = dipc.compile(model, two_kind_batch([1, 1, 0, 0], [0, 0, 0, 0], 12, 0), 2,
                               instances=kinds[:1], check=False)
    with pytest.raises(BatchError, match=r"key\(s\) \['clip'\] that the example batch did not have \(dipc learns a "
                                         r"batch's keys from the example batch"):  # not "did you mean 'image'"
        only_images.batch_spec.split(two_kind_batch([1, 0, 0, 0], [0, 1, 0, 0], 12, 3), 2)
