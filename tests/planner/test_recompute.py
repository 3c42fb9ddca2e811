"""The "recompute" memory strategy is executed, not only costed (issue 8 scope 4): a recomputed stage keeps only its
inputs after its forward, runs the chunk again in its backward, and the loss and every gradient still equal the
unsplit model's; the simulator charges it the forward again and counts its inputs as its kept memory."""
import pytest
import torch

import dipc
from dipc.launch import spawn
from dipc.runtime import run_local
from dipc.planner import build_workload, set_recompute
from dipc.testing import local_check

import pipeline_cases as pc


@pytest.fixture(scope="module")
def compiled():
    torch.manual_seed(0)
    model = pc.vlm(False, 4, 8)
    return model, dipc.compile(model, pc.vlm_batch([1, 1], 12, 0), 2, chunks_per_rank={"text": 2},
                               sub_microbatch_size={"vision": 1})


def _with_recompute(compiled, batch, n_mb, which):
    model, c = compiled
    model.zero_grad(set_to_none=True)
    loss, plan = run_local(c, batch, n_mb, recompute=which)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss, grads, plan


@pytest.mark.parametrize("which", [True, "text", "odd microbatches"])
def test_recomputed_stages_give_the_unsplit_gradients(compiled, which):
    model, c = compiled
    pred = {True: True, "text": lambda st: st.modality == "text", "odd microbatches": lambda st: st.mb % 2 == 1}[which]
    batch = pc.vlm_batch([2, 1, 0, 0, 1, 3], 14, 3)
    model.zero_grad(set_to_none=True)
    ref = model(**batch)
    ref.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    loss, grads, plan = _with_recompute(compiled, batch, 3, pred)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    assert set(grads) == set(want)
    for n in want:
        torch.testing.assert_close(grads[n], want[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
    import re
    text = plan.to_text()
    assert re.search(r"\b\d+F\d+(\.\d+)?r\b", text) and re.search(r"\b\d+B\d+(\.\d+)?r\b", text)  # 3F1r
    assert dipc.Plan.from_json(plan.to_json()).to_text() == text
    strategies = {a.strategy for _, a in plan.compute_actions()}
    assert strategies == ({"recompute"} if which is True else {"keep", "recompute"})
    local_check(model, c, batch, 3)  # and the same pipeline without recompute


def test_recompute_keeps_less_and_costs_a_forward_more(compiled):
    _, c = compiled
    batch = pc.vlm_batch([2, 1, 0, 0, 1, 3], 14, 3)
    mbs = c.batch_spec.split(batch, 3)
    keep, again = build_workload(c, mbs), build_workload(c, mbs)
    assert set_recompute(again, True) == sum(1 for s in keep.graph.stages.values() if s.kind == "F")
    for k, st in keep.graph.stages.items():
        r = again.graph.stages[k]
        if st.kind == "B":
            assert r.latency == pytest.approx(st.latency + keep.graph.stages["F" + k[1:]].latency)
    kept = sum(s.activation_bytes for s in keep.graph.stages.values() if s.kind == "F")
    recomputed = sum(s.activation_bytes for s in again.graph.stages.values() if s.kind == "F")
    assert recomputed < kept
    res_keep, _ = dipc.simulate(c, batch, 3)
    res_again, _ = dipc.simulate(c, batch, 3, recompute=True)
    assert max(res_again.peak_memory) < max(res_keep.peak_memory)
    assert res_again.iteration_time > res_keep.iteration_time


def test_a_plan_whose_forward_and_backward_disagree_on_the_strategy_is_refused(compiled):
    import dataclasses
    _, c = compiled
    _, _, plan = _with_recompute(compiled, pc.vlm_batch([1, 0, 1, 0], 12, 4), 2, True)
    r, i = next((r, i) for r, acts in enumerate(plan.ranks) for i, a in enumerate(acts) if a.kind == "B")
    plan.ranks[r][i] = dataclasses.replace(plan.ranks[r][i], strategy="keep")
    with pytest.raises(dipc.PlanError, match=r"has memory strategy 'recompute' but its backward .* has 'keep'"):
        dipc.validate(plan)


def _two_ranks(rank, world):
    from dipc.testing import reference_check
    return reference_check(rank, world, "pipeline_cases:vlm", (True,), "pipeline_cases:vlm_batches_mixed", (),
                           compile_kwargs={"sub_microbatch_size": {"vision": 2}}, n_microbatches=2,
                           check_state_dict=False, runtime_kwargs={"recompute": True})["grad_err"]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_recompute_on_two_ranks_with_a_tied_embedding():
    errs = spawn(_two_ranks, 2, timeout=180)
    assert max(errs) < 1e-5
