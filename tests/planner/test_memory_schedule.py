"""Memory-aware interleaving (issue 8 scope 3): the dual-queue scheduler keeps every rank's live activations under
its limit on random VLM-like steps without deadlocking, switches stages to recompute only when nothing else fits
(else a PlanError naming the rank, the bytes and the limit), keeps the CPU model's memory flat as 1F1B does, and
its plans, recompute included, still give the unsplit model's gradients."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import dipc
from dipc.plan import PlanError
from dipc.validation import validate
from dipc.planner.lowering import lower
from dipc.planner.schedule import list_schedule
from dipc.sim.simulate import simulate_plan

import pipeline_cases as pc
from stage_graphs import vlm_graph


def _peaks(graph, p, sched):
    plan = lower(graph, sched, [c % p for c in range(2 * p)])
    validate(plan)
    lat = {k: s.latency for k, s in graph.stages.items()}
    act = {k: s.activation_bytes for k, s in graph.stages.items() if s.kind == "F"}
    return simulate_plan(plan, lat, activation_bytes=act).peak_memory, plan


@settings(max_examples=60, deadline=None)
@given(p=st.sampled_from([2, 4, 8]), images=st.lists(st.integers(0, 48), min_size=1, max_size=64),
       slack=st.floats(1.0, 4.0))
def test_live_activations_stay_under_the_limit_and_the_scheduler_never_deadlocks(p, images, slack):
    graph = vlm_graph(p, images, b_i=12, vision_per_image=1.0, text_bytes=4.0)
    # the smallest limit that always works: one microbatch's forwards on the busiest rank (its text and all its
    # vision sub-microbatches), times a random slack
    one = max(sum(s.activation_bytes for s in graph.stages.values() if s.kind == "F" and s.rank == r and s.mb == m)
              for r in range(p) for m in range(len(images)))
    limit = one * slack
    sched = list_schedule(graph, p, memory_limit=limit)
    assert sum(len(o) for o in sched.order) == len(graph.stages)
    peaks, _ = _peaks(graph, p, sched)
    assert max(peaks) <= limit * (1 + 1e-9), (peaks, limit)


@settings(max_examples=40, deadline=None)
@given(p=st.sampled_from([2, 4, 8]), images=st.lists(st.integers(0, 30), min_size=1, max_size=24),
       window=st.sampled_from([None, 1, 2, 3, 8]), seed=st.integers(0, 1000), text_k=st.sampled_from([1, 2]),
       comm=st.sampled_from([0.0, 0.05, 0.7]))
def test_the_unlimited_list_schedule_on_heaps_is_the_general_loops_schedule(p, images, window, seed, text_k, comm):
    """Without a memory limit, list_schedule runs on per-rank heaps (the search's rollouts): the same order and
    the same start and end of every stage as the general loop, under random priorities (the search's
    permutations), windows, transfer times and text-only microbatches."""
    import random

    import dipc.planner.schedule as sch

    g = vlm_graph(p, images, text_k=text_k)
    rnd = random.Random(seed)
    for st_ in g.stages.values():
        st_.priority = float(rnd.randrange(5))  # ties too: the key breaks them
    cross = (lambda e: comm) if comm else None
    fast = list_schedule(g, p, comm_time=cross, window=window)
    sch._GENERAL = True
    try:
        slow = list_schedule(g, p, comm_time=cross, window=window)
    finally:
        sch._GENERAL = False
    assert fast.order == slow.order and fast.start == slow.start and fast.end == slow.end


def test_unlimited_memory_grows_with_the_microbatches_a_limit_keeps_it_flat():
    """The issue's measurement: without a limit rank 0 runs every encoder forward first; with one it stays flat."""
    p = 4
    unl, lim = {}, {}
    for n in (8, 32):
        images = [24] * n
        g = vlm_graph(p, images)
        unl[n] = max(_peaks(g, p, list_schedule(g, p))[0])
        g = vlm_graph(p, images)
        lim[n] = max(_peaks(g, p, list_schedule(g, p, memory_limit=3 * (24 + 4)))[0])
    assert unl[32] > 2.5 * unl[8]
    assert lim[32] <= 1.2 * lim[8]


def test_recompute_only_when_memory_binds_else_a_clear_error():
    p, images = 2, [30, 30, 30]
    g = vlm_graph(p, images, vision_per_image=1.0)
    one = 30 + 4.0  # a microbatch's forward bytes on rank 0 (vision 30 + text 4)
    free = max(_peaks(g, p, list_schedule(g, p))[0])  # what the unconstrained schedule keeps
    g = vlm_graph(p, images, vision_per_image=1.0)
    sched = list_schedule(g, p, memory_limit=free, recompute_cost=lambda s: (s.activation_bytes / 10, s.latency))
    assert not [s for s in g.stages.values() if s.strategy == "recompute"]  # it fits: nothing recomputed
    g = vlm_graph(p, images, vision_per_image=1.0)
    sched = list_schedule(g, p, memory_limit=one, recompute_cost=lambda s: (s.activation_bytes / 10, s.latency))
    assert max(_peaks(g, p, sched)[0]) <= one
    g = vlm_graph(p, images, vision_per_image=1.0)
    sched = list_schedule(g, p, memory_limit=one / 2,
                          recompute_cost=lambda s: (s.activation_bytes / 10, s.latency))
    rec = [s for s in g.stages.values() if s.strategy == "recompute"]
    assert rec and all(g.stages["B" + s.key[1:]].strategy == "recompute" for s in rec if s.kind == "F")
    peaks, plan = _peaks(g, p, sched)
    assert max(peaks) <= one / 2
    assert any(a.strategy == "recompute" for _, a in plan.compute_actions())
    g = vlm_graph(p, images, vision_per_image=1.0)
    with pytest.raises(PlanError, match=r"rank 0 cannot keep F:\d+:0:-?\d+: it needs [\d.]+ bytes of activations "
                                        r"even recomputed \([\d.]+ kept whole\) on top of [\d.e+]+ live, over its "
                                        r"activation budget of 5 bytes \(the memory limit less"):
        list_schedule(g, p, memory_limit=5.0, recompute_cost=lambda s: (s.activation_bytes / 2, s.latency))


def test_cpu_model_flat_memory_and_recomputed_plans_equal_the_unsplit_model():
    torch.manual_seed(0)
    model = pc.vlm(False, 4, 4)
    c = dipc.compile(model, pc.vlm_batch([1, 1], 12, 0), 2, sub_microbatch_size={"vision": 1})
    static = max(c.rank_state_bytes())

    def batch(n):
        return pc.vlm_batch([2, 1] * (n // 2), 16, n)

    peak = {n: dipc.simulate(c, batch(n), n)[0].peak_memory[0] - c.rank_state_bytes()[0] for n in (8, 32)}
    assert peak[32] > 2.5 * peak[8]  # no limit (no device profile): rank 0 keeps all encoder forwards
    limit = static + peak[8]
    lim = {n: dipc.simulate(c, batch(n), n, memory_limit=limit)[0] for n in (8, 32)}
    assert all(max(r.peak_memory) <= limit * (1 + 1e-9) for r in lim.values())
    assert lim[32].peak_memory[0] - c.rank_state_bytes()[0] <= 1.2 * peak[8]
    # a limit under one microbatch's activations: stages recompute (wholly or some layers: the planner picks among
    # "recompute", "recompute:k" and "recompute:n/g"; whole-chunk recompute alone is test_recompute.py's), and the
    # gradients are still exact
    b = batch(8)
    tight = static + peak[8] / 8
    res, plan = dipc.simulate(c, b, 8, memory_limit=tight)
    assert sum(a.strategy != "keep" for _, a in plan.compute_actions()) >= 8
    assert max(res.peak_memory) <= tight * (1 + 1e-9)
    from dipc.runtime import run_local
    model.zero_grad(set_to_none=True)
    ref = model(**b)
    ref.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss, plan = run_local(c, b, 8, memory_limit=tight)
    assert sum(a.strategy != "keep" for _, a in plan.compute_actions()) >= 8
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
    with pytest.raises(PlanError, match=r"rank 0 holds [\d.e+]+ bytes of parameters, gradients and optimizer "
                                        r"states, over the memory limit of 1000 bytes"):
        dipc.simulate(c, b, 8, memory_limit=1000)
