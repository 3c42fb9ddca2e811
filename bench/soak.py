"""Soak: many steps on 2 CPU ranks with varying batches; is memory (RSS) per rank flat, and does anything fail?

    python bench/soak.py                         # 300 steps of the reference VLM, asynchronous planning
    python bench/soak.py --steps 1000 --out docs/bench_soak.md

Each rank trains the reference VLM with AdamW on batches generated as the main job's (:mod:`dipc.models.data`:
images per sample and text lengths vary step to step), through :func:`dipc.prefetch` (so rank 0's background
planner makes every plan but the first), and records its resident set size (``/proc/self/statm``) and step time
after every step.  Warm-up is the first 20% of the steps (captures, cost compilation, allocator growth; the 32 distinct batches are cycled, so warm-up has seen them all); the table
gives per rank the RSS at the end of warm-up, the largest RSS after it and the growth between them (acceptance:
within 5%), the step time over the first and the last tenth of the run, the fallbacks, and whether any step failed.
The planner process's own RSS is reported too.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rss_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _rank(rank, world, steps, batch_size, n_mb, seed):
    import torch

    import dipc
    from dipc.models import ReferenceVLM, VLMConfig
    from dipc.models.data import vlm_batches
    from dipc.wire import all_gather_json

    torch.manual_seed(seed)
    cfg = VLMConfig.tiny()
    model = ReferenceVLM(cfg)
    batches = list(vlm_batches(cfg, 33, batch_size, seed + 1))  # 32 cycled: shapes vary every step
    compiled = dipc.compile(model, batches[0], world)
    pipe = compiled.runtime(n_microbatches=n_mb, timeout=600)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    rss, times, losses, planner_rss = [], [], [], []
    failures = 0
    t_all = time.perf_counter()
    for i, batch in enumerate(dipc.prefetch(batches[(j % (len(batches) - 1)) + 1] for j in range(steps))):
        t = time.perf_counter()
        try:
            loss = pipe.step(batch)
            losses.append(float(loss))
        except Exception:  # noqa: BLE001 - counted, the soak goes on
            failures += 1
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
        rss.append(_rss())
        if rank == 0 and pipe._planner is not None and pipe._planner.pid is not None:
            planner_rss.append(_rss_of(pipe._planner.pid))
    fallbacks = pipe.fallbacks
    pipe.close()
    mine = {"rss": rss, "times": times, "failures": failures, "fallbacks": fallbacks, "planner_rss": planner_rss,
            "wall": time.perf_counter() - t_all, "loss_first": losses[:5], "loss_last": losses[-5:]}
    return all_gather_json(mine, what="soak figures")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the table (markdown) here")
    args = ap.parse_args(argv)
    from dipc.launch import spawn

    res = spawn(_rank, 2, (args.steps, args.batch_size, args.microbatches, args.seed), timeout=7200)[0]
    n = args.steps
    warm = max(1, n // 5)
    tenth = max(1, n // 10)
    MB = 2 ** 20
    lines = [f"# Soak: {n} steps on 2 CPU ranks (reference VLM, batches of {args.batch_size}, {args.microbatches} "
             "microbatches, asynchronous planning)", "",
             f"`python bench/soak.py --steps {n}`; RSS from /proc/self/statm after every step; warm-up = the first "
             f"{warm} steps.", "",
             "| rank | RSS after warm-up MiB | max RSS after MiB | growth | step ms, first tenth | step ms, last tenth "
             "| failed steps | fallbacks |", "|---|---|---|---|---|---|---|---|"]
    ok = True
    for r, d in enumerate(res):
        base, top = d["rss"][warm - 1], max(d["rss"][warm:])
        growth = top / base - 1
        ok &= growth <= 0.05 and d["failures"] == 0
        lines.append(f"| {r} | {base / MB:.1f} | {top / MB:.1f} | {growth:+.1%} | "
                     f"{statistics.fmean(d['times'][:tenth]) * 1e3:.1f} | "
                     f"{statistics.fmean(d['times'][-tenth:]) * 1e3:.1f} | {d['failures']} | {d['fallbacks']} |")
    pr = res[0]["planner_rss"]
    if pr:
        lines += ["", f"Background planner RSS: {pr[min(warm, len(pr)) - 1] / MB:.1f} MiB after warm-up, max "
                      f"{max(pr[min(warm, len(pr)):] or pr) / MB:.1f} MiB after."]
    lines += ["", f"Loss: first steps {[round(x, 3) for x in res[0]['loss_first']]}, last steps "
                  f"{[round(x, 3) for x in res[0]['loss_last']]}; wall {res[0]['wall']:.0f} s. "
                  f"{'PASS' if ok else 'FAIL'}: RSS growth within 5% after warm-up and no failed step."]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
