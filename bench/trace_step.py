"""Pictures of one step of the reference VLM on 2 CPU ranks: simulated (planner's estimate) and measured.

    python bench/trace_step.py [--out docs]

Writes ``gantt_simulated.png``, ``trace_simulated.json``, ``gantt_measured.png`` and ``trace_measured.json``
(open the JSON files in https://ui.perfetto.dev or chrome://tracing).  The simulated step uses the compiled
pipeline's first, uncalibrated cost estimate (nominal 1 TFLOP/s, 100 GB/s), so its time scale differs from the
measured one until the calibrated cost model lands; the order of actions is the plan both share.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _measure(rank, world, out):
    import torch
    import dipc
    from dipc.models import ReferenceVLM, VLMConfig
    from dipc.models.data import vlm_batches
    from dipc.trace import gantt_png, write_chrome_trace
    torch.manual_seed(0)
    cfg = VLMConfig.tiny()
    batches = list(vlm_batches(cfg, 3, 4, 1, max_seq=48))
    compiled = dipc.compile(ReferenceVLM(cfg), batches[0], world, sub_microbatch_size={"vision": 4})
    pipe = compiled.runtime(n_microbatches=4)
    pipe.step(batches[1])  # warm-up
    pipe.step(batches[2])
    events = pipe.trace_events()
    if rank == 0:
        write_chrome_trace(events, os.path.join(out, "trace_measured.json"), "dipc: measured step, reference VLM")
        gantt_png(events, os.path.join(out, "gantt_measured.png"), "measured step (reference VLM, 2 CPU ranks)")
        res, plan = dipc.simulate(compiled, batches[2], 4)
        ev = res.events({c.index: c.modality for c in compiled.partition.chunks})
        write_chrome_trace(ev, os.path.join(out, "trace_simulated.json"), "dipc: simulated step, reference VLM")
        gantt_png(ev, os.path.join(out, "gantt_simulated.png"), "simulated step (uncalibrated estimate)")
        return {"plan": plan.to_text(), "sim_iteration_s": res.iteration_time, "bubble": res.bubble_ratio,
                "measured_s": pipe.last_timing["execute_s"]}
    return None


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="docs")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    from dipc.launch import spawn
    r = spawn(_measure, 2, (os.path.abspath(args.out),), timeout=600)[0]
    print(r["plan"])
    print(f"simulated iteration {r['sim_iteration_s'] * 1e3:.3f} ms (bubble ratio {r['bubble']:.3f}); "
          f"measured execution {r['measured_s'] * 1e3:.1f} ms")
    print(f"wrote {args.out}/gantt_simulated.png, trace_simulated.json, gantt_measured.png, trace_measured.json")


if __name__ == "__main__":
    main()
