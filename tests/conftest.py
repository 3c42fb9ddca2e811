"""Test-suite settings: every dipc.compile in the tests (and in the ranks they spawn, which inherit the
environment) runs in debug mode, comparing each capture and the partitioned pipeline with the eager model
(dipc.check)."""
import os

os.environ.setdefault("DIPC_CHECK", "1")

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
