"""The bytes a re-shard moves, rank of the old plan by rank of the new: predicted beside measured.

``reshard_pairs_figure(predicted, measured, world_a, world_b)`` draws two matrices (rows: the rank of plan
A that wrote a file; columns: the rank of plan B that read from it; each cell the bytes, labelled) from
``parallel_lab.reshard.transfers`` and ``distributed.runtime.reshard_run.ReshardResult.measured`` (or the ``pairs`` of
``parallel-lab reshard --json``). The diagonal is what a GPU keeps when it keeps its rank number.

``payback_figure`` draws when a change of plan pays: the time the new plan saves, summed over the steps of
the phase, against the switch's one-off cost (``reshard.switch_seconds``, ``reshard.payback_steps``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from matplotlib.figure import Figure

from ...quantities import fmt_bytes
from ...reshard import payback_steps
from ..palette import CURVE_COLORS, GHOST, INK, MARK_COLORS, MUTED
from .base import new_figure


def _matrix(pairs: Mapping[tuple[int, int], int], world_a: int, world_b: int) -> list[list[float]]:
    m = [[0.0] * world_b for _ in range(world_a)]
    for (i, j), n in pairs.items():
        m[i][j] = float(n)
    return m


def reshard_pairs_figure(predicted: Mapping[tuple[int, int], int], measured: Mapping[tuple[int, int], int] | None,
                         world_a: int, world_b: int, title: str = "bytes read by B's ranks from A's files",
                         label_a: str = "A", label_b: str = "B") -> Figure:
    """Predicted (and, if given, measured) bytes per (rank of A, rank of B) as labelled matrices."""
    panels = [("predicted", predicted)] + ([("measured", measured)] if measured is not None else [])
    fig = new_figure((3.6 * len(panels) + 0.8, 3.4))
    top = max([n for _, p in panels for n in p.values()] or [1])
    for k, (name, pairs) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), k + 1)
        m = _matrix(pairs, world_a, world_b)
        ax.imshow(m, cmap="Blues", vmin=0, vmax=top, aspect="auto")
        for i in range(world_a):
            for j in range(world_b):
                if m[i][j]:
                    ax.text(j, i, fmt_bytes(m[i][j], 2), ha="center", va="center", fontsize=7,
                            color="white" if m[i][j] > top / 2 else "black")
        ax.set_xticks(range(world_b))
        ax.set_yticks(range(world_a))
        ax.set_xlabel(f"rank of {label_b} (reads)")
        ax.set_ylabel(f"rank of {label_a} (wrote the file)")
        ax.set_title(name, fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.16, top=0.82, wspace=0.35)
    return fig


def payback_figure(steps: Sequence[float], saved_per_step: Mapping[str, float], switch_s: float, *,
                   phase_steps: float | None = None, title: str | None = None) -> Figure:
    """Seconds saved by the new plan, summed over the steps (one line per case, ``{name: seconds saved a
    step}``), against the switch's cost (a horizontal line); each crossing (the payback) marked, and the
    phase's length (``phase_steps``) as a vertical line. Log-log."""
    fig = new_figure((8.6, 4.0))
    ax = fig.subplots()
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.14, top=0.88)
    for i, (name, s) in enumerate(saved_per_step.items()):
        color = CURVE_COLORS[i % len(CURVE_COLORS)]
        pays = payback_steps(switch_s, s, 0.0)         # a step that saves s seconds
        ax.plot(list(steps), [n * s for n in steps], color=color, lw=1.8, gid=f"saved:{name}",
                label=f"{name}: pays after {pays:,.0f} steps" if math.isfinite(pays) else f"{name}: never pays")
        if math.isfinite(pays):
            ax.plot([pays], [switch_s], "o", color=MARK_COLORS["peak"], ms=6, gid=f"payback:{name}")
    ax.axhline(switch_s, color=INK, lw=1, ls="--")
    ax.text(steps[0], switch_s, f" switch: {switch_s:,.0f} s", va="bottom", fontsize=8, color=INK)
    if phase_steps:
        ax.axvline(phase_steps, color=GHOST, lw=1, ls=":")
        ax.text(phase_steps, 0.02, f"phase: {phase_steps:,.0f} steps ", transform=ax.get_xaxis_transform(),
                ha="right", fontsize=8, color=MUTED)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("steps of the new phase")
    ax.set_ylabel("seconds saved by the new plan")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, frameon=False, loc="upper left")
    if title:
        ax.set_title(title, fontsize=9.5)
    return fig
