"""PNG frames of a figure that changes a little at a time: what makes an explorer's redraw cheap.

Matplotlib draws a figure from scratch on every ``savefig``, most of it text. An explorer's update changes a
few bars and numbers, so :class:`Frames` blits with Agg: the charts say which artists an update moves
(``Chart.dynamic``); the rest (the *background*: axes, ticks, titles, legends) is drawn once and kept in
tiles keyed by what they show (:func:`figure_key`, :func:`axes_key`), and a frame is the background with
the dynamic artists drawn over it, encoded as PNG. Fresh and cached frames are made the same way, so they
are the same picture pixel for pixel (``tests/viz/test_frames.py`` also checks them against matplotlib's
own drawing). :class:`TextStampRenderer` renders each distinct text once and stamps its pixels, at most
half a pixel from where Agg would put it. The rules a chart must follow: docs/app.md.
"""

from __future__ import annotations

import contextlib
import math
import struct
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.axis import Axis
from matplotlib.backends.backend_agg import FigureCanvasAgg, RendererAgg
from matplotlib.figure import Figure
from matplotlib.legend import Legend
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle
from matplotlib.spines import Spine
from matplotlib.text import Text
from matplotlib.transforms import Bbox

from .plots.base import CHART_ATTR

#: Rendered texts kept per figure (each a few kB).
TEXT_STAMPS = 2048


# --------------------------------------------------------------------------------------------------
# text drawn once, stamped afterwards
# --------------------------------------------------------------------------------------------------

class TextStampRenderer(RendererAgg):
    """Agg, with every plain text rendered once into a small RGBA image and stamped from then on.

    ``draw_text`` renders a text it has not seen (same string, font properties, angle, colour, dpi) on a
    transparent scratch canvas with Agg itself, crops it, and keeps it in ``stamps`` (shared by the
    renderers of one canvas); each later draw is one ``draw_image`` at the text's position rounded to
    whole pixels, clipped like the text would be. Mathtext goes the usual way.
    """

    def __init__(self, width: float, height: float, dpi: float, stamps: OrderedDict[Any, Any]) -> None:
        super().__init__(width, height, dpi)
        self.stamps = stamps

    def draw_text(self, gc: Any, x: float, y: float, s: str, prop: Any, angle: float, ismath: Any = False,
                  mtext: Any = None) -> None:
        if ismath or not s.strip():
            super().draw_text(gc, x, y, s, prop, angle, ismath, mtext)
            return
        key = (s, tuple(prop.get_family()), prop.get_style(), prop.get_variant(), prop.get_weight(),
               prop.get_stretch(), prop.get_size_in_points(), prop.get_file(), angle, self.dpi,
               tuple(gc.get_rgb()), gc.get_alpha(), gc.get_antialiased())
        stamp = self.stamps.get(key)
        if stamp is not None:
            self.stamps.move_to_end(key)                 # least recently used texts go first
        else:
            stamp = self.stamps[key] = self._render_stamp(gc, s, prop, angle, mtext)
            while len(self.stamps) > TEXT_STAMPS:
                self.stamps.popitem(last=False)
        image, dx, dy = stamp
        if image is None:
            return
        stamp_gc = self.new_gc()
        stamp_gc.copy_properties(gc)                     # the text's clipping; its alpha is in the pixels
        stamp_gc.set_alpha(1.0)
        # Agg's text y runs downwards (flipy); draw_image wants the lower left corner, y upwards
        self.draw_image(stamp_gc, round(x) + dx, round(self.height - (round(y) + dy)), image)
        stamp_gc.restore()

    def _render_stamp(self, gc: Any, s: str, prop: Any, angle: float, mtext: Any) -> tuple[Any, int, int]:
        """``(rgba rows bottom-up, dx, dy)``: the cropped pixels of ``s`` drawn at the origin of a scratch
        canvas, with the offsets of its left column and bottom row from that origin."""
        w, h, d = self.get_text_width_height_descent(s, prop, False)
        half = int(math.ceil(max(w, h + d))) + 4              # room for any angle around the origin
        scratch = RendererAgg(2 * half, 2 * half, self.dpi)
        scratch_gc = scratch.new_gc()
        scratch_gc.copy_properties(gc)
        scratch_gc.set_clip_rectangle(None)
        scratch_gc.set_clip_path(None)
        RendererAgg.draw_text(scratch, scratch_gc, half, half, s, prop, angle, False, mtext)
        scratch_gc.restore()
        pixels = np.asarray(scratch.buffer_rgba())
        alpha = pixels[:, :, 3]
        rows, cols = np.flatnonzero(alpha.any(axis=1)), np.flatnonzero(alpha.any(axis=0))
        if not len(rows):
            return None, 0, 0
        r0, r1, c0, c1 = rows[0], rows[-1] + 1, cols[0], cols[-1] + 1
        return np.ascontiguousarray(pixels[r0:r1, c0:c1][::-1]), int(c0 - half), int(r1 - half)


class StampCanvas(FigureCanvasAgg):
    """An Agg canvas whose renderer is a :class:`TextStampRenderer`; ``stamps`` (the rendered texts) may be
    shared by several canvases, e.g. the figures of one explorer."""

    def __init__(self, figure: Figure, stamps: OrderedDict[Any, Any] | None = None) -> None:
        super().__init__(figure)
        self.stamps: OrderedDict[Any, Any] = OrderedDict() if stamps is None else stamps

    def get_renderer(self) -> RendererAgg:
        w, h = self.get_width_height(physical=True)
        key = (w, h, self.figure.dpi)
        if getattr(self, "_stamp_key", None) != key:
            self.renderer = TextStampRenderer(w, h, self.figure.dpi, self.stamps)
            self._stamp_key = key
        return self.renderer


# --------------------------------------------------------------------------------------------------
# what is static, what moves
# --------------------------------------------------------------------------------------------------

def _artist_key(a: Artist) -> Any:
    """What a static artist shows, for :func:`axes_key` (identity plus the properties the charts set)."""
    if isinstance(a, Axis):                             # ticks follow from limits, locator and formatter
        loc, fmt = a.get_major_locator(), a.get_major_formatter()
        func = getattr(fmt, "func", None)
        return (id(a), a.get_visible(), tuple(a.get_view_interval()), a.get_scale(), a.label.get_text(),
                type(loc).__name__, tuple(getattr(loc, "locs", ())), type(fmt).__name__,
                tuple(getattr(fmt, "seq", ())), getattr(func, "__code__", None))
    if isinstance(a, Text):
        return (id(a), a.get_visible(), a.get_text(), a.get_position(), a.get_color(), a.get_fontweight(),
                a.get_fontsize(), a.get_rotation())
    if isinstance(a, Legend):                           # by content: a legend made again keeps the key
        texts = tuple(t.get_text() for t in a.get_texts())
        colors = tuple(str(getattr(h, "get_facecolor", str)()) for h in a.legend_handles)
        return ("legend", a.get_visible(), a.get_title().get_text(), texts, colors)
    if isinstance(a, Line2D):
        return (id(a), a.get_visible(), a.get_xydata().tobytes())
    if isinstance(a, Rectangle):
        return (id(a), a.get_visible(), a.get_xy(), a.get_width(), a.get_height(), a.get_facecolor())
    return (id(a), a.get_visible())


def axes_key(ax: Axes, dynamic: set[int]) -> tuple:
    """A key of everything ``ax`` shows that is not in ``dynamic`` (artists' ids): its place, limits,
    scales, ticks, titles, labels, legend and static artists. Same key, same picture of the axes."""
    chart = getattr(ax, CHART_ATTR, None)
    return (id(ax), ax.get_position().bounds, ax.axison, ax.get_visible(), ax.get_xlim(), ax.get_ylim(),
            (chart.kind, chart.shape) if chart else None,
            *(_artist_key(a) for a in ax.get_children()
              if id(a) not in dynamic and a is not ax.patch and not isinstance(a, Spine)))


def figure_key(fig: Figure) -> tuple:
    """A key of what ``fig`` shows outside its axes: size, dpi, where the axes are, its legends and texts."""
    places = tuple((id(ax), ax.get_position().bounds) for ax in fig.axes)
    others = (_artist_key(a) for a in (*fig.legends, *fig.texts))
    return (tuple(fig.get_size_inches()), fig.dpi, places, *others)


def dynamic_artists(fig: Figure) -> dict[Axes, list[Artist]]:
    """The artists the charts on ``fig`` move on an update, per axes in drawing (z) order. The spines of
    those axes come with them: bars start on the axis line, which is drawn over them."""
    out: dict[Axes, list[Artist]] = {}
    for ax in fig.axes:
        chart = getattr(ax, CHART_ATTR, None)
        arts = list(chart.dynamic) if chart is not None else []
        if arts and ax.axison and ax.get_frame_on():
            arts += ax.spines.values()
        out[ax] = sorted(arts, key=lambda a: a.get_zorder())
    return out


# --------------------------------------------------------------------------------------------------
# frames
# --------------------------------------------------------------------------------------------------

Rect = tuple[int, int, int, int]


def _overlap(a: Rect, b: Rect) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


class Frames:
    """PNG frames of one figure, redrawing only what changed since an earlier frame (blitting).

    The background is kept in pieces: the figure without its axes (legends, suptitle), and one *tile* per
    axes (the axes' static part over that, cropped to the axes' tight box), each under its key
    (:func:`figure_key`, :func:`axes_key`). A change of one axes' limits or title thus redraws that axes
    only. The last ``keep`` tiles per axes and ``keep_bases`` figure backgrounds are kept (a background is
    ``4 * width * height`` bytes, 1.5 MB at 960 x 390; a tile a part of it). If two axes' tiles overlap (a
    crowded layout), frames fall back to one background for the whole figure, still cached by key.

    Gives the figure a :class:`StampCanvas` (with the rendered texts ``stamps``, if given: figures that
    show the same labels can share them). :meth:`render` returns the figure as it is now;
    ``full_draws`` counts frames that drew some background, ``blits`` frames made from cached pieces
    only; ``last_full`` says which the last one was. Call :meth:`invalidate` after rebuilding the axes.
    """

    def __init__(self, figure: Figure, *, keep: int = 6, keep_bases: int = 2, compress_level: int = 1,
                 stamps: OrderedDict[Any, Any] | None = None) -> None:
        StampCanvas(figure, stamps)
        self.figure = figure
        self.keep = keep
        self.keep_bases = keep_bases
        self.compress_level = compress_level
        self.tiled = True
        self._pieces: OrderedDict[tuple, tuple[Any, Rect]] = OrderedDict()
        self.full_draws = 0
        self.blits = 0
        self.last_full = False

    def invalidate(self) -> None:
        self._pieces.clear()

    def render(self, *, full: bool = False) -> bytes:
        """The figure as it is now, as PNG bytes (``full=True``: draw all of the background again, e.g. to
        check that the cached pieces were right)."""
        fig, canvas = self.figure, self.figure.canvas
        dynamic = dynamic_artists(fig)
        ids = {id(a) for arts in dynamic.values() for a in arts}
        if full:
            self._pieces.clear()
        drew = self._tiles(dynamic, ids) if self.tiled else self._whole(dynamic, ids)
        renderer = canvas.get_renderer()
        for arts in dynamic.values():
            for a in arts:
                a.draw(renderer)
        self.last_full = drew
        self.full_draws += drew
        self.blits += not drew
        return png_bytes(np.asarray(canvas.buffer_rgba()), self.compress_level)

    def _piece(self, key: tuple, draw: Any) -> tuple[tuple[Any, Rect], bool]:
        """The cached piece for ``key`` restored onto the canvas, or ``draw()``'s new one (drawn there)."""
        piece = self._pieces.get(key)
        if piece is not None:
            self._pieces.move_to_end(key)
            self.figure.canvas.restore_region(piece[0])
            return piece, False
        piece = self._pieces[key] = draw()
        kind = key[0]                                    # "base", "axes" or "whole"
        limit = self.keep * len(self.figure.axes) if kind == "axes" else self.keep_bases
        same = [k for k in self._pieces if k[0] == kind]
        for k in same[: max(0, len(same) - limit)]:      # the least recently used first
            del self._pieces[k]
        return piece, True

    def _tiles(self, dynamic: dict[Axes, list[Artist]], ids: set[int]) -> bool:
        fig, canvas = self.figure, self.figure.canvas
        fkey = figure_key(fig)

        def draw_base() -> tuple[Any, Rect]:
            shown = [ax.get_visible() for ax in fig.axes]
            for ax in fig.axes:
                ax.set_visible(False)
            try:
                canvas.draw()
            finally:
                for ax, v in zip(fig.axes, shown, strict=True):
                    ax.set_visible(v)
            return canvas.copy_from_bbox(fig.bbox), (0, 0, 0, 0)

        _, drew = self._piece(("base", fkey), draw_base)
        renderer = canvas.get_renderer()
        rects: list[Rect] = []
        for ax, arts in dynamic.items():
            def draw_tile(ax: Axes = ax, arts: list[Artist] = arts) -> tuple[Any, Rect]:
                with _animated(arts):
                    ax.apply_aspect()
                    ax.draw(renderer)
                    box = ax.get_tightbbox(renderer) or ax.bbox
                w, h = canvas.get_width_height(physical=True)
                rect = (max(0, math.floor(box.x0) - 1), max(0, math.floor(box.y0) - 1),
                        min(w, math.ceil(box.x1) + 1), min(h, math.ceil(box.y1) + 1))
                return canvas.copy_from_bbox(Bbox.from_extents(*rect)), rect

            (_, rect), new = self._piece(("axes", fkey, axes_key(ax, ids)), draw_tile)
            drew |= new
            if any(_overlap(rect, other) for other in rects):
                self.tiled = False                       # crowded: one background for the whole figure
                self._pieces.clear()
                return self._whole(dynamic, ids)
            rects.append(rect)
        return drew

    def _whole(self, dynamic: dict[Axes, list[Artist]], ids: set[int]) -> bool:
        fig, canvas = self.figure, self.figure.canvas

        def draw_all() -> tuple[Any, Rect]:
            with _animated([a for arts in dynamic.values() for a in arts]):
                canvas.draw()
            return canvas.copy_from_bbox(fig.bbox), (0, 0, 0, 0)

        key = ("whole", figure_key(fig), *(axes_key(ax, ids) for ax in fig.axes))
        return self._piece(key, draw_all)[1]


@contextlib.contextmanager
def _animated(artists: list[Artist]) -> Iterator[None]:
    """Agg's draw leaves animated artists out: the background without the dynamic artists."""
    for a in artists:
        a.set_animated(True)
    try:
        yield
    finally:
        for a in artists:
            a.set_animated(False)


def png_bytes(rgba: np.ndarray, compress_level: int = 1) -> bytes:
    """An RGB PNG of an ``(h, w, 4)`` uint8 image (alpha dropped: the figure is opaque).

    The PNG format (RFC 2083) at its simplest: no row filter and zlib at level 1. On a chart (long runs of
    the same colour) that is as small as Pillow's adaptive filters (~50 kB at 960 x 390) in half the time.
    """
    h, w = rgba.shape[:2]
    rows = np.empty((h, 1 + 3 * w), np.uint8)
    rows[:, 0] = 0                                           # filter type 0 (none) for every row
    rows[:, 1:] = rgba[:, :, :3].reshape(h, 3 * w)

    def chunk(tag: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body))

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)    # 8 bits per channel, RGB, no interlace
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(rows.tobytes(), compress_level)) + chunk(b"IEND", b""))
