"""What every chart shares: colours, units, round axis ends and charts that update in place.

Everything a ``draw_*`` function needs: the colours of the ledger's categories, of collectives and of
link tiers; axes labelled in the unit that suits the value (the text from ``parallel_lab.quantities``);
round axis ends (:func:`nice_ceil`, the ladder 1, 1.5, 2, 3, 4, 6, 8 x 10^k) that stay put while the data
still fit (:func:`sticky_ceil`); and :class:`Chart`, what a ``draw_*`` function leaves on an ``Axes`` so
that the next call with data of the same shape moves the artists it made (``set_height``, ``set_text``)
instead of building new ones.

Why: an explorer redraws on every widget change. Updating a few bars on axes whose ticks did not move
lets the renderer keep the picture of everything else (blitting, ``Chart.dynamic`` lists what moves),
and it lets a learner watch bars grow against the same axis.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb
from matplotlib.container import BarContainer
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import AutoLocator, Formatter, ScalarFormatter
from matplotlib.transforms import Bbox

from ...quantities import BYTE_UNITS, fmt_bytes, fmt_number, unit_for
from .. import palette

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


class UnitFormatter(Formatter):
    """Tick labels in the unit that the axis's far end calls for (``unit_for``): bytes on an axis that ends
    at 3 MB read 0, 0.5, ... 3 and the axis label says MB (:func:`unit_label`). The unit follows the view
    limits, so a cached background (keyed by the limits) never shows a stale unit."""

    def __init__(self, units: Sequence[tuple[str, float]] = BYTE_UNITS) -> None:
        self.units = tuple(units)

    def unit(self) -> tuple[str, float]:
        lo, hi = self.axis.get_view_interval()
        return unit_for(max(abs(lo), abs(hi)), self.units)

    def __call__(self, x: float, pos: Any = None) -> str:
        name, scale = self.unit()
        v = x / scale
        return "0" if abs(v) < 1e-9 else fmt_number(v, 4)


def unit_axis(ax: Axes, which: str, label: str, units: Sequence[tuple[str, float]] = BYTE_UNITS) -> str:
    """Give the ``which`` ("x" or "y") axis of ``ax`` a :class:`UnitFormatter` and the label
    ``"<label> (<unit>)"`` for its current limits; returns the unit's name. Call after setting the limits."""
    axis = ax.xaxis if which == "x" else ax.yaxis
    fmt = axis.get_major_formatter()
    if not (isinstance(fmt, UnitFormatter) and fmt.units == tuple(units)):
        fmt = UnitFormatter(units)
        axis.set_major_formatter(fmt)
    name = fmt.unit()[0]
    text = f"{label} ({name})"
    if axis.label.get_text() != text:
        axis.set_label_text(text)
    return name


def bytes_label(x: float, _pos: Any = None) -> str:
    """A log axis's tick label: each tick with its own unit (``10 MB``, ``1 GB``)."""
    return fmt_bytes(x)


def lighten(color: str, amount: float) -> tuple[float, float, float]:
    r, g, b = to_rgb(color)
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount)


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


def empty_bars(ax: Axes, xs: Sequence[float], width: float, *, horizontal: bool = False, label: str | None = None,
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


def set_title(ax: Axes, title: str | None) -> None:
    if ax.get_title() != (title or ""):
        ax.set_title(title or "", fontsize=10, y=1.0)          # a fixed height: no per-draw placement


def set_ticks(ax: Axes, chart: Chart, which: str, positions: Sequence[float], labels: Sequence[str]) -> None:
    """``set_xticks`` / ``set_yticks`` only when the labels changed (it rebuilds the tick objects)."""
    if chart.parts.get(f"{which}ticks") != (tuple(positions), tuple(labels)):
        (ax.set_xticks if which == "x" else ax.set_yticks)(list(positions), list(labels))
        chart.parts[f"{which}ticks"] = (tuple(positions), tuple(labels))


def highlight_category(ax: Axes, chart: Chart, index: int | None) -> None:
    """Mark category ``index`` of the x axis: a pale band behind it and its tick label in bold.

    The bold label is a copy of the tick label on a white box, drawn over the normal one: the axis itself
    (in the cached background) does not change when the highlighted category does.
    """
    band, bold = chart.parts.get("band"), chart.parts.get("bold")
    if band is None:
        band = ax.axvspan(-0.45, 0.45, color=palette.HIGHLIGHT, alpha=0.5, zorder=0, gid="current")
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



def value_labels(ax: Axes, chart: Chart, n: int, **style: Any) -> None:
    chart.parts["values"] = [ax.text(x, 0.0, "", ha="center", va="bottom", bbox=LABEL_BOX, **style)
                             for x in range(n)]
    chart.dynamic += chart.parts["values"]



def two_panels(fig: Figure, width_ratios: tuple[float, float], *, wspace: float, left: float, right: float,
               bottom: float, top: float) -> list[Axes]:
    """Two axes side by side on ``fig`` (the explorers' usual picture beside its chart)."""
    gs = fig.add_gridspec(1, 2, width_ratios=width_ratios, wspace=wspace, left=left, right=right, bottom=bottom,
                          top=top)
    return [fig.add_subplot(gs[0]), fig.add_subplot(gs[1])]
