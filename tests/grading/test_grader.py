"""The grader end to end, through the command a teacher runs (``parallel-lab grade``).

Every exercise's reference solution gets full marks and every mutant loses marks with a message that says
what is wrong, with the hidden tests always and with the public tests alone for at least three in four
mutants (the mutant table, printed); hostile submissions (a hang, a deadlock, ``os._exit`` in a rank,
unbounded memory, a fixed port, an endless import) fail within their limits and the grader carries on;
grades are deterministic.
"""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUNDLE = REPO / "instructor"
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def grade(*args: str, timeout: float) -> dict:
    p = subprocess.run([sys.executable, "-m", "parallel_lab", "grade", *args, "--json"], capture_output=True,
                       text=True, cwd=REPO, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def class_of(tmp_path: Path) -> tuple[Path, dict[tuple[str, str], str]]:
    """``reference/EX.py`` and ``mutant-i/EX.py``: the layout of ``--batch``; and each ``(learner, exercise)``'s
    mutant name (``reference`` for the solution)."""
    root = tmp_path / "submissions"
    names = {}
    for ex_dir in sorted(p for p in BUNDLE.iterdir() if p.is_dir()):
        sol = next(ex_dir.glob("solution.*"))
        (root / "reference").mkdir(parents=True, exist_ok=True)
        shutil.copy(sol, root / "reference" / f"{ex_dir.name}{sol.suffix}")
        names[("reference", ex_dir.name)] = "reference"
        for i, m in enumerate(sorted((ex_dir / "mutants").iterdir()), 1):
            (root / f"mutant-{i}").mkdir(parents=True, exist_ok=True)
            shutil.copy(m, root / f"mutant-{i}" / f"{ex_dir.name}{m.suffix}")
            names[(f"mutant-{i}", ex_dir.name)] = m.stem
    return root, names


def hidden_source_lines() -> set[str]:
    return {line.strip() for f in BUNDLE.glob("*/hidden_tests.py") for line in f.read_text().splitlines()
            if len(line.strip()) > 25}


def marks(g: dict, visibility: tuple[str, ...]) -> tuple[float, int]:
    """``(points, max_points)`` of a grade's tests of the given visibilities."""
    tests = [t for t in g["tests"] if t["visibility"] in visibility]
    return sum(t["points"] for t in tests), sum(t["max_points"] for t in tests)


def mutant_table(grades: dict, names: dict) -> str:
    """One row per exercise and submission: public marks (what a learner sees alone), all marks (with the
    hidden tests). The public tests run first and alike with or without the bundle, so one graded pass gives
    both."""
    lines = [f"{'exercise':<22} {'submission':<26} {'public':>7} {'all':>7}"]
    for (learner, ex), g in sorted(grades.items(), key=lambda kv: (kv[0][1], names[kv[0]] != "reference",
                                                                     names[kv[0]])):
        pub, allm = marks(g, ("public",)), marks(g, ("public", "hidden"))
        flag = "  full public marks" if learner != "reference" and pub[0] == pub[1] else ""
        lines.append(f"{ex:<22} {names[(learner, ex)]:<26} {pub[0]:>3g}/{pub[1]:<3} {allm[0]:>3g}/{allm[1]:<3}{flag}")
    return "\n".join(lines)


@pytest.mark.distributed
@pytest.mark.timeout(1500)
def test_references_get_full_marks_and_mutants_lose_marks(tmp_path):
    subs, names = class_of(tmp_path)
    out = grade("--batch", str(subs), "--bundle", str(BUNDLE), "--out", str(tmp_path / "grades.csv"),
                timeout=1400)
    grades = {(g["learner"], g["exercise"]): g for g in out["grades"]}
    print("\n" + mutant_table(grades, names))
    exercises = {ex for _, ex in grades}
    assert len(exercises) >= 12
    mutants = [k for k in grades if k[0] != "reference"]
    full_public = [f"{ex}/{names[(lr, ex)]}" for lr, ex in mutants
                   if marks(grades[(lr, ex)], ("public",))[0] == marks(grades[(lr, ex)], ("public",))[1]]
    assert len(full_public) <= len(mutants) / 4, f"{len(full_public)} of {len(mutants)} mutants keep full public " \
                                                 f"marks: {full_public}"
    leaked = hidden_source_lines()
    for (learner, ex), g in sorted(grades.items()):
        failed = [t for t in g["tests"] if not t["passed"]]
        if learner == "reference":
            assert g["points"] == g["max_points"], f"{ex} reference: {[(t['name'], t['message']) for t in failed]}"
            assert marks(g, ("public",))[0] == marks(g, ("public",))[1], f"{ex} reference: public marks"
            continue
        assert g["points"] < g["max_points"], f"{ex} {names[(learner, ex)]} (a mutant) got full marks"
        for t in failed:
            msg = t["message"]
            assert len(msg) >= 40 and not msg.startswith(("AssertionError", "a check failed")), (ex, learner, msg)
            assert not any(line in msg for line in leaked), f"{ex} {learner}: feedback shows hidden test source"
    assert {g["visibility"] for g in grades[("reference", "ddp_buckets")]["tests"]} == {"public", "hidden"}
    rows = list(csv.DictReader(open(tmp_path / "grades.csv")))
    assert len(rows) == len(grades) and set(rows[0]) >= {"learner", "exercise", "points", "max_points", "feedback",
                                                          "written_answers"}
    written = {r["exercise"]: r["written_answers"] for r in rows if r["learner"] == "reference"}
    assert written["design_plan"].startswith("why: TP 2 with SP") and "bubble_vs_memory: 1F1B" in \
        written["predict_bubble"] and written["zigzag"] == ""


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_hostile_submissions_fail_within_their_limits(tmp_path):
    subs = tmp_path / "submissions"
    for f in (FIXTURES / "submissions").glob("*.py"):
        (subs / f.stem).mkdir(parents=True)
        shutil.copy(f, subs / f.stem / "ranks.py")
    out = grade("--batch", str(subs), "--exercises", str(FIXTURES / "exercises"), "--out", str(tmp_path / "g.csv"),
                "--time-scale", "0.35", "--memory-mb", "1536", timeout=380)
    by = {g["learner"]: {t["name"]: t for t in g["tests"]} for g in out["grades"]}
    assert all(t["passed"] for t in by["good"].values())
    expect = {
        "hang": ["did not finish within 5.6 s", "rank 1 while calling work(): at submission.py line 8",
                 "rank 0 finished"],
        "deadlock": ["rank 0 while calling work(): at submission.py line 10",
                     "waiting in torch.distributed.all_reduce"],
        "exit_rank": ["rank 1 died", "exited with code 3"],
        "unbounded": ["MemoryError at submission.py line 7"],
        "fixed_port": ["bound a fixed port", "rank "],
        "spin": ["took over 10.5 s to import"],
    }
    for learner, parts in expect.items():
        msg = by[learner]["test_two_ranks"]["message"]
        assert not by[learner]["test_two_ranks"]["passed"] and all(p in msg for p in parts), (learner, msg)
        if learner != "spin":                     # carried on: the next test of the same submission ran
            assert by[learner]["test_after_the_ranks"]["passed"], learner
    limits = {"hang": 40, "deadlock": 40, "exit_rank": 40, "unbounded": 40, "fixed_port": 40, "spin": 40}
    for g in out["grades"]:
        assert g["seconds"] < limits.get(g["learner"], 60), (g["learner"], g["seconds"])


def test_learner_loop_runs_public_tests_only():
    listed = grade("--list", timeout=60)["exercises"]
    assert len(listed) >= 12 and "ddp_buckets" in listed
    g = grade("zigzag", timeout=120)                 # the starter, as a learner first runs it
    assert g["points"] == 0 and {t["visibility"] for t in g["tests"]} == {"public"}
    assert all("NotImplementedError" in t["message"] and "submission.py line" in t["message"] for t in g["tests"])


def test_same_submission_same_grade_from_a_directory_or_an_archive(tmp_path):
    sub = BUNDLE / "zigzag" / "mutants" / "work_without_diagonal.py"
    archive = shutil.make_archive(str(tmp_path / "bundle"), "gztar", root_dir=REPO, base_dir="instructor")
    runs = [grade("zigzag", str(sub), "--bundle", b, timeout=120) for b in (str(BUNDLE), archive)]
    strip = [[(t["name"], t["points"], t["message"]) for t in r["tests"]] for r in runs]
    assert strip[0] == strip[1] and runs[0]["points"] == runs[1]["points"] < runs[0]["max_points"]
