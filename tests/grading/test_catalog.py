"""The course catalog (``parallel_lab.grading.catalog``) agrees with the exercises on disk, their tests' points and
the handout; written answers are read from a submission without running it; ``grade --list`` shows time and
points."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

from parallel_lab.grading.catalog import BY_NAME, EXERCISES, answers_text, missing_answer, written_answers

REPO = Path(__file__).resolve().parents[2]


def points_of(path: Path) -> int:
    """The points of a test file's ``test_`` functions (``@points(n)``, 1 when undecorated), read from its source."""
    total = 0
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            marks = [d.args[0].value for d in node.decorator_list
                     if isinstance(d, ast.Call) and getattr(d.func, "id", "") == "points"]
            total += marks[0] if marks else 1
    return total


def test_catalog_matches_the_exercises_and_their_points():
    on_disk = sorted(p.name for p in (REPO / "exercises").iterdir() if (p / "public_tests.py").exists())
    assert sorted(BY_NAME) == on_disk
    for e in EXERCISES:
        got = points_of(REPO / "exercises" / e.name / "public_tests.py") + \
            points_of(REPO / "instructor" / e.name / "hidden_tests.py")
        assert e.points == got, f"{e.name}: the catalog says {e.points} points, its tests are worth {got}"
        assert e.kind in ("predict", "implement", "design") and 10 <= e.minutes <= 180


def test_handout_lists_every_exercise_in_order_with_time_and_points():
    text = (REPO / "exercises" / "README.md").read_text()
    rows = [line for line in text.splitlines() if re.match(r"\| \d+ \|", line)]
    named = [line.split("`")[1] for line in rows]
    assert named == [e.name for e in EXERCISES]
    for e, row in zip(EXERCISES, rows, strict=True):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert f"{e.minutes} min" in cells and str(e.points) in cells, (e.name, cells)


def test_written_answers_are_read_without_running_the_submission(tmp_path):
    py = tmp_path / "predict_bubble.py"
    py.write_text('import os\nos._exit(3)\nBUBBLE_VS_MEMORY = """GPipe holds m\n  micro-batches."""\n')
    assert written_answers("predict_bubble", py) == {"bubble_vs_memory": "GPipe holds m micro-batches."}
    assert "at least 15 words" in missing_answer("predict_bubble", py)
    yml = tmp_path / "design_plan.yaml"
    yml.write_text("# why: first line\nschema_version: 1\n  # why:   second   line\n# whys: not this\n")
    assert written_answers("design_plan", yml) == {"why": "first line second line"}
    assert answers_text("design_plan", yml) == "why: first line second line"
    assert answers_text("zigzag", py) == "" and missing_answer("zigzag", py) == ""
    assert answers_text("predict_bubble", tmp_path / "absent.py") == "bubble_vs_memory: (no answer)"


def test_grade_list_shows_time_and_points():
    p = subprocess.run([sys.executable, "-m", "parallel_lab", "grade", "--list", "--json"], capture_output=True,
                       text=True, cwd=REPO, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["exercises"] == sorted(BY_NAME)
    assert [r["exercise"] for r in out["details"]] == [e.name for e in EXERCISES]
    assert all(r["minutes"] and r["points"] for r in out["details"])


def test_listing_keeps_an_exercise_the_catalog_does_not_know_yet():
    from parallel_lab.grading.catalog import listing

    rows, table = listing(["zigzag", "new_one", "predict_ledger"])
    assert [r["exercise"] for r in rows] == ["predict_ledger", "zigzag", "new_one"]
    assert table.splitlines()[3].split()[:2] == ["3", "new_one"] and "3 exercises" in table


def test_every_graded_public_test_names_its_property_and_a_hint():
    for path in sorted((REPO / "exercises").glob("*/public_tests.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                calls = {getattr(d.func, "id", ""): d for d in node.decorator_list if isinstance(d, ast.Call)}
                if "points" in calls and calls["points"].args[0].value == 0:
                    continue                   # an ungraded reminder (a written answer)
                assert "checks" in calls, f"{path.parent.name}.{node.name} has no @checks(property, hint)"


def test_checks_appends_the_property_and_the_hint_to_a_failure_only():
    import pytest

    from parallel_lab.grading.harness import Fail, checks, points

    @points(3)
    @checks("the answer is 42", "count again")
    def test_x(sub):
        if sub == "assert":
            raise Fail("you gave 41")
        if sub == "raise":
            raise NotImplementedError("TODO")
        return "ok"

    assert test_x.points == 3 and test_x.checks == "the answer is 42" and test_x("fine") == "ok"
    with pytest.raises(Fail) as e:
        test_x("assert")
    assert str(e.value) == "you gave 41\n  checks: the answer is 42\n  hint: count again"
    with pytest.raises(NotImplementedError):      # the submission's own error: the grader reports where it was
        test_x("raise")
