"""The ``$ parallel-lab ...`` examples of the README and of every ``docs/*.md`` page print what they say.

Each block fenced by a bare ``` (not ```console) that starts with ``$ parallel-lab`` is run in a scratch
directory holding a copy of ``examples/`` (some write a profile or a plan file). A block shown whole must
come out line for line; a block that is an excerpt (it leaves out lines, or marks a cut with ``...``) must
have each of its lines in the output. Lines that carry a wall-clock time (``searched in``) and the
micro-benchmark's timings are not compared: they are measurements of the host that ran them; a run's parameter
difference from its reference must be round-off on both sides.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: the pages whose examples are run: the README and every page of the site's docs/
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
#: blocks whose numbers are timings of the machine that runs them
MEASURED = ("--microbench",)
#: blocks the README shows as excerpts of a longer output (a table's top rows, a run's comparison lines)
EXCERPTS = ("parallel-lab plan ", "parallel-lab run ", "parallel-lab launch ")
#: a run's largest parameter difference from its one-process reference: round-off, compared as such
ROUND_OFF = "largest parameter difference after"


def fenced_blocks(text: str) -> list[str]:
    """The text of every block fenced by a bare ```: a fence with an info string (```console for an
    illustration the scratch directory cannot run, such as a learner's submission; ```python, ```yaml) is
    skipped whole."""
    blocks, current, skipping = [], None, False
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            if current is not None:
                blocks.append("".join(current))
                current = None
            elif skipping:
                skipping = False
            elif line.strip() == "```":
                current = []
            else:
                skipping = True
        elif current is not None:
            current.append(line)
    return blocks


def readme_examples() -> list[tuple[list[str], list[str]]]:
    """``(commands, expected lines)`` for every block of ``PAGES`` that starts with ``$ parallel-lab``;
    continuation lines (a trailing backslash) are joined."""
    out = []
    for block in [b for page in PAGES for b in fenced_blocks(page.read_text())]:
        lines = block.splitlines()
        if not lines or not lines[0].startswith("$ parallel-lab"):
            continue
        commands, expected, i = [], [], 0
        while i < len(lines):
            if lines[i].startswith("$ "):
                parts = [lines[i][2:]]
                while parts[-1].endswith("\\") and i + 1 < len(lines):
                    i += 1
                    parts[-1] = parts[-1][:-1].rstrip()
                    parts.append(lines[i].strip())
                commands.append(" ".join(parts))
            else:
                expected.append(lines[i])
            i += 1
        out.append((commands, expected))
    return out


EXAMPLES = readme_examples()


def test_the_readme_has_examples():
    assert len(EXAMPLES) >= 12


@pytest.mark.timeout(300)
@pytest.mark.parametrize("commands,expected", EXAMPLES, ids=[c[0][13:60] for c, _ in EXAMPLES])
def test_readme_example_prints_what_the_readme_shows(commands, expected, tmp_path):
    if any(m in c for c in commands for m in MEASURED):
        pytest.skip("timings of the host (the format is tested in tests/test_microbench.py)")
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    bindir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1"}
    got: list[str] = []
    for cmd in commands:
        p = subprocess.run(cmd, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
                           start_new_session=True)
        assert p.returncode == 0, f"{cmd}\n{p.stderr[-2000:]}"
        got += p.stdout.splitlines()
    # round-off between a parallel run and its one-process reference depends on the CPU's kernels: the
    # README's figure and the printed one must both be round-off (fp32: under 1e-4), not equal
    for line in [e for e in expected if e.startswith(ROUND_OFF)]:
        printed = [g for g in got if g.startswith(ROUND_OFF)]
        assert printed and all(float(x.split()[-1]) < 1e-4 for x in [line, *printed]), (line, printed)
    shown = [line for line in expected if "searched in" not in line and not line.startswith(ROUND_OFF)]
    excerpt = len(commands) > 1 or any(e in commands[0] for e in EXCERPTS) or \
        any(line.strip() == "..." or line.rstrip().endswith("...") for line in shown)
    if not excerpt:
        assert [g.rstrip() for g in got] == [s.rstrip() for s in shown], commands[0]
        return
    printed = {g.rstrip() for g in got}
    missing = [s for s in shown if s.strip() and "..." not in s and s.rstrip() not in printed]
    assert not missing, f"{commands[0]}: README lines not printed: {missing}"
