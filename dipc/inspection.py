"""What a :class:`dipc.CompiledPipeline` shows its user: its outputs and chunk parameters, the chunk order, tied
weights, the text of ``describe()`` and the modality report, the plan as torch.distributed.pipelining's CSV and the
generated stage sources (``save``).  Read-only over the compiled record (DESIGN.md "Contracts": the stage graphs are
inspectable before any process group exists).
"""
from __future__ import annotations

import os

import torch

from .codegen.source import chunk_source
from .passes.cost import node_latency
from .passes.modality import modality_summary, module_path

__all__ = ["InspectionMixin"]


class InspectionMixin:
    """The read-only views of a compiled pipeline (mixed into :class:`dipc.CompiledPipeline`)."""

    @property
    def outputs(self) -> list[str]:
        """The model's output keys besides the loss that forward-only evaluation can hand back (``["logits"]`` for
        a Hugging Face causal LM: the loss is computed from them; outputs the loss does not need are not in the
        captured graph)."""
        return list(self.program.capture.outputs)

    def output_reads(self, key: str, batch_key: str) -> bool:
        """True when the model output ``key`` is computed from the batch tensor ``batch_key`` (in the first
        capture's graph).

        Raises:
            KeyError: ``key`` is not one of :attr:`outputs`."""
        cap = self.program.capture
        name = cap.outputs[key]
        stack = [n for n in cap.graph.nodes if n.name == name]
        seen = set()
        sizes = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default, torch.ops.aten.sym_stride.int}
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n.op == "placeholder" and cap.input_keys.get(n.name) == batch_key:
                return True
            if n.op == "call_function" and n.target in sizes:  # a size read off the tensor, not its values
                continue
            stack.extend(n.all_input_nodes)
        return False

    def chunk_params(self, chunk: int) -> list[str]:
        """Fully qualified names of the parameters chunk ``chunk`` reads (in the main capture)."""
        cm = self.program.chunks.get(chunk)
        if cm is None:
            return []
        return [n for n in cm.state_names if isinstance(self._state.get(n), torch.nn.Parameter)]

    def tensor_parallel_plan(self, tp: int | None = None):
        """How a tensor-parallel group of ``tp`` ranks (default the compiled ``tp_size``) holds each parameter:
        Megatron's column/row split chosen from the main capture's graph
        (:func:`dipc.passes.tensor_parallel.plan_tensor_parallel`; what the runtime shards and
        :meth:`rank_state_bytes` counts; cached per ``tp``).

        Returns:
            a :class:`dipc.passes.tensor_parallel.TensorParallelPlan`.

        Raises:
            ValueError: ``tp`` is not an int >= 1."""
        from .passes.tensor_parallel import plan_tensor_parallel

        tp = self.tp_size if tp is None else tp
        cache = self.__dict__.setdefault("_tp_plans", {})
        if tp not in cache:
            cap = self.program.capture
            names = {n: fqn for n, (kind, fqn) in cap.state_targets.items() if kind == "parameter"}
            shapes = {fqn: tuple(self._state[fqn].shape) for fqn in names.values()}
            plan = plan_tensor_parallel([cap.graph], names, shapes, tp)
            aliases: dict[int, list[str]] = {}  # a tied weight's names all get its style
            for n, t in self._state.items():
                if isinstance(t, torch.nn.Parameter):
                    aliases.setdefault(id(t), []).append(n)
            for group in aliases.values():
                style = next((plan.styles[n] for n in group if n in plan.styles), None)
                if style is not None:
                    plan.styles.update(dict.fromkeys(group, style))
                    for n in group:
                        plan.replicated.pop(n, None)
            cache[tp] = plan
        return cache[tp]

    def to_torch_csv(self, plan) -> str:
        """``plan`` in torch.distributed.pipelining's compute-only CSV schedule format (one row per rank, actions
        ``{stage}F{microbatch}`` / ``{stage}B{microbatch}``, as ``PipelineScheduleMulti._load_csv`` reads), with
        stage ``i`` the chunk at position ``i`` of :meth:`chunk_order`.  torch's runtime adds the sends and receives
        and passes each stage's outputs to the next, so values that skip stages must be carried through them there.

        Raises:
            PlanError: the plan is not representable: a stage in sub-microbatches (DIP's plans; the templates run
                encoders whole), a recomputed stage, or a (chunk, microbatch) without stages (torch runs every
                stage for every microbatch: a text-only microbatch skips the encoder).
        """
        from .plan import PlanError

        pos = {c: i for i, c in enumerate(self.chunk_order())}
        seen: dict[tuple[str, int, int], int] = {}
        rows = []
        n_mb = len(plan.microbatches) or 1 + max(a.mb for acts in plan.ranks for a in acts if a.kind in ("F", "B"))
        for acts in plan.ranks:
            row = []
            for a in acts:
                if a.kind not in ("F", "B"):
                    continue
                if a.strategy != "keep":
                    raise PlanError(f"{a} recomputes ({a.strategy}): torch.distributed.pipelining schedules have no "
                                    "per-stage recompute")
                key = (a.kind, a.chunk, a.mb)
                seen[key] = seen.get(key, 0) + 1
                if seen[key] > 1:
                    raise PlanError(f"chunk {a.chunk} runs microbatch {a.mb} in sub-microbatches: not representable "
                                    "in torch.distributed.pipelining (use a template: dipc.schedules())")
                row.append(f"{pos[a.chunk]}{a.kind}{a.mb}")
            rows.append(",".join(row))
        missing = [(c, m) for c in pos for m in range(n_mb) if ("F", c, m) not in seen]
        if missing:
            raise PlanError(f"chunk {missing[0][0]} has no stage for microbatch {missing[0][1]} ({len(missing)} such): "
                            "torch.distributed.pipelining runs every stage for every microbatch")
        return "\n".join(rows) + "\n"

    def chunk_order(self) -> list[int]:
        """Every chunk index in a topological order of the chunks' data flow (the captures seen so far): the
        encoders' chunks before the loss's modality (the backbone) where both are free, then by modality and index.
        Schedule templates use it as their virtual-stage order (:mod:`dipc.codegen.templates`)."""
        import networkx as nx

        g = nx.DiGraph()
        g.add_nodes_from(c.index for c in self.partition.chunks)
        for prog in self.programs:
            for c, cm in prog.chunks.items():
                g.add_edges_from((i.src_chunk, c) for i in cm.inputs if i.kind == "value" and i.src_chunk != c)
        sinks = [c for c in g.nodes if g.out_degree(c) == 0 and g.in_degree(c) > 0] or [self.partition.chunks[-1].index]
        backbone = self.partition.chunks[max(sinks)].modality
        mods = self.partition.modalities
        mod = {c.index: c.modality for c in self.partition.chunks}
        return list(nx.lexicographical_topological_sort(
            g, key=lambda c: (mod[c] == backbone, mods.index(mod[c]), c)))

    def tied_params(self) -> list[tuple[str, tuple[int, ...], int]]:
        """Parameters read by chunks on more than one rank (e.g. a tied input embedding / LM head): ``(name, ranks,
        bytes)`` per distinct tensor, in model order; the runtime all-reduces their gradients over those ranks at the
        end of every step."""
        ranks: dict[int, set] = {}
        names: dict[int, str] = {}
        for c in self.partition.chunks:
            for n in self.chunk_params(c.index):
                t = self._state[n]
                ranks.setdefault(id(t), set()).add(c.rank)
                names.setdefault(id(t), n)
        out = []
        for n, p in self.model.named_parameters():
            rs = ranks.get(id(p), set())
            if len(rs) > 1 and p.requires_grad:
                out.append((names[id(p)], tuple(sorted(rs)), p.numel() * p.element_size()))
        return out

    def describe(self) -> str:
        """A table of the chunks: rank, modality, segment, layers, parameters, estimated forward cost, and with a
        device profile each chunk's forward + backward milliseconds on it (at B_i instances for instance modalities,
        the example batch's sizes otherwise), which the partition balanced."""
        part = self.partition
        lr = self.batch_spec.loss
        lines = [f"dipc pipeline: P={self.pp_size}, modalities {part.modalities}",
                 f"  loss: {lr.kind}" + (f" over {lr.labels_key!r} (shift {lr.shift}, ignore {lr.ignore_index})"
                                        if lr.kind == "token_mean" else "") + f" - {self.loss_form.note}"]
        for m in part.modalities:
            inst = next((i for i in self.batch_spec.instances if i.modality == m), None)
            b = f", B_i={inst.sub_microbatch_size} {m} instance(s) per sub-microbatch" if inst else ""
            if m in self.rule_notes:
                b += f" ({self.rule_notes[m]})"
            lines.append(f"  {m}: {part.n_blocks[m]} block(s) ({part.notes.get(m, '')}), "
                         f"K_i={part.chunks_per_rank[m]} chunk(s) per rank{b}, est. forward "
                         f"{node_latency(part.module_cost[m]) * 1e3:.3f} ms")
        dev_col = f" {'F+B ms on ' + self.device.name:>16}" if self.chunk_seconds else ""
        lines.append("  (K_i: chunks of the modality per rank; B_i: instances per sub-microbatch; segment: the pipeline "
                     "pass of its modality the chunk is in (its position // P); est. ms: the nominal estimate at 1 TFLOP/s"
                     + (f"; F+B ms: forward + backward on the {self.device.name} profile" if self.chunk_seconds else "")
                     + ")")
        lines.append(f"{'chunk':>5} {'rank':>4} {'modality':>12} {'segment':>7} {'params':>12} "
                     f"{'GFLOP':>9} {'est. ms':>8}{dev_col}  blocks (module calls)")
        for c in part.chunks:
            names = part.chunk_blocks(c.index)
            blocks = f"{names[0]} .. {names[-1]} ({len(names)})" if len(names) > 1 else names[0]
            n_params = sum(self._state[n].numel() for n in set(self.chunk_params(c.index)))
            lines.append(f"{c.index:>5} {c.rank:>4} {c.modality:>12} {c.segment:>7} {n_params:>12,} "
                         f"{c.cost.flops / 1e9:>9.4f} {node_latency(c.cost) * 1e3:>8.4f}"
                         + (f" {self.chunk_seconds.get(c.index, 0.0) * 1e3:>16.4f}" if self.chunk_seconds else "")
                         + f"  {blocks}")
        if self.tp_size > 1:
            lines.append(self.tensor_parallel_plan().summary())
        if self.specialized:
            dims = [f"{k}.shape[{d}]" for k, d in self.specialized]
            lines.append(f"static dims (re-captured per value when they change): {', '.join(dims)}")
        return "\n".join(lines)

    def modality_report(self) -> str:
        """Compute nodes per modality and the module paths that fell into each."""
        g = self.program.capture.graph
        lines = []
        for m, n in modality_summary(g).items():
            paths = {}
            for node in g.nodes:
                if node.meta.get("dipc_modality") == m:
                    p = module_path(node)
                    top = p[-1].split(".")[:3] if p else ["(no module)"]
                    paths[".".join(top)] = paths.get(".".join(top), 0) + 1
            lines.append(f"{m}: {n} nodes")
            for p, k in sorted(paths.items(), key=lambda x: -x[1])[:12]:
                lines.append(f"    {k:6d}  {p}")
        return "\n".join(lines)

    def save(self, directory: str) -> list[str]:
        """Write each chunk's readable generated source to ``directory/rank<r>/chunk<c>_<modality>.py`` and the
        :meth:`describe` table to ``directory/pipeline.txt``.  Returns the written paths."""
        os.makedirs(directory, exist_ok=True)
        written = []
        for c in self.partition.chunks:
            cm = self.program.chunks.get(c.index)
            d = os.path.join(directory, f"rank{c.rank}")
            os.makedirs(d, exist_ok=True)
            path = os.path.join(d, f"chunk{c.index}_{c.modality}.py")
            with open(path, "w") as f:
                f.write(chunk_source(c, cm, self.partition.chunk_blocks(c.index)))
            written.append(path)
        path = os.path.join(directory, "pipeline.txt")
        with open(path, "w") as f:
            f.write(self.describe() + "\n\n" + self.modality_report() + "\n")
        written.append(path)
        return written
