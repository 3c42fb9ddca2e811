"""Is planning hidden?  Step time with asynchronous planning vs a precomputed plan vs synchronous planning.

    python bench/async_planning.py                 # the reference VLM, 2 CPU ranks, 12 batches x 8 rounds
    python bench/async_planning.py --model llava   # the main job's default model (re-captures per image count)
    python bench/async_planning.py --modes async --rounds 1000  # the acceptance figure (+-0.5%; 29 min here)
    python bench/async_planning.py --out docs/bench_async_planning.md
    python bench/async_planning.py --model llava --modes async --rounds 600 --pin  # ranks pinned to their CPUs

DIP §2.2 plans step t+1 in a background process while step t runs.  On 2 CPU ranks (gloo, one thread each) every
rank runs the same batches (generated as the main job's, :mod:`dipc.models.data`) in up to four modes (``--modes``;
the precomputed one always), interleaved in rounds, in an order drawn per round, so that the machine's drift hits
all alike:

* ``precomputed``: every batch's plan made before the loop (:func:`dipc.planner.make_plan`, validated) and handed
  to ``pipe.step(batch, plan=...)``: no planning on the step's path.  Each step gets its own plan object, read
  back from the plan's JSON text before the step's clock starts, as in a run with a plan made ahead for each of
  its batches: the same Python objects handed over every round (the bench repeats its batches) ran about 1%
  faster in a 100-round check (within its noise), a favour no real run gets;
* ``async``: ``for batch in dipc.prefetch(batches): pipe.step(batch)``: rank 0's background planner makes each
  next plan during the current step (its time reported per step), with ``simulate_steps=False``: plans only, the
  work the precomputed mode does before the loop;
* ``async+sim``: the same, and the planner also simulates each plan for the step report (bubble ratio, its causes,
  peak memory: what the main job prints per step), work that the other modes do not do at all;
* ``handover``: as ``async``, but rank 0's planner process plans nothing: it answers each batch's frame with the
  plan made before the loop for that batch (:class:`dipc.planner.background.BackgroundPlanner`'s ``serve``): the
  handover alone (frames, sender thread, pipe, the reply's JSON read on rank 0), what ``async`` costs beyond the
  planning work on the ranks' cores;
* ``sync``: each plan made by rank 0 at the start of its step.

Each step's time is the slowest rank's ``pipe.step`` (split, plan delivery, execution, all-reduces); no optimizer
step, so every mode runs on the same weights.  The table gives the mean and median step time per mode, their
ratios to the precomputed mode, and two ratios paired by round (the modes of one round see the same machine
state): each round's ratio of mean step times, and, paired by batch as well, the geometric mean of each batch's
step-time ratio over the round's steady steps (every step but the round's first, where an asynchronous mode has
no plan made ahead yet): the batches differ in cost (images, tokens) by up to 2x, and pairing each step with the
same batch's step in the other mode takes that out of the comparison.  Each is the mean over rounds with its 95%
Student-t interval; the acceptance (async within 2%) is shown only when the whole interval of the paired ratio is
inside 0.98 - 1.02.  On a shared 2-core VM one round's paired ratio varies by about +-8%, so that takes hundreds
of rounds (``--modes async`` runs two modes per round: 300 rounds, +-0.8%, are about 9 minutes at the reference
VLM's 71 ms steps; 1000 rounds, +-0.5%, about 29).  Also given: the training thread's planning-path time per step, the background planner's time per
plan, and stalls (steps over 1.5x the mode's median) per mode.  On a 2-core machine the planner process shares the
cores with the two ranks, so what it costs the ranks shows up in the async row.
After the warm-up every rank runs ``gc.collect(); gc.freeze()``, as the main job does: without it a
generation-2 collection over the model and its captures (0.1-1.4 s at LLaVA) stalled a step, in any mode, a few
times a run.
"""
from __future__ import annotations

import argparse
import gc
import math
import random
import statistics
import sys
import time


def _rank(rank, world, model_name, n_batches, batch_size, n_mb, rounds, modes):

    import dipc
    from dipc.plan import Plan
    from dipc.planner import build_workload, make_plan, split_for
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
    texts = [(p.to_json(), p._validated) for p in plans]
    planners = {}  # rank 0: "async" -> the runtime's background planner, "handover" -> the stand-in
    current = "async"  # whose planner pipe._planner holds
    if "handover" in modes and rank == 0:
        planners["handover"] = _handover_planner(compiled, steps, texts, n_mb)
    times: dict[str, list] = {m: [] for m in modes}
    plan_path: dict[str, list] = {k: [] for k in times}
    planner: dict[str, list] = {m: [] for m in modes if m in ("async", "async+sim", "handover")}
    sources: dict[str, set] = {k: set() for k in times}
    order = random.Random(0)  # the same seed on every rank: they run the modes in the same order
    for _ in range(rounds):
        for mode in order.sample(modes, len(modes)):
            if rank == 0 and mode not in ("precomputed", "sync"):  # this mode's planner process takes the batches
                kind = "handover" if mode == "handover" else "async"
                planners[current] = pipe._planner
                pipe._planner, current = planners.get(kind), kind
            it = dipc.prefetch(steps) if mode in ("async", "async+sim", "handover") else steps
            pipe.simulate_steps = mode == "async+sim"
            for i, b in enumerate(it):
                given = None
                if mode == "precomputed":  # its own plan object per step, as a run with a plan made ahead for
                    given = Plan.from_json(texts[i][0])  # each of its batches has (made outside the timed step)
                    given._validated = texts[i][1]
                t = time.perf_counter()
                pipe.step(b, plan=given)
                times[mode].append(time.perf_counter() - t)
                rep = pipe.last_report
                plan_path[mode].append(rep.plan_s)
                sources[mode].add(rep.plan_source)
                if mode in planner and rep.planner_s is not None:
                    planner[mode].append((rep.planner_s, rep.planner_cpu_s))
                for p in pipe.parameters():
                    p.grad = None
    pipe.close()
    for p in planners.values():
        if p is not None:
            p.close()
    mine = {"times": times, "plan_path": plan_path, "planner": planner, "precompute_s": precompute_s,
            "sources": {k: sorted(v) for k, v in sources.items()}, "fallbacks": pipe.fallbacks}
    return all_gather_json(mine, what="bench figures")


def _handover_planner(compiled, steps, texts, n_mb):
    """A planner process that plans nothing: it answers each frame with the plan made before the loop for that
    batch (found by the frame's bytes), in the planner's reply format.  The ``handover`` mode runs it: the same
    frames, sender thread, pipe and replies as ``async``, without the planning work."""
    import hashlib
    import os

    from dipc.planner.background import BackgroundPlanner, decode_batch, encode_batch
    from dipc.planner import build_workload, split_for, step_digest
    from dipc.wire import encode_json

    def key(batch):
        return hashlib.sha256(encode_batch({}, batch, float_values=False)).hexdigest()

    table = {}
    for b, (text, _) in zip(steps, texts):
        table[key(b)] = (text, step_digest(compiled, build_workload(compiled, split_for(compiled, b, n_mb))))

    def serve(conn):
        while True:
            try:
                frame = conn.recv_bytes()
                while conn.poll(0):
                    frame = conn.recv_bytes()
            except (EOFError, OSError):
                os._exit(0)
            head, batch = decode_batch(frame)
            text, digest = table[key(batch)]
            conn.send_bytes(encode_json({"step": head["step"], "seq": head["seq"], "digest": digest, "plan": text,
                                         "schedule": head["schedule"], "n_microbatches": head["n_microbatches"],
                                         "amp": head.get("amp"), "seconds": 0.0, "cpu_seconds": 0.0}))

    return BackgroundPlanner(compiled, {}, serve=serve)


def _interval(xs, log: bool = False) -> str:
    """The mean of ``xs`` and its two-sided 95% Student-t interval (the rounds taken as independent draws), e.g.
    ``1.030 (0.990 - 1.070)``; with ``log`` the ``xs`` are log ratios, and the mean and bounds are given as ratios
    (``exp``).  A ratio whose interval lies inside 1 +- 0.02 is shown within 2%; one whose interval is wider than
    that is not shown either way."""
    from scipy.stats import t

    f = math.exp if log else float
    mean = statistics.fmean(xs)
    if len(xs) < 2:
        return f"{f(mean):.3f}"
    half = t.ppf(0.975, len(xs) - 1) * statistics.stdev(xs) / len(xs) ** 0.5
    return f"{f(mean):.3f} ({f(mean - half):.3f} - {f(mean + half):.3f})"


MODES = ("precomputed", "async", "handover", "async+sim", "sync")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="vlm", choices=["vlm", "llava", "t2v"])
    ap.add_argument("--batches", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"comma-separated subset of {', '.join(MODES)} (precomputed is always run: the baseline)")
    ap.add_argument("--pin", action="store_true",
                    help="pin each rank to its own CPU (dipc.launch.spawn(pin_cpus=True)); rank 0's background "
                         "planner then runs on the other CPU, which idles while the pipeline fills")
    ap.add_argument("--out", default=None, help="also write the table (markdown) here")
    ap.add_argument("--raw", default=None, help="also write every rank's per-step figures (JSON) here")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"--modes: unknown mode(s) {bad}; choose from {list(MODES)}")
    if args.batches < 3:
        ap.error(f"--batches {args.batches}: at least 3 (a round's first step per mode is left out of the "
                 "steady-state figures)")
    modes = ["precomputed"] + [m for m in MODES[1:] if m in modes]
    from dipc.launch import spawn

    t0 = time.perf_counter()
    res = spawn(_rank, 2, (args.model, args.batches, args.batch_size, args.microbatches, args.rounds, modes),
                timeout=3600, pin_cpus=args.pin)[0]
    wall = time.perf_counter() - t0
    if args.raw:
        import json
        with open(args.raw, "w") as f:
            json.dump(res, f)
    n = len(res[0]["times"]["precomputed"])
    step = {m: [max(r["times"][m][i] for r in res) for i in range(n)] for m in modes}
    base = statistics.fmean(step["precomputed"])
    med_base = statistics.median(step["precomputed"])
    per_round = n // args.rounds

    def block(m, k, steady=False):
        return step[m][k * per_round + (1 if steady else 0):(k + 1) * per_round]

    # paired by round: the modes of one round ran one after another (in an order drawn per round), so a round's
    # figures see one machine state.  Two per-round ratios to the precomputed mode:
    # * of the round's mean step times (all its steps);
    # * paired by batch: the geometric mean over the round's steady steps of each batch's step-time ratio (the same
    #   batch, so its own cost cancels; the first step of a round is left out in every mode: there the
    #   asynchronous modes have no plan made ahead yet and plan synchronously, as the first step of any run does).
    # Each is given as its mean over rounds with a 95% Student-t interval (the second on the log scale).
    def ratios_of_means(m):
        return [statistics.fmean(block(m, k)) / statistics.fmean(block("precomputed", k)) for k in range(args.rounds)]

    def log_ratios_paired(m):
        return [statistics.fmean(math.log(a / b) for a, b in zip(block(m, k, True), block("precomputed", k, True)))
                for k in range(args.rounds)]

    def stalls(m):  # steps over 1.5x the mode's median: stalls, counted so that a mode that causes them shows
        med = statistics.median(step[m])
        return sum(t > 1.5 * med for t in step[m])

    lines = [f"# Asynchronous planning on 2 CPU ranks ({args.model}, {args.batches} batches of {args.batch_size}, "
             f"{args.microbatches} microbatches, {args.rounds} rounds)", "",
             f"`python bench/async_planning.py --model {args.model} --batches {args.batches} --batch-size "
             f"{args.batch_size} --microbatches {args.microbatches} --rounds {args.rounds} --modes "
             f"{','.join(modes)}{' --pin' if args.pin else ''}` ({wall:.0f} s). Step time: the slowest rank's `pipe.step`; plan path: rank 0's "
             "time from the step's start to the plan's delivery. Ratios to the precomputed mode: of the mean and "
             "of the median step times over the run; paired by round (the modes of a round ran back to back, in "
             "an order drawn per round): each round's ratio of mean step times (all its steps), and, paired by "
             "batch, the geometric mean of each batch's step-time ratio over the round's steady steps (all but "
             "its first, where the asynchronous modes have no plan made ahead yet), each as the mean over rounds "
             "with its 95% Student-t interval (the second on the log scale). Within 2% is shown only when the "
             "whole interval of the paired ratio is inside 0.98 - 1.02. Stalls: steps over 1.5x the mode's median step "
             "time (a mode that caused stalls would have more of them).", "",
             "| mode | mean step ms | median step ms | mean vs precomputed | median vs precomputed | "
             "per-round ratio of means, 95% interval | paired by batch: geometric mean ratio, 95% interval | "
             "stalls / steps | rank-0 plan path ms | plan sources |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for m, ts in step.items():
        pp = statistics.fmean(res[0]["plan_path"][m]) * 1e3
        lines.append(f"| {m} | {statistics.fmean(ts) * 1e3:.1f} | {statistics.median(ts) * 1e3:.1f} | "
                     f"{statistics.fmean(ts) / base:.3f} | {statistics.median(ts) / med_base:.3f} | "
                     f"{_interval(ratios_of_means(m))} | {_interval(log_ratios_paired(m), log=True)} | "
                     f"{stalls(m)} / {len(ts)} | "
                     f"{pp:.1f} | {', '.join(res[0]['sources'][m])} |")
    import os
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    per = []
    for m, pl in res[0]["planner"].items():
        if pl:
            per.append(f"{m} {statistics.fmean(w for w, _ in pl) * 1e3:.1f} ms wall per plan (max "
                       f"{max(w for w, _ in pl) * 1e3:.1f} ms; {statistics.fmean(c for _, c in pl) * 1e3:.1f} ms CPU, "
                       f"the simulation after it not counted), {len(pl)} plans")
    lines += ["", f"Background planner: {'; '.join(per) or 'not run'}; the same plans made in the training process "
              f"before the loop: {res[0]['precompute_s'] * 1e3:.1f} ms each; fallbacks {res[0]['fallbacks']}. Host "
              f"cores: {cores}, training processes: 2" + (" (no idle core for the planner: its CPU time comes out "
                                                          "of the ranks')" if cores <= 2 else "") + "."]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
