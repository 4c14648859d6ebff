"""Predicted beside measured (viz/plots/measured.py): the bars are the numbers given, the ratios their quotient."""

from __future__ import annotations

import pytest

from parallel_lab.quantities import TIME_UNITS
from parallel_lab.viz.plots.measured import draw_predicted_measured, predicted_measured_figure


def widths(ax, gid: str) -> list[float]:
    return [p.get_width() for p in ax.patches if p.get_gid() == gid]


def test_bars_are_the_given_values_and_ratios_their_quotient():
    fig = predicted_measured_figure(["tp", "tp_vocab"], [8_388_608, 1_060_864], [8_388_608, 530_432],
                                    title="bytes")
    ax = fig.axes[0]
    assert widths(ax, "predicted:tp") == [8_388_608] and widths(ax, "measured:tp") == [8_388_608]
    assert widths(ax, "predicted:tp_vocab") == [1_060_864] and widths(ax, "measured:tp_vocab") == [530_432]
    assert ax.get_xlabel() == "bytes (MB)"
    assert "(0.5x)" in {t.get_text().split("  ")[-1] for t in ax.texts}


def test_ratio_is_none_for_a_zero_prediction_and_other_units_work():
    fig = predicted_measured_figure(["a"], [1.0], [1.0], units=None, quantity="micro-batches")
    assert fig.axes[0].get_xlabel() == "micro-batches"
    ax = fig.axes[0]
    ratios = draw_predicted_measured(ax, ["x", "y"], [0.0, 0.002], [0.001, 0.003], units=TIME_UNITS,
                                     quantity="time")
    assert ratios[0] is None and ratios[1] == pytest.approx(1.5)


def test_mismatched_lengths_name_the_counts():
    with pytest.raises(ValueError, match=r"labels \(2\), predicted \(1\)"):
        predicted_measured_figure(["a", "b"], [1.0], [1.0, 2.0])
