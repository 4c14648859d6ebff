"""The process-grid explorer: each rank's (dp, pp, cp, tp) coordinates, the groups of one dimension
coloured, the groups that cross a node boundary, and the bytes each link tier carries for the plan.

Placement and tiers come from the library (``parallel_lab.mesh.rank_of``, ``group_ranks``' rules and
``tier_of``), the bytes from ``parallel_lab.comm.report``: the picture is the arithmetic the ledger and
the planner use. Groups here are the plain grid lines of one dimension (the ranks that differ only in
that coordinate); the data-parallel gradient group of ``comm`` spans dp x cp, which "dp+cp" shows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from ... import comm as comm_mod
from ...errors import ParallelLabError
from ...hardware import CLUSTER_PRESETS, ClusterSpec
from ...mesh import node_count, rank_of, tier_of
from ...quantities import fmt_bytes
from ...specs import Plan
from ..palette import MUTED
from ..plots.grid import draw_grid, draw_tier_bytes, grid_legend_handles
from .base import SEQS, Explorer, dropdown, labelled, model_controls, model_from, slider, status_line, toggles

GRID_DIMS = ("tp", "cp", "pp", "dp", "dp+cp")
MAX_DRAWN_RANKS = 128
_AXES = {"tp": 3, "cp": 2, "pp": 1, "dp": 0}           # index in (dp, pp, cp, tp)


def grid_coords(plan: Plan) -> dict[int, tuple[int, int, int, int]]:
    """Rank -> (dp, pp, cp, tp), from ``mesh.rank_of`` (the library's placement)."""
    return {rank_of(plan, d, p, c, t): (d, p, c, t)
            for d in range(plan.dp) for p in range(plan.pp) for c in range(plan.cp) for t in range(plan.tp)}


def grid_groups(plan: Plan, dim: str) -> list[list[int]]:
    """The groups of ``dim``: ranks equal in every coordinate but ``dim`` ("dp+cp": but dp and cp)."""
    coords = grid_coords(plan)
    free = {_AXES["dp"], _AXES["cp"]} if dim == "dp+cp" else {_AXES[dim]}
    groups: dict[tuple[int, ...], list[int]] = {}
    for r in sorted(coords):
        key = tuple(c for i, c in enumerate(coords[r]) if i not in free)
        groups.setdefault(key, []).append(r)
    return list(groups.values())


class GridExplorer(Explorer):
    """The 4-D process grid of a plan on a cluster's nodes, and the bytes per link tier."""

    figsize = (9.6, 4.2)

    def __init__(self, model: str = "llama2-7b", dp: int = 2, tp: int = 4, pp: int = 2, cp: int = 1,
                 cluster: str = "h100-sxm", color_by: str = "tp", seq: int = 4096) -> None:
        c, custom = model_controls(model)
        c["cluster"] = dropdown("cluster", CLUSTER_PRESETS, cluster)
        c["seq"] = slider("sequence", SEQS, seq)
        c["dp"] = slider("dp", (1, 2, 4, 8, 16), dp)
        c["tp"] = slider("tp", (1, 2, 4, 8), tp)
        c["pp"] = slider("pp", (1, 2, 4, 8), pp)
        c["cp"] = slider("cp", (1, 2, 4), cp)
        c["color_by"] = toggles("colour groups of", GRID_DIMS, color_by, "56px")
        columns = [[c["model"], custom, c["cluster"], c["seq"]], [c["dp"], c["tp"]], [c["pp"], c["cp"]]]
        super().__init__(c, columns)
        self.children = (self.children[0], labelled("colour groups of", c["color_by"]), *self.children[1:])

    def compute(self, v: dict[str, Any]) -> dict[str, Any]:
        model, cluster = model_from(v), ClusterSpec.preset(v["cluster"])
        plan = Plan(dp=v["dp"], tp=v["tp"], pp=v["pp"], cp=v["cp"], seq=v["seq"],
                    grad_accum=1 if v["pp"] == 1 else 2 * v["pp"]).validate(model, None, cluster)
        if plan.world > MAX_DRAWN_RANKS:
            raise ParallelLabError(f"dp x tp x pp x cp = {plan.world} ranks; the grid draws up to "
                                   f"{MAX_DRAWN_RANKS}: lower a degree")
        groups = grid_groups(plan, v["color_by"])
        crossing = [tier_of(cluster, g) is cluster.inter for g in groups]
        rep = comm_mod.report(model, plan, cluster)
        tiers = (cluster.intra.name, cluster.inter.name)
        per_tier: dict[str, dict[str, float]] = {t: {} for t in tiers}
        for dim, b in rep.per_step_bytes.items():
            d = "tp" if dim == "tp_vocab" else dim
            per_tier[rep.tiers[dim]][d] = per_tier[rep.tiers[dim]].get(d, 0.0) + b
        self.verdict = f"{sum(crossing)} of {len(groups)} {v['color_by']} groups cross nodes"
        return {"plan": plan, "cluster": cluster, "coords": grid_coords(plan), "groups": groups,
                "crossing": crossing, "dim": v["color_by"], "per_tier": per_tier, "tiers": tiers, "report": rep}

    def layout_key(self, r: dict[str, Any]) -> Any:
        return node_count(r["plan"].world, r["cluster"].gpus_per_node)          # rows of nodes

    def make_axes(self, fig: Figure, r: dict[str, Any]) -> Sequence[Axes]:
        rows = self.layout_key(r)
        h = max(3.2, 0.75 + 0.5 * rows)
        fig.set_size_inches(self.figsize[0], h)
        gs = fig.add_gridspec(1, 2, width_ratios=(1.5, 1.0), wspace=0.25, left=0.07, right=0.97,
                              bottom=0.6 / h, top=1 - 0.45 / h)
        return [fig.add_subplot(gs[0]), fig.add_subplot(gs[1])]

    def draw(self, r: dict[str, Any], axes: list[Axes]) -> None:
        plan = r["plan"]
        draw_grid(axes[0], r["coords"], r["groups"], r["crossing"], r["cluster"].gpus_per_node,
                  title=f"{plan.world} ranks as (dp, pp, cp, tp) = ({plan.dp}, {plan.pp}, {plan.cp}, {plan.tp}); "
                        f"colour: {r['dim']} groups")
        draw_tier_bytes(axes[1], r["per_tier"], r["tiers"], title="bytes per GPU per step, by link tier")
        if not any(leg.get_gid() == "grid" for leg in self.figure.legends):
            leg = self.figure.legend(handles=grid_legend_handles(), loc="lower left", bbox_to_anchor=(0.07, 0.0),
                                     fontsize=8, frameon=False)
            leg.set_gid("grid")

    def describe(self, r: dict[str, Any]) -> str:
        n, k = len(r["groups"]), sum(r["crossing"])
        tiers = ", ".join(f"{t}: {fmt_bytes(sum(v.values()))}" for t, v in r["per_tier"].items())
        where = ", ".join(f"{d} on {t}" for d, t in r["report"].tiers.items())
        return (status_line(f"<b>{k} of {n}</b> {r['dim']} groups span more than one node of "
                            f"{r['cluster'].gpus_per_node} GPUs. Bytes per GPU per step by tier: {tiers}.")
                + status_line(f"Each dimension's collectives land on: {where or 'no communication'}.", MUTED))
