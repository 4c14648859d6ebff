"""The grader against a hostile learner (issue 36): forged or garbled frames, the grader's own recorder and
judge formats used to claim "passed", tests rewritten in the submission's process, feedback that quotes the
hidden tests, processes that leave the submission's session, a subprocess on a fixed port, a flood of output;
and grade options that are refused in one line. Containment exercised: the grader as child subreaper and a
sweep of every descendant through ``/proc`` (always), and, where unprivileged namespaces work
(``NAMESPACES``), the bundle hidden under a tmpfs and a loopback-only network; the feedback filter is also
tested with namespaces turned off.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from parallel_lab.grading import contain, runner, tape

#: unprivileged user, mount and network namespaces work here (the grader then hides the bundle)
NAMESPACES = shutil.which("unshare") is not None and subprocess.run(
    ["unshare", "--user", "--mount", "--net", "true"], capture_output=True).returncode == 0

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def run_grade(*args: str, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "parallel_lab", "grade", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout, env=env)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_hostile_submissions_fail_and_leave_nothing_running(tmp_path):
    subs = tmp_path / "submissions"
    for f in [*(FIXTURES / "hostile").glob("*.py"), FIXTURES / "submissions" / "good.py"]:
        (subs / f.stem).mkdir(parents=True)
        shutil.copy(f, subs / f.stem / "ranks.py")
    pids_file = tmp_path / "pids.txt"
    out_csv = tmp_path / "grades.csv"
    p = run_grade("--batch", str(subs), "--exercises", str(FIXTURES / "exercises"), "--bundle",
                  str(FIXTURES / "bundle"), "--out", str(out_csv), "--time-scale", "0.35", "--memory-mb", "1536",
                  "--json", timeout=560, env={**os.environ, "PL_HOSTILE_PIDS": str(pids_file)})
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)                       # one JSON object: no submission's output mixed in
    by = {g["learner"]: {t["name"]: t for t in g["tests"]} for g in out["grades"]}
    assert all(t["passed"] for t in by["good"].values())
    hidden_gone = NAMESPACES and runner.ISOLATE     # the bundle under an empty tmpfs: nothing to read
    garbled, short = "forged or garbled", "recorded less than the test asks"
    expect = {"forge": (garbled, 3), "bad_line": (garbled, 3), "fd_forge": (garbled, 3), "garbage": (garbled, 3),
              "reporter": (short, 3), "monkeypatch": ("returned", 2),     # the tests do not run in its process
              "echo_hidden": ("no hidden test found" if hidden_gone else "withheld", 1),
              "setsid_children": ("left its process group", 1), "subprocess_bind": ("started a program", 3),
              "stdout_flood": ("printed over 1 MB", 3)}
    hidden = contain.secret_lines([(FIXTURES / "bundle" / "ranks" / "hidden_tests.py").read_text()])
    if hidden_gone:                                    # the ranks saw loopback only
        assert all(t["passed"] for t in by["net_probe"].values()), by["net_probe"]
    for learner, (reason, n_failed) in expect.items():
        failed = [t for t in by[learner].values() if not t["passed"]]
        assert len(failed) == n_failed and all(reason in t["message"] for t in failed), (learner, failed)
        assert all(len(t["message"]) <= contain.MAX_MESSAGE for t in by[learner].values())
        assert not any(line in t["message"] for t in by[learner].values() for line in hidden), learner
    rows = list(csv.DictReader(open(out_csv)))
    assert {r["learner"] for r in rows} == set(by) and len(rows) == len(by)
    left = [pid for pid in map(int, pids_file.read_text().split()) if _alive(pid)]
    assert len(pids_file.read_text().split()) == 200 and left == [], f"{len(left)} setsid children still run"
    assert "x" * 1000 not in p.stdout + p.stderr


def test_feedback_quoting_hidden_source_is_withheld_without_namespaces(tmp_path):
    """The file readable (no namespaces): the echo of its text is withheld from the feedback."""
    fx = FIXTURES / "hostile" / "echo_hidden.py"
    p = run_grade("ranks", str(fx), "--exercises", str(FIXTURES / "exercises"), "--bundle", str(FIXTURES / "bundle"),
                  "--time-scale", "0.35", "--memory-mb", "1536", "--json", timeout=300,
                  env={**os.environ, "PARALLEL_LAB_GRADE_NAMESPACES": "0"})
    assert p.returncode == 0, p.stderr[-2000:]
    (t,) = [t for t in json.loads(p.stdout)["tests"] if t["name"] == "test_hidden_value"]
    assert not t["passed"] and "withheld" in t["message"], t


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("args", [
    ("zigzag", "--time-scale", "-1"), ("zigzag", "--time-scale", "nan"), ("zigzag", "--memory-mb", "-5"),
    ("zigzag", "--cpu-s", "0"), ("x" * 300,), ("zigzag", "y" * 300), ("zigzag", "--bundle", "README.md"),
    ("--batch", "/nonexistent", "--out", "/tmp/never.csv"), ("--list", "--exercises", "/dev/null"),
])
def test_bad_options_are_one_line_refusals(args):
    p = run_grade(*args, timeout=120)
    assert p.returncode == 2, (args, p.returncode, p.stderr[-500:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and len(lines[0]) < 300, (args, p.stderr)


def test_frames_and_values_round_trip_and_garbage_is_refused():
    import torch

    from parallel_lab.schedules.actions import B, F

    value = {"x": torch.arange(6.0).reshape(2, 3), ("a", 1): [F(0), B(1)], "n": float("nan"), "s": {1, 2},
             "b": b"\x00\x01", "z": torch.Size([2, 3]), "e": torch.empty(0, dtype=torch.int64)}
    enc = tape.Encoder({}, None)
    tree = enc.enc(value)
    (head, payload), = tape.FrameReader().feed(tape.frame({"k": "ev", "r": tree}, enc.blobs))
    back = tape.Decoder(tape.split_blobs(head, payload), lambda k: None, lambda h: None).dec(head["r"])
    assert torch.equal(back["x"], value["x"]) and back[("a", 1)] == [F(0), B(1)] and back["n"] != back["n"]
    assert (back["s"], back["b"], back["z"], back["e"].shape) == ({1, 2}, b"\x00\x01", torch.Size([2, 3]), (0,))
    for bad in (b"this line is not JSON\n", b"PLT1" + b"\xff" * 8, tape.frame({"k": "ev"})[:12] + b"{not json}"):
        with pytest.raises(tape.Malformed):
            tape.FrameReader().feed(bad + b"x" * 64)
    for tree in ({"O": "os:system", "f": {}}, {"O": "parallel_lab.__main__:main", "f": {}},
                  {"X": 0, "d": "float32", "s": [4]}, {"Q": "x"}, [1, 2]):
        with pytest.raises(tape.Malformed):                        # no class outside the library, no short tensor
            tape.Decoder([b"\x00" * 4], lambda k: None, lambda h: None).dec(tree)


def test_the_judge_answers_from_the_tape_and_refuses_a_tape_that_differs():
    """A replayed test sees what the run recorded; a tape with a missing, extra or different event fails it."""
    frames = []
    rec = tape.Recorder(lambda data: frames.extend(tape.FrameReader().feed(data)), type("M", (), {"f": len})())
    rec.begin("t")
    assert rec.root.f([1, 2, 3]) == 3
    rep = tape.Replayer()
    rep.begin_tape("t", list(frames), "")
    assert rep.root.f([1, 2, 3]) == 3
    rep.finish()
    for tape_, call in ((frames[:1], lambda s: s.f([1, 2, 3])), (frames, lambda s: s.f([1, 2])),
                        (frames * 2, lambda s: (s.f([1, 2, 3]), object.__getattribute__(s, "_pl")[0].finish()))):
        rep = tape.Replayer()
        rep.begin_tape("t", list(tape_), "")
        with pytest.raises(tape.TapeError):
            call(rep.root)


def test_feedback_is_bounded_and_never_quotes_hidden_source():
    secret = contain.secret_lines(["def test_x(sub):\n    got = sub.value() if hasattr(sub, 'value') else 42\n"])
    assert "withheld" in contain.clean_message("boom: got = sub.value() if hasattr(sub, 'value') else 42", secret)
    assert len(contain.clean_message("y" * 10_000, secret)) == contain.MAX_MESSAGE
    assert contain.clean_message("value() returned 3", secret) == "value() returned 3"


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_submission_that_cannot_be_graded_is_a_row_of_the_csv(tmp_path):
    """``ranks_copy`` has no hidden tests in the bundle: its row says why, the class is graded and written."""
    exercises = tmp_path / "exercises"
    for name in ("ranks", "ranks_copy"):
        shutil.copytree(FIXTURES / "exercises" / "ranks", exercises / name)
    learner = tmp_path / "submissions" / "ada"
    learner.mkdir(parents=True)
    for name in ("ranks", "ranks_copy"):
        shutil.copy(FIXTURES / "submissions" / "good.py", learner / f"{name}.py")
    out_csv = tmp_path / "grades.csv"
    p = run_grade("--batch", str(tmp_path / "submissions"), "--exercises", str(exercises), "--bundle",
                  str(FIXTURES / "bundle"), "--out", str(out_csv), "--time-scale", "0.35", "--memory-mb", "1536",
                  timeout=280)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = {r["exercise"]: r for r in csv.DictReader(open(out_csv))}
    assert rows["ranks"]["points"] == "3" and rows["ranks_copy"]["points"] == "0"
    assert rows["ranks_copy"]["failed_tests"] == "grading" and "has no ranks_copy/hidden_tests.py" in \
        rows["ranks_copy"]["feedback"]
