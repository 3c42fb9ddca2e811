"""The README's table of supported model families, generated from the tests' results.

``python bench/support_table.py --run`` runs ``tests/models/test_hf_models.py`` with ``DIPC_SUPPORT_TABLE`` set, so the
tests write their results (status, largest gradient difference against the unsplit model, compile seconds, captures
made) to ``docs/hf_support.json``; then (and without ``--run``, from the existing file) it renders the table, with
each model's captures over ``bench/capture.py``'s dynamic stream where ``docs/bench_capture.json`` has them, into
README.md between the ``<!-- support-table -->`` markers and prints it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "docs", "hf_support.json")
STREAM = os.path.join(ROOT, "docs", "bench_capture.json")  # written by bench/capture.py --out docs/bench_capture.md

#: test name -> (family, class, what the test exercises)
FAMILIES = {
    "llava": ("LLaVA", "transformers LlavaForConditionalGeneration",
              "list(image_features) fixes the image count in a plain trace: captured through dipc's recipe (one "
              "capture for every image count, one for text-only microbatches), sub-microbatches of 1 image"),
    "llava_next": ("LLaVA-NeXT", "transformers LlavaNextForConditionalGeneration",
                   "image_sizes read in Python (tiles per image, grid crop): captured through dipc's anyres recipe "
                   "(the feature rows of each placeholder computed per microbatch by a custom op; one capture for "
                   "every image count and size, one for text-only microbatches); tokens per image follow each "
                   "image's size (declared with Instances(tokens_per_instance=fn))"),
    "llava_onevision": ("LLaVA-OneVision", "transformers LlavaOnevisionForConditionalGeneration",
                        "the per-sample batch_num_images decides each image's tiles (anyres when alone in its sample, "
                        "its base tile in a multi-image one), image_sizes the crop, anyres_max the bilinear "
                        "down-scaling: captured through dipc's anyres recipe, which reads them per microbatch at run "
                        "time, so image sub-microbatches cut samples; tokens per image declared with "
                        "Instances(tokens_per_instance=fn)"),
    "paligemma": ("PaliGemma", "transformers PaliGemmaForConditionalGeneration",
                  "prefix/suffix token_type_ids; the model's token-count check placed at the merge"),
    "gemma3": ("Gemma 3", "transformers Gemma3ForConditionalGeneration",
               "vmap-built bidirectional image mask (made functional at capture); trace follows the hash seed"),
    "idefics3": ("Idefics3 / SmolVLM", "transformers Idefics3ForConditionalGeneration",
                 "per-sample padded images; the count of real images is a data-dependent size computed from the "
                 "batch"),
    "mllama": ("Mllama (Llama 3.2 Vision)", "transformers MllamaForConditionalGeneration",
               "cross-attention to per-sample padded image tiles, gates set non-zero; in-place mask writes"),
    "flux": ("Flux", "diffusers FluxTransformer2DModel + CLIPTextModel + T5EncoderModel",
             "two block lists (double and single stream), img_ids/txt_ids without a batch dimension"),
    "sd3": ("Stable Diffusion 3", "diffusers SD3Transformer2DModel + 2 CLIPTextModelWithProjection + T5EncoderModel",
            "three text encoders, joint attention blocks"),
    "qwen2_vl": ("Qwen2-VL", "transformers Qwen2VLForConditionalGeneration",
                 "patch-packed pixel_values with image_grid_thw values read by the vision rotary positions, the "
                 "per-frame attention split and M-RoPE: captured through dipc's recipe (custom ops compute them per "
                 "(sub-)microbatch; an absent kind runs as 0 instances, so one capture serves every count, size and "
                 "mix of images and videos); videos a second instance kind of the vision tower; sub-microbatches of "
                 "1 image or video"),
    "qwen2_5_vl": ("Qwen2.5-VL", "transformers Qwen2_5_VLForConditionalGeneration",
                   "Qwen2-VL's constructs plus windowed vision attention (the patch rows permuted into windows by "
                   "grid values): captured through the same recipe"),
}


def render(results: dict, stream: dict | None = None) -> str:
    """The table's Markdown from the tests' ``results`` and ``stream`` (``docs/bench_capture.json``: captures over
    the dynamic stream of ``bench/capture.py``)."""
    stream = stream or {}
    lines = ["| family | class | result on 2 ranks, 3 steps vs the unsplit model | compile s | exercises / why not |",
             "| --- | --- | --- | --- | --- |"]
    for key, (family, cls, what) in FAMILIES.items():
        r = results.get(key)
        if r is None:
            status = "not run"
        elif r["status"] == "tested":
            status = f"equal (largest gradient difference {r['grad_err']:.1e}; {r['captures']} captures"
            if key in stream.get("captures", {}):
                status += f"; {stream['captures'][key]} over bench/capture.py's {stream['batches']}-batch stream"
            status += ")"
        else:
            status = r["status"]
        why = r.get("why", what) if r else what
        lines.append(f"| {family} | {cls} | {status} | {r.get('compile_s', '') if r else ''} | {why} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="store_true", help="run tests/models/test_hf_models.py first (about 3-4 minutes)")
    args = ap.parse_args()
    if args.run:
        if os.path.exists(RESULTS):
            os.remove(RESULTS)
        env = dict(os.environ, DIPC_SUPPORT_TABLE=RESULTS)
        subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/models/test_hf_models.py"], cwd=ROOT, env=env,
                       check=True)
    results = json.load(open(RESULTS))
    table = render(results, json.load(open(STREAM)) if os.path.exists(STREAM) else None)
    readme = os.path.join(ROOT, "README.md")
    text = open(readme).read()
    new = re.sub(r"(<!-- support-table -->\n).*?(<!-- /support-table -->)",
                 lambda m: m.group(1) + table + "\n" + m.group(2), text, flags=re.S)
    if new != text:
        with open(readme, "w") as f:
            f.write(new)
    print(table)


if __name__ == "__main__":
    main()
