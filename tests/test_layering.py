"""Layer 1 (``parallel_lab/*.py``) is pure Python: importing it is fast and never pulls in torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "parallel_lab"
LAYER1 = sorted(PKG.glob("*.py"))
FORBIDDEN = {"torch", "matplotlib", "ipywidgets", "numpy", "voila"}


def fresh(code: str) -> str:
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=PKG.parent)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_import_is_fast_and_torch_free():
    code = ("import time, sys; t = time.perf_counter(); import parallel_lab; dt = time.perf_counter() - t; "
            "print(dt, 'torch' in sys.modules, 'matplotlib' in sys.modules)")
    runs = [fresh(code).split() for _ in range(3)]
    assert all(r[1:] == ["False", "False"] for r in runs), runs
    best = min(float(r[0]) for r in runs)                  # best of 3: the machine is shared
    assert best < 0.3, f"import parallel_lab took {best:.3f} s"


@pytest.mark.parametrize("argv", [["memory", "--model", "llama2-7b", "--tp", "2", "--dp", "4", "--json"],
                                  ["comm", "--model", "tiny-llama", "--seq", "128", "--dp", "2", "--json"],
                                  ["flops", "--model", "tiny-llama", "--seq", "128", "--json"]])
def test_analytic_subcommands_do_not_import_torch(argv):
    code = ("import sys, io, contextlib; from parallel_lab import cli; "
            f"contextlib.redirect_stdout(io.StringIO()).__enter__(); rc = cli.main({argv!r}); "
            "sys.__stdout__.write(f\"{rc} {'torch' in sys.modules}\")")
    assert fresh(code) == "0 False"


def _function_scoped(tree: ast.AST) -> set[int]:
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside |= {id(n) for n in ast.walk(node) if n is not node}
    return inside


@pytest.mark.parametrize("path", LAYER1, ids=[p.name for p in LAYER1])
def test_layer1_sources_import_no_heavy_packages(path):
    tree = ast.parse(path.read_text(), str(path))
    lazy = _function_scoped(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:                                   # relative: .dist and .viz only inside functions
                mod = (node.module or "").split(".")[0]
                names = [a.name for a in node.names] if not node.module else [mod]
                if id(node) not in lazy:
                    assert not {"distributed", "viz"} & set(names), f"{path.name}:{node.lineno} imports layer 2/3"
                continue
            roots = [(node.module or "").split(".")[0]]
        else:
            continue
        bad = FORBIDDEN & set(roots)
        assert not bad, f"{path.name}:{node.lineno} imports {bad}; layer 1 must stay pure Python"
