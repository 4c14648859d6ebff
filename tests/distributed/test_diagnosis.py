"""Diagnosis and fault injection (issue 15): each injected fault named by rank on real ranks, within a limit.

Limits, from the launch to the error (a loaded 2-core machine; idle it is a few seconds): a dead rank and a
NaN within 60 s, a hung rank within its progress timeout (8 s here) + 40 s; a straggler is named in the report.
The unit tests feed the same functions synthetic inputs whose answer is known.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from parallel_lab.distributed.runtime.compare import Comparison, check_same_data, compare, plan_from_text
from parallel_lab.distributed.runtime.diagnosis import ActionLog, FiniteWatch, NonFiniteError, step_time_report
from parallel_lab.distributed.runtime.faults import SLOW_S, Fault, check_faults
from parallel_lab.distributed.runtime.launch import LaunchTimeout, RankError
from parallel_lab.distributed.runtime.run import run
from parallel_lab.errors import ParallelLabError
from parallel_lab.specs import MODEL_PRESETS, RUN_DEFAULTS, Plan

SPEC = MODEL_PRESETS["tiny-llama"]
DP2 = Plan(dp=2, **RUN_DEFAULTS)


# ---- no processes ------------------------------------------------------------------------------

def test_fault_spellings_parse_and_bad_ones_name_the_fix():
    assert Fault.parse("die:1") == Fault("die", 1, 1)
    assert Fault.parse("slow:0:3") == Fault("slow", 0, 3)
    assert Fault.parse("unscaled-accum") == Fault("unscaled-accum")
    for bad, words in (("boom:1", "unknown"), ("die", "KIND:RANK"), ("die:x", "integers"),
                       ("die:1:0", ">= 1"), ("unscaled-accum:1", "every rank")):
        with pytest.raises(ParallelLabError, match=words):
            Fault.parse(bad)
    with pytest.raises(ParallelLabError, match="rank 4 is not in a run of 2"):
        check_faults((Fault("die", 4),), world=2, steps=3)
    with pytest.raises(ParallelLabError, match="after the last step"):
        check_faults((Fault("nan", 0, 5),), world=2, steps=3)


def test_step_time_report_names_the_rank_that_computes_longer_and_no_one_when_even():
    steps = [[1.0, 1.0, 1.0]] * 4
    waits = [[0.1, 0.6, 0.6], [0.1, 0.6, 0.6], [0.1, 0.0, 0.0], [0.1, 0.6, 0.6]]   # rank 2 never waits
    rep = step_time_report(steps, waits)
    assert rep["straggler"] == 2 and "rank 2 is a straggler" in rep["why"]
    assert [round(r["compute_s"], 6) for r in rep["ranks"]] == [0.8, 0.8, 2.0, 0.8]   # first step left out
    even = step_time_report(steps, [[0.1, 0.1, 0.1]] * 4)
    assert even["straggler"] is None and "no straggler" in even["why"]


def test_action_log_sums_the_time_blocked_on_peers_and_keeps_the_last_call():
    now = [0.0]
    seen: list[tuple[str, bool]] = []
    log = ActionLog(lambda text, waiting: seen.append((text, waiting)), clock=lambda: now[0])
    log.begin_step(1)
    now[0] = 1.0
    log("in backward dp all_reduce of 8 B", True)
    now[0] = 1.25
    log("after backward dp all_reduce of 8 B", False)
    now[0] = 2.0
    log("step phase", False)
    assert log.wait_s == [0.25]
    assert seen[-1] == ("step 1: step phase (last call: after backward dp all_reduce of 8 B)", False)
    assert seen[1] == ("step 1: in backward dp all_reduce of 8 B", True)


def test_finite_watch_names_the_innermost_module_whose_output_went_bad():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 4)))
    watch = FiniteWatch(model, rank=3)
    watch.step = 7
    model(torch.ones(2, 4))                                   # finite: silent
    with torch.no_grad():
        model[1][1].weight[0, 0] = float("inf")
    with pytest.raises(NonFiniteError, match="rank 3 at step 7 .* of 1.1") as info:
        model(-torch.ones(2, 4))                              # relu passes 0s; inf * 0 = nan in 1.1
    assert (info.value.rank, info.value.step, info.value.module) == (3, 7, "1.1")
    watch.remove()
    model(torch.ones(2, 4))                                   # hooks gone


def test_finite_watch_adds_nothing_to_the_activations_the_meter_measures():
    from parallel_lab.distributed.instruments.saved import SavedTensorMeter
    from parallel_lab.distributed.model.data import synthetic_batch
    from parallel_lab.distributed.model.model import build_model, loss_fn

    spec = MODEL_PRESETS["tiny-gpt"].with_(layers=2)
    plan = Plan(**{**RUN_DEFAULTS, "seq": 64, "micro_batch": 2})
    seen = []
    for watched in (False, True):
        model = build_model(spec, 0)
        watch = FiniteWatch(model, 0) if watched else None
        meter = SavedTensorMeter(model)
        b = synthetic_batch(spec, plan, 0, 0)
        with meter:
            loss_fn(model(b.tokens, b.positions, b.doc_ids), b.targets).backward()
        seen.append((dict(meter.peak), dict(meter.forward_bytes)))
        if watch is not None:
            watch.remove()
    assert seen[0] == seen[1]


def test_compare_plans_from_text_and_the_same_data_rule():
    base = Plan(**RUN_DEFAULTS)
    assert plan_from_text("dp=1,grad_accum=2", base)[1] == base.with_(dp=1, grad_accum=2)
    assert plan_from_text("tp=2,sp=true", base)[1].sp is True
    for bad, words in (("dp", "FIELD=VALUE"), ("speed=2", "not a Plan field"), ("dp=two", "an integer")):
        with pytest.raises(ParallelLabError, match=words):
            plan_from_text(bad, base)
    with pytest.raises(ParallelLabError, match="same data"):
        check_same_data(SPEC, base.with_(dp=2), base.with_(dp=2, grad_accum=2))


def test_the_diagnosis_plots_draw_what_they_are_given():
    from parallel_lab.viz.plots import diagnosis as P

    rep = step_time_report([[1.0, 1.0, 1.0]] * 2, [[0.0, 0.7, 0.7], [0.0, 0.0, 0.0]])
    fig = P.rank_times_figure(rep)
    bars = fig.axes[0].patches
    assert [round(b.get_width(), 6) for b in bars] == [0.6, 2.0, 1.4, 0.0]     # compute 0, 1; wait 0, 1
    assert "straggler" in fig.axes[0].get_yticklabels()[1].get_text()
    fig = P.loss_curves_figure({"a": [3.0, 2.0], "b": [3.0, 2.5]})
    assert [list(line.get_ydata()) for line in fig.axes[0].get_lines()] == [[3.0, 2.0], [3.0, 2.5]]
    fig = P.knob_figure([4, 8], [1.75, 0.875], [1e9, 2e9])
    assert list(fig.axes[0].get_lines()[0].get_ydata()) == [175.0, 87.5]
    assert list(fig.axes[1].get_lines()[0].get_ydata()) == [1.0, 2.0]


# ---- real ranks ----------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_rank_killed_in_a_pipeline_is_named_with_its_last_action_within_60_s():
    plan = Plan(pp=2, **{**RUN_DEFAULTS, "grad_accum": 2})
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        run(SPEC, plan, steps=3, faults=[Fault("die", 1, 2)], timeout_s=60)
    assert time.monotonic() - t0 < 60
    e = info.value
    assert (e.rank, e.signal, e.step) == (1, 9, 1)
    assert e.last_action.startswith("step 2:") and " pp " in e.last_action, e.last_action


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_hung_rank_is_named_not_the_peer_that_waits_for_it():
    t0 = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        run(SPEC, DP2, steps=3, faults=[Fault("hang", 1, 2)], timeout_s=8)
    assert time.monotonic() - t0 < 8 + 40
    e = info.value
    assert e.ranks == [1] and e.stopped == [] and e.steps == [1, 1], str(e)
    assert "outside any collective" in str(e) and "rank 1: step 2:" in str(e)
    assert e.actions[0].startswith("step 2:") and "all_reduce" in e.actions[0]   # rank 0: blocked in dp sync


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_hung_tensor_parallel_rank_is_named_while_its_peer_waits_in_a_tp_all_reduce():
    with pytest.raises(LaunchTimeout) as info:
        run(SPEC, Plan(tp=2, **RUN_DEFAULTS), steps=2, faults=[Fault("hang", 0, 2)], timeout_s=8)
    e = info.value
    assert e.ranks == [0] and e.steps == [1, 1], str(e)
    assert e.actions[1].startswith("step 2: in forward tp all_reduce"), e.actions   # blocked in the MLP's


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_nan_is_named_with_rank_step_and_module_within_60_s():
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        run(SPEC, DP2, steps=3, faults=[Fault("nan", 0, 2)], timeout_s=60)
    assert time.monotonic() - t0 < 60
    e = info.value
    assert e.rank == 0 and e.exc_type == "NonFiniteError"
    assert "first appeared on rank 0 at step 2 in the forward output of blocks.0.mlp" in e.last_line


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_slow_rank_is_named_as_the_straggler_and_its_peer_waits():
    rep = run(SPEC, DP2, steps=3, faults=[Fault("slow", 1)], timeout_s=60)
    st = rep.extra["step_times"]
    assert st["straggler"] == 1, st["why"]
    r0, r1 = st["ranks"]
    assert r1["compute_s"] >= 2 * SLOW_S                     # 2 steps counted, one slow forward each
    assert r0["wait_s"] > 0.5 * 2 * SLOW_S                   # rank 0 waited for it in the all-reduce
    assert "rank 1 is a straggler" in rep.summary()
    assert rep.max_abs_param_diff < 1e-5                     # slow, not wrong


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_compare_agrees_across_plans_and_catches_a_plan_dependent_normalisation():
    base = Plan(**{**RUN_DEFAULTS, "optimizer": "sgd-momentum"})
    a, b = base.with_(dp=2), base.with_(dp=1, grad_accum=2)
    good = compare(SPEC, a, b, steps=3, timeout_s=90)
    assert good.agree and max(good.rel_diffs) < 1e-6, good.summary()
    bad_b = run(SPEC, b, steps=3, faults=[Fault("unscaled-accum")], timeout_s=90)
    bad = Comparison(a, b, good.a, bad_b, good.tolerance, (Fault("unscaled-accum"),))
    assert bad.rel_diffs[0] < 1e-6                           # the logged loss of step 0 is still right
    assert not bad.agree and bad.first_disagreement == 1 and "fifth failure mode" in bad.verdict()
    assert bad_b.max_abs_param_diff > 1e-4                   # and B no longer equals its own reference


# ---- the command line ----------------------------------------------------------------------------

def _cli(*args: str, timeout: float = 200):
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": repo}
    return subprocess.run([sys.executable, "-m", "parallel_lab", *args], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_cli_refuses_bad_faults_and_plans_in_one_line_with_exit_2(capsys):
    from parallel_lab.cli import main  # in this process: each is refused before any rank starts

    for args, words in ((("run", "--inject-fault", "boom:1"), "fault kind 'boom' is unknown"),
                        (("run", "--dp", "2", "--inject-fault", "die:2"), "rank 2 is not in a run of 2 ranks"),
                        (("compare", "dp=2", "dp=2,grad_accum=2"), "compare needs the same data"),
                        (("compare", "dp=2", "speed=1"), "'speed' is not a Plan field")):
        try:
            code = main(list(args))
        except SystemExit as e:                  # argparse's own refusals exit
            code = e.code
        err = capsys.readouterr().err
        assert code == 2, (args, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and words in lines[0] and "Traceback" not in err, err


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_cli_run_names_a_nan_with_exit_3():
    p = _cli("run", "--dp", "2", "--steps", "2", "--inject-fault", "nan:1:2")
    assert p.returncode == 3, p.stderr[-800:]
    assert "failed: rank 1 raised NonFiniteError" in p.stderr and "at step 2 in the forward output of blocks.0.mlp" \
        in p.stderr, p.stderr[-800:]
    assert "its last action: step 2:" in p.stderr and "Traceback" not in p.stderr


def test_on_an_accelerator_the_finite_flags_are_read_once_per_step():
    # off the CPU each module's flag stays on the device (no synchronisation per module); check_loss reads
    # them at once and names the first module whose output was not finite
    import torch

    from parallel_lab.distributed.runtime.diagnosis import FiniteWatch, NonFiniteError
    w = FiniteWatch(torch.nn.Linear(2, 2), rank=1)
    w.step = 4
    w._pending = [("blocks.0.attn", torch.tensor(True)), ("blocks.0.mlp", torch.tensor(False)),
                  ("blocks.1.attn", torch.tensor(False))]
    with pytest.raises(NonFiniteError, match="rank 1 at step 4 in the forward output of blocks.0.mlp"):
        w.check_loss(2.5)
    assert w._pending == []
    w.check_loss(2.5)                      # nothing pending, finite loss: no error
