"""Trace each repeated block once: the layers of a ``nn.ModuleList`` / ``nn.Sequential`` that are the same module
(class, parameter shapes, attributes) and are called with the same kind of inputs are traced by torch.export only at
their first call; every later layer is recorded as one opaque call and replaced, after the export, by a copy of the
first layer's traced ops reading that layer's own parameters and inputs (issue "Capture once" §5).

Why: torch.export's non-strict trace costs about 10 ms per ATen op with symbolic shapes, so a paper-scale VLM (a
63-layer ViT and a 32-layer LLM) spent most of ``dipc.compile`` tracing the same layer 95 times.  The layers'
*inputs* still come from the model's own loop, so a parent that feeds some layers another tensor (Qwen2.5-VL's
full-attention layers read ``cu_seqlens`` where the others read the window's) gets the right graph.

A layer is reused only when its classes are trusted (every module class in it from torch.nn, transformers,
diffusers, timm or dipc.models: forwards that are pure functions of the layer's attributes, parameters and inputs,
the contract activation checkpointing relies on; ``DIPC_REUSE_BLOCKS=all`` extends this to any class, its author
asserting that no forward reads global or class state, draws Python random numbers or has a side effect), and
nothing tells it apart from the first one of its group:

- the same class tree, train / eval mode, parameter and buffer names, shapes, dtypes and ``requires_grad``; no
  parameter or buffer with another name in the model (tied);
- the same attributes and hooks, at the call (a parent may set one between layers): primitives, containers,
  functions (code and closure), partials and plain objects equal by content, the layer's own modules and tensors by
  their path in it, any other tensor or object identical; except a layer-index attribute (``layer_idx`` ...) that
  no method of the layer's classes mentions but for the KV cache;
- inputs with the same pytree structure, the same non-tensor values (objects by content) and tensors of the same
  dtype, device, (symbolic) shape, stride and ``requires_grad``, under the same grad, inference and autocast modes;
  no global module hook;
- its traced ops make no unbacked size (``.item()``, ``nonzero``) and its list sits in no other reused layer;
- nothing outside the first layer reads a tensor inside it, or its inputs as it saw them, but through its outputs
  (a hook recording attention weights, a layer handing its input to a collector would do so for one layer only).

Anything else is traced as usual.  ``DIPC_REUSE_BLOCKS=0`` turns the reuse off (every layer traced).  A helper's
hostile sweep (per-layer globals, class attributes, hooks with per-layer closures, partials, eval layers, tied lists,
collectors, ``requires_grad`` branches, layer-index reads through ``getattr``) shaped these rules; the purity of an
untrusted class's forward (globals, Python random, counters) cannot be seen from a trace and is the opt-in's
contract.

Pure tracing support for :mod:`dipc.capture`: no process group, no I/O.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import operator
import os
import re
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

__all__ = ["reusing_blocks", "splice", "NoReuse"]


class NoReuse(Exception):
    """The traced graph cannot be completed from the recorded layers; ``prefix`` names the list whose layers are at
    fault, where known (the caller exports again without reusing them)."""

    def __init__(self, message: str, prefix: str | None = None):
        super().__init__(message)
        self.prefix = prefix


def _marker(name: str):
    """A custom op ``dipc::<name>(x, template, index) -> copy of x`` marking input or output ``index`` of the first
    (template) call of a repeated layer in the trace; removed after the export.  Gradients pass through, so its
    output requires grad as its input does (a layer may branch on it)."""
    def mark(x: torch.Tensor, template: int, index: int) -> torch.Tensor:
        return x.clone()

    op = torch.library.custom_op(f"dipc::{name}", mark, mutates_args=())
    op.register_fake(lambda x, template, index: x.new_empty_strided(x.size(), x.stride()))
    op.register_autograd(lambda ctx, grad: (grad, None, None))
    return op


_block_input, _block_output = _marker("block_input"), _marker("block_output")

_OUTPUTS: dict[int, list] = {}  # template key -> [(size, stride, dtype, device, requires_grad)] per output


@torch.library.custom_op("dipc::reused_block", mutates_args=())
def _reused_block(inputs: list[torch.Tensor], template: int, call: int) -> list[torch.Tensor]:
    """A later call of a repeated layer during the trace: its outputs have the template call's metadata."""
    raise RuntimeError("dipc::reused_block exists only inside a capture and is replaced by the layer's ops")


@_reused_block.register_fake
def _(inputs, template, call):
    return [torch.empty_strided(size, stride, dtype=dtype, device=device)
            for size, stride, dtype, device, _ in _OUTPUTS[template]]


_INDEX_NAMES = ("layer_idx", "layer_id", "layer_index", "layer_number", "layer_num", "block_idx")
_MODULE_KEYS = frozenset(vars(torch.nn.Module()))
_counter = itertools.count()


@functools.lru_cache(maxsize=None)
def _index_only_for_cache(classes: tuple, name: str) -> bool:
    """True when no method (but ``__init__``) of any of ``classes`` (every class of a layer's module tree) mentions
    ``name`` in its code (comments left out) except on a line about the KV cache: the layer index then changes
    nothing in a training trace.  Code outside these classes (a module-level helper given ``self``) is not read:
    that is why only trusted layer classes are reused by default (:func:`trusted`)."""
    pattern = re.compile(rf"\b{name}\b")
    for cls in classes:
        for klass in cls.__mro__:
            if klass in (torch.nn.Module, object):
                continue
            for attr, fn in vars(klass).items():
                if attr == "__init__" or not callable(fn):
                    continue
                try:
                    src = inspect.getsource(fn)
                except (OSError, TypeError):
                    continue
                for line in src.splitlines():
                    code = line.split("#", 1)[0]
                    if pattern.search(code) and not re.search(r"cache|past_key_value", code, re.IGNORECASE):
                        return False
    return True


#: packages whose layer classes are reused by default: their forwards are pure functions of the layer's attributes,
#: parameters and inputs (the contract activation checkpointing relies on, which re-runs a layer's forward)
TRUSTED_PACKAGES = ("torch.nn.", "transformers.", "diffusers.", "timm.", "dipc.models.", "open_clip.")


def trusted(layer: torch.nn.Module) -> bool:
    """True when every module class in ``layer`` comes from :data:`TRUSTED_PACKAGES`.  A layer of another class is
    reused only with ``DIPC_REUSE_BLOCKS=all``: its author asserts that its forward reads no global or class state
    and has no side effect (nothing a copy of another layer's trace could not reproduce)."""
    return all(type(m).__module__.startswith(TRUSTED_PACKAGES) for m in layer.modules())


_PRIMITIVES = (bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def _describe(value: Any, modules: dict[int, str], depth: int = 0):
    """A comparable description of an attribute value: primitives by value; containers, functions, bound methods
    and plain objects by their contents (to a depth of 3); a module or tensor of the layer by its path in it; any
    other module by its class, attributes and tensors' identity; any other tensor or object by identity."""
    if value is None or isinstance(value, _PRIMITIVES):
        return ("value", type(value).__name__, value)
    if id(value) in modules:
        return ("own", modules[id(value)])
    if depth >= 3 or isinstance(value, torch.Tensor):
        return ("object", id(value))
    d = depth + 1
    if isinstance(value, torch.nn.Module):  # not the layer's own (a kernel wrapper kept in a dict): by content
        return ("module", type(value), tuple(id(t) for t in itertools.chain(value.parameters(), value.buffers())),
                tuple((k, _describe(v, modules, d)) for k, v in vars(value).items() if k not in _MODULE_KEYS))
    if isinstance(value, (tuple, list, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return ("seq", type(value).__name__, tuple(_describe(v, modules, d) for v in items))
    if isinstance(value, dict):
        return ("dict", tuple((repr(k), _describe(v, modules, d)) for k, v in value.items()))
    if isinstance(value, functools.partial):
        return ("partial", _describe(value.func, modules, d), _describe(value.args, modules, d),
                _describe(value.keywords, modules, d))
    if getattr(value, "_dipc_forward", None) is not None:  # our tracing wrapper: the forward it wraps
        return _describe(value._dipc_forward, modules, depth)
    if inspect.ismethod(value):
        return ("method", _describe(value.__func__, modules, d), _describe(value.__self__, modules, d))
    if inspect.isfunction(value):
        cells = tuple(_describe(c.cell_contents, modules, d) for c in value.__closure__ or ())
        return ("function", value.__code__, cells, _describe(value.__defaults__, modules, d))
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return ("instance", type(value), _describe(vars(value), modules, d))
    return ("object", id(value))


def fingerprint(layer: torch.nn.Module) -> tuple:
    """What must be equal for two layers to share one trace (see the module docstring)."""
    out = []
    own = {id(m): f"module:{p}" for p, m in layer.named_modules(remove_duplicate=False)}
    own.update({id(t): f"tensor:{p}" for p, t in itertools.chain(layer.named_parameters(remove_duplicate=False),
                                                                 layer.named_buffers(remove_duplicate=False))})
    classes = tuple(sorted({type(m) for m in layer.modules()}, key=lambda c: f"{c.__module__}.{c.__qualname__}"))
    for path, sub in layer.named_modules(remove_duplicate=False):
        attrs = []
        for k, v in sorted(vars(sub).items()):
            if k in _MODULE_KEYS:
                continue
            if k in _INDEX_NAMES and isinstance(v, int) and _index_only_for_cache(classes, k):
                continue
            attrs.append((k, _describe(v, own)))
        params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in sub.named_parameters(recurse=False))
        buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in sub.named_buffers(recurse=False))
        hooks = tuple(_describe(h, own) for d in (sub._forward_pre_hooks, sub._forward_hooks) for h in d.values())
        out.append((path, type(sub), sub.training, tuple(attrs), params, buffers, hooks))
    return tuple(out)


@dataclasses.dataclass(eq=False)
class _Group:
    """Layers of one list that share a fingerprint; the first one called is traced (the template)."""
    prefix: str
    template: str | None = None  # child name of the template layer
    key: int = -1
    in_spec: Any = None
    in_leaves: list = dataclasses.field(default_factory=list)  # non-tensor leaves (tensors: their metadata)
    out_spec: Any = None
    out_leaves: list = dataclasses.field(default_factory=list)
    modes: tuple = ()  # grad / inference / autocast modes of the template call
    fingerprint: tuple = ()  # the template layer's, at its call


@dataclasses.dataclass
class Reuse:
    """What :func:`reusing_blocks` recorded: reusable template key -> (list path, child name); reused call ->
    (template key, list path, child name)."""
    templates: dict = dataclasses.field(default_factory=dict)
    calls: dict = dataclasses.field(default_factory=dict)
    lists: dict = dataclasses.field(default_factory=dict)  # every template key (reusable or not) -> list path


def _same_size(a, b) -> bool:
    """Sizes known equal without adding a guard (a symbol the trace has since fixed equals that number)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return bool(statically_known_true(a == b))
    return a == b


def _leaf(x: Any):
    """How a call's input leaf is compared: a tensor by its metadata, a primitive by value, any other object by its
    content now (an object the parent changes between layers differs)."""
    if isinstance(x, torch.Tensor):
        return _tensor_meta(x)
    if x is None or isinstance(x, (bool, int, float, str, torch.dtype, torch.device, torch.SymInt, torch.SymFloat,
                                   torch.SymBool)):
        return x
    return ("content", _describe(x, {}))


def _tensor_meta(t: torch.Tensor):
    return ("tensor", t.dtype, t.device, tuple(t.size()), tuple(t.stride()), t.requires_grad)


def _same_leaf(a, b) -> bool:
    if isinstance(a, tuple) and a and a[0] == "tensor":
        return (isinstance(b, tuple) and b and b[0] == "tensor" and a[1] == b[1] and a[2] == b[2] and a[5] == b[5]
                and len(a[3]) == len(b[3]) and all(_same_size(x, y) for x, y in zip(a[3], b[3]))
                and all(_same_size(x, y) for x, y in zip(a[4], b[4])))
    if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)) or isinstance(
            b, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return False
    if type(a) is not type(b):
        return False
    if a is None or isinstance(a, (bool, int, float, str, torch.dtype, torch.device)):
        return a == b
    return a == b if isinstance(a, tuple) and a and a[0] == "content" else a is b


def _repeated_lists(model: torch.nn.Module, everything: bool = False) -> list[tuple[str, list]]:
    """``(path, [(child name, layer)])`` of every ``ModuleList`` / ``Sequential`` of two or more distinct layers
    whose parameters and buffers have one name each in the model (none tied to another module's), outermost
    first; a list inside another such list's layer is left out.  Layers of untrusted classes (:func:`trusted`) are
    left out unless ``everything``."""
    names: dict[int, int] = {}  # tensor -> how many names it has in the model (tied weights have several)
    for _, t in itertools.chain(model.named_parameters(remove_duplicate=False),
                                model.named_buffers(remove_duplicate=False)):
        names[id(t)] = names.get(id(t), 0) + 1
    found = []
    for path, mod in model.named_modules():
        if not isinstance(mod, (torch.nn.ModuleList, torch.nn.Sequential)) or len(mod) < 2:
            continue
        if any(path.startswith(p + ".") for p, _ in found):
            continue
        children = list(mod.named_children())
        if len({id(c) for _, c in children}) != len(children):
            continue
        owners: dict[int, str] = {}
        shared = False
        for name, c in children:
            for t in itertools.chain(c.parameters(), c.buffers()):
                if owners.setdefault(id(t), name) != name or names.get(id(t), 0) > 1:
                    shared = True  # torch.export names a tied tensor after one of its modules, maybe another
        children = [(n, c) for n, c in children if everything or trusted(c)]
        if not shared and len(children) >= 2:
            found.append((path, children))
    return found


@contextlib.contextmanager
def reusing_blocks(model: torch.nn.Module, exclude: frozenset = frozenset()):
    """While torch.export traces ``model``, trace each group of equal layers once (module docstring), but in the
    lists named in ``exclude``; yields the :class:`Reuse` record that :func:`splice` needs, or ``None`` when nothing
    repeats (or ``DIPC_REUSE_BLOCKS=0``)."""
    from torch.nn.modules import module as nn_module

    setting = os.environ.get("DIPC_REUSE_BLOCKS", "1")
    hooked = nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks  # they see every layer's call
    lists = [] if setting == "0" or hooked else [
        (path, children) for path, children in _repeated_lists(model, everything=setting == "all")
        if path not in exclude]
    record = Reuse()
    patched = []
    for path, children in lists:
        groups: list[tuple[tuple, _Group]] = []
        for name, layer in children:
            fp = fingerprint(layer)
            group = next((g for f, g in groups if f == fp), None)
            if group is None:
                group = _Group(prefix=path)
                groups.append((fp, group))
            patched.append((layer, name, group))
    counts: dict[int, int] = {}
    for fp_count in patched:
        counts[id(fp_count[2])] = counts.get(id(fp_count[2]), 0) + 1
    patched = [p for p in patched if counts[id(p[2])] >= 2]
    if not patched:
        yield None
        return
    own = {id(layer): layer.__dict__["forward"] for layer, _, _ in patched if "forward" in layer.__dict__}
    for layer, name, group in patched:
        layer.forward = _wrapped(layer, name, group, layer.forward, record)
    try:
        yield record
    finally:
        for layer, _, _ in patched:  # a forward set on the instance before (a user's wrapper) comes back
            if id(layer) in own:
                layer.forward = own[id(layer)]
            else:
                layer.__dict__.pop("forward", None)
        for key in record.templates:
            _OUTPUTS.pop(key, None)


def _wrapped(layer, name, group: _Group, forward, record: Reuse):
    called = [False]

    def run(*args, **kwargs):
        if called[0]:
            return forward(*args, **kwargs)
        called[0] = True
        leaves, spec = pytree.tree_flatten((args, kwargs))
        now = fingerprint(layer)  # at the call: the parent may have set an attribute since the capture began
        if group.template is None:
            group.fingerprint = now
            return _run_template(group, name, forward, leaves, spec, record)
        described = [_leaf(x) for x in leaves]
        alike = (now == group.fingerprint and _modes() == group.modes and spec == group.in_spec
                 and len(described) == len(group.in_leaves)
                 and all(_same_leaf(a, b) for a, b in zip(group.in_leaves, described)))
        if not alike:
            return forward(*args, **kwargs)
        call = next(_counter)
        record.calls[call] = (group.key, group.prefix, name)
        outs = torch.ops.dipc.reused_block([x for x in leaves if isinstance(x, torch.Tensor)], group.key, call)
        for o, meta in zip(outs, _OUTPUTS[group.key]):  # as the first layer's outputs (the parent may branch on it)
            o.requires_grad_(meta[4])
        outs = iter(outs)
        return pytree.tree_unflatten([next(outs) if isinstance(x, tuple) and x and x[0] == "tensor" else x
                                      for x in group.out_leaves], group.out_spec)

    run._dipc_forward = forward
    return run


def _modes() -> tuple:
    """The modes a layer's trace depends on beyond its inputs: grad (a layer under ``torch.no_grad()`` is traced
    inside a region of its own), inference mode, and autocast per device type."""
    autocast = tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda"))
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast)


def _run_template(group: _Group, name: str, forward, leaves, spec, record: Reuse):
    key = next(_counter)
    group.template, group.key, group.in_spec, group.modes = name, key, spec, _modes()
    record.lists[key] = group.prefix
    group.in_leaves = [_leaf(x) for x in leaves]
    if not any(isinstance(x, torch.Tensor) for x in leaves):  # nothing to feed a copy: trace every layer
        group.in_spec = object()
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        return forward(*args, **kwargs)
    marked, j = [], 0
    for x in leaves:
        if isinstance(x, torch.Tensor):
            x = torch.ops.dipc.block_input(x, key, j)
            j += 1
        marked.append(x)
    args, kwargs = pytree.tree_unflatten(marked, spec)
    out = forward(*args, **kwargs)
    out_leaves, out_spec = pytree.tree_flatten(out)
    metas, result, j = [], [], 0
    for x in out_leaves:
        if isinstance(x, torch.Tensor):
            metas.append((tuple(x.size()), tuple(x.stride()), x.dtype, x.device, x.requires_grad))
            x = torch.ops.dipc.block_output(x, key, j)
            j += 1
        result.append(x)
    simple = all(x is None or isinstance(x, (bool, int, float, str, torch.Tensor)) for x in out_leaves)
    if metas and simple:  # later layers may reuse it
        _OUTPUTS[key] = metas
        group.out_spec = out_spec
        group.out_leaves = [_tensor_meta(x) if isinstance(x, torch.Tensor) else x for x in out_leaves]
        record.templates[key] = (group.prefix, name)
    else:  # no tensor output, or one we cannot rebuild: no reuse for this group
        group.in_spec = object()
    return pytree.tree_unflatten(result, out_spec)


def _swap_prefix(text: str, old: str, new: str) -> str:
    for lead in ("L__self__", ""):
        if text.startswith(lead + old + ".") or text == lead + old or text.startswith(lead + old + "@"):
            return lead + new + text[len(lead + old):]
    return text


def splice(ep, record: Reuse) -> int:
    """Replace every ``dipc::reused_block`` call in the exported program ``ep`` by a copy of its template layer's
    ops (that layer's parameters and buffers swapped for the reused layer's, the template's inputs for the call's),
    then drop the template's markers.  Output specs naming a replaced value are renamed.

    Returns:
        the number of layers whose ops were copied (not traced).

    Raises:
        NoReuse: a template made unbacked sizes, or a reused layer's parameter is not an input of the program.
    """
    from torch.export.graph_signature import InputKind, TensorArgument

    graph = ep.graph
    by_target = {s.target: s.arg.name for s in ep.graph_signature.input_specs
                 if s.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)}
    by_name = {name: target for target, name in by_target.items()}
    nodes = {n.name: n for n in graph.nodes}
    order = {n: i for i, n in enumerate(graph.nodes)}
    marks_in: dict[int, dict[int, torch.fx.Node]] = {}
    marks_out: dict[int, dict[int, torch.fx.Node]] = {}
    calls = []
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is torch.ops.dipc.block_input.default:
            marks_in.setdefault(n.args[1], {})[n.args[2]] = n
        elif n.target is torch.ops.dipc.block_output.default:
            marks_out.setdefault(n.args[1], {})[n.args[2]] = n
        elif n.target is torch.ops.dipc.reused_block.default:
            calls.append(n)
    regions: dict[int, list[torch.fx.Node]] = {}
    for key, ins in marks_in.items():
        start = max((order[m] for m in ins.values()), default=-1)
        outs = marks_out.get(key, {})
        end = min((order[m] for m in outs.values()), default=len(order))
        region = [n for n in graph.nodes if start < order[n] < end and n.op in ("call_function", "get_attr")]
        inside, ends = set(region), set(outs.values())
        for m in ins.values():  # the layer handed its input on (a collector): the copies would not
            if any(u not in inside and u not in ends for u in m.users):
                raise NoReuse(f"{m.name}, an input of a repeated layer, is read outside it", record.lists.get(key))
        for n in region:  # a size (SymInt) may be read anywhere; a tensor only through the layer's outputs
            if isinstance(n.meta.get("val"), torch.Tensor) and any(u not in inside and u not in ends
                                                                   for u in n.users):
                raise NoReuse(f"{n.name}, inside a repeated layer, is read outside it", record.lists.get(key))
        regions[key] = region
    renamed: dict[str, str] = {}
    for call in calls:
        key, call_id = call.args[1], call.args[2]
        if key not in regions or call_id not in record.calls:
            raise NoReuse(f"no template recorded for reused call {call.name}")
        region = regions[key]
        prefix, t_name = record.templates[key]
        if any("unbacked_bindings" in n.meta for n in region):
            raise NoReuse("the repeated layer's trace makes unbacked sizes", prefix)
        _, _, i_name = record.calls[call_id]
        old, new = f"{prefix}.{t_name}", f"{prefix}.{i_name}"
        inside = set(region)
        env: dict[torch.fx.Node, Any] = {m: call.args[0][j] for j, m in marks_in[key].items()}

        def outer(x: torch.fx.Node):
            if x in env:
                return env[x]
            if x.op == "placeholder":
                target = by_name.get(x.name)
                if target is not None and target.startswith(old + "."):
                    mapped = by_target.get(new + target[len(old):])
                    if mapped is None:
                        raise NoReuse(f"{new + target[len(old):]} is not an input of the exported program", prefix)
                    return nodes[mapped]
            if x in inside:
                raise NoReuse(f"{x.name} used before it is copied", prefix)
            return x

        stack = call.meta.get("nn_module_stack") or {}
        with graph.inserting_before(call):
            for n in region:
                copy = graph.node_copy(n, outer)
                copy.meta = dict(n.meta)
                deeper, seen = {}, False
                for k, v in (n.meta.get("nn_module_stack") or {}).items():
                    path = v[0] if isinstance(v, tuple) else str(v)
                    if seen:
                        deeper[_swap_prefix(k, old, new)] = (_swap_prefix(path, old, new),) + tuple(v[1:])
                    elif path.split("@")[0] == old:
                        seen = True
                copy.meta["nn_module_stack"] = {**stack, **deeper}
                env[n] = copy
        for user in list(call.users):
            if not (user.op == "call_function" and user.target is operator.getitem):
                raise NoReuse(f"reused call {call.name} is read whole by {user.name}", prefix)
            value = outer(marks_out[key][user.args[1]].args[0])
            user.replace_all_uses_with(value)
            renamed[user.name] = value.name
            graph.erase_node(user)
        graph.erase_node(call)
    for marks in itertools.chain(marks_in.values(), marks_out.values()):
        for m in marks.values():
            m.replace_all_uses_with(m.args[0])
            renamed[m.name] = m.args[0].name
            graph.erase_node(m)
    ours = (torch.ops.dipc.reused_block.default, torch.ops.dipc.block_input.default,
            torch.ops.dipc.block_output.default)
    for gm in ep.graph_module.modules():  # a call inside a region of its own (a submodule graph) was not replaced
        left = [n for n in gm.graph.nodes if n.target in ours] if isinstance(gm, torch.fx.GraphModule) else []
        if left:
            raise NoReuse("a repeated layer was called inside a region traced as a submodule",
                          record.lists.get(left[0].args[1]))
    for spec in ep.graph_signature.output_specs:
        name = getattr(spec.arg, "name", None)
        while name in renamed:
            name = renamed[name]
        if name is not None and name != spec.arg.name:
            spec.arg = TensorArgument(name=name)
    ep.graph_module.recompile()
    return len(calls)
