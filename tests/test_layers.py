"""The layers hold (issue 38, DESIGN.md "Layout"): IR -> capture -> passes -> codegen -> program -> simulator ->
planner -> runtime -> API -> tools, each importing only layers below it, checked by import-linter with the
``layers`` contract in pyproject.toml.  ``passes/``, ``codegen/`` and ``models/`` install as ``dipc.passes``,
``dipc.codegen`` and ``dipc.models``, which import-linter cannot see in an editable install: the test copies them
into one ``dipc`` package first."""
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_imports_follow_the_layers(tmp_path):
    pkg = tmp_path / "dipc"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(os.path.join(ROOT, "dipc"), pkg, ignore=ignore)
    for sub in ("passes", "codegen", "models"):
        shutil.copytree(os.path.join(ROOT, sub), pkg / sub, ignore=ignore)
    lint = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    out = subprocess.run([lint, "--config", os.path.join(ROOT, "pyproject.toml"), "--no-cache"], cwd=tmp_path,
                         env=dict(os.environ, PYTHONPATH=str(tmp_path)), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "1 kept, 0 broken" in out.stdout, out.stdout[-4000:] + out.stderr[-2000:]
