"""``dipc.compile``: capture -> passes -> codegen, into an inspectable :class:`CompiledPipeline`.

Compilation needs no process group and no device (DESIGN.md "Data flow").  The static part of DIP's
modality-aware partitioning (shared/PAPER.md §2.1) is done here: modality annotation, cost estimate, per-module
balanced chunks with K_i chunks per rank placed VPP-style, per-chunk GraphModules.  The per-batch part
(sub-microbatches, schedule, execution) lives in :mod:`dipc.runtime`.

Re-capture: when torch.export specializes a dim that varies between batches (Hugging Face LLaVA fixes the image
count), the pipeline keeps one *program* (a capture and its chunk modules, partitioned with the same block ranges)
per distinct value of the specialized dims, made on first use and cached; a one-time warning names the dims.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
import warnings
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.fx

from .batch import BatchError, BatchSpec, Instances, LossReduction, batch_spec_from_example
from .capture import CaptureError, is_meta
from .check import check_capture, check_pipeline
from .passes.cost import annotate_cost
from .passes.modality import DEFAULT_RULES, annotate_modality, modality_summary, module_path, rule_modality
from .passes.checks import place_checks
from .passes.lossform import loss_form
from .passes.partition import Partition, PartitionError, partition
from .program import Program, _check_acyclic, _tied_dims, index_ranges
from .families import _auto_instances, _loss_from_form
from .costing import CostingMixin, _param_weights, _state_weights
from .inspection import InspectionMixin
from .planner.planning import check_memory_headroom
from .programs import ProgramCacheMixin
from .recipes import recipe_agrees, recipe_for, recipe_variable_dims, runs_empty_kinds

__all__ = ["compile", "CompiledPipeline", "Program", "ONE_SEGMENT"]

#: the module name of every node with ``compile(..., one_segment=True)``
ONE_SEGMENT = "model"


def _rule_hit(node, rules) -> bool:
    return rule_modality(module_path(node), rules, True) is not None


class CompiledPipeline(ProgramCacheMixin, CostingMixin, InspectionMixin):
    """A model compiled into modality chunks for ``pp_size`` pipeline ranks.

    Build it with :func:`compile`.  Inspect with :meth:`describe`, :meth:`modality_report`, :attr:`partition` and
    :attr:`program` (its ``chunks[c].gm`` are the generated GraphModules); write sources with :meth:`save`; train
    with :meth:`runtime` in each of the ``pp_size`` processes.

    ``mode_dependent``: the model has dropout (or a batch norm), so its ``train()`` and ``eval()`` forwards
    differ and :meth:`program_for` keeps a capture per mode.
    """

    #: bytes per device plans leave free under their memory limit (``dipc.compile(..., memory_headroom=)``; None:
    #: the default of :func:`dipc.planner.planning.headroom_bytes`)
    memory_headroom: float | None = None

    def __init__(self, model: torch.nn.Module, example_batch: Mapping[str, torch.Tensor], pp_size: int, *,
                 modalities: Mapping[str, Sequence[str]] | None, chunks_per_rank: Mapping[str, int] | None,
                 instances: Sequence[Instances], loss: LossReduction, dynamic: Mapping[str, Mapping[int, Any]] | None,
                 loss_key: str, build: set[int] | None = None, device=None, auto_b: set[str] | None = None,
                 check: bool = False, split_points: Mapping[str, Sequence[str]] | None = None,
                 shared_keys: Sequence[str] = (), static_keys: Sequence[str] = (), tp_size: int = 1,
                 balance: str = "time", one_segment: bool = False, progress: bool | None = None,
                 fsdp_size: int = 1, sequence_parallel: bool = False):
        self._progress = _Progress(progress)
        self.model = model
        self.one_segment = one_segment
        self.check = check and not is_meta(model)
        self.device = device
        self.pp_size = pp_size
        self.tp_size = tp_size
        #: FSDP2's shard count on the mesh's "dp" dim (1: parameters whole on every replica), which the memory model
        #: and the simulator plan for (:meth:`rank_state_parts`, :func:`dipc.sim.simulate.fsdp_seconds`)
        self.fsdp_size = fsdp_size
        #: the cost model divides every op and the messages by ``tp_size`` (Megatron's sequence parallelism), not
        #: only the split ones (:meth:`dipc.costing.CostingMixin._tp_div`); modelled, not run by the runtime yet
        self.sequence_parallel = sequence_parallel
        self.rules = dict(modalities) if modalities is not None else dict(DEFAULT_RULES)
        self.dynamic = dynamic
        self.loss_key = loss_key
        inst_keys = {k for i in instances for k in i.keys}
        variable = {(k, d) for k, dims in (dynamic or {}).items() if k in inst_keys
                    for d, spec in dims.items() if spec is not None}
        self._state: dict[str, torch.Tensor] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            self._state[name] = p
        for name, b in model.named_buffers(remove_duplicate=False):
            self._state[name] = b
        self._build = build
        self._warned: set = set()
        self.static_keys = list(static_keys)
        # a capture recipe reads every instance value at run time; static_keys asks for them as trace constants
        # (re-captured per value), which the recipe's custom ops cannot take: the model's own forward then
        self.use_recipe = not self.static_keys and recipe_agrees(model, example_batch, loss_key)
        if self.use_recipe:  # dims the recipe keeps symbolic that the batch layout would fix (tiles per image)
            variable |= recipe_variable_dims(model)
        try:
            cap = self._capture(example_batch, first=True)
        except CaptureError as e:
            if self.use_recipe or recipe_for(model) is None:
                raise
            raise CaptureError(f"{e}\n(dipc's capture recipe for {type(model).__name__}, which traces such code, was "
                               "dropped: it does not reproduce the model's forward on the example batch, e.g. under "
                               "a setting the recipe does not carry, such as dropout inside the vision attention)") \
                from e
        self._progress.done("capture (torch.export)")
        if self.check:
            check_capture(model, cap, example_batch, loss_key=loss_key)
            self._progress.done("check of the capture against the model")
        self.loss_form = loss_form(cap.graph, cap.loss_node, cap.input_keys)
        if loss is None and self.loss_form.uncertain:
            warnings.warn(f"dipc: {type(model).__name__}: {self.loss_form.note}", stacklevel=3)
        loss = _loss_from_form(loss, self.loss_form)
        self.batch_spec: BatchSpec = batch_spec_from_example(example_batch, instances, loss, variable,
                                                             index_ranges(cap), shared=shared_keys,
                                                             tied=_tied_dims(cap))
        self.batch_spec.sample_constants = _sample_constants(self.batch_spec, self.static_keys, example_batch)
        annotate_modality(cap.graph, self.rules)
        self.rules_matched = any(_rule_hit(n, self.rules) for n in cap.graph.nodes if n.op == "call_function")
        if modalities is not None:
            found = set(modality_summary(cap.graph))
            unused = [m for m in modalities if m not in found]
            if unused:
                raise ValueError(f"modalities rule(s) {[(m, list(modalities[m])) for m in unused]} match no module "
                                 f"of {type(model).__name__}; the graph's modalities are {sorted(found)}")
        self._one_segment_labels(cap.graph)
        annotate_cost(cap.graph)
        self.rule_notes: dict[str, str] = {}
        module_latency = node_seconds = None
        if device is not None:
            instances, module_latency, node_seconds = self._dip_rules(cap, instances, auto_b or set())
            self.batch_spec.instances = list(instances)
        if self.use_recipe and runs_empty_kinds(model):  # one capture for every mix of a modality's kinds
            many = {i.modality for i in self.batch_spec.instances
                    if sum(o.modality == i.modality for o in self.batch_spec.instances) > 1}
            self.batch_spec.instances = [dataclasses.replace(i, drop_with_modality=True)
                                         if i.modality in many and i.drop_when_empty else i
                                         for i in self.batch_spec.instances]
        weights = node_seconds
        if balance == "params":  # Megatron-LM's layer split: chunks of about equal parameter count
            weights, module_latency = _param_weights(cap, model), None
        self.partition: Partition = partition(cap.graph, pp_size, chunks_per_rank=chunks_per_rank,
                                              module_latency=module_latency, node_seconds=weights,
                                              split_points=split_points)
        capacity = getattr(device, "memory_capacity", None) if device is not None else None
        if capacity and balance == "time" and split_points is None:
            # a time balance may pile parameters onto few ranks (a language model's layers cost less time per
            # parameter than a vision encoder's over many image tokens): keep each chunk's parameters, gradients
            # and optimizer states under 70% of the device's memory over the rank's chunks, as nnScaler's planner
            # keeps every stage within the device
            state = _state_weights(cap, model, tp_size)
            per_rank = [0.0] * pp_size
            for n in cap.graph.nodes:
                if n.op == "call_function":
                    per_rank[self.partition.chunks[n.meta["dipc_chunk"]].rank] += state.get(n.name, 0.0)
            if max(per_rank) > STATE_SHARE * capacity:
                k = sum(self.partition.chunks_per_rank.values())
                try:
                    capped = partition(cap.graph, pp_size, chunks_per_rank=dict(self.partition.chunks_per_rank),
                                       module_latency=module_latency, node_seconds=weights,
                                       node_bytes=state, max_chunk_bytes=STATE_SHARE * capacity / k)
                except PartitionError:  # no cut under equal per-chunk shares: keep the plain time balance
                    capped = partition(cap.graph, pp_size, chunks_per_rank=chunks_per_rank,
                                       module_latency=module_latency, node_seconds=weights,
                                       split_points=split_points)
                else:
                    capped.notes = {m: v + f"; chunks capped at {STATE_SHARE * capacity / k:.3g} bytes of "
                                    "parameters, gradients and optimizer states per GPU (a time balance put "
                                    f"{max(per_rank):.3g} on one rank)" for m, v in capped.notes.items()}
                self.partition = capped
        self.check_notes = place_checks(cap.graph, self.partition)
        if self.rules_matched is False:
            self.partition.notes[self.partition.modalities[0]] += (
                "; no modality rule matched any module, so the whole model is one modality: name its parts with "
                "modalities={'vision': ['<module path>'], 'text': [...]}")
        # forward + backward seconds per chunk on the device profile, at the sizes the partition balanced
        self.chunk_seconds: dict[int, float] = {}
        if node_seconds is not None:
            for n in cap.graph.nodes:
                if n.op == "call_function":
                    c = n.meta["dipc_chunk"]
                    self.chunk_seconds[c] = self.chunk_seconds.get(c, 0.0) + node_seconds.get(n.name, 0.0)
        for inst in instances:
            if inst.modality not in self.partition.modalities and not one_segment:
                raise BatchError(f"instances of modality {inst.modality!r} are declared but the model has modalities "
                                 f"{self.partition.modalities}")
        self.specialized = cap.specialized
        # a model whose forward differs between train() and eval() (dropout) gets a capture per mode; when its
        # modules do not say so (F.dropout(h, 0.3, self.training)), the first step in the other mode captures the
        # example batch in that mode and compares the graphs
        self.mode_dependent = _mode_dependent(model) or _has_dropout(cap.graph)
        self._example_batch = example_batch
        self._modes_seen = {model.training}
        self._progress.done("passes (modality, cost, partition)")
        self.program = self._program_from(cap)
        self._progress.done("codegen (chunk modules)")
        _check_acyclic(self.program, self.partition)
        self.programs: list[Program] = [self.program]
        self._check_sub_microbatching(self.program)

    def _one_segment_labels(self, graph: torch.fx.Graph) -> None:
        """With ``one_segment``: every compute node belongs to one module, ``model`` (Megatron-LM's and nnScaler's
        view of a multimodal model: one layer sequence cut into one set of chunks; the baselines' partition)."""
        if self.one_segment:
            for n in graph.nodes:
                if n.op == "call_function":
                    n.meta["dipc_modality"] = ONE_SEGMENT

    def runtime(self, group=None, *, mesh=None, n_microbatches: int | None = None, timeout: float = 300.0,
                recompute: bool = False, memory_limit: float | None = None, schedule: str = "dip",
                budget_s: float = 0.0, seed: int = 0, fallback_schedule: str = "1f1b", plan_wait_s: float = 1.0,
                bucket_mb: float = 25.0, init=None, simulate_steps: bool = True, planner_cpus=None,
                data_parallel: str | None = None):
        """This rank's :class:`dipc.runtime.PipelineRuntime` (its chunks' modules, the executor, the planner).

        Args:
            group: the pipeline's process group (default: the default group, which must have ``pp_size`` ranks).
            mesh: instead of ``group``, a ``torch.distributed.device_mesh.DeviceMesh`` whose dims are named from
                "pp", "dp" and "tp" (any subset that includes "pp", in any order; an unnamed 2-D mesh is read as
                ``[dp, pp]``, an unnamed 1-D one as ``[pp]``).  "tp": tensor parallelism inside every stage
                (:mod:`dipc.runtime.tensor_parallel`: the parameters become DTensors split as
                :meth:`tensor_parallel_plan` says); its size must be the compiled ``tp_size``.  The ranks of one
                tensor-parallel group run the same plan (made by the group's pipeline rank 0 of tp rank 0) and must
                be given the same batch: the step's digests are checked over the pipeline's ranks of every
                tensor-parallel index before any activation moves.  "dp": each data-parallel
                replica is a pipeline of ``pp_size`` ranks with its own batch and its own planner; after each step
                the replicas' gradients are all-reduced in buckets of ``bucket_mb`` MiB, weighted so they equal the
                unsplit model's on the replicas' concatenated batch (see :class:`dipc.runtime.PipelineRuntime`).
            data_parallel: how the mesh's "dp" dim keeps the parameters: "ddp" (every replica holds them whole;
                gradients all-reduced in buckets while the last backwards run) or "fsdp" (FSDP2,
                ``torch.distributed.fsdp.fully_shard`` per chunk: parameters, gradients and optimizer states sharded
                ``1/dp`` between steps, all-gathered at the step's start and reduce-scattered at its end;
                :mod:`dipc.runtime.fsdp`; with a "tp" dim too, FSDP shards the tensor-parallel DTensors); default
                "fsdp" when compiled with ``fsdp_size`` > 1 (whose value must then be the mesh's "dp" size), else
                "ddp".
            init: for a model built on the meta device: ``init(module)`` runs for every module of which this rank
                materialises a parameter or buffer (only its own chunks' are: about 1/P of the model), e.g. the
                model's weight init; then load the weights with ``pipe.load_checkpoint``.
            n_microbatches: microbatches per step (default ``2 * pp_size``).
            timeout: seconds any distributed wait may take before it raises.
            recompute: every stage recomputes its forward in its backward (keeps only its inputs); without it the
                planner switches stages to recompute only where nothing else fits the memory limit.
            memory_limit: bytes per device the plans stay under (static state + live activations; default the
                device profile's ``memory_capacity``, none without one).
            schedule: the schedule template of every step (:func:`dipc.schedules`; default "dip");
                ``pipe.step(batch, schedule=...)`` overrides it per step.
            budget_s: seconds of DIP's MCTS segment reordering per step (DIP §2.3; 0: the interleaver alone), run
                on rank 0: in the background planner while the previous step runs when the step is given its batch
                ahead (``pipe.step(batch, next_batch=...)`` or :func:`dipc.prefetch`), else before the step;
                ``seed`` + the step index seeds it.
            fallback_schedule: the template a step runs when its background plan is late, failed or its planner
                died (DIP §2.2), planned then.
            plan_wait_s: seconds after a step begins that it waits for its background plan before falling back.
            simulate_steps: the background planner also simulates each plan it made, after sending it, for the
                step report's bubble ratio, its causes and peak memory (``pipe.last_report.simulation``); False
                leaves that to :meth:`StepReport.simulate`, on demand, and the planner's CPU to the ranks (at small
                sizes the simulation costs about what the plan does).  The attribute ``pipe.simulate_steps`` can be
                changed between steps.
            planner_cpus: the CPUs rank 0's background planning process runs on (a set of CPU numbers; DIP §2.2
                plans on idle cores: on a GPU host, cores no rank or data loader uses).  Default: when
                :func:`dipc.launch.pin_rank` (``spawn(pin_cpus=True)``) pinned this rank to its CPU, the other CPUs
                the ranks were pinned among; else this process's CPUs (:func:`dipc.planner.background.planner_cpus`).

        Raises:
            ValueError: a mesh whose dims are not named from "pp", "dp", "tp", whose "pp" size is not ``pp_size``
                or whose "tp" size (1 without one) is not the compiled ``tp_size``; both ``group`` and ``mesh``;
                unknown ``schedule`` or ``fallback_schedule``, a bad ``memory_limit``, ``budget_s``,
                ``seed``, ``timeout``, ``n_microbatches`` or ``plan_wait_s``; ``simulate_steps`` not a bool;
                ``planner_cpus`` not a non-empty set of this host's CPU numbers; ``data_parallel`` not "ddp" or "fsdp",
                "fsdp" with a mesh smaller than the default group or a "dp" size other than the compiled
                ``fsdp_size``, "ddp" when compiled with ``fsdp_size`` > 1.
        """
        from .runtime import PipelineRuntime
        from .runtime.mesh import runtime_groups
        return PipelineRuntime(self, n_microbatches=n_microbatches, timeout=timeout, recompute=recompute,
                               memory_limit=memory_limit, schedule=schedule, budget_s=budget_s, seed=seed,
                               fallback_schedule=fallback_schedule, plan_wait_s=plan_wait_s, bucket_mb=bucket_mb,
                               init=init, simulate_steps=simulate_steps, planner_cpus=planner_cpus,
                               **runtime_groups(self, group, mesh, data_parallel, timeout))


#: seconds after which ``dipc.compile(..., progress=None)`` starts printing its phases
PROGRESS_AFTER_S = 3.0


class _Progress:
    """Phase timer of one compile: ``done(phase)`` records the seconds since the last mark and, when ``progress``
    says so, prints them (stderr, rank 0 only); ``finish()`` returns ``{phase: seconds, "total": seconds}``."""

    def __init__(self, progress: bool | None):
        self._time = time.perf_counter
        self.start = self.last = self._time()
        self.progress = progress
        self.seconds: dict[str, float] = {}
        self.printed = False

    def _show(self) -> bool:
        if self.progress is False:
            return False
        if dist.is_available() and dist.is_initialized():
            if dist.get_rank() != 0:
                return False
        elif os.environ.get("RANK", "0") != "0":  # under torchrun, compiled before init_process_group
            return False
        return self.progress is True or self._time() - self.start >= PROGRESS_AFTER_S

    def done(self, phase: str) -> None:
        now = self._time()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.last
        self.last = now
        if self._show():
            if not self.printed:  # the phases before the first printed one
                for p, t in list(self.seconds.items())[:-1]:
                    print(f"dipc.compile: {p} {t:.1f} s", file=sys.stderr, flush=True)
            print(f"dipc.compile: {phase} {self.seconds[phase]:.1f} s", file=sys.stderr, flush=True)
            self.printed = True

    def finish(self) -> dict[str, float]:
        out = dict(self.seconds, total=self._time() - self.start)
        if self.printed:
            print(f"dipc.compile: total {out['total']:.1f} s", file=sys.stderr, flush=True)
        return out


def _check_read_instances(model, example: Mapping[str, Any], instances: Sequence[Instances]) -> None:
    """The instances dipc read from a model's config (:func:`dipc.families._auto_instances`) must fit the example
    batch (DIP §2.1 cuts encoder work by them).

    Raises:
        BatchError: they do not (the placeholder tokens do not add up to whole instances): names the value read,
            the config it came from and the ``Instances(...)`` declaration to write."""
    for inst in instances:
        if not inst.present(example) or inst.token_key not in example or inst.token_id is None \
                or example[inst.token_key].is_meta:  # a meta batch (paper scale) has shapes, not token values
            continue
        try:
            inst.per_sample_counts(example, int(example[inst.token_key].shape[0]))
        except BatchError as e:
            tpi = inst.tokens_per_instance if not callable(inst.tokens_per_instance) else "per instance"
            raise BatchError(
                f"{e}.  dipc read this from {type(model).__name__}'s config ({tpi} placeholder tokens per "
                f"{inst.modality} instance, token id {inst.token_id}); if the model's processor lays "
                f"{inst.modality} inputs out otherwise, declare them: compile(..., instances=[dipc.Instances("
                f"{inst.modality!r}, {tuple(inst.keys)!r}, token_id={inst.token_id}, tokens_per_instance=<an int, or "
                "a function of the batch giving each instance's count>)])") from None


def _sample_constants(spec: BatchSpec, static_keys: Sequence[str], example: Mapping[str, Any]) -> set[str]:
    """The per-sample keys whose values the trace holds as constants: static keys (read with ``.tolist()``) and
    Python lists with one entry per sample.  Sub-microbatches of a batch with any hold whole samples
    (:mod:`dipc.batch`), so no sub-microbatch's trace reads another's values.

    Raises:
        BatchError: a Python list that is not per-sample has one entry per instance of a sub-microbatched modality
            (e.g. tiles per image): dipc cannot cut a Python value with the instances it describes, and every
            microbatch would read the whole batch's list; the error asks for it as a tensor instance key.
    """
    n_inst = {i.modality: i.n_instances(example) for i in spec.instances if not i.per_sample}
    for k, kind in spec.values.items():
        v = example[k]
        if kind == "shared" and isinstance(v, (list, tuple)) and len(v) > 1:
            for mod, n in n_inst.items():
                if len(v) == n:
                    raise BatchError(
                        f"batch value {k!r} is a Python list of {n} entries, one per {mod} instance of the example "
                        f"batch: dipc cannot cut a Python value with the instances it describes (every microbatch "
                        f"and sub-microbatch would read the whole list); give it as a tensor with the instances "
                        f"as dim 0 and add it to the instance keys: Instances({mod!r}, keys=(..., {k!r}))")
    per_sample = set(spec.per_sample_keys)
    return {k for k in static_keys if k in per_sample} | {k for k, kind in spec.values.items() if kind == "sample"}


def _mode_dependent(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward may differ between ``train()`` and ``eval()``: an ``nn.Dropout*`` with p > 0, a
    batch norm, or a dropout probability > 0 kept as a float attribute of a module or in a Hugging Face config
    (``attention_dropout``, ``hidden_dropout_prob``: the functional dropout of ``self.training``)."""
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.modules.dropout import _DropoutNd

    for m in model.modules():
        if isinstance(m, _BatchNorm) or (isinstance(m, _DropoutNd) and m.p > 0):
            return True
        items = list(vars(m).items())
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "to_dict"):
            try:
                items += list(cfg.to_dict().items())
            except Exception:  # noqa: BLE001 - a config that cannot list itself: its modules still count
                pass
        for k, v in items:
            if "dropout" in k.lower() and isinstance(v, float) and v > 0:
                return True
    return False


def _has_dropout(graph: torch.fx.Graph) -> bool:
    """Whether a capture holds a dropout that is active (p > 0, in training)."""
    for n in graph.nodes:
        if n.op == "call_function" and "dropout" in str(n.target):
            p = n.args[1] if len(n.args) > 1 else n.kwargs.get("p", 0.5)
            train = n.args[2] if len(n.args) > 2 else n.kwargs.get("train", True)
            if (not isinstance(p, (int, float)) or p > 0) and train is not False:
                return True
    return False


#: the share of device memory a rank's parameters, gradients and optimizer states may take under a time balance
STATE_SHARE = 0.7


def compile(model: torch.nn.Module, example_batch: Mapping[str, torch.Tensor], pp_size: int, *,
            modalities: Mapping[str, Sequence[str]] | None = None,
            chunks_per_rank: Mapping[str, int] | None = None,
            sub_microbatch_size: Mapping[str, int] | None = None,
            instances: Sequence[Instances] | None = None,
            loss: LossReduction | str | None = None,
            dynamic: Mapping[str, Mapping[int, Any]] | None = None,
            loss_key: str = "loss", device=None, check: bool | None = None,
            split_points: Mapping[str, Sequence[str]] | Sequence[str] | None = None,
            shared_keys: Sequence[str] = (), static_keys: Sequence[str] = (),
            tp_size: int = 1, balance: str = "time", one_segment: bool = False,
            memory_headroom: float | None = None, progress: bool | None = None,
            fsdp_size: int = 1, sequence_parallel: bool = False) -> CompiledPipeline:
    """Compile ``model`` for a ``pp_size``-rank modality-aware pipeline (DIP §2.1).

    Args:
        model: the unsplit model. ``model(**batch)`` returns the scalar training loss (or a mapping/ModelOutput with
            it under ``loss_key``).  Its forward must be deterministic (no dropout) for gradients to match exactly.
        example_batch: key -> tensor, e.g. ``input_ids [B, S]``, ``pixel_values [N, 3, H, W]``, ``labels [B, S]``;
            every later batch must have the same keys, ranks and dtypes.
        pp_size: P, the number of pipeline ranks.
        modalities: modality -> module path components, e.g. ``{"vision": ["vision_tower",
            "multi_modal_projector"], "text": ["language_model"]}``; default :data:`dipc.passes.modality.DEFAULT_RULES`.
        chunks_per_rank: K_i per modality (default: DIP's rule floor(T_i / T_1), capped by the block count).
        sub_microbatch_size: B_i per instance modality (default: with ``device``, DIP's rule - the smallest size
            keeping >= 95% of the module's peak efficiency on that device; without, 12, the size DIP chose in its
            sweep, PAPER.md §3.6).  With ``device``, K_i's rule uses each module's latency at B_i.
        instances: how instances (images) appear in batches; default detected from ``model.config``
            (``image_token_id``/``image_token_index``, ``tokens_per_image`` or the vision config's patch grid).
        loss: "token_mean", "sample_mean", "sum" or a :class:`dipc.batch.LossReduction` (default: read from the
            graph by :mod:`dipc.passes.lossform`: a mean cross-entropy is a token-mean over its targets' key, with
            its ignore index and shift; a summed one "sum"; anything else a mean over samples).
        dynamic: per key ``{dim: Dim | None}`` overriding the dynamic dims (``None`` fixes a dim).
        loss_key: key of the loss in a mapping output.
        device: a :class:`dipc.sim.device.DeviceProfile` or a profile name ("h100", "cpu" after
            ``python -m dipc.calibrate``, ...): stage latencies and activation memory then come from the symbolic
            cost model (:mod:`dipc.passes.symcost`) on that device, evaluated per (chunk, shape); without it the
            planner uses the first, nominal estimate.
        split_points: module paths to cut before, as torch.distributed.pipelining users give them: one list
            (``["vision_tower.layers.12", "language_model.layers.8"]``, each path given to its module's modality)
            or per modality (``{"vision": [...], "text": [...]}``); a modality with points has ``len(points) + 1``
            chunks (a multiple of ``pp_size``) instead of the balanced search's.
        shared_keys: batch keys given whole to every microbatch: tensors without a batch dimension (Flux's
            ``img_ids [S, 3]``, a RoPE table passed in).  0-dim tensors and Python values (ints, flags, dicts) are
            shared without being named; a Python list or tuple with one entry per sample is split with the samples.
            A tensor whose dim 0 is not the batch size must be named here or be an instance key.
        static_keys: tensor keys whose *values* the forward reads in Python (``image_sizes.tolist()``): the trace
            gets them as nested lists, is specialised to them, and is re-captured per distinct value (cached).  When
            the first capture fails on a data-dependent size or branch, small integer tensors of the example batch
            (not tokens, labels or token masks) are retried this way, with a warning.
        tp_size: T, tensor-parallel GPUs per pipeline stage (``compiled.runtime(mesh=...)`` with a "tp" dim of T
            ranks): with ``device``, the FLOPs, bytes and kept activations of the ops Megatron's column/row split
            divides (projections, attention, activations between them) and the split parameters' memory are divided
            by T per GPU, the rest (norms, residual adds, the loss, messages) counts whole on every GPU, as the
            runtime runs it; each block pays two TP all-reduces per direction on the profile's ``tp_bandwidth``
            (:meth:`CompiledPipeline.tp_comm_seconds`).  Default 1.
        sequence_parallel: with T > 1, plan as Megatron-LM's sequence parallelism runs: every op, the kept
            activations and the pipeline messages divided by T (each GPU keeps and sends its sequence shard).  For
            simulation at the paper's scale (``bench/paper.py``): dipc's runtime does not run it yet and refuses a
            pipeline compiled with it.  Default False.
        fsdp_size: D, the data-parallel replicas that shard parameters, gradients and optimizer states with FSDP2
            (``compiled.runtime(mesh=...)`` then runs ``data_parallel="fsdp"`` on a "dp" dim of D ranks): the memory
            model divides the sharded state by D and keeps the whole parameters and gradients a step holds
            (:meth:`CompiledPipeline.rank_state_parts`), the simulator adds the step's all-gather and reduce-scatter
            (:func:`dipc.sim.simulate.fsdp_seconds`).  Default 1 (replicated data parallelism, or none).
        balance: what the partition balances chunks by: "time" (default: the cost model's forward + backward time,
            on ``device`` when given) or "params" (parameter count, as Megatron-LM splits layers; the paper's
            Megatron baseline).
        one_segment: cut the whole model as one module, ``"model"`` (chunks then mix modalities: the end of the
            vision tower and the start of the language model may share one), as Megatron-LM and nnScaler see a
            multimodal model: the partition of the paper's baselines (with ``balance="params"`` and
            ``chunks_per_rank={"model": v}``: Megatron VPP).  Microbatches still split by whole instances; nothing
            runs on sub-microbatches.  Default False (DIP's modality-aware partition).
        memory_headroom: bytes per device every plan leaves free under its memory limit, for what the memory model
            does not count (the allocator's fragmentation, the CUDA context, NCCL's and the kernels' workspaces):
            a plan's peak plus the headroom stays under the limit.  Default (``None``): 5% of the device profile's
            ``memory_capacity`` (:data:`dipc.planner.planning.DEFAULT_HEADROOM`) when the limit is that capacity,
            0 when the runtime or ``dipc.simulate`` is given an explicit ``memory_limit`` (the bytes the plan may
            use).  Settable later: ``compiled.memory_headroom = bytes``.
        progress: print each phase's seconds (capture, passes, codegen, checks) and the total to stderr, on rank 0
            of the default process group (or without one): ``True`` always, ``False`` never, ``None`` (default) once
            the compile has taken :data:`PROGRESS_AFTER_S` seconds.  The seconds are also in
            ``compiled.compile_seconds`` (phase -> seconds, and ``"total"``).
        check: debug mode (:mod:`dipc.check`): compare each capture, and the partitioned pipeline on the example
            batch, with the eager model (loss and every parameter gradient) in this process, and raise at the first
            difference.  Default: on when the environment variable ``DIPC_CHECK`` is ``1`` (the test suite sets
            it); skipped for a model on the meta device.  Costs about one eager forward + backward per capture.

    Returns:
        a :class:`CompiledPipeline` (no process group needed).

    Raises:
        dipc.passes.partition.PartitionError: a module has fewer candidate blocks (module calls) than its
            ``pp_size * K_i`` chunks need, a bad K_i or split point, or the chunks of all modalities do not form an
            acyclic graph (names the values on the cycle).
        dipc.capture.CaptureError: the model cannot be exported or returns no loss.
        dipc.batch.BatchError: an instance declaration does not fit the model.
        dipc.capture.CaptureError / dipc.codegen.stage.CodegenError: with ``check``, a capture or the partitioned
            pipeline computes another loss or gradient than the eager model (names the first parameter that differs).
    """
    if check is None:
        check = os.environ.get("DIPC_CHECK", "0") == "1"
    if not isinstance(pp_size, int) or isinstance(pp_size, bool) or pp_size < 1:
        raise ValueError(f"pp_size must be a positive int, got {pp_size!r}")
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive int, got {tp_size!r}")
    if not isinstance(fsdp_size, int) or isinstance(fsdp_size, bool) or fsdp_size < 1:
        raise ValueError(f"fsdp_size must be a positive int, got {fsdp_size!r}")
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"sequence_parallel must be True or False, got {sequence_parallel!r}")
    if balance not in ("time", "params"):
        raise ValueError(f"balance must be 'time' or 'params', got {balance!r}")
    if not isinstance(one_segment, bool):
        raise ValueError(f"one_segment must be True or False, got {one_segment!r}")
    if one_segment and modalities is not None:
        raise ValueError("one_segment=True cuts the whole model as one module, 'model'; modalities= does not apply "
                         "(give chunks_per_rank={'model': v} or split_points={'model': [...]})")
    auto_b: set[str] = set()
    for m, b in dict(sub_microbatch_size or {}).items():  # before the family rules read them (int() would truncate)
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"sub_microbatch_size for {m!r} must be an int >= 1, got {b!r}")
    if instances is None:
        instances = _auto_instances(model, example_batch, sub_microbatch_size)
        auto_b = {i.modality for i in instances} - set(sub_microbatch_size or {})
        _check_read_instances(model, example_batch, instances)
    elif sub_microbatch_size:
        instances = [dataclasses.replace(i, sub_microbatch_size=sub_microbatch_size.get(i.modality,
                                                                                       i.sub_microbatch_size))
                     for i in instances]
    unknown = sorted(set(sub_microbatch_size or {}) - {i.modality for i in instances})
    if unknown:
        raise ValueError(f"sub_microbatch_size names {unknown}, but the instance modalities are "
                         f"{[i.modality for i in instances]}")
    for i in instances:
        b = i.sub_microbatch_size
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"sub_microbatch_size for {i.modality!r} must be an int >= 1, got {b!r}")
    if isinstance(loss, str) and loss not in ("token_mean", "sample_mean", "sum"):
        raise ValueError(f"loss must be 'token_mean', 'sample_mean', 'sum' or a dipc.LossReduction, got {loss!r}")
    check_memory_headroom(memory_headroom)
    if progress is not None and not isinstance(progress, bool):
        raise ValueError(f"progress must be True, False or None (print phases once a compile is slow), got "
                         f"{progress!r}")
    if isinstance(device, str):
        from .sim.device import DeviceProfile
        device = DeviceProfile.load(device)
    compiled = CompiledPipeline(model, example_batch, pp_size, modalities=modalities,
                                chunks_per_rank=chunks_per_rank, instances=instances, loss=loss, dynamic=dynamic,
                                loss_key=loss_key, device=device, auto_b=auto_b, check=bool(check),
                                split_points=split_points, shared_keys=tuple(shared_keys),
                                static_keys=tuple(static_keys), tp_size=tp_size, balance=balance,
                                one_segment=bool(one_segment), progress=progress, fsdp_size=fsdp_size,
                                sequence_parallel=sequence_parallel)
    compiled.memory_headroom = memory_headroom
    if compiled.check:
        check_pipeline(compiled, example_batch)
        compiled._progress.done("check of the pipeline against the model")
    compiled.compile_seconds = compiled._progress.finish()
    return compiled
