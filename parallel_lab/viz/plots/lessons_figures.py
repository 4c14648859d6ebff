"""The lessons' central pictures as static figures: plain data in, a matplotlib ``Figure`` out.

Each function draws what one lesson explains, from numbers the lesson computes with the library (the ledger's
bytes per rank, the process grid's groups, a layer's shard shapes, the simulator's bubbles), so that the
executed notebook and the docs site show it without an explorer: ZeRO's shards per rank and stage
(:func:`zero_shards_figure`), the grid's groups on nodes along every axis (:func:`grid_groups_figure`), the
column- then row-parallel MLP with its ``f`` and ``g`` (:func:`tp_split_figure`), and the pipeline bubble of
each schedule as the micro-batches grow (:func:`bubble_sweep_figure`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch, Rectangle

from ...quantities import fmt_bytes
from ..palette import CATEGORY_COLORS, INK, MARK_COLORS, RANK_COLORS
from .base import CATEGORY_LABELS, lighten, new_figure
from .grid import draw_grid, grid_legend_handles

STATE = ("parameters", "gradients", "optimizer_states")


def zero_shards_figure(per_rank: Sequence[Mapping[str, float]], sharded: Sequence[Mapping[str, bool]], dp: int,
                       *, title: str | None = None) -> Figure:
    """One panel per ZeRO stage (``per_rank[s]``: bytes per rank by state category, ``sharded[s]``: whether
    stage s shards it): a row per rank, a column per category; a full cell is a whole copy, a sharded one
    is filled only over the rank's own ``1/dp`` slice. Column headers give the bytes per rank."""
    n = len(per_rank)
    fig = new_figure((2.6 * n + 0.4, 0.45 * dp + 1.9))
    axes = fig.subplots(1, n, squeeze=False)[0]
    fig.subplots_adjust(left=0.07, right=0.99, top=1 - 0.75 / (0.45 * dp + 1.9), bottom=0.5 / (0.45 * dp + 1.9),
                        wspace=0.12)
    for s, ax in enumerate(axes):
        for j, cat in enumerate(STATE):
            color = CATEGORY_COLORS[cat]
            for r in range(dp):
                ax.add_patch(Rectangle((j + 0.05, r + 0.1), 0.9, 0.8, facecolor=lighten(color, 0.8),
                                       edgecolor="white"))
                if sharded[s][cat]:
                    ax.add_patch(Rectangle((j + 0.05 + 0.9 * r / dp, r + 0.1), 0.9 / dp, 0.8, facecolor=color,
                                           gid=f"zero{s}:{cat}:{r}"))
                else:
                    ax.add_patch(Rectangle((j + 0.05, r + 0.1), 0.9, 0.8, facecolor=color, gid=f"zero{s}:{cat}:{r}"))
            ax.text(j + 0.5, dp + 0.05, fmt_bytes(per_rank[s][cat]), ha="center", va="top", fontsize=8)
        ax.set_xlim(0, len(STATE))
        ax.set_ylim(dp + 0.5, 0)
        ax.set_xticks([j + 0.5 for j in range(len(STATE))],
                      [CATEGORY_LABELS[c].replace(" ", "\n") for c in STATE], fontsize=8)
        ax.xaxis.tick_top()
        ax.set_yticks([r + 0.5 for r in range(dp)], [f"rank {r}" for r in range(dp)] if s == 0 else [])
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
        ax.set_xlabel(f"ZeRO-{s}: {fmt_bytes(sum(per_rank[s][c] for c in STATE))} per rank", fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def grid_groups_figure(coords: Mapping[int, tuple[int, int, int, int]], groups: Mapping[str, Sequence[Sequence[int]]],
                       crossing: Mapping[str, Sequence[bool]], gpus_per_node: int, *,
                       title: str | None = None) -> Figure:
    """The grid explorer's picture once per axis (``groups[dim]``, ``crossing[dim]`` as
    :func:`~parallel_lab.viz.plots.grid.draw_grid` takes them), two panels a row."""
    dims = list(groups)
    rows = (len(dims) + 1) // 2
    nodes = -(-len(coords) // gpus_per_node)
    h = rows * (0.45 * nodes + 0.9) + 0.6
    fig = new_figure((10.0, h))
    axes = fig.subplots(rows, 2, squeeze=False).ravel()
    fig.subplots_adjust(left=0.08, right=0.98, top=1 - 0.55 / h, bottom=0.45 / h, hspace=0.35, wspace=0.15)
    for ax, d in zip(axes, dims, strict=False):
        n_cross = sum(crossing[d])
        draw_grid(ax, coords, groups[d], crossing[d], gpus_per_node,
                  title=f"{d} groups: {len(groups[d])}, {n_cross} cross nodes")
    for ax in axes[len(dims):]:
        ax.set_visible(False)
    fig.legend(handles=grid_legend_handles(), loc="lower right", fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def _box(ax, x: float, y: float, w: float, h: float, text: str, color: str, *, gid: str | None = None) -> None:
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor=INK, linewidth=0.8, gid=gid))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=7.5)


def _op(ax, x: float, y: float, name: str, forward: str, backward: str, below: float) -> None:
    ax.add_patch(FancyBboxPatch((x - 0.32, y - 0.3), 0.64, 0.6, boxstyle="round,pad=0.02",
                                facecolor=MARK_COLORS["operator_fill"], edgecolor=MARK_COLORS["operator"],
                                gid=f"op:{name}"))
    ax.text(x, y, name, ha="center", va="center", fontsize=11, fontweight="bold")
    ax.text(x, below, f"fwd: {forward}\nbwd: {backward}", ha="center", va="top", fontsize=8)


def tp_split_figure(tokens: int, hidden: int, ffn: int, tp: int, *, title: str | None = None) -> Figure:
    """The tensor-parallel MLP ``Z = act(X A) B`` on ``tp`` ranks, a row per rank: ``X [tokens, hidden]`` (whole
    on every rank) enters ``f``, the column-parallel slice ``A_r [hidden, ffn/tp]`` gives ``Y_r [tokens,
    ffn/tp]``, the row-parallel slice ``B_r [ffn/tp, hidden]`` a partial ``[tokens, hidden]`` that ``g`` sums."""
    fig = new_figure((10.0, 1.0 * tp + 1.3))
    ax = fig.add_subplot()
    fig.subplots_adjust(left=0.07, right=0.99, top=0.86, bottom=0.04)
    k = ffn // tp
    for r in range(tp):
        y = (tp - 1 - r) * 1.4
        c = RANK_COLORS[r % len(RANK_COLORS)]
        light = lighten(c, 0.6)
        ax.text(-0.2, y + 0.4, f"rank {r}", ha="right", va="center", fontsize=9)
        _box(ax, 0.0, y, 1.3, 0.8, f"X\n[{tokens}, {hidden}]", "#dddddd")
        _box(ax, 2.6, y, 1.5, 0.8, f"A[:, {r * k}:{(r + 1) * k}]\n[{hidden}, {k}]", c, gid=f"A:{r}")
        _box(ax, 4.5, y, 1.3, 0.8, f"Y{r} = act(X A{r})\n[{tokens}, {k}]", light)
        _box(ax, 6.2, y, 1.5, 0.8, f"B[{r * k}:{(r + 1) * k}, :]\n[{k}, {hidden}]", c, gid=f"B:{r}")
        _box(ax, 8.1, y, 1.3, 0.8, f"Y{r} B{r} (partial)\n[{tokens}, {hidden}]", light)
        _box(ax, 11.0, y, 1.7, 0.8, f"Z = sum of partials\n[{tokens}, {hidden}]", "#dddddd")
        for x0, x1 in ((1.3, 1.65), (2.35, 2.6), (4.1, 4.5), (5.8, 6.2), (7.7, 8.1), (9.4, 9.75), (10.65, 11.0)):
            ax.annotate("", (x1, y + 0.4), (x0, y + 0.4), arrowprops={"arrowstyle": "->", "lw": 0.8})
    mid = (tp - 1) * 0.7 + 0.4
    ax.add_patch(Rectangle((1.68, -0.1), 0.64, (tp - 1) * 1.4 + 1.0, facecolor="none",
                           edgecolor=MARK_COLORS["operator"], linestyle="--"))
    ax.add_patch(Rectangle((9.78, -0.1), 0.64, (tp - 1) * 1.4 + 1.0, facecolor="none",
                           edgecolor=MARK_COLORS["operator"], linestyle="--"))
    _op(ax, 2.0, mid, "f", "identity", "all-reduce", -0.2)
    _op(ax, 10.1, mid, "g", "all-reduce", "identity", -0.2)
    ax.text(3.35, (tp - 1) * 1.4 + 1.05, "column-parallel", ha="center", fontsize=8.5, style="italic")
    ax.text(6.95, (tp - 1) * 1.4 + 1.05, "row-parallel", ha="center", fontsize=8.5, style="italic")
    ax.set_xlim(-1.0, 12.8)
    ax.set_ylim(-1.0, (tp - 1) * 1.4 + 1.3)
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=10)
    return fig


def bubble_sweep_figure(microbatches: Sequence[int], bubble: Mapping[str, Sequence[float | None]],
                        idle: Mapping[str, Sequence[float | None]], closed_form: Sequence[float], *,
                        title: str | None = None) -> Figure:
    """Two panels over the micro-batch counts: the bubble ratio (left) and the idle fraction (right) of each
    schedule (a line per name, ``None`` where it cannot run), the closed form ``(p-1)/m`` dashed on the left."""
    fig = new_figure((9.6, 3.6))
    axes = fig.subplots(1, 2)
    fig.subplots_adjust(left=0.07, right=0.8, bottom=0.15, top=0.86, wspace=0.25)
    for ax, values, label in ((axes[0], bubble, "bubble ratio (idle / compute)"),
                              (axes[1], idle, "idle fraction (of p x step)")):
        for i, (name, ys) in enumerate(values.items()):
            pts = [(m, 100 * y) for m, y in zip(microbatches, ys, strict=True) if y is not None]
            ax.plot([m for m, _ in pts], [y for _, y in pts], "o-", ms=4, label=name, gid=f"{label}:{name}",
                    color=f"C{i}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(microbatches), [str(m) for m in microbatches])
        ax.set_xlabel("micro-batches m")
        ax.set_ylabel(f"{label} (%)")
        ax.set_ylim(0, None)
        ax.grid(alpha=0.3)
    axes[0].plot(list(microbatches), [100 * y for y in closed_form], "k--", lw=1, label="(p-1)/m")
    axes[0].legend(fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(2.28, 1.0))
    if title:
        fig.suptitle(title, fontsize=10)
    return fig
