"""Instances: how a modality's images, videos or clips belong to samples, and how they are cut with them.

An instance belongs to one sample and may own several rows of several keys.  The layouts dipc reads
(DESIGN.md "Instances"; one example each in docs/user_guide.md):

* **rows along dim 0, tied by placeholder tokens** (LLaVA, PaliGemma, Gemma3): ``pixel_values [N, 3, H, W]``;
  sample ``b`` owns the next ``count(input_ids[b] == token_id) / tokens_per_instance`` instances.  Tokens per
  instance may differ per instance: ``tokens_per_instance`` is then a function of the batch returning ``[N]``
  counts (Qwen2-VL: ``grid.prod(-1) // merge**2``; LLaVA-NeXT: a function of ``image_sizes``).
* **patch-packed rows** (Qwen2-VL): ``pixel_values [sum of patches, C*T*P*P]`` with ``image_grid_thw [N, 3]``;
  with ``row_counts="image_grid_thw"`` instance ``i`` owns ``prod(image_grid_thw[i])`` consecutive rows of every
  key whose dim 0 is not ``N``.
* **owner index**: ``owner [N]`` = the sample of each instance (non-decreasing); ``owner_key="owner"``.  Sliced
  into a microbatch, the owner values are re-based to the microbatch's first sample.
* **per-sample padded** (Mllama, Idefics3): ``pixel_values [B, max_images, ...]`` with a mask; dim 0 of every key is
  the sample (``per_sample=True``), the instance count of a sample comes from its placeholder tokens.  These keys
  are cut with the samples; their encoder runs on the whole microbatch (one sub-microbatch).

A modality may have several instance kinds (one :class:`Instances` each, same ``modality``): Qwen2-VL's images
and videos go through one vision tower.  Each sub-microbatch then holds instances of one kind (the other kinds'
keys are left out of its view, or 0-sized without ``drop_when_empty``), and each value the modality hands to the
backbone is the concatenation over the sub-microbatches of the kind it is computed from.

Microbatch and sub-microbatch cuts move whole instances with all their rows and side keys (DIP, shared/PAPER.md
§2.1 step 4: a microbatch with N_i instances is cut into ``M_i = ceil(N_i / B_i)`` near-equal sub-microbatches).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import torch

from .errors import BatchError

__all__ = ["Instances"]


@dataclasses.dataclass(frozen=True)
class Instances:
    """How a modality's instances (e.g. images) appear in a batch (see the module docstring for the layouts).

    Attributes:
        modality: the modality module that encodes them (e.g. "vision").
        keys: the instance keys: dim 0 = instance (or packed row, or sample with ``per_sample``), e.g.
            ``("pixel_values", "image_grid_thw")``.
        token_id: the placeholder token id in ``token_key`` (``None`` with ``owner_key``).
        tokens_per_instance: placeholder tokens per instance: an int, or ``fn(batch) -> LongTensor [N]`` giving
            each instance's count.
        token_key: the per-sample token key holding the placeholders.
        sub_microbatch_size: B_i, instances per sub-microbatch (default 12, the size DIP chose, PAPER.md §3.6).
        drop_when_empty: drop ``keys`` from a microbatch that has no instance (models that take ``None`` for a
            text-only batch, like Hugging Face LLaVA) instead of passing a 0-sized tensor (or, with ``per_sample``,
            the padding slots); a batch may then leave the keys out (per-sample keys may always be left out by a
            batch without instances).
        drop_with_modality: with ``drop_when_empty``, drop ``keys`` only from a (sub-)microbatch where the
            modality has no instance of any kind; beside another kind's instances they are passed with 0
            instances, so one capture serves every mix of kinds.  Set by the compiler for its own capture recipes
            whose graphs run at 0 instances (:func:`dipc.recipes.runs_empty_kinds`); the unsplit model still gets
            ``None`` (:meth:`dipc.batch.BatchSpec.eager_view`).
        owner_key: an instance key holding each instance's sample index (non-decreasing); ownership is read from
            it instead of placeholder tokens.
        row_counts: an instance key ``[N, k]`` whose per-instance product is the number of rows the instance owns
            in the other keys (patch-packed pixels).
        per_sample: the keys' dim 0 is the sample (padded ``[B, max_instances, ...]`` layouts).
    """

    modality: str
    keys: tuple[str, ...]
    token_id: int | None = None
    tokens_per_instance: int | Callable[[Mapping[str, torch.Tensor]], torch.Tensor] = 1
    token_key: str = "input_ids"
    sub_microbatch_size: int = 12
    drop_when_empty: bool = False
    drop_with_modality: bool = False
    owner_key: str | None = None
    row_counts: str | None = None
    per_sample: bool = False

    def __post_init__(self):
        if isinstance(self.keys, str):
            object.__setattr__(self, "keys", (self.keys,))
        object.__setattr__(self, "keys", tuple(self.keys))
        for k, what in ((self.owner_key, "owner_key"), (self.row_counts, "row_counts")):
            if k is not None and k not in self.keys:
                raise ValueError(f"Instances({self.modality!r}): {what}={k!r} must be one of keys {self.keys}")
        if self.owner_key is None and self.token_id is None:
            raise ValueError(f"Instances({self.modality!r}) needs token_id (placeholder tokens) or owner_key")
        if self.per_sample and (self.owner_key or self.row_counts):
            raise ValueError(f"Instances({self.modality!r}): per_sample keys cannot also have owner_key/row_counts")

    # ------------------------------------------------------------------ reading a batch
    def present(self, batch: Mapping) -> bool:
        """True when the batch holds this modality's keys."""
        return all(k in batch for k in self.keys)

    def n_instances(self, batch: Mapping) -> int:
        """N: instances in ``batch`` (0 when its keys are absent); with ``per_sample``, the samples."""
        if not self.present(batch):
            return 0
        if self.row_counts is not None:
            return int(batch[self.row_counts].shape[0])
        if self.owner_key is not None:
            return int(batch[self.owner_key].shape[0])
        return int(batch[self.keys[0]].shape[0])

    def token_counts(self, batch: Mapping, n: int) -> torch.Tensor:
        """Placeholder tokens of each of the ``n`` instances, ``[n]``."""
        t = self.tokens_per_instance
        if callable(t):
            out = torch.as_tensor(t(batch)).reshape(-1).long() if n else torch.zeros(0, dtype=torch.long)
            if out.numel() != n:
                raise BatchError(f"tokens_per_instance of {self.modality!r} gave {out.numel()} counts for {n} instances")
            return out
        return torch.full((n,), int(t), dtype=torch.long)

    def per_sample_counts(self, batch: Mapping, B: int) -> torch.Tensor:
        """Instances of each sample, ``[B]`` (validates ownership).

        Raises:
            BatchError: placeholder tokens do not add up to whole instances, the keys disagree on the instance or
                row count, or an owner index is out of range or decreasing.
        """
        if self.per_sample:
            for k in self.keys:
                if k in batch and batch[k].shape[0] != B:
                    raise BatchError(f"batch[{k!r}] has dim 0 = {batch[k].shape[0]}, but {self.modality} keys are "
                                 f"per-sample (dim 0 = the {B} samples)")
            return self._from_tokens(batch, B, None)
        n = self.n_instances(batch)
        if self.owner_key is not None:
            owner = batch[self.owner_key].reshape(-1).long() if n else torch.zeros(0, dtype=torch.long)
            if n and (int(owner.min()) < 0 or int(owner.max()) >= B):
                raise BatchError(f"batch[{self.owner_key!r}] holds sample indices in [{int(owner.min())}, "
                             f"{int(owner.max())}] but the batch has {B} samples")
            if n > 1 and bool((owner[1:] < owner[:-1]).any()):
                raise BatchError(f"batch[{self.owner_key!r}] must be non-decreasing (each sample's {self.modality} "
                             f"instances together, in sample order), got {owner.tolist()}")
            counts = torch.bincount(owner, minlength=B) if n else torch.zeros(B, dtype=torch.long)
        else:
            counts = self._from_tokens(batch, B, n)
        self._check_rows(batch, n)
        return counts

    def _from_tokens(self, batch: Mapping, B: int, n: int | None) -> torch.Tensor:
        tok = batch[self.token_key]
        per = (tok == self.token_id).reshape(B, -1).sum(dim=1)
        if not callable(self.tokens_per_instance):
            tpi = int(self.tokens_per_instance)
            bad = [(b, int(c)) for b, c in enumerate(per.tolist()) if c % tpi]
            if bad:
                raise BatchError(f"sample(s) {[b for b, _ in bad]} of {self.token_key!r} hold {[c for _, c in bad]} "
                             f"placeholder tokens (id {self.token_id}), not a multiple of {tpi} tokens per "
                             f"{self.modality} instance")
            counts = per // tpi
            if n is not None and int(counts.sum()) != n:
                raise BatchError(f"batch[{self.keys[0]!r}] holds {n} {self.modality} instance(s) but "
                             f"{self.token_key!r} has {int(per.sum())} placeholder tokens (id {self.token_id}) = "
                             f"{int(counts.sum())} instance(s) of {tpi} tokens")
            return counts
        # tokens differ per instance: sample b owns the next instances whose tokens add up to its placeholders
        t = self.token_counts(batch, n)
        ends = torch.cat([torch.zeros(1, dtype=torch.long), t.cumsum(0)]).tolist()
        pos = {e: i for i, e in enumerate(ends)}
        counts, acc, last = [], 0, 0
        for b, c in enumerate(per.tolist()):
            acc += c
            if acc not in pos:
                raise BatchError(f"sample {b} of {self.token_key!r} ends at placeholder token {acc}, which is not the end "
                             f"of a {self.modality} instance (instance token counts {t.tolist()})")
            counts.append(pos[acc] - last)
            last = pos[acc]
        if last != n:
            raise BatchError(f"{self.token_key!r} has {acc} placeholder tokens (id {self.token_id}) for {last} "
                         f"{self.modality} instance(s), but the batch holds {n}")
        return torch.tensor(counts, dtype=torch.long)

    def rows(self, batch: Mapping) -> torch.Tensor | None:
        """Rows each instance owns in the packed keys ``[N]`` (``None`` without ``row_counts``)."""
        if self.row_counts is None:
            return None
        grid = batch[self.row_counts]
        return grid.reshape(grid.shape[0], -1).long().prod(dim=1) if grid.shape[0] else torch.zeros(0, dtype=torch.long)

    def _check_rows(self, batch: Mapping, n: int) -> None:
        rows = self.rows(batch) if n else None
        total = int(rows.sum()) if rows is not None else None
        for k in self.keys:
            if k not in batch:
                continue
            d0 = batch[k].shape[0]
            if d0 == n:
                continue
            if total is not None and d0 == total:
                continue
            what = f"{n} instance(s)" + (f" or the {total} rows of {self.row_counts!r}" if total is not None else "")
            raise BatchError(f"batch[{k!r}] holds {d0} {self.modality} rows but the batch has {what}")

    # ------------------------------------------------------------------ cutting
    def cut(self, batch: Mapping, lo: int, hi: int, sample_lo: int = 0) -> dict[str, torch.Tensor]:
        """The instance keys of instances ``[lo, hi)`` (samples ``[lo, hi)`` with ``per_sample``), all their rows;
        owner values re-based by ``sample_lo``."""
        out = {}
        n = self.n_instances(batch)
        rows = self.rows(batch)
        r = torch.cat([torch.zeros(1, dtype=torch.long), rows.cumsum(0)]).tolist() if rows is not None else None
        for k in self.keys:
            v = batch[k]
            if self.per_sample or v.shape[0] == n:
                out[k] = v[lo:hi]
            else:  # packed rows
                out[k] = v[r[lo]:r[hi]]
        if self.owner_key is not None and sample_lo:
            out[self.owner_key] = out[self.owner_key] - sample_lo
        return out
