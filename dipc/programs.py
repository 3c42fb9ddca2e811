"""The program cache of a :class:`dipc.CompiledPipeline` (a mixin): captures of the model (torch.export) and their
chunk modules, one per distinct key set, static dims and static values of a (sub-)microbatch, made on first use
and looked up by a dict per step."""
from __future__ import annotations

import warnings
from typing import Any, Mapping

import torch
import torch.fx

from .batch import BatchError
from .capture import Capture, CaptureError, _ancestors, capture, is_meta, signature_of
from .check import check_capture
from .codegen.stage import build_chunk_modules
from .errors import NeedsCapture
from .passes.checks import place_checks
from .passes.datasizes import size_program
from .passes.modality import annotate_modality
from .passes.partition import apply_partition
from .program import Program, _bindings, _carries_grad, _data_dependent


class ProgramCacheMixin:
    """The compiled pipeline's captures and programs (:mod:`dipc.programs`)."""

    # ------------------------------------------------------------------ programs
    def traced(self, data: Mapping[str, Any]) -> dict:
        """``data`` as the trace sees it: the ``static_keys`` tensors as nested Python lists (constants)."""
        out = dict(data)
        for k in self.static_keys:
            if isinstance(out.get(k), torch.Tensor):
                out[k] = out[k].tolist()
        return out

    def _capture(self, data: Mapping[str, Any], first: bool = False) -> Capture:
        """Capture ``model(**data)``.  When the first capture fails on a size or branch that depends on data,
        small integer tensors of the batch (not its tokens or labels) are retried as static values - the
        ``.tolist()`` of Hugging Face LLaVA-NeXT's ``image_sizes`` - with a warning naming them."""
        import contextlib

        # the caller may be inside torch.autocast (a new shape met in an autocast step): a capture is the model's own
        # graph; autocast is applied when the chunks run
        with contextlib.ExitStack() as stack:
            for kind in ("cpu", "cuda"):
                if torch.is_autocast_enabled(kind):
                    stack.enter_context(torch.autocast(kind, enabled=False))
            return self._capture_plain(data, first)

    def _capture_plain(self, data: Mapping[str, Any], first: bool = False) -> Capture:
        try:
            return capture(self._tracer(), self._trace_data(data), dynamic=self.dynamic, loss_key=self.loss_key,
                           forward=self._recipe())
        except CaptureError as e:
            if not first or self.static_keys or not _data_dependent(e):
                raise
            guess = [k for k, v in data.items() if isinstance(v, torch.Tensor) and not v.is_floating_point()
                     and 0 < v.numel() <= 4096 and k not in (self.batch_spec_keys_excluded(data))]
            if not guess:
                raise
            self.static_keys = guess
            try:
                cap = capture(self._tracer(), self._trace_data(data), dynamic=self.dynamic, loss_key=self.loss_key,
                              forward=self._recipe())
            except CaptureError:
                self.static_keys = []
                raise e
            warnings.warn(f"dipc: {type(self.model).__name__}'s forward reads the values of {guess} (e.g. with "
                          ".tolist()): they are static in its trace, re-captured per distinct value; pass "
                          "static_keys= to say so", stacklevel=4)
            return cap

    def _recipe(self):
        """The capture recipe of the traced module (:mod:`dipc.recipes`), when the compiler kept one."""
        if not getattr(self, "use_recipe", False):
            return None
        from .recipes import recipe_for
        return recipe_for(self._tracer())

    def _tracer(self) -> torch.nn.Module:
        """The module torch.export traces: the model, or after a runtime materialised its rank's part of a
        meta-device model (:meth:`dipc.runtime.PipelineRuntime`), the all-meta copy it kept (in the model's mode)."""
        twin = getattr(self, "_trace_model", None)
        if twin is None:
            return self.model
        twin.train(self.model.training)
        return twin

    def _trace_data(self, data: Mapping[str, Any]) -> dict:
        """:meth:`traced` ``data``, its tensors on the meta device when the traced model is (a meta model's trace
        sees only shapes and dtypes; the graph's ``device=meta`` constants are set to the rank's device when its
        chunks first run)."""
        out = self.traced(data)
        if self._traces_on_meta():
            out = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in out.items()}
        return out

    def _traces_on_meta(self) -> bool:
        return is_meta(self._tracer())

    @staticmethod
    def batch_spec_keys_excluded(data: Mapping[str, Any]) -> set[str]:
        """Integer keys never made static by the retry: tokens, labels and masks over tokens."""
        from .batch import TOKEN_ALIGNED
        return {"input_ids"} | TOKEN_ALIGNED | {k for k in data if k.endswith("input_ids")}

    def _program_from(self, cap: Capture) -> Program:
        state = self._state_with(cap)
        sizes = size_program(cap.graph, cap.input_keys, cap.state_targets, cap.constants)
        chunks = build_chunk_modules(cap.graph, cap.state_targets, cap.input_keys, cap.loss_node, state,
                                     len(self.partition.chunks), build=self._build,
                                     data_symbols=sizes.symbols if sizes is not None else (),
                                     extra_outputs=cap.outputs)
        bindings = _bindings(cap)
        boundary: dict[str, list[str]] = {}
        mod_of = {c.index: c.modality for c in self.partition.chunks}
        for c, cm in chunks.items():
            for inp in cm.inputs:
                if inp.kind == "value" and mod_of[inp.src_chunk] != mod_of[c]:
                    lst = boundary.setdefault(mod_of[inp.src_chunk], [])
                    if inp.name not in lst:
                        lst.append(inp.name)
        order = {n.name: i for i, n in enumerate(cap.graph.nodes)}
        for m in boundary:
            boundary[m].sort(key=order.__getitem__)
        by_name = {n.name: n for n in cap.graph.nodes}
        boundary_keys = {name: frozenset(cap.input_keys[a.name] for a in _ancestors([by_name[name]])
                                         if a.op == "placeholder" and a.name in cap.input_keys)
                         for names in boundary.values() for name in names}
        # parameters the loss reaches through values that carry a gradient (not through .detach() or no_grad):
        # autograd gives those a gradient in the unsplit model, zero or not, and the others none
        loss_params, stack, seen = set(), [next(n for n in cap.graph.nodes if n.name == cap.loss_node)], set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n.op == "placeholder" and cap.state_targets.get(n.name, ("",))[0] == "parameter":
                loss_params.add(cap.state_targets[n.name][1])
            if n.op == "placeholder" or _carries_grad(n):
                stack.extend(n.all_input_nodes)
        prog = Program(capture=cap, chunks=chunks, bindings=bindings, boundary=boundary, loss_params=loss_params,
                       sizes=sizes, boundary_keys=boundary_keys)
        prog.builder = lambda c, prog=prog: self._build_chunk(prog, c)
        prog.training = self.model.training  # the mode it was captured in (see mode_dependent)
        prog.meta_trace = self._traces_on_meta()  # its graph's device constants say "meta" (see _trace_data)
        if self.device is not None:
            prog.chunk_costs = self._chunk_costs(cap)
            prog.block_costs_of = self._block_costs
        return prog

    def build_only(self, chunks: set[int] | None) -> None:
        """Keep GraphModules only for ``chunks`` (a pipeline rank's own; ``None``: all): the other chunks' modules of
        every program are dropped now, later captures build only these, and a module asked for anyway
        (:meth:`dipc.program.Program.module`, e.g. by :func:`dipc.runtime.run_local` in this process) is built
        then.  :class:`dipc.runtime.PipelineRuntime` calls it with its rank's chunks."""
        self._build = None if chunks is None else set(chunks)
        if self._build is None:
            return
        for prog in self.programs:
            for c, cm in prog.chunks.items():
                if c not in self._build:
                    cm.gm = None

    def _state_with(self, cap: Capture) -> dict[str, torch.Tensor]:
        """The model's current parameters and buffers by name, plus ``cap``'s lifted constants."""
        state = dict(self._state)
        for name, t in cap.constants.items():
            state.setdefault(name, t)
        return state

    def _build_chunk(self, prog: Program, chunk: int) -> torch.fx.GraphModule:
        """``chunk``'s GraphModule of ``prog``, generated now from its capture with the model's current tensors."""
        cap = prog.capture
        return build_chunk_modules(cap.graph, cap.state_targets, cap.input_keys, cap.loss_node, self._state_with(cap),
                                   len(self.partition.chunks), build={chunk},
                                   data_symbols=prog.sizes.symbols if prog.sizes is not None else (),
                                   extra_outputs=cap.outputs)[chunk].gm

    def _check_sub_microbatching(self, prog: Program) -> None:
        """Chunks of a sub-microbatched modality may read only its instance keys and its own chunks' values."""
        mod_of = {c.index: c.modality for c in self.partition.chunks}
        keys_of: dict[str, list[str]] = {}  # modality -> the keys of all its instance kinds
        for inst in self.batch_spec.instances:
            keys_of.setdefault(inst.modality, []).extend(k for k in inst.keys if k not in keys_of.get(inst.modality, []))
        for inst in self.batch_spec.instances:
            for c, cm in prog.chunks.items():
                if mod_of[c] != inst.modality:
                    continue
                for i in cm.inputs:
                    if i.kind == "batch" and i.key not in keys_of[inst.modality]:
                        raise BatchError(f"chunk {c} ({inst.modality}) reads batch key {i.key!r}, which is not one of "
                                         f"its instance keys {keys_of[inst.modality]}: it cannot run on "
                                         "sub-microbatches")
                    if i.kind == "value" and mod_of[i.src_chunk] != inst.modality:
                        raise BatchError(f"chunk {c} ({inst.modality}) reads {i.name!r} from a {mod_of[i.src_chunk]} "
                                         "chunk: it cannot run on sub-microbatches")

    def _widened(self, data: Mapping[str, Any]) -> Mapping[str, Any]:
        """``data`` to trace: an instance kind with exactly one instance gets it twice (rows, side keys; the text is
        unchanged), so torch.export does not fix that count at 1 (its 0/1 rule) and the capture serves every count
        of that key set, as one traced at 2 or more does (a trace sees shapes only); a kind fed as 0 instances
        (``Instances.drop_with_modality``) gets two of the example batch's.  ``data`` itself where the
        model reads instance values as constants (``static_keys``) or no kind has one instance."""
        if self.static_keys:
            return data
        out = None
        for inst in self.batch_spec.instances:
            if inst.per_sample or not inst.present(data) or inst.n_instances(data) != 1:
                continue
            out = dict(data) if out is None else out
            for k, v in inst.cut(data, 0, 1).items():
                out[k] = torch.cat([v, v])
        for inst in self.batch_spec.instances:  # a kind fed as 0 instances beside its modality's others
            if not inst.drop_with_modality or not inst.present(data) or inst.n_instances(data):
                continue
            example = self.batch_spec.normalize(self._example_batch)
            n = inst.n_instances(example)
            if n:  # traced with 2 of the example's (the trace sees shapes only), so it serves 0 and any count
                out = dict(data) if out is None else out
                for k, v in inst.cut(example, 0, min(n, 2)).items():
                    out[k] = torch.cat([v, v]) if n == 1 else v
        return data if out is None else out

    def _candidates(self, traced: Mapping[str, Any]) -> list[Program]:
        """The programs whose capture has ``traced``'s keys, static-dim values and Python values (what
        :meth:`dipc.capture.Capture.fits` compares), in :attr:`programs` order: a dict lookup per distinct set of
        static dims instead of a scan of every capture, which every stage of every step made (LLaVA captures once
        per image count: dozens of programs)."""
        from .capture import python_values, signature_of

        index = getattr(self, "_program_index", None)
        if index is None or index[0] is not self.programs or index[1] != len(self.programs):
            groups: dict[tuple, dict[tuple, list[int]]] = {}
            for i, prog in enumerate(self.programs):
                cap = prog.capture
                groups.setdefault(tuple(cap.specialized), {}).setdefault(
                    (cap.keys, tuple(cap.signature), tuple(cap.values)), []).append(i)
            index = self._program_index = (self.programs, len(self.programs), groups)
        keys, values = frozenset(traced), python_values(traced)
        found: list[int] = []
        for specialized, table in index[2].items():
            found.extend(table.get((keys, signature_of(traced, specialized), values), ()))
        return [self.programs[i] for i in sorted(found)]

    def program_for(self, data: Mapping[str, torch.Tensor], whole: bool = True) -> Program:
        """A program whose graph fits ``data``: every dim static in that capture (fixed by the model, by
        torch.export's 0/1 rule or by the user) has ``data``'s value.  Captured on first use and cached; a new capture
        can fix more dims than the first one (e.g. an image count of 1), so each program is checked against its own
        static dims and no graph ever runs with a stale shape.

        Args:
            data: a microbatch, or a sub-microbatch view (instance keys sliced).

        A model with dropout (:attr:`mode_dependent`) is captured per mode: the program is one captured while the
        model was in its current mode (``model.train()`` / ``model.eval()``, which ``pipe.train()`` / ``pipe.eval()``
        set); a model without runs the same graphs in both.
            whole: ``data`` is a whole microbatch (the eager model can run it): with ``check``, a new capture is
                compared with the eager model (:func:`dipc.check.check_capture`).
        """
        traced = self.traced(data)
        mode = self.model.training
        if not self.mode_dependent and mode not in self._modes_seen and getattr(self, "allow_capture", True):
            self._modes_seen.add(mode)
            other = self._capture(self._example_batch)
            def ops(g):  # each op with its constant arguments (dropout's train flag, ...)
                return [(str(n.target), [repr(a) for a in n.args if not isinstance(a, torch.fx.Node)])
                        for n in g.nodes if n.op == "call_function"]
            if ops(other.graph) != ops(self.program.capture.graph):
                self.mode_dependent = True
        empty = frozenset(k for i in self.batch_spec.instances if i.drop_with_modality for k in i.keys)
        for prog in self._candidates(traced):  # a capture fits when every dim static in *its* graph has the
            if prog.fits(data, traced, empty) and (not self.mode_dependent or prog.training == mode):  # batch's value
                return prog
        if not getattr(self, "allow_capture", True):  # rank 0's background planner: the training process captures
            raise NeedsCapture(f"no capture of {type(self.model).__name__} fits a microbatch with shapes "
                               f"{ {k: list(v.shape) for k, v in data.items() if isinstance(v, torch.Tensor)} }")
        sig = signature_of(data, self.specialized)
        dims = sorted({f"{k}.shape[{d}]" for (k, d), a, b in zip(self.specialized, sig, self.program.capture.signature)
                       if a is not None and a != b} - self._warned)
        keys = sorted({f"without {k}" for k in self.program.capture.keys if k not in data} - self._warned)
        if dims or keys:
            self._warned.update(dims + keys)
            why = []
            if dims:
                why.append(f"the model fixes {', '.join(dims)} when traced (e.g. with list(tensor))")
            if keys:
                why.append(f"a microbatch {' and '.join(keys)} (e.g. text-only) runs another graph")
            # stacklevel: past this, build_workload and its gc_paused wrapper, to build_workload's caller
            warnings.warn(f"dipc: {'; '.join(why)}: dipc captures the model once per distinct value or key set "
                          "(about one torch.export each, 2-20 s) and caches it", stacklevel=4)
        wide = self._widened(data)
        cap = self._capture(wide)
        if wide is not data and not cap.fits(traced):  # the model fixed the widened count: trace the data itself
            cap = self._capture(data)
        prog = self._finish_program(cap, data, whole)
        if wide is not data and not prog.fits(data, traced, empty):  # a bound the widened trace derived excludes
            prog = self._finish_program(self._capture(data), data, whole)  # the data (no capture made each step)
        self.programs.append(prog)
        return prog

    def _finish_program(self, cap, data: Mapping[str, Any], whole: bool) -> Program:
        """The program of a new capture of ``data``: checked against the eager model (``check``, whole
        microbatches), labelled, partitioned."""
        if self.check and whole:
            check_capture(self.model, cap, self.batch_spec.eager_view(data), loss_key=self.loss_key)
        annotate_modality(cap.graph, self.rules)
        self._one_segment_labels(cap.graph)
        apply_partition(cap.graph, self.partition)
        place_checks(cap.graph, self.partition)
        return self._program_from(cap)
