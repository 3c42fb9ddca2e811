"""Pipelines of 8 ranks, one process each (gloo), against the unsplit model (issue 39 §5): the reference VLM
and an ALBERT-style model whose weights are tied over ranks (0, 7) and over all eight, under DIP's schedule and
1F1B; and a rank killed mid-step, which every other rank hears of within seconds.  8 processes on the project's 2
cores take minutes: the full suite's (DIPC_FULL=1)."""
import json

import pytest

from dipc.launch import SpawnError, spawn
from test_pipeline import run_case

pytestmark = pytest.mark.slow

P = 8


@pytest.mark.timeout(900)
@pytest.mark.parametrize("schedule", ["dip", "1f1b"])
def test_reference_vlm_on_8_ranks(schedule):
    run_case(P, timeout=800, model_fn="pipeline_cases:vlm", model_args=(False, 8, 8),
             batches_fn="pipeline_cases:vlm_batches_4ranks", batches_args=(),
             compile_kwargs={"sub_microbatch_size": {"vision": 1}}, n_microbatches=8,
             runtime_kwargs={"schedule": schedule, "timeout": 600}, check_state_dict=False)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("schedule", ["dip", "1f1b"])
def test_weights_tied_over_8_ranks(schedule):
    run_case(P, timeout=800, model_fn="pipeline_cases:albert_like", model_args=(P,),
             batches_fn="pipeline_cases:albert_like_batches", batches_args=(P,),
             compile_kwargs={"split_points": {"text": [f"repeats.{i}" for i in range(1, P)]}}, n_microbatches=P,
             runtime_kwargs={"schedule": schedule, "timeout": 600})


def _killed(rank, world, path, victim):
    import os
    import time

    import torch

    import dipc
    import pipeline_cases as pc
    from dipc.runtime import StepFailed

    torch.manual_seed(0)
    batches = pc.vlm_batches_4ranks()
    compiled = dipc.compile(pc.vlm(False, 8, 8), batches[0], world, sub_microbatch_size={"vision": 1}, check=False)
    pipe = compiled.runtime(n_microbatches=8, timeout=600)
    pipe.step(batches[1])
    if rank == victim:  # dies in the middle of its next backward
        pipe.parameters()[0].register_hook(lambda g: os._exit(3))
    before = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
    t = time.perf_counter()
    try:
        pipe.step(batches[2])
    except StepFailed as e:
        same = all(torch.equal(p.grad, before[n]) for n, p in pipe.named_parameters() if n in before)
        with open(f"{path}.{rank}", "w") as f:
            json.dump({"took": time.perf_counter() - t, "error": str(e), "grads_as_before": same}, f)
        return None
    finally:
        pipe.close()
    raise AssertionError("the step did not raise")


@pytest.mark.timeout(900)
def test_a_killed_rank_reaches_all_8_within_seconds(tmp_path):
    victim = 3
    path = str(tmp_path / "survivor")
    with pytest.raises(SpawnError, match=rf"ranks \[{victim}\] exited without reporting"):
        spawn(_killed, P, (path, victim), timeout=800)
    for r in range(P):
        if r == victim:
            continue
        seen = json.load(open(f"{path}.{r}"))
        assert seen["took"] < 20 and seen["grads_as_before"] and "step 1" in seen["error"], (r, seen)
