"""Asynchronous planning (DIP §2.2) and plan delivery without pickle, on 2 CPU ranks (gloo).

One process group runs every scenario (a fresh runtime each, so that each gets its own background planner with the
environment the scenario sets), and every step's loss and gradients are compared with the unsplit model on the same
batch:

* ``dipc.prefetch`` / ``next_batch``: plans made in the background while the previous step runs, exact, with every
  rank pinned to its own CPU (``spawn(pin_cpus=True)``) and rank 0's planner on the other CPUs;
* a planner slowed on purpose (``DIPC_PLANNER_DELAY_S``) misses its deadline: the step runs the fallback template
  without waiting for it, the ``dipc`` logger says so and the report counts it;
* a planner that raises (``DIPC_PLANNER_FAIL``) and one killed with SIGKILL: the step falls back, training goes
  on, and a killed planner is restarted for the next batch;
* a ``next_batch`` that is not the next step's batch: planned again synchronously;
* with ``pickle.loads`` / ``pickle.Unpickler`` made to fail in every rank, steps (synchronous and asynchronous), the
  gathered state dict and the trace events still work: nothing pickled reaches a socket.
"""
import pytest

from dipc.launch import spawn

TIMEOUT = 240


def _compare(pipe, ref, batch, loss, rank, what):
    import torch
    from dipc.testing import unsplit_loss

    ref.zero_grad(set_to_none=True)
    want = unsplit_loss(ref, batch)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"rank {rank} {what}: loss differs: {m}")
    params = dict(ref.named_parameters(remove_duplicate=False))
    for name, p in pipe.named_parameters():
        rp = params[name]
        if rp.grad is None:
            assert p.grad is None or not p.grad.any(), f"rank {rank} {what}: unexpected gradient of {name}"
            continue
        torch.testing.assert_close(p.grad, rp.grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank} {what}: gradient of {name} differs: {m}")
    for p in pipe.parameters():
        p.grad = None


def _scenarios(rank, world):
    import copy
    import logging
    import os
    import pickle
    import signal

    import torch
    import torch.distributed.distributed_c10d as c10d

    import dipc
    import pipeline_cases as pc

    torch.manual_seed(0)
    model = pc.vlm()
    ref = copy.deepcopy(model)
    batches = pc.vlm_batches_mixed()
    compiled = dipc.compile(model, batches[0], world, sub_microbatch_size={"vision": 2})
    steps = batches[1:]
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("dipc").addHandler(Keep())
    out = {}

    def run(label, env=None, **kw):
        os.environ.pop("DIPC_PLANNER_DELAY_S", None)
        os.environ.pop("DIPC_PLANNER_FAIL", None)
        os.environ.update(env or {})
        pipe = compiled.runtime(n_microbatches=2, timeout=60, **kw)
        reports = []
        try:
            for i, batch in enumerate(dipc.prefetch(steps)):
                loss = pipe.step(batch)
                _compare(pipe, ref, batch, loss, rank, f"{label} step {i}")
                reports.append(pipe.last_report)
                if label == "killed" and rank == 0 and i == 0:  # the planner is busy with step 1's batch
                    os.kill(pipe._planner.pid, signal.SIGKILL)
                if label == "async" and rank == 0 and i == 0:  # spawn(pin_cpus=True): the planner is off rank 0's CPU
                    allowed = sorted(os.sched_getaffinity(os.getppid()))
                    mine = os.sched_getaffinity(0)
                    out["pinned"] = (sorted(mine), sorted(os.sched_getaffinity(pipe._planner.pid)), allowed)
        finally:
            pipe.close()
        out[label] = [(r.plan_source, r.schedule, r.fallback_reason) for r in reports]
        out[label + "_fallbacks"] = pipe.fallbacks
        return pipe, reports

    # background plans, exact (every rank pinned to its own CPU, the planner on the others)
    allowed = sorted(os.sched_getaffinity(os.getppid()))
    assert os.sched_getaffinity(0) == {allowed[rank % len(allowed)]}, (rank, allowed)
    _, reps = run("async")
    if rank == 0:
        mine, planner, allowed = out["pinned"]
        assert mine == [allowed[0]], out["pinned"]
        if len(allowed) > 1:  # the host's other CPUs: none of them rank 0's
            assert allowed[0] not in planner and set(planner) <= set(allowed), out["pinned"]
        else:
            assert planner == mine, out["pinned"]
    assert [r.plan_source for r in reps] == ["sync"] + ["async"] * (len(steps) - 1), out["async"]
    if rank == 0:
        assert all(r.planner_s is not None for r in reps[1:])
        sim = reps[1].simulate()  # the planner's figures (or made now): the report's bubble ratio and its causes
        assert 0 <= sim["bubble_ratio"] < 1 and len(sim["bubble_causes"]) == world and len(sim["peak_memory"]) == world
        assert "async" in reps[1].summary() and "bubble" in reps[1].summary()
    # a planner slowed on purpose: the step does not wait for it
    records.clear()
    _, reps = run("slow", {"DIPC_PLANNER_DELAY_S": "30"}, plan_wait_s=0.05)
    assert [r.plan_source for r in reps[1:]] == ["fallback"] * (len(steps) - 1), out["slow"]
    assert all(r.schedule == "1f1b" for r in reps[1:])
    assert all("deadline missed" in r.fallback_reason for r in reps[1:]), out["slow"]  # every rank says why
    assert reps[-1].fallbacks == len(steps) - 1  # and counts them
    if rank == 0:
        assert any("running the '1f1b' template instead" in m for m in records), records
        # not blocked: each step waited its 0.05 s deadline, far from the planner's 30 s
        assert max(r.plan_s for r in reps) < 10.0, [r.plan_s for r in reps]
    # a planner that raises: the step is planned now (with its own schedule), and training goes on
    _, reps = run("fail", {"DIPC_PLANNER_FAIL": "1"}, fallback_schedule="gpipe")
    assert [(r.plan_source, r.schedule) for r in reps[1:]] == [("sync", "dip")] * (len(steps) - 1), out["fail"]
    assert all("fails on purpose" in r.fallback_reason for r in reps[1:]), out["fail"]
    assert reps[-1].fallbacks == 0
    # a planner killed mid-plan: that step falls back, the next one gets a restarted planner's plan
    _, reps = run("killed", {"DIPC_PLANNER_DELAY_S": "1"}, plan_wait_s=20)
    assert reps[1].plan_source == "fallback" and reps[2].plan_source == "async", out["killed"]
    if rank == 0:
        assert "died" in reps[1].fallback_reason, out["killed"]
    # a wrong look-ahead (another batch, another schedule, not a mapping): planned again, exact (the planner's
    # reply is awaited up to 30 s: on a loaded machine the SCHED_IDLE planner may get no core for a second)
    pipe = compiled.runtime(n_microbatches=2, timeout=60, plan_wait_s=30)
    try:
        loss = pipe.step(steps[0], next_batch=steps[2])
        _compare(pipe, ref, steps[0], loss, rank, "wrong look-ahead step 0")
        loss = pipe.step(steps[1], next_batch=steps[2], schedule="gpipe")
        _compare(pipe, ref, steps[1], loss, rank, "wrong look-ahead step 1")
        assert pipe.last_report.plan_source == "sync" and pipe.fallbacks == 0, \
            (pipe.last_report.plan_source, pipe.fallbacks, pipe.last_report.fallback_reason)
        loss = pipe.step(steps[2], schedule="1f1b", next_batch=[steps[3]])  # planned for gpipe: not taken
        _compare(pipe, ref, steps[2], loss, rank, "wrong look-ahead step 2")
        rep = pipe.last_report
        assert (rep.plan_source, rep.schedule) == ("sync", "1f1b"), (rep.plan_source, rep.schedule)
        if rank == 0:
            assert "schedule 'gpipe'" in rep.fallback_reason, rep.fallback_reason
        loss = pipe.step(steps[3])  # the list was refused with a warning: planned now
        _compare(pipe, ref, steps[3], loss, rank, "wrong look-ahead step 3")
        assert pipe.last_report.plan_source == "sync" and pipe.fallbacks == 0
        if rank == 0:
            assert any("next_batch must be a mapping" in m for m in records), records
        out["wrong"] = pipe.last_report.plan_source
        # the look-ahead was planned without autocast and its step runs under it: planned again, and it says why
        pipe.step(steps[0], next_batch=steps[1])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pipe.step(steps[1])
        rep = pipe.last_report
        assert rep.plan_source == "sync" and pipe.fallbacks == 0, (rep.plan_source, rep.fallback_reason)
        if rank == 0:
            assert "planned under torch.autocast None" in rep.fallback_reason, rep.fallback_reason
        pipe.zero_grad()
    finally:
        pipe.close()

    # a plan handed over that validates on its own but lacks a gradient message (and the dependency it carried):
    # it would run and leave gradients short; refused on every rank (a break-it run), and the next step is exact
    from dipc.plan import PlanError
    from dipc.planner import build_workload, make_plan, split_for

    pipe = compiled.runtime(n_microbatches=2, timeout=60)
    try:
        plan = make_plan(compiled, build_workload(compiled, split_for(compiled, steps[0], 2)), 0)
        s = next(a for acts in plan.ranks for a in acts if a.kind == "SEND_B" and a.tensors)
        short = copy.deepcopy(plan)
        short.ranks = [[a for a in acts if a.msg != s.msg] for acts in short.ranks]
        short.deps = {k: [d for d in v if not (k == s.peer_stage and d == s.stage)] for k, v in short.deps.items()}
        dipc.validate(short)
        with pytest.raises(PlanError, match="but the plan has no message for it"):
            pipe.step(steps[0], plan=short)
        loss = pipe.step(steps[0], plan=plan)
        _compare(pipe, ref, steps[0], loss, rank, "the given plan after a refused one")
    finally:
        pipe.close()

    # nothing pickled reaches a socket: unpickling fails in this rank from here on
    def refuse(*a, **k):
        raise AssertionError("pickle was used to read a message")

    saved = (pickle.loads, pickle.Unpickler, c10d._unpickler)
    pickle.loads, pickle.Unpickler, c10d._unpickler = refuse, refuse, refuse
    try:
        # and the planner makes plans only: the step report's simulation is made on demand, here
        pipe = compiled.runtime(n_microbatches=2, timeout=60, plan_wait_s=30, simulate_steps=False)
        for i, batch in enumerate(dipc.prefetch(steps[:3])):
            loss = pipe.step(batch)
            _compare(pipe, ref, batch, loss, rank, f"no-pickle step {i}")
        rep = pipe.last_report
        assert rep.plan_source == "async" and rep.simulation is None, (rep.plan_source, rep.fallback_reason)
        if rank == 0:
            assert pipe._planner.simulations == {}, sorted(pipe._planner.simulations)
            assert "bubble" not in rep.summary()
        sim = rep.simulate()
        assert 0 <= sim["bubble_ratio"] < 1 and len(sim["peak_memory"]) == world
        sd = pipe.full_state_dict()
        events = pipe.trace_events()
        out["trace"] = (events, pipe.last_timing["execute_s"])
        pipe.load_state_dict(sd)  # the checkpoint round trip, still without pickle
        loss = pipe.step(steps[3])
        _compare(pipe, ref, steps[3], loss, rank, "no-pickle step after loading")
        pipe.close()
    finally:
        pickle.loads, pickle.Unpickler, c10d._unpickler = saved
    want = ref.state_dict()
    assert set(sd) == set(want), sorted(set(sd) ^ set(want))
    for k, v in want.items():
        assert torch.equal(sd[k], v), f"{k} differs in the gathered state dict"
    assert {e["rank"] for e in events} == set(range(world))
    return out



def test_planner_cpus_default_to_the_cpus_rank_0_leaves_and_bad_ones_are_refused():
    """``planner_cpus``: given, they are the planning process's; by default, once ``pin_rank`` pinned the training
    process, the other CPUs the ranks were pinned among; None (the scheduler's choice) for a process dipc did not
    pin, a ``taskset`` restriction included (found by a break-it run: its planner left the user's CPUs); bad values
    are refused by name, ``pin_rank``'s when called and the runtime's when it is made (before it needs a process
    group)."""
    import os

    import torch

    import dipc
    import pipeline_cases as pc
    from dipc.launch import pin_rank
    from dipc.planner.background import planner_cpus

    assert planner_cpus({3, 1}) == {1, 3}
    saved, env = os.sched_getaffinity(0), os.environ.pop("DIPC_PINNED_CPUS", None)
    try:
        assert planner_cpus() is None  # not pinned
        os.sched_setaffinity(0, {min(saved)})  # restricted by the user (taskset), not by dipc: kept
        assert planner_cpus() is None
        os.sched_setaffinity(0, saved)
        cpu = pin_rank(0)
        assert os.sched_getaffinity(0) == {cpu} == {min(saved)}
        assert planner_cpus() == (saved - {cpu} or None)
        n = os.cpu_count()
        for bad in ([], [-1], [True], [n], [2 ** 40], 5, "01"):
            with pytest.raises(ValueError, match="cpus must be a non-empty list or set of CPU numbers"):
                pin_rank(0, bad)
        with pytest.raises(ValueError, match="rank must be an int"):
            pin_rank(-1)
    finally:  # every thread of this process back on its CPUs, the environment as it was
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), saved)
            except OSError:
                pass
        os.environ.pop("DIPC_PINNED_CPUS", None)
        if env is not None:
            os.environ["DIPC_PINNED_CPUS"] = env
    torch.manual_seed(0)
    batches = pc.vlm_batches_mixed()
    compiled = dipc.compile(pc.vlm(), batches[0], 2)
    for bad in ("01", [], [-1], [1.5], {True}, 3, {os.cpu_count()}, {2 ** 40}):
        with pytest.raises(ValueError, match="planner_cpus must be a non-empty list or set of CPU numbers"):
            compiled.runtime(planner_cpus=bad)


def test_prefetch_copies_each_batch_before_reading_the_next():
    """A loader may refill one dict in place (found by a break-it run: step 0 got batch 1's data): each batch
    prefetch yields is the one at its position, and its next_batch the one after it."""
    import torch

    import dipc

    def refilling(n):
        d = {}
        for i in range(n):
            d["x"] = torch.full((2,), float(i))
            yield d

    got = [(float(b["x"][0]), None if b.next_batch is None else float(b.next_batch["x"][0]))
           for b in dipc.prefetch(refilling(3))]
    assert got == [(0.0, 1.0), (1.0, 2.0), (2.0, None)], got

@pytest.mark.timeout(300)
def test_async_planning_fallbacks_and_no_pickle_2_ranks(tmp_path):
    out = spawn(_scenarios, 2, (), timeout=TIMEOUT, pin_cpus=True)
    for label in ("async", "slow", "fail", "killed"):  # every rank ran the same schedules from the same sources
        assert [s[:2] for s in out[0][label]] == [s[:2] for s in out[1][label]], label
    _check_measured_trace(out, tmp_path)


def _check_measured_trace(out, tmp_path):
    """The measured trace of the no-pickle run's last step (issue "The house": the measured Gantt chart draws
    sends, receives and waits): every rank's sends, receives and waits on messages are there, with durations >= 0,
    inside the rank's execution of the step and not overlapping its other events; the Chrome trace gives each its
    category, and the Gantt chart is drawn."""
    from dipc.sim.trace import category, chrome_trace, gantt_png

    events = out[0]["trace"][0]
    assert events == out[1]["trace"][0]  # gathered: the same on every rank
    for r in (0, 1):
        mine = sorted((e for e in events if e["rank"] == r), key=lambda e: e["start"])
        cats = {category(e["kind"]) for e in mine}
        assert cats == {"compute", "send", "recv", "wait"}, (r, cats)
        execute_s = out[r]["trace"][1]
        assert all(0 <= e["start"] <= e["end"] <= execute_s for e in mine), (r, execute_s, mine)
        for a, b in zip(mine, mine[1:]):
            assert a["end"] <= b["start"] + 1e-9, (r, a, b)
        waits = [e for e in mine if e["kind"] == "WAIT"]
        assert all(e["name"].startswith("wait ") for e in waits), waits
    cats = {x["cat"] for x in chrome_trace(events)["traceEvents"] if x["ph"] == "X"}
    assert cats == {"compute", "send", "recv", "wait"}, cats
    path = gantt_png(events, str(tmp_path / "measured.png"), "measured")
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["vlm", "t2v"])
def test_planner_frame_without_float_values_plans_the_same(case):
    """The background planner gets floating-point tensors (pixel values, latents, timesteps) as shape and dtype
    only: the stage graph, its digest and the plan it makes from that frame are those of the whole batch, for every
    batch of the case (text-only microbatches first included), and the frame carries only the integer tensors'
    bytes."""
    import torch

    import dipc
    import pipeline_cases as pc
    from dipc.planner.background import decode_batch, encode_batch
    from dipc.planner import build_workload, make_plan, split_for
    from dipc.planner.workload import step_digest

    torch.manual_seed(0)
    model, batches = (pc.vlm(), pc.vlm_batches_mixed()) if case == "vlm" else (pc.t2v(), pc.t2v_batches())
    kw = {"sub_microbatch_size": {"vision": 2}} if case == "vlm" else {}
    compiled = dipc.compile(model, batches[0], 2, **kw)
    assert any(v.is_floating_point() for v in batches[0].values() if isinstance(v, torch.Tensor))
    for i, batch in enumerate(batches):
        full = encode_batch({"step": i}, batch)
        frame = encode_batch({"step": i}, batch, float_values=False)
        ints = sum(v.numel() * v.element_size() for v in batch.values()
                   if isinstance(v, torch.Tensor) and not v.is_floating_point())
        assert len(frame) <= len(full) + 1 and len(frame) - ints < 4096, (len(frame), len(full), ints)
        head, meta = decode_batch(frame)
        assert head == {"step": i} and meta.keys() == batch.keys()
        for k, v in batch.items():
            if isinstance(v, torch.Tensor):
                assert meta[k].shape == v.shape and meta[k].dtype == v.dtype, k
                if v.is_floating_point():
                    assert not meta[k].any(), k
                else:
                    assert torch.equal(meta[k], v), k
        want_w = build_workload(compiled, split_for(compiled, batch, 2))
        got_w = build_workload(compiled, split_for(compiled, meta, 2))
        assert step_digest(compiled, got_w) == step_digest(compiled, want_w), f"batch {i}"
        want = make_plan(compiled, want_w, i, budget_s=0.0).to_json()
        got = make_plan(compiled, got_w, i, budget_s=0.0).to_json()
        assert got == want, f"batch {i}: the plan made from the frame differs"
        # the digest reads every integer value: one token changed (anywhere) is another step
        key = next(k for k, v in batch.items() if isinstance(v, torch.Tensor) and not v.is_floating_point())
        for where in (0, -1):
            other = dict(batch, **{key: batch[key].clone()})
            other[key].view(-1)[where] += 1
            assert step_digest(compiled, build_workload(compiled, split_for(compiled, other, 2))) != \
                step_digest(compiled, want_w), f"batch {i}: {key}[{where}] changed, the digest did not"
