"""Pictures of one step of the reference VLM on 2 CPU ranks: simulated (planner's estimate) and measured.

    python bench/trace_step.py [--out docs]

Writes ``gantt_simulated.png``, ``trace_simulated.json``, ``gantt_measured.png`` and ``trace_measured.json``
(open the JSON files in https://ui.perfetto.dev or chrome://tracing).  The CPU profile is calibrated by operator
microbenchmarks (``dipc.calibrate``, quick) and then on this pipeline itself
(:func:`dipc.calibrate.fit_pipeline_overheads`, on other batches than the drawn one); the pipeline is re-compiled with
that profile, so the simulated step is the planner's prediction of the measured one, on the same time scale, for
the plan both share.  Compute actions, SEND/RECV postings and waits for messages are drawn (:mod:`dipc.sim.trace`).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _measure(rank, world, out, profile_json):
    import torch
    import dipc
    from dipc.calibrate import fit_pipeline_overheads
    from dipc.sim.device import DeviceProfile
    from dipc.models import ReferenceVLM, VLMConfig
    from dipc.models.data import vlm_batches
    from dipc.sim.trace import gantt_png, write_chrome_trace
    torch.manual_seed(0)
    cfg = VLMConfig.tiny()
    batches = list(vlm_batches(cfg, 3, 4, 1, max_seq=48))
    model = ReferenceVLM(cfg)
    compiled = dipc.compile(model, batches[0], world, sub_microbatch_size={"vision": 4},
                            device=DeviceProfile.from_json(profile_json))
    prof = fit_pipeline_overheads(compiled.runtime(n_microbatches=4), batches[1], steps=4)
    compiled = dipc.compile(model, batches[0], world, sub_microbatch_size={"vision": 4}, device=prof)
    pipe = compiled.runtime(n_microbatches=4)
    pipe.step(batches[1])  # warm-up
    pipe.step(batches[2])
    pipe.step(batches[2])
    events = pipe.trace_events()
    if rank == 0:
        write_chrome_trace(events, os.path.join(out, "trace_measured.json"), "dipc: measured step, reference VLM")
        gantt_png(events, os.path.join(out, "gantt_measured.png"), "measured step (reference VLM, 2 CPU ranks)")
        res, plan = dipc.simulate(compiled, batches[2], 4)
        ev = res.events({c.index: c.modality for c in compiled.partition.chunks})
        write_chrome_trace(ev, os.path.join(out, "trace_simulated.json"), "dipc: simulated step, reference VLM")
        gantt_png(ev, os.path.join(out, "gantt_simulated.png"), "simulated step (calibrated CPU profile)")
        return {"plan": plan.to_text(), "sim_iteration_s": res.iteration_time, "bubble": res.bubble_ratio,
                "measured_s": pipe.last_timing["execute_s"], "fit": prof.meta["pipeline_fit"]}
    return None


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="docs")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    from dipc.calibrate import calibrate
    from dipc.launch import spawn
    base = calibrate("cpu", quick=True, verbose=False).profile
    r = spawn(_measure, 2, (os.path.abspath(args.out), base.to_json()), timeout=600)[0]
    print(r["plan"])
    print(f"simulated iteration {r['sim_iteration_s'] * 1e3:.3f} ms (bubble ratio {r['bubble']:.3f}); "
          f"measured execution {r['measured_s'] * 1e3:.1f} ms")
    f = r["fit"]
    print(f"calibration steps (batch 1): measured {f['measured_step_s'] * 1e3:.1f} ms, simulated "
          f"{f['simulated_step_s'] * 1e3:.1f} ms with the fitted profile")
    print(f"wrote {args.out}/gantt_simulated.png, trace_simulated.json, gantt_measured.png, trace_measured.json")


if __name__ == "__main__":
    main()
