"""Every notebook in notebooks/ is committed without outputs and executes from top to bottom (the lessons:
``tests/test_lesson_answers.py``, which also runs their answer keys)."""

from __future__ import annotations

import importlib.util
import os
import resource
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
CHECKS = REPO / "tests" / "notebook_checks"
LESSON_BUDGET_S = 90


def test_there_are_notebooks():
    assert {p.name for p in NOTEBOOKS} >= {"app.ipynb", "01_memory_ledger.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
    assert not dirty, (f"{path.name}: cells {dirty} have outputs; strip them before committing "
                       "(jupyter nbconvert --clear-output --inplace)")


def test_hidden_sources_are_hidden_everywhere():
    """A cell whose code is grading or plotting machinery is collapsed in JupyterLab (``source_hidden``) and
    tagged ``hide-input``, which the docs site's mkdocs-jupyter removes (mkdocs.yml ``remove_input_tags``)."""
    assert "remove_input_tags: [hide-input]" in (REPO / "mkdocs.yml").read_text()
    tagged = 0
    for path in NOTEBOOKS:
        for i, c in enumerate(nbformat.read(path, as_version=4).cells):
            tags = c.metadata.get("tags", [])
            hidden = c.metadata.get("jupyter", {}).get("source_hidden", False)
            assert ("hide-input" in tags) == hidden, f"{path.name} cell {i}: source_hidden and hide-input disagree"
            tagged += "hide-input" in tags
            if c.cell_type == "code" and "Markdown(f" in c.source and path.name[:2].isdigit():
                assert hidden, f"{path.name} cell {i}: a summary's f-string should be hidden (hide-input)"
    assert tagged >= 9, tagged


def execute(path: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    return nb


def text_of(nb: nbformat.NotebookNode) -> str:
    """All outputs as text, each output once: a stream's text, else its text/plain (a rich object such as
    a check() Feedback also renders as text/markdown; counting both would count each answer cell twice)."""
    out = []
    for c in nb.cells:
        for o in c.get("outputs", []):
            if "text" in o:
                out.append(o["text"])
            data = o.get("data", {})
            texts = [v for k, v in data.items() if k.startswith("text/")]
            if "text/plain" in data:
                out.append(str(data["text/plain"]))
            elif texts:
                out.append(str(texts[0]))
    return "\n".join(out)


def lesson_check(path: Path):
    """The ``check(text, nb)`` of ``tests/notebook_checks/<stem>.py``, or None when the notebook has none."""
    module = CHECKS / f"{path.stem}.py"
    if not module.exists():
        return None
    spec = importlib.util.spec_from_file_location(f"notebook_check_{path.stem}", module)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.check


def test_every_lesson_has_checks():
    lessons = [p for p in NOTEBOOKS if p.name[:2].isdigit()]
    missing = [p.name for p in lessons if lesson_check(p) is None]
    assert not missing, f"lessons without tests/notebook_checks/<stem>.py: {missing}"


#: the lessons with an answer key (``0*``) run in tests/test_lesson_answers.py, as committed with their checks and
#: then keyed; here the rest (the companion lesson 10, the app)
OTHERS = [p for p in NOTEBOOKS if not p.name.startswith("0")]


@pytest.mark.notebook
@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", OTHERS, ids=lambda p: p.name)
def test_notebook_executes(path):
    t0, cpu0 = time.perf_counter(), _children_cpu()
    nb = execute(path)                       # raises CellExecutionError on the first failing cell
    seconds, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    check = lesson_check(path)
    if check is not None:
        check(text_of(nb), nb)
    # The budget of a lesson is 90 s on 2 CPU cores. Wall time depends on what else runs, so the
    # test asserts the CPU time of the kernel and its ranks (which load does not inflate much) always, and
    # the wall time only when the machine is idle.
    print(f"{path.name}: {seconds:.1f} s wall, {cpu:.1f} s CPU")
    if path.name[:2].isdigit():
        assert cpu < LESSON_BUDGET_S, f"{path.name} used {cpu:.1f} s of CPU, over its {LESSON_BUDGET_S} s budget"
        if os.getloadavg()[0] < 1.5:
            assert seconds < LESSON_BUDGET_S, f"{path.name} took {seconds:.1f} s, over its {LESSON_BUDGET_S} s budget"


def _children_cpu() -> float:
    """CPU seconds of this process's finished children (the kernel, and the ranks it waited for)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime
