"""How long a lesson takes a learner: the core path, and the parts marked optional.

The estimate of a part of a lesson is its markdown read at 200 words a minute, plus 2 minutes for every
prediction (an ``my_x = ...`` answer line), plus the lesson's run time (at most 90 s of CPU: counted as 1.5
minutes, on the core path only). The optional parts are the sections under a markdown heading that starts
``Going deeper (optional)``; such a section runs until the next heading of the same or a higher level.

``python tests/lesson_time.py`` prints the table: each lesson's stated core-path time and the estimates.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LESSONS = sorted((REPO / "notebooks").glob("0*.ipynb"))
WORDS_PER_MINUTE = 200
MINUTES_PER_PREDICTION = 2.0
RUN_MINUTES = 1.5
HEADING = re.compile(r"^(#{1,6})\s+(.*)$", re.M)
OPTIONAL = re.compile(r"^Going deeper \(optional\)", re.I)
ANSWER_LINE = re.compile(r"^(my_\w+)[ \t]*=(?!=)", re.M)
#: the statement in a lesson's first cell: "Core path: about 35 minutes"; "... add(s) about 10 (minutes)"
STATED = re.compile(r"Core path: about (\d+) minutes", re.I)
STATED_OPTIONAL = re.compile(r"optional\W[^.]*?\badds? about (\d+)", re.I | re.S)


def cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def source(cell: dict) -> str:
    return "".join(cell["source"])


def optional_flags(nb_cells: list[dict]) -> list[bool]:
    """For each cell: is it inside a "Going deeper (optional)" section? A heading's level opens or closes one."""
    flags, level = [], None          # level: the heading level of the open optional section, None if none
    for c in nb_cells:
        opens_here = False
        if c["cell_type"] == "markdown":
            for hashes, title in HEADING.findall(source(c)):
                n = len(hashes)
                if OPTIONAL.match(title.strip()):
                    if level is None or n <= level:
                        level, opens_here = n, True
                elif level is not None and n <= level:
                    level = None
        flags.append(level is not None or opens_here)
    return flags


def estimate(path: Path) -> dict:
    """Minutes of the core path and of the optional parts: reading, predictions, runs."""
    nb_cells = cells(path)
    parts = {False: {"words": 0, "predictions": 0}, True: {"words": 0, "predictions": 0}}
    for c, optional in zip(nb_cells, optional_flags(nb_cells), strict=True):
        text = source(c)
        if c["cell_type"] == "markdown":
            parts[optional]["words"] += len(text.split())
        else:
            parts[optional]["predictions"] += len(ANSWER_LINE.findall(text))

    def minutes(p: dict, run: float) -> float:
        return p["words"] / WORDS_PER_MINUTE + MINUTES_PER_PREDICTION * p["predictions"] + run

    core, extra = parts[False], parts[True]
    return {"core_min": minutes(core, RUN_MINUTES), "optional_min": minutes(extra, 0.0),
            "core_words": core["words"], "core_predictions": core["predictions"],
            "optional_words": extra["words"], "optional_predictions": extra["predictions"]}


def stated(path: Path) -> tuple[int | None, int | None]:
    """The core-path minutes (and the optional parts' minutes, if said) stated in the lesson's first cell."""
    first = source(cells(path)[0])
    core, extra = STATED.search(first), STATED_OPTIONAL.search(first)
    return (int(core.group(1)) if core else None), (int(extra.group(1)) if extra else None)


def main() -> None:
    print(f"{'lesson':<36}{'stated':>7}{'core est.':>10}{'optional':>9}{'est.':>6}  (minutes)")
    for path in LESSONS:
        e, (core, extra) = estimate(path), stated(path)
        print(f"{path.stem:<36}{core!s:>7}{e['core_min']:>10.1f}{extra!s:>9}{e['optional_min']:>6.1f}"
              f"   core: {e['core_words']} words, {e['core_predictions']} predictions")


if __name__ == "__main__":
    main()
