"""The Memory tab's "measure this plan" driven in-process: a child ``parallel-lab memory --measure --json`` of
Llama 3.2 1B (seconds), its figures read back from the panel's table and chart against ``measure_json`` run
here and against the ledger; refusals that start nothing; Cancel; the command spelling the very plan shown."""

from __future__ import annotations

import os
import re
import time

import pytest

from parallel_lab import ledger
from parallel_lab.errors import ParallelLabError
from parallel_lab.specs import ModelSpec, Plan
from parallel_lab.viz.explorers.base import model_from
from parallel_lab.viz.explorers.jobs import check_spelled, cli_argv, group_gone
from parallel_lab.viz.explorers.memory import MemoryExplorer
from parallel_lab.viz.explorers.memory_measure import ROWS, measure_argv

pytestmark = pytest.mark.timeout(120)


def table_rows(html: str) -> dict[str, dict[str, int | None]]:
    """The panel's table read back: row -> {measured, per-op, korthikanti} exact bytes (None for "-")."""
    out = {}
    for row, cells in re.findall(r"<tr data-row='(\w+)'>(.*?)</tr>", html):
        vals = dict(re.findall(r"<td class='(measured|per-op|korthikanti)'[^>]*>([^<]*)</td>", cells))
        out[row] = {k: None if v == "-" else int(v.replace(",", "")) for k, v in vals.items()}
    return out


def test_measure_this_plan_shows_what_measure_json_measures():
    from parallel_lab.distributed.instruments.measure import measure_json

    ex = MemoryExplorer(model="llama3.2-1b", seq=1024, dp=8)
    panel = ex.measure
    assert "measure this plan" in panel.status.value and panel.image.layout.display == "none"
    assert panel.start()
    assert panel.button.disabled
    panel.wait(90)
    assert panel.failed is None and panel.refused is None, panel.failed or panel.refused
    assert not panel.button.disabled and panel.cancel_button.disabled
    assert panel.progress.value == panel.progress.max and "done" in panel.progress_text.value
    model, plan = ModelSpec.preset("llama3.2-1b"), Plan(dp=8, seq=1024).validate(ModelSpec.preset("llama3.2-1b"))
    assert panel.measured_for == (model, plan, 0)
    here = measure_json(model, plan, stage=0)["stages"][0]               # the same measurement, in this process
    entry = panel.entry
    assert entry["measured"] == here["measured"] and entry["predicted"] == here["predicted"]
    rows = table_rows(panel.table.value)
    assert list(rows) == list(ROWS)
    for k in ROWS:
        m = here["measured"][k]
        assert rows[k]["measured"] == (None if m is None else int(m)), k
        for f in ("per-op", "korthikanti"):
            assert rows[k][f] == int(here["predicted"][f]["total" if k == "peak" else k]), (k, f)
    # the predictions are the ledger's, and the state categories measure exactly what it says
    for f in ("per-op", "korthikanti"):
        led = ledger.memory(model, plan, activation_model=f)
        assert {k: rows[k][f] for k in led.per_gpu_bytes} == {k: int(v) for k, v in led.per_gpu_bytes.items()}
        assert rows["peak"][f] == int(led.total_bytes)
    for k in ("parameters", "gradients", "optimizer_states"):
        assert rows[k]["measured"] == rows[k]["per-op"]
    # the chart's measured bars are the measured bytes (draw_predicted_measured's gids)
    bars = {p.get_gid(): p.get_width() for p in panel.figure.axes[1].patches if p.get_gid()}
    assert bars["measured:parameters"] == here["measured"]["parameters"]
    assert bars["measured:peak"] == here["measured"]["peak"]
    assert bars["predicted:activations"] == here["predicted"]["per-op"]["activations"]
    assert "Measured" in panel.status.value and panel.image.layout.display is None

    # another plan hides the answer (no redraw of it), the plan measured shows it again
    png = panel.image.value
    ex.widgets["tp"].value = 2
    assert panel.image.layout.display == "none" and "another plan" in panel.status.value
    ex.widgets["tp"].value = 1
    assert panel.image.layout.display is None and "Measured" in panel.status.value
    assert panel.image.value == png


@pytest.mark.parametrize(("change", "said"), [
    ({"model": "tiny-llama", "tp": 4}, "tp=4 > kv_heads=2"),                # replicated kv heads
    ({"zero": 3}, "fsdp2-mixed"),                                           # no runnable layout: its fix
])
def test_a_plan_fake_tensors_cannot_run_says_why_and_starts_nothing(change, said):
    ex = MemoryExplorer(model="llama3.2-1b", seq=1024, dp=8)
    ex.set(**change)
    assert ex.error is None                                                 # a valid plan, for the ledger
    ex.measure.start()
    ex.measure.wait(60)
    assert ex.measure.job is None, "a refused plan started a process"
    assert said in ex.measure.refused and "Not measured" in ex.measure.status.value
    assert not ex.measure.button.disabled
    ex.widgets["seq"].value = 2048                                          # a refusal is about its plan only
    assert ex.measure.refused is None


def test_an_invalid_plan_is_not_measured():
    ex = MemoryExplorer(model="llama3.2-1b", seq=1024, dp=8)
    ex.widgets["tp"].value = 64                                             # 32 heads: invalid
    assert ex.error is not None
    assert ex.measure.start() is False and ex.measure.job is None
    assert str(ex.error) in ex.measure.refused


def test_cancel_stops_the_measurement():
    ex = MemoryExplorer(model="llama3-8b", seq=8192, dp=8, zero=1)
    panel = ex.measure
    assert panel.start()
    deadline = time.monotonic() + 60
    while panel.job is None and time.monotonic() < deadline:               # the check hands over the start
        time.sleep(0.05)
    assert panel.job is not None and not panel.cancel_button.disabled
    pgid = panel.job.proc.pid
    while panel.progress.value < 1 and time.monotonic() < deadline:        # its first progress line
        time.sleep(0.05)
    assert panel.progress.value >= 1 and "building" in panel.progress_text.value
    panel.cancel()
    panel.wait(30)
    assert panel.job.cancelled and panel.report is None and panel.failed == "cancelled"
    assert "cancelled" in panel.progress_text.value and not panel.button.disabled
    assert group_gone(pgid)


@pytest.mark.parametrize("plan", [
    Plan(dp=8, seq=4096),
    Plan(dp=4, tp=8, pp=4, zero=1, sp=True, grad_accum=8, seq=8192, recompute="selective",
         schedule="interleaved", interleave=2),
    Plan(dp=16, zero=3, optimizer="fsdp2-mixed", zero_unit="root", micro_batch=2, attention="flash", mlp="fused",
         loss_chunk=1024),
])
def test_the_command_spells_the_plan_shown(plan):
    model = ModelSpec.preset("llama3-70b")
    plan = plan.validate(model)
    from parallel_lab.hardware import ClusterSpec

    argv = measure_argv(model, plan, ClusterSpec.preset("h100-sxm"), 0, "per-op")
    assert argv[1:4] == ["-m", "parallel_lab", "memory"] and argv[-2:] == ["--measure", "--json"]
    check_spelled(argv, model, plan)                                        # the CLI's parser reads it back
    with pytest.raises(ParallelLabError, match="reads this plan differently"):
        check_spelled(argv, model, plan.with_(seq=plan.seq * 2))


def test_a_custom_shape_is_spelled_or_refused():
    llama = model_from({"model": "custom", "layers": 4, "hidden": 512, "heads": 8, "kv_heads": 2, "ffn": 1024,
                        "vocab": 1000, "flavour": "llama"})
    plan = Plan(dp=2, seq=1024).validate(llama)
    check_spelled(cli_argv("memory", llama, plan), llama, plan)
    gpt = model_from({"model": "custom", "layers": 4, "hidden": 512, "heads": 8, "kv_heads": 8, "ffn": 2048,
                      "vocab": 1000, "flavour": "gpt"})
    with pytest.raises(ParallelLabError, match="max_positions"):        # the explorer's table is longer
        check_spelled(cli_argv("memory", gpt, plan), gpt, plan)


_NO_TORCH = """
import sys
from parallel_lab.viz.explorers.memory import MemoryExplorer
ex = MemoryExplorer(model="llama3.2-1b", seq=1024, dp=8)
ex.set(tp=16)
ex.measure.start()
assert ex.measure.refused and ex.measure.job is None
print("torch" in sys.modules)
"""


def test_the_kernel_refuses_without_loading_torch():
    """The Memory tab's refusals are the torch-free rules (measurable): a learner's kernel
    does not grow by torch's few hundred MB to be told that tp > kv_heads cannot be measured."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _NO_TORCH], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_a_finished_job_keeps_no_descriptors_or_exit_hooks():

    from parallel_lab.viz.explorers.jobs import CliJob

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    CliJob(["true"], lambda line: None, lambda job: None).wait(30)      # warm up (lazy imports, caches)
    before = fds()
    jobs = [CliJob(["true"], lambda line: None, lambda job: None) for _ in range(5)]
    for job in jobs:
        job.wait(30)
        assert job.returncode == 0 and not job.thread.is_alive()
    assert fds() <= before
