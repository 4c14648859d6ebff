"""Goodput pictures: useful time over wall time against the checkpoint interval (the optimum marked), and the
chance that a step of N ranks meets no slow rank."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from matplotlib.figure import Figure

from ..palette import CURVE_COLORS, MARK_COLORS
from .base import new_figure


def goodput_figure(intervals_min: Sequence[float], curves: Mapping[str, Sequence[float]],
                   optima: Mapping[str, tuple[float, float]], n_ranks: Sequence[int],
                   clean: Mapping[str, Sequence[float]], *, title: str | None = None) -> Figure:
    """Left: goodput (%) against the checkpoint interval (minutes), one curve per job, its optimum
    ``(interval, goodput)`` marked (and written in the legend). Right: P(no slow rank) against the number of
    ranks, one curve per ``p``."""
    fig = new_figure((9.6, 3.8))
    left, right = fig.subplots(1, 2)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.15, top=0.85, wspace=0.28)
    for i, (name, ys) in enumerate(curves.items()):
        color = CURVE_COLORS[i % len(CURVE_COLORS)]
        x, y = optima[name]
        left.plot(list(intervals_min), [100 * y for y in ys], color=color, lw=1.6, gid=f"goodput:{name}",
                  label=f"{name}: best {x:.0f} min, {100 * y:.1f}%")
        left.plot([x], [100 * y], "o", color=MARK_COLORS["peak"], ms=6, gid=f"optimum:{name}")
    left.set_xscale("log")
    left.set_xlabel("checkpoint interval (minutes of work)")
    left.set_ylabel("goodput: useful / wall time (%)")
    left.set_ylim(0, 100)
    left.grid(alpha=0.3)
    left.legend(fontsize=8, frameon=False, loc="lower center")
    for i, (name, ys) in enumerate(clean.items()):
        right.plot(list(n_ranks), [100 * y for y in ys], color=CURVE_COLORS[(i + 2) % len(CURVE_COLORS)], lw=1.6,
                   label=name, gid=f"clean:{name}")
    right.set_xscale("log", base=2)
    right.set_xlabel("ranks N in one synchronous step")
    right.set_ylabel("P(no slow rank) = (1-p)^N (%)")
    right.set_ylim(0, 100)
    right.grid(alpha=0.3)
    right.legend(fontsize=8, frameon=False, loc="lower left")
    if title:
        fig.suptitle(title, fontsize=10)
    return fig
