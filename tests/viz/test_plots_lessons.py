"""The lessons' static figures (viz/plots/lessons_figures.py): what they draw is the data they were given."""

from __future__ import annotations

from parallel_lab import ledger, mesh
from parallel_lab.hardware import ClusterSpec
from parallel_lab.specs import ModelSpec, Plan
from parallel_lab.viz.plots.base import to_png
from parallel_lab.viz.plots.lessons_figures import (
    bubble_sweep_figure,
    grid_groups_figure,
    tp_split_figure,
    zero_shards_figure,
)

STATE = ("parameters", "gradients", "optimizer_states")


def _patches(fig, prefix):
    return {p.get_gid(): p for ax in fig.axes for p in ax.patches if (p.get_gid() or "").startswith(prefix)}


def test_zero_shards_fill_one_slice_per_rank_where_sharded():
    model, plan = ModelSpec.preset("tiny-llama"), Plan(dp=4)
    per = [ledger.state_bytes(model, plan.with_(zero=z)) for z in range(4)]
    sharded = [{c: per[z][c] < per[0][c] for c in STATE} for z in range(4)]
    assert [sum(s.values()) for s in sharded] == [0, 1, 2, 3]
    fig = zero_shards_figure(per, sharded, 4)
    cells = _patches(fig, "zero")
    assert len(cells) == 4 * 3 * 4
    for z in range(4):
        for c in STATE:
            widths = {round(cells[f"zero{z}:{c}:{r}"].get_width(), 6) for r in range(4)}
            assert widths == {round(0.9 / 4 if sharded[z][c] else 0.9, 6)}, (z, c)
    assert to_png(fig)


def test_grid_groups_one_panel_per_axis_with_its_crossing_count():
    h100, plan = ClusterSpec.preset("h100-sxm"), Plan(dp=2, pp=2, cp=2, tp=8)
    groups = {d: mesh.all_groups(plan, d) for d in ("tp", "cp", "pp", "dp")}
    crossing = {d: [mesh.tier_of(h100, g) is h100.inter for g in gs] for d, gs in groups.items()}
    coords = {r: tuple(mesh.coords(plan, r)[d] for d in ("dp", "pp", "cp", "tp")) for r in range(plan.world)}
    fig = grid_groups_figure(coords, groups, crossing, h100.gpus_per_node)
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert titles == ["tp groups: 8, 0 cross nodes", "cp groups: 32, 32 cross nodes",
                      "pp groups: 32, 32 cross nodes", "dp groups: 32, 32 cross nodes"]


def test_tp_split_slices_cover_the_hidden_features_once():
    fig = tp_split_figure(512, 128, 512, 4)
    texts = [t.get_text() for t in fig.axes[0].texts]
    cols = [f"{r * 128}:{(r + 1) * 128}" for r in range(4)]
    assert [t for t in texts if t.startswith("A[")] == [f"A[:, {c}]\n[128, 128]" for c in cols]
    assert [t for t in texts if t.startswith("B[")] == [f"B[{c}, :]\n[128, 128]" for c in cols]
    assert {"f", "g"} <= set(texts)
    assert len(_patches(fig, "op:")) == 2


def test_bubble_sweep_draws_each_schedule_where_it_runs():
    fig = bubble_sweep_figure((8, 16), {"a": [0.5, 0.25], "b": [None, 0.1]}, {"a": [0.3, 0.2], "b": [None, 0.05]},
                              [7 / 8, 7 / 16])
    lines = {ln.get_gid(): ln for ax in fig.axes for ln in ax.lines if ln.get_gid()}
    assert list(lines["bubble ratio (idle / compute):a"].get_ydata()) == [50.0, 25.0]
    assert list(lines["bubble ratio (idle / compute):b"].get_xdata()) == [16]
    assert list(lines["idle fraction (of p x step):b"].get_ydata()) == [5.0]
