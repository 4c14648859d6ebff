"""docs/code_map.md tells the truth: each parallelism reads in at most two files of about 400 lines, the line
counts it prints are today's, and every module of parallel_lab is on the map."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "parallel_lab"
MAP = (ROOT / "docs" / "code_map.md").read_text()
READ = MAP.split("## Read one parallelism", 1)[1].split("\n## ", 1)[0]
ROWS = [line for line in READ.splitlines() if line.startswith("| ") and not line.startswith(("| parallelism", "|---"))]


def test_the_reading_table_covers_the_parallelisms_the_course_teaches():
    names = " ".join(r.split("|")[1] for r in ROWS)
    for want in ("DDP", "ZeRO-1/2", "ZeRO-3", "TP with SP", "1F1B", "ring attention", "EP dispatch"):
        assert want in names, want


def test_each_parallelism_reads_in_two_files_of_about_400_lines_as_printed():
    for row in ROWS:
        cells = [c.strip() for c in row.strip("|").split("|")]
        files = re.findall(r"`([^`]+\.py)` \((\d+)\)", cells[1])
        assert 1 <= len(files) <= 2, row
        counts = [len((PKG / f).read_text().splitlines()) for f, _ in files]
        assert [int(n) for _, n in files] == counts, f"{cells[0]}: the map says {files}, the files have {counts}"
        assert int(cells[2]) == sum(counts) <= 450, f"{cells[0]}: {sum(counts)} lines"


def test_every_module_is_on_the_map():
    listed = set(re.findall(r"`([\w/]+\.py)`", MAP))
    missing = [str(p.relative_to(PKG)) for p in sorted(PKG.rglob("*.py")) if str(p.relative_to(PKG)) not in listed]
    assert not missing, f"add these to docs/code_map.md: {missing}"
