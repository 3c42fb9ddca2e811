"""Pipeline x tensor parallelism on DTensor (issue 37, points 1, 2, 4 and 5): 4 processes launched by torchrun as a
("pp", "tp") = (2, 2) DeviceMesh.  Against the unsplit model, same seed and batch, over 3 steps with different image
counts (a text-only microbatch first, then last) and AdamW: the loss, every gathered gradient and the parameters after
each step (tolerance: rtol 1e-4, atol 1e-6 for gradients; tensor parallelism sums each row-parallel product in two
halves, so the last bits differ from the unsplit model's).  Per rank, the parameter, gradient, optimizer-state and
buffer bytes it really holds equal the memory model's figure (:meth:`CompiledPipeline.rank_state_bytes`).  Ranks of
one tensor-parallel group given different batches are refused on every rank before any activation moves, gradients
untouched.  Every memory strategy gives the same gradients on the shards (recompute, selective and per-layer +
offload in the default suite; all five in the full one).  The full state dict is the unsplit model's; a DCP
checkpoint written at (pp 2, tp 2) loads into the unsplit model and into the pipeline again; ops DTensor cannot split
run whole (the reference VLM with tied embeddings, in the default suite).  In the full suite also: the checkpoint at
(dp 2, pp 2) sharded by FSDP2 and back, HF LLaVA with re-captures and bf16 autocast (at (pp 2, tp 2) and at
(dp 2, pp 2) under FSDP2), (dp 2, pp 2, tp 2) on 8 processes, and a failure on one TP rank."""
import os

import pytest

FULL = os.environ.get("DIPC_FULL") == "1"
SLOW = pytest.mark.skipif(not FULL, reason="full suite only (DIPC_FULL=1)")


def _full(t):
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t):
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def _held_bytes(pipe, opt) -> float:
    """Bytes this rank really holds: its parameters' shards, their gradients, AdamW's two state tensors per
    parameter and the buffers its chunks read."""
    import torch
    total = 0.0
    for p in pipe.parameters():
        n = _local(p).numel() * p.element_size()
        total += n + (_local(p.grad).numel() * p.grad.element_size() if p.grad is not None else 0)
        total += sum(_local(v).numel() * v.element_size() for k, v in opt.state[p].items()
                     if k in ("exp_avg", "exp_avg_sq"))
    comp = pipe.compiled
    seen = set()
    for c in comp.partition.chunks:
        if c.rank == pipe.rank:
            for name in comp.program.chunks[c.index].state_names:
                t = comp._state[name]
                if not isinstance(t, torch.nn.Parameter) and id(t) not in seen:
                    seen.add(id(t))
                    total += t.numel() * t.element_size()
    return total


def _steps(rank, pipe, ref, steps, autocast=False):
    """Train both for ``steps``: loss, gathered gradients and parameters after AdamW equal the unsplit model's;
    returns the worst gradient error relative to the step's largest gradient, and the optimizer."""
    import contextlib

    import torch

    from dipc.testing import unsplit_loss

    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2, eps=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-3)
    params = dict(ref.named_parameters())
    worst = 0.0
    amp = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
    for i, b in enumerate(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        with amp():
            loss = pipe.step(b)
            want = unsplit_loss(ref, b)
        want.backward()
        scale = max(float(g.grad.abs().max()) for g in params.values() if g.grad is not None)
        torch.testing.assert_close(loss, want.detach().float(), rtol=2 ** -8 if autocast else 1e-5,
                                   atol=1e-5 if autocast else 1e-6, msg=lambda m: f"rank {rank} step {i}: loss: {m}")
        for n, p in pipe.named_parameters():
            g = params[n].grad
            assert (p.grad is None) == (g is None), n
            if g is None:
                continue
            assert tuple(p.grad.placements) == tuple(p.placements), (n, p.grad.placements, p.placements)
            mine = _full(p.grad)
            if autocast:  # within four bf16 ulps (tensor parallelism adds a bf16 all-reduce) of the parameter's largest gradient element (or 1e-3 of the
                err = float((mine - g).abs().max())  # step's largest, for a gradient that is 0 but for rounding:
                bound = 2 ** -5 * max(float(g.abs().max()), 1e-3 * scale)  # attention's key bias)
                assert err <= bound, f"rank {rank} step {i}: {n}: {err} > {bound}"
            else:
                torch.testing.assert_close(mine, g, rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"rank {rank} step {i}: gradient of {n}: {m}")
            worst = max(worst, float((mine - g).abs().max()) / scale)
        opt.step()
        ref_opt.step()
        if not autocast:
            for n, p in pipe.named_parameters():
                torch.testing.assert_close(_full(p), params[n], rtol=1e-4, atol=1e-5,
                                           msg=lambda m: f"rank {rank} step {i}: parameter {n}: {m}")
    return worst, opt


def _vlm(rank, world, out_dir):
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dipc
    import pipeline_cases as pc
    from dipc.plan import PlanError

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp, tp = mesh.get_local_rank("pp"), mesh.get_local_rank("tp")
    torch.manual_seed(0)
    model = pc.vlm(True)  # embedding and LM head tied across the pipeline's two ranks
    ref = copy.deepcopy(model)
    if tp == 1:  # another start: the group starts from its first rank's weights
        torch.manual_seed(7)
        model.load_state_dict(pc.vlm(True).state_dict())
    compiled = dipc.compile(model, pc.vlm_batch([1, 1], 12, 0), 2, tp_size=2, sub_microbatch_size={"vision": 2},
                            progress=False)
    text = compiled.describe()
    assert "tensor parallel (tp=2)" in text, text
    split = compiled.tensor_parallel_plan()
    assert "language_model.layers.0.self_attn.q_proj.weight" in split.styles
    assert split.style("language_model.layers.0.self_attn.o_proj.weight") == "rowwise"
    assert split.style("language_model.layers.0.mlp.gate_proj.weight") == "colwise"
    assert split.style("vision_tower.layers.0.mlp.fc2.weight") == "rowwise"
    assert split.style("language_model.embed_tokens.weight") == "vocab"
    pipe = compiled.runtime(mesh=mesh, n_microbatches=2, timeout=120)
    steps = [pc.vlm_batch([0, 0, 2, 1], 16, 10), pc.vlm_batch([1, 2, 0, 0], 14, 20), pc.vlm_batch([0, 3, 0, 1], 18, 30)]
    worst, opt = _steps(rank, pipe, ref, steps)
    held, model_bytes = _held_bytes(pipe, opt), compiled.rank_state_bytes()[pp]
    assert held == model_bytes, (rank, held, model_bytes)
    # every memory strategy the planner may choose runs on the shards (selective checkpoints and offload's hooks
    # see DTensors): one step each, every pair at that strategy (the default suite: the three code paths)
    import dataclasses

    from dipc.testing import unsplit_loss
    b = steps[0]
    ref.zero_grad()
    unsplit_loss(ref, b).backward()
    want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    strategies = ("recompute", "recompute:1", "selective", "offload", "recompute:1+offload") if FULL else \
        ("recompute", "selective", "recompute:1+offload")
    for strategy in strategies:
        _, plan = dipc.simulate(compiled, b, 2)
        plan.ranks = [[dataclasses.replace(a, strategy=strategy) if a.kind in ("F", "B") else a for a in acts]
                      for acts in plan.ranks]
        pipe.zero_grad()
        pipe.step(b, plan=plan)
        for n, p in pipe.named_parameters():
            if n in want:
                torch.testing.assert_close(_full(p.grad), want[n], rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"rank {rank} {strategy}: gradient of {n}: {m}")
    # the ranks of a tensor-parallel group given different batches: every rank refuses the step before any
    # activation moves, gradients untouched
    before = {n: _local(p.grad).clone() for n, p in pipe.named_parameters() if p.grad is not None}
    bad = pc.vlm_batch([0, 0, 2, 1], 16, 10 + tp)
    with pytest.raises(PlanError, match="disagree on the step"):
        pipe.step(bad)
    for n, p in pipe.named_parameters():
        if n in before:
            assert torch.equal(_local(p.grad), before[n]), f"rank {rank}: {n}'s .grad changed in the refused step"
    # the full state dict is the unsplit model's after the same steps; a DCP checkpoint loads into the unsplit model
    # and back into the pipeline after the parameters moved on, exactly
    ck = os.path.join(out_dir, "ck")
    full = pc.checkpoint_round_trip(rank, pipe, ref, opt, ck, 1e-4, 1e-5)
    want = ref.state_dict()
    _odd_ops(rank, mesh)  # ops DTensor has no strategy for (forward or backward) run on whole tensors
    if not FULL:
        pipe.close()
        return worst
    # across mesh shapes (full suite): the (pp 2, tp 2) checkpoint loads at (dp 2, pp 2), and one written there loads
    # back at (pp 2, tp 2), exactly
    other = dipc.compile(pc.vlm(True), pc.vlm_batch([1, 1], 12, 0), 2, sub_microbatch_size={"vision": 2},
                         progress=False, fsdp_size=2)  # (dp 2, pp 2) sharded by FSDP2
    dp_pipe = other.runtime(mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp")), n_microbatches=2,
                            timeout=120)
    dp_pipe.load_checkpoint(ck)
    moved = dp_pipe.full_state_dict()
    for n in want:
        assert torch.equal(moved[n], full[n]), f"rank {rank}: {n} loaded at (dp 2, pp 2)"
    with torch.no_grad():
        for p in dp_pipe.parameters():
            p.mul_(0.5)
    halved = dp_pipe.full_state_dict()
    ck2 = os.path.join(out_dir, "ck_dp")
    dp_pipe.save_checkpoint(ck2)
    dist.barrier()
    pipe.load_checkpoint(ck2)
    back = pipe.full_state_dict()
    for n in want:
        assert torch.equal(back[n], halved[n]), f"rank {rank}: {n} loaded back at (pp 2, tp 2)"
    dp_pipe.close()
    pipe.close()
    return worst


def _mesh3_fsdp(rank, world, out_dir):
    return _mesh3(rank, world, out_dir, fsdp=True)


def _mesh3(rank, world, out_dir, fsdp=False):
    """(dp 2, pp 2, tp 2) on 8 processes: each replica's batch differs; loss, gathered gradients, the global
    gradient norm and the parameters after AdamW equal the unsplit model's on the concatenated batch.  With
    ``fsdp``, FSDP2 shards the tensor-parallel DTensors over "dp": the bytes each rank keeps are the memory model's
    (its largest shards on replica 0) and a checkpoint every rank writes is the unsplit model's state dict."""
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import dipc
    import pipeline_cases as pc
    from dipc.testing import unsplit_loss

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "pp", "tp"))
    dp = mesh.get_local_rank("dp")
    torch.manual_seed(0)
    model = pc.vlm(True)
    ref = copy.deepcopy(model)
    compiled = dipc.compile(model, pc.vlm_batch([1, 1], 12, 0), 2, tp_size=2, sub_microbatch_size={"vision": 2},
                            progress=False, fsdp_size=2 if fsdp else 1)
    pipe = compiled.runtime(mesh=mesh, n_microbatches=2, timeout=200, bucket_mb=0.01)  # several buckets
    opt, ref_opt = pc.adamw_pair(pipe, ref)
    steps = pc.replica_steps()
    params = dict(ref.named_parameters())
    worst = 0.0
    for mine, theirs in steps:
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = pipe.step((mine, theirs)[dp])
        want = unsplit_loss(ref, {k: torch.cat([mine[k], theirs[k]]) for k in mine})
        want.backward()
        torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
        for n, p in pipe.named_parameters():
            g = params[n].grad
            if g is not None:
                torch.testing.assert_close(_full(p.grad), g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")
                worst = max(worst, float((_full(p.grad) - g).abs().max()))
        torch.testing.assert_close(pipe.clip_grad_norm_(1.0), torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0),
                                   rtol=1e-4, atol=1e-6)
        opt.step()
        ref_opt.step()
        for n, p in pipe.named_parameters():
            torch.testing.assert_close(_full(p), params[n], rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")
    if fsdp:
        nbytes = lambda ts: sum(_local(t).numel() * t.element_size() for t in ts)  # noqa: E731
        measured = {"parameters": nbytes(pipe.parameters()),
                    "gradients": nbytes(p.grad for p in pipe.parameters() if p.grad is not None),
                    "optimizer": nbytes(v for st in opt.state.values() for k, v in st.items() if k != "step"),
                    "step": 2 * nbytes(pipe.fsdp.unsharded_parameters())}
        want_parts = compiled.rank_state_parts()[pipe.rank]
        for k, v in measured.items():
            assert (v == want_parts[k]) if dp == 0 or k == "step" else (0 < v <= want_parts[k]), \
                (rank, k, v, want_parts[k])
        pc.checkpoint_round_trip(rank, pipe, ref, opt, os.path.join(out_dir, "ck3"), 1e-4, 1e-5)
    pipe.close()
    return worst


def _odd_model():
    """A tiny language model whose blocks hold ops DTensor cannot split: an ``avg_pool2d`` over the token grid
    (Gemma 3's projector: DTensor has its forward strategy, not its backward's) and boolean-mask indexing (Idefics3
    and many HF VLMs: a data-dependent size DTensor's propagation cannot compute)."""
    import torch
    import torch.nn.functional as F

    class Block(torch.nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.up, self.down = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

        def forward(self, h, ids):
            h = h + self.down(F.gelu(self.up(h)))
            B, S, D = h.shape
            g = F.avg_pool2d(h.transpose(1, 2).reshape(B, D, 2, S // 2), kernel_size=(1, 2), stride=(1, 2))
            h = h + g.flatten(2).transpose(1, 2).repeat_interleave(2, dim=1)
            m = ids > 32
            return h.index_put((m,), h[m] * 2.0)

    class Tiny(torch.nn.Module):
        def __init__(self, vocab=64, dim=16, n=4):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, dim)
            self.blocks = torch.nn.ModuleList([Block(dim) for _ in range(n)])
            self.head = torch.nn.Linear(dim, vocab, bias=False)

        def forward(self, input_ids, labels):
            h = self.embed(input_ids)
            for b in self.blocks:
                h = b(h, input_ids)
            return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())

    return Tiny()


def _odd_ops(rank, mesh):
    """:func:`_odd_model` at (pp 2, tp 2): loss and every gradient equal the unsplit model's."""
    import copy

    import torch

    import dipc
    from dipc.testing import unsplit_loss

    torch.manual_seed(0)
    model = _odd_model()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    b = {"input_ids": torch.randint(0, 64, (4, 8), generator=g), "labels": torch.randint(0, 64, (4, 8), generator=g)}
    compiled = dipc.compile(model, b, 2, tp_size=2, progress=False)
    pipe = compiled.runtime(mesh=mesh, n_microbatches=2, timeout=120)
    loss = pipe.step(b)
    want = unsplit_loss(ref, b)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
    params = dict(ref.named_parameters())
    for n, p in pipe.named_parameters():
        torch.testing.assert_close(_full(p.grad), params[n].grad, rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: gradient of {n}: {m}")
    pipe.close()


def _llava(rank, world, out_dir, fsdp=False):
    """HF LLaVA at (pp 2, tp 2), or with ``fsdp`` at (dp 2, pp 2) sharded by FSDP2 (issue 37 scope 3; both replicas
    given each step's batch, whose concatenation's loss and gradients are the batch's): new image counts captured
    while training, then bf16 autocast."""
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import dipc
    import pipeline_cases as pc

    names = ("pp", "dp") if fsdp else ("tp", "pp")  # any order of the names
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    torch.manual_seed(0)
    model = pc.llava()
    ref = copy.deepcopy(model)
    bs = pc.llava_batches_mixed()
    compiled = dipc.compile(model, bs[0], 2, progress=False, **({"fsdp_size": 2} if fsdp else {"tp_size": 2}))
    pipe = compiled.runtime(mesh=mesh, n_microbatches=2, timeout=200)
    worst, _ = _steps(rank, pipe, ref, [bs[2], bs[1], bs[3]])  # new image counts: captures while training
    worst_amp, _ = _steps(rank, pipe, ref, [bs[1], bs[2]], autocast=True)
    pipe.close()
    return worst, worst_amp


def _llava_fsdp(rank, world, out_dir):
    return _llava(rank, world, out_dir, fsdp=True)


def _fault(rank, world, out_dir):
    """A rank of a tensor-parallel group raises in a forward: its peer is left in the stage's collective until the
    runtime's timeout (its group's own), then every rank of the mesh raises the same StepFailed naming the rank
    whose code failed, with .grad as before the step, and the group marked unusable."""
    import time

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import dipc
    import pipeline_cases as pc
    from dipc.runtime import StepFailed
    from dipc.runtime.executor import Executor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    torch.manual_seed(0)
    compiled = dipc.compile(pc.vlm(True), pc.vlm_batch([1, 1], 12, 0), 2, tp_size=2,
                            sub_microbatch_size={"vision": 2}, progress=False)
    pipe = compiled.runtime(mesh=mesh, n_microbatches=2, timeout=20)
    b = pc.vlm_batch([0, 0, 2, 1], 16, 10)
    pipe.step(b)
    before = {n: _local(p.grad).clone() for n, p in pipe.named_parameters() if p.grad is not None}
    real, calls = Executor._forward, []

    def failing(self, a):
        calls.append(a)
        if len(calls) == 2:
            raise RuntimeError("injected forward failure")
        return real(self, a)
    if rank == 1:  # pipeline rank 0, tensor-parallel rank 1
        Executor._forward = failing
    t = time.perf_counter()
    try:
        with pytest.raises(StepFailed) as err:
            pipe.step(b)
    finally:
        Executor._forward = real
    took = time.perf_counter() - t
    e = err.value
    assert "rank 0 (tensor-parallel rank 1, global rank 1) failed in" in str(e) and "injected forward failure" in str(e), str(e)
    assert e.origin == 0 and not e.usable, (e.origin, e.usable)
    for n, p in pipe.named_parameters():
        if n in before:
            assert torch.equal(_local(p.grad), before[n]), f"rank {rank}: {n}'s .grad changed in the failed step"
    return took


_MAIN = """
import json, os, sys
sys.path[:0] = [{tests!r}, {shared!r}]
import torch
torch.set_num_threads(1)
from test_tensor_parallel import {fn}
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
res = {fn}(rank, world, {out!r})
json.dump(res, open(os.path.join({out!r}, "rank%d.json" % rank), "w"))
torch.distributed.barrier()
torch.distributed.destroy_process_group()
"""


def _torchrun(tmp_path, fn, nprocs=4, timeout=280):
    import json
    import subprocess
    import sys

    from dipc.launch import free_port

    main = tmp_path / "tp_main.py"
    here = os.path.dirname(os.path.abspath(__file__))
    main.write_text(_MAIN.format(tests=here, shared=os.path.dirname(here), out=str(tmp_path), fn=fn))
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nprocs),
                          "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(main)],
                         capture_output=True, text=True, timeout=timeout, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return [json.load(open(tmp_path / f"rank{r}.json")) for r in range(nprocs)]


@pytest.mark.timeout(300)
def test_pp_by_tp_mesh_equals_the_unsplit_model(tmp_path):
    out = _torchrun(tmp_path, "_vlm")
    assert max(out) < 1e-4


@SLOW
@pytest.mark.timeout(400)
def test_dp_by_pp_by_tp_mesh_equals_the_unsplit_model_on_the_concatenated_batch(tmp_path):
    out = _torchrun(tmp_path, "_mesh3", nprocs=8, timeout=380)
    assert max(out) < 1e-5


@SLOW
@pytest.mark.timeout(400)
def test_dp_by_pp_by_tp_mesh_sharded_by_fsdp2_equals_the_unsplit_model(tmp_path):
    out = _torchrun(tmp_path, "_mesh3_fsdp", nprocs=8, timeout=380)
    assert max(out) < 1e-5


@SLOW
@pytest.mark.hf
@pytest.mark.timeout(400)
@pytest.mark.parametrize("fn", ["_llava", "_llava_fsdp"])  # (pp 2, tp 2); (dp 2, pp 2) sharded by FSDP2
def test_hf_llava_trains_as_the_unsplit_model_on_tp_and_fsdp2_meshes(tmp_path, fn):
    out = _torchrun(tmp_path, fn, timeout=380)
    assert max(w for w, _ in out) < 1e-4


@SLOW
@pytest.mark.timeout(300)
def test_a_failure_on_one_tp_rank_raises_on_every_rank_of_the_mesh_within_the_timeout(tmp_path):
    out = _torchrun(tmp_path, "_fault")
    assert max(out) < 3 * 20  # the runtime's timeout is 20 s: the status exchange waits out the peer's collective
