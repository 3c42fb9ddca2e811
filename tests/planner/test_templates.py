"""The schedule-template library (issue 8 scope 5) and the bounds in every simulated result (scope 6): GPipe, 1F1B
(Megatron interleaved), Megatron MIMO's three phases, Optimus coarse and DIP each make a plan that validates, never
deadlocks on random VLM steps, fits a memory limit (the static ones by recomputing stages, as their users do), and
runs on CPU ranks with the unsplit model's loss and gradients, in batch orders with text-only microbatches first."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import dipc
from dipc.codegen.templates import TEMPLATES, fixed_order, schedules
from dipc.plan import PlanError
from dipc.validation import validate
from dipc.planner.fitting import fit_by_recompute, order_peaks, timed_schedule
from dipc.planner.lowering import lower
from dipc.sim.simulate import simulate_plan
from dipc.testing import local_check

import pipeline_cases as pc
from stage_graphs import chain_graph, gpipe_order, one_f_one_b_order, vlm_graph

FIXED = [n for n, t in TEMPLATES.items() if t.kind == "fixed"]


def _sim(graph, p, order):
    sched = timed_schedule(graph, order)
    plan = lower(graph, sched, [c % p for c in range(1 + max(s.chunk for s in graph.stages.values()))])
    validate(plan)
    lat = {k: s.latency for k, s in graph.stages.items()}
    act = {k: s.activation_bytes for k, s in graph.stages.items() if s.kind == "F"}
    return simulate_plan(plan, lat, activation_bytes=act), sched


def _chunks(graph):
    return sorted({s.chunk for s in graph.stages.values()})


def test_the_library_lists_every_template_and_refuses_unknown_names():
    assert schedules() == ["gpipe", "1f1b", "mimo", "optimus", "dip"] == dipc.schedules()
    with pytest.raises(ValueError, match=r"unknown schedule 'zb'; dipc.schedules\(\) lists \['gpipe'"):
        fixed_order("zb", {}, 2, [], [])


@pytest.mark.parametrize("p,m", [(2, 2), (4, 8), (4, 6), (3, 1)])
def test_fixed_orders_on_a_chain_are_the_textbook_schedules_and_their_bounds(p, m):
    g = chain_graph(p, m)
    assert fixed_order("gpipe", g.stages, p, [], list(range(p))) == gpipe_order(p, m)
    assert fixed_order("1f1b", g.stages, p, [], list(range(p))) == one_f_one_b_order(p, m)
    for name in ("gpipe", "1f1b"):
        res, _ = _sim(g, p, fixed_order(name, g.stages, p, [], list(range(p))))
        assert res.iteration_time == pytest.approx((m + p - 1) * 3.0)  # (m + p - 1)(t_f + t_b)
        assert res.bound == pytest.approx(m * 3.0)  # the busiest rank's work
        assert res.critical_path == pytest.approx(p * 3.0)  # one microbatch through every chunk and back
        assert res.bound_ratio == pytest.approx((m + p - 1) / m)
    # 1F1B keeps at most p - r microbatches in flight on rank r; GPipe all m
    for s in g.stages.values():
        s.activation_bytes = 1.0
    peaks_1f1b = [pk for pk, _ in order_peaks(g, fixed_order("1f1b", g.stages, p, [], list(range(p))))]
    peaks_gpipe = [pk for pk, _ in order_peaks(g, fixed_order("gpipe", g.stages, p, [], list(range(p))))]
    assert peaks_1f1b == [min(p - r, m) for r in range(p)]
    assert peaks_gpipe == [m] * p


@settings(max_examples=40, deadline=None)
@given(p=st.sampled_from([2, 4, 8]), images=st.lists(st.integers(0, 48), min_size=1, max_size=64),
       text_k=st.sampled_from([1, 2]), name=st.sampled_from(FIXED))
def test_fixed_orders_never_deadlock_and_run_every_stage(p, images, text_k, name):
    g = vlm_graph(p, images, b_i=10 ** 6, text_k=text_k)  # templates run a microbatch's images whole
    order = fixed_order(name, g.stages, p, ["vision"], _chunks(g))
    res, sched = _sim(g, p, order)
    assert sum(map(len, sched.order)) == len(g.stages)
    assert res.iteration_time >= max(res.bound, res.critical_path) - 1e-9


@settings(max_examples=30, deadline=None)
@given(p=st.sampled_from([2, 4]), images=st.lists(st.integers(0, 48), min_size=1, max_size=32),
       name=st.sampled_from(FIXED), slack=st.floats(1.0, 3.0))
def test_static_templates_recompute_until_they_fit_the_limit(p, images, name, slack):
    g = vlm_graph(p, images, b_i=10 ** 6)
    order = fixed_order(name, g.stages, p, ["vision"], _chunks(g))
    unlimited = max(pk for pk, _ in order_peaks(g, order))
    # recompute keeps a tenth; the smallest limit that can work is every stage's recomputed bytes on a rank
    floor = max(sum(s.activation_bytes / 10 for s in g.stages.values() if s.kind == "F" and s.rank == r)
                for r in range(p))
    limit = max(floor * slack, unlimited / 2)
    n = fit_by_recompute(g, order, [limit] * p, lambda s: (s.activation_bytes / 10, s.latency))
    res, _ = _sim(g, p, order)
    assert max(res.peak_memory) <= limit * (1 + 1e-9)
    assert (n > 0) == (unlimited > limit)
    assert n == sum(1 for s in g.stages.values() if s.kind == "F" and s.strategy == "recompute")


def test_a_limit_no_recompute_can_meet_is_a_clear_error():
    g = vlm_graph(2, [24, 24, 24], b_i=10 ** 6)
    order = fixed_order("gpipe", g.stages, 2, ["vision"], _chunks(g))
    with pytest.raises(PlanError, match=r"rank 0 keeps [\d.e+]+ bytes of activations at its peak \(F:\d+:\d:-?\d\) "
                                        r"with every stage live there recomputed, over its activation budget of 1 bytes"):
        fit_by_recompute(g, order, [1.0, 1.0], lambda s: (s.activation_bytes / 2, s.latency))


def test_a_bad_order_is_refused():
    g = chain_graph(2, 2)
    order = fixed_order("1f1b", g.stages, 2, [], [0, 1])
    with pytest.raises(PlanError, match="does not run every stage once"):
        timed_schedule(g, [order[0][:-1], order[1]])
    with pytest.raises(PlanError, match="deadlocks"):
        timed_schedule(g, [list(reversed(order[0])), order[1]])


@pytest.fixture(scope="module")
def vlm2():
    torch.manual_seed(0)
    model = pc.vlm(False, 4, 4)
    return model, dipc.compile(model, pc.vlm_batch([1, 1], 12, 0), 2, sub_microbatch_size={"vision": 1})


def test_every_template_fits_a_limit_on_the_cpu_model_and_stays_exact(vlm2):
    model, c = vlm2
    b = pc.vlm_batch([2, 1] * 4, 16, 8)
    static = max(c.rank_state_bytes())
    for name in schedules():
        free, _ = dipc.simulate(c, b, 8, schedule=name)
        assert free.schedule == name and free.recomputed == 0
        assert free.iteration_time >= max(free.bound, free.critical_path) - 1e-12
        need = max(free.peak_memory) - static
        limit = static + 0.5 * need
        res, plan = dipc.simulate(c, b, 8, schedule=name, memory_limit=limit)
        assert max(res.peak_memory) <= limit * (1 + 1e-9), name
        if name != "dip":  # the static templates recompute to fit; DIP may reorder instead
            assert res.recomputed > 0, name
        assert res.recomputed == plan.simulated["recomputed"]
        local_check(model, c, b, 8, schedule=name, memory_limit=limit)


def _two_ranks(rank, world):
    from dipc.testing import reference_check
    errs = {}
    for name, kw in (("1f1b", {}), ("mimo", {}), ("optimus", {}), ("dip+search", {"budget_s": 0.2, "seed": 1})):
        errs[name] = reference_check(rank, world, "pipeline_cases:vlm", (False,), "pipeline_cases:vlm_batches_mixed",
                                     (), compile_kwargs={"sub_microbatch_size": {"vision": 2}}, n_microbatches=2,
                                     check_state_dict=False,
                                     runtime_kwargs={"schedule": name.split("+")[0], **kw})["grad_err"]
    return errs


@pytest.mark.timeout(300)
def test_templates_on_two_ranks_equal_the_unsplit_model():
    from dipc.launch import spawn
    for errs in spawn(_two_ranks, 2, timeout=280):
        assert max(errs.values()) < 1e-5, errs


def test_template_plans_export_to_torch_pipelining_csv(vlm2, tmp_path):
    from torch.distributed.pipelining.schedules import _Action, _validate_schedule
    model, c = vlm2
    b = pc.vlm_batch([2, 1, 1, 3], 16, 2)  # every microbatch has images: every chunk runs every microbatch
    for name in ("gpipe", "1f1b", "mimo"):
        _, plan = dipc.simulate(c, b, 4, schedule=name)
        text = c.to_torch_csv(plan)
        rows = [[_Action.from_str(a) for a in line.split(",")] for line in text.strip().split("\n")]
        n_stages = len(c.partition.chunks)
        mapping = _validate_schedule(dict(enumerate(rows)), 2, n_stages, 4)  # torch's own checks
        assert mapping == {i: ch % 2 for i, ch in enumerate(range(n_stages))}
        # the same order as dipc's plan
        pos = {ch: i for i, ch in enumerate(c.chunk_order())}
        want = [[f"{pos[a.chunk]}{a.kind}{a.mb}" for a in acts if a.kind in ("F", "B")] for acts in plan.ranks]
        assert [[str(a) for a in row] for row in rows] == want
    _, plan = dipc.simulate(c, b, 4, schedule="dip")
    with pytest.raises(PlanError, match="sub-microbatches: not representable"):
        c.to_torch_csv(plan)
    _, plan = dipc.simulate(c, pc.vlm_batch([2, 0, 1, 3], 16, 2), 4, schedule="1f1b")
    with pytest.raises(PlanError, match="has no stage for microbatch 1"):
        c.to_torch_csv(plan)


@pytest.mark.parametrize("p", [2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_every_template_gives_the_unsplit_gradients(p):
    """Every template on 2, 3 and 4 ranks, in two batch orders (text-only microbatches first), microbatch counts
    divisible by P and not: all ranks in one process (run_local executes the plan in a feasible global order, as
    validate proves); the multi-process executor runs templates on 2 ranks below, and 4 ranks in
    tests/runtime/test_pipeline.py and tests/models/test_zoo.py."""
    torch.manual_seed(0)
    model = pc.vlm(False, 2 * p, 2 * p)
    c = dipc.compile(model, pc.vlm_batch([1, 1], 12, 0), p, sub_microbatch_size={"vision": 1})
    for counts in ([0, 2, 1, 0, 3, 0, 1], [2, 1, 0, 3, 0, 1, 1]):
        b = pc.vlm_batch(counts, 18, 5)
        for name in schedules():
            for n in (len(counts), 3):
                local_check(model, c, b, n, schedule=name)


def test_bad_limits_and_schedules_are_refused_before_planning(vlm2):
    import math
    model, c = vlm2
    b = pc.vlm_batch([2, 1, 1, 3], 16, 2)
    for bad in (math.nan, math.inf, -1.0, 0, True, [1e9, 1e9], "80GB"):
        with pytest.raises(ValueError, match=r"memory_limit must be a finite number of bytes per device > 0"):
            dipc.simulate(c, b, 4, memory_limit=bad)
    for bad in ("", "GPipe", None):
        with pytest.raises(ValueError, match="unknown schedule"):
            dipc.simulate(c, b, 4, schedule=bad)
    with pytest.raises(dipc.BatchError, match="n_microbatches must be a positive int, got True"):
        dipc.simulate(c, b, True)


def test_the_plan_and_the_simulator_count_the_same_optimizer_states():
    from dipc.sim.device import DeviceProfile
    torch.manual_seed(0)
    model = pc.vlm(False, 4, 4)
    c = dipc.compile(model, pc.vlm_batch([1, 1], 12, 0), 2, device=DeviceProfile.load("h100"),
                     sub_microbatch_size={"vision": 1}, check=False)
    b = pc.vlm_batch([2, 1, 3, 1], 16, 2)
    for k in (4,):  # more states than the AdamW default the runtime budgets for
        static = c.rank_state_bytes(k)
        for name in schedules():
            free, _ = dipc.simulate(c, b, 4, schedule=name, memory_limit=1e15, optimizer_states=k)
            need = max(p - s for p, s in zip(free.peak_memory, static))
            limit = max(static) + 0.6 * need  # memory binds: the plan must count the same static bytes
            res, plan = dipc.simulate(c, b, 4, schedule=name, memory_limit=limit, optimizer_states=k)
            assert max(res.peak_memory) <= limit * (1 + 1e-9), (k, name)
            # memory binds: some pair recomputes or offloads
            assert any(a.strategy != "keep" for _, a in plan.compute_actions()) or name == "dip", (k, name)


def test_one_segment_partition_mixes_modalities_and_stays_exact():
    """The baselines' partition (issue 8 scope 5): ``one_segment=True`` cuts the whole VLM as one layer sequence
    (Megatron VPP with chunks balanced by parameters, 2 per rank; nnScaler*: by time, 1 per rank), so a chunk may
    hold vision and language layers together; its 1F1B (and every other template's) run
    equals the unsplit model, text-only microbatches first and image-heavy first, and fits a memory limit."""
    from dipc.passes.modality import module_path

    torch.manual_seed(0)
    model = pc.vlm(False, 4, 4)
    example = pc.vlm_batch([1, 1], 12, 0)
    megatron = dipc.compile(model, example, 2, one_segment=True, balance="params", chunks_per_rank={"model": 2})
    nnscaler = dipc.compile(model, example, 2, one_segment=True)
    for c, n_chunks in ((megatron, 4), (nnscaler, 2)):
        assert c.partition.modalities == ["model"] and len(c.partition.chunks) == n_chunks
    tops = [{module_path(n)[0].split(".")[0] for n in cm.gm.graph.nodes if n.op == "call_function" and module_path(n)}
            for _, cm in sorted(nnscaler.program.chunks.items())]
    assert {"vision_tower", "language_model"} <= tops[0], tops  # one chunk runs vision and language layers
    for counts in ([0, 0, 2, 1, 3, 1], [3, 2, 1, 0, 0, 1]):
        b = pc.vlm_batch(counts, 16, 3)
        for name in ("1f1b", "dip"):
            local_check(model, megatron, b, 6, schedule=name)
        local_check(model, nnscaler, b, 3, schedule="1f1b")
    b = pc.vlm_batch([2, 1] * 3, 16, 3)
    free, _ = dipc.simulate(megatron, b, 6, schedule="1f1b")
    limit = max(megatron.rank_state_bytes()) + 0.5 * (max(free.peak_memory) - max(megatron.rank_state_bytes()))
    res, _ = dipc.simulate(megatron, b, 6, schedule="1f1b", memory_limit=limit)
    assert max(res.peak_memory) <= limit * (1 + 1e-9) and res.recomputed > 0
    local_check(model, megatron, b, 6, schedule="1f1b", memory_limit=limit)
