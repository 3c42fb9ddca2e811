"""The paper benchmark: every schedule template against DIP at the paper's scale, on dipc's simulator.

    python bench/paper.py [--out docs/benchmarks.md] [--models VLM-S,VLM-M,VLM-L,T2V-S,T2V-L] [--microbatches 16,32,64]
                          [--quick]

What it does (shared/PAPER.md §3; issue 8 scope 7), all on the H800 profile (``dipc/sim/profiles/h800.json``: datasheet
rates, the paper-fitted small-matrix efficiency curve, 80 GB):

* builds each model of Table 3 on the meta device in bf16 (no weight is materialised) and compiles it for the
  paper's PP and TP (``dipc.compile(model, example, pp_size=P, tp_size=T, device="h800")``);
* generates batches from the paper's published statistics (:func:`dipc.models.data.paper_vlm_batch`: sequences
  packed to 8192 tokens, 169 tokens per 728 px image, <= 48 images per sequence, the mixed / LAION-like /
  OBELICS-like sources; T2V: :func:`t2v_paper_batch`), one packed sequence (VLM) or one clip group (T2V) per
  microbatch;
* plans and simulates one step per (model, microbatch count, schedule) under the 80 GB limit
  (``dipc.simulate(compiled, batch, n, schedule=...)``), every template with the recompute it needs to fit, and
  the one-segment baselines (``dipc.compile(..., one_segment=True)``: Megatron VPP with chunks balanced by
  parameters, nnScaler* by time) with 1F1B;
* the memory strategies: DIP per VLM against its unlimited-memory bound, with the strategies offered growing
  (recompute only, + op-selective, + offload; ``bench/memory_strategies.py``);
* the ablation ladder (Megatron VPP -> + modality-aware partition -> + DIP interleaving -> + MCTS -> + the
  per-layer memory ILP), the sub-microbatch sweep B in {4, 8, 12, 16, 32} (VLM-S), the rank-0 memory timeline of
  Megatron (1F1B), Optimus and DIP (VLM-M, the paper's memory figure; PNG), DIP against Optimus at Optimus' own
  peak and the rise-and-fall dynamic trace (40 iterations; PNG);
* writes tables (and the plots) to ``--out`` with the paper's figures beside them.

Real execution against torch.distributed.pipelining is ``bench/torch_compare.py``.  T2V-S microbatches are uniform
here (one 16 s clip group each; dipc batches one latent shape), so its dynamicity is the caption length only.

Runs in about 20 minutes on 2 cores (compiling the five models three ways on meta is most of it).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import dipc  # noqa: E402
from dipc.planner.planning import SEARCH_SHARE  # noqa: E402

#: Table 3: name -> (config factory name, PP, TP)
SETUPS = {"VLM-S": ("vlm_s", 4, 4), "VLM-M": ("vlm_m", 4, 8), "VLM-L": ("vlm_l", 8, 8), "T2V-S": ("t2v_s", 4, 4),
          "T2V-L": ("t2v_l", 8, 8)}
GB = 1e9
PAPER = {
    "gain_vlm": "+15.6% to +76.2% throughput over Megatron-LM, nnScaler*, Optimus (VLM-S/M/L)",
    "gain_t2v": "+36.6% to +97.3% over Megatron-LM, nnScaler* (T2V-S/L)",
    "ablation": [("Vanilla Megatron-LM", 26.13), ("+ modality-aware partitioner", 22.27),
                 ("+ pipeline stage interleaving", 18.81), ("+ segment reordering (MCTS)", 17.61),
                 ("+ per-layer memory optimisation", 16.05)],
}


def t2v_paper_batch(cfg, n_rows: int, seed: int, seconds: float = 16.0) -> dict:
    """T2V microbatches at the paper's scale (PAPER.md §3.2: 16 fps, <= 16 s): ``n_rows`` clip groups of
    ``seconds`` of video each, latents of the config's largest size ``[n_rows, C, F, H, W]`` on meta (dipc batches one
    latent shape), captions of 1..``cfg.max_text_len`` tokens (uniform; padded to the longest)."""
    g = torch.Generator().manual_seed(seed)
    L = cfg.max_text_len
    lengths = torch.randint(1, L + 1, (n_rows,), generator=g)
    ids = torch.full((n_rows, int(lengths.max())), cfg.pad_token_id, dtype=torch.long)
    for b, n in enumerate(lengths.tolist()):
        ids[b, 0] = cfg.bos_token_id
        ids[b, 1:n] = torch.randint(3, cfg.vocab_size, (n - 1,), generator=g)
    shape = (n_rows, *cfg.latent_shape)
    return {"input_ids": ids, "latents": torch.empty(shape, device="meta", dtype=torch.bfloat16),
            "noise": torch.empty(shape, device="meta", dtype=torch.bfloat16),
            "timesteps": torch.rand(n_rows, generator=g).to(torch.bfloat16)}


def _to_meta(batch):
    return {k: v.to("meta") for k, v in batch.items()}


#: microbatch counts a model runs at by default (others: all of ``--microbatches``)
MICROBATCHES = {"T2V-L": (16, 32)}

#: the baselines that cut the model as one segment (``dipc.compile(..., one_segment=True)``), run with 1F1B:
#: name -> (balance, chunks per rank).  Megatron-LM's VPP splits layers by parameter count (2 virtual stages per
#: rank here; the paper does not give its VPP size); nnScaler* balances by time, one chunk per rank.
ONE_SEGMENT = {"megatron-vpp": ("params", 2), "nnscaler*": ("time", 1)}


def build(name: str, b_i: int | None = None, baseline: str | None = None):
    """``(compiled, batch_fn, compile_s)`` for setup ``name``: the bf16 model on meta compiled at the paper's PP/TP
    on the H800 profile (``baseline``: one of :data:`ONE_SEGMENT`'s partitions instead of DIP's);
    ``batch_fn(n, seed, mix)`` makes a batch of ``n`` microbatches."""
    from dipc.models import configs
    from dipc.models.data import paper_vlm_batch
    factory, pp, tp = SETUPS[name]
    cfg = getattr(configs, factory)()
    model = configs.build_on_meta(cfg).to(torch.bfloat16)
    if name.startswith("VLM"):
        def batch_fn(n, seed, mix="mixed"):
            b = paper_vlm_batch(cfg, n, seed, mix)
            b["pixel_values"] = b["pixel_values"].to(torch.bfloat16)
            return b
        example = _to_meta(batch_fn(1, 0))
        kw = {"sub_microbatch_size": {"vision": b_i}} if b_i else {}
    else:
        def batch_fn(n, seed, mix=None):
            return t2v_paper_batch(cfg, n, seed)
        example = _to_meta(batch_fn(1, 0))
        kw = {}
    if baseline is not None:
        balance, v = ONE_SEGMENT[baseline]
        kw = {"one_segment": True, "balance": balance, "chunks_per_rank": {"model": v}}
    t = time.perf_counter()
    compiled = dipc.compile(model, example, pp, tp_size=tp, device="h800", sequence_parallel=tp > 1, **kw)
    return compiled, batch_fn, time.perf_counter() - t


def run(compiled, batch, n, schedule, memory_limit=None, label=None, **planning):
    t = time.perf_counter()
    res, plan = dipc.simulate(compiled, batch, n, schedule=schedule, memory_limit=memory_limit, **planning)
    return {"schedule": label or schedule, "time": res.iteration_time, "bound": res.bound, "ratio": res.bound_ratio,
            "peak": max(res.peak_memory), "recomputed": res.recomputed,
            "partly": plan.simulated.get("recomputed_partly", 0), "plan_s": time.perf_counter() - t,
            "res": res, "search": plan.simulated.get("search")}


def fluctuation(timeline, horizon: float) -> float:
    """Time-weighted standard deviation (bytes) of a rank's memory over ``[0, horizon]``."""
    pts = sorted(timeline)
    area = sq = 0.0
    for (t0, v), (t1, _) in zip(pts, pts[1:] + [(horizon, pts[-1][1])]):
        dt = max(0.0, min(t1, horizon) - t0)
        area += v * dt
        sq += v * v * dt
    mean = area / horizon
    return max(0.0, sq / horizon - mean * mean) ** 0.5


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="markdown file to write (default: print only)")
    ap.add_argument("--models", default="VLM-S,VLM-M,VLM-L,T2V-S,T2V-L")
    ap.add_argument("--microbatches", default="16,32,64")
    ap.add_argument("--quick", action="store_true", help="VLM-S at 16 microbatches only, no sweep")
    ap.add_argument("--dip-budget", type=float, default=5.0,
                    help="seconds of DIP's MCTS search (seed 0) in the main table's dip rows (0: the interleaver alone)")
    args = ap.parse_args(argv)
    args.microbatches_given = any(a.startswith("--microbatches") for a in (argv if argv is not None else sys.argv))
    models = ["VLM-S"] if args.quick else args.models.split(",")
    mbs = [16] if args.quick else [int(x) for x in args.microbatches.split(",")]
    lines: list[str] = []

    def out(s=""):
        print(s, flush=True)
        lines.append(s)

    out("# The paper benchmark: schedule templates vs DIP on dipc's simulator")
    out()
    out(f"Command: `python bench/paper.py{' --quick' if args.quick else ''}`. H800 profile (80 GB; datasheet rates, "
        "small-matrix efficiency curve fitted to the paper's B_i figures), bf16 models on the meta device at the "
        "paper's PP/TP (Table 3), batches from the paper's published statistics (one packed 8192-token sequence "
        "per VLM microbatch, mixed sources; T2V: one 16 s clip group per microbatch).  Every plan is held to 80 GB "
        "per GPU.  Memory strategies per forward-backward pair: keep, per-layer recompute (each of the chunk's "
        "first k layers its own checkpoint, rebuilt one at a time) or full recompute (the chunk as one region); the "
        "static templates choose one per chunk for all microbatches (as their users set Megatron's recompute flags: "
        "whole chunks at each peak, then the fewest layers that fit, by the ILP), "
        "Optimus and DIP per pair (DIP's per-rank memory ILP, PAPER.md §2.5).  `megatron-vpp` and `nnscaler*` cut "
        "the model as one segment (`dipc.compile(..., one_segment=True)`: chunks mix modalities), balanced by "
        "parameters (2 chunks per rank) and by time (1 per rank), and run 1F1B.  `bound` is the busiest rank's work "
        "(recompute included); `ratio` = time / bound; `recomputed` counts pairs that recompute, wholly or in part "
        f"(`in part`).  `dip` is the interleaver plus {args.dip_budget:g} s of MCTS segment reordering (seed 0; "
        "`--dip-budget`), as the paper's DIP searches each batch.")
    out()
    out("| model | PP | TP | microbatches | schedule | iteration (s) | bound (s) | ratio | peak GB/GPU | "
        "recomputed (in part) | plan (s) | DIP speed-up |")
    out("|---|---|---|---|---|---|---|---|---|---|---|---|")
    summary = []
    vpp_speed: dict = {}  # (model, microbatches) -> megatron-vpp time / DIP time (None: it did not fit)
    compiled_cache = {}
    meshes: list[str] = []
    for name in models:
        compiled, batch_fn, cs = build(name)
        compiled_cache[name] = (compiled, batch_fn)
        baselines = {}
        for bname in ONE_SEGMENT:
            baselines[bname] = build(name, baseline=bname)
            compiled_cache[(name, bname)] = baselines[bname][:2]
        _, pp, tp = SETUPS[name]
        for n in mbs:
            if n not in MICROBATCHES.get(name, (n,)) and not args.microbatches_given:
                out(f"| {name} | {pp} | {tp} | {n} | not run by default (the 20-minute budget of this command; "
                    f"`--models {name} --microbatches {n}` runs it) |")
                continue
            batch = batch_fn(n, 1)
            rows = []
            for sched in dipc.schedules():
                if name.startswith("T2V") and sched == "optimus":
                    continue  # the paper excludes Optimus from T2V (no diffusion decoders)
                search = {"budget_s": args.dip_budget, "seed": 0} if sched == "dip" and args.dip_budget > 0 else {}
                try:
                    rows.append(run(compiled, batch, n, sched, **search))
                except dipc.PlanError as e:
                    out(f"| {name} | {pp} | {tp} | {n} | {sched} | does not fit: {str(e)[:80]} |")
            for bname, (bc, _, _) in baselines.items():
                try:
                    rows.insert(-1, run(bc, batch, n, "1f1b", label=bname))
                except dipc.PlanError as e:
                    out(f"| {name} | {pp} | {tp} | {n} | {bname} | does not fit: {str(e)[:80]} |")
            dip = next(r for r in rows if r["schedule"] == "dip")
            best = min((r for r in rows if r["schedule"] != "dip"), key=lambda r: r["time"])
            for r in rows:
                speed = f"{r['time'] / dip['time']:.3f}x" if r is not dip else f"best template {best['schedule']}"
                out(f"| {name} | {pp} | {tp} | {n} | {r['schedule']} | {r['time']:.2f} | {r['bound']:.2f} | "
                    f"{r['ratio']:.3f} | {r['peak'] / GB:.1f} | {r['recomputed']} ({r['partly']}) | "
                    f"{r['plan_s']:.2f} | {speed} |")
            vpp = next((r for r in rows if r["schedule"] == "megatron-vpp"), None)
            vpp_speed[name, n] = vpp["time"] / dip["time"] if vpp is not None else None
            summary.append((name, n, best["schedule"], best["time"] / dip["time"], dip["ratio"],
                            max(r["peak"] for r in rows) / GB, best["time"] / dip["bound"]))
        cs_b = ", ".join(f"{b} {v[2]:.0f} s" for b, v in baselines.items())
        out(f"| {name} | | | | compile {cs:.0f} s ({cs_b}) | | | | static "
            f"{max(compiled.rank_state_bytes()) / GB:.1f} GB/GPU | | | |")
        split = compiled.tensor_parallel_plan()
        meshes.append(f"- {name}: `init_device_mesh(\"cuda\", ({pp}, {tp}), mesh_dim_names=(\"pp\", \"tp\"))`, "
                      f"{pp * tp} GPUs, `compiled.runtime(mesh=mesh)`; {split.summary().splitlines()[0]} "
                      f"({len(split.replicated)} 2-D weight(s) left whole)")
    out()
    out("Each row's mesh (one data-parallel replica; the tensor-parallel split is `compiled.tensor_parallel_plan()`, "
        "the one the static bytes count).  The rows model Megatron-LM's sequence parallelism, as the paper's runs use "
        "it (`dipc.compile(..., sequence_parallel=True)`: norms, residual stream and messages sharded on the "
        "sequence); dipc's runtime runs the same mesh without it and refuses such a compile: "
        "`sequence_parallel=False` plans what it runs (norms, residual stream and messages whole on each GPU):")
    out()
    for m in meshes:
        out(m)
    out()
    out("Summary: DIP against the best template, and DIP's distance to its bubble-free bound (acceptance: every peak "
        "<= 80 GB; DIP within 10% of its bound; DIP >= 1.15x the best template on VLM-S, >= 1.3x on T2V-S).")
    out()
    out("| model | microbatches | best template | DIP speed-up | DIP time / bound | max peak GB | paper |")
    out("|---|---|---|---|---|---|---|")
    for name, n, bname, sp, ratio, peak, _ in summary:
        paper = PAPER["gain_vlm"] if name.startswith("VLM") else PAPER["gain_t2v"]
        out(f"| {name} | {n} | {bname} | {sp:.3f}x | {ratio:.3f} | {peak:.1f} | {paper} |")
    out()
    short = [(name, n, sp, cap) for name, n, _, sp, _, _, cap in summary
             if (name == "VLM-S" and sp < 1.15) or (name == "T2V-S" and sp < 1.3)]
    if short:
        out("Where DIP falls short of the targets (1.15x on VLM-S, 1.3x on T2V-S): "
            + "; ".join(f"{name} at {n} microbatches {sp:.3f}x, where the best template's time over DIP's own "
                        f"bubble-free bound is {cap:.3f}x" for name, n, sp, cap in short)
            + ".  That ratio is the most any schedule with DIP's memory strategies could gain over that template: "
            "the templates here already run on dipc's modality-aware chunks with the recompute they need to fit "
            "80 GB, and at 32-64 microbatches their fill and drain are a small share of the step, so every plan is "
            "within a few percent of its rank-0 work (recompute included).  The paper's larger gains are over "
            f"Megatron-LM's own one-segment partition ({_vpp_text(vpp_speed, ('VLM-S', 'T2V-S'))}) and over "
            "schedules with more bubble than these.  T2V-S's microbatches are "
            "uniform (one 16 s clip group each; dipc batches one latent shape), so DIP has no dynamicity to exploit "
            "and ties MIMO, whose three phases are already within 2% of the bound.")
        out()
    # --- memory strategies (issue "Memory strategies"): the unlimited-memory bound and the strategy ablation
    import memory_strategies as ms

    n_mem = 16 if args.quick else 64
    out(f"## Memory strategies: DIP at 80 GB against its unlimited-memory bound ({n_mem} microbatches)")
    out()
    out("The strategies offered grow down each model's rows (`bench/memory_strategies.py` has every template): "
        "whole- and per-layer recompute only, + op-selective recompute, + activation offload (PCIe host link, 32 GB "
        "of host memory per GPU); the first row plans with no memory limit.")
    out()
    out("| model | strategies offered | iteration (s) | vs recompute only | vs unlimited | peak GB/GPU | host peak GB | "
        "pairs by strategy |")
    out("|---|---|---|---|---|---|---|---|")
    for name in [m for m in models if m.startswith("VLM")]:
        compiled, batch_fn = compiled_cache[name]
        times = {}
        for label, res, plan in ms.ablation(compiled, batch_fn(n_mem, 0), n_mem):
            if plan is None:
                out(f"| {name} | {label} | no plan: {str(res)[:80]} | | | | | |")
                continue
            times[label] = t = res.iteration_time
            rec, unl = times.get(ms.REC), times.get(ms.UNLIMITED)
            out(f"| {name} | {label} | {t:.2f} | "
                f"{f'{rec / t:.3f}x' if rec is not None and label not in (ms.REC, ms.UNLIMITED) else ''} | "
                f"{f'{t / unl:.2f}x' if unl is not None and label != ms.UNLIMITED else ''} | "
                f"{max(res.peak_memory) / GB:.1f} | {max(res.host_peak, default=0.0) / GB:.1f} | "
                f"{ms.pairs_by_strategy(plan)} |")
    out()
    out("Targets (issue \"Memory strategies\", 64 microbatches): every strategy at least 1.15x faster than recompute "
        "only, and within 1.2x of the unlimited bound; `bench/memory_strategies.py` says by how much each model "
        "misses and what bounds it (the unlimited plans hold 11-21x the 80 GB, and the ViT chunks save activations "
        "faster than a PCIe link moves them).")
    out()
    if args.quick:
        return _write(args.out, lines)

    # --- ablation (VLM-S, 64 microbatches): the paper's ladder
    compiled, batch_fn = compiled_cache.get("VLM-S") or build("VLM-S")[:2]
    mega = compiled_cache.get(("VLM-S", "megatron-vpp")) or build("VLM-S", baseline="megatron-vpp")[:2]
    batch = batch_fn(64, 1)
    budget = 10.0  # the paper: VLM-L's search is near its optimum within 10 s

    def rung(c, sched, **kw):
        try:
            return run(c, batch, 64, sched, **kw)
        except dipc.PlanError as e:
            return {"error": str(e)}

    ladder = [("Megatron VPP: one segment, chunks balanced by parameters (2 per rank), whole-chunk recompute",
               rung(mega[0], "1f1b", memory_opt="greedy"), 26.13),
              ("Megatron VPP, per-layer recompute by the ILP (one strategy per chunk)",
               rung(mega[0], "1f1b"), 26.13),
              ("+ modality-aware partition (1F1B, interleaved, on dipc's chunks)",
               rung(compiled, "1f1b", memory_opt="greedy"), 22.27),
              ("+ pipeline stage interleaving (DIP's candidates, whole-chunk recompute, greedy)",
               rung(compiled, "dip", memory_opt="greedy"), 18.81),
              (f"+ segment reordering (MCTS, {budget:.0f} s budget)",
               rung(compiled, "dip", memory_opt="greedy", budget_s=budget, seed=0), 17.61),
              ("+ per-layer memory optimisation (per-rank ILP over keep / per-layer / full recompute)",
               rung(compiled, "dip", budget_s=budget, seed=0), 16.05)]
    out("## Ablation (VLM-S, 64 microbatches)")
    out()
    out("| configuration | dipc (s) | speed-up over the first rung that fits | rollouts | paper (s) | "
        "paper speed-up |")
    out("|---|---|---|---|---|---|")
    t0 = next((r["time"] for _, r, _ in ladder if "time" in r), 1.0)
    for label, r, paper_s in ladder:
        if "error" in r:
            out(f"| {label} | does not fit: {r['error'][:160]} | | | {paper_s:.2f} | {26.13 / paper_s:.3f} |")
            continue
        sr = r["search"] or {}
        roll = f"{sr['rollouts']} ({'improved' if sr['improved'] else 'not improved'})" if sr else ""
        if sr.get("gap_fill"):
            roll += f", {sr['gap_fill']['moves']} gap-fill moves"
        out(f"| {label} | {r['time']:.2f} | {t0 / r['time']:.3f} | {roll} | {paper_s:.2f} | {26.13 / paper_s:.3f} |")
    out()
    if all("error" in r for _, r, _ in ladder[:2]):
        out("Megatron VPP does not fit 80 GB at these batches in dipc's memory model, even with per-layer "
            "checkpoints (`recompute:k`) or Megatron's uniform groups (`recompute:n/g`): its first chunk runs the "
            "first half of the vision tower on a whole microbatch (up to 48 images).")
    else:
        out("Megatron VPP fits 80 GB with the recompute its users turn on: the first rung recomputes whole chunks "
            "where the rank-0 peak needs it and per-layer checkpoints where a whole chunk's rebuild does not fit; the "
            "second lets the ILP choose, per chunk for all microbatches, among keep, the first k layers each its own "
            "checkpoint (`recompute:k`, Megatron's block method), all layers in checkpoints of g (`recompute:n/g`, "
            "its uniform method) and the whole chunk.  Its chunks mix the vision tower and the LLM, so rank 0's "
            "first chunk runs half the vision tower on each whole microbatch (up to 48 images): that rank is the "
            "busiest, and its recompute adds to it.")
    out()
    last = (ladder[-1][1].get("search") or {}) if "error" not in ladder[-1][1] else {}
    per = f"{1e3 * last['seconds'] / last['rollouts']:.0f} ms" if last.get("rollouts") else "?"
    out("A rung's search keeps the interleaver's plan when no rollout beats it.  Under the memory limit the search "
        f"has {SEARCH_SHARE:.0%} of the budget and the rest fills the busiest rank's idle gaps with later "
        "forwards (dipc's own local search, not the paper's; its moves are counted beside the rollouts).  A rollout "
        f"at this size (the window family's list schedule, the memory fit by the per-rank ILP, the timing) took {per} "
        "in the last rung (the search's seconds over its rollouts).")
    out()

    # --- sub-microbatch sweep (VLM-S, 64 microbatches)
    out("## Sub-microbatch size sweep (VLM-S, 64 microbatches, DIP)")
    out()
    out("| B (images per sub-microbatch) | iteration (s) | vs B = 12 | bound (s) | recomputed |")
    out("|---|---|---|---|---|")
    import dataclasses
    sweep = {}
    compiled, batch_fn = compiled_cache.get("VLM-S") or build("VLM-S")[:2]
    batch = batch_fn(64, 1)
    chosen = compiled.batch_spec.instances
    for b_i in (4, 8, 12, 16, 32):  # the chunks stay those compiled at the rule's B_i
        compiled.batch_spec.instances = [dataclasses.replace(i, sub_microbatch_size=b_i) for i in chosen]
        sweep[b_i] = run(compiled, batch, 64, "dip")
    compiled.batch_spec.instances = chosen
    for b_i, r in sweep.items():
        out(f"| {b_i} | {r['time']:.2f} | {r['time'] / sweep[12]['time']:.3f} | {r['bound']:.2f} | "
            f"{r['recomputed']} |")
    out()
    out("Paper (VLM-S): sizes below 8 give 12.1% longer iterations than medium sizes; 12 was chosen.")
    out()

    # --- memory over time, rank 0 (VLM-M, 32 microbatches) and DIP at Optimus' peak
    name = "VLM-M" if "VLM-M" in compiled_cache else "VLM-S"
    compiled, batch_fn = compiled_cache[name]
    batch = batch_fn(32, 1)
    runs = {s: run(compiled, batch, 32, s) for s in ("1f1b", "optimus", "dip")}
    out(f"## Memory on rank 0 ({name}, 32 microbatches)")
    out()
    out("| schedule | peak GB | time-weighted std of memory GB | iteration (s) |")
    out("|---|---|---|---|")
    fl = {}
    for s, r in runs.items():
        res = r["res"]
        fl[s] = fluctuation(res.memory_timeline[0], res.iteration_time)
        out(f"| {s} | {res.peak_memory[0] / GB:.1f} | {fl[s] / GB:.2f} | {r['time']:.2f} |")
    eq = run(compiled, batch, 32, "dip", memory_limit=runs["optimus"]["peak"])
    out()
    out(f"DIP at Optimus' peak ({runs['optimus']['peak'] / GB:.1f} GB): {eq['time']:.2f} s vs Optimus "
        f"{runs['optimus']['time']:.2f} s ({runs['optimus']['time'] / eq['time']:.3f}x; paper: +12.2%).  "
        f"DIP's memory fluctuation (time-weighted std) is {fl['dip'] / fl['1f1b']:.0%} of Megatron's (1F1B) "
        "(paper: 52.9% less, i.e. 47%); "
        f"Optimus' peak vs Megatron: {runs['optimus']['res'].peak_memory[0] / runs['1f1b']['res'].peak_memory[0] - 1:+.1%} "
        "(paper: +25.3%; here every schedule is held to 80 GB).")
    out()
    if args.out:
        png = os.path.join(os.path.dirname(args.out), "benchmarks_memory.png")
        _figure(png, "time (s)", "rank 0 memory (GB per GPU)", f"{name}, 32 microbatches, H800 80 GB (simulated)",
                lambda ax: [ax.step([t for t, _ in sorted(r["res"].memory_timeline[0])],
                                    [v / GB for _, v in sorted(r["res"].memory_timeline[0])], where="post", label=s)
                            for s, r in runs.items()])
        out(f"![rank-0 memory over time]({os.path.basename(png)})")
        out()
    # --- the dynamic workload (VLM-S, rise-and-fall trace of 40 iterations)
    from dipc.models.configs import vlm_s
    from dipc.models.data import rise_and_fall_trace
    compiled, _ = compiled_cache.get("VLM-S") or build("VLM-S")[:2]
    n_dyn = 16
    out(f"## Dynamic workload (VLM-S, the rise-and-fall trace, 40 iterations of {n_dyn} microbatches)")
    out()
    out("| iteration | images per microbatch | 1f1b (s) | mimo (s) | optimus (s) | dip (s) | 1f1b / dip | "
        "best template / dip |")
    out("|---|---|---|---|---|---|---|---|")
    trace = []
    for it, (lo, hi), b in rise_and_fall_trace(vlm_s(), n_dyn):
        b["pixel_values"] = b["pixel_values"].to(torch.bfloat16)
        t = {s: run(compiled, b, n_dyn, s)["time"] for s in ("1f1b", "mimo", "optimus", "dip")}
        trace.append((it, t))
        best = min(v for k, v in t.items() if k != "dip")
        out(f"| {it + 1} | {lo}-{hi} | {t['1f1b']:.2f} | {t['mimo']:.2f} | {t['optimus']:.2f} | {t['dip']:.2f} | "
            f"{t['1f1b'] / t['dip']:.3f} | {best / t['dip']:.3f} |")
    heavy = [t for it, t in trace if it % 20 < 8]
    out()
    out(f"Iteration 6 (image-heavy): 1f1b is {trace[5][1]['1f1b'] / trace[5][1]['dip'] - 1:+.1%} slower than DIP "
        "(paper: Megatron-LM 52.9% slower).  Image-heavy phase (iterations 1-8 of each cycle), optimus vs DIP: "
        f"{sum(t['optimus'] for t in heavy) / sum(t['dip'] for t in heavy) - 1:+.1%} (paper: nnScaler* and Optimus "
        "still 10.4% slower).")
    out()
    if args.out:
        png2 = os.path.join(os.path.dirname(args.out), "benchmarks_dynamic.png")
        _figure(png2, "iteration", "iteration time (s, simulated)",
                f"VLM-S, rise-and-fall trace, {n_dyn} microbatches, H800 80 GB",
                lambda ax: [ax.plot([it + 1 for it, _ in trace], [t[sname] for _, t in trace], marker=".",
                                    label=sname) for sname in ("1f1b", "mimo", "optimus", "dip")])
        out(f"![iteration time over the dynamic trace]({os.path.basename(png2)})")
        out()
    out("Real execution against torch.distributed.pipelining: `python bench/torch_compare.py` "
        "(docs/bench_torch_compare.md).")
    return _write(args.out, lines)


def _vpp_text(vpp_speed: dict, models) -> str:
    """One sentence part: DIP's speed-up over the ``megatron-vpp`` rows of ``models`` (or that they did not fit)."""
    parts = []
    for m in models:
        got = [v for (name, _), v in vpp_speed.items() if name == m and v is not None]
        miss = sum(1 for (name, _), v in vpp_speed.items() if name == m and v is None)
        if got:
            parts.append(f"DIP is {min(got):.2f}-{max(got):.2f}x the `megatron-vpp` rows on {m} here"
                         + (f", {miss} of them not fitting 80 GB" if miss else ""))
        elif miss:
            parts.append(f"the `megatron-vpp` rows on {m} do not fit 80 GB")
    return "; ".join(parts) or "not run here"


def _figure(path, xlabel, ylabel, title, draw) -> None:
    """One line plot written as a PNG: ``draw(ax)`` adds the series."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 3.5))
    draw(ax)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _write(path, lines) -> int:
    if path:
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
