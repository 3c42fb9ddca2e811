"""Checks pass: place the model's own assertions where their inputs meet.

A model's checks (Hugging Face's "image tokens == image features" ``torch_compilable_check``, shape and range
assertions) trace as ``_assert_scalar`` / ``_assert_async`` nodes fed by a few ops.  Labelled by the modality rules,
such a chain can land in an encoder chunk and pull a text value into it (an encoder chunk that reads text cannot run
on sub-microbatches).  This pass moves every check, with the ops only it uses, into the earliest chunk that every
one of its inputs reaches (the merge of the image features into the text, for the check above); a check whose
inputs never meet in one chunk is dropped and named in the returned notes (``dipc.batch`` validates placeholder
counts and shapes on every rank before any communication anyway).

Pure: rewrites ``dipc_chunk`` / ``dipc_modality`` / ``dipc_block`` metadata and may erase dropped check nodes.
"""
from __future__ import annotations

import networkx as nx
import torch.fx

from dipc.capture import ASSERTS
from .partition import node_layer

__all__ = ["place_checks", "is_check"]


def is_check(node: torch.fx.Node) -> bool:
    """True for an assertion node (:data:`ASSERTS`)."""
    if node.op != "call_function":
        return False
    name = getattr(getattr(node.target, "overloadpacket", None), "__name__", "")
    return name in ASSERTS


def place_checks(graph: torch.fx.Graph, part) -> list[str]:
    """Move each check (and the ops only it uses) to the earliest chunk all its inputs reach; drop it when none
    does.  ``part`` is the :class:`dipc.passes.partition.Partition` whose chunks label the graph.

    Returns:
        one note per dropped check.
    """
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    only_checks: set[torch.fx.Node] = {n for n in nodes if is_check(n)}
    for n in reversed(nodes):  # ops whose every user is a check (or such an op)
        if n not in only_checks and n.users and all(u in only_checks for u in n.users):
            only_checks.add(n)
    if not only_checks:
        return []
    dag = nx.DiGraph()
    dag.add_nodes_from(c.index for c in part.chunks)
    for n in nodes:
        if n in only_checks:
            continue
        for a in n.all_input_nodes:
            if a.op == "call_function" and a not in only_checks and a.meta["dipc_chunk"] != n.meta["dipc_chunk"]:
                dag.add_edge(a.meta["dipc_chunk"], n.meta["dipc_chunk"])
    order = {c: i for i, c in enumerate(nx.topological_sort(dag))} if nx.is_directed_acyclic_graph(dag) else None
    # one group per check: the check and the exclusive ops feeding it
    notes = []
    pos = {n: i for i, n in enumerate(graph.nodes)}
    groups = sorted(_groups(only_checks), key=lambda grp: min(pos[n] for n in grp))
    info = {c.index: c for c in part.chunks}
    for group in groups:
        inputs = {a for n in group for a in n.all_input_nodes if a.op == "call_function" and a not in group}
        srcs = {a.meta["dipc_chunk"] for a in inputs}
        target = None
        if order is not None:
            reach = None
            for s in srcs:
                r = nx.descendants(dag, s) | {s}
                reach = r if reach is None else reach & r
            if reach is None:  # reads only batch inputs and sizes: keep it where its first op is
                reach = {min(group, key=pos.__getitem__).meta["dipc_chunk"]}
            if reach:
                target = min(reach, key=order.__getitem__)
        if target is None:
            checks = [n for n in group if is_check(n)]
            notes.append(f"dropped the model's check {checks[0].name} ({checks[0].target}): its inputs live in "
                         f"chunks {sorted(srcs)}, which never meet in one chunk")
            for n in sorted(group, key=pos.__getitem__, reverse=True):
                graph.erase_node(n)
            continue
        c = info[target]
        for n in group:
            n.meta["dipc_chunk"] = target
            n.meta["dipc_modality"] = c.modality
            n.meta["dipc_block"] = c.blocks[0]
            n.meta["dipc_layer"] = node_layer(n, part.block_names[c.modality][c.blocks[0]])
    return notes


def _groups(only_checks: set[torch.fx.Node]) -> list[set[torch.fx.Node]]:
    """Connected groups of check ops (a check with the exclusive ops feeding it)."""
    g = nx.Graph()
    for n in only_checks:
        g.add_node(n)
        for a in n.all_input_nodes:
            if a in only_checks:
                g.add_edge(a, n)
    return [set(c) for c in nx.connected_components(g)]
