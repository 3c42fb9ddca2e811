"""Hugging Face models (transformers, diffusers) from tiny configs, and their training batches, for the tests.

Importable by spawned ranks ("hf_cases:paligemma").  Every batch list is ``[example, step 1, step 2, step 3]`` of
4 samples; with 2 microbatches the steps' microbatches hold (0, 2), (2, 0) and (1, 1) images: a text-only
microbatch first, then one last, then images in both, so models that fix the image count at export (most HF
VLMs) are re-captured for 0, 1 and 2 images, and a capture made for one key set is never reused for another.
Text lengths differ between steps.
"""
from dipc.models import hf_diffusion, hf_vlm

COUNTS = [[1, 1, 0, 1], [0, 0, 1, 1], [1, 1, 0, 0], [1, 0, 0, 1]]
SEQS = [40, 40, 36, 44]


def _vlm_batches(batch_fn):
    return [batch_fn(c, s, seed) for seed, (c, s) in enumerate(zip(COUNTS, SEQS))]


def paligemma():
    return hf_vlm.tiny_paligemma(0)


def paligemma_batches():
    return _vlm_batches(hf_vlm.paligemma_batch)


def gemma3():
    return hf_vlm.tiny_gemma3(0)


def gemma3_batches():
    return _vlm_batches(hf_vlm.gemma3_batch)


def mllama():
    """Mllama with every cross-attention and vision gate at 0.5: Hugging Face initialises them to zero, which makes
    the text blind to the images and the vision gradients zero (a vacuous check)."""
    return hf_vlm.tiny_mllama(0)


def mllama_batches():
    return _vlm_batches(hf_vlm.mllama_batch)


def idefics3():
    return hf_vlm.tiny_idefics3(0)


def idefics3_batches():
    return _vlm_batches(hf_vlm.idefics3_batch)


def llava_next():
    return hf_vlm.tiny_llava_next(0)


def llava_next_batches():
    return _vlm_batches(hf_vlm.llava_next_batch)


def llava_next_instances():
    """LLaVA-NeXT's placeholder tokens per image follow each image's size (``image_sizes``): the instance
    declaration dipc asks for."""
    import dipc
    import torch
    cfg = hf_vlm.tiny_llava_next_config()

    def tokens(batch):
        return torch.tensor([hf_vlm.llava_next_tokens_per_image(cfg, int(h), int(w))
                             for h, w in batch["image_sizes"].tolist()], dtype=torch.long)
    return [dipc.Instances("vision", ("pixel_values", "image_sizes"), cfg.image_token_id, tokens,
                           drop_when_empty=True)]


def llava_onevision():
    return hf_vlm.tiny_llava_onevision(0)


#: images per sample (6 samples, 2 microbatches of 3): a 32x32 image alone in its sample is 5 tiles and 24 tokens,
#: each image of a multi-image sample 1 tile and 5 tokens; [1, 2, 1] in one microbatch is the layout whose image
#: sub-microbatches read another's tile counts before issue 35
ONEVISION_COUNTS = [[1, 2, 0, 1, 0, 1], [0, 0, 0, 1, 2, 1], [2, 1, 1, 1, 0, 0], [1, 2, 1, 0, 0, 0]]


def llava_onevision_batches():
    """Example, then a text-only microbatch first, a two-image sample before single ones, a text-only one last."""
    return [hf_vlm.llava_onevision_batch(c, s, seed) for seed, (c, s) in
            enumerate(zip(ONEVISION_COUNTS, [40, 36, 40, 44]))]


def llava_onevision_instances():
    """The documented declaration: ``pixel_values`` and ``image_sizes`` per image, tokens per image from the
    per-sample ``batch_num_images``, two images per sub-microbatch."""
    return hf_vlm.llava_onevision_instances(sub_microbatch_size=2)


def llava():
    from dipc.models.hf import tiny_llava
    return tiny_llava(0)


def llava_batches():
    import pipeline_cases as pc
    from dipc.models.hf import tiny_llava_config
    cfg = tiny_llava_config()
    size = cfg.vision_config.image_size
    tpi = (size // cfg.vision_config.patch_size) ** 2
    return [pc.vlm_batch(c, s, seed, tpi, cfg.image_token_id, size) for seed, (c, s) in
            enumerate(zip(COUNTS, [3 * tpi, 3 * tpi, 4 * tpi, 3 * tpi + 2]))]


def flux():
    return hf_diffusion.tiny_flux(0)


def flux_batches():
    """Text lengths of CLIP and T5 differ (the model does not tie them)."""
    return [hf_diffusion.flux_batch(4, seed, t5_len=t) for seed, t in enumerate((7, 6, 8, 7))]


def flux_with_ids_batches():
    """``img_ids [H*W/4, 3]`` and ``txt_ids [L, 3]`` in the batch: tensors without a batch dimension."""
    return [hf_diffusion.flux_batch(4, seed, t5_len=t, with_ids=True) for seed, t in enumerate((7, 6, 8, 7))]


def sd3():
    return hf_diffusion.tiny_sd3(0)


def sd3_batches():
    return [hf_diffusion.sd3_batch(4, seed, t5_len=t) for seed, t in enumerate((7, 6, 8, 7))]


#: name -> (model fn, batches fn, compile kwargs), the models the multi-rank test trains
QWEN_IMAGE_HW = ((16, 16), (16, 24), (24, 32))  # 4, 6 and 12 tokens: image sizes differ within every batch
QWEN_VIDEO_FHW = ((4, 16, 16), (2, 16, 24), (4, 24, 16))  # frames, height, width: 8, 6 and 12 tokens
#: videos per sample of each Qwen batch: with COUNTS, the steps' microbatches hold (text only | image + video),
#: (image + video | text only), (image + video | image)
QWEN_VIDEOS = [[0, 1, 1, 0], [0, 0, 1, 0], [0, 1, 0, 0], [1, 0, 0, 0]]


def qwen2_vl():
    return hf_vlm.tiny_qwen2_vl(0)


def _qwen_batches(cfg):
    return [hf_vlm.qwen2_vl_batch(c, s + 32, seed, config=cfg, image_hw=QWEN_IMAGE_HW, videos=v,
                                  video_fhw=QWEN_VIDEO_FHW)
            for seed, (c, v, s) in enumerate(zip(COUNTS, QWEN_VIDEOS, SEQS))]


def qwen2_vl_batches():
    return _qwen_batches(hf_vlm.tiny_qwen2_vl_config())


def qwen2_5_vl():
    return hf_vlm.tiny_qwen2_5_vl(0)


def qwen2_5_vl_batches():
    return _qwen_batches(hf_vlm.tiny_qwen2_5_vl_config())


CASES = {
    "paligemma": ("hf_cases:paligemma", "hf_cases:paligemma_batches", {}),
    "gemma3": ("hf_cases:gemma3", "hf_cases:gemma3_batches", {}),
    "mllama": ("hf_cases:mllama", "hf_cases:mllama_batches", {}),
    "idefics3": ("hf_cases:idefics3", "hf_cases:idefics3_batches", {}),
    "llava_next": ("hf_cases:llava_next", "hf_cases:llava_next_batches", {"instances": "hf_cases:llava_next_instances"}),
    "llava": ("hf_cases:llava", "hf_cases:llava_batches", {"sub_microbatch_size": {"vision": 1}}),
    "llava_onevision": ("hf_cases:llava_onevision", "hf_cases:llava_onevision_batches",
                        {"instances": "hf_cases:llava_onevision_instances"}),
    "qwen2_vl": ("hf_cases:qwen2_vl", "hf_cases:qwen2_vl_batches", {"sub_microbatch_size": {"vision": 1}}),
    "qwen2_5_vl": ("hf_cases:qwen2_5_vl", "hf_cases:qwen2_5_vl_batches", {}),
    "flux": ("hf_cases:flux", "hf_cases:flux_with_ids_batches", {"shared_keys": ["img_ids", "txt_ids"]}),
    "sd3": ("hf_cases:sd3", "hf_cases:sd3_batches", {}),
}

#: the cases only the full suite trains (DIPC_FULL=1): the default suite's 10 minutes hold the others
SLOW = ("gemma3", "mllama", "idefics3", "sd3", "qwen2_5_vl", "llava_next", "paligemma", "flux")
