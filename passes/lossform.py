"""Loss form: how the model reduces its loss over a batch, read from the captured graph.

Microbatch losses are combined with weights so the pipeline's loss is the whole batch's (DESIGN.md "Numerics"):
a token-mean cross-entropy is weighted by each microbatch's count of counted targets, a sum by 1, a mean over
samples by each microbatch's samples.  The weights must follow what the forward computes, not the batch's key
names: this pass finds the cross-entropy / NLL node the loss is made of and reads its target key, its
``ignore_index``, its reduction and whether the targets are shifted (``labels[..., 1:]``, next-token prediction, as
Hugging Face causal LMs do; a masked LM, a classifier with ``labels [B]`` or a seq2seq decoder does not shift).

A loss that is not one cross-entropy scaled by constants (an MSE, a sum of several terms) is taken as a mean over
samples, which is exact for a per-sample mean of equal-size samples; the debug check (``dipc.check``), which splits
the example batch unevenly, catches a model where that is wrong.

Pure: reads the graph.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

__all__ = ["LossForm", "loss_form"]

_CE = {"cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss_forward", "nll_loss2d_forward"}
#: ops the loss may pass through after its cross-entropy without changing how it reduces
_SCALAR_SAFE = {"_to_copy", "to", "alias", "view", "reshape", "clone", "squeeze", "unsqueeze", "type_as", "float",
                "mul", "div", "neg", "contiguous", "copy", "lift_fresh_copy"}
_TARGET_SAFE = {"view", "reshape", "_unsafe_view", "slice", "contiguous", "clone", "to", "_to_copy", "alias",
                "flatten", "squeeze", "unsqueeze", "constant_pad_nd", "pad", "lift_fresh_copy", "detach", "select",
                "expand", "permute", "transpose", "long", "type_as"}


@dataclasses.dataclass(frozen=True)
class LossForm:
    """What :func:`loss_form` found.

    Attributes:
        kind: "token_mean" (mean over the counted targets), "sum" (a sum: every microbatch weighs 1) or
            "sample_mean".
        labels_key: the batch key holding the targets (token_mean).
        ignore_index: the target value not counted.
        shift: the targets are taken from position 1 on along their last dim (next-token prediction).
        note: how it was decided (for ``describe()``).
        uncertain: the reduction is a guess (``dipc.compile`` warns).
    """

    kind: str
    labels_key: str | None = None
    ignore_index: int = -100
    shift: bool = False
    note: str = ""
    uncertain: bool = False


def _name(n) -> str:
    return getattr(getattr(n.target, "overloadpacket", None), "__name__", "") if n.op == "call_function" else ""


def _scalar_only(node: torch.fx.Node, tensor_arg: torch.fx.Node) -> bool:
    """``node`` combines ``tensor_arg`` only with constants (no other tensor)."""
    others = [a for a in node.all_input_nodes if a is not tensor_arg]
    return all(not isinstance(a.meta.get("val"), torch.Tensor) for a in others)


def _reads_data(node) -> bool:
    """``node`` depends on the values of a batch tensor (not only on its sizes)."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if not isinstance(n, torch.fx.Node) or n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            return True
        if _name(n) == "sym_size":
            continue
        stack.extend(n.all_input_nodes)
    return False


def loss_form(graph: torch.fx.Graph, loss_node: str, input_keys) -> LossForm:
    """Read the loss's reduction over the batch (see the module docstring)."""
    node = next(n for n in graph.nodes if n.name == loss_node)
    while _name(node) not in _CE:
        ins = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        if _name(node) in ("mean", "sum") and len(ins) == 1:
            return LossForm("sample_mean", note=f"a {_name(node)} over the batch's elements: weighted by samples")
        if _name(node) not in _SCALAR_SAFE and not (node.op == "call_function" and node.target is operator.getitem):
            return LossForm("sample_mean", uncertain=True,
                            note=f"the loss ends in {node.target}: weighted by samples (pass loss= if wrong)")
        if len(ins) != 1 or not _scalar_only(node, ins[0]):
            return LossForm("sample_mean", uncertain=True, note="the loss combines several terms, which dipc cannot "
                                                                 "weight per microbatch: weighted by samples (pass "
                                                                 "loss= if wrong)")
        node = ins[0]
    args = list(node.args)
    name = _name(node)
    if name == "cross_entropy_loss":  # (input, target, weight, reduction, ignore_index, label_smoothing)
        reduction = args[3] if len(args) > 3 else node.kwargs.get("reduction", 1)
        ignore = args[4] if len(args) > 4 else node.kwargs.get("ignore_index", -100)
    else:  # nll_loss*(input, target, weight, reduction, ignore_index)
        reduction = args[3] if len(args) > 3 else node.kwargs.get("reduction", 1)
        ignore = args[4] if len(args) > 4 else node.kwargs.get("ignore_index", -100)
    weight = args[2] if len(args) > 2 else node.kwargs.get("weight")
    if isinstance(weight, torch.fx.Node):
        return LossForm("sample_mean", note="cross-entropy with class weights: weighted by samples")
    # walk the target back to a batch key, noting a slice that drops the first position of the last dim
    t, shift = args[1], False
    for _ in range(64):
        if not isinstance(t, torch.fx.Node):
            break
        if t.op == "placeholder":
            break
        if _name(t) == "roll":  # torch.roll(labels, -1, last dim): next-token targets, the wrapped one masked
            v = t.args[0].meta.get("val")
            shifts = t.args[1] if len(t.args) > 1 else t.kwargs.get("shifts")
            dims = t.args[2] if len(t.args) > 2 else t.kwargs.get("dims")
            shifts = shifts[0] if isinstance(shifts, (list, tuple)) and len(shifts) == 1 else shifts
            dims = dims[0] if isinstance(dims, (list, tuple)) and len(dims) == 1 else dims
            if isinstance(v, torch.Tensor) and shifts == -1 and dims in (v.dim() - 1, -1):
                shift = True
                t = t.args[0]
                continue
        if _name(t) == "masked_fill" and len(t.args) > 2 and t.args[2] == ignore and \
                isinstance(t.args[0], torch.fx.Node) and _name(t.args[0]) == "roll" and not _reads_data(t.args[1]):
            t = t.args[0]  # masks the rolled-in last position (its mask is built from sizes, not from data)
            continue
        if _name(t) not in _TARGET_SAFE:
            return LossForm("sample_mean", uncertain=True,
                            note=f"the loss's targets come from {t.target}: weighted by samples (pass loss= if wrong)")
        if _name(t) == "slice":
            v = t.args[0].meta.get("val")
            dim = t.args[1] if len(t.args) > 1 else 0
            start = t.args[2] if len(t.args) > 2 else 0
            if isinstance(v, torch.Tensor) and dim in (v.dim() - 1, -1) and start == 1:
                shift = True
        t = t.args[0]
    key = input_keys.get(t.name) if isinstance(t, torch.fx.Node) and t.op == "placeholder" else None
    if key is None:
        return LossForm("sample_mean", uncertain=True,
                        note="the loss's targets are not a batch key: weighted by samples (pass loss= if wrong)")
    if reduction == 2:  # sum
        return LossForm("sum", note=f"a summed cross-entropy over {key!r}")
    if reduction != 1:
        return LossForm("sample_mean", note="an unreduced cross-entropy: weighted by samples")
    return LossForm("token_mean", labels_key=key, ignore_index=int(ignore), shift=shift,
                    note=f"a mean cross-entropy over {key!r}" + (" shifted by one" if shift else "")
                         + f", ignoring {int(ignore)}")
