"""Test-suite settings.  Every dipc.compile in the tests (and in the ranks they spawn, which inherit the
environment) runs in debug mode, comparing each capture and the partitioned pipeline with the eager model
(dipc.check)."""
import os
import sys

os.environ.setdefault("DIPC_CHECK", "1")
# the tests mirror the packages (tests/ir, capture, passes, sim, planner, runtime, models); the models and batches
# they share (pipeline_cases, hf_cases, zoo_cases, stage_graphs) stay here, importable from every folder and by the
# ranks the tests spawn (which inherit sys.path)
TESTS = os.path.dirname(os.path.abspath(__file__))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` (more models, ranks and processes than the default suite's 10 minutes on 2 cores
    allow) run with ``DIPC_FULL=1`` or when selected by ``-m slow``."""
    if os.environ.get("DIPC_FULL") == "1" or "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with DIPC_FULL=1 python -m pytest (the full suite)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
