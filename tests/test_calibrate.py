"""The roofline step-time model calibrated on one published run, against the other published runs.

Calibration run: Llama 3 405B, 8K sequence, 16,384 H100s (TP 8, PP 16, DP 128), 400 TFLOP/s per GPU
(Dubey et al. 2024, Table 4, second row; shared/reference/published_runs.md), with Meta's settings as in
tests/test_llama3_published.py (examples/calibration/llama3_405b.csv holds all three rows). Only the
matmul efficiency is fitted; the attention efficiency keeps its prior (StepProfile's docstring).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from conftest import REPO, run_cli

from parallel_lab.calibrate import fit_profile, load_profile, load_runs, predicted_tflops
from parallel_lab.planner import Constraints, evaluate, plan_search
from parallel_lab.specs import ClusterSpec, ModelSpec, StepProfile

RUNS = REPO / "examples" / "calibration" / "llama3_405b.csv"
H100 = ClusterSpec.preset("h100-sxm")


@pytest.fixture(scope="module")
def calibrated():
    runs = load_runs(RUNS)
    cluster, fitted = fit_profile([runs[1]], H100)
    return runs, cluster, fitted


def test_the_calibration_row_is_matched(calibrated):
    runs, cluster, fitted = calibrated
    assert fitted == ["matmul_efficiency"]
    assert predicted_tflops(runs[1], cluster) == pytest.approx(400.0, rel=1e-3)
    assert 0.3 < cluster.profile.matmul_efficiency < 0.9


def test_the_other_8k_row_is_predicted_within_10_percent(calibrated):
    """8,192 GPUs, DP 64, 32 micro-batches per step: published 430 TFLOP/s (the bubble (p-1)/(v m) halves)."""
    runs, cluster, _ = calibrated
    assert predicted_tflops(runs[0], cluster) == pytest.approx(430.0, rel=0.10)


@pytest.mark.xfail(strict=True, reason="known gap: the 128K row (CP 16) is predicted about 25% fast; the "
                   "attention prior (FlashAttention-2 speed, causal FLOPs) or the all-gather CP overlap rule "
                   "does not describe Meta's long-context kernels")
def test_the_128k_row_is_predicted_within_10_percent(calibrated):
    runs, cluster, _ = calibrated
    assert predicted_tflops(runs[2], cluster) == pytest.approx(380.0, rel=0.10)


def test_without_a_profile_the_step_time_model_is_unchanged():
    runs = load_runs(RUNS)
    default = evaluate(runs[1].model, H100, runs[1].plan)
    with_profile = evaluate(runs[1].model, replace(H100, profile=StepProfile()), runs[1].plan)
    assert default.step_time_s != with_profile.step_time_s
    assert H100.profile is None


def test_search_with_a_profile_equals_evaluate():
    model = ModelSpec.preset("llama2-7b")
    cluster = replace(H100, profile=StepProfile(matmul_efficiency=0.6, overhead_s=1e-3, tp_overlap=0.5))
    res = plan_search(model, cluster, 16, 4096, global_batch=32,
                      constraints=Constraints(zero_stages=(0, 1), recompute=("none", "full")))
    assert res.estimates
    for e in res.estimates[:20]:
        ref = evaluate(model, cluster, e.plan)
        assert e.step_time_s == pytest.approx(ref.step_time_s, rel=1e-9)


def test_cli_calibrate_writes_a_profile_the_planner_reads(tmp_path):
    runs = tmp_path / "one.yaml"
    runs.write_text("runs:\n  - {name: row2, model: llama3-405b, gpus: 16384, dp: 128, tp: 8, pp: 16, seq: 8192,\n"
                    "     grad_accum: 16, sp: true, zero: 2, optimizer: adam-mixed-fp32-grad, schedule: interleaved,\n"
                    "     interleave: 8, pp_split: embed-head, attention: flash, mlp: fused, tflops_per_gpu: 400}\n")
    out = tmp_path / "h100.json"
    p = run_cli("calibrate", "--runs", str(runs), "--out", str(out), "--json")
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert data["runs"][0]["predicted_tflops_per_gpu"] == pytest.approx(400.0, rel=1e-3)
    assert load_profile(out).profile.matmul_efficiency == pytest.approx(data["profile"]["matmul_efficiency"])
    p = run_cli("calibrate", "--runs", str(RUNS), "--cluster", str(out), "--no-fit")
    assert p.returncode == 0 and "measured 430.0" in p.stdout, p.stderr
    p = run_cli("plan", "--model", "llama2-7b", "--gpus", "16", "--seq", "4096", "--global-batch", "32",
                "--cluster", str(out), "--top", "3")
    assert p.returncode == 0, p.stderr
