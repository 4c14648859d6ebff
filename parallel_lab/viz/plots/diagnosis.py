"""Pictures of a diagnosis: loss curves overlaid (``parallel-lab compare``) and each rank's compute and wait.

:func:`loss_curves_figure` draws one line per run on the same axes: plans that train the same data must
lie on top of each other, and the first step where one leaves the others is where a plan-dependent
normalisation shows. :func:`rank_times_figure` draws, per rank, its compute and its wait (blocked on peers)
as stacked bars, from ``distributed.runtime.diagnosis.step_time_report`` (or ``run --json``'s ``step_times``): a
straggler has the longest compute bar and the shortest wait, its peers the reverse. Both take plain data
and return a matplotlib ``Figure`` (see :mod:`parallel_lab.viz.plots`). :func:`step_parts_figure` stacks
one step's time per plan: compute, then each dimension's exposed communication (a TP group across nodes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from ..palette import CATEGORY_COLORS, CURVE_COLORS, DIM_COLORS, INK, STEP_COLORS
from .base import new_figure, set_title

#: Line styles for the curves, in order: solid, dashed, dotted (so that overlapping curves stay visible).
_STYLES = ({"ls": "-", "lw": 3.0, "alpha": 0.45}, {"ls": "--", "lw": 1.8, "marker": "o"},
           {"ls": ":", "lw": 1.8, "marker": "s"}, {"ls": "-.", "lw": 1.5, "marker": "^"})


def draw_loss_curves(ax: Axes, curves: Mapping[str, Sequence[float]], *, title: str | None = None) -> None:
    """One line per ``{label: losses per step}``, steps from 0."""
    for i, (label, losses) in enumerate(curves.items()):
        ax.plot(range(len(losses)), list(losses), label=label, **_STYLES[i % len(_STYLES)])
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    n = max((len(v) for v in curves.values()), default=0)
    ax.set_xticks(range(n))
    ax.legend(loc="best", fontsize=8)
    set_title(ax, title)


def loss_curves_figure(curves: Mapping[str, Sequence[float]], *, title: str | None = None) -> Figure:
    fig = new_figure((6.4, 3.6))
    draw_loss_curves(fig.add_subplot(), curves, title=title)
    fig.tight_layout()
    return fig


def draw_rank_times(ax: Axes, report: Mapping[str, Any], *, title: str | None = None) -> dict[int, tuple[float, float]]:
    """Stacked bars per rank, compute then wait (seconds); returns ``{rank: (compute_s, wait_s)}`` as drawn."""
    rows = report["ranks"]
    ranks = [r["rank"] for r in rows]
    compute = [r["compute_s"] for r in rows]
    wait = [r["wait_s"] for r in rows]
    ax.barh(ranks, compute, color=STEP_COLORS["compute"], label="compute")
    ax.barh(ranks, wait, left=compute, color=STEP_COLORS["wait"],
            label="wait (blocked on peers)")
    ax.set_yticks(ranks, [f"rank {r}" + (" (straggler)" if r == report.get("straggler") else "") for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("seconds (steps after the first)")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    set_title(ax, title)
    return {r: (c, w) for r, c, w in zip(ranks, compute, wait, strict=True)}


def rank_times_figure(report: Mapping[str, Any], *, title: str | None = None) -> Figure:
    fig = new_figure((7.6, 1.2 + 0.5 * len(report["ranks"])))
    draw_rank_times(fig.add_subplot(), report, title=title)
    fig.tight_layout()
    return fig


def draw_knob(ax: Axes, microbatches: Sequence[int], bubbles: Sequence[float], activations: Sequence[float], *,
              title: str | None = None) -> Axes:
    """The pipeline's one knob: bubble ratio (left axis, %) and in-flight activation bytes per stage (right
    axis, GB) against the number of micro-batches ``m``; returns the right-hand axes."""
    ax.plot(microbatches, [100 * b for b in bubbles], "o-", color=CURVE_COLORS[0],
            label="bubble (% of ideal compute)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(microbatches), [str(m) for m in microbatches])
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble (%)")
    right = ax.twinx()
    right.plot(microbatches, [a / 1e9 for a in activations], "s--", color=CATEGORY_COLORS["activations"],
               label="in-flight activations (GB per stage)")
    right.set_ylabel("activations (GB per stage)")
    lines = ax.get_lines() + right.get_lines()
    ax.legend(lines, [str(line.get_label()) for line in lines], loc="upper center", fontsize=8)
    set_title(ax, title)
    return right


def knob_figure(microbatches: Sequence[int], bubbles: Sequence[float], activations: Sequence[float], *,
                title: str | None = None) -> Figure:
    fig = new_figure((6.4, 3.6))
    draw_knob(fig.add_subplot(), microbatches, bubbles, activations, title=title)
    fig.tight_layout()
    return fig


def step_parts_figure(rows: Mapping[str, Mapping[str, float]], *, title: str | None = None) -> Figure:
    """One horizontal stacked bar per plan: its step's parts in ms (``{"compute": s, "tp": s, "dp": s}``:
    compute, then each dimension's exposed communication in its dimension's colour), the total written at the
    bar's end."""
    fig = new_figure((9.0, 1.2 + 0.6 * len(rows)))
    ax = fig.subplots()
    fig.subplots_adjust(left=0.2, right=0.88, bottom=0.3, top=0.8)
    names = list(rows)
    parts = list(dict.fromkeys(k for r in rows.values() for k in r))
    for i, n in enumerate(names):
        left = 0.0
        for k in parts:
            w = 1e3 * rows[n].get(k, 0.0)
            color = STEP_COLORS.get(k) or DIM_COLORS[k]
            ax.barh(i, w, left=left, color=color, edgecolor=INK, linewidth=0.5, gid=f"part:{n}:{k}",
                    label=(k if k == "compute" else f"{k} (exposed)") if i == 0 else None)
            left += w
        ax.text(left, i, f" {left:,.0f} ms", va="center", fontsize=8, color=INK)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.2 * max(1e3 * sum(r.values()) for r in rows.values()))
    ax.set_xlabel("time of one step (ms)")
    ax.legend(fontsize=8, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=len(parts))
    set_title(ax, title)
    return fig
