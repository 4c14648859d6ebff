"""``parallel-lab run``: the report compares measured with predicted; refusals come before any process."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from parallel_lab.distributed.runtime import train
from parallel_lab.distributed.runtime.run import predicted_activations, run
from parallel_lab.errors import ParallelLabError
from parallel_lab.specs import RUN_DEFAULTS, ModelSpec, Plan

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def test_run_report_for_dp2():
    spec = ModelSpec.preset("tiny-gpt").with_(layers=2)
    plan = Plan(dp=2, **{**RUN_DEFAULTS, "seq": 64, "micro_batch": 2})
    rep = run(spec, plan, steps=2)
    j = rep.to_json()
    assert list(j) == ["losses", "reference_losses", "max_abs_param_diff", "comm", "memory", "wall_s", "step_times",
                       "comm_buffers"]
    assert j["comm_buffers"] == {"measured_bytes": 0, "predicted_bytes": 0}     # DDP's gradients are bucket views
    assert len(j["losses"]) == 2 and j["max_abs_param_diff"] <= 2e-5
    dp = j["comm"]["dp"]
    assert dp["measured_bytes"] == dp["predicted_bytes"] == 2 * 2 * 4 * spec.n_params   # 2 ranks, 2 steps
    for cat in ("parameters", "gradients", "optimizer_states", "activations"):
        assert j["memory"][cat]["measured_bytes"] == j["memory"][cat]["predicted_bytes"], cat
    assert j["memory"]["activations"]["predicted_bytes"] == predicted_activations(spec, plan)
    assert "loss (parallel)" in rep.summary() and json.dumps(j)


def test_cli_run_json():
    p = run_cli("run", "--model", "tiny-llama", "--dp", "2", "--steps", "2", "--seq", "64", "--json")
    assert p.returncode == 0, p.stderr
    j = json.loads(p.stdout)
    assert all(isinstance(j["comm"]["dp"][k], int) for k in ("measured_bytes", "predicted_bytes"))
    assert j["comm"]["dp"]["measured_bytes"] == j["comm"]["dp"]["predicted_bytes"]
    assert j["losses"][-1] < j["losses"][0]
    assert "2/2 steps" in p.stderr                       # the progress bar


def test_plans_a_parallelism_cannot_run_are_refused_before_any_process_starts():
    tied = ModelSpec(layers=4, hidden=128, heads=4, vocab=512, flavour="llama", tied_embeddings=True)
    with pytest.raises(ParallelLabError, match="tied embeddings"):             # check_pp
        train.check_runnable(tied, Plan(pp=2, grad_accum=2, **RUN_DEFAULTS))
    with pytest.raises(ParallelLabError, match="dropout"):                     # check_cp
        train.check_runnable(ModelSpec.preset("tiny-gpt").with_(dropout=0.1), Plan(cp=2, **RUN_DEFAULTS))
    p = run_cli("run", "--layers", "4", "--hidden", "128", "--heads", "4", "--vocab", "512", "--flavour", "llama",
                "--tied-embeddings", "--pp", "2", "--grad-accum", "2", "--steps", "1")
    assert p.returncode == 2 and "tied embeddings" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_bf16_is_refused_clearly():
    with pytest.raises(ParallelLabError, match="fp32"):
        train.check_runnable(ModelSpec.preset("tiny-llama"), Plan(dp=2, dtype="bf16", optimizer="adam-fp32"))


def test_plan_files_give_model_and_plan():
    from conftest import REPO

    from parallel_lab.cli.run import _plan_from_file

    model, p = _plan_from_file(str(REPO / "examples" / "plans" / "tiny-dp2-zero3.yaml"))
    assert model == ModelSpec.preset("tiny-llama")
    assert (p.dp, p.zero, p.dtype, p.optimizer) == (2, 3, "fp32", "adam-fp32")
