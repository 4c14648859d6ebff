"""PNG frames of a figure by matplotlib's standard blitting, encoded by Pillow.

An explorer's update moves a few artists (bars, value labels, timeline boxes: ``Chart.dynamic`` of
:mod:`parallel_lab.viz.plots`) and leaves the rest (axes, ticks, titles, legends) as it was. The classic
animation recipe of matplotlib draws that rest once and keeps it:

1. ``canvas.draw()`` with the moving artists marked *animated* (Agg leaves them out), then
   ``canvas.copy_from_bbox(figure.bbox)``: the background;
2. on each update ``canvas.restore_region(background)`` and ``ax.draw_artist(a)`` for each moving artist,
   in z-order;
3. the canvas's RGBA buffer to PNG with Pillow (``compress_level=1``: the fastest zlib level).

The background is redrawn when what it shows changed: :func:`background_key` lists the figure's size,
where the axes sit, their limits, ticks, titles, labels, legends and static artists. The last few
backgrounds are kept, so going back to an earlier setting does not draw again. A static artist must not
lie over a moving one of lower z-order (the moving one would be drawn over it); the charts keep legends
out of the way. ``tests/viz/test_blit.py`` checks that a blitted frame equals a full draw, pixel for pixel.
"""

from __future__ import annotations

import contextlib
import io
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.axis import Axis
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.legend import Legend
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle
from matplotlib.spines import Spine
from matplotlib.text import Text
from PIL import Image

from .plots import CHART_ATTR


def _artist_key(a: Artist) -> Any:
    """What a static artist shows (its identity plus the properties the charts change)."""
    if isinstance(a, Axis):                             # ticks follow from limits, locator and formatter
        loc, fmt = a.get_major_locator(), a.get_major_formatter()
        func = getattr(fmt, "func", None)
        return (id(a), a.get_visible(), tuple(a.get_view_interval()), a.get_scale(), a.label.get_text(),
                type(loc).__name__, tuple(getattr(loc, "locs", ())), type(fmt).__name__,
                tuple(getattr(fmt, "seq", ())), getattr(func, "__code__", None))
    if isinstance(a, Text):
        return (id(a), a.get_visible(), a.get_text(), a.get_position(), a.get_color(), a.get_fontweight(),
                a.get_fontsize(), a.get_rotation())
    if isinstance(a, Legend):
        texts = tuple(t.get_text() for t in a.get_texts())
        colors = tuple(str(getattr(h, "get_facecolor", str)()) for h in a.legend_handles)
        return ("legend", a.get_visible(), a.get_title().get_text(), texts, colors)
    if isinstance(a, Line2D):
        return (id(a), a.get_visible(), a.get_xydata().tobytes())
    if isinstance(a, Rectangle):
        return (id(a), a.get_visible(), a.get_xy(), a.get_width(), a.get_height(), str(a.get_facecolor()))
    return (id(a), a.get_visible())


def dynamic_artists(fig: Figure) -> dict[Axes, list[Artist]]:
    """The artists the charts on ``fig`` move on an update, per axes in z-order. The spines of those axes
    come with them: bars start on the axis line, which is drawn over them."""
    out: dict[Axes, list[Artist]] = {}
    for ax in fig.axes:
        chart = getattr(ax, CHART_ATTR, None)
        arts = list(chart.dynamic) if chart is not None else []
        if arts and ax.axison and ax.get_frame_on():
            arts += ax.spines.values()
        out[ax] = sorted(arts, key=lambda a: a.get_zorder())
    return out


def background_key(fig: Figure, moving: set[int]) -> tuple:
    """Everything ``fig`` shows that is not in ``moving`` (artists' ids). Same key, same background."""
    parts: list[Any] = [tuple(fig.get_size_inches()), fig.dpi,
                        *(_artist_key(a) for a in (*fig.legends, *fig.texts))]
    for ax in fig.axes:
        chart = getattr(ax, CHART_ATTR, None)
        parts.append((id(ax), ax.get_position().bounds, ax.axison, ax.get_visible(), ax.get_xlim(),
                      ax.get_ylim(), (chart.kind, chart.shape) if chart else None))
        parts += [_artist_key(a) for a in ax.get_children()
                  if id(a) not in moving and a is not ax.patch and not isinstance(a, Spine)]
    return tuple(parts)


@contextlib.contextmanager
def _animated(artists: list[Artist]) -> Iterator[None]:
    """Agg's ``draw`` leaves animated artists out: the background without the moving artists."""
    for a in artists:
        a.set_animated(True)
    try:
        yield
    finally:
        for a in artists:
            a.set_animated(False)


def png_bytes(rgba: np.ndarray, compress_level: int = 1) -> bytes:
    """An RGB PNG of an ``(h, w, 4)`` uint8 image, by Pillow (alpha dropped: the figures are opaque)."""
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(rgba[:, :, :3])).save(buf, format="png", compress_level=compress_level)
    return buf.getvalue()


class Blitter:
    """PNG frames of one figure: the cached background restored, the moving artists drawn over it.

    ``render()`` returns the figure as it is now. ``full_draws`` counts frames that drew the background,
    ``blits`` frames made over a kept one; ``last_full`` says which the last one was. The last ``keep``
    backgrounds are kept (each ``4 * width * height`` bytes, 1.5 MB at 960 x 390).
    """

    def __init__(self, figure: Figure, *, keep: int = 8, compress_level: int = 1) -> None:
        if not isinstance(figure.canvas, FigureCanvasAgg):
            FigureCanvasAgg(figure)
        self.figure = figure
        self.keep = keep
        self.compress_level = compress_level
        self._backgrounds: OrderedDict[tuple, Any] = OrderedDict()
        self.full_draws = 0
        self.blits = 0
        self.last_full = False

    def invalidate(self) -> None:
        self._backgrounds.clear()

    def render(self, *, full: bool = False) -> bytes:
        """The figure as it is now, as PNG bytes (``full=True``: draw the background again)."""
        fig, canvas = self.figure, self.figure.canvas
        dynamic = dynamic_artists(fig)
        moving = [a for arts in dynamic.values() for a in arts]
        key = background_key(fig, {id(a) for a in moving})
        background = None if full else self._backgrounds.get(key)
        drew = background is None
        if drew:
            with _animated(moving):
                canvas.draw()
            background = self._backgrounds[key] = canvas.copy_from_bbox(fig.bbox)
            while len(self._backgrounds) > self.keep:
                self._backgrounds.popitem(last=False)     # the least recently used first
        else:
            self._backgrounds.move_to_end(key)
            canvas.restore_region(background)
        for ax, arts in dynamic.items():
            for a in arts:
                ax.draw_artist(a)
        self.last_full = drew
        self.full_draws += drew
        self.blits += not drew
        return png_bytes(np.asarray(canvas.buffer_rgba()), self.compress_level)
