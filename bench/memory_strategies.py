"""Memory-strategy ablation at the paper's scale (issue "Memory strategies": recompute only vs + op-selective):
the paper's VLMs (H800 80 GB profile) with ``--microbatches`` packed 8192-token microbatches from the paper's
statistics, planned by each template under the profile's capacity (less the default ``memory_headroom``) and
simulated, once with every memory strategy and once without "selective" (the planner's option list filtered in
this script), and with no limit (the unlimited-memory bound).  Models: VLM-S (PP 4, TP 4), VLM-M (PP 4, TP 8),
VLM-L (PP 8, TP 8), as bench/paper.py builds them on meta.

    python bench/memory_strategies.py [--models VLM-S,VLM-M,VLM-L] [--microbatches 64] [--schedules dip,optimus,mimo,1f1b]
                                       [--out FILE]

Prints a Markdown table (and writes it to ``--out``): iteration time, peak memory, the strategies the plan chose.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="VLM-S,VLM-M,VLM-L")
    ap.add_argument("--microbatches", type=int, default=64)
    ap.add_argument("--schedules", default="dip,optimus,mimo,1f1b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import paper

    import dipc
    import dipc.planner.options as options
    import dipc.planner.planning as planning

    own = options.memory_options

    def without_selective(w, fk):
        return [o for o in own(w, fk) if o[0] != "selective"]

    lines = ["# Memory strategies at the paper's scale", "",
             f"`python bench/memory_strategies.py --microbatches {args.microbatches}` (simulated)", "",
             f"{args.microbatches} microbatches (seed {args.seed}) per model, H800 profile; limit: the profile's "
             "80 GB capacity less the default headroom (5%), or none (the unlimited-memory bound)", "",
             "| model | schedule | strategies offered | iteration s | vs recompute only | vs unlimited | peak GB | "
             "pairs by strategy |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    notes = []
    peak_unlimited = 0.0
    for model in args.models.split(","):
        compiled, batch_fn, _ = paper.build(model)
        batch = batch_fn(args.microbatches, args.seed)
        for schedule in args.schedules.split(","):
            times = {}
            for label, opts, limit in (("unlimited memory", own, 1e15),
                                       ("recompute only (no selective)", without_selective, None),
                                       ("all (keep, selective, per-layer, full)", own, None)):
                options.memory_options = planning.memory_options = opts
                try:
                    res, plan = dipc.simulate(compiled, batch, args.microbatches, schedule=schedule,
                                              memory_limit=limit)
                except dipc.PlanError as e:
                    lines.append(f"| {model} | {schedule} | {label} | no plan: {str(e)[:80]} | | | | |")
                    continue
                finally:
                    options.memory_options = planning.memory_options = own
                times[label] = t = res.iteration_time
                if label.startswith("unlimited"):
                    peak_unlimited = max(res.peak_memory)
                whole = sum(1 for _, a in plan.compute_actions() if a.kind == "F" and a.strategy.startswith("recompute"))
                pairs = sum(1 for _, a in plan.compute_actions() if a.kind == "F")
                used = collections.Counter(a.strategy.split(":")[0] + (":k" if ":" in a.strategy else "")
                                           for _, a in plan.compute_actions() if a.kind == "F")
                vs_rec = times.get("recompute only (no selective)")
                vs_unl = times.get("unlimited memory")
                lines.append(f"| {model} | {schedule} | {label} | {t:.2f} | "
                             f"{'' if vs_rec is None or label.startswith('recompute') else f'{vs_rec / t:.3f}x faster'} | "
                             f"{'' if vs_unl is None or label.startswith('unlimited') else f'{t / vs_unl:.2f}x'} | "
                             f"{max(res.peak_memory) / 1e9:.1f} | {dict(sorted(used.items()))} |")
                print(lines[-1], flush=True)
            if schedule == "dip" and len(times) == 3:
                notes.append((model, times, peak_unlimited, compiled.device.memory_capacity, whole, pairs))
    lines += ["", "Targets (DIP under 80 GB): at least 1.15x faster with every strategy than with recompute only, and "
              "within 1.2x of the unlimited-memory bound."]
    for model, times, peak, cap, whole, pairs in notes:
        t_all = times["all (keep, selective, per-layer, full)"]
        t_rec = times["recompute only (no selective)"]
        t_unl = times["unlimited memory"]
        lines.append(f"- {model}: {t_rec / t_all:.3f}x vs recompute only (target 1.15x: "
                     f"{'met' if t_rec / t_all >= 1.15 else f'missed by {1.15 / (t_rec / t_all):.2f}x'}), "
                     f"{t_all / t_unl:.2f}x of the bound (target 1.2x: "
                     f"{'met' if t_all / t_unl <= 1.2 else f'missed by {t_all / t_unl / 1.2:.2f}x'}). What bounds "
                     f"it: the unlimited plan holds {peak / 1e9:.0f} GB at its peak, {peak / cap:.0f}x the capacity, "
                     f"so most pairs must drop most of their activations whatever the strategy: with every "
                     f"strategy offered, {whole} of {pairs} pairs still recompute whole layers (selective keeps "
                     "the matmul outputs, too much for them).")
    text = "\n".join(lines)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
