"""Simulated vs measured iteration time on 2 CPU ranks (issue 3 acceptance; DIP §2.6 reports 97.6% after calibration).

    python bench/sim_accuracy.py [--quick-calibration] [--steps 5] [--out docs/bench_sim_accuracy.md]

1. Calibrates a CPU device profile (``dipc.calibrate``, 1 thread per process as the ranks use), then fits the
   executor's per-op overhead on the first case's chunks in one process (``fit_executor_overhead``).
2. For each case (reference VLM at several widths and image counts): compiles with ``device=profile``, runs the
   same batch ``--steps`` times through the executor on 2 gloo ranks (first run discarded) and takes the median
   executed time per step (plan delivery excluded), then simulates the same plan with the profile.
3. Prints, per case, simulated and measured seconds and the accuracy ``1 - |sim - meas| / meas``, and writes the
   table to the markdown file.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = [  # (name, vision dim, text dim, layers, images per sample, seq, batch, microbatches, B_i)
    ("tiny, few images", 32, 32, 4, [1, 0, 2, 1], 24, 4, 2, 2),
    ("tiny, many images", 32, 32, 4, [4, 3, 5, 4], 48, 4, 2, 4),
    ("d128, few images", 128, 128, 4, [1, 0, 2, 1], 64, 4, 2, 2),
    ("d128, many images", 128, 128, 4, [6, 4, 5, 6], 96, 4, 4, 4),
    ("d256, text heavy", 128, 256, 4, [0, 1, 0, 1], 256, 4, 4, 2),
]


def _model(vdim, tdim, layers):
    from dipc.models import ReferenceVLM, VLMConfig
    from dipc.models.language import TextConfig
    from dipc.models.vlm import VisionConfig
    cfg = VLMConfig.tiny()
    cfg.vision = VisionConfig(image_size=16, patch_size=8, dim=vdim, n_layers=layers, n_heads=2, ffn_dim=4 * vdim)
    cfg.text = TextConfig(vocab_size=128, dim=tdim, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=4 * tdim)
    return ReferenceVLM(cfg)


def _batch(counts, seq, seed):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from pipeline_cases import vlm_batch
    return vlm_batch(counts, seq, seed)


def _run(rank, world, profile_json, case, steps):
    import torch
    import dipc
    from dipc.device import DeviceProfile
    name, vdim, tdim, layers, counts, seq, bs, n_mb, b_i = case
    prof = DeviceProfile.from_json(profile_json)
    torch.manual_seed(0)
    model = _model(vdim, tdim, layers)
    compiled = dipc.compile(model, _batch([1, 1], 12, 0), world, device=prof, sub_microbatch_size={"vision": b_i})
    pipe = compiled.runtime(n_microbatches=n_mb)
    batch = _batch(counts, seq, 1)
    times = []
    for _ in range(steps + 1):
        pipe.step(batch)
        times.append(pipe.last_timing["execute_s"])
        for p in pipe.parameters():
            p.grad = None
    measured = statistics.median(times[1:])
    gathered = [None] * world
    import torch.distributed as dist
    dist.all_gather_object(gathered, measured)
    if rank == 0:
        res, plan = dipc.simulate(compiled, batch, n_mb)
        return {"sim": res.iteration_time, "meas": max(gathered), "bubble": res.bubble_ratio}
    return None


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--quick-calibration", action="store_true")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default="docs/bench_sim_accuracy.md")
    args = p.parse_args(argv)
    from dipc.calibrate import calibrate
    from dipc.launch import spawn
    t = time.perf_counter()
    cal = calibrate("cpu", quick=args.quick_calibration, verbose=False)
    prof = cal.profile
    print(f"calibrated CPU profile in {time.perf_counter() - t:.0f} s: peak {prof.peak_flops / 1e9:.1f} GFLOP/s, "
          f"memory {prof.mem_bandwidth / 1e9:.1f} GB/s, P2P {prof.p2p_bandwidth / 1e9:.2f} GB/s + "
          f"{prof.p2p_latency * 1e6:.0f} us, launch overhead {prof.launch_overhead * 1e6:.1f} us")
    # graph-level correction: the executor's per-op overhead, fitted on the first case's chunks in this process
    import torch
    import dipc
    from dipc.calibrate import fit_executor_overhead
    torch.set_num_threads(1)
    name, vdim, tdim, layers, counts, seq, bs, n_mb, b_i = CASES[0]
    torch.manual_seed(0)
    fit_on = dipc.compile(_model(vdim, tdim, layers), _batch([1, 1], 12, 0), 2, device=prof,
                          sub_microbatch_size={"vision": b_i})
    bare = prof.launch_overhead
    prof = fit_executor_overhead(fit_on, _batch(counts, seq, 1), n_mb)
    print(f"executor overhead per op: {prof.launch_overhead * 1e6:.1f} us (bare op launch {bare * 1e6:.1f} us)")
    rows = []
    for case in CASES:
        r = spawn(_run, 2, (prof.to_json(), case, args.steps), timeout=900)[0]
        acc = 1 - abs(r["sim"] - r["meas"]) / r["meas"]
        rows.append((case[0], r["sim"], r["meas"], acc, r["bubble"]))
        print(f"{case[0]:>20}: simulated {r['sim'] * 1e3:8.2f} ms  measured {r['meas'] * 1e3:8.2f} ms  "
              f"accuracy {acc:6.1%}", flush=True)
    lines = ["| case | simulated (ms) | measured (ms) | accuracy | simulated bubble ratio |", "|---|---|---|---|---|"]
    for name, s, m, a, b in rows:
        lines.append(f"| {name} | {s * 1e3:.2f} | {m * 1e3:.2f} | {a:.1%} | {b:.3f} |")
    table = "\n".join(lines)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        f.write("# Simulated vs measured iteration time, reference VLM on 2 CPU ranks\n\n")
        f.write(f"Command: `python bench/sim_accuracy.py{' --quick-calibration' if args.quick_calibration else ''} "
                f"--steps {args.steps}`. Profile: peak {prof.peak_flops / 1e9:.1f} GFLOP/s, memory "
                f"{prof.mem_bandwidth / 1e9:.1f} GB/s, P2P {prof.p2p_bandwidth / 1e9:.2f} GB/s + "
                f"{prof.p2p_latency * 1e6:.0f} us, per-op overhead in the executor {prof.launch_overhead * 1e6:.1f} us "
                f"(fitted on the first case's chunks in one process; bare op launch {bare * 1e6:.1f} us).\n\n")
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
