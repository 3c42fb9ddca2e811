"""The plan checker (dipc.validation.validate) and the list scheduler on hand-made stage graphs."""
import dataclasses

import pytest
from hypothesis import given, settings, strategies as st

from dipc.plan import Action, Plan, PlanError, TensorSpec
from dipc.validation import validate
from dipc.planner.lowering import lower
from dipc.planner.schedule import list_schedule

from stage_graphs import chain_graph

T = (TensorSpec("h", (2, 4), "float32"),)


def two_rank_plan(recv_tensors=T):
    """chunk 0 on rank 0 -> chunk 1 on rank 1, one microbatch, forward and backward."""
    r0 = [Action("F", 0, 0), Action("SEND_F", 0, 0, peer_rank=1, peer_chunk=1, msg=0, tensors=T),
          Action("RECV_B", 0, 0, peer_rank=1, peer_chunk=1, msg=1, tensors=T), Action("B", 0, 0)]
    r1 = [Action("RECV_F", 1, 0, peer_rank=0, peer_chunk=0, msg=0, tensors=recv_tensors), Action("F", 1, 0),
          Action("B", 1, 0), Action("SEND_B", 1, 0, peer_rank=0, peer_chunk=0, msg=1, tensors=T)]
    deps = {"F:1:0:-1": ["F:0:0:-1"], "B:1:0:-1": ["F:1:0:-1"], "B:0:0:-1": ["B:1:0:-1", "F:0:0:-1"]}
    return Plan(step=0, chunk_ranks=[0, 1], ranks=[r0, r1], deps=deps)


def test_valid_plan_round_trips_text_and_json():
    p = two_rank_plan()
    order = validate(p)
    assert len(order) == 8
    assert p.to_text() == ("rank 0: 0F0 0SEND_F0->1 0RECV_B0<-1 0B0\n"
                           "rank 1: 1RECV_F0<-0 1F0 1B0 1SEND_B0->0")
    q = Plan.from_json(p.to_json())
    assert q.to_json() == p.to_json() and q.digest() == p.digest()



def test_json_format_2_round_trips_every_field_and_format_1_still_reads():
    """The compact form (one array per action, message tensors written once per distinct list) gives back equal
    actions, including sub-microbatches, peers and recompute strategies; a plan written as format 1 (one object per
    action, as dipc wrote before) reads as the same plan; malformed format-2 text is refused by name."""
    import json

    from dipc.planner.lowering import lower
    from dipc.planner.schedule import list_schedule
    from stage_graphs import chain_graph

    g = chain_graph(3, 4)
    plan = lower(g, list_schedule(g, 3), [0, 1, 2], microbatches=[{}] * 4)
    ranks = [[dataclasses.replace(a, strategy="recompute:2/1") if a.kind in ("F", "B") and a.mb == 1 else a
              for a in acts] for acts in plan.ranks]
    ranks[0].insert(0, Action("F", 0, 9, sub=2))  # a sub-microbatch stage, an action with a set sub
    plan = dataclasses.replace(plan, ranks=ranks, simulated={"iteration_time": 1.5})
    text = plan.to_json()
    back = Plan.from_json(text)
    assert back == plan and back.to_json() == text and json.loads(text)["format"] == 2
    assert any(a.tensors for acts in back.ranks for a in acts)
    old = json.dumps({"step": plan.step, "chunk_ranks": plan.chunk_ranks,
                      "ranks": [[a.to_json() for a in acts] for acts in plan.ranks], "deps": plan.deps,
                      "microbatches": plan.microbatches, "simulated": plan.simulated})
    assert Plan.from_json(old) == plan
    d = json.loads(text)
    row = next(i for i, r in enumerate(d["ranks"][0]) if len(r) > 8)
    for bad, why in ((99, "IndexError"), (-2, "ValueError: tensor set index -2")):
        d["ranks"][0][row][8] = bad
        with pytest.raises(PlanError, match=f"not a dipc plan: {why}"):
            Plan.from_json(json.dumps(d))
    with pytest.raises(PlanError, match="unknown plan format 3"):
        Plan.from_json(json.dumps(dict(json.loads(text), format=3)))


def test_plans_of_the_wrong_types_are_refused_by_name():
    """Found by a break-it run: from_json coerced a step of 2.9 or "5", read forward_only "false" as True, took a
    chunk "0", a msg of false or a shape [-2, 4] and validate() then passed them or failed with a TypeError; an
    infinite step or shape or deeply nested text raised OverflowError / RecursionError.  Each is a PlanError naming
    it."""
    import json

    text = two_rank_plan().to_json()
    d = json.loads(text)
    send = next(i for i, r in enumerate(d["ranks"][0]) if r[0] == "SEND_F")

    def mut(path, value):
        x = json.loads(text)
        o = x
        for k in path[:-1]:
            o = o[k]
        o[path[-1]] = value
        return json.dumps(x)

    cases = [(text.replace('"step":0', '"step":Infinity'), "step must be an int, got inf"),
             (mut(["tensor_sets", 0, 0, 1], [float("inf")]), "malformed tensor spec"),
             ("[" * 100000 + "]" * 100000, "RecursionError"),
             (mut(["step"], 2.9), "step must be an int, got 2.9"), (mut(["step"], "5"), "step must be an int"),
             (mut(["forward_only"], "false"), "forward_only must be a bool"),
             (mut(["microbatches"], "ab"), "microbatches must be a list of dicts"),
             (mut(["ranks", 0, send, 1], "0"), "chunk='0'"), (mut(["ranks", 0, send, 4], 1.0), "peer_rank=1.0"),
             (mut(["ranks", 0, send, 7], False), "msg=False"), (mut(["ranks", 0, 0], "F00"), "3 to 10 fields"),
             (mut(["tensor_sets", 0, 0, 1], [-2, 4]), "malformed tensor spec"),
             (mut(["tensor_sets", 0, 0, 2], None), "malformed tensor spec"),
             (mut(["deps", next(iter(d["deps"]))], "abc"), "deps must map stage keys"),
             (mut(["chunk_ranks"], [0, "1"]), "chunk_ranks must be a list of ranks")]
    for bad, why in cases:
        with pytest.raises(PlanError, match=why):
            Plan.from_json(bad)
    p = two_rank_plan()  # built by hand in Python: validate names it too
    p.ranks[0][0] = Action("F", "0", 0)
    with pytest.raises(PlanError, match="action 0 of rank 0 has fields of the wrong type: chunk='0'"):
        validate(p)

def test_shape_mismatch_is_named():
    bad = (TensorSpec("h", (2, 5), "float32"),)
    with pytest.raises(PlanError, match=r"message 0: .*\(2, 4\).*\(2, 5\)"):
        validate(two_rank_plan(recv_tensors=bad))


def test_dtype_mismatch_is_named():
    bad = (TensorSpec("h", (2, 4), "float16"),)
    with pytest.raises(PlanError, match="float16"):
        validate(two_rank_plan(recv_tensors=bad))


def test_missing_receive():
    p = two_rank_plan()
    p.ranks[1] = [a for a in p.ranks[1] if a.kind != "RECV_F"]
    with pytest.raises(PlanError, match="no matching receive"):
        validate(p)


def test_deadlock_names_waits():
    """Each rank's first forward waits on a message the other sends only after its own first forward."""
    r0 = [Action("RECV_F", 0, 1, peer_rank=1, peer_chunk=1, msg=1, tensors=T), Action("F", 0, 1), Action("F", 0, 0),
          Action("SEND_F", 0, 0, peer_rank=1, peer_chunk=1, msg=0, tensors=T)]
    r1 = [Action("RECV_F", 1, 0, peer_rank=0, peer_chunk=0, msg=0, tensors=T), Action("F", 1, 0), Action("F", 1, 1),
          Action("SEND_F", 1, 1, peer_rank=0, peer_chunk=0, msg=1, tensors=T)]
    with pytest.raises(PlanError, match=r"deadlock: rank 0 at 0F1 waits on message\(s\) \[1\]; "
                                        r"rank 1 at 1F0 waits on message\(s\) \[0\]"):
        validate(Plan(0, [0, 1], [r0, r1], {}))


def test_dependency_order_checked():
    p = two_rank_plan()
    p.ranks[1] = [p.ranks[1][0], p.ranks[1][2], p.ranks[1][1], p.ranks[1][3]]  # B before F
    with pytest.raises(PlanError, match="before its dependency"):
        validate(p)


def test_stage_on_wrong_rank():
    p = two_rank_plan()
    p.chunk_ranks = [1, 0]
    with pytest.raises(PlanError, match="lives on rank"):
        validate(p)


def test_out_of_order_pair_messages_rejected():
    t = T
    r0 = [Action("F", 0, 0), Action("SEND_F", 0, 0, peer_rank=1, peer_chunk=1, msg=0, tensors=t),
          Action("F", 0, 1), Action("SEND_F", 0, 1, peer_rank=1, peer_chunk=1, msg=1, tensors=t)]
    r1 = [Action("RECV_F", 1, 1, peer_rank=0, peer_chunk=0, msg=1, tensors=t),
          Action("RECV_F", 1, 0, peer_rank=0, peer_chunk=0, msg=0, tensors=t), Action("F", 1, 1), Action("F", 1, 0)]
    with pytest.raises(PlanError, match="sent in order"):
        validate(Plan(0, [0, 1], [r0, r1], {}))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4), (3, 7)])
def test_list_schedule_matches_1f1b_on_uniform_stages(p, m):
    """On uniform stages the dual-queue interleaver reproduces 1F1B's iteration time (m + p - 1) * (t_f + t_b)."""
    g = chain_graph(p, m)
    s = list_schedule(g, p)
    assert s.iteration_time == pytest.approx((m + p - 1) * 3.0)
    plan = lower(g, s, list(range(p)))
    validate(plan)
    # 1F1B steady state on the last rank: F and B alternate
    kinds = [a.kind for a in plan.ranks[p - 1] if a.kind in ("F", "B")]
    assert kinds == ["F", "B"] * m


@settings(max_examples=30, deadline=None)
@given(p=st.integers(1, 4), m=st.integers(1, 6), tf=st.floats(0.1, 3), tb=st.floats(0.1, 3))
def test_lowered_plans_always_validate(p, m, tf, tb):
    g = chain_graph(p, m, tf, tb)
    plan = lower(g, list_schedule(g, p), list(range(p)))
    validate(plan)
    assert sum(a.kind in ("F", "B") for acts in plan.ranks for a in acts) == 2 * p * m


def test_validate_refuses_incomplete_plans_and_from_json_malformed_text():
    """A plan missing a backward (or a forward, or a whole microbatch) would run and return a wrong loss: refused."""
    import dataclasses as dc
    from dipc.plan import Plan, PlanError
    from dipc.validation import validate
    from dipc.planner.lowering import lower
    from dipc.planner.schedule import list_schedule
    from stage_graphs import chain_graph
    g = chain_graph(2, 3)
    plan = lower(g, list_schedule(g, 2), [0, 1], microbatches=[{}, {}, {}])
    validate(plan)
    for kind in ("B", "F"):
        bad = dc.replace(plan, ranks=[list(a) for a in plan.ranks], deps={})
        r, i = next((r, i) for r, acts in enumerate(bad.ranks) for i, a in enumerate(acts)
                    if a.kind == kind and a.chunk == 0 and a.mb == 1)
        del bad.ranks[r][i]
        lacks = "backward" if kind == "B" else "forward"
        with pytest.raises(PlanError, match=f"the plan is incomplete: .* has no {lacks}"):
            validate(bad)
    wider = dc.replace(plan, microbatches=[{}, {}, {}, {}])
    with pytest.raises(PlanError, match=r"microbatch\(es\) \[3\] of 4 have no stage"):
        validate(wider)
    assert Plan.from_json(plan.to_json()).digest() == plan.digest()
    for text, why in (("not json", "JSONDecodeError"), ('{"step": 0}', "KeyError"),
                      ('{"step": 0, "chunk_ranks": [0], "ranks": [[{"kind": "F", "nope": 1}]], "deps": {}}',
                       "TypeError")):
        with pytest.raises(PlanError, match=f"not a dipc plan: {why}"):
            Plan.from_json(text)


@settings(max_examples=20, deadline=None)
@given(p=st.integers(1, 4), m=st.integers(1, 6), tf=st.floats(0.1, 3), tb=st.floats(0.1, 3))
def test_forward_only_plans_keep_the_forward_order_and_validate(p, m, tf, tb):
    """An evaluation plan (dipc.plan.forward_only): every rank's forwards and activation messages in the training
    plan's order, no backward; it validates (no deadlock), survives JSON, and a backward in it is refused."""
    import dataclasses as dc
    from dipc.plan import forward_only
    g = chain_graph(p, m, tf, tb)
    plan = lower(g, list_schedule(g, p), list(range(p)))
    fo = forward_only(plan)
    for r in range(p):
        assert fo.ranks[r] == [a for a in plan.ranks[r] if a.kind in ("F", "SEND_F", "RECV_F")]
    validate(fo)
    back = Plan.from_json(fo.to_json())
    assert back.forward_only and back.digest() == fo.digest() and back.digest() != plan.digest()
    with pytest.raises(PlanError, match="already forward-only"):
        forward_only(fo)
    bad = dc.replace(fo, ranks=[list(a) for a in fo.ranks])
    bad.ranks[0].append(Action("B", 0, 0))
    with pytest.raises(PlanError, match="a forward-only plan has no backward"):
        validate(bad)


def test_lowered_plans_validate_alike_without_the_type_check_and_carry_no_per_stage_times():
    """The background planner validates its own lowered plan without :func:`dipc.plan.check_types` (every rank's
    ``Plan.from_json`` checks the types of the text it reads): the same order, and the same refusals of a broken
    plan.  A plan's ``simulated`` holds the scheduler's iteration time, not each stage's start and end (no rank
    reads them; they were 40% of the text every rank reads).  Actions and tensor specs stay immutable and equal by
    value."""
    from dipc.plan import check_types

    for p, m in ((2, 4), (3, 5), (4, 8)):
        g = chain_graph(p, m)
        plan = lower(g, list_schedule(g, p), list(range(p)), microbatches=[{}] * m)
        assert validate(plan, types=False) == validate(plan)
        assert set(plan.simulated) == {"iteration_time"}
        text = plan.to_json()
        assert '"start"' not in text and Plan.from_json(text) == plan
    bad = two_rank_plan(recv_tensors=(TensorSpec("h", (2, 5), "float32"),))
    for types in (True, False):
        with pytest.raises(PlanError, match="sends"):
            validate(bad, types=types)
    typo = dataclasses.replace(two_rank_plan(), step="0")
    with pytest.raises(PlanError, match="step must be an int"):
        check_types(typo)
    a = Action("SEND_F", 0, 1, 2, 1, 3, 4, 5, T)
    assert a == Action("SEND_F", 0, 1, sub=2, peer_rank=1, peer_chunk=3, peer_sub=4, msg=5, tensors=T)
    assert hash(a) == hash(dataclasses.replace(a)) and a.stage == "F:0:1:2" and a.peer_stage == "F:3:1:4"
    assert Action("F", 0, 1) == Action("F", 0, 1, -1, -1, -1, -1, -1, (), "keep")
    for obj, field in ((a, "mb"), (T[0], "shape")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, field, 3)


def test_stage_keys_are_built_and_parsed_strictly():
    from dipc.plan import backward_key, forward_key, paired_key, parse_stage_key, stage_key

    k = stage_key("F", 3, 1, -1)
    assert k == "F:3:1:-1" and parse_stage_key(k) == ("F", 3, 1, -1)
    assert backward_key(k) == "B:3:1:-1" and forward_key(backward_key(k)) == k and paired_key(paired_key(k)) == k
    for bad in ("F: 1:2:3", "F:1_0:2:3", "F:+1:2:3", "F:01:2:3", "X:1:2:3", "F:1:2:-2", "F:1:2", "", 3, None):
        with pytest.raises(ValueError, match="not a stage key"):
            parse_stage_key(bad)
