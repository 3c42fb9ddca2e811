"""Partition pass: cut each modality module into P*K_i balanced chunks and place them VPP-style.

Follows DIP's modality-aware partitioning (shared/PAPER.md §2.1):

* each modality module i is cut on its own into ``P * K_i`` contiguous chunks;
* cuts fall only between the module's repeated blocks (the entries of its largest ``nn.ModuleList``, e.g.
  ``language_model.layers.<j>``); nodes before the first block (embeddings, masks, RoPE tables, the image/text
  merge) join the first block, nodes between blocks join the next block, nodes after the last block (final norm, LM
  head, loss) join the last block;
* blocks are grouped into chunks minimising the largest chunk cost (linear partition by dynamic programming), every
  block in exactly one chunk, however the block count divides; the cost is the device profile's forward + backward
  seconds when the compiler has one (``node_seconds``), else the first, nominal estimate;
* chunk ``k * P + r`` of module i lives on rank ``r`` (Megatron VPP placement); ``P`` consecutive chunks of one
  module form a pipeline segment;
* ``K_i = floor(T_i / T_1)`` with ``T_i`` module i's estimated latency at its sub-microbatch size and ``T_1`` the
  fastest module's, capped at ``floor(L_i / P)`` (``L_i`` = block count) and overridable.

Pure: takes an annotated graph (``dipc_modality``, ``dipc_cost``) and returns a :class:`Partition`; sets
``node.meta["dipc_block"]`` and ``node.meta["dipc_chunk"]``.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter, defaultdict
from typing import Mapping

import torch.fx

from .cost import ZERO, NodeCost, node_latency
from .modality import module_path

__all__ = ["ChunkInfo", "Partition", "find_blocks", "assign_blocks", "balanced_cuts", "partition",
           "PartitionError", "chunks_per_rank_rule"]


class PartitionError(ValueError):
    """The model cannot be cut as asked (e.g. more chunks than a module has blocks)."""


_IDX = re.compile(r"^(.*)\.(\d+)$")


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
        block_container: modality -> module path of its repeated blocks.
        n_blocks: modality -> number of blocks L_i.
        chunks_per_rank: modality -> K_i.
        chunks: all chunks, by global index.
        block_numbers: modality -> the original indices (in the block container) of its blocks.
        block_to_chunk: (modality, block) -> global chunk index.
        module_cost: modality -> estimated forward cost of the whole module at the example batch.
    """

    pp_size: int
    modalities: list[str]
    block_container: dict[str, str]
    n_blocks: dict[str, int]
    chunks_per_rank: dict[str, int]
    chunks: list[ChunkInfo]
    block_numbers: dict[str, list[int]]
    block_to_chunk: dict[tuple[str, int], int]
    module_cost: dict[str, NodeCost]

    def chunks_of(self, modality: str) -> list[ChunkInfo]:
        return [c for c in self.chunks if c.modality == modality]


def find_blocks(graph: torch.fx.Graph) -> dict[str, str]:
    """Per modality, the module path whose numbered children are its repeated blocks.

    The container is the ``<path>.<int>`` prefix whose numbered children hold the most compute nodes of the
    modality (so ``transformer.blocks`` wins over a two-entry ``nn.Sequential`` such as ``transformer.time_mlp``,
    whose children are single ops); ties go to the first in graph order.  A modality with no numbered module is
    one block.
    """
    nodes_in: dict[str, Counter] = defaultdict(Counter)
    for n in graph.nodes:
        m = n.meta.get("dipc_modality")
        if m is None:
            continue
        seen = set()
        for p in module_path(n):
            mt = _IDX.match(p)
            if mt and mt.group(1) not in seen:
                seen.add(mt.group(1))
                nodes_in[m][mt.group(1)] += 1
    out = {}
    for m, c in nodes_in.items():
        best = max(c.values())
        out[m] = next(p for p, k in c.items() if k == best)
    return out


def _block_of(node: torch.fx.Node, container: str | None) -> int | None:
    if container is None:
        return None
    for p in module_path(node):
        mt = _IDX.match(p)
        if mt and mt.group(1) == container:
            return int(mt.group(2))
    return None


def assign_blocks(graph: torch.fx.Graph, containers: Mapping[str, str],
                  known: Mapping[str, list[int]] | None = None) -> dict[str, list[int]]:
    """Set ``node.meta["dipc_block"]`` (an index into the modality's sorted block list) on every compute node.

    ``known`` (modality -> block numbers of a first capture) keeps another capture's numbering.
    Returns modality -> sorted list of the original block numbers that have nodes (blocks the loss does not reach,
    e.g. the last ViT layer when features come from layer -2, have no nodes and are not counted).
    """
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    raw: dict[torch.fx.Node, int | None] = {}
    present: dict[str, set] = defaultdict(set)
    for n in nodes:
        m = n.meta["dipc_modality"]
        b = _block_of(n, containers.get(m))
        raw[n] = b
        if b is not None:
            present[m].add(b)
    blocks = {m: sorted(present.get(m, ())) or [0] for m in {n.meta["dipc_modality"] for n in nodes}}
    if known is not None:  # another capture of the same model: keep the first capture's numbering
        for m in blocks:
            if m not in known or not set(present.get(m, ())) <= set(known[m]):
                raise PartitionError(f"module {m!r} has blocks {sorted(present.get(m, ()))} that the partition "
                                     f"does not know ({known.get(m)})")
            blocks[m] = list(known[m])
    rank_of = {m: {b: i for i, b in enumerate(bs)} for m, bs in blocks.items()}
    # nodes outside blocks join the next block node of their modality in graph order, else the last block
    nxt: dict[str, int] = {m: len(bs) - 1 for m, bs in blocks.items()}
    for n in reversed(nodes):
        m = n.meta["dipc_modality"]
        b = raw[n]
        if b is None:
            n.meta["dipc_block"] = nxt[m]
        else:
            n.meta["dipc_block"] = rank_of[m][b]
            nxt[m] = rank_of[m][b]
    return blocks


def balanced_cuts(costs: list[float], n_parts: int) -> list[tuple[int, int]]:
    """Split ``costs`` (one per block) into ``n_parts`` contiguous non-empty ranges minimising the largest sum.

    Returns ``[(lo, hi), ...]`` half-open block ranges covering every block exactly once.

    Raises:
        PartitionError: ``n_parts`` exceeds the number of blocks or is < 1.
    """
    L = len(costs)
    if n_parts < 1 or n_parts > L:
        raise PartitionError(f"cannot cut {L} blocks into {n_parts} chunks")
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
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i] - 1e-12 * max(1.0, abs(v)):
                    best[k][i] = v
                    arg[k][i] = j
    cuts = []
    i = L
    for k in range(n_parts, 0, -1):
        j = arg[k][i]
        cuts.append((j, i))
        i = j
    return cuts[::-1]


def chunks_per_rank_rule(module_latency: Mapping[str, float]) -> dict[str, int]:
    """DIP's K_i = floor(T_i / T_1), T_1 the fastest module's latency (shared/PAPER.md §2.1 step 2)."""
    positive = [t for t in module_latency.values() if t > 0]
    t1 = min(positive) if positive else 1.0
    return {m: max(1, int(math.floor(t / t1))) if t > 0 else 1 for m, t in module_latency.items()}


def partition(graph: torch.fx.Graph, pp_size: int, *,
              chunks_per_rank: Mapping[str, int] | None = None,
              module_latency: Mapping[str, float] | None = None,
              node_seconds: Mapping[str, float] | None = None) -> Partition:
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

    Returns:
        a :class:`Partition`; nodes get ``dipc_block`` and ``dipc_chunk`` metadata.

    Raises:
        PartitionError: ``pp_size`` < 1, a module has fewer blocks than ``pp_size`` (or than ``pp_size * K_i`` for a
            given K_i), a K_i < 1 is asked for, or a ``node_seconds`` value is negative or not finite.
    """
    if pp_size < 1:
        raise PartitionError(f"pp_size must be >= 1, got {pp_size}")
    containers = find_blocks(graph)
    blocks = assign_blocks(graph, containers)
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    modalities = list(dict.fromkeys(n.meta["dipc_modality"] for n in nodes))
    block_cost: dict[str, list[NodeCost]] = {m: [ZERO] * len(blocks[m]) for m in modalities}
    for n in nodes:
        m, b = n.meta["dipc_modality"], n.meta["dipc_block"]
        block_cost[m][b] = block_cost[m][b] + n.meta.get("dipc_cost", ZERO)
    module_cost = {m: sum(block_cost[m], ZERO) for m in modalities}
    for m in modalities:
        if len(blocks[m]) < pp_size:
            raise PartitionError(
                f"pp_size={pp_size} is larger than module {m!r} allows: it has {len(blocks[m])} block(s) "
                f"({containers.get(m, 'no repeated layers')}), and each of the {pp_size} ranks needs at least one")
    given = dict(chunks_per_rank or {})
    for m, k in given.items():
        if m not in modalities:
            raise PartitionError(f"chunks_per_rank names modality {m!r}, but the model has {modalities}")
        if k < 1 or pp_size * k > len(blocks[m]):
            raise PartitionError(
                f"chunks_per_rank[{m!r}]={k} needs {pp_size * k} chunks but module {m!r} has {len(blocks[m])} "
                f"block(s)")
    lat = dict(module_latency) if module_latency else {m: node_latency(module_cost[m]) for m in modalities}
    rule = chunks_per_rank_rule({m: lat.get(m, 0.0) for m in modalities})
    K = {m: given.get(m, min(rule[m], len(blocks[m]) // pp_size)) for m in modalities}

    chunks: list[ChunkInfo] = []
    block_to_chunk: dict[tuple[str, int], int] = {}
    seconds: dict[str, list[float]] | None = None
    if node_seconds is not None:
        seconds = {m: [0.0] * len(blocks[m]) for m in modalities}
        for n in nodes:
            v = float(node_seconds.get(n.name, 0.0))
            if not math.isfinite(v) or v < 0:
                raise PartitionError(f"node_seconds[{n.name!r}] = {v}: it must be a finite number >= 0")
            seconds[n.meta["dipc_modality"]][n.meta["dipc_block"]] += v
    for m in modalities:
        costs = seconds[m] if seconds is not None else [node_latency(c) for c in block_cost[m]]
        for pos, (lo, hi) in enumerate(balanced_cuts(costs, pp_size * K[m])):
            idx = len(chunks)
            chunks.append(ChunkInfo(index=idx, modality=m, position=pos, segment=pos // pp_size,
                                    rank=pos % pp_size, blocks=(lo, hi),
                                    cost=sum(block_cost[m][lo:hi], ZERO)))
            for b in range(lo, hi):
                block_to_chunk[(m, b)] = idx
    for n in nodes:
        n.meta["dipc_chunk"] = block_to_chunk[(n.meta["dipc_modality"], n.meta["dipc_block"])]
    return Partition(pp_size=pp_size, modalities=modalities, block_container=containers,
                     n_blocks={m: len(blocks[m]) for m in modalities}, chunks_per_rank=K, chunks=chunks,
                     block_numbers={m: list(blocks[m]) for m in modalities},
                     block_to_chunk=block_to_chunk, module_cost=module_cost)


def apply_partition(graph: torch.fx.Graph, part: Partition) -> None:
    """Label the nodes of another capture of the same model with ``part``'s chunks (same block ranges)."""
    assign_blocks(graph, part.block_container, part.block_numbers)
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        key = (n.meta["dipc_modality"], n.meta["dipc_block"])
        if key not in part.block_to_chunk:
            raise PartitionError(f"node {n.name} falls in block {key} that the partition does not know")
        n.meta["dipc_chunk"] = part.block_to_chunk[key]
