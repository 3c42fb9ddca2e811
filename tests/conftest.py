"""Test-suite settings: every dipc.compile in the tests (and in the ranks they spawn, which inherit the
environment) runs in debug mode, comparing each capture and the partitioned pipeline with the eager model
(dipc.check)."""
import os

os.environ.setdefault("DIPC_CHECK", "1")
