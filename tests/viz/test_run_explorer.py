"""The Run tab driven programmatically: a real run on CPU ranks (a child ``parallel-lab run``), its measured
figures against the ledger and comm's own predictions, the memory guard's refusal, and cancel."""

from __future__ import annotations

import time

import pytest

from parallel_lab import comm, ledger
from parallel_lab.specs import ModelSpec, Plan
from parallel_lab.viz.explorers.jobs import group_gone
from parallel_lab.viz.explorers.run import RunExplorer, run_plan

pytestmark = pytest.mark.timeout(300)


def test_a_real_run_shows_measured_beside_the_ledger():
    ex = RunExplorer(dp=2, pp=2, steps=1)
    assert ex.verdict == "not run" and "Not run yet" in ex.status.value
    assert ex.start()
    assert ex.run_button.disabled and not ex.cancel_button.disabled
    assert "Running" in ex.status.value and "Not run yet" not in ex.status.value
    try:
        ex.job.wait(240)
    finally:
        ex.cancel()
    assert ex.job.returncode == 0, ex.job.error
    assert ex.verdict == "measured" and ex.error is None
    model, plan = run_plan(ex.values())
    assert plan == Plan(dp=2, pp=2, seq=128, micro_batch=4, grad_accum=4, dtype="fp32", optimizer="adam-fp32")
    rep = ex.report
    for cat in ("parameters", "gradients", "optimizer_states"):     # the fullest stage, exactly the ledger's
        expected = max(ledger.state_bytes(model, plan, stage=s)[cat] for s in range(plan.pp))
        assert rep["memory"][cat]["measured_bytes"] == int(expected)
        assert f"<td class='measured' style='text-align:right'>{int(expected):,}</td>" in ex.tables.value
    predicted = {}
    for stage in [0, 0, 1, 1]:                                       # dp=2 ranks on each of the 2 stages
        for dim, b in comm.payload_bytes(comm.collectives(model, plan, stage=stage)).items():
            predicted[dim] = predicted.get(dim, 0) + b
    assert {d: c["measured_bytes"] for d, c in rep["comm"].items()} == predicted
    assert rep["losses"] == pytest.approx(rep["reference_losses"], abs=1e-4)
    assert ex.progress.value == ex.progress.max == 1
    # the measured pipeline timeline under the simulated one, in the embedded Pipeline explorer
    assert ex.pipeline.layout.display is None and len(ex.pipeline.figure.axes) == 2
    assert ex.pipeline.widgets["stages"].value == 2 and ex.pipeline.widgets["microbatches"].value == 4
    assert "Measured: 2 ranks" in ex.pipeline.status.value
    assert all(c.layout.display == "none" for c in ex.pipeline.children[:2])   # no second schedule controls
    sim_ax, meas_ax = ex.pipeline.figure.axes[:2]                    # one unit and one axis for both timelines
    assert sim_ax.get_xlabel() == meas_ax.get_xlabel() == "time (ms)" and sim_ax.get_xlim() == meas_ax.get_xlim()
    assert "<tr><td>1</td>" in ex.tables.value and "<tr><td>0</td>" not in ex.tables.value   # steps from 1
    assert [int(t) for t in ex.figure.axes[2].get_xticks()] == [1]
    bars = [p for p in ex.figure.axes[0].patches if p.get_gid() == "measured"]
    assert len(bars) == 4 and ex.image.layout.display is None
    ex.widgets["dp"].value = 1                                       # another plan: its run is not shown
    assert ex.verdict == "not run"


def test_the_memory_guard_refuses_before_any_process_starts():
    ex = RunExplorer()
    ex.widgets["model"].value = "llama3-8b"
    assert ex.start() is False and ex.job is None
    assert "available" in ex.run_error and "Not started" in ex.status.value
    assert "pick a smaller model" in ex.status.value


def test_cancel_stops_every_rank():
    ex = RunExplorer(dp=2, pp=1, steps=5)
    assert ex.start()
    pgid = ex.job.proc.pid
    time.sleep(3)
    ex.cancel()
    ex.job.wait(30)
    assert ex.job.cancelled and ex.report is None
    assert "cancelled" in ex.progress_text.value and not ex.run_button.disabled
    deadline = time.monotonic() + 15
    while not group_gone(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert group_gone(pgid), "ranks of a cancelled run are still running"


def test_the_command_is_parallel_lab_run():
    from parallel_lab.viz.explorers.run import run_argv

    model, plan = ModelSpec.preset("tiny-llama"), Plan(dp=2, tp=2, seq=64)
    argv = run_argv(model, plan, 2, python="python")
    assert argv[:4] == ["python", "-m", "parallel_lab", "run"] and argv[-1] == "--json"
    from parallel_lab.cli import build_parser

    args = build_parser().parse_args(argv[3:])
    assert (args.dp, args.tp, args.seq, args.steps) == (2, 2, 64, 2)
