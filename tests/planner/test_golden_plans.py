"""Golden plans: every schedule template's plan of one step on small fixtures, pinned as text.

Like torch.distributed.pipelining's golden schedule tests: each template of :func:`dipc.schedules` plans one fixed
step of each fixture in :data:`FIXTURES` with :func:`dipc.simulate`, and the plan's text form
(:meth:`dipc.plan.Plan.to_text`, one line per rank) must equal ``tests/planner/golden/<fixture>_<template>.txt`` byte for
byte.

The goldens pin the planner's output.  A refactor of the planner (moving code between modules, making
``make_plan`` a sequence of named steps, ...) must leave every file unchanged.  A change that is meant to change
plans (a new heuristic, a cost-model or profile fix, a new template) regenerates them with::

    DIPC_REGEN_GOLDEN=1 python -m pytest -q tests/planner/test_golden_plans.py

which rewrites the files instead of comparing (and removes goldens no fixture and template names any more); review
``git diff tests/planner/golden`` and explain in the commit message why the plans changed.  A mismatch fails with a
unified diff of the first differing actions (one action per diff line, ``rank r: token``) and this command
(``-p no:logging`` leaves out the torch.export trace records pytest captures after it).

What the plans depend on, all fixed here: the model and its capture (``dipc.compile`` of the tiny reference VLM of
``pipeline_cases``), the device profile "h100" (stage latencies and activation bytes from the symbolic cost model,
:mod:`dipc.passes.symcost`, never from wall-clock measurement), the batch (seeded), the memory limit, ``seed=0``
and ``budget_s=0``: no MCTS search and no gap filling, the only planner steps a deadline cuts.  The memory ILP
(HiGHS via ``scipy.optimize.milp``) runs under a 2 s time limit per rank, which these sizes do not approach
(milliseconds).  The plans were checked to be the same text in separate processes under different
``PYTHONHASHSEED`` values.  A torch upgrade that changes the exported graph, or a change to the cost model or the
"h100" profile, may change the goldens as well as a planner change does.

Fixtures (compiled once per module each):

* ``vlm2``: 2 ranks, 4 vision + 4 text layers, vision sub-microbatches of 1 image, 8 samples in 4 microbatches
  with 3, 0 (text only), 4 and 3 images; the "h100" profile's memory capacity as the limit (nothing recomputes).
* ``vlm4_limit``: 4 ranks, 8 + 8 layers, vision sub-microbatches of 2 images, 12 samples in 6 microbatches (one
  text only) under a memory limit of 1.1e6 bytes per device (0.57 to 0.74e6 of it the ranks' parameters, gradients
  and optimizer states): every template recomputes, with whole-chunk, per-layer ("recompute:k"), grouped
  ("recompute:k/g") and op-selective ("selective", ``s`` in the text) strategies in the plans.
"""
import difflib
import os
import pathlib

import pytest
import torch

import dipc
from dipc.plan import Plan

import pipeline_cases as pc

GOLDEN = pathlib.Path(__file__).resolve().parent / "golden"
REGEN = os.environ.get("DIPC_REGEN_GOLDEN") == "1"
REGEN_CMD = "DIPC_REGEN_GOLDEN=1 python -m pytest -q tests/planner/test_golden_plans.py"
DIFF_LINES = 60

#: fixture -> how it is compiled and which step it plans
FIXTURES = {
    "vlm2": dict(pp_size=2, layers=4, vision_sub=1, counts=[2, 1, 0, 0, 3, 1, 1, 2], seq=16, batch_seed=8,
                 n_microbatches=4, memory_limit=None),
    "vlm4_limit": dict(pp_size=4, layers=8, vision_sub=2, counts=[2, 1, 0, 0, 3, 1, 1, 2, 0, 1, 2, 0], seq=18,
                       batch_seed=9, n_microbatches=6, memory_limit=1.1e6),
}
CASES = [(f, t) for f in FIXTURES for t in dipc.schedules()]


class _Plans:
    """Each fixture compiled once, each (fixture, template) planned once, on first use."""

    def __init__(self):
        self.compiled, self.plans = {}, {}

    def __getitem__(self, case) -> Plan:
        if case not in self.plans:
            self.plans[case] = self._plan(*case)
        return self.plans[case]

    def _plan(self, name: str, schedule: str) -> Plan:
        spec = FIXTURES[name]
        if name not in self.compiled:
            torch.manual_seed(0)
            model = pc.vlm(False, spec["layers"], spec["layers"])
            self.compiled[name] = dipc.compile(model, pc.vlm_batch([1, 1], 12, 0), spec["pp_size"], device="h100",
                                               sub_microbatch_size={"vision": spec["vision_sub"]},
                                               check=False)  # the plan, not the gradients
        batch = pc.vlm_batch(spec["counts"], spec["seq"], spec["batch_seed"])
        _, plan = dipc.simulate(self.compiled[name], batch, spec["n_microbatches"], schedule=schedule,
                                memory_limit=spec["memory_limit"], budget_s=0.0, seed=0)
        return plan


@pytest.fixture(scope="module")
def plans():
    return _Plans()


def _actions(text: str) -> list[str]:
    """One line per action, ``rank r: token``: a plan's lines are hundreds of actions long."""
    out = []
    for line in text.splitlines():
        rank, _, tokens = line.partition(": ")
        out += [f"{rank}: {tok}" for tok in tokens.split()] or [line]
    return out


def _golden_diff(want: str, got: str, path: pathlib.Path) -> str:
    diff = list(difflib.unified_diff(_actions(want), _actions(got), f"{path.name} (golden)", "planned now",
                                     lineterm=""))
    more = f"\n... ({len(diff) - DIFF_LINES} more diff lines)" if len(diff) > DIFF_LINES else ""
    return (f"the plan differs from {path} (one action per diff line):\n" + "\n".join(diff[:DIFF_LINES]) + more
            + f"\nIf the change is intended, regenerate with\n    {REGEN_CMD}\nand say in the commit message why "
              "the plans changed.")


@pytest.mark.parametrize("fixture,schedule", CASES, ids=[f"{f}-{t}" for f, t in CASES])
def test_plan_equals_its_golden(plans, fixture, schedule):
    got = plans[fixture, schedule].to_text() + "\n"
    path = GOLDEN / f"{fixture}_{schedule}.txt"
    if REGEN:
        GOLDEN.mkdir(exist_ok=True)
        if not path.exists() or path.read_text() != got:
            path.write_text(got)
        return
    assert path.exists(), f"no golden plan {path}; write it with\n    {REGEN_CMD}"
    want = path.read_text()
    if want != got:
        pytest.fail(_golden_diff(want, got, path), pytrace=False)


def test_every_golden_belongs_to_a_fixture_and_template():
    """A golden no (fixture, template) names any more is stale (regeneration removes it)."""
    names = {f"{f}_{t}.txt" for f, t in CASES}
    stale = sorted(p.name for p in GOLDEN.glob("*.txt") if p.name not in names)
    if REGEN:
        for name in stale:
            (GOLDEN / name).unlink()
        return
    assert not stale, f"stale golden plans in {GOLDEN}: {stale}; remove them with\n    {REGEN_CMD}"


@pytest.mark.parametrize("fixture,schedule", CASES, ids=[f"{f}-{t}" for f, t in CASES])
def test_golden_plan_survives_its_json_form(plans, fixture, schedule):
    plan = plans[fixture, schedule]
    assert Plan.from_json(plan.to_json()).to_text() == plan.to_text()
