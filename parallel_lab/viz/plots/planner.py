"""Planner pictures: ranked plans and their labels.

The planner's ranked plans (``parallel_lab.planner.plan_search``): :func:`plan_label` names a plan in one
short token string (``tp8 cp1 pp16 dp128 z1``), :func:`draw_plans` draws the estimated step time of the
best plans as horizontal bars with their MFU beside them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from matplotlib.axes import Axes

from ..palette import MARK_COLORS, STEP_COLORS
from .base import field


def plan_label(plan: Any) -> str:
    """``tp8 cp1 pp16 dp128 z1`` from a plan (object or the planner JSON's dictionary)."""
    src = field(plan, "plan", None) or plan
    parts = [f"{k}{field(src, k)}" for k in ("tp", "cp", "pp", "dp") if field(src, k) is not None]
    zero = field(src, "zero")
    if zero is not None:
        parts.append(f"z{zero}")
    rec = field(src, "recompute")
    if rec and rec != "none":
        parts.append(f"rc-{rec[:3]}")
    sched = field(src, "schedule")
    pp = field(src, "pp")
    if sched and pp and pp > 1:
        v = field(src, "interleave") or 1
        parts.append(sched + (f"x{v}" if v > 1 else ""))
    return " ".join(parts)


def draw_plans(ax: Axes, plans: Sequence[Any], *, top: int = 10, title: str | None = None,
               chosen: int | None = 0) -> list[float]:
    """The ranked plans' estimated step time (s), best at the top, MFU written beside each bar."""
    plans = list(plans)[:top]
    times = [float(field(p, "step_time_s", 0.0)) for p in plans]
    ys = list(range(len(plans)))
    colors = [MARK_COLORS["peak"] if i == chosen else STEP_COLORS["compute"] for i in ys]
    bars = ax.barh(ys, times, 0.65, color=colors)
    for i, b in enumerate(bars):
        b.set_gid(f"plan:{i}")
    right = max(times + [1e-9])
    ax.set_xlim(0, right * 1.3)
    for y, p, t in zip(ys, plans, times, strict=True):
        mfu = field(p, "mfu")
        ax.text(t + right * 0.01, y, f"{t:.3g} s" + (f"  MFU {float(mfu):.0%}" if mfu is not None else ""),
                va="center", fontsize=8)
    ax.set_yticks(ys, [f"#{i + 1} {plan_label(p)}" for i, p in enumerate(plans)], fontsize=8)
    ax.set_ylim(len(plans) - 0.5, -0.5)                        # best plan on top
    ax.set_xlabel("estimated step time (s)")
    if title:
        ax.set_title(title, fontsize=10, y=1.0)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    return times
