"""Layer 3: pictures and widgets.

* :mod:`parallel_lab.viz.plots` (one module per topic): pure functions, plain data (a memory ledger, a
  communication report, a timeline, a planner result) -> a matplotlib ``Figure``. No widgets, no pyplot.
* :mod:`parallel_lab.viz.explorers` (one module per explorer): ipywidgets explorers composed from those
  plots, each usable in one line (``MemoryExplorer()``), each a widget itself.
* :mod:`parallel_lab.viz.serve`: the Voila command line behind ``make app``.

Each name is imported from its module (``from parallel_lab.viz.explorers.app import App``); this package
imports nothing, so ``python -m parallel_lab.viz.serve`` does not load matplotlib.
"""
