"""The roofline step-time model calibrated on one published run, against the other published runs.

Calibration run: Llama 3 405B, 8K sequence, 16,384 H100s (TP 8, PP 16, DP 128), 400 TFLOP/s per GPU
(Dubey et al. 2024, Table 4, second row; shared/reference/published_runs.md), with Meta's settings as in
tests/test_llama3_published.py (examples/calibration/llama3_405b.csv holds all three rows). Only the
matmul efficiency is fitted; the attention efficiency is a prior, a published kernel's speed
(hardware.ATTENTION_KERNELS_H100; default FlashAttention-2's). The paper says neither which kernel it ran nor
how it counted attention FLOPs, so each (count, kernel) pair is a hypothesis tested against the rows.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from conftest import REPO, run_cli

from parallel_lab import ledger
from parallel_lab.calibrate import (
    attention_efficiency_needed,
    fit_profile,
    load_profile,
    load_runs,
    predicted_tflops,
    with_attention_kernel,
)
from parallel_lab.errors import ParallelLabError
from parallel_lab.flops import step_flops
from parallel_lab.hardware import ClusterSpec, StepProfile
from parallel_lab.planner import evaluate, plan_search
from parallel_lab.planner_constraints import Constraints
from parallel_lab.specs import ModelSpec

RUNS = REPO / "examples" / "calibration" / "llama3_405b.csv"
#: calibrated from the prior presets, no fitted constant: FlashAttention-2's attention speed on H100 (the default
#: presets carry the fits these tests make: tests/test_steptime_heldout.py)
H100 = ClusterSpec.preset("h100-sxm-prior")


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


def test_the_published_kernel_rates_and_flashattention_2s_own_figure():
    """The attention priors come from the FlashAttention-3 paper's H100 benchmark figures: the causal forward
    panel and the backward figure (hardware.ATTENTION_KERNELS_H100). A check on the transcription: the paper's
    non-causal forward panel (FlashAttention-2 370 TFLOP/s at 16K) with the same backward combines to the 335
    TFLOP/s forward + backward that the FlashAttention-2 paper itself reports on H100."""
    from parallel_lab.hardware import ATTENTION_KERNELS_H100, H100_PEAK_FLOPS, attention_kernel_efficiency
    non_causal_fwd, bwd = 370.0, ATTENTION_KERNELS_H100["fa2"][1]
    assert 3.5 / (1 / non_causal_fwd + 2.5 / bwd) == pytest.approx(335, rel=0.01)
    got = {k: round(attention_kernel_efficiency(k), 3) for k in ("fa2", "cudnn", "fa3")}
    assert got == {"fa2": 0.329, "cudnn": 0.528, "fa3": 0.582}
    # the default prior is FlashAttention-2's, the kernel torch's SDPA flash backend runs
    assert StepProfile().attention_efficiency * H100_PEAK_FLOPS / 1e12 == pytest.approx(325.6, abs=0.1)
    with pytest.raises(ParallelLabError, match="'fa4' has no published H100 SXM5 rate"):
        attention_kernel_efficiency("fa4")
    with pytest.raises(ParallelLabError, match="'cudnn' has no published A100 SXM4 rate"):
        attention_kernel_efficiency("cudnn", 312e12)
    with pytest.raises(ParallelLabError, match="no published attention-kernel speeds for a GPU of 125 TFLOP/s"):
        attention_kernel_efficiency("fa2", 125e12)
    # the prior of a GPU with no profile: FlashAttention-2's rate on it, else H100's fraction
    from parallel_lab.hardware import A100_PEAK_FLOPS, default_attention_efficiency, flash_efficiency
    assert default_attention_efficiency(A100_PEAK_FLOPS) == pytest.approx(3.5 / (1 / 0.73 + 2.5 / 0.63))
    assert default_attention_efficiency(H100_PEAK_FLOPS) == default_attention_efficiency(125e12) == \
        StepProfile().attention_efficiency
    # a forward and its 2.5x backward at one speed run at that speed; at two, the slower weighs 2.5x
    assert flash_efficiency(500e12, 500e12, 1e15) == pytest.approx(0.5)
    assert flash_efficiency(600e12, 300e12, 1e15) == pytest.approx(3.5 / (1 / 0.6 + 2.5 / 0.3))


def _hypothesis(convention: str, kernel: str) -> list[float]:
    """Each row's predicted TFLOP/s under one FLOP count and one published kernel speed, calibrated on row 2."""
    runs = load_runs(RUNS, convention)
    cluster, _ = fit_profile([runs[1]], with_attention_kernel(H100, kernel))
    return [predicted_tflops(r, cluster) for r in runs]


@pytest.fixture(scope="module")
def hypotheses():
    return {(c, k): _hypothesis(c, k) for c in ("palm", "causal") for k in ("fa2", "cudnn", "fa3")}


def test_counted_causally_with_a_hopper_kernel_every_row_is_within_10_percent(hypotheses):
    """Issue 12's criterion, with its caveat. The paper says neither how it counted attention FLOPs nor which
    kernel it ran. Counted causally (what the kernels compute) with either Hopper kernel's published speed,
    the model calibrated on row 2 predicts the other two rows within 10%: cuDNN 425.0 and 384.8 (-1.2%,
    +1.3%), FlashAttention-3 425.0 and 398.3 (-1.2%, +4.8%). The kernel speeds are the paper's, not fitted;
    but the choice among the six (count, kernel) pairs is made by the 128K row itself (row 1 holds under
    every pair), so this is a consistency check, not an out-of-sample prediction."""
    for kernel, (row1, row3) in {"cudnn": (425.0, 384.8), "fa3": (425.0, 398.3)}.items():
        p = hypotheses["causal", kernel]
        assert p[1] == pytest.approx(400.0, rel=1e-3)
        assert p[0] == pytest.approx(430.0, rel=0.10) and p[2] == pytest.approx(380.0, rel=0.10)
        assert (round(p[0], 1), round(p[2], 1)) == (row1, row3), kernel


def test_the_convention_changes_only_the_count():
    """A given profile predicts the same step time under either count; the causal count of the 128K row is
    29% smaller (4% at 8K), since attention is most of its FLOPs."""
    causal, palm = load_runs(RUNS, "causal"), load_runs(RUNS)
    assert [r.convention for r in causal] == ["causal"] * 3
    cluster, _ = fit_profile([causal[1]], H100)
    assert evaluate(palm[2].model, cluster, palm[2].plan).step_time_s == \
        evaluate(causal[2].model, cluster, causal[2].plan).step_time_s
    assert causal[2].model_flops() / palm[2].model_flops() == pytest.approx(0.714, abs=0.01)
    assert causal[1].model_flops() / palm[1].model_flops() == pytest.approx(0.96, abs=0.01)


def test_the_calibrated_planner_ranks_metas_configurations():
    """With the profile that holds on every row (causal count, cuDNN's speed, fitted on row 2), the planner
    given Meta's settings puts Meta's 131K degrees 2nd, 0.07% behind the first; at 8K Meta's degrees are 7th
    and 6.8% behind the best plan (dp 32 tp 4 pp 16 cp 8, ZeRO-3): a bubble of 0.029
    against 0.117 (64 micro-batches instead of 16) and half the exposed TP time (tp 4)."""
    cluster, _ = fit_profile([load_runs(RUNS, "causal")[1]], with_attention_kernel(H100, "cudnn"))
    model = ModelSpec.preset("llama3-405b")
    cons = Constraints(optimizer="adam-mixed-fp32-grad", attention="flash", mlp="fused", pp_split="embed-head",
                       cp_kind="allgather", zero2_accumulate=("unsharded", "sharded"),
                       fixed={"interleave": 8, "recompute": "none", "micro_batch": 1})
    for seq, cp, dp, rank, behind in ((131072, 16, 8, 2, 0.002), (8192, 1, 128, 7, 0.08)):
        res = plan_search(model, cluster, 16384, seq, global_batch_tokens="16M", constraints=cons)
        got = res.rank_of(tp=8, pp=16, cp=cp, dp=dp, zero=2, zero2_accumulate="sharded")
        assert got is not None and got <= rank, (seq, got)
        best, meta = res.top(got)[0], res.top(got)[-1]
        assert meta.fields["cp"] == cp and meta.fields["dp"] == dp
        assert 0 <= meta.step_time_s / best.step_time_s - 1 < behind, seq
        if seq == 8192:
            assert (best.fields["tp"], best.fields["cp"], best.fields["zero"]) == (4, 8, 3)
            assert best.bubble_ratio == pytest.approx(0.029, abs=1e-3) and meta.bubble_ratio == \
                pytest.approx(0.117, abs=1e-3)


def test_the_other_hypotheses_miss_the_128k_row_and_keep_the_8k_rows(hypotheses):
    """At 8K attention is a small part of the step and every hypothesis predicts row 1 within 2%. At 128K it
    is most of the step: counted as the full square (PaLM) every published kernel predicts the row more than
    10% fast (fa2 +13.8%, cudnn +38%, fa3 +43%), and counted causally FlashAttention-2 predicts it 17% slow.
    So of these pairs only the causal count with a Hopper-class kernel agrees with the published rows."""
    for (convention, kernel), p in hypotheses.items():
        assert p[0] == pytest.approx(430.0, rel=0.02), (convention, kernel)
        miss = p[2] / 380.0 - 1
        if convention == "palm":
            assert miss > 0.10, (kernel, miss)
        elif kernel == "fa2":
            assert miss < -0.10, miss
        else:
            assert abs(miss) < 0.10, (kernel, miss)


def test_the_attention_speed_each_count_needs_against_the_published_kernels():
    """What decides the 128K row is how fast the attention kernel ran. For the row to be predicted exactly
    the kernel must have run at about 0.255 of peak if Meta counted the full square, slower than every
    published fused kernel (FlashAttention-2 is 0.329), or at about 0.51 if it counted causally, just below
    cuDNN's 0.528 and FlashAttention-3's 0.582."""
    from parallel_lab.calibrate import attention_efficiency_needed
    from parallel_lab.hardware import attention_kernel_efficiency
    needed = {c: attention_efficiency_needed(load_runs(RUNS, c)[2], [load_runs(RUNS, c)[1]], H100)
              for c in ("palm", "causal")}
    assert needed["palm"] == pytest.approx(0.255, abs=0.01) and needed["causal"] == pytest.approx(0.51, abs=0.01)
    published = sorted(attention_kernel_efficiency(k) for k in ("fa2", "cudnn", "fa3"))
    assert needed["palm"] < published[0] < needed["causal"] < published[1]
    # at the needed speed the row is matched
    runs = load_runs(RUNS, "causal")
    at = replace(H100, profile=StepProfile(attention_efficiency=needed["causal"]))
    cluster, _ = fit_profile([runs[1]], at)
    assert predicted_tflops(runs[2], cluster) == pytest.approx(380.0, rel=2e-3)


def test_cli_attention_kernel(tmp_path):
    """``calibrate --attention-kernel`` sets the prior, keeps it through the fit and says so in the source;
    it is refused for a kernel with no published figure on the cluster's GPU, and with --microbench."""
    out = tmp_path / "h100c.json"
    p = run_cli("calibrate", "--runs", str(RUNS), "--flops-convention", "causal", "--attention-kernel", "cudnn",
                "--out", str(out), "--json")
    assert p.returncode == 0, p.stderr
    prof = load_profile(out).profile
    assert prof.attention_efficiency == pytest.approx(0.5282, abs=1e-4)
    assert prof.source.endswith("; attention prior: cudnn")
    # a profile file given back with another kernel names that kernel only
    p = run_cli("calibrate", "--runs", str(RUNS), "--cluster", str(out), "--attention-kernel", "fa3", "--json")
    assert p.returncode == 0, p.stderr
    source = json.loads(p.stdout)["profile"]["source"]
    assert source.endswith("; attention prior: fa3") and "cudnn" not in source
    # a profile whose attention speed was changed by hand no longer names the kernel
    edited = replace(H100, profile=replace(prof, attention_efficiency=0.4))
    assert "attention prior" not in fit_profile([load_runs(RUNS)[1]], edited)[0].profile.source
    p = run_cli("calibrate", "--runs", str(RUNS), "--cluster", "a100-80gb", "--attention-kernel", "fa3")
    assert p.returncode == 2 and "'fa3' has no published A100 SXM4 rate here; pick one of fa2, fa1" in p.stderr
    p = run_cli("calibrate", "--runs", str(FA2_RUNS), "--cluster", "a100-80gb", "--attention-kernel", "fa1", "--json")
    assert p.returncode == 0, p.stderr
    prof = json.loads(p.stdout)["profile"]
    assert prof["attention_efficiency"] == pytest.approx(0.3828, abs=1e-4) and prof["source"].endswith("prior: fa1")
    p = run_cli("calibrate", "--microbench", "--attention-kernel", "fa3")
    assert p.returncode == 2 and "--attention-kernel" in p.stderr


MEGATRON = REPO / "examples" / "calibration" / "megatron_2021.csv"
FA2_RUNS = REPO / "examples" / "calibration" / "flashattention2_2023.csv"


def test_flashattention_2_papers_runs_where_count_and_kernel_are_known():
    """A third set of published runs: Dao 2023 (FlashAttention-2), Table 1: GPT-3 1.3B on 8 A100s, counted
    with the full square (the paper states its formula), kernel known. Calibrated on the 2K FlashAttention-2
    row with that kernel's own published A100 best (fwd 73%, bwd 63%: 0.656, an upper bound), the 8K row,
    four times the attention work per token, is predicted within 3% (+1.9% in the lab's count, +2.5% in
    the paper's); the speed it needs, 0.593, lies below that bound. The paper's FlashAttention(-1) rows (189,
    170 TFLOP/s) against the band FlashAttention's published range (fwd 30-50%, bwd 25-35%) predicts with the
    same matmul efficiency: 8K inside, 2K 1.6% above the top (the test allows 2%). H100's fraction (0.329)
    taken on an A100 would be 18% slow."""
    from parallel_lab.hardware import A100_PEAK_FLOPS, flash_efficiency
    a100 = ClusterSpec.preset("a100-80gb-prior")
    runs = load_runs(FA2_RUNS)
    assert [(r.plan.seq, r.plan.micro_batch * r.plan.grad_accum * r.plan.dp * r.plan.seq) for r in runs] == \
        [(2048, 2**20), (8192, 2**20)]
    assert ledger.memory(runs[0].model, runs[0].plan, a100).fits
    # 8K: the lab's GPT block and whole-logit loss peak at 78.9 GB, inside the 80 GB but not the lab's 10% margin;
    # the run's in-place cross-entropy backward (not modelled) holds no separate logit gradient, and its
    # dropout masks and fp32 residuals (the preset drops them) are not counted either: not the run's peak. The
    # lab's nearest to the in-place loss, a chunked loss, fits; none of these changes the predicted time.
    assert 78e9 < ledger.memory(runs[1].model, runs[1].plan, a100).peak.peak_bytes < 80e9
    assert ledger.memory(runs[1].model, replace(runs[1].plan, loss_chunk=4096), a100).fits
    cluster, fitted = fit_profile([runs[0]], a100)
    assert fitted == ["matmul_efficiency"]
    assert cluster.profile.attention_efficiency == pytest.approx(0.6557, abs=1e-4)     # the A100 default prior
    miss = predicted_tflops(runs[1], cluster) / 220.0 - 1
    assert 0 < miss < 0.03, miss
    # in the paper's own count (6 s N with the position table, 0.3% and 0.8% above the lab's palm): +2.5%
    paper = [6 * r.model.n_params + 12 * r.model.layers * r.model.hidden * r.plan.seq for r in runs]
    lab = [step_flops(r.model, r.plan).model_flops_per_step / r.plan.global_batch_tokens for r in runs]
    as_lab = [replace(r, tflops_per_gpu=r.tflops_per_gpu * lab[i] / paper[i]) for i, r in enumerate(runs)]
    refit, _ = fit_profile([as_lab[0]], a100)
    assert 0 < predicted_tflops(as_lab[1], refit) * paper[1] / lab[1] / 220.0 - 1 < 0.03
    needed = attention_efficiency_needed(runs[1], [runs[0]], a100)
    # below the combined upper bound; 0.50, the bottom of the forward range, is a sanity floor, not a bound
    assert 0.50 < needed < cluster.profile.attention_efficiency, needed
    fa1 = {end: flash_efficiency(f * A100_PEAK_FLOPS, b * A100_PEAK_FLOPS, A100_PEAK_FLOPS)
           for end, (f, b) in {"low": (0.30, 0.25), "high": (0.50, 0.35)}.items()}
    for run, measured in zip(runs, (189.0, 170.0), strict=True):
        band = [predicted_tflops(run, replace(cluster, profile=replace(cluster.profile, attention_efficiency=e)))
                for e in (fa1["low"], fa1["high"])]
        assert 0.98 * band[0] <= measured <= 1.02 * band[1], (run.name, band, measured)
    h100_fraction = replace(cluster, profile=replace(cluster.profile,
                                                     attention_efficiency=StepProfile().attention_efficiency))
    assert predicted_tflops(runs[1], h100_fraction) < 0.85 * 220.0


def test_megatron_2021_runs_calibrated_on_one_row():
    """A second set of published runs: Narayanan et al. 2021, Table 2, PTD-P rows (A100 80 GB, GPT 174.6B
    and 529.6B, micro-batch 1, full recomputation, the paper's eq. 3 count: ``hardware``). Calibrated on one
    row, the runs of the same model on 2x and 4x the GPUs follow within 1.5% (only the bubble (p - 1)/m
    changes). Across the two models the roofline alone (no HBM bandwidth) is 9-10% off: fitted on 174.6B, the
    529.6B runs are predicted 8.9-10.1% slow; fitted on 529.6B, the 174.6B runs 8.7-9.4% fast. With the
    memory-bound term (``membound``) the gap is 3-5.5%: 4.2-5.5% slow and 3.3-4.0% fast (docs/validation.md)."""
    from parallel_lab import ledger
    a100 = ClusterSpec.preset("a100-80gb-prior")
    runs = load_runs(MEGATRON)
    assert {r.convention for r in runs} == {"hardware"} and len(runs) == 6
    assert all(ledger.memory(r.model, r.plan, a100).fits for r in runs)
    for cluster_used, band in ((replace(a100, hbm_bandwidth=0.0), (0.08, 0.11)), (a100, (0.03, 0.06))):
        for fit, sign in ((0, -1), (3, +1)):
            cluster, _ = fit_profile([runs[fit]], cluster_used)
            for r in runs:
                miss = predicted_tflops(r, cluster) / r.tflops_per_gpu - 1
                if r.model == runs[fit].model:
                    assert abs(miss) < 0.015, (r.name, miss)
                else:
                    assert band[0] < sign * miss < band[1], (runs[fit].name, r.name, miss)


def test_cli_fit_on(tmp_path):
    p = run_cli("calibrate", "--runs", str(MEGATRON), "--cluster", "a100-80gb", "--fit-on", "1", "--json")
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert data["profile"]["source"] == "fitted to 1 run(s): megatron 174.6B 384 GPUs"
    assert [round(r["predicted_tflops_per_gpu"], 1) for r in data["runs"]][:3] == [153.0, 148.5, 140.1]
    for bad in ("7", "0", "x", ""):
        p = run_cli("calibrate", "--runs", str(MEGATRON), "--cluster", "a100-80gb", "--fit-on", bad)
        assert p.returncode == 2 and "give run numbers from 1 to 6" in p.stderr, (bad, p.stderr)
    p = run_cli("calibrate", "--runs", str(MEGATRON), "--cluster", "a100-80gb", "--fit-on", "1", "--no-fit")
    assert p.returncode == 2 and "--fit-on" in p.stderr


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
        assert flash == pytest.approx(3.5 * 4 * tokens * (8192 + 1) / 2 * q / (H100.peak_flops * 0.3292), rel=1e-3)
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
