"""Readable source of generated chunk modules (what ``CompiledPipeline.save`` writes).

Each file holds a header naming the chunk (rank, modality, segment, layers), its inputs with where they come from,
its outputs, the parameters it owns, and the GraphModule's generated Python code.
"""
from __future__ import annotations

__all__ = ["chunk_source"]


def chunk_source(info, cm, names=()) -> str:
    """Source text for chunk ``info`` (a ``dipc.passes.partition.ChunkInfo``) and its ``ChunkModule`` ``cm``
    (``None`` when the chunk has no node in this capture); ``names``: the module paths of its blocks."""
    head = [f'"""Chunk {info.index}: rank {info.rank}, modality {info.modality!r}, segment {info.segment}, '
            f'blocks {info.blocks[0]}..{info.blocks[1] - 1} (position {info.position} in its module).', ""]
    if names:
        head.insert(1, "Module calls: " + ", ".join(names))
    if cm is None:
        head += ["This chunk has no compute node in this capture.", '"""', ""]
        return "\n".join(head)
    head.append("Inputs:")
    for i in cm.inputs:
        src = {"batch": f"batch[{i.key!r}]", "value": f"chunk {i.src_chunk}", "sym": f"size {i.expr}"}[i.kind]
        head.append(f"    {i.name}: {src}")
    head.append("Outputs: " + ", ".join(cm.outputs) + (f" (loss: {cm.loss})" if cm.loss else ""))
    head.append(f"Parameters and buffers ({len(cm.state_names)}):")
    head += [f"    {n}" for n in cm.state_names]
    head += ['"""', ""]
    code = cm.gm.code if cm.gm is not None else "# (module not built in this process)\n"
    return "\n".join(head) + code
