"""The pipeline in an ordinary training loop (issue "A citizen of any torch training loop"), on 2 CPU ranks against
the unsplit model: global gradient clipping (2-norm and inf-norm, tied weights counted once), loading a state
dict of the unsplit model (a resumed run), forward-only evaluation, bf16 autocast and fp16 with a gradient scaler, in
one process group."""
import pytest

from dipc.launch import spawn


def _loop(rank, world):
    import copy
    import math

    import torch

    import dipc
    import pipeline_cases as pc
    from dipc.testing import unsplit_loss

    torch.manual_seed(0)
    model = pc.vlm(True)  # lm_head tied to the embedding: rank 0 and rank 1 both hold it
    ref = copy.deepcopy(model)
    batches = pc.vlm_batches_mixed()
    compiled = dipc.compile(model, batches[0], world, sub_microbatch_size={"vision": 2})
    pipe = compiled.runtime(n_microbatches=2, timeout=120)
    params = dict(ref.named_parameters())
    out = {}
    for i, (norm_type, max_norm) in enumerate([(2.0, 0.05), (math.inf, 0.01), (2.0, 1e6)]):
        batch = batches[1 + i]
        pipe.zero_grad()
        ref.zero_grad()
        pipe.step(batch)
        unsplit_loss(ref, batch).backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
        got = pipe.clip_grad_norm_(max_norm, norm_type)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7,
                                   msg=lambda m: f"rank {rank}: norm {norm_type}: {m}")
        for n, p in pipe.named_parameters():
            if params[n].grad is not None:
                torch.testing.assert_close(p.grad, params[n].grad, rtol=1e-5, atol=1e-7,
                                           msg=lambda m: f"rank {rank}: clipped gradient of {n}: {m}")
        out[f"norm_{norm_type}"] = float(got)
    # the per-rank call is what the docstring warns about: its norm is this rank's part only
    local = torch.nn.utils.clip_grad_norm_(pipe.parameters(), 1e6)
    out["local_norm"] = float(local)
    # resume: an unsplit model's state dict (other weights) loads into the pipeline; the losses then agree
    torch.manual_seed(7)
    other = pc.vlm(True)
    pipe.load_state_dict(other.state_dict())
    pipe.zero_grad()
    loss = pipe.step(batches[4])
    with torch.no_grad():
        want = unsplit_loss(other, batches[4])
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank}: after loading: {m}")
    with pytest.raises(KeyError, match="missing"):
        pipe.load_state_dict({})
    out.update(_evaluation(rank, pipe, other, batches))
    out.update(_evaluation_outputs(rank, world, batches))
    out.update(_autocast(rank, pipe, other, batches))
    out.update(_grad_scaler(rank, pipe, other, batches))
    with pytest.raises(ValueError, match="max_norm must be a number >= 0"):
        pipe.clip_grad_norm_(-1.0)
    return out


def _evaluation_outputs(rank, world, batches):
    """Evaluation outputs of a model returning several (pipeline_cases.OutputsVLM): each equals the unsplit model's
    on the last rank (None elsewhere), with and without labels, text-only microbatches first; an encoder output
    of a batch without images is empty as the unsplit model's; an output computed on rank 0 reaches the last
    rank; an output computed from the labels is refused without them, on every rank."""
    import torch

    import dipc
    import pipeline_cases as pc

    torch.manual_seed(3)
    model = pc.outputs_vlm()
    compiled = dipc.compile(model, batches[0], world, sub_microbatch_size={"vision": 2})
    assert sorted(compiled.outputs) == ["early", "feats", "logits", "masked"], compiled.outputs
    pipe = compiled.runtime(n_microbatches=2, timeout=120)
    n = 0
    keys = ["logits", "feats", "early"]
    for i in (2, 1, 3):  # batches[2]: the image-free microbatch first; batches[3]: no image at all
        with torch.no_grad():
            want = model(**batches[i])
        for labelled in (True, False):
            b = batches[i] if labelled else {k: v for k, v in batches[i].items() if k != "labels"}
            loss, got = pipe.eval_step(b, outputs=keys, n_microbatches=2 if labelled else 4)
            if labelled:
                torch.testing.assert_close(loss, want["loss"], rtol=1e-5, atol=1e-6)
            else:
                assert loss is None
            if rank != world - 1:
                assert got is None
                continue
            for k in keys:
                torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"batch {i}, labels {labelled}, {k}: {m}")
                n += 1
    with pytest.raises(ValueError, match="computed from 'labels'"):
        pipe.eval_step({k: v for k, v in batches[1].items() if k != "labels"}, outputs=["logits", "masked"])
    return {"outputs_compared": n}


def _evaluation(rank, pipe, ref, batches):
    """Forward-only pipelines: eval_step and step under no_grad / inference_mode equal the unsplit model's loss under
    no_grad, in two batch orders (the image-free batch first, then last), with 1f1b's and DIP's sub-microbatched
    order; no gradient moves; the training step after still equals the unsplit model; a rank evaluating while the
    other trains raises on both."""
    import torch

    from dipc.plan import PlanError
    from dipc.testing import unsplit_loss

    pipe.zero_grad()
    grads_before = {n: None if p.grad is None else p.grad.clone() for n, p in pipe.named_parameters()}
    step_before = pipe.step_index
    with torch.no_grad():
        want = {i: unsplit_loss(ref, batches[i]) for i in (1, 2, 3, 4)}
    got = {}
    for order, schedule in (([3, 1, 2, 4], "1f1b"), ([4, 2, 1, 3], "dip")):
        for i in order:
            loss = pipe.eval_step(batches[i], schedule=schedule)
            torch.testing.assert_close(loss, want[i], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank}: eval_step of batch {i} ({schedule}): {m}")
            got[(i, schedule)] = float(loss)
    assert pipe.last_plan is None or not pipe.last_plan.forward_only
    with torch.no_grad():
        torch.testing.assert_close(pipe.step(batches[2]), want[2], rtol=1e-5, atol=1e-6)
    with torch.inference_mode():
        torch.testing.assert_close(pipe.step(batches[1], n_microbatches=4), want[1], rtol=1e-5, atol=1e-6)
    for n, p in pipe.named_parameters():
        assert (p.grad is None) == (grads_before[n] is None), f"rank {rank}: evaluation changed {n}'s .grad"
    assert pipe.step_index == step_before
    assert pipe.eval() is pipe and not pipe.training and pipe.train().training
    # a rank evaluating while the other trains: both raise before any activation moves, and the next step runs
    with pytest.raises(PlanError, match="disagree"):
        if rank == 0:
            pipe.eval_step(batches[1], schedule="dip")
        else:
            pipe.step(batches[1], schedule="dip")
    pipe.zero_grad()
    ref.zero_grad()
    loss = pipe.step(batches[2])
    unsplit_loss(ref, batches[2]).backward()
    torch.testing.assert_close(loss, want[2], rtol=1e-5, atol=1e-6)
    params = dict(ref.named_parameters())
    for n, p in pipe.named_parameters():
        if params[n].grad is not None:
            torch.testing.assert_close(p.grad, params[n].grad, rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"rank {rank}: gradient of {n} after evaluation: {m}")
    return {"eval": got}


def _autocast(rank, pipe, ref, batches):
    """Under torch.autocast("cpu", bfloat16) the chunks run autocast and the messages carry its dtypes; loss and
    every gradient equal the unsplit model's under the same autocast to bf16 tolerance (loss rtol 2^-8; each
    parameter's gradient within 2^-6 of its largest element, about two bf16 ulps: microbatches change the
    accumulation order of bf16 matmuls), in two batch orders (the image-free batch first), for training and eval."""
    import torch

    from dipc.testing import unsplit_loss

    params = dict(ref.named_parameters())
    worst = 0.0
    for i in (3, 1, 2, 4):
        pipe.zero_grad()
        ref.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = pipe.step(batches[i])
            want = unsplit_loss(ref, batches[i])
        want.backward()
        torch.testing.assert_close(loss, want.detach().float(), rtol=2 ** -8, atol=1e-5,
                                   msg=lambda m: f"rank {rank}: autocast loss of batch {i}: {m}")
        for n, p in pipe.named_parameters():
            g = params[n].grad
            if g is None:
                continue
            err = float((p.grad - g).abs().max())
            scale = float(g.abs().max())
            assert err <= 2 ** -6 * scale + 1e-7, f"rank {rank}: batch {i}: {n}'s gradient differs by {err} " \
                                                  f"(largest element {scale})"
            worst = max(worst, err / max(scale, 1e-12))
    dtypes = {t.dtype for acts in pipe.last_plan.ranks for a in acts for t in a.tensors}
    assert "bfloat16" in dtypes, dtypes
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = pipe.eval_step(batches[2])
        with torch.no_grad():
            want = unsplit_loss(ref, batches[2])
    torch.testing.assert_close(got, want.float(), rtol=2 ** -8, atol=1e-5)
    # and without autocast the next step is float32 again, exact
    pipe.zero_grad()
    ref.zero_grad()
    loss = pipe.step(batches[1])
    unsplit_loss(ref, batches[1]).backward()
    assert {t.dtype for acts in pipe.last_plan.ranks for a in acts for t in a.tensors} == {"float32"}
    for n, p in pipe.named_parameters():
        if params[n].grad is not None:
            torch.testing.assert_close(p.grad, params[n].grad, rtol=1e-5, atol=1e-7)
    return {"autocast_worst_relative_grad_error": worst}


def _grad_scaler(rank, pipe, ref, batches):
    """fp16 autocast with a gradient scaler: pipe.step(batch, scaler=) seeds the backward with the scaled loss;
    ShardedGradScaler (its inf check all-reduced over the ranks) unscales; the unscaled gradients match the unsplit
    model's under GradScaler (fp16 tolerance: within 2^-6 of each gradient's largest element), both take the same
    SGD steps and keep the same scale; a scale that overflows fp16 makes every rank skip the step and back off."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from dipc.plan import PlanError
    from dipc.testing import unsplit_loss

    params = dict(ref.named_parameters())
    for init_scale, overflow in ((2.0 ** 10, False), (2.0 ** 100, True)):
        scaler = ShardedGradScaler("cpu", init_scale=init_scale, process_group=dist.group.WORLD)
        ref_scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        before = {n: p.detach().clone() for n, p in pipe.named_parameters()}
        for i in (3, 1):
            opt.zero_grad()
            ref_opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = pipe.step(batches[i], scaler=scaler)
                want = unsplit_loss(ref, batches[i])
            ref_scaler.scale(want).backward()
            torch.testing.assert_close(loss, want.detach().float(), rtol=2 ** -8, atol=1e-5)
            scaler.unscale_(opt)
            ref_scaler.unscale_(ref_opt)
            if not overflow:
                for n, p in pipe.named_parameters():
                    g = params[n].grad
                    if g is not None:
                        err = float((p.grad - g).abs().max())
                        assert err <= 2 ** -6 * float(g.abs().max()) + 1e-7, (rank, i, n, err)
            scaler.step(opt)
            scaler.update()
            ref_scaler.step(ref_opt)
            ref_scaler.update()
            assert scaler.get_scale() == ref_scaler.get_scale(), (rank, scaler.get_scale(), ref_scaler.get_scale())
            if overflow:  # every rank skipped the step: nothing moved anywhere
                for n, p in pipe.named_parameters():
                    assert torch.equal(p, before[n]), f"rank {rank}: {n} moved in a step the scaler skipped"
    with pytest.raises(PlanError, match="gradient scalers disagree"):
        pipe.step(batches[1], scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** (4 + rank)))
    pipe.zero_grad()
    return {"scale": scaler.get_scale()}


@pytest.mark.timeout(300)
def test_global_gradient_clipping_and_loading_a_state_dict_2_ranks():
    out = spawn(_loop, 2, (), timeout=240)
    assert out[0]["norm_2.0"] == out[1]["norm_2.0"] and out[0]["norm_inf"] == out[1]["norm_inf"]
    assert out[0]["local_norm"] != out[1]["local_norm"]  # each rank alone sees another norm
    assert out[0]["eval"] == out[1]["eval"]
    assert out[0]["outputs_compared"] == 0 and out[1]["outputs_compared"] == 18  # 3 batches x 2 x 3 outputs


def test_train_and_eval_modes_select_their_own_captures():
    """A model with dropout is captured per mode: after model.eval() (pipe.eval() sets it) the chunks run without
    dropout and the loss equals the unsplit model's in eval mode; back in train mode dropout runs again (another
    capture, another loss).  A model without dropout shares its captures between the modes."""
    import torch
    import torch.nn as nn

    import dipc
    from dipc.runtime import run_local

    class WithDropout(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.emb, self.l1, self.drop, self.l2 = nn.Embedding(50, 16), nn.Linear(16, 16), nn.Dropout(p), \
                nn.Linear(16, 50)

        def forward(self, input_ids, labels):
            h = self.drop(torch.relu(self.l1(self.emb(input_ids))))
            return nn.functional.cross_entropy(self.l2(h).flatten(0, 1), labels.flatten())

    torch.manual_seed(0)
    batch = {"input_ids": torch.randint(0, 50, (4, 6)), "labels": torch.randint(0, 50, (4, 6))}
    model = WithDropout(0.5).eval()
    compiled = dipc.compile(model, batch, 2)
    assert compiled.mode_dependent
    with torch.no_grad():
        want = model(**batch)
    loss, _ = run_local(compiled, batch, 2)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    model.train()
    torch.manual_seed(1)
    loss_train, _ = run_local(compiled, batch, 2)
    assert len(compiled.programs) == 2 and abs(float(loss_train) - float(want)) > 1e-3
    assert any("dropout" in str(n.target) for n in compiled.programs[1].capture.graph.nodes)
    model.eval()
    again, _ = run_local(compiled, batch, 2)
    assert len(compiled.programs) == 2
    torch.testing.assert_close(again, want, rtol=1e-6, atol=1e-6)
    plain = dipc.compile(WithDropout(0.0), batch, 2)
    assert not plain.mode_dependent

    class FunctionalDropout(WithDropout):  # F.dropout with a literal p: no module or attribute says so
        def forward(self, input_ids, labels):
            h = nn.functional.dropout(torch.relu(self.l1(self.emb(input_ids))), 0.5, self.training)
            return nn.functional.cross_entropy(self.l2(h).flatten(0, 1), labels.flatten())

    torch.manual_seed(0)
    fmodel = FunctionalDropout(0.0).eval()  # compiled in eval mode: its capture has no dropout to see
    fcompiled = dipc.compile(fmodel, batch, 2)
    assert not fcompiled.mode_dependent
    with torch.no_grad():
        fwant = fmodel(**batch)
    fmodel.train()  # the first step in train mode captures the example in that mode and compares the graphs
    floss, _ = run_local(fcompiled, batch, 2)
    assert fcompiled.mode_dependent and abs(float(floss) - float(fwant)) > 1e-3
    fmodel.eval()
    torch.testing.assert_close(run_local(fcompiled, batch, 2)[0], fwant, rtol=1e-6, atol=1e-6)
    assert dipc.compile(FunctionalDropout(0.0), batch, 2).mode_dependent  # compiled in train mode: the graph says


def test_a_capture_made_under_autocast_is_the_models_own_graph():
    """A shape first met inside torch.autocast is captured without it (autocast is applied when the chunks run), so
    a later float32 step of that shape runs float32 graphs and equals the unsplit model."""
    import copy

    import torch
    import torch.nn as nn

    import dipc
    from dipc.runtime import run_local

    class PerSample(nn.Module):  # a Python loop over the batch: the batch size is fixed per capture
        def __init__(self):
            super().__init__()
            self.emb, self.layers, self.head = nn.Embedding(50, 16), nn.ModuleList(
                [nn.Linear(16, 16) for _ in range(4)]), nn.Linear(16, 50)

        def forward(self, input_ids, labels):
            h = torch.stack([self.emb(input_ids)[b] for b in range(input_ids.shape[0])])
            for layer in self.layers:
                h = h + torch.relu(layer(h))
            return nn.functional.cross_entropy(self.head(h).flatten(0, 1).float(), labels.flatten())

    torch.manual_seed(0)
    model = PerSample()
    ref = copy.deepcopy(model)
    small = {"input_ids": torch.randint(0, 50, (4, 6)), "labels": torch.randint(0, 50, (4, 6))}
    big = {"input_ids": torch.randint(0, 50, (6, 6)), "labels": torch.randint(0, 50, (6, 6))}
    compiled = dipc.compile(model, small, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        run_local(compiled, big, 2)  # the new capture of 6 samples happens here
    model.zero_grad()
    loss, plan = run_local(compiled, big, 2)
    want = ref(**big)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=1e-6)
    assert {t.dtype for acts in plan.ranks for a in acts for t in a.tensors} <= {"float32", "int64", "bool"}
    # a plan dipc.simulate makes under autocast carries autocast's dtypes, and runs under it
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, amp_plan = dipc.simulate(compiled, big, 2)
        run_local(compiled, big, 2, amp_plan)
    assert "bfloat16" in {t.dtype for acts in amp_plan.ranks for a in acts for t in a.tensors}


def test_a_model_cast_to_bfloat16_as_a_whole():
    """model.to(torch.bfloat16) compiles as it is (bf16 parameters, activations and messages); one step per batch
    (the image-free one first) equals the unsplit bf16 model: loss exactly or to an ulp, each gradient within 2^-6
    of its largest element."""
    import copy

    import torch

    import dipc
    import pipeline_cases as pc
    from dipc.runtime import run_local
    from dipc.testing import unsplit_loss

    torch.manual_seed(0)
    ref = pc.vlm(True).to(torch.bfloat16)
    batches = [{k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in b.items()}
               for b in pc.vlm_batches_mixed()]
    model = copy.deepcopy(ref)
    compiled = dipc.compile(model, batches[0], 2, sub_microbatch_size={"vision": 2})
    params = dict(ref.named_parameters())
    for i in (3, 1):
        loss, plan = run_local(compiled, batches[i], 2)
        want = unsplit_loss(ref, batches[i])
        want.backward()
        torch.testing.assert_close(loss.float(), want.detach().float(), rtol=2 ** -7, atol=1e-5)
        assert {t.dtype for acts in plan.ranks for a in acts for t in a.tensors} >= {"bfloat16"}
        for n, p in model.named_parameters():
            if params[n].grad is not None:
                assert p.grad.dtype == torch.bfloat16
                err = float((p.grad.float() - params[n].grad.float()).abs().max())
                assert err <= 2 ** -6 * float(params[n].grad.float().abs().max()) + 1e-7, (i, n, err)
        model.zero_grad()
        ref.zero_grad()


def test_a_materialised_meta_model_refuses_values_nobody_set(tmp_path):
    """A meta-device model on a 1-rank pipeline: an init that leaves RoPE's non-persistent table unset is refused at
    construction, naming it; a model whose parameters neither init nor a checkpoint set is refused at the first
    step, naming them (materialised tensors start as NaN), instead of a silent NaN loss."""
    import torch
    import torch.distributed as dist

    import dipc
    import pipeline_cases as pc
    from dipc.launch import free_port
    from dipc.models.language import RotaryEmbedding

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        batches = pc.vlm_batches_mixed()
        with torch.device("meta"):
            model = pc.vlm(True)
        compiled = dipc.compile(model, batches[0], 1)
        with pytest.raises(ValueError, match=r"non-persistent buffer.*rotary_emb\.inv_freq"):
            compiled.runtime(n_microbatches=2, timeout=60, init=lambda m: None)

        def rope_only(m):
            if isinstance(m, RotaryEmbedding):
                m.reset_inv_freq()
        with torch.device("meta"):
            model = pc.vlm(True)
        pipe = dipc.compile(model, batches[0], 1).runtime(n_microbatches=2, timeout=60, init=rope_only)
        with pytest.raises(ValueError, match="materialised but never set"):
            pipe.step(batches[1])
        torch.manual_seed(0)
        pipe.load_state_dict(pc.vlm(True).state_dict())
        assert torch.isfinite(pipe.step(batches[1]))
    finally:
        dist.destroy_process_group()


@pytest.mark.hf
def test_hf_llava_under_bf16_autocast_equals_the_unsplit_model():
    """Hugging Face LLaVA (masked_scatter of image features: its symbolic fake run fails, so the message dtypes come
    from a fake run at the trace's own sizes) under torch.autocast("cpu", bfloat16), all ranks in one process: loss
    and every gradient as the unsplit model's under the same autocast (bf16 tolerance, plus 1e-6 for the key biases
    whose true gradient is 0).  And, in fp32, a microbatch without a labelled token weighs 0 (the unsplit model's
    loss and gradients on the whole batch)."""
    import copy

    import torch

    import dipc
    import pipeline_cases as pc
    from dipc.runtime import run_local
    from dipc.testing import local_check, unsplit_loss

    torch.manual_seed(0)
    model = pc.llava()
    ref = copy.deepcopy(model)
    batches = pc.llava_batches_mixed()
    compiled = dipc.compile(model, batches[0], 2, check=False)
    params = dict(ref.named_parameters())
    for i in (2, 1):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = unsplit_loss(ref, batches[i])
            loss, plan = run_local(compiled, batches[i], 2)
        want.backward()
        torch.testing.assert_close(loss.float(), want.detach().float(), rtol=2 ** -8, atol=1e-5)
        assert "bfloat16" in {t.dtype for acts in plan.ranks for a in acts for t in a.tensors}
        for n, p in model.named_parameters():
            g = params[n].grad
            if p.grad is not None and g is not None:
                err = float((p.grad - g).abs().max())
                assert err <= 2 ** -6 * float(g.abs().max()) + 1e-6, (i, n, err)
        model.zero_grad()
        ref.zero_grad()
    # a microbatch without a labelled token (the first, text-only one) weighs 0: loss and gradients as the unsplit
    # model's on the whole batch, in which its tokens add nothing
    b = dict(batches[2])
    b["labels"] = b["labels"].clone()
    b["labels"][:2] = -100
    local_check(model, compiled, b, n_microbatches=2, rtol=1e-5, atol=1e-6)


def test_a_chunk_module_not_built_in_this_process_is_built_when_asked_for():
    """``build_only`` (what a runtime does with its rank's chunks) drops the other chunks' modules; a run of every
    rank in this process builds them again and equals the unsplit model."""
    import torch

    import dipc
    import pipeline_cases as pc
    from dipc.testing import local_check

    torch.manual_seed(0)
    model = pc.vlm(True)
    batches = pc.vlm_batches_mixed()
    compiled = dipc.compile(model, batches[0], 2, sub_microbatch_size={"vision": 2})
    mine = {c.index for c in compiled.partition.chunks if c.rank == 1}
    compiled.build_only(mine)
    assert {c for c, cm in compiled.program.chunks.items() if cm.gm is not None} == mine
    local_check(model, compiled, batches[1])
    assert all(cm.gm is not None for cm in compiled.program.chunks.values())
