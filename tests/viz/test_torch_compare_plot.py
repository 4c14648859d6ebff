"""The lab-vs-torch bytes picture (companion 10): each row's three bars have the widths given, top to bottom."""

from __future__ import annotations

import pytest

from parallel_lab.viz.plots.torch_compare import plot_lab_vs_torch


def _bars(fig) -> dict[str, tuple[float, float]]:
    return {p.get_gid(): (p.get_width(), p.get_y()) for ax in fig.axes for p in ax.patches if p.get_gid()}


def test_rows_carry_predicted_lab_and_torch_widths():
    fig = plot_lab_vs_torch(["DDP all_reduce", "FSDP all_gather"], [[100, 100, 100], [300, 300, 250]],
                            [[10, 10, 6], [5, 5, 5]])
    bars = _bars(fig)
    assert bars["predicted:DDP all_reduce"][0] == bars["torch:DDP all_reduce"][0] == 100
    assert bars["torch:FSDP all_gather"][0] == 250 and bars["lab:FSDP all_gather"][0] == 300
    assert bars["predicted:DDP all_reduce"][1] > bars["predicted:FSDP all_gather"][1]       # first row on top
    texts = " ".join(t.get_text() for t in fig.axes[0].texts)
    assert "6 calls" in texts and "10 calls" in texts


def test_rows_must_match():
    with pytest.raises(ValueError):
        plot_lab_vs_torch(["a"], [[1, 2, 3], [1, 2, 3]], [[1, 1, 1]])
