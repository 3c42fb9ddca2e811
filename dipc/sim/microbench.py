"""Operator microbenchmarks and the fits that turn their timings into a :class:`~dipc.sim.device.DeviceProfile`
(DIP §2.6's roofline: ``launch_overhead + alpha * max(flops / peak_flops, bytes / mem_bandwidth)`` per operator
family).

:func:`benchmarks` lists (benchmark, factory) pairs that time ATen operators the way a captured chunk calls them
(``torch.ops.aten.<op>.<overload>``); :func:`timeit` times one; :func:`fit_profile` fits the profile's fields from
the timings and P2P ping-pong points; :func:`accuracy_table` prints measured vs predicted seconds.  The command that
runs them, with the P2P processes, is ``python -m dipc.calibrate`` (:mod:`dipc.calibrate`).  Units: seconds, bytes,
FLOPs.
"""
from __future__ import annotations

import dataclasses
import gc
import math
import os
import platform
import statistics
import time
from typing import Any, Callable, Sequence

import torch

from .device import COMPUTE_FAMILIES, DeviceProfile

__all__ = ["Bench", "Calibration", "benchmarks", "timeit", "itemsize", "fit_alpha", "fit_profile", "l2_bytes",
           "accuracy_table", "accuracies", "cpu_name", "gpu_profile_name"]

aten = torch.ops.aten


@dataclasses.dataclass
class Bench:
    """One microbenchmark and its result.

    Attributes:
        name: readable description (operator and shape).
        family: operator family (see :data:`dipc.sim.device.FAMILIES`).
        op: operator key (:func:`dipc.sim.device.op_name`), for the per-operator factor.
        flops: FLOPs of one call (flop_counter conventions).
        bytes: bytes read + written by one call.
        role: "fit" (fits alpha and op_alpha), "stream" (sets mem_bandwidth and the optional cache level; not in the
            alpha fits) or "overhead" (sets launch_overhead).
        seconds: measured seconds per call, median (or min) of the timed loops (NaN until measured).
        predicted: seconds the fitted profile predicts (NaN until fitted).
    """

    name: str
    family: str
    op: str
    flops: float
    bytes: float
    role: str = "fit"
    seconds: float = math.nan
    predicted: float = math.nan

    @property
    def accuracy(self) -> float:
        """1 - |predicted - measured| / measured."""
        return 1.0 - abs(self.predicted - self.seconds) / self.seconds


@dataclasses.dataclass
class Calibration:
    """What :func:`calibrate` returns: the fitted profile, the benchmarks and the P2P points (bytes, seconds)."""

    profile: DeviceProfile
    benches: list[Bench]
    p2p: list[tuple[int, float]]
    #: mean accuracy over all benchmarks (and P2P points) with the per-operator factors
    accuracy: float
    #: ... with the per-family factors alone
    family_accuracy: float
    #: ... with alpha = 1 and no launch overhead (same peaks): the uncalibrated roofline
    uncalibrated_accuracy: float
    #: seconds the calibration took
    elapsed: float


# ---------------------------------------------------------------------- timing
def timeit(fn: Callable[[], Any], sync: Callable[[], None], min_time: float, repeats: int,
            stat: str = "median") -> float:
    """Seconds per call of ``fn``: the median (or minimum, ``stat="min"``) over ``repeats`` timed loops of about
    ``min_time`` seconds each, after a warm-up call and a short loop that sizes the timed ones."""
    fn()
    sync()
    # estimate the per-call time with a short loop
    n, t = 1, 0.0
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        t = time.perf_counter() - t0
        if t >= min(min_time / 4, 2e-3) or n >= 1 << 16:
            break
        n *= 4
    per = t / n
    n = max(1, min(1 << 20, int(min_time / max(per, 1e-9))))
    times = []
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            times.append((time.perf_counter() - t0) / n)
    finally:
        if gc_was:
            gc.enable()
    return min(times) if stat == "min" else statistics.median(times)


# ---------------------------------------------------------------------- benchmarks
def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def benchmarks(dev: str, dtype: torch.dtype, quick: bool) -> list[tuple[Bench, Callable[[], Callable[[], Any]]]]:
    """(Bench, maker) pairs; ``maker()`` allocates the inputs and returns the zero-argument callable to time."""
    es = itemsize(dtype)
    gpu = dev != "cpu"
    out: list[tuple[Bench, Callable[[], Callable[[], Any]]]] = []

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, device=dev, dtype=dt)

    def add(b: Bench, maker):
        out.append((b, maker))

    def binary(op, n):
        def mk():
            a, b = rnd(n), rnd(n)
            return lambda: op(a, b)
        return mk

    # --- launch overhead: tiny ops on inputs that require grad, as in a training forward (autograd records them)
    def tiny(op, *shapes):
        def mk():
            xs = [rnd(*sh).requires_grad_() for sh in shapes]
            return lambda: op(*xs)  # timed with grad mode on (the other benchmarks run under no_grad)
        return mk

    add(Bench("add 1 elt", "elementwise", "add", 0, 3 * es, "overhead"), tiny(aten.add.Tensor, (1,), (1,)))
    add(Bench("mul 1 elt", "elementwise", "mul", 0, 3 * es, "overhead"), tiny(aten.mul.Tensor, (1,), (1,)))
    add(Bench("mm 1x1x1", "matmul", "mm", 2, 3 * es, "overhead"), tiny(aten.mm.default, (1, 1), (1, 1)))
    add(Bench("sum 1 elt", "reduction", "sum", 0, 2 * es, "overhead"),
        tiny(lambda a: aten.sum.dim_IntList(a, [-1]), (1, 1)))

    # --- matmul: (M, K, N) for mm, (tokens, in, out) for linear, (batch, M, K, N) for bmm
    if gpu:
        mm = [1024, 2048, 4096] if quick else [1024, 2048, 4096, 8192]
        lin = [(4096, 4096, 4096), (8192, 4096, 14336)] if quick else \
            [(2048, 1024, 4096), (4096, 4096, 4096), (8192, 4096, 14336), (8192, 14336, 4096)]
        bmm = [(32, 2048, 128, 2048)] if quick else [(32, 2048, 128, 2048), (64, 4096, 128, 4096)]
    else:
        mm = [128, 256, 512, 1024] if quick else [64, 128, 256, 512, 1024, 2048]
        lin = [(512, 512, 2048), (512, 2048, 512)] if quick else \
            [(256, 256, 1024), (512, 512, 2048), (512, 2048, 512), (2048, 512, 512), (1024, 1024, 4096)]
        bmm = [(8, 256, 64, 256)] if quick else [(8, 256, 64, 256), (8, 512, 512, 64), (16, 512, 64, 512)]
    for s in mm:
        add(Bench(f"mm {s}x{s}x{s}", "matmul", "mm", 2.0 * s ** 3, 3.0 * s * s * es),
            (lambda s: lambda: (lambda a, b: lambda: aten.mm.default(a, b))(rnd(s, s), rnd(s, s)))(s))
    for m, k, n in lin:
        add(Bench(f"linear {m}x{k}->{n}", "matmul", "linear", 2.0 * m * k * n, float(m * k + n * k + n + m * n) * es),
            (lambda m, k, n: lambda: (lambda x, w, b: lambda: aten.linear.default(x, w, b))(
                rnd(m, k), rnd(n, k), rnd(n)))(m, k, n))
    for bt, m, k, n in bmm:
        add(Bench(f"bmm {bt}x{m}x{k}x{n}", "matmul", "bmm", 2.0 * bt * m * k * n,
                  float(bt * (m * k + k * n + m * n)) * es),
            (lambda bt, m, k, n: lambda: (lambda a, b: lambda: aten.bmm.default(a, b))(
                rnd(bt, m, k), rnd(bt, k, n)))(bt, m, k, n))

    # --- attention (B, H, S, D, causal)
    if gpu:
        att = [(4, 32, 2048, 128, True)] if quick else \
            [(4, 32, 2048, 128, True), (1, 32, 8192, 128, True), (16, 16, 1024, 64, False)]
    else:
        att = [(1, 8, 256, 64, True), (1, 8, 512, 64, False)] if quick else \
            [(1, 8, 128, 64, True), (1, 8, 256, 64, True), (2, 8, 512, 64, True), (1, 8, 512, 64, False),
             (1, 4, 1024, 64, True)]
    for b, h, s, d, causal in att:
        add(Bench(f"sdpa {b}x{h}x{s}x{d}{' causal' if causal else ''}", "attention", "scaled_dot_product_attention",
                  4.0 * b * h * s * s * d, 4.0 * b * h * s * d * es),
            (lambda b, h, s, d, causal: lambda: (lambda q, k, v: lambda: aten.scaled_dot_product_attention.default(
                q, k, v, None, 0.0, causal))(rnd(b, h, s, d), rnd(b, h, s, d), rnd(b, h, s, d)))(b, h, s, d, causal))

    # --- conv2d (N, C_in, H, W, C_out, kernel, stride, padding)
    if gpu:
        conv = [(32, 3, 224, 224, 1024, 14, 14, 0), (8, 256, 64, 64, 256, 3, 1, 1)]
    else:
        conv = [(4, 3, 224, 224, 256, 16, 16, 0), (2, 64, 32, 32, 64, 3, 1, 1)] if quick else \
            [(4, 3, 224, 224, 256, 16, 16, 0), (8, 3, 224, 224, 512, 14, 14, 0), (2, 64, 32, 32, 64, 3, 1, 1),
             (4, 128, 32, 32, 128, 3, 1, 1)]
    for n, c, hh, ww, co, k, st, pd in conv:
        ho, wo = (hh + 2 * pd - k) // st + 1, (ww + 2 * pd - k) // st + 1
        flops = 2.0 * n * co * ho * wo * c * k * k
        nbytes = float(n * c * hh * ww + co * c * k * k + co + n * co * ho * wo) * es
        add(Bench(f"conv2d {n}x{c}x{hh}x{ww} k{k} s{st} ->{co}", "conv", "conv2d", flops, nbytes),
            (lambda n, c, hh, ww, co, k, st, pd: lambda: (lambda x, w, bb: lambda: aten.conv2d.default(
                x, w, bb, [st, st], [pd, pd]))(rnd(n, c, hh, ww), rnd(co, c, k, k), rnd(co)))(
                n, c, hh, ww, co, k, st, pd))

    # --- elementwise (allocating, as a captured graph runs them) and stream (into a preallocated output)
    if gpu:
        ew = [1 << 22, 1 << 26] if quick else [1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28]
        stream = [1 << 27, 1 << 28] if quick else [1 << 27, 1 << 28, 1 << 29]
    else:
        # outputs up to 16 MB: larger ones are fresh mmap allocations on every call (glibc's threshold is at most
        # 32 MB), whose page faults cost more than the copy; CPU training tensors of the reference models are smaller
        ew = [1 << 16, 1 << 18, 1 << 20, 1 << 22] if quick else [1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22]
        # the smallest fit the per-core L2 (the optional cache level of the profile), the others do not
        stream = [1 << 14, 1 << 16, 1 << 20, 1 << 22] if quick else [1 << 14, 1 << 16, 1 << 20, 1 << 22, 1 << 24]
    unary = [("silu", lambda x: aten.silu.default(x)), ("gelu", lambda x: aten.gelu.default(x)),
             ("gelu_tanh", lambda x: aten.gelu.default(x, approximate="tanh")),
             ("rsqrt", lambda x: aten.rsqrt.default(x)), ("pow", lambda x: aten.pow.Tensor_Scalar(x, 2))]
    for n in ew:
        for op, f in (("add", aten.add.Tensor), ("mul", aten.mul.Tensor), ("div", aten.div.Tensor)):
            add(Bench(f"{op} {n}", "elementwise", op, 0, 3.0 * n * es), binary(f, n))
        for op, f in unary:
            add(Bench(f"{op} {n}", "elementwise", op, 0, 2.0 * n * es),
                (lambda n, f: lambda: (lambda a: lambda: f(a))(rnd(n)))(n, f))
    for n in stream:
        add(Bench(f"copy_ {n} (stream)", "elementwise", "copy", 0, 2.0 * n * es, "stream"),
            (lambda n: lambda: (lambda a, c: lambda: c.copy_(a))(rnd(n), rnd(n)))(n))
        add(Bench(f"add out= {n} (stream)", "elementwise", "add", 0, 3.0 * n * es, "stream"),
            (lambda n: lambda: (lambda a, b, c: lambda: torch.add(a, b, out=c))(rnd(n), rnd(n), rnd(n)))(n))

    # --- row-wise ops on (rows, cols): reductions, norms, softmax
    if gpu:
        rows = [(8192, 4096), (16384, 8192)] if quick else [(2048, 4096), (8192, 4096), (16384, 8192)]
    else:
        rows = [(512, 512), (2048, 1024)] if quick else [(256, 256), (512, 512), (2048, 1024), (2048, 2048)]
    for r, c in rows:
        n = r * c
        add(Bench(f"sum {r}x{c} dim-1", "reduction", "sum", 0, float(n + r) * es),
            (lambda r, c: lambda: (lambda x: lambda: aten.sum.dim_IntList(x, [-1]))(rnd(r, c)))(r, c))
        add(Bench(f"mean {r}x{c} dim-1", "reduction", "mean", 0, float(n + r) * es),
            (lambda r, c: lambda: (lambda x: lambda: aten.mean.dim(x, [-1], True))(rnd(r, c)))(r, c))
        add(Bench(f"amax {r}x{c} dim-1", "reduction", "amax", 0, float(n + r) * es),
            (lambda r, c: lambda: (lambda x: lambda: aten.amax.default(x, [-1]))(rnd(r, c)))(r, c))
        add(Bench(f"layer_norm {r}x{c}", "norm", "layer_norm", 0, float(2 * n + 2 * c) * es),
            (lambda r, c: lambda: (lambda x, w, b: lambda: aten.layer_norm.default(x, [c], w, b, 1e-5))(
                rnd(r, c), rnd(c), rnd(c)))(r, c))
        add(Bench(f"rms_norm {r}x{c}", "norm", "rms_norm", 0, float(2 * n + c) * es),
            (lambda r, c: lambda: (lambda x, w: lambda: aten.rms_norm.default(x, [c], w, 1e-6))(
                rnd(r, c), rnd(c)))(r, c))
        add(Bench(f"softmax {r}x{c}", "softmax", "softmax", 0, 2.0 * n * es),
            (lambda r, c: lambda: (lambda x: lambda: aten.softmax.int(x, -1))(rnd(r, c)))(r, c))

    # --- embedding gather (vocab, dim, tokens): bytes = indices + rows read + output written
    if gpu:
        emb = [(151936, 4096, 8192)] if quick else [(32000, 4096, 4096), (151936, 8192, 8192)]
    else:
        emb = [(8000, 512, 2048)] if quick else [(8000, 256, 512), (32000, 512, 2048), (32000, 1024, 4096)]
    for v, d, t in emb:
        add(Bench(f"embedding {v}x{d}[{t}]", "embedding", "embedding", 0, 2.0 * t * d * es + 8.0 * t),
            (lambda v, d, t: lambda: (lambda w, i: lambda: aten.embedding.default(w, i))(
                rnd(v, d), torch.randint(0, v, (t,), device=dev)))(v, d, t))

    # --- loss: cross entropy over (tokens, vocab) logits, mean reduction
    if gpu:
        ce = [(8192, 32000)] if quick else [(4096, 32000), (8192, 151936)]
    else:
        ce = [(512, 8000)] if quick else [(256, 2000), (512, 8000), (2048, 2000)]
    for t, v in ce:
        add(Bench(f"cross_entropy {t}x{v}", "loss", "cross_entropy_loss", 0, float(t * v) * es + 8.0 * t + es),
            (lambda t, v: lambda: (lambda x, y: lambda: aten.cross_entropy_loss.default(x, y))(
                rnd(t, v), torch.randint(0, v, (t,), device=dev)))(t, v))

    # --- other: concatenation, transpose copy (layout changes)
    if gpu:
        oth = [(8192, 4096)] if quick else [(2048, 4096), (8192, 4096), (16384, 8192)]
    else:
        oth = [(512, 512), (2048, 1024)] if quick else [(256, 256), (512, 512), (2048, 1024)]
    for r, c in oth:
        n = r * c
        add(Bench(f"cat 2x{r}x{c}", "other", "cat", 0, 4.0 * n * es),
            (lambda r, c: lambda: (lambda a, b: lambda: aten.cat.default([a, b], -1))(rnd(r, c), rnd(r, c)))(r, c))
        add(Bench(f"transpose-copy {r}x{c}", "other", "clone", 0, 2.0 * n * es),
            (lambda r, c: lambda: (lambda a: lambda: aten.clone.default(a, memory_format=torch.contiguous_format))(
                rnd(r, c).t()))(r, c))
    return out


# ---------------------------------------------------------------------- fitting
def fit_alpha(points: Sequence[tuple[float, float]], overhead: float) -> float:
    """The alpha minimizing the mean |log(pred / m)| with pred = overhead + alpha * r over ``points`` = [(r, m)]
    (roofline seconds at alpha 1, measured seconds); 1.0 when no point has r > 0 and m > overhead.

    The log error treats a prediction 2x too high and one 2x too low alike (1 - |pred - m| / m would favour
    under-prediction, whose error is capped at 100%).  Each term is smallest at its own alpha (m - overhead) / r and
    monotone on either side, so the search runs over those candidates.
    """
    cands = [(m - overhead) / r for r, m in points if r > 0 and m > overhead]
    if not cands:
        return 1.0
    return min(cands, key=lambda a: sum(abs(math.log((overhead + a * r) / m)) for r, m in points))


def fit_profile(benches: list[Bench], p2p: list[tuple[int, float]], cache_bytes: float | None, cache_level: bool):
    """Fit the model to the measurements; returns the profile's keyword arguments (no name, source, ...).

    ``cache_bytes``: the per-core cache size (or None): stream benchmarks within it do not count for mem_bandwidth;
    with ``cache_level`` they set the profile's cache level instead.
    """
    overhead = statistics.median(b.seconds for b in benches if b.role == "overhead")
    peak = max(b.flops / b.seconds for b in benches if b.family == "matmul" and b.role == "fit")
    streams = [b for b in benches if b.role == "stream"]
    in_cache = [b for b in streams if cache_bytes is not None and b.bytes <= cache_bytes]
    mem = max(b.bytes / b.seconds for b in streams if b not in in_cache)
    cache_bw = max((b.bytes / b.seconds for b in in_cache), default=None)
    if not cache_level or cache_bw is None or cache_bw <= mem:  # single-level roofline (DIP's)
        cache_bytes = cache_bw = None
    # the roofline at alpha = 1 without overhead, with the fitted peaks
    base = DeviceProfile(name="fit", peak_flops=peak, mem_bandwidth=mem, p2p_bandwidth=1.0, p2p_latency=0.0,
                         alpha={}, cache_bytes=cache_bytes, cache_bandwidth=cache_bw)
    fitted = [b for b in benches if b.role == "fit"]
    roof = {id(b): base.op_latency(b.family, b.flops, b.bytes) for b in fitted}
    alpha: dict[str, float] = {}
    for fam in COMPUTE_FAMILIES:
        pts = [(roof[id(b)], b.seconds) for b in fitted if b.family == fam]
        if pts:
            alpha[fam] = fit_alpha(pts, overhead)
    op_alpha = {op: fit_alpha([(roof[id(b)], b.seconds) for b in fitted if b.op == op], overhead)
                for op in sorted({b.op for b in fitted})}
    if "other" not in alpha:
        mems = [alpha[f] for f in ("elementwise", "reduction", "norm", "softmax") if f in alpha]
        alpha["other"] = statistics.median(mems) if mems else 1.0
    out = dict(peak_flops=peak, mem_bandwidth=mem, cache_bytes=cache_bytes, cache_bandwidth=cache_bw,
               launch_overhead=overhead, alpha=alpha, op_alpha=op_alpha)
    if p2p:
        p2p = sorted(p2p)
        # latency: the fastest small message (robust to one slow point); bandwidth: the best large message
        lat = min(t for n, t in p2p if n <= max(16384, p2p[0][0]))
        big = [(n, t) for n, t in p2p if n >= (1 << 20)] or p2p[-1:]
        bw = max(n / max(t - lat, 1e-12) for n, t in big)
        alpha["p2p"] = fit_alpha([(n / bw, t) for n, t in p2p], lat)
        out.update(p2p_latency=lat, p2p_bandwidth=bw)
    return out


def l2_bytes() -> float | None:
    """Per-core L2 size in bytes from Linux sysfs, or None."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for idx in sorted(os.listdir(base)):
            d = os.path.join(base, idx)
            with open(os.path.join(d, "level")) as f:
                level = int(f.read())
            with open(os.path.join(d, "type")) as f:
                kind = f.read().strip()
            if level == 2 and kind in ("Unified", "Data"):
                with open(os.path.join(d, "size")) as f:
                    txt = f.read().strip().upper()
                mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(txt[-1:], 1)
                return float(int(txt.rstrip("KMG")) * mult)
    except (OSError, ValueError):
        pass
    return None


# ---------------------------------------------------------------------- reporting
def _acc(pred: float, meas: float) -> float:
    return 1.0 - abs(pred - meas) / meas


def accuracy_table(profile: DeviceProfile, benches: Sequence[Bench], p2p: Sequence[tuple[int, float]] = ()) -> str:
    """Text table: per benchmark its family, role, GFLOP, MB, measured microseconds, predicted microseconds with
    the per-operator factor (``pred op``) and with the family factor alone (``pred fam``), and the accuracy
    1 - |pred - meas| / meas of each; then the mean accuracies per family.  P2P rows come from ``p2p`` =
    [(bytes, seconds)]."""
    lines = [f"{'benchmark':<34} {'family':<11} {'role':<8} {'GFLOP':>8} {'MB':>8} {'meas us':>10} "
             f"{'pred op':>10} {'acc':>6} {'pred fam':>10} {'acc':>6}"]
    per: dict[str, list[tuple[float, float]]] = {}
    for b in benches:
        p_op = profile.op_latency(b.family, b.flops, b.bytes, op=b.op)
        p_f = profile.op_latency(b.family, b.flops, b.bytes)
        a_op, a_f = _acc(p_op, b.seconds), _acc(p_f, b.seconds)
        per.setdefault(b.family, []).append((a_op, a_f))
        lines.append(f"{b.name:<34} {b.family:<11} {b.role:<8} {b.flops / 1e9:>8.3f} {b.bytes / 1e6:>8.3f} "
                     f"{b.seconds * 1e6:>10.2f} {p_op * 1e6:>10.2f} {a_op * 100:>5.1f}% {p_f * 1e6:>10.2f} "
                     f"{a_f * 100:>5.1f}%")
    for n, t in p2p:
        pred = profile.p2p_time(n)
        a = _acc(pred, t)
        per.setdefault("p2p", []).append((a, a))
        lines.append(f"{'p2p send ' + str(n) + ' B':<34} {'p2p':<11} {'fit':<8} {0:>8.3f} {n / 1e6:>8.3f} "
                     f"{t * 1e6:>10.2f} {pred * 1e6:>10.2f} {a * 100:>5.1f}% {pred * 1e6:>10.2f} {a * 100:>5.1f}%")
    lines.append("mean accuracy per family (op factor / family factor): " + ", ".join(
        f"{f} {statistics.mean(x[0] for x in v) * 100:.1f}/{statistics.mean(x[1] for x in v) * 100:.1f}%"
        for f, v in per.items()))
    return "\n".join(lines)


def accuracies(profile: DeviceProfile, benches: Sequence[Bench], p2p: Sequence[tuple[int, float]],
                use_op: bool = True) -> list[float]:
    accs = [_acc(profile.op_latency(b.family, b.flops, b.bytes, op=b.op if use_op else None), b.seconds)
            for b in benches]
    return accs + [_acc(profile.p2p_time(n), t) for n, t in p2p]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_profile_name(gpu_name: str) -> str | None:
    g = gpu_name.upper()
    for key in ("H800", "H200", "H100", "A100"):
        if key in g:
            return key.lower()
    return None
