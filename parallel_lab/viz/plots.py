"""Pictures of the lab's numbers: pure functions from plain data to a matplotlib ``Figure``.

Every function here takes data (a memory ledger, a communication report, a timeline, a planner result),
either as the library's objects or as the dictionaries that ``parallel-lab ... --json`` prints, and returns
a :class:`matplotlib.figure.Figure`. Nothing here touches widgets or pyplot's global state, so the same
pictures serve notebooks, the Voila app and the tests (which read the bars' heights back).

Each ``*_figure`` function has a ``draw_*`` twin that draws into a given ``Axes``. The ``draw_*`` functions
are *updaters*: called again on the same ``Axes`` with data of the same shape (the same categories, the
same dimensions, the same ranks), they move the artists they made last time (``set_height``, ``set_y``,
``set_text``) instead of building new ones; data of another shape empties the ``Axes`` and builds afresh.
Their axis ranges come from a short ladder of round numbers (:func:`nice_ceil`) and stay where they are
while the data still fit (:func:`sticky_ceil`), so the axes, ticks and labels rarely move.
:class:`parallel_lab.viz.frames.Frames` uses both: it redraws only the artists a ``draw_*`` function
marks as changing (``Chart.dynamic``) over a cached picture of the rest (blitting), which is what makes
the explorers' redraws cheap.

Units: GB means 10**9 bytes (as in ``docs/conventions.md``), times are seconds or milliseconds as labelled.
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PathCollection
from matplotlib.colors import to_rgb
from matplotlib.container import BarContainer
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.legend import Legend
from matplotlib.patches import Patch, Rectangle
from matplotlib.path import Path
from matplotlib.textpath import TextPath
from matplotlib.ticker import AutoLocator, FuncFormatter, NullLocator, ScalarFormatter
from matplotlib.transforms import Affine2D, Bbox

GB = 1e9

#: The ledger's categories in stacking order (``docs/conventions.md``), with a label and a colour each.
CATEGORIES: tuple[str, ...] = (
    "parameters", "gradients", "optimizer_states", "activations", "logits_and_loss", "comm_buffers",
)
CATEGORY_LABELS: dict[str, str] = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_states": "optimizer states",
    "activations": "activations",
    "logits_and_loss": "logits + loss",
    "comm_buffers": "comm buffers",
}
CATEGORY_COLORS: dict[str, str] = {
    "parameters": "#4c72b0",
    "gradients": "#55a868",
    "optimizer_states": "#8172b2",
    "activations": "#dd8452",
    "logits_and_loss": "#c44e52",
    "comm_buffers": "#937860",
}
#: Pipeline action colours: forward, backward (or backward-for-input), backward-for-weights.
KIND_COLORS: dict[str, str] = {"F": "#4c72b0", "B": "#55a868", "W": "#8172b2", "other": "#999999"}
KIND_LABELS: dict[str, str] = {"F": "forward", "B": "backward", "W": "weight grad", "other": "other"}
DIM_COLORS: dict[str, str] = {
    "dp": "#4c72b0", "tp": "#dd8452", "tp_vocab": "#e8b07f", "pp": "#55a868", "cp": "#8172b2",
}
#: Collective kinds: a palette apart from the ledger's categories (both may share one figure).
COLLECTIVE_COLORS: dict[str, str] = {
    "all_reduce": "#2a9d8f", "all_gather": "#e9c46a", "reduce_scatter": "#577590",
    "all_to_all": "#264653", "send": "#f28482", "recv": "#f5cac3", "broadcast": "#b5838d",
}
TIER_COLORS: tuple[str, ...] = ("#4c72b0", "#c44e52", "#55a868", "#8172b2")

FIGSIZE = (9.6, 3.9)
DPI = 100
#: Axis ends: 1, 1.5, 2, 3, 4, 6, 8 times a power of ten (each step at most 1.5x the one below).
NICE_STEPS: tuple[float, ...] = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 10.0)
#: The white box behind a bar's value label (it stays readable over the HBM line or a neighbour).
LABEL_BOX = {"facecolor": "white", "edgecolor": "none", "pad": 0.5, "alpha": 0.8}
CHART_ATTR = "_parallel_lab_chart"


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------

def field(obj: Any, name: str, default: Any = None) -> Any:
    """``obj[name]`` for a mapping (the CLI's JSON), ``obj.name`` for an object; ``default`` if absent."""
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def new_figure(figsize: tuple[float, float] = FIGSIZE, dpi: int = DPI) -> Figure:
    """A figure with an Agg canvas attached, outside pyplot (no global state, no leak)."""
    fig = Figure(figsize=figsize, dpi=dpi)
    FigureCanvasAgg(fig)
    return fig


def to_png(fig: Figure) -> bytes:
    """Render ``fig`` to PNG bytes (the whole figure, as ``savefig`` draws it)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=fig.dpi, pil_kwargs={"compress_level": 1})
    return buf.getvalue()


def nice_ceil(x: float) -> float:
    """The smallest of 1, 1.5, 2, 3, 4, 6, 8 x 10^k that is at least ``x`` (1.0 for ``x <= 0``).

    An axis that ends there keeps its ticks while the data move within a step, so a redraw only moves
    the bars (see ``frames.Frames``), and a round end reads better than 1.18 times the tallest bar.
    """
    if not (x > 0 and math.isfinite(x)):
        return 1.0
    base = 10.0 ** math.floor(math.log10(x))
    for step in NICE_STEPS:
        if step * base >= x * (1 - 1e-9):
            return step * base
    return 10 * base


def log_bounds(lo: float, hi: float) -> tuple[float, float]:
    """Log-axis ends from the ladder 1, 3 x 10^k: the largest at or below ``lo``, the smallest at or
    above ``hi``."""
    def down(x: float) -> float:
        base = 10.0 ** math.floor(math.log10(x))
        return 3 * base if 3 * base <= x * (1 + 1e-9) else base

    def up(x: float) -> float:
        base = 10.0 ** math.floor(math.log10(x))
        return base if base >= x * (1 - 1e-9) else 3 * base if 3 * base >= x * (1 - 1e-9) else 10 * base

    return down(lo), up(hi)


def sticky_ceil(chart: Chart, name: str, needed: float, keep_above: float = 1 / 4) -> float:
    """An axis end for ``needed`` that stays where it was while it still fits: the chart's last value for
    ``name`` if ``needed`` lies between ``keep_above`` times it and it, else :func:`nice_ceil`.

    A learner toggling between two settings then watches bars grow and shrink against the same axis, and
    the redraw keeps its cached background (``frames.Frames``). A new chart starts from :func:`nice_ceil`.
    """
    last = chart.parts.get(name)
    top = last if last is not None and keep_above * last <= needed <= last else nice_ceil(needed)
    chart.parts[name] = top
    return top


def reset_axes(ax: Axes) -> None:
    """Empty ``ax`` for a new chart, keeping its tick objects: several times cheaper than ``ax.clear()``.

    Removes every artist and the legend, forgets the data limits and the retained chart, and restores
    what the ``draw_*`` functions change (titles, labels, linear scales, automatic limits and ticks).
    """
    for group in (ax.patches, ax.texts, ax.lines, ax.collections, ax.images, ax.artists):
        for artist in list(group):
            artist.remove()
    ax.containers.clear()                                     # bar containers feed the legend
    if ax.get_legend() is not None:
        ax.get_legend().remove()
    ax.dataLim = Bbox.null()
    ax.ignore_existing_data_limits = True
    ax.set_autoscale_on(True)
    ax.set_axis_on()
    for axis, scale in ((ax.xaxis, ax.get_xscale()), (ax.yaxis, ax.get_yscale())):
        if scale != "linear":
            (ax.set_xscale if axis is ax.xaxis else ax.set_yscale)("linear")
        axis.set_major_locator(AutoLocator())
        axis.set_major_formatter(ScalarFormatter())
    ax.set_title("")
    ax.set_xlabel("")
    ax.set_ylabel("")
    ax.grid(False)
    if hasattr(ax, CHART_ATTR):
        delattr(ax, CHART_ATTR)


def fmt_bytes(n: float) -> str:
    """``7.52 GB``, ``312 MB``, ``4.1 kB``: decimal units as everywhere in the lab."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            v = n / scale
            return f"{v:.3g} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{n:.0f} B"


def fmt_seconds(t: float) -> str:
    """``8.35 ms``, ``1.2 s``, ``40 µs``."""
    if t >= 1:
        return f"{t:.3g} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} µs"


def _lighten(color: str, amount: float) -> tuple[float, float, float]:
    r, g, b = to_rgb(color)
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount)


def per_gpu_gb(ledger: Any) -> dict[str, float]:
    """The ledger's categories in GB, in :data:`CATEGORIES` order (unknown categories appended)."""
    per = dict(field(ledger, "per_gpu_bytes") or {})
    keys = [c for c in CATEGORIES if c in per] + [c for c in per if c not in CATEGORIES]
    return {k: float(per[k]) / GB for k in keys}


# --------------------------------------------------------------------------------------------------
# retained charts
# --------------------------------------------------------------------------------------------------

class Chart:
    """What a ``draw_*`` function left on an ``Axes``: its ``kind``, the ``shape`` of the data it was built
    for, its artists by name (``parts``) and the artists an update moves (``dynamic``), so that the next
    call with data of the same shape updates them in place. ``frames.Frames`` draws the dynamic artists
    over a cached picture of everything else, so whatever an update changes must be in ``dynamic`` or be
    seen by ``frames.axes_key`` (limits, ticks, titles, labels, legends, static texts and lines)."""

    __slots__ = ("kind", "shape", "parts", "dynamic")

    def __init__(self, kind: str, shape: Any) -> None:
        self.kind, self.shape = kind, shape
        self.parts: dict[str, Any] = {}
        self.dynamic: list[Artist] = []


def chart_on(ax: Axes, kind: str, shape: Any) -> tuple[Chart, bool]:
    """The chart ``ax`` holds if it is of this ``kind`` and ``shape`` (then ``True``: update it in place);
    otherwise a new, empty one on an emptied ``ax`` (``False``: build it)."""
    old = getattr(ax, CHART_ATTR, None)
    if old is not None and old.kind == kind and old.shape == shape:
        return old, True
    if old is not None:
        reset_axes(ax)
    chart = Chart(kind, shape)
    setattr(ax, CHART_ATTR, chart)
    return chart, False


def dynamic_title(ax: Axes) -> None:
    """Redraw the title of the chart on ``ax`` with every frame (for a title that changes with every
    update, e.g. a number), instead of treating it as part of the cached background."""
    chart = getattr(ax, CHART_ATTR, None)
    if chart is not None and ax.title not in chart.dynamic:
        chart.dynamic.append(ax.title)


def _bars(ax: Axes, xs: Sequence[float], width: float, *, horizontal: bool = False, label: str | None = None,
          **style: Any) -> list[Rectangle]:
    """Empty bars (height 0) centred on ``xs``, like ``ax.bar`` / ``ax.barh`` but without updating the data
    limits for each bar (the charts set their limits themselves): several times cheaper to build."""
    rects = [Rectangle((0.0, x - width / 2), 0.0, width) if horizontal else
             Rectangle((x - width / 2, 0.0), width, 0.0) for x in xs]
    for r in rects:
        r.set(**style)
        ax.add_artist(r)
    ax.add_container(BarContainer(rects, orientation="horizontal" if horizontal else "vertical", label=label))
    return rects


def _set_title(ax: Axes, title: str | None) -> None:
    if ax.get_title() != (title or ""):
        ax.set_title(title or "", fontsize=10, y=1.0)          # a fixed height: no per-draw placement


def _set_ticks(ax: Axes, chart: Chart, which: str, positions: Sequence[float], labels: Sequence[str]) -> None:
    """``set_xticks`` / ``set_yticks`` only when the labels changed (it rebuilds the tick objects)."""
    if chart.parts.get(f"{which}ticks") != (tuple(positions), tuple(labels)):
        (ax.set_xticks if which == "x" else ax.set_yticks)(list(positions), list(labels))
        chart.parts[f"{which}ticks"] = (tuple(positions), tuple(labels))


def _highlight(ax: Axes, chart: Chart, index: int | None) -> None:
    """Mark category ``index`` of the x axis: a pale band behind it and its tick label in bold.

    The bold label is a copy of the tick label on a white box, drawn over the normal one: the axis itself
    (in the cached background) does not change when the highlighted category does.
    """
    band, bold = chart.parts.get("band"), chart.parts.get("bold")
    if band is None:
        band = ax.axvspan(-0.45, 0.45, color="#ffe9a8", alpha=0.5, zorder=0, gid="current")
        bold = ax.text(0, 0, "", fontweight="bold", clip_on=False, zorder=3.5, gid="current-label",
                       bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.0})
        chart.parts.update(band=band, bold=bold)
        chart.dynamic += [band, bold]
    ticks = ax.xaxis.get_major_ticks()
    shown = index is not None and 0 <= index < len(ticks)
    band.set_visible(shown)
    bold.set_visible(shown)
    if shown:
        band.set_x(index - 0.45)
        label = ticks[index].label1
        bold.set_transform(label.get_transform())
        bold.set(x=index, y=label.get_position()[1], text=ax.xaxis.get_major_formatter()(index, index),
                 ha=label.get_ha(), va=label.get_va(), fontsize=label.get_fontsize(),
                 fontfamily=label.get_fontfamily())


def draw_message(ax: Axes, text: str) -> None:
    """``text`` in the middle of an ``ax`` with no axes (e.g. "no communication")."""
    chart, same = chart_on(ax, "message", None)
    if not same:
        chart.parts["text"] = ax.text(0.5, 0.5, "", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
    chart.parts["text"].set_text(text)


# --------------------------------------------------------------------------------------------------
# memory ledger
# --------------------------------------------------------------------------------------------------

def _categories(ledgers: Sequence[Any]) -> list[str]:
    cats: list[str] = []
    for led in ledgers:
        if led is not None:
            cats += [c for c in per_gpu_gb(led) if c not in cats]
    return cats


def _build_stack(ax: Axes, chart: Chart, n: int, cats: Sequence[str], width: float) -> None:
    """Empty stacked bars at 0..n-1, one series per category; each segment gets ``gid = "<category>"``
    so that tests can read heights back by category."""
    bars: dict[str, list[Rectangle]] = {}
    for cat in cats:
        bars[cat] = _bars(ax, range(n), width, label=CATEGORY_LABELS.get(cat, cat), gid=cat,
                          facecolor=CATEGORY_COLORS.get(cat, "#bbbbbb"), edgecolor="white", linewidth=0.5)
        chart.dynamic += bars[cat]
    chart.parts["bars"] = bars


def _update_stack(chart: Chart, ledgers: Sequence[Any]) -> list[float]:
    """Heights of the stacked bars from the ledgers (a ``None`` ledger: no bar); returns totals in GB."""
    per = [per_gpu_gb(led) if led is not None else {} for led in ledgers]
    totals = [0.0] * len(ledgers)
    for cat, bars in chart.parts["bars"].items():
        for i, b in enumerate(bars):
            h = per[i].get(cat, 0.0)
            b.set_y(totals[i])
            b.set_height(h)
            b.set_visible(h > 0)                                 # nothing to draw
            totals[i] += h
    return totals


def _value_labels(ax: Axes, chart: Chart, n: int, **style: Any) -> None:
    chart.parts["values"] = [ax.text(x, 0.0, "", ha="center", va="bottom", bbox=LABEL_BOX, **style)
                             for x in range(n)]
    chart.dynamic += chart.parts["values"]


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


def _update_hbm(chart: Chart, hbm_gb: float, margin: float, label_x: float | None = None) -> None:
    ys = [hbm_gb, hbm_gb * (1 - margin)]
    for line, y in zip(chart.parts["hbm_lines"], ys, strict=False):
        line.set_ydata([y, y])
    for text, y, what in zip(chart.parts.get("hbm_labels", []), ys, ("HBM", "usable"), strict=False):
        text.set_position((label_x, y))
        text.set_text(f"{what} {y:.4g} GB ")


def draw_memory(ax: Axes, ledgers: Any, labels: Sequence[str] | None = None, *, title: str | None = None,
                legend: bool = False, xlabel: str | None = None) -> list[float]:
    """Stacked bars (GB per GPU, one bar per ledger) of the ledger's categories against the HBM line.

    ``ledgers`` is one ledger or a list (e.g. one per pipeline stage). The solid line is the GPU's HBM, the
    dashed one what is usable after the ledger's safety ``margin``. Returns the bars' totals in GB.
    Updates the bars of an earlier call on ``ax`` in place when the categories and bar count match.
    """
    if not isinstance(ledgers, Sequence) or isinstance(ledgers, Mapping):
        ledgers = [ledgers]
    n = len(ledgers)
    labels = list(labels) if labels is not None else ["per GPU"] * n
    hbm = float(field(ledgers[0], "hbm_bytes", 0.0)) / GB
    margin = float(field(ledgers[0], "margin", 0.0) or 0.0)
    chart, same = chart_on(ax, "memory", (n, tuple(_categories(ledgers)), hbm > 0, margin > 0, legend))
    if not same:
        _build_stack(ax, chart, n, chart.shape[1], 0.6)
        _value_labels(ax, chart, n, fontsize=9 if n == 1 else 8, fontweight="bold")
        if hbm:
            _hbm_lines(ax, chart, margin > 0, labels=True)
        ax.set_ylabel("memory per GPU (GB)")
        if legend:
            handles, names = ax.get_legend_handles_labels()     # top of the stack first, as drawn
            ax.legend(handles[::-1], names[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
                      frameon=False)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    totals = _update_stack(chart, ledgers)
    top = sticky_ceil(chart, "top", max([t * 1.1 for t in totals] + [hbm * 1.1]))
    ax.set_ylim(0, top)
    right = n - 0.4 + (0.45 * n + 0.7 if hbm else 0)
    ax.set_xlim(-0.6, right)
    if hbm:
        _update_hbm(chart, hbm, margin, right)
    for x, (text, t) in enumerate(zip(chart.parts["values"], totals, strict=True)):
        text.set_position((x, t + top * 0.01))
        text.set_text(f"{t:.4g} GB" if n == 1 else f"{t:.3g}")
    _set_ticks(ax, chart, "x", range(n), labels)
    ax.set_xlabel(xlabel or "")
    _set_title(ax, title)
    return totals


def draw_memory_sweep(ax: Axes, values: Sequence[Any], ledgers: Sequence[Any], knob: str, *,
                      title: str | None = None, value_fmt: str = "{}", highlight: Any = None) -> list[float]:
    """How each category scales while one knob sweeps: stacked bars at each knob value, HBM line across.

    ``values[i]`` labels ``ledgers[i]``; a ``None`` ledger is an invalid combination, marked "n/a";
    ``highlight`` (one of ``values``) marks the current setting. Updates an earlier sweep on ``ax`` in place.
    """
    n = len(values)
    valid = [led for led in ledgers if led is not None]
    hbm = float(field(valid[0], "hbm_bytes", 0.0)) / GB if valid else 0.0
    margin = float(field(valid[0], "margin", 0.0) or 0.0) if valid else 0.0
    chart, same = chart_on(ax, "memory_sweep", (n, tuple(_categories(ledgers)), hbm > 0, margin > 0))
    if not same:
        _build_stack(ax, chart, n, chart.shape[1], 0.7)
        _value_labels(ax, chart, n, fontsize=8)
        if hbm:
            _hbm_lines(ax, chart, margin > 0, labels=False)
        ax.set_ylabel("GB per GPU")
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        ax.set_xlim(-0.5, n - 0.5)
    totals = _update_stack(chart, ledgers)
    top = sticky_ceil(chart, "top", max([t * 1.1 for t in totals] + [hbm * 1.05, 1e-9]))
    ax.set_ylim(0, top)
    if hbm:
        _update_hbm(chart, hbm, margin)
    for x, (text, t, led) in enumerate(zip(chart.parts["values"], totals, ledgers, strict=True)):
        text.set_position((x, t + top * 0.01))
        text.set_text(f"{t:.3g}" if led is not None else "n/a")
        text.set_color("black" if led is not None else "#888888")
    _set_ticks(ax, chart, "x", range(n), [value_fmt.format(v) for v in values])
    _highlight(ax, chart, list(values).index(highlight) if highlight in list(values) else None)
    ax.set_xlabel(knob)
    _set_title(ax, title)
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
        b1 = _bars(ax, [x - w / 2 for x in range(n)], w, label="everything else (grows like s)", gid="linear",
                   facecolor=color, edgecolor=color)
        b2 = _bars(ax, [x + w / 2 for x in range(n)], w, label="attention scores (grow like s²)",
                   gid="quadratic", facecolor=_lighten(color, 0.55), edgecolor=color, hatch="//")
        chart.parts["bars"] = (b1, b2)
        chart.dynamic += [*b1, *b2]
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))   # plain numbers, no mathtext
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
        ax.set_ylabel("activations per GPU (GB, log scale)")
        if legend_outside:
            handles, _ = ax.get_legend_handles_labels()
            ax.legend(handles, ["everything else\n(grows like s)", "attention scores\n(grow like s²)"],
                      loc="upper left", bbox_to_anchor=(1.02, 0.45), fontsize=8, frameon=False)
        else:
            ax.legend(loc="upper left", fontsize=8, frameon=False)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    lin = [v / GB if v else float("nan") for v in linear_bytes]
    quad = [v / GB if v else float("nan") for v in quadratic_bytes]
    for bars, hs in zip(chart.parts["bars"], (lin, quad), strict=True):
        for b, h in zip(bars, hs, strict=True):
            b.set_height(h)
    finite = [v for v in lin + quad if v == v and v > 0]
    # room above the tallest bar (for the legend inside: 4x on the log axis); kept while within a decade
    need_lo = min(finite, default=1e-3) / 2
    need_hi = max(finite + [hbm_bytes / GB], default=1.0) * (2 if legend_outside else 4)
    last = chart.parts.get("ylog")
    if last is not None and need_lo / 10 <= last[0] <= need_lo and need_hi <= last[1] <= need_hi * 10:
        lo, hi = last
    else:
        lo, hi = log_bounds(need_lo, need_hi)
    chart.parts["ylog"] = (lo, hi)
    ax.set_ylim(lo, hi)
    if hbm_bytes:
        _update_hbm(chart, hbm_bytes / GB, 0.0)
        chart.parts["hbm_label"].set_position((-0.45, hbm_bytes / GB))
        chart.parts["hbm_label"].set_text(f"HBM {hbm_bytes / GB:.4g} GB")
    for x, (text, v) in enumerate(zip(chart.parts["na"], linear_bytes, strict=True)):
        text.set_visible(v is None)
        text.set_position((x, lo * 1.5))
    _set_ticks(ax, chart, "x", range(n), [f"{s // 1024}K" if s % 1024 == 0 else str(s) for s in seqs])
    _highlight(ax, chart, list(seqs).index(highlight) if highlight in list(seqs) else None)
    _set_title(ax, title)


def memory_axes(fig: Figure) -> tuple[Axes, Axes]:
    """The memory explorer's layout: a narrow bar (left), a sweep (middle), room for one legend (right)."""
    gs = fig.add_gridspec(1, 2, width_ratios=(1.0, 1.45), wspace=0.3, left=0.07, right=0.84,
                          bottom=0.14, top=0.9)
    return fig.add_subplot(gs[0]), fig.add_subplot(gs[1])


def category_legend(fig: Figure, categories: Sequence[str] = CATEGORIES) -> Legend:
    """One legend of the ledger's categories at the figure's right edge (kept if it already shows them)."""
    names = [CATEGORY_LABELS[c] for c in reversed(categories)]
    for leg in fig.legends:
        if leg.get_gid() == "categories":
            if [t.get_text() for t in leg.get_texts()] == names:
                return leg
            leg.remove()
    handles = [Patch(color=CATEGORY_COLORS[c], label=CATEGORY_LABELS[c]) for c in reversed(categories)]
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


# --------------------------------------------------------------------------------------------------
# communication
# --------------------------------------------------------------------------------------------------

def _collective_rows(report: Any) -> list[dict[str, Any]]:
    rows = []
    for c in field(report, "collectives") or []:
        rows.append({k: field(c, k) for k in ("dim", "kind", "message_bytes", "group_size", "count",
                                                "wire_bytes", "tier")})
    return rows


def draw_comm_bytes(ax: Axes, report: Any, *, title: str | None = None) -> dict[str, float]:
    """Bytes one GPU sends per step (GB), one stacked bar per dimension, split by collective kind.

    Per dimension the bar's height is the report's ``per_step_bytes[dim]``. When the report lists its
    collectives with ``wire_bytes`` (bytes sent for all ``count`` calls, as ``Collective.to_json`` gives
    them) and they add up to ``per_step_bytes``, the bar is split by kind; otherwise it is one colour.
    Returns ``{dim: GB}``. Updates an earlier call on ``ax`` in place when dimensions and kinds match.
    """
    per_dim = {d: float(v) / GB for d, v in (field(report, "per_step_bytes") or {}).items()}
    dims = list(per_dim)
    by_kind: dict[str, dict[str, float]] = {}
    for r in _collective_rows(report):
        if r["dim"] in per_dim and r["wire_bytes"] is not None:
            by_kind.setdefault(r["kind"], {}).setdefault(r["dim"], 0.0)
            by_kind[r["kind"]][r["dim"]] += float(r["wire_bytes"]) / GB
    split_ok = bool(by_kind) and all(
        abs(sum(k.get(d, 0.0) for k in by_kind.values()) - per_dim[d]) <= 1e-6 * max(per_dim[d], 1e-12)
        for d in dims)
    # e.g. recv: its bytes are counted at the sender, so it gets no bar
    kinds = [k for k, vals in by_kind.items() if any(vals.get(d, 0.0) for d in dims)] if split_ok else []
    n = len(dims)
    chart, same = chart_on(ax, "comm_bytes", (tuple(dims), tuple(kinds)))
    if not same:
        series: list[tuple[list[Rectangle], list[str]]] = []
        for kind in kinds:
            bars = _bars(ax, range(n), 0.6, label=kind.replace("_", "-"),
                         facecolor=COLLECTIVE_COLORS.get(kind, "#bbbbbb"), edgecolor="white", linewidth=0.5)
            series.append((bars, [kind] * n))
        if kinds:
            ax.legend(loc="upper left", fontsize=8, frameon=False, ncols=min(len(kinds), 3),
                      columnspacing=1.0, handlelength=1.2)
        else:
            bars = _bars(ax, range(n), 0.6)
            for b, d in zip(bars, dims, strict=True):
                b.set_facecolor(DIM_COLORS.get(d, "#bbbbbb"))
            series.append((bars, [""] * n))
        for bars, ks in series:
            for b, d, k in zip(bars, dims, ks, strict=True):
                b.set_gid(f"{d}:{k}" if k else d)
            chart.dynamic += bars
        chart.parts["series"] = [bars for bars, _ in series]
        _value_labels(ax, chart, n, fontsize=8.5)
        ax.set_xlabel("parallel dimension")
        ax.set_ylabel("GB sent per GPU per step")
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        _set_ticks(ax, chart, "x", range(n), dims)
    bottoms = [0.0] * n
    for bars, kind in zip(chart.parts["series"], kinds or [None], strict=True):
        for i, (b, d) in enumerate(zip(bars, dims, strict=True)):
            h = by_kind[kind].get(d, 0.0) if kind is not None else per_dim[d]
            b.set_y(bottoms[i])
            b.set_height(h)
            bottoms[i] += h
    top = sticky_ceil(chart, "top", max([*bottoms, 1e-12]) * (1.4 if kinds else 1.18))   # legend room
    ax.set_ylim(0, top)
    ax.set_xlim(-0.5, n - 0.5)
    for x, (text, d) in enumerate(zip(chart.parts["values"], dims, strict=True)):
        text.set_position((x, per_dim[d] + top * 0.01))
        text.set_text(fmt_bytes(per_dim[d] * GB))
    _set_title(ax, title)
    return per_dim


def draw_comm_time(ax: Axes, report: Any, tiers: Mapping[str, str] | None = None, *,
                   title: str | None = None) -> dict[str, float]:
    """Time per step per dimension (ms, alpha-beta model), coloured by the link tier it lands on.

    ``tiers`` maps a dimension to its tier's label (e.g. ``{"tp": "nvlink4 450 GB/s"}``); without it the
    report's ``tiers`` field is used when present. Returns ``{dim: seconds}``. The tiers' legend sits in a
    band kept free below the bars. Updates an earlier call on ``ax`` in place when the dimensions match.
    """
    times = {d: float(v) for d, v in (field(report, "time_s") or {}).items()}
    tiers = dict(tiers or field(report, "tiers") or {})
    dims = list(times)
    n = len(dims)
    tier_names = list(dict.fromkeys(str(tiers.get(d, "?")) for d in dims))
    color = {t: TIER_COLORS[i % len(TIER_COLORS)] for i, t in enumerate(tier_names)}
    chart, same = chart_on(ax, "comm_time", (tuple(dims), bool(tiers)))
    if not same:
        bars = _bars(ax, range(n), 0.6, horizontal=True)
        for b, d in zip(bars, dims, strict=True):
            b.set_gid(d)
        chart.parts["bars"] = bars
        chart.dynamic += bars
        chart.parts["values"] = [ax.text(0.0, y, "", va="center", fontsize=8.5) for y in range(n)]
        chart.dynamic += chart.parts["values"]
        ax.set_xlabel("time per step (ms)")
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
        _set_ticks(ax, chart, "y", range(n), dims)
    ms = [times[d] * 1e3 for d in dims]
    for b, d, w in zip(chart.parts["bars"], dims, ms, strict=True):
        b.set_width(w)
        b.set_facecolor(color[str(tiers.get(d, "?"))])
    right = sticky_ceil(chart, "right", max(ms + [1e-9]) * 1.45)       # room for the labels beside
    ax.set_xlim(0, right)
    for text, y, d, w in zip(chart.parts["values"], range(n), dims, ms, strict=True):
        text.set_position((w + right * 0.02, y))
        text.set_text(fmt_seconds(times[d]))
    band = 0.0
    if tiers:
        if chart.parts.get("tiers") != tier_names:
            ax.legend(handles=[Patch(color=color[t], label=t) for t in tier_names], loc="lower right",
                      fontsize=8, frameon=False, title="link tier", title_fontsize=8)
            chart.parts["tiers"] = tier_names
        # a band below the last bar as tall as the legend (title + one row per tier, 8 pt rows)
        fig = ax.get_figure()
        axes_pt = ax.get_position().height * fig.get_size_inches()[1] * 72 if fig else 200.0
        frac = min(0.6, (len(tier_names) + 1) * 13.0 / max(axes_pt, 1.0))
        band = n * frac / (1 - frac)
    ax.set_ylim(n - 0.5 + band, -0.5)                         # first dimension on top
    _set_title(ax, title)
    return times


def comm_axes(fig: Figure) -> tuple[Axes, Axes]:
    gs = fig.add_gridspec(1, 2, width_ratios=(1.2, 1.0), wspace=0.3, left=0.08, right=0.98, bottom=0.14,
                          top=0.9)
    return fig.add_subplot(gs[0]), fig.add_subplot(gs[1])


def comm_figure(report: Any, tiers: Mapping[str, str] | None = None, *, title: str | None = None) -> Figure:
    """Bytes per step per dimension (split by collective) and time per dimension on its link tier."""
    fig = new_figure()
    a1, a2 = comm_axes(fig)
    draw_comm_bytes(a1, report, title="bytes per GPU per step")
    draw_comm_time(a2, report, tiers, title="time per step (alpha-beta)")
    if title:
        fig.suptitle(title, fontsize=11)
    return fig


# --------------------------------------------------------------------------------------------------
# pipeline timelines
# --------------------------------------------------------------------------------------------------

def kind_key(kind: Any) -> str:
    """Map an action kind to ``F``, ``B`` or ``W`` (forward, backward / backward-for-input, weights)."""
    k = str(kind).lower()
    if k in ("w", "bw", "backward_weight", "backward-weight", "weight") or "weight" in k:
        return "W"
    if k in ("b", "bi", "backward", "backward_input", "backward-input") or k.startswith("b"):
        return "B"
    if k in ("f", "forward") or k.startswith("f"):
        return "F"
    return "other"


def timeline_rows(timeline: Any) -> list[tuple[int, float, float, str, int, int]]:
    """Normalise a timeline to ``[(rank, start, end, kind, microbatch, chunk)]``.

    Accepts ``parallel-lab bubble --json``'s ``timeline`` list (or the dictionary holding it), the
    simulator's result (``simulate.SimResult``, whose intervals have these attributes), and the spans the
    runnable code records (``distributed.instruments.Span``: ``rank, kind, name, t_start, t_end, micro_batch``;
    only ``kind == "compute"`` spans are kept, named ``F``, ``B`` or ``W``).
    """
    if isinstance(timeline, Mapping):
        timeline = timeline.get("timeline", [])
    elif hasattr(timeline, "timeline"):
        timeline = timeline.timeline
    rows = []
    for r in timeline or []:
        if isinstance(r, (list, tuple)):
            rank, start, end, kind, mb, chunk = (list(r) + [0, 0])[:6]
        elif hasattr(r, "start") and hasattr(r, "rank"):             # the simulator's interval
            rank, start, end, kind = r.rank, r.start, r.end, r.kind
            mb, chunk = getattr(r, "microbatch", 0), getattr(r, "chunk", 0)
        elif isinstance(r, Sequence) and not isinstance(r, str):
            rank, start, end, kind, mb, chunk = (list(r) + [0, 0])[:6]
        elif hasattr(r, "t_start"):                                  # a measured Span
            if field(r, "kind") != "compute":
                continue
            rank, start, end = field(r, "rank"), field(r, "t_start"), field(r, "t_end")
            kind, mb, chunk = field(r, "name"), field(r, "micro_batch", 0), field(r, "chunk", 0)
        else:
            rank, start, end = field(r, "rank"), field(r, "start"), field(r, "end")
            kind, mb, chunk = field(r, "kind"), field(r, "microbatch", 0), field(r, "chunk", 0)
        rows.append((int(rank), float(start), float(end), str(kind), int(mb or 0), int(chunk or 0)))
    return rows


_BOX_CODES = np.array([Path.MOVETO, Path.LINETO, Path.LINETO, Path.LINETO, Path.CLOSEPOLY], Path.code_type)


def _boxes_path(spans: Sequence[tuple[float, float]], y0: float, y1: float) -> Path:
    """Rectangles ``[start, start + width] x [y0, y1]`` as one compound path (a subpath per box)."""
    sw = np.asarray(spans, dtype=float).reshape(-1, 2)
    x0, x1 = sw[:, 0], sw[:, 0] + sw[:, 1]
    verts = np.empty((len(sw), 5, 2))
    verts[:, :, 0] = np.stack([x0, x0, x1, x1, x0], axis=1)
    verts[:, :, 1] = (y0, y1, y1, y0, y0)
    return Path(verts.reshape(-1, 2), np.tile(_BOX_CODES, len(sw)))


def n_boxes(collection: Any) -> int:
    """How many boxes a timeline collection draws (one closed subpath each)."""
    paths = collection.get_paths()
    return sum(int((p.codes == Path.MOVETO).sum()) if p.codes is not None else 1 for p in paths)


@functools.lru_cache(maxsize=1024)
def _label_path(text: str, size: float) -> Path:
    """``text`` as a path in points, centred on (0, 0) (cached: micro-batch numbers repeat)."""
    path = TextPath((0, 0), text, size=size, prop=FontProperties(size=size))
    box = path.get_extents()
    return path.transformed(Affine2D().translate(-(box.x0 + box.x1) / 2, -(box.y0 + box.y1) / 2))


def draw_timeline(ax: Axes, timeline: Any, *, title: str | None = None, time_unit: str = "time",
                  time_scale: float = 1.0, label_microbatches: bool | None = None,
                  step_time: float | None = None, sticky: bool = False) -> dict[str, Any]:
    """One row per rank: forward / backward / weight-gradient actions as coloured boxes on a hatched grey
    band, so that idle gaps (the bubble) stay visible. Later chunks (interleaving) are drawn lighter;
    each box wide enough shows its micro-batch number.

    ``time_scale`` multiplies the times (e.g. 1e3 for seconds -> ms) and ``time_unit`` labels the x axis.
    ``step_time`` (unscaled) extends the idle band when the step ends after the last compute action (a
    last send still in flight). The time axis ends with the step, or with ``sticky=True`` at a round
    number kept while the step fits (:func:`sticky_ceil`): an explorer's axis then stays put, and the
    learner sees the step grow or shrink as the schedule changes.
    Returns ``{"ranks", "makespan", "busy": {rank: busy time}}``, scaled. The boxes are one collection per
    kind (``gid`` ``"F"``, ``"B"``, ``"W"``) holding one path of boxes per (chunk, rank) (count them with
    :func:`n_boxes`); the idle bands are the collection ``"idle"`` (one path per rank), the numbers
    ``"microbatch-labels"``.
    Updates an earlier timeline on ``ax`` in place when the ranks match.
    """
    rows = timeline_rows(timeline)
    ranks = sorted({r[0] for r in rows})
    t0 = min((r[1] for r in rows), default=0.0)
    makespan = (max([r[2] for r in rows] + [t0 + (step_time or 0.0)], default=0.0) - t0) * time_scale
    height = 0.72
    chart, same = chart_on(ax, "timeline", tuple(ranks))
    old: dict[str, PathCollection] = chart.parts.get("collections", {})
    colls: dict[str, PathCollection] = {}

    def collection(gid: str, paths: list[Path], **style: Any) -> PathCollection:
        """The collection ``gid`` of the last update with new paths, or a new one."""
        coll = old.pop(gid, None)
        if coll is None:
            coll = PathCollection(paths, gid=gid, **style)
            ax.add_collection(coll, autolim=False)
        else:
            coll.set_paths(paths)
            coll.set(**style)
        colls[gid] = coll
        return coll

    def row(spans: Sequence[tuple[float, float]], rank: int) -> Path:
        """The ``(start, width)`` boxes of one row as one path of closed rectangles."""
        return _boxes_path(spans, rank - height / 2, rank + height / 2)

    collection("idle", [row([(0.0, makespan)], rank) for rank in ranks], facecolor="#f2f2f2",
               edgecolor="#c8c8c8", hatch="////", linewidth=0.0)
    busy: dict[int, float] = dict.fromkeys(ranks, 0.0)
    groups: dict[tuple[str, int, int], list[tuple[float, float]]] = {}
    for rank, start, end, kind, _mb, chunk in rows:
        key = kind_key(kind)
        if key == "other" and end <= start:
            continue
        span = ((start - t0) * time_scale, (end - start) * time_scale)
        groups.setdefault((key, chunk, rank), []).append(span)
        busy[rank] += (end - start) * time_scale
    max_chunk = max((c for _, c, _ in groups), default=0)
    dense = len(rows) > 60 * max(len(ranks), 1)              # thin boxes: no white edges between them
    for kind in ("F", "B", "W", "other"):
        mine = sorted((c, r) for k, c, r in groups if k == kind)
        if mine:                                       # one path per (chunk, rank), later chunks lighter
            colors = [_lighten(KIND_COLORS[kind], 0.45 * c / max(max_chunk, 1)) for c, _ in mine]
            collection(kind, [row(groups[kind, c, r], r) for c, r in mine], facecolor=colors,
                       edgecolor="white", linewidth=0.0 if dense else 0.6)
    right = sticky_ceil(chart, "right", makespan * 1.01) if sticky else (makespan * 1.01 or 1.0)
    if label_microbatches is None:
        label_microbatches = 0 < len(rows) <= 160
    shown = []
    if label_microbatches and makespan > 0:
        min_w = right / 70
        shown = [(((start - t0) + (end - start) / 2) * time_scale, rank, str(mb))
                 for rank, start, end, kind, mb, _chunk in rows
                 if (end - start) * time_scale >= min_w and kind_key(kind) != "other"]
    if shown:
        # the numbers as glyph outlines in one collection: one draw call instead of one text per box
        labels = collection("microbatch-labels", [_label_path(s, 7.0) for _, _, s in shown],
                            facecolor="white", edgecolor="none", linewidth=0.0, zorder=3)
        labels.set_offsets([(x, y) for x, y, _ in shown])
        labels.set_offset_transform(ax.transData)
        labels.set_transform(Affine2D().scale(1 / 72) + ax.get_figure().dpi_scale_trans)   # points -> pixels
    for coll in old.values():
        coll.remove()                                           # kinds or chunks that are gone
    chart.parts["collections"] = colls
    chart.dynamic = [*colls.values(), ax.title]                 # titles of timelines carry their numbers
    if not same:
        ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
        ax.set_ylim(max(ranks, default=0) + 0.6, min(ranks, default=0) - 0.6)
    ax.set_xlim(0, right)
    ax.set_xlabel(time_unit)
    present = [k for k in ("F", "B", "W") if k in colls]
    legend_key = (tuple(present), max_chunk)
    if chart.parts.get("legend") != legend_key:
        handles = [Patch(facecolor=KIND_COLORS[k], label=KIND_LABELS[k]) for k in present]
        if 0 < max_chunk <= 3:
            handles += [Patch(facecolor=_lighten(KIND_COLORS["F"], 0.45 * c / max_chunk), label=f"chunk {c}")
                        for c in range(max_chunk + 1)]
        elif max_chunk > 3:
            handles.append(Patch(facecolor=_lighten(KIND_COLORS["F"], 0.45),
                                 label=f"lighter: later chunk (v={max_chunk + 1})"))
        handles.append(Patch(facecolor="#f2f2f2", edgecolor="#c8c8c8", hatch="////", label="idle"))
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
        chart.parts["legend"] = legend_key
    _set_title(ax, title)
    return {"ranks": ranks, "makespan": makespan, "busy": busy}


def timeline_figure(timeline: Any, *, title: str | None = None, time_unit: str = "time (cost units)",
                    time_scale: float = 1.0) -> Figure:
    """A simulated (or measured) pipeline timeline, one row per rank."""
    rows = timeline_rows(timeline)
    n = len({r[0] for r in rows}) or 1
    fig = new_figure((9.6, 1.2 + 0.42 * n))
    ax = fig.add_subplot()
    fig.subplots_adjust(left=0.08, right=0.86, bottom=0.6 / (1.2 + 0.42 * n) + 0.1, top=0.86)
    draw_timeline(ax, rows, title=title, time_unit=time_unit, time_scale=time_scale)
    return fig


def timelines_figure(simulated: Any, measured: Any = None, *, sim_title: str = "simulated",
                     measured_title: str = "measured", measured_unit: str = "time (ms)",
                     measured_scale: float = 1e3) -> Figure:
    """Simulated timeline above, measured timeline (seconds, drawn in ms) below when given."""
    n = len({r[0] for r in timeline_rows(simulated)}) or 1
    panels = 2 if measured is not None else 1
    h = 0.9 + panels * (0.55 + 0.36 * n)
    fig = new_figure((9.6, h))
    axes = fig.subplots(panels, 1, squeeze=False)[:, 0]
    fig.subplots_adjust(left=0.08, right=0.86, bottom=0.55 / h, top=1 - 0.35 / h, hspace=0.75)
    draw_timeline(axes[0], simulated, title=sim_title, time_unit="time (cost units)")
    if measured is not None:
        draw_timeline(axes[1], measured, title=measured_title, time_unit=measured_unit,
                      time_scale=measured_scale)
    return fig


def timeline_figures(timeline: Any, step_time: float | None = None) -> dict[str, float]:
    """``idle_fraction`` and ``bubble_ratio`` of a timeline, as ``simulate.simulate`` defines them: over the
    window ``[0, step_time]`` (default: first start to last end), ``1 - sum(busy) / (ranks * window)`` and
    ``(window - busiest rank's busy time) / busiest``."""
    rows = timeline_rows(timeline)
    if not rows:
        return {"idle_fraction": 0.0, "bubble_ratio": 0.0, "window": 0.0}
    window = step_time if step_time is not None else max(r[2] for r in rows) - min(r[1] for r in rows)
    busy: dict[int, float] = {}
    for rank, start, end, *_ in rows:
        busy[rank] = busy.get(rank, 0.0) + end - start
    top = max(busy.values())
    return {"idle_fraction": 1.0 - sum(busy.values()) / (len(busy) * window) if window else 0.0,
            "bubble_ratio": (window - top) / top if top else 0.0, "window": window}


def pipeline_timelines_figure(simulated: Any, measured: Any, *, measured_step_time: float | None = None,
                              title: str | None = None) -> Figure:
    """The simulated pipeline timeline above the measured one, each titled with its idle fraction and bubble
    ratio (:func:`timeline_figures`, the simulator's definitions), so that the bubble the schedule predicts
    and the one a run shows are read side by side.

    ``simulated``: a ``simulate.SimResult`` (or ``parallel-lab bubble --json``); its ``step_time`` closes the
    window. ``measured``: rows ``[rank, start, end, kind, microbatch, chunk]`` in seconds from the step's
    start (``parallel-lab run --json``'s ``pipeline.timeline``) or ``Span`` records; ``measured_step_time``
    (seconds, e.g. ``pipeline.step_time_s``) closes its window, last sends included.
    """
    sim_step = field(simulated, "step_time", None)
    if sim_step is None and isinstance(simulated, Mapping):
        sim_step = simulated.get("step_time")
    s, m = timeline_figures(simulated, sim_step), timeline_figures(measured, measured_step_time)
    def label(what: str, d: dict[str, float]) -> str:
        return f"{what}: idle {d['idle_fraction']:.1%} of rank-time, bubble {d['bubble_ratio']:.1%}"

    head = f"{title}: " if title else ""
    return timelines_figure(simulated, measured, sim_title=head + label("simulated", s),
                            measured_title=label("measured", m))


# --------------------------------------------------------------------------------------------------
# planner
# --------------------------------------------------------------------------------------------------

def plan_label(plan: Any) -> str:
    """``tp8 cp1 pp16 dp128 z1`` from a plan (object or the planner JSON's dictionary)."""
    src = field(plan, "plan", None) or plan
    parts = [f"{k}{field(src, k)}" for k in ("tp", "cp", "pp", "dp") if field(src, k) is not None]
    zero = field(src, "zero")
    if zero is not None:
        parts.append(f"z{zero}")
    rec = field(src, "recompute")
    if rec and rec != "none":
        parts.append(f"rc-{rec[:3]}")
    sched = field(src, "schedule")
    pp = field(src, "pp")
    if sched and pp and pp > 1:
        v = field(src, "interleave") or 1
        parts.append(sched + (f"x{v}" if v > 1 else ""))
    return " ".join(parts)


def draw_plans(ax: Axes, plans: Sequence[Any], *, top: int = 10, title: str | None = None,
               chosen: int | None = 0) -> list[float]:
    """The ranked plans' estimated step time (s), best at the top, MFU written beside each bar."""
    plans = list(plans)[:top]
    times = [float(field(p, "step_time_s", 0.0)) for p in plans]
    ys = list(range(len(plans)))
    colors = ["#dd8452" if i == chosen else "#4c72b0" for i in ys]
    bars = ax.barh(ys, times, 0.65, color=colors)
    for i, b in enumerate(bars):
        b.set_gid(f"plan:{i}")
    right = max(times + [1e-9])
    ax.set_xlim(0, right * 1.3)
    for y, p, t in zip(ys, plans, times, strict=True):
        mfu = field(p, "mfu")
        ax.text(t + right * 0.01, y, f"{t:.3g} s" + (f"  MFU {float(mfu):.0%}" if mfu is not None else ""),
                va="center", fontsize=8)
    ax.set_yticks(ys, [f"#{i + 1} {plan_label(p)}" for i, p in enumerate(plans)], fontsize=8)
    ax.set_ylim(len(plans) - 0.5, -0.5)                        # best plan on top
    ax.set_xlabel("estimated step time (s)")
    if title:
        ax.set_title(title, fontsize=10, y=1.0)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    return times
