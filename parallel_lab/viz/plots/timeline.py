"""Pipeline timelines: one row per rank, forward / backward / weight-gradient boxes, idle bands.

A pipeline schedule as a timeline: one row per rank, forward / backward / weight-gradient actions as
coloured boxes on a hatched idle band, so that the bubble is what the eye sees. Simulated timelines
(``parallel_lab.simulate``) and measured ones (``parallel-lab run --json``'s ``pipeline.timeline``, or
``distributed.instruments.Span`` records) go through :func:`timeline_rows` to the same
``(rank, start, end, kind, microbatch, chunk)`` rows.

:func:`timeline_figures` gives a timeline's idle fraction and bubble ratio with the simulator's
definitions: over the window W, ``1 - sum(busy) / (ranks * W)`` and ``(W - busiest) / busiest``.
Boxes are drawn as one path collection per kind (thousands of boxes in one draw call).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.collections import PathCollection
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.patches import Patch
from matplotlib.path import Path
from matplotlib.textpath import TextPath
from matplotlib.transforms import Affine2D

from parallel_lab.simulate import Interval, timeline_stats

from ..palette import IDLE, IDLE_EDGE, KIND_COLORS, KIND_LABELS
from .base import CHART_ATTR, chart_on, field, lighten, new_figure, set_title, sticky_ceil


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
    """Normalise a timeline to ``[(rank, start, end, kind, microbatch, chunk)]`` of its compute intervals.

    Accepts the one interval type, ``simulate.Interval`` (the simulator's and the measured ones), its JSON
    rows (``Interval.as_row``: ``parallel-lab bubble --json``'s and ``run --json``'s ``timeline``), a mapping of
    its fields, or anything holding a ``timeline`` (``simulate.SimResult``, the JSON dictionary).
    """
    if isinstance(timeline, Mapping):
        timeline = timeline.get("timeline", [])
    elif hasattr(timeline, "timeline"):
        timeline = timeline.timeline
    rows = []
    for r in timeline or []:
        if isinstance(r, Interval):
            i = r
        elif isinstance(r, Mapping):
            i = Interval(**{k: r[k] for k in r if k in Interval.__dataclass_fields__})
        else:
            i = Interval.from_row(r)
        if i.kind == "compute":
            rows.append((int(i.rank), float(i.t_start), float(i.t_end), str(i.name), int(i.micro_batch or 0),
                         int(i.chunk or 0)))
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


@dataclass(frozen=True)
class _Prepared:
    """What :func:`draw_timeline` derives from a timeline before drawing: the data side of the chart."""

    ranks: list[int]
    makespan: float
    busy: dict[int, float]
    idle: list[Path]
    kinds: list[tuple[str, list[Path], list[Any]]]      # (kind, one path per (chunk, rank), their colours)
    max_chunk: int
    dense: bool
    labels: list[tuple[float, float, int, str]]        # (centre, width, rank, micro-batch) per box
    n_rows: int


_HEIGHT = 0.72                                          # of a box, in rows


def _prepare(timeline: Any, time_scale: float, step_time: float | None,
             window: tuple[float, float] | None = None, origin: float = 0.0) -> _Prepared:
    rows = timeline_rows(timeline)
    ranks = sorted({r[0] for r in rows})
    t0 = min((r[1] for r in rows), default=0.0)
    makespan = (max([r[2] for r in rows] + [t0 + (step_time or 0.0)], default=0.0) - t0) * time_scale
    if window is not None:                              # only the boxes a zoomed axis shows
        lo, hi = window
        rows = [r for r in rows if (r[2] - t0) * time_scale >= lo and (r[1] - t0) * time_scale <= hi]

    def row(spans: Sequence[tuple[float, float]], rank: int) -> Path:
        """The ``(start, width)`` boxes of one row as one path of closed rectangles."""
        return _boxes_path(spans, rank - _HEIGHT / 2, rank + _HEIGHT / 2)

    busy: dict[int, float] = dict.fromkeys(ranks, 0.0)
    groups: dict[tuple[str, int, int], list[tuple[float, float]]] = {}
    labels = []
    for rank, start, end, kind, mb, chunk in rows:
        key = kind_key(kind)
        if key == "other" and end <= start:
            continue
        span = ((start - t0) * time_scale - origin, (end - start) * time_scale)
        groups.setdefault((key, chunk, rank), []).append(span)
        busy[rank] += (end - start) * time_scale
        if key != "other":
            labels.append((span[0] + span[1] / 2, span[1], rank, str(mb)))
    max_chunk = max((c for _, c, _ in groups), default=0)
    kinds = []
    for kind in ("F", "B", "W", "other"):
        mine = sorted((c, r) for k, c, r in groups if k == kind)
        if mine:                                       # one path per (chunk, rank), later chunks lighter
            colors = [lighten(KIND_COLORS[kind], 0.45 * c / max(max_chunk, 1)) for c, _ in mine]
            kinds.append((kind, [row(groups[kind, c, r], r) for c, r in mine], colors))
    return _Prepared(ranks, makespan, busy, [row([(-origin, makespan)], rank) for rank in ranks], kinds, max_chunk,
                     len(rows) > 60 * max(len(ranks), 1), labels, len(rows))


def draw_timeline(ax: Axes, timeline: Any, *, title: str | None = None, time_unit: str = "time",
                  time_scale: float = 1.0, label_microbatches: bool | None = None,
                  step_time: float | None = None, sticky: bool = False,
                  memo: dict[Any, Any] | None = None, window: tuple[float, float] | None = None,
                  origin: float = 0.0, legend: bool = True) -> dict[str, Any]:
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
    ``window``: ``(start, end)`` (scaled): draw only the boxes in it (an axis zoomed on part of the step);
    ``origin`` (scaled) is drawn at x = 0 (the step's end, for a time axis counting to it). ``legend=False``:
    no legend (the caller draws one for several axes).
    Updates an earlier timeline on ``ax`` in place when the ranks match. ``memo``: a dictionary the caller
    keeps for timelines it does not change, so that drawing one of them again skips building its boxes
    (an explorer toggling between the schedules of two plans); a timeline is found there by identity.
    """
    key = (id(timeline), time_scale, step_time, window, origin)
    hit = memo.get(key) if memo is not None else None
    if hit is not None and hit[0] is timeline:
        prep = hit[1]
    else:
        prep = _prepare(timeline, time_scale, step_time, window, origin)
        if memo is not None:
            memo[key] = (timeline, prep)
    ranks, makespan = prep.ranks, prep.makespan
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

    collection("idle", prep.idle, facecolor=IDLE, edgecolor=IDLE_EDGE, hatch="////", linewidth=0.0)
    max_chunk = prep.max_chunk
    for kind, paths, colors in prep.kinds:
        collection(kind, paths, facecolor=colors, edgecolor="white", linewidth=0.0 if prep.dense else 0.6)
    right = sticky_ceil(chart, "right", makespan * 1.01) if sticky else (makespan * 1.01 or 1.0)
    if label_microbatches is None:
        label_microbatches = 0 < prep.n_rows <= 160
    shown = []
    if label_microbatches and makespan > 0:
        min_w = right / 70
        shown = [(x, rank, mb) for x, width, rank, mb in prep.labels if width >= min_w]
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
    if legend:
        _kinds_legend(ax, chart, present, max_chunk)
    set_title(ax, title)
    return {"ranks": ranks, "makespan": makespan, "busy": dict(prep.busy), "kinds": present,
            "max_chunk": max_chunk}


def _kinds_legend(ax: Axes, chart: Any, present: Sequence[str], max_chunk: int, x: float = 1.005) -> None:
    """The kinds' legend right of ``ax`` (rebuilt only when the kinds or chunks shown change)."""
    legend_key = (tuple(present), max_chunk)
    if chart.parts.get("legend") == legend_key:
        return
    handles = [Patch(facecolor=KIND_COLORS[k], label=KIND_LABELS[k]) for k in present]
    if 0 < max_chunk <= 3:              # chunk 0 is the kind's own colour: one colour, one label
        handles += [Patch(facecolor=lighten(KIND_COLORS["F"], 0.45 * c / max_chunk), label=f"chunk {c}")
                    for c in range(1, max_chunk + 1)]
    elif max_chunk > 3:
        handles.append(Patch(facecolor=lighten(KIND_COLORS["F"], 0.45),
                             label=f"lighter: later chunk (v={max_chunk + 1})"))
    handles.append(Patch(facecolor=IDLE, edgecolor=IDLE_EDGE, hatch="////", label="idle"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(x, 1.0), fontsize=8, frameon=False)
    chart.parts["legend"] = legend_key


#: More micro-batches than this (times the interleave) draw the timeline's start and end, not a moire.
ZOOM_MICROBATCHES = 24


def needs_ends(stages: int, microbatches: int, interleave: int = 1) -> bool:
    """Whether a schedule has too many boxes for one readable row per rank: :func:`draw_timeline_ends` then."""
    return stages > 1 and microbatches * max(interleave, 1) > ZOOM_MICROBATCHES


def draw_timeline_ends(start: Axes, end: Axes, sim: Any, stages: int, *, title: str, time_unit: str = "time",
                       memo: dict[Any, Any] | None = None) -> None:
    """A long schedule as two windows side by side: the step's start (warm-up into the steady state) on
    ``start`` and its end (the steady state into the cool-down) on ``end``, each about ``2 p + 6``
    micro-batches' compute wide, so each box is wide enough to see (one legend, right of the pair).
    ``sim``: a ``simulate.SimResult`` (its ``step_time`` closes the window)."""
    total = sim.step_time
    window = min(total / 2, 3.0 * (2 * stages + 6))
    a = draw_timeline(start, sim, time_unit=f"{time_unit}: the start, warm-up", step_time=total, title=title,
                      memo=memo, window=(0.0, window), legend=False)
    b = draw_timeline(end, sim, time_unit="... the end, cool-down: time to the step's end", step_time=total,
                      title=f"(the step is {total:g})", memo=memo, window=(total - window, total), origin=total,
                      legend=False)
    start.set_xlim(0, window)                           # both axes stay put while m changes: no new background
    end.set_xlim(-window, 0)
    if len(end.get_yticks()):
        end.set_yticks([])
    kinds = [k for k in ("F", "B", "W") if k in a["kinds"] or k in b["kinds"]]
    _kinds_legend(end, getattr(end, CHART_ATTR), kinds, max(a["max_chunk"], b["max_chunk"]), x=1.01)


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
    """``idle_fraction`` and ``bubble_ratio`` of a timeline: ``simulate.timeline_stats``, the one definition
    (the simulator's and the pipeline report's), over ``[0, step_time]`` (default: first start to last end)."""
    rows = timeline_rows(timeline)
    if not rows:
        return {"idle_fraction": 0.0, "bubble_ratio": 0.0, "window": 0.0}
    intervals = [Interval(rank, "compute", kind, start, end, mb, chunk) for rank, start, end, kind, mb, chunk in rows]
    stats = timeline_stats(intervals, 0.0, step_time) if step_time is not None else timeline_stats(intervals)
    return {"idle_fraction": stats.idle_fraction, "bubble_ratio": stats.bubble_ratio, "window": stats.step_time}


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


