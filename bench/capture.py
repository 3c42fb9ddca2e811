"""Captures on a stream of dynamic batches, and compile time at the paper's sizes (issue "Capture once").

For each Hugging Face VLM (tiny configs, random init): a stream of ``--batches`` batches of 8 samples, 4
microbatches, 0 to 6 images per sample (0..12 per microbatch; Qwen2-VL's also 0 or 1 video per sample), text-only
microbatches among them, run twice through
every rank of a 2-rank pipeline in this process (:func:`dipc.runtime.run_local`): the captures made, the seconds
spent in them (``torch.export``), and the mean step time of the first (cold) pass and of the second (warm) pass.
Then ``dipc.compile`` of the paper's VLM-S, VLM-M, VLM-L and T2V-S on the meta device (bf16, the paper's PP/TP, the
H800 profile), seconds, with each repeated layer traced once (:mod:`dipc.repeated`) and, for comparison, with every
layer traced.

    python bench/capture.py [--batches 20] [--models llava,llava_next,llava_onevision,qwen2_vl,qwen2_5_vl] [--paper vlm_s,...] [--out F]

Prints a Markdown table (and writes it to ``--out``, and each model's captures over the stream to the same name
with ``.json``, which the README's support table reads: ``bench/support_table.py``).  Timings are this machine's (2 shared cores here): compare
the ratios within one run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))


def _stream(name: str, n: int):
    """``(model, [batches], compile kwargs)``: counts per sample drawn from 0..3 by a seeded generator (every
    fourth batch's first two samples text-only, so text-only microbatches occur)."""
    from dipc.models import hf_vlm

    g = torch.Generator().manual_seed(0)
    counts = []
    for i in range(n):
        c = torch.randint(0, 7, (8,), generator=g).tolist()
        if i % 4 == 0:
            c[0] = c[1] = 0
        counts.append(c)
    if name == "llava":
        import pipeline_cases as pc
        from dipc.models.hf import tiny_llava_config
        cfg = tiny_llava_config()
        tpi = (cfg.vision_config.image_size // cfg.vision_config.patch_size) ** 2
        batches = [pc.vlm_batch(c, tpi * max(c) + 8, i, tpi, cfg.image_token_id, cfg.vision_config.image_size)
                   for i, c in enumerate(counts)]
        return pc.llava(), batches, {"sub_microbatch_size": {"vision": 4}}
    if name == "llava_next":  # images of 16x32, 32x32 and 24x16 pixels: 3 or 5 tiles, 14 to 24 tokens
        import hf_cases
        hw = ((16, 32), (32, 32), (24, 16))
        batches = [hf_vlm.llava_next_batch(c, 24 * sum(c) + 8, i, image_hw=hw) for i, c in enumerate(counts)]
        return hf_vlm.tiny_llava_next(0), batches, {"instances": hf_cases.llava_next_instances()}
    if name == "llava_onevision":
        batches = [hf_vlm.llava_onevision_batch(c, 24 * max(c) + 8, i) for i, c in enumerate(counts)]
        return (hf_vlm.tiny_llava_onevision(0), batches,
                {"instances": hf_vlm.llava_onevision_instances(sub_microbatch_size=4)})
    if name in ("qwen2_vl", "qwen2_5_vl"):  # images of 4, 6 and 12 tokens; 0-1 video per sample, 6-12 tokens
        cfg = hf_vlm.tiny_qwen2_vl_config() if name == "qwen2_vl" else hf_vlm.tiny_qwen2_5_vl_config()
        videos = [[int(x) for x in torch.randint(0, 2, (8,), generator=g)] for _ in counts]  # 0-1 per sample
        for i in range(0, len(counts), 4):
            videos[i][0] = videos[i][1] = 0
        batches = [hf_vlm.qwen2_vl_batch(c, 14 * max(c) + 14 * max(v) + 8, i, config=cfg, videos=v,
                                         image_hw=((16, 16), (16, 24), (24, 32)),
                                         video_fhw=((4, 16, 16), (2, 16, 24), (4, 24, 16)))
                   for i, (c, v) in enumerate(zip(counts, videos))]
        build = hf_vlm.tiny_qwen2_vl if name == "qwen2_vl" else hf_vlm.tiny_qwen2_5_vl
        return build(0), batches, {"sub_microbatch_size": {"vision": 4}}
    raise ValueError(f"unknown model {name!r}")


def run_stream(name: str, n: int) -> dict:
    import dipc
    from dipc.runtime import run_local

    model, batches, kw = _stream(name, n)
    t = time.perf_counter()
    try:
        compiled = dipc.compile(model, batches[0], 2, check=False, **kw)
    except dipc.CaptureError as e:  # the construct the trace stopped at, as the error names it
        import re
        code = re.search(r"in the model's code at [^`]*(`[^`]*`)", str(e))
        return {"model": name, "status": "refused at compile" + (f" at {code.group(1)}" if code else "")}
    compile_s = time.perf_counter() - t
    spent = [0.0]
    real = compiled._capture

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            spent[0] += time.perf_counter() - t0
    compiled._capture = timed
    passes = []
    for _ in range(2):
        t0 = time.perf_counter()
        for b in batches:
            model.zero_grad(set_to_none=True)
            run_local(compiled, b, 4)
        passes.append((time.perf_counter() - t0) / len(batches))
    return {"model": name, "status": "ok", "captures": len(compiled.programs), "capture_s": spent[0],
            "compile_s": compile_s, "cold_step_s": passes[0], "warm_step_s": passes[1],
            "recipe": getattr(compiled, "use_recipe", False)}


def paper_compile(name: str, reuse: bool = True) -> dict:
    """``compiled.compile_seconds`` of the paper setup ``name`` on meta (phase -> seconds, ``"total"``), and
    ``"reused"``: the layers whose ops were copied from their first layer's trace (:mod:`dipc.repeated`); with
    ``reuse=False`` every layer is traced (``DIPC_REUSE_BLOCKS=0``)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import paper
    label = {"vlm_s": "VLM-S", "vlm_m": "VLM-M", "vlm_l": "VLM-L", "t2v_s": "T2V-S"}[name]
    os.environ["DIPC_REUSE_BLOCKS"] = "1" if reuse else "0"
    try:
        compiled = paper.build(label)[0]
    finally:
        os.environ.pop("DIPC_REUSE_BLOCKS")
    return {**compiled.compile_seconds, "reused": compiled.programs[0].capture.reused_layers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--models", default="llava,llava_next,llava_onevision,qwen2_vl,qwen2_5_vl")
    ap.add_argument("--paper", default="vlm_s,vlm_m,vlm_l,t2v_s")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    lines = [f"Stream of {args.batches} batches (8 samples, 4 microbatches, 0-6 images per sample; Qwen2-VL's also 0-1 "
             "video per sample), 2 ranks in one process; cold = first pass over the stream, warm = second.", "",
             "| model | result | captures | s in capture | compile s | cold step s | warm step s | cold / (warm + "
             "compile share) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    streams = {}
    for name in [m for m in args.models.split(",") if m]:
        r = streams[name] = run_stream(name, args.batches)
        if r["status"] != "ok":
            lines.append(f"| {name} | {r['status']} | | | | | | |")
        else:
            ratio = r["cold_step_s"] / (r["warm_step_s"] + r["compile_s"] / args.batches)
            how = " (recipe)" if r["recipe"] else ""
            lines.append(f"| {name}{how} | runs | {r['captures']} | {r['capture_s']:.1f} | "
                         f"{r['compile_s']:.1f} | {r['cold_step_s']:.3f} | {r['warm_step_s']:.3f} | {ratio:.2f} |")
        print(lines[-1], flush=True)
    lines += ["", "| paper setup on meta | dipc.compile s | of which capture (torch.export) | passes | codegen | "
              "layers copied, not traced | dipc.compile s tracing every layer |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for name in [m for m in args.paper.split(",") if m]:
        t, plain = paper_compile(name), paper_compile(name, reuse=False)
        lines.append(f"| {name} | {t['total']:.1f} | {t.get('capture (torch.export)', 0.0):.1f} | "
                     f"{t.get('passes (modality, cost, partition)', 0.0):.1f} | {t.get('codegen (chunk modules)', 0.0):.1f} "
                     f"| {t['reused']} | {plain['total']:.1f} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write("# Captures on a dynamic stream, and compile time at paper scale\n\n`python bench/capture.py "
                    f"--out {args.out}`\n\n" + text + "\n")
        # the README's support table (bench/support_table.py) shows each model's captures over this stream
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump({"batches": args.batches, "captures": {n: r["captures"] for n, r in streams.items()
                                                             if r["status"] == "ok"}}, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
