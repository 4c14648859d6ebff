"""ZeRO and FSDP pictures: which rank owns which shard of each unit, and the gathered bytes over a step.

A unit of ``n`` elements is padded to ``g * ceil(n / g)`` and rank ``r`` of the shard group owns elements
``[r S, (r + 1) S)`` with ``S = ceil(n / g)`` (``sharding.shard_range``; docs/conventions.md). Under ZeRO-3
a rank holds only its shards between uses; :func:`gather_timeline` walks one step's forward and backward
unit by unit (FSDP's order: the root unit gathered first and kept until its gradient is reduced, each
block unit gathered before its forward and again before its backward, the next one prefetched, freed
after use) and records the gathered bytes a rank holds after every event. Its peak is the ledger's
``zero3_gathered_bytes``: the root plus the two largest blocks with block units, the whole padded model
with ``zero_unit="root"`` (the test checks the two against each other).

:func:`draw_zero_stage` shows what the stage changes: per rank a row each for parameters, gradients and
optimizer states, the part the rank holds filled and, where the stage shards a category, the other ranks'
part hatched.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from matplotlib.axes import Axes
from matplotlib.patches import Patch

from ...quantities import BYTE_UNITS, fmt_bytes, unit_for
from ..palette import CATEGORY_COLORS, INK, MUTED, RANK_COLORS, UNIT_COLORS
from .base import LABEL_BOX, lighten, reset_axes

STATE = ("parameters", "gradients", "optimizer_states")
STATE_LABELS = {"parameters": "parameters", "gradients": "gradients", "optimizer_states": "optimizer states"}


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
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"elements of the padded flat unit ({unit or 'count'})", fontsize=8)
    ax.tick_params(labelsize=8)
    if title:
        ax.set_title(title, fontsize=9)


def shown_ranks(g: int, most: int = 4) -> list[int]:
    """The ranks a picture draws: all of ``g`` up to ``most``, else the first ``most - 1`` and the last."""
    return list(range(g)) if g <= most else [*range(most - 1), g - 1]


def draw_zero_stage(ax: Axes, full: Mapping[str, float], held: Mapping[str, float], sharded: Mapping[str, bool],
                    g: int, *, title: str | None = None) -> None:
    """Per rank (up to four drawn), a row each for parameters, gradients and optimizer states: the bar's
    length is the category's unsharded bytes (``full``), the part rank ``r`` holds (``held``: its ``1/g``
    slice at ``r/g`` where ``sharded``, else all of it) filled in the category's colour, the other ranks'
    part hatched. Patches carry ``gid = "held:<rank>:<category>"``; rank 0's rows say their bytes."""
    from ...quantities import fmt_bytes

    reset_axes(ax)
    ranks = shown_ranks(g)
    top = max(full.values(), default=1.0) or 1.0
    unit, scale = unit_for(top, BYTE_UNITS)
    y, ticks, labels = 0.0, [], []
    for i, r in enumerate(ranks):
        if i and ranks[i - 1] != r - 1:
            ax.text(0.0, y - 0.1, "...", fontsize=8, color=MUTED, va="center")
            y += 0.6
        for cat in STATE:
            w, color = full[cat] / scale, CATEGORY_COLORS[cat]
            if sharded[cat]:
                ax.barh(y, w, 0.8, color=lighten(color, 0.8), edgecolor=color, hatch="///", linewidth=0.0,
                        gid=f"others:{r}:{cat}")
                ax.barh(y, held[cat] / scale, 0.8, left=r * w / g, color=color, gid=f"held:{r}:{cat}")
            else:
                ax.barh(y, w, 0.8, color=color, gid=f"held:{r}:{cat}")
            if i == 0:
                right = (r + 1) * w / g if sharded[cat] else w
                ax.text(right + top / scale * 0.02, y, fmt_bytes(held[cat]), va="center", fontsize=8, color=INK,
                        bbox=LABEL_BOX)
            y += 1.0
        ticks.append(y - 2.0)
        labels.append(f"rank {r}")
        y += 0.5
    ax.set_yticks(ticks, labels, fontsize=8)
    for t, r in zip(ax.get_yticklabels(), ranks, strict=True):
        t.set_color(RANK_COLORS[r % len(RANK_COLORS)])
        t.set_fontweight("bold")
    ax.set_ylim(y - 0.2, -0.7)
    ax.set_xlim(0, top / scale * 1.3)
    ax.set_xlabel(f"model state per rank ({unit}); hatched: held by the other ranks", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.legend(handles=[Patch(color=CATEGORY_COLORS[c], label=STATE_LABELS[c].replace(" ", "\n"))
                       for c in STATE], fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=3,
              frameon=False, handlelength=1.0, columnspacing=0.8)
    if title:
        ax.set_title(title, fontsize=9)


def rank_legend(ax: Axes, g: int) -> None:
    """The ranks' colours as a legend under ``ax`` (rows of up to eight)."""
    short = g > 4
    handles = [Patch(color=RANK_COLORS[r % len(RANK_COLORS)], label=str(r) if short else f"rank {r}")
               for r in range(min(g, 16))]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=min(len(handles), 8),
              fontsize=8, frameon=False, handlelength=0.8, handletextpad=0.3, columnspacing=0.5,
              title="rank" if short else None, title_fontsize=8)


def draw_gather_timeline(ax: Axes, timelines: Mapping[str, Sequence[GatherEvent]], chosen: str, *,
                         shard_bytes: Mapping[str, int] | None = None, title: str | None = None) -> None:
    """Gathered bytes held by one rank after each event: the ``chosen`` unit choice's step curve on an axis
    of its own (so each gather and free shows); another choice is drawn faint where its peak is within
    twice the chosen one's, else only named in the legend with its peak; forward and backward marked."""
    from matplotlib.lines import Line2D

    reset_axes(ax)
    peaks = {name: max((e.held for e in events), default=0) for name, events in timelines.items()}
    top = peaks.get(chosen) or max(peaks.values(), default=1) or 1
    unit, scale = unit_for(top, BYTE_UNITS)
    extra = []
    for name, events in timelines.items():
        after: dict[float, float] = {0.0: 0.0}          # what is held once every event at time t is done
        for e in events:
            after[e.t] = e.held / scale
        xs, ys = list(after), list(after.values())
        bold = name == chosen
        label = f"{name} units, peak {fmt_bytes(peaks[name])}"
        color = UNIT_COLORS.get(name, MUTED)
        if not bold and peaks[name] > 2 * top:
            extra.append(Line2D([], [], color=color, lw=1.0, alpha=0.45, label=label + " (off scale)"))
            continue
        ax.step(xs, ys, where="post", lw=2.2 if bold else 1.0, alpha=1.0 if bold else 0.45, color=color,
                label=label, gid=f"gathered:{name}")
        if bold:
            rs = [e.t for e in events if e.kind == "reduce_scatter"]
            ax.plot(rs, [after[t] for t in rs], "v", ms=3, color=MUTED, gid="reduce_scatter")
        else:
            top = max(top, peaks[name])
    split = 0.5
    ax.axvline(split, ymax=1 / 1.45, color=MUTED, lw=0.8, ls=":")         # under the legend's band
    ax.text(split / 2, 1.02, "forward", transform=ax.transAxes, ha="center", fontsize=8, color=MUTED)
    ax.text((1 + split) / 2, 1.02, "backward", transform=ax.transAxes, ha="center", fontsize=8, color=MUTED)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, top / scale * 1.45)                  # room for the legend above the curve
    ax.set_xticks([0, 0.5, 1], ["start", "backward\nstarts", "end"])
    ax.set_xlabel("one micro-batch (v: a reduce-scatter)", fontsize=8)
    ax.set_ylabel(f"gathered parameters ({unit})", fontsize=8)
    ax.tick_params(labelsize=8)
    handles, _ = ax.get_legend_handles_labels()
    ax.legend(handles=handles + extra, fontsize=8, loc="upper center", frameon=False, handlelength=1.2,
              borderaxespad=0.2)
    if title:
        ax.set_title(title, fontsize=9, pad=14)
