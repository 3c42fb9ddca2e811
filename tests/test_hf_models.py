"""Hugging Face models nobody here wrote, given to dipc.compile unmodified (the wrapper of the diffusion models only
computes the flow-matching loss from their outputs, as a training step does), trained on 2 gloo ranks for 3 steps
against the unsplit model (dipc.testing.reference_check: loss, every parameter gradient, parameters after AdamW,
the gathered state dict).  One spawn runs every model, so transformers is imported once per rank.

The results are written to ``docs/hf_support.json`` when ``DIPC_SUPPORT_TABLE`` names that file (the README's
support table is generated from it by ``python bench/support_table.py``).
"""
import json
import os
import time

import pytest

from dipc.launch import spawn
from dipc.testing import reference_check, resolve

pytestmark = pytest.mark.hf


def _train_all(rank, world, names):
    import hf_cases
    out = {}
    for name in names:
        model_fn, batches_fn, kwargs = hf_cases.CASES[name]
        if isinstance(kwargs.get("instances"), str):
            kwargs = dict(kwargs, instances=resolve(kwargs["instances"])())
        t = time.perf_counter()
        # each rank compares every gradient with the unsplit model itself: the compile-time debug check would
        # repeat that work
        # param_atol: attention key biases (CLIP, SigLIP) have an exactly-zero gradient (softmax ignores them), so
        # AdamW turns rounding noise of ~1e-10 into updates of up to lr * eps-limited size; gradients themselves are
        # compared at rtol 1e-5 / atol 1e-6
        rep = reference_check(rank, world, model_fn, (), batches_fn, (), compile_kwargs=dict(kwargs, check=False),
                              n_microbatches=2, check_state_dict=(name in ("paligemma", "flux")), param_atol=1e-4)
        out[name] = {"loss": rep["loss"], "grad_err": rep["grad_err"], "n_params": rep["n_params"],
                     "seconds": time.perf_counter() - t}
    return out


@pytest.mark.timeout(900)
def test_hf_models_match_the_unsplit_model_on_2_ranks():
    import hf_cases
    names = list(hf_cases.CASES)
    reports = spawn(_train_all, 2, (names,), timeout=850)
    for name in names:
        a, b = reports[0][name], reports[1][name]
        assert a["loss"] == b["loss"], f"{name}: ranks disagree on the loss"
        assert a["n_params"] > 0 and b["n_params"] > 0, f"{name}: a rank holds no parameter"
    path = os.environ.get("DIPC_SUPPORT_TABLE")
    if path:
        with open(path, "w") as f:
            json.dump({n: {"status": "tested", "grad_err": max(r[n]["grad_err"] for r in reports),
                           "seconds_rank0": reports[0][n]["seconds"]} for n in names}, f, indent=1)
