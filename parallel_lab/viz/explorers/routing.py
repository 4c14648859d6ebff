"""The routing explorer: how unevenly tokens reach the experts, what capacity drops, what ep sends.

Controls: a mixture-of-experts model, the router's skew (``routing.synthetic_choices``: popularity
``(e + 1) ** -skew``; 0 is what a well-balanced router, helped by the aux loss, gets close to), the capacity
factor, and ``ep``. The left chart: tokens per expert coloured by expert rank, the dropped part hatched,
capacity as a line (``routing.load_report`` on ``SEQUENCES`` sequences of ``SEQ`` tokens, one MoE block).
The right chart: bytes one GPU sends per step for the all-to-alls beside the gradient all-reduces
(``comm.report`` of ``Plan(dp=DP, ep=ep, seq=SEQ)``). The status names the drops and the busiest rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from ... import comm
from ...routing import load_report
from ...specs import ModelSpec, Plan
from ..palette import MUTED
from ..plots.base import two_panels
from ..plots.routing import draw_ep_bytes, draw_expert_load
from .base import Explorer, dropdown, slider, status_line

MODELS = ("mixtral-8x7b", "deepseekmoe-16b", "tiny-moe")
SEQ, SEQUENCES, DP = 1024, 2, 8


class RoutingExplorer(Explorer):
    """Routing imbalance, capacity and the all-to-all, for one MoE block."""

    figsize = (9.6, 3.9)

    def __init__(self, model: str = "mixtral-8x7b", skew: float = 1.0, capacity_factor: float = 1.25,
                 ep: int = 4) -> None:
        c = {"model": dropdown("model", MODELS, model),
             "skew": slider("skew", (0.0, 0.25, 0.5, 1.0, 1.5, 2.0), skew),
             "capacity_factor": slider("capacity", (1.0, 1.25, 1.5, 2.0, 3.0, 4.0), capacity_factor),
             "ep": slider("ep", (1, 2, 4, 8), ep)}
        self._axis: dict[Any, float] = {}            # the axis top of (model, capacity, ep): the most skewed load
        self._last: tuple[Any, Any] | None = None     # (setting without skew, routed) of the last picture
        super().__init__(c, [[c["model"], c["skew"]], [c["capacity_factor"], c["ep"]]])

    def compute(self, v: dict[str, Any]) -> dict[str, Any]:
        model = ModelSpec.preset(v["model"]).with_(capacity_factor=float(v["capacity_factor"]))
        ep = v["ep"]
        rep = load_report(model, SEQ, ep=ep, skew=float(v["skew"]), sequences=SEQUENCES)
        plan = Plan(dp=DP, ep=ep, seq=SEQ, micro_batch=SEQUENCES).validate(model)
        per_step = comm.report(model, plan).per_step_bytes
        self.verdict = f"dropped {rep.dropped:.1%}, busiest rank {rep.imbalance:.2f}x the mean"
        key = (v["model"], v["capacity_factor"], ep)
        if key not in self._axis:
            skews = self.widgets["skew"].options
            self._axis[key] = max(max(load_report(model, SEQ, ep=ep, skew=float(s), sequences=SEQUENCES).routed)
                                  for s in (skews[0], skews[-1]))
        ghost = self._last[1] if self._last is not None and self._last[0] == key else None
        self._last = (key, list(rep.routed))
        return {"model": model, "ep": ep, "load": rep, "per_step": per_step, "plan": plan, "ghost": ghost,
                "ymax": self._axis[key]}

    def layout_key(self, r: dict[str, Any]) -> Any:
        return 0

    def make_axes(self, fig: Figure, r: dict[str, Any]) -> Sequence[Axes]:
        return two_panels(fig, (1.6, 1.0), wspace=0.35, left=0.08, right=0.97, bottom=0.15, top=0.9)

    def draw(self, r: dict[str, Any], axes: list[Axes]) -> None:
        m = r["model"]
        draw_expert_load(axes[0], r["load"], r["ep"],
                         title=f"{m.name}: {SEQUENCES} x {SEQ} tokens, top-{m.top_k} of {m.experts}",
                         ghost=r["ghost"], ymax=r["ymax"], ghost_label="before this change")
        draw_ep_bytes(axes[1], r["per_step"], title=f"one GPU, one step (dp={DP}, ep={r['ep']})")

    def describe(self, r: dict[str, Any]) -> str:
        load = r["load"]
        ranks = ", ".join(f"{j}: {n:,}" for j, n in enumerate(load.per_rank))
        return (status_line(f"<b>{load.dropped:.1%}</b> of the token choices find their expert full and are "
                            f"dropped (capacity {load.capacity:,} per expert over {SEQUENCES} sequences).")
                + status_line(f"Tokens each expert rank computes: {ranks}; the busiest does "
                              f"{load.imbalance:.2f}x the mean, and the others wait for it.", MUTED))
