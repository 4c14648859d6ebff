"""Pipeline pictures from the articles: the bubble of Meta's Llama 3 settings, and the all-to-all that
DualPipe's paired chunks hide (against a serial pair, with or without zero-bubble's B/W split)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from matplotlib.figure import Figure

from ..palette import CURVE_COLORS, INK, MARK_COLORS, STEP_COLORS
from .base import new_figure


def bubble_bars_figure(bubble: Mapping[str, float], *, title: str | None = None) -> Figure:
    """One horizontal bar per setting: its bubble ratio (%), the value written at the bar's end."""
    fig = new_figure((9.6, 0.6 + 0.55 * len(bubble)))
    ax = fig.subplots()
    fig.subplots_adjust(left=0.36, right=0.9, bottom=0.25, top=0.82)
    names = list(bubble)
    ax.barh(range(len(names)), [100 * bubble[n] for n in names], color=STEP_COLORS["bubble"], edgecolor=INK,
            gid="bubble")
    for i, n in enumerate(names):
        ax.text(100 * bubble[n], i, f" {100 * bubble[n]:.1f}%", va="center", fontsize=8, color=INK)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.2 * max(100 * v for v in bubble.values()))
    ax.set_xlabel("bubble ratio: idle / compute (%)")
    if title:
        ax.set_title(title, fontsize=10)
    return fig


def exposed_comm_figure(ratios: Sequence[float], exposed: Mapping[str, Sequence[float]], mark: float, *,
                        title: str | None = None) -> Figure:
    """Exposed communication per (forward, backward) pair, over the pair's compute, against the ratio of
    communication to compute; one line per schedule, a vertical mark at ``mark`` (the published ratio)."""
    fig = new_figure((9.6, 3.6))
    ax = fig.subplots()
    fig.subplots_adjust(left=0.08, right=0.72, bottom=0.15, top=0.86)
    styles = ("-", "--", "-")
    for i, (name, ys) in enumerate(exposed.items()):
        ax.plot(list(ratios), [100 * y for y in ys], styles[i % 3], color=CURVE_COLORS[i % len(CURVE_COLORS)],
                lw=2.2 - 0.6 * (i == 1), label=name, gid=f"exposed:{name}")
    ax.axvline(mark, color=MARK_COLORS["operator"], lw=1, ls=":")
    ax.text(mark, 1.02, f"DeepSeek-V3: about {mark:g}:1", transform=ax.get_xaxis_transform(), ha="center",
            fontsize=8, color=INK)
    ax.set_xlabel("all-to-all time / compute time of the pair")
    ax.set_ylabel("exposed communication / compute (%)")
    ax.set_ylim(0, None)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if title:
        fig.suptitle(title, fontsize=10, y=0.99)
    return fig
