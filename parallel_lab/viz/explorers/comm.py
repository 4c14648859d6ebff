"""The Communication explorer.

The communication explorer: the bytes each GPU sends per step by parallel dimension and collective
(``parallel_lab.comm.report``), their time under the alpha-beta model on the link tier each group lands
on, and every collective in a table. The toggle "TP group across nodes" times tensor parallelism's
collectives on the inter-node link (:func:`tp_on_tier`) to show why TP stays inside a node.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import ipywidgets as W
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from ... import comm as comm_mod
from ...hardware import CLUSTER_PRESETS, ClusterSpec
from ...quantities import fmt_bytes, fmt_seconds
from ...specs import CP_KINDS, Plan
from ..plots.base import draw_message
from ..plots.comm import comm_axes, draw_comm_bytes, draw_comm_time
from .base import (
    SEQS,
    Explorer,
    degree_controls,
    dropdown,
    labelled,
    model_controls,
    model_from,
    slider,
    status_line,
    tier_label,
)

TP_DIMS = ("tp", "tp_vocab")


def tp_on_tier(report: comm_mod.CommReport, tier: Any) -> tuple[dict[str, float], dict[str, str]]:
    """Times and tier names of ``report`` with the TP collectives (``tp``, ``tp_vocab``) moved to ``tier``.

    Each call is timed again with :func:`parallel_lab.comm.collective_time` (same alpha-beta model); only
    the link changes. Used by the explorer's "TP group across nodes" toggle.
    """
    times, tiers = dict(report.time_s), dict(report.tiers)
    for dim in TP_DIMS:
        if dim in times:
            times[dim] = sum(c.count * comm_mod.collective_time(c.kind, c.message_bytes, c.group_size, tier)
                             for c in report.collectives if c.dim == dim)
            tiers[dim] = tier.name
    return times, tiers


class CommExplorer(Explorer):
    """Bytes per GPU per step by dimension and collective, and their time on each link tier.

    The toggle "TP across nodes" times the tensor-parallel collectives on the inter-node link instead of
    NVLink, as if the TP group straddled the node boundary: the four-parallelisms tutorial's 7.5 GB per step goes from
    milliseconds to about 150 ms.
    """

    figsize = (9.6, 3.7)

    def __init__(self, model: str = "llama2-7b", seq: int = 4096, dp: int = 1, tp: int = 8, pp: int = 1,
                 cp: int = 1, zero: int = 0, cluster: str = "h100-sxm") -> None:
        c, custom = model_controls(model)
        c["seq"] = slider("sequence", SEQS, seq)
        c["micro_batch"] = slider("micro-batch", (1, 2, 4, 8, 16, 32), 1)
        c["grad_accum"] = slider("micro-batches", (1, 2, 4, 8, 16, 32, 64, 128), 1 if pp == 1 else 2 * pp)
        c["cluster"] = dropdown("cluster", CLUSTER_PRESETS, cluster)
        c.update(degree_controls(dp, tp, pp, cp, zero))
        c["cp_kind"] = dropdown("CP kind", CP_KINDS, "ring")
        c["tp_across_nodes"] = W.ToggleButton(value=False, description="TP group across nodes",
                                              icon="", tooltip="time TP's collectives on the inter-node link",
                                              layout=W.Layout(width="200px"))
        self.table = W.HTML()
        columns = [
            [c["model"], custom, c["cluster"], c["seq"], c["micro_batch"], c["grad_accum"]],
            [c["dp"], c["tp"], c["pp"], c["cp"], c["cp_kind"]],
            [c["sp"], labelled("ZeRO stage", c["zero"]), c["tp_across_nodes"]],
        ]
        super().__init__(c, columns, extra=(self.table,))

    def compute(self, v: dict[str, Any]) -> dict[str, Any]:
        model = model_from(v)
        cluster = ClusterSpec.preset(v["cluster"])
        plan = Plan(dp=v["dp"], tp=v["tp"], pp=v["pp"], cp=v["cp"], zero=v["zero"], sp=v["sp"],
                    micro_batch=v["micro_batch"], grad_accum=v["grad_accum"], seq=v["seq"],
                    cp_kind=v["cp_kind"]).validate(model, None, cluster)
        rep = comm_mod.report(model, plan, cluster)
        near_t, near_tiers = dict(rep.time_s), dict(rep.tiers)
        far_t, far_tiers = tp_on_tier(rep, cluster.inter)
        across = bool(v["tp_across_nodes"])
        times, tiers = (far_t, far_tiers) if across else (near_t, near_tiers)
        self.verdict = fmt_seconds(sum(times.values()))
        return {"model": model, "plan": plan, "cluster": cluster, "report": rep, "across": across,
                "time_s": times, "tiers": tiers, "near_time_s": near_t, "far_time_s": far_t,
                "near_tiers": near_tiers, "far_tiers": far_tiers}

    def make_axes(self, fig: Figure, result: Any) -> Sequence[Axes]:
        return comm_axes(fig)

    def draw(self, r: dict[str, Any], axes: list[Axes]) -> None:
        a1, a2 = axes
        rep = r["report"]
        data = {"per_step_bytes": rep.per_step_bytes, "time_s": r["time_s"],
                "collectives": [c.to_json() for c in rep.collectives]}
        labels = {d: tier_label(r["cluster"], t) for d, t in r["tiers"].items()}
        if not rep.per_step_bytes:
            draw_message(a1, "no communication: every degree is 1")
            draw_message(a2, "")
            return
        draw_comm_bytes(a1, data, title="bytes sent per GPU per step")
        both = max([*r["near_time_s"].values(), *r["far_time_s"].values(), 0.0])     # one axis for both states
        draw_comm_time(a2, data, labels, title="time per step, alpha-beta" + (
            " (TP across nodes)" if r["across"] else ""),
            ghost=r["near_time_s"] if r["across"] else None, axis_max=both, ghost_label="inside a node")

    def describe(self, r: dict[str, Any]) -> str:
        rep, cl = r["report"], r["cluster"]
        lines = []
        tp_bytes = sum(rep.per_step_bytes.get(d, 0.0) for d in TP_DIMS)
        if tp_bytes:
            near = sum(r["near_time_s"].get(d, 0.0) for d in TP_DIMS)
            far = sum(r["far_time_s"].get(d, 0.0) for d in TP_DIMS)
            lines.append(status_line(
                f"<b>TP</b> sends {fmt_bytes(tp_bytes)} per GPU per step: <b>{fmt_seconds(near)}</b> on "
                f"{tier_label(cl, cl.intra.name)} inside a node, <b>{fmt_seconds(far)}</b> on "
                f"{tier_label(cl, cl.inter.name)} across nodes ({far / near:.1f}x slower)."))
        total = sum(r["time_s"].values())
        per_dim = ", ".join(f"{d} {fmt_seconds(t)}" for d, t in r["time_s"].items())
        none = "No communication: every degree is 1."
        lines.append(status_line(f"All communication, if none overlapped compute: <b>{fmt_seconds(total)}</b> "
                           f"per step ({per_dim})." if r["time_s"] else none))
        self.table.value = collectives_table(rep, r["tiers"], r["time_s"], cl)
        return "".join(lines)


def collectives_table(rep: comm_mod.CommReport, tiers: dict[str, str], times: dict[str, float],
                      cluster: ClusterSpec) -> str:
    """The report's collectives as an HTML table: one row per (dim, kind, message size, group)."""
    if not rep.collectives:
        return ""
    th = "".join(f"<th style='text-align:{a};padding:2px 8px'>{h}</th>" for h, a in (
        ("dim", "left"), ("collective", "left"), ("phase", "left"), ("calls", "right"),
        ("message", "right"), ("group", "right"), ("sent per step", "right"), ("link", "left")))
    rows = []
    for c in rep.collectives:
        cells = (c.dim, c.kind.replace("_", "-"), c.phase, f"{c.count:,}", fmt_bytes(c.message_bytes),
                 str(c.group_size), fmt_bytes(c.wire_bytes), tier_label(cluster, tiers.get(c.dim, "")))
        rows.append("<tr>" + "".join(
            f"<td style='text-align:{'right' if i in (3, 4, 5, 6) else 'left'};padding:2px 8px'>"
            f"{html.escape(x)}</td>" for i, x in enumerate(cells)) + "</tr>")
    return ("<details><summary>every collective of one GPU in one step "
            f"({len(rep.collectives)} kinds)</summary><table style='border-collapse:collapse;font-size:12px'>"
            f"<tr>{th}</tr>{''.join(rows)}</table></details>")



