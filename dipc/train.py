"""The main job: train a multimodal model as a dipc pipeline across processes on CPU.

    python -m dipc.train                      # tiny Hugging Face LLaVA, 2 ranks, 30 steps
    python -m dipc.train --model vlm          # dipc's reference VLM
    python -m dipc.train --model t2v          # dipc's reference text-to-video diffusion model
    torchrun --nproc-per-node 2 -m dipc.train # the same under torchrun

Every rank builds the model from the same seed (random init, no download), compiles it with :func:`dipc.compile`,
and trains with AdamW on generated batches whose images per sample and text lengths vary like real interleaved
image-text data (see :mod:`dipc.models.data` for the published statistics used).  Rank 0 prints per step the loss,
the microbatches (images in each), the sub-microbatches, and the step report's line
(:meth:`dipc.runtime.StepReport.summary`): which schedule ran and where its plan came from (``async``: made by the
background planner while the previous step ran, DIP §2.2; ``sync``: made at the start of the step, as the first
step's is; ``fallback``: the background plan was late), the planning time on the training thread (which includes
re-capturing the model when a batch brings a shape the model fixes, e.g. a new image count for HF LLaVA) and in the
background planner, the simulated iteration time (first, uncalibrated cost estimate) against the measured one, the
simulated bubble ratio, and the fallbacks so far.  ``--sync-planning`` plans every step at its start instead;
``--report STEP`` writes that step's measured Gantt chart (PNG, needs matplotlib) and Chrome trace (JSON).
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import math
import os
import time
import warnings

import torch

__all__ = ["main", "build", "parse_args"]


def build(model: str, seed: int, n_batches: int, batch_size: int):
    """(model, batches) for ``model`` in {"llava", "vlm", "t2v"}; batches[0] is the example batch."""
    torch.manual_seed(seed)
    if model == "llava":
        from dipc.models.hf import tiny_llava
        from dipc.models.data import llava_batches
        m = tiny_llava(seed)
        return m, list(llava_batches(m.config, n_batches, batch_size, seed + 1))
    if model == "vlm":
        from dipc.models import ReferenceVLM, VLMConfig
        from dipc.models.data import vlm_batches
        cfg = VLMConfig.tiny()
        return ReferenceVLM(cfg), list(vlm_batches(cfg, n_batches, batch_size, seed + 1))
    if model == "t2v":
        from dipc.models import ReferenceT2V, T2VConfig
        from dipc.models.data import t2v_batches
        cfg = T2VConfig.tiny()
        return ReferenceT2V(cfg), list(t2v_batches(cfg, n_batches, batch_size, seed + 1))
    raise ValueError(f"unknown model {model!r}: choose llava, vlm or t2v")


def _run(rank: int, world: int, args) -> list:
    if rank != 0:  # every rank meets the same warnings: rank 0 prints them once for the job
        warnings.filterwarnings("ignore", message="dipc:")
    import dipc
    model, batches = build(args.model, args.seed, args.steps + 1, args.batch_size)
    t0 = time.perf_counter()
    compiled = dipc.compile(model, batches[0], world)
    compile_s = time.perf_counter() - t0
    if rank == 0:
        print(f"compiled {type(model).__name__} for {world} ranks in {compile_s:.2f} s", flush=True)
        print(compiled.describe(), flush=True)
        if args.save:
            compiled.save(args.save)
            print(f"wrote chunk sources to {args.save}/", flush=True)
    pipe = compiled.runtime(n_microbatches=args.microbatches, timeout=args.timeout)
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    # the model, its captures and the stage modules live for the whole job: out of the collector's reach, a
    # generation-2 collection stays short (about 1.25M objects at LLaVA took 0.1-1.4 s a collection, a stall every
    # rank waits for; Megatron-LM's --manual-gc answers the same)
    gc.collect()
    gc.freeze()
    history = []
    steps = batches[1:] if args.sync_planning else dipc.prefetch(batches[1:])
    for step, batch in enumerate(steps):
        t = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:  # dipc's notes print under the step's row
            loss = pipe.step(batch)
        opt.step()
        opt.zero_grad()
        dt = time.perf_counter() - t
        mbs = pipe.last_microbatches
        images = [sum(mb.instances.values()) for mb in mbs]
        subs = sum(len(v) for mb in mbs for v in mb.subs.values())
        history.append((float(loss), dt))
        if args.report is not None and step == args.report:
            events = pipe.trace_events()  # a collective: every rank
            if rank == 0:
                from dipc.sim.trace import gantt_png, write_chrome_trace
                os.makedirs(args.report_dir, exist_ok=True)
                base = os.path.join(args.report_dir, f"step{step}")
                write_chrome_trace(events, base + ".json", f"{args.model} step {step}")
                try:
                    gantt_png(events, base + ".png", f"{args.model} step {step} ({pipe.last_report.schedule})")
                    print(f"wrote {base}.png and {base}.json", flush=True)
                except ImportError:
                    print(f"wrote {base}.json (matplotlib is not installed: no Gantt PNG)", flush=True)
        if rank == 0:
            shape = "x".join(str(s) for s in next(iter(batch.values())).shape)
            enc = f" (images {images})  sub-microbatches {subs}" if compiled.batch_spec.instances else ""
            print(f"step {step:3d}  loss {float(loss):.4f}  batch {shape}  microbatches {len(mbs)}{enc}  "
                  f"wall {dt * 1e3:.0f} ms | {pipe.last_report.summary()}", flush=True)
        for w in caught:
            if str(w.message).startswith("dipc:"):
                if rank == 0:
                    print(f"          note: {str(w.message)[len('dipc:'):].strip()}", flush=True)
            else:
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    pipe.close()
    if rank == 0 and len(history) >= 10:
        first = sum(l for l, _ in history[:5]) / 5
        last = sum(l for l, _ in history[-5:]) / 5
        print(f"mean loss of the first 5 steps {first:.4f}, of the last 5 steps {last:.4f}", flush=True)
    return history


class _Given(argparse.Action):
    """Stores the value and notes that the option was given (``args.given``): options that only take effect with
    another, or only without torchrun, are refused when given in vain."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.given = getattr(namespace, "given", frozenset()) | {self.dest}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dipc.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="llava", choices=["llava", "vlm", "t2v"],
                   help="the model to train (docs/user_guide.md: Main job options)")
    p.add_argument("--pp", type=int, default=2, action=_Given,
                   help="pipeline ranks (processes) when not under torchrun")
    p.add_argument("--steps", type=int, default=30, help="training steps")
    p.add_argument("--batch-size", type=int, default=8, help="samples per step")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step (at most --batch-size)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="model and data seed")
    p.add_argument("--save", default=None, help="write the generated chunk sources to this folder")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds any distributed wait may take; without torchrun also the whole job's limit")
    p.add_argument("--sync-planning", action="store_true",
                   help="plan each step at its start instead of in the background during the previous step")
    p.add_argument("--report", type=int, default=None, metavar="STEP",
                   help="write this step's measured Gantt chart and Chrome trace to --report-dir (steps count "
                        "from 0)")
    p.add_argument("--report-dir", default="dipc_report", action=_Given,
                   help="folder for --report (made if missing; its parent folder must exist)")
    p.add_argument("--pin-cpus", action="store_true",
                   help="pin each rank to its own CPU (dipc.launch.pin_rank); rank 0's background planner then runs "
                        "on the other CPUs")
    return p


def _out_folder(p, option: str, path: str) -> None:
    """``path`` must be a folder that exists or can be made in an existing one, writable either way."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    if os.path.exists(path) and not os.path.isdir(path):
        p.error(f"{option} {path}: a file of that name exists; give a folder")
    if not os.path.isdir(parent):
        p.error(f"{option} {path}: the folder {parent} does not exist")
    here = path if os.path.isdir(path) else parent
    if not os.access(here, os.W_OK | os.X_OK):
        p.error(f"{option} {path}: {here} is not writable")


def parse_args(argv=None) -> argparse.Namespace:
    """The job's options, checked: a combination that cannot take effect exits with an argparse error (exit code
    2, naming the option and its value) before any process starts."""
    p = _parser()
    args = p.parse_args(argv)
    given = getattr(args, "given", frozenset())
    args.given = given
    from dipc.wire import MIN_TIMEOUT

    for opt, v in (("--pp", args.pp), ("--steps", args.steps), ("--batch-size", args.batch_size),
                   ("--microbatches", args.microbatches)):
        if v < 1:
            p.error(f"{opt} must be at least 1, got {v}")
    if args.microbatches > args.batch_size:
        p.error(f"--microbatches {args.microbatches} is more than --batch-size {args.batch_size}: a microbatch "
                "needs at least one sample")
    if not math.isfinite(args.lr) or args.lr < 0:
        p.error(f"--lr must be a finite number >= 0, got {args.lr:g}")
    if not -2 ** 63 <= args.seed <= 2 ** 64 - 2:  # torch.manual_seed's range; the data uses seed + 1
        p.error(f"--seed must be between -2**63 and 2**64 - 2, got {args.seed}")
    if not math.isfinite(args.timeout) or args.timeout < MIN_TIMEOUT:
        p.error(f"--timeout must be a finite number of seconds >= {MIN_TIMEOUT:g}, got {args.timeout:g}")
    if args.report is not None and not 0 <= args.report < args.steps:
        p.error(f"--report {args.report} is not a step of this job: --steps {args.steps} runs steps 0 to "
                f"{args.steps - 1}")
    if args.report is None and "report_dir" in given:
        p.error(f"--report-dir {args.report_dir} takes effect only with --report STEP")
    if args.report is not None:
        _out_folder(p, "--report-dir", args.report_dir)
    if args.save is not None:
        _out_folder(p, "--save", args.save)
    if args.pin_cpus and not hasattr(os, "sched_setaffinity"):
        p.error("--pin-cpus needs os.sched_setaffinity (Linux)")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: its world size is the pipeline's
        world = os.environ["WORLD_SIZE"]
        if "pp" in given and str(args.pp) != world:
            p.error(f"--pp {args.pp} does not apply under torchrun, whose WORLD_SIZE is {world} (give "
                    "--nproc-per-node instead)")
    if args.model == "llava" and importlib.util.find_spec("transformers") is None:
        p.error("--model llava needs transformers (pip install -e '.[hf]'); --model vlm and t2v do not")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        from dipc.launch import init_from_env, pin_rank
        import torch.distributed as dist
        if args.pin_cpus:
            pin_rank(int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
        init_from_env(timeout=args.timeout)
        torch.set_num_threads(1)
        _run(dist.get_rank(), dist.get_world_size(), args)
        dist.destroy_process_group()
    else:
        from dipc.launch import spawn
        spawn(_run, args.pp, (args,), timeout=args.timeout, pin_cpus=args.pin_cpus)


if __name__ == "__main__":
    main()
