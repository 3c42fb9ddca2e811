"""The memory strategies of a step's forward-backward pairs (DESIGN.md "Memory"; DIP §2.5's per-layer candidates):
what each strategy keeps, what its backward pays and rebuilds (:func:`memory_options`), the rebuild a rank must
leave room for (:func:`rebuild_need`, :func:`group_rebuild_need`), and forcing a strategy (:func:`set_recompute`).
Units: bytes per GPU and seconds.
"""
from __future__ import annotations

from typing import Callable

from ..plan import OFFLOAD_SUFFIX, PlanError, backward_key, offloads, recompute_layout
from ..stages import Stage
from .workload import StepWorkload

__all__ = ["set_recompute", "memory_options", "rebuild_need", "group_rebuild_need"]


def set_recompute(w: StepWorkload, which: Callable[[Stage], bool] | bool = True) -> int:
    """Give the forward-backward stage pairs ``which`` selects (a predicate on the forward :class:`Stage`, or all)
    the "recompute" memory strategy: the forward then keeps only its inputs (their bytes become its
    ``activation_bytes``) and the backward runs it again (its latency grows by the forward's).  Megatron's
    ``--recompute-granularity full``, per stage.  Returns how many pairs changed."""
    n = 0
    for k, st in w.graph.stages.items():
        if st.kind != "F" or st.strategy == "recompute" or not (which is True or (callable(which) and which(st))):
            continue
        b = w.graph.stages[backward_key(k)]
        kept = _input_bytes(w, k)
        st.keep_bytes, st.recompute_extra, st.forced = st.activation_bytes, st.latency, True
        for x in (st, b):
            x.strategy = "recompute"
            x.activation_bytes = kept
        b.latency += st.latency
        n += 1
    return n



def memory_options(w: StepWorkload, fk: str) -> list[tuple[str, float, float, float]]:
    """The memory strategies forward ``fk``'s pair may take (DESIGN.md "Memory"; DIP §2.5's per-layer
    candidates): ``(strategy, bytes per GPU its forward keeps until the backward, seconds its backward grows by,
    bytes per GPU its backward holds again while it recomputes)`` for "keep", "recompute:k" for every k in
    1 .. layers (each of the chunk's first k layers is its own activation checkpoint: it keeps its inputs instead of
    its saved bytes, its forward seconds join the backward, and the backward rebuilds one layer at a time, the
    largest of them at its peak), "selective" (the chunk as one checkpoint that keeps its inputs and the outputs of
    its matmuls, attention and convolutions, :data:`dipc.passes.symcost.SELECTIVE_SAVED_FAMILIES`: its backward
    runs every other op again, their forward seconds, and rebuilds what they saved; offered where it keeps less
    than "keep", with a device profile), "recompute:k/k" for k >= 2 (one checkpoint over those k layers: it keeps the
    chunk's inputs, and the backward rebuilds all k at once), "recompute:n/g" for g = 2, 4, 8, ... < n layers (all of them in
    checkpoints of g consecutive layers, Megatron's ``--recompute-method uniform --recompute-num-layers g``: it keeps
    each checkpoint's input, and the backward rebuilds one checkpoint at a time, the largest at its peak) and
    "recompute" (the whole chunk as one region: its inputs only are kept, and the backward rebuilds all of it at
    once) and, where the device profile states its host link and host memory (``StepWorkload.host_bandwidth``),
    "offload" (what the forward saves besides its inputs waits in host memory: it keeps its inputs on the device,
    its backward waits for the part of the copy back that the action before it on the rank - taken as long as
    the backward itself - does not hide, and holds those bytes again; the two copies' device-memory traffic is
    charged too; the copy out overlaps what follows the
    forward, and the simulator times both on the rank's link), and with it "recompute:k+offload" for k < layers
    (the first k layers as "recompute:k", what the layers after them save offloaded, and the checkpoints' own
    inputs, which torch saves for them outside them: the device keeps the chunk's inputs).  An offloading option
    has a fifth and a sixth figure: the bytes per GPU it holds in host memory, and the seconds its two copies take
    on the host link.  Per-layer seconds and bytes come from the compiled per-layer costs on
    the device profile (:meth:`dipc.program.Program.block_costs`); without a profile the chunk's estimate is split
    evenly over its layers, each reading as much as the chunk's inputs.  The forward must still be at "keep"."""
    st = w.graph.stages[fk]
    if st.strategy != "keep":
        raise PlanError(f"memory options of {fk} are taken from its 'keep' costs; it is at {st.strategy!r}")
    prog = w.programs[fk]
    cm = prog.chunks[st.chunk]
    keep, f_lat = st.activation_bytes, st.latency
    inputs = _input_bytes(w, fk)
    out = [("keep", keep, 0.0, 0.0)]
    blocks = prog.block_costs(st.chunk, w.bindings[fk])
    if blocks is None:
        n = max(cm.n_layers, 1)
        blocks = [(1.0 / n, keep / n, inputs)] * n
    else:  # a tensor several layers save (a RoPE table, a shared mask) is in each layer's bytes, once in the chunk's:
        total_a = sum(b[1] for b in blocks)  # spread the chunk's own figure over its layers in their proportions
        if total_a > keep > 0:
            blocks = [(f, a * keep / total_a, i) for f, a, i in blocks]
    total_f = sum(b[0] for b in blocks) or 1.0
    bw = w.host_bandwidth
    b_lat = w.graph.stages[backward_key(fk)].latency

    def exposed(host: float) -> float:
        """Seconds offloading ``host`` bytes costs the pair: the backward waits for what the prefetch during the
        rank's action before it (taken as long as the backward) does not bring back, and the two copies read and
        write the device's memory beside the compute (``2 host / mem_bandwidth``: never free, so "keep" stays the
        choice where memory allows)."""
        return max(0.0, host / bw - b_lat) + 2.0 * host / (w.mem_bandwidth or bw)

    done_f, done_a, held, rebuild, kept_after = 0.0, 0.0, 0.0, 0.0, sum(b[1] for b in blocks)
    for k in range(1, len(blocks) + 1):
        f, a, i = blocks[k - 1]
        done_f += f
        done_a += a
        kept_after -= a
        held += i
        rebuild = max(rebuild, a)
        extra = f_lat * done_f / total_f
        # a checkpoint holds its inputs whatever they are: more than "keep" where the layers save little of them
        # (a stage with no instances of its kind: 0 kept, its batch inputs held by the checkpoint)
        out.append((f"recompute:{k}", held + max(kept_after, 0.0), extra, min(rebuild, keep)))
        if k >= 2:  # one checkpoint over them: it holds the chunk's inputs only, and its backward rebuilds them all
            out.append((f"recompute:{k}/{k}", inputs + max(kept_after, 0.0), extra, min(done_a, keep)))
        if bw and k < len(blocks) and kept_after > 1e-9 * keep and inputs < keep:  # and what the layers after
            # them save offloaded, with the checkpoints' inputs (saved for them outside them)
            host = kept_after + max(held - inputs, 0.0)
            out.append((f"recompute:{k}{OFFLOAD_SUFFIX}", inputs, extra + exposed(host), min(rebuild, keep) + host,
                        host, 2.0 * host / bw))
    n = len(blocks)
    g = 2
    while g < n:  # Megatron's uniform method: all layers in checkpoints of g, each keeping its input
        groups = [blocks[s:s + g] for s in range(0, n, g)]
        out.append((f"recompute:{n}/{g}", sum(grp[0][2] for grp in groups), f_lat,
                    min(max(sum(b[1] for b in grp) for grp in groups), keep)))
        g *= 2
    if inputs < keep:
        out.append(("recompute", inputs, f_lat, keep - inputs))
        if bw:
            out.append(("offload", inputs, exposed(keep - inputs), keep - inputs, keep - inputs,
                        2.0 * (keep - inputs) / bw))
    cost = prog.stage_cost(st.chunk, w.bindings[fk])
    if cost is not None and "selective_keep_bytes" in cost:
        kept = inputs + cost["selective_keep_bytes"]
        if kept < keep:
            out.append(("selective", kept, cost["selective_recompute_f"], keep - kept))
    return out



def rebuild_need(options) -> float:
    """Bytes a pair's backward must be able to rebuild when it recomputes in the least memory that rebuilds one
    layer at a time: the rebuild of its last per-layer option ("recompute:<all layers>") of
    :func:`memory_options`, or, without one, of its whole-chunk "recompute" (0 when it has neither)."""
    per_block = [o for o in options if o[0].startswith("recompute:") and "/" not in o[0] and not offloads(o[0])]
    if per_block:
        return per_block[-1][3]
    return max((o[3] for o in options if o[0] == "recompute"), default=0.0)



def group_rebuild_need(options, g: int) -> float:
    """Bytes a pair's backward must be able to rebuild when all its ``n`` layers recompute in checkpoints of
    ``min(g, n)`` layers ("recompute:n/g" of :func:`memory_options`; g = 1 is :func:`rebuild_need`); a pair
    without per-layer options falls back to :func:`rebuild_need`."""
    n = max((recompute_layout(o[0])[0] for o in options if o[0] != "recompute"), default=0)
    if g <= 1 or n == 0:
        return rebuild_need(options)
    layout = (n, min(g, n))
    return next((o[3] for o in options if o[0] != "recompute" and not offloads(o[0])
                 and recompute_layout(o[0]) == layout),
                rebuild_need(options))



def _input_bytes(w: StepWorkload, fk: str) -> float:
    """Bytes per GPU of a forward stage's inputs: the values it receives and the batch keys it reads (divided by
    the workload's ``message_shards``: with sequence parallelism each GPU of a stage keeps its shard)."""
    prog = w.programs[fk]
    st = w.graph.stages[fk]
    cm = prog.chunks[st.chunk]
    total = 0.0
    for inp in cm.inputs:
        if inp.kind == "batch":
            v = w.data[fk][inp.key]
            total += v.numel() * v.element_size()
        elif inp.kind == "value":
            for pk, pname in w.wiring[fk][inp.name]:
                meta = w.programs[pk].chunks[w.graph.stages[pk].chunk].output_meta[pname]
                n = 1
                for d in meta.concrete_shape(w.bindings[pk]):
                    n *= d
                total += n * meta.dtype.itemsize
    return total / w.message_shards
