"""Gradient buckets of data parallelism x pipeline parallelism, all-reduced while the step's last backwards run
(DDP's bucketing, Li et al., VLDB 2020, as torch.nn.parallel.DistributedDataParallel does it).

A rank's parameters are cut into buckets of one dtype of about ``bucket_bytes`` in reverse model order (the order
in which a backward pass finishes them), the same on every replica of its data-parallel group.  During the step a
bucket's all-reduce starts as soon as the rank's last backward action reading any of its parameters has run - in
bucket order, so that every replica issues the same collectives in the same order whatever its own plan - and the
rest start when the plan is done.  Each replica's gradients are scaled by its share of the loss normaliser before
the sum (its labelled tokens over all replicas'), so the sum is the concatenated batch's gradient.  Nothing is
written into ``.grad`` until the step succeeded on every replica (:meth:`GradBuckets.copy_back`).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..errors import BatchError
from ..plan import Plan
from ..planner.workload import StepWorkload
from .executor import StepFailed
from .tensor_parallel import local_tensor

__all__ = ["GradBuckets"]


class GradBuckets:
    """The gradient buckets of one training step on one rank.

    Args:
        params: this rank's parameters in model order (the same list on every replica of the group).
        bucket_bytes: bytes per bucket (a bucket closes once it holds at least this many).
        group: the data-parallel process group.
        scale: this replica's gradient weight (its share of the loss normaliser; 1 for a summed loss).
        timeout: seconds each all-reduce may take once the step waits for it.
        tp: the rank's :class:`dipc.runtime.tensor_parallel.TensorParallel` or None: a bucket's gradients are first
            settled to their parameters' placements, and the buckets hold this rank's shards.
    """

    def __init__(self, params: list[torch.Tensor], bucket_bytes: int, group, scale: float, timeout: float, tp=None):
        self.group, self.scale, self.timeout, self.tp = group, scale, timeout, tp
        self.buckets: list[list[torch.Tensor]] = []
        size = 0  # bytes in the last bucket
        for p in reversed(params):
            if not self.buckets or self.buckets[-1][0].dtype != p.dtype or size >= bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += local_tensor(p).numel() * p.element_size()
        self.ready = [-1] * len(self.buckets)  # index of the rank's action after which each bucket is final
        self.flats: list[torch.Tensor] = []
        self.works: list = []
        self.launched_at: list[int] = []  # the action index each bucket's all-reduce started after (-1: before)
        self.n_actions = 0

    def schedule(self, plan: Plan, rank: int, reads) -> None:
        """Set when each bucket is final: after the last "B" action of ``rank``'s plan whose chunk reads one of its
        parameters (``reads(action)``: the ids of the parameters the action's chunk reads)."""
        last: dict[int, int] = {}
        for i, a in enumerate(plan.ranks[rank]):
            if a.kind == "B":
                for pid in reads(a):
                    last[pid] = i
        self.ready = [max([last.get(id(p), -1) for p in b], default=-1) for b in self.buckets]
        self.n_actions = len(plan.ranks[rank])

    def after(self, i: int) -> None:
        """The rank's action ``i`` ran (-1: none yet): start the all-reduces of the next buckets that are final."""
        while len(self.works) < len(self.buckets) and self.ready[len(self.works)] <= i:
            self._launch(i)

    def launch_rest(self) -> None:
        """Start every all-reduce not started yet (the plan is done, or failed and drained: the other replicas
        still expect each one)."""
        while len(self.works) < len(self.buckets):
            self._launch(len(self.ready))

    def _launch(self, i: int) -> None:
        b = self.buckets[len(self.works)]
        if self.tp is not None:
            self.tp.settle(b)
        flat = torch.cat([local_tensor(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in b])
        if self.scale != 1.0:
            flat.mul_(self.scale)
        self.flats.append(flat)
        self.works.append(dist.all_reduce(flat, group=self.group, async_op=True))
        self.launched_at.append(i)

    def wait(self, what: str) -> None:
        """Wait for every all-reduce (raises :class:`dipc.wire.WireTimeout` after ``timeout``)."""
        from ..wire import wait_work

        for k, wk in enumerate(self.works):
            wait_work(wk, self.timeout, f"{what} (gradient bucket {k} of {len(self.works)})")

    def copy_back(self, live: set[int]) -> None:
        """After :meth:`wait`: the summed gradients become ``.grad`` of the parameters in ``live`` (ids: those
        some replica reached); the others keep ``None``, as in the unsplit model."""
        for b, flat in zip(self.buckets, self.flats):
            o = 0
            for p in b:
                shard = local_tensor(p)
                n = shard.numel()
                if id(p) in live:
                    g = flat[o:o + n].view_as(shard)
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    local_tensor(p.grad).copy_(g)
                else:
                    p.grad = None
                o += n

    def drain(self) -> None:
        """After a failure: wait for what was started, ignoring errors (the step's gradients are discarded)."""
        import datetime

        for wk in self.works:
            try:
                wk.wait(datetime.timedelta(seconds=self.timeout))
            except Exception:  # noqa: BLE001 - the first failure is what is reported
                pass


#: data-parallel sizes up to this name their failed replicas (a float64 bit mask in the step headers)
_DP_MASK_BITS = 50


class DataParallelMixin:
    """The runtime's data-parallel step protocol (headers before and after each step, failures named across
    replicas, the gradient buckets' all-reduce): methods of :class:`dipc.runtime.PipelineRuntime`."""

    # -- data parallelism
    def _dp_layout(self, fsdp: bool = False) -> dict:
        """What the data-parallel replicas must share: the partition (chunk, rank, modality, blocks), this rank's
        parameters and buffers (names, shapes, dtypes: the broadcast and the gradient buckets follow them), the
        bucket size and whether parameters are sharded (FSDP2)."""
        import hashlib

        from ..wire import encode_json

        comp = self.compiled
        chunks = [[c.index, c.rank, c.modality, list(c.blocks)] for c in comp.partition.chunks]
        state = [[n, list(t.shape), str(t.dtype)] for n, t in self.state_dict_names().items()]
        return {"chunks": hashlib.sha256(encode_json(chunks)).hexdigest()[:16],
                "state": hashlib.sha256(encode_json(state)).hexdigest()[:16], "bucket_bytes": self.bucket_bytes,
                "data_parallel": "fsdp" if fsdp else "ddp"}

    def _dp_check_layout(self, fsdp: bool = False) -> None:
        """Before any weight moves between replicas: every replica compiled the same partition, holds the same
        tensors on this pipeline rank and buckets gradients alike (else the broadcast and the all-reduces would pair
        unlike tensors).  One all-gather over the data-parallel group, then one all-reduce over the pipeline, so
        that every rank of every replica raises alike.

        Raises:
            ValueError: the replicas differ (names what differs: compiled from other example batches or options,
                another ``bucket_mb``)."""
        from ..wire import wait_work, all_gather_json

        mine = self._dp_layout(fsdp)
        every = all_gather_json(mine, self.dp_group, self.device, self.timeout,
                                what="data-parallel replicas' layouts")
        diff = sorted({k for o in every for k in o if o[k] != mine[k]})
        bad = torch.tensor([1.0 if diff else 0.0], dtype=torch.float64, device=self.device)
        wait_work(dist.all_reduce(bad, group=self.group, async_op=True), self.timeout,
              "the pipeline's agreement on the data-parallel layout")
        if diff or float(bad.item()) > 0:
            what = {"chunks": "the partition (compile every replica from the same example batch and options)",
                    "state": "the parameters and buffers of this pipeline rank",
                    "bucket_bytes": "bucket_mb", "data_parallel": "data_parallel ('ddp' or 'fsdp')"}
            detail = "; ".join(what[k] for k in diff) if diff else "another pipeline rank's replicas differ"
            raise ValueError(f"rank {self.rank}: the data-parallel replicas were built differently: {detail}; "
                             "every replica must compile the same model, example batch and options and pass the "
                             f"same bucket_mb (this rank: {mine})")

    def _dp_broadcast_state(self) -> None:
        """Every data-parallel replica starts from the first replica's parameters and buffers (as DDP does)."""
        from ..wire import wait_work

        src = dist.get_global_rank(self.dp_group, 0)
        with torch.no_grad():
            for n, t in self.state_dict_names().items():
                wait_work(dist.broadcast(local_tensor(t.data), src=src, group=self.dp_group, async_op=True),
                          self.timeout, f"the data-parallel broadcast of {n}")

    def _dp_count(self, batch) -> float:
        """This replica's share of the concatenated batch's loss normaliser (labelled tokens, samples, ...)."""
        spec = self.compiled.batch_spec
        if spec.loss.kind == "sum":
            return 1.0
        try:
            key = spec.sample_key
            n = int(batch[key].shape[0]) if key and isinstance(batch.get(key), torch.Tensor) else 1
            return float(spec.loss.numerator(batch, n))
        except Exception:  # noqa: BLE001 - a bad batch (or one without labels): the step refuses it on every rank
            return 0.0

    def _dp_guard(self, run):
        """Run one pipeline's step under data parallelism; when it raises before every replica heard of it, tell
        them (which then raise too) before raising here, so that no replica waits in an all-reduce until the
        timeout: before the step's first header (:meth:`_dp_start`) that header says "failed"; after it, the
        gradient buckets still owed are all-reduced (zeros) and the second header says "failed"."""
        self._dp_phase, self._dp_buckets = 0, None
        try:
            return run()
        except BaseException as e:
            if not getattr(e, "_dipc_dp_told", False):
                error = f"{type(e).__name__}: {e}"[:4000]  # what the other replicas' StepFailed will say
                try:
                    if self._dp_phase == 0:
                        self._dp_start(0.0, training=False, failed=True, error=error)
                    elif self._dp_phase == 1:
                        if self._dp_buckets is not None:
                            self._dp_buckets.launch_rest()
                        self._dp_end(True, 0.0, None, error=error)
                except Exception:  # noqa: BLE001 - the other replicas then meet their own timeout
                    pass
                if self._dp_buckets is not None:
                    self._dp_buckets.drain()
            if self.fsdp is not None:
                self.fsdp.release()
            raise
        finally:
            self._dp_buckets = None

    def _dp_allreduce(self, h: torch.Tensor, what: str) -> torch.Tensor:
        from ..wire import wait_work

        h = h.to(self.device)
        wait_work(dist.all_reduce(h, group=self.dp_group, async_op=True), self.timeout, what)
        return h.cpu()

    def _dp_failed(self, why: str) -> StepFailed:
        e = StepFailed(f"step {self.step_index}: {why}; every replica stopped it and its .grad is as before it",
                       step=self.step_index, usable=True)
        e._dipc_dp_told = True
        return e

    def _dp_failure(self, mask: float, error: str) -> str:
        """After a header whose first entry (``mask``: the sum of ``2 ** replica`` over the failed replicas) is not
        0: the lowest failed replica's ``error`` reaches every replica (JSON over the data-parallel group, a
        collective), and the text every replica's :class:`StepFailed` gives: which replicas failed and why."""
        from ..wire import broadcast_json

        bits = int(mask)
        failed = [r for r in range(self.dp_size) if bits >> r & 1] if self.dp_size <= _DP_MASK_BITS else []
        if not failed:
            return f"{bits} data-parallel replica(s) failed this step"
        me = dist.get_rank(self.dp_group)
        text = broadcast_json(error if me == failed[0] else None, failed[0], self.dp_group, self.device, self.timeout,
                              f"the error of data-parallel replica {failed[0]}")
        return f"data-parallel replica(s) {failed} failed this step; replica {failed[0]}: {text}"

    def _dp_flag(self, failed: bool) -> float:
        """This replica's entry in a header's failure mask (``2 ** replica``; a count past 50 replicas)."""
        if not failed:
            return 0.0
        return float(2 ** dist.get_rank(self.dp_group)) if self.dp_size <= _DP_MASK_BITS else 1.0

    def _dp_start(self, count: float, training: bool, failed: bool = False, scale: float = 1.0,
                  error: str = "") -> float:
        """The step's first header, one float64 all-reduce (sum) over the data-parallel group before any activation
        moves: [failed replicas, loss normaliser (``count``), replicas that train (not evaluate), step index, its
        square, log2 of the gradient scaler's scale, its square].  Returns the normaliser's sum (the concatenated
        batch's).

        Raises:
            StepFailed: a replica failed before its step began, evaluates while this one trains (or the reverse),
                is at another step or has another gradient scale (every rank of every replica raises)."""
        D = self.dp_size
        ls = math.log2(scale) if 0 < scale < math.inf else 0.0
        h = self._dp_allreduce(torch.tensor([self._dp_flag(failed), count, float(training), float(self.step_index),
                                             float(self.step_index) ** 2, ls, ls * ls], dtype=torch.float64),
                               f"the data-parallel replicas' status before step {self.step_index}")
        self._dp_phase = 1
        why = ""
        if h[0] > 0:
            why = self._dp_failure(float(h[0]), error)
        elif float(h[2]) not in (0.0, float(D)):
            why = (f"{int(h[2])} of the {D} data-parallel replicas trained while the others evaluated (every "
                   "replica must call step() or eval_step() alike)")
        elif float(h[4]) * D != float(h[3]) ** 2:
            why = (f"the data-parallel replicas are at different steps (this one at step {self.step_index}): every "
                   "replica must call step() for every batch")
        elif abs(float(h[6]) * D - float(h[5]) ** 2) > 1e-9 * max(1.0, float(h[6]) * D):
            why = (f"the data-parallel replicas' gradient scalers disagree (this one's scale is {scale!r}): use one "
                   "scaler whose inf check spans every rank (ShardedGradScaler with process_group = all ranks)")
        if why:
            self._dp_phase = 2
            raise self._dp_failed(why)
        return float(h[1])

    def _dp_end(self, failed: bool, weighted_loss: float, flags, error: str = "") -> tuple[torch.Tensor, str]:
        """The step's second header, after its plan ran: [failed replicas' mask, sum of count-weighted losses, per
        local parameter whether it has a gradient]; returns it and, when a replica failed, why
        (:meth:`_dp_failure`, "" otherwise)."""
        n = len(self.local_param_ids)
        h = torch.zeros(2 + n, dtype=torch.float64)
        h[0], h[1] = self._dp_flag(failed), weighted_loss
        if flags is not None:
            h[2:] = flags
        h = self._dp_allreduce(h, f"the data-parallel replicas' status after step {self.step_index}")
        self._dp_phase = 2
        return h, (self._dp_failure(float(h[0]), error) if h[0] > 0 else "")

    def _dp_begin_step(self, batch, training: bool, count: float | None = None, scale: float = 1.0) -> None:
        """The data-parallel part of a step's start (:meth:`_dp_start`); a training step also gets its gradient
        buckets (:class:`dipc.runtime.data_parallel.GradBuckets`, all-reduced as its backwards finish them)."""
        from .data_parallel import GradBuckets

        count = self._dp_count(batch) if count is None else count
        total = self._dp_start(count, training, scale=scale)
        self._dp_count_now, self._dp_total = count, total
        if self.fsdp is not None:  # every replica is here, whatever its batch: FSDP2's all-gathers, chunk order
            self.fsdp.unshard()
        elif training:
            scale = 1.0 if self.compiled.batch_spec.loss.kind == "sum" else (count / total if total else 0.0)
            self._dp_buckets = GradBuckets(self.parameters(), self.bucket_bytes, self.dp_group, scale, self.timeout,
                                           self.tp)

    def _dp_reads(self, w: StepWorkload):
        """action -> ids of the parameters its chunk reads (for :meth:`GradBuckets.schedule`)."""
        from ..plan import stage_key

        memo: dict = {}

        def reads(a):
            fk = stage_key("F", a.chunk, a.mb, a.sub)
            prog = w.programs[fk]
            k = (id(prog), a.chunk)
            if k not in memo:
                memo[k] = {id(self.compiled._state[n]) for n in prog.chunks[a.chunk].state_names
                           if isinstance(self.compiled._state.get(n), torch.nn.Parameter)}
            return memo[k]
        return reads

    def _dp_finish(self, loss: torch.Tensor, grads: bool) -> torch.Tensor:
        """The data-parallel part of a step's end: the loss (and, with ``grads``, this step's gradients) as on the
        replicas' concatenated batch.  Replica r's loss weighs ``count_r / sum(count)`` (labelled tokens for a
        token-mean loss, samples for a sample mean; 1 for a summed loss) and so do its gradients, summed by the
        buckets' all-reduces that started during the step (``bucket_mb`` MiB per bucket).  A parameter no replica
        reached keeps no gradient, as in the unsplit model.

        Raises:
            StepFailed: another replica's step failed (every rank of every replica raises; the gradients are as
                before the step)."""
        params = self.parameters()
        flags = None
        b, fsdp = self._dp_buckets, self.fsdp
        count, total = self._dp_count_now, self._dp_total
        spec = self.compiled.batch_spec.loss
        err = None
        try:  # what a rank does alone before the header: its pipeline's ranks hear of a failure, then every replica
            if grads and fsdp is not None:
                flags = torch.tensor([1.0 if fsdp.reached(p) else 0.0 for p in params], dtype=torch.float64)
                fsdp.weigh(1.0 if spec.kind == "sum" else (count / total if total else 0.0))
            elif grads:
                b.launch_rest()
                flags = torch.tensor([0.0 if p.grad is None else 1.0 for p in params], dtype=torch.float64)
        except Exception as e:  # noqa: BLE001 - told to every rank of the mesh, then raised
            err = e
        bad = self._ranks_failing(err is not None, f"the pipeline's ranks before step {self.step_index}'s "
                                                   "data-parallel header")
        if bad:
            flags = torch.zeros(len(params), dtype=torch.float64)
        h, why = self._dp_end(bool(bad), float(loss) * count if count else 0.0, flags,
                              error=f"{type(err).__name__}: {err}"[:4000] if err is not None else
                              f"pipeline rank(s) {bad} of this replica failed after its plan")
        if why:
            if b is not None:
                b.drain()
            raise self._dp_failed(why)
        if grads and spec.kind == "token_mean" and not total:  # every replica raises this, .grad stays as before
            raise BatchError(f"step {self.step_index}: no data-parallel replica's batch has a labelled token in "
                             f"{spec.labels_key!r}: the concatenated batch's token-mean loss is undefined")
        if fsdp is not None:
            if not grads:
                fsdp.release()
            else:
                fsdp.reduce()
                for p, f in zip(params, h[2:].tolist()):
                    if f == 0:  # no replica reached it: no gradient, as in the unsplit model
                        p.grad = None
        elif grads:
            b.wait(f"the data-parallel gradient all-reduce of step {self.step_index}")
            b.copy_back({id(p) for p, f in zip(params, h[2:].tolist()) if f > 0})
            # after which of the rank's actions each bucket's all-reduce started (n_actions: after the plan)
            self.last_dp_buckets = {"started_after": list(b.launched_at), "n_actions": b.n_actions}
        out = float(h[1]) if self.compiled.batch_spec.loss.kind == "sum" else (float(h[1]) / total if total else 0.0)
        return torch.tensor(out, dtype=torch.float32)
