"""Layer 3: pictures and widgets.

* :mod:`parallel_lab.viz.plots` (one module per topic): pure functions, plain data (a memory ledger, a
  communication report, a timeline, a planner result) -> a matplotlib ``Figure``. No widgets, no pyplot.
* :mod:`parallel_lab.viz.explorers` (one module per explorer): ipywidgets explorers composed from those
  plots, each usable in one line (``MemoryExplorer()``), each a widget itself.
* :mod:`parallel_lab.viz.serve`: the Voila command line behind ``make app``.

Names are imported lazily, so ``python -m parallel_lab.viz.serve`` does not load matplotlib.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPLORERS = ("MemoryExplorer", "CommExplorer", "PipelineExplorer", "PlannerExplorer", "App")

__all__ = list(_EXPLORERS)


def __getattr__(name: str) -> Any:
    if name in _EXPLORERS:
        return getattr(importlib.import_module("parallel_lab.viz.explorers"), name)
    if name in ("plots", "explorers", "serve"):
        return importlib.import_module(f"parallel_lab.viz.{name}")
    raise AttributeError(f"module 'parallel_lab.viz' has no attribute {name!r}")
