"""Depth on demand: each lesson states its core-path time, marks its optional parts, and keeps the two apart.

The estimate (tests/lesson_time.py) reads the markdown outside the "Going deeper (optional)" sections at 200
words a minute, adds 2 minutes per prediction and the run time. The core path must fit in 45 minutes, and the
time the lesson's first cell states must be within 30% of the estimate. No core cell may use a name that only
an optional part defines, so a learner who skips the optional parts can run the rest.
"""

from __future__ import annotations

import ast
import builtins
import re

import pytest

from tests.lesson_time import LESSONS, cells, estimate, optional_flags, source, stated

CORE_LIMIT_MIN = 45
TOLERANCE = 0.30


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_core_path_time_is_stated_and_honest(path):
    core, extra = stated(path)
    e = estimate(path)
    assert core is not None, f"{path.name}: the first cell must say 'Core path: about N minutes'"
    assert e["core_min"] <= CORE_LIMIT_MIN, f"{path.name}: the core path is {e['core_min']:.1f} min, over 45"
    assert abs(core - e["core_min"]) <= TOLERANCE * e["core_min"], \
        f"{path.name}: states {core} min, the estimate is {e['core_min']:.1f} min"
    if e["optional_words"]:
        assert extra is not None, f"{path.name}: the first cell must say what the optional parts add"
        assert abs(extra - e["optional_min"]) <= max(2.0, TOLERANCE * e["optional_min"]), \
            f"{path.name}: states the optional parts add {extra} min, the estimate is {e['optional_min']:.1f}"
    else:
        assert "no optional parts" in source(cells(path)[0]), \
            f"{path.name}: without a 'Going deeper (optional)' part the first cell says it has no optional parts"


def _code(cell: dict) -> ast.Module | None:
    text = "\n".join(line for line in source(cell).splitlines() if not line.lstrip().startswith(("%", "!")))
    try:
        return ast.parse(text)
    except SyntaxError:
        return None


def _defined(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _used(tree: ast.Module) -> set[str]:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_core_path_does_not_depend_on_optional_parts(path):
    nb_cells = cells(path)
    core_defined = set(dir(builtins))
    optional_only: dict[str, int] = {}       # name -> the optional cell that defines it
    for i, (c, optional) in enumerate(zip(nb_cells, optional_flags(nb_cells), strict=True)):
        if c["cell_type"] != "code" or (tree := _code(c)) is None:
            continue
        if optional:
            for name in _defined(tree) - core_defined:
                optional_only.setdefault(name, i)
            continue
        stale = {n: optional_only[n] for n in _used(tree) - _defined(tree) if n in optional_only}
        assert not stale, f"{path.name} cell {i} (core) uses names defined only in optional cells: {stale}"
        core_defined |= _defined(tree)
        for name in _defined(tree):
            optional_only.pop(name, None)


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_optional_headings_are_spelled_alike(path):
    """A heading that calls itself optional uses the one marker the estimate and the reader look for."""
    for i, c in enumerate(cells(path)):
        if c["cell_type"] != "markdown":
            continue
        for line in source(c).splitlines():
            if line.startswith("#") and re.search(r"optional", line, re.I):
                assert re.match(r"#+ Going deeper \(optional\)", line), f"{path.name} cell {i}: {line!r}"
