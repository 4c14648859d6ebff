"""ZeRO and FSDP pictures: which rank owns which shard of each unit, and the gathered bytes over a step.

A unit of ``n`` elements is padded to ``g * ceil(n / g)`` and rank ``r`` of the shard group owns elements
``[r S, (r + 1) S)`` with ``S = ceil(n / g)`` (``sharding.shard_range``; docs/conventions.md). Under ZeRO-3
a rank holds only its shards between uses; :func:`gather_timeline` walks one step's forward and backward
unit by unit (FSDP's order: the root unit gathered first and kept until its gradient is reduced, each
block unit gathered before its forward and again before its backward, the next one prefetched, freed
after use) and records the gathered bytes a rank holds after every event. Its peak is the ledger's
``zero3_gathered_bytes``: the root plus the two largest blocks with block units, the whole padded model
with ``zero_unit="root"`` (the test checks the two against each other).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from matplotlib.axes import Axes

from ...quantities import BYTE_UNITS, fmt_bytes, unit_for
from .base import reset_axes

RANK_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c",
               "#ccb974", "#64b5cd", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")


@dataclass(frozen=True)
class GatherEvent:
    """One event of a ZeRO-3 step on one rank: ``kind`` (``all_gather``, ``free``, ``reduce_scatter``),
    the ``unit``, the ``phase``, the gathered bytes ``held`` after it, and ``t``, where in the step it
    happens (0: forward starts, 0.5: backward starts, 1: the step's end; block units take equal time)."""

    kind: str
    unit: str
    phase: str
    held: int
    t: float


def gather_timeline(padded_bytes: Mapping[str, int], prefetch: bool = True) -> list[GatherEvent]:
    """The gathers and frees of one ZeRO-3 step (one micro-batch) over units ``padded_bytes`` (in
    registration order: ``root`` and ``blocks.{i}``), with the bytes held gathered after each event."""
    blocks = [u for u in padded_bytes if u != "root"]
    held: dict[str, int] = {}
    out: list[GatherEvent] = []

    def ev(kind: str, unit: str, phase: str, t: float) -> None:
        if kind == "all_gather":
            if unit in held:
                return
            held[unit] = padded_bytes[unit]
        elif kind == "free":
            held.pop(unit, None)
        out.append(GatherEvent(kind, unit, phase, sum(held.values()), t))

    if "root" in padded_bytes:
        ev("all_gather", "root", "forward", 0.0)
    n = max(len(blocks), 1)
    for order, phase, t0 in ((blocks, "forward", 0.0), (blocks[::-1], "backward", 0.5)):
        for i, u in enumerate(order):
            start, end = t0 + i / (2 * n), t0 + (i + 1) / (2 * n)
            ev("all_gather", u, phase, start)
            if prefetch and i + 1 < len(order):
                ev("all_gather", order[i + 1], phase, start)
            if phase == "backward":
                ev("reduce_scatter", u, phase, end)
            ev("free", u, phase, end)
    if "root" in padded_bytes:
        ev("reduce_scatter", "root", "backward", 1.0)
        ev("free", "root", "backward", 1.0)
    return out


def draw_shards(ax: Axes, padded_elems: Mapping[str, int], g: int, *, title: str | None = None,
                max_rows: int = 12) -> None:
    """One bar per unit, its length the padded elements, cut into the ``g`` equal shards of the ranks
    (colour = rank). More than ``max_rows`` units: the first and last ones, the middle elided."""
    reset_axes(ax)
    names = list(padded_elems)
    if len(names) > max_rows:
        k = max_rows // 2
        names = names[:k] + ["..."] + names[-(max_rows - k - 1):]
    top = max(padded_elems.values())
    unit, scale = unit_for(top, (("", 1), ("k", 1e3), ("M", 1e6), ("G", 1e9)))
    for r in range(g):                                  # one bar call per rank: its shard of every unit
        rows = [(y, padded_elems[name] / g / scale) for y, name in enumerate(names) if name != "..."]
        ax.barh([y for y, _ in rows], [w for _, w in rows], left=[r * w for _, w in rows], height=0.7,
                color=RANK_COLORS[r % len(RANK_COLORS)], edgecolor="white", linewidth=0.5 if g <= 16 else 0,
                gid=f"shard:{r}", label=f"rank {r}")
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"elements of the padded flat unit ({unit or 'count'})", fontsize=8)
    ax.tick_params(labelsize=7)
    if title:
        ax.set_title(title, fontsize=9)


def draw_gather_timeline(ax: Axes, timelines: Mapping[str, Sequence[GatherEvent]], chosen: str, *,
                         shard_bytes: Mapping[str, int] | None = None, title: str | None = None) -> None:
    """Gathered bytes held by one rank after each event, one step curve per unit choice (``chosen``
    drawn bold, the others faint); forward and backward halves marked."""
    reset_axes(ax)
    top = max((e.held for t in timelines.values() for e in t), default=1) or 1
    unit, scale = unit_for(top, BYTE_UNITS)
    for name, events in timelines.items():
        after: dict[float, float] = {0.0: 0.0}          # what is held once every event at time t is done
        for e in events:
            after[e.t] = e.held / scale
        xs, ys = list(after), list(after.values())
        bold = name == chosen
        peak = max((e.held for e in events), default=0)
        ax.step(xs, ys, where="post", lw=2.2 if bold else 1.0, alpha=1.0 if bold else 0.45,
                color="#0969da" if name == "block" else "#cf222e",
                label=f"{name} units: peak {fmt_bytes(peak)}", gid=f"gathered:{name}")
        if bold:
            rs = [e.t for e in events if e.kind == "reduce_scatter"]
            ax.plot(rs, [after[t] for t in rs], "v", ms=3, color="#6e7781", gid="reduce_scatter")
    split = 0.5
    ax.axvline(split, color="#8c959f", lw=0.8, ls=":")
    ax.text(split / 2, 1.02, "forward", transform=ax.transAxes, ha="center", fontsize=7, color="#57606a")
    ax.text((1 + split) / 2, 1.02, "backward", transform=ax.transAxes, ha="center", fontsize=7, color="#57606a")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, top / scale * 1.15)
    ax.set_xticks([0, 0.5, 1], ["start", "backward starts", "end"])
    ax.set_xlabel("one micro-batch, each block taking the same time (v: a reduce-scatter)", fontsize=8)
    ax.set_ylabel(f"gathered parameters ({unit})", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7, loc="upper right", frameon=False)
    if title:
        ax.set_title(title, fontsize=9, pad=14)
