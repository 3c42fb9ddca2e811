"""The stage simulator (dipc.simulate) on hand-computable schedules, and the trace writers."""
import json

import pytest

from dipc.plan import PlanError
from dipc.stages import Schedule
from dipc.planner.lowering import lower
from dipc.sim.simulate import simulate_plan
from dipc.sim.trace import chrome_trace, gantt_png

from stage_graphs import chain_graph, gpipe_order, one_f_one_b_order

def run(p, m, tf, tb, order):
    g = chain_graph(p, m, tf, tb)
    plan = lower(g, Schedule(order=order, start={k: 0.0 for k in g.stages}, end={}), list(range(p)))
    lat = {k: s.latency for k, s in g.stages.items()}
    act = {k: 1.0 for k in g.stages if k.startswith("F")}
    return simulate_plan(plan, lat, activation_bytes=act, static_bytes=[10.0] * p)


@pytest.mark.parametrize("p,m,tf,tb", [(2, 4, 1.0, 2.0), (4, 8, 1.0, 2.0), (4, 4, 0.5, 1.0), (3, 7, 2.0, 3.0)])
def test_gpipe_and_1f1b_iteration_time_and_bubbles(p, m, tf, tb):
    for order in (gpipe_order(p, m), one_f_one_b_order(p, m)):
        r = run(p, m, tf, tb, order)
        assert r.iteration_time == pytest.approx((m + p - 1) * (tf + tb))
        assert r.bubble_ratio == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 6)])
def test_peak_activation_memory_1f1b_vs_gpipe(p, m):
    """Rank 0 holds p microbatches' activations under 1F1B and all m under GPipe (plus its static bytes)."""
    assert run(p, m, 1.0, 2.0, one_f_one_b_order(p, m)).peak_memory[0] == pytest.approx(10.0 + p)
    assert run(p, m, 1.0, 2.0, gpipe_order(p, m)).peak_memory[0] == pytest.approx(10.0 + m)


def test_comm_time_delays_consumers():
    g = chain_graph(2, 1, 1.0, 1.0)
    plan = lower(g, Schedule(order=gpipe_order(2, 1), start={k: 0.0 for k in g.stages}, end={}), [0, 1])
    lat = {k: s.latency for k, s in g.stages.items()}
    r = simulate_plan(plan, lat, comm_time=lambda tensors: 0.25 * len(tensors))
    assert r.iteration_time == pytest.approx(4.5)  # F0, send .25, F1, B1, send .25, B0


def test_deadlock_is_reported():
    g = chain_graph(2, 2, 1.0, 1.0)
    order = gpipe_order(2, 2)
    order[1] = [order[1][1], order[1][0]] + order[1][2:]  # rank 1 runs mb 1 first
    plan = lower(g, Schedule(order=order, start={k: 0.0 for k in g.stages}, end={}), [0, 1])
    # posting receives in send order still lets rank 1 run mb 1 first: no deadlock, just a later start
    r = simulate_plan(plan, {k: 1.0 for k in g.stages})
    assert r.iteration_time > 0
    plan.ranks[0] = [a for a in plan.ranks[0] if not (a.kind == "SEND_F" and a.mb == 1)]
    with pytest.raises(PlanError, match=r"deadlock: rank 0 at 0B0 waits on .*; rank 1 at 1F1 waits on message\(s\) \[1\]"):
        simulate_plan(plan, {k: 1.0 for k in g.stages})


def test_trace_and_gantt(tmp_path):
    r = run(2, 3, 1.0, 2.0, one_f_one_b_order(2, 3))
    ev = r.events({0: "vision", 1: "text"})
    tr = chrome_trace(ev)
    xs = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    compute = [e for e in xs if e["cat"] == "compute"]
    assert len(compute) == 12 and {e["pid"] for e in xs} == {0, 1}
    assert xs[0]["ts"] == 0.0 and xs[0]["dur"] == pytest.approx(1e6)
    # rank 1 waits 1 s for 0F0's output before its first forward; rank 0 2 s for 1B0's gradient before 0B0
    waits = [(e["pid"], e["name"], e["ts"] / 1e6, e["dur"] / 1e6) for e in xs if e["cat"] == "wait"]
    assert (1, "wait 1F0", 0.0, pytest.approx(1.0)) in waits and (0, "wait 0B0", 2e6 / 1e6, 2.0) in waits
    assert all(w[3] > 0 for w in waits)
    assert {e["args"]["modality"] for e in xs if e["cat"] == "wait"} <= {"vision", "text"}
    json.dumps(tr)
    path = gantt_png(ev, str(tmp_path / "g.png"))
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_simulate_compiled_pipeline_with_a_device_profile():
    """With a device profile, stage costs come from the symbolic cost model at each stage's own sizes."""
    import torch
    import dipc
    import pipeline_cases as pc
    torch.manual_seed(0)
    c = dipc.compile(pc.vlm(), pc.vlm_batch([1, 1], 12, 0), 2, device="h100", sub_microbatch_size={"vision": 2})
    small, _ = dipc.simulate(c, pc.vlm_batch([1, 0, 1, 0], 16, 1), 2)
    big, plan = dipc.simulate(c, pc.vlm_batch([3, 2, 3, 2], 48, 1), 2)
    assert 0 < small.iteration_time < big.iteration_time
    assert 0 <= big.bubble_ratio < 1 and all(m > 0 for m in big.peak_memory)
    prog = c.program
    text0 = c.partition.chunks_of("text")[0].index
    a = prog.stage_cost(text0, {s: v for s, v in prog.bind(pc.vlm_batch([1, 1], 16, 0)).items()})
    b = prog.stage_cost(text0, {s: v for s, v in prog.bind(pc.vlm_batch([1, 1], 32, 0)).items()})
    assert b["flops_fwd"] > a["flops_fwd"] and b["latency_f"] > a["latency_f"] > 0
    dipc.validate(plan)


@pytest.mark.slow
def test_dip_rule_for_b_i_and_k_i_on_a_device_profile():
    """DIP §2.1: B_i = smallest sub-microbatch size with >= 95% of peak efficiency; fixed launch overheads make
    small sub-microbatches inefficient, so B_i grows with them; a given B_i is kept."""
    import dataclasses
    import torch
    import dipc
    from dipc.sim.device import DeviceProfile
    import pipeline_cases as pc
    base = dataclasses.replace(DeviceProfile.load("h100"), matmul_half_flops=0.0)  # the datasheet roofline alone
    got = {}
    for overhead, half in ((0.0, 0.0), (2e-6, 0.0), (0.0, 1e9)):
        torch.manual_seed(0)
        c = dipc.compile(pc.vlm(), pc.vlm_batch([1, 1], 12, 0), 2, check=False,  # the rule, not the gradients
                         device=dataclasses.replace(base, launch_overhead=overhead, matmul_half_flops=half))
        got[overhead, half] = c.batch_spec.instances[0].sub_microbatch_size
        assert "B_i by the DIP rule" in c.describe()
        assert all(k >= 1 for k in c.partition.chunks_per_rank.values())
    assert 1 <= got[0.0, 0.0] < got[2e-6, 0.0] <= 64
    assert got[0.0, 0.0] < got[0.0, 1e9] <= 64  # the small-matrix efficiency curve too
    torch.manual_seed(0)
    c = dipc.compile(pc.vlm(), pc.vlm_batch([1, 1], 12, 0), 2, device=base, sub_microbatch_size={"vision": 3},
                     check=False)
    assert c.batch_spec.instances[0].sub_microbatch_size == 3


def test_static_memory_counts_parameters_gradients_and_adam_states():
    import torch
    import dipc
    import pipeline_cases as pc
    torch.manual_seed(0)
    model = pc.vlm()
    c = dipc.compile(model, pc.vlm_batch([1, 1], 12, 0), 2)
    per_rank = c.rank_state_bytes(optimizer_states=2)
    params = sum(p.numel() * 4 for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if "rotary" not in n)
    # every parameter on exactly one rank (untied): 4 copies (param, grad, 2 Adam moments); RoPE inv_freq is read
    # by every text chunk and held by each rank that has one
    assert sum(per_rank) >= 4 * params + buffers
    assert sum(per_rank) <= 4 * params + buffers + 2 * 64
    res, _ = dipc.simulate(c, pc.vlm_batch([1, 0, 2, 0], 16, 1), 2)
    assert all(peak > static for peak, static in zip(res.peak_memory, per_rank))


def _two_rank_one_mb_plan(lookahead=1):
    g = chain_graph(2, 1, 1.0, 1.0)
    return g, lower(g, Schedule(order=gpipe_order(2, 1), start={k: 0.0 for k in g.stages}, end={}), [0, 1],
                    recv_lookahead=lookahead)


def test_posting_cost_rendezvous_and_epilogue():
    """Hand-computed: each SEND/RECV occupies its rank 0.1 s, a message takes 0.25 s, the step ends 0.5 s after the
    last action.  Rank 0 posts its RECV_B, runs F0 (0.1-1.1), posts SEND_F (1.1-1.2, arrives 1.45); rank 1 posted
    RECV_F at 0-0.1, runs F1 1.45-2.45, B1 -3.45, SEND_B 3.45-3.55 (arrives 3.8); rank 0 runs B0 3.8-4.8; + 0.5."""
    g, plan = _two_rank_one_mb_plan()
    assert [a.kind for a in plan.ranks[0]] == ["RECV_B", "F", "SEND_F", "B"]
    lat = {k: s.latency for k, s in g.stages.items()}
    kw = dict(comm_time=lambda tensors: 0.25, post_overhead=0.1, epilogue=0.5)
    r = simulate_plan(plan, lat, **kw)
    assert r.iteration_time == pytest.approx(5.3)
    assert [(s, e) for s, e, _, _ in r.comm[0]] == [pytest.approx((0.0, 0.1)), pytest.approx((1.1, 1.2))]
    # the post cost may depend on the message: 0.1 s per tensor here is the same
    assert simulate_plan(plan, lat, **{**kw, "post_overhead": lambda ts: 0.1 * len(ts)}).iteration_time == \
        pytest.approx(5.3)
    # rendezvous 2.0: the forward message moves once rank 1's receive (posted at 0.1) + 2.0 = 2.1 -> arrives 2.35;
    # F1 2.35-3.35, B1 -4.35, SEND_B -4.45, rank 0's receive was posted at 0.1 -> arrives 4.7; B0 -5.7; + 0.5
    assert simulate_plan(plan, lat, rendezvous=2.0, **kw).iteration_time == pytest.approx(6.2)


@pytest.mark.parametrize("kw,name", [
    ({"post_overhead": -0.5}, "post_overhead"), ({"post_overhead": float("nan")}, "post_overhead"),
    ({"epilogue": -100.0}, "epilogue"), ({"rendezvous": -5.0}, "rendezvous"),
    ({"post_overhead": lambda ts: -10.0}, r"post_overhead for \S+"),
    ({"comm_time": lambda ts: float("inf")}, r"comm_time for 0SEND_F0->1"),
])
def test_negative_or_non_finite_costs_are_refused(kw, name):
    g, plan = _two_rank_one_mb_plan()
    with pytest.raises(ValueError, match=name + r" must be a finite number of seconds >= 0"):
        simulate_plan(plan, {k: 1.0 for k in g.stages}, **kw)


def test_receive_lookahead_posts_one_compute_action_early():
    g, late = _two_rank_one_mb_plan(lookahead=0)
    assert [a.kind for a in late.ranks[0]] == ["F", "SEND_F", "RECV_B", "B"]
    _, early = _two_rank_one_mb_plan(lookahead=1)
    assert [a.kind for a in early.ranks[0]] == ["RECV_B", "F", "SEND_F", "B"]
    import dipc
    for p in (late, early):
        dipc.validate(p)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match=f"recv_lookahead must be an int >= 0, got {bad!r}"):
            _two_rank_one_mb_plan(lookahead=bad)
    # on a longer 1F1B plan every lookahead still validates and simulates to the same iteration time without costs
    g = chain_graph(3, 5, 1.0, 2.0)
    times = set()
    for la in (0, 1, 3):
        plan = lower(g, Schedule(order=one_f_one_b_order(3, 5), start={k: 0.0 for k in g.stages}, end={}),
                     [0, 1, 2], recv_lookahead=la)
        dipc.validate(plan)
        times.add(round(simulate_plan(plan, {k: s.latency for k, s in g.stages.items()}).iteration_time, 9))
    assert times == {7 * 3.0}


@pytest.mark.slow
def test_fit_pipeline_overheads_on_two_ranks():
    """The executor calibration runs on a real 2-rank pipeline and gives a profile whose simulation of that same
    calibration step is within a factor of 2 of the measurement (a loose in-sample check: CI machines are noisy)."""
    from dipc.launch import spawn
    profiles = spawn(_fit_worker, 2, timeout=240)
    assert profiles[0] == profiles[1], "ranks fitted different profiles"
    from dipc.sim.device import DeviceProfile
    p = DeviceProfile.from_json(profiles[0])
    fit = p.meta["pipeline_fit"]
    assert 0.5 <= fit["contention_scale"] <= 4.0 and fit["stages"] > 0 and fit["p2p_actions"] > 0
    assert p.launch_overhead >= 0 and p.backward_overhead >= 0 and p.p2p_post_overhead >= 0
    assert p.p2p_post_per_byte >= 0 and p.step_overhead >= 0
    assert 0.5 < fit["simulated_step_s"] / fit["measured_step_s"] < 2.0


def _fit_worker(rank, world):
    import torch
    import dipc
    from dipc.calibrate import fit_pipeline_overheads
    from dipc.sim.device import DeviceProfile
    import pipeline_cases as pc
    torch.manual_seed(0)
    base = DeviceProfile(name="cpu-test", peak_flops=5e10, mem_bandwidth=1e10, p2p_bandwidth=2e9, p2p_latency=5e-5,
                         launch_overhead=5e-6, dtype="float32")
    compiled = dipc.compile(pc.vlm(), pc.vlm_batch([1, 1], 12, 0), world, device=base,
                            sub_microbatch_size={"vision": 2})
    pipe = compiled.runtime(n_microbatches=2)
    held = pipe.parameters()[0]
    held.grad = torch.full_like(held, 0.5)  # a gradient the caller accumulated: the fit must give it back
    p = fit_pipeline_overheads(pipe, pc.vlm_batch([2, 1, 0, 3], 24, 1), steps=2)
    assert torch.equal(held.grad, torch.full_like(held, 0.5))
    # the measured trace of the last step: every rank's actions of the plan, in plan order, with modalities
    ev = pipe.trace_events()
    for r in range(world):
        mine = [e for e in ev if e["rank"] == r and e["kind"] != "WAIT"]
        assert [e["name"] for e in mine] == [str(a) for a in pipe.last_plan.ranks[r]]
        assert all(0 <= e["start"] <= e["end"] for e in mine)
        assert {e["modality"] for e in mine} == {"vision", "text"}
    assert all(q.grad is None for q in pipe.parameters()[1:])
    # the fitted profile drives the simulator: posting and the epilogue now cost time
    torch.manual_seed(0)
    refit = dipc.compile(pc.vlm(), pc.vlm_batch([1, 1], 12, 0), world, device=p, sub_microbatch_size={"vision": 2})
    res, _ = dipc.simulate(refit, pc.vlm_batch([2, 1, 0, 3], 24, 1), 2)
    assert any(res.comm) and res.iteration_time > 0
    return p.to_json()


def test_bubble_causes_add_up_and_the_report_names_them():
    """The plan report (issue 9 scope 5): per rank busy + posting + fill + waits + drain = the iteration time; 1F1B
    on a uniform chain has no wait on rank 0's critical stretch but fill on the last ranks; the report lists them."""
    from dipc.planner.fitting import timed_schedule
    from dipc.planner.lowering import lower
    from dipc.sim.simulate import simulate_plan
    from stage_graphs import chain_graph, one_f_one_b_order

    g = chain_graph(4, 8)
    sched = timed_schedule(g, one_f_one_b_order(4, 8))
    plan = lower(g, sched, [0, 1, 2, 3])
    res = simulate_plan(plan, {k: s.latency for k, s in g.stages.items()}, post_overhead=0.01, epilogue=0.5)
    causes = res.bubble_causes()
    for c in causes:
        assert c["busy"] + c["posting"] + c["fill"] + c["waits"] + c["drain"] == pytest.approx(res.iteration_time)
    assert causes[0]["fill"] == 0 and causes[3]["fill"] > causes[1]["fill"] > 0
    assert all(c["drain"] >= 0.5 for c in causes)  # the epilogue
    text = res.report(plan)
    assert "bubble ratio" in text and text.count("\n") == 1 + 4
