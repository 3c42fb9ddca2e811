"""Partition pass: cut each modality module into P*K_i balanced chunks and place them VPP-style.

Follows DIP's modality-aware partitioning (shared/PAPER.md §2.1):

* each modality module i is cut on its own into ``P * K_i`` contiguous chunks (graph order);
* cuts fall at module boundaries (:mod:`dipc.passes.blocks`): the blocks are module calls on a frontier of the
  modality's call tree.  The frontier starts at the top-level calls and is refined where needed: (1) every call
  costing more than ``1 / (2P)`` of the module is replaced by its children (so each rank's share spans at least two
  blocks; a Llama's decoder layers, Flux's double and single blocks, a ``Sequential``'s entries, an embedding and a
  head become blocks); (2) while fewer blocks than chunks exist, the costliest call is expanded; (3) while the best
  cut is more than 10% above its lower bound (the module's cost / chunks, or its largest indivisible block), the
  costliest call is expanded, e.g. a 100x heavier vision block is cut inside;
* blocks are grouped into chunks minimising the largest chunk cost (linear partition by dynamic programming); among
  cuts whose largest chunk is within 5% of that optimum, the one sending the fewest bytes across its cuts (values
  live at the cut, at the example's sizes) wins;
* the cost is the device profile's forward + backward seconds when the compiler has one (``node_seconds``), else
  the first, nominal estimate;
* ``split_points`` (torch.distributed.pipelining style, "cut before this module") replace the search for a module;
* chunk ``k * P + r`` of module i lives on rank ``r`` (Megatron VPP placement); ``P`` consecutive chunks of one
  module form a pipeline segment;
* ``K_i = floor(T_i / T_1)`` with ``T_i`` module i's estimated latency at its sub-microbatch size and ``T_1`` the
  fastest module's, capped at ``floor(L_i / P)`` with ``L_i`` the module's layer count (the longest run of sibling
  calls of one module class) and overridable.

Pure: takes an annotated graph (``dipc_modality``, ``dipc_cost``) and returns a :class:`Partition`; sets
``node.meta["dipc_block"]`` and ``node.meta["dipc_chunk"]``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import torch.fx

from .blocks import Call, assign, call_tree, crossing_bytes, expand, walk
from .cost import ZERO, NodeCost, node_latency
from .modality import module_path

__all__ = ["ChunkInfo", "Partition", "balanced_cuts", "layer_of", "min_crossing_cuts", "partition", "apply_partition",
           "PartitionError", "chunks_per_rank_rule"]

BALANCE_TOLERANCE = 0.10   #: refine blocks while the best cut exceeds its lower bound by more than this
CROSSING_SLACK = 0.05      #: a cut may cost this much more than the optimum to send fewer bytes


class PartitionError(ValueError):
    """The model cannot be cut as asked (e.g. more chunks than a module has candidate blocks)."""


@dataclasses.dataclass(frozen=True)
class ChunkInfo:
    """One chunk: a contiguous range of one module's blocks on one rank.

    Attributes:
        index: global chunk id (chunks of the first module first, then the next module's, ...).
        modality: the module's modality name.
        position: position of the chunk within its module, ``0 .. P*K_i - 1``.
        segment: ``position // P``: the pipeline segment the chunk belongs to.
        rank: pipeline rank holding it, ``position % P``.
        blocks: ``(first, last + 1)`` block indices.
        cost: estimated forward cost at the example batch.
    """

    index: int
    modality: str
    position: int
    segment: int
    rank: int
    blocks: tuple[int, int]
    cost: NodeCost


@dataclasses.dataclass
class Partition:
    """Static partition of the model, shared by every capture of it.

    Attributes:
        pp_size: P.
        modalities: modality names in graph order.
        block_keys: modality -> torch.export call ids of its blocks (how another capture finds them).
        block_names: modality -> module path of each block (``language_model.layers.3``; ``shared@2`` for the
            third call of a shared module).
        n_blocks: modality -> number of blocks L_i.
        chunks_per_rank: modality -> K_i.
        chunks: all chunks, by global index.
        block_to_chunk: (modality, block) -> global chunk index.
        module_cost: modality -> estimated forward cost of the whole module at the example batch.
        crossing: modality -> bytes live at a cut before each block (example sizes).
        notes: modality -> how its blocks were found (for ``describe()``).
    """

    pp_size: int
    modalities: list[str]
    block_keys: dict[str, list[str]]
    block_names: dict[str, list[str]]
    n_blocks: dict[str, int]
    chunks_per_rank: dict[str, int]
    chunks: list[ChunkInfo]
    block_to_chunk: dict[tuple[str, int], int]
    module_cost: dict[str, NodeCost]
    crossing: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    notes: dict[str, str] = dataclasses.field(default_factory=dict)

    def chunks_of(self, modality: str) -> list[ChunkInfo]:
        return [c for c in self.chunks if c.modality == modality]

    def chunk_blocks(self, chunk: int) -> list[str]:
        """Module paths of the blocks of ``chunk``."""
        c = self.chunks[chunk]
        return self.block_names[c.modality][c.blocks[0]:c.blocks[1]]


def layer_of(block_name: str) -> str:
    """The layer a block belongs to, the unit of per-layer activation recompute (Megatron's "layer" of
    ``--recompute-num-layers``): the module path up to the first numbered ``ModuleList`` index
    (``language_model.layers.3.self_attn.q_proj`` -> ``language_model.layers.3``), or the block's own path when it
    is in no numbered list (``multi_modal_projector``).  Nodes carry their :func:`node_layer` as
    ``node.meta["dipc_layer"]``."""
    parts = block_name.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[:i + 1])
    return block_name


def _weight_ok(weights: Sequence[float] | None, weight_cap: float | None):
    """``ok(j, i)``: blocks ``j .. i-1`` weigh at most ``weight_cap`` (always true without a cap)."""
    if weights is None or weight_cap is None:
        return lambda j, i: True
    wp = [0.0]
    for w in weights:
        wp.append(wp[-1] + w)
    cap = weight_cap + 1e-12 * (abs(weight_cap) + wp[-1])  # prefix sums round: allow 1e-12 of cap + total
    return lambda j, i: wp[i] - wp[j] <= cap


def node_layer(node: torch.fx.Node, block_name: str) -> str:
    """The layer (:func:`layer_of`) of a node: of its innermost module call, whatever block the partition put it
    in (a block may be a whole encoder whose layers are its sub-calls), else of its block."""
    paths = module_path(node)
    return layer_of(paths[-1] if paths else block_name)


def balanced_cuts(costs: list[float], n_parts: int, weights: Sequence[float] | None = None,
                  weight_cap: float | None = None) -> list[tuple[int, int]]:
    """Split ``costs`` (one per block) into ``n_parts`` contiguous non-empty ranges minimising the largest sum;
    with ``weights`` (one per block, e.g. parameter bytes) and ``weight_cap``, each range weighs at most the cap
    (up to rounding: 1e-12 of the cap plus the total weight).

    Returns ``[(lo, hi), ...]`` half-open block ranges covering every block exactly once.

    Raises:
        PartitionError: ``n_parts`` exceeds the number of blocks or is < 1; no cut keeps every range under
            ``weight_cap``.
    """
    L = len(costs)
    if n_parts < 1 or n_parts > L:
        raise PartitionError(f"cannot cut {L} blocks into {n_parts} chunks")
    ok = _weight_ok(weights, weight_cap)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    INF = float("inf")
    # best[k][i]: minimal max-sum cutting the first i blocks into k parts
    best = [[INF] * (L + 1) for _ in range(n_parts + 1)]
    arg = [[0] * (L + 1) for _ in range(n_parts + 1)]
    best[0][0] = 0.0
    for k in range(1, n_parts + 1):
        for i in range(k, L - (n_parts - k) + 1):
            for j in range(k - 1, i):
                if not ok(j, i):
                    continue
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i] - 1e-12 * max(1.0, abs(v)):
                    best[k][i] = v
                    arg[k][i] = j
    if best[n_parts][L] == INF:
        raise PartitionError(f"no cut of {L} blocks into {n_parts} chunks keeps every chunk under {weight_cap:.4g} "
                             f"(largest block {max(weights):.4g}, total {sum(weights):.4g})")
    return _unwind(arg, L, n_parts)


def _unwind(arg, L: int, n_parts: int) -> list[tuple[int, int]]:
    cuts, i = [], L
    for k in range(n_parts, 0, -1):
        j = arg[k][i]
        cuts.append((j, i))
        i = j
    return cuts[::-1]


def min_crossing_cuts(costs: Sequence[float], crossing: Sequence[float], n_parts: int,
                      cap: float, weights: Sequence[float] | None = None,
                      weight_cap: float | None = None) -> list[tuple[int, int]] | None:
    """Contiguous ranges of ``costs`` into ``n_parts`` parts, each summing to at most ``cap`` (and weighing at most
    ``weight_cap`` when given), minimising the sum of ``crossing[lo]`` over the parts' starts (the bytes sent across
    the cuts); ``None`` if no such cut exists."""
    ok = _weight_ok(weights, weight_cap)
    L = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    INF = float("inf")
    cap = cap * (1 + 1e-12) + 1e-300
    best = [[INF] * (L + 1) for _ in range(n_parts + 1)]
    arg = [[0] * (L + 1) for _ in range(n_parts + 1)]
    best[0][0] = 0.0
    for k in range(1, n_parts + 1):
        for i in range(k, L - (n_parts - k) + 1):
            for j in range(i - 1, k - 2, -1):
                if prefix[i] - prefix[j] > cap:
                    break
                if not ok(j, i):
                    continue
                v = best[k - 1][j] + (crossing[j] if j > 0 else 0.0)
                if v < best[k][i]:
                    best[k][i] = v
                    arg[k][i] = j
    if best[n_parts][L] == INF:
        return None
    return _unwind(arg, L, n_parts)


def chunks_per_rank_rule(module_latency: Mapping[str, float]) -> dict[str, int]:
    """DIP's K_i = floor(T_i / T_1), T_1 the fastest module's latency (shared/PAPER.md §2.1 step 2)."""
    positive = [t for t in module_latency.values() if t > 0]
    t1 = min(positive) if positive else 1.0
    return {m: max(1, int(math.floor(t / t1))) if t > 0 else 1 for m, t in module_latency.items()}


class _Module:
    """One modality's nodes, call tree, frontier and block costs during partitioning."""

    def __init__(self, name: str, nodes: list[torch.fx.Node], cost_of):
        self.name = name
        self.nodes = nodes
        self.cost_of = cost_of
        self.top = call_tree(nodes)
        self.frontier: list[Call] = list(self.top)
        self.total = sum(cost_of(n) for n in nodes)
        self._cost: dict[int, float] = {}

    def call_cost(self, c: Call) -> float:
        v = self._cost.get(id(c))
        if v is None:
            v = self._cost[id(c)] = sum(self.cost_of(n) for n in c.nodes)
        return v

    def expandable(self) -> list[Call]:
        return [c for c in self.frontier if c.children]

    def expand_largest(self, above: float = 0.0) -> bool:
        """Replace the costliest expandable call costing more than ``above`` by its children; False if none."""
        cand = [c for c in self.expandable() if self.call_cost(c) > above]
        if not cand:
            return False
        self.frontier = expand(self.frontier, max(cand, key=self.call_cost))
        return True

    def blocks(self) -> tuple[list[int], list[float]]:
        """Block of every node, and the cost of every block (glue included)."""
        keys = [c.key for c in self.frontier]
        of = assign(self.nodes, keys)
        costs = [0.0] * max(len(keys), 1)
        for n, b in zip(self.nodes, of):
            costs[b] += self.cost_of(n)
        return of, costs

    def n_layers(self) -> int:
        """L_i for the K_i cap: the most sibling calls of one module class (a decoder's layers, a ``Sequential``'s
        blocks; calls with sub-modules first), or the natural blocks when nothing repeats."""
        for leaves in (False, True):  # layers with sub-modules first (not a layer's q/k/v projections)
            best = 0
            for siblings in [self.top] + [c.children for c in walk(self.top)]:
                counts: dict[str, int] = {}
                for c in siblings:
                    if leaves or c.children:
                        counts[c.module_type] = counts.get(c.module_type, 0) + 1
                best = max([best] + list(counts.values()))
            if best >= 2:
                return best
        return len(self.frontier)



def _refine_for_split_points(mod: _Module, points: Sequence[str]) -> list[int]:
    """Expand ``mod``'s frontier until every named module starts a block; returns their block indices."""
    calls = list(walk(mod.top))
    out = []
    for p in points:
        target = next((c for c in calls if c.path == p or c.module == p), None)
        if target is None:
            known = sorted({c.module for c in calls})
            near = [k for k in known if p.rsplit(".", 1)[0] in k][:8] or known[:8]
            raise PartitionError(f"split point {p!r} is not a module called in modality {mod.name!r} (modules there "
                                 f"include {near})")
        chain = []
        c = target
        while c is not None:
            chain.append(c)
            c = c.parent
        for anc in reversed(chain[1:]):
            if anc in mod.frontier:
                mod.frontier = expand(mod.frontier, anc)
        out.append(mod.frontier.index(target))
    if out != sorted(set(out)) or (out and out[0] == 0):
        raise PartitionError(f"split points {list(points)} of modality {mod.name!r} must name distinct modules in "
                             "graph order, after the module's first block")
    return out


def _split_points_by_modality(split_points, mods: Mapping[str, _Module]) -> dict[str, list[str]]:
    """``split_points`` as modality -> module paths.  Taken per modality (``{"text": ["layers.8"]}``) or as one list
    of module paths, as torch.distributed.pipelining users write them (``["layers.4", "layers.8"]``): each path
    then goes to the modality whose module it is.

    Raises:
        PartitionError: another form, a path that is not a string, or a listed path no modality calls.
    """
    forms = ("a list of module paths to cut before (['layers.4', 'layers.8']) or a dict of such lists per modality "
             "({'text': ['language_model.layers.8']})")
    if split_points is None:
        return {}
    if isinstance(split_points, Mapping):
        for m, p in split_points.items():
            if isinstance(p, str) or not isinstance(p, (list, tuple)) or not all(isinstance(x, str) for x in p):
                raise PartitionError(f"split_points[{m!r}] must be a list of module paths, got {p!r}; split_points "
                                     f"takes {forms}")
        return {m: list(p) for m, p in split_points.items()}
    if isinstance(split_points, str) or not isinstance(split_points, (list, tuple)) or \
            not all(isinstance(x, str) for x in split_points):
        raise PartitionError(f"split_points={split_points!r}: split_points takes {forms}")
    out: dict[str, list[str]] = {}
    for p in split_points:
        owner = next((m for m, mod in mods.items() if any(c.path == p or c.module == p for c in walk(mod.top))),
                     None)
        if owner is None:
            raise PartitionError(f"split point {p!r} is not a module the model calls (modalities "
                                 f"{list(mods)}); split_points takes {forms}")
        out.setdefault(owner, []).append(p)
    return out


def partition(graph: torch.fx.Graph, pp_size: int, *,
              chunks_per_rank: Mapping[str, int] | None = None,
              module_latency: Mapping[str, float] | None = None,
              node_seconds: Mapping[str, float] | None = None,
              split_points: Mapping[str, Sequence[str]] | None = None,
              node_bytes: Mapping[str, float] | None = None,
              max_chunk_bytes: float | None = None) -> Partition:
    """Cut every modality module of an annotated graph into ``pp_size * K_i`` chunks (see the module docstring).

    Args:
        graph: a graph annotated by the modality and cost passes.
        pp_size: P, the number of pipeline ranks.
        chunks_per_rank: K_i per modality; modalities not given follow the DIP rule, capped at ``L_i // P``.
        module_latency: T_i per modality used by the rule (seconds); defaults to each module's estimated
            latency on the example batch.
        node_seconds: node name -> seconds (e.g. forward + backward on a device profile, at the sizes the modules
            will run at); when given, blocks are balanced by the sum of their nodes' seconds (nodes not listed count
            0) instead of the first estimate's ``node_latency(dipc_cost)``.
        split_points: modality -> module paths to cut before (``{"text": ["language_model.layers.8"]}``), or one
            list of module paths (torch.distributed.pipelining's form), each given to its module's modality; a
            modality with points has ``len(points) + 1`` chunks, a multiple of ``pp_size``.
        node_bytes, max_chunk_bytes: node name -> bytes it holds for good (parameters, gradients, optimizer
            states); with both, every balanced chunk holds at most ``max_chunk_bytes`` (a balance under memory, as
            nnScaler's planner keeps each stage within the device).

    Returns:
        a :class:`Partition`; nodes get ``dipc_block`` and ``dipc_chunk`` metadata.

    Raises:
        PartitionError: ``pp_size`` < 1; a module has fewer candidate blocks (module calls) than its chunks need,
            naming the module and its candidate count; a K_i < 1 is asked for; a ``node_seconds`` value is negative
            or not finite; a split point names no module of its modality, is out of order, or gives a chunk count
            that is not a multiple of ``pp_size``.
    """
    if pp_size < 1:
        raise PartitionError(f"pp_size must be >= 1, got {pp_size}")
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    modalities = list(dict.fromkeys(n.meta["dipc_modality"] for n in nodes))
    if node_seconds is not None:
        for n in nodes:
            v = float(node_seconds.get(n.name, 0.0))
            if not math.isfinite(v) or v < 0:
                raise PartitionError(f"node_seconds[{n.name!r}] = {v}: it must be a finite number >= 0")
        cost_of = lambda n: float(node_seconds.get(n.name, 0.0))  # noqa: E731
    else:
        cost_of = lambda n: node_latency(n.meta.get("dipc_cost", ZERO))  # noqa: E731
    given = dict(chunks_per_rank or {})
    mods = {m: _Module(m, [n for n in nodes if n.meta["dipc_modality"] == m], cost_of) for m in modalities}
    points = _split_points_by_modality(split_points, mods)
    for m in list(given) + list(points):
        if m not in modalities:
            what = "chunks_per_rank" if m in given else "split_points"
            raise PartitionError(f"{what} names modality {m!r}, but the model has {modalities}")
    for m, k in given.items():
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise PartitionError(f"chunks_per_rank[{m!r}] must be an int >= 1, got {k!r}")
    module_cost = {m: sum((n.meta.get("dipc_cost", ZERO) for n in mods[m].nodes), ZERO) for m in modalities}

    # (1) natural blocks: no call above 1/(2P) of its module, so each rank's share spans two blocks or more
    fixed: dict[str, list[int]] = {}
    for m, mod in mods.items():
        if m in points:
            fixed[m] = _refine_for_split_points(mod, points[m])
            n = len(fixed[m]) + 1
            if n % pp_size:
                raise PartitionError(f"the split points of modality {m!r} ({points[m]}) give {n} chunks, not a "
                                     f"multiple of pp_size={pp_size}")
            if m in given and given[m] * pp_size != n:
                raise PartitionError(f"the split points of modality {m!r} ({points[m]}) give {n} chunks but "
                                     f"chunks_per_rank[{m!r}]={given[m]} asks for {given[m] * pp_size}")
            given[m] = n // pp_size
            continue
        while True:
            big = [c for c in mod.expandable() if mod.call_cost(c) > mod.total / (2 * pp_size)]
            if not big:
                break
            mod.frontier = expand(mod.frontier, max(big, key=mod.call_cost))
    lat = dict(module_latency) if module_latency else {m: node_latency(module_cost[m]) for m in modalities}
    rule = chunks_per_rank_rule({m: lat.get(m, 0.0) for m in modalities})
    K = {m: given.get(m, max(1, min(rule[m], mods[m].n_layers() // pp_size))) for m in modalities}

    chunks: list[ChunkInfo] = []
    block_to_chunk: dict[tuple[str, int], int] = {}
    block_keys, block_names, crossing, notes = {}, {}, {}, {}
    for m in modalities:
        mod, n_parts = mods[m], pp_size * K[m]
        # (2) enough blocks for the chunks
        while len(mod.frontier) < n_parts and mod.expand_largest():
            pass
        if max(len(mod.frontier), 1) < n_parts:
            why = (f"pp_size={pp_size}" if m not in given else f"chunks_per_rank[{m!r}]={K[m]} with pp_size={pp_size}")
            raise PartitionError(
                f"{why} needs {n_parts} chunks of module {m!r}, but it has only {len(mod.frontier)} candidate "
                f"block(s) even cut down to its innermost module calls ({[c.path for c in mod.frontier][:4]} ...); "
                "use a smaller pp_size or chunks_per_rank")
        if m in fixed:
            starts = [0] + fixed[m] + [len(mod.frontier)]
            of, costs = mod.blocks()
            cuts = list(zip(starts[:-1], starts[1:]))
            notes[m] = f"split at {points[m]}"
        else:
            def weights(of, n_blocks):
                if node_bytes is None or max_chunk_bytes is None:
                    return None
                out = [0.0] * n_blocks
                for n, b in zip(mod.nodes, of):
                    out[b] += float(node_bytes.get(n.name, 0.0))
                return out

            # (3) balance: refine the costliest calls while the best cut is far above its lower bound
            for _ in range(256):
                of, costs = mod.blocks()
                wts = weights(of, len(costs))
                best = max(sum(costs[lo:hi]) for lo, hi in balanced_cuts(costs, n_parts, wts, max_chunk_bytes))
                indivisible = max((c for b, c in enumerate(costs) if not mod.frontier[b].children), default=0.0)
                # a call under a tenth of a chunk cannot unbalance a cut by more than the tolerance on its own
                if best <= (1 + BALANCE_TOLERANCE) * max(sum(costs) / n_parts, indivisible) or \
                        not mod.expand_largest(above=BALANCE_TOLERANCE * sum(costs) / n_parts):
                    break
            of, costs = mod.blocks()
            wts = weights(of, len(costs))
            best = max(sum(costs[lo:hi]) for lo, hi in balanced_cuts(costs, n_parts, wts, max_chunk_bytes))
            cross = crossing_bytes(mod.nodes, of, len(costs))
            cuts = min_crossing_cuts(costs, cross, n_parts, best * (1 + CROSSING_SLACK), wts, max_chunk_bytes) or \
                balanced_cuts(costs, n_parts, wts, max_chunk_bytes)
            notes[m] = "cut between module calls"
        crossing[m] = crossing_bytes(mod.nodes, of, len(costs))
        block_keys[m] = [c.key for c in mod.frontier] or ["(glue)"]
        block_names[m] = [c.path for c in mod.frontier] or ["(ops outside modules)"]
        for n, b in zip(mod.nodes, of):
            n.meta["dipc_block"] = b
            n.meta["dipc_layer"] = node_layer(n, block_names[m][b])
        for pos, (lo, hi) in enumerate(cuts):
            idx = len(chunks)
            cost = sum((n.meta.get("dipc_cost", ZERO) for n, b in zip(mod.nodes, of) if lo <= b < hi), ZERO)
            chunks.append(ChunkInfo(index=idx, modality=m, position=pos, segment=pos // pp_size,
                                    rank=pos % pp_size, blocks=(lo, hi), cost=cost))
            for b in range(lo, hi):
                block_to_chunk[(m, b)] = idx
    for n in nodes:
        n.meta["dipc_chunk"] = block_to_chunk[(n.meta["dipc_modality"], n.meta["dipc_block"])]
    return Partition(pp_size=pp_size, modalities=modalities, block_keys=block_keys, block_names=block_names,
                     n_blocks={m: len(block_keys[m]) for m in modalities}, chunks_per_rank=K, chunks=chunks,
                     block_to_chunk=block_to_chunk, module_cost=module_cost, crossing=crossing, notes=notes)


def apply_partition(graph: torch.fx.Graph, part: Partition) -> None:
    """Label the nodes of another capture of the same model with ``part``'s chunks: each node joins the block of
    the deepest known module call holding it (glue: the next block in graph order), by torch.export's call ids.

    Raises:
        PartitionError: a node's modality is not one of the partition's.
    """
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    by_mod: dict[str, list[torch.fx.Node]] = {}
    for n in nodes:
        m = n.meta["dipc_modality"]
        if m not in part.block_keys:
            raise PartitionError(f"node {n.name} has modality {m!r}, which the partition ({part.modalities}) "
                                 "does not know")
        by_mod.setdefault(m, []).append(n)
    for m, ns in by_mod.items():
        for n, b in zip(ns, assign(ns, part.block_keys[m])):
            n.meta["dipc_block"] = b
            n.meta["dipc_layer"] = node_layer(n, part.block_names[m][b])
            n.meta["dipc_chunk"] = part.block_to_chunk[(m, b)]
