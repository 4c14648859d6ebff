"""pyproject.toml and environment.yml list the same packages with the same version ranges."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
CONDA_TO_PIP = {"pytorch": "torch"}


def split(req: str) -> tuple[str, str]:
    """``"torch>=2.4,<3"`` -> ``("torch", ">=2.4,<3")`` (name normalised as pip does)."""
    m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*(.*?)\s*", req)
    assert m, req
    name = re.sub(r"[-_.]+", "-", m.group(1)).lower()
    return CONDA_TO_PIP.get(name, name), m.group(2).replace(" ", "")


def pyproject() -> dict[str, str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = data["dependencies"] + data["optional-dependencies"]["dev"]
    return dict(split(r) for r in reqs)


def conda() -> tuple[dict[str, str], dict[str, str]]:
    deps = yaml.safe_load((ROOT / "environment.yml").read_text())["dependencies"]
    top = dict(split(d) for d in deps if isinstance(d, str))
    pip = next((d["pip"] for d in deps if isinstance(d, dict) and "pip" in d), [])
    for name in ("python", "pip"):
        top.pop(name, None)
    return top, dict(split(r) for r in pip)


def test_same_packages_and_ranges():
    top, pip = conda()
    assert not set(top) & set(pip), "a package is listed twice in environment.yml"
    assert {**top, **pip} == pyproject()


def test_playwright_in_pip_section_and_torch_as_pytorch():
    top, pip = conda()
    assert "playwright" in pip and "playwright" not in top
    raw = (ROOT / "environment.yml").read_text()
    assert re.search(r"^\s*-\s*pytorch\b", raw, re.M), "conda-forge calls torch 'pytorch'"


def test_issue_dependencies_are_declared():
    wanted = {"torch", "jupyterlab", "ipywidgets", "voila", "matplotlib", "ipykernel", "pyyaml",
              "pytest", "pytest-timeout", "hypothesis", "nbmake", "playwright", "ruff"}
    assert wanted <= set(pyproject())


def test_console_script_and_readme_commands():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert data["project"]["scripts"]["parallel-lab"] == "parallel_lab.cli:main"
    readme = (ROOT / "README.md").read_text()
    assert "make app" in readme and "make test" in readme


def test_ruff_lints_every_python_file():
    """ruff's default exclude list holds names such as ``dist`` and ``build``: `make test` runs ``ruff check .``,
    and every tracked Python file and notebook must be among the files it really reads."""
    tracked = subprocess.run(["git", "ls-files", "*.py", "*.ipynb"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    ruff = Path(sys.executable).with_name("ruff")
    shown = subprocess.run([str(ruff), "check", "--show-files", "."], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
    assert shown.returncode == 0, shown.stderr
    linted = {str(Path(line.strip()).resolve().relative_to(ROOT)) for line in shown.stdout.splitlines()
              if line.strip().endswith((".py", ".ipynb"))}
    missing = set(tracked.stdout.split()) - linted
    assert not missing, f"ruff never reads {sorted(missing)}"
