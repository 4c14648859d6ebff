"""Routing pictures: tokens per expert against capacity, and the all-to-all bytes next to the all-reduce.

:func:`draw_expert_load` draws one bar per expert (its routed choices; the part over capacity hatched as
dropped), coloured by the expert-parallel rank that holds it, with the capacity as a line: routing
imbalance as a picture. :func:`draw_ep_bytes` puts the bytes one GPU sends per step for expert parallelism
(all-to-all, ``comm.report``'s ``per_step_bytes["ep"]``) beside data parallelism's (all-reduce, ``"dp"``).
Bars carry ``gid`` ``"expert:<e>"`` / ``"dropped:<e>"`` / ``"bytes:<dim>"`` so tests read them back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from ...quantities import fmt_bytes
from ..palette import DIM_COLORS, GHOST, INK, RANK_COLORS
from .base import field, new_figure, set_title


def draw_expert_load(ax: Axes, report: Any, ep: int = 1, *, title: str | None = None,
                     ghost: Sequence[float] | None = None, ymax: float | None = None,
                     ghost_label: str = "before") -> dict[str, list[int]]:
    """Tokens per expert: ``report`` has ``routed``, ``kept`` and ``capacity`` (``routing.LoadReport``, or the
    ``moe`` entry of ``parallel-lab run --json`` with ``capacity`` added). Returns ``{"kept", "dropped"}``.

    ``ghost`` (routed choices per expert before a change) is drawn as dashed outlines, with the busiest
    expert's ratio over its ghost ("x1.8") above it; ``ymax`` keeps the axis for every setting."""
    ax.clear()
    routed, kept = list(field(report, "routed")), list(field(report, "kept"))
    n = len(routed)
    per = max(1, n // max(ep, 1))
    dropped = [r - k for r, k in zip(routed, kept, strict=True)]
    for e in range(n):
        color = RANK_COLORS[(e // per) % len(RANK_COLORS)]
        ax.bar(e, kept[e], 0.8, color=color, gid=f"expert:{e}")
        if dropped[e]:
            ax.bar(e, dropped[e], 0.8, bottom=kept[e], color="white", edgecolor=color, hatch="///",
                   gid=f"dropped:{e}")
    top = max(routed + list(ghost or []) + [field(report, "capacity") or 0, ymax or 0, 1]) * 1.15
    if ghost is not None and list(ghost) != routed:
        ax.bar(range(n), list(ghost), 0.8, facecolor="none", edgecolor=GHOST, linestyle="--", linewidth=1.0,
               gid="ghost", label=ghost_label, zorder=3)
        busiest = max(range(n), key=lambda e: routed[e])
        if ghost[busiest]:
            ax.text(busiest, max(routed[busiest], ghost[busiest]) + top * 0.01,
                    f"x{routed[busiest] / ghost[busiest]:.3g}", ha="center", va="bottom", fontsize=8,
                    fontweight="bold", color=INK, gid="ratio")
        ax.legend(loc="upper right", fontsize=8, frameon=False)
    cap = field(report, "capacity")
    if cap:
        ax.axhline(cap, color=INK, linestyle="--", linewidth=1.2)
        ax.text(1.0, cap, " capacity", va="center", ha="left", fontsize=8, transform=ax.get_yaxis_transform(),
                clip_on=False)
    ax.set_xlabel("expert" + (f" (colour: expert rank of ep={ep})" if ep > 1 else " (colour: rank 0, ep=1)"))
    ax.set_ylabel("token choices")
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_ylim(0, top)
    if n <= 16:
        ax.set_xticks(range(n))
    set_title(ax, title)
    return {"kept": kept, "dropped": dropped}


def draw_ep_bytes(ax: Axes, per_step_bytes: dict[str, float], *, title: str | None = None) -> dict[str, float]:
    """Bytes one GPU sends per step: expert parallelism's all-to-alls (``ep``) beside data parallelism's
    gradient all-reduces (``dp``). Returns the heights drawn."""
    ax.clear()
    dims = [d for d in ("ep", "dp") if per_step_bytes.get(d)]
    vals = [float(per_step_bytes[d]) for d in dims]
    top = max(vals, default=1.0)
    unit, scale = _unit(top)
    for i, (d, v) in enumerate(zip(dims, vals, strict=True)):
        ax.bar(i, v / scale, 0.6, color=DIM_COLORS[d], gid=f"bytes:{d}")
        ax.text(i, v / scale, fmt_bytes(v), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(dims)))
    ax.set_xticklabels([{"ep": "ep: all-to-all", "dp": "dp: all-reduce"}[d] for d in dims])
    ax.set_ylabel(f"sent per GPU per step ({unit})")
    ax.set_ylim(0, top / scale * 1.18 if vals else 1)
    set_title(ax, title)
    return dict(zip(dims, vals, strict=True))


def _unit(x: float) -> tuple[str, float]:
    for name, s in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= s:
            return name, s
    return "B", 1.0


def routing_figure(report: Any, per_step_bytes: dict[str, float], ep: int = 1) -> Figure:
    """Both pictures side by side."""
    fig = new_figure()
    a, b = fig.subplots(1, 2, gridspec_kw={"width_ratios": (1.6, 1.0), "wspace": 0.35})
    draw_expert_load(a, report, ep, title="tokens per expert")
    draw_ep_bytes(b, per_step_bytes, title="bytes per step")
    return fig


__all__ = ["draw_expert_load", "draw_ep_bytes", "routing_figure"]
