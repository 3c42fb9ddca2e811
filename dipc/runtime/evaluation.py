"""Forward-only evaluation of a :class:`dipc.runtime.PipelineRuntime` (a mixin): an evaluation plan, the loss
with or without labels, and the model's outputs (logits) gathered on the last rank.  The plan runs through the same
"run the plan, exchange status" routine as a training step (:meth:`dipc.runtime.faults.FaultExchangeMixin._run_plan`)."""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from ..planner.workload import StepWorkload
from .executor import Executor
from .transport import TransportError


class EvaluationMixin:
    """The runtime's evaluation methods (:mod:`dipc.runtime.evaluation`)."""

    def eval_step(self, batch: Mapping[str, torch.Tensor], n_microbatches: int | None = None,
                  schedule: str | None = None, outputs: Sequence[str] | str | None = None):
        """The loss of ``batch`` by a forward-only pipeline (Megatron's ``forward_only=True``): each rank runs its
        forwards in the order of ``schedule``'s plan (default "1f1b"; :func:`dipc.schedules`) with the backwards
        dropped (:func:`dipc.plan.forward_only`), without autograd (nothing is kept for a backward; an output is
        freed after its last reader), and sends activations only.  No gradient, optimizer state or step counter
        changes; the background planner's look-ahead for the next training step stays valid.  ``pipe.step`` under
        ``torch.no_grad()`` or ``torch.inference_mode()`` runs this.

        The chunks run as the model was captured: a model compiled in training mode runs its dropout (dipc's
        models are deterministic; compile a model with dropout in ``eval()`` mode for evaluation numbers).

        Args:
            batch: as for :meth:`step`.  With ``outputs``, a token-mean model's labels may be left out (an
                evaluation for a metric or for generation): they are filled with the loss's ignore index, which only
                its loss reads (checked: an output computed from the labels is refused), and no loss is returned.
            n_microbatches: default the runtime's.
            schedule: whose forward order to follow; default "1f1b" (no sub-microbatches, no planning search).
            outputs: model output keys to hand back besides the loss, e.g. ``["logits"]``
                (:attr:`CompiledPipeline.outputs` lists those the model has): each microbatch's values are sent to
                the pipeline's last rank and concatenated there in sample order along dim 0 (``logits`` ``[B, S,
                vocab]`` for the whole ``batch``; 0-dim values are stacked, ``[n_microbatches]``).  Under data
                parallelism each pipeline's last rank gets its own batch's.

        Returns:
            without ``outputs``: the batch loss (0-dim float32), identical on every rank and equal to the unsplit
            model's under ``torch.no_grad()`` up to float rounding.  With ``outputs``: ``(loss, values)``, ``loss``
            None when the labels were left out, ``values`` a dict key -> tensor on the last rank and None on the
            others.

        Raises:
            ValueError: an unknown output key, labels left out without ``outputs``, or an asked-for output that
                reads the labels (on every rank, before any activation moves).
            as :meth:`step` (on every rank, before any activation moves, for bad input or ranks that disagree,
            including one rank evaluating while another trains or asking for other outputs); ``StepFailed`` for a
            failure inside the plan.
        """
        if self.dp_size == 1:
            return self._tracked(lambda: self._eval_step(batch, n_microbatches, schedule, outputs))

        def run():
            self._dp_begin_step(batch, training=False)
            res = self._eval_step(batch, n_microbatches, schedule, outputs)
            if outputs is None:
                return self._dp_finish(res, grads=False)
            loss, values = res
            if loss is None:  # no labels: nothing to average, but the replicas still check each other
                self._dp_finish(torch.zeros(()), grads=False)
                return None, values
            return self._dp_finish(loss, grads=False), values
        return self._tracked(lambda: self._dp_guard(run))

    def _eval_request(self, batch, outputs) -> tuple[tuple[str, ...], Mapping, bool]:
        """``(output keys, batch, labelled)`` for :meth:`eval_step`: the keys checked, and a batch without labels
        given labels of the ignore index (``labelled`` False).

        Raises:
            ValueError: see :meth:`eval_step`."""
        comp = self.compiled
        if outputs is None:
            keys: tuple[str, ...] = ()
        else:
            keys = (outputs,) if isinstance(outputs, str) else tuple(outputs)
            if not keys or not all(isinstance(k, str) for k in keys) or len(set(keys)) != len(keys):
                raise ValueError(f"outputs must be output keys (distinct strings), got {outputs!r}")
            have = comp.outputs
            bad = [k for k in keys if k not in have]
            if bad:
                dropped = comp.program.capture.dropped_outputs
                raise ValueError(f"outputs {bad}: {type(comp.model).__name__} returns {sorted(have) or 'no output'} "
                                 "besides the loss that an evaluation can hand back"
                                 + (f" ({list(dropped)} are not computed on the way to the loss, so they are not in "
                                    "the captured graph)" if dropped else ""))
        spec = comp.batch_spec.loss
        if not isinstance(batch, Mapping) or spec.kind != "token_mean" or not spec.labels_key or \
                spec.labels_key in batch:
            return keys, batch, True
        if not keys:
            raise ValueError(f"the batch has no {spec.labels_key!r}: an evaluation without labels computes no loss; "
                             "ask for outputs=[...] (e.g. 'logits')")
        ref = batch.get("input_ids")
        if not isinstance(ref, torch.Tensor):
            raise ValueError(f"the batch has no {spec.labels_key!r} and no 'input_ids' to shape labels after")
        reading = [k for k in keys if comp.output_reads(k, spec.labels_key)]
        if reading:
            raise ValueError(f"outputs {reading} of {type(comp.model).__name__} are computed from "
                             f"{spec.labels_key!r}: they cannot be evaluated without labels")
        batch = dict(batch)
        batch[spec.labels_key] = torch.full_like(ref, spec.ignore_index)
        return keys, batch, False

    def _eval_step(self, batch: Mapping[str, torch.Tensor], n_microbatches: int | None = None,
                   schedule: str | None = None, outputs=None):
        """The body of :meth:`eval_step` (one pipeline)."""
        schedule = "1f1b" if schedule is None else schedule
        try:
            keys, batch, labelled = self._eval_request(batch, outputs)
            refused = None
        except ValueError as e:
            keys, labelled, refused = (), True, e
        # planning may capture a new program: that is a training trace, whatever grad mode the caller is in
        with torch.inference_mode(False), torch.enable_grad():
            batch, mbs, early, n = self._split(batch, n_microbatches, schedule, not labelled, refused)
            w, plan = self.plan_step(mbs, schedule, batch, early=early, forward_only=True,
                                     tag=f"|outputs:{','.join(keys)}" if keys else "")

        def configure(ex: Executor) -> None:
            ex.want_outputs = frozenset(keys)

        ex, loss = self._run_plan(w, plan, f"evaluation at step {self.step_index}", configure, grad=False,
                                  labelled=labelled)
        if outputs is None:
            return loss
        try:
            values = self._gather_outputs(ex, w, keys)
        except TransportError as e:
            self._broken = f"evaluation at step {self.step_index} ({e})"
            raise
        return (loss if labelled else None), values

    def _gather_outputs(self, ex: Executor, w: StepWorkload, keys) -> dict[str, torch.Tensor] | None:
        """The evaluation outputs ``keys`` of every microbatch, on the last rank of the pipeline: each rank that
        computed some sends a JSON header (key, microbatch, sub-microbatch, shape, dtype per tensor) and the
        tensors; the last rank concatenates them in microbatch (then sub-microbatch) order.  Returns None on the
        other ranks.

        Raises:
            TransportError: a message did not arrive within the runtime's timeout."""
        from ..wire import decode_json, encode_json

        dst = self.world - 1
        owners, computed = set(), set()
        for k, st in w.graph.stages.items():
            have = [x for x in keys if st.kind == "F" and x in w.programs[k].chunks[st.chunk].extra]
            if have:
                owners.add(st.rank)
                computed.update(have)
        empty = {x: self._empty_output(w, x) for x in keys if x not in computed}  # e.g. image features, no image
        tag = self._OUTPUTS_TAG
        if self.rank != dst:
            if self.rank in owners:
                items = sorted(ex.extra.items())
                head = torch.frombuffer(bytearray(encode_json(
                    [[k, m, s, list(t.shape), str(t.dtype).removeprefix("torch.")] for (k, m, s), t in items])),
                    dtype=torch.uint8).to(self.device)
                works = [self.transport.isend(torch.tensor([head.numel()], device=self.device), dst, tag),
                         self.transport.isend(head, dst, tag + 1)]
                works += [self.transport.isend(t.contiguous(), dst, tag + 2) for _, t in items]
                for wk in works:
                    self.transport.wait(wk, "the evaluation outputs' transfer to the last rank")
            return None
        got = dict(ex.extra)
        for r in sorted(owners - {dst}):
            n = torch.zeros(1, dtype=torch.int64, device=self.device)
            self.transport.wait(self.transport.irecv(n, r, tag), f"the evaluation outputs' header from rank {r}")
            head = torch.empty(int(n.item()), dtype=torch.uint8, device=self.device)
            self.transport.wait(self.transport.irecv(head, r, tag + 1), f"the evaluation outputs' header from rank {r}")
            for k, m, s, shape, dtype in decode_json(bytes(head.cpu().numpy().tobytes())):
                t = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
                self.transport.wait(self.transport.irecv(t, r, tag + 2), f"evaluation output {k!r} from rank {r}")
                got[(k, m, s)] = t
        values = dict(empty)
        for key in keys:
            if key in empty:
                continue
            parts = [t for (k, _, _), t in sorted(got.items(), key=lambda kv: kv[0][1:]) if k == key]
            values[key] = torch.stack(parts) if parts[0].dim() == 0 else torch.cat(parts)
        return values

    def _empty_output(self, w: StepWorkload, key: str) -> torch.Tensor:
        """The value of output ``key`` when no stage of the step computes it (an encoder's output for a batch
        without images): an empty tensor, 0 in dim 0 and the other dims as the capture has them.

        Raises:
            ValueError: those dims depend on the batch (on every rank: they all see the same step)."""
        from ..planner.workload import autocast_dtypes

        for prog in self.compiled.programs:
            for cm in prog.chunks.values():
                meta = cm.extra_meta.get(key)
                if meta is None:
                    continue
                data = w.microbatches[0].data if w.microbatches else {}
                bind = {sym: int(data[k].shape[d]) for sym, k, d in prog.bindings
                        if isinstance(data.get(k), torch.Tensor) and d < data[k].dim()}
                rest = []
                for d in meta.shape[1:]:
                    d = d if isinstance(d, int) else d.xreplace(bind)
                    rest.append(int(d) if isinstance(d, int) or d.is_number else None)
                if None in rest or not meta.shape:
                    raise ValueError(f"output {key!r} is computed by no stage of this batch (e.g. an encoder's "
                                     f"output and no image) and its shape {list(meta.shape)} depends on the batch: "
                                     "dipc cannot make it empty")
                dtype = autocast_dtypes(prog, w.amp).get(prog.capture.outputs.get(key), meta.dtype)
                return torch.empty([0, *rest], dtype=dtype, device=self.device)
        raise ValueError(f"output {key!r} is computed by no chunk")
