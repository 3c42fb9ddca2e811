"""Device profiles: the numbers DIP's simulator turns FLOPs and bytes into seconds with.

DIP's simulator (shared/PAPER.md §2.6) is an operator-level roofline: an operator that performs ``N_fop``
floating-point operations, moves ``N_mem`` bytes through device memory and sends ``N_net`` bytes over the network
takes::

    max(alpha_f * N_fop / F, alpha_m * N_mem / B_mem, alpha_n * N_net / B_net)

seconds, where ``F``, ``B_mem`` and ``B_net`` are the device's peak FLOP/s, memory bandwidth and network bandwidth
and the ``alpha`` are efficiency factors calibrated by microbenchmarks (``python -m dipc.calibrate``).  A
:class:`DeviceProfile` holds those numbers.  dipc keeps one ``alpha`` per operator family (:data:`FAMILIES`): an
operator of family ``f`` uses ``alpha[f]`` for both its compute and its memory term, and every network term uses
``alpha["p2p"]``.  On top of the roofline each operator pays a fixed ``launch_overhead`` (Python + dispatcher + kernel
launch; microseconds, dominant for small operators on CPU).  Two optional refinements, both off in the shipped GPU
profiles: per-operator factors (``op_alpha``, fitted by every calibration: a CPU ``gelu(approximate="tanh")`` is 5-8x
slower per byte than ``add``) and a cache level (``cache_bytes``, ``cache_bandwidth``; ``python -m dipc.calibrate
--cache-level``: on CPU, bandwidth-bound operators whose tensors fit the per-core L2 run 2-4x faster than the
DRAM/L3 rate).

Conventions (the calibration measures with the same ones, so a cost pass should count the same way):

* FLOPs as ``torch.utils.flop_counter`` counts them: a multiply-add is 2 FLOPs; ``mm``/``linear``/``bmm``
  ``2*M*N*K``; convolution ``2 * out_numel * C_in/groups * prod(kernel)``; ``scaled_dot_product_attention``
  ``4 * B * H * S_q * S_k * D`` (causal masking not discounted); elementwise, normalization, softmax, reduction,
  embedding and loss operators count 0 FLOPs (they are memory-bound and use the memory term).
* bytes = bytes of the operator's tensor inputs plus its outputs, except ``embedding``: indices + gathered rows
  read + output written (``2 * out_bytes + index_bytes``), not the whole table.

Shipped profiles (``dipc/sim/profiles/*.json``, loaded by name with :meth:`DeviceProfile.load`) come from NVIDIA
datasheets and are marked ``calibrated: false``; calibrated profiles written by ``python -m dipc.calibrate`` go to
:func:`user_profile_dir` and take precedence over shipped ones of the same name.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

__all__ = ["DeviceProfile", "FAMILIES", "COMPUTE_FAMILIES", "VIEW_FAMILY", "op_name", "user_profile_dir",
           "shipped_profiles", "available_profiles", "PROFILE_DIR_ENV"]

#: families whose compute term follows the small-matrix efficiency curve (``DeviceProfile.matmul_half_flops``)
_CURVE_FAMILIES = ("matmul", "attention", "conv")

#: operator families with their own efficiency factor; "p2p" is the network term (pipeline send/recv, collectives).
FAMILIES: tuple[str, ...] = ("matmul", "attention", "conv", "elementwise", "reduction", "norm", "softmax",
                             "embedding", "loss", "other", "p2p")
#: the families of on-device operators (all but "p2p").
COMPUTE_FAMILIES: tuple[str, ...] = FAMILIES[:-1]
#: metadata-only operators (view, reshape, transpose, ...; the cost pass ``dipc.passes.symcost`` names them so): no
#: FLOPs, no bytes, no alpha; :meth:`DeviceProfile.op_latency` charges them the launch overhead alone.
VIEW_FAMILY = "view"

#: environment variable naming the folder where calibrated profiles are written and looked up first.
PROFILE_DIR_ENV = "DIPC_PROFILE_DIR"

_SHIPPED_DIR = Path(__file__).resolve().parent / "profiles"


def user_profile_dir() -> Path:
    """Folder of user (calibrated) profiles: ``$DIPC_PROFILE_DIR``, else ``$XDG_CACHE_HOME/dipc/profiles``, else
    ``~/.cache/dipc/profiles``.  It need not exist."""
    env = os.environ.get(PROFILE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dipc" / "profiles"


def shipped_profiles() -> list[str]:
    """Names of the datasheet profiles that ship with dipc (``dipc/sim/profiles/*.json``)."""
    return sorted(p.stem for p in _SHIPPED_DIR.glob("*.json"))


def available_profiles() -> list[str]:
    """Names :meth:`DeviceProfile.load` accepts: shipped profiles plus the ``*.json`` in :func:`user_profile_dir`."""
    d = user_profile_dir()
    user = [p.stem for p in d.glob("*.json")] if d.is_dir() else []
    return sorted(set(shipped_profiles()) | set(user))


def _check_pos(name: str, v: Any, allow_zero: bool = False) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {v!r}") from None
    if not math.isfinite(f) or f < 0 or (f == 0 and not allow_zero):
        raise ValueError(f"{name} must be a finite {'non-negative' if allow_zero else 'positive'} number, got {v!r}")
    return f


@dataclasses.dataclass
class DeviceProfile:
    """Peak rates, efficiency factors and overheads of one device (DIP §2.6).

    Attributes:
        name: short name ("h100", "cpu", ...).
        peak_flops: peak dense FLOP/s in ``dtype`` (GPUs: BF16 tensor-core dense peak, no sparsity; CPU: the best
            fp32 matmul rate measured with the calibration's thread count).
        mem_bandwidth: device memory bandwidth in bytes/s (HBM on GPUs; best sustained copy/add rate on CPU).
        p2p_bandwidth: point-to-point bandwidth between two pipeline ranks in bytes/s, one direction (NVLink per
            direction on GPUs; gloo over loopback on CPU).
        p2p_latency: fixed time of one point-to-point message in seconds.
        alpha: family -> efficiency factor (dimensionless, usually >= 1; 1 means the operator runs at the peak
            rate; below 1 means faster than the roofline at these peaks, e.g. cache-resident data on CPU).
            Families missing from the dict use ``alpha["other"]`` (or 1.0).
        op_alpha: optional per-operator overrides, ATen op name (see :func:`op_name`: "gelu", "gelu_tanh", "silu",
            "mm", ...) -> efficiency factor; used by :meth:`op_latency` when its ``op`` argument names one.  The
            calibration fits one per benchmarked operator, since one factor per family cannot cover both ``add``
            and a CPU ``gelu(approximate="tanh")`` that runs 5-8x slower per byte.
        launch_overhead: fixed seconds added to every operator (dispatch and kernel launch) in forward.
        backward_overhead: fixed seconds per forward operator added to a stage's backward (the autograd engine runs
            one or more nodes per forward operator); None (default) uses ``launch_overhead``.
        p2p_post_overhead: seconds a rank is busy posting one pipeline send or receive action (host-side work of
            ``isend``/``irecv``: buffer allocation, dispatch, the communication library's bookkeeping); 0 in the
            datasheet profiles.  The simulator charges it to every SEND/RECV action of a plan.
        p2p_post_per_byte: seconds per message byte added to posting it (packing the message's tensors into one
            buffer, and on CPU the part of the transfer the posting thread does itself); 0 in the datasheet profiles.
        step_overhead: fixed seconds per training step outside the plan's actions (executor setup, the end-of-step
            loss and tied-gradient all-reduces' host cost); 0 in the datasheet profiles.
        cache_bytes: optional on-chip cache size in bytes: an operator moving at most this many bytes uses
            ``cache_bandwidth`` instead of ``mem_bandwidth`` (a two-level roofline; None, the default and what the
            GPU datasheet profiles use, is DIP's single memory level).  ``python -m dipc.calibrate --cache-level``
            sets it to the per-core L2 size on CPU, where bandwidth-bound operators that fit run 2-4x faster.
        cache_bandwidth: bytes/s for operators within ``cache_bytes``; given together with ``cache_bytes``.
        calibrated: True when the figures were measured by ``python -m dipc.calibrate``.
        source: where the figures come from (datasheet citation or measurement details).
        dtype: the training dtype ``peak_flops`` refers to ("bfloat16", "float32").
        memory_capacity: device memory in bytes, or None when unknown.
        matmul_half_flops: the small-matrix efficiency curve of compute-bound operators (families "matmul",
            "attention", "conv"): an operator of ``f`` FLOPs runs at ``f / (f + matmul_half_flops)`` of its
            roofline rate, i.e. its compute term is ``a * (f + h) / peak_flops`` with ``h`` this figure once per
            forward operator and twice in backward (two matmuls per forward one).  Small GEMMs under-fill the
            device (tile and wave quantisation); this is what makes DIP's B_i rule (§2.1) pick a size.  0 (no
            curve) by default; the shipped GPU profiles take it from the paper's published figures (see their
            ``source``).
        tp_bandwidth: bytes/s per direction of the links tensor-parallel collectives use (NVLink inside a node);
            None: ``p2p_bandwidth``.
        host_bandwidth: bytes/s per direction of one GPU's link to host memory (PCIe), which activation offload
            uses (DESIGN.md "Memory"); None (unknown, the default, and on CPU where "host" is device memory): the
            planner offers no offload.
        host_memory: bytes of host memory one GPU may fill with offloaded activations (its share of the node's);
            None: unknown, no offload offered.
        meta: free-form details (host, torch version, threads, raw measurements); not used by the model.

    Raises:
        ValueError: on construction, a rate that is not a finite positive number, a negative latency or overhead,
            an unknown family or a non-positive alpha.
    """

    name: str
    peak_flops: float
    mem_bandwidth: float
    p2p_bandwidth: float
    p2p_latency: float
    alpha: dict[str, float] = dataclasses.field(default_factory=lambda: {f: 1.0 for f in FAMILIES})
    op_alpha: dict[str, float] = dataclasses.field(default_factory=dict)
    launch_overhead: float = 0.0
    backward_overhead: float | None = None
    p2p_post_overhead: float = 0.0
    p2p_post_per_byte: float = 0.0
    step_overhead: float = 0.0
    cache_bytes: float | None = None
    cache_bandwidth: float | None = None
    calibrated: bool = False
    source: str = ""
    dtype: str = "bfloat16"
    memory_capacity: float | None = None
    matmul_half_flops: float = 0.0
    tp_bandwidth: float | None = None
    host_bandwidth: float | None = None
    host_memory: float | None = None
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.matmul_half_flops = _check_pos("matmul_half_flops", self.matmul_half_flops, allow_zero=True)
        if self.tp_bandwidth is not None:
            self.tp_bandwidth = _check_pos("tp_bandwidth", self.tp_bandwidth)
        for name in ("host_bandwidth", "host_memory"):
            if getattr(self, name) is not None:
                setattr(self, name, _check_pos(name, getattr(self, name)))
        self.peak_flops = _check_pos("peak_flops", self.peak_flops)
        self.mem_bandwidth = _check_pos("mem_bandwidth", self.mem_bandwidth)
        self.p2p_bandwidth = _check_pos("p2p_bandwidth", self.p2p_bandwidth)
        self.p2p_latency = _check_pos("p2p_latency", self.p2p_latency, allow_zero=True)
        self.launch_overhead = _check_pos("launch_overhead", self.launch_overhead, allow_zero=True)
        if self.backward_overhead is not None:
            self.backward_overhead = _check_pos("backward_overhead", self.backward_overhead, allow_zero=True)
        self.p2p_post_overhead = _check_pos("p2p_post_overhead", self.p2p_post_overhead, allow_zero=True)
        self.step_overhead = _check_pos("step_overhead", self.step_overhead, allow_zero=True)
        self.p2p_post_per_byte = _check_pos("p2p_post_per_byte", self.p2p_post_per_byte, allow_zero=True)
        if (self.cache_bytes is None) != (self.cache_bandwidth is None):
            raise ValueError("cache_bytes and cache_bandwidth go together (both None or both set)")
        if self.cache_bytes is not None:
            self.cache_bytes = _check_pos("cache_bytes", self.cache_bytes)
            self.cache_bandwidth = _check_pos("cache_bandwidth", self.cache_bandwidth)
        if self.memory_capacity is not None:
            self.memory_capacity = _check_pos("memory_capacity", self.memory_capacity)
        alpha = {}
        for k, v in dict(self.alpha).items():
            if k not in FAMILIES:
                raise ValueError(f"alpha has unknown operator family {k!r}; families are {', '.join(FAMILIES)}")
            alpha[k] = _check_pos(f"alpha[{k!r}]", v)
        self.alpha = alpha
        self.op_alpha = {str(k): _check_pos(f"op_alpha[{k!r}]", v) for k, v in dict(self.op_alpha).items()}
        self.calibrated = bool(self.calibrated)

    # ------------------------------------------------------------------ the model
    def alpha_for(self, family: str) -> float:
        """Efficiency factor of ``family`` (falls back to ``alpha["other"]``, then 1.0; "view" has no entry of its
        own and falls back the same way, which does not matter as views move no bytes).

        Raises:
            ValueError: ``family`` is not one of :data:`FAMILIES`.
        """
        if family not in FAMILIES and family != VIEW_FAMILY:
            raise ValueError(f"unknown operator family {family!r}; families are {', '.join(FAMILIES)} "
                             f"(and {VIEW_FAMILY!r})")
        a = self.alpha.get(family)
        if a is None:
            a = self.alpha.get("other", 1.0)
        return a

    def op_latency(self, family: str, flops: float, bytes: float, net_bytes: float = 0.0, *,
                   op: str | None = None) -> float:
        """Seconds one operator takes (DIP §2.6 roofline plus the launch overhead)::

            launch_overhead + max(a * flops / peak_flops,
                                  a * bytes / mem_bandwidth,
                                  alpha["p2p"] * net_bytes / p2p_bandwidth)

        with ``a = op_alpha[op]`` when ``op`` is given and has an override, else ``alpha[family]``; when the profile
        has a cache level and ``bytes <= cache_bytes``, ``cache_bandwidth`` replaces ``mem_bandwidth``.

        Args:
            family: operator family, one of :data:`FAMILIES`, or "view" (:data:`VIEW_FAMILY`).
            flops: floating-point operations (multiply-add = 2).
            bytes: bytes moved through device memory (tensor inputs + outputs).
            net_bytes: bytes sent over the network by this operator (collectives inside a stage); the per-message
                latency is not included here (see :meth:`p2p_time` for pipeline sends).
            op: optional operator name (:func:`op_name`) for a per-operator factor.

        Raises:
            ValueError: unknown family, or a negative count.
        """
        if flops < 0 or bytes < 0 or net_bytes < 0:
            raise ValueError(f"op_latency needs non-negative counts, got flops={flops}, bytes={bytes}, "
                             f"net_bytes={net_bytes}")
        a = self.op_alpha.get(op) if op is not None else None
        if a is None:
            a = self.alpha_for(family)
        if flops and family in _CURVE_FAMILIES:
            flops = flops + self.matmul_half_flops
        t = max(a * flops / self.peak_flops, a * bytes / self.bandwidth_for(bytes))
        if net_bytes:
            t = max(t, self.alpha_for("p2p") * net_bytes / self.p2p_bandwidth)
        return self.launch_overhead + t

    def op_latency_expr(self, family: str, flops: Any, bytes: Any, net_bytes: Any = 0, *, op: str | None = None,
                        backward: bool = False):
        """:meth:`op_latency` as a sympy expression, for symbolic costs (``dipc.passes.symcost``): ``flops``,
        ``bytes`` and ``net_bytes`` may be sympy expressions in the size symbols; the result uses ``sympy.Max`` (and
        ``sympy.Piecewise`` for the cache level), so that a chunk's sum can be compiled once with
        ``sympy.lambdify`` (e.g. ``compile_costs(nodes, extra={"latency": lambda c: profile.op_latency_expr(
        c.family, c.flops_fwd, c.bytes_read + c.bytes_written)})``).  Counts are assumed non-negative.  With
        ``backward=True`` the fixed term is :meth:`overhead` of the backward (``backward_overhead``).

        Raises:
            ValueError: unknown family.
        """
        a = self.op_alpha.get(op) if op is not None else None
        if a is None:
            a = self.alpha_for(family)
        curve = bool(self.matmul_half_flops) and family in _CURVE_FAMILIES
        # a model's repeated blocks give the same count expressions layer after layer: built once per distinct key
        return _latency_expr(float(a), flops, bytes, net_bytes, curve, backward, self.overhead(backward),
                             self.peak_flops, self.mem_bandwidth, self.cache_bytes, self.cache_bandwidth,
                             self.matmul_half_flops, self.alpha_for("p2p"), self.p2p_bandwidth)

    def overhead(self, backward: bool = False) -> float:
        """Fixed seconds per operator: ``launch_overhead`` in forward; in backward ``backward_overhead`` when set,
        else ``launch_overhead``."""
        if backward and self.backward_overhead is not None:
            return self.backward_overhead
        return self.launch_overhead

    def post_time(self, nbytes: float) -> float:
        """Seconds a rank is busy posting one pipeline send or receive of ``nbytes``:
        ``p2p_post_overhead + p2p_post_per_byte * nbytes``.

        Raises:
            ValueError: ``nbytes`` is negative.
        """
        if nbytes < 0:
            raise ValueError(f"post_time needs a non-negative size, got {nbytes}")
        return self.p2p_post_overhead + self.p2p_post_per_byte * nbytes

    def tp_allreduce_time(self, nbytes: float, tp_size: int) -> float:
        """Seconds of one tensor-parallel all-reduce of ``nbytes`` over ``tp_size`` GPUs of a node (Megatron's
        row-parallel output; with sequence parallelism its reduce-scatter + all-gather move the same bytes): a ring
        on ``tp_bandwidth``, ``2 (T - 1) p2p_latency + 2 (T - 1) / T * alpha["p2p"] * nbytes / tp_bandwidth``; 0
        for T = 1.

        Raises:
            ValueError: ``nbytes`` negative or ``tp_size`` < 1.
        """
        return self._ring("tp_allreduce_time", nbytes, tp_size, "tp_size", self.tp_bandwidth or self.p2p_bandwidth)

    def allreduce_time(self, nbytes: float, n_ranks: int) -> float:
        """Seconds of a ring all-reduce of ``nbytes`` over ``n_ranks`` ranks on the P2P links:
        ``2 (n - 1) p2p_latency + 2 (n - 1) / n * alpha["p2p"] * nbytes / p2p_bandwidth``; 0 for one rank.

        Raises:
            ValueError: ``nbytes`` negative or ``n_ranks`` < 1.
        """
        return self._ring("allreduce_time", nbytes, n_ranks, "n_ranks", self.p2p_bandwidth)

    def _ring(self, what: str, nbytes: float, n: int, n_name: str, bandwidth: float) -> float:
        """Ring all-reduce of ``nbytes`` over ``n`` ranks on links of ``bandwidth`` bytes/s."""
        if nbytes < 0 or n < 1:
            raise ValueError(f"{what} needs nbytes >= 0 and {n_name} >= 1, got {nbytes}, {n}")
        if n == 1:
            return 0.0
        steps = 2 * (n - 1)
        return steps * self.p2p_latency + steps / n * self.alpha_for("p2p") * nbytes / bandwidth

    def bandwidth_for(self, nbytes: float) -> float:
        """Memory bandwidth in bytes/s that an operator moving ``nbytes`` sees: ``cache_bandwidth`` when the profile
        has a cache level and ``nbytes <= cache_bytes``, else ``mem_bandwidth``."""
        if self.cache_bytes is not None and nbytes <= self.cache_bytes:
            return self.cache_bandwidth  # type: ignore[return-value]
        return self.mem_bandwidth

    def p2p_time(self, nbytes: float) -> float:
        """Seconds to send one ``nbytes`` message to a neighbouring rank: ``p2p_latency + alpha["p2p"] * nbytes /
        p2p_bandwidth``.

        Raises:
            ValueError: ``nbytes`` is negative.
        """
        if nbytes < 0:
            raise ValueError(f"p2p_time needs a non-negative size, got {nbytes}")
        return self.p2p_latency + self.alpha_for("p2p") * nbytes / self.p2p_bandwidth

    def host_time(self, nbytes: float) -> float:
        """Seconds one copy of ``nbytes`` between this GPU and host memory takes on its link (activation offload):
        ``nbytes / host_bandwidth``.

        Raises:
            ValueError: ``nbytes`` is negative, or the profile has no ``host_bandwidth``.
        """
        if nbytes < 0:
            raise ValueError(f"host_time needs a non-negative size, got {nbytes}")
        if self.host_bandwidth is None:
            raise ValueError(f"device profile {self.name!r} has no host_bandwidth (its link to host memory): set it "
                             "to model activation offload")
        return nbytes / self.host_bandwidth

    # ------------------------------------------------------------------ (de)serialization
    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON-types dict of every field."""
        d = dataclasses.asdict(self)
        d["alpha"] = {f: self.alpha[f] for f in FAMILIES if f in self.alpha}
        d["op_alpha"] = dict(sorted(self.op_alpha.items()))
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DeviceProfile":
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: a required field is missing, a field is unknown, or a value is invalid.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"a device profile must be a JSON object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"device profile has unknown fields {unknown}; known fields are {sorted(names)}")
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"device profile lacks required fields {missing}")
        return cls(**dict(d))

    def to_json(self, indent: int | None = 2) -> str:
        """JSON text of :meth:`to_dict`."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "DeviceProfile":
        """Parse :meth:`to_json`'s output.

        Raises:
            ValueError: not JSON (``json.JSONDecodeError`` is a ``ValueError``) or an invalid profile.
        """
        return cls.from_dict(json.loads(text))

    def save(self, path: str | os.PathLike) -> Path:
        """Write the profile as JSON to ``path`` (parent folders are created); returns the path."""
        p = Path(path).expanduser()
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(self.to_json() + "\n")
        return p

    @classmethod
    def load(cls, name_or_path: str | os.PathLike, *, user: bool = True) -> "DeviceProfile":
        """Load a profile by file path or by name.

        A name ("h100", "h800", "h200", "a100", "cpu", ...) is looked up as ``<name>.json`` first in
        :func:`user_profile_dir` (where ``python -m dipc.calibrate`` writes; skipped when ``user`` is False), then
        among the shipped datasheet profiles.  "cpu" exists only once a calibration has written one.

        Raises:
            FileNotFoundError: no such file or name (the message lists the known names).
            ValueError: the file is not a valid profile.
        """
        s = os.fspath(name_or_path)
        p = Path(s).expanduser()
        looks_like_path = p.suffix == ".json" or os.sep in s or (os.altsep is not None and os.altsep in s)
        if p.is_file():
            return cls._read(p)
        if looks_like_path:
            raise FileNotFoundError(f"no device profile file {s!r}")
        key = s.lower()
        candidates = ([user_profile_dir() / f"{key}.json"] if user else []) + [_SHIPPED_DIR / f"{key}.json"]
        for c in candidates:
            if c.is_file():
                return cls._read(c)
        hint = (" Run `python -m dipc.calibrate --device cpu` to measure this machine." if key in ("cpu", "cuda")
                else "")
        raise FileNotFoundError(f"no device profile named {s!r} (looked in {', '.join(str(c) for c in candidates)});"
                                f" known: {', '.join(available_profiles()) or 'none'}.{hint}")

    @classmethod
    def _read(cls, p: Path) -> "DeviceProfile":
        try:
            return cls.from_json(p.read_text())
        except ValueError as e:
            raise ValueError(f"{p}: {e}") from e

    def summary(self) -> str:
        """One line: name, peak TFLOP/s, memory and P2P bandwidth in GB/s, P2P latency and launch overhead in us."""
        cache = (f" ({self.cache_bandwidth / 1e9:.4g} GB/s up to {self.cache_bytes / 2**20:.3g} MiB)"
                 if self.cache_bytes is not None else "")
        return (f"{self.name}: {self.peak_flops / 1e12:.3g} TFLOP/s ({self.dtype}), mem {self.mem_bandwidth / 1e9:.4g}"
                f" GB/s{cache}, p2p {self.p2p_bandwidth / 1e9:.4g} GB/s + {self.p2p_latency * 1e6:.3g} us, launch "
                f"{self.launch_overhead * 1e6:.3g} us, {'calibrated' if self.calibrated else 'uncalibrated'}")


# ---------------------------------------------------------------------- operator names
def op_name(op: Any, kwargs: Mapping[str, Any] | None = None) -> str:
    """The key :attr:`DeviceProfile.op_alpha` uses for an operator: the ATen packet name without a trailing
    underscore ("mm", "add", "layer_norm", ...), with ``gelu`` called with ``approximate="tanh"`` (in ``kwargs``)
    named "gelu_tanh".  ``op`` is an ``OpOverload``/``OpOverloadPacket`` or a name such as ``"aten.mm.default"``."""
    packet = getattr(op, "overloadpacket", op)
    name = getattr(packet, "__name__", None) or str(op)
    name = name.split("::")[-1]
    parts = name.split(".")
    if len(parts) >= 2 and parts[0] in ("aten", "prims", "torch"):
        parts = parts[1:]
    base = parts[0].rstrip("_") or parts[0]
    if base == "gelu" and kwargs and kwargs.get("approximate") == "tanh":
        return "gelu_tanh"
    return base


@functools.lru_cache(maxsize=65536)
def _latency_expr(a, flops, nbytes, net, curve, backward, overhead, peak_flops, mem_bandwidth, cache_bytes,
                  cache_bandwidth, matmul_half_flops, p2p_alpha, p2p_bandwidth):
    """:meth:`DeviceProfile.op_latency_expr`'s expression from the profile's numbers (memoised: every argument is a
    float or a sympy expression, hashable)."""
    import sympy

    a = sympy.Float(a)
    flops, nbytes, net = sympy.sympify(flops), sympy.sympify(nbytes), sympy.sympify(net)
    if cache_bytes is not None:
        bw = sympy.Piecewise((sympy.Float(cache_bandwidth), nbytes <= cache_bytes),
                             (sympy.Float(mem_bandwidth), True))
    else:
        bw = sympy.Float(mem_bandwidth)
    if curve and flops != 0:
        flops = flops + sympy.Float(matmul_half_flops * (2 if backward else 1))
    terms = [a * flops / sympy.Float(peak_flops), a * nbytes / bw]
    if net != 0:
        terms.append(sympy.Float(p2p_alpha) * net / sympy.Float(p2p_bandwidth))
    return sympy.Float(overhead) + sympy.Max(*terms)
