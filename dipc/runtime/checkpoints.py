"""The state dicts, optimizer states and DCP checkpoints of a :class:`dipc.runtime.PipelineRuntime` (a mixin
whose methods the runtime has; it reads the runtime's compiled pipeline, ranks, group, device and timeout): under
the model's original names, at any pp size, all or nothing, each shard with its checksum."""
from __future__ import annotations

import json
from collections import defaultdict
from typing import Mapping

import torch
import torch.distributed as dist


#: the file in a checkpoint directory holding its shards' checksums (:meth:`PipelineRuntime.save_checkpoint`)
CHECKSUMS = "dipc_checksums.json"


def _file_digest(path: str) -> str:
    """BLAKE2b of a file's bytes, read in 8 MiB pieces."""
    import hashlib

    h = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(8 << 20), b""):
            h.update(piece)
    return h.hexdigest()


def _copy_into(dst, src) -> None:
    """Write ``src``'s values into ``dst`` (same nested mappings): tensors in place, other values by key."""
    for k, v in src.items():
        if isinstance(v, torch.Tensor) and isinstance(dst[k], torch.Tensor):
            dst[k].copy_(v)
        elif isinstance(v, Mapping) and isinstance(dst[k], Mapping):
            _copy_into(dst[k], v)
        else:
            dst[k] = v


def _full(t: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel parameter's whole value (a collective over its group), else ``t``."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _assign(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` in ``dst``'s device and dtype; a whole ``src`` into a tensor-parallel ``dst`` copies
    this rank's shard of it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    src = src.to(dst.device, dst.dtype)
    if isinstance(dst, DTensor) and not isinstance(src, DTensor):
        src = distribute_tensor(src, dst.device_mesh, dst.placements, src_data_rank=None)
    dst.copy_(src)


# ---------------------------------------------------------------------------------------------------- runtime


class CheckpointsMixin:
    """The runtime's state-dict and checkpoint methods (:mod:`dipc.runtime.checkpoints`)."""

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Load this rank's parameters and buffers from ``state_dict`` under the original names (e.g. a full
        checkpoint of the unsplit model, or :meth:`state_dict` of this rank); entries of other ranks are ignored.
        Copies in place (the optimizer keeps its parameter objects).

        Raises:
            KeyError: ``strict`` and one of this rank's entries is missing (all of them named), or a name is not the
                model's.
            ValueError: an entry's shape differs from the model's (named), before anything is copied.
        """
        mine = self.state_dict_names()
        known = set(self.compiled.model.state_dict(keep_vars=True))
        unknown = sorted(set(state_dict) - known)
        missing = sorted(n for n in mine if n not in state_dict)
        if strict and (unknown or missing):
            raise KeyError(f"load_state_dict(strict=True): missing {missing[:10]}{'...' if len(missing) > 10 else ''}"
                           f", unexpected {unknown[:10]}{'...' if len(unknown) > 10 else ''}")
        targets = dict(self.compiled.model.state_dict(keep_vars=True))
        for n, t in mine.items():
            if n in state_dict and tuple(state_dict[n].shape) != tuple(t.shape):
                raise ValueError(f"{n}: the state dict holds shape {tuple(state_dict[n].shape)}, the model "
                                 f"{tuple(t.shape)}")
        with torch.no_grad():
            for n in mine:
                if n in state_dict:
                    _assign(targets[n], state_dict[n])

    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load this rank's part of a full state dict (:meth:`full_state_dict`, or the unsplit model's
        ``state_dict()``) that must hold every entry of the model, not only this rank's.

        Raises:
            KeyError: an entry of the model is missing or a name is not the model's (named).
            ValueError: an entry's shape differs from the model's (named), before anything is copied.
        """
        want = set(self.compiled.model.state_dict(keep_vars=True))
        missing, unknown = sorted(want - set(state_dict)), sorted(set(state_dict) - want)
        if missing or unknown:
            raise KeyError(f"load_full_state_dict: the state dict misses {missing[:10]}"
                           f"{'...' if len(missing) > 10 else ''} and has unexpected {unknown[:10]}"
                           f"{'...' if len(unknown) > 10 else ''} (a full state dict holds every rank's entries)")
        self.load_state_dict(state_dict, strict=True)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """``optimizer``'s state (an optimizer over :meth:`parameters`) keyed by the original parameter names, in
        torch.distributed.checkpoint's flattened form (``state.<name>.exp_avg``, ``param_groups.<name>.lr``):
        ``get_optimizer_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))``
        on the whole model, so the unsplit model's optimizer and one at any pp size read it alike (a tied weight's
        ranks hold the same state under the same name).

        Raises:
            ValueError: ``optimizer`` holds a parameter that is not this rank's.
        """
        return self._flat_optimizer(optimizer, init=False)

    def _flat_optimizer(self, optimizer, init: bool) -> dict:
        """:meth:`optimizer_state_dict`.  torch initialises an optimizer without state by a step at lr 0 (AdamW's
        step count becomes 1, SGD's momentum buffer weight_decay x the weight), but only when no parameter has a
        ``.grad``: ``init`` False keeps the optimizer as it is (one zero ``.grad`` stands in meanwhile), True lets
        it make the state tensors a checkpoint's state is loaded into (the ``.grad`` step aside meanwhile)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        self._check_optimizer(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        grads = [(p, p.grad) for p in params]
        if not optimizer.state and params:
            if init:
                for p in params:
                    p.grad = None
            elif all(g is None for _, g in grads):
                params[0].grad = torch.zeros_like(params[0])
        groups = optimizer.param_groups
        optimizer.param_groups = [g for g in groups if g["params"]]  # torch's flattening trips on an empty group
        try:
            return get_optimizer_state_dict(self.compiled.model, optimizer,
                                            options=StateDictOptions(flatten_optimizer_state_dict=True))
        finally:
            optimizer.param_groups = groups
            for p, g in grads:
                p.grad = g

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: Mapping) -> None:
        """Load :meth:`optimizer_state_dict`'s form (this rank's names, or a superset) into ``optimizer``.

        Raises:
            ValueError: ``optimizer`` holds a parameter that is not this rank's.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        self._check_optimizer(optimizer)
        groups = optimizer.param_groups  # a group with none of this rank's parameters (per-module learning rates)
        kept = [g for g in groups if g["params"]]
        optimizer.param_groups = list(kept)
        try:
            set_optimizer_state_dict(self.compiled.model, optimizer, dict(state_dict),
                                     options=StateDictOptions(flatten_optimizer_state_dict=True))
            for old, new in zip(kept, optimizer.param_groups):  # load_state_dict made new group dicts: the loaded
                old.update({k: v for k, v in new.items() if k != "params"})  # hyperparameters go to the user's
        finally:
            optimizer.param_groups = groups

    def _check_optimizer(self, optimizer) -> None:
        mine = {id(p) for p in self.parameters()}
        for g in optimizer.param_groups:
            for p in g["params"]:
                if id(p) not in mine:
                    raise ValueError(f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not one of "
                                     f"rank {self.rank}'s (build it from pipe.parameters())")

    def checkpoint_state(self, optimizer: torch.optim.Optimizer | None = None) -> dict:
        """What :meth:`save_checkpoint` writes: ``{"model": this rank's state dict entries (the tensors, no copy),
        "optim": optimizer_state_dict(optimizer)}`` ("optim" only with an optimizer)."""
        out = {"model": self.state_dict_names()}
        if optimizer is not None:
            out["optim"] = self.optimizer_state_dict(optimizer)
        return out

    def save_checkpoint(self, checkpoint_id, optimizer: torch.optim.Optimizer | None = None,
                        extra: Mapping | None = None) -> None:
        """Write a torch.distributed.checkpoint (DCP) checkpoint of the model (and ``optimizer``) under the
        original names: every rank writes its own entries, a tied weight once (a collective over the pipeline's
        ranks).  The keys are ``model.<name>`` and ``optim.state.<name>.<field>`` / ``optim.param_groups.<name>.<key>``,
        so an unsplit model loads it with ``sd = {"model": model.state_dict()}; dcp.load(sd, checkpoint_id=path,
        no_dist=True); model.load_state_dict(sd["model"])`` (its optimizer likewise, through
        ``get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))``),
        and a pipeline of any pp size with :meth:`load_checkpoint`.  With data parallelism the first replica
        writes it; with sharded data parallelism (``data_parallel="fsdp"``) every rank writes its shards of each
        tensor (DCP's DTensor entries, over the default process group, which the mesh must span).

        Args:
            checkpoint_id: the checkpoint's directory (as ``torch.distributed.checkpoint.save``).
            optimizer: this rank's optimizer, or None.
            extra: more entries under their own keys (e.g. ``{"step": torch.tensor(step)}``, a scheduler's
                ``state_dict()``): the same on every rank.
        """
        import torch.distributed.checkpoint as dcp

        sd = self.checkpoint_state(optimizer)
        if extra:
            if set(extra) & set(sd):
                raise ValueError(f"extra may not use the keys {sorted(set(extra) & set(sd))}")
            sd.update(extra)
        if self.dp_size == 1:
            dcp.save(sd, checkpoint_id=checkpoint_id, process_group=self.plan_group)
            self._write_checksums(checkpoint_id)
            return
        if self.fsdp is not None:  # sharded: every replica writes its shards, one checkpoint over every rank
            group = dist.group.WORLD
            dcp.save(sd, checkpoint_id=checkpoint_id, process_group=group)
            self._write_checksums(checkpoint_id, group)
            return
        from ..wire import wait_work

        failed = torch.zeros(1, device=self.device)
        err = None
        try:  # data parallel: the first replica writes it, the others return once it is written
            if dist.get_rank(self.dp_group) == 0:
                dcp.save(sd, checkpoint_id=checkpoint_id, process_group=self.plan_group)
                self._write_checksums(checkpoint_id)
        except BaseException as e:  # noqa: BLE001 - the other replicas must hear of it, not wait
            failed += 1
            err = e
        wait_work(dist.all_reduce(failed, group=self.dp_group, async_op=True), self.timeout,
              "the data-parallel replicas after writing a checkpoint")
        if err is not None:
            raise err
        if float(failed) > 0:
            raise RuntimeError(f"the first data-parallel replica could not write the checkpoint {checkpoint_id!r}")

    def _write_checksums(self, checkpoint_id, group=None) -> None:
        """After a DCP save: each rank hashes the shard files it wrote (``__<rank>_*.distcp``, BLAKE2b) and rank 0
        writes them all to ``dipc_checksums.json`` in the checkpoint (JSON), which :meth:`load_checkpoint`
        checks (a collective over ``group``, the group DCP saved over: default the pipeline's ranks; every rank
        returns once the file is written).

        Raises:
            OSError: rank 0 could not write the file (on every rank)."""
        import glob
        import os

        from ..wire import all_gather_json

        group = self.plan_group if group is None else group
        me = dist.get_rank(group)
        mine = {os.path.basename(f): _file_digest(f) for f in
                sorted(glob.glob(os.path.join(str(checkpoint_id), f"__{me}_*.distcp")))}
        every = all_gather_json(mine, group, self.device, self.timeout, "every rank's shard checksums")
        error = None
        if me == 0:
            table = {k: v for part in every for k, v in part.items()}
            try:
                with open(os.path.join(str(checkpoint_id), CHECKSUMS), "w") as f:
                    json.dump({"blake2b": table}, f, indent=0, sort_keys=True)
            except OSError as e:
                error = e
        # no rank returns before the table is written (a rank that reads the checkpoint at once, or exits and tears
        # its process group down while rank 0 still writes, sees it whole)
        failed = self._ranks_failing(error is not None, f"rank 0's write of {CHECKSUMS}", group)
        if error is not None:
            raise error
        if failed:
            raise OSError(f"rank 0 could not write {CHECKSUMS} in the checkpoint {checkpoint_id!r} (its error says why)")

    def _bad_shards(self, checkpoint_id) -> list[str]:
        """The shard files of a checkpoint whose BLAKE2b differs from ``dipc_checksums.json``, that are gone, or
        that the table does not name; each rank checks every P-th file, so each file is read once.  ``[]`` without
        that file.

        Raises:
            ValueError: the checksum file is not the table ``save_checkpoint`` writes (names it)."""
        import os

        import glob

        path = os.path.join(str(checkpoint_id), CHECKSUMS)
        if not os.path.exists(path):
            return []
        try:
            with open(path) as f:
                table = json.load(f)["blake2b"]
            if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()):
                raise TypeError("not a table of file names to hex digests")
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"the checksum file {path} is damaged ({type(e).__name__}: {e}); delete it to load the "
                             "checkpoint without checksums") from None
        # a shard the table does not name is not checked: damaged as well
        bad = [os.path.basename(f) for f in sorted(glob.glob(os.path.join(str(checkpoint_id), "*.distcp")))
               if os.path.basename(f) not in table] if self.plan_rank == 0 else []
        world = dist.get_world_size(self.plan_group)
        for i, name in enumerate(sorted(table)):
            if i % world == self.plan_rank:
                f = os.path.join(str(checkpoint_id), name)
                if os.path.basename(name) != name or not os.path.exists(f) or _file_digest(f) != table[name]:
                    bad.append(name)
        return bad

    def load_checkpoint(self, checkpoint_id, optimizer: torch.optim.Optimizer | None = None,
                        extra: Mapping | None = None) -> None:
        """Load a DCP checkpoint written by :meth:`save_checkpoint` at any pp size, or by the unsplit model under
        ``{"model": model.state_dict(), "optim": ...}``: this rank reads its own entries (and ``optimizer``'s
        state); ``extra``'s tensors are loaded in place as ``dcp.load`` does.  Round trips are exact.

        A checkpoint written by :meth:`save_checkpoint` carries a checksum per shard file (``dipc_checksums.json``),
        checked first (the ranks share the files): a damaged shard is refused on every rank by name.  All or
        nothing: DCP reads into copies, the ranks then agree that every one of them read its part, and only
        then are the parameters, the optimizer and ``extra`` written; a rank that failed leaves every rank's state as
        it was (an optimizer without state that this call initialised to read into is cleared again).

        Raises:
            torch.distributed.checkpoint.api.CheckpointException (a ``BaseException``, from DCP) or
                FileNotFoundError: an entry this rank needs is not in the checkpoint, its shape differs, or there
                is no checkpoint at ``checkpoint_id``.
            RuntimeError: another rank could not read its part (names the ranks); nothing was loaded here either.
            ValueError: a shard does not match its checksum (names it), on every rank before anything is read.
            dipc.wire.WireTimeout: a rank did not report within the runtime's timeout; nothing was loaded.
        """
        import torch.distributed.checkpoint as dcp
        from torch.utils._pytree import tree_map

        had_state = optimizer is not None and bool(optimizer.state)
        failure: BaseException | None = None
        try:  # everything a rank can fail at alone, before DCP's collectives: every rank hears of it
            bad = self._bad_shards(checkpoint_id)
            if bad:
                raise ValueError(f"the checkpoint {checkpoint_id!r} is damaged: shard(s) {bad} do not match their "
                                 f"checksums in {CHECKSUMS} (written by save_checkpoint)")
            sd = {"model": {n: t.detach().clone() for n, t in self.state_dict_names().items()}}
            has_state = False
            if optimizer is not None:
                self._check_optimizer(optimizer)
                # state tensors to load into only when the checkpoint holds state for this rank's parameters (an
                # optimizer saved before its first step holds none: this one then starts without state too)
                keys = set(dcp.FileSystemReader(str(checkpoint_id)).read_metadata().state_dict_metadata)
                names = {n for n, _ in self.named_parameters()}
                has_state = any(k.startswith("optim.state.") and any(k.startswith(f"optim.state.{n}.") for n in names)
                                for k in keys)
                flat = self._flat_optimizer(optimizer, init=has_state and not had_state)
                if not has_state:  # loaded as an optimizer without state: its entries are hyperparameters only
                    flat = {k: v for k, v in flat.items() if not k.startswith("state.")}
                # read into copies: the optimizer's own tensors change only once every rank has read its part
                full_optim = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in flat.items()}
                # parameters the checkpoint holds no state for (no gradient before it was saved) keep none either
                missing = {k for k in full_optim if k.startswith("state.") and f"optim.{k}" not in keys}
                stateless = [p for n, p in self.named_parameters() if any(k.startswith(f"state.{n}.") for k in missing)]
                sd["optim"] = {k: v for k, v in full_optim.items() if k not in missing}
            if extra:
                sd.update(tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, dict(extra)))
        except Exception as e:  # noqa: BLE001
            failure = e
        self._all_or_nothing(failure, optimizer, had_state, f"every rank's check of the checkpoint {checkpoint_id!r}")
        try:
            dcp.load(sd, checkpoint_id=checkpoint_id, process_group=self.plan_group)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            failure = e
        self._all_or_nothing(failure, optimizer, had_state, f"every rank's load of the checkpoint {checkpoint_id!r}")
        self.load_state_dict(sd["model"], strict=False)
        if optimizer is not None:
            if not has_state:
                optimizer.state.clear()
            full_optim.update(sd["optim"])
            self.load_optimizer_state_dict(optimizer, full_optim)
            for p in stateless:
                optimizer.state.pop(p, None)
        if extra:
            _copy_into(extra, {k: sd[k] for k in extra})

    def _all_or_nothing(self, failure: BaseException | None, optimizer, had_state: bool, what: str) -> None:
        """Every rank says whether ``failure`` happened to it (:meth:`_ranks_failing`); when any did, each rank
        raises (its own error, or one naming the failed ranks), an optimizer without state that was initialised to
        read into cleared again.  Nothing else was written yet."""
        failed = self._ranks_failing(failure is not None, what)
        if not failed:
            return
        if optimizer is not None and not had_state:
            optimizer.state.clear()
        if failure is not None:
            raise failure
        raise RuntimeError(f"rank(s) {failed} failed in {what} (their error says why); nothing was loaded on rank "
                           f"{self.rank} either")

    def _ranks_failing(self, failed: bool, what: str, group=None) -> list[int]:
        """The ranks of the pipeline (and of its tensor-parallel groups: the plan group), or of ``group``, for which
        ``failed`` is true (a collective: every rank says whether it failed)."""
        from ..wire import wait_work

        group = self.plan_group if group is None else group
        flags = torch.zeros(dist.get_world_size(group), dtype=torch.int32, device=self.device)
        flags[dist.get_rank(group)] = int(failed)
        wait_work(dist.all_reduce(flags, group=group, async_op=True), self.timeout, what)
        return [r for r, f in enumerate(flags.tolist()) if f]

    def state_dict_names(self) -> dict[str, torch.Tensor]:
        """This rank's entries of the state dict, name -> the model's tensor (no copy)."""
        out = {}
        for pid in self.local_param_ids:
            for n in self._names_by_id[pid]:
                out[n] = self._param_obj[pid]
        persistent = set(self.compiled.model.state_dict(keep_vars=True))
        for n, b in self.compiled.model.named_buffers(remove_duplicate=False):
            if n in persistent and (n in self._local_state_names or self.rank == 0):
                out[n] = b
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and persistent buffers under every original name (tied weights under each alias);
        buffers no chunk reads are kept by rank 0.  Copies (:meth:`state_dict_names` gives the tensors)."""
        return {n: t.detach().clone() for n, t in self.state_dict_names().items()}

    def _owners(self) -> list[tuple[int, str, torch.Tensor]]:
        """``(owner rank, name, tensor)`` for every entry of the full state dict, in model order: a parameter's
        lowest holding rank, a buffer's lowest reading rank (rank 0 for buffers no chunk reads)."""
        comp = self.compiled
        readers: dict[str, set] = defaultdict(set)
        for c in comp.partition.chunks:
            if c.index in comp.program.chunks:
                for n in comp.program.chunks[c.index].state_names:
                    readers[n].add(c.rank)
        out = []
        for pid, p in self._param_obj.items():
            for n in self._names_by_id[pid]:
                out.append((min(self._ranks_by_id[pid]), n, p))
        persistent = set(comp.model.state_dict(keep_vars=True))
        for n, b in comp.model.named_buffers(remove_duplicate=False):
            if n in persistent:
                out.append((min(readers[n]) if readers.get(n) else 0, n, b))
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict gathered from all ranks, under the original names (a collective).

        Each rank broadcasts the bytes of the tensors it owns as one buffer; every rank knows their names, dtypes and
        shapes from its copy of the model, so nothing but tensor bytes travels (no pickle).

        Raises:
            dipc.wire.WireTimeout: a rank's tensors did not arrive within the runtime's timeout.
        """
        from ..wire import wait_work

        owned: dict[int, list] = defaultdict(list)
        for r, n, t in self._owners():
            owned[r].append((n, t))
        out: dict[str, torch.Tensor] = {}
        for r in range(self.world):
            items = owned.get(r, [])
            sizes = [t.numel() * t.element_size() for _, t in items]
            total = sum(sizes)
            if not total:
                for n, t in items:
                    out[n] = t.detach().clone()
                continue
            if r == self.rank:  # a tensor-parallel parameter is gathered first (over its group, on every owner)
                buf = torch.cat([_full(t).detach().contiguous().reshape(-1).view(torch.uint8).to(self.device)
                                 for _, t in items if t.numel()])
            else:
                buf = torch.empty(total, dtype=torch.uint8, device=self.device)
            src = dist.get_global_rank(self.group, r) if self.group is not None else r
            wait_work(dist.broadcast(buf, src=src, group=self.group, async_op=True), self.timeout,
                  f"rank {r}'s {len(items)} state tensors ({total} bytes)")
            off = 0
            for (n, t), size in zip(items, sizes):
                piece = buf[off:off + size].clone()
                out[n] = piece.view(t.dtype).reshape(t.shape).to(t.device) if size else t.detach().clone()
                off += size
        return out
