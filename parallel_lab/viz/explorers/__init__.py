"""Explorers: ipywidgets front-ends to the ledger, the communication report, the pipeline simulator and
the planner. Each is one line in a notebook (``MemoryExplorer()``) and is itself a widget (a ``VBox``);
:class:`App` puts them in tabs for the Voila app.

One module per explorer (:mod:`.memory`, :mod:`.comm`, :mod:`.pipeline`, :mod:`.grid`, :mod:`.ring`, :mod:`.zero`,
:mod:`.tp`, :mod:`.routing`, :mod:`.planner`, :mod:`.run`; the lessons they link to in :mod:`.lessons`), the shared
base class and inputs in :mod:`.base`, the tabs in :mod:`.app`; each name is imported from its module
(``from parallel_lab.viz.explorers.memory import MemoryExplorer``). How an explorer works (widgets in,
one figure out, redrawn in place on a change event) is told in :class:`.base.Explorer`.

Tests and benchmarks drive explorers programmatically: ``ex.widgets["zero"].value = 3`` (one redraw) or
``ex.set(zero=3, dp=16)`` (one redraw for several values), then read ``ex.result``, ``ex.verdict``,
``ex.error`` and the bars of ``ex.figure``.
"""
