"""Modality pass: label every compute node of a captured graph with the modality module it belongs to.

DIP (shared/PAPER.md §2.1) partitions each modality module (ViT, LLM, DiT, text encoder, ...) on its own; this pass
decides which nodes belong to which module.  A node's module comes from its ``nn_module_stack`` (the module paths
torch.export records): with user rules the deepest path that matches a rule wins (the most specific); with
:data:`DEFAULT_RULES` the outermost (generic names such as ``patch_embed`` must not pull a DiT's own layers out of
it).  Rules map a modality name to path components,
e.g. ``{"vision": ["vision_tower", "multi_modal_projector"], "text": ["language_model"]}``; a rule component matches
a whole dotted component of the path (``model.vision_tower.encoder`` matches ``vision_tower``) or a dotted prefix.

Nodes no rule claims ("glue": the image/text merge, masks, position ids, RoPE tables built outside the modules, the
LM head, the loss) follow this documented rule:

1. *consumer rule*: a glue node takes the modality of its labelled consumers, walking the graph backwards, so values
   are computed by the module that consumes them - the scatter of image features into the text sequence belongs to
   the text backbone, which keeps encoder chunks free of text work; consumers in several modalities give it the
   upstream one (the modality whose first module op comes first in graph order: the vision tower before the
   language model), so a value both need (Idefics3's mask of real images) flows one way and no cycle forms;
2. *producer rule*: glue nodes whose consumers are all unlabelled (the LM head, the loss, assertions) take the
   modality of their latest labelled input, walking forwards; rules 1 and 2 repeat until nothing changes;
3. nodes with no labelled neighbour at all (e.g. an assertion on an input) take the modality of the next labelled
   node in graph order (else the previous one); a graph no rule matches at all is one modality, ``default``.

Sets ``node.meta["dipc_modality"]`` on every ``call_function`` node and returns the graph.
"""
from __future__ import annotations

import re
from typing import Mapping, Sequence

import torch.fx

__all__ = ["DEFAULT_RULES", "annotate_modality", "module_path", "modality_summary", "rule_modality"]

#: default rules: modality -> path components.  Order matters only for paths matching several modalities
#: (with these default rules the outermost matching module wins - a DiT's ``transformer.patch_embed`` stays in
#: the DiT, a bare ``patch_embed`` or ``img_in`` at the top is an image encoder; with user rules the deepest, most
#: specific match wins; then the first rule).
DEFAULT_RULES: dict[str, list[str]] = {
    "vision": ["vision_tower", "visual", "vision_model", "image_encoder", "vision_encoder", "multi_modal_projector",
               "mm_projector", "vision", "image_tower", "img_encoder", "patch_embed", "img_in"],
    "audio": ["audio_tower", "audio_encoder"],
    "text_encoder": ["text_encoder", "text_encoders", "text_encoder_2", "text_encoder_3"],
    "text": ["language_model", "llm", "text_model"],
    "dit": ["transformer", "dit", "unet", "denoiser"],
}

_SUFFIX = re.compile(r"@\d+$")


def module_path(node: torch.fx.Node) -> list[str]:
    """Module paths of ``node`` from outermost to innermost (call suffixes like ``@1`` removed)."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = []
    for v in stack.values():
        p = v[0] if isinstance(v, tuple) else str(v)
        p = _SUFFIX.sub("", p)
        if p and not p.startswith("_empty_nn_module_stack"):
            paths.append(p)
    return paths


def _match(path: str, component: str) -> bool:
    parts = path.split(".")
    comp = component.split(".")
    n = len(comp)
    return any(parts[i:i + n] == comp for i in range(len(parts) - n + 1))


def rule_modality(paths: Sequence[str], rules: Mapping[str, Sequence[str]], outermost: bool = False) -> str | None:
    """The modality the first rule matching a module path names (innermost path first; outermost first with
    ``outermost``), or None when no rule matches."""
    for p in (paths if outermost else reversed(paths)):
        for modality, comps in rules.items():
            if any(_match(p, c) for c in comps):
                return modality
    return None


def annotate_modality(graph: torch.fx.Graph, rules: Mapping[str, Sequence[str]] | None = None,
                      default: str = "text") -> torch.fx.Graph:
    """Label each ``call_function`` node with ``node.meta["dipc_modality"]`` (see the module docstring).

    Args:
        graph: a captured graph whose nodes carry ``nn_module_stack``.
        rules: modality -> list of path components; replaces :data:`DEFAULT_RULES` when given.
        default: modality for nodes no rule reaches (graphs with no matching module at all).

    Returns:
        the same graph, annotated in place.
    """
    outermost = rules is None or dict(rules) == DEFAULT_RULES
    rules = dict(DEFAULT_RULES if rules is None else rules)
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    label: dict[torch.fx.Node, str] = {}
    for n in nodes:
        m = rule_modality(module_path(n), rules, outermost)
        if m is not None:
            label[n] = m
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = _upstream_order(nodes, label, order)
    changed = True
    while changed:  # rules 1 and 2 until nothing changes (a glue chain may need both directions)
        changed = False
        for n in reversed(nodes):  # 1. consumer rule, backwards
            if n in label:
                continue
            users = sorted((u for u in n.users if u in label), key=order.__getitem__)
            if users:  # consumers in several modalities: the upstream one (it runs first), so no cycle forms
                label[n] = min((label[u] for u in users), key=lambda m: (first.get(m, len(order)),))
                changed = True
        for n in nodes:  # 2. producer rule, forwards
            if n in label:
                continue
            ins = sorted((a for a in n.all_input_nodes if a in label), key=order.__getitem__)
            if ins:
                label[n] = label[ins[-1]]
                changed = True
    # 3. isolated nodes (e.g. assertions on inputs): the next labelled node in graph order, else the previous
    nxt = None
    for n in reversed(nodes):
        if n in label:
            nxt = label[n]
        elif nxt is not None:
            label[n] = nxt
    prev = None
    for n in nodes:
        if n in label:
            prev = label[n]
        elif prev is not None:
            label[n] = prev
    for n in nodes:
        n.meta["dipc_modality"] = label.get(n, default)
    return graph


def _upstream_order(nodes, label, order) -> dict[str, int]:
    """Rank of each modality in the data flow between modules (0 = feeds the others): modality A precedes B when
    a value of A's modules reaches B's modules; without such an order, the position of its first op."""
    import networkx as nx

    reach = nx.DiGraph()
    mods = set(label.values())
    reach.add_nodes_from(mods)
    for m in mods:
        seen, stack = set(), [n for n in nodes if label.get(n) == m]
        while stack:
            n = stack.pop()
            for u in n.users:
                if u in seen:
                    continue
                seen.add(u)
                if label.get(u, m) != m:
                    reach.add_edge(m, label[u])
                else:
                    stack.append(u)
    first = {}
    for n, m in label.items():
        first[m] = min(first.get(m, order[n]), order[n])
    if nx.is_directed_acyclic_graph(reach):
        ranked = list(nx.lexicographical_topological_sort(reach, key=first.__getitem__))
        return {m: i for i, m in enumerate(ranked)}
    return first


def modality_summary(graph: torch.fx.Graph) -> dict[str, int]:
    """Number of compute nodes per modality, in order of first appearance."""
    out: dict[str, int] = {}
    for n in graph.nodes:
        m = n.meta.get("dipc_modality")
        if m is not None:
            out[m] = out.get(m, 0) + 1
    return out
