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
launch; microseconds, dominant for small operators on CPU).

Conventions (the calibration measures with the same ones, so a cost pass should count the same way):

* FLOPs as ``torch.utils.flop_counter`` counts them: a multiply-add is 2 FLOPs; ``mm``/``linear``/``bmm``
  ``2*M*N*K``; convolution ``2 * out_numel * C_in/groups * prod(kernel)``; ``scaled_dot_product_attention``
  ``4 * B * H * S_q * S_k * D`` (causal masking not discounted); elementwise, normalization, softmax, reduction,
  embedding and loss operators count 0 FLOPs (they are memory-bound and use the memory term).
* bytes = bytes of the operator's tensor inputs plus its outputs, except ``embedding``: indices + gathered rows
  read + output written (``2 * out_bytes + index_bytes``), not the whole table.

Shipped profiles (``dipc/profiles/*.json``, loaded by name with :meth:`DeviceProfile.load`) come from NVIDIA
datasheets and are marked ``calibrated: false``; calibrated profiles written by ``python -m dipc.calibrate`` go to
:func:`user_profile_dir` and take precedence over shipped ones of the same name.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

__all__ = ["DeviceProfile", "FAMILIES", "COMPUTE_FAMILIES", "op_family", "user_profile_dir", "shipped_profiles",
           "available_profiles", "PROFILE_DIR_ENV"]

#: operator families with their own efficiency factor; "p2p" is the network term (pipeline send/recv, collectives).
FAMILIES: tuple[str, ...] = ("matmul", "attention", "conv", "elementwise", "reduction", "norm", "softmax",
                             "embedding", "loss", "other", "p2p")
#: the families of on-device operators (all but "p2p").
COMPUTE_FAMILIES: tuple[str, ...] = FAMILIES[:-1]

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
    """Names of the datasheet profiles that ship with dipc (``dipc/profiles/*.json``)."""
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
            rate).  Families missing from the dict use ``alpha["other"]`` (or 1.0).
        launch_overhead: fixed seconds added to every operator (dispatch and kernel launch).
        calibrated: True when the figures were measured by ``python -m dipc.calibrate``.
        source: where the figures come from (datasheet citation or measurement details).
        dtype: the training dtype ``peak_flops`` refers to ("bfloat16", "float32").
        memory_capacity: device memory in bytes, or None when unknown.
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
    launch_overhead: float = 0.0
    calibrated: bool = False
    source: str = ""
    dtype: str = "bfloat16"
    memory_capacity: float | None = None
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.peak_flops = _check_pos("peak_flops", self.peak_flops)
        self.mem_bandwidth = _check_pos("mem_bandwidth", self.mem_bandwidth)
        self.p2p_bandwidth = _check_pos("p2p_bandwidth", self.p2p_bandwidth)
        self.p2p_latency = _check_pos("p2p_latency", self.p2p_latency, allow_zero=True)
        self.launch_overhead = _check_pos("launch_overhead", self.launch_overhead, allow_zero=True)
        if self.memory_capacity is not None:
            self.memory_capacity = _check_pos("memory_capacity", self.memory_capacity)
        alpha = {}
        for k, v in dict(self.alpha).items():
            if k not in FAMILIES:
                raise ValueError(f"alpha has unknown operator family {k!r}; families are {', '.join(FAMILIES)}")
            alpha[k] = _check_pos(f"alpha[{k!r}]", v)
        self.alpha = alpha
        self.calibrated = bool(self.calibrated)

    # ------------------------------------------------------------------ the model
    def alpha_for(self, family: str) -> float:
        """Efficiency factor of ``family`` (falls back to ``alpha["other"]``, then 1.0).

        Raises:
            ValueError: ``family`` is not one of :data:`FAMILIES`.
        """
        if family not in FAMILIES:
            raise ValueError(f"unknown operator family {family!r}; families are {', '.join(FAMILIES)}")
        a = self.alpha.get(family)
        if a is None:
            a = self.alpha.get("other", 1.0)
        return a

    def op_latency(self, family: str, flops: float, bytes: float, net_bytes: float = 0.0) -> float:
        """Seconds one operator takes (DIP §2.6 roofline plus the launch overhead)::

            launch_overhead + max(alpha[family] * flops / peak_flops,
                                  alpha[family] * bytes / mem_bandwidth,
                                  alpha["p2p"] * net_bytes / p2p_bandwidth)

        Args:
            family: operator family, one of :data:`FAMILIES`.
            flops: floating-point operations (multiply-add = 2).
            bytes: bytes moved through device memory (tensor inputs + outputs).
            net_bytes: bytes sent over the network by this operator (collectives inside a stage); the per-message
                latency is not included here (see :meth:`p2p_time` for pipeline sends).

        Raises:
            ValueError: unknown family, or a negative count.
        """
        if flops < 0 or bytes < 0 or net_bytes < 0:
            raise ValueError(f"op_latency needs non-negative counts, got flops={flops}, bytes={bytes}, "
                             f"net_bytes={net_bytes}")
        a = self.alpha_for(family)
        t = max(a * flops / self.peak_flops, a * bytes / self.mem_bandwidth)
        if net_bytes:
            t = max(t, self.alpha_for("p2p") * net_bytes / self.p2p_bandwidth)
        return self.launch_overhead + t

    def p2p_time(self, nbytes: float) -> float:
        """Seconds to send one ``nbytes`` message to a neighbouring rank: ``p2p_latency + alpha["p2p"] * nbytes /
        p2p_bandwidth``.

        Raises:
            ValueError: ``nbytes`` is negative.
        """
        if nbytes < 0:
            raise ValueError(f"p2p_time needs a non-negative size, got {nbytes}")
        return self.p2p_latency + self.alpha_for("p2p") * nbytes / self.p2p_bandwidth

    # ------------------------------------------------------------------ (de)serialization
    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON-types dict of every field."""
        d = dataclasses.asdict(self)
        d["alpha"] = {f: self.alpha[f] for f in FAMILIES if f in self.alpha}
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
        return (f"{self.name}: {self.peak_flops / 1e12:.3g} TFLOP/s ({self.dtype}), mem {self.mem_bandwidth / 1e9:.4g}"
                f" GB/s, p2p {self.p2p_bandwidth / 1e9:.4g} GB/s + {self.p2p_latency * 1e6:.3g} us, launch "
                f"{self.launch_overhead * 1e6:.3g} us, {'calibrated' if self.calibrated else 'uncalibrated'}")


# ---------------------------------------------------------------------- operator families
_FAMILY_OF_OP = {
    "matmul": ("mm", "bmm", "addmm", "baddbmm", "linear", "matmul", "addbmm", "dot", "mv", "einsum"),
    "attention": ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                  "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
                  "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward"),
    "conv": ("conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose1d", "conv_transpose2d",
             "conv_transpose3d"),
    "norm": ("layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm", "group_norm", "native_group_norm",
             "batch_norm", "native_batch_norm", "_native_batch_norm_legit", "instance_norm"),
    "softmax": ("softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"),
    "reduction": ("sum", "mean", "amax", "amin", "max", "min", "prod", "var", "std", "var_mean", "norm",
                  "linalg_vector_norm", "logsumexp", "argmax", "argmin", "cumsum", "any", "all"),
    "embedding": ("embedding", "index_select", "gather", "take_along_dim"),
    "loss": ("cross_entropy_loss", "nll_loss", "nll_loss_forward", "nll_loss2d", "mse_loss", "l1_loss",
             "smooth_l1_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div"),
    "elementwise": ("add", "sub", "mul", "div", "neg", "pow", "sqrt", "rsqrt", "exp", "log", "sin", "cos", "tanh",
                    "sigmoid", "silu", "gelu", "relu", "erf", "abs", "clamp", "where", "masked_fill", "maximum",
                    "minimum", "reciprocal", "dropout", "native_dropout", "to", "_to_copy", "copy", "copy_",
                    "fill", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "lerp", "addcmul",
                    "eq", "ne", "lt", "le", "gt", "ge", "logical_not", "logical_and", "bitwise_not", "floor",
                    "ceil", "round", "sign", "square", "softplus", "hardtanh", "leaky_relu", "type_as"),
}
_OP_TO_FAMILY = {op: fam for fam, ops in _FAMILY_OF_OP.items() for op in ops}


def op_family(op: Any) -> str:
    """Family (one of :data:`COMPUTE_FAMILIES`) of an ATen operator, an ``OpOverload``/``OpOverloadPacket`` or an op
    name such as ``"aten.mm.default"`` or ``"linear"``; unknown operators (cat, views, index, ...) are "other"."""
    packet = getattr(op, "overloadpacket", op)
    name = getattr(packet, "__name__", None) or str(op)
    name = name.split("::")[-1]
    parts = name.split(".")
    if len(parts) >= 2 and parts[0] in ("aten", "prims", "torch"):
        parts = parts[1:]
    return _OP_TO_FAMILY.get(parts[0]) or _OP_TO_FAMILY.get(parts[0].rstrip("_")) or "other"
