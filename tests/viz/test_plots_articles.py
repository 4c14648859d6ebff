"""The pictures of the articles' ideas: goodput against the checkpoint interval, Meta's pipeline bubble,
DualPipe's exposed all-to-all and the model state per optimizer draw what they are given, no text under 8 pt."""

from __future__ import annotations

from matplotlib.text import Text

from parallel_lab.viz.plots.goodput import goodput_figure
from parallel_lab.viz.plots.memory import optimizer_state_figure
from parallel_lab.viz.plots.overlap import bubble_bars_figure, exposed_comm_figure


def _texts(fig) -> list[Text]:
    fig.canvas.draw()
    return [t for t in fig.findobj(Text) if t.get_text()]


def _gids(fig) -> set[str]:
    return {a.get_gid() for a in fig.findobj() if a.get_gid()}


def test_goodput_figure_marks_each_optimum():
    fig = goodput_figure([1, 10, 100], {"a": [0.5, 0.9, 0.6]}, {"a": (10, 0.9)}, [16, 256], {"p = 0.001": [0.98, 0.77]})
    assert {"goodput:a", "optimum:a", "clean:p = 0.001"} <= _gids(fig)
    assert any("best 10 min, 90.0%" in t.get_text() for t in _texts(fig))
    assert min(t.get_fontsize() for t in _texts(fig)) >= 8


def test_pipeline_and_overlap_figures():
    bars = bubble_bars_figure({"m 32": 0.0586, "m 16": 0.117})
    assert any(t.get_text().strip() == "11.7%" for t in _texts(bars))
    lines = exposed_comm_figure([0, 1, 2], {"serial": [0, 1, 2], "paired": [0, 0, 1]}, 1.0)
    assert {"exposed:serial", "exposed:paired"} <= _gids(lines)
    assert min(t.get_fontsize() for t in _texts(bars) + _texts(lines)) >= 8


def test_optimizer_state_figure_writes_each_total():
    fig = optimizer_state_figure({"adam-8bit": {"parameters": 14e9, "gradients": 14e9, "optimizer_states": 42e9}},
                                 80e9)
    assert any(t.get_text() == "70 GB" for t in _texts(fig))
    assert {"optimizer:parameters", "optimizer:optimizer_states"} <= _gids(fig)
