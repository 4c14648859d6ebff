"""Measured training steps: compute beside communication per rank, and loss curves that should overlap.

Two pictures for data parallelism (lesson 02), both pure functions of measured data:

* :func:`draw_compute_comm`: one row per rank and two lanes per row, the compute intervals (forward,
  backward, optimizer step) above and the traced collectives below, on one time axis. The intervals are
  ``simulate.Interval`` records, what ``distributed.instruments.timeline.Timeline.with_comm`` returns (kind
  ``compute`` or ``comm``). A collective is drawn from the moment it is launched until the moment the
  training step has it back (an asynchronous all-reduce of a DDP bucket: launched during backward, waited
  for before the optimizer step), so overlap with backward is what the eye sees.
  :func:`exposed_comm` is the number that goes with it: per rank and step, the time from the end of the
  last backward to the start of the optimizer step, i.e. communication nobody hid.
* :func:`draw_loss_curves`: one line per named curve over the steps, each with its own marker and dash so
  that curves lying on top of each other stay visible (gradient accumulation done right overlaps the
  single-process run; done wrong it does not).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from parallel_lab.simulate import Interval

from ..palette import COLLECTIVE_COLORS, CURVE_COLORS, KIND_COLORS, KIND_LABELS, STEP_COLORS
from .base import new_figure, set_title

STEP_COLOR = STEP_COLORS["step"]
_COMPUTE_COLORS = {"F": KIND_COLORS["F"], "B": KIND_COLORS["B"], "step": STEP_COLOR}
_COMPUTE_LABELS = {"F": KIND_LABELS["F"], "B": KIND_LABELS["B"], "step": "optimizer step"}


def _comm_kind(name: str) -> str:
    """``"dp:all_reduce"`` -> ``"all_reduce"`` (the interval name of a traced call is ``dim:kind``)."""
    return name.split(":", 1)[-1]


def draw_compute_comm(ax: Axes, intervals: Iterable[Interval], *, title: str | None = None,
                      time_scale: float = 1e3, time_unit: str = "time (ms)") -> dict[str, Any]:
    """Per rank, compute boxes on the upper lane and collectives on the lower lane (module docstring).

    ``time_scale`` multiplies the times (seconds -> ms by default). Returns ``{"ranks", "makespan",
    "n_comm"}`` (scaled makespan; the number of collectives drawn). Collectives of one rank that overlap in
    time are drawn translucent on the same lane, so a darker band means several calls in flight.
    """
    spans = list(intervals)
    ranks = sorted({s.rank for s in spans})
    t0 = min((s.t_start for s in spans), default=0.0)
    ax.clear()
    height = 0.36
    n_comm = 0
    for row, rank in enumerate(ranks):
        y = len(ranks) - 1 - row
        for s in spans:
            if s.rank != rank:
                continue
            x, w = (s.t_start - t0) * time_scale, (s.t_end - s.t_start) * time_scale
            if s.kind == "comm":
                color = COLLECTIVE_COLORS.get(_comm_kind(s.name), "#999999")
                ax.broken_barh([(x, w)], (y - 0.02 - height, height), facecolors=color, alpha=0.45,
                               edgecolor=color, linewidth=0.6)
                n_comm += 1
            else:
                color = _COMPUTE_COLORS.get(s.name, KIND_COLORS["other"])
                ax.broken_barh([(x, w)], (y + 0.02, height), facecolors=color, edgecolor="white", linewidth=0.5)
    makespan = max((s.t_end for s in spans), default=t0) - t0
    ax.set_xlim(0, makespan * time_scale * 1.01 or 1.0)
    ax.set_ylim(-0.6, len(ranks) - 0.4)
    ax.set_yticks([len(ranks) - 1 - i for i in range(len(ranks))], [f"rank {r}" for r in ranks])
    ax.set_xlabel(time_unit)
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    kinds = sorted({_comm_kind(s.name) for s in spans if s.kind == "comm"})
    handles = [Patch(color=_COMPUTE_COLORS[k], label=_COMPUTE_LABELS[k]) for k in ("F", "B", "step")]
    handles += [Patch(color=COLLECTIVE_COLORS.get(k, "#999999"), alpha=0.6, label=k.replace("_", "-") + " (in flight)")
                for k in kinds]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=8)
    set_title(ax, title)
    return {"ranks": ranks, "makespan": makespan * time_scale, "n_comm": n_comm}


def exposed_comm(intervals: Iterable[Interval]) -> list[float]:
    """Seconds between the end of each step's last backward and the start of its optimizer step, for every
    rank and step (in order of time): communication the backward pass did not hide."""
    out = []
    by_rank: dict[int, list[Interval]] = {}
    for s in intervals:
        if s.kind == "compute":
            by_rank.setdefault(s.rank, []).append(s)
    for rank in sorted(by_rank):
        last_b = None
        for s in sorted(by_rank[rank], key=lambda s: s.t_start):
            if s.name == "B":
                last_b = s
            elif s.name == "step" and last_b is not None:
                out.append(s.t_start - last_b.t_end)
                last_b = None
    return out


def compute_comm_figure(panels: Mapping[str, Iterable[Interval]], *, time_scale: float = 1e3,
                        time_unit: str = "time (ms)") -> Figure:
    """One :func:`draw_compute_comm` panel per named timeline, stacked, each on its own time axis."""
    panels = {k: list(v) for k, v in panels.items()}
    n_ranks = max((len({s.rank for s in v}) for v in panels.values()), default=1)
    h = 0.8 + len(panels) * (0.6 + 0.55 * n_ranks)
    fig = new_figure((9.6, h))
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    fig.subplots_adjust(left=0.08, right=0.8, bottom=0.5 / h, top=1 - 0.35 / h, hspace=0.9)
    for ax, (name, spans) in zip(axes, panels.items(), strict=True):
        draw_compute_comm(ax, spans, title=name, time_scale=time_scale, time_unit=time_unit)
    return fig


_STYLES = (("o", "-"), ("s", "--"), ("^", ":"), ("D", "-."), ("v", (0, (5, 1))))


def draw_loss_curves(ax: Axes, curves: Mapping[str, Sequence[float]], *, title: str | None = None,
                     ylabel: str = "loss", colors: Sequence[str] | None = None) -> dict[str, Any]:
    """One line per curve (steps on x), distinct markers and dashes; returns ``{"curves", "steps"}``."""
    ax.clear()
    palette = list(colors) if colors is not None else list(CURVE_COLORS)
    steps = 0
    for i, (name, ys) in enumerate(curves.items()):
        marker, dash = _STYLES[i % len(_STYLES)]
        ax.plot(range(len(ys)), list(ys), marker=marker, linestyle=dash, color=palette[i % len(palette)],
                markersize=6 - i, linewidth=1.6, label=name)
        steps = max(steps, len(ys))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_xticks(range(steps))
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.legend(frameon=False, fontsize=8)
    set_title(ax, title)
    return {"curves": list(curves), "steps": steps}


def loss_curves_figure(curves: Mapping[str, Sequence[float]], *, title: str | None = None) -> Figure:
    """:func:`draw_loss_curves` on a figure of its own."""
    fig = new_figure((7.5, 3.8))
    ax = fig.add_subplot()
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.14, top=0.9)
    draw_loss_curves(ax, curves, title=title)
    return fig
