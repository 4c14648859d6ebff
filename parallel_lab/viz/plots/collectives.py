"""Pictures of the collectives: what every rank holds before and after a call, the ring step by step, the
alpha-beta time of all-reduce algorithms against the message size, two collectives sharing one link, and a
cluster's bandwidth map (bus bandwidth per link tier against the message size).

The grids draw real tensors: ranks as rows, chunks as columns, one number per cell (a chunk's first
element). Lesson 00 fills rank ``r``'s chunk ``c`` with :func:`tag` ``(r, c) = 10**r * (c + 1)``, so that a
sum of chunks stays readable: decimal digit ``r`` of a cell is rank ``r``'s share (:func:`contributors`).
A cell is coloured by the rank it came from, shaded when it holds a partial sum of ``k`` ranks, green when
it holds all ``n``, white when the rank holds nothing there (a value of 0); its label names the ranks
it holds (``r2 c1``: rank 2's chunk 1; ``r0+1+3``: a partial sum; ``sum``: all of them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ...quantities import fmt_bytes, fmt_seconds
from ..palette import CURVE_COLORS, GHOST, IDLE_EDGE, INK, MEASURED, MUTED, RANK_COLORS, RING_COLORS, TIER_COLORS
from .base import new_figure

COMPLETE = RING_COLORS["complete"]   #: a chunk summed over every rank
PARTIAL = RING_COLORS["partial"]     #: a partial sum (shade: the share of ranks it holds)
CHANGED = RING_COLORS["sent"]        #: outline of a cell that changed at this step (what it received)

Grid = Sequence[Sequence[float]]


def tag(rank: int, chunk: int) -> float:
    """The value of rank ``rank``'s chunk ``chunk`` in lesson 00's tensors: ``10**rank * (chunk + 1)``."""
    return float(10**rank * (chunk + 1))


def contributors(value: float, n: int) -> tuple[list[int], int]:
    """``(ranks, chunk)`` of a cell built from :func:`tag` values of one chunk: its non-zero decimal digits
    name the ranks, the digit is ``chunk + 1`` (``([], -1)`` for an empty cell)."""
    v, ranks, digit = int(round(value)), [], 0
    for r in range(n):
        d = (v // 10**r) % 10
        if d:
            ranks.append(r)
            digit = d
    return ranks, digit - 1


def _label(ranks: list[int], chunk: int, n: int) -> str:
    if not ranks:
        return ""
    if len(ranks) == 1:
        return f"r{ranks[0]} c{chunk}"
    if len(ranks) == n:
        return "sum"
    return "r" + "+".join(str(r) for r in ranks)


def draw_chunks(ax: Axes, values: Grid, n: int, *, title: str | None = None, changed: Grid | None = None) -> None:
    """One grid of ranks (rows) by chunks (columns); ``changed``: the previous grid, whose differing cells
    are outlined. Each cell carries ``gid`` ``"cell:<rank>:<chunk>:<ranks>"`` for tests."""
    ax.set_aspect("equal")
    cols = max(len(row) for row in values)
    for r, row in enumerate(values):
        for c, v in enumerate(row):
            ranks, chunk = contributors(v, n)
            k = len(ranks)
            color = "white" if not k else RANK_COLORS[ranks[0]] if k == 1 else COMPLETE if k == n else PARTIAL
            alpha = 1.0 if k in (0, 1, n) else 0.3 + 0.6 * k / n
            edge = CHANGED if changed is not None and changed[r][c] != v else IDLE_EDGE
            cell = ax.add_patch(Rectangle((c, r), 0.94, 0.94, facecolor=color, alpha=alpha, edgecolor=edge,
                                          linewidth=2.0 if edge == CHANGED else 0.8))
            cell.set_gid(f"cell:{r}:{c}:{','.join(map(str, ranks))}")
            ax.text(c + 0.47, r + 0.47, _label(ranks, chunk, n), ha="center", va="center",
                    fontsize=6.5 if k < 3 or k == n else 5.5,
                    color="white" if k and alpha > 0.6 else INK)
    ax.set_xlim(-0.05, cols)
    ax.set_ylim(len(values), -0.05)
    ax.set_xticks([c + 0.47 for c in range(cols)], [f"c{c}" for c in range(cols)], fontsize=8)
    ax.set_xlabel("chunk", fontsize=8, labelpad=1)
    ax.set_yticks([r + 0.47 for r in range(len(values))], [f"rank {r}" for r in range(len(values))], fontsize=8)
    ax.tick_params(length=0)
    for sp in ax.spines.values():
        sp.set_visible(False)
    if title:
        ax.set_title(title, fontsize=8.5)


def before_after_figure(name: str, before: Grid, after: Grid, n: int, note: str = "") -> Figure:
    """Two grids side by side: every rank's chunks before and after one collective ``name``."""
    fig = new_figure((7.2, 2.5))
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.12, top=0.8, wspace=0.25)
    a, b = fig.subplots(1, 2)
    draw_chunks(a, before, n, title="before")
    draw_chunks(b, after, n, title="after", changed=before)
    fig.suptitle(f"{name}" + (f": {note}" if note else ""), fontsize=9.5)
    return fig


def ring_steps_figure(states: Sequence[tuple[str, Grid]], n: int, message_bytes: float | None = None) -> Figure:
    """The ring all-reduce, one panel per step (``states``: ``(label, grid)`` from the start), cells that
    changed at a step outlined in red."""
    cols = 4
    rows = -(-len(states) // cols)
    fig = new_figure((9.6, 2.4 * rows))
    fig.subplots_adjust(left=0.06, right=0.99, bottom=0.05, top=0.86, wspace=0.25, hspace=0.45)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for i, ax in enumerate(axes):
        if i >= len(states):
            ax.set_visible(False)
            continue
        label, grid = states[i]
        draw_chunks(ax, grid, n, title=label, changed=states[i - 1][1] if i else None)
    size = f", message {fmt_bytes(message_bytes)}: one chunk of {fmt_bytes(message_bytes / n)}" if message_bytes else ""
    fig.suptitle(f"ring all-reduce on {n} ranks, what every rank holds after each step{size}\n"
                 "red outline: the chunk a rank received at that step", fontsize=9.5)
    return fig


def _against_message_size(ax: Axes, ylabel: str, title: str) -> None:
    """Log-log axes against the message size, a light grid, the legend top left, the title."""
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(title, fontsize=9.5)


def alpha_beta_figure(sizes: Sequence[float], times: Mapping[str, Sequence[float]], *,
                      crossovers: Mapping[str, float] | None = None, title: str = "") -> Figure:
    """Seconds per call against message bytes, log-log, one line per algorithm; ``crossovers`` marks sizes."""
    fig = new_figure((8.0, 4.2))
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.13, top=0.9)
    ax = fig.add_subplot()
    for i, (name, ts) in enumerate(times.items()):
        ax.plot(sizes, ts, label=name, color=CURVE_COLORS[i % len(CURVE_COLORS)], linewidth=1.8)
    for label, m in (crossovers or {}).items():
        ax.axvline(m, color=GHOST, linestyle=":", linewidth=1)
        ax.text(m, 0.02, f" {label}\n {fmt_bytes(m)}", transform=ax.get_xaxis_transform(), fontsize=8,
                color=MUTED, va="bottom")
    _against_message_size(ax, "time of one all-reduce (s)", title)
    return fig


def shared_link_figure(lanes: Mapping[str, Sequence[tuple[str, float, float]]], title: str = "") -> Figure:
    """Timelines, one lane per scenario: ``(label, start s, end s)`` bars (two collectives on one link)."""
    fig = new_figure((8.0, 0.9 + 0.7 * len(lanes)))
    fig.subplots_adjust(left=0.28, right=0.97, bottom=0.3, top=0.8)
    ax = fig.add_subplot()
    colors: dict[str, str] = {}
    for y, bars in enumerate(lanes.values()):
        for j, (label, t0, t1) in enumerate(bars):
            color = colors.setdefault(label, CURVE_COLORS[len(colors) % len(CURVE_COLORS)])
            h = 0.7 / (2 if len(bars) > 1 and bars[0][1] == bars[-1][1] else 1)
            off = h * (j if h < 0.7 else 0)
            ax.barh(y - 0.35 + off + h / 2, (t1 - t0) * 1e3, left=t0 * 1e3, height=h * 0.95, color=color)
            ax.text((t0 + t1) / 2 * 1e3, y - 0.35 + off + h / 2, f"{label} {fmt_seconds(t1 - t0)}", ha="center",
                    va="center", fontsize=8, color="white")
    ax.set_yticks(range(len(lanes)), list(lanes), fontsize=8)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_xlabel("time (ms)")
    ax.set_title(title, fontsize=9.5)
    return fig


def bandwidth_map_figure(sizes: Sequence[float], busbw: Mapping[str, Sequence[float]], *,
                         measured: Mapping[str, tuple[Sequence[float], Sequence[float]]] | None = None,
                         title: str = "") -> Figure:
    """A bandwidth map: bus bandwidth (GB/s, nccl-tests' ``busbw``) against the message size, one line per
    link tier (``busbw``: bytes per second at each of ``sizes``), the ratio of the first tier to the second at
    the largest size written beside them; ``measured``: ``{name: (sizes, busbw)}`` drawn as filled points."""
    fig = new_figure((8.0, 4.0))
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.14, top=0.9)
    ax = fig.add_subplot()
    for i, (name, bw) in enumerate(busbw.items()):
        ax.plot(sizes, [b / 1e9 for b in bw], label=name, color=TIER_COLORS[i % len(TIER_COLORS)], linewidth=1.8,
                gid=f"tier:{name}")
    for name, (xs, bw) in (measured or {}).items():
        ax.plot(xs, [b / 1e9 for b in bw], "o", color=MEASURED, ms=6, label=name, gid=f"measured:{name}")
    if len(busbw) >= 2:
        (a, bw_a), (b, bw_b) = list(busbw.items())[:2]
        ratio = bw_a[-1] / bw_b[-1]
        ax.text(0.98, 0.5, f"at {fmt_bytes(sizes[-1])}: {ratio:.1f}x\n{a.split(',')[0]} / {b.split(',')[0]}",
                transform=ax.transAxes, ha="right", va="center", fontsize=9, color=INK, gid="ratio")
    _against_message_size(ax, "bus bandwidth (GB/s)", title)
    return fig
