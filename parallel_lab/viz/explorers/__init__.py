"""Explorers: ipywidgets front-ends to the ledger, the communication report, the pipeline simulator and
the planner. Each is one line in a notebook (``MemoryExplorer()``) and is itself a widget (a ``VBox``);
:class:`App` puts them in tabs for the Voila app.

One module per explorer (:mod:`.memory`, :mod:`.comm`, :mod:`.pipeline`, :mod:`.grid`, :mod:`.ring`, :mod:`.zero`,
:mod:`.tp`, :mod:`.routing`, :mod:`.planner`, :mod:`.run`; the lessons they link to in :mod:`.lessons`), the shared
base class and inputs in :mod:`.base`, the tabs in :mod:`.app`. Every public name is importable from
here. How an explorer works (widgets in, one figure out, redrawn in place on a change event) is told in
:class:`.base.Explorer`.

Tests and benchmarks drive explorers programmatically: ``ex.widgets["zero"].value = 3`` (one redraw) or
``ex.set(zero=3, dp=16)`` (one redraw for several values), then read ``ex.result``, ``ex.verdict``,
``ex.error`` and the bars of ``ex.figure``.
"""

from __future__ import annotations

from .app import App
from .base import Explorer, error_html, model_from, tier_label
from .comm import CommExplorer, collectives_table, tp_on_tier
from .grid import GridExplorer, grid_coords, grid_groups
from .lessons import EXPLAINED_BY, LESSONS, lesson_url
from .memory import MemoryExplorer
from .pipeline import PipelineExplorer
from .planner import PlannerExplorer, plans_table, rejected_table
from .ring import RingExplorer
from .routing import RoutingExplorer
from .run import RunExplorer, RunJob, run_argv, run_plan
from .tp import TPExplorer, block_splits
from .zero import ZeroExplorer

__all__ = ["App", "CommExplorer", "EXPLAINED_BY", "Explorer", "GridExplorer", "LESSONS", "MemoryExplorer",
           "PipelineExplorer", "PlannerExplorer", "RingExplorer", "RoutingExplorer", "RunExplorer", "RunJob",
           "TPExplorer",
           "ZeroExplorer", "block_splits", "collectives_table", "error_html", "grid_coords", "grid_groups",
           "lesson_url", "model_from", "plans_table", "rejected_table", "run_argv", "run_plan", "tier_label",
           "tp_on_tier"]
