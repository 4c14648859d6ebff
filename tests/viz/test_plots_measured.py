"""The predicted-beside-measured bars of the lessons (parallel_lab.viz.plots.measured)."""

from __future__ import annotations

import pytest

from parallel_lab.viz.plots.measured import draw_predicted_measured, predicted_measured_figure


def _bars(fig):
    return {p.get_gid(): p.get_height() for p in fig.axes[0].patches if p.get_gid()}


def test_bars_carry_the_values_and_the_ratio_labels():
    fig = predicted_measured_figure(["cp", "dp"], [100, 200], [100, 250])
    bars = _bars(fig)
    assert bars == {"predicted:cp": 100, "measured:cp": 100, "predicted:dp": 200, "measured:dp": 250}
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert labels == ["=", "1.250x"]


def test_mismatched_lengths_name_the_counts():
    fig = predicted_measured_figure(["a"], [1], [1])
    with pytest.raises(ValueError, match="2 labels, 1 predicted and 1 measured"):
        draw_predicted_measured(fig.axes[0], ["a", "b"], [1], [1])
