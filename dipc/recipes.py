"""Capture recipes: the same loss as a Hugging Face model's forward, written so that one ``torch.export`` trace
serves every image count (issue "Capture once"; DESIGN.md "Capture once").

Hugging Face LLaVA's ``get_image_features`` ends in ``list(image_features)``: a Python list of one tensor per image,
which fixes the image count in the trace, so dipc used to capture the model again for every new count.  A recipe
computes the model's loss from its own modules with dipc's merge as the glue: the vision tower and the projector on
all images at once (``[N, T, D]``, N symbolic), the features flattened into the placeholder positions of the text
embeddings (``masked_scatter`` reads its source in order, so ``[N*T, D]`` fills the same positions as the model's
``torch.cat`` of its per-image list), and the model's own forward from ``inputs_embeds`` on.  Parameters keep their
names (the recipe runs as the model's forward while it is traced).

:func:`recipe_for` returns one for the families it knows and ``None`` for the rest (captured through their own
forward).  The compiler checks a recipe against the model's forward on the example batch before using it
(:meth:`dipc.CompiledPipeline`), and drops it, with a warning, where they differ.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Mapping

import torch

__all__ = ["recipe_for", "recipe_agrees", "recipe_variable_dims", "runs_empty_kinds"]


def runs_empty_kinds(model: torch.nn.Module) -> bool:
    """Whether the graph of ``model``'s recipe runs with an instance kind of a modality given as 0 instances while
    another kind has some (Qwen2-VL's videos beside images, :mod:`dipc.recipes_qwen`), so that one capture serves
    every mix of kinds (``Instances.drop_with_modality``)."""
    return getattr(getattr(model, "config", None), "model_type", None) in ("qwen2_vl", "qwen2_5_vl")


def recipe_variable_dims(model: torch.nn.Module) -> set[tuple[str, int]]:
    """``(key, dim)`` of instance keys whose size per instance may change from batch to batch under ``model``'s
    recipe: the tiles per image of LLaVA-NeXT / LLaVA-OneVision's ``pixel_values [N, max_tiles, 3, H, W]`` (the
    processor pads to each batch's largest tile count; :mod:`dipc.recipes_anyres` reads every tile's rows)."""
    if getattr(getattr(model, "config", None), "model_type", None) in ("llava_next", "llava_onevision"):
        return {("pixel_values", 1)}
    return set()


def recipe_for(model: torch.nn.Module) -> Callable | None:
    """A forward computing ``model``'s output from the batch's keyword arguments whose trace keeps the image count
    symbolic, or ``None`` (no recipe for this model's family).  Known: ``LlavaForConditionalGeneration``
    (``model_type == "llava"``, one vision feature layer or several), ``Qwen2VLForConditionalGeneration`` and
    ``Qwen2_5_VLForConditionalGeneration`` (:mod:`dipc.recipes_qwen`), ``LlavaNextForConditionalGeneration`` and
    ``LlavaOnevisionForConditionalGeneration`` (:mod:`dipc.recipes_anyres`)."""
    cfg = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    if getattr(cfg, "model_type", None) in ("qwen2_vl", "qwen2_5_vl"):
        from .recipes_qwen import qwen2_vl_recipe
        return qwen2_vl_recipe(model)
    if getattr(cfg, "model_type", None) in ("llava_next", "llava_onevision"):
        from .recipes_anyres import anyres_recipe
        return anyres_recipe(model)
    if getattr(cfg, "model_type", None) != "llava" or inner is None:
        return None
    needed = ("vision_tower", "multi_modal_projector", "get_placeholder_mask", "get_input_embeddings")
    if not all(hasattr(inner, n) for n in needed):
        return None
    own_forward = model.forward  # the bound method: the recipe runs in its place while traced

    def llava_forward(input_ids=None, pixel_values=None, labels=None, **rest):
        if pixel_values is None or rest.get("image_sizes") is not None:  # text only, or per-image splits: as is
            return own_forward(input_ids=input_ids, pixel_values=pixel_values, labels=labels, **rest)
        embeds = inner.get_input_embeddings()(input_ids)
        layer = cfg.vision_feature_layer
        strategy = cfg.vision_feature_select_strategy
        hidden = inner.vision_tower(pixel_values, output_hidden_states=True, return_dict=True).hidden_states
        picked = [hidden[i] for i in ([layer] if isinstance(layer, int) else layer)]
        if strategy == "default":  # the CLS token of each layer's output is dropped
            picked = [h[:, 1:] for h in picked]
        feats = inner.multi_modal_projector(picked[0] if len(picked) == 1 else torch.cat(picked, dim=-1))
        feats = feats.reshape(-1, feats.shape[-1]).to(embeds.device, embeds.dtype)  # [N*T, D]
        mask = inner.get_placeholder_mask(input_ids, inputs_embeds=embeds, image_features=feats)
        embeds = embeds.masked_scatter(mask, feats)
        return own_forward(inputs_embeds=embeds, labels=labels, **rest)

    return llava_forward


def recipe_agrees(model: torch.nn.Module, batch: Mapping[str, Any], loss_key: str) -> bool:
    """Whether to capture ``model`` through its recipe (:mod:`dipc.recipes`): one exists and, run eagerly on the
    example batch (same random state), gives the model's own loss to the bit (within rounding, rtol 1e-5, for a
    recipe marked ``rounding``: LLaVA-OneVision's bilinear down-scaling as weighted rows); a model on the meta
    device, which cannot run, is taken through the recipe as its family is.  A recipe that differs is dropped with
    a warning."""
    from .capture import is_meta
    from .check import loss_of

    recipe = recipe_for(model)
    if recipe is None:
        return False
    if is_meta(model):
        return True
    outs = []
    with torch.no_grad():
        for fn in (model, recipe):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                try:
                    outs.append(loss_of(fn(**batch), loss_key))
                except Exception as e:  # noqa: BLE001 - the model's own forward is captured instead
                    outs.append(e)
    if all(isinstance(o, torch.Tensor) for o in outs) and (
            torch.equal(outs[0], outs[1]) if not getattr(recipe, "rounding", False)
            else torch.allclose(outs[0], outs[1], rtol=1e-5, atol=1e-7)):
        return True
    warnings.warn(f"dipc: the capture recipe of {type(model).__name__} does not reproduce its forward on the example "
                  f"batch ({outs[0]!r} vs {outs[1]!r}); capturing the model's own forward (one capture per image "
                  "count)", stacklevel=3)
    return False
