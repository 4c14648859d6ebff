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


@pytest.mark.xfail(strict=True, reason="known gap, counted as the full square (PaLM): the 128K row (CP 16) is "
                   "predicted about 15% fast with FlashAttention-2's published rate as the attention prior; it "
                   "would hold if the attention kernel ran at about 0.25 of peak (the test below)")
def test_the_128k_row_is_predicted_within_10_percent(calibrated):
    runs, cluster, _ = calibrated
    assert predicted_tflops(runs[2], cluster) == pytest.approx(380.0, rel=0.10)


@pytest.fixture(scope="module")
def calibrated_causal():
    runs = load_runs(RUNS, "causal")
    cluster, _ = fit_profile([runs[1]], H100)
    return runs, cluster


def test_counted_causally_the_8k_rows_hold_and_the_convention_changes_only_the_count(calibrated_causal):
    """The paper does not say how its TFLOP/s count attention. Counted causally (the visible half, as the
    kernels compute it) and calibrated on the same one row, the other 8K row holds: 430 -> 425.0. The two
    conventions differ by 4% at 8K and by 29% at 128K, where attention is most of the FLOPs."""
    runs, cluster = calibrated_causal
    assert [r.convention for r in runs] == ["causal"] * 3
    assert predicted_tflops(runs[1], cluster) == pytest.approx(400.0, rel=1e-3)
    assert predicted_tflops(runs[0], cluster) == pytest.approx(430.0, rel=0.10)
    # the convention changes only how throughput is counted, not the step time of a given profile
    palm = load_runs(RUNS)
    assert evaluate(palm[2].model, cluster, palm[2].plan).step_time_s == \
        evaluate(runs[2].model, cluster, runs[2].plan).step_time_s
    assert runs[2].model_flops() / palm[2].model_flops() == pytest.approx(0.714, abs=0.01)


@pytest.mark.xfail(strict=True, reason="known gap, counted causally: the 128K row is predicted about 16% slow "
                   "with FlashAttention-2's rate as the prior; it would hold at about 0.51 of peak (below)")
def test_counted_causally_the_128k_row_is_within_10_percent(calibrated_causal):
    runs, cluster = calibrated_causal
    assert predicted_tflops(runs[2], cluster) == pytest.approx(380.0, rel=0.10)


def test_the_attention_speed_each_count_needs_brackets_the_prior():
    """What decides the 128K row is how fast the attention kernel ran, which the paper does not report. The
    prior is FlashAttention-2's published H100 rate (0.34 of peak). For the row to be predicted exactly, the
    kernel must have run at about 0.25 of peak if Meta counted the full square, slower than FlashAttention-2,
    or at about 0.51 if it counted causally, faster (FlashAttention-3's class). The prior lies between them,
    which is why neither count holds within 10% with it."""
    from parallel_lab.calibrate import attention_efficiency_needed
    prior = StepProfile().attention_efficiency
    needed = {c: attention_efficiency_needed(load_runs(RUNS, c)[2], [load_runs(RUNS, c)[1]], H100)
              for c in ("palm", "causal")}
    assert needed["palm"] == pytest.approx(0.255, abs=0.01) and needed["causal"] == pytest.approx(0.51, abs=0.01)
    assert needed["palm"] < prior < needed["causal"]
    # at the needed speed the row is matched
    runs = load_runs(RUNS, "causal")
    at = replace(H100, profile=StepProfile(attention_efficiency=needed["causal"]))
    cluster, _ = fit_profile([runs[1]], at)
    assert predicted_tflops(runs[2], cluster) == pytest.approx(380.0, rel=2e-3)


def test_flash_attentions_backward_recomputes_the_scores_and_eager_computes_every_score():
    """The roofline charges FlashAttention forward + 2.5x backward (its backward computes the scores again) on
    the causal half; an eager core forward + 2x backward on every score, as GEMMs of inner width head_dim.
    So eager is the slower of the two under any profile, and flash's time follows its efficiency alone."""
    from parallel_lab.steptime import roofline_layer
    model = ModelSpec.preset("llama3-8b")
    for prof in (StepProfile(), StepProfile(matmul_efficiency=0.55)):
        _, eager, _ = roofline_layer(model, prof, H100.peak_flops, 8192, 1, 1, 1, "none", "eager")
        _, flash, _ = roofline_layer(model, prof, H100.peak_flops, 8192, 1, 1, 1, "none", "flash")
        assert eager > flash
        tokens, q = 8192, model.heads * model.head_dim
        assert flash == pytest.approx(3.5 * 4 * tokens * (8192 + 1) / 2 * q / (H100.peak_flops * 0.34))
        d = model.head_dim
        assert eager == pytest.approx(3 * 4 * tokens * 8192 * q / (H100.peak_flops * prof.matmul_efficiency
                                                                    * d / (d + prof.half_width)))


def test_flops_convention_column_and_flag(tmp_path):
    runs = tmp_path / "runs.csv"
    runs.write_text(RUNS.read_text().splitlines()[0] + ",flops_convention\n"
                    + RUNS.read_text().splitlines()[2] + ",causal\n")
    assert load_runs(runs)[0].convention == "causal"
    assert load_runs(runs, "palm")[0].convention == "palm"
    bad = tmp_path / "bad.csv"
    bad.write_text(RUNS.read_text().splitlines()[0] + ",flops_convention\n" + RUNS.read_text().splitlines()[2]
                   + ",square\n")
    p = run_cli("calibrate", "--runs", str(bad))
    assert p.returncode == 2 and "flops_convention='square' is not known" in p.stderr
    p = run_cli("calibrate", "--runs", str(RUNS), "--flops-convention", "causal", "--json")
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert {r["flops_convention"] for r in data["runs"]} == {"causal"}


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


def test_every_calibration_row_is_a_plan_that_fits():
    # the rows carry Meta's settings (tests/test_llama3_published.py), including FSDP's per-micro-batch
    # reduce-scatter: a fit against a plan the ledger says cannot run would calibrate on nothing real
    from parallel_lab import ledger
    for run in load_runs(RUNS):
        assert run.plan.zero2_accumulate == "sharded"
        assert ledger.memory(run.model, run.plan, H100).fits, run.name
