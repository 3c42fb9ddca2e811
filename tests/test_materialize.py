"""Per-rank materialisation (issue "A citizen of any torch training loop", point 5): a model built on the meta
device compiles; each of 2 ranks materialises only its own chunks' parameters and buffers (``init`` then a DCP
checkpoint of the unsplit model give them values), so its parameter bytes are its chunks' share, not the model's;
loss and every gradient then equal the unsplit model's, in two batch orders (an image-free batch first), through
the optimizer step, and for batches that need a new capture (traced on the meta copy)."""
import pytest

from dipc.launch import spawn


def _init(module):
    """The reference models' own init, and RoPE's table (a non-persistent buffer: in no checkpoint)."""
    from dipc.models.language import RotaryEmbedding, init_weights
    init_weights(module)
    if isinstance(module, RotaryEmbedding):
        module.reset_inv_freq()


def _ranks(rank, world, path):
    import torch

    import dipc
    import pipeline_cases as pc
    from dipc.testing import unsplit_loss

    torch.manual_seed(0)
    ref = pc.vlm(True)
    with torch.device("meta"):
        model = pc.vlm(True)
    batches = pc.vlm_batches_mixed()
    compiled = dipc.compile(model, batches[0], world, sub_microbatch_size={"vision": 2})
    pipe = compiled.runtime(n_microbatches=2, timeout=120, init=_init)
    pipe.load_checkpoint(path)
    full = sum(p.numel() * p.element_size() for p in ref.parameters())
    local = sum(p.numel() * p.element_size() for p in pipe.parameters())
    real = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
    assert all(not p.is_meta for p in pipe.parameters())
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    params = dict(ref.named_parameters())
    n_programs = len(compiled.programs)
    for i in (3, 1, 2, 4):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = pipe.step(batches[i])
        want = unsplit_loss(ref, batches[i])
        want.backward()
        torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"batch {i}: {m}")
        for n, p in pipe.named_parameters():
            if params[n].grad is not None:
                torch.testing.assert_close(p.grad, params[n].grad, rtol=1e-5, atol=1e-7,
                                           msg=lambda m: f"rank {rank}: batch {i}: {n}: {m}")
        opt.step()
        ref_opt.step()
    # odd sizes (3 samples, 12 tokens); a new capture traces the all-meta copy (the model is part real, part meta)
    odd = pc.vlm_batch([0, 2, 1], 12, 7)
    loss = pipe.step(odd)
    torch.testing.assert_close(loss, unsplit_loss(ref, odd).detach(), rtol=1e-5, atol=1e-6)
    assert compiled._tracer() is not model
    cap = compiled._capture(odd)
    assert all(t.is_meta for t in compiled._tracer().parameters()) and cap.loss_node
    with torch.no_grad():
        torch.testing.assert_close(pipe.eval_step(batches[2]), unsplit_loss(ref, batches[2]), rtol=1e-5, atol=1e-6)
    return {"full": full, "local": local, "real": real, "materialized": pipe.materialized_bytes,
            "programs": [n_programs, len(compiled.programs)]}


@pytest.mark.timeout(300)
def test_a_meta_device_model_materialises_only_each_ranks_share(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    import pipeline_cases as pc

    torch.manual_seed(0)
    ref = pc.vlm(True)
    dcp.save({"model": ref.state_dict()}, checkpoint_id=str(tmp_path), no_dist=True)
    out = spawn(_ranks, 2, (str(tmp_path),), timeout=240)
    full = out[0]["full"]
    for r, o in enumerate(out):
        assert o["real"] == o["local"], f"rank {r} materialised {o['real']} bytes of parameters, its own {o['local']}"
        assert o["local"] < 0.8 * full, f"rank {r} holds {o['local']} of the model's {full} parameter bytes"
    # a tied embedding lives on both ranks; otherwise the ranks split the model
    assert full <= out[0]["local"] + out[1]["local"] <= 1.1 * full + 2 * max(o["local"] for o in out) * 0.1
