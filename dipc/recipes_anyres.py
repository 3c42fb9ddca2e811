"""The capture recipe of the "anyres" LLaVA families, LLaVA-NeXT and LLaVA-OneVision (issue "Capture once" §2): one
``torch.export`` trace serves every image count, every tile count per image and every original image size.

Their ``get_image_features`` reads ``image_sizes`` (and OneVision's per-sample ``batch_num_images``) in Python: the
tiles of each image (``pixel_values[i, :tiles]``), the split of the projected features per image, and
``pack_image_features``, which lays each image's tile features out on its tile grid, crops the grid to the original
aspect ratio (``unpad_image``), down-scales it bilinearly where it exceeds ``anyres_max_<n>`` tiles (OneVision),
adds an ``image_newline`` feature at the end of each grid row and puts the base tile first.  Every one of those
steps moves feature *rows*; none computes on a feature but the bilinear down-scaling, which is a weighted sum of
four rows.  So the recipe is:

* the vision tower and the projector on every tile of ``pixel_values [N, M, C, H, W]`` (the processor's padding
  tiles included: a tile attends only to itself, and a padding tile's features are never read, so it adds no
  gradient), giving ``rows [N*M*T, D]`` (``T`` features per tile), image-major, so the rows of image
  sub-microbatches concatenate into the microbatch's;
* ``dipc::metadata`` (:mod:`dipc.varlen`) computes, from the microbatch's own ``input_ids``, ``image_sizes``,
  ``batch_num_images`` and the shape of ``rows``, for every text position the four rows and the bilinear weights
  its feature is made of (-1: the ``image_newline``; weights ``(1, 0, 1, 0)`` where nothing is interpolated), by the
  model's own ``image_size_to_num_patches``, ``get_anyres_image_grid_shape`` and ``unpad_image`` run on row ids,
  and ``torch.nn.functional.interpolate``'s own weights;
* the features at the placeholder positions are ``h0 * (w0 * x00 + w1 * x01) + h1 * (w0 * x10 + w1 * x11)`` (the
  order of torch's CPU bilinear kernel; the newline is a last row, index -1), written into the text embeddings with
  ``torch.where`` (the model's ``masked_scatter`` fills the same positions in the same order), and the model's own
  forward runs from ``inputs_embeds`` on.

Values are the model's to the bit where nothing is interpolated; a bilinear down-scaling rounds some features
one float32 ulp apart from torch's vectorised kernel, so the compiler checks a LLaVA-OneVision recipe against the
model's loss on the example batch within rounding (``anyres_forward.rounding``) and the others to the bit.  Transient memory of the merge:
``[B, S, 4, D]`` gathered rows.  A text-only microbatch, video inputs, ``pixel_values`` given per tile
(``[tiles, C, H, W]``) or a vision feature layer/strategy given at the call run the model's own forward.
"""
from __future__ import annotations

import hashlib
import math
import sys
from typing import Callable

import torch

from . import varlen

__all__ = ["anyres_recipe"]

_FAMILIES = ("llava_next", "llava_onevision")


def _linear_taps(n_in: int, n_out: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The two source indices ``[n_out]`` (a <= b) and their weights ``[n_out]`` float32 of each output position of
    a bilinear (``align_corners=False``) resize from ``n_in`` to ``n_out``, read from
    ``torch.nn.functional.interpolate`` itself (a resize of the identity, one source position per channel)."""
    eye = torch.eye(n_in, dtype=torch.float32)[None, :, :, None]  # [1, n_in (channel = source), n_in, 1]
    w = torch.nn.functional.interpolate(eye, size=(n_out, 1), mode="bilinear")[0, :, :, 0]  # [source, output]
    a = torch.empty(n_out, dtype=torch.long)
    b = torch.empty(n_out, dtype=torch.long)
    wa = torch.empty(n_out)
    wb = torch.zeros(n_out)
    for y in range(n_out):
        nz = torch.nonzero(w[:, y]).flatten().tolist() or [0]
        a[y], b[y] = nz[0], nz[-1]
        wa[y] = w[nz[0], y]
        if nz[-1] != nz[0]:
            wb[y] = w[nz[-1], y]
    return a, b, wa, wb


class _Packing:
    """The feature layout of one family's ``pack_image_features`` on row ids (module docstring)."""

    def __init__(self, model: torch.nn.Module, onevision: bool):
        cfg = model.config
        vc = cfg.vision_config
        self.side = int(vc.image_size) // int(vc.patch_size)
        self.tile_px = int(vc.image_size)
        self.pinpoints = cfg.image_grid_pinpoints
        self.token = int(cfg.image_token_id)
        self.onevision = onevision
        self.max_tiles = (int(str(cfg.vision_aspect_ratio).strip("anyres_max_")) if onevision else None)
        self.hf = sys.modules[type(model.model).__module__]

    def image(self, sizes: torch.Tensor, first_row: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[n, 4]`` (-1: newline) and weights ``[n, 4]`` of one image's ``n`` features, whose ``tiles``
        tiles start at row ``first_row``."""
        T = self.side * self.side
        base = first_row + torch.arange(T)
        if tiles == 1:
            ids = torch.cat([base, torch.tensor([-1])])
            return ids[:, None].expand(-1, 4), _ones(len(ids))
        nph, npw = self.hf.get_anyres_image_grid_shape(sizes, self.pinpoints, self.tile_px)
        if nph * npw != tiles - 1:
            raise ValueError(f"image of size {sizes.tolist()} has {tiles} tiles but its anyres grid is {nph}x{npw} "
                             "plus the base tile")
        grid = (first_row + T + torch.arange((tiles - 1) * T)).view(nph, npw, self.side, self.side, 1)
        grid = grid.permute(4, 0, 2, 1, 3).flatten(1, 2).flatten(2, 3)  # [1, nph*side, npw*side], as the model
        grid = self.hf.unpad_image(grid, sizes)[0]
        h, w = grid.shape
        ratio = math.sqrt(h * w / (self.max_tiles * self.side ** 2)) if self.onevision else 0.0
        if ratio > 1.1:  # OneVision's anyres_max down-scaling
            ya, yb, hy0, hy1 = _linear_taps(h, int(h // ratio))
            xa, xb, wx0, wx1 = _linear_taps(w, int(w // ratio))
            taps = torch.stack([grid[ya][:, xa], grid[ya][:, xb], grid[yb][:, xa], grid[yb][:, xb]], -1)
            wts = torch.stack(torch.broadcast_tensors(hy0[:, None], hy1[:, None], wx0[None, :], wx1[None, :]), -1)
        else:
            taps = grid[..., None].expand(-1, -1, 4)
            wts = _ones(h * w).view(h, w, 4)
        newline = torch.full((taps.shape[0], 1, 4), -1, dtype=torch.long)
        taps = torch.cat([taps, newline], 1).reshape(-1, 4)
        wts = torch.cat([wts, _ones(wts.shape[0]).view(-1, 1, 4)], 1).reshape(-1, 4)
        return torch.cat([base[:, None].expand(-1, 4), taps]), torch.cat([_ones(T), wts])

    def layout(self, input_ids, image_sizes, rows, batch_num_images=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[B, S, 4]`` int64 and weights ``[B, S, 4]`` float32 of every position of ``input_ids [B, S]``
        (text positions: -1 and ``(1, 0, 1, 0)``).

        Raises:
            ValueError: the image placeholders of ``input_ids`` are not as many as the images' features, or
                ``batch_num_images`` does not add up to the images.
        """
        n = image_sizes.shape[0]
        T = self.side * self.side
        m = rows.shape[0] // (T * n) if n else 0
        if n and m * T * n != rows.shape[0]:
            raise ValueError(f"{rows.shape[0]} feature rows are not {n} images x tiles x {T}")
        if batch_num_images is None or not self.onevision:
            patch = [True] * n
        else:
            counts = [int(c) for c in batch_num_images.reshape(-1).tolist()]
            if sum(counts) != n:
                raise ValueError(f"batch_num_images {counts} adds up to {sum(counts)} images but image_sizes has {n}")
            patch = [c == 1 for c in counts for _ in range(c)]
        ids, wts = [], []
        for i in range(n):
            tiles = (self.hf.image_size_to_num_patches(image_sizes[i], grid_pinpoints=self.pinpoints,
                                                       patch_size=self.tile_px) if patch[i] else 1)
            if tiles > m:
                raise ValueError(f"image {i} of size {image_sizes[i].tolist()} needs {tiles} tiles but "
                                 f"pixel_values holds {m} per image")
            a, b = self.image(image_sizes[i], i * m * T, tiles)
            ids.append(a)
            wts.append(b)
        mask = input_ids == self.token
        out_ids = torch.full((*input_ids.shape, 4), -1, dtype=torch.long)
        out_wts = _ones(input_ids.numel()).view(*input_ids.shape, 4).clone()
        if ids:
            feats = torch.cat(ids)
            if int(mask.sum()) != feats.shape[0]:
                raise ValueError(f"Image features and image tokens do not match: {int(mask.sum())} image tokens in "
                                 f"input_ids, {feats.shape[0]} features for image_sizes {image_sizes.tolist()}")
            out_ids[mask.cpu()] = feats
            out_wts[mask.cpu()] = torch.cat(wts)
        return out_ids.to(input_ids.device), out_wts.to(input_ids.device)


def _ones(n: int) -> torch.Tensor:
    """Weights ``(1, 0, 1, 0)`` for ``n`` features ``[n, 4]``: the feature is its first row."""
    return torch.tensor([1.0, 0.0, 1.0, 0.0]).repeat(n, 1)


def anyres_recipe(model: torch.nn.Module) -> Callable | None:
    """The recipe of a ``LlavaNextForConditionalGeneration`` or ``LlavaOnevisionForConditionalGeneration`` (module
    docstring), or ``None`` for another layout (no ``image_newline``, another packing function)."""
    cfg = getattr(model, "config", None)
    family = getattr(cfg, "model_type", None)
    inner = getattr(model, "model", None)
    if family not in _FAMILIES or inner is None or getattr(inner, "image_newline", None) is None:
        return None
    if not all(hasattr(inner, n) for n in ("vision_tower", "multi_modal_projector", "get_input_embeddings")):
        return None
    packing = _Packing(model, family == "llava_onevision")
    if not all(hasattr(packing.hf, f) for f in ("get_anyres_image_grid_shape", "image_size_to_num_patches",
                                                  "unpad_image")):
        return None
    tag = hashlib.sha1(cfg.to_json_string(use_diff=False).encode()).hexdigest()[:12]

    def shape(input_ids, *rest, dtype):
        return torch.empty((*input_ids.shape, 4), dtype=dtype, device=input_ids.device)

    last: list = [None, None]  # the rows op, then the weights op, read the same tensors in one forward: one layout

    def layout(*inputs):
        held, out = last
        if held is not None and len(held) == len(inputs) and all(
                a is b and v == b._version for (a, v), b in zip(held, inputs)):
            last[:] = [None, None]  # used once: no tensor of this microbatch is kept past its second op
            return out
        out = packing.layout(*inputs)
        last[:] = [[(t, t._version) for t in inputs], out]
        return out

    names = (varlen.register_metadata(f"{family}.feature_rows:{tag}", lambda *a: layout(*a)[0],
                                      lambda *a: shape(*a, dtype=torch.long)),
             varlen.register_metadata(f"{family}.feature_weights:{tag}", lambda *a: layout(*a)[1],
                                      lambda *a: shape(*a, dtype=torch.float32)))
    own_forward = model.forward

    def anyres_forward(input_ids=None, pixel_values=None, image_sizes=None, labels=None, batch_num_images=None,
                       **rest):
        as_is = dict(input_ids=input_ids, pixel_values=pixel_values, image_sizes=image_sizes, labels=labels, **rest)
        if family == "llava_onevision":
            as_is["batch_num_images"] = batch_num_images
        if pixel_values is None or input_ids is None or image_sizes is None or pixel_values.dim() != 5 \
                or any(rest.get(k) is not None for k in ("inputs_embeds", "pixel_values_videos", "mm_encoder_outputs",
                                                         "vision_feature_layer", "vision_feature_select_strategy")):
            return own_forward(**as_is)  # text only, or a layout the recipe does not rewrite
        embeds = inner.get_input_embeddings()(input_ids)
        layer, strategy = cfg.vision_feature_layer, cfg.vision_feature_select_strategy
        hidden = inner.vision_tower(pixel_values.flatten(0, 1), output_hidden_states=True,
                                    return_dict=True).hidden_states
        picked = hidden[layer] if isinstance(layer, int) else torch.cat([hidden[i] for i in layer], dim=-1)
        if strategy == "default":  # the CLS token is dropped
            picked = picked[:, 1:]
        feats = inner.multi_modal_projector(picked)  # [N*M, T, D]
        rows = feats.reshape(-1, feats.shape[-1])  # [N*M*T, D], image-major
        given = [input_ids, image_sizes, rows.detach()[:, :0]]  # rows: their count only
        if family == "llava_onevision" and batch_num_images is not None:
            given.append(batch_num_images)
        idx = varlen.metadata(names[0], given)  # [B, S, 4]
        wts = varlen.metadata(names[1], given).to(rows.dtype)
        # the newline is the last row (-1), so the rows are never empty (a microbatch given 0 images)
        rows = torch.cat([rows, inner.image_newline.to(rows.dtype)[None]])
        x = rows[torch.where(idx < 0, rows.shape[0] - 1, idx)]  # [B, S, 4, D]
        h0, h1, w0, w1 = (wts[..., k:k + 1] for k in range(4))
        values = h0 * (w0 * x[..., 0, :] + w1 * x[..., 1, :]) + h1 * (w0 * x[..., 2, :] + w1 * x[..., 3, :])
        values = values.to(embeds.device, embeds.dtype)
        mask = (input_ids == packing.token).unsqueeze(-1)
        embeds = torch.where(mask, values, embeds)
        return own_forward(inputs_embeds=embeds, labels=labels, **rest)

    anyres_forward.rounding = packing.onevision  # dipc.recipes.recipe_agrees: within rounding, not to the bit
    return anyres_forward
