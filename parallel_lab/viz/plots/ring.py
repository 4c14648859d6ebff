"""Ring attention step by step: which key/value block each rank holds, which tiles of the causal mask it
computes, and the attention work per rank for contiguous and zigzag chunks.

The sequence is cut into equal chunks: ``cp`` of them (contiguous: rank r holds chunk r) or ``2 cp``
(zigzag, Llama 3: rank r holds chunks r and 2 cp - 1 - r, as ``distributed.context_parallel.cp_balance.rank_indices``
places them). At ring step t (0 .. cp - 1) rank r holds the key/value block of rank (r - t) mod cp and
computes the tiles (query chunk, key chunk) of its own queries against those keys that the causal mask
allows: a whole tile when the query chunk comes after the key chunk, the lower triangle (c (c + 1) / 2
pairs of c-token chunks) on the diagonal, nothing above it. Summed over the steps, a rank's pairs are
``cp_balance.work_per_rank`` (``tests/viz/test_ring.py`` checks it against that function).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from matplotlib.axes import Axes
from matplotlib.patches import Patch, Rectangle

from ..palette import CURVE_COLORS, INK, RANK_COLORS
from .base import chart_on, empty_bars, set_ticks, set_title

BALANCES = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Tile:
    """One (query chunk, key chunk) tile: the rank that computes it, at which ring step, how many pairs."""

    q: int
    k: int
    rank: int
    step: int
    pairs: int


def rank_chunks(cp: int, balance: str) -> list[list[int]]:
    """The chunks each rank holds (``2 cp`` chunks for zigzag, ``cp`` for contiguous)."""
    if balance == "zigzag":
        return [[r, 2 * cp - 1 - r] for r in range(cp)]
    if balance == "contiguous":
        return [[r] for r in range(cp)]
    raise ValueError(f"balance={balance!r}; pick one of {', '.join(BALANCES)}")


def ring_tiles(cp: int, balance: str, chunk_tokens: int) -> list[Tile]:
    """Every tile the causal mask allows, with its rank and ring step."""
    chunks = rank_chunks(cp, balance)
    c = chunk_tokens
    out = []
    for r in range(cp):
        for t in range(cp):
            for q in chunks[r]:
                for k in chunks[(r - t) % cp]:
                    if q > k:
                        out.append(Tile(q, k, r, t, c * c))
                    elif q == k:
                        out.append(Tile(q, k, r, t, c * (c + 1) // 2))
    return out


def work_per_rank(tiles: Sequence[Tile], cp: int) -> list[int]:
    """Allowed (query, key) pairs per rank, all steps."""
    out = [0] * cp
    for tile in tiles:
        out[tile.rank] += tile.pairs
    return out


def draw_ring_tiles(ax: Axes, tiles: Sequence[Tile], n_chunks: int, step: int, cp: int, *,
                    title: str | None = None) -> dict[str, int]:
    """The causal mask as ``n_chunks x n_chunks`` tiles (queries down, keys across): a tile computed at a
    step up to ``step`` in its rank's colour (this step's with an ink border), a later one pale grey,
    masked ones empty. Tiles carry ``gid = "tile:<q>:<k>"``. Returns counts of done / now / later tiles."""
    chart, same = chart_on(ax, "ring_tiles", (n_chunks, cp))
    if not same:
        squares = {}
        for q in range(n_chunks):
            for k in range(n_chunks):
                sq = Rectangle((k + 0.04, q + 0.04), 0.92, 0.92, gid=f"tile:{q}:{k}", facecolor="white",
                               edgecolor="#dddddd", linewidth=0.8)
                ax.add_patch(sq)
                squares[q, k] = sq
        chart.parts["squares"] = squares
        chart.dynamic += list(squares.values())
        ax.set_xlim(0, n_chunks)
        ax.set_ylim(n_chunks, 0)
        ax.set_aspect("equal", adjustable="box")
        set_ticks(ax, chart, "x", [i + 0.5 for i in range(n_chunks)], [str(i) for i in range(n_chunks)])
        set_ticks(ax, chart, "y", [i + 0.5 for i in range(n_chunks)], [str(i) for i in range(n_chunks)])
        ax.set_xlabel("key/value chunk")
        ax.set_ylabel("query chunk")
        ax.tick_params(length=0)
        states = [Patch(facecolor="white", edgecolor=INK, linewidth=1.6, label="this step"),
                  Patch(facecolor="#eeeeee", edgecolor="white", label="a later step"),
                  Patch(facecolor="white", edgecolor="#dddddd", label="masked: never")]
        ax.legend(handles=[Patch(facecolor=RANK_COLORS[r % len(RANK_COLORS)], label=f"rank {r}")
                           for r in range(cp)] + states, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8,
                  frameon=False)
    counts = {"done": 0, "now": 0, "later": 0}
    for sq in chart.parts["squares"].values():
        sq.set(facecolor="white", edgecolor="#dddddd", linewidth=0.8)
    for tile in tiles:
        sq = chart.parts["squares"][tile.q, tile.k]
        if tile.step <= step:
            sq.set_facecolor(RANK_COLORS[tile.rank % len(RANK_COLORS)])
            now = tile.step == step
            sq.set_edgecolor(INK if now else "white")
            sq.set_linewidth(1.6 if now else 0.8)
            counts["now" if now else "done"] += 1
        else:
            sq.set(facecolor="#eeeeee", edgecolor="white")
            counts["later"] += 1
    set_title(ax, title)
    return counts


def draw_work(ax: Axes, work: dict[str, Sequence[int]], *, title: str | None = None) -> None:
    """Attention work per rank (allowed query/key pairs) for each balance, as grouped bars in units of the
    balanced share (the total over cp, the dashed line at 1). Bars carry ``gid = "work:<balance>:<rank>"``."""
    names = list(work)
    cp = len(next(iter(work.values())))
    w = 0.8 / len(names)
    chart, same = chart_on(ax, "ring_work", (tuple(names), cp))
    if not same:
        series = {}
        for i, name in enumerate(names):
            bars = empty_bars(ax, [r - 0.4 + w * (i + 0.5) for r in range(cp)], w, label=name,
                              facecolor=CURVE_COLORS[i % len(CURVE_COLORS)], edgecolor="white")
            for r, b in enumerate(bars):
                b.set_gid(f"work:{name}:{r}")
            series[name] = bars
            chart.dynamic += bars
        chart.parts["series"] = series
        chart.parts["ideal"] = ax.axhline(0.0, color="black", linestyle="--", linewidth=1.0, label="ideal")
        chart.dynamic.append(chart.parts["ideal"])
        ax.legend(loc="upper left", fontsize=8, frameon=False)
        ax.set_xlim(-0.5, cp - 0.5)
        set_ticks(ax, chart, "x", range(cp), [str(r) for r in range(cp)])
        ax.set_xlabel("rank")
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    ideal = sum(next(iter(work.values()))) / cp            # every balance does the same total work
    for name, bars in chart.parts["series"].items():
        for b, v in zip(bars, work[name], strict=True):
            b.set_height(v / ideal)
    chart.parts["ideal"].set_ydata([1.0, 1.0])
    ax.set_ylim(0, max(max(v) for v in work.values()) / ideal * 1.3)
    ax.set_ylabel("work per rank (x the balanced share)")
    set_title(ax, title)
