"""Calibrate a :class:`~dipc.sim.device.DeviceProfile` by microbenchmarks on this machine (DIP §2.6).

Usage::

    python -m dipc.calibrate [--device cpu|cuda] [--out profile.json] [--quick] [--threads N] [--no-p2p]
                             [--dtype float32|bfloat16] [--name NAME] [--stat median|min] [--cache-level]

The command times ATen operators the way a captured chunk calls them (``torch.ops.aten.<op>.<overload>``) at
several sizes, per operator family, then fits the model of :meth:`DeviceProfile.op_latency`:

* ``launch_overhead``: median time of tiny operators (1-element add/mul/sum, 1x1 mm) on inputs that require grad,
  with grad mode on, as in a training forward; seconds.  (The other benchmarks run under ``no_grad``.)
* ``peak_flops``: the best FLOP/s any matmul benchmark reached (fp32 on CPU, bf16 on CUDA by default).
* ``mem_bandwidth``: the best bytes/s (bytes read + written) of the stream benchmarks (``copy_`` and ``add``
  into a preallocated output), on CPU among those larger than the per-core L2 (read from sysfs).
* ``cache_bytes``, ``cache_bandwidth`` (CPU, only with ``--cache-level``): the L2 size and the best stream rate within
  it; operators that small then use that rate (see :meth:`DeviceProfile.bandwidth_for`).  Off by default: it helps
  bandwidth-bound operators (add, copy, sum, embedding) at L2 sizes 2-4x, but transcendental pointwise operators
  (silu, gelu, rsqrt, softmax), which one CPU core runs at a fixed per-element rate whatever the cache, fit worse.
* ``alpha[family]``: the factor that minimizes the mean log error ``|log(pred / meas)|`` of
  ``pred = launch_overhead + alpha * max(flops / peak_flops, bytes / mem_bandwidth)`` over that family's benchmarks
  (see :func:`fit_alpha`).
* ``op_alpha[op]``: the same fit over one operator's benchmarks (e.g. "gelu_tanh", "silu", "mm"), used when the
  caller names the operator (``op_latency(..., op=...)``).
* ``p2p_latency``, ``p2p_bandwidth``, ``alpha["p2p"]``: a ping-pong between two processes (gloo over loopback on
  CPU, NCCL between GPUs 0 and 1 on CUDA) started with :func:`dipc.launch.spawn`; latency = one-way time of the
  smallest message, bandwidth = the best rate of the large messages after subtracting the latency, alpha fitted as
  above.  With fewer than two GPUs (or ``--no-p2p``) P2P is not measured and the figures come from the matching
  datasheet profile (CUDA) or a nominal guess (CPU), which ``source`` says.

It prints a table of measured vs predicted latency per benchmark (accuracy = 1 - |pred - meas| / meas), also for the
uncalibrated model (alpha = 1, no launch overhead), and writes the profile as JSON (default:
``<user profile dir>/<name>.json``, which :meth:`DeviceProfile.load` finds by name: ``DeviceProfile.load("cpu")``).

Every process runs ``--threads`` intra-op threads (default 1, as each pipeline rank does).  ``--quick`` (smaller
sizes, shorter timing) takes well under 30 s on a 2-core CPU; the full run about a minute or two.
"""
from __future__ import annotations

import argparse
import datetime
import dataclasses
import os
import platform
import statistics
import sys
import time
from typing import Callable, Sequence

import torch

from .plan import forward_key
from .sim.device import DeviceProfile, user_profile_dir
from .sim.microbench import (Bench, Calibration, accuracies, accuracy_table, benchmarks, cpu_name, fit_alpha,
                             fit_profile, gpu_profile_name, l2_bytes, timeit)

__all__ = ["Bench", "Calibration", "calibrate", "main", "accuracy_table", "fit_alpha",
           "fit_pipeline_overheads"]


# ---------------------------------------------------------------------- P2P
def _p2p_worker(rank: int, world: int, sizes: Sequence[int], min_time: float, repeats: int,
                device: str, stat: str = "median") -> list[tuple[int, float]] | None:
    """Ping-pong between ranks 0 and 1 (module-level so that :func:`dipc.launch.spawn` can pickle it); rank 0 returns
    [(bytes, one-way seconds)]: half the round trip, median (or min) over ``repeats`` loops of about ``min_time``."""
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        sync = torch.cuda.synchronize
    else:
        dev = torch.device("cpu")
        sync = lambda: None  # noqa: E731
    peer = 1 - rank
    res = []
    for nbytes in sizes:
        buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=dev)

        def rt(n):
            for _ in range(n):
                if rank == 0:
                    dist.send(buf, peer)
                    dist.recv(buf, peer)
                else:
                    dist.recv(buf, peer)
                    dist.send(buf, peer)
            sync()

        rt(2)
        # rank 0 decides the loop length from a short estimate and tells rank 1
        t0 = time.perf_counter()
        rt(2)
        est = (time.perf_counter() - t0) / 2
        n = torch.tensor([max(1, min(10000, int(min_time / max(est, 1e-7))))], dtype=torch.int64, device=dev)
        dist.broadcast(n, 0)
        n = int(n.item())
        times = []
        for _ in range(repeats):
            if device != "cuda":
                dist.barrier()
            t0 = time.perf_counter()
            rt(n)
            times.append((time.perf_counter() - t0) / n / 2)
        res.append((int(buf.numel() * 4), min(times) if stat == "min" else statistics.median(times)))
    return res if rank == 0 else None


def _measure_p2p(device: str, quick: bool, threads: int, stat: str = "median") -> list[tuple[int, float]]:
    from . import calibrate as _self  # the worker must be pickled by its module name, also under `python -m`
    from .launch import spawn

    if device == "cuda":
        sizes = [4, 1 << 16, 1 << 22, 1 << 26] if quick else [4, 1 << 12, 1 << 16, 1 << 20, 1 << 24, 1 << 26, 1 << 28]
    else:
        sizes = [4, 1 << 12, 1 << 18, 1 << 22] if quick else [4, 1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22, 1 << 24,
                                                              1 << 26]
    min_time, repeats = (0.02, 5) if quick else (0.1, 7)
    out = spawn(_self._p2p_worker, 2, (sizes, min_time, repeats, device, stat), timeout=120.0 if quick else 600.0,
                backend="nccl" if device == "cuda" else "gloo", threads_per_rank=threads)
    return out[0]




# ---------------------------------------------------------------------- driver
def calibrate(device: str = "cpu", *, quick: bool = False, threads: int = 1, p2p: bool = True,
              dtype: str | None = None, name: str | None = None, stat: str = "median", cache_level: bool = False,
              verbose: bool = True,
              log: Callable[[str], None] = print) -> Calibration:
    """Run the microbenchmarks on ``device`` and fit a calibrated :class:`DeviceProfile` (DIP §2.6).

    Args:
        device: "cpu" or "cuda" (the current CUDA device).
        quick: smaller sizes and shorter timing loops (under ~30 s on a 2-core CPU).
        threads: torch intra-op threads for this process and for each P2P process (restored afterwards).
        p2p: measure P2P between two processes (on CUDA only with at least two GPUs).
        dtype: training dtype of the compute benchmarks ("float32", "bfloat16", "float16"); default float32 on
            CPU, bfloat16 on CUDA.
        name: profile name; default "cpu", or on CUDA the matching datasheet name ("h100", ...) else "cuda".
        stat: "median" (default) or "min" of the timed loops; "min" is steadier on a machine other processes load.
        cache_level: on CPU, also fit the profile's optional cache level (``cache_bytes`` = per-core L2,
            ``cache_bandwidth``); False (default) keeps DIP's single memory level.
        verbose: print progress and the accuracy table through ``log``.

    Returns:
        a :class:`Calibration` (profile with ``calibrated=True``, measured benchmarks, P2P points, mean accuracies).

    Raises:
        ValueError: unknown device, dtype or stat; "cuda" without a CUDA device; threads < 1.
        dipc.launch.SpawnError: the P2P processes failed.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch.cuda.is_available() is False")
    dtype = dtype or ("float32" if device == "cpu" else "bfloat16")
    tdtype = getattr(torch, dtype, None)
    if not isinstance(tdtype, torch.dtype) or not tdtype.is_floating_point:
        raise ValueError(f"dtype must be a torch floating dtype name, got {dtype!r}")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if stat not in ("median", "min"):
        raise ValueError(f"stat must be 'median' or 'min', got {stat!r}")
    started = time.perf_counter()
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if device == "cuda":
            dev = f"cuda:{torch.cuda.current_device()}"
            sync = torch.cuda.synchronize
            gpu_name = torch.cuda.get_device_name()
            hw = f"{gpu_name} (CUDA {torch.version.cuda})"
            datasheet = gpu_profile_name(gpu_name)
            mem_cap = float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
        else:
            dev, sync = "cpu", (lambda: None)
            hw = f"{cpu_name()}, {os.cpu_count()} logical CPUs"
            datasheet = None
            try:
                mem_cap = float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
            except (ValueError, OSError, AttributeError):
                mem_cap = None
        name = name or ((datasheet or "cuda") if device == "cuda" else "cpu")
        min_time, repeats = (0.01, 5) if quick else (0.05, 7)
        try:
            load = os.getloadavg()[0]
        except (OSError, AttributeError):
            load = None
        if verbose:
            log(f"dipc.calibrate: {hw}, torch {torch.__version__}, {threads} thread(s), {dtype}, "
                f"{'quick' if quick else 'full'}, {stat} of {repeats} loops")
            if device == "cpu" and load is not None and load > 0.5 * (os.cpu_count() or 1):
                log(f"  warning: this machine is busy (1-minute load average {load:.2f} on {os.cpu_count()} CPUs); "
                    f"other processes will inflate and scatter the timings (P2P most: its two processes need two "
                    f"free cores). Calibrate on an idle machine, or try --stat min.")
        benches: list[Bench] = []
        torch.manual_seed(0)
        for b, make in benchmarks(dev, tdtype, quick):
            with torch.set_grad_enabled(b.role == "overhead"):
                fn = make()
                b.seconds = timeit(fn, sync, min_time, repeats, stat)
            del fn
            benches.append(b)
        if device == "cuda":
            torch.cuda.empty_cache()
        if verbose:
            log(f"  {len(benches)} operator benchmarks in {time.perf_counter() - started:.1f} s")

        points: list[tuple[int, float]] = []
        if p2p and (device == "cpu" or torch.cuda.device_count() >= 2):
            t0 = time.perf_counter()
            points = _measure_p2p(device, quick, threads, stat)
            if verbose:
                log(f"  P2P ping-pong ({'NCCL' if device == 'cuda' else 'gloo'}, 2 processes) in "
                    f"{time.perf_counter() - t0:.1f} s")
        fit = fit_profile(benches, points, l2_bytes() if device == "cpu" else None, cache_level)
        if points:
            p2p_note = (f"P2P: {'NCCL' if device == 'cuda' else 'gloo'} send/recv ping-pong between 2 processes; "
                        f"latency = one-way time of a {points[0][0]} B message, bandwidth = best rate of messages "
                        f">= 1 MiB after the latency, alpha['p2p'] fitted over {len(points)} sizes.")
        elif device == "cuda" and datasheet:
            ref = DeviceProfile.load(datasheet, user=False)
            fit.update(p2p_latency=ref.p2p_latency, p2p_bandwidth=ref.p2p_bandwidth)
            fit["alpha"]["p2p"] = 1.0
            p2p_note = f"P2P not measured (needs 2 GPUs or was disabled): latency and bandwidth from {datasheet}.json."
        else:
            lat, bw = (1e-5, 25e9) if device == "cuda" else (5e-5, 1e9)
            fit.update(p2p_latency=lat, p2p_bandwidth=bw)
            fit["alpha"]["p2p"] = 1.0
            p2p_note = f"P2P not measured (needs 2 GPUs or was disabled): nominal {bw / 1e9:g} GB/s, {lat * 1e6:g} us."
        cache_note = ("cache level: operators moving <= cache_bytes (the per-core L2) use cache_bandwidth = best "
                      "copy_/add-into-output rate of such sizes. " if fit["cache_bytes"] is not None else "")
        source = (f"Measured by `python -m dipc.calibrate{' --quick' if quick else ''}` on {hw}, "
                  f"{datetime.datetime.now().astimezone().isoformat(timespec='seconds')}, torch {torch.__version__}, "
                  f"{threads} thread(s) per process, {dtype}, {stat} of {repeats} timed loops. launch_overhead = "
                  f"median time of tiny ATen ops (grad mode on); peak_flops = best matmul rate; mem_bandwidth = best "
                  f"copy_/add-into-output rate (bytes read + written) of sizes beyond the cache level; {cache_note}"
                  f"alpha per family (and op_alpha per operator) minimizes the mean |log(pred/meas)| of "
                  f"launch_overhead + alpha * max(flops/F, bytes/B) over its benchmarks. {p2p_note}")
        profile = DeviceProfile(name=name, **fit, calibrated=True, source=source, dtype=dtype, memory_capacity=mem_cap)
        for b in benches:
            b.predicted = profile.op_latency(b.family, b.flops, b.bytes, op=b.op)
        raw = dataclasses.replace(profile, alpha={}, op_alpha={}, launch_overhead=0.0, cache_bytes=None,
                                  cache_bandwidth=None)
        accs = accuracies(profile, benches, points)
        acc_raw = statistics.mean(accuracies(raw, benches, points, use_op=False))
        acc_fam = statistics.mean(accuracies(profile, benches, points, use_op=False))
        acc, acc_med = statistics.mean(accs), statistics.median(accs)
        profile.meta = {
            "host": platform.node(), "hardware": hw, "torch": torch.__version__, "threads": threads,
            "quick": quick, "stat": stat, "load_average": load, "mean_accuracy": acc, "median_accuracy": acc_med,
            "mean_accuracy_family_alpha": acc_fam,
            "mean_accuracy_uncalibrated": acc_raw,
            "benchmarks": [{"name": b.name, "family": b.family, "op": b.op, "role": b.role, "flops": b.flops,
                            "bytes": b.bytes, "seconds": b.seconds, "predicted": b.predicted} for b in benches],
            "p2p": [{"bytes": n, "seconds": t, "predicted": profile.p2p_time(n)} for n, t in points],
        }
        elapsed = time.perf_counter() - started
        if verbose:
            log(accuracy_table(profile, benches, points))
            log(f"mean accuracy: {acc * 100:.1f}% with per-operator alpha (median {acc_med * 100:.1f}%), "
                f"{acc_fam * 100:.1f}% with per-family alpha, {acc_raw * 100:.1f}% uncalibrated (alpha = 1, no launch "
                f"overhead, same peaks)")
            log(profile.summary())
            log("alpha: " + ", ".join(f"{k} {v:.3g}" for k, v in profile.alpha.items()))
            log("op_alpha: " + ", ".join(f"{k} {v:.3g}" for k, v in profile.op_alpha.items()))
            log(f"calibration took {elapsed:.1f} s")
        return Calibration(profile, benches, points, acc, acc_fam, acc_raw, elapsed)
    finally:
        torch.set_num_threads(old_threads)


def main(argv: Sequence[str] | None = None) -> DeviceProfile:
    """Command-line entry point (``python -m dipc.calibrate --help``); writes and returns the profile.

    Raises:
        SystemExit: bad arguments (argparse).
        ValueError, dipc.launch.SpawnError: see :func:`calibrate`.
    """
    ap = argparse.ArgumentParser(prog="python -m dipc.calibrate",
                                 description="Measure this machine and write a calibrated dipc device profile (JSON).")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--out", default=None,
                    help="output JSON path (default: <user profile dir>/<name>.json, loadable by name)")
    ap.add_argument("--quick", action="store_true", help="smaller sizes, shorter loops (< ~30 s on 2 CPU cores)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1, as pipeline ranks)")
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) | bfloat16 (CUDA default) | float16")
    ap.add_argument("--name", default=None, help="profile name (default: cpu, or the GPU's datasheet name)")
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="statistic over the timed loops (min is steadier on a loaded machine)")
    ap.add_argument("--no-p2p", action="store_true", help="skip the two-process P2P measurement")
    ap.add_argument("--cache-level", action="store_true",
                    help="CPU: add an L2 cache level (cache_bytes, cache_bandwidth) to DIP's single memory bandwidth")
    args = ap.parse_args(argv)
    cal = calibrate(args.device, quick=args.quick, threads=args.threads, p2p=not args.no_p2p, dtype=args.dtype,
                    name=args.name, stat=args.stat, cache_level=args.cache_level)
    out = args.out or (user_profile_dir() / f"{cal.profile.name}.json")
    path = cal.profile.save(out)
    print(f"wrote {path}")
    return cal.profile


if __name__ == "__main__":
    main()
    sys.exit(0)


def fit_pipeline_overheads(pipe, batch, *, steps: int = 4, n_microbatches: int | None = None) -> DeviceProfile:
    """Calibrate the profile on a running pipeline (a collective: call it on every rank of ``pipe``).

    Operator microbenchmarks time ATen calls alone, one process at a time; a pipeline rank also pays fx's generated
    Python, autograd recording and the autograd engine per operator, the host side of every ``isend``/``irecv`` and
    a fixed cost per step around the plan, and it computes while the other ranks compute beside it (on a CPU they
    share caches, memory bandwidth and clock boost).  This runs ``steps`` + 1 training steps of ``batch`` (the first
    is a warm-up; parameters are not updated, and gradients the caller had accumulated are put back afterwards) and
    fits, from the executor's
    own timeline (DIP §2.6 calibration, done on the real executor):

    * a contention factor ``s`` and the per-operator overheads ``launch_overhead`` (forward) and
      ``backward_overhead``, by least squares over every stage's mean compute time (time spent waiting for
      messages excluded), relative errors weighted equally::

          measured = s * roofline + operators * (launch_overhead | backward_overhead)

      ``s`` multiplies every ``alpha`` and ``op_alpha`` of the profile (clamped to [0.5, 4], then the overheads
      are re-fitted with ``s`` fixed); when the rooflines add up to less than 20% of the measured compute (tiny,
      overhead-bound stages) ``s`` cannot be told apart from the overheads and stays 1;
    * ``p2p_post_overhead`` and ``p2p_post_per_byte``: least-squares line through the SEND/RECV actions'
      durations against their message bytes (the host work of posting one, packing included);
    * ``step_overhead``: mean over steps of the smallest per-rank time outside the actions (setup, end-of-step
      all-reduces) minus the all-reduce time the profile already predicts.

    P2P latency and bandwidth stay the microbenchmark's: in a running pipeline a message whose receive is posted
    arrives about one idle ping-pong latency after its send.  ``meta["pipeline_fit"]`` keeps the calibration step's
    mean measured time and its simulated time with the fitted profile (an in-sample check).

    Means, not medians: an iteration adds these times up, and on a shared CPU their distribution has a long tail
    (an ``isend`` now and then blocks for a scheduler time slice, milliseconds), so medians would underestimate the
    sum.  Calibrate on a model and batch of the same kind as, but not identical to, the ones you will simulate,
    with both tiny (overhead-bound) and large (FLOP-bound) stages so that the two compute terms can be told apart,
    and shortly before the runs you compare with when the machine is shared.

    Args:
        pipe: a :class:`dipc.runtime.PipelineRuntime` whose compiled pipeline has a device profile.
        batch: a batch for ``pipe.step``.
        steps: timed steps (>= 1).
        n_microbatches: microbatches per step (default: the runtime's).

    Returns:
        a copy of the compiled pipeline's profile with those fields set (the same on every rank).

    Raises:
        ValueError: the pipeline has no device profile, or ``steps`` < 1.
    """
    import numpy as np

    from .sim.simulate import end_of_step_seconds, simulate_plan

    compiled = pipe.compiled
    prof = compiled.device
    if prof is None:
        raise ValueError("compile with device=... first: the overheads are fitted against that profile")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    kept = [(p, p.grad) for p in pipe.parameters()]  # the caller's accumulated gradients, given back at the end
    for p, _ in kept:
        p.grad = None
    samples: dict[str, list] = {}  # stage -> [measured compute seconds]
    shape: dict[str, tuple[float, int, bool]] = {}  # stage -> (roofline seconds, operators, is backward)
    post, tails, execs = [], [], []
    try:
        for i in range(steps + 1):
            pipe.step(batch, n_microbatches)
            for p in pipe.parameters():
                p.grad = None
            if i == 0:
                continue
            w = pipe.last_workload
            last = 0.0
            for a, s, e, wait in pipe.last_timeline:
                last = max(last, e)
                if a.kind in ("SEND_F", "SEND_B", "RECV_F", "RECV_B"):
                    post.append((sum(t.nbytes for t in a.tensors), e - s))
                    continue
                n_ops = w.programs[forward_key(a.stage)].chunks[a.chunk].n_nodes
                backward = a.kind == "B"
                roofline = w.graph.stages[a.stage].latency - n_ops * prof.overhead(backward)
                shape[a.stage] = (roofline, n_ops, backward)
                samples.setdefault(a.stage, []).append(e - s - wait)
            tails.append(pipe.last_timing["execute_s"] - last)  # setup before the first action + after the last one
            execs.append(pipe.last_timing["execute_s"])
    finally:
        for p, g in kept:
            p.grad = g
    mine = {k: (statistics.fmean(v), *shape[k]) for k, v in samples.items()}
    from .wire import all_gather_json

    gathered = all_gather_json([mine, post, tails, execs], pipe.group, pipe.device, pipe.timeout,
                               what="calibration samples")
    stages = {k: r for g in gathered for k, r in g[0].items()}
    post = [x for g in gathered for x in g[1]]
    tail = statistics.fmean(min(g[2][i] for g in gathered) for i in range(steps))
    measured = statistics.fmean(max(g[3][i] for g in gathered) for i in range(steps))
    rows = list(stages.values())
    y = np.array([r[0] for r in rows])
    x = np.array([[r[1], r[2] * (not r[3]), r[2] * r[3]] for r in rows], dtype=float)
    keep = y > 0
    xs, ys = x[keep] / y[keep, None], np.ones(int(keep.sum()))
    roofline_share = float(x[keep, 0].sum() / max(y[keep].sum(), 1e-30))
    if roofline_share >= 0.2:
        coef, *_ = np.linalg.lstsq(xs, ys, rcond=None)
        scale = float(np.clip(coef[0], 0.5, 4.0))
    else:  # overhead-bound stages only: the roofline factor cannot be told apart, keep the microbenchmarks' rates
        scale = 1.0
    # the overheads, with the factor fixed (clipped or not)
    coef, *_ = np.linalg.lstsq(xs[:, 1:], ys - scale * xs[:, 0], rcond=None)
    o_f = max(float(coef[0]), 0.0) if x[:, 1].any() else prof.launch_overhead
    o_b = max(float(coef[1]), 0.0) if x[:, 2].any() else prof.overhead(True)
    def allreduces(p: DeviceProfile) -> float:  # what dipc.simulate adds for the end-of-step collectives
        return end_of_step_seconds(compiled, p)

    if post:  # posting cost = fixed + per byte, least squares on the actions' mean durations
        pb = np.array([b for b, _ in post], dtype=float)
        pt = np.array([t for _, t in post], dtype=float)
        if pb.max() > pb.min():
            slope, icpt = np.polyfit(pb, pt, 1)
            if slope < 0:
                slope, icpt = 0.0, float(pt.mean())
            if icpt < 0:
                slope, icpt = float((pb * pt).sum() / (pb * pb).sum()), 0.0
        else:
            slope, icpt = 0.0, float(pt.mean())
        post_s, post_b = float(icpt), float(slope)
    else:
        post_s, post_b = prof.p2p_post_overhead, prof.p2p_post_per_byte
    step_s = max(tail - allreduces(prof), 0.0)
    # the calibration step itself, simulated with the fitted profile (an in-sample check kept in meta)
    lat = {k: scale * r[1] + r[2] * (o_b if r[3] else o_f) for k, r in stages.items()}
    simulated = simulate_plan(
        pipe.last_plan, lat, comm_time=lambda ts: prof.p2p_time(sum(t.nbytes for t in ts)),
        post_overhead=lambda ts: post_s + post_b * sum(t.nbytes for t in ts), epilogue=step_s + allreduces(prof),
        rendezvous=prof.p2p_latency).iteration_time
    return dataclasses.replace(
        prof,
        alpha={f: a * scale if f != "p2p" else a for f, a in prof.alpha.items()},
        op_alpha={k: a * scale for k, a in prof.op_alpha.items()},
        launch_overhead=o_f,
        backward_overhead=o_b,
        p2p_post_overhead=post_s,
        p2p_post_per_byte=post_b,
        step_overhead=step_s,
        meta={**prof.meta, "pipeline_fit": {"contention_scale": scale, "roofline_share": roofline_share,
                                            "measured_step_s": measured,
                                            "simulated_step_s": simulated, "stages": len(rows),
                                            "p2p_actions": len(post), "steps": steps, "ranks": pipe.world}},
        source=prof.source + f"; alpha x{scale:.3g} and executor overheads fitted on a {pipe.world}-rank pipeline "
                             f"({steps} steps, {len(rows)} stages, {len(post)} P2P actions)")
