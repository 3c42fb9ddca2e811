"""Batches: validation, microbatches, sub-microbatches and loss weights.

* A batch is a dict with the keys of the example batch.  Per-sample keys have the text batch as dim 0
  (``input_ids [B, S]``, ``labels [B, S]``); per-instance keys have a modality's instances as dim 0
  (``pixel_values [N, 3, H, W]``); *shared* keys are given whole to every microbatch (a tensor without a batch
  dimension such as Flux's ``img_ids [S, 3]``, a 0-dim tensor, a Python value such as a dict of flags).  Python
  values are allowed: a list or tuple of length B is per-sample (split with the samples), anything else is shared;
  the model's trace is specialised to Python values, so each distinct value gets its own capture.  Which instances
  belong to which sample: :mod:`dipc.instances` (placeholder tokens, an owner index, patch-packed rows, per-sample
  padded keys).
* Microbatches split the samples into near-equal contiguous groups and keep each sample's instances with it
  (image and text tensors are never split independently along dim 0).
* An instance modality's work in a microbatch with N_i instances is split into ``M_i = ceil(N_i / B_i)`` near-equal
  sub-microbatches (DIP, shared/PAPER.md §2.1 step 4).
* Per-sample values that the trace holds as constants (:attr:`BatchSpec.sample_constants`: a static key or a Python
  list with one entry per sample, such as LLaVA-OneVision's ``batch_num_images [B]``, which decides how each of a
  sample's images is tiled) describe instances through their samples.  A sub-microbatch then holds the instances
  of whole samples, and its view (:meth:`Microbatch.sub_view`) is those samples' sub-batch, every per-sample key
  and value sliced with them: no sub-microbatch reads another's per-sample values.  Sub-microbatches are packed
  greedily up to B_i instances; a sample with more than B_i instances is a sub-microbatch of its own.
* Loss semantics: a token-mean loss over the batch stays a token-mean over the whole batch: microbatch m's loss is
  weighted ``n_m / n`` (its labelled tokens over the batch's), a sample-mean loss ``B_m / B``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Sequence

import torch

from .errors import BatchError
from .instances import Instances

__all__ = ["BatchError", "Instances", "LossReduction", "Microbatch", "BatchSpec", "near_equal"]


@dataclasses.dataclass(frozen=True)
class LossReduction:
    """Reduction of the model's loss over a batch.

    Attributes:
        kind: "token_mean" (mean over labelled tokens: weight = labelled tokens of the microbatch), "sample_mean"
            (weight = samples), "sum" (a summed loss: every microbatch weighs 1) or "custom" (weight from
            ``weight_fn(microbatch) -> float``, normalised over the batch).
        labels_key: the labels key for "token_mean".
        ignore_index: label value that is not counted.
        shift: labels are shifted by one inside the model (next-token prediction): position 0 is never counted.
    """

    kind: str = "token_mean"
    labels_key: str = "labels"
    ignore_index: int = -100
    shift: bool = True
    weight_fn: Callable[[Mapping[str, torch.Tensor]], float] | None = None

    def numerator(self, mb: Mapping[str, torch.Tensor], n_samples: int) -> float:
        """This reduction's count for microbatch ``mb`` of ``n_samples`` samples (labelled tokens, samples, ...)."""
        if self.kind == "token_mean":
            lab = mb[self.labels_key]
            if self.shift:
                lab = lab[..., 1:]
            return float((lab != self.ignore_index).sum())
        if self.kind == "sample_mean":
            return float(n_samples)
        if self.kind == "sum":
            return 1.0
        if self.kind == "custom" and self.weight_fn is not None:
            return float(self.weight_fn(mb))
        raise BatchError(f"unknown loss reduction {self.kind!r}")


def near_equal(n: int, parts: int) -> list[int]:
    """Sizes of ``parts`` near-equal pieces of ``n`` (larger pieces first)."""
    q, r = divmod(n, parts)
    return [q + 1] * r + [q] * (parts - r)


@dataclasses.dataclass
class Microbatch:
    """One microbatch of a step.

    Attributes:
        index: microbatch id.
        data: key -> tensor (instance keys hold this microbatch's instances only).
        instances: modality -> instance count N_i.
        subs: modality -> list of ``(start, stop)`` instance ranges of its sub-microbatches (M_i entries; sample
            ranges for per-sample instance keys).
        weight: this microbatch's share of the batch loss.
        sub_samples: modality -> ``(start, stop)`` sample range of each sub-microbatch, for modalities whose
            sub-microbatches hold whole samples (the batch has :attr:`BatchSpec.sample_constants`); the ranges
            partition the microbatch's samples.
        sample_keys: the keys a sample range slices (per-sample tensors and Python lists), with ``sub_samples``.
        sample_starts: with ``sub_samples``, per instance modality its first instance of each sample and the end,
            ``[n + 1]``: how a sample range cuts every modality's keys.
        sub_kinds: for a modality with several instance kinds (e.g. images and videos encoded by one vision tower),
            the kind of each sub-microbatch (each holds instances of one kind; its ``subs`` range counts in that
            kind's instances); absent for a modality with one kind.
        kinds: modality -> its instance kinds, for modalities with several.
    """

    index: int
    data: dict[str, torch.Tensor]
    instances: dict[str, int]
    subs: dict[str, list[tuple[int, int]]]
    weight: float
    sub_samples: dict[str, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)
    sample_keys: frozenset = frozenset()
    sample_starts: tuple = ()
    sub_kinds: dict[str, list[Instances]] = dataclasses.field(default_factory=dict)
    kinds: dict[str, tuple[Instances, ...]] = dataclasses.field(default_factory=dict)

    def sub_kind(self, modality: str, sub: int, default: Instances) -> Instances:
        """The instance kind (:class:`Instances`) sub-microbatch ``sub`` of ``modality`` holds: ``default`` for a
        modality with one kind; for one with several (Qwen2-VL's images and videos), the kind of that range."""
        kinds = self.sub_kinds.get(modality)
        return default if kinds is None else kinds[sub]

    def sub_view(self, inst: Instances, sub: int) -> dict[str, torch.Tensor]:
        """The microbatch with ``inst``'s keys restricted to sub-microbatch ``sub``; where its sub-microbatches hold
        whole samples (``sub_samples``), the sub-batch of those samples: every per-sample key and value sliced with
        them, so the trace of the view sees its own samples' values (e.g. ``batch_num_images``)."""
        lo, hi = self.subs[inst.modality][sub]
        view = dict(self.data)
        samples = self.sub_samples.get(inst.modality)
        if samples is None:
            view.update(inst.cut(self.data, lo, hi))
            for other in self.kinds.get(inst.modality, ()):  # the modality's other kinds: none in this view
                if other is inst or not other.present(self.data):
                    continue
                if other.drop_when_empty and not other.drop_with_modality:
                    for k in other.keys:
                        view.pop(k, None)
                else:
                    view.update(other.cut(self.data, 0, 0))
            return view
        s_lo, s_hi = samples[sub]
        for k in self.sample_keys:
            if k in view:
                view[k] = view[k][s_lo:s_hi]
        view.update(inst.cut(self.data, lo, hi, sample_lo=s_lo))
        for other, starts in self.sample_starts:  # every other modality's instances of those samples, as split cuts
            if other.modality == inst.modality or not other.present(self.data):
                continue
            o_lo, o_hi = starts[s_lo], starts[s_hi]
            if o_lo == o_hi and other.drop_when_empty:
                for k in other.keys:
                    view.pop(k, None)
            elif other.per_sample:
                view.update(other.cut(self.data, s_lo, s_hi))
            else:
                view.update(other.cut(self.data, o_lo, o_hi, sample_lo=s_lo))
        return view

    def meta(self) -> dict:
        return {"index": self.index, "instances": dict(self.instances),
                "subs": {m: [list(r) for r in v] for m, v in self.subs.items()}, "weight": self.weight,
                "shapes": {k: list(v.shape) for k, v in self.data.items() if isinstance(v, torch.Tensor)}}


@dataclasses.dataclass
class BatchSpec:
    """What a batch must look like, taken from the example batch.

    Attributes:
        keys: tensor key -> (ndim, dtype) of the example batch.
        shared: tensor keys given whole to every microbatch (no batch dim).
        values: Python-valued key -> "sample" (a list/tuple with one entry per sample) or "shared".
        sample_key: the per-sample tensor key whose dim 0 is the batch size B.
        trailing: instance key -> the example's sizes after dim 0; later batches must keep them (an image size
            the model cannot take would otherwise fail inside one rank's chunk), except dims in
            ``variable_trailing`` (declared dynamic by the user).
        same_shape: groups of ``(key, dim)`` that are one size in the model's trace (``input_ids`` and ``labels``
            along the sequence: torch.export ties dims the forward combines); they must stay equal.
        value_ranges: (key, low, high, ignore, what): integer values of ``key`` must lie in ``[low, high)`` (or equal
            ``ignore``), e.g. token ids in the embedding's vocabulary, class labels of a cross-entropy.
        instances: instance modalities.
        loss: the loss reduction.
        sample_constants: per-sample keys whose values the trace holds as constants (static keys read with
            ``.tolist()`` and Python lists of one entry per sample); with any, sub-microbatches hold whole samples
            (see the module docstring).  Set by the compiler from its first capture.
    """

    keys: dict[str, tuple[int, torch.dtype]]
    instances: list[Instances]
    loss: LossReduction
    shared: set[str] = dataclasses.field(default_factory=set)
    values: dict[str, str] = dataclasses.field(default_factory=dict)
    sample_key: str | None = None
    trailing: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    same_shape: list[tuple[tuple[str, int], ...]] = dataclasses.field(default_factory=list)
    variable_trailing: set[tuple[str, int]] = dataclasses.field(default_factory=set)
    value_ranges: list[tuple[str, int, int, int | None, str]] = dataclasses.field(default_factory=list)
    sample_constants: set[str] = dataclasses.field(default_factory=set)

    def normalize(self, batch: Mapping[str, torch.Tensor]) -> dict:
        """A shallow copy where an instance key given as ``None`` (or left out, for instances the model takes as
        ``None``: ``drop_when_empty``) becomes a 0-instance tensor, as Hugging Face batches without images carry
        ``pixel_values=None`` or no pixel key at all."""
        if not isinstance(batch, Mapping):
            raise BatchError(f"a batch is a dict of tensors, got {type(batch).__name__}")
        out = dict(batch)
        for inst in self.instances:
            for k in inst.keys:
                if (k in out and out[k] is None) or (k not in out and (inst.drop_when_empty or inst.per_sample)):
                    if inst.per_sample:  # per-sample keys cannot be 0-sized: the batch has none of them
                        out.pop(k, None)
                    else:
                        out[k] = torch.empty((0,) + tuple(self.trailing[k]), dtype=self.keys[k][1])
        return out

    @property
    def optional_keys(self) -> set[str]:
        """Per-sample instance keys, which a batch without instances may leave out."""
        return {k for i in self.instances if i.per_sample for k in i.keys}

    def batch_size(self, batch: Mapping[str, torch.Tensor]) -> int:
        """B, the number of samples of a valid ``batch`` (raises :class:`BatchError` like :meth:`validate`)."""
        return self.validate(batch)[0]

    def eager_view(self, batch: Mapping[str, torch.Tensor]) -> dict:
        """``batch`` as the unsplit model takes it: instance keys of a modality with no instance are dropped where
        the model takes ``None`` for them (``drop_when_empty``, e.g. Hugging Face LLaVA's ``pixel_values``)."""
        out = self.normalize(batch)
        for inst in self.instances:
            if inst.drop_when_empty and all(out[k].shape[0] == 0 for k in inst.keys if k in out):
                for k in inst.keys:
                    out.pop(k, None)
        return out

    @property
    def instance_keys(self) -> set[str]:
        return {k for i in self.instances for k in i.keys}

    @property
    def per_sample_keys(self) -> list[str]:
        """Tensor keys whose dim 0 is the sample."""
        return [k for k in self.keys if k not in self.instance_keys and k not in self.shared]

    def validate(self, batch: Mapping[str, torch.Tensor]) -> tuple[int, dict[str, torch.Tensor]]:
        """Check ``batch`` against the spec.

        Returns:
            (text batch size B, modality -> per-sample instance counts ``[B]``).

        Raises:
            BatchError: a key is missing or unexpected, a value is not a tensor or has the wrong rank or dtype,
                per-sample keys disagree on B, or a sample's placeholder-token count does not match its instances.
        """
        if not isinstance(batch, Mapping):
            raise BatchError(f"a batch is a dict of tensors, got {type(batch).__name__}")
        expected = list(self.keys) + list(self.values)
        missing = [k for k in expected if k not in batch and k not in self.optional_keys]
        for inst in self.instances:  # optional keys come all together or not at all
            given = [k for k in inst.keys if k in batch]
            if given and len(given) < len(inst.keys):
                missing += [k for k in inst.keys if k not in batch and k not in missing]
        extra = [k for k in batch if k not in expected]
        if missing or extra:
            import difflib

            why = []
            if missing:
                why.append(f"is missing key(s) {missing} of the example batch")
            if extra:  # a misspelt key is one the batch lacks; a key beside its near namesake is new input
                near = [(k, difflib.get_close_matches(str(k), missing, n=1)) for k in extra]
                hints = [f"{m[0]!r} for {k!r}" for k, m in near if m]
                why.append(f"has key(s) {extra} that the example batch did not have" +
                           (f" (did you mean {', '.join(hints)}?)" if hints else
                            " (dipc learns a batch's keys from the example batch given to dipc.compile: give it one "
                            "holding every kind of input the training batches hold, e.g. images and videos)"))
            raise BatchError(f"batch {'; '.join(why)} (expected {expected})")
        for k, (ndim, dtype) in self.keys.items():
            if k not in batch:
                continue
            v = batch[k]
            if not isinstance(v, torch.Tensor):
                raise BatchError(f"batch[{k!r}] is a {type(v).__name__}, expected a tensor")
            if v.dim() != ndim:
                raise BatchError(f"batch[{k!r}] has {v.dim()} dims (shape {list(v.shape)}), the example had {ndim}")
            if v.dtype != dtype:
                raise BatchError(f"batch[{k!r}] has dtype {v.dtype}, the example had {dtype}")
        per_sample = self.per_sample_keys
        for group in self.same_shape:
            sizes = {f"{k}.shape[{d}]": batch[k].shape[d] for k, d in group if k in batch}
            if len(set(sizes.values())) > 1:
                raise BatchError(f"keys {list(dict.fromkeys(k for k, _ in group))} must agree in size where the "
                                 f"model's trace ties them, but differ here: {sizes}")
        per_sample_inst = {k for i in self.instances if i.per_sample for k in i.keys}
        for k, trail in self.trailing.items():
            if k not in batch or k in per_sample_inst:  # padded per-sample layouts vary in their max counts
                continue
            got = tuple(batch[k].shape[1:])
            bad = [d + 1 for d, (a, b) in enumerate(zip(got, trail)) if a != b and (k, d + 1) not in self.variable_trailing]
            if bad:
                raise BatchError(f"batch[{k!r}] has per-instance shape {list(got)} but the example had {list(trail)} "
                                 f"(dims {bad}); declare them with dynamic={{{k!r}: {{dim: Dim(...)}}}} if the model "
                                 "takes other sizes")
        for k, lo, hi, ignore, what in self.value_ranges:
            v = batch.get(k)
            if v is None or v.numel() == 0:
                continue
            valid = v if ignore is None else v[v != ignore]
            if valid.numel() and (int(valid.min()) < lo or int(valid.max()) >= hi):
                raise BatchError(f"batch[{k!r}] holds values in [{int(valid.min())}, {int(valid.max())}] but {what} "
                                 f"takes [{lo}, {hi - 1}]" + (f" (or {ignore})" if ignore is not None else ""))
        sizes = {k: batch[k].shape[0] for k in per_sample}
        sizes.update({k: len(batch[k]) for k, kind in self.values.items() if kind == "sample"})
        for k, kind in self.values.items():
            if kind == "sample" and not isinstance(batch[k], (list, tuple)):
                raise BatchError(f"batch[{k!r}] is a {type(batch[k]).__name__}; the example had a list with one entry "
                                 "per sample")
        if len(set(sizes.values())) > 1:
            raise BatchError(f"per-sample keys disagree on the batch size: {sizes}")
        B = next(iter(sizes.values())) if sizes else 1
        if B == 0:
            raise BatchError("batch has no sample (batch size 0)")
        counts = {}
        for inst, c in zip(self.instances, self.kind_counts(batch, B)):
            counts[inst.modality] = counts[inst.modality] + c if inst.modality in counts else c
        return B, counts

    def kind_counts(self, batch: Mapping[str, torch.Tensor], B: int) -> list[torch.Tensor]:
        """Per-sample instance counts ``[B]`` of each of :attr:`instances` (validating their ownership)."""
        return [inst.per_sample_counts(batch, B) for inst in self.instances]

    def split(self, batch: Mapping[str, torch.Tensor], n_microbatches: int, *,
              whole_instances: bool = False, allow_unlabelled: bool = False) -> list[Microbatch]:
        """Validate ``batch`` and cut it into ``n_microbatches`` microbatches (see the module docstring).

        ``whole_instances``: each microbatch's instances form one sub-microbatch (the encoders run on the
        microbatch whole, as static schedule templates do) instead of sub-microbatches of ``sub_microbatch_size``.
        A microbatch without a labelled token (under a token-mean loss) weighs 0: it adds nothing to the loss or
        the gradients, as its tokens add nothing in the unsplit model.  ``allow_unlabelled``: the whole batch may
        have none (evaluation without labels, or a data-parallel replica whose peers have some; every weight is 0).

        Raises:
            BatchError: invalid batch (:meth:`validate`), ``n_microbatches`` < 1 or larger than the batch size, or
                (without ``allow_unlabelled``) a batch with no labelled token under a token-mean loss.
        """
        batch = self.normalize(batch)
        B, _ = self.validate(batch)
        counts = self.kind_counts(batch, B)
        if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise BatchError(f"n_microbatches must be a positive int, got {n_microbatches!r}")
        if n_microbatches > B:
            raise BatchError(f"n_microbatches={n_microbatches} is larger than the batch size {B}")
        sizes = near_equal(B, n_microbatches)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        inst_start = [torch.cat([torch.zeros(1, dtype=torch.long), c.cumsum(0)]).tolist() for c in counts]
        kinds = {}
        for inst in self.instances:
            kinds.setdefault(inst.modality, []).append(inst)
        kinds = {m: tuple(v) for m, v in kinds.items() if len(v) > 1}
        if kinds and self.sample_constants:
            raise BatchError(f"modality {next(iter(kinds))!r} has several instance kinds "
                             f"({[i.keys[0] for i in next(iter(kinds.values()))]}) and the model reads per-sample "
                             f"values {sorted(self.sample_constants)} as trace constants: dipc cannot yet cut both "
                             "by whole samples")
        sample_keys = frozenset(self.per_sample_keys) | {k for k, kind in self.values.items() if kind == "sample"}
        mbs = []
        for i, (s, n) in enumerate(zip(starts, sizes)):
            data = {}
            for k, v in batch.items():
                if k in self.shared or self.values.get(k) == "shared":
                    data[k] = v
                elif k not in self.instance_keys:
                    data[k] = v[s:s + n]
            ninst, subs, sub_samples, sub_kinds = {}, {}, {}, {}
            for q, inst in enumerate(self.instances):
                lo, hi = inst_start[q][s], inst_start[q][s + n]
                N = hi - lo
                ninst[inst.modality] = ninst.get(inst.modality, 0) + N
                subs.setdefault(inst.modality, [])
                if inst.per_sample and inst.present(batch) and not (N == 0 and inst.drop_when_empty):
                    # cut with the samples, padding slots included (Mllama encodes those too); the encoder runs on
                    # the whole microbatch
                    data.update(inst.cut(batch, s, s + n))
                    subs[inst.modality] = [(0, n)]
                    continue
                if not inst.present(batch) or (N == 0 and inst.drop_when_empty):
                    continue
                data.update(inst.cut(batch, lo, hi, sample_lo=s))
                if self.sample_constants and not whole_instances:
                    subs[inst.modality], sub_samples[inst.modality] = whole_sample_subs(
                        counts[q][s:s + n].tolist(), inst.sub_microbatch_size)
                    continue
                M = (1 if N else 0) if whole_instances else math.ceil(N / inst.sub_microbatch_size)
                ranges, o = [], 0
                for sz in (near_equal(N, M) if M else []):
                    ranges.append((o, o + sz))
                    o += sz
                subs[inst.modality].extend(ranges)
                if inst.modality in kinds:
                    sub_kinds.setdefault(inst.modality, []).extend([inst] * len(ranges))
            for q, inst in enumerate(self.instances):  # an absent kind beside its modality's instances: 0 of it
                if inst.drop_with_modality and ninst.get(inst.modality) and inst.present(batch) \
                        and not inst.present(data):
                    data.update(inst.cut(batch, inst_start[q][s], inst_start[q][s], sample_lo=s))
            for m in kinds:
                sub_kinds.setdefault(m, [])
            starts = tuple((inst, [x - inst_start[k][s] for x in inst_start[k][s:s + n + 1]])
                           for k, inst in enumerate(self.instances)) if sub_samples else ()
            mbs.append(Microbatch(index=i, data=data, instances=ninst, subs=subs, weight=0.0,
                                  sub_samples=sub_samples, sample_keys=sample_keys, sample_starts=starts,
                                  sub_kinds=sub_kinds, kinds=kinds))
        nums = [self.loss.numerator(mb.data, n) for mb, n in zip(mbs, sizes)]
        total = sum(nums)
        if self.loss.kind == "token_mean" and not allow_unlabelled and total == 0:
            raise BatchError(f"the batch has no labelled token in {self.loss.labels_key!r} (all "
                             f"{self.loss.ignore_index}): its token-mean loss is undefined")
        for mb, x in zip(mbs, nums):
            mb.weight = 1.0 if self.loss.kind == "sum" else (x / total if total else 0.0)
        return mbs


def whole_sample_subs(counts: Sequence[int], size: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Sub-microbatches that hold whole samples' instances: samples are packed in order while a sub-microbatch
    stays within ``size`` instances (a sample with more is one sub-microbatch of its own).

    Args:
        counts: instances of each sample of the microbatch, ``[n]``.
        size: B_i, the sub-microbatch size.

    Returns:
        ``(instance ranges, sample ranges)``, one ``(start, stop)`` pair each per sub-microbatch; the sample ranges
        partition ``[0, n)`` (samples without instances join the sub-microbatch before them, leading ones the
        first), so the one sub-microbatch of a microbatch is the microbatch itself.
    """
    groups: list[list[int]] = []  # per sub-microbatch: [first instance, stop instance, first sample]
    o = 0
    for b, c in enumerate(counts):
        if not c:
            continue
        if groups and groups[-1][1] - groups[-1][0] + c <= size:
            groups[-1][1] += c
        else:
            groups.append([o, o + c, b])
        o += c
    if not groups:
        return [], []
    starts = [0] + [g[2] for g in groups[1:]]
    return [(g[0], g[1]) for g in groups], list(zip(starts, starts[1:] + [len(counts)]))


#: per-sample keys that Hugging Face processors align token by token with ``input_ids`` (their dim 1 must stay equal)
TOKEN_ALIGNED = {"labels", "attention_mask", "token_type_ids", "mm_token_type_ids", "position_ids",
                 "cross_attention_mask", "image_token_mask"}


def batch_spec_from_example(example: Mapping[str, torch.Tensor], instances: Sequence[Instances],
                            loss: LossReduction, variable_trailing=(), value_ranges=(),
                            shared: Sequence[str] = (), tied: Sequence[Sequence[tuple[str, int]]] = ()) -> BatchSpec:
    """The :class:`BatchSpec` of an example batch.

    Args:
        shared: keys given whole to every microbatch (tensors without a batch dim; 0-dim tensors and Python values
            that are not per-sample lists are shared without being named).
        tied: groups of ``(key, dim)`` the trace gives one size (checked on every batch).

    Raises:
        BatchError: an instance key is missing from the example, a shared key is not in it, or tensor keys disagree
            on dim 0 (e.g. images given without declaring them as instances, or a table without a batch dim not
            declared shared).
    """
    inst_keys = {k for i in instances for k in i.keys}
    for k in inst_keys:
        if example.get(k) is None:
            raise BatchError(f"the example batch must hold at least one instance in {k!r}")
    unknown = [k for k in shared if k not in example]
    if unknown:
        raise BatchError(f"shared key(s) {unknown} are not in the example batch ({list(example)})")
    tensors = {k: v for k, v in example.items() if isinstance(v, torch.Tensor)}
    shared_t = {k for k in shared if k in tensors} | {k for k, v in tensors.items() if v.dim() == 0}
    per_sample = [k for k in tensors if k not in inst_keys and k not in shared_t]
    token_keys = [i.token_key for i in instances if i.token_key in per_sample]
    sample_key = token_keys[0] if token_keys else (per_sample[0] if per_sample else None)
    B = tensors[sample_key].shape[0] if sample_key else None
    sizes = {k: tensors[k].shape[0] for k in per_sample}
    if B is not None and any(v != B for v in sizes.values()):
        raise BatchError(f"the example batch's per-sample keys disagree on dim 0: {sizes} (batch size {B} from "
                         f"{sample_key!r}); keys whose dim 0 counts images (or other instances) must be declared with "
                         "instances=[dipc.Instances(...)], and tensors without a batch dim with shared_keys=[...]")
    # per-token keys of the Hugging Face processors' conventions stay aligned with the token key (the trace does
    # not always record the model's requirement, e.g. cross_entropy's N == N)
    if sample_key is not None and example[sample_key].dim() >= 2:
        S = example[sample_key].shape[1]
        aligned = [(k, d) for k in per_sample if k != sample_key and (k in TOKEN_ALIGNED or k == loss.labels_key)
                   and tensors[k].dim() >= 2 and tensors[k].shape[1] == S for d in (1,)]
        if aligned:
            tied = list(tied) + [[(sample_key, 1)] + aligned]
    values = {}
    for k, v in example.items():
        if k in tensors:
            continue
        values[k] = "sample" if isinstance(v, (list, tuple)) and B is not None and len(v) == B and \
            k not in shared else "shared"
    return BatchSpec(keys={k: (v.dim(), v.dtype) for k, v in tensors.items()}, instances=list(instances), loss=loss,
                     trailing={k: tuple(example[k].shape[1:]) for k in inst_keys},
                     same_shape=[tuple(g) for g in tied if len({k for k, _ in g}) > 1],
                     variable_trailing=set(variable_trailing), value_ranges=list(value_ranges),
                     shared=shared_t, values=values, sample_key=sample_key)
