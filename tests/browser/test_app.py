"""The Voila app in a real browser: headless Chromium through Playwright, every external request blocked.

One Voila server for the module, started as ``make app`` starts it (``parallel_lab.viz.serve``) on a free
port, stopped with SIGTERM at the end; the test then checks that its kernels are gone too. Screenshots land
in ``artifacts/browser/`` (gitignored). Without Chromium (or Playwright) the tests skip and say why.
"""

from __future__ import annotations

import re
import time

import pytest

from parallel_lab.hardware import ClusterSpec
from parallel_lab.ledger import memory
from parallel_lab.specs import ModelSpec, Plan
from parallel_lab.viz import browser as B
from parallel_lab.viz.plots.memory import need_text
from parallel_lab.viz.serve import APP_NOTEBOOK, REPO

pytestmark = pytest.mark.browser

ARTIFACTS = REPO / "artifacts" / "browser"

if B.chromium_path() is None:
    pytest.skip("Chromium is not installed (looked for /usr/bin/chromium and `chromium` on PATH); "
                "install it with `apt-get install chromium` to run the browser tests",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api",
                               reason="playwright is not installed (pip install playwright)")
psutil = pytest.importorskip("psutil")
# a tab's explorer is built when the tab is first opened: seconds on a loaded machine
sync_api.expect.set_options(timeout=30_000)


@pytest.fixture(scope="module")
def app_url():
    """Voila serving notebooks/app.ipynb on a free port; SIGTERM afterwards, kernels included."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    # one page (and kernel) per test, and a closed page's kernel lives 2 minutes: more than the default cap
    server = B.AppServer(APP_NOTEBOOK, ARTIFACTS / "voila.log", max_kernels=32)
    try:
        server.wait_ready()
    except RuntimeError as err:
        server.stop()
        pytest.fail(str(err))
    yield server.url
    left = server.stop()
    assert server.proc.returncode == 0, "voila did not stop cleanly on SIGTERM"
    assert not left, f"kernels left running after voila stopped: {left}"


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as pw:
        b = B.launch(pw)
        yield b
        b.close()


@pytest.fixture
def page(browser, app_url):
    """A page on the app with every request that is not for 127.0.0.1 aborted and recorded."""
    pg = B.open_page(browser, app_url)
    yield pg
    pg.context.close()
    assert pg.external_requests == [], f"the app needed external hosts: {pg.external_requests}"
    assert pg.page_errors == [], f"JavaScript errors: {pg.page_errors}"


def changed_screenshot(locator, before: bytes, timeout_s: float = 15) -> bytes:
    """Poll element screenshots until one differs from ``before``."""
    deadline = time.monotonic() + timeout_s
    while True:
        shot = locator.screenshot()
        if shot != before or time.monotonic() > deadline:
            return shot
        time.sleep(0.2)


def per_gpu_bytes(text: str) -> float:
    """The bytes of the status line's "26.25 GB per GPU" (any unit: B, kB, MB, GB)."""
    from parallel_lab.quantities import BYTE_UNITS

    value, unit = re.search(r"([\d.]+) (\w+) per GPU", text).groups()
    return float(value) * dict(BYTE_UNITS)[unit]


def test_memory_slider_moves_the_numbers_and_the_chart(page):
    status = page.locator(".pl-status:visible").first
    chart = page.locator(".pl-chart:visible").first
    sync_api.expect(status).to_contain_text("per GPU")
    before_text, before_png = status.inner_text(), chart.screenshot(path=str(ARTIFACTS / "memory_before.png"))
    model, h100 = ModelSpec.preset("llama2-7b"), ClusterSpec.preset("h100-sxm")
    expected = memory(model, Plan(dp=8, seq=4096), h100).need_bytes       # the total, or the peak if larger
    assert per_gpu_bytes(before_text) == pytest.approx(expected, rel=5e-3)       # 3 significant digits

    handle = page.locator(".widget-slider .noUi-handle:visible").first    # the sequence-length slider
    handle.focus()
    page.keyboard.press("ArrowRight")                                     # 4096 -> 8192 tokens
    sync_api.expect(page.locator(".widget-readout:visible").first).to_have_text("8192")
    sync_api.expect(status).not_to_have_text(before_text, timeout=15_000)
    after_png = changed_screenshot(chart, before_png)
    (ARTIFACTS / "memory_after.png").write_bytes(after_png)
    page.screenshot(path=str(ARTIFACTS / "app_memory.png"), full_page=True)
    # the numbers are the ledger's for the new sequence length, and the chart was redrawn
    expected = memory(model, Plan(dp=8, seq=8192), h100).need_bytes
    assert per_gpu_bytes(status.inner_text()) == pytest.approx(expected, rel=5e-3)
    assert after_png != before_png


def test_communication_and_pipeline_tabs(page):
    page.locator(".lm-TabBar-tab", has_text="Communication").click()
    chart = page.locator(".pl-chart:visible").first
    status = page.locator(".pl-status:visible").first
    sync_api.expect(status).to_contain_text("across nodes")
    before_text = status.inner_text()
    before = chart.screenshot(path=str(ARTIFACTS / "comm_nvlink.png"))
    page.get_by_role("button", name="TP group across nodes").click()
    after = changed_screenshot(chart, before)
    (ARTIFACTS / "comm_across_nodes.png").write_bytes(after)
    assert after != before
    sync_api.expect(status).not_to_have_text(before_text)     # the total now uses the inter-node time

    page.locator(".lm-TabBar-tab", has_text="Pipeline").click()
    status = page.locator(".pl-status:visible").first
    sync_api.expect(status).to_contain_text("Bubble ratio 37.5%")          # (p - 1) / m for p=4, m=8
    page.locator(".pl-chart:visible").first.screenshot(path=str(ARTIFACTS / "pipeline.png"))
    page.screenshot(path=str(ARTIFACTS / "app_pipeline.png"), full_page=True)


def test_planner_tab_saves_a_plan_file(page):
    from parallel_lab.planfile import load_plan

    page.locator(".lm-TabBar-tab", has_text="Planner").click()
    status = page.locator(".pl-status:visible").first
    sync_api.expect(status).to_contain_text("that fit", timeout=30_000)
    sync_api.expect(page.get_by_text("Ranked plans")).to_be_visible()
    sync_api.expect(page.get_by_text("Rejected families")).to_be_visible()
    target = ARTIFACTS / "plan_from_app.yaml"
    target.unlink(missing_ok=True)
    path_box = page.locator(".widget-text:visible input").first
    path_box.fill(str(target))
    path_box.press("Enter")
    page.get_by_role("button", name="save plan file").click()
    sync_api.expect(page.get_by_text("Saved plan #1")).to_be_visible(timeout=15_000)
    sync_api.expect(page.get_by_text(str(target))).to_be_visible()
    page.screenshot(path=str(ARTIFACTS / "app_planner.png"), full_page=True)
    assert load_plan(target).gpus == 16


def test_inputs_show_their_tooltips_not_null(page):
    from parallel_lab.viz.explorers.help import TOOLTIPS

    titles = page.evaluate("() => [...document.querySelectorAll('[title]')].map(e => e.title)")
    assert "null" not in titles and "undefined" not in titles
    assert TOOLTIPS["seq"] in titles and TOOLTIPS["zero"] in titles and TOOLTIPS["gpus"] in titles
    page.locator(".lm-TabBar-tab", has_text="Pipeline").click()
    sync_api.expect(page.locator(".pl-status:visible").first).to_contain_text("Bubble ratio")   # tab built
    titles = page.evaluate("() => [...document.querySelectorAll('[title]')].map(e => e.title)")
    assert TOOLTIPS["microbatches"] in titles


def test_a_degree_change_updates_gpus_and_the_chart(page):

    status = page.locator(".pl-status:visible").first
    sync_api.expect(status).to_contain_text("per GPU")
    tp = page.locator(".widget-slider:visible").filter(has=page.get_by_text("tp", exact=True))
    handle = tp.locator(".noUi-handle")                                       # tp: 1 -> 2
    handle.focus()
    page.keyboard.press("ArrowRight")
    expected = memory(ModelSpec.preset("llama2-7b"), Plan(dp=8, tp=2, seq=4096),
                      ClusterSpec.preset("h100-sxm")).need_bytes
    sync_api.expect(status).to_contain_text(f"{need_text(expected)} per GPU", timeout=15_000)
    gpus = page.locator(".widget-inline-hbox:visible", has_text="GPUs").locator("input").first
    sync_api.expect(gpus).to_have_value("16")                                # dp x tp = 8 x 2
    assert "Invalid" not in status.inner_text()
    assert per_gpu_bytes(status.inner_text()) == pytest.approx(expected, rel=5e-3)        # 3 significant digits


def test_grid_tab_colours_groups_and_counts_the_crossing_ones(page):
    from parallel_lab.viz.explorers.grid import grid_groups

    page.locator(".lm-TabBar-tab", has_text="Grid").click()
    status = page.locator(".pl-status:visible").first
    chart = page.locator(".pl-chart:visible").first
    sync_api.expect(status).to_contain_text("groups span more than one node")
    plan = Plan(dp=2, tp=4, pp=2, cp=1)                                  # the tab's defaults: 16 ranks, 2 nodes
    sync_api.expect(status).to_contain_text(f"0 of {len(grid_groups(plan, 'tp'))} tp groups")
    before = chart.screenshot(path=str(ARTIFACTS / "grid_tp.png"))
    page.get_by_role("button", name="dp", exact=True).filter(visible=True).first.click()
    crossing = sum(1 for g in grid_groups(plan, "dp")
                   if len({r // ClusterSpec.preset("h100-sxm").gpus_per_node for r in g}) > 1)
    sync_api.expect(status).to_contain_text(f"{crossing} of {len(grid_groups(plan, 'dp'))} dp groups")
    after = changed_screenshot(chart, before)
    (ARTIFACTS / "grid_dp.png").write_bytes(after)
    assert after != before
    page.screenshot(path=str(ARTIFACTS / "app_grid.png"), full_page=True)


def test_a_plan_from_the_planner_opens_in_the_memory_tab(page):
    from parallel_lab.planner import plan_search

    page.locator(".lm-TabBar-tab", has_text="Planner").click()
    sync_api.expect(page.locator(".pl-status:visible").first).to_contain_text("that fit", timeout=30_000)
    page.get_by_role("button", name="open in every tab").click()
    sync_api.expect(page.get_by_text("opened in Memory")).to_be_visible(timeout=30_000)
    model, h100 = ModelSpec.preset("llama2-7b"), ClusterSpec.preset("h100-sxm")
    best = plan_search(model, h100, 16, 4096, global_batch_tokens="1M").top(1)[0].plan  # the tab's defaults
    page.locator(".lm-TabBar-tab", has_text="Memory").click()
    status = page.locator(".pl-status:visible").first
    expected = memory(model, best, h100).need_bytes
    sync_api.expect(status).to_contain_text(f"{need_text(expected)} per GPU", timeout=15_000)
    page.screenshot(path=str(ARTIFACTS / "app_plan_opened_in_memory.png"), full_page=True)


def test_ring_attention_tab_walks_the_ring(page):
    page.locator(".lm-TabBar-tab", has_text="Ring attention").click()
    status = page.locator(".pl-status:visible").first
    chart = page.locator(".pl-chart:visible").first
    sync_api.expect(status).to_contain_text("Step 1")
    sync_api.expect(status).to_contain_text("rank 0 holds K/V chunks 0, 7")          # zigzag, cp=4
    before = chart.screenshot(path=str(ARTIFACTS / "ring_step1.png"))
    step = page.locator(".widget-slider:visible").filter(has=page.get_by_text("ring step", exact=True))
    step.locator(".noUi-handle").focus()
    page.keyboard.press("ArrowRight")
    sync_api.expect(status).to_contain_text("Step 2")
    sync_api.expect(status).to_contain_text("rank 0 holds K/V chunks 3, 4")          # the block of rank 3
    after = changed_screenshot(chart, before)
    (ARTIFACTS / "ring_step2.png").write_bytes(after)
    assert after != before


def run_table(page, table: str) -> dict[str, tuple[int, int]]:
    """The Run tab's table ``table`` (memory, comm) read back: row -> (measured, predicted) bytes."""
    rows = page.locator(f".pl-run-table[data-table='{table}'] tr[data-row]:visible")
    out = {}
    for i in range(rows.count()):
        row = rows.nth(i)
        cells = [c.replace(",", "") for c in row.locator("td").all_inner_texts()]
        out[row.get_attribute("data-row")] = (int(cells[1]), int(cells[2]))
    return out


@pytest.mark.timeout(420)
def test_run_tab_trains_on_cpu_ranks_and_shows_measured_beside_the_ledger(page):
    from parallel_lab import comm, ledger, ledger_activations

    page.locator(".lm-TabBar-tab", has_text="Run").last.click()
    status = page.locator(".pl-status:visible").first
    sync_api.expect(status).to_contain_text("Not run yet")
    page.get_by_role("button", name="Run on CPU ranks").click()
    sync_api.expect(page.get_by_role("button", name="Cancel")).to_be_enabled(timeout=15_000)
    sync_api.expect(status).to_contain_text("Measured", timeout=360_000)
    page.screenshot(path=str(ARTIFACTS / "app_run.png"), full_page=True)
    model = ModelSpec.preset("tiny-llama")                      # the tab's defaults, the run's CPU defaults
    plan = Plan(dp=2, pp=2, seq=128, micro_batch=4, grad_accum=4, dtype="fp32", optimizer="adam-fp32")
    memory_rows = run_table(page, "memory")
    for cat in ("parameters", "gradients", "optimizer_states"):
        expected = int(max(ledger.state_bytes(model, plan, stage=s)[cat] for s in range(plan.pp)))
        assert memory_rows[cat] == (expected, expected)
    acts = memory_rows["activations"]
    assert acts[1] == int(round(ledger_activations.activation_bytes(model, plan, 0, formula="per-op")))
    assert abs(acts[0] - acts[1]) <= 0.02 * acts[1]
    predicted: dict[str, int] = {}
    for stage in (0, 0, 1, 1):
        for dim, b in comm.payload_bytes(comm.collectives(model, plan, stage=stage)).items():
            predicted[dim] = predicted.get(dim, 0) + 2 * b                 # the tab's default: 2 steps
    assert {d: m for d, (m, _) in run_table(page, "comm").items()} == predicted
    sync_api.expect(page.locator(".pl-status:visible", has_text="Measured: 2 ranks")).to_be_visible()
    assert page.locator(".pl-chart:visible").count() == 2          # the run's chart and the pipeline's


def test_zero_tab_shows_shards_and_the_peak_rising_with_one_root_unit(page):
    from parallel_lab.ledger_buffers import zero3_gathered_bytes
    from parallel_lab.quantities import fmt_bytes

    page.locator(".lm-TabBar-tab", has_text="ZeRO/FSDP").click()
    status = page.locator(".pl-status:visible").first
    chart = page.locator(".pl-chart:visible").first
    model, plan = ModelSpec.preset("llama2-7b"), Plan(dp=4, zero=3)            # the tab's defaults
    sync_api.expect(status).to_contain_text("ZeRO-3 over 4 ranks")
    sync_api.expect(status).to_contain_text(f"at most {fmt_bytes(zero3_gathered_bytes(model, plan))} per rank "
                                            "with block units")
    before = chart.screenshot(path=str(ARTIFACTS / "zero_block_units.png"))
    page.get_by_role("button", name="root", exact=True).filter(visible=True).first.click()
    sync_api.expect(status).to_contain_text("Unit root has")
    after = changed_screenshot(chart, before)
    (ARTIFACTS / "zero_root_unit.png").write_bytes(after)
    assert after != before
    root_peak = zero3_gathered_bytes(model, plan.with_(zero_unit="root"))
    sync_api.expect(status).to_contain_text(f"{fmt_bytes(root_peak)} with one root unit")
    link = page.locator(".pl-lesson-link:visible a")
    assert link.get_attribute("data-lesson") == "02_data_parallel_and_zero"
    page.screenshot(path=str(ARTIFACTS / "app_zero.png"), full_page=True)


def test_tp_tab_splits_the_weights_and_walks_the_ring_all_reduce(page):
    from parallel_lab.comm import tp_layer_collectives
    from parallel_lab.quantities import fmt_bytes

    page.locator(".lm-TabBar-tab", has_text="Tensor parallel").click()
    status = page.locator(".pl-status:visible").first
    chart = page.locator(".pl-chart:visible").first
    calls = tp_layer_collectives(ModelSpec.preset("llama2-7b"), Plan(tp=4, seq=4096))   # the tab's defaults
    for c in calls:
        sync_api.expect(status).to_contain_text(f"{c.count} x all-reduce of {fmt_bytes(c.message_bytes)} in {c.phase}")
    before = chart.screenshot(path=str(ARTIFACTS / "tp_step0.png"))
    step = page.locator(".widget-slider:visible").filter(has=page.get_by_text("all-reduce step", exact=True))
    step.locator(".noUi-handle").focus()
    for _ in range(3):                                                   # the 3 reduce-scatter steps of tp=4
        page.keyboard.press("ArrowRight")
    sync_api.expect(step.locator(".widget-readout")).to_have_text("3")
    after = changed_screenshot(chart, before)
    (ARTIFACTS / "tp_step3.png").write_bytes(after)
    assert after != before
    page.get_by_role("button", name="on", exact=True).filter(visible=True).first.click()      # SP
    sync_api.expect(status).to_contain_text("x all-gather of")
    page.screenshot(path=str(ARTIFACTS / "app_tp.png"), full_page=True)


TABS = ("Memory", "Communication", "Pipeline", "Grid", "Ring attention", "ZeRO/FSDP", "Tensor parallel", "Experts",
        "Planner", "Run")


def test_every_tab_s_picture_is_on_the_first_screen(browser, app_url, tmp_path):
    """A learner's 1440 x 900 window: each tab's main picture lies within the first screen, unscrolled;
    a screenshot of each tab is saved under a temporary directory."""
    pg = B.open_page(browser, app_url, viewport=(1440, 900))
    off = []
    try:
        sync_api.expect(pg.locator(".pl-chart:visible").first).to_be_visible()
        for tab in TABS:
            pg.locator(".lm-TabBar-tab", has_text=tab).click()
            chart = pg.locator(".pl-chart:visible").first
            sync_api.expect(chart).to_be_visible(timeout=60_000)
            pg.wait_for_function("() => [...document.querySelectorAll('.pl-chart')].some("
                                 "i => i.offsetParent && i.naturalHeight > 0)")
            pg.evaluate("() => window.scrollTo(0, 0)")
            shot = pg.screenshot(path=str(tmp_path / f"{tab.replace('/', '_').replace(' ', '_')}.png"))
            (ARTIFACTS / f"first_screen_{tab.replace('/', '_').replace(' ', '_')}.png").write_bytes(shot)
            box = chart.bounding_box()
            assert box is not None and box["height"] > 100, tab
            if not (box["y"] >= 0 and box["y"] + box["height"] <= 900):
                off.append(f"{tab}: y {box['y']:.0f} to {box['y'] + box['height']:.0f}")
    finally:
        pg.context.close()
    assert len(list(tmp_path.glob("*.png"))) == len(TABS)
    assert not off, f"pictures below the first screen (900 px): {off}"


def test_lesson_links_stay_on_127_0_0_1(page):
    from parallel_lab.viz.explorers.lessons import LESSONS, lesson_url

    hrefs = page.evaluate("() => [...document.querySelectorAll('a.pl-lesson')].map(a => a.href)")
    assert set(hrefs) >= {lesson_url(s) for s in LESSONS}
    assert all(h.startswith("http://127.0.0.1:") for h in hrefs)
    link = page.locator(".pl-lesson-link:visible a")
    assert link.get_attribute("data-lesson") == "01_memory_ledger"          # the Memory tab's lesson


def measure_table(page) -> dict[str, dict[str, int | None]]:
    """The Memory tab's measurement table read back: row -> {measured, per-op, korthikanti} bytes."""
    rows = page.locator(".pl-measure-table tr[data-row]:visible")
    out = {}
    for i in range(rows.count()):
        row = rows.nth(i)
        out[row.get_attribute("data-row")] = {
            cls: (None if (t := row.locator(f"td.{cls}").inner_text().replace(",", "")) == "-" else int(t))
            for cls in ("measured", "per-op", "korthikanti")}
    return out


@pytest.mark.timeout(120)
def test_memory_tab_measures_the_plan_shown_in_fake_tensors(page):
    from parallel_lab import ledger

    status = page.locator(".pl-status:visible").first
    sync_api.expect(status).to_contain_text("per GPU")
    page.locator(".widget-dropdown:visible", has_text="model").locator("select").first.select_option("tiny-llama")
    model, h100 = ModelSpec.preset("tiny-llama"), ClusterSpec.preset("h100-sxm")
    plan = Plan(dp=8, seq=4096).validate(model)                      # the tab's other defaults
    expected = memory(model, plan, h100)
    sync_api.expect(status).to_contain_text(f"{need_text(expected.need_bytes)} per GPU", timeout=15_000)
    measure_status = page.locator(".pl-measure-status:visible")
    sync_api.expect(measure_status).to_contain_text("measure this plan")
    page.get_by_role("button", name="measure this plan").click()
    sync_api.expect(page.locator(".pl-measure-progress:visible")).to_contain_text("stage 0", timeout=30_000)
    sync_api.expect(measure_status).to_contain_text("Measured", timeout=90_000)
    sync_api.expect(page.locator(".pl-measure-progress:visible")).to_contain_text("done")
    page.locator(".pl-measure:visible").screenshot(path=str(ARTIFACTS / "memory_measured.png"))
    page.screenshot(path=str(ARTIFACTS / "app_memory_measured.png"), full_page=True)
    rows = measure_table(page)
    assert list(rows) == [*ledger.CATEGORIES, "peak"]
    for f in ("per-op", "korthikanti"):                              # the predicted columns are the ledger's
        led = ledger.memory(model, plan, h100, activation_model=f)
        assert {k: rows[k][f] for k in led.per_gpu_bytes} == {k: int(v) for k, v in led.per_gpu_bytes.items()}
        assert rows["peak"][f] == int(led.total_bytes)
    for k in ("parameters", "gradients", "optimizer_states"):        # the state is measured exactly
        assert rows[k]["measured"] == int(expected.per_gpu_bytes[k]), k
    acts = rows["activations"]
    assert abs(acts["measured"] - acts["per-op"]) <= 0.02 * acts["per-op"]
    assert page.locator(".pl-measure-chart:visible").count() == 1
