"""Blitted frames (``viz.frames.Frames``, the explorers' one renderer): a frame drawn over a cached background
is the picture a full draw gives, pixel for pixel, whatever changed before it; and it is the picture
matplotlib itself draws (up to text placed on whole pixels)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from PIL import Image

from parallel_lab.viz.explorers.comm import CommExplorer
from parallel_lab.viz.explorers.memory import MemoryExplorer
from parallel_lab.viz.explorers.pipeline import PipelineExplorer
from parallel_lab.viz.explorers.planner import PlannerExplorer
from parallel_lab.viz.frames import png_bytes
from parallel_lab.viz.plots.base import to_png


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)


def check_frame_is_a_full_draw(ex) -> None:
    assert ex.error is None, ex.error
    shown = pixels(bytes(ex.image.value))
    assert np.array_equal(shown, pixels(ex.frames.render(full=True))), f"stale background after {ex.values()}"


CHANGES = {
    "memory": (lambda: MemoryExplorer(sweep="ZeRO stage"),
               [("zero", 1), ("seq", 8192), ("zero", 2), ("recompute", "selective"), ("zero", 1),
                ("sweep", "sequence"), ("seq", 2048), ("seq", 4096), ("sweep", "dp"), ("dp", 4), ("gpus", 4),
                ("cluster", "a100-80gb"), ("model", "llama2-13b"), ("sweep", "ZeRO stage"), ("zero", 0)]),
    "comm": (lambda: CommExplorer(),
             [("tp_across_nodes", True), ("seq", 8192), ("tp_across_nodes", False), ("tp", 4), ("dp", 2),
              ("zero", 3), ("tp", 1), ("tp_across_nodes", True), ("zero", 0), ("dp", 1), ("tp", 8)]),
    "pipeline": (lambda: PipelineExplorer(schedule="1f1b", stages=4, microbatches=8),
                 [("microbatches", 9), ("microbatches", 16), ("schedule", "zb-h1"), ("microbatches", 8),
                  ("schedule", "interleaved"), ("stages", 2), ("schedule", "gpipe"), ("b", 2.0),
                  ("microbatches", 40), ("stages", 4), ("schedule", "1f1b")]),
}


@pytest.mark.parametrize("name", sorted(CHANGES))
def test_every_frame_equals_a_full_draw(name):
    make, changes = CHANGES[name]
    ex = make()
    check_frame_is_a_full_draw(ex)
    for widget, value in changes:
        ex.widgets[widget].value = value
        if ex.error is None:                              # an invalid step between two valid ones: no chart
            check_frame_is_a_full_draw(ex)
    assert ex.error is None and ex.frames.blits > 0 and ex.frames.full_draws > 0


def test_planner_frames_while_choosing_plans():
    ex = PlannerExplorer(model="llama2-70b", gpus=16)
    for k in (2, 3, 1, 4, 2):
        ex.widgets["chosen"].value = k
        check_frame_is_a_full_draw(ex)


def test_a_layout_seen_before_keeps_its_figure():
    ex = PipelineExplorer(schedule="1f1b", stages=4, microbatches=8)
    four = ex.figure
    ex.widgets["stages"].value = 2                        # two rows: another layout, another figure
    assert ex.figure is not four and len(ex.figure.axes[0].get_yticks()) == 2
    ex.widgets["stages"].value = 4
    assert ex.figure is four and ex.timings["full"] == 0.0   # its charts and frames were kept
    check_frame_is_a_full_draw(ex)


def test_a_change_within_the_axes_is_blitted():
    ex = MemoryExplorer(sweep="ZeRO stage", zero=0)
    ex.widgets["zero"].value = 1                          # ZeRO-1 on 8 ranks: the bars shrink under 200 GB
    ex.widgets["zero"].value = 2
    assert ex.timings["full"] == 0.0 and ex.frames.last_full is False
    assert ex.figure.axes[1].get_ylim() == (0.0, 200e9)   # the sticky round axis end (bytes)


def test_frames_draw_what_matplotlib_draws():
    """The explorers' PNG against matplotlib's own rendering of the same figure: the same picture, up to
    text placed on whole pixels (anti-aliased edges move by less than a pixel)."""
    for ex in (MemoryExplorer(), CommExplorer(), PipelineExplorer()):
        ours = pixels(bytes(ex.image.value))
        FigureCanvasAgg(ex.figure)                        # matplotlib's own Agg canvas, no text stamps
        theirs = pixels(to_png(ex.figure))
        assert ours.shape == theirs.shape
        differ = (np.abs(ours - theirs).max(axis=2) > 96).mean()
        assert differ < 0.01, f"{type(ex).__name__}: {differ:.2%} of the pixels differ"


def test_png_bytes_round_trip():
    rng = np.random.default_rng(0)
    rgba = rng.integers(0, 256, size=(7, 5, 4), dtype=np.uint8)
    back = np.asarray(Image.open(io.BytesIO(png_bytes(rgba))))
    assert back.shape == (7, 5, 3) and np.array_equal(back, rgba[:, :, :3])
