"""Faults (issue "Faults"): a failure on one rank stops every rank within seconds, ranks that disagree are caught,
and nothing is left half-done.  gloo on CPU; the runtime's timeout is 300 s, so a failure seen in seconds was passed
on, not timed out.

One process group per test runs several scenarios.  After each failure every rank must raise the same
:class:`dipc.runtime.StepFailed` (or ``PlanError`` for disagreeing ranks) naming the failing rank, the step and the
action, within 10 s, with every ``.grad`` exactly as before the step; the next step must then run and equal the
unsplit model (the process group stays usable: the failed plan was drained, no operation is left unmatched).
"""
import pytest

from dipc.launch import spawn


def _setup(world, **kw):
    import copy

    import torch

    import dipc
    import pipeline_cases as pc

    torch.manual_seed(0)
    model = pc.vlm(*kw.pop("model_args", ()))
    ref = copy.deepcopy(model)
    batches = kw.pop("batches", None) or pc.vlm_batches_mixed()
    compiled = dipc.compile(model, batches[0], world, **kw)
    return compiled, ref, batches


def _good_step(pipe, ref, batch, rank, what):
    import torch
    from dipc.testing import unsplit_loss

    for p in pipe.parameters():
        p.grad = None
    ref.zero_grad(set_to_none=True)
    loss = pipe.step(batch)
    want = unsplit_loss(ref, batch)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {what}: {m}")
    params = dict(ref.named_parameters())
    for n, p in pipe.named_parameters():
        if params[n].grad is not None:
            torch.testing.assert_close(p.grad, params[n].grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {what}: gradient of {n}: {m}")


def _expect_failure(pipe, batch, rank, what, arm=None, **step_kw):
    """Run a step that must fail: returns (exception, seconds), after checking .grad is untouched (the previous
    step's gradients are still there: the failed step must leave exactly them).  ``arm`` is called first."""
    import time

    import torch

    if arm is not None:
        arm()
    before = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
    assert before, "the failing step must find gradients to keep"
    t = time.perf_counter()
    try:
        pipe.step(batch if "bad" not in step_kw else step_kw.pop("bad"), **step_kw)
    except Exception as e:  # noqa: BLE001
        took = time.perf_counter() - t
        after = {n: p.grad for n, p in pipe.named_parameters() if p.grad is not None}
        assert set(after) == set(before), f"rank {rank} {what}: gradients appeared or vanished"
        for n, g in before.items():
            assert torch.equal(after[n], g), f"rank {rank} {what}: .grad of {n} changed by the failed step"
        return e, took
    raise AssertionError(f"rank {rank} {what}: the step did not raise")


def _in_rank_failures(rank, world, fwd_rank=0, bwd_rank=0, only=None):
    import dipc
    import pipeline_cases as pc
    from dipc.runtime import StepFailed

    if world == 4:
        compiled, ref, batches = _setup(world, model_args=(False, 8, 8), batches=pc.vlm_batches_4ranks(),
                                        chunks_per_rank={"vision": 2, "text": 2}, sub_microbatch_size={"vision": 1})
    else:
        compiled, ref, batches = _setup(world, sub_microbatch_size={"vision": 2})
    pipe = compiled.runtime(n_microbatches=world, timeout=300)
    good, other = batches[1], batches[2]
    out = {}
    _good_step(pipe, ref, other, rank, "first step")

    def check(label, e, took, origin, action_kind):
        assert isinstance(e, StepFailed), f"rank {rank} {label}: {type(e).__name__}: {e}"
        assert took < 10, f"rank {rank} {label}: the failure took {took:.1f} s to reach this rank"
        assert e.origin == origin and e.usable and f"rank {origin} failed in" in str(e), str(e)
        assert e.step == pipe.step_index and f"step {e.step}" in str(e), str(e)
        assert action_kind in e.action, (label, e.action)
        out[label] = str(e)
        _good_step(pipe, ref, other, rank, f"after {label}")  # the group is usable and exact

    def want(label):
        return only is None or label in only

    # a label out of range: the last rank's loss, in its second microbatch's forward
    bad = dict(good)
    labels = bad["labels"].clone()
    labels[-1, 3] = 10_000
    bad["labels"] = labels
    if want("label"):
        e, took = _expect_failure(pipe, good, rank, "label", bad=bad)
        check("label", e, took, world - 1, "F")
        assert "out of bounds" in str(e) or "IndexError" in str(e), str(e)

    # a token id past the embedding table: caught by the batch's validation, on every rank, before any message
    bad = dict(good)
    ids = bad["input_ids"].clone()
    ids[0, -3] = 10_000
    bad["input_ids"] = ids
    if want("table"):
        e, took = _expect_failure(pipe, good, rank, "table", bad=bad)
        assert isinstance(e, dipc.BatchError) and "10000" in str(e), f"{type(e).__name__}: {e}"
        out["table"] = str(e)
        _good_step(pipe, ref, other, rank, "after table")

    # a bug in a forward of a rank's chunks, in its second forward: its peers are blocked in receives
    armed, calls = [], []

    def pre(mod, args, kwargs):
        calls.append(1)
        if armed and len(calls) > 1:
            raise ValueError("a bug in a forward, on purpose")
    hooks = [cm.gm.register_forward_pre_hook(pre, with_kwargs=True) for prog in compiled.programs
             for c, cm in prog.chunks.items()
             if cm.gm is not None and compiled.partition.chunks[c].rank == rank == fwd_rank]
    e, took = _expect_failure(pipe, good, rank, "forward", arm=lambda: (armed.append(1), calls.clear()))
    for h in hooks:
        h.remove()
    check("forward", e, took, fwd_rank, "F")
    assert "on purpose" in str(e), str(e)

    # a bug in a backward on rank 0 (a gradient hook that raises) while rank 1 waits for its last sends
    armed = []

    def hook(g):
        if armed:
            raise RuntimeError("a bug in a backward, on purpose")
    h = pipe.parameters()[0].register_hook(hook) if rank == bwd_rank else None
    e, took = _expect_failure(pipe, good, rank, "backward", arm=lambda: armed.append(1))
    if h is not None:
        h.remove()
    check("backward", e, took, bwd_rank, "B")
    assert "on purpose" in str(e), str(e)
    if only is None:  # not an Exception: that rank gets it back, its peers a StepFailed, the group stays in step
        def interrupt(g):
            raise KeyboardInterrupt
        h = pipe.parameters()[0].register_hook(interrupt) if rank == world - 1 else None
        import time as _time
        t = _time.perf_counter()
        try:
            pipe.step(good)
            raise AssertionError("no error")
        except KeyboardInterrupt:
            out["interrupt"] = "KeyboardInterrupt"
        except StepFailed as e:
            out["interrupt"] = f"StepFailed: {e}"
            assert e.origin == world - 1 and e.usable and _time.perf_counter() - t < 10, str(e)
        if h is not None:
            h.remove()
        _good_step(pipe, ref, other, rank, "after interrupt")
    return out


@pytest.mark.timeout(300)
def test_failures_inside_a_rank_reach_every_rank_at_once_and_leave_grads_as_before_2_ranks():
    out = spawn(_in_rank_failures, 2, (), timeout=240)
    for label in ("label", "table", "forward", "backward"):
        assert out[0][label] == out[1][label], label  # the same error on every rank
    assert out[1]["interrupt"] == "KeyboardInterrupt" and out[0]["interrupt"].startswith("StepFailed"), \
        (out[0]["interrupt"], out[1]["interrupt"])


@pytest.mark.timeout(400)
def test_failures_on_middle_ranks_reach_every_rank_of_4():
    """Rank 1's forward and rank 2's backward fail: the abort messages travel both ways along the pipeline."""
    out = spawn(_in_rank_failures, 4, (1, 2, ("forward", "backward")), timeout=360)
    for label in ("forward", "backward"):
        assert len({o[label] for o in out}) == 1, (label, [o[label] for o in out])


def _disagreeing(rank, world):
    import dipc
    from dipc.plan import PlanError
    import pipeline_cases as pc

    compiled, ref, batches = _setup(world, sub_microbatch_size={"vision": 2})
    pipe = compiled.runtime(n_microbatches=2, timeout=300)
    good = batches[1]
    out = {}

    def expect(label, **kw):
        import pytest as _pytest
        with _pytest.raises(PlanError) as info:
            pipe.step(kw.pop("batch", good), **kw)
        out[label] = str(info.value)
        _good_step(pipe, ref, batches[2], rank, f"after {label}")

    # different token values on one rank
    other = dict(good)
    ids = other["input_ids"].clone()
    ids[0, -1] = (ids[0, -1] + 1) % 100 + 3
    other["input_ids"] = ids
    expect("values", batch=other if rank == 1 else good)
    # different pixel values only (issue 39 §4: the step check covered integer tensors alone)
    pixels = dict(good, pixel_values=good["pixel_values"].clone())
    pixels["pixel_values"][0, 0, 0, 0] += 1.0
    expect("floats", batch=pixels if rank == 1 else good)
    # different shapes (sequence length)
    expect("shapes", batch=pc.vlm_batch([2, 1, 0, 0], 22, 1) if rank == 1 else good)
    # different microbatch counts
    expect("microbatches", n_microbatches=4 if rank == 1 else 2)
    # a failure on one rank before the plan runs (building its stage graph): every rank raises, naming it
    if rank == 1:
        real = pipe._workload

        def broken(mbs, amp=None):
            pipe._workload = real  # once
            raise RuntimeError("cannot build this step, on purpose")
        pipe._workload = broken
    expect("local")
    # bad input on one rank only (a token past the table, a microbatch count of 0, another schedule): that rank
    # raises its own error, the others a PlanError naming it, in the same step; the group stays in step
    bad = dict(good)
    ids = bad["input_ids"].clone()
    ids[0, -3] = 10_000
    bad["input_ids"] = ids
    for label, kw in (("one_bad_batch", {"batch": bad}), ("one_zero_mb", {"n_microbatches": 0}),
                      ("one_schedule", {"schedule": "gpipe"})):
        try:
            pipe.step(**({"batch": good} | kw)) if rank == 1 else pipe.step(good)
            raise AssertionError(f"rank {rank} {label}: no error")
        except (PlanError, dipc.BatchError, ValueError) as e:
            out[label] = f"{type(e).__name__}: {e}"
        _good_step(pipe, ref, batches[2], rank, f"after {label}")
    # a position past a learned table: latents with more frames than the DiT's learned position table; the
    # re-capture for that size fails on every rank, which all raise the same error before any activation moves
    import torch
    t2v = pc.t2v()
    t2v_batches = pc.t2v_batches()
    tp = dipc.compile(t2v, t2v_batches[0], world).runtime(n_microbatches=2, timeout=300)
    long = dict(t2v_batches[1])
    for k in ("latents", "noise"):
        shape = list(long[k].shape)
        shape[2] *= 4  # frames
        long[k] = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    import time
    t = time.perf_counter()
    with __import__("pytest").raises(PlanError) as info:
        tp.step(long)
    took = time.perf_counter() - t  # a failed re-capture attempt, not the 300 s timeout
    assert took < 30, f"rank {rank}: the refused step took {took:.1f} s"
    out["table"] = str(info.value)
    # a skipped step on one rank: rank 1 is one step behind
    if rank == 1:
        pipe.step_index -= 1
    with __import__("pytest").raises(PlanError) as info:
        pipe.step(good)
    out["skipped"] = str(info.value)
    return out


@pytest.mark.timeout(300)
def test_ranks_that_disagree_all_raise_before_any_activation_moves_2_ranks():
    out = spawn(_disagreeing, 2, (), timeout=240)
    for label in ("values", "floats", "shapes", "microbatches"):
        assert "the ranks disagree on the step" in out[0][label] and "the ranks disagree" in out[1][label], label
    assert "holds other floating-point values than rank 0's" in out[1]["floats"], out[1]["floats"]
    assert all("rank 1 could not build the step: RuntimeError: cannot build this step, on purpose" in o["local"]
               for o in out), [o["local"] for o in out]
    assert all("different steps (from step 7 to step 8" in o["skipped"] for o in out), [o["skipped"] for o in out]
    assert out[1]["one_bad_batch"].startswith("BatchError") and "10000" in out[1]["one_bad_batch"]
    assert "rank 1 could not build the step: BatchError" in out[0]["one_bad_batch"], out[0]["one_bad_batch"]
    assert out[1]["one_zero_mb"].startswith("ValueError: n_microbatches must be an int >= 1, got 0")
    assert "rank 1 could not build the step: ValueError" in out[0]["one_zero_mb"], out[0]["one_zero_mb"]
    assert all("this rank asked for schedule 'gpipe', rank 0 for 'dip'" in o["one_schedule"] for o in out), \
        [o["one_schedule"] for o in out]
    assert out[0]["table"] == out[1]["table"], (out[0]["table"], out[1]["table"])
    assert "step 0: rank 0 could not plan it: PlanError: building the step failed: CaptureError" in out[0]["table"]
    assert "must match the size of tensor" in out[0]["table"], out[0]["table"]
    assert "rank 0 split the batch into 2 microbatches, this rank into 4" in out[1]["microbatches"]


def _killed(rank, world, path, victim):
    import json
    import os
    import time

    import dipc
    from dipc.runtime import StepFailed

    os.environ["DIPC_PLANNER_DELAY_S"] = "60"  # rank 0's background planner is busy when a rank dies
    compiled, ref, batches = _setup(world, sub_microbatch_size={"vision": 2})
    pipe = compiled.runtime(n_microbatches=2, timeout=300, plan_wait_s=0.01)
    steps = dipc.prefetch(batches[1:4])
    pipe.step(next(steps))
    if rank == victim:  # dies in the middle of its next backward
        pipe.parameters()[0].register_hook(lambda g: os._exit(3))
    import torch

    before = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
    t = time.perf_counter()
    try:
        pipe.step(next(steps))
    except StepFailed as e:
        took = time.perf_counter() - t
        same = all(torch.equal(p.grad, before[n]) for n, p in pipe.named_parameters() if n in before)
        t = time.perf_counter()
        try:  # a broken group refuses further steps at once instead of waiting another timeout
            pipe.step(batches[3])
            refused = "no error"
        except RuntimeError as r:
            refused = f"{time.perf_counter() - t:.3f} s: {r}"
        with open(path, "w") as f:
            json.dump({"took": took, "error": str(e), "usable": e.usable, "grads_as_before": same,
                       "refused": refused}, f)
        return None
    finally:
        pipe.close()
    raise AssertionError("the step did not raise")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("victim", [pytest.param(1, marks=pytest.mark.slow), 0])
def test_a_killed_rank_is_seen_by_its_peer_within_seconds(tmp_path, victim):
    """Rank 1 or rank 0 exits mid-step (rank 0 while its background planner, a forked child that must not keep its
    sockets open, is busy): the survivor raises StepFailed naming the peer it waited for, within seconds."""
    import json

    from dipc.launch import SpawnError

    path = str(tmp_path / "survivor.json")
    with pytest.raises(SpawnError, match=rf"ranks \[{victim}\] exited without reporting"):
        spawn(_killed, 2, (path, victim), timeout=120)
    seen = json.load(open(path))
    assert seen["took"] < 10 and not seen["usable"] and seen["grads_as_before"], seen
    assert "process group broke at step 1" in seen["refused"] and float(seen["refused"].split(" s:")[0]) < 1, seen
    assert f"rank {victim}" in seen["error"] and "step 1" in seen["error"], seen["error"]
