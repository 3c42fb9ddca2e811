"""Hugging Face models nobody here wrote, given to dipc.compile unmodified (the wrapper of the diffusion models only
computes the flow-matching loss from their outputs, as a training step does), trained on 2 gloo ranks for 3 steps
against the unsplit model (dipc.testing.reference_check: loss, every parameter gradient, parameters after AdamW,
the gathered state dict).  One spawn runs every model, so transformers is imported once per rank.

The results are written to ``docs/hf_support.json`` when ``DIPC_SUPPORT_TABLE`` names that file (the README's
support table is generated from it by ``python bench/support_table.py``).
"""
import json
import os
import time

import pytest

from dipc.launch import spawn
from dipc.testing import reference_check, resolve

pytestmark = pytest.mark.hf


def _train_all(rank, world, names):
    import hf_cases
    out = {}
    for name in names:
        model_fn, batches_fn, kwargs = hf_cases.CASES[name]
        if isinstance(kwargs.get("instances"), str):
            kwargs = dict(kwargs, instances=resolve(kwargs["instances"])())
        t = time.perf_counter()
        # each rank compares every gradient with the unsplit model itself: the compile-time debug check would
        # repeat that work
        # param_atol: attention key biases (CLIP, SigLIP) have an exactly-zero gradient (softmax ignores them), so
        # AdamW turns rounding noise of ~1e-10 into updates of up to lr * eps-limited size; gradients themselves are
        # compared at rtol 1e-5 / atol 1e-6
        rep = reference_check(rank, world, model_fn, (), batches_fn, (), compile_kwargs=dict(kwargs, check=False),
                              n_microbatches=2, check_state_dict=(name in ("paligemma", "flux")), param_atol=1e-4)
        out[name] = {"loss": rep["loss"], "grad_err": rep["grad_err"], "n_params": rep["n_params"],
                     "seconds": time.perf_counter() - t, "compile_s": rep["compile_s"],
                     "captures": rep["n_programs"]}
    if "llava_onevision" in names:
        out["onevision_sub_sizes"] = _onevision_sub_sizes(rank)
    if "qwen2_vl" in names:
        out["qwen_sub_sizes"] = _qwen_one_capture(rank, world)  # on the last rank, beside OneVision's on rank 0
    if "llava" in names:
        out["llava_eval"] = _llava_eval_outputs(rank, world)
        if os.environ.get("DIPC_FULL") == "1":  # per-layer strategies run on the reference VLM by default
            out["llava_recompute"] = _llava_per_layer_recompute(rank, world)
    return out


def _llava_per_layer_recompute(rank, world):
    """Issue 8 on a model nobody here wrote: HF LLaVA cut as one segment (Megatron VPP's partition) under 1F1B,
    every forward-backward pair given a per-layer strategy in turn ("recompute:<all layers>", each layer its own
    checkpoint; "recompute:1"; "recompute:k/k", one checkpoint over them; "recompute:k/2"), runs with the unsplit
    model's loss and every gradient, in two batch orders (a text-only microbatch first, then an image first).  Rank 0
    only
    (run_local runs every rank in-process); returns the batches checked."""
    if rank != 0:
        return 0
    import dataclasses

    import pipeline_cases as pc
    import torch

    import dipc
    from dipc.runtime import run_local

    torch.manual_seed(0)
    model = pc.llava()
    batches = pc.llava_batches_mixed()
    c = dipc.compile(model, batches[0], world, check=False, one_segment=True, balance="params",
                     chunks_per_rank={"model": 2}, device="h800")
    seen = 0
    for b in (batches[2], batches[1]):
        _, plan = dipc.simulate(c, b, 4, schedule="1f1b")
        layers = {}  # per chunk, the fewest layers over the captures its microbatches run (image counts differ)
        for prog in c.programs:
            for k, cm in prog.chunks.items():
                layers[k] = min(layers.get(k, cm.n_layers), cm.n_layers)
        assert max(layers.values()) >= 2, layers

        def strategy(a):
            n = layers[a.chunk]
            return [f"recompute:{n}", "recompute:1", f"recompute:{n}/{n}", f"recompute:{n}/{min(2, n)}"][a.mb % 4]

        plan.ranks = [[dataclasses.replace(a, strategy=strategy(a)) if a.kind in ("F", "B") else a for a in acts]
                      for acts in plan.ranks]
        model.zero_grad(set_to_none=True)
        ref = model(**b).loss
        ref.backward()
        want = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        loss, _ = run_local(c, b, 4, plan, schedule="1f1b")
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
        for k, p in model.named_parameters():
            if k in want:
                torch.testing.assert_close(p.grad, want[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
            else:
                assert p.grad is None or not p.grad.any(), k
        seen += 1
    return seen


def _onevision_sub_sizes(rank, pp=3):
    """Issue 35 §1-2 on LLaVA-OneVision: ``batch_num_images`` (per sample) decides each image's tiles and
    ``image_sizes`` its grid's crop, so image sub-microbatches must see their own images' values.  Images of four
    original sizes (crops in both directions) and a config whose ``anyres_max_1`` down-scales every tiled image's
    grid (bilinear), through dipc's anyres recipe (:mod:`dipc.recipes_anyres`).  A ``pp``-rank pipeline (run in this
    process) at sub-microbatch sizes 1, 2 and 3 equals the unsplit model's loss and every gradient on a microbatch
    holding [1, 2, 1] images (5, 1, 1 and 5 tiles), with a text-only microbatch first and then last, and on two
    more batches of other counts; the whole run makes 2 captures (text only, images).  Rank 0 only; returns the
    (size, batch) pairs checked."""
    if rank != 0:
        return 0
    import dataclasses

    import torch

    import dipc
    from dipc.models import hf_vlm
    from dipc.testing import local_check

    torch.manual_seed(0)
    cfg = hf_vlm.tiny_llava_onevision_config()
    cfg.vision_aspect_ratio = "anyres_max_1"
    model = hf_vlm.tiny_llava_onevision(0, cfg)
    hw = ((32, 32), (20, 32), (32, 24), (16, 32))
    batches = [hf_vlm.llava_onevision_batch(c, s, seed, config=cfg, image_hw=hw) for seed, (c, s) in enumerate(
        [([1, 2, 0, 1, 0, 1], 40), ([0, 0, 0, 1, 2, 1], 36), ([2, 1, 1, 1, 0, 0], 40), ([1, 2, 1, 0, 0, 0], 44),
         ([3, 1, 0, 2, 1, 1], 44)])]
    c = dipc.compile(model, batches[0], pp, instances=hf_vlm.llava_onevision_instances(cfg, 2), check=False)
    assert c.use_recipe, "the anyres recipe was dropped: it did not reproduce the model's loss on the example"
    inst = c.batch_spec.instances[0]
    seen = 0
    # the recipe reads batch_num_images at run time, per microbatch, so sub-microbatches cut samples: {0, 1} and
    # {2, 3} at size 2 is the issue's case (image 2 read image 0's tile count when the trace held the values)
    for size, subs in ((1, [(0, 1), (1, 2), (2, 3), (3, 4)]), (2, [(0, 2), (2, 4)]), (3, [(0, 2), (2, 4)])):  # near-equal
        c.batch_spec.instances = [dataclasses.replace(inst, sub_microbatch_size=size)]
        for b, images in ((batches[1], 1), (batches[3], 0)):  # [0, 0, 0 | 1, 2, 1], then [1, 2, 1 | 0, 0, 0]
            mbs = c.batch_spec.split(b, 2)
            assert mbs[images].subs["vision"] == subs and mbs[1 - images].subs["vision"] == [], (size, mbs)
            local_check(model, c, b, 2)
            seen += 1
    # and a batch whose largest tile count (3: 16x16 images) is not the example's (5): the processor pads each batch
    # to its own
    small = hf_vlm.llava_onevision_batch([1, 0, 1, 2, 0, 1], 40, 7, config=cfg, image_hw=((16, 16),))
    assert small["pixel_values"].shape[1] == 3 and batches[0]["pixel_values"].shape[1] == 5
    for b in (batches[2], batches[4], small):
        local_check(model, c, b, 2)
    assert len(c.programs) == 2, f"{len(c.programs)} captures for 6 batches of 0-8 images (want 2)"
    return seen


def _qwen_one_capture(rank, world):
    """Issue 35 §2-3 on Qwen2-VL and Qwen2.5-VL given unmodified (patch-packed ``pixel_values``,
    ``image_grid_thw`` values read by the vision rotary positions, the per-frame attention split, the window
    permutation and M-RoPE; videos as a second instance kind of the vision modality, with Qwen2.5-VL's
    ``second_per_grid_ts``): a 2-rank pipeline (run in this process) at sub-microbatch sizes 1, 2 and 3 (Qwen2.5-VL:
    2; the default suite: 1 and 3, and Qwen2.5-VL on two microbatch pairs), and in the full suite (Qwen2-VL) a
    3-rank one at 2, equal the unsplit model on microbatches of 0 to 6 images of three sizes and 0 to
    3 videos of three shapes, multi-image samples, a text-only microbatch first and then last, video-only and
    image-only ones; 2 captures in all (text only; the vision graph, which runs an absent kind as 0 instances, in
    microbatches and sub-microbatches alike), whatever the counts and mixes of kinds; and Qwen2.5-VL with right-padded samples (``attention_mask``).  The last rank
    only (rank 0 checks LLaVA-OneVision meanwhile); returns the checks made."""
    if rank != world - 1:
        return 0
    import dataclasses

    import hf_cases
    import torch

    import dipc
    from dipc.models import hf_vlm
    from dipc.testing import local_check

    seen, full = 0, os.environ.get("DIPC_FULL") == "1"
    spec = [([1, 2, 0, 1], [0, 1, 1, 0], 64), ([0, 0, 2, 1], [0, 0, 1, 2], 96), ([3, 1, 0, 0], [0, 0, 0, 0], 64),
            ([0, 0, 0, 0], [1, 0, 2, 1], 96), ([2, 1, 3, 0], [1, 0, 0, 1], 112)]
    for build, cfg_fn in ((hf_vlm.tiny_qwen2_vl, hf_vlm.tiny_qwen2_vl_config),
                          (hf_vlm.tiny_qwen2_5_vl, hf_vlm.tiny_qwen2_5_vl_config)):
        model, cfg = build(0), cfg_fn()
        batches = [hf_vlm.qwen2_vl_batch(c, s, i, config=cfg, image_hw=hf_cases.QWEN_IMAGE_HW, videos=v,
                                         video_fhw=hf_cases.QWEN_VIDEO_FHW) for i, (c, v, s) in enumerate(spec)]
        # the 3-rank pipeline runs in the full suite only (DIPC_FULL=1)
        for pp in ((2, 3) if cfg.model_type == "qwen2_vl" and full else (2,)):
            torch.manual_seed(0)
            c = dipc.compile(model, batches[0], pp, check=False)
            assert c.use_recipe, "the Qwen2-VL capture recipe was dropped"
            assert [i.keys[0] for i in c.batch_spec.instances] == ["pixel_values", "pixel_values_videos"]
            kinds = c.batch_spec.instances
            # the default suite: Qwen2-VL at 1 and 3 (2 is Qwen2.5-VL's), Qwen2.5-VL on a video-and-image and a
            # text-first microbatch pair; every size and batch in the full suite
            sizes = (1, 2, 3) if full else (1, 3)
            for size in (sizes if pp == 2 and cfg.model_type == "qwen2_vl" else (2,)):
                c.batch_spec.instances = [dataclasses.replace(i, sub_microbatch_size=size) for i in kinds]
                for b in (batches[1:] if full or cfg.model_type == "qwen2_vl" else batches[1:3]):
                    local_check(model, c, b, 2)
                    seen += 1
            if cfg.model_type == "qwen2_5_vl":  # 8x8 images: 4 patch rows, under the 8 the window trace derives
                local_check(model, c, hf_vlm.qwen2_vl_batch([1, 0, 2, 0], 40, 9, config=cfg, image_hw=((8, 8),)), 2)
                seen += 1
            assert len(c.programs) == 2, f"{type(model).__name__}: {len(c.programs)} captures (want 2)"
            assert all(i.drop_with_modality for i in c.batch_spec.instances)
    # right padding (attention_mask, padded labels ignored as a collator does): M-RoPE skips the padded tokens
    padded = []
    for b, pad in ((batches[0], (0, 5)), (batches[2], (3, 7))):  # text-only samples: no placeholder is padding
        b = dict(b, attention_mask=torch.ones_like(b["input_ids"]))
        b["attention_mask"][pad[0], -pad[1]:] = 0
        padded.append(dict(b, labels=b["labels"].masked_fill(b["attention_mask"] == 0, -100)))
    local_check(model, dipc.compile(model, padded[0], 2, check=False), padded[1], 2)
    return seen + 1


def _llava_eval_outputs(rank, world):
    """Forward-only evaluation handing back Hugging Face LLaVA's logits (issue 11, point 1): on the last rank the
    whole batch's ``[B, S, vocab]`` logits equal the unsplit model's under no_grad, with the labels (loss too) and
    without them (no loss; the labels are filled with the ignore index), text-only microbatches first."""
    import pipeline_cases as pc
    import torch

    import dipc

    torch.manual_seed(0)
    model = pc.llava()
    batches = pc.llava_batches_mixed()
    compiled = dipc.compile(model, batches[0], world, check=False)
    assert compiled.outputs == ["logits"], compiled.outputs
    pipe = compiled.runtime(n_microbatches=2, timeout=120)
    pipe.eval()
    model.eval()
    seen = 0
    for b in (batches[2], batches[1]):  # batches[2]: its first microbatch has no image
        with torch.no_grad():
            want = model(**b)
        loss, got = pipe.eval_step(b, outputs=["logits"])
        torch.testing.assert_close(loss, want.loss.float(), rtol=1e-5, atol=1e-6)
        unlabelled = {k: v for k, v in b.items() if k != "labels"}
        none, got2 = pipe.eval_step(unlabelled, outputs="logits", n_microbatches=4)
        assert none is None
        if rank == world - 1:
            torch.testing.assert_close(got["logits"], want.logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got2["logits"], want.logits, rtol=1e-5, atol=1e-5)
            seen += 1
        else:
            assert got is None and got2 is None
    # an unknown output and labels left out without outputs are refused on every rank
    import pytest
    with pytest.raises(ValueError, match="hidden_states"):
        pipe.eval_step(batches[1], outputs=["hidden_states"])
    with pytest.raises(ValueError, match="no 'labels'"):
        pipe.eval_step({k: v for k, v in batches[1].items() if k != "labels"})
    # and the pipeline still trains after them
    pipe.train()
    model.train()
    pipe.step(batches[3])
    return seen


def _check(names):
    reports = spawn(_train_all, 2, (names,), timeout=850)
    for name in names:
        a, b = reports[0][name], reports[1][name]
        assert a["loss"] == b["loss"], f"{name}: ranks disagree on the loss"
        assert a["n_params"] > 0 and b["n_params"] > 0, f"{name}: a rank holds no parameter"
    if "llava_onevision" in names:
        assert reports[0]["onevision_sub_sizes"] == 6, "LLaVA-OneVision's sub-microbatch sizes were not all checked"
    if "qwen2_vl" in names:
        want = 22 if os.environ.get("DIPC_FULL") == "1" else 12
        assert reports[-1]["qwen_sub_sizes"] == want, "Qwen2-VL's sub-microbatch sizes were not all checked"
    if "llava" in names:
        assert [r["llava_eval"] for r in reports] == [0, 2], "the logits were not compared on the last rank"
        if os.environ.get("DIPC_FULL") == "1":
            assert reports[0]["llava_recompute"] == 2, "per-layer recompute was not checked on both batch orders"
    _record({n: {"status": "tested", "grad_err": max(r[n]["grad_err"] for r in reports),
                 "compile_s": round(reports[0][n]["compile_s"], 1), "captures": reports[0][n]["captures"],
                 "seconds": round(reports[0][n]["seconds"], 1)} for n in names})


@pytest.mark.timeout(900)
def test_hf_models_match_the_unsplit_model_on_2_ranks():
    """The default suite's share: LLaVA-OneVision (per-sample image counts that decide each image's tiles), LLaVA
    (re-captured image counts) and Qwen2-VL (patch-packed images and videos, one capture per set of kinds;
    Qwen2.5-VL is checked locally here and trained in the full suite).  Diffusion in the default suite is the
    reference T2V's (tests/runtime/test_pipeline.py); the Flux transformer trains in the full suite (the default
    suite's 10 minutes)."""
    import hf_cases
    _check([n for n in hf_cases.CASES if n not in hf_cases.SLOW])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_more_hf_models_match_the_unsplit_model_on_2_ranks():
    """The full suite's rest (DIPC_FULL=1): Gemma 3, Mllama's cross-attention, Idefics3's per-sample padded images,
    SD3, Qwen2.5-VL, PaliGemma, LLaVA-NeXT (per-image token counts) and Flux (its state dict loaded back into the
    unsplit model)."""
    import hf_cases
    _check(list(hf_cases.SLOW))


def _record(rows):
    """Merge ``rows`` into the JSON file named by ``DIPC_SUPPORT_TABLE`` (the README's support table is made from
    it by ``python bench/support_table.py``)."""
    path = os.environ.get("DIPC_SUPPORT_TABLE")
    if not path:
        return
    old = json.load(open(path)) if os.path.exists(path) else {}
    old.update(rows)
    with open(path, "w") as f:
        json.dump(old, f, indent=1, sort_keys=True)


@pytest.mark.slow  # 12 s: the default suite's 10 minutes
def test_tokens_per_image_are_read_from_each_familys_config():
    """Issue 35 §4: Idefics2's perceiver resamples every image to ``resampler_n_latents`` tokens (8 here, where the
    patch grid would say 16), and the pipeline of such a model equals the unsplit one; InternVL's ``[h, w]``-valued
    ``image_size`` / ``patch_size`` give ``(size / patch)^2 * downsample_ratio^2`` tokens per tile (an internal
    TypeError before); a non-square grid is refused naming the config fields."""
    import types

    import torch
    from transformers import Idefics2Config, Idefics2ForConditionalGeneration, InternVLConfig, MistralConfig

    import dipc
    from dipc.families import _auto_instances
    from dipc.testing import local_check

    text = MistralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    cfg = Idefics2Config(vision_config=dict(image_size=16, patch_size=4, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=2),
                         perceiver_config=dict(resampler_n_latents=8, resampler_depth=1, resampler_n_heads=2,
                                               resampler_head_dim=8, num_key_value_heads=1, hidden_size=32),
                         text_config=text.to_dict(), image_token_id=127, use_cache=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Idefics2ForConditionalGeneration(cfg).float().train()

    def batch(counts, seq, seed):  # per-sample padded images, 8 placeholder tokens each
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, 100, (len(counts), seq), generator=g)
        pv = torch.randn(len(counts), max(counts), 3, 16, 16, generator=g)
        mask = torch.zeros(len(counts), max(counts), 16, 16, dtype=torch.bool)
        for b, k in enumerate(counts):
            ids[b, 1:1 + 8 * k] = 127
            mask[b, :k] = True
            pv[b, k:] = 0
        return {"input_ids": ids, "labels": ids.masked_fill(ids == 127, -100), "pixel_values": pv,
                "pixel_attention_mask": mask}

    ex = batch([1, 2, 0, 1], 30, 0)
    assert _auto_instances(model, ex, None)[0].tokens_per_instance == 8
    wrong = dict(ex, input_ids=ex["input_ids"].clone())
    wrong["input_ids"][0, 7:9] = 5  # a processor giving 6 placeholder tokens per image: the read value does not fit
    with pytest.raises(dipc.BatchError, match=r"dipc read this from Idefics2ForConditionalGeneration's config \(8 "
                                              r"placeholder tokens per vision instance.*dipc.Instances\('vision'"):
        dipc.compile(model, wrong, 2)
    local_check(model, dipc.compile(model, ex, 2), batch([0, 0, 1, 2], 32, 1), 2)

    def internvl(size, patch):
        c = InternVLConfig(vision_config=dict(image_size=size, patch_size=patch, hidden_size=32,
                                              intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
                           image_token_id=127, downsample_ratio=0.5)
        return _auto_instances(types.SimpleNamespace(config=c), {"pixel_values": torch.zeros(1, 3, 16, 16)}, None)

    assert internvl([16, 16], [4, 4])[0].tokens_per_instance == 4
    assert internvl([448, 448], [14, 14])[0].tokens_per_instance == 256
    with pytest.raises(dipc.BatchError, match=r"vision_config.image_size=\[16, 32\] with patch_size=\[4, 4\] gives "
                                              r"a 4x8 patch grid"):
        internvl([16, 32], [4, 4])


def test_hf_llava_one_capture_serves_every_image_count():
    """Issue 35 §2 for Hugging Face LLaVA: traced through its capture recipe (``dipc.recipes``: the vision tower on
    all images at once, dipc's merge), the image count stays symbolic, so microbatches of 1 to 6 images (and their
    sub-microbatches) run one capture, text-only microbatches a second; every step equals the unsplit model.  Each
    capture traces its vision and text layers once and copies the rest (issue 35 §5)."""
    import pipeline_cases as pc
    import torch

    import dipc
    from dipc.testing import local_check

    torch.manual_seed(0)
    model = pc.llava()
    batches = pc.llava_batches_mixed()
    c = dipc.compile(model, batches[1], 2, sub_microbatch_size={"vision": 2}, check=False)
    assert c.use_recipe and ("pixel_values", 0) not in c.specialized
    vc = model.config.vision_config
    tpi, size = (vc.image_size // vc.patch_size) ** 2, vc.image_size
    seen = set()
    for counts in ([0, 0, 1, 2], [3, 1, 0, 2], [2, 2, 2, 0], [1, 0, 0, 0]):
        b = pc.vlm_batch(counts, tpi * max(counts) + 6, sum(counts), tpi, model.config.image_token_id, size)
        local_check(model, c, b, 2)
        seen.update(sum(counts[i:i + 2]) for i in (0, 2))
    assert len(seen) >= 4 and len(c.programs) <= 2, (sorted(seen), len(c.programs))
    # each capture copied its repeated layers from their first layer's trace (dipc.repeated), as equal as traced
    assert all(p.capture.reused_layers >= 1 for p in c.programs), [p.capture.reused_layers for p in c.programs]
