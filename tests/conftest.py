"""Shared test helpers (kept minimal; add fixtures for your own tests below)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``python -m parallel_lab ARGS`` in a fresh interpreter (the way a user runs it)."""
    return subprocess.run([sys.executable, "-m", "parallel_lab", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout)


@pytest.fixture
def cli_json():
    """``cli_json(*args)``: run the CLI with ``--json``, assert exit 0, return the parsed object."""

    def call(*args: str) -> dict:
        p = run_cli(*args, "--json")
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)

    return call
