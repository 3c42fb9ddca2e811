"""DIP's segment reordering by MCTS (PAPER.md §2.3; issue 9 scope 1): on small stage graphs it finds what exhaustive
search finds, it is deterministic under a seed, and bad arguments are refused."""
import dataclasses
import itertools

import pytest

from dipc.planner.mcts import mcts
from dipc.stages import StageGraph
from dipc.planner.schedule import list_schedule

from stage_graphs import vlm_graph


def _with_priorities(graph, perm):
    """The stage graph with each (microbatch, modality) group's stages at priority n - position."""
    prio = {g: len(perm) - i for i, g in enumerate(perm)}
    stages = {k: dataclasses.replace(st, priority=prio[(st.mb, st.modality)]) for k, st in graph.stages.items()}
    return StageGraph(stages=stages, edges=graph.edges)


def test_mcts_finds_the_exhaustive_optimum_of_a_stage_graph():
    graph = vlm_graph(2, [0, 5, 1], b_i=2, tf_v=0.35, tf_t=1.0, text_k=1)
    groups = sorted({(st.mb, st.modality) for st in graph.stages.values()})
    assert len(groups) == 5

    def score(perm):
        return list_schedule(_with_priorities(graph, perm), 2).iteration_time

    best = min(score(list(p)) for p in itertools.permutations(groups))
    default = sorted(groups)  # the interleaver's own order: oldest microbatch first
    assert best < score(default) - 1e-9, "the case should leave something for the search to find"
    res = mcts(groups, score, budget_s=60.0, seed=0, start=default)
    assert res.exhausted
    assert res.time == pytest.approx(best)
    assert score(res.order) == pytest.approx(best)
    assert res.history[0][1] == pytest.approx(score(default)) and res.history[-1][1] == pytest.approx(best)
    assert [t for _, t in res.history] == sorted((t for _, t in res.history), reverse=True)


def test_mcts_on_a_function_with_one_best_order_and_determinism():
    groups = list("abcdef")
    target = list("fdbeca")

    def score(perm):  # distance to the target order, plus a constant
        return 1.0 + sum(abs(perm.index(g) - target.index(g)) for g in groups)

    res = mcts(groups, score, budget_s=60.0, seed=3)
    assert res.exhausted and res.order == target and res.time == 1.0
    a = mcts(groups, score, budget_s=60.0, seed=7, max_iterations=30)
    b = mcts(groups, score, budget_s=60.0, seed=7, max_iterations=30)
    assert (a.order, a.time, a.rollouts) == (b.order, b.time, b.rollouts)
    assert not a.exhausted and a.iterations == 30


def test_parallel_workers_find_what_one_finds(monkeypatch):
    """Leaf-parallel rollouts (§2.3's parallel workers) on forked processes: a seeded search gives the same order,
    score and rollout count with 2 workers as with 1, on the stage graph whose optimum exhaustive search knows, and
    search_priorities hands back the schedule of the order found (scored in the workers, built again here)."""
    import dipc.planner.mcts as M
    from dipc.planner.search import search_priorities

    monkeypatch.setattr(M, "max_workers", lambda: 2)  # this host may have 2 cores: half is 1
    graph = vlm_graph(2, [0, 5, 1], b_i=2, tf_v=0.35, tf_t=1.0, text_k=1)
    groups = sorted({(st.mb, st.modality) for st in graph.stages.values()})

    def score(perm):
        return list_schedule(_with_priorities(graph, perm), 2).iteration_time

    one = mcts(groups, score, budget_s=60.0, seed=1, max_iterations=12, start=groups)
    two = mcts(groups, score, budget_s=60.0, seed=1, max_iterations=12, start=groups, workers=2)
    assert (one.order, one.time, one.rollouts, one.iterations) == (two.order, two.time, two.rollouts, two.iterations)
    full = mcts(groups, score, budget_s=60.0, seed=0, start=groups, workers=2)
    assert full.exhausted and full.time == pytest.approx(min(score(list(p)) for p in itertools.permutations(groups)))
    found, res = search_priorities(graph, 2, None, None, None, 60.0, 0, workers=2, max_iterations=12)
    assert found is not None and found[0].iteration_time == pytest.approx(res.time)
    with pytest.raises(ValueError, match="workers must be an int >= 1"):
        mcts(groups, score, workers=0)


def test_mcts_refuses_bad_arguments():
    with pytest.raises(ValueError, match="distinct"):
        mcts(["a", "a"], lambda p: 1.0)
    with pytest.raises(ValueError, match="budget_s must be > 0"):
        mcts(["a"], lambda p: 1.0, budget_s=0)
    with pytest.raises(ValueError, match="rollouts must be >= 1"):
        mcts(["a"], lambda p: 1.0, rollouts=0)
    with pytest.raises(ValueError, match="start must be a permutation"):
        mcts(["a", "b"], lambda p: 1.0, start=["a"])


def test_searched_plans_run_with_the_unsplit_gradients():
    """A plan the search improved (with and without a memory limit, where the limit makes pairs recompute) validates
    and its run equals the unsplit model, for two batch orders (text-only microbatches first, then image-heavy)."""
    import torch

    import dipc
    import pipeline_cases as pc
    from dipc.runtime import run_local

    torch.manual_seed(0)
    model = pc.vlm(False, 4, 4)
    c = dipc.compile(model, pc.vlm_batch([1, 1], 12, 0), 2, sub_microbatch_size={"vision": 1})
    static = max(c.rank_state_bytes())
    improved = []
    for counts in ([0, 0, 3, 1, 2, 3], [3, 2, 3, 1, 0, 0]):
        b = pc.vlm_batch(counts, 16, 3)
        model.zero_grad(set_to_none=True)
        ref = model(**b)
        ref.backward()
        want = {n: p.grad.clone() for n, p in model.named_parameters()}
        peak = dipc.simulate(c, b, 6)[0].peak_memory[0] - c.rank_state_bytes()[0]
        for limit in (None, static + peak / 3):
            model.zero_grad(set_to_none=True)
            loss, plan = run_local(c, b, 6, memory_limit=limit, budget_s=0.5, seed=0)
            s = plan.simulated["search"]
            assert s["rollouts"] >= 1 and s["best_over_time"]
            improved.append(s["improved"])
            if limit is not None:  # the rest of the budget filled the busiest rank's gaps: never slower
                fill = s["gap_fill"]
                assert plan.simulated["iteration_time"] == fill["after_s"] <= fill["before_s"] * (1 + 1e-9), fill
                res, searched = dipc.simulate(c, b, 6, memory_limit=limit, budget_s=0.5, seed=0)
                assert "gap filling:" in res.report(searched)  # the plan report says what it did
            dipc.validate(plan)
            torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
            for n, p in model.named_parameters():
                torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
    assert any(improved), "the search should beat the interleaver on one of these batches"
    for bad in (-1.0, True, "1s", float("nan")):
        with pytest.raises(ValueError, match="budget_s must be a number >= 0"):
            dipc.simulate(c, b, 6, budget_s=bad)
    with pytest.raises(ValueError, match="memory_opt must be 'ilp' or 'greedy'"):
        dipc.simulate(c, b, 6, memory_opt="lp")


def test_gap_filling_shortens_the_busiest_ranks_stalls_within_memory_and_keeps_the_unsplit_gradients():
    """The local search after MCTS (``_fill_gaps``, no deadline here so it runs to its end): on the interleaver's
    plan of a memory-limited step it moves forwards into the busiest rank's idle gaps; the iteration gets shorter,
    every rank's order stays under its activation budget with the strategies the ILP chose again, and the lowered
    plan validates and runs with the unsplit model's loss and gradients (text-only microbatches first)."""
    import math

    import torch

    import dipc
    import pipeline_cases as pc
    from dipc.plan import stage_key
    from dipc.planner.candidates import fill_gaps as _fill_gaps
    from dipc.planner.planning import activation_budget
    from dipc.runtime import run_local
    from dipc.planner import build_workload, make_plan, split_for
    from dipc.planner.fitting import order_peaks, timed_schedule
    from dipc.planner.lowering import lower

    torch.manual_seed(0)
    model = pc.vlm(False, 4, 4)
    c = dipc.compile(model, pc.vlm_batch([1, 1], 12, 0), 2, sub_microbatch_size={"vision": 1})
    b = pc.vlm_batch([0, 0, 3, 1, 2, 3], 16, 3)
    peak = dipc.simulate(c, b, 6)[0].peak_memory[0] - c.rank_state_bytes()[0]
    limit = max(c.rank_state_bytes()) + peak / 3
    w = build_workload(c, split_for(c, b, 6))
    plan = make_plan(c, w, 0, memory_limit=limit)
    order = [[stage_key(a.kind, a.chunk, a.mb, a.sub) for a in acts if a.kind in ("F", "B")] for acts in plan.ranks]
    sched = timed_schedule(w.graph, order)
    limits = activation_budget(c, limit)
    filled, g, moves = _fill_gaps(w.graph, sched, 2, None, limits, math.inf)
    assert moves >= 1 and filled.iteration_time < sched.iteration_time * (1 - 1e-6), (moves, sched.iteration_time)
    for r, (p, _) in enumerate(order_peaks(g, filled.order)):
        assert p <= limits[r] * (1 + 1e-9), (r, p, limits[r])
    w.graph.stages.update(g.stages)
    ranks = [ch.rank for ch in c.partition.chunks]
    new = lower(w.graph, filled, ranks, microbatches=[mb.meta() for mb in w.microbatches])
    dipc.validate(new)
    model.zero_grad(set_to_none=True)
    ref = model(**b)
    ref.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss, _ = run_local(c, b, 6, new)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_a_rank_simulating_a_received_plan_on_its_own_workload_sees_the_plans_recompute():
    """Ranks other than 0 receive the plan and build their own workload, whose stages are still at "keep": the
    step report's simulation there read the plan's peak memory as if nothing recomputed (over the limit, though
    the run was exact; break-it found it on 2 and 4 ranks).  Simulated on a fresh workload, a memory-limited plan
    now gives the planning workload's figures."""
    import torch

    import dipc
    import pipeline_cases as pc
    from dipc.planner.background import simulated_summary
    from dipc.planner import build_workload, make_plan, split_for

    torch.manual_seed(0)
    c = dipc.compile(pc.vlm(False, 4, 4), pc.vlm_batch([1, 1], 12, 0), 2, sub_microbatch_size={"vision": 1},
                     device="h800")
    b = pc.vlm_batch([0, 0, 0, 0, 2, 3, 1, 1], 16, 3)
    static = c.rank_state_bytes()
    limit = max(static) + 0.45 * (max(dipc.simulate(c, b, 8)[0].peak_memory) - max(static))
    planned = build_workload(c, split_for(c, b, 8))
    plan = make_plan(c, planned, 0, memory_limit=limit)
    assert plan.simulated["recomputed"] > 0
    fresh = build_workload(c, split_for(c, b, 8))  # what another rank builds
    here, there = simulated_summary(c, planned, plan, static), simulated_summary(c, fresh, plan, static)
    assert max(there["peak_memory"]) <= limit * (1 + 1e-9), (there["peak_memory"], limit)
    assert there["peak_memory"] == pytest.approx(here["peak_memory"], rel=1e-9)
    assert there["iteration_time"] == pytest.approx(here["iteration_time"], rel=1e-9)
    assert all(st.strategy == "keep" for st in fresh.graph.stages.values())  # not changed in place
