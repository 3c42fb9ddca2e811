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


import pytest


@pytest.fixture(scope="module")
def laid_out(tmp_path_factory):
    """The installed layout in one folder: ``dipc/`` with ``passes/``, ``codegen/`` and ``models/`` inside."""
    root = tmp_path_factory.mktemp("layout")
    pkg = root / "dipc"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "passes", "codegen", "models")
    shutil.copytree(os.path.join(ROOT, "dipc"), pkg, ignore=ignore)
    for sub in ("passes", "codegen", "models"):
        shutil.copytree(os.path.join(ROOT, sub), pkg / sub, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return root


def test_imports_follow_the_layers(laid_out):
    lint = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    out = subprocess.run([lint, "--config", os.path.join(ROOT, "pyproject.toml"), "--no-cache"], cwd=laid_out,
                         env=dict(os.environ, PYTHONPATH=str(laid_out)), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "1 kept, 0 broken" in out.stdout, out.stdout[-4000:] + out.stderr[-2000:]


_CYCLES = """
import grimp, networkx as nx
g = grimp.build_graph("dipc", include_external_packages=False)
G = nx.DiGraph([(m, d) for m in g.modules for d in g.find_modules_directly_imported_by(m) if d != m])
print("\\n".join(" -> ".join(c) for c in nx.simple_cycles(G)))
"""


def test_no_import_cycle(laid_out):
    """No chain of imports leads from a module back to itself, also within a layer (import-linter's ``layers``
    contract allows modules of one layer to import each other).  A module importing itself by name (to be pickled
    by it under ``python -m``) is not a cycle."""
    out = subprocess.run([sys.executable, "-c", _CYCLES], cwd=laid_out, env=dict(os.environ, PYTHONPATH=str(laid_out)),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert not out.stdout.strip(), "import cycles:\n" + out.stdout[:3000]


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].split(os.sep)
    if rel[0] != "dipc":
        rel = ["dipc"] + rel
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def _python_files():
    for top in ("dipc", "passes", "codegen", "models"):
        for d, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            yield from (os.path.join(d, f) for f in files if f.endswith(".py"))


def test_no_module_imports_another_packages_private_name():
    """Underscore names stay inside their package: ``from dipc.x.y import _z`` is allowed only within ``dipc.x``."""
    import ast

    bad = []
    for path in _python_files():
        mod = _module_name(path)
        pkg = mod if path.endswith("__init__.py") else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(open(path).read())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = pkg.split(".")[:len(pkg.split(".")) - (node.level - 1)]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            if not src.startswith("dipc") or src == pkg or src.rsplit(".", 1)[0] == pkg:
                continue
            bad += [f"{os.path.relpath(path, ROOT)}:{node.lineno} imports {a.name} from {src}" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, "\n".join(bad)


def test_no_source_file_is_over_600_lines():
    """Rooms that say what they hold: no module of ``dipc/``, ``passes/`` or ``codegen/`` over 600 lines."""
    big = []
    for path in _python_files():
        if os.path.relpath(path, ROOT).startswith("models"):
            continue
        with open(path) as f:
            n = sum(1 for _ in f)
        if n > 600:
            big.append(f"{os.path.relpath(path, ROOT)}: {n} lines")
    assert not big, "\n".join(big)
