"""The pictures of the articles' ideas: goodput against the checkpoint interval, Meta's pipeline bubble,
DualPipe's exposed all-to-all, the model state per optimizer, the bandwidth map, a step's parts, the payback of
a re-shard and the misses per FLOP story draw what they are given, no text under 8 pt."""

from __future__ import annotations

from matplotlib.text import Text

from parallel_lab.viz.plots.collectives import bandwidth_map_figure
from parallel_lab.viz.plots.diagnosis import step_parts_figure
from parallel_lab.viz.plots.goodput import goodput_figure
from parallel_lab.viz.plots.measured import misses_figure
from parallel_lab.viz.plots.memory import optimizer_state_figure
from parallel_lab.viz.plots.overlap import bubble_bars_figure, exposed_comm_figure
from parallel_lab.viz.plots.reshard import payback_figure


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


def test_bandwidth_map_writes_the_tier_ratio():
    fig = bandwidth_map_figure([1e3, 1e9], {"NVLink, intra": [1e9, 450e9], "IB, inter": [0.5e9, 50e9]},
                               measured={"measured": ([1e3, 1e6], [1e8, 1e9])})
    assert {"tier:NVLink, intra", "tier:IB, inter", "measured:measured", "ratio"} <= _gids(fig)
    assert any("9.0x" in t.get_text() for t in _texts(fig))
    assert min(t.get_fontsize() for t in _texts(fig)) >= 8


def test_step_parts_figure_stacks_and_totals():
    fig = step_parts_figure({"inside": {"compute": 0.5, "tp": 0.1}, "across": {"compute": 0.5, "tp": 0.9}})
    assert {"part:inside:compute", "part:across:tp"} <= _gids(fig)
    assert any(t.get_text().strip() == "1,400 ms" for t in _texts(fig))
    assert min(t.get_fontsize() for t in _texts(fig)) >= 8


def test_payback_figure_marks_the_crossing():
    fig = payback_figure([1, 10, 100, 1000], {"faster plan": 2.0, "same plan": 0.0}, 100.0, phase_steps=500)
    assert {"saved:faster plan", "payback:faster plan"} <= _gids(fig)
    assert "payback:same plan" not in _gids(fig)
    texts = [t.get_text() for t in _texts(fig)]
    assert any("pays after 50 steps" in t for t in texts) and any("never pays" in t for t in texts)
    assert min(t.get_fontsize() for t in _texts(fig)) >= 8


def test_misses_figure_one_bar_per_story_and_row():
    fig = misses_figure(["8K", "128K"], {"palm": [0.0, 0.14], "causal": [0.01, -0.17]})
    bars = [a for a in fig.findobj() if a.get_gid() == "miss:causal"]
    assert bars and min(t.get_fontsize() for t in _texts(fig)) >= 8
