"""The Pipeline explorer.

The pipeline explorer: a schedule (``parallel_lab.schedules``) simulated (``parallel_lab.simulate``) with
per-action costs f, b, w and a p2p latency, drawn one row per rank with its idle gaps; the bubble ratio
beside its closed form, and the peak number of in-flight micro-batches per rank. A measured timeline
(``set_measured``) is drawn below the simulated one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ipywidgets as W
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from ... import simulate as simulate_mod
from ...quantities import fmt_seconds
from ...schedules.generators import build_schedule
from ...specs import SCHEDULES
from ..palette import MUTED
from ..plots.timeline import draw_timeline, draw_timeline_ends, needs_ends, timeline_rows
from .base import DESC, ROW_ITEM, Explorer, int_slider, labelled, status_line, toggles


class PipelineExplorer(Explorer):
    """A pipeline schedule simulated: one row per rank, forward / backward / weight-gradient boxes and the
    idle gaps between them, with the bubble ratio and the peak number of in-flight micro-batches.

    ``measured`` (or :meth:`set_measured`) adds a measured timeline below the simulated one: rows
    ``[rank, start_s, end_s, kind, microbatch, chunk]`` (seconds), the shape of ``parallel-lab bubble
    --json``'s ``timeline``, as the runnable pipeline records them.
    """

    figsize = (9.6, 3.2)

    def __init__(self, schedule: str = "1f1b", stages: int = 4, microbatches: int = 8, interleave: int = 2,
                 measured: Any = None, measured_title: str = "measured") -> None:
        self._measured = measured
        self._measured_title = measured_title
        self.unit_s: float | None = None     # seconds per cost unit (F = 1): the simulated timeline in ms too
        c: dict[str, W.ValueWidget] = {
            "schedule": toggles("schedule", SCHEDULES, schedule, "86px"),
            "stages": int_slider("stages p", 1, 16, stages),
            "microbatches": int_slider("micro-batches m", 1, 128, microbatches),
            "interleave": int_slider("interleave v", 1, 32, interleave),
            "f": W.FloatSlider(value=1.0, min=0.25, max=3.0, step=0.25, description="forward f",
                               continuous_update=False, style=DESC, layout=ROW_ITEM),
            "b": W.FloatSlider(value=1.0, min=0.25, max=3.0, step=0.25, description="backward b",
                               continuous_update=False, style=DESC, layout=ROW_ITEM),
            "w": W.FloatSlider(value=1.0, min=0.0, max=3.0, step=0.25, description="weight grad w",
                               continuous_update=False, style=DESC, layout=ROW_ITEM),
            "p2p": W.FloatSlider(value=0.0, min=0.0, max=1.0, step=0.05, description="p2p latency",
                                 continuous_update=False, style=DESC, layout=ROW_ITEM),
        }
        note = W.HTML("<small>costs per micro-batch per model chunk; a backward that is not split costs "
                      "b + w</small>", layout=ROW_ITEM)
        columns = [[c["stages"], c["microbatches"], c["interleave"]], [c["f"], c["b"]],
                   [c["w"], c["p2p"], note]]
        super().__init__(c, columns)
        self.children = (labelled("schedule", c["schedule"]), *self.children)
        c["schedule"].observe(self._sync_interleave, names="value")
        self._sync_interleave()

    def _sync_interleave(self, _: Any = None) -> None:
        self.widgets["interleave"].disabled = self.widgets["schedule"].value != "interleaved"

    # ---- measured data --------------------------------------------------------------------------
    def set_measured(self, timeline: Any, title: str = "measured") -> None:
        """Show a measured timeline (rows ``[rank, start_s, end_s, kind, microbatch, chunk]``) below the
        simulated one; ``None`` removes it."""
        self._measured, self._measured_title = timeline, title
        self.refresh()

    def compute(self, v: dict[str, Any]) -> dict[str, Any]:
        name = v["schedule"]
        vv = v["interleave"] if name == "interleaved" else 1
        costs = simulate_mod.Costs(f=v["f"], b=v["b"], w=v["w"], p2p=v["p2p"])
        sched = build_schedule(name, v["stages"], v["microbatches"], vv)
        sim = simulate_mod.simulate(sched, costs)
        formula = (simulate_mod.bubble_formula(name, v["stages"], v["microbatches"], vv, costs)
                   if v["p2p"] == 0 else None)
        measured = timeline_rows(self._measured) if self._measured is not None else None
        self.verdict = f"bubble {sim.bubble_ratio:.1%}"
        return {"name": name, "p": v["stages"], "m": v["microbatches"], "v": vv, "costs": costs, "sim": sim,
                "formula": formula, "measured": measured}

    def layout_key(self, r: dict[str, Any]) -> Any:
        mp = len({row[0] for row in r["measured"]}) if r["measured"] else 0
        return (r["p"], mp, not mp and needs_ends(r["p"], r["m"], r["v"]))

    def make_axes(self, fig: Figure, r: dict[str, Any]) -> Sequence[Axes]:
        p, mp, ends = self.layout_key(r)
        rows = [p] + ([mp] if mp else [])
        title_in, label_in = 0.32, 0.5                       # inches above (title) and below (x label)
        h_in = [0.45 + 0.3 * n for n in rows]
        total = sum(title_in + h + label_in for h in h_in) + 0.05
        fig.set_size_inches(self.figsize[0], total)
        axes, top = [], 1.0
        for i, h in enumerate(h_in):
            bottom = top - (title_in + h) / total
            if ends and i == 0:                    # the step's start and its end, side by side
                gs = fig.add_gridspec(1, 2, wspace=0.12, left=0.085, right=0.855, bottom=bottom,
                                      top=bottom + h / total)
                axes += [fig.add_subplot(gs[0]), fig.add_subplot(gs[1])]
            else:
                axes.append(fig.add_axes((0.085, bottom, 0.77, h / total)))
            top = bottom - label_in / total
        return axes

    def draw(self, r: dict[str, Any], axes: list[Axes]) -> None:
        sim = r["sim"]
        title = (f"simulated {r['name']}: p={r['p']}, m={r['m']}" + (f", v={r['v']}" if r["v"] > 1 else "")
                 + f"; bubble {sim.bubble_ratio:.1%}")
        # a time axis on round numbers: it stays put (and shows the step growing) while m or p change
        if r["measured"] and self.unit_s:            # both in ms on one axis: simulated beside measured
            draw_timeline(axes[0], sim, title=title + f" (F = {self.unit_s * 1e3:.3g} ms, as measured)",
                          time_unit="time (ms)", step_time=sim.step_time, time_scale=self.unit_s * 1e3)
        elif len(axes) > 1 and not r["measured"]:     # many micro-batches: the start and the end, not a moire
            draw_timeline_ends(axes[0], axes[1], sim, r["p"], title=title, time_unit="time (cost units)")
        else:
            # a time axis on round numbers: it stays put (and shows the step growing) while m or p change
            draw_timeline(axes[0], sim, title=title, time_unit="time (cost units)", step_time=sim.step_time,
                          sticky=True)
        if r["measured"]:
            draw_timeline(axes[1], r["measured"], title=self._measured_title, time_unit="time (ms)",
                          time_scale=1e3)
            if self.unit_s:
                right = max(axes[0].get_xlim()[1], axes[1].get_xlim()[1])
                for ax in axes[:2]:
                    ax.set_xlim(0, right)

    def describe(self, r: dict[str, Any]) -> str:
        sim = r["sim"]
        formula = "" if r["formula"] is None else f" (closed form: {r['formula']:.1%})"
        peaks = ", ".join(str(n) for n in sim.peak_inflight)
        lines = [
            status_line(f"<b>Bubble ratio {sim.bubble_ratio:.1%}</b>{formula}: idle time over ideal compute time. "
                  f"Idle fraction of the whole step {sim.idle_fraction:.1%}; step time {sim.step_time:g}."),
            status_line(f"Peak in-flight (micro-batch, chunk) pairs per rank: [{peaks}]"
                  + (f"; in micro-batches of a whole stage: "
                     f"[{', '.join(f'{x:g}' for x in sim.peak_activation_units)}]" if r["v"] > 1 else "")
                  + ".", MUTED),
        ]
        if r["measured"]:
            rows = r["measured"]
            t0 = min(x[1] for x in rows)
            span = max(x[2] for x in rows) - t0
            ranks = {x[0] for x in rows}
            busy = sum(x[2] - x[1] for x in rows)
            idle = 1 - busy / (len(ranks) * span) if span > 0 else 0.0
            lines.append(status_line(f"Measured: {len(ranks)} ranks, step {fmt_seconds(span)}, idle fraction "
                               f"{idle:.1%} (simulated {sim.idle_fraction:.1%})."))
        return "".join(lines)


