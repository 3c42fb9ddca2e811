"""First cost estimate per node: FLOPs and bytes at the captured example's shapes.

This is the placeholder for DIP's calibrated simulator (shared/PAPER.md §2.6): it evaluates FLOPs with torch's own
per-op formulas (``torch.utils.flop_counter``) and bytes as the sizes of a node's tensor inputs and outputs, at the
example batch's sizes (symbolic sizes are evaluated at their hints).  Everything that consumes costs goes through
:class:`NodeCost` and :func:`node_latency`, the one interface a symbolic, calibrated model will replace.

Sets ``node.meta["dipc_cost"]`` (a :class:`NodeCost`) on every ``call_function`` node.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx
from torch.utils.flop_counter import flop_registry

__all__ = ["NodeCost", "annotate_cost", "node_latency", "NOMINAL_FLOPS", "NOMINAL_BYTES_PER_S"]

#: nominal device used to turn FLOPs and bytes into seconds until a calibrated profile exists (issue: cost model):
#: 1 TFLOP/s and 100 GB/s, roughly one modern CPU socket.
NOMINAL_FLOPS = 1e12
NOMINAL_BYTES_PER_S = 1e11


@dataclasses.dataclass(frozen=True)
class NodeCost:
    """Cost of one node's forward at the example shapes.

    Attributes:
        flops: floating point operations (a multiply-add counts 2).
        bytes_read: bytes of tensor inputs.
        bytes_written: bytes of tensor outputs.
        activation_bytes: bytes of outputs that autograd may keep for backward (= bytes_written here).
    """

    flops: float
    bytes_read: float
    bytes_written: float
    activation_bytes: float

    def __add__(self, other: "NodeCost") -> "NodeCost":
        return NodeCost(self.flops + other.flops, self.bytes_read + other.bytes_read,
                        self.bytes_written + other.bytes_written, self.activation_bytes + other.activation_bytes)


ZERO = NodeCost(0.0, 0.0, 0.0, 0.0)


def _hint(x) -> int:
    if isinstance(x, torch.SymInt):
        return int(x.node.hint) if x.node.hint is not None else 1
    return int(x)


def _concrete(v):
    """Fake tensor -> meta tensor with hinted sizes; other values unchanged."""
    if isinstance(v, torch.Tensor):
        return torch.empty([_hint(s) for s in v.shape], dtype=v.dtype, device="meta")
    if isinstance(v, (list, tuple)):
        return type(v)(_concrete(x) for x in v)
    if isinstance(v, torch.SymInt):
        return _hint(v)
    return v


def _arg_val(a):
    if isinstance(a, torch.fx.Node):
        return _concrete(a.meta.get("val"))
    if isinstance(a, (list, tuple)):
        return type(a)(_arg_val(x) for x in a)
    return a


def _nbytes(v) -> float:
    if isinstance(v, torch.Tensor):
        n = 1
        for s in v.shape:
            n *= _hint(s)
        return float(n * v.element_size())
    if isinstance(v, (list, tuple)):
        return sum(_nbytes(x) for x in v)
    return 0.0


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= _hint(d)
    return n


def _direct_flops(node: torch.fx.Node) -> float | None:
    """FLOPs of the training-IR ops torch's registry does not list (it counts their decompositions)."""
    name = getattr(getattr(node.target, "overloadpacket", None), "__name__", "")
    val = node.meta.get("val")
    ins = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args]
    if name == "linear" and isinstance(val, torch.Tensor):
        return 2.0 * _numel(val.shape) * _hint(ins[1].shape[-1])
    if name == "matmul" and isinstance(val, torch.Tensor):
        return 2.0 * _numel(val.shape) * _hint(ins[0].shape[-1])
    if name in ("conv1d", "conv2d", "conv3d") and isinstance(val, torch.Tensor):
        w = ins[1]
        return 2.0 * _numel(val.shape) * _numel(w.shape[1:])
    if name == "scaled_dot_product_attention" and isinstance(val, torch.Tensor):
        q, k = ins[0], ins[1]
        # Q K^T and P V: 2 * 2 * (batch * heads) * S_q * S_k * D
        return 4.0 * _numel(q.shape[:-1]) * _hint(k.shape[-2]) * _hint(q.shape[-1])
    return None


def _flops(node: torch.fx.Node) -> float:
    direct = _direct_flops(node)
    if direct is not None:
        return direct
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    fn = flop_registry.get(packet) if packet is not None else None
    if fn is None:
        return 0.0
    try:
        args = _arg_val(node.args)
        kwargs = {k: _arg_val(v) for k, v in node.kwargs.items()}
        out = _concrete(node.meta.get("val"))
        return float(fn(*args, out_val=out, **kwargs))
    except Exception:  # a formula that does not accept these arguments: count no FLOPs, keep bytes
        return 0.0


def annotate_cost(graph: torch.fx.Graph) -> torch.fx.Graph:
    """Attach a :class:`NodeCost` to every ``call_function`` node (see the module docstring)."""
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        read = sum(_nbytes(a.meta.get("val")) for a in n.all_input_nodes)
        written = _nbytes(n.meta.get("val"))
        n.meta["dipc_cost"] = NodeCost(_flops(n), read, written, written)
    return graph


def node_latency(cost: NodeCost, flops_per_s: float = NOMINAL_FLOPS,
                 bytes_per_s: float = NOMINAL_BYTES_PER_S) -> float:
    """Roofline forward latency in seconds: max(FLOPs / F, bytes / B_mem) (DIP §2.6 with all alpha = 1)."""
    return max(cost.flops / flops_per_s, (cost.bytes_read + cost.bytes_written) / bytes_per_s)
