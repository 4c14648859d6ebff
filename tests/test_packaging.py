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
    wanted = {"torch", "jupyterlab", "ipywidgets", "voila", "matplotlib", "ipympl", "ipykernel", "pyyaml",
              "pytest", "pytest-timeout", "hypothesis", "nbmake", "playwright", "ruff"}
    assert wanted <= set(pyproject())


def test_console_script_and_readme_commands():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert data["project"]["scripts"]["parallel-lab"] == "parallel_lab.cli:main"
    readme = (ROOT / "README.md").read_text()
    assert "make app" in readme and "make test" in readme


def test_make_test_collects_every_test_directory():
    """pytest skips directories named ``dist`` by default; the multi-process tests live in tests/dist, so
    the suite that `make test` runs must collect them (and every other tests/ subdirectory)."""
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    collected = {line.split("::")[0] for line in p.stdout.splitlines() if "::" in line}
    dirs = {str(f.parent.relative_to(ROOT)) for f in (ROOT / "tests").rglob("test_*.py")}
    assert dirs <= {str(Path(c).parent) for c in collected}, p.stdout[-2000:]
