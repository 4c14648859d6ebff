"""Tensor-parallel pictures: how one block's weights are split, and a ring all-reduce step by step.

Megatron's split (Shoeybi et al. 2019, section 3): in ``Y = X A`` the first linear of each region is
*column-parallel* (``A = [A_1 ... A_t]``, rank ``i`` computes ``X A_i``: its attention heads, its slice of
the MLP width) and the second *row-parallel* (rank ``i`` holds the rows of ``B`` matching its columns and
computes a partial ``Y_i B_i``). Two conjugate operators join them: ``f`` before the region (identity in
forward, all-reduce of the input's gradient in backward) and ``g`` after it (all-reduce of the partial
outputs in forward, identity in backward). With sequence parallelism ``f`` becomes an all-gather and
``g`` a reduce-scatter along the sequence (Korthikanti et al. 2022).

A ring all-reduce of ``M`` bytes over ``n`` ranks is a reduce-scatter (``n - 1`` steps: each rank passes
one chunk of ``M / n`` to its neighbour, which adds it to its own) then an all-gather (``n - 1`` steps:
the completed chunks travel round). :func:`ring_allreduce_states` records whose contributions each rank's
copy of each chunk holds after every step; each rank sends ``2 (n - 1) / n * M``, ``comm``'s wire bytes.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

from matplotlib.axes import Axes
from matplotlib.patches import Circle, Patch, Rectangle

from ...comm import ring_steps
from ..palette import MARK_COLORS, MUTED, RANK_COLORS, RING_COLORS, text_on
from .base import reset_axes


def ring_allreduce_states(n: int) -> list[list[list[frozenset[int]]]]:
    """``states[s][r][c]``: the ranks whose contribution rank ``r``'s copy of chunk ``c`` holds after
    ``s`` steps (``s = 0 .. 2 (n - 1)``; steps ``1 .. n - 1`` reduce-scatter, the rest all-gather)."""
    acc = [[frozenset([r]) for _ in range(n)] for r in range(n)]
    states = [[row[:] for row in acc]]
    for s in range(n - 1):                        # reduce-scatter: rank r sends chunk (r - s) to r + 1
        sent = [(r, (r - s) % n, acc[r][(r - s) % n]) for r in range(n)]
        for r, c, part in sent:
            acc[(r + 1) % n][c] = acc[(r + 1) % n][c] | part
        states.append([row[:] for row in acc])
    for s in range(n - 1):                        # all-gather: rank r sends its complete chunk (r + 1 - s)
        sent = [(r, (r + 1 - s) % n, acc[r][(r + 1 - s) % n]) for r in range(n)]
        for r, c, part in sent:
            acc[(r + 1) % n][c] = part
        states.append([row[:] for row in acc])
    return states


def ring_sent_chunks(n: int, step: int) -> list[tuple[int, int]]:
    """``(rank, chunk)`` each rank sends at ring step ``step`` (1-based), as in :func:`ring_allreduce_states`."""
    if step < 1 or step > ring_steps("all_reduce", n):
        return []
    s = step - 1
    return [(r, (r - s) % n) for r in range(n)] if s < n - 1 else [(r, (r + 1 - (s - n + 1)) % n) for r in range(n)]


def draw_ring_allreduce(ax: Axes, n: int, step: int, message_bytes: int | None = None, *,
                        title: str | None = None) -> None:
    """Ranks (rows) by chunks (columns) after ``step`` ring steps: a cell's shade is the share of the ranks'
    contributions its copy holds (``k/n`` written in it); the chunks sent at this step are outlined.
    Built once per ``n``; a new step only recolours the cells (drawn over the cached grid)."""
    from ...quantities import fmt_bytes
    from .base import chart_on

    chart, same = chart_on(ax, "ring_allreduce", (n, message_bytes, title))
    if not same:
        ax.set_aspect("equal")
        cells = {(r, c): ax.add_patch(Rectangle((c, r), 0.92, 0.92, linewidth=2)) for r in range(n) for c in range(n)}
        texts = {(r, c): ax.text(c + 0.46, r + 0.46, "", ha="center", va="center", fontsize=8)
                 for r in range(n) for c in range(n)}
        phase = ax.text(0.5, -0.03, "", transform=ax.transAxes, ha="center", va="top", fontsize=8)
        chart.parts.update(cells=cells, texts=texts, phase=phase)
        chart.dynamic += [*cells.values(), *texts.values(), phase]
        ax.set_xlim(-0.1, n)
        ax.set_ylim(n, -0.1)
        ax.set_xticks([c + 0.46 for c in range(n)], [str(c) for c in range(n)], fontsize=8)
        ax.xaxis.tick_top()                      # the caption below needs the room
        ax.set_yticks([r + 0.46 for r in range(n)], [f"rank {r}" for r in range(n)], fontsize=8)
        ax.tick_params(length=0)
        for sp in ax.spines.values():
            sp.set_visible(False)
        if title:
            ax.set_title(title, fontsize=9)
        ax.legend(handles=[Patch(facecolor=RING_COLORS["partial"], alpha=0.6, label="partial sum (k/n)"),
                           Patch(facecolor=RING_COLORS["complete"], label="complete"),
                           Patch(facecolor="white", edgecolor=RING_COLORS["sent"], linewidth=2, label="sent now")],
                  loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3, fontsize=8, frameon=False,
                  handlelength=1.2, columnspacing=1.0)
    state = ring_allreduce_states(n)[step]
    sent = set(ring_sent_chunks(n, step))
    for (r, c), cell in chart.parts["cells"].items():
        k = len(state[r][c])
        fill, alpha = RING_COLORS["complete"] if k == n else RING_COLORS["partial"], 0.25 + 0.75 * k / n
        cell.set_facecolor(fill)
        cell.set_alpha(alpha)
        cell.set_edgecolor(RING_COLORS["sent"] if (r, c) in sent else "none")
        cell.set_gid(f"chunk:{r}:{c}:{k}")
        t = chart.parts["texts"][(r, c)]
        t.set_text(f"{k}/{n}")
        t.set_color(text_on(fill, alpha))
    phase = ("start: every rank holds its own partial sums" if step == 0 else
             f"reduce-scatter step {step} of {n - 1}" if step < n else
             f"all-gather step {step - n + 1} of {n - 1}")
    size = f"\none chunk ({fmt_bytes(message_bytes / n)}) per rank" if message_bytes else ""   # wrapped
    chart.parts["phase"].set_text(phase + size)


@dataclass(frozen=True)
class Split:
    """One linear of a block under TP: ``name``, ``kind`` (column / row), full (in, out), what one rank holds."""

    name: str
    kind: str
    shape: tuple[int, int]
    local: str


def draw_tp_block(ax: Axes, attention: Sequence[Split], mlp: Sequence[Split], tp: int, sp: bool, *,
                  title: str | None = None) -> None:
    """The two regions of a block, each ``f -> column-parallel -> row-parallel -> g``, the weights drawn
    as matrices cut into the ``tp`` slices the ranks hold (colour = rank)."""
    reset_axes(ax)
    ax.set_xlim(-0.3, 8.95)
    ax.set_ylim(-0.2, 6.4)
    ax.set_axis_off()
    f_note = "fwd: all-gather (s)\nbwd: reduce-scatter" if sp else "fwd: identity\nbwd: all-reduce"
    g_note = "fwd: reduce-scatter (s)\nbwd: all-gather" if sp else "fwd: all-reduce\nbwd: identity"
    for y, region, splits in ((3.5, "attention", attention), (0.4, "MLP", mlp)):
        ax.text(0.05, y + 2.3, region, fontsize=9, weight="bold")
        _operator(ax, 0.7, y + 1.0, "f", f_note)
        x = 1.85
        for sp_ in splits:
            w = 2.4 if sp_.kind == "column" else 1.2
            h = 1.2 if sp_.kind == "column" else 2.0
            y0 = y + 1.0 - h / 2
            for r in range(tp):
                color = RANK_COLORS[r % len(RANK_COLORS)]
                if sp_.kind == "column":           # A = [A_1 ... A_t]: a slice of the output columns each
                    rect = (x + r * w / tp, y0, w / tp, h)
                else:                               # B = [B_1; ...; B_t]: a slice of the input rows each
                    rect = (x, y0 + (tp - 1 - r) * h / tp, w, h / tp)
                ax.add_patch(Rectangle(rect[:2], rect[2], rect[3], facecolor=color, edgecolor="white",
                                       linewidth=0.6, gid=f"w:{sp_.name}:{r}"))
            ax.text(x + w / 2, y0 + h + 0.12, f"{sp_.name} ({sp_.kind})", ha="center", fontsize=8)
            share = "\n".join(textwrap.wrap(sp_.local, 24))               # wrapped: it fits under the weight
            ax.text(x + w / 2, y0 - 0.15, f"{sp_.shape[0]:,} x {sp_.shape[1]:,}\n{share}", ha="center",
                    va="top", fontsize=8, color=MUTED)
            ax.annotate("", (x - 0.05, y + 1.0), (x - 0.55, y + 1.0), arrowprops={"arrowstyle": "->", "lw": 0.8})
            x += w + 0.9
        ax.annotate("", (x - 0.1, y + 1.0), (x - 0.85, y + 1.0), arrowprops={"arrowstyle": "->", "lw": 0.8})
        _operator(ax, x + 0.25, y + 1.0, "g", g_note)
    if title:
        ax.set_title(title, fontsize=9)


def _operator(ax: Axes, x: float, y: float, name: str, note: str) -> None:
    ax.add_patch(Circle((x, y), 0.3, facecolor=MARK_COLORS["operator_fill"], edgecolor=MARK_COLORS["operator"],
                        linewidth=1, gid=f"op:{name}"))
    ax.text(x, y, name, ha="center", va="center", fontsize=9, weight="bold", style="italic")
    ax.text(x, y + 0.4, note, ha="center", va="bottom", fontsize=8, color=MARK_COLORS["operator"])
