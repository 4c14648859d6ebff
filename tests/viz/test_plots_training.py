"""viz/plots/training.py: the compute/comm lanes and the loss curves draw exactly the data they are given."""

from __future__ import annotations

import pytest

from parallel_lab.simulate import Interval
from parallel_lab.viz.plots.training import (
    compute_comm_figure,
    draw_compute_comm,
    exposed_comm,
    loss_curves_figure,
)


def _step(rank: int, t0: float, overlap: bool) -> list[Interval]:
    """F [t0, t0+1), B [t0+1, t0+3), step [t0+3.5, t0+4); two all-reduces, during or after backward."""
    comm_start = t0 + 2.0 if overlap else t0 + 3.0
    return [Interval(rank, "compute", "F", t0, t0 + 1), Interval(rank, "compute", "B", t0 + 1, t0 + 3),
            Interval(rank, "comm", "dp:all_reduce", comm_start, t0 + 3.4),
            Interval(rank, "comm", "dp:all_reduce", comm_start + 0.1, t0 + 3.5),
            Interval(rank, "compute", "step", t0 + 3.5, t0 + 4)]


def test_compute_comm_lanes_hold_every_interval():
    spans = _step(0, 10.0, True) + _step(1, 10.2, True)
    fig = compute_comm_figure({"bucketed": spans})
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    bars = [b for coll in ax.collections for b in coll.get_paths()]
    assert len(bars) == len(spans)                       # one box per interval
    out = draw_compute_comm(ax, spans, time_scale=1.0)
    assert out["n_comm"] == 4 and out["ranks"] == [0, 1]
    assert out["makespan"] == pytest.approx(4.2)         # from the first start (10.0) to the last end (14.2)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["forward", "backward", "optimizer step", "all-reduce (in flight)"]


def test_exposed_comm_is_backward_end_to_step_start_per_rank_and_step():
    spans = _step(0, 0.0, False) + _step(0, 4.0, False) + _step(1, 0.0, True)
    assert exposed_comm(spans) == pytest.approx([0.5, 0.5, 0.5])
    late = [s if s.name != "step" else Interval(s.rank, s.kind, s.name, 3.9, 4.0) for s in _step(0, 0.0, True)]
    assert exposed_comm(late) == pytest.approx([0.9])


def test_loss_curves_one_line_per_curve_with_the_values():
    curves = {"reference": [3.0, 2.5, 2.0], "right": [3.0, 2.5, 2.0], "wrong": [3.0, 2.7, 2.6]}
    fig = loss_curves_figure(curves, title="t")
    ax = fig.axes[0]
    lines = ax.get_lines()
    assert [ln.get_label() for ln in lines] == list(curves)
    for ln, ys in zip(lines, curves.values(), strict=True):
        assert list(ln.get_ydata()) == ys
    assert len({(ln.get_marker(), str(ln.get_linestyle())) for ln in lines}) == 3   # overlapping curves stay visible
