"""What of the hidden tests a submission's process can reach (issue 36, item 2): a thief submission looks for
the fixture bundle's hidden test in its process's modules, objects, frames, code objects, open files and raw
memory, on disk (the grader's command line names the bundle), and in the memory of the grader's other
processes, and returns the list of places that had it, which the hidden test's feedback then shows (the way
it would exfiltrate them into the feedback and the CSV). The submission's process is forked from a zygote that
never held a hidden test, and only a driver process runs the tests' code: nothing in its own process; with
namespaces (where Linux allows them) nothing on disk nor in another process either. Without namespaces the
bundle's files stay readable to the grader's user (and, for root, every process's memory): docs/grading.md.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

#: unprivileged user, mount and network namespaces work here (the grader then hides the bundle)
NAMESPACES = shutil.which("unshare") is not None and subprocess.run(
    ["unshare", "--user", "--mount", "--net", "true"], capture_output=True).returncode == 0
REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def stolen(namespaces: bool) -> str:
    p = subprocess.run([sys.executable, "-m", "parallel_lab", "grade", "ranks", str(FIXTURES / "thieves" / "ranks.py"),
                        "--exercises", str(FIXTURES / "exercises"), "--bundle", str(FIXTURES / "bundle"),
                        "--time-scale", "0.5", "--memory-mb", "1536", "--json"], capture_output=True, text=True,
                       cwd=REPO, timeout=300, env={**os.environ, "PARALLEL_LAB_GRADE_NAMESPACES": str(int(namespaces))})
    assert p.returncode == 0, p.stderr[-2000:]
    (t,) = [t for t in json.loads(p.stdout)["tests"] if t["name"] == "test_hidden_value"]
    assert not t["passed"] and "LEAKS[" in t["message"], t
    return t["message"].split("LEAKS[", 1)[1].split("]", 1)[0]


@pytest.mark.skipif(not NAMESPACES, reason="unprivileged user, mount and network namespaces are unavailable")
def test_hidden_tests_are_out_of_the_submissions_reach():
    assert stolen(True) == ""


def test_hidden_tests_are_not_in_the_submissions_process_without_namespaces():
    """Without namespaces the files on disk stay readable (and, to root, other processes' memory); the process
    itself holds nothing of them: no module, function, frame, code object, open file or byte of memory."""
    leaks = {x for x in stolen(False).split(",") if x}
    assert leaks <= {"disk", "another process's memory"}, leaks
