"""docs/coverage.md cannot drift from the lessons: every section it cites exists in that lesson, every prediction it
names is asked in a lesson, and every exercise it names is in the handout. No cell may say "missing": every idea
has a lesson section, a run or computation, a picture and a checked prediction or exercise (the cells still
missing, if any, are printed before the assertion names them).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TABLE = REPO / "docs" / "coverage.md"
COLUMNS = ["Idea", "Lesson section", "Run or computation", "Picture", "Checked prediction or exercise"]
#: "lesson 04" sets the lesson; each "§3", "§4b" or '§"Try it"' after it cites one of its sections
CITATION = re.compile(r'lesson (\d\d)|§("[^"]+"|\d+[a-z]?)')
OPTIONAL_PREFIX = re.compile(r"^Going deeper \(optional\):\s*")


def rows() -> list[list[str]]:
    lines = [line.strip() for line in TABLE.read_text().splitlines() if line.strip().startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == COLUMNS, header
    assert set(lines[1].replace("|", "").split()) <= {"---", ":---", "---:"}, lines[1]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]


def lesson_path(number: str) -> Path:
    paths = list((REPO / "notebooks").glob(f"{number}_*.ipynb"))
    assert len(paths) == 1, f"lesson {number}: {paths}"
    return paths[0]


def headings(path: Path) -> list[str]:
    out = []
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "markdown":
            out += [m.group(1).strip() for m in re.finditer(r"^#{2,3}\s+(.*)$", "".join(cell["source"]), re.M)]
    return out


def cites(cell: str, lesson: str | None = None) -> list[tuple[str, str]]:
    """(lesson, section) pairs of one cell; a bare section belongs to the lesson named before it in the cell, or
    else to the first lesson of the row's "Lesson section" column (``lesson``)."""
    out = []
    for m in CITATION.finditer(cell):
        if m.group(1):
            lesson = m.group(1)
        else:
            assert lesson, f"a section with no lesson before it: {cell!r}"
            out.append((lesson, m.group(2)))
    return out


def section_exists(path: Path, section: str) -> bool:
    for h in headings(path):
        plain = OPTIONAL_PREFIX.sub("", h)
        if section.startswith('"'):
            if h.startswith(section.strip('"')) or plain.startswith(section.strip('"')):
                return True
        elif re.match(rf"{re.escape(section)}[.\s]", plain):
            return True
    return False


def test_the_table_has_its_columns_and_rows():
    table = rows()
    assert len(table) >= 30
    for row in table:
        assert len(row) == len(COLUMNS), row
        assert all(row), f"an empty cell (write 'missing'): {row}"


def test_every_cited_section_exists():
    bad = []
    for row in rows():
        first = next(iter(cites(row[1])), (None, None))[0]
        for cell in row[1:]:
            for lesson, section in cites(cell, first):
                if not section_exists(lesson_path(lesson), section):
                    bad.append(f"{row[0]}: lesson {lesson} §{section}")
    assert not bad, "sections cited in docs/coverage.md that the lessons lack:\n" + "\n".join(bad)


def test_every_named_prediction_and_exercise_exists():
    asked = set()
    for path in (REPO / "notebooks").glob("[01]*.ipynb"):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code":
                asked |= set(re.findall(r"^(my_\w+)[ \t]*=(?!=)", "".join(cell["source"]), re.M))
    exercises = {p.name for p in (REPO / "exercises").iterdir() if p.is_dir()}
    for row in rows():
        for name in re.findall(r"`(my_\w+)`", row[4]):
            assert name in asked, f"{row[0]}: no lesson asks {name}"
        for name in re.findall(r"exercises? ((?:`\w+`(?:, )?)+)", row[4]):
            for ex in re.findall(r"`(\w+)`", name):
                assert ex in exercises, f"{row[0]}: no exercise {ex} in exercises/"


def test_report_missing_cells(capsys):
    missing = [f"{row[0]} -> {COLUMNS[i]}" for row in rows() for i, cell in enumerate(row) if "missing" in cell]
    with capsys.disabled():
        print(f"\ndocs/coverage.md: {len(missing)} missing cells")
        for m in missing:
            print("  " + m)
    assert not missing, "cells of docs/coverage.md that say 'missing':\n" + "\n".join(missing)
