"""Is planning hidden?  Step time with asynchronous planning vs a precomputed plan vs synchronous planning.

    python bench/async_planning.py                 # the reference VLM, 2 CPU ranks, 12 batches x 8 rounds
    python bench/async_planning.py --model llava   # the main job's default model (re-captures per image count)
    python bench/async_planning.py --out docs/bench_async_planning.md

DIP §2.2 plans step t+1 in a background process while step t runs.  On 2 CPU ranks (gloo, one thread each) every
rank runs the same batches (generated as the main job's, :mod:`dipc.models.data`) in three modes, interleaved in
rounds so that the machine's drift hits all alike:

* ``precomputed``: every batch's plan made before the loop (:func:`dipc.runtime.make_plan`, validated) and handed
  to ``pipe.step(batch, plan=...)``: no planning on the step's path;
* ``async``: ``for batch in dipc.prefetch(batches): pipe.step(batch)``: rank 0's background planner makes each
  next plan during the current step (its time reported per step), with ``simulate_steps=False``: plans only, the
  work the precomputed mode does before the loop;
* ``async+sim``: the same, and the planner also simulates each plan for the step report (bubble ratio, its causes,
  peak memory: what the main job prints per step), work that the other modes do not do at all;
* ``sync``: each plan made by rank 0 at the start of its step.

Each step's time is the slowest rank's ``pipe.step`` (split, plan delivery, execution, all-reduces); no optimizer
step, so every mode runs on the same weights.  The table gives the mean and median step time per mode, their
ratios to the precomputed mode (acceptance: async within 2%), the same ratio paired by round (each round's ratio of
mean step times, its median over the rounds: the modes of one round see the same machine state, and the mean of
those ratios with its 95% interval: within 2% is shown only when the whole interval is), the training
thread's planning-path time per step and the background planner's time per plan.  On this 2-core machine the
planner process shares the cores with the two ranks, so what it costs the ranks shows up in the async row.
After the warm-up every rank runs ``gc.collect(); gc.freeze()``, as the main job does: without it a
generation-2 collection over the model and its captures (0.1-1.4 s at LLaVA) stalled a step, in any mode, a few
times a run.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time


def _rank(rank, world, model_name, n_batches, batch_size, n_mb, rounds):

    import dipc
    from dipc.runtime import build_workload, make_plan, split_for
    from dipc.train import build
    from dipc.wire import all_gather_json

    model, batches = build(model_name, 0, n_batches + 1, batch_size)
    compiled = dipc.compile(model, batches[0], world)
    steps = batches[1:]
    pipe = compiled.runtime(n_microbatches=n_mb, timeout=600)
    for b in steps:  # warm-up: captures, cost compilation, allocator
        pipe.step(b)
        for p in pipe.parameters():
            p.grad = None
    # as the main job does (dipc.train): what lives for the whole run is frozen out of the collector, whose
    # generation-2 passes over it (0.1-1.4 s at LLaVA) stalled a step in any mode a few times a run
    gc.collect()
    gc.freeze()
    plans = []
    t0 = time.perf_counter()
    for i, b in enumerate(steps):
        w = build_workload(compiled, split_for(compiled, b, n_mb))
        plans.append(make_plan(compiled, w, i))
    precompute_s = (time.perf_counter() - t0) / len(steps)
    times: dict[str, list] = {"precomputed": [], "async": [], "async+sim": [], "sync": []}
    plan_path: dict[str, list] = {k: [] for k in times}
    planner: dict[str, list] = {"async": [], "async+sim": []}
    sources: dict[str, set] = {k: set() for k in times}
    for _ in range(rounds):
        for mode in times:
            it = dipc.prefetch(steps) if mode.startswith("async") else steps
            pipe.simulate_steps = mode == "async+sim"
            for i, b in enumerate(it):
                t = time.perf_counter()
                pipe.step(b, plan=plans[i] if mode == "precomputed" else None)
                times[mode].append(time.perf_counter() - t)
                rep = pipe.last_report
                plan_path[mode].append(rep.plan_s)
                sources[mode].add(rep.plan_source)
                if mode in planner and rep.planner_s is not None:
                    planner[mode].append((rep.planner_s, rep.planner_cpu_s))
                for p in pipe.parameters():
                    p.grad = None
    pipe.close()
    mine = {"times": times, "plan_path": plan_path, "planner": planner, "precompute_s": precompute_s,
            "sources": {k: sorted(v) for k, v in sources.items()}, "fallbacks": pipe.fallbacks}
    return all_gather_json(mine, what="bench figures")


def _interval(xs) -> str:
    """The mean of ``xs`` and its two-sided 95% Student-t interval (the rounds taken as independent draws), e.g.
    ``1.030 (0.990 - 1.070)``: a ratio whose interval holds 1 +- 0.02 is shown within 2%; one whose interval is
    wider than that is not shown either way."""
    from scipy.stats import t

    mean = statistics.fmean(xs)
    if len(xs) < 2:
        return f"{mean:.3f}"
    half = t.ppf(0.975, len(xs) - 1) * statistics.stdev(xs) / len(xs) ** 0.5
    return f"{mean:.3f} ({mean - half:.3f} - {mean + half:.3f})"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="vlm", choices=["vlm", "llava", "t2v"])
    ap.add_argument("--batches", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", default=None, help="also write the table (markdown) here")
    ap.add_argument("--raw", default=None, help="also write every rank's per-step figures (JSON) here")
    args = ap.parse_args(argv)
    from dipc.launch import spawn

    t0 = time.perf_counter()
    res = spawn(_rank, 2, (args.model, args.batches, args.batch_size, args.microbatches, args.rounds),
                timeout=3600)[0]
    wall = time.perf_counter() - t0
    if args.raw:
        import json
        with open(args.raw, "w") as f:
            json.dump(res, f)
    n = len(res[0]["times"]["precomputed"])
    step = {m: [max(r["times"][m][i] for r in res) for i in range(n)] for m in res[0]["times"]}
    base = statistics.fmean(step["precomputed"])
    med_base = statistics.median(step["precomputed"])
    # paired by round: the modes ran one after another in each round, so a round's ratio of mean step times sees
    # the same machine state; their median over rounds resists a round hit by another process on the host
    per_round = n // args.rounds

    def round_ratios(m):
        return [statistics.fmean(step[m][k * per_round:(k + 1) * per_round])
                / statistics.fmean(step["precomputed"][k * per_round:(k + 1) * per_round])
                for k in range(args.rounds)]

    lines = [f"# Asynchronous planning on 2 CPU ranks ({args.model}, {args.batches} batches of {args.batch_size}, "
             f"{args.microbatches} microbatches, {args.rounds} rounds)", "",
             f"`python bench/async_planning.py --model {args.model} --batches {args.batches} --batch-size "
             f"{args.batch_size} --microbatches {args.microbatches} --rounds {args.rounds}` ({wall:.0f} s). Step "
             "time: the slowest rank's `pipe.step`; plan path: rank 0's time from the step's start to the plan's "
             "delivery; ratios to the precomputed mode: of the mean step times, of the medians, and the median "
             "(min - max) over rounds of each round's ratio of means, and their mean with its 95% Student-t "
             "interval (within 2% is shown only when the whole interval is inside 0.98 - 1.02).", "",
             "| mode | mean step ms | median step ms | mean vs precomputed | median vs precomputed | "
             "per-round ratio median (min - max) | per-round ratio mean, 95% interval | rank-0 plan path ms | "
             "plan sources |",
             "|---|---|---|---|---|---|---|---|---|"]
    for m, ts in step.items():
        pp = statistics.fmean(res[0]["plan_path"][m]) * 1e3
        rr = round_ratios(m)
        lines.append(f"| {m} | {statistics.fmean(ts) * 1e3:.1f} | {statistics.median(ts) * 1e3:.1f} | "
                     f"{statistics.fmean(ts) / base:.3f} | {statistics.median(ts) / med_base:.3f} | "
                     f"{statistics.median(rr):.3f} ({min(rr):.3f} - {max(rr):.3f}) | {_interval(rr)} | {pp:.1f} | "
                     f"{', '.join(res[0]['sources'][m])} |")
    import os
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    per = []
    for m, pl in res[0]["planner"].items():
        if pl:
            per.append(f"{m} {statistics.fmean(w for w, _ in pl) * 1e3:.1f} ms wall per plan (max "
                       f"{max(w for w, _ in pl) * 1e3:.1f} ms; {statistics.fmean(c for _, c in pl) * 1e3:.1f} ms CPU, "
                       f"the simulation after it not counted), {len(pl)} plans")
    lines += ["", f"Background planner: {'; '.join(per)}; the same plans made in the training process before the loop: "
              f"{res[0]['precompute_s'] * 1e3:.1f} ms each; fallbacks {res[0]['fallbacks']}. Host cores: {cores}, "
              "training processes: 2" + (" (no idle core for the planner: its CPU time comes out of the ranks')"
                                          if cores <= 2 else "") + "."]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
