"""Memory pictures: the ledger as stacked bars per GPU against HBM, sweeps, activation terms.

The memory ledger (``parallel_lab.ledger.memory``) drawn as one stacked bar per GPU (per pipeline stage
when pp > 1) of its six categories (``docs/conventions.md``), against the GPU's HBM (solid line) and what
is usable after the safety margin (dashed). :func:`draw_memory_sweep` stacks the same categories while
one knob sweeps (ZeRO stage, dp); :func:`draw_activation_terms` splits the activations into the part
linear in the sequence length and the attention scores that grow like s² (Korthikanti et al. 2022,
per layer ``s b h (34 + 5 a s / h)`` bytes), on a log axis.

Every segment carries ``gid = "<category>"`` so that tests read the heights back by category and compare
them with the ledger. The axis unit (B, kB, MB, GB) follows the largest value drawn. Where the peak at
one moment exceeds the categories' sum (``MemoryLedger.need_bytes``), a hatched segment (``gid = "peak"``)
tops the bar up to it: the number the verdict weighs is drawn, labelled with :func:`need_text` (the
status line's rounding), and always inside the axis.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.legend import Legend
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import FuncFormatter, NullLocator

from ...quantities import fmt_bytes, fmt_number
from ..palette import CATEGORY_COLORS, INK, MARK_COLORS, MUTED
from .base import (
    CATEGORIES,
    CATEGORY_LABELS,
    LABEL_BOX,
    Chart,
    bytes_label,
    chart_on,
    empty_bars,
    field,
    highlight_category,
    lighten,
    log_bounds,
    new_figure,
    set_ticks,
    set_title,
    sticky_ceil,
    unit_axis,
    value_labels,
)

#: The HBM line is left off an axis whose bars stay under this fraction of it (tiny-llama's 1.7 MB on an
#: 80 GB GPU would be empty bars); a note says how far off the scale it is.
HBM_OFF_SCALE = 0.02
PEAK_LABEL = "peak moment"


def need_text(n: float) -> str:
    """The one rounding of the verdict's bytes: status line, bar label and sweep (3 significant digits)."""
    return fmt_bytes(n, 3)


def need_bytes(ledger: Any) -> float:
    """What the verdict weighs: ``need_bytes`` (the peak at one moment where larger), else the total."""
    if ledger is None:
        return 0.0
    need = field(ledger, "need_bytes")
    return float(need) if need is not None else sum(per_gpu_bytes(ledger).values())


def per_gpu_bytes(ledger: Any) -> dict[str, float]:
    """The ledger's categories in bytes, in :data:`CATEGORIES` order (unknown categories appended)."""
    per = dict(field(ledger, "per_gpu_bytes") or {})
    keys = [c for c in CATEGORIES if c in per] + [c for c in per if c not in CATEGORIES]
    return {k: float(per[k]) for k in keys}


def _categories(ledgers: Sequence[Any]) -> list[str]:
    cats: list[str] = []
    for led in ledgers:
        if led is not None:
            cats += [c for c in per_gpu_bytes(led) if c not in cats]
    return cats


def _build_stack(ax: Axes, chart: Chart, n: int, cats: Sequence[str], width: float) -> None:
    """Empty stacked bars at 0..n-1, one series per category; each segment gets ``gid = "<category>"``
    so that tests can read heights back by category."""
    bars: dict[str, list[Rectangle]] = {}
    for cat in cats:
        bars[cat] = empty_bars(ax, range(n), width, label=CATEGORY_LABELS.get(cat, cat), gid=cat,
                          facecolor=CATEGORY_COLORS.get(cat, "#bbbbbb"), edgecolor="white", linewidth=0.5)
        chart.dynamic += bars[cat]
    chart.parts["bars"] = bars
    peak = empty_bars(ax, range(n), width, label=PEAK_LABEL, gid="peak", facecolor="white",
                      edgecolor=MARK_COLORS["peak"], hatch="xx", linewidth=0.8)
    chart.parts["peak"] = peak
    chart.dynamic += peak


def _update_stack(chart: Chart, ledgers: Sequence[Any], needs: Sequence[float]) -> list[float]:
    """Heights of the stacked bars (bytes) from the ledgers (a ``None`` ledger: no bar); returns totals."""
    per = [per_gpu_bytes(led) if led is not None else {} for led in ledgers]
    totals = [0.0] * len(ledgers)
    for cat, bars in chart.parts["bars"].items():
        for i, b in enumerate(bars):
            h = per[i].get(cat, 0.0)
            b.set_y(totals[i])
            b.set_height(h)
            b.set_visible(h > 0)                                 # nothing to draw
            totals[i] += h
    for b, need, t in zip(chart.parts["peak"], needs, totals, strict=True):
        extra = need - t
        b.set_y(t)
        b.set_height(max(extra, 0.0))
        b.set_visible(extra > 0)
    return totals


def _place_labels(chart: Chart, ledgers: Sequence[Any], needs: Sequence[float], top: float,
                  shown: Sequence[bool]) -> None:
    """Each shown bar's verdict bytes above it, moved above any reference line the text would cross."""
    lines = [ln.get_ydata()[0] for ln in chart.parts.get("hbm_lines", []) if ln.get_visible()]
    for x, (text, led, need, show) in enumerate(zip(chart.parts["values"], ledgers, needs, shown, strict=True)):
        y = need + top * 0.01
        for ln in sorted(lines):
            if y - top * 0.01 <= ln <= y + top * 0.09:
                y = ln + top * 0.012
        text.set_position((x, y))
        text.set_text(need_text(need) if led is not None else "n/a")
        text.set_color(INK if led is not None else "#888888")
        text.set_visible(show)



def _hbm_lines(ax: Axes, chart: Chart, margin: bool, labels: bool) -> None:
    """The HBM line (solid) and the usable line after the safety margin (dashed), optionally labelled."""
    lines = [ax.axhline(0.0, color="black", linewidth=1.4, gid="hbm")]
    if margin:
        lines.append(ax.axhline(0.0, color="black", linewidth=1.0, linestyle="--", gid="usable"))
    chart.parts["hbm_lines"] = lines
    chart.dynamic += lines                                   # drawn over the bars
    if labels:
        chart.parts["hbm_labels"] = [ax.text(0.0, 0.0, "", va=va, ha="right", fontsize=8.5)
                                     for va in ("bottom", "top")[: len(lines)]]
        chart.dynamic += chart.parts["hbm_labels"]
    chart.parts["hbm_note"] = ax.text(0.98, 0.97, "", transform=ax.transAxes, ha="right", va="top", fontsize=8,
                                      color=MUTED, bbox=LABEL_BOX)
    chart.dynamic.append(chart.parts["hbm_note"])


def _hbm_on_scale(hbm: float, totals: Sequence[float]) -> bool:
    """Whether the HBM line belongs on the axis: the tallest bar reaches :data:`HBM_OFF_SCALE` of it."""
    return hbm > 0 and max(totals, default=0.0) >= HBM_OFF_SCALE * hbm


def _update_hbm(chart: Chart, hbm: float, margin: float, label_x: float | None, tallest: float) -> None:
    """HBM and usable lines at ``hbm`` and ``hbm * (1 - margin)`` bytes, or, when the bars are too small
    to see beside them, no lines and a note saying how many times the tallest bar HBM is."""
    shown = _hbm_on_scale(hbm, [tallest])
    ys = [hbm, hbm * (1 - margin)]
    for line, y in zip(chart.parts["hbm_lines"], ys, strict=False):
        line.set_ydata([y, y])
        line.set_visible(shown)
    for text, y, what in zip(chart.parts.get("hbm_labels", []), ys, ("HBM", "usable"), strict=False):
        text.set_position((label_x, y))
        text.set_text(f"{what} {fmt_bytes(y, 4)} ")
        text.set_visible(shown)
    note = chart.parts["hbm_note"]
    note.set_visible(not shown)
    times = hbm / tallest if tallest > 0 else float("inf")
    note.set_text(f"HBM {fmt_bytes(hbm)} is off the scale" + (f" ({fmt_number(times, 2)}x)"
                                                              if math.isfinite(times) else ""))


def _restack_and_rescale(ax: Axes, chart: Chart, ledgers: Sequence[Any], hbm: float, hbm_room: float,
                         ylabel: str) -> tuple[list[float], list[float], float]:
    """Restack the bars and rescale y (sticky: it grows, never jitters): 12% above the tallest need, and
    ``hbm_room`` times HBM when its line is on the scale. Returns the needs, the stack totals and the top."""
    needs = [need_bytes(led) for led in ledgers]
    totals = _update_stack(chart, ledgers, needs)
    room = hbm * hbm_room if _hbm_on_scale(hbm, needs) else 0.0
    top = sticky_ceil(chart, "top", max([t * 1.12 for t in needs] + [room, 1.0]))
    ax.set_ylim(0, top)
    unit_axis(ax, "y", ylabel)
    return needs, totals, top


def draw_memory(ax: Axes, ledgers: Any, labels: Sequence[str] | None = None, *, title: str | None = None,
                legend: bool = False, xlabel: str | None = None) -> list[float]:
    """Stacked bars (bytes per GPU, one bar per ledger) of the ledger's categories against the HBM line.

    ``ledgers`` is one ledger or a list (e.g. one per pipeline stage). The solid line is the GPU's HBM, the
    dashed one what is usable after the ledger's safety ``margin``; bars under :data:`HBM_OFF_SCALE` of
    HBM get an axis of their own and a note instead. The axis unit follows its end (B ... GB).
    Returns the bars' totals in bytes.
    Updates the bars of an earlier call on ``ax`` in place when the categories and bar count match.
    """
    if not isinstance(ledgers, Sequence) or isinstance(ledgers, Mapping):
        ledgers = [ledgers]
    n = len(ledgers)
    labels = list(labels) if labels is not None else ["per GPU"] * n
    hbm = float(field(ledgers[0], "hbm_bytes", 0.0))
    margin = float(field(ledgers[0], "margin", 0.0) or 0.0)
    chart, same = chart_on(ax, "memory", (n, tuple(_categories(ledgers)), hbm > 0, margin > 0, legend))
    if not same:
        _build_stack(ax, chart, n, chart.shape[1], 0.6)
        value_labels(ax, chart, n, fontsize=9 if n == 1 else 8, fontweight="bold")
        if hbm:
            _hbm_lines(ax, chart, margin > 0, labels=True)
        if legend:
            handles, names = ax.get_legend_handles_labels()     # top of the stack first, as drawn
            ax.legend(handles[::-1], names[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
                      frameon=False)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    needs, totals, top = _restack_and_rescale(ax, chart, ledgers, hbm, 1.1, "memory per GPU")
    right = n - 0.4 + (0.45 * n + 0.7 if hbm else 0)
    ax.set_xlim(-0.6, right)
    if hbm:
        _update_hbm(chart, hbm, margin, right, max(needs))
    # labels where they fit: every bar of one or two, else the one the verdict weighs (the largest need)
    _place_labels(chart, ledgers, needs, top, [n <= 2 or x == needs.index(max(needs)) for x in range(n)])
    set_ticks(ax, chart, "x", range(n), labels)
    ax.set_xlabel(xlabel or "")
    set_title(ax, title)
    return totals


def draw_memory_sweep(ax: Axes, values: Sequence[Any], ledgers: Sequence[Any], knob: str, *,
                      title: str | None = None, value_fmt: str = "{}", highlight: Any = None) -> list[float]:
    """How each category scales while one knob sweeps: stacked bars at each knob value, HBM line across.

    ``values[i]`` labels ``ledgers[i]``; a ``None`` ledger is an invalid combination, marked "n/a";
    ``highlight`` (one of ``values``) marks the current setting. Updates an earlier sweep on ``ax`` in place.
    """
    n = len(values)
    valid = [led for led in ledgers if led is not None]
    hbm = float(field(valid[0], "hbm_bytes", 0.0)) if valid else 0.0
    margin = float(field(valid[0], "margin", 0.0) or 0.0) if valid else 0.0
    chart, same = chart_on(ax, "memory_sweep", (n, tuple(_categories(ledgers)), hbm > 0, margin > 0))
    if not same:
        _build_stack(ax, chart, n, chart.shape[1], 0.7)
        value_labels(ax, chart, n, fontsize=8)
        if hbm:
            _hbm_lines(ax, chart, margin > 0, labels=False)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        ax.set_xlim(-0.5, n - 0.5)
    needs, totals, top = _restack_and_rescale(ax, chart, ledgers, hbm, 1.12, "per GPU")
    if hbm:
        _update_hbm(chart, hbm, margin, None, max(needs))
    at = list(values).index(highlight) if highlight in list(values) else None
    # labels where they fit: the selected bar and the sweep's ends; an invalid value always says "n/a"
    shown = [i in (0, n - 1, at) or led is None for i, led in enumerate(ledgers)]
    if n > 6 and at is not None:                       # the selected bar's label needs its neighbours' room
        shown = [s and (abs(i - at) > 1 or i == at) for i, s in enumerate(shown)]
    _place_labels(chart, ledgers, needs, top, shown)
    set_ticks(ax, chart, "x", range(n), [value_fmt.format(v) for v in values])
    highlight_category(ax, chart, at)
    ax.set_xlabel(knob)
    set_title(ax, title)
    return totals


def draw_activation_terms(ax: Axes, seqs: Sequence[int], linear_bytes: Sequence[float | None],
                          quadratic_bytes: Sequence[float | None], *, hbm_bytes: float = 0.0,
                          title: str | None = None, highlight: int | None = None,
                          legend_outside: bool = False) -> None:
    """Activations over sequence length: the part linear in s beside the attention scores, on a log axis.

    Korthikanti et al. 2022: per layer ``s b h (34 + 5 a s / h)`` bytes; ``34 s b h`` grows linearly,
    ``5 a s^2 b`` (the attention scores, softmax and dropout) quadratically. On the log axis each doubling
    of s lifts the first pair of bars by one step and the second by two. The explorer takes the two parts
    from the ledger itself (selective recomputation drops exactly the score term), so the picture shows
    what the ledger computes. ``None`` marks an invalid sequence length (no bars, "n/a"). The legend sits
    in the upper left corner, or right of the axes with ``legend_outside`` (an explorer's choice: nothing
    it redraws then passes over the legend).
    """
    n = len(seqs)
    w = 0.38
    chart, same = chart_on(ax, "activation_terms", (n, hbm_bytes > 0, legend_outside))
    if not same:
        color = CATEGORY_COLORS["activations"]
        b1 = empty_bars(ax, [x - w / 2 for x in range(n)], w, label="activations (grow like s)", gid="linear",
                   facecolor=color, edgecolor=color)
        b2 = empty_bars(ax, [x + w / 2 for x in range(n)], w, label="attention scores (grow like s²)",
                   gid="quadratic", facecolor=lighten(color, 0.55), edgecolor=color, hatch="//")
        chart.parts["bars"] = (b1, b2)
        chart.dynamic += [*b1, *b2]
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(bytes_label))           # 10 MB, 1 GB: no mathtext
        ax.yaxis.set_minor_locator(NullLocator())                              # decades only: fewer ticks
        if hbm_bytes:
            chart.parts["hbm_lines"] = [ax.axhline(1.0, color="black", linewidth=1.4, gid="hbm")]
            chart.parts["hbm_label"] = ax.text(-0.45, 1.0, "", ha="left", va="bottom", fontsize=8)
            chart.dynamic += [*chart.parts["hbm_lines"], chart.parts["hbm_label"]]
        chart.parts["na"] = [ax.text(x, 1.0, "n/a", ha="center", va="bottom", fontsize=8, color="#888888")
                             for x in range(n)]
        chart.dynamic += chart.parts["na"]
        ax.set_xlim(-0.5, n - 0.5)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel("activations per GPU (log scale)")
        if legend_outside:
            handles, _ = ax.get_legend_handles_labels()
            ax.legend(handles, ["activations\n(grow like s)", "attention scores\n(grow like s²)"],
                      loc="upper left", bbox_to_anchor=(1.02, 0.45), fontsize=8, frameon=False)
        else:
            ax.legend(loc="upper left", fontsize=8, frameon=False)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    lin = [float(v) if v else float("nan") for v in linear_bytes]
    quad = [float(v) if v else float("nan") for v in quadratic_bytes]
    for bars, hs in zip(chart.parts["bars"], (lin, quad), strict=True):
        for b, h in zip(bars, hs, strict=True):
            b.set_height(h)
    finite = [v for v in lin + quad if v == v and v > 0]
    # room above the tallest bar (for the legend inside: 4x on the log axis); kept while within a decade
    need_lo = min(finite, default=1e6) / 2
    need_hi = max(finite + [hbm_bytes], default=1e9) * (2 if legend_outside else 4)
    last = chart.parts.get("ylog")
    if last is not None and need_lo / 10 <= last[0] <= need_lo and need_hi <= last[1] <= need_hi * 10:
        lo, hi = last
    else:
        lo, hi = log_bounds(need_lo, need_hi)
    chart.parts["ylog"] = (lo, hi)
    ax.set_ylim(lo, hi)
    if hbm_bytes:
        chart.parts["hbm_lines"][0].set_ydata([hbm_bytes, hbm_bytes])
        chart.parts["hbm_label"].set_position((-0.45, hbm_bytes))
        chart.parts["hbm_label"].set_text(f"HBM {fmt_bytes(hbm_bytes, 4)}")
    for x, (text, v) in enumerate(zip(chart.parts["na"], linear_bytes, strict=True)):
        text.set_visible(v is None)
        text.set_position((x, lo * 1.5))
    set_ticks(ax, chart, "x", range(n), [f"{s // 1024}K" if s % 1024 == 0 else str(s) for s in seqs])
    highlight_category(ax, chart, list(seqs).index(highlight) if highlight in list(seqs) else None)
    set_title(ax, title)


def memory_axes(fig: Figure) -> tuple[Axes, Axes]:
    """The memory explorer's layout: a narrow bar (left), a sweep (middle), room for one legend (right)."""
    gs = fig.add_gridspec(1, 2, width_ratios=(1.0, 1.45), wspace=0.3, left=0.07, right=0.84,
                          bottom=0.14, top=0.9)
    return fig.add_subplot(gs[0]), fig.add_subplot(gs[1])


def category_legend(fig: Figure, categories: Sequence[str] = CATEGORIES) -> Legend:
    """One legend of the ledger's categories at the figure's right edge (kept if it already shows them)."""
    names = [CATEGORY_LABELS[c] for c in reversed(categories)] + [PEAK_LABEL]
    for leg in fig.legends:
        if leg.get_gid() == "categories":
            if [t.get_text() for t in leg.get_texts()] == names:
                return leg
            leg.remove()
    handles = [Patch(color=CATEGORY_COLORS[c], label=CATEGORY_LABELS[c]) for c in reversed(categories)]
    handles.append(Patch(facecolor="white", edgecolor=MARK_COLORS["peak"], hatch="xx", label=PEAK_LABEL))
    leg = fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.85, 0.9), fontsize=8, frameon=False)
    leg.set_gid("categories")
    return leg


def memory_figure(ledger: Any, *, title: str | None = None) -> Figure:
    """One ledger: stacked bar per GPU against HBM, with the verdict in the title."""
    fig = new_figure((6.6, 4.2))
    ax = fig.add_subplot()
    fig.subplots_adjust(left=0.11, right=0.72, bottom=0.1, top=0.9)
    fits = field(ledger, "fits")
    verdict = "" if fits is None else ("fits" if fits else "does NOT fit")
    draw_memory(ax, ledger, title=title or f"memory per GPU: {verdict}", legend=True)
    return fig


def memory_sweep_figure(values: Sequence[Any], ledgers: Sequence[Any], knob: str, *,
                        title: str | None = None, value_fmt: str = "{}") -> Figure:
    """Stacked categories while one knob sweeps (e.g. ZeRO stage 0-3), with the HBM line and a legend."""
    fig = new_figure((6.4, 4.0))
    ax = fig.add_subplot()
    fig.subplots_adjust(left=0.11, right=0.7, bottom=0.14, top=0.9)
    draw_memory_sweep(ax, values, ledgers, knob, title=title, value_fmt=value_fmt)
    handles, names = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], names[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
              frameon=False)
    return fig




def optimizer_state_figure(per_optimizer: Mapping[str, Mapping[str, float]], hbm_bytes: float, *,
                           title: str | None = None) -> Figure:
    """One stacked bar per optimizer: bytes of parameters, gradients and optimizer states (GB), the HBM of
    one GPU as a dashed line and each bar's total written above it."""
    fig = new_figure((9.6, 3.6))
    ax = fig.subplots()
    fig.subplots_adjust(left=0.08, right=0.78, bottom=0.22, top=0.86)
    names = list(per_optimizer)
    bottoms = [0.0] * len(names)
    for cat in ("parameters", "gradients", "optimizer_states"):
        vals = [per_optimizer[n].get(cat, 0.0) / 1e9 for n in names]
        ax.bar(range(len(names)), vals, bottom=bottoms, color=CATEGORY_COLORS[cat],
               label=CATEGORY_LABELS[cat], gid=f"optimizer:{cat}")
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    for i, total in enumerate(bottoms):
        ax.text(i, total, f"{total:.0f} GB", ha="center", va="bottom", fontsize=8, color=INK)
    ax.axhline(hbm_bytes / 1e9, color=MUTED, ls="--", lw=1)
    ax.set_xticks(range(len(names)), names, fontsize=8, rotation=15)
    ax.set_ylabel("model state (GB)")
    ax.set_ylim(0, 1.15 * max(max(bottoms), hbm_bytes / 1e9))
    ax.legend(fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if title:
        ax.set_title(title, fontsize=10)
    return fig
