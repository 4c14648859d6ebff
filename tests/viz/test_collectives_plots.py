"""viz/plots/collectives.py: the grids read their cells back from the values (digits = ranks), the charts draw
what they are given."""

from __future__ import annotations

from matplotlib.colors import to_hex

from parallel_lab.viz.plots.collectives import (
    COMPLETE,
    alpha_beta_figure,
    before_after_figure,
    contributors,
    ring_steps_figure,
    shared_link_figure,
    tag,
)
from parallel_lab.viz.plots.zero import RANK_COLORS


def _cells(ax):
    return {p.get_gid(): p for p in ax.patches if (p.get_gid() or "").startswith("cell:")}


def test_tags_sum_to_readable_digits():
    assert tag(2, 1) == 200.0 and tag(0, 3) == 4.0
    assert contributors(sum(tag(r, 1) for r in range(4)), 4) == ([0, 1, 2, 3], 1)     # 2222
    assert contributors(tag(0, 2) + tag(1, 2) + tag(3, 2), 4) == ([0, 1, 3], 2)      # 3033
    assert contributors(0.0, 4) == ([], -1)


def test_before_after_colours_each_cell_by_where_it_came_from():
    n = 2
    before = [[tag(0, 0), tag(0, 1)], [tag(1, 0), tag(1, 1)]]
    after = [[tag(0, 0) + tag(1, 0), 0.0], [0.0, tag(0, 1) + tag(1, 1)]]                 # a reduce-scatter
    fig = before_after_figure("reduce-scatter", before, after, n)
    b, a = fig.axes
    cb, ca = _cells(b), _cells(a)
    assert to_hex(cb["cell:1:0:1"].get_facecolor()) == RANK_COLORS[1]
    assert to_hex(ca["cell:0:0:0,1"].get_facecolor()) == COMPLETE
    assert set(ca) == {"cell:0:0:0,1", "cell:0:1:", "cell:1:0:", "cell:1:1:0,1"}
    assert ca["cell:1:1:0,1"].get_edgecolor() != cb["cell:1:1:1"].get_edgecolor()        # changed: outlined


def test_ring_steps_one_panel_per_state():
    grid = [[tag(r, c) for c in range(4)] for r in range(4)]
    fig = ring_steps_figure([(f"step {i}", grid) for i in range(7)], 4, 16_000)
    assert sum(ax.get_visible() for ax in fig.axes) == 7


def test_alpha_beta_and_shared_link_draw_their_data():
    fig = alpha_beta_figure([1e3, 1e6], {"a": [1e-5, 1e-3], "b": [2e-5, 5e-4]}, crossovers={"a = b": 5e5})
    ax = fig.axes[0]
    assert [ln.get_label() for ln in ax.get_lines() if not ln.get_label().startswith("_")] == ["a", "b"]
    assert ax.get_xscale() == ax.get_yscale() == "log"
    fig = shared_link_figure({"x": [("TP", 0, 2e-3), ("DP", 2e-3, 5e-3)], "y": [("TP", 0, 4e-3), ("DP", 0, 5e-3)]})
    widths = sorted(round(p.get_width(), 9) for p in fig.axes[0].patches)
    assert widths == [2.0, 3.0, 4.0, 5.0]                                                  # in ms
