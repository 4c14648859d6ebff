"""Predicted beside measured: one pair of bars per quantity, the lessons' picture of a real run.

A lesson predicts a number with the analytic core (``ledger``, ``comm``, ``simulate``) and then measures it
on ranks (``parallel_lab.distributed.runtime.run``). This draws the two side by side, one row per quantity (a
communication dimension, a memory category, a pipeline stage), the prediction as a hollow bar and the
measurement as a filled one, each labelled with its value and the row with the measured / predicted ratio,
so that a gap is seen before it is read. Values are plain numbers (bytes by default; any unit ladder of
:mod:`parallel_lab.quantities`, e.g. ``TIME_UNITS``, or ``units=None`` for counts).

Bars carry ``gid = "predicted:<label>"`` and ``"measured:<label>"`` so that tests read their widths back.
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ...quantities import BYTE_UNITS, fmt_number, fmt_quantity
from .. import palette
from .base import LABEL_BOX, new_figure, set_title, unit_axis

PREDICTED_EDGE = palette.PREDICTED_EDGE
MEASURED_COLOR = palette.MEASURED


def _fmt(x: float, units: Sequence[tuple[str, float]] | None) -> str:
    return fmt_quantity(x, units) if units else fmt_number(x)


def draw_predicted_measured(ax: Axes, labels: Sequence[str], predicted: Sequence[float], measured: Sequence[float],
                            *, units: Sequence[tuple[str, float]] | None = BYTE_UNITS, quantity: str = "bytes",
                            title: str | None = None) -> list[float | None]:
    """Hollow bars for ``predicted``, filled bars for ``measured``, one row per label (top to bottom).

    Returns the measured / predicted ratio per row (None where the prediction is 0).
    """
    if not len(labels) == len(predicted) == len(measured):
        raise ValueError(f"labels ({len(labels)}), predicted ({len(predicted)}) and measured ({len(measured)}) "
                         "must have one entry per row")
    n = len(labels)
    ys = list(range(n))[::-1]
    h = 0.36
    ratios: list[float | None] = []
    top = max([*predicted, *measured, 0.0]) or 1.0
    for y, lab, p, m in zip(ys, labels, predicted, measured, strict=True):
        ax.barh(y + h / 2, p, h, facecolor="white", edgecolor=PREDICTED_EDGE, linewidth=1.2, gid=f"predicted:{lab}")
        ax.barh(y - h / 2, m, h, color=MEASURED_COLOR, gid=f"measured:{lab}")
        ratio = m / p if p else None
        ratios.append(ratio)
        ax.text(p + 0.01 * top, y + h / 2, _fmt(p, units), va="center", fontsize=8, bbox=LABEL_BOX)
        note = _fmt(m, units) + ("" if ratio is None else f"  ({ratio:.3g}x)")
        ax.text(m + 0.01 * top, y - h / 2, note, va="center", fontsize=8, bbox=LABEL_BOX)
    ax.set_yticks(ys, list(labels))
    ax.set_ylim(-0.7, n - 0.3)
    ax.set_xlim(0, top * 1.35)
    if units:
        unit_axis(ax, "x", quantity, units)
    else:
        ax.set_xlabel(quantity)
    ax.legend(handles=[Patch(facecolor="white", edgecolor=PREDICTED_EDGE, label="predicted"),
                       Patch(color=MEASURED_COLOR, label="measured")], loc="upper left", bbox_to_anchor=(1.0, 1.0),
              fontsize=8, frameon=False)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    set_title(ax, title)
    return ratios


def predicted_measured_figure(labels: Sequence[str], predicted: Sequence[float], measured: Sequence[float], *,
                              units: Sequence[tuple[str, float]] | None = BYTE_UNITS, quantity: str = "bytes",
                              title: str | None = None) -> Figure:
    """:func:`draw_predicted_measured` on a figure of its own, sized to the number of rows."""
    height = 1.3 + 0.55 * len(labels)
    fig = new_figure((8.4, height))
    ax = fig.add_subplot()
    fig.subplots_adjust(left=0.24, right=0.86, bottom=0.55 / height + 0.05, top=1 - 0.45 / height)
    draw_predicted_measured(ax, labels, predicted, measured, units=units, quantity=quantity, title=title)
    return fig


def misses_figure(rows: Sequence[str], misses: dict[str, Sequence[float]], *, band: float = 0.1,
                  title: str | None = None) -> Figure:
    """Prediction / measured - 1 per row (a published run), one bar per story (``{story: [miss per row]}``),
    grouped by row; a grey band of +-``band`` around zero."""
    fig = new_figure((8.6, 3.8))
    ax = fig.subplots()
    fig.subplots_adjust(left=0.1, right=0.72, bottom=0.14, top=0.88)
    k = len(misses)
    width = 0.8 / max(k, 1)
    ax.axhspan(-100 * band, 100 * band, color=palette.IDLE, zorder=0)
    for i, (story, ys) in enumerate(misses.items()):
        xs = [r + (i - (k - 1) / 2) * width for r in range(len(rows))]
        ax.bar(xs, [100 * y for y in ys], width, color=palette.CURVE_COLORS[i % len(palette.CURVE_COLORS)],
               edgecolor=palette.INK, linewidth=0.5, label=story, gid=f"miss:{story}")
    ax.axhline(0, color=palette.INK, lw=0.8)
    ax.set_xticks(range(len(rows)), list(rows), fontsize=8)
    ax.set_ylabel("prediction / measured - 1 (%)")
    ax.legend(fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    set_title(ax, title)
    return fig
