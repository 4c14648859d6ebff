"""Communication pictures: bytes per GPU per step by dimension and collective, time per link tier.

The communication report (``parallel_lab.comm.report``) drawn two ways: bytes one GPU sends per step,
one stacked bar per parallel dimension split by collective kind (:func:`draw_comm_bytes`, the bar's
height is ``per_step_bytes[dim]``); and the time of each dimension's collectives per step under the
alpha-beta model, coloured by the link tier its group lands on (:func:`draw_comm_time`).

The bars carry ``gid`` ``"<dim>:<kind>"`` (or ``"<dim>"``) so that tests read them back against the
report. Axis units follow the value: B ... GB per step, µs ... s per step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from ...quantities import TIME_UNITS, fmt_bytes, fmt_seconds
from ..palette import COLLECTIVE_COLORS, DIM_COLORS, GHOST, TIER_COLORS
from .base import chart_on, empty_bars, field, new_figure, set_ticks, set_title, sticky_ceil, unit_axis, value_labels


def _collective_rows(report: Any) -> list[dict[str, Any]]:
    rows = []
    for c in field(report, "collectives") or []:
        rows.append({k: field(c, k) for k in ("dim", "kind", "message_bytes", "group_size", "count",
                                                "wire_bytes", "tier")})
    return rows


def draw_comm_bytes(ax: Axes, report: Any, *, title: str | None = None) -> dict[str, float]:
    """Bytes one GPU sends per step, one stacked bar per dimension, split by collective kind.

    Per dimension the bar's height is the report's ``per_step_bytes[dim]``. When the report lists its
    collectives with ``wire_bytes`` (bytes sent for all ``count`` calls, as ``Collective.to_json`` gives
    them) and they add up to ``per_step_bytes``, the bar is split by kind; otherwise it is one colour.
    The axis unit follows its end (B ... GB). Returns ``{dim: bytes}``. Updates an earlier call on ``ax``
    in place when dimensions and kinds match.
    """
    per_dim = {d: float(v) for d, v in (field(report, "per_step_bytes") or {}).items()}
    dims = list(per_dim)
    by_kind: dict[str, dict[str, float]] = {}
    for r in _collective_rows(report):
        if r["dim"] in per_dim and r["wire_bytes"] is not None:
            by_kind.setdefault(r["kind"], {}).setdefault(r["dim"], 0.0)
            by_kind[r["kind"]][r["dim"]] += float(r["wire_bytes"])
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
            bars = empty_bars(ax, range(n), 0.6, label=kind.replace("_", "-"),
                         facecolor=COLLECTIVE_COLORS.get(kind, "#bbbbbb"), edgecolor="white", linewidth=0.5)
            series.append((bars, [kind] * n))
        if kinds:
            ax.legend(loc="upper left", fontsize=8, frameon=False, ncols=min(len(kinds), 3),
                      columnspacing=1.0, handlelength=1.2)
        else:
            bars = empty_bars(ax, range(n), 0.6)
            for b, d in zip(bars, dims, strict=True):
                b.set_facecolor(DIM_COLORS.get(d, "#bbbbbb"))
            series.append((bars, [""] * n))
        for bars, ks in series:
            for b, d, k in zip(bars, dims, ks, strict=True):
                b.set_gid(f"{d}:{k}" if k else d)
            chart.dynamic += bars
        chart.parts["series"] = [bars for bars, _ in series]
        value_labels(ax, chart, n, fontsize=8.5)
        ax.set_xlabel("parallel dimension")
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        set_ticks(ax, chart, "x", range(n), dims)
    bottoms = [0.0] * n
    for bars, kind in zip(chart.parts["series"], kinds or [None], strict=True):
        for i, (b, d) in enumerate(zip(bars, dims, strict=True)):
            h = by_kind[kind].get(d, 0.0) if kind is not None else per_dim[d]
            b.set_y(bottoms[i])
            b.set_height(h)
            bottoms[i] += h
    top = sticky_ceil(chart, "top", max([*bottoms, 1e-12]) * (1.4 if kinds else 1.18))   # legend room
    ax.set_ylim(0, top)
    unit_axis(ax, "y", "sent per GPU per step")
    ax.set_xlim(-0.5, n - 0.5)
    for x, (text, d) in enumerate(zip(chart.parts["values"], dims, strict=True)):
        text.set_position((x, per_dim[d] + top * 0.01))
        text.set_text(fmt_bytes(per_dim[d]))
    set_title(ax, title)
    return per_dim


def draw_comm_time(ax: Axes, report: Any, tiers: Mapping[str, str] | None = None, *,
                   title: str | None = None, ghost: Mapping[str, float] | None = None,
                   axis_max: float | None = None, ghost_label: str = "before") -> dict[str, float]:
    """Time per step per dimension (alpha-beta model), coloured by the link tier it lands on; the axis
    unit follows its end (µs, ms, s).

    ``tiers`` maps a dimension to its tier's label (e.g. ``{"tp": "nvlink4 450 GB/s"}``); without it the
    report's ``tiers`` field is used when present. Returns ``{dim: seconds}``. The tiers' legend sits in a
    band kept free below the bars. Updates an earlier call on ``ax`` in place when the dimensions match.
    ``ghost`` (seconds by dimension, e.g. before a toggle) draws those bars as dashed outlines and writes
    the ratio beside a bar that differs ("x7.6"), the legend naming it ``ghost_label``; ``axis_max``
    (seconds) keeps the axis wide enough for both states, so a toggle moves bars, not the axis.
    """
    times = {d: float(v) for d, v in (field(report, "time_s") or {}).items()}
    tiers = dict(tiers or field(report, "tiers") or {})
    dims = list(times)
    n = len(dims)
    tier_names = list(dict.fromkeys(str(tiers.get(d, "?")) for d in dims))
    color = {t: TIER_COLORS[i % len(TIER_COLORS)] for i, t in enumerate(tier_names)}
    chart, same = chart_on(ax, "comm_time", (tuple(dims), bool(tiers)))
    if not same:
        ghosts = empty_bars(ax, range(n), 0.6, horizontal=True, facecolor="none", edgecolor=GHOST,
                            linestyle="--", linewidth=1.2, zorder=2.5)
        bars = empty_bars(ax, range(n), 0.6, horizontal=True)
        for b, g, d in zip(bars, ghosts, dims, strict=True):
            b.set_gid(d)
            g.set_gid(f"ghost:{d}")
        chart.parts["bars"], chart.parts["ghosts"] = bars, ghosts
        chart.dynamic += bars + ghosts
        chart.parts["values"] = [ax.text(0.0, y, "", va="center", fontsize=8.5) for y in range(n)]
        chart.dynamic += chart.parts["values"]
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
        set_ticks(ax, chart, "y", range(n), dims)
    ms = [times[d] for d in dims]                              # seconds
    for b, d, w in zip(chart.parts["bars"], dims, ms, strict=True):
        b.set_width(w)
        b.set_facecolor(color[str(tiers.get(d, "?"))])
    before = {d: float(ghost[d]) for d in dims if ghost and d in ghost}
    far = max(ms + list(before.values()) + [axis_max or 0.0, 1e-9])
    right = sticky_ceil(chart, "right", far * 1.6)                   # room for the labels beside
    ax.set_xlim(0, right)
    unit_axis(ax, "x", "time per step", TIME_UNITS)
    for g, d in zip(chart.parts["ghosts"], dims, strict=True):
        g.set_width(before.get(d, 0.0))
        g.set_visible(d in before and abs(before[d] - times[d]) > 1e-12)
    for text, y, d, w in zip(chart.parts["values"], range(n), dims, ms, strict=True):
        text.set_position((max(w, before.get(d, 0.0)) + right * 0.02, y))
        ratio = w / before[d] if before.get(d) else 1.0
        text.set_text(fmt_seconds(times[d]) + (f"  x{ratio:.3g}" if abs(ratio - 1) > 1e-3 else ""))
    band = 0.0
    if tiers:
        shown = [g.get_visible() for g in chart.parts["ghosts"]]
        key = (tier_names, any(shown) and ghost_label)
        if chart.parts.get("tiers") != key:
            handles = [Patch(color=color[t], label=t) for t in tier_names]
            if any(shown):
                handles.append(Patch(facecolor="none", edgecolor=GHOST, linestyle="--", label=ghost_label))
            ax.legend(handles=handles, loc="lower right", fontsize=8, frameon=False, title="link tier",
                      title_fontsize=8)
            chart.parts["tiers"] = key
        # a band below the last bar as tall as the legend (title + one row per tier, 8 pt rows)
        fig = ax.get_figure()
        axes_pt = ax.get_position().height * fig.get_size_inches()[1] * 72 if fig else 200.0
        frac = min(0.6, (len(tier_names) + 1 + any(shown)) * 13.0 / max(axes_pt, 1.0))
        band = n * frac / (1 - frac)
    ax.set_ylim(n - 0.5 + band, -0.5)                         # first dimension on top
    set_title(ax, title)
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


