"""Costing one paper-size batch on the meta device (issue 3 acceptance: under 10 ms for 64 microbatches).

    python bench/vlm_l_costing.py [--microbatches 64] [--pp 8] [--out docs/bench_vlm_l_costing.md]

Captures the full VLM-L (ViT 22B + Qwen2 72B, shared/PAPER.md Table 2) with every weight on the meta device (about a
minute), partitions it for ``--pp`` ranks, annotates the symbolic cost (``dipc.passes.symcost``) and lambdifies one
cost function per chunk; then costs one batch of ``--microbatches`` packed microbatches (2 x 8192 tokens, 0..48
images each; vision chunks per sub-microbatch of B_i = 12 images, PAPER.md §3.6) three ways: memoised per shape (the
planner's path, cold at the start of the batch), without memo, and vectorised (one numpy call per chunk).  Prints the
timings and writes them to the markdown file.  No weight is materialised (asserted).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sympy  # noqa: E402
import torch  # noqa: E402

from dipc.capture import capture  # noqa: E402
from dipc.passes.symcost import annotate_symbolic_cost, compile_groups  # noqa: E402


def vlm_l_meta_batch(cfg, rows=2, seq=8192, images=48):
    """Meta tensors shaped like one packed VLM microbatch (``rows`` x ``seq`` tokens, ``images`` images)."""
    return {"input_ids": torch.empty(rows, seq, dtype=torch.long, device="meta"),
            "pixel_values": torch.empty(images, 3, cfg.image_size, cfg.image_size, device="meta"),
            "labels": torch.empty(rows, seq, dtype=torch.long, device="meta")}


def bench_vlm_l(n_microbatches: int = 64, pp_size: int = 8, repeats: int = 5, seed: int = 0) -> dict:
    """Cost one batch of ``n_microbatches`` packed VLM-L microbatches (2 x 8192 tokens, 0..48 images each) for
    every chunk of a ``pp_size``-rank partition; vision chunks per sub-microbatch of 12 images (B_i, PAPER.md §3.6).
    Prints and returns the timings (seconds).  Captures the full paper-size model on meta (about a minute)."""
    from dipc.models.configs import build_on_meta, vlm_l
    from dipc.passes.cost import annotate_cost
    from dipc.passes.modality import DEFAULT_RULES, annotate_modality
    from dipc.passes.partition import partition

    cfg = vlm_l()
    model = build_on_meta(cfg)
    t0 = time.perf_counter()
    cap = capture(model, vlm_l_meta_batch(cfg))
    t1 = time.perf_counter()
    annotate_modality(cap.graph, DEFAULT_RULES)
    annotate_cost(cap.graph)
    part = partition(cap.graph, pp_size)
    t2 = time.perf_counter()
    annotate_symbolic_cost(cap.graph, inputs=cap.input_keys)
    t3 = time.perf_counter()
    costs = compile_groups(cap.graph)
    t4 = time.perf_counter()
    assert all(p.is_meta for p in model.parameters())
    modality = {c.index: c.modality for c in part.chunks}
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 49, (n_microbatches,), generator=g).tolist()
    b_i = 12
    ph = {n.name: n for n in cap.graph.nodes if n.op == "placeholder"}
    sym = {}
    for name, key in cap.input_keys.items():
        for d, s in enumerate(ph[name].meta["val"].shape):
            if isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Symbol):
                sym[(key, d)] = s.node.expr
    size = cfg.image_size

    def binding(n_images):  # a microbatch of 2 x 8192 tokens with n_images images
        shapes = {"input_ids": (2, 8192), "labels": (2, 8192), "pixel_values": (n_images, 3, size, size)}
        return {s: shapes[k][d] for (k, d), s in sym.items()}

    work = []  # (compiled cost, bindings) per (chunk, microbatch, sub-microbatch)
    for n in counts:
        subs = [min(b_i, n - i) for i in range(0, n, b_i)] or [0]
        for c, cc in costs.items():
            for k in (subs if modality[c] == "vision" else [n]):
                work.append((cc, binding(k)))
    def timed(fn):
        best = float("inf")
        for _ in range(repeats):
            for cc in costs.values():
                cc.cache_clear()
            s = time.perf_counter()
            out = fn()
            best = min(best, time.perf_counter() - s)
        return best, out

    def per_call():  # memoised per (chunk, shape) within the batch, cold at its start
        return sum(cc(bd)["flops_fwd"] for cc, bd in work)

    def no_memo():  # every evaluation runs the generated function
        return sum(dict(zip(cc.fields, map(float, cc.values(*cc._args(bd)))))["flops_fwd"] for cc, bd in work)

    def vectorised():  # one numpy call per chunk for all its (sub-)microbatches
        total = 0.0
        for c, cc in costs.items():
            ks = [min(b_i, n - i) for n in counts for i in range(0, n, b_i)] if modality[c] == "vision" else counts
            cols = {k: [v] * len(ks) for k, v in binding(0).items()}
            cols[sym[("pixel_values", 0)]] = ks
            total += float(cc.many(cols)["flops_fwd"].sum())
        return total

    t_call, total = timed(per_call)
    t_raw, total_raw = timed(no_memo)
    t_vec, total_vec = timed(vectorised)
    assert abs(total_raw - total) <= 1e-9 * total and abs(total_vec - total) <= 1e-6 * total
    res = {"capture_s": t1 - t0, "partition_s": t2 - t1, "annotate_s": t3 - t2, "compile_s": t4 - t3,
           "n_chunks": len(costs), "evaluations": len(work), "cost_batch_s": t_call, "cost_batch_no_memo_s": t_raw,
           "cost_batch_vectorised_s": t_vec, "images": sum(counts), "flops_fwd": total}
    print(f"VLM-L (ViT 22B + Qwen2 72B) on meta, P={pp_size}: {len(cap.graph.nodes)} nodes, {len(costs)} chunks "
          f"(K_i {part.chunks_per_rank}); capture {res['capture_s']:.1f} s, symbolic annotate "
          f"{res['annotate_s']:.2f} s, lambdify {res['compile_s']:.2f} s; no weight materialised")
    print(f"costing one batch of {n_microbatches} microbatches (2 x 8192 tokens; {sum(counts)} images; {len(work)} "
          f"chunk x (sub-)microbatch evaluations): {t_call * 1e3:.2f} ms (memo per shape, cold), "
          f"{t_raw * 1e3:.2f} ms (no memo), {t_vec * 1e3:.2f} ms (vectorised); forward {total / 1e15:.1f} PFLOP")
    return res



def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--microbatches", type=int, default=64)
    p.add_argument("--pp", type=int, default=8)
    p.add_argument("--out", default="docs/bench_vlm_l_costing.md")
    args = p.parse_args(argv)
    r = bench_vlm_l(args.microbatches, args.pp)
    rows = [("capture on meta (torch.export)", f"{r['capture_s']:.1f} s"),
            ("modality + partition passes", f"{r['partition_s']:.2f} s"),
            ("symbolic cost annotation", f"{r['annotate_s']:.2f} s"),
            ("lambdify one cost function per chunk", f"{r['compile_s']:.2f} s"),
            (f"cost one batch: {r['evaluations']} chunk x (sub-)microbatch evaluations, memoised per shape (cold)",
             f"{r['cost_batch_s'] * 1e3:.2f} ms"),
            ("same, no memo", f"{r['cost_batch_no_memo_s'] * 1e3:.2f} ms"),
            ("same, vectorised (one numpy call per chunk)", f"{r['cost_batch_vectorised_s'] * 1e3:.2f} ms")]
    table = "\n".join(["| step | time |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows])
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        f.write("# Costing a VLM-L batch on the meta device\n\n")
        f.write(f"Command: `python bench/vlm_l_costing.py --microbatches {args.microbatches} --pp {args.pp}`. "
                f"VLM-L = ViT 22B + Qwen2 72B (PAPER.md Table 2), every weight on meta; {r['n_chunks']} chunks; "
                f"{args.microbatches} microbatches of 2 x 8192 tokens with {r['images']} images in all; forward "
                f"{r['flops_fwd'] / 1e15:.1f} PFLOP. Best of 5 timed runs.\n\n")
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
