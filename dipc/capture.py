"""Capture: trace a model's training forward (up to its loss) with torch.export.

DIP (shared/PAPER.md §2.1) partitions the computation graph of a multimodal model; dipc obtains that graph with
``torch.export.export(..., strict=False)``.  Every dimension of the example batch that can vary between batches
(text batch, sequence length, number of images, ...) is exported as ``Dim.AUTO`` unless the user fixes it.  When the
model itself specializes one of those dimensions (Hugging Face LLaVA fixes the image count through a
``list(image_features)`` in its forward), the capture records it in :attr:`Capture.specialized`; the compiler then
re-captures once per distinct value of those dimensions (see ``dipc.compiler``), so no graph ever runs with a shape it
was not traced for.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Mapping

import torch
import torch.fx
from torch.export import Dim, export
from torch.export.graph_signature import InputKind, OutputKind

__all__ = ["Capture", "capture", "CaptureError"]


class CaptureError(ValueError):
    """Raised when a model or batch cannot be captured into a pipeline-able graph."""


@dataclasses.dataclass
class Capture:
    """One torch.export trace of ``model(**batch)`` reduced to the loss.

    Attributes:
        graph_module: the exported graph (ATen training IR).  Parameters, buffers and constants are placeholders;
            ``state_targets`` maps those placeholder names to the model's fully qualified names.
        state_targets: placeholder name -> (kind, fully qualified name); kind is "parameter", "buffer" or "constant".
        input_keys: placeholder name -> batch key, for the user inputs.
        loss_node: name of the node that computes the scalar loss.
        specialized: (batch key, dim) pairs that are static in the graph (fixed by the model, by torch.export's 0/1
            rule, or by the user): a batch with other values there needs another capture, never this graph.
        symbols: placeholder name -> list per dim of the size (an ``int`` or a ``torch.SymInt``).
        signature: the values of the ``specialized`` dims for the traced batch (``None`` where a key was absent).
    """

    graph_module: torch.fx.GraphModule
    state_targets: dict[str, tuple[str, str]]
    input_keys: dict[str, str]
    loss_node: str
    specialized: list[tuple[str, int]]
    signature: tuple
    constants: dict[str, Any]

    @property
    def graph(self) -> torch.fx.Graph:
        return self.graph_module.graph


def default_dynamic_dims(batch: Mapping[str, torch.Tensor]) -> dict[str, dict[int, Any]]:
    """Every dim of every tensor input is dynamic (``Dim.AUTO``): torch.export keeps what the model allows."""
    return {k: {d: Dim.AUTO for d in range(v.dim())} for k, v in batch.items()}


def _loss_output(ep, loss_key) -> str:
    """Find the output node name holding the loss (an output named ``loss_key`` or a lone scalar tensor)."""
    import torch.utils._pytree as pytree

    user_outputs = [s for s in ep.graph_signature.output_specs if s.kind == OutputKind.USER_OUTPUT]
    mutations = [s for s in ep.graph_signature.output_specs if s.kind != OutputKind.USER_OUTPUT]
    if mutations:
        raise CaptureError(
            f"the model's forward mutates state in place ({[s.target for s in mutations]}); pipelining such models "
            "(e.g. BatchNorm running statistics) is not supported: use eval-mode norms or LayerNorm/RMSNorm")
    spec = ep.call_spec.out_spec
    leaves_spec = pytree.tree_unflatten(list(range(len(user_outputs))), spec)
    idx = None
    if isinstance(leaves_spec, int):
        idx = leaves_spec
    elif isinstance(leaves_spec, Mapping) or hasattr(leaves_spec, "keys"):
        if loss_key in leaves_spec.keys() and isinstance(leaves_spec[loss_key], int):
            idx = leaves_spec[loss_key]
    elif isinstance(leaves_spec, (tuple, list)) and leaves_spec and isinstance(leaves_spec[0], int):
        idx = leaves_spec[0]
    if idx is None:
        raise CaptureError(f"cannot find the loss in the model's output (looked for a scalar tensor or key "
                           f"{loss_key!r}); structure: {spec}")
    arg = user_outputs[idx].arg
    if not hasattr(arg, "name") or getattr(arg, "value", 0) is None:
        raise CaptureError(f"the model's output {loss_key!r} is not a tensor (is the label key in the batch?)")
    return arg.name


def capture(model: torch.nn.Module, batch: Mapping[str, torch.Tensor], *,
            dynamic: Mapping[str, Mapping[int, Any]] | None = None, loss_key: str = "loss") -> Capture:
    """Export ``model(**batch)`` and prune the graph to the computation of the loss.

    Args:
        model: the unsplit model; its forward takes the batch's keys as keyword arguments and returns a scalar loss
            tensor, or a mapping / ModelOutput holding it under ``loss_key``.
        batch: key -> tensor, e.g. ``input_ids [B, S]``, ``pixel_values [N, 3, H, W]``, ``labels [B, S]``.
        dynamic: overrides of the dynamic dims, ``{key: {dim: Dim | Dim.AUTO | None}}``; ``None`` fixes a dim.
            Keys not given keep the default: every dim ``Dim.AUTO``.
        loss_key: name of the loss in a mapping output.

    Returns:
        a :class:`Capture`.

    Raises:
        CaptureError: a batch value is not a tensor, the loss is not found, or the forward mutates buffers.
    """
    for k, v in batch.items():
        if not isinstance(v, torch.Tensor):
            raise CaptureError(f"batch value {k!r} is a {type(v).__name__}; dipc batches hold tensors only")
    dyn = default_dynamic_dims(batch)
    for k, dims in (dynamic or {}).items():
        if k not in dyn:
            continue
        for d, spec in dims.items():
            dyn[k][d] = spec
    dyn = {k: {d: s for d, s in dims.items() if s is not None} for k, dims in dyn.items()}
    # torch.export always specializes sizes 0 and 1: ask for them static (no warning) and record them below
    tiny = {(k, d) for k, dims in dyn.items() for d in dims if batch[k].shape[d] <= 1}
    export_dyn = {k: {d: s for d, s in dims.items() if (k, d) not in tiny} for k, dims in dyn.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            ep = export(model, (), dict(batch), strict=False, dynamic_shapes={k: export_dyn[k] for k in batch})
        except Exception as e:
            shapes = {k: list(v.shape) for k, v in batch.items()}
            raise CaptureError(f"torch.export could not trace {type(model).__name__}(**batch) with batch shapes "
                               f"{shapes}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    gm = ep.graph_module
    loss_name = _loss_output(ep, loss_key)

    state_targets: dict[str, tuple[str, str]] = {}
    input_keys: dict[str, str] = {}
    user_input_names = []
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.PARAMETER:
            state_targets[spec.arg.name] = ("parameter", spec.target)
        elif spec.kind == InputKind.BUFFER:
            state_targets[spec.arg.name] = ("buffer", spec.target)
        elif spec.kind in (InputKind.CONSTANT_TENSOR,):
            state_targets[spec.arg.name] = ("constant", spec.target)
        elif spec.kind == InputKind.USER_INPUT:
            user_input_names.append(spec.arg.name)
        else:
            raise CaptureError(f"unsupported exported input kind {spec.kind} for {spec.arg}")
    # user inputs are flattened in the order of the kwargs dict (all tensors)
    keys = list(batch.keys())
    if len(keys) != len(user_input_names):
        raise CaptureError(f"expected {len(keys)} user inputs, export produced {len(user_input_names)}")
    for name, key in zip(user_input_names, keys):
        input_keys[name] = key

    # keep only the loss as output and drop dead code
    graph = gm.graph
    out = next(n for n in graph.nodes if n.op == "output")
    loss_node = next(n for n in graph.nodes if n.name == loss_name)
    out.args = ((loss_node,),)
    _prune_to_loss(graph, {n for n in graph.nodes if n.op == "placeholder" and n.name in state_targets
                           and state_targets[n.name][0] == "parameter"})
    gm.recompile()

    # dims that were requested dynamic but came out static
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    specialized = []
    for name, key in input_keys.items():
        val = placeholders[name].meta.get("val") if name in placeholders else None
        if val is None:
            continue
        for d in range(val.dim()):  # every static dim, whether the model or the user fixed it
            size = val.shape[d]
            if isinstance(size, int) or (isinstance(size, torch.SymInt) and size.node.expr.is_number):
                specialized.append((key, d))
    signature = tuple(batch[k].shape[d] for k, d in specialized)
    return Capture(graph_module=gm, state_targets=state_targets, input_keys=input_keys, loss_node=loss_name,
                   specialized=specialized, signature=signature, constants=dict(ep.constants))


_ASSERTS = {"_assert_scalar", "_assert_async", "sym_constrain_range", "sym_constrain_range_for_size",
            "_assert_tensor_metadata"}


def _ancestors(nodes) -> set:
    seen, stack = set(), list(nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _prune_to_loss(graph: torch.fx.Graph, params: set) -> None:
    """Keep what the loss needs, plus shape/value assertions on the inputs; drop everything else, including ops
    torch.fx's dead-code elimination keeps as impure (attention with a dropout argument) - e.g. the last ViT layer
    when image features come from layer -2.  Assertions that would need dropped parameter work are dropped too,
    as are dtype/device metadata assertions (the runtime checks the batch's dtypes itself)."""
    out = next(n for n in graph.nodes if n.op == "output")
    live = _ancestors([out])
    with_params = set()
    for n in graph.nodes:
        if n in params or any(a in with_params for a in n.all_input_nodes):
            with_params.add(n)
    for n in graph.nodes:
        name = getattr(getattr(n.target, "overloadpacket", None), "__name__", "") if n.op == "call_function" else ""
        if name in _ASSERTS and name != "_assert_tensor_metadata" and n not in live:
            anc = _ancestors([n])
            if not ((anc - live) & with_params):
                live |= anc
    for n in reversed(list(graph.nodes)):
        if n not in live and n.op != "placeholder" and n.op != "output":
            graph.erase_node(n)


def signature_of(batch: Mapping[str, torch.Tensor], specialized: list[tuple[str, int]]) -> tuple:
    """Values of the specialized dims for ``batch`` (``None`` for an absent key)."""
    return tuple(batch[k].shape[d] if k in batch else None for k, d in specialized)
