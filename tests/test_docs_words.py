"""Text that speaks to users says where its figures come from and what was measured on what.

In the README, every ``docs/`` page, the exercise handout, the lessons (markdown cells and the strings of code
cells), every ``parallel-lab ... --help`` and every string of ``parallel_lab/viz/`` (the app's texts): no issue
numbers, no "the seed" (name the article or paper: ``docs/sources.md``), no "this machine" (say what was
measured on what), no path outside the repository. And the app's own texts agree with the app: its tab count,
its tab names, and which lesson explains which tab.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from parallel_lab.cli import build_parser
from parallel_lab.viz.explorers.lessons import EXPLAINED_BY, LESSONS

REPO = Path(__file__).resolve().parents[1]

FORBIDDEN = {
    "an issue number": re.compile(r"\(issue \d+\)|\bissues? \d+\b", re.I),
    "the seed (name the article or paper)": re.compile(r"\bthe seed\b|\bseed(?:'s| articles?| figures?)\b"
                                                       r"|\bone seed\b", re.I),
    "this machine (say what was measured on what)": re.compile(r"\bthis\s+(?:[\w-]+\s+){0,2}machine\b", re.I),
    "a path outside the repository": re.compile(r"\.\./shared\b|\bshared/(?:reference|tools)\b", re.I),
}
#: a lesson's printed label that its check (tests/notebook_checks/04_pipeline_schedules.py) matches verbatim
KNOWN: tuple[str, ...] = ()
NUMBERS = {9: "nine", 10: "ten", 11: "eleven", 12: "twelve"}


def offences(text: str) -> list[str]:
    for known in KNOWN:
        text = text.replace(known, "")
    out = []
    for why, pattern in FORBIDDEN.items():
        for m in pattern.finditer(text):
            line = text[:m.start()].count("\n") + 1
            out.append(f"line {line}: {m[0]!r} ({why})")
    return out


def strings_of(source: str) -> str:
    """Every string literal of Python source (docstrings included), one per line; IPython magics dropped."""
    code = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())
    return "\n".join(n.value for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Constant)
                     and isinstance(n.value, str))


def pages() -> list[Path]:
    return [REPO / "README.md", REPO / "exercises" / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


@pytest.mark.parametrize("path", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_pages_speak_to_users(path):
    assert not offences(path.read_text()), f"{path.relative_to(REPO)}: {offences(path.read_text())}"


@pytest.mark.parametrize("path", sorted((REPO / "notebooks").glob("*.ipynb")), ids=lambda p: p.name)
def test_lessons_speak_to_users(path):
    cells = json.loads(path.read_text())["cells"]
    bad = []
    for i, cell in enumerate(cells):
        source = "".join(cell["source"])
        text = strings_of(source) if cell["cell_type"] == "code" else source
        bad += [f"cell {i} {o}" for o in offences(text)]
    assert not bad, f"{path.name}: {bad}"


def test_cli_help_speaks_to_users():
    parser = build_parser()
    helps = [parser.format_help()]
    for action in parser._subparsers._group_actions:          # the subcommands' own parsers
        helps += [sub.format_help() for sub in action.choices.values()]
    assert len(helps) > 10
    bad = [o for h in helps for o in offences(h)]
    assert not bad, bad


@pytest.mark.parametrize("path", sorted((REPO / "parallel_lab" / "viz").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(REPO)))
def test_app_strings_speak_to_users(path):
    assert not offences(strings_of(path.read_text())), f"{path.relative_to(REPO)}: " \
        f"{offences(strings_of(path.read_text()))}"


def app_tabs() -> dict[str, str]:
    """Tab name -> explorer class name, read from ``App.__init__``'s dict of makers."""
    tree = ast.parse((REPO / "parallel_lab" / "viz" / "explorers" / "app.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict) and node.values and all(
                isinstance(v, ast.Name) and v.id.endswith("Explorer") for v in node.values):
            return {k.value: v.id for k, v in zip(node.keys, node.values, strict=True)}
    raise AssertionError("App.__init__ has no dict of tab name -> Explorer class")


def test_the_app_texts_agree_with_the_app():
    tabs = app_tabs()
    count = NUMBERS[len(tabs)]
    app_md = (REPO / "docs" / "app.md").read_text()
    assert f"{count} tabs" in app_md, f"docs/app.md must say the app has {count} tabs"
    assert all(f"**{t}**" in app_md for t in tabs), [t for t in tabs if f"**{t}**" not in app_md]
    assert f"{count} tabs" in (REPO / "README.md").read_text()
    assert all(t in (REPO / "README.md").read_text() for t in tabs)
    assert f"the {count} explorers" in (REPO / "notebooks" / "app.ipynb").read_text()
    # the table "| tab | explained by |" of docs/app.md follows lessons.EXPLAINED_BY
    rows = dict(re.findall(r"^\| ([^|]+?) \| lesson (\d\d), [^|]+\|$", app_md, re.M))
    assert rows.keys() == tabs.keys(), sorted(set(rows) ^ set(tabs))
    for tab, cls in tabs.items():
        assert EXPLAINED_BY[cls][:2] == rows[tab], (tab, cls, EXPLAINED_BY[cls])
    assert f"all {NUMBERS[len(LESSONS)]} lessons" in app_md
