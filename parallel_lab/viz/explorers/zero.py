"""The ZeRO / FSDP explorer: which rank owns which shard of which unit, and when ZeRO-3 gathers and frees.

Left: every ZeRO unit of the plan (``sharding.unit_sizes``: one per transformer block plus the root unit of
embeddings, final norm and head, or a single root unit) as a bar of its padded flat buffer, cut into the
``g = dp x cp`` equal shards the ranks own (``sharding.shard_range``). Right: the parameters one rank holds
gathered over one micro-batch of ZeRO-3 (:func:`~parallel_lab.viz.plots.zero.gather_timeline`), for
block units and for a single root unit side by side: with block units the peak is the root plus two
blocks (the one computing and the prefetched next one); with one root unit it rises to the whole model.
The status gives the ledger's bytes per rank of each model-state category for the chosen stage
(``ledger.state_bytes``) and its ZeRO-3 gathered peak (``ledger_buffers.zero3_gathered_bytes``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from ... import ledger as ledger_mod
from ... import ledger_buffers as ledger_buffers_mod
from ...optimizers import OPTIMIZERS
from ...quantities import fmt_bytes
from ...sharding import padded, param_comm_bytes, shard_group, shard_range, unit_sizes
from ...specs import Plan
from ..palette import MUTED
from ..plots.base import draw_message
from ..plots.zero import (
    STATE,
    STATE_LABELS,
    draw_gather_timeline,
    draw_shards,
    draw_zero_stage,
    gather_timeline,
    rank_legend,
)
from .base import Explorer, dropdown, fresh, labelled, model_controls, model_from, slider, status_line, toggles

UNITS = ("block", "root")


class ZeroExplorer(Explorer):
    """ZeRO-1/2/3 shards per unit and rank, and ZeRO-3's gathered parameters over a step."""

    figsize = (9.6, 3.8)

    def __init__(self, model: str = "llama2-7b", dp: int = 4, zero: int = 3, zero_unit: str = "block",
                 optimizer: str = "adam-mixed") -> None:
        c, custom = model_controls(model)
        c["dp"] = slider("dp", (1, 2, 4, 8, 16), dp)
        c["optimizer"] = dropdown("optimizer", OPTIMIZERS, optimizer)
        c["zero"] = toggles("ZeRO stage", (0, 1, 2, 3), zero)
        c["zero_unit"] = toggles("ZeRO unit", UNITS, zero_unit, "64px")
        super().__init__(c, [[c["model"], custom], [c["dp"], c["optimizer"]]])
        self.children = (self.children[0], labelled("ZeRO stage", c["zero"]), labelled("ZeRO unit", c["zero_unit"]),
                         *self.children[1:])

    def compute(self, v: dict[str, Any]) -> dict[str, Any]:
        model = model_from(v)
        plan = Plan(dp=v["dp"], zero=v["zero"], zero_unit=v["zero_unit"], optimizer=v["optimizer"],
                    seq=min(Plan.seq, model.max_positions)).validate(model)     # seq: no part in the shards
        g = shard_group(plan)
        per_unit = {u: plan.with_(zero=3, zero_unit=u) for u in UNITS} if g > 1 else {}     # ZeRO-3 needs g > 1
        timelines = {}
        for u, p in per_unit.items():
            pb = param_comm_bytes(p)
            timelines[u] = gather_timeline({k: padded(n, g) * pb for k, n in unit_sizes(model, p).items()})
        units = {k: padded(n, g) for k, n in unit_sizes(model, plan).items()}
        first = next(iter(unit_sizes(model, plan).items()))
        self.verdict = f"{len(units)} units x {g} shards"
        sharded = {"parameters": plan.zero >= 3 and g > 1, "gradients": plan.zero >= 2 and g > 1,
                   "optimizer_states": plan.zero >= 1 and g > 1}
        return {"model": model, "plan": plan, "g": g, "units": units, "timelines": timelines,
                "state": ledger_mod.state_bytes(model, plan), "sharded": sharded,
                "full": ledger_mod.state_bytes(model, plan.with_(zero=0)),
                "peaks": {u: ledger_buffers_mod.zero3_gathered_bytes(model, p) for u, p in per_unit.items()} or None,
                "first": (first[0], first[1], [shard_range(first[1], g, r) for r in range(min(g, 4))])}

    def layout_key(self, r: dict[str, Any]) -> Any:
        # one figure per (model, group, unit): going back to a recent setting reuses its picture
        return (r["model"], r["g"], r["plan"].zero_unit)

    def make_axes(self, fig: Figure, r: dict[str, Any]) -> Sequence[Axes]:
        gs = fig.add_gridspec(1, 3, width_ratios=(1.25, 0.85, 1.0), wspace=0.55, left=0.075, right=0.985,
                              bottom=0.3, top=0.88)
        return [fig.add_subplot(gs[i]) for i in range(3)]

    def draw(self, r: dict[str, Any], axes: list[Axes]) -> None:
        plan, g = r["plan"], r["g"]
        if fresh(axes[0], (r["model"], g, plan.zero, plan.optimizer)):
            draw_zero_stage(axes[0], r["full"], r["state"], r["sharded"], g,
                            title=f"ZeRO-{plan.zero}: what each rank holds")
        if fresh(axes[1], (r["model"], g, plan.zero_unit)):   # an axes left alone keeps its cached picture
            draw_shards(axes[1], r["units"], g,
                        title=(f"{len(r['units'])} units" if len(r["units"]) > 1 else "one unit")
                        + f", {g} shards each")
            rank_legend(axes[1], g)
        what = "ZeRO-3: gathered parameters" if plan.zero == 3 else "what ZeRO-3 would gather"
        if not fresh(axes[2], (r["model"], g, plan.optimizer, plan.zero_unit, what)):
            return
        if r["timelines"]:
            draw_gather_timeline(axes[2], r["timelines"], plan.zero_unit, title=what)
        else:
            draw_message(axes[2], "dp=1: one rank holds\nevery parameter;\nnothing is gathered")

    def describe(self, r: dict[str, Any]) -> str:
        plan, st, g, full = r["plan"], r["state"], r["g"], r["full"]
        held = []
        for k in STATE:
            name = STATE_LABELS[k]
            held.append(f"1/{g} of the {name} ({fmt_bytes(st[k])} of {fmt_bytes(full[k])})" if r["sharded"][k]
                        else f"all {name} ({fmt_bytes(st[k])})")
        name, n, ranges = r["first"]
        owns = "; ".join(f"rank {i} owns [{a:,}, {b:,})" for i, (a, b) in enumerate(ranges))
        peaks = r["peaks"]
        gathered = ("" if peaks is None else
                    status_line(f"ZeRO-3 gathers one unit at a time: at most {fmt_bytes(peaks['block'])} per rank "
                                f"with block units, {fmt_bytes(peaks['root'])} with one root unit.", MUTED))
        total = sum(st[k] for k in STATE)
        return (status_line(f"<b>ZeRO-{plan.zero} over {g} ranks</b>: each rank holds " + ", ".join(held)
                            + f": <b>{fmt_bytes(total)}</b> of model state per rank.")
                + gathered
                + f"<details style='color:{MUTED};font-size:12px'><summary>element ranges</summary>Unit {name} has "
                  f"{n:,} elements, padded to {padded(n, g):,}: {owns}{'; ...' if g > 4 else ''}.</details>")
