"""The schedule-template library: the static pipeline schedules DIP is measured against, on dipc's chunks.

A template turns the stages of one step (forward ``F`` and backward ``B`` of each (chunk, microbatch), encoders run
on a microbatch's instances whole, without sub-microbatches) into a fixed order per rank.  The planner
(:mod:`dipc.planner.schedule`) then times that order, switches stages to recompute until it fits the memory limit (as a
user of that system turns recompute on), and lowers it into a :class:`dipc.plan.Plan` that the executor runs and the
simulator scores, exactly like DIP's own plans.  Sources followed (shared/PAPER.md §3.1 baselines, DESIGN.md
"Schedules"):

* ``gpipe`` - GPipe (Huang et al. 2019): every forward, then every backward; a rank with several chunks runs them
  breadth-first (torch.distributed.pipelining's ``ScheduleLoopedBFS``): forwards by (chunk, microbatch), backwards by
  (reverse chunk, microbatch).
* ``1f1b`` - Megatron-LM's interleaved 1F1B (Narayanan et al. 2021; virtual pipeline, VPP) over the rank's chunks in
  graph order (plain 1F1B when a rank has one chunk): microbatches in groups of P, each group runs chunk by chunk;
  ``(P - r - 1) * 2 + (V - 1) * P`` warm-up forwards on rank r with V chunks (``P - r - 1`` when V = 1), then one
  forward and one backward alternately, then the remaining backwards.  With the encoder chunks this is 1F1B with all
  modalities in one segment, as nnScaler* schedules them.
* ``mimo`` - Megatron MIMO's colocated three-phase schedule: the encoder forwards of the whole batch, the backbone's
  interleaved 1F1B, then the encoder backwards.
* ``optimus`` - Optimus' coarse schedule (Feng et al. 2024): every encoder forward first on each rank, the rest
  (backbone and encoder backwards) by the dual-queue list scheduler; :func:`encoder_first_edges` gives the
  precedence the planner adds for it.
* ``dip`` - DIP (§2.4): sub-microbatched encoders interleaved with the backbone by the memory-aware dual-queue list
  scheduler (the planner's default; no fixed order here).

Megatron's 1F1B needs the microbatch count to be a multiple of P and every stage present; here the order is made
for microbatches padded to a multiple of P and then the stages a step lacks (padding, a microbatch without images)
are dropped.  Dropped stages are ones nothing waits for, so the order stays deadlock-free.

Nothing here imports the planner or the runtime: a stage is anything with ``kind``, ``chunk``, ``mb``, ``sub``,
``rank``, ``modality`` and ``key``.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Iterable, Mapping, Sequence

__all__ = ["Template", "TEMPLATES", "schedules", "template", "fixed_order", "encoder_first_edges"]


@dataclasses.dataclass(frozen=True)
class Template:
    """One schedule template.

    Attributes:
        name: what ``schedule=`` takes.
        description: one line, with its source.
        sub_microbatches: whether encoders run in sub-microbatches (only DIP's own plans do).
        kind: "fixed" (an order per rank, :func:`fixed_order`), "encoder_first" (the list scheduler after
            :func:`encoder_first_edges`) or "interleave" (DIP's memory-aware list scheduler).
    """

    name: str
    description: str
    sub_microbatches: bool
    kind: str

    @property
    def searches(self) -> bool:
        """Whether DIP's MCTS search (``budget_s``, §2.3) applies: only to the interleaver's plans."""
        return self.kind == "interleave"


TEMPLATES: dict[str, Template] = {t.name: t for t in [
    Template("gpipe", "GPipe: all forwards, then all backwards (breadth-first over a rank's chunks)", False, "fixed"),
    Template("1f1b", "Megatron-LM interleaved 1F1B (VPP) over each rank's chunks; all modalities in one segment "
             "(nnScaler*-like)", False, "fixed"),
    Template("mimo", "Megatron MIMO colocated three-phase: encoder forwards of the whole batch, backbone 1F1B, "
             "encoder backwards", False, "fixed"),
    Template("optimus", "Optimus coarse: every encoder forward first, then the dual-queue list scheduler", False,
             "encoder_first"),
    Template("dip", "DIP: sub-microbatched encoders interleaved with the backbone, memory-aware (PAPER.md §2.4)",
             True, "interleave"),
]}


def schedules() -> list[str]:
    """Names of the schedule templates, for ``schedule=`` (``pipe.step``, ``dipc.simulate``)."""
    return list(TEMPLATES)


def template(name: str) -> Template:
    """The template called ``name``.

    Raises:
        ValueError: unknown name (lists the known ones).
    """
    if name not in TEMPLATES:
        raise ValueError(f"unknown schedule {name!r}; dipc.schedules() lists {schedules()}")
    return TEMPLATES[name]


def _index(stages: Iterable) -> dict[tuple[str, int, int], list[str]]:
    by = defaultdict(list)
    for st in stages:
        by[(st.kind, st.chunk, st.mb)].append(st)
    return {k: [s.key for s in sorted(v, key=lambda s: s.sub)] for k, v in by.items()}


def _interleaved(local: Sequence[int], n_mb: int, P: int, r: int) -> list[tuple[str, int, int]]:
    """Megatron's interleaved 1F1B order on rank ``r`` for its chunks ``local`` (graph order): (kind, chunk, mb)."""
    V = len(local)
    if not V or not n_mb:
        return []
    groups = -(-n_mb // P)
    padded = groups * P

    def seq(reverse: bool):
        out = []
        for g in range(groups):
            for j in (reversed(range(V)) if reverse else range(V)):
                for m in range(g * P, g * P + P):
                    out.append((local[j], m))
        return out

    fwd, bwd = seq(False), seq(True)
    total = padded * V
    warm = min(total, (P - r - 1) if V == 1 else (P - r - 1) * 2 + (V - 1) * P)
    order = [("F",) + x for x in fwd[:warm]]
    fi = warm
    for bi in range(total):
        if fi < total:
            order.append(("F",) + fwd[fi])
            fi += 1
        order.append(("B",) + bwd[bi])
    return order


def fixed_order(name: str, stages: Mapping[str, object], n_ranks: int, encoders: Iterable[str],
                chunk_order: Sequence[int]) -> list[list[str]]:
    """Per rank, the stage keys of template ``name`` (a "fixed" one) in execution order.

    Args:
        stages: stage key -> stage (see the module docstring).
        n_ranks: P.
        chunk_order: every chunk index, in a topological order of the chunks' data flow (the template's
            "virtual stages"; a chunk index is not one: a backbone's embedding comes before its encoder in graph
            order).
        encoders: the modalities that feed the backbone (every modality but the one computing the loss).

    Raises:
        ValueError: ``name`` is not a fixed-order template.
    """
    t = template(name)
    if t.kind != "fixed":
        raise ValueError(f"schedule {name!r} is not a fixed order (it is {t.kind!r})")
    encoders = set(encoders)
    idx = _index(stages.values())
    n_mb = 1 + max((s.mb for s in stages.values()), default=-1)
    chunks: dict[int, tuple[int, str]] = {}
    for s in stages.values():
        chunks[s.chunk] = (s.rank, s.modality)
    pos = {c: i for i, c in enumerate(chunk_order)}
    order: list[list[str]] = []
    for r in range(n_ranks):
        local = sorted((c for c, (rk, _) in chunks.items() if rk == r), key=pos.__getitem__)
        enc = [c for c in local if chunks[c][1] in encoders]
        back = [c for c in local if chunks[c][1] not in encoders]
        if name == "gpipe":
            seq = ([("F", c, m) for c in local for m in range(n_mb)]
                   + [("B", c, m) for c in reversed(local) for m in range(n_mb)])
        elif name == "1f1b":
            seq = _interleaved(local, n_mb, n_ranks, r)
        else:  # mimo
            seq = ([("F", c, m) for c in enc for m in range(n_mb)] + _interleaved(back, n_mb, n_ranks, r)
                   + [("B", c, m) for c in reversed(enc) for m in range(n_mb)])
        order.append([k for x in seq for k in idx.get(x, ())])
    return order


def encoder_first_edges(stages: Mapping[str, object], n_ranks: int, encoders: Iterable[str],
                        chunk_order: Sequence[int]) -> list[tuple[str, str]]:
    """Precedence edges ``(before, after)`` that make every rank run all its encoder forwards (by microbatch, then
    chunk in ``chunk_order``, a topological order) before any other stage (Optimus' coarse schedule).  Edges join
    stages of one rank, so they carry no message."""
    encoders = set(encoders)
    pos = {c: i for i, c in enumerate(chunk_order)}
    per_rank_enc = defaultdict(list)
    per_rank_rest = defaultdict(list)
    for s in stages.values():
        if s.kind == "F" and s.modality in encoders:
            per_rank_enc[s.rank].append(s)
        else:
            per_rank_rest[s.rank].append(s)
    out = []
    for r in range(n_ranks):
        enc = sorted(per_rank_enc[r], key=lambda s: (s.mb, pos[s.chunk], s.sub))
        out += [(a.key, b.key) for a, b in zip(enc, enc[1:])]
        if enc:
            out += [(enc[-1].key, s.key) for s in per_rank_rest[r]]
    return out
