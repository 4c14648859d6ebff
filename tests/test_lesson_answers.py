"""The lessons run: each as committed (its figures checked by ``tests/notebook_checks/<stem>.py``, every check
saying "no answer yet"), every check right with the key and "not yet" with a wrong answer.

``tests/notebook_checks/<stem>.py`` of each lesson ``notebooks/0*.ipynb`` holds ``check(text, nb)`` and three
literal dicts:

- ``ANSWERS = {"my_x": value}``: a right answer to every question, worked out from the lesson's text (an
  estimate question: a value within its stated tolerance). Every ``my_* = ...`` answer line must have one.
- ``WRONG = {"my_x": value}``: a plausible learner's mistake for the same question (a missed term, a unit slip,
  the value of a neighbouring question).
- ``HINTS = {"my_x": "text"}``: where the feedback diagnoses that mistake, a piece of the diagnosis it must print.

The run executes the lesson once, cell by cell, as committed. After each check cell, in the same kernel, it
sets the answers the cell checks to their keys and re-runs the cell's checking statements (from the first
``check(...)`` call to the last statement that uses its result; the whole cell where it reads an answer before
that), asserts right; sets each answer to its WRONG value, asserts "not yet" (and the hint), and at the end puts
the placeholders back and re-runs the statements once more, so that the rest of the lesson runs as committed.
Re-running only those statements never repeats a cell's training run, and checking right after the cell means a
later section cannot have overwritten what the check compares with. The lesson's ``check(text, nb)`` then reads
the outputs of the run as committed (``tests/test_notebooks.py`` runs the notebooks that are not lessons).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import resource
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.test_notebooks import text_of

REPO = Path(__file__).resolve().parents[1]
LESSONS = sorted((REPO / "notebooks").glob("0*.ipynb"))
CHECKS = REPO / "tests" / "notebook_checks"
#: an answer line: a top-level assignment to ``my_<name>`` (``my_x = None   # what to predict``)
ANSWER_LINE = re.compile(r"^(my_\w+)[ \t]*=(?!=).*$", re.M)
CHECK_CALLS = {"check", "check_hash"}
#: what a Feedback message says (parallel_lab/grading/feedback.py): ``name: right, ...`` / ``name: right (...``
#: / ``name: right, every term``; ``name: not yet, ...``; ``name: no answer yet; ...``
RIGHT = re.compile(r": right\b")
NOT_YET = "not yet"
NO_ANSWER = "no answer yet"
LESSON_BUDGET_S = 90


# --------------------------------------------------------------------------------------------------
# Reading a lesson: its answer lines, its check cells, the key
# --------------------------------------------------------------------------------------------------

def answer_variables(nb) -> list[str]:
    """The ``my_*`` names of the notebook's answer lines, in order."""
    return [m.group(1) for c in nb.cells if c.cell_type == "code" for m in ANSWER_LINE.finditer(c.source)]


def fill_answers(source: str, answers: dict) -> str:
    """``source`` with each answer line ``my_x = ...`` replaced by ``my_x = <answers[my_x]>``."""
    return ANSWER_LINE.sub(lambda m: f"{m.group(1)} = {answers[m.group(1)]!r}", source)


def _parse(source: str) -> ast.Module:
    """The cell's Python, IPython's ``%magic`` and ``!shell`` lines read as ``pass`` (line numbers kept)."""
    lines = [("pass" if line.lstrip().startswith(("%", "!")) else line) for line in source.splitlines()]
    return ast.parse("\n".join(lines))


def _is_check(n: ast.AST) -> bool:
    return isinstance(n, ast.Call) and ((isinstance(n.func, ast.Name) and n.func.id in CHECK_CALLS)
                                        or (isinstance(n.func, ast.Attribute) and n.func.attr in CHECK_CALLS))


def _calls_check(node: ast.AST) -> bool:
    return any(_is_check(n) for n in ast.walk(node))


def check_tail(source: str) -> str | None:
    """The checking statements of a cell: from its first top-level statement that calls ``check(...)`` to its last
    one that calls it or uses a name such a statement assigned (``feedback = check(...)`` ... ``feedback``);
    None when the cell calls no check."""
    body = _parse(source).body
    first = last = None
    names: set[str] = set()
    for i, stmt in enumerate(body):
        uses = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        if _calls_check(stmt) or (first is not None and uses & names):
            first = i if first is None else first
            last = i
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
            names |= {n.id for t in targets if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign))
                      for n in ast.walk(t) if isinstance(n, ast.Name)}
    if first is None:
        return None
    lines = source.splitlines()
    return "\n".join(lines[body[first].lineno - 1:body[last].end_lineno])


def checked_variables(tail: str) -> list[str]:
    """The ``my_*`` names the checking statements read, in order of first use."""
    seen: dict[str, None] = {}
    for n in ast.walk(ast.parse(tail)):
        if isinstance(n, ast.Name) and n.id.startswith("my_"):
            seen.setdefault(n.id)
    return list(seen)


def check_calls(tail: str) -> int:
    """How many ``check(...)`` calls the checking statements hold."""
    return sum(_is_check(n) for n in ast.walk(ast.parse(tail)))


def key_of(path: Path):
    """The lesson's checker module (its ANSWERS, WRONG and HINTS), or None when it has none."""
    module = CHECKS / f"{path.stem}.py"
    if not module.exists():
        return None
    spec = importlib.util.spec_from_file_location(f"notebook_key_{path.stem}", module)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def key_problems(nb, answers: dict | None, wrong: dict | None) -> list[str]:
    """What the key lacks for this notebook: an answer line without ANSWERS or WRONG, a key for no question, a
    WRONG equal to its key, a question no check cell reads."""
    if answers is None or wrong is None:
        return ["the checker module has no ANSWERS or no WRONG dict"]
    asked = answer_variables(nb)
    checked = {v for c in nb.cells if c.cell_type == "code" and (t := check_tail(c.source)) for v in
               checked_variables(t)}
    out = [f"{v}: no key in ANSWERS" for v in asked if v not in answers]
    out += [f"{v}: no wrong answer in WRONG" for v in asked if v not in wrong]
    out += [f"{v}: a key for no answer line" for v in {**answers, **wrong} if v not in asked]
    out += [f"{v}: WRONG equals the key" for v in asked if v in answers and v in wrong and answers[v] == wrong[v]]
    out += [f"{v}: no check(...) reads it" for v in asked if v not in checked]
    out += [f"{v}: asked twice" for v in set(asked) if asked.count(v) > 1]
    return out


# --------------------------------------------------------------------------------------------------
# Fast tests: every question has a key
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_every_question_has_a_key(path):
    nb = nbformat.read(path, as_version=4)
    mod = key_of(path)
    assert mod is not None, f"{path.name}: no tests/notebook_checks/{path.stem}.py"
    problems = key_problems(nb, getattr(mod, "ANSWERS", None), getattr(mod, "WRONG", None))
    assert not problems, f"{path.name} (tests/notebook_checks/{path.stem}.py): " + "; ".join(problems)
    assert set(getattr(mod, "HINTS", {})) <= set(mod.WRONG), f"{path.name}: HINTS for a question with no WRONG"


def test_a_new_question_without_a_key_is_caught():
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("%matplotlib inline\nmy_a = None   # predict\nmy_b = None"),
        nbformat.v4.new_code_cell("x = 2\nfeedback = check(my_a, x)\ny = 3\nfeedback\nz = 4"),
        nbformat.v4.new_code_cell("print(check(None if my_b is None else my_b * 1e9, 5e9, unit='B'))"),
    ])
    assert answer_variables(nb) == ["my_a", "my_b"]
    assert key_problems(nb, {"my_a": 2, "my_b": 5}, {"my_a": 3, "my_b": 4}) == []
    assert key_problems(nb, {"my_a": 2}, {"my_a": 3}) == ["my_b: no key in ANSWERS", "my_b: no wrong answer in WRONG"]
    assert key_problems(nb, {"my_a": 2, "my_b": 5}, {"my_a": 2, "my_b": 4}) == ["my_a: WRONG equals the key"]
    nb.cells.append(nbformat.v4.new_code_cell("my_c = None"))
    assert key_problems(nb, {"my_a": 2, "my_b": 5, "my_c": 1}, {"my_a": 3, "my_b": 4, "my_c": 0}) == [
        "my_c: no check(...) reads it"]
    assert check_tail(nb.cells[1].source) == "feedback = check(my_a, x)\ny = 3\nfeedback"
    assert fill_answers(nb.cells[0].source, {"my_a": 2.5, "my_b": {"k": 1}}) == (
        "%matplotlib inline\nmy_a = 2.5\nmy_b = {'k': 1}")


# --------------------------------------------------------------------------------------------------
# The keyed run
# --------------------------------------------------------------------------------------------------

def _text(outputs) -> str:
    """Each output once, as tests/test_notebooks.py reads them: stream text, else text/plain, else any text."""
    out = []
    for o in outputs:
        if "text" in o:
            out.append(o["text"])
        data = o.get("data", {})
        texts = [v for k, v in data.items() if k.startswith("text/")]
        if "text/plain" in data:
            out.append(str(data["text/plain"]))
        elif texts:
            out.append(str(texts[0]))
    return "\n".join(out)


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def reads_answers_before_its_check(source: str, tail: str) -> bool:
    """Whether a check cell reads a ``my_*`` answer outside its checking statements (then its keyed re-run is the
    whole cell, so that what the cell does with a real answer runs too)."""
    rest = ANSWER_LINE.sub("", source.replace(tail, ""))
    return any(isinstance(n, ast.Name) and n.id.startswith("my_") for n in ast.walk(_parse(rest)))


@pytest.mark.notebook
@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_lesson_answer_key(path):
    mod = key_of(path)
    answers, wrong, hints = (getattr(mod, name, None) for name in ("ANSWERS", "WRONG", "HINTS"))
    nb = nbformat.read(path, as_version=4)
    problems = key_problems(nb, answers, wrong)
    assert not problems, f"{path.name}: " + "; ".join(problems)
    hints = hints or {}
    client = NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    failures, verdicts, checked = [], [], []
    t0, cpu0 = time.perf_counter(), _children_cpu()

    def rerun(source: str, index: int) -> str:
        cell = nbformat.v4.new_code_cell(source)
        client.execute_cell(cell, index)
        return _text(cell.outputs)

    with client.setup_kernel():
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            client.execute_cell(cell, i)           # raises CellExecutionError, with the cell, on an error
            tail = check_tail(cell.source)
            if tail is None:
                continue
            where = f"{path.name} cell {i}"
            calls = check_calls(tail)
            names = checked_variables(tail)
            keyed = "\n".join(f"{v} = {answers[v]!r}" for v in names)
            rerun(f"_placeholders = ({', '.join(names)},)", i)       # as committed; put back at the end
            body = fill_answers(cell.source, answers) if reads_answers_before_its_check(cell.source, tail) else tail
            shown = rerun(f"{keyed}\n{body}", i)
            if NOT_YET in shown or NO_ANSWER in shown or len(RIGHT.findall(shown)) < calls:
                failures.append(f"{where}: with the key {keyed.replace(chr(10), ', ')} it printed, for {calls} "
                                f"check(s):\n{shown}")
            else:
                for var in names:
                    checked.append(var)
                    said = rerun(f"{var} = {wrong[var]!r}\n{tail}", i)
                    again = rerun(f"{var} = {answers[var]!r}\n{tail}", i)
                    verdicts.append(f"{where} {var} = {wrong[var]!r}: "
                                    + " | ".join(line.strip() for line in said.splitlines() if NOT_YET in line or
                                                 line.startswith("hint")))
                    if NOT_YET not in said or len(RIGHT.findall(said)) >= len(RIGHT.findall(again)):
                        failures.append(f"{where}: {var} = {wrong[var]!r} (WRONG) was not told 'not yet'; it "
                                        f"printed:\n{said}")
                    elif var in hints and hints[var] not in said:
                        failures.append(f"{where}: {var} = {wrong[var]!r} (WRONG): no hint {hints[var]!r} in:\n{said}")
                    if NOT_YET in again or len(RIGHT.findall(again)) < calls:
                        failures.append(f"{where}: {var} back to {answers[var]!r} (the key) re-ran as:\n{again}")
            rerun(f"{', '.join(names)}, = _placeholders\n{tail}", i)
            nb.cells[i] = cell                     # execute_cell stores each re-run as cell i: the committed one back
    seconds, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    print(f"{path.name}: {len(checked)} questions keyed, {seconds:.1f} s wall, {cpu:.1f} s CPU")
    print("\n".join(verdicts))
    unchecked = [v for v in answer_variables(nb) if v not in checked]
    assert not failures, "\n\n".join(failures)
    assert not unchecked, f"{path.name}: no check cell ran for {unchecked}"
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    mod.check(text_of(nb), nb)                     # the lesson's figures, from its run as committed
    assert cpu < LESSON_BUDGET_S, f"{path.name}: the run used {cpu:.1f} s of CPU, over {LESSON_BUDGET_S} s"
    if os.getloadavg()[0] < 1.5:                   # wall time only when nothing else runs (CPU time always)
        assert seconds < LESSON_BUDGET_S, f"{path.name} took {seconds:.1f} s, over its {LESSON_BUDGET_S} s budget"
