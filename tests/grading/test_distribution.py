"""The student distribution (what ``pip install`` builds: the wheel and the sdist) holds no hidden test,
no reference solution and no mutant; the instructor bundle lives outside the package."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUNDLE = REPO / "instructor"


def _hidden_markers() -> list[str]:
    """Lines only the bundle has: the code of the hidden tests, solutions and mutants (test names are not
    secret, the feedback shows them; lines shared with the package or the public exercises are skipped)."""
    public = {line.strip() for root in (REPO / "parallel_lab", REPO / "exercises") for f in root.rglob("*.py")
              for line in f.read_text().splitlines()}
    out = []
    files = [*BUNDLE.glob("*/hidden_tests.py"), *BUNDLE.glob("*/solution.*"), *BUNDLE.glob("*/mutants/*")]
    for f in files:
        for line in f.read_text().splitlines():
            t = line.strip()
            if len(t) > 30 and t not in public and not t.startswith(("def test_", "from ", "import ", "#", '"""')):
                out.append(t)
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The wheel and the sdist, built from a copy of the tree (the copy includes ``instructor/``), offline with
    the environment's setuptools (``python -m build`` may be missing; pip and setuptools' PEP 517 hooks are not)."""
    pytest.importorskip("setuptools")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "parallel_lab", "exercises", "instructor"):
        p = REPO / name
        (shutil.copytree if p.is_dir() else shutil.copy)(p, src / name)
    out = tmp_path_factory.mktemp("dist")
    wheel = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert wheel.returncode == 0, wheel.stderr[-2000:]
    sdist = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
                            f"print(b.build_sdist({str(out)!r}))"], cwd=src, capture_output=True, text=True,
                           timeout=300)
    assert sdist.returncode == 0, sdist.stderr[-2000:]
    return next(out.glob("*.whl")), next(out.glob("*.tar.gz"))


def _members(path: Path) -> dict[str, bytes]:
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as z:
            return {n: z.read(n) for n in z.namelist()}
    with tarfile.open(path) as t:
        return {m.name: t.extractfile(m).read() for m in t.getmembers() if m.isfile()}


def test_bundle_has_what_the_grader_needs():
    exercises = sorted(p.name for p in (REPO / "exercises").iterdir() if (p / "public_tests.py").exists())
    assert len(exercises) >= 12
    for ex in exercises:
        assert (BUNDLE / ex / "hidden_tests.py").exists() and list((BUNDLE / ex).glob("solution.*")), ex
        assert list((BUNDLE / ex / "mutants").iterdir()), f"{ex} has no mutant"


@pytest.mark.timeout(600)
def test_wheel_and_sdist_hold_no_hidden_test(built):
    markers = _hidden_markers()
    assert len(markers) > 200
    for dist in built:
        members = _members(dist)
        assert any(n.endswith("parallel_lab/grading/runner.py") for n in members), f"{dist.name}: grader missing"
        bad = [n for n in members if "instructor" in n or "hidden_tests" in n or "/mutants/" in n
               or n.endswith(("solution.py", "solution.yaml"))]
        assert not bad, f"{dist.name} ships instructor files: {bad[:5]}"
        lines = {line.strip() for body in members.values()
                 for line in body.decode("utf-8", "replace").splitlines()}
        leaked = [m for m in markers if m in lines]
        assert not leaked, f"{dist.name} contains text of the instructor bundle: {leaked[:5]}"
