"""Predicted beside measured: one pair of bars per quantity, the measured bar labelled with its ratio.

The lessons put the analytic core's prediction next to what real ranks measured (bytes of a
dimension's collectives, state memory, attention work per rank). This draws that table as a picture:
for each label a solid bar (predicted) and a hatched one (measured), on a linear axis in the quantity's
unit (bytes by default, through :func:`.base.unit_axis`), and above the measured bar ``measured /
predicted`` (``=`` when they are equal to the unit, as the byte counts must be). Bars carry
``gid = "predicted:<label>"`` and ``"measured:<label>"`` so that tests read their heights back.
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from .base import BYTE_UNITS, empty_bars, lighten, new_figure, set_title, unit_axis

PREDICTED_COLOR = "#4c72b0"


def draw_predicted_measured(ax: Axes, labels: Sequence[str], predicted: Sequence[float], measured: Sequence[float],
                            *, units: Sequence[tuple[str, float]] = BYTE_UNITS, quantity: str = "bytes",
                            title: str | None = None) -> dict[str, float]:
    """Grouped bars, predicted and measured, for each label; returns ``{label: measured / predicted}``."""
    if not len(labels) == len(predicted) == len(measured):
        raise ValueError(f"{len(labels)} labels, {len(predicted)} predicted and {len(measured)} measured "
                         "values; give one of each per label")
    n, w = len(labels), 0.38
    pred = empty_bars(ax, [i - w / 2 for i in range(n)], w, label="predicted", facecolor=PREDICTED_COLOR,
                      edgecolor=PREDICTED_COLOR)
    meas = empty_bars(ax, [i + w / 2 for i in range(n)], w, label="measured", facecolor=lighten(PREDICTED_COLOR, 0.6),
                      edgecolor=PREDICTED_COLOR, hatch="//")
    ratios: dict[str, float] = {}
    top = max([*predicted, *measured, 1.0])
    for i, (label, p, m, bp, bm) in enumerate(zip(labels, predicted, measured, pred, meas, strict=True)):
        bp.set_height(p)
        bm.set_height(m)
        bp.set_gid(f"predicted:{label}")
        bm.set_gid(f"measured:{label}")
        ratios[label] = m / p if p else float("inf")
        text = "=" if m == p else f"{ratios[label]:.3f}x"
        ax.text(i + w / 2, m + top * 0.01, text, ha="center", va="bottom", fontsize=8)
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_ylim(0, top * 1.2)
    ax.set_xticks(range(n), list(labels), fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    ax.legend(loc="upper left", fontsize=8, frameon=False)
    unit_axis(ax, "y", quantity, units)
    set_title(ax, title)
    return ratios


def predicted_measured_figure(labels: Sequence[str], predicted: Sequence[float], measured: Sequence[float], *,
                              units: Sequence[tuple[str, float]] = BYTE_UNITS, quantity: str = "bytes",
                              title: str | None = None, figsize: tuple[float, float] = (7.5, 3.6)) -> Figure:
    """:func:`draw_predicted_measured` on a figure of its own."""
    fig = new_figure(figsize)
    ax = fig.add_subplot()
    fig.subplots_adjust(left=0.11, right=0.98, bottom=0.2, top=0.9)
    draw_predicted_measured(ax, labels, predicted, measured, units=units, quantity=quantity, title=title)
    return fig
