"""Pictures of the lab's numbers: pure functions from plain data to a matplotlib ``Figure``.

Every function takes data (a memory ledger, a communication report, a timeline, a planner result), as the
library's objects or as the dictionaries ``parallel-lab ... --json`` prints, and returns a
:class:`matplotlib.figure.Figure` (``*_figure``) or draws into a given ``Axes`` (``draw_*``). Nothing here
touches widgets or pyplot's global state, so the same pictures serve notebooks, the Voila app and the
tests (which read the bars' heights back).

One module per topic: :mod:`.base` (colours, units, round axis ends, charts that update in place),
:mod:`.memory`, :mod:`.comm`, :mod:`.timeline`, :mod:`.planner`. Every public name is importable from
here (``from parallel_lab.viz import plots as P; P.memory_figure(...)``).

Units: GB means 10**9 bytes (``docs/conventions.md``); every label picks the unit that suits its value
(:func:`fmt_bytes`, :func:`fmt_seconds`).
"""

from __future__ import annotations

from ...quantities import BYTE_UNITS, TIME_UNITS, fmt_bytes, fmt_number, fmt_quantity, fmt_seconds, unit_for
from .base import (
    CATEGORIES,
    CATEGORY_COLORS,
    CATEGORY_LABELS,
    CHART_ATTR,
    COLLECTIVE_COLORS,
    DIM_COLORS,
    DPI,
    FIGSIZE,
    GB,
    KIND_COLORS,
    KIND_LABELS,
    LABEL_BOX,
    NICE_STEPS,
    TIER_COLORS,
    Chart,
    UnitFormatter,
    chart_on,
    draw_message,
    dynamic_title,
    field,
    log_bounds,
    new_figure,
    nice_ceil,
    reset_axes,
    sticky_ceil,
    to_png,
    unit_axis,
)
from .comm import comm_axes, comm_figure, draw_comm_bytes, draw_comm_time
from .memory import (
    HBM_OFF_SCALE,
    category_legend,
    draw_activation_terms,
    draw_memory,
    draw_memory_sweep,
    memory_axes,
    memory_figure,
    memory_sweep_figure,
    per_gpu_bytes,
)
from .planner import draw_plans, plan_label
from .timeline import (
    draw_timeline,
    kind_key,
    n_boxes,
    pipeline_timelines_figure,
    timeline_figure,
    timeline_figures,
    timeline_rows,
    timelines_figure,
)

__all__ = [
    "BYTE_UNITS", "TIME_UNITS", "UnitFormatter", "fmt_number", "fmt_quantity", "unit_axis", "unit_for",
    "HBM_OFF_SCALE", "CATEGORIES", "CATEGORY_COLORS", "CATEGORY_LABELS", "CHART_ATTR", "COLLECTIVE_COLORS",
    "DIM_COLORS", "DPI",
    "FIGSIZE", "GB", "KIND_COLORS", "KIND_LABELS", "LABEL_BOX", "NICE_STEPS", "TIER_COLORS", "Chart",
    "category_legend", "chart_on", "comm_axes", "comm_figure", "draw_activation_terms", "draw_comm_bytes",
    "draw_comm_time", "draw_memory", "draw_memory_sweep", "draw_message", "draw_plans", "draw_timeline",
    "dynamic_title", "field", "fmt_bytes", "fmt_seconds", "kind_key", "log_bounds", "memory_axes",
    "memory_figure", "memory_sweep_figure", "n_boxes", "new_figure", "nice_ceil", "per_gpu_bytes",
    "pipeline_timelines_figure", "plan_label", "reset_axes", "sticky_ceil", "timeline_figure",
    "timeline_figures", "timeline_rows", "timelines_figure", "to_png",
]
