"""Explorers driven programmatically: set widget values, check the figure's data and the verdict against
the analytic core (and the seed's published numbers), and check that invalid input shows the library's
message in the widget instead of raising."""

from __future__ import annotations

import pytest

from parallel_lab import comm, ledger
from parallel_lab.errors import ParallelLabError
from parallel_lab.hardware import ClusterSpec
from parallel_lab.schedules.generators import build_schedule
from parallel_lab.specs import ModelSpec, Plan
from parallel_lab.viz.explorers.comm import CommExplorer
from parallel_lab.viz.explorers.memory import MemoryExplorer
from parallel_lab.viz.explorers.pipeline import PipelineExplorer
from parallel_lab.viz.plots.planner import plan_label
from parallel_lab.viz.plots.timeline import n_boxes

GB = 1e9
H100 = ClusterSpec.preset("h100-sxm")


def heights(ax, gid: str) -> list[float]:
    return [p.get_height() / GB for p in ax.patches if p.get_gid() == gid]    # the bars are in bytes


def assert_shows_error(ex, expected: str) -> None:
    assert isinstance(ex.error, ParallelLabError)
    assert str(ex.error) == expected
    assert "Invalid combination" in ex.status.value and "Traceback" not in ex.status.value
    assert expected.split(";")[0].replace("'", "&#x27;") in ex.status.value
    assert ex.image.layout.display == "none" and ex.verdict is None


def assert_shows_figure(ex) -> None:
    assert ex.error is None and ex.image.layout.display is None
    data = bytes(ex.image.value)
    assert ex.image.format == "png" and data[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------------

def test_memory_bars_and_verdict_follow_the_ledger():
    ex = MemoryExplorer(model="llama2-7b", seq=4096, dp=8, zero=0)
    assert_shows_figure(ex)
    model = ModelSpec.preset("llama2-7b")
    expected = ledger.memory(model, Plan(dp=8, seq=4096), H100)
    bar_ax = ex.figure.axes[0]
    for cat, b in expected.per_gpu_bytes.items():
        assert heights(bar_ax, cat) == [pytest.approx(b / GB)]
    assert not expected.fits and ex.verdict == "does not fit"
    assert "Does not fit" in ex.status.value

    ex.widgets["zero"].value = 3                      # one change event -> one redraw
    after = ledger.memory(model, Plan(dp=8, zero=3, seq=4096), H100)
    assert after.fits and ex.verdict == "fits" and "Fits" in ex.status.value
    optim = after.per_gpu_bytes["optimizer_states"] / GB
    assert heights(ex.figure.axes[0], "optimizer_states") == [pytest.approx(optim)]
    # ZeRO-3 on 8 ranks: every model-state category is an eighth of ZeRO-0's (up to the unit padding)
    assert after.state_bytes == pytest.approx(expected.state_bytes / 8, rel=1e-6)


def test_memory_zero_sweep_is_the_seed_table():
    ex = MemoryExplorer(model="llama2-7b", dp=8, sweep="ZeRO stage")
    sweep_ax = ex.figure.axes[1]
    cats = ("parameters", "gradients", "optimizer_states")
    state = [sum(v) for v in zip(*(heights(sweep_ax, c) for c in cats), strict=True)]
    n = ModelSpec.preset("llama2-7b").n_params / GB
    # 16, 2 + 2 + 12/8, 2 + (2 + 12)/8, 16/8 bytes per parameter (seed table, ZeRO paper)
    assert state == pytest.approx([16 * n, 5.5 * n, 3.75 * n, 2 * n], rel=1e-6)


def test_memory_sequence_sweep_shows_the_quadratic_term():
    ex = MemoryExplorer(model="custom", seq=4096, dp=1, sweep="sequence")
    ex.set(layers=32, hidden=4096, heads=32, kv_heads=32, ffn=16384, vocab=32000, flavour="gpt")
    assert_shows_figure(ex)
    ax = ex.figure.axes[1]
    lin, quad = heights(ax, "linear"), heights(ax, "quadratic")
    seqs = ex.result["sweep_values"]
    i4k = seqs.index(4096)
    # Korthikanti et al. 2022 at s=4096 (the seed): 34 sbh per layer is 18.25 GB for 32 layers, and
    # sbh (34 + 5as/h) is 104.15 GB, so the attention scores are the difference.
    assert lin[i4k] == pytest.approx(18.253611008)
    assert lin[i4k] + quad[i4k] == pytest.approx(104.152956928)
    # doubling s doubles the linear part and quadruples the scores
    assert lin[i4k + 1] / lin[i4k] == pytest.approx(2.0)
    assert quad[i4k + 1] / quad[i4k] == pytest.approx(4.0)


def test_memory_gpus_and_degrees_stay_consistent(monkeypatch):
    ex = MemoryExplorer(model="llama2-7b", dp=8)
    refreshes = []
    monkeypatch.setattr(ex, "refresh", lambda: refreshes.append(ex.values()))
    for name, value, gpus, dp in (("tp", 2, 16, 8), ("pp", 2, 32, 8), ("dp", 2, 8, 2), ("cp", 2, 16, 2),
                                  ("gpus", 64, 64, 8)):          # typed GPUs: dp = 64 / (tp pp cp)
        ex.widgets[name].value = value
        assert (ex.widgets["gpus"].value, ex.widgets["dp"].value) == (gpus, dp), name
    assert len(refreshes) == 5                                  # one redraw per change, both values set
    assert all(v["gpus"] == v["dp"] * v["tp"] * v["pp"] * v["cp"] for v in refreshes)


def test_memory_gpus_that_no_dp_fills_say_what_to_type():
    ex = MemoryExplorer(model="llama2-7b", dp=8, tp=2)
    ex.widgets["gpus"].value = 12                                # 12 / tp=2 = 6: not a dp of the slider
    assert isinstance(ex.error, ParallelLabError) and ex.widgets["dp"].value == 8
    assert "GPUs=12 is not dp x tp x pp x cp = 8 x 2 x 1 x 1 = 16" in str(ex.error)
    assert "type one of 2, 4, 8, 16, 32, 64" in str(ex.error) and "Invalid combination" in ex.status.value
    ex.widgets["gpus"].value = 16                                # valid again: the chart comes back
    assert_shows_figure(ex)


def test_memory_invalid_combinations_show_the_library_message():
    ex = MemoryExplorer(model="llama2-7b", dp=8)
    ex.set(dp=8, zero=1)
    assert_shows_figure(ex)

    ex.set(gpus=1, dp=1)                              # ZeRO needs dp >= 2
    with pytest.raises(ParallelLabError) as exc:
        Plan(dp=1, zero=1)
    assert_shows_error(ex, str(exc.value))

    ex.set(gpus=8, dp=1, tp=8, zero=0, model="custom", hidden=4096, heads=24)   # heads must divide hidden
    with pytest.raises(ParallelLabError) as exc:
        ModelSpec(layers=32, hidden=4096, heads=24)
    assert_shows_error(ex, str(exc.value))


def test_memory_pipeline_shows_one_bar_per_stage():
    ex = MemoryExplorer(model="llama2-7b", dp=2, pp=4, seq=4096)
    ex.set(grad_accum=8, schedule="1f1b")
    assert_shows_figure(ex)
    model, plan = ModelSpec.preset("llama2-7b"), Plan(dp=2, pp=4, seq=4096, grad_accum=8)
    acts = heights(ex.figure.axes[0], "activations")
    assert acts == pytest.approx([ledger.memory(model, plan, H100, stage=s).per_gpu_bytes["activations"] / GB
                                  for s in range(4)])
    # 1F1B: stage r holds p - r micro-batches in flight (Narayanan et al. 2021)
    assert acts[0] / acts[3] == pytest.approx(4.0, rel=0.02)


# --------------------------------------------------------------------------------------------------
# Communication
# --------------------------------------------------------------------------------------------------

def test_comm_seed_tp_bytes_and_the_node_boundary_toggle():
    ex = CommExplorer(model="llama2-7b", seq=4096, tp=8, dp=1)
    assert_shows_figure(ex)
    a_bytes, a_time = ex.figure.axes
    # the seed: 7.516192768 GB per GPU per step for L=32, h=4096, s=4096, t=8
    assert sum(heights(a_bytes, "tp:all_reduce")) == pytest.approx(7.516192768)
    near = {p.get_gid(): p.get_width() for p in a_time.patches}["tp"]
    rep = comm.report(ModelSpec.preset("llama2-7b"), Plan(tp=8, seq=4096), H100)
    assert near == pytest.approx(rep.time_s["tp"])

    ex.widgets["tp_across_nodes"].value = True
    far = {p.get_gid(): p.get_width() for p in ex.figure.axes[1].patches}["tp"]
    # bandwidth term 7.516 GB / 50 GB/s = 150 ms (the seed's "about 150 ms"), plus ring latencies
    assert 7.516192768 / 50 <= far <= 7.516192768 / 50 + 0.03
    assert far > 6 * near
    assert "ib-400g" in [t.get_text() for t in ex.figure.axes[1].get_legend().get_texts()][0]
    assert "slower" in ex.status.value
    assert "all-reduce" in ex.table.value


def test_comm_invalid_tp_shows_the_library_message():
    ex = CommExplorer(tp=8)
    ex.widgets["tp"].value = 16
    with pytest.raises(ParallelLabError) as exc:
        Plan(tp=16).validate(ModelSpec.preset("llama2-7b"), None, H100)
    assert_shows_error(ex, str(exc.value))
    ex.widgets["tp"].value = 1                        # no communication at all is valid, and says so
    assert ex.error is None and "every degree is 1" in ex.status.value


# --------------------------------------------------------------------------------------------------
# Pipeline
# --------------------------------------------------------------------------------------------------

def _boxes(ax) -> dict[str, int]:
    """Action boxes per kind (collections with gid "F:chunk:rank"; not the idle bands nor the numbers)."""
    out: dict[str, int] = {}
    for c in ax.collections:
        gid = c.get_gid() or ""
        if not gid.startswith(("idle", "microbatch-labels")):
            out[gid[0]] = out.get(gid[0], 0) + n_boxes(c)
    return out


@pytest.mark.parametrize("name,expected", [("gpipe", 3 / 8), ("1f1b", 3 / 8), ("zb-h1", 3 / 24)])
def test_pipeline_bubble_matches_the_published_formulas(name, expected):
    ex = PipelineExplorer(schedule=name, stages=4, microbatches=8)
    # GPipe and 1F1B: (p - 1) / m; ZB-H1 with f = b = w: a third of it (Qi et al. 2023)
    assert ex.result["sim"].bubble_ratio == pytest.approx(expected)
    assert f"{expected:.1%}" in ex.status.value
    assert _boxes(ex.figure.axes[0]) == {"F": 32, "B": 32, **({"W": 32} if name == "zb-h1" else {})}
    peaks = ex.result["sim"].peak_inflight
    assert peaks == ([8] * 4 if name == "gpipe" else [4, 3, 2, 1] if name == "1f1b" else [4] * 4)


def test_pipeline_changes_redraw_and_invalid_combinations():
    ex = PipelineExplorer(schedule="interleaved", stages=4, microbatches=8, interleave=2)
    assert ex.result["sim"].bubble_ratio == pytest.approx(3 / 16)          # (p - 1) / (v m)
    assert not ex.widgets["interleave"].disabled
    ex.widgets["microbatches"].value = 6
    with pytest.raises(ParallelLabError) as exc:
        build_schedule("interleaved", 4, 6, 2)
    assert_shows_error(ex, str(exc.value))
    ex.widgets["schedule"].value = "1f1b"                                  # interleave is ignored, greyed
    assert ex.widgets["interleave"].disabled
    assert ex.result["sim"].bubble_ratio == pytest.approx(3 / 6)
    ex.widgets["stages"].value = 8
    assert len(ex.figure.axes[0].get_yticks()) == 8


def test_pipeline_measured_timeline_beside_the_simulated_one():
    ex = PipelineExplorer(schedule="1f1b", stages=2, microbatches=4)
    sim = ex.result["sim"].to_dict()["timeline"]
    measured = [[r, 0.5 + s * 0.01, 0.5 + e * 0.01, k, mb, c] for r, s, e, k, mb, c in sim]
    ex.set_measured(measured, "measured on 2 CPU ranks")
    assert len(ex.figure.axes) == 2
    assert ex.figure.axes[1].get_title() == "measured on 2 CPU ranks"
    assert _boxes(ex.figure.axes[1]) == {"F": 8, "B": 8}
    assert "Measured: 2 ranks" in ex.status.value
    ex.set_measured(None)
    assert len(ex.figure.axes) == 1


# --------------------------------------------------------------------------------------------------
# Planner
# --------------------------------------------------------------------------------------------------

def test_planner_table_chosen_plan_and_bubble():
    from parallel_lab.planner import plan_search
    from parallel_lab.simulate import Costs, bubble_formula
    from parallel_lab.viz.explorers.planner import PlannerExplorer

    # 64 GPUs: among the listed plans after the best is a pipeline (on 32 the default profile lists none)
    ex = PlannerExplorer(model="llama2-70b", gpus=64, seq=4096, batch_tokens="1M")
    assert_shows_figure(ex)
    model = ModelSpec.preset("llama2-70b")
    expected = plan_search(model, H100, 64, 4096, global_batch_tokens="1M")
    res = ex.result["result"]
    shown = ex.result["shown"]
    listed = expected.top(shown)            # the plans whose peak at one moment fits too: memory's verdict
    assert [e.plan for e in res.top(shown)] == [e.plan for e in listed] and len(listed) == shown
    assert all(ledger.memory(model, e.plan, H100).fits for e in listed)
    assert ex.table.value.count("<tr") == shown + 1                      # header + one row per plan
    for reason, n in expected.rejected.items():
        assert reason in ex.rejected.value and f">{n:,}<" in ex.rejected.value

    # another plan, no new search: the first pipeline after the best whose schedule the explorer draws
    from parallel_lab.viz.explorers.planner import MAX_DRAWN_ACTIONS
    idx = next(i for i, e in enumerate(listed[1:], 1)
               if 1 < e.plan.pp and e.plan.pp * e.plan.microbatches * e.plan.interleave <= MAX_DRAWN_ACTIONS)
    ex.widgets["chosen"].value = idx + 1
    assert ex.result["result"] is res
    est = listed[idx]
    assert ex.verdict == plan_label(est.plan)
    led = ledger.memory(model, est.plan, H100)
    for cat, b in led.per_gpu_bytes.items():
        assert heights(ex.figure.axes[0], cat) == [pytest.approx(b / GB)]
    assert est.memory_bytes == pytest.approx(led.total_bytes)      # the planner's fast path = the ledger
    assert est.need_bytes == pytest.approx(led.need_bytes)
    # the simulated timeline's bubble is the planner's closed form
    plan = est.plan
    assert plan.pp > 1 and len(ex.figure.axes) == (4 if plan.microbatches * plan.interleave > 24 else 3)
    sim = ex.result["sim"]
    assert sim.bubble_ratio == pytest.approx(est.bubble_ratio)
    costs = Costs(1, 2 if plan.recompute == "full" else 1, 1)          # full recomputation: B runs F again
    assert est.bubble_ratio == pytest.approx(bubble_formula(plan.schedule, plan.pp, plan.microbatches,
                                                            plan.interleave, costs))


def test_planner_no_plan_and_saving(tmp_path):
    from parallel_lab.planfile import load_plan
    from parallel_lab.viz.explorers.planner import PlannerExplorer

    ex = PlannerExplorer(model="llama2-7b", gpus=8, seq=4096, batch_tokens="512K")
    ex.path.value = str(tmp_path / "plans" / "7b.yaml")
    assert ex.save() is None and "cannot write" in ex.save_message.value     # the folder does not exist
    ex.path.value = str(tmp_path / "7b.yaml")
    ex.phase.value = "pretrain-4k"
    ex.save_button.click()
    assert ex.saved_path == (tmp_path / "7b.yaml").resolve()
    assert str(ex.saved_path) in ex.save_message.value
    loaded = load_plan(ex.saved_path)
    assert loaded.plan == ex.result["plan"] and loaded.phase == "pretrain-4k" and loaded.gpus == 8
    assert loaded.engine == "lab"
    ex.set(engine="torchtitan")                          # only what torchtitan runs; the file says so
    assert ex.error is None and ex.result["plan"].zero != 1 and ex.result["plan"].recompute != "selective"
    assert ex.result["plan"].attention == "flash" and ex.save() is not None
    assert load_plan(ex.saved_path).engine == "torchtitan"
    ex.set(engine="lab")

    ex.set(model="llama3-405b")                                   # 405B does not fit on 8 GPUs at all
    assert isinstance(ex.error, ParallelLabError) and "no plan for llama3-405b" in ex.status.value
    assert ex.table.value == "" and "oom" in ex.rejected.value           # why, family by family
    assert ex.save() is None and "invalid" in ex.save_message.value


# --------------------------------------------------------------------------------------------------
# Common behaviour
# --------------------------------------------------------------------------------------------------

def test_sliders_send_one_event_on_release():
    import ipywidgets as W

    for ex in (MemoryExplorer(), CommExplorer(), PipelineExplorer()):
        kinds = (W.IntSlider, W.FloatSlider, W.SelectionSlider)
        sliders = [w for w in ex.widgets.values() if isinstance(w, kinds)]
        assert sliders, type(ex).__name__
        assert all(w.continuous_update is False for w in sliders), type(ex).__name__


def test_a_bug_in_the_core_is_shown_without_a_traceback(monkeypatch):
    ex = MemoryExplorer()
    monkeypatch.setattr(ledger, "memory", lambda *a, **k: 1 / 0)
    ex.widgets["zero"].value = 1
    assert isinstance(ex.error, ZeroDivisionError)
    assert "Internal error" in ex.status.value and "ZeroDivisionError" in ex.status.value
    assert "Traceback" not in ex.status.value and ex.image.layout.display == "none"


def test_every_input_has_a_tooltip_with_meaning_and_unit():
    from parallel_lab.viz.explorers.app import App
    from parallel_lab.viz.explorers.help import GLOSSARY, TOOLTIPS

    app = App(freeze_gc=False)          # a test process is not the app's kernel
    for tab, ex in app.explorers.items():
        for name, w in ex.widgets.items():
            assert w.tooltip == TOOLTIPS[name] and len(w.tooltip) > 20, (tab, name)
    units = ("count", "tokens", "elements", "GB", "cost units", "sequences")
    counted = [k for k, t in TOOLTIPS.items() if any(u in t for u in units)]
    assert {"seq", "dp", "tp", "pp", "cp", "gpus", "micro_batch", "hidden", "f", "p2p"} <= set(counted)
    assert {"bubble", "in-flight", "ZeRO-1/2/3", "korthikanti / per-op", "tp_vocab"} <= {t for t, _ in GLOSSARY}
    assert "Glossary" in app.glossary.value


def test_an_input_without_a_tooltip_is_refused():
    from parallel_lab.viz.explorers.help import tooltip

    with pytest.raises(KeyError, match="'warp_speed' has no tooltip"):
        tooltip("warp_speed")


# --------------------------------------------------------------------------------------------------
# Planner: reading the numbers
# --------------------------------------------------------------------------------------------------

def test_planner_step_breakdown_adds_up_to_the_step_time():
    import re

    from parallel_lab.viz.explorers.planner import PlannerExplorer, step_breakdown

    ex = PlannerExplorer(model="llama2-70b", gpus=64, seq=4096, batch_tokens="1M")
    est = ex.result["estimate"]
    parts = step_breakdown(est)
    assert parts["compute"] == est.compute_s and sum(parts.values()) == pytest.approx(est.step_time_s)
    for dim, t in est.exposed_s.items():
        assert parts.get(dim, 0.0) == t
    shown = {k: float(v) for k, v in re.findall(r"data-part='(\w+)' data-seconds='([^']+)'", ex.status.value)}
    assert shown == pytest.approx(parts)


def test_planner_slider_ends_at_the_plans_shown_and_says_it_is_searching(monkeypatch):
    from parallel_lab import planner
    from parallel_lab.viz.explorers.planner import PlannerExplorer

    ex = PlannerExplorer(model="llama2-7b", gpus=16)
    assert ex.widgets["chosen"].max == min(ex.widgets["top"].value, len(ex.result["result"].estimates))
    ex.widgets["chosen"].value = 8
    ex.widgets["top"].value = 3                                   # the slider shrinks, the choice with it
    assert ex.widgets["chosen"].max == 3 and ex.result["index"] == 2 and ex.error is None
    seen = []
    real = planner.plan_search
    monkeypatch.setattr(planner, "plan_search", lambda *a, **k: (seen.append(ex.status.value), real(*a, **k))[1])
    ex.widgets["seq"].value = 8192
    assert len(seen) == 1 and "Searching" in seen[0] and "Searching" not in ex.status.value


def test_planner_warns_when_even_the_best_plan_is_poor():
    from parallel_lab.viz.explorers.planner import POOR_MFU, PlannerExplorer

    ex = PlannerExplorer(model="llama2-7b", gpus=16384, seq=4096, batch_tokens="1M")   # 64 tokens per GPU-step
    best = ex.result["result"].estimates[0]
    assert best.mfu < POOR_MFU and "even the best plan is poor" in ex.status.value
    ex.set(gpus=64)
    assert ex.result["result"].estimates[0].mfu >= POOR_MFU and "poor" not in ex.status.value


# --------------------------------------------------------------------------------------------------
# One plan across the tabs
# --------------------------------------------------------------------------------------------------

def test_a_plan_picked_in_the_planner_opens_in_every_tab():
    from parallel_lab.viz.explorers.app import App

    app = App(freeze_gc=False)          # a test process is not the app's kernel
    planner_ex = app.explorers["Planner"]
    r = planner_ex.result
    msg = planner_ex.open_in_tabs()
    assert msg.startswith("opened in Memory, Communication, Pipeline, Grid, Ring attention")
    if r["plan"].cp == 1:                                        # no ring: the Ring tab says what it kept
        assert msg.endswith("Ring attention kept cp=1 (not on its sliders)")
    mem, com, pipe = (app.explorers[k] for k in ("Memory", "Communication", "Pipeline"))
    assert mem.error is None and mem.result["plan"] == r["plan"]
    assert mem.result["ledger"].total_bytes == ledger.memory(r["model"], r["plan"], r["cluster"]).total_bytes
    assert com.result["report"].per_step_bytes == comm.report(r["model"], com.result["plan"],
                                                              r["cluster"]).per_step_bytes
    assert com.result["plan"].tp == r["plan"].tp and com.result["plan"].dp == r["plan"].dp
    m_max = pipe.widgets["microbatches"].max
    if r["plan"].pp > 1 and r["plan"].microbatches <= m_max:
        assert pipe.result["sim"].bubble_ratio == pytest.approx(r["estimate"].bubble_ratio)
    elif r["plan"].pp > 1:          # more micro-batches than the Pipeline tab's slider: it says what it kept
        assert f"Pipeline kept microbatches={r['plan'].microbatches}" in msg, msg
    assert "opened in Memory" in planner_ex.save_message.value


def test_a_plan_file_opens_in_every_tab_and_a_bad_path_is_a_file_error(tmp_path):
    from parallel_lab.planfile import save_plan
    from parallel_lab.viz.explorers.app import App

    model, plan = ModelSpec.preset("llama2-13b"), Plan(dp=4, tp=2, pp=1, zero=1, seq=4096)
    target = tmp_path / "13b.yaml"
    save_plan(target, model, H100, plan, phase="pretrain-4k", gpus=8)
    app = App(freeze_gc=False)          # a test process is not the app's kernel
    planner_ex = app.explorers["Planner"]
    planner_ex.path.value = str(target)
    assert planner_ex.load().startswith("opened in Memory")
    mem = app.explorers["Memory"]
    assert mem.error is None and mem.result["plan"] == plan and mem.widgets["gpus"].value == 8
    planner_ex.path.value = str(tmp_path / "missing.yaml")
    assert planner_ex.load() is None
    shown = planner_ex.save_message.value
    assert "Plan file error" in shown and "missing.yaml" in shown and "check the path" in shown
    assert "Invalid combination" not in shown
