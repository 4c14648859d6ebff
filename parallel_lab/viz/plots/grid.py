"""The 4-D process grid: where each rank sits, which groups it belongs to, and what each link tier carries.

Ranks are placed as ``arange(world).view(dp, pp, cp, tp)`` (``parallel_lab.comm.rank_of``: tp varies
fastest, so a TP group is consecutive ranks and stays inside a node when tp <= GPUs per node). The
picture draws one square per rank, a row per node (rank // GPUs per node), each square labelled with its
rank and its (dp, pp, cp, tp) coordinates, coloured by its group along one dimension; a group whose ranks
span more than one node (``parallel_lab.comm.tier_of`` gives the inter-node tier) is drawn with a red
border: its collectives cross the network. Beside it: the bytes one GPU sends per step on each link tier,
split by dimension (``parallel_lab.comm.report``).

Squares carry ``gid = "rank:<r>"`` and texts ``gid = "coords:<r>"`` so that tests read them back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from matplotlib.axes import Axes
from matplotlib.patches import Patch, Rectangle

from ...mesh import node_count, node_of
from ...quantities import fmt_bytes
from ..palette import DIM_COLORS, GROUP_COLORS, MARK_COLORS, TIER_COLORS, text_on
from .base import chart_on, empty_bars, set_ticks, set_title, unit_axis

#: A crossing group's border (groups are coloured by ``palette.GROUP_COLORS``).
CROSSING = MARK_COLORS["crossing"]


def draw_grid(ax: Axes, coords: Mapping[int, tuple[int, int, int, int]], groups: Sequence[Sequence[int]],
              crossing: Sequence[bool], gpus_per_node: int, *, title: str | None = None) -> dict[int, int]:
    """One square per rank (a row per node), coloured by group; crossing groups get a red border.

    ``coords[r]`` is rank r's (dp, pp, cp, tp); ``groups`` the groups of one dimension (lists of ranks);
    ``crossing[i]`` whether group i spans nodes. Returns ``{rank: group index}``.
    """
    world = len(coords)
    rows = node_count(world, gpus_per_node)
    chart, same = chart_on(ax, "grid", (world, gpus_per_node))
    if not same:
        squares, labels = [], []
        for r in range(world):
            x, y = r % gpus_per_node, node_of(r, gpus_per_node)             # GPU in its node (LOCAL_RANK), node
            sq = Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, gid=f"rank:{r}", linewidth=1.0)
            ax.add_patch(sq)
            squares.append(sq)
            labels.append(ax.text(x + 0.5, y + 0.5, "", ha="center", va="center", gid=f"coords:{r}",
                                  fontsize=8))
        chart.parts.update(squares=squares, labels=labels)
        chart.dynamic += [*squares, *labels]
        ax.set_xlim(0, gpus_per_node)
        ax.set_ylim(rows, 0)
        ax.set_aspect("equal", adjustable="box")
        set_ticks(ax, chart, "x", [i + 0.5 for i in range(gpus_per_node)], [str(i) for i in range(gpus_per_node)])
        set_ticks(ax, chart, "y", [i + 0.5 for i in range(rows)], [f"node {i}" for i in range(rows)])
        ax.set_xlabel("GPU in the node")
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
    owner = {r: i for i, g in enumerate(groups) for r in g}
    for r, (sq, text) in enumerate(zip(chart.parts["squares"], chart.parts["labels"], strict=True)):
        g = owner[r]
        sq.set_facecolor(GROUP_COLORS[g % len(GROUP_COLORS)])
        sq.set_edgecolor(CROSSING if crossing[g] else "white")
        sq.set_linewidth(2.0 if crossing[g] else 1.0)
        text.set_text(f"{r}\n" + ",".join(str(c) for c in coords[r]))
        text.set_color(text_on(GROUP_COLORS[g % len(GROUP_COLORS)]))
    set_title(ax, title)
    return owner


def draw_tier_bytes(ax: Axes, per_tier: Mapping[str, Mapping[str, float]], tier_order: Sequence[str], *,
                    title: str | None = None) -> dict[str, float]:
    """Bytes one GPU sends per step on each link tier (a bar per tier, in ``tier_order``), stacked by
    dimension. Returns ``{tier: bytes}``. Bars carry ``gid = "<tier>:<dim>"``."""
    dims = [d for d in DIM_COLORS if any(d in v for v in per_tier.values())]
    n = len(tier_order)
    chart, same = chart_on(ax, "tier_bytes", (tuple(tier_order), tuple(dims)))
    if not same:
        series = {}
        for d in dims:
            bars = empty_bars(ax, range(n), 0.6, label=d, facecolor=DIM_COLORS[d], edgecolor="white")
            for b, t in zip(bars, tier_order, strict=True):
                b.set_gid(f"{t}:{d}")
            series[d] = bars
            chart.dynamic += bars
        chart.parts["series"] = series
        chart.parts["values"] = [ax.text(x, 0.0, "", ha="center", va="bottom", fontsize=8) for x in range(n)]
        chart.dynamic += chart.parts["values"]
        if dims:
            ax.legend(loc="upper right", fontsize=8, frameon=False, title="dimension", title_fontsize=8)
        ax.set_xlim(-0.5, n - 0.5)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        for label, color in zip(ax.get_xticklabels(), TIER_COLORS, strict=False):
            label.set_color(color)
    totals = [0.0] * n
    for d, bars in chart.parts["series"].items():
        for i, (b, t) in enumerate(zip(bars, tier_order, strict=True)):
            h = float(per_tier.get(t, {}).get(d, 0.0))
            b.set_y(totals[i])
            b.set_height(h)
            totals[i] += h
    top = max(totals + [1.0]) * 1.35
    ax.set_ylim(0, top)
    unit_axis(ax, "y", "sent per GPU per step")
    for x, (text, t) in enumerate(zip(chart.parts["values"], totals, strict=True)):
        text.set_position((x, t + top * 0.01))
        text.set_text(fmt_bytes(t))
    set_ticks(ax, chart, "x", range(n), list(tier_order))
    for label, i in zip(ax.get_xticklabels(), range(n), strict=False):
        label.set_color(TIER_COLORS[i % len(TIER_COLORS)])
    set_title(ax, title)
    return dict(zip(tier_order, totals, strict=True))


def grid_legend_handles() -> list[Patch]:
    return [Patch(facecolor="white", edgecolor=CROSSING, linewidth=2.0, label="group spans nodes"),
            Patch(facecolor="white", edgecolor="#c8c8c8", label="cell: rank, then its (dp, pp, cp, tp) coordinates")]
