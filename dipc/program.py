"""Programs: one capture of the model and its chunk modules, and what the compiler reads off a capture.

A :class:`Program` is what the runtime runs a (sub-)microbatch with; the compiler keeps one per distinct set of
keys, static dims and static values of the batch (``dipc.compiler.CompiledPipeline.program_for``).  The helpers
here read a capture: the value ranges its integer inputs need, the input-size symbols and the dims the trace ties,
which parameters the loss reaches through gradient-carrying values, and whether the chunks form a DAG.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

import sympy
import torch
import torch.fx

from .capture import Capture
from .codegen.stage import ChunkModule
from .passes.datasizes import SizeProgram
from .passes.partition import Partition, PartitionError

__all__ = ["Program", "index_ranges"]


@dataclasses.dataclass
class Program:
    """One capture of the model and its chunk modules.

    Attributes:
        capture: the torch.export capture.
        chunks: chunk index -> :class:`dipc.codegen.stage.ChunkModule` (chunks with no node here are absent).
        bindings: (symbol, batch key, dim) triples: how to read each input-size symbol off a batch.
        boundary: modality -> names of the values its chunks hand to other modalities' chunks, in graph order.
        boundary_keys: each boundary value -> the batch keys it is computed from (which instance kind made it).
        loss_params: fully qualified names of the parameters the loss depends on (autograd gives them a gradient,
            zero or not, in the unsplit model).
    """

    capture: Capture
    chunks: dict[int, ChunkModule]
    bindings: list[tuple[sympy.Symbol, str, int]]
    boundary: dict[str, list[str]]
    loss_params: set[str] = dataclasses.field(default_factory=set)
    boundary_keys: dict[str, frozenset] = dataclasses.field(default_factory=dict)
    chunk_costs: dict = dataclasses.field(default_factory=dict)
    sizes: SizeProgram | None = None
    _last_sizes: tuple | None = dataclasses.field(default=None, repr=False, compare=False)
    #: chunk -> CompiledCost with ``f<j>`` / ``a<j>`` per block j of the chunk, made on first use by this function
    block_costs_of: object = dataclasses.field(default=None, repr=False, compare=False)
    _block_costs: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    #: chunk -> its GraphModule built now (a chunk whose module this process did not build: see
    #: :meth:`dipc.compiler.CompiledPipeline.build_only`), or None
    builder: object = dataclasses.field(default=None, repr=False, compare=False)

    def module(self, chunk: int) -> torch.fx.GraphModule:
        """The GraphModule of ``chunk``, built on first use when this process did not build it.

        Raises:
            KeyError: ``chunk`` has no node in this capture.
        """
        cm = self.chunks[chunk]
        if cm.gm is None and self.builder is not None:
            cm.gm = self.builder(chunk)
        return cm.gm

    def block_costs(self, chunk: int, bindings: Mapping) -> list[tuple[float, float, float]] | None:
        """Per layer of ``chunk`` (graph order; :func:`dipc.codegen.stage.chunk_layers`), ``(forward seconds on
        the device profile, bytes its nodes save for the backward, bytes of the values it reads from outside
        itself)`` at concrete sizes (per GPU under tensor parallelism), or ``None`` without a device profile: the
        units of per-layer recompute (DIP §2.5's per-layer memory strategies; the third is what the layer's
        activation checkpoint holds).  The costs are
        compiled for a chunk on first use and memoised per shape."""
        if self.block_costs_of is None or chunk not in self.chunk_costs:
            return None
        cc = self._block_costs.get(chunk)
        if cc is None:
            cc = self._block_costs[chunk] = self.block_costs_of(self, chunk)
        v = cc(bindings)
        n = len(v) // 3
        return [(v[f"f{j}"], v[f"a{j}"], v[f"i{j}"]) for j in range(n)]

    def stage_cost(self, chunk: int, bindings: Mapping) -> dict[str, float] | None:
        """Compiled cost of ``chunk`` at concrete sizes (``latency_f``/``latency_b`` in seconds on the device
        profile, ``activation_bytes``, FLOPs, bytes), or ``None`` without a device profile.  Memoised per shape
        (DIP's subgraph reuse)."""
        cc = self.chunk_costs.get(chunk)
        return None if cc is None else cc(bindings)

    def bind(self, data: Mapping[str, torch.Tensor]) -> dict[sympy.Symbol, int]:
        """Values of the input-size symbols for ``data`` (a microbatch or a sub-microbatch view), and of the sizes
        that depend on its values (:mod:`dipc.passes.datasizes`, e.g. Idefics3's count of real images)."""
        out = {}
        for sym, key, dim in self.bindings:
            if key in data:
                out[sym] = int(data[key].shape[dim])
        if self.sizes is not None:
            last = self._last_sizes
            if last is not None and last[0] is data:  # every chunk of a microbatch binds the same data
                out.update(last[1])
            else:
                values = self.sizes(data)
                self._last_sizes = (data, values)
                out.update(values)
        return out

    def fits(self, data: Mapping[str, torch.Tensor], traced: Mapping | None = None,
             empty_keys: frozenset = frozenset()) -> bool:
        """True when this program's graph is valid for ``data``: same keys, static dims and static values as its
        capture (:meth:`dipc.capture.Capture.fits`, on ``traced``: ``data`` as the trace saw it), and the trace's
        assertions on data-dependent sizes hold.  ``empty_keys``: instance keys whose graph runs at 0 instances
        (``Instances.drop_with_modality``, set for dipc's own recipes): their dim 0 fits below whatever lower bound
        the trace derived for it (torch.export's 0/1 convention carried through a reshape: 8 rows for
        ``rows // 4 >= 2``; one 8x8 Qwen2.5-VL image has 4)."""
        if not self.capture.fits(data if traced is None else traced):
            return False
        bind = self.bind(data)
        for sym, (lo, hi) in self.capture.ranges.items():  # the trace's range constraints (a branch on a size)
            v = bind.get(sym)
            # a lower bound of 2 is torch.export's 0/1 convention for every dynamic dim, not the model's: sizes 0
            # and 1 (an image-free or one-image sub-microbatch) run the same graph, as they always did here
            if v is not None and lo is not None and v < lo and empty_keys and self._binds_only(sym, empty_keys):
                continue  # a recipe's size-generic keys: the bound is the 0/1 convention carried through a reshape
            if v is not None and ((lo is not None and lo > 2 and v < lo) or (hi is not None and v > hi)):
                return False
        return self.sizes is None or not self.sizes.guards or self.sizes.holds(bind)

    def _binds_only(self, sym, keys: frozenset) -> bool:
        """Whether ``sym`` is bound from dim 0 of ``keys`` only (and from some)."""
        found = [(k, d) for s, k, d in self.bindings if s == sym]
        return bool(found) and all(k in keys and d == 0 for k, d in found)


_TRANSPARENT = {"view", "reshape", "_unsafe_view", "slice", "contiguous", "clone", "to", "_to_copy", "alias",
                "unsqueeze", "squeeze", "flatten", "expand", "permute", "transpose", "select", "roll",
                "constant_pad_nd", "pad", "lift_fresh_copy", "detach"}


def _source_key(node, cap: Capture) -> str | None:
    """The batch key whose values reach ``node`` unchanged (through views, slices, casts, pads), if any."""
    for _ in range(32):
        if not isinstance(node, torch.fx.Node):
            return None
        if node.op == "placeholder":
            return cap.input_keys.get(node.name)
        name = getattr(getattr(node.target, "overloadpacket", None), "__name__", "")
        if name not in _TRANSPARENT or not node.args:
            return None
        node = node.args[0]
    return None


def _static(x):
    if isinstance(x, torch.SymInt) and x.node.expr.is_number:
        return int(x.node.expr)
    return x


def index_ranges(cap: Capture) -> list[tuple[str, int, int, int | None, str]]:
    """Value ranges the model needs of integer batch keys: embedding indices < vocabulary size, cross-entropy
    targets < number of classes (or the ignore index).  Checked on every rank before any communication."""
    out = []
    for n in cap.graph.nodes:
        name = getattr(getattr(n.target, "overloadpacket", None), "__name__", "") if n.op == "call_function" else ""
        try:
            if name == "embedding":
                key = _source_key(n.args[1], cap)
                vocab = _static(n.args[0].meta["val"].shape[0])
                if key and isinstance(vocab, int):
                    out.append((key, 0, vocab, None, f"embedding {n.name} (vocabulary {vocab})"))
            elif name in ("cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss_forward"):
                key = _source_key(n.args[1], cap)
                logits = n.args[0].meta["val"]
                classes = _static(logits.shape[1] if logits.dim() > 1 else logits.shape[0])
                ignore = n.args[4] if len(n.args) > 4 else n.kwargs.get("ignore_index", -100)
                if key and isinstance(classes, int) and isinstance(ignore, int):
                    out.append((key, 0, classes, ignore, f"the loss {n.name} ({classes} classes)"))
        except (AttributeError, IndexError, KeyError, TypeError):
            continue
    return out


def _bindings(cap: Capture) -> list[tuple[sympy.Symbol, str, int]]:
    """(symbol, batch key, dim) for every input size that is a bare symbol in the capture."""
    out = []
    ph = {n.name: n for n in cap.graph.nodes if n.op == "placeholder"}
    for name, key in cap.input_keys.items():
        v = ph[name].meta.get("val")
        for d, s in enumerate(getattr(v, "shape", ())):
            if isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Symbol):
                out.append((s.node.expr, key, d))
    return out


def _data_dependent(e: BaseException) -> bool:
    """True when a capture failed on a size or branch that depends on the batch's values."""
    text = f"{e} {e.__cause__}"
    return any(w in text for w in ("data-dependent", "DataDependent", "GuardOnDataDependent", "control flow",
                                   "unbacked"))


def _tied_dims(cap: Capture) -> list[list[tuple[str, int]]]:
    """Groups of ``(batch key, dim)`` that are one symbol in the capture (e.g. the sequence length of
    ``input_ids`` and ``labels``)."""
    groups: dict = {}
    for sym, key, dim in _bindings(cap):
        groups.setdefault(sym, []).append((key, dim))
    return [g for g in groups.values() if len(g) > 1]


def _carries_grad(node) -> bool:
    """Whether a gradient can flow back through ``node`` to its inputs: not through ``.detach()``, a
    ``torch.no_grad()`` region (``wrap_with_set_grad_enabled(False, ...)``) or an integer/bool value.  Read from
    the graph's structure: functionalized captures record no ``requires_grad`` in their values."""
    import operator

    target = node.target
    if node.op != "call_function":
        return True
    if target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        return _carries_grad(node.args[0])
    name = getattr(getattr(target, "overloadpacket", None), "__name__", "") or getattr(target, "__name__", "")
    if name in ("detach", "_detach") or (name == "wrap_with_set_grad_enabled" and node.args and
                                         node.args[0] is False):
        return False
    v = node.meta.get("val")
    vals = v if isinstance(v, (list, tuple)) else [v]
    tensors = [x for x in vals if isinstance(x, torch.Tensor)]
    return not tensors or any(x.dtype.is_floating_point or x.dtype.is_complex for x in tensors)


def _check_acyclic(prog: Program, part: Partition) -> None:
    """The chunks of all modalities must form a DAG (a ``modalities=`` override can make two modules feed each
    other); the error names the values on a cycle."""
    import networkx as nx

    g = nx.DiGraph()
    for c, cm in prog.chunks.items():
        g.add_node(c)
        for i in cm.inputs:
            if i.kind == "value" and i.src_chunk != c:
                g.add_edge(i.src_chunk, c)
                g.edges[i.src_chunk, c].setdefault("values", []).append(i.name)
    try:
        cycle = nx.find_cycle(g)
    except nx.NetworkXNoCycle:
        return
    mod = {c.index: c.modality for c in part.chunks}
    hops = [f"chunk {a} ({mod[a]}) -> chunk {b} ({mod[b]}) via {g.edges[a, b]['values'][:3]}" for a, b, *_ in cycle]
    raise PartitionError("the chunks form a cycle, so no pipeline order exists: " + "; ".join(hops) + ". Check the "
                         "modalities= rules: a module's glue (masks, merges) may have been given to another module")
