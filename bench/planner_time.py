"""Planner time per batch vs microbatch count, at the paper's scale (DIP issue "search and asynchronous planning").

    python bench/planner_time.py                       # VLM-S (P=4) and VLM-L (P=8), 8..64 microbatches
    python bench/planner_time.py --out docs/bench_planner_time.md

For each setup (compiled on meta as ``bench/paper.py`` does: the paper's PP/TP on the H800 profile) and each
microbatch count, one batch of the paper's mixed image-text distribution is planned with DIP under the 80 GB limit
(``schedule="dip"``, ``budget_s=0``: the interleaver and the per-rank memory ILP, no search), timing each part of
the per-batch path on one core: the split into microbatches and sub-microbatches, the step's stage graph
(:func:`dipc.planner.build_workload`), scheduling + memory optimisation + lowering (:func:`dipc.planner.make_plan`
with ``check=False``), and :func:`dipc.validation.validate`.  The stage count shows how the work grows.  One untimed
plan per setup comes first: a process's one-time costs (imports, HiGHS, caches; ~0.6 s at VLM-L) are paid once
per background planner, not per batch; as there, the compiled pipeline is frozen out of the garbage
collector's reach (``gc.freeze()``) first.  This is the time a background planner needs per step (it must stay under
the previous step's iteration time, shown as the simulated iteration time of the plan).  Then DIP's MCTS search
(DIP §2.3) with budgets of 1 and 10 s on VLM-S at 64 microbatches, to compare what a 1 s budget finds with a 10 s
one.  Per setup and microbatch count also: the slowest rank's memory ILP instance on the plan's order (DIP §2.5)
and the seconds per rollout of a short search.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="VLM-S,VLM-L")
    ap.add_argument("--microbatches", default="8,16,32,64")
    ap.add_argument("--memory-limit", type=float, default=80e9, help="bytes per GPU")
    ap.add_argument("--budgets", default="1,10", help="MCTS budgets (s) compared on --budget-setup at 64 microbatches")
    ap.add_argument("--budget-setup", default="VLM-S")
    ap.add_argument("--rollout-budget", type=float, default=2.0,
                    help="seconds of the short search that times one rollout per setup and microbatch count")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    import paper
    from dipc.validation import validate
    import copy

    import dipc
    from dipc.plan import stage_key
    from dipc.planner.memory import optimize_memory
    from dipc.planner.planning import activation_budget
    from dipc.planner import build_workload, make_plan, split_for
    from dipc.sim.simulate import simulate_workload

    rows, searched = [], []
    for name in args.models.split(","):
        compiled, batch_fn, compile_s = paper.build(name)
        if name == args.budget_setup and args.budgets:
            batch = batch_fn(64, 1)
            for b in [float(x) for x in args.budgets.split(",")]:
                t0 = time.perf_counter()
                res, plan = dipc.simulate(compiled, batch, 64, memory_limit=args.memory_limit, budget_s=b, seed=0)
                s = plan.simulated.get("search") or {}
                searched.append((name, b, res.iteration_time, s.get("rollouts", 0), bool(s.get("improved")),
                                 time.perf_counter() - t0))
                print(searched[-1], flush=True)
        gc.collect()
        gc.freeze()  # as the background planner does after its fork: the compiled pipeline out of the collector's reach
        # untimed: the first plan of a process pays its one-time costs (imports, HiGHS, the cost models' caches,
        # ~0.6 s at VLM-L), once per background planner, not per batch
        warm = batch_fn(8, 1)
        make_plan(compiled, build_workload(compiled, split_for(compiled, warm, 8)), 0, check=False,
                  memory_limit=args.memory_limit)
        for n in [int(x) for x in args.microbatches.split(",")]:
            batch = batch_fn(n, 1)
            t = [time.perf_counter()]
            mbs = split_for(compiled, batch, n)
            t.append(time.perf_counter())
            w = build_workload(compiled, mbs)
            t.append(time.perf_counter())
            plan = make_plan(compiled, w, 0, check=False, memory_limit=args.memory_limit)
            t.append(time.perf_counter())
            validate(plan)
            t.append(time.perf_counter())
            res = simulate_workload(compiled, w, plan)
            parts = [b - a for a, b in zip(t, t[1:])]
            # one rank's memory ILP on the plan's own order and candidates (DIP §2.5: the issue asks < 10 ms)
            order = [[stage_key(a.kind, a.chunk, a.mb, a.sub) for a in acts if a.kind in ("F", "B")]
                     for acts in plan.ranks]
            budgets = activation_budget(compiled, args.memory_limit)
            stats = optimize_memory(copy.deepcopy(w.graph), order, budgets)
            ilp_ms = max((i["seconds"] for i in stats.get("instances", [])), default=0.0) * 1e3
            # a rollout of the search (interleave + memory ILP + timing, DIP §2.3: the issue asks < 20 ms)
            _, sp = dipc.simulate(compiled, batch, n, memory_limit=args.memory_limit, budget_s=args.rollout_budget,
                                  seed=0)
            s = sp.simulated.get("search") or {}
            rollout_ms = 1e3 * s["seconds"] / s["rollouts"] if s.get("rollouts") else float("nan")
            tried = plan.simulated.get("plans_tried", 1)
            per_k = 1e3 * parts[2] / tried / (len(w.graph.stages) / 1e3)  # ms per 1000 stages per schedule made
            rows.append((name, compiled.pp_size, n, len(w.graph.stages), *parts, sum(parts), res.iteration_time,
                         max(res.peak_memory) / 1e9, ilp_ms, rollout_ms, s.get("rollouts", 0), tried, per_k))
            print(rows[-1], flush=True)
    lines = ["# Planner time per batch vs microbatch count (DIP, 80 GB per GPU, no search, one core)", "",
             "`python bench/planner_time.py`: seconds per part of the per-batch path.", "",
             "| setup | P | microbatches | stages | split s | stage graph s | schedule + ILP + lower s | validate s "
             "| total s | simulated iteration s | peak GB | slowest ILP instance ms | ms per rollout (rollouts in "
             f"{args.rollout_budget:g} s) | schedules made | ms per 1000 stages per schedule |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.3f} | {r[5]:.3f} | {r[6]:.3f} | {r[7]:.3f} | "
                     f"{r[8]:.3f} | {r[9]:.2f} | {r[10]:.1f} | {r[11]:.1f} | {r[12]:.0f} ({r[13]}) | {r[14]} | {r[15]:.0f} |")
    lines += ["", "The ILP column: `dipc.planner.memory.optimize_memory` once on the plan's own per-rank order and "
              "candidates, its slowest rank's instance (the LP relaxation, rounding and upgrades; HiGHS branch and "
              "bound where that misses the 5% gap).  The rollout column: a "
              f"{args.rollout_budget:g} s MCTS search's wall seconds over its rollouts (each: the list schedule of "
              "the window family, the memory ILP on every rank, the timing).  The issue asks < 10 ms per instance "
              "and < 20 ms per rollout at VLM-L / 64 microbatches.  Schedules made: the interleaver and memory "
              "optimisation run once per reserve policy and again under smaller budgets where the simulated plan is "
              "over its limit (`plan.simulated[\"plans_tried\"]`, a small number that the batch decides); the last "
              "column divides the scheduling time by it and by the stages: flat when each schedule is linear in the "
              "stages."]
    if searched:
        lines += ["", f"MCTS segment reordering on {args.budget_setup} at 64 microbatches (`dipc.simulate(..., "
                  "budget_s=b, seed=0)`, one core): the issue asks that 1 s find within 2% of what 10 s finds.", "",
                  "| budget s | iteration s | rollouts | search beat the interleaver | wall s |", "|---|---|---|---|---|"]
        for name, b, it, ro, imp, wall in searched:
            lines.append(f"| {b:g} | {it:.3f} | {ro} | {'yes' if imp else 'no'} | {wall:.1f} |")
        best = min(it for _, _, it, _, _, _ in searched)
        lines.append("")
        lines.append("Ratio to the best budget's: " + ", ".join(f"{b:g} s: {it / best:.4f}"
                                                             for _, b, it, _, _, _ in searched) + ".")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
