"""The pipeline in an ordinary training loop (issue "A citizen of any torch training loop"), on 2 CPU ranks against
the unsplit model: global gradient clipping (2-norm and inf-norm, tied weights counted once) and loading a state
dict of the unsplit model (a resumed run), in one process group."""
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
    with pytest.raises(ValueError, match="max_norm must be a number >= 0"):
        pipe.clip_grad_norm_(-1.0)
    return out


@pytest.mark.timeout(300)
def test_global_gradient_clipping_and_loading_a_state_dict_2_ranks():
    out = spawn(_loop, 2, (), timeout=240)
    assert out[0]["norm_2.0"] == out[1]["norm_2.0"] and out[0]["norm_inf"] == out[1]["norm_inf"]
    assert out[0]["local_norm"] != out[1]["local_norm"]  # each rank alone sees another norm
