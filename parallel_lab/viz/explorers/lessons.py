"""The lessons behind the explorers, and the links from the app and from each explorer to them.

The lessons are notebooks in ``notebooks/`` (file names fixed: ``LESSONS``), meant to be worked through
in JupyterLab: they ask for predictions in answer cells, which a Voila page cannot edit. So the app, which
Voila serves alone (``viz/serve.py`` gives it one notebook; Voila's directory mode would render the lessons
read-only, code hidden, their real runs started on every page view), links each lesson to the JupyterLab
of ``make lab``: ``http://127.0.0.1:LAB_PORT/lab/tree/<lesson>.ipynb`` (the same browser logs in once with
the token ``make lab`` prints). Nothing links outside 127.0.0.1.

``EXPLAINED_BY`` names, for each explorer class, the lesson that explains its picture; the explorer shows
the link under its chart.
"""

from __future__ import annotations

import html

from ..palette import LINK

LAB_PORT = 8888          #: the port of ``make lab`` (Makefile LAB_PORT)

#: lesson file stem -> title, in order
LESSONS: dict[str, str] = {
    "00_collectives": "The collectives",
    "01_memory_ledger": "The memory ledger",
    "02_data_parallel_and_zero": "Data parallelism and ZeRO",
    "03_tensor_and_sequence_parallel": "Tensor and sequence parallelism",
    "04_pipeline_schedules": "Pipeline schedules",
    "05_context_parallel": "Context parallelism",
    "06_composing_4d": "Composing the four dimensions",
    "07_llama3_405b": "Planning Llama 3 405B",
    "08_failures_and_diagnosis": "Failures and diagnosis",
    "09_expert_parallel": "Expert parallelism",
}

#: explorer class name -> the lesson that explains it
EXPLAINED_BY: dict[str, str] = {
    "MemoryExplorer": "01_memory_ledger",
    "CommExplorer": "03_tensor_and_sequence_parallel",     # its default is TP 8 (and lesson 03 embeds it)
    "ZeroExplorer": "02_data_parallel_and_zero",
    "TPExplorer": "03_tensor_and_sequence_parallel",
    "PipelineExplorer": "04_pipeline_schedules",
    "RingExplorer": "05_context_parallel",
    "GridExplorer": "06_composing_4d",
    "PlannerExplorer": "07_llama3_405b",
    "RunExplorer": "08_failures_and_diagnosis",
    "RoutingExplorer": "09_expert_parallel",
}


def lesson_url(stem: str, lab_port: int = LAB_PORT) -> str:
    """The lesson's page in the JupyterLab of ``make lab``; an unknown stem raises ``KeyError`` naming them."""
    if stem not in LESSONS:
        raise KeyError(f"lesson {stem!r} is not one of {', '.join(LESSONS)}")
    return f"http://127.0.0.1:{lab_port}/lab/tree/{stem}.ipynb"


def lesson_link(stem: str) -> str:
    """``<a class="pl-lesson" ...>Lesson 01: The memory ledger</a>`` (opens in a new tab)."""
    return (f'<a class="pl-lesson" data-lesson="{stem}" href="{html.escape(lesson_url(stem))}" target="_blank" '
            f'rel="noopener" style="color:{LINK};text-decoration:underline">'
            f'Lesson {stem[:2]}: {html.escape(LESSONS[stem])}</a>')


def lessons_html() -> str:
    """Every lesson as a link, one line, with how to open them (``make lab``)."""
    links = " &middot; ".join(lesson_link(s) for s in LESSONS)
    return (f"<details class='pl-lessons' style='font-size:12px;margin:0 0 6px'><summary>Lessons (open in "
            f"JupyterLab: run <code>make lab</code>, it serves them on port {LAB_PORT})</summary>"
            f"<div style='margin:4px 0'>{links}</div></details>")
