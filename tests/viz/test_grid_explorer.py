"""The process-grid explorer against the library's placement (``mesh.rank_of``, ``group_ranks``,
``tier_of``) and its communication report: every square, border and bar read back from the figure."""

from __future__ import annotations

import pytest

from parallel_lab import comm, mesh
from parallel_lab.errors import ParallelLabError
from parallel_lab.hardware import ClusterSpec
from parallel_lab.specs import ModelSpec, Plan
from parallel_lab.viz.explorers.grid import GridExplorer, grid_coords, grid_groups

H100 = ClusterSpec.preset("h100-sxm")


def squares(ax) -> dict[int, object]:
    return {int(p.get_gid().split(":")[1]): p for p in ax.patches if (p.get_gid() or "").startswith("rank:")}


def test_coordinates_and_groups_are_the_librarys_placement():
    plan = Plan(dp=2, tp=4, pp=2, cp=2)
    coords = grid_coords(plan)
    assert sorted(coords) == list(range(plan.world))
    for r, (d, p, c, t) in coords.items():
        assert mesh.rank_of(plan, d, p, c, t) == r
    assert grid_groups(plan, "tp")[0] == mesh.group_ranks(plan, "tp")
    assert grid_groups(plan, "cp")[0] == mesh.group_ranks(plan, "cp")
    assert grid_groups(plan, "dp+cp")[0] == sorted(mesh.group_ranks(plan, "dp"))   # comm's gradient group
    assert sorted(r for g in grid_groups(plan, "pp") for r in g) == list(range(plan.world))


def test_the_figure_colours_groups_and_borders_the_ones_that_cross_nodes():
    ex = GridExplorer(dp=2, tp=8, pp=2, cp=1, color_by="dp")          # 32 ranks on four nodes of 8
    assert ex.error is None
    grid_ax, bytes_ax = ex.figure.axes
    sq = squares(grid_ax)
    assert len(sq) == 32
    plan = ex.result["plan"]
    for group in grid_groups(plan, "dp"):
        colors = {tuple(sq[r].get_facecolor()) for r in group}
        assert len(colors) == 1                                         # one colour per group
        crosses = mesh.tier_of(H100, group) is H100.inter
        assert crosses                                                  # dp=2 with tp*pp = 16 spans two nodes
        assert all(sq[r].get_linewidth() == 2.0 for r in group)
    assert ex.verdict == "16 of 16 dp groups cross nodes"
    ex.widgets["color_by"].value = "tp"                                 # tp=8 fills one node: no group crosses
    sq = squares(ex.figure.axes[0])
    assert ex.verdict == "0 of 4 tp groups cross nodes" and all(p.get_linewidth() == 1.0 for p in sq.values())
    texts = {t.get_gid(): t.get_text() for t in ex.figure.axes[0].texts}
    assert texts["coords:9"] == "9\n0,1,0,1"                           # rank 9 = (dp 0, pp 1, cp 0, tp 1)


def test_bytes_per_tier_are_the_communication_reports():
    ex = GridExplorer(model="llama2-7b", dp=4, tp=8, pp=2, cp=1, seq=4096)
    plan = ex.result["plan"]
    rep = comm.report(ModelSpec.preset("llama2-7b"), plan, H100)
    want: dict[str, float] = {}
    for dim, b in rep.per_step_bytes.items():
        want[rep.tiers[dim]] = want.get(rep.tiers[dim], 0.0) + b
    got: dict[str, float] = {}
    for p in ex.figure.axes[1].patches:
        tier = (p.get_gid() or ":").split(":")[0]
        if tier:
            got[tier] = got.get(tier, 0.0) + p.get_height()
    assert got == pytest.approx({t: want.get(t, 0.0) for t in got})
    assert want.get(H100.intra.name, 0) > 0 and want.get(H100.inter.name, 0) > 0   # TP inside, DP across


def test_too_many_ranks_to_draw_is_refused_with_the_fix():
    ex = GridExplorer(dp=16, tp=8, pp=2)
    assert isinstance(ex.error, ParallelLabError) and "lower a degree" in str(ex.error)
