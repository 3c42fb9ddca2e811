"""Checkpoints through torch.distributed.checkpoint (issue "A citizen of any torch training loop", point 3): a
pipeline at pp=2 saves model and AdamW state under the original names; the same ranks resume from it exactly, the
unsplit model loads it (no process group), a pipeline at pp=4 loads it and the unsplit model's own checkpoint, and
every resumed run's next step equals the unsplit model's (loss, parameters after the optimizer step).  The pp=4
pipeline is built from a model on the meta device: each rank materialises only its own chunks' tensors (point 5)."""
import pytest

from dipc.launch import spawn

LR = 1e-2
# Adam divides by sqrt(v) + eps: with torch's 1e-8 an element whose gradient is ~1e-9 moves by about lr in either
# direction on float rounding alone, so the pipeline's run and the unsplit one part by lr; 1e-3 keeps the update
# continuous in the gradient (the round trips are compared exactly either way)
EPS = 1e-3


def _ref_run(n_steps):
    """The unsplit model trained ``n_steps`` steps (AdamW) on the mixed VLM batches, and its optimizer."""
    import torch

    import pipeline_cases as pc
    from dipc.testing import unsplit_loss

    torch.manual_seed(0)
    ref = pc.vlm(True)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    batches = pc.vlm_batches_mixed()
    for i in range(n_steps):
        opt.zero_grad()
        unsplit_loss(ref, batches[1 + i]).backward()
        opt.step()
    return ref, opt, batches


def _flat(model, opt):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    return get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))


def _read_unsplit(path):
    """An unsplit model and AdamW loaded from the checkpoint at ``path`` without a process group (DCP no_dist)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    import pipeline_cases as pc

    torch.manual_seed(3)
    model = pc.vlm(True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    sd = {"model": model.state_dict(), "optim": _flat(model, opt)}
    dcp.load(sd, checkpoint_id=path, no_dist=True)
    model.load_state_dict(sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"], options=StateDictOptions(flatten_optimizer_state_dict=True))
    return model, opt


def _same_state(rank, model, opt, saved, saved_opt, what):
    """``model``'s parameters (all, or a pipeline rank's) and ``opt``'s flattened state equal ``saved``'s exactly."""
    import torch

    params = dict(saved.named_parameters())
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]), f"rank {rank}: {what}: parameter {n} differs"
    want = _flat(saved, saved_opt)
    got = model.optimizer_state_dict(opt) if hasattr(model, "optimizer_state_dict") else _flat(model, opt)
    mine = [n for n, _ in model.named_parameters()]
    expected = {k for k in want if any(k.startswith(f"state.{n}.") or k.startswith(f"param_groups.{n}.")
                                       for n in mine)}
    assert any(k.startswith("state.") for k in expected), what
    assert set(got) == expected, f"rank {rank}: {what}: entries {sorted(set(got) ^ expected)[:5]} differ"
    for k, v in got.items():
        ok = torch.equal(v, want[k]) if isinstance(v, torch.Tensor) else v == want[k]
        assert ok, f"rank {rank}: {what}: optimizer entry {k} differs"


def _close_params(rank, model, ref, what):
    """Parameters equal the unsplit run's to float rounding (2 AdamW steps apart from the gradients' rounding)."""
    import torch

    params = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, params[n], rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {rank}: {what}: {n}: {m}")


def _check_resumed(rank, pipe, opt, path, ref, batch, what):
    """``pipe`` + ``opt`` hold exactly the checkpoint's state (and the unsplit run's parameters, to float rounding);
    one more step of the pipeline and of the unsplit model loaded from the same checkpoint agrees."""
    import torch

    from dipc.testing import unsplit_loss

    saved, saved_opt = _read_unsplit(path)
    _same_state(rank, pipe, opt, saved, saved_opt, what)
    _close_params(rank, pipe, ref, what + " (vs the unsplit run)")
    opt.zero_grad()
    loss = pipe.step(batch)
    opt.step()
    saved_opt.zero_grad()
    want = unsplit_loss(saved, batch)
    want.backward()
    saved_opt.step()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: loss: {m}")
    params = dict(saved.named_parameters())
    for n, p in pipe.named_parameters():
        torch.testing.assert_close(p, params[n], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: {what}: {n} after the resumed step: {m}")


def _pp2(rank, world, path):
    import copy

    import torch

    import dipc
    import pipeline_cases as pc

    ref, ref_opt, batches = _ref_run(0)
    model = copy.deepcopy(ref)
    compiled = dipc.compile(model, batches[0], world, sub_microbatch_size={"vision": 2})
    pipe = compiled.runtime(n_microbatches=2, timeout=120)
    # saving an optimizer before its first step leaves it untouched (torch would initialise it by a step at lr 0:
    # SGD's momentum buffers = weight_decay x weight), and loading that checkpoint gives an optimizer without state
    # (one param group per module, as VLM recipes give the projector its own lr: a rank may hold none of a group)
    named = pipe.named_parameters()
    sgd = torch.optim.SGD([{"params": [p for n, p in named if n.startswith("multi_modal_projector")], "lr": 0.01},
                           {"params": [p for n, p in named if not n.startswith("multi_modal_projector")]}],
                          lr=0.1, momentum=0.9, weight_decay=0.01)
    pipe.save_checkpoint(f"{path}/pre", sgd)
    assert not sgd.state
    sgd.zero_grad()
    pipe.step(batches[1])
    sgd.step()
    assert sgd.state
    pipe.load_checkpoint(f"{path}/pre", sgd)  # the weights go back to the initial ones too
    assert not any(sgd.state.values())  # torch leaves an empty entry per parameter: no momentum buffer
    params0 = dict(ref.named_parameters())
    assert all(torch.equal(p, params0[n]) for n, p in pipe.named_parameters())
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR, eps=EPS)
    for i in range(2):
        opt.zero_grad()
        pipe.step(batches[1 + i])
        opt.step()
    pipe.save_checkpoint(f"{path}/pp2", opt, extra={"step": torch.tensor(2)})
    ref, _, _ = _ref_run(2)
    # resume on the same ranks: other weights and a fresh optimizer, then the checkpoint
    torch.manual_seed(9)
    pipe.load_state_dict(pc.vlm(True).state_dict())
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR, eps=EPS)
    step = torch.tensor(0)
    pipe.load_checkpoint(f"{path}/pp2", opt, extra={"step": step})
    assert int(step) == 2
    _check_resumed(rank, pipe, opt, f"{path}/pp2", ref, batches[3], "pp=2 resumed")
    with pytest.raises(KeyError, match="full state dict holds every rank"):
        pipe.load_full_state_dict(pipe.state_dict())
    pipe.load_full_state_dict(ref.state_dict())
    _failed_loads_change_nothing(rank, pipe, opt, path, batches)
    return {}


def _failed_loads_change_nothing(rank, pipe, opt, path, batches):
    """Issue 39 §2: a checkpoint one rank cannot read (its shard deleted, or the other rank's truncated; without the
    checksums, so DCP meets it) raises on every rank and leaves every rank's parameters, optimizer state and
    ``extra`` as they were (DCP used to write the readable rank's optimizer state and counter in place before the
    failure surfaced); a shard with flipped bytes (it used to load silently) is refused by its checksum, by name,
    on every rank."""
    import json
    import os
    import time

    import torch
    import torch.distributed as dist

    opt.zero_grad()
    pipe.step(batches[1])
    opt.step()
    for name, shard, damage in (("gone", "__1_0.distcp", "delete"), ("cut", "__0_0.distcp", "truncate"),
                                ("flipped", "__1_0.distcp", "flip"), ("unnamed", "__0_0.distcp", "flip"),
                                ("foreign", "", "optimizer")):
        pipe.save_checkpoint(f"{path}/{name}", opt, extra={"step": torch.tensor(5)})
        opt.zero_grad()
        pipe.step(batches[2])  # the live state moves on from the checkpoint's
        opt.step()
        dist.barrier()
        if rank == 0 and damage != "optimizer":
            f = os.path.join(path, name, shard)
            if name == "unnamed":  # its entry gone from the table as well: a shard the table does not name
                table = os.path.join(path, name, "dipc_checksums.json")
                rows = json.load(open(table))
                del rows["blake2b"][shard]
                json.dump(rows, open(table, "w"))
            if damage == "delete":
                os.remove(f)
            elif damage == "truncate":
                os.truncate(f, os.path.getsize(f) // 2)
            else:
                with open(f, "r+b") as fh:
                    fh.seek(os.path.getsize(f) // 2)
                    byte = fh.read(1)
                    fh.seek(-1, 1)
                    fh.write(bytes([byte[0] ^ 0xFF]))
            if damage in ("delete", "truncate"):  # DCP itself meets the damage
                os.remove(os.path.join(path, name, "dipc_checksums.json"))
        dist.barrier()
        params = {n: p.detach().clone() for n, p in pipe.named_parameters()}
        state = {id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()} for p, st in opt.state.items()}
        step = torch.tensor(3)
        # a rank that fails before DCP starts (here: an optimizer that is not its own) is heard of at once
        mine = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))]) if damage == "optimizer" and rank == 1 else opt
        t = time.perf_counter()
        with pytest.raises(BaseException) as err:
            pipe.load_checkpoint(f"{path}/{name}", mine, extra={"step": step})
        assert time.perf_counter() - t < 30, f"rank {rank}: {name}: the refusal waited for a timeout"
        assert not isinstance(err.value, (KeyboardInterrupt, SystemExit)), err.value
        culprit = {"flipped": 1, "unnamed": 0, "foreign": 1}.get(name)
        if culprit is not None:
            own = {"flipped": "shard(s) ['__1_0.distcp'] do not match", "unnamed": "shard(s) ['__0_0.distcp'] do not "
                   "match", "foreign": "is not one of rank 1's"}[name]
            assert (own in str(err.value) if rank == culprit else
                    f"rank(s) [{culprit}] failed in every rank's check of the checkpoint" in str(err.value)), err.value
        assert int(step) == 3, f"rank {rank}: {name}: extra was loaded"
        for n, p in pipe.named_parameters():
            assert torch.equal(p, params[n]), f"rank {rank}: {name}: parameter {n} changed"
        assert set(state) == {id(p) for p in opt.state}, f"rank {rank}: {name}: optimizer entries changed"
        for p, st in opt.state.items():
            for k, v in st.items():
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(state[id(p)][k])), \
                    f"rank {rank}: {name}: optimizer state {k} changed"


def _init(module):
    """The reference models' own init, and RoPE's table (a non-persistent buffer: in no checkpoint)."""
    from dipc.models.language import RotaryEmbedding, init_weights
    init_weights(module)
    if isinstance(module, RotaryEmbedding):
        module.reset_inv_freq()


def _pp4(rank, world, path):
    """pp=4 from a model built on the meta device (point 5, per-rank materialisation): each rank makes only its
    own chunks' tensors real, then loads the pp=2 checkpoint and the unsplit model's."""
    import torch

    import dipc
    import pipeline_cases as pc
    from dipc.testing import unsplit_loss

    fresh, _, batches = _ref_run(0)
    with torch.device("meta"):
        model = pc.vlm(True)
    compiled = dipc.compile(model, pc.vlm_batches_4ranks()[0], world, sub_microbatch_size={"vision": 2})
    pipe = compiled.runtime(n_microbatches=2, timeout=120, init=_init)
    assert all(not p.is_meta for p in pipe.parameters())
    real = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
    local = sum(p.numel() * p.element_size() for p in pipe.parameters())
    for source in ("pp2", "unsplit"):
        opt = torch.optim.AdamW(pipe.parameters(), lr=LR, eps=EPS)
        pipe.load_checkpoint(f"{path}/{source}", opt)
        ref, _, _ = _ref_run(2)
        _check_resumed(rank, pipe, opt, f"{path}/{source}", ref, batches[3],
                       f"pp=4 from the {source} checkpoint")
    # odd sizes; a new capture traces the all-meta copy (the model is now part real, part meta)
    pipe.load_checkpoint(f"{path}/unsplit")
    ref, _, _ = _ref_run(2)  # what that checkpoint holds
    odd = pc.vlm_batch([0, 2, 1], 12, 7)
    pipe.zero_grad()
    torch.testing.assert_close(pipe.step(odd), unsplit_loss(ref, odd).detach(), rtol=1e-5, atol=1e-6)
    assert compiled._tracer() is not model and compiled._capture(odd).loss_node
    assert all(t.is_meta for t in compiled._tracer().parameters())
    with torch.no_grad():
        torch.testing.assert_close(pipe.eval_step(batches[2]), unsplit_loss(ref, batches[2]), rtol=1e-5, atol=1e-6)
    # under bf16 autocast: the meta trace's message dtypes are those autocast gives on this rank's device
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = pipe.step(batches[1]), unsplit_loss(ref, batches[1])
    torch.testing.assert_close(got.float(), want.detach().float(), rtol=2 ** -8, atol=1e-5)
    # the programs hold modules of this rank's chunks only
    own = {c.index for c in compiled.partition.chunks if c.rank == rank}
    built = {c for prog in compiled.programs for c, cm in prog.chunks.items() if cm.gm is not None}
    assert built and built <= own, (rank, built, own)
    return {"real": real, "local": local, "full": sum(p.numel() * p.element_size() for p in fresh.parameters())}


@pytest.mark.timeout(400)
def test_dcp_checkpoints_across_pp_sizes_and_the_unsplit_model(tmp_path):
    import torch.distributed.checkpoint as dcp

    spawn(_pp2, 2, (str(tmp_path),), timeout=240)
    # the unsplit model reads the pipeline's checkpoint without a process group: the pipeline's training to float
    # rounding
    ref, ref_opt, _ = _ref_run(2)
    model, opt = _read_unsplit(str(tmp_path / "pp2"))
    _close_params(-1, model, ref, "the unsplit model from the pp=2 checkpoint")
    # and writes one of its own, which a pipeline at pp=4 loads (as it loads the pp=2 one)
    dcp.save({"model": ref.state_dict(), "optim": _flat(ref, ref_opt)}, checkpoint_id=str(tmp_path / "unsplit"),
             no_dist=True)
    out = spawn(_pp4, 4, (str(tmp_path),), timeout=300)
    for r, o in enumerate(out):  # each rank of the meta-device model holds its own chunks' parameters only
        assert o["real"] == o["local"] < 0.6 * o["full"], (r, o)
    assert sum(o["local"] for o in out) >= out[0]["full"]
