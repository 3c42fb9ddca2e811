"""An honest peak (issue "Memory strategies", scope 4): every plan leaves ``memory_headroom`` bytes free under its
memory limit, for what the memory model does not count (allocator fragmentation, the CUDA context, NCCL's
buffers); the default keeps 5% of a device profile's capacity free and nothing under an explicit limit."""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import dipc
from dipc.plan import PlanError
from dipc.planner.planning import DEFAULT_HEADROOM, activation_budget

import pipeline_cases as pc


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    c = dipc.compile(pc.vlm(False, 4, 4), pc.vlm_batch([1, 1], 12, 0), 2, device="h100",
                     sub_microbatch_size={"vision": 1}, check=False)
    b = pc.vlm_batch([0, 2, 1, 3, 0, 1], 16, 6)
    free = dipc.simulate(c, b, 6, memory_limit=1e15)[0]
    static = c.rank_state_bytes()
    return c, b, static, max(p - s for p, s in zip(free.peak_memory, static))


def test_the_default_headroom_is_a_share_of_the_capacity_and_none_under_an_explicit_limit(case):
    c, _, static, _ = case
    cap = c.device.memory_capacity
    assert c.memory_headroom is None
    assert activation_budget(c) == pytest.approx([cap * (1 - DEFAULT_HEADROOM) - s for s in static])
    assert activation_budget(c, 1e9) == pytest.approx([1e9 - s for s in static])
    try:
        c.memory_headroom = 2e8
        assert activation_budget(c) == pytest.approx([cap - 2e8 - s for s in static])
        assert activation_budget(c, 1e9) == pytest.approx([1e9 - 2e8 - s for s in static])
        c.memory_headroom = 1e9 - min(static) + 1  # nothing left for activations: named
        with pytest.raises(PlanError, match=r"rank \d holds .* and keeps .* bytes free \(memory_headroom\), over the "
                                            r"memory limit of 1e\+09 bytes"):
            activation_budget(c, 1e9)
    finally:
        c.memory_headroom = None
    c, b, static, act = case  # a headroom makes a plan keep less, its peak that much lower
    limit = max(static) + 0.6 * act
    peaks = []
    for h in (0.0, 0.2 * act):
        c.memory_headroom = h
        try:
            res, plan = dipc.simulate(c, b, 6, memory_limit=limit)
        finally:
            c.memory_headroom = None
        assert max(res.peak_memory) + h <= limit * (1 + 1e-9)
        peaks.append(max(res.peak_memory))
    # the plan without a headroom uses memory the headroom forbids: the headroom changed the plan (which pairs
    # recompute, and how, is the ILP's choice: a whole-chunk recompute may let more pairs keep)
    assert peaks[0] > limit - 0.2 * act, (peaks, limit - 0.2 * act)
    import numpy as np

    c.memory_headroom = np.int64(1000)  # numbers of any real type
    try:
        assert activation_budget(c, 1e9) == pytest.approx([1e9 - 1000 - s for s in static])
    finally:
        c.memory_headroom = None
    for bad in (-1.0, math.nan, math.inf, "1GB", True):
        with pytest.raises(ValueError, match="memory_headroom must be a finite number of bytes"):
            dipc.compile(pc.vlm(False, 1, 1), pc.vlm_batch([1, 1], 12, 0), 2, memory_headroom=bad)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(limit_share=st.floats(0.1, 1.2), headroom_share=st.floats(0.0, 0.6), host_share=st.floats(0.0, 1.0),
       schedule=st.sampled_from(["dip", "1f1b", "gpipe"]))
def test_plans_under_a_limit_keep_their_peak_plus_headroom_under_it(case, limit_share, headroom_share, host_share,
                                                                    schedule):
    """Whatever the limit, headroom and host memory, a plan that is made keeps its simulated peak (static state,
    live activations, transients, message buffers, offloaded activations until their copy out ends and after
    their copy back starts) plus the headroom under the limit, and its offloaded activations within each rank's
    host memory; else planning says why."""
    c, b, static, act = case
    limit = max(static) + limit_share * act
    headroom = headroom_share * act
    c.memory_headroom = headroom
    host = c.device.host_memory
    c.device.host_memory = max(host_share * act, 1.0)
    try:
        res, plan = dipc.simulate(c, b, 6, memory_limit=limit, schedule=schedule)
    except PlanError:
        return
    finally:
        c.memory_headroom = None
        c.device.host_memory = host
    assert max(res.peak_memory) + headroom <= limit * (1 + 1e-9), (max(res.peak_memory), headroom, limit)
    assert max(res.host_peak) <= max(host_share * act, 1.0) * (1 + 1e-9), (res.host_peak, host_share * act)
