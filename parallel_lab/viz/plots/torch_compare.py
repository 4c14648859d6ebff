"""The lab's prediction beside two measurements, the lab's engine and torch's, one row per collective kind.

Lesson 10 runs each parallelism twice on the same ranks (the lab's code, then torch's own engine) and
measures both with one ruler. Each row is one engine's collective kind (``"FSDP all_gather"``): bytes one
rank sends as payload per step, predicted (hollow), the lab's run (filled) and torch's run (hatched), each
labelled with its number of calls. Bars carry ``gid = "<series>:<label>"`` (series ``predicted``, ``lab``,
``torch``) so that tests read their widths back.
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ...quantities import BYTE_UNITS, fmt_quantity
from ..palette import CURVE_COLORS, MEASURED, PREDICTED_EDGE
from .base import LABEL_BOX, new_figure, set_title, unit_axis

SERIES = (("predicted", {"facecolor": "white", "edgecolor": PREDICTED_EDGE, "linewidth": 1.2}),
          ("lab", {"color": MEASURED}),
          ("torch", {"facecolor": CURVE_COLORS[1], "hatch": "//", "edgecolor": "white"}))


def plot_lab_vs_torch(labels: Sequence[str], bytes_: Sequence[Sequence[float]], calls: Sequence[Sequence[int]],
                      title: str | None = None) -> Figure:
    """``bytes_[i]`` and ``calls[i]``: (predicted, lab, torch) of row ``labels[i]``, top to bottom."""
    if not len(labels) == len(bytes_) == len(calls):
        raise ValueError("labels, bytes_ and calls need one entry per row")
    fig = new_figure((8.0, 0.75 + 0.62 * len(labels)))
    ax = fig.add_subplot(1, 1, 1)
    h, top = 0.26, max([v for row in bytes_ for v in row] + [1.0])
    for y, (lab, row, n) in enumerate(zip(labels, bytes_, calls, strict=True)):
        y = len(labels) - 1 - y
        for j, ((series, style), v, c) in enumerate(zip(SERIES, row, n, strict=True)):
            yy = y + (1 - j) * h
            ax.barh(yy, v, h, gid=f"{series}:{lab}", **style)
            ax.text(v + 0.01 * top, yy, f"{fmt_quantity(v, BYTE_UNITS)}, {c} calls", va="center", fontsize=8,
                    bbox=LABEL_BOX)
    ax.set_yticks(range(len(labels)), list(labels)[::-1])
    ax.set_ylim(-0.6, len(labels) - 0.4)
    ax.set_xlim(0, top * 1.45)
    unit_axis(ax, "x", "payload bytes per rank per step", BYTE_UNITS)
    ax.legend(handles=[Patch(label=f"{s}: " + {"predicted": "the lab's comm.py", "lab": "the lab's engine, measured",
                                              "torch": "torch's engine, measured"}[s], **st) for s, st in SERIES],
              loc="lower right", fontsize=8)
    set_title(ax, title)
    fig.tight_layout()
    return fig
