"""What each lesson must print: one module per notebook, ``<notebook stem>.py`` with ``check(text, nb)``.

``tests/test_lesson_answers.py`` (the lessons ``0*``) and ``tests/test_notebooks.py`` (the other notebooks)
execute every notebook once as committed and then call the ``check`` of its module (when one exists) with the
text of all outputs and the executed notebook. Keep the figures here the ones the
lesson computes with the library and measures on ranks, so a drifted lesson fails.

Each module of a lesson also holds its answer key, ``ANSWERS``, ``WRONG`` and ``HINTS`` (literal dicts keyed by
the ``my_*`` answer variables), which ``tests/test_lesson_answers.py`` runs the lesson with.
"""

from __future__ import annotations

import re


def number(pattern: str, text: str) -> float:
    """The number in group 1 of the first match of ``pattern`` in ``text`` (thousands commas dropped); the
    pattern must match."""
    m = re.search(pattern, text)
    assert m, pattern
    return float(m.group(1).replace(",", ""))


def _plain(cell) -> str:
    """One text form per output, as tests/test_notebooks.py joins them: stream text, else text/plain."""
    return "\n".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", "")) for o in cell.get("outputs", []))


def assert_no_answer_everywhere(text: str, nb) -> None:
    """Every ``check(...)`` ran with its placeholder and said "no answer yet" (a mapping answer says it once per
    term), never a silent pass; and the text holds exactly as many as the cells show, none counted twice."""
    total = 0
    for c in nb.cells:
        calls = c.source.count("check(") if c.cell_type == "code" else 0
        if calls:
            shown = _plain(c).count("no answer yet")
            assert shown >= calls, f"{shown} 'no answer yet' for {calls} check(...) in cell: {c.source[:120]!r}"
            total += shown
    assert total > 0, "the lesson has no check(...) cell"
    assert text.count("no answer yet") == total, (text.count("no answer yet"), total)


def markdown_of(nb) -> str:
    """The text/markdown of every output (the "What to remember" cells and other ``Markdown(...)`` results):
    the text the test passes holds one form per output, text/plain, which for a Markdown object is its repr."""
    return "\n".join(str(o.get("data", {}).get("text/markdown", "")) for c in nb.cells for o in c.get("outputs", []))


def figures(nb) -> int:
    """How many image/png outputs the executed notebook holds (a removed static figure lowers it)."""
    return sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
