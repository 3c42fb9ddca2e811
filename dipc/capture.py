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

import contextlib
import dataclasses
import operator
import warnings
from typing import Any, Mapping

import sympy
import torch
import torch.fx
from torch.export import Dim, export
from torch.export.graph_signature import InputKind, OutputKind

from dipc.repeated import NoReuse, reusing_blocks, splice

__all__ = ["Capture", "capture", "CaptureError", "is_meta"]


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
        keys: the batch keys the trace was made with: a batch with another key set (e.g. ``pixel_values`` absent
            from a text-only microbatch) needs another capture, whatever its dims.
        functionalized: True when the exported graph held in-place ops and was made functional
            (``ExportedProgram.run_decompositions({})``), so no pass can lose a write into a view.
        value_inputs: placeholder name -> the Python value (a leaf of a non-tensor batch value) it was traced with;
            these placeholders have no users (the trace is specialised to the value).
        values: the batch's Python values (:func:`python_values`): a batch with other values needs another trace.
        ranges: symbol -> (lowest, highest or None) size the trace is valid for (torch.export's range constraints).
    """

    graph_module: torch.fx.GraphModule
    state_targets: dict[str, tuple[str, str]]
    input_keys: dict[str, str]
    loss_node: str
    specialized: list[tuple[str, int]]
    signature: tuple
    constants: dict[str, Any]
    keys: frozenset = frozenset()
    functionalized: bool = False
    value_inputs: dict[str, Any] = dataclasses.field(default_factory=dict)
    values: tuple = ()
    ranges: dict = dataclasses.field(default_factory=dict)
    #: model output key (a ModelOutput / dict key, or the position in a tuple output as a string) -> node name, for
    #: each tensor output other than the loss that the loss also needs (``logits``): what forward-only evaluation
    #: can hand back (:meth:`dipc.runtime.PipelineRuntime.eval_step`'s ``outputs``)
    outputs: dict = dataclasses.field(default_factory=dict)
    #: output keys the model returns that the loss does not need (pruned from the graph; not available)
    dropped_outputs: tuple = ()
    #: repeated layers whose ops were copied from their first layer's trace instead of traced (:mod:`dipc.repeated`)
    reused_layers: int = 0

    def fits(self, data: Mapping[str, Any]) -> bool:
        """True when ``data`` (a batch, microbatch or sub-microbatch) has this trace's keys and, in every dim
        that is static in the graph, this trace's value."""
        return (frozenset(data) == self.keys and signature_of(data, self.specialized) == self.signature
                and python_values(data) == self.values)

    @property
    def graph(self) -> torch.fx.Graph:
        return self.graph_module.graph

    def arguments(self, model: torch.nn.Module, data: Mapping[str, Any]) -> list:
        """The graph's inputs, in placeholder order: ``model``'s parameters and buffers (by fully qualified name),
        this capture's constants and ``data``'s tensors and Python values.

        Raises:
            KeyError: ``model`` lacks a parameter or buffer the graph reads, or ``data`` a key."""
        state = dict(model.named_parameters(remove_duplicate=False))
        state.update(model.named_buffers(remove_duplicate=False))
        args = []
        for n in self.graph.nodes:
            if n.op != "placeholder":
                continue
            if n.name in self.state_targets:
                kind, fqn = self.state_targets[n.name]
                args.append(self.constants[fqn] if kind == "constant" else state[fqn])
            elif n.name in self.value_inputs:
                args.append(self.value_inputs[n.name])
            else:
                args.append(data[self.input_keys[n.name]])
        return args


def default_dynamic_dims(batch: Mapping[str, torch.Tensor]) -> dict[str, dict[int, Any]]:
    """Every dim of every tensor input is dynamic (``Dim.AUTO``): torch.export keeps what the model allows."""
    return {k: {d: Dim.AUTO for d in range(v.dim())} for k, v in batch.items()}


def _loss_output(ep, loss_key) -> str:
    """Find the output node name holding the loss (an output named ``loss_key`` or a lone scalar tensor)."""
    mutations = [s for s in ep.graph_signature.output_specs if s.kind != OutputKind.USER_OUTPUT]
    if mutations:
        raise CaptureError(
            f"the model's forward mutates state in place ({[s.target for s in mutations]}); pipelining such models "
            "(e.g. BatchNorm running statistics) is not supported: use eval-mode norms or LayerNorm/RMSNorm")
    spec = ep.call_spec.out_spec
    user_outputs, leaves_spec = _output_tree(ep)
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


def _output_tree(ep) -> tuple[list, Any]:
    """``(user output specs, the model's output structure with each leaf replaced by its index there)``."""
    import torch.utils._pytree as pytree

    user_outputs = [s for s in ep.graph_signature.output_specs if s.kind == OutputKind.USER_OUTPUT]
    return user_outputs, pytree.tree_unflatten(list(range(len(user_outputs))), ep.call_spec.out_spec)


def _output_nodes(ep) -> dict[str, str]:
    """Model output key -> node name of every tensor user output (mapping keys; tuple positions as strings)."""
    user_outputs, tree = _output_tree(ep)
    if isinstance(tree, Mapping) or hasattr(tree, "keys"):
        items = [(str(k), tree[k]) for k in tree.keys()]
    elif isinstance(tree, (tuple, list)):
        items = [(str(i), v) for i, v in enumerate(tree)]
    else:
        items = []
    out = {}
    for key, idx in items:
        if isinstance(idx, int) and hasattr(user_outputs[idx].arg, "name"):
            out[key] = user_outputs[idx].arg.name
    return out


def capture(model: torch.nn.Module, batch: Mapping[str, torch.Tensor], *,
            dynamic: Mapping[str, Mapping[int, Any]] | None = None, loss_key: str = "loss",
            forward=None) -> Capture:
    """Export ``model(**batch)`` and prune the graph to the computation of the loss.

    Args:
        model: the unsplit model; its forward takes the batch's keys as keyword arguments and returns a scalar loss
            tensor, or a mapping / ModelOutput holding it under ``loss_key``.
        batch: key -> tensor, e.g. ``input_ids [B, S]``, ``pixel_values [N, 3, H, W]``, ``labels [B, S]``.
        dynamic: overrides of the dynamic dims, ``{key: {dim: Dim | Dim.AUTO | None}}``; ``None`` fixes a dim.
            Keys not given keep the default: every dim ``Dim.AUTO``.
        loss_key: name of the loss in a mapping output.
        forward: traced in place of ``model.forward`` (a function of the batch's keys computing the same output:
            a capture recipe, :mod:`dipc.recipes`); the parameters keep their names.

    Returns:
        a :class:`Capture`.

    Raises:
        CaptureError: a batch value is not a tensor, the loss is not found, or the forward mutates buffers.
    """
    import torch.utils._pytree as pytree

    for k, v in batch.items():
        if not isinstance(v, torch.Tensor) and any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(v)):
            raise CaptureError(f"batch value {k!r} is a {type(v).__name__} holding tensors; give each tensor its own "
                               "batch key (dipc splits and routes top-level tensors)")
    dyn = default_dynamic_dims({k: v for k, v in batch.items() if isinstance(v, torch.Tensor)})
    for k, dims in (dynamic or {}).items():
        if k not in dyn:
            continue
        for d, spec in dims.items():
            dyn[k][d] = spec
    dyn = {k: {d: s for d, s in dims.items() if s is not None} for k, dims in dyn.items()}
    # torch.export always specializes sizes 0 and 1: ask for them static (no warning) and record them below
    tiny = {(k, d) for k, dims in dyn.items() for d in dims if batch[k].shape[d] <= 1}
    export_dyn = {k: {d: s for d, s in dims.items() if (k, d) not in tiny} for k, dims in dyn.items()}
    for k, v in batch.items():  # Python values (lists, flags) are constants of the trace
        if not isinstance(v, torch.Tensor):
            export_dyn[k] = pytree.tree_map(lambda _: None, v)
    with warnings.catch_warnings(), _checkpoints_traced_through(), _named_kwargs(model, batch, forward):
        warnings.simplefilter("ignore")
        try:
            ep, reused = _export_reusing_blocks(model, batch, {k: export_dyn[k] for k in batch})
        except Exception as e:
            shapes = {k: list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__ for k, v in batch.items()}
            hint = ("; the model returns a KV cache: set model.config.use_cache = False for training"
                    if "Cache" in str(e) and "pytree" in str(e) else "")
            raise CaptureError(f"torch.export could not trace {type(model).__name__}(**batch) with batch shapes "
                               f"{shapes}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                               f"{_model_frame(e)}{hint}") from e
    if any(n.op == "call_function" and "wrap_with_autocast" in str(n.target) for n in ep.graph.nodes):
        raise CaptureError(f"{type(model).__name__}'s forward runs a torch.autocast region: torch.export traces it as "
                           "one opaque subgraph with no module structure inside, so dipc cannot cut it into chunks; "
                           "remove torch.autocast from the forward (or cast the model to bf16 as a whole)")
    functionalized = False
    if _mutating_ops(ep.graph) or _transform_ops(ep.graph):
        # an in-place write into a view (``mask[:, -2:] = 0``, ``index_put_``, ``copy_`` into a slice) has no users
        # in the training IR: make the graph functional so the write becomes a value the loss depends on.  The
        # same re-trace runs functorch transforms (``torch.vmap`` in Hugging Face's mask functions, traced as
        # nesting calls and ``flat_apply`` of opaque attributes) into plain batched ops.
        try:
            ep = ep.run_decompositions({})
        except Exception as e:
            raise CaptureError(f"the exported {type(model).__name__} has in-place ops {_mutating_ops(ep.graph)} and "
                               f"could not be made functional: {type(e).__name__}: {e}") from e
        left = _mutating_ops(ep.graph)
        if left:
            raise CaptureError(f"in-place op(s) {left} of {type(model).__name__} remain after functionalization; "
                               "dipc cannot partition a graph whose writes have no users")
        functionalized = True
        # the re-trace may record another memory layout for a kernel's output than it has at run time (T5's
        # attention with SDPA on CPU) and lower reshape/contiguous to views of that layout: in a functional graph
        # nothing depends on aliasing, so every view is a reshape
        for n in ep.graph.nodes:
            if n.op == "call_function" and n.target in (torch.ops.aten.view.default,
                                                        torch.ops.aten._unsafe_view.default):
                n.target = torch.ops.aten.reshape.default
            elif n.op == "call_function" and n.target is torch.ops.aten.copy.default:
                _differentiable_copy(ep.graph, n)
        ep.graph_module.recompile()
    gm = ep.graph_module
    loss_name = _loss_output(ep, loss_key)
    loss_val = next(n for n in gm.graph.nodes if n.name == loss_name).meta.get("val")
    if isinstance(loss_val, torch.Tensor) and loss_val.dim() != 0:
        raise CaptureError(f"the loss of {type(model).__name__} has shape {list(loss_val.shape)}; dipc trains a model "
                           "whose forward returns the scalar batch loss (reduce it, e.g. .mean(), in the forward)")

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
    # user inputs are the kwargs' pytree leaves in dict order: a tensor per tensor key, one leaf per Python value
    leaves = [(key, leaf) for key, v in batch.items()
              for leaf in ([v] if isinstance(v, torch.Tensor) else pytree.tree_leaves(v))]
    if len(leaves) != len(user_input_names):
        raise CaptureError(f"expected {len(leaves)} user inputs, export produced {len(user_input_names)}")
    value_inputs: dict[str, Any] = {}
    for name, (key, leaf) in zip(user_input_names, leaves):
        if isinstance(leaf, torch.Tensor):
            input_keys[name] = key
        else:
            value_inputs[name] = leaf

    # keep only the loss as output and drop dead code
    named_outputs = {k: v for k, v in _output_nodes(ep).items() if v != loss_name}
    graph = gm.graph
    out = next(n for n in graph.nodes if n.op == "output")
    loss_node = next(n for n in graph.nodes if n.name == loss_name)
    out.args = ((loss_node,),)
    _prune_to_loss(graph, {n for n in graph.nodes if n.op == "placeholder" and n.name in state_targets
                           and state_targets[n.name][0] == "parameter"})
    _explicit_view_sizes(graph)
    for n in graph.nodes:
        if n.op == "placeholder" and n.name in value_inputs and n.users:
            raise CaptureError(f"the trace reads the Python value {n.name} = {value_inputs[n.name]!r} as an input; "
                               "dipc needs Python batch values specialised (constants of the trace)")
    gm.recompile()
    alive = {n.name for n in graph.nodes}
    kept = {k: v for k, v in named_outputs.items() if v in alive}

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
                   specialized=specialized, signature=signature, constants=dict(ep.constants),
                   keys=frozenset(batch), functionalized=functionalized, value_inputs=value_inputs,
                   values=python_values(batch), ranges=_ranges(ep), outputs=kept,
                   dropped_outputs=tuple(k for k in named_outputs if k not in kept), reused_layers=reused)


def _export_reusing_blocks(model: torch.nn.Module, batch: Mapping[str, Any], dynamic: dict):
    """``(torch.export.export(model, (), batch, strict=False), layers reused)`` with each repeated layer traced
    once (:mod:`dipc.repeated`).  Where the reuse of one list cannot complete the graph, the model is exported again
    with that list's layers traced; where that fails too, or the trace fails, with every layer traced (0 reused)."""
    exclude: frozenset = frozenset()
    for _ in range(2):  # a list at fault is traced whole the second time; then everything is
        with reusing_blocks(model, exclude) as record:
            if record is None:
                break
            try:
                ep = export(model, (), dict(batch), strict=False, dynamic_shapes=dynamic)
                return ep, splice(ep, record)
            except NoReuse as e:
                if e.prefix is None:
                    break
                exclude = exclude | {e.prefix}
            except Exception:  # noqa: BLE001 (the plain trace below raises what the model really does)
                break
    return export(model, (), dict(batch), strict=False, dynamic_shapes=dynamic), 0


def _ranges(ep) -> dict:
    """symbol -> (lowest, highest or None) value the trace is valid for (torch.export's range constraints: a
    forward that branches on ``seq > 8`` is valid only on one side)."""
    def finite(x):
        try:
            return int(x) if bool(getattr(x, "is_finite", True)) and bool(sympy.sympify(x).is_finite) else None
        except (TypeError, ValueError, AttributeError, OverflowError, sympy.SympifyError):
            return None

    return {sym: (finite(vr.lower), finite(vr.upper)) for sym, vr in ep.range_constraints.items()}


def python_values(batch: Mapping[str, Any]) -> tuple:
    """The batch's Python (non-tensor) values in a hashable form: the trace is specialised to them."""
    return tuple(sorted((k, repr(v)) for k, v in batch.items() if not isinstance(v, torch.Tensor)))


@contextlib.contextmanager
def _named_kwargs(model: torch.nn.Module, batch: Mapping[str, Any], recipe=None):
    """While tracing, give the model a forward whose signature names every batch key: torch.export matches
    ``dynamic_shapes`` to the forward's parameters and cannot match keys that land in ``**kwargs`` (Hugging Face's
    ``num_items_in_batch``, custom ``forward(input_ids, labels, **kwargs)``; pytorch/pytorch#150022).  With
    ``recipe``, that forward runs the recipe instead of the model's own."""
    import inspect

    if recipe is not None:
        def run_recipe(**kwargs):
            return recipe(**kwargs)

        run_recipe.__signature__ = inspect.Signature([inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY)
                                                      for k in batch])
        model.forward = run_recipe
        try:
            yield
        finally:
            del model.forward
        return
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    named = {n for n, p in params.items() if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                        inspect.Parameter.KEYWORD_ONLY)}
    if not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()) or set(batch) <= named:
        yield
        return
    bound = model.forward

    def forward(**kwargs):
        return bound(**kwargs)

    forward.__signature__ = inspect.Signature([inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY) for k in batch])
    model.forward = forward
    try:
        yield
    finally:
        del model.forward


def _model_frame(e: BaseException) -> str:
    """`` at <file>:<line> `<code>` ``: the innermost frame of the model's own code (not torch's, not dipc's) where
    tracing failed, so the error names the construct (a ``.tolist()``, a data-dependent branch, ...)."""
    import os
    import traceback

    torch_dir = os.path.dirname(torch.__file__)
    dipc_dir = os.path.dirname(__file__)
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not f.filename.startswith(torch_dir) and not f.filename.startswith(dipc_dir)
              and "/contextlib.py" not in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    short = f.filename.split("site-packages/")[-1]
    return f" (in the model's code at {short}:{f.lineno}: `{(f.line or '').strip()}`)"


@contextlib.contextmanager
def _checkpoints_traced_through():
    """Trace reentrant activation checkpoints (``checkpoint(fn, x, use_reentrant=True)``, Hugging Face's
    ``gradient_checkpointing_enable()``) as the plain call they stand for.  Exported as they are, their forward runs
    under ``no_grad`` and the graph has no gradient; non-reentrant checkpoints torch.export already inlines.  The
    math is the same; recomputation is the planner's memory strategy per stage, not the model's."""
    import torch.utils.checkpoint as ckpt

    fn = ckpt.CheckpointFunction
    own = "apply" in fn.__dict__
    original = fn.__dict__.get("apply")
    def plain(function, preserve_rng_state, *args):
        # as a reentrant checkpoint does: no input needing a gradient means an output without one (the wrapped
        # layer's parameters then get no gradient in the eager model either)
        if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return function(*args)
        with torch.no_grad():
            return function(*args)

    fn.apply = staticmethod(plain)
    try:
        yield
    finally:
        if own:
            fn.apply = original
        else:
            del fn.apply


def _differentiable_copy(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """Functionalization turns ``dst.copy_(src)`` (``h[:, 0] = h[:, 0] * 2``) into ``aten.copy(dst, src)``, which
    has no derivative: the same value is ``src`` cast to ``dst``'s dtype and broadcast to its shape."""
    dst, src = node.args[0], node.args[1]
    val = dst.meta["val"]
    with graph.inserting_before(node):
        cast = graph.call_function(torch.ops.aten._to_copy.default, (src,), {"dtype": val.dtype})
        sizes = [graph.call_function(torch.ops.aten.sym_size.int, (dst, d)) if isinstance(s, torch.SymInt) else int(s)
                 for d, s in enumerate(val.shape)]
        out = graph.call_function(torch.ops.aten.expand.default, (cast, sizes))
        out = graph.call_function(torch.ops.aten.clone.default, (out,))
    for new in (cast, out):
        new.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")})
    cast.meta["val"] = src.meta["val"].to(val.dtype) if isinstance(src.meta.get("val"), torch.Tensor) else None
    out.meta["val"] = node.meta["val"]
    for s_ in sizes:
        if isinstance(s_, torch.fx.Node):
            s_.meta.update({k: v for k, v in node.meta.items() if k == "nn_module_stack"})
            s_.meta["val"] = val.shape[s_.args[1]]
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def _transform_ops(graph: torch.fx.Graph) -> list[str]:
    """Nodes of functorch transforms (``vmap`` nesting, ``flat_apply``) that only a re-trace turns into ops."""
    out = []
    for n in graph.nodes:
        name = getattr(n.target, "__name__", str(n.target)) if n.op == "call_function" else ""
        if "_vmap_" in name or "flat_apply" in name or "batch_dim" in name:
            out.append(n.name)
    return out


#: in-place ops that change no value (``torch.tensor(list)`` exports a ``detach_`` of a fresh constant)
_METADATA_ONLY = {torch.ops.aten.detach_.default}


def _mutating_ops(graph: torch.fx.Graph) -> list[str]:
    """Names of the graph's ops that write into one of their arguments (``aten.fill_``, ``index_put_``, ...)."""
    out = []
    for n in graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable \
                and n.target not in _METADATA_ONLY:
            out.append(f"{n.name} ({n.target})")
    return out


#: ATen ops that only check (no value flows out of them)
ASSERTS = {"_assert_scalar", "_assert_async", "sym_constrain_range", "sym_constrain_range_for_size",
           "_assert_tensor_metadata"}


def _ancestors(nodes) -> set:
    seen, stack = set(), list(nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)


def size_floordiv(a, b):
    """``a // b`` of two sizes, 0 where ``b`` is 0: a size divided by a size that is 0 belongs to a tensor with no
    element (Qwen2.5-VL's ``(n // 4) * (n // (n // 4))`` rows after its window permutation, at ``n = 0``)."""
    return a // b if b else 0


def size_mod(a, b):
    """``a % b`` of two sizes, 0 where ``b`` is 0 (as :func:`size_floordiv`)."""
    return a % b if b else 0


def _explicit_view_sizes(graph: torch.fx.Graph) -> None:
    """Write the size a view's ``-1`` stands for where the trace found it static (a head dim): ``view(x, [n, 3, 2,
    -1])`` cannot infer ``-1`` when ``n`` is 0 (an instance kind fed as 0 instances, a sub-microbatch without
    any), though the graph's value is the same for every ``n``; sizes divided by sizes become
    :func:`size_floordiv` / :func:`size_mod`, defined at 0."""
    for n in graph.nodes:
        if n.op != "call_function" or n.target not in _VIEWS or len(n.args) < 2:
            continue
        shape, val = n.args[1], n.meta.get("val")
        if not isinstance(shape, (list, tuple)) or -1 not in shape or not isinstance(val, torch.Tensor):
            continue
        i = list(shape).index(-1)
        if isinstance(val.shape[i], int):
            n.args = (n.args[0], [val.shape[i] if j == i else d for j, d in enumerate(shape)]) + tuple(n.args[2:])
    for n in graph.nodes:  # and a size divided by a 0 size is 0 (every tensor it shapes is empty)
        if n.op == "call_function" and n.target in (operator.floordiv, operator.mod):
            n.target = size_floordiv if n.target is operator.floordiv else size_mod


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
        if name in ASSERTS and name != "_assert_tensor_metadata" and n not in live:
            anc = _ancestors([n])
            if not ((anc - live) & with_params):
                live |= anc
    for n in reversed(list(graph.nodes)):
        if n not in live and n.op != "placeholder" and n.op != "output":
            graph.erase_node(n)


def signature_of(batch: Mapping[str, torch.Tensor], specialized: list[tuple[str, int]]) -> tuple:
    """Values of the specialized dims for ``batch`` (``None`` for an absent key)."""
    return tuple(batch[k].shape[d] if k in batch else None for k, d in specialized)


def is_meta(model: torch.nn.Module) -> bool:
    """True when any parameter or buffer of ``model`` is on the meta device (a check cannot run it)."""
    return any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
