"""The plan IR: per-rank ordered action lists and their text and JSON forms (checked by :mod:`dipc.validation`).

A plan (DESIGN.md "Plan"; DIP shared/PAPER.md §2.8, in DynaPipe's instruction style) is, per rank, an ordered list
of actions:

* ``F`` / ``B``: forward / backward of one stage, i.e. of (chunk, microbatch, sub-microbatch) with a memory strategy;
* ``SEND_F`` / ``SEND_B``: post a non-blocking send of named tensors (activations / gradients) to another rank;
* ``RECV_F`` / ``RECV_B``: post a non-blocking receive of named tensors; the ``F`` / ``B`` that consumes them waits
  for completion (the wait is implicit in the consuming compute action).

Text form, one token per action, in the spirit of torch.distributed.pipelining's ``0F1`` / ``1SEND_F1``:
``3F1`` = chunk 3 forward of microbatch 1; ``0F1.2`` = sub-microbatch 2 of it; ``3SEND_F1->5`` = chunk 3 sends its
microbatch-1 activations to chunk 5; ``5RECV_F1<-3`` = chunk 5 receives them; ``5RECV_B1<-7.0`` receives the
gradient from chunk 7's sub-microbatch 0.

:func:`dipc.validation.validate` checks a plan before it runs: every send has its receive with the same tensors (names, shapes,
dtypes) and sends between a pair of ranks are received in the order they are sent (so the plan is also valid on
NCCL, which matches point-to-point messages in order), every compute action appears once on the rank that owns its
chunk, every dependency holds, and a dry run finds no deadlock (else it names what each blocked rank waits on).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import Iterable, NewType

__all__ = ["TensorSpec", "Action", "Plan", "PlanError", "check_types", "StageKey", "stage_key", "backward_key",
           "forward_key", "paired_key", "parse_stage_key", "recomputed_blocks", "recompute_layout", "forward_only",
           "offloads"]

COMPUTE = ("F", "B")
SENDS = ("SEND_F", "SEND_B")
RECVS = ("RECV_F", "RECV_B")


class PlanError(ValueError):
    """A plan is malformed, inconsistent or would deadlock."""


@dataclasses.dataclass(frozen=True, init=False)
class TensorSpec:
    """A named tensor in a message: ``shape`` in elements, ``dtype`` as torch's name (e.g. "float32")."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __init__(self, name: str, shape: tuple[int, ...], dtype: str):
        self.__dict__.update(name=name, shape=shape, dtype=dtype)  # as Action's: the frozen __init__ is slow

    @property
    def nbytes(self) -> int:
        import torch
        n = 1
        for s in self.shape:
            n *= s
        return n * getattr(torch, self.dtype).itemsize


#: memory strategies a stage may carry (DESIGN.md "Memory"); besides these, "recompute:<k>" (k >= 1): the first k
#: layers of the chunk recompute, each as its own checkpoint, and "recompute:<k>/<g>": in checkpoints of g layers
#: (:func:`recompute_layout`); "selective": op-selective recompute of the whole chunk; "offload": the chunk's saved
#: activations copied to host memory after its forward and back before its backward
STRATEGIES = {"keep", "recompute", "selective", "offload"}

#: :func:`recompute_layout` of "selective": no layer recomputes whole; the chunk is one checkpoint that keeps its
#: matmul, attention and convolution outputs (torch's selective activation checkpointing)
SELECTIVE_LAYOUT = (0, 0)

#: :func:`recompute_layout` of "offload": nothing recomputes; what the forward saves waits in host memory
OFFLOAD_LAYOUT = (0, -1)

#: a per-layer recompute strategy with this suffix ("recompute:k+offload", "recompute:k/g+offload") also offloads:
#: what the chunk saves outside its checkpoints (the layers after the first k) waits in host memory
OFFLOAD_SUFFIX = "+offload"


def offloads(strategy: str) -> bool:
    """Whether a memory strategy copies saved activations to host memory: "offload", "recompute:k+offload" and
    "recompute:k/g+offload"."""
    return strategy == "offload" or strategy.endswith(OFFLOAD_SUFFIX)


def recompute_layout(strategy: str) -> tuple[int, int] | None:
    """How a memory strategy recomputes a chunk: ``(0, 1)`` for "keep", ``None`` for "recompute" (the whole chunk as
    one region), ``(k, g)`` for "recompute:k/g": the chunk's first k layers (:func:`dipc.codegen.stage.chunk_layers`)
    in activation checkpoints of g consecutive layers each (the last may hold fewer).  "recompute:k" is
    "recompute:k/1", each layer its own checkpoint: Megatron's ``--recompute-method block --recompute-num-layers
    k``; "recompute:k/k" is one checkpoint over the k layers.  "selective" (Megatron's ``--recompute-granularity
    selective``, by op family): :data:`SELECTIVE_LAYOUT`; "offload" (activation offload to host memory):
    :data:`OFFLOAD_LAYOUT`; "recompute:k/g+offload": that of "recompute:k/g" (:func:`offloads` tells them apart).

    Raises:
        PlanError: not a known strategy (``k`` and ``g`` decimal ints, ``1 <= g <= k``).
    """
    if strategy == "keep":
        return 0, 1
    if strategy == "recompute":
        return None
    if strategy == "selective":
        return SELECTIVE_LAYOUT
    if strategy == "offload":
        return OFFLOAD_LAYOUT
    if isinstance(strategy, str) and strategy.startswith("recompute:"):
        spec = strategy[len("recompute:"):]
        spec = spec[:-len(OFFLOAD_SUFFIX)] if spec.endswith(OFFLOAD_SUFFIX) else spec
        k, sep, g = spec.partition("/")
        g = g if sep else "1"
        if all(x.isascii() and x.isdigit() and x == str(int(x)) for x in (k, g)) and 1 <= int(g) <= int(k):
            return int(k), int(g)
    raise PlanError(f"unknown memory strategy {strategy!r}; known: 'keep', 'recompute', 'selective', 'offload', "
                    "'recompute:<k>' (k >= 1 layers, each its own checkpoint) and 'recompute:<k>/<g>' (checkpoints of "
                    f"g <= k layers), each also with {OFFLOAD_SUFFIX!r} (the layers after them offloaded)")


def recomputed_blocks(strategy: str) -> int | None:
    """How many of a chunk's layers a memory strategy recomputes whole: 0 for "keep", "selective" and "offload",
    ``None`` for "recompute" (the whole chunk), ``k`` for "recompute:k" and "recompute:k/g" (:func:`recompute_layout`).

    Raises:
        PlanError: not a known strategy.
    """
    layout = recompute_layout(strategy)
    return None if layout is None else layout[0]


#: The key of a compute stage: ``"<kind>:<chunk>:<microbatch>:<sub-microbatch>"``, e.g. ``"F:3:1:-1"`` (the forward
#: of chunk 3 on microbatch 1, whole microbatch: sub -1).  Keys stay plain interned strings (a planner at VLM-L scale
#: looks up millions per second); build and take them apart only with the functions below.
StageKey = NewType("StageKey", str)


def stage_key(kind: str, chunk: int, mb: int, sub: int) -> StageKey:
    """Key of a compute stage, e.g. ``F:3:1:-1`` (sub -1 = the whole microbatch)."""
    return StageKey(f"{kind}:{chunk}:{mb}:{sub}")


def backward_key(key: str) -> StageKey:
    """The key of the backward paired with stage ``key`` (``F:3:1:-1`` -> ``B:3:1:-1``; a backward's own key).
    Unchecked (the planner's inner loops call it): ``key`` must be a stage key (:func:`parse_stage_key` checks)."""
    return StageKey("B" + key[1:])


def forward_key(key: str) -> StageKey:
    """The key of the forward paired with stage ``key`` (``B:3:1:-1`` -> ``F:3:1:-1``; a forward's own key)."""
    return StageKey("F" + key[1:])


def paired_key(key: str) -> StageKey:
    """The other stage of ``key``'s forward-backward pair."""
    return StageKey(("B" if key[0] == "F" else "F") + key[1:])


def parse_stage_key(key: str) -> tuple[str, int, int, int]:
    """``(kind, chunk, mb, sub)`` of a stage key.

    Raises:
        ValueError: ``key`` is not ``"<F|B>:<int>:<int>:<int>"``.
    """
    m = _STAGE_KEY.fullmatch(key) if isinstance(key, str) else None
    if m is None:
        raise ValueError(f"not a stage key: {key!r} (expected 'F:<chunk>:<mb>:<sub>' or 'B:<chunk>:<mb>:<sub>', "
                         "decimal integers, sub -1 for the whole microbatch)")
    return m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))


_STAGE_KEY = re.compile(r"([FB]):(0|[1-9][0-9]*):(0|[1-9][0-9]*):(-1|0|[1-9][0-9]*)", re.ASCII)


@dataclasses.dataclass(frozen=True, init=False)
class Action:
    """One action of a rank's list.

    Attributes:
        kind: F, B, SEND_F, RECV_F, SEND_B or RECV_B.
        chunk, mb, sub: the stage the action belongs to (for a send: the producer; for a receive: the consumer);
            ``sub = -1`` means the whole microbatch.
        peer_rank, peer_chunk, peer_sub: the other end of a send or receive.
        msg: message id (unique in a plan), for sends and receives.
        tensors: the message's tensors.
        strategy: memory strategy of a stage, the same on its F and B: "keep" (the forward keeps what autograd
            saves until the backward), "recompute" (the forward keeps only its inputs and runs without autograd;
            the backward runs it again, with the forward's RNG state, then back-propagates), "recompute:k" (each
            of the chunk's first k layers runs under its own activation checkpoint: per-layer recompute) or
            "recompute:k/g" (those layers in checkpoints of g layers each, :func:`recompute_layout`) or
            "selective" (the forward runs as one activation checkpoint that keeps the outputs of its matmuls,
            attention and convolutions; the backward runs every other op again: op-selective recompute) or
            "offload" (what the forward saves for the backward, other than its inputs and the weights, is copied
            to host memory; the backward gets it back first: activation offload) or "recompute:k+offload" /
            "recompute:k/g+offload" (the first k layers recompute, what the rest saves is offloaded).
    """

    kind: str
    chunk: int
    mb: int
    sub: int = -1
    peer_rank: int = -1
    peer_chunk: int = -1
    peer_sub: int = -1
    msg: int = -1
    tensors: tuple[TensorSpec, ...] = ()
    strategy: str = "keep"

    def __init__(self, kind: str, chunk: int, mb: int, sub: int = -1, peer_rank: int = -1, peer_chunk: int = -1,
                 peer_sub: int = -1, msg: int = -1, tensors: tuple[TensorSpec, ...] = (), strategy: str = "keep"):
        # the dataclass's frozen __init__ sets each field through object.__setattr__: 1.3 us an action against
        # 0.5 here, and every step lowers its plan and every rank reads it back (a few hundred actions each)
        self.__dict__.update(kind=kind, chunk=chunk, mb=mb, sub=sub, peer_rank=peer_rank, peer_chunk=peer_chunk,
                             peer_sub=peer_sub, msg=msg, tensors=tensors, strategy=strategy)

    @property
    def stage(self) -> str:
        """Key of the compute stage this action belongs to (:func:`stage_key`: a send's or receive's direction is
        its kind's last letter, as a compute action's kind is)."""
        return stage_key(self.kind[-1], self.chunk, self.mb, self.sub)

    @property
    def peer_stage(self) -> str:
        """Key of the compute stage at the other end of a send or receive."""
        return stage_key(self.kind[-1], self.peer_chunk, self.mb, self.peer_sub)

    def __str__(self) -> str:
        s = f".{self.sub}" if self.sub >= 0 else ""
        if self.kind in COMPUTE:
            r = {"keep": "", "recompute": "r", "selective": "s", "offload": "o"}.get(
                self.strategy, "r" + self.strategy[len("recompute:"):].replace(OFFLOAD_SUFFIX, "o"))
            return f"{self.chunk}{self.kind}{self.mb}{s}{r}"
        ps = f".{self.peer_sub}" if self.peer_sub >= 0 else ""
        arrow = "->" if self.kind in SENDS else "<-"
        return f"{self.chunk}{self.kind}{self.mb}{s}{arrow}{self.peer_chunk}{ps}"

    def to_json(self) -> dict:
        d = {"kind": self.kind, "chunk": self.chunk, "mb": self.mb}
        for k in ("sub", "peer_rank", "peer_chunk", "peer_sub", "msg"):  # fields at their default are left out
            v = getattr(self, k)
            if v != -1:
                d[k] = v
        if self.tensors:
            d["tensors"] = [[t.name, list(t.shape), t.dtype] for t in self.tensors]
        if self.strategy != "keep":
            d["strategy"] = self.strategy
        return d

    @staticmethod
    def from_json(d: dict) -> "Action":
        d = dict(d)
        d["tensors"] = tuple(TensorSpec(n, tuple(s) if isinstance(s, list) else s, t)
                             for n, s, t in d.get("tensors", []))
        return Action(**d)


@dataclasses.dataclass
class Plan:
    """A whole step's plan.

    Attributes:
        step: training step it is for.
        chunk_ranks: chunk index -> rank owning it.
        ranks: per rank, its ordered actions.
        deps: compute stage key -> keys of the compute stages it depends on.
        microbatches: per microbatch, its metadata (instances, sub-microbatch ranges, loss weight, shapes).
        simulated: optional figures from the planner: ``iteration_time`` (the scheduler's estimate, seconds),
            ``schedule``, ``plans_tried``, ``recomputed``, ``recomputed_partly`` and, after a search, ``search``
            (:func:`dipc.planner.make_plan`).  Per-stage times are the simulator's (:func:`dipc.simulate`): the plan
            that travels to every rank holds what the ranks need.
        forward_only: an evaluation plan (:func:`forward_only`): forwards and their activation messages only, no
            backward, nothing kept for one.
    """

    step: int
    chunk_ranks: list[int]
    ranks: list[list[Action]]
    deps: dict[str, list[str]]
    microbatches: list[dict] = dataclasses.field(default_factory=list)
    simulated: dict = dataclasses.field(default_factory=dict)
    forward_only: bool = False

    @property
    def n_ranks(self) -> int:
        return len(self.ranks)

    def __repr__(self) -> str:
        n = sum(len(acts) for acts in self.ranks)
        sched = self.simulated.get("schedule", "?")
        return (f"Plan(step={self.step}, schedule={sched!r}, ranks={len(self.ranks)}, actions={n}, "
                f"microbatches={len(self.microbatches)}; to_text() lists them)")

    def to_text(self) -> str:
        """Stable text form: one line per rank, ``rank r: tok tok ...``."""
        return "\n".join(f"rank {r}: " + " ".join(str(a) for a in acts) for r, acts in enumerate(self.ranks))

    def to_json(self) -> str:
        """The plan as JSON text (format 2), the form that travels to every rank and whose SHA-256 they check.

        Each action is one array ``[kind, chunk, mb, sub, peer_rank, peer_chunk, peer_sub, msg, tensors, strategy]``
        with its trailing fields at their defaults (-1, no tensors, "keep") left out; ``tensors`` indexes the
        plan's ``tensor_sets``, where each distinct list of a message's ``[name, shape, dtype]`` is written once (a
        stage's messages carry the same names and dtypes for every microbatch of one shape).  A reference-VLM plan at
        4 microbatches is about 3x smaller and 3-4x faster to write and read than format 1's one object per action,
        which :meth:`from_json` still reads."""
        sets: dict[tuple, int] = {}
        by_id: dict[int, int] = {}  # a message's send and receive share one tuple: found by identity, no hashing
        rows = []
        for acts in self.ranks:
            out = []
            for a in acts:
                ts = -1
                if a.tensors:
                    ts = by_id.get(id(a.tensors), -1)
                    if ts < 0:
                        ts = sets.get(a.tensors, -1)
                        if ts < 0:
                            ts = sets[a.tensors] = len(sets)
                        by_id[id(a.tensors)] = ts
                row = [a.kind, a.chunk, a.mb, a.sub, a.peer_rank, a.peer_chunk, a.peer_sub, a.msg, ts, a.strategy]
                n = 10 if a.strategy != "keep" else 9
                while n > 3 and row[n - 1] == -1:
                    n -= 1
                out.append(row[:n])
            rows.append(out)
        d = {"format": 2, "step": self.step, "chunk_ranks": self.chunk_ranks, "ranks": rows,
             "tensor_sets": [[[t.name, list(t.shape), t.dtype] for t in ts] for ts in sets],
             "deps": self.deps, "microbatches": self.microbatches, "simulated": self.simulated}
        if self.forward_only:
            d["forward_only"] = True
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> "Plan":
        """The plan :meth:`to_json` wrote (format 2, or format 1: one object per action, as dipc wrote before).

        Raises:
            PlanError: ``text`` is not JSON, or not a plan (a field missing or of the wrong type, :func:`check_types`;
                a tensor set index out of range), naming what.
        """
        try:
            d = json.loads(text)
            if not isinstance(d, dict):
                raise TypeError(f"the text holds a {type(d).__name__}, not an object")
            if d.get("format", 1) == 2:
                sets = [tuple(TensorSpec(n, tuple(s) if isinstance(s, list) else s, t) for n, s, t in ts)
                        for ts in d["tensor_sets"]]
                ranks = []
                for acts in d["ranks"]:
                    out = []
                    for row in acts:
                        if type(row) is not list or not 3 <= len(row) <= 10:
                            raise ValueError(f"an action is an array of 3 to 10 fields, got {str(row)[:60]}")
                        if len(row) > 8:
                            row = list(row)
                            if not _is_int(row[8]) or row[8] < -1:
                                raise ValueError(f"tensor set index {row[8]!r} in {row}")
                            row[8] = sets[row[8]] if row[8] >= 0 else ()
                        out.append(Action(*row))
                    ranks.append(out)
            elif d.get("format", 1) != 1:
                raise ValueError(f"unknown plan format {d['format']!r}")
            else:
                ranks = [[Action.from_json(a) for a in acts] for acts in d["ranks"]]
            plan = Plan(step=d["step"], chunk_ranks=d["chunk_ranks"], ranks=ranks, deps=d["deps"],
                        microbatches=d.get("microbatches", []), simulated=d.get("simulated", {}),
                        forward_only=d.get("forward_only", False))
        except (ValueError, KeyError, TypeError, AttributeError, IndexError, OverflowError, RecursionError) as e:
            raise PlanError(f"not a dipc plan: {type(e).__name__}: {str(e)[:200]}") from None
        check_types(plan)
        return plan

    def digest(self) -> str:
        """SHA-256 of the JSON form: every rank checks it before executing."""
        return Plan.text_digest(self.to_json())

    @staticmethod
    def text_digest(text: str) -> str:
        """SHA-256 of a plan's JSON text (:meth:`to_json`): equals ``Plan.from_json(text).digest()``, without
        writing the plan again."""
        return hashlib.sha256(text.encode()).hexdigest()

    def compute_actions(self) -> Iterable[tuple[int, Action]]:
        for r, acts in enumerate(self.ranks):
            for a in acts:
                if a.kind in COMPUTE:
                    yield r, a


_DTYPES: set[str] | None = None


def _dtype_names() -> set[str]:
    global _DTYPES
    if _DTYPES is None:
        import torch

        _DTYPES = {str(v).removeprefix("torch.") for v in vars(torch).values() if isinstance(v, torch.dtype)}
    return _DTYPES


def _is_int(x) -> bool:
    return type(x) is int  # not bool, not float, not a numeric string


def check_types(plan: Plan) -> None:
    """Check that every field of ``plan`` has its type (ints are ints, not bools, floats or strings; a tensor's
    shape non-negative ints, its dtype a torch dtype's name): a plan read from JSON or built by hand with, e.g., a
    chunk ``"0"`` would compare unequal to every stage and run wrong rather than fail.  :func:`validate` and
    :meth:`Plan.from_json` call it.

    Raises:
        PlanError: naming the first field of the wrong type, and where it is.
    """
    if not _is_int(plan.step):
        raise PlanError(f"the plan's step must be an int, got {plan.step!r}")
    if type(plan.forward_only) is not bool:
        raise PlanError(f"the plan's forward_only must be a bool, got {plan.forward_only!r}")
    if not isinstance(plan.chunk_ranks, list) or not all(_is_int(r) and r >= 0 for r in plan.chunk_ranks):
        raise PlanError(f"the plan's chunk_ranks must be a list of ranks (ints >= 0), got {plan.chunk_ranks!r}")
    if not isinstance(plan.deps, dict) or not all(
            type(k) is str and isinstance(v, list) and all(type(x) is str for x in v) for k, v in plan.deps.items()):
        raise PlanError("the plan's deps must map stage keys (str) to lists of stage keys")
    if not isinstance(plan.microbatches, list) or not all(isinstance(m, dict) for m in plan.microbatches):
        raise PlanError(f"the plan's microbatches must be a list of dicts, got {str(plan.microbatches)[:80]}")
    if not isinstance(plan.simulated, dict):
        raise PlanError(f"the plan's simulated figures must be a dict, got {type(plan.simulated).__name__}")
    if not isinstance(plan.ranks, list) or not all(isinstance(acts, list) for acts in plan.ranks):
        raise PlanError("the plan's ranks must be a list of per-rank action lists")
    kinds = COMPUTE + SENDS + RECVS
    checked: set[int] = set()  # tensor lists shared by many actions (format 2) are checked once
    dtypes = None
    for r, acts in enumerate(plan.ranks):
        for i, a in enumerate(acts):
            if type(a) is not Action:
                raise PlanError(f"action {i} of rank {r} is a {type(a).__name__}, not an Action")
            if not (a.kind in kinds and _is_int(a.chunk) and _is_int(a.mb) and _is_int(a.sub)
                    and _is_int(a.peer_rank) and _is_int(a.peer_chunk) and _is_int(a.peer_sub) and _is_int(a.msg)
                    and type(a.strategy) is str and type(a.tensors) is tuple):
                bad = [f"{k}={getattr(a, k)!r}" for k in ("chunk", "mb", "sub", "peer_rank", "peer_chunk",
                                                          "peer_sub", "msg") if not _is_int(getattr(a, k))]
                if a.kind not in kinds:
                    bad.insert(0, f"kind={a.kind!r} (one of {list(kinds)})")
                if type(a.strategy) is not str:
                    bad.append(f"strategy={a.strategy!r}")
                if type(a.tensors) is not tuple:
                    bad.append(f"tensors={a.tensors!r}")
                raise PlanError(f"action {i} of rank {r} has fields of the wrong type: {', '.join(bad)}")
            if a.tensors and id(a.tensors) not in checked:
                checked.add(id(a.tensors))
                dtypes = dtypes or _dtype_names()
                for t in a.tensors:
                    if not (type(t) is TensorSpec and type(t.name) is str and type(t.shape) is tuple
                            and all(_is_int(x) and x >= 0 for x in t.shape) and type(t.dtype) is str
                            and t.dtype in dtypes):
                        raise PlanError(f"action {i} of rank {r} ({a.kind}, message {a.msg!r}) carries a malformed "
                                        f"tensor spec {t!r}: a str name, a shape of ints >= 0 and a torch dtype's "
                                        "name")


def forward_only(plan: Plan) -> Plan:
    """The evaluation plan of ``plan``: each rank's forwards and activation messages in ``plan``'s order, the
    backwards and gradient messages dropped, every forward at the "keep" strategy (nothing is kept: the executor runs
    it without autograd).  Megatron's ``forward_only=True`` pipeline.  Dropping actions only removes waits, so a plan
    that :func:`validate` accepts stays deadlock-free; the result is validated again by the runtime.

    Raises:
        PlanError: ``plan`` is already forward-only.
    """
    if plan.forward_only:
        raise PlanError("the plan is already forward-only")
    ranks = [[dataclasses.replace(a, strategy="keep") if a.kind == "F" else a
              for a in acts if a.kind in ("F", "SEND_F", "RECV_F")] for acts in plan.ranks]
    deps = {k: [d for d in v if d.startswith("F")] for k, v in plan.deps.items() if k.startswith("F")}
    return Plan(step=plan.step, chunk_ranks=list(plan.chunk_ranks), ranks=ranks, deps=deps,
                microbatches=list(plan.microbatches), simulated={}, forward_only=True)
