"""The pure plot functions: what they draw equals the data they were given (read back from the artists)."""

from __future__ import annotations

import json

import pytest

from parallel_lab import comm, ledger
from parallel_lab.hardware import ClusterSpec
from parallel_lab.quantities import fmt_bytes, fmt_number, fmt_seconds
from parallel_lab.schedules.generators import build_schedule
from parallel_lab.simulate import Costs, simulate
from parallel_lab.specs import ModelSpec, Plan
from parallel_lab.viz.plots.base import new_figure, to_png
from parallel_lab.viz.plots.comm import comm_figure
from parallel_lab.viz.plots.memory import memory_figure, memory_sweep_figure
from parallel_lab.viz.plots.planner import plan_label
from parallel_lab.viz.plots.timeline import (
    draw_timeline,
    kind_key,
    n_boxes,
    timeline_figure,
    timeline_rows,
    timelines_figure,
)

GB = 1e9
H100 = ClusterSpec.preset("h100-sxm")
# The seed's 7B-class shape (L=32, h=4096, a=32) at s=4096, b=1.
SEED = ModelSpec(layers=32, hidden=4096, heads=32, max_positions=4096)


def heights(ax, gid: str) -> list[float]:
    return [p.get_height() / GB for p in ax.patches if p.get_gid() == gid]    # the bars are in bytes


def test_memory_figure_bars_are_the_ledgers_categories():
    led = ledger.memory(ModelSpec.from_params(7e9), Plan(dp=8, zero=2), H100)
    fig = memory_figure(led)
    ax = fig.axes[0]
    for cat, b in led.per_gpu_bytes.items():
        assert heights(ax, cat) == [pytest.approx(b / GB)]
    # the seed's ZeRO-2 figure for 7B on 8 GPUs: 26.25 GB of model state
    state = sum(heights(ax, c)[0] for c in ("parameters", "gradients", "optimizer_states"))
    assert state == pytest.approx(26.25)
    # the HBM line and the usable line after the 10% margin
    ys = {ln.get_gid(): ln.get_ydata()[0] for ln in ax.lines}
    assert ys == {"hbm": pytest.approx(80e9), "usable": pytest.approx(72e9)}
    assert "fits" in ax.get_title()


def test_memory_figure_accepts_the_cli_json():
    led = ledger.memory(SEED, Plan(seq=4096), H100)
    ax_obj = memory_figure(led).axes[0]
    ax_json = memory_figure(json.loads(json.dumps(led.to_json()))).axes[0]
    assert heights(ax_json, "activations") == heights(ax_obj, "activations")
    # the seed's 104.15 GB of activations without recomputation
    assert heights(ax_obj, "activations")[0] == pytest.approx(104.152956928)
    assert "does NOT fit" in ax_obj.get_title()


def test_memory_sweep_marks_invalid_points():
    m = ModelSpec.from_params(7e9)
    leds = [None] + [ledger.memory(m, Plan(dp=8, zero=z), H100) for z in (1, 2, 3)]
    fig = memory_sweep_figure([0, 1, 2, 3], leds, "ZeRO stage")
    ax = fig.axes[0]
    # the seed's table: 38.5, 26.25, 14.0 GB for ZeRO-1, 2, 3 of 7B on 8 GPUs
    state = [sum(v) for v in zip(*(heights(ax, c) for c in ("parameters", "gradients", "optimizer_states")),
                                 strict=True)]
    assert state == [0.0, pytest.approx(38.5), pytest.approx(26.25), pytest.approx(14.0)]
    assert "n/a" in [t.get_text() for t in ax.texts]


def test_comm_figure_seed_tp_bytes_and_time_per_tier():
    rep = comm.report(SEED, Plan(tp=8, seq=4096), H100)
    fig = comm_figure(rep, {d: f"{t}" for d, t in rep.tiers.items()})
    a_bytes, a_time = fig.axes
    tp = sum(heights(a_bytes, "tp:all_reduce"))
    # the seed: L * 4 * (s b h 2) * 2 (t-1)/t = 7.516192768 GB per GPU per step
    assert tp == pytest.approx(7.516192768)
    widths = {p.get_gid(): p.get_width() for p in a_time.patches}
    assert widths["tp"] == pytest.approx(rep.time_s["tp"])                 # seconds
    assert [t.get_text() for t in a_time.get_legend().get_texts()] == ["nvlink4"]


def test_comm_bytes_split_matches_per_step_bytes_for_zero():
    cpu = ClusterSpec.preset("cpu-gloo")
    rep = comm.report(ModelSpec.preset("tiny-llama"), Plan(dp=4, zero=3, seq=128), cpu)
    fig = comm_figure(rep.to_json())
    ax = fig.axes[0]
    kinds = {p.get_gid() for p in ax.patches}
    assert kinds == {"dp:all_gather", "dp:reduce_scatter"}
    assert sum(p.get_height() for p in ax.patches) == pytest.approx(rep.per_step_bytes["dp"])


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)])
def test_timeline_draws_every_action_once(name, v):
    p, m = 4, 8
    sim = simulate(build_schedule(name, p, m, v), Costs())
    fig = timeline_figure(sim)
    ax = fig.axes[0]
    boxes = {c.get_gid(): n_boxes(c) for c in ax.collections}
    per_kind: dict[str, int] = {}
    for gid, n in boxes.items():
        if not gid.startswith("idle"):
            per_kind[gid[0]] = per_kind.get(gid[0], 0) + n
    assert per_kind["F"] == p * m * v
    assert per_kind["B"] == p * m * v
    assert per_kind.get("W", 0) == (p * m if name == "zb-h1" else 0)
    assert boxes["idle"] == p                                           # one hatched band per rank
    # the same picture from `parallel-lab bubble --json`'s rows
    fig2 = timeline_figure(sim.to_dict()["timeline"])
    assert {c.get_gid(): n_boxes(c) for c in fig2.axes[0].collections} == boxes


def test_timeline_busy_time_gives_the_bubble():
    p, m = 4, 8
    sim = simulate(build_schedule("1f1b", p, m), Costs())
    fig = new_figure()
    info = draw_timeline(fig.add_subplot(), sim)
    busy = max(info["busy"].values())
    # bubble_ratio = (step - ideal) / ideal = (p - 1) / m for 1F1B with equal costs (Narayanan et al. 2021)
    assert (info["makespan"] - busy) / busy == pytest.approx((p - 1) / m)


def test_timelines_figure_puts_measured_below_in_ms():
    sim = simulate(build_schedule("1f1b", 2, 4), Costs())
    measured = [[r, s / 100, e / 100, k, mb, c] for r, s, e, k, mb, c in sim.to_dict()["timeline"]]
    fig = timelines_figure(sim, measured)
    assert len(fig.axes) == 2
    assert fig.axes[1].get_xlabel() == "time (ms)"
    assert fig.axes[1].get_xlim()[1] == pytest.approx(sim.step_time * 10, rel=0.02)


def test_plan_label_and_helpers():
    assert plan_label({"tp": 8, "cp": 1, "pp": 16, "dp": 128, "zero": 1, "recompute": "none",
                       "schedule": "interleaved", "interleave": 2}) == "tp8 cp1 pp16 dp128 z1 interleavedx2"
    assert fmt_bytes(7.516192768e9) == "7.52 GB"
    assert fmt_bytes(312e6) == "312 MB"
    assert fmt_seconds(0.0083) == "8.3 ms"
    assert [kind_key(k) for k in ("F", "forward", "B", "backward_input", "W", "backward_weight")] == \
        ["F", "F", "B", "B", "W", "W"]
    png = to_png(memory_figure(ledger.memory(ModelSpec.from_params(1e9), Plan(), H100)))
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_timeline_accepts_the_runnable_codes_spans():
    pytest.importorskip("torch")
    from parallel_lab.distributed.instruments.timeline import align
    from parallel_lab.simulate import Interval as Span  # the runnable code records simulate.Interval

    spans = align([Span(0, "compute", "F", 10.0, 10.1, 0), Span(0, "comm", "pp:send", 10.1, 10.12),
                   Span(1, "compute", "F", 10.12, 10.22, 0), Span(1, "compute", "B", 10.22, 10.42, 0),
                   Span(0, "compute", "B", 10.44, 10.64, 0)])
    rows = timeline_rows(spans)
    assert [(r, k) for r, _, _, k, _, _ in rows] == [(0, "F"), (1, "F"), (1, "B"), (0, "B")]
    fig = timelines_figure(simulate(build_schedule("1f1b", 2, 1), Costs()), spans)
    info = draw_timeline(fig.axes[1], spans, time_scale=1e3)
    assert info["makespan"] == pytest.approx(640.0)                        # ms, from the first start
    assert info["busy"] == {0: pytest.approx(300.0), 1: pytest.approx(300.0)}


# --------------------------------------------------------------------------------------------------
# units that scale with the value
# --------------------------------------------------------------------------------------------------

def test_units_follow_the_value_and_never_use_an_exponent():
    assert [fmt_bytes(x) for x in (0, 96, 4.1e3, 1.7e6, 999.96e6, 7.516192768e9, 2.5e12)] == \
        ["0 B", "96 B", "4.1 kB", "1.7 MB", "1 GB", "7.52 GB", "2.5 TB"]
    assert [fmt_seconds(t) for t in (0, 4e-5, 0.0009999, 0.00835, 150.3)] == \
        ["0 s", "40 µs", "1 ms", "8.35 ms", "150 s"]
    assert fmt_bytes(26.25e9, 4) == "26.25 GB" and fmt_number(1234.6, 3) == "1235"


def test_tiny_llama_gets_an_axis_of_its_own_not_empty_bars_on_a_gb_axis():
    model = ModelSpec.preset("tiny-llama")
    led = ledger.memory(model, Plan(dp=2, seq=128, micro_batch=4), H100)
    assert led.total_bytes < 1e9                                   # a few hundred MB at most on an 80 GB GPU
    fig = memory_figure(led)
    ax = fig.axes[0]
    lo, hi = ax.get_ylim()
    assert led.need_bytes <= hi <= 2 * led.need_bytes            # the bar fills at least half of the axis
    assert ax.get_ylabel() == "memory per GPU (MB)"
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels and all("e" not in x for x in labels)
    shown = [t.get_text() for t in ax.texts if t.get_visible()]
    assert fmt_bytes(led.need_bytes, 3) in shown                   # the bar's label: the verdict's bytes, in MB
    assert any(t.startswith("HBM 80 GB is off the scale") for t in shown)
    assert not any(ln.get_visible() for ln in ax.lines if ln.get_gid() in ("hbm", "usable"))
    for cat, b in led.per_gpu_bytes.items():                     # the bars are still the ledger's bytes
        assert heights(ax, cat) == [pytest.approx(b / GB)]


def test_a_large_model_keeps_its_hbm_line_and_gb_axis():
    led = ledger.memory(ModelSpec.from_params(7e9), Plan(dp=8, zero=2), H100)
    ax = memory_figure(led).axes[0]
    assert ax.get_ylabel() == "memory per GPU (GB)"
    assert all(ln.get_visible() for ln in ax.lines if ln.get_gid() in ("hbm", "usable"))
    assert not any(t.get_visible() and "off the scale" in t.get_text() for t in ax.texts)


def test_a_timeline_drawn_from_the_memo_is_the_same_picture():
    """``draw_timeline(memo=...)`` (the Planner tab toggling between two plans' schedules) must draw what a
    fresh call draws: the same pixels after A, then B, then A again, with other timelines in the memo."""
    import numpy as np

    def sim(name: str, v: int = 1):
        return simulate(build_schedule(name, 4, 8, v), Costs(f=1.0, b=1.0, w=1.0))

    a, b = sim("1f1b"), sim("zb-h1")

    def pixels(timelines, memo):
        fig = new_figure(figsize=(8, 3))
        ax = fig.add_subplot(1, 1, 1)
        for t in timelines:
            draw_timeline(ax, t, title="schedule", step_time=t.step_time, memo=memo)
        fig.canvas.draw()
        return np.asarray(fig.canvas.buffer_rgba()).copy()

    fresh_a, fresh_b = pixels([a], None), pixels([b], None)
    memo: dict = {}
    assert (pixels([a, b, a], memo) == fresh_a).all()
    assert len(memo) == 2                                    # both timelines built once
    assert (pixels([b, a, b], memo) == fresh_b).all()        # drawn from the memo on a new axes
    assert not (fresh_a == fresh_b).all()                    # the two pictures differ: the test can fail
