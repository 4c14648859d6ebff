"""GEMM and all-reduce micro-benchmarks (parallel_lab/distributed/instruments/microbench.py) and their fits
(parallel_lab/microfit.py), ending in ``parallel-lab calibrate --microbench``'s profile file.

The fits are checked on samples made by the planner's own cost functions (``steptime.gemm_time``,
``comm.collective_time``) from known parameters: exact samples give the parameters back to 1e-6, samples
with 5% log-normal noise within the tolerances stated below, and input the fits cannot use is refused with a
message naming the fix. The timing code runs on this CPU (GEMMs in-process, all-reduce on 2 gloo ranks); on
a machine with a GPU the cuda path is checked too.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import replace

import pytest
import torch
from conftest import REPO, run_cli

from parallel_lab.calibrate import (
    fit_microbench,
    fit_profile,
    load_profile,
    load_runs,
    microbench_to_json,
    profile_to_json,
)
from parallel_lab.comm import collective_time
from parallel_lab.errors import ParallelLabError
from parallel_lab.hardware import ClusterSpec, LinkTier, StepProfile
from parallel_lab.microfit import AttentionSample, CommSample, GemmSample, fit_attention, fit_gemm, fit_link
from parallel_lab.planner import evaluate
from parallel_lab.specs import ModelSpec, Plan
from parallel_lab.steptime import gemm_time

H100 = ClusterSpec.preset("h100-sxm")
SHAPES = [(t, w, w) for t in (16, 64, 256, 1024, 4096) for w in (1024, 8192)] + [(8192, 8192, n) for n in (128, 512)]
SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20]


def gemm_samples(e_max: float, d_half: float, peak: float, noise: float = 0.0, seed: int = 0) -> list[GemmSample]:
    prof, rng = StepProfile(matmul_efficiency=e_max, half_width=d_half), random.Random(seed)
    return [GemmSample(t, k, n, gemm_time(t, n, k, peak, prof) * (rng.lognormvariate(0, noise) if noise else 1))
            for t, k, n in SHAPES]


def link_samples(tier: LinkTier, groups: tuple[int, ...] = (2,), noise: float = 0.0, seed: int = 0,
                 kind: str = "all_reduce") -> list[CommSample]:
    rng = random.Random(seed)
    return [CommSample(m, g, collective_time(kind, m, g, tier) * (rng.lognormvariate(0, noise) if noise else 1), kind)
            for g in groups for m in SIZES]


# --------------------------------------------------------------------------------------------------
# The fits (layer 1)
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("e_max,d_half,peak", [(0.8, 64.0, 989e12), (0.55, 300.0, 312e12), (0.3, 5.0, 1.8e11),
                                               (1.0, 0.0, 989e12)])
def test_gemm_fit_recovers_known_parameters(e_max, d_half, peak):
    fit = fit_gemm(gemm_samples(e_max, d_half, peak), peak)
    assert fit.matmul_efficiency == pytest.approx(e_max, rel=1e-6)
    assert fit.half_width == pytest.approx(d_half, rel=1e-6, abs=1e-6 * d_half + 1e-9)
    assert fit.rms < 1e-9 and len(fit.residuals) == len(SHAPES)


@pytest.mark.parametrize("groups,kind", [((2,), "all_reduce"), ((2, 4, 8), "all_reduce"), ((4,), "all_gather"),
                                         ((8,), "reduce_scatter")])
def test_link_fit_recovers_known_latency_and_bandwidth(groups, kind):
    for tier in (LinkTier("nvlink4", 450e9, 3e-6), LinkTier("loopback", 1.4e9, 0.5e-3)):
        fit = fit_link(link_samples(tier, groups, kind=kind), "x")
        assert fit.tier.bandwidth == pytest.approx(tier.bandwidth, rel=1e-6)
        assert fit.tier.latency == pytest.approx(tier.latency, rel=1e-6)
        assert fit.rms < 1e-9


def test_the_ring_factor_is_comms():
    """The fitted bandwidth is the bus bandwidth of comm's ring: n = 8 moves 2 * 7/8 of the message per GPU."""
    tier = LinkTier("x", 100e9, 0.0)
    m = 1 << 30
    t = collective_time("all_reduce", m, 8, tier)
    assert t == pytest.approx(2 * 7 / 8 * m / 100e9)
    fit = fit_link([CommSample(m, 8, t), CommSample(m // 4, 8, t / 4)])
    assert fit.tier.bandwidth == pytest.approx(100e9, rel=1e-9) and fit.tier.latency == pytest.approx(0, abs=1e-15)


# Tolerances with 5% log-normal noise on every sample (12 GEMM shapes, 5 message sizes). Over these 200 seeds
# the worst relative errors were 6.2% (e_max), 13.7% (d_half), 9.6% (bandwidth), 9.7% (latency); over 1000
# seeds the 99th percentiles 6.9%, 13.3%, 10.0%, 8.3% and the medians 1.6%, 3.2%, 2.6%, 2.2%.
NOISY_TOL = {"e_max": 0.10, "d_half": 0.25, "bandwidth": 0.15, "latency": 0.15}


def test_noisy_samples_are_fitted_within_the_stated_tolerance():
    worst = dict.fromkeys(NOISY_TOL, 0.0)
    for seed in range(200):
        g = fit_gemm(gemm_samples(0.7, 128.0, 989e12, noise=0.05, seed=seed), 989e12)
        link = fit_link(link_samples(LinkTier("x", 200e9, 5e-6), noise=0.05, seed=seed))
        errs = {"e_max": g.matmul_efficiency / 0.7 - 1, "d_half": g.half_width / 128 - 1,
                "bandwidth": link.tier.bandwidth / 200e9 - 1, "latency": link.tier.latency / 5e-6 - 1}
        worst = {k: max(worst[k], abs(v)) for k, v in errs.items()}
        assert g.rms < 0.15 and link.rms < 0.15
    assert all(worst[k] <= NOISY_TOL[k] for k in NOISY_TOL), worst
    assert worst["e_max"] > 0.002                      # the noise did reach the fit


@pytest.mark.parametrize("samples,peak,words", [
    ([GemmSample(1024, 1024, 1024, 1e-3)], 1e12, "at least two different smallest dimensions"),
    ([GemmSample(1024, 1024, 1024, 1e-3), GemmSample(1024, 4096, 4096, 2e-3)], 1e12, "d = [1024]"),
    ([GemmSample(16, 64, 64, 0.0), GemmSample(64, 64, 64, 1e-3)], 1e12, "seconds=0.0 must be a finite time > 0"),
    ([GemmSample(16, 64, 64, -1e-3), GemmSample(64, 64, 64, 1e-3)], 1e12, "time more calls per repetition"),
    ([GemmSample(16, 64, 64, math.nan), GemmSample(64, 64, 64, 1e-3)], 1e12, "seconds=nan"),
    ([GemmSample(0, 64, 64, 1e-3), GemmSample(64, 64, 64, 1e-3)], 1e12, "needs every dimension >= 1"),
    ([GemmSample(16, 64, 64, 1e-3), GemmSample(64, 64, 64, 1e-3)], 0.0, "--peak-tflops"),
    ([GemmSample(1024, 1024, 1024, 1e-6), GemmSample(64, 1024, 1024, 1e-7)], 1e12, "give the device's real dense peak"),
])
def test_gemm_fit_refuses_what_it_cannot_fit(samples, peak, words):
    with pytest.raises(ParallelLabError) as e:
        fit_gemm(samples, peak)
    assert words in str(e.value)


@pytest.mark.parametrize("samples,words", [
    ([CommSample(1 << 20, 2, 1e-3)], "at least two message sizes"),
    ([CommSample(1 << 20, 2, 1e-3), CommSample(1 << 20, 2, 2e-3)], "add e.g. 4 KB and 16 MB"),
    ([CommSample(1 << 10, 1, 1e-5), CommSample(1 << 20, 1, 1e-3)], "--nproc 2 or more"),
    ([CommSample(1 << 10, 2, 0.0), CommSample(1 << 20, 2, 1e-3)], "seconds=0.0"),
    ([CommSample(1 << 10, 2, 1e-3), CommSample(1 << 20, 2, -1e-3)], "seconds=-0.001"),
    ([CommSample(1 << 10, 2, 1e-3), CommSample(1 << 20, 2, 5e-4)], "do not grow with the message size"),
])
def test_link_fit_refuses_what_it_cannot_fit(samples, words):
    with pytest.raises(ParallelLabError) as e:
        fit_link(samples)
    assert words in str(e.value)


def test_fits_at_the_boundaries_say_so():
    # small shapes no slower than large ones: d_half = 0, e_max the (relative) mean efficiency
    flat = [GemmSample(t, 512, 512, 2 * t * 512 * 512 / (0.5e12 * (1.0 + 0.01 * (t == 8)))) for t in (8, 64, 512)]
    g = fit_gemm(flat, 1e12)
    assert g.half_width == 0.0 and "d_half = 0" in g.note and g.matmul_efficiency == pytest.approx(0.5, rel=0.01)
    # times proportional to the bytes: no latency at all is the best line
    lin = [CommSample(m, 2, m / 1e9 * (0.95 if m == 1 << 10 else 1.0)) for m in (1 << 10, 1 << 20, 1 << 24)]
    link = fit_link(lin)
    assert link.tier.latency == 0.0 and "alpha = 0" in link.note


def test_the_attention_fit_makes_the_roofline_reproduce_the_timed_core():
    """``fit_attention`` counts a timed core as ``steptime.roofline_layer`` charges it (3.5 x 4 s (s + 1)/2 d
    per head, causal, FlashAttention's backward), so a profile with the fitted speed gives back the time."""
    from parallel_lab.steptime import roofline_layer
    peak = 400e12
    model = ModelSpec(layers=1, hidden=2048, heads=16, kv_heads=16, ffn=8192, vocab=1000, flavour="llama")
    sample = AttentionSample(batch=1, heads=16, seq=8192, head_dim=128, seconds=0.021)
    e, (only,) = fit_attention([sample], peak)
    assert e == only == pytest.approx(3.5 * 4 * 16 * 8192 * (8192 + 1) / 2 * 128 / 0.021 / peak, rel=1e-12)
    _, attention, _ = roofline_layer(model, StepProfile(attention_efficiency=e), peak, 8192, 1, 1, 1, "none", "flash")
    assert attention == pytest.approx(sample.seconds, rel=1e-12)
    # several shapes: the median fraction; a fraction above 1 means the peak given is too low
    slow, fast = replace(sample, seconds=0.042), replace(sample, seconds=0.0105)
    assert fit_attention([slow, sample, fast], peak)[0] == pytest.approx(e)
    with pytest.raises(ParallelLabError, match="the peak is too low"):
        fit_attention([sample], 1e12)
    # every sample is checked, not the median only
    impossible = replace(sample, seconds=1e-4)
    with pytest.raises(ParallelLabError, match=r"sample 1 x 16 x 8192 x 128 ran at \d+\.\d\d of the peak"):
        fit_attention([sample, sample, impossible], peak)
    with pytest.raises(ParallelLabError, match="time nan s is not > 0"):
        fit_attention([replace(sample, seconds=float("nan"))], peak)
    with pytest.raises(ParallelLabError, match="no attention samples"):
        fit_attention([], peak)


# --------------------------------------------------------------------------------------------------
# The profile file
# --------------------------------------------------------------------------------------------------

def test_a_microbench_profile_round_trips_and_the_planner_uses_it(tmp_path):
    gemms = gemm_samples(0.62, 96.0, 700e12)
    comms = link_samples(LinkTier("x", 380e9, 4e-6), (8,))
    cluster, g, link = fit_microbench(gemms, comms, ClusterSpec.preset("h200"), 700e12, source="synthetic")
    assert cluster.peak_flops == 700e12 and cluster.intra.bandwidth == pytest.approx(380e9)
    assert cluster.inter == ClusterSpec.preset("h200").inter        # only the measured tier changes
    path = tmp_path / "h200.json"
    path.write_text(json.dumps(microbench_to_json(cluster, gemms, comms, g, link, device="cuda", dtype="bf16")))
    loaded = load_profile(path)
    assert loaded == cluster
    model, plan = ModelSpec.preset("llama3-8b"), Plan(dp=2, tp=4, seq=4096, sp=True)
    assert evaluate(model, loaded, plan).step_time_s == evaluate(model, cluster, plan).step_time_s
    assert evaluate(model, loaded, plan).step_time_s != evaluate(model, ClusterSpec.preset("h200"), plan).step_time_s
    data = json.loads(path.read_text())
    assert data["fitted"] == ["matmul_efficiency", "half_width", "intra.latency", "intra.bandwidth"]
    assert len(data["microbench"]["gemm"]) == len(SHAPES) and data["microbench"]["all_reduce"][0]["group_size"] == 8


def test_a_runs_fit_on_a_microbench_profile_keeps_its_peak_tier_and_half_width():
    gemms, comms = gemm_samples(0.62, 96.0, 700e12), link_samples(LinkTier("x", 380e9, 4e-6), (8,))
    micro, _, _ = fit_microbench(gemms, comms, H100, 700e12)
    runs = load_runs(REPO / "examples" / "calibration" / "llama3_405b.csv")[1:2]
    cluster, fitted = fit_profile(runs, micro)
    data = profile_to_json(cluster, runs, fitted)
    assert data["peak_flops"] == 700e12 and data["intra"]["bandwidth"] == pytest.approx(380e9)
    assert data["profile"]["half_width"] == pytest.approx(96.0)
    plain, fitted = fit_profile(runs, H100)
    assert "intra" not in profile_to_json(plain, runs, fitted)        # a preset's own tier is not repeated


# --------------------------------------------------------------------------------------------------
# The timing code (layer 2) and the command
# --------------------------------------------------------------------------------------------------

def test_gemm_timing_on_cpu_scales_with_the_work():
    from parallel_lab.distributed.instruments.microbench import time_gemms

    torch.set_num_threads(1)
    small, big = time_gemms([(4, 256, 256), (256, 256, 256)], "cpu", "fp32", repeats=7)
    assert (small.tokens, small.k, small.n) == (4, 256, 256)
    # 64x the FLOPs: about 50x the time alone here; a generous bound for a machine shared with other jobs
    assert 0 < small.seconds and big.seconds > 4 * small.seconds
    with pytest.raises(ParallelLabError, match="pick one of"):
        time_gemms([(4, 4, 4)], "cpu", "int8")


def test_attention_timing_on_cpu_scales_with_the_work():
    from parallel_lab.distributed.instruments.microbench import time_attention

    torch.set_num_threads(1)
    short, long = time_attention([(1, 2, 128, 32), (1, 2, 512, 32)], "cpu", "fp32", repeats=5)
    assert (short.batch, short.heads, short.seq, short.head_dim) == (1, 2, 128, 32)
    # 16x the causal FLOPs: a generous bound for a machine shared with other jobs
    assert 0 < short.seconds and long.seconds > 3 * short.seconds
    with pytest.raises(ParallelLabError, match="pick one of"):
        time_attention([(1, 1, 8, 8)], "cpu", "int8")


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_cli_microbench_on_cpu_end_to_end(tmp_path):
    """The whole command on this CPU, 2 gloo ranks: under 30 s, a profile that plan reads back."""
    from parallel_lab.distributed.instruments.microbench import ATTENTION_SHAPES, GEMM_SHAPES, MESSAGE_BYTES

    out = tmp_path / "cpu.json"
    t0 = time.perf_counter()
    p = run_cli("calibrate", "--microbench", "--device", "cpu", "--dtype", "fp32", "--nproc", "2",
                "--peak-tflops", "1", "--out", str(out), timeout=60)
    wall = time.perf_counter() - t0
    assert p.returncode == 0, p.stderr
    assert wall < 30, f"calibrate --microbench took {wall:.1f} s"
    assert "fit e(d) = e_max d / (d + d_half)" in p.stdout and "bus bandwidth" in p.stdout
    data = json.loads(out.read_text())
    mb = data["microbench"]
    assert (mb["device"], mb["dtype"], mb["nproc"]) == ("cpu", "fp32", 2) and data["cluster"] == "cpu-gloo"
    assert [(g["tokens"], g["k"], g["n"]) for g in mb["gemm"]] == GEMM_SHAPES["cpu"]
    assert [(a["message_bytes"], a["group_size"]) for a in mb["all_reduce"]] == [(b, 2) for b in MESSAGE_BYTES["cpu"]]
    assert [(a["batch"], a["heads"], a["seq"], a["head_dim"]) for a in mb["attention"]] == ATTENTION_SHAPES["cpu"]
    assert "attention_efficiency" in data["fitted"] and "causal attention b x h x s x d" in p.stdout
    cluster = load_profile(out)
    assert cluster.peak_flops == 1e12 and 0 < cluster.profile.matmul_efficiency < 0.5   # one core: < 0.5 TFLOP/s
    # the recorded residuals are the planner's cost functions against the recorded times
    for a in mb["all_reduce"]:
        t = collective_time("all_reduce", a["message_bytes"], 2, cluster.intra)
        assert t / a["seconds"] - 1 == pytest.approx(a["residual"], rel=1e-9)
    for g in mb["gemm"]:
        t = gemm_time(g["tokens"], g["n"], g["k"], cluster.peak_flops, cluster.profile)
        assert t / g["seconds"] - 1 == pytest.approx(g["residual"], rel=1e-9, abs=1e-12)
    # the profile's attention speed is the median of the recorded fractions, each the roofline's count
    fractions = sorted(a["of_peak"] for a in mb["attention"])
    assert cluster.profile.attention_efficiency == pytest.approx(sum(fractions) / 2) and 0 < fractions[0] < 1
    from parallel_lab.steptime import roofline_layer
    for a in mb["attention"]:
        sample = AttentionSample(a["batch"], a["heads"], a["seq"], a["head_dim"], a["seconds"])
        assert sample.flops / a["seconds"] / cluster.peak_flops == pytest.approx(a["of_peak"], rel=1e-12)
        # the recorded residual is the roofline's time for that core against the timed one
        model = ModelSpec(layers=1, hidden=a["heads"] * a["head_dim"], heads=a["heads"], ffn=64, vocab=64)
        _, t, _ = roofline_layer(model, cluster.profile, cluster.peak_flops, a["seq"], 1, 1, a["batch"], "none",
                                 "flash")
        assert t / a["seconds"] - 1 == pytest.approx(a["residual"], rel=1e-9, abs=1e-12)
    # loopback gloo: latency and bandwidth in the range shared/reference/torch_cpu_notes.md measured
    assert 1e-6 < cluster.intra.latency < 5e-3 and 5e7 < cluster.intra.bandwidth < 5e10
    p = run_cli("plan", "--model", "tiny-llama", "--gpus", "2", "--seq", "128", "--global-batch", "8",
                "--cluster", str(out), "--top", "2", "--json")
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize("argv,words", [
    (["--microbench", "--device", "cpu"], "give --peak-tflops X"),
    (["--microbench", "--runs", "x.csv"], "drop --runs"),
    ([], "--runs FILE (measured runs) or --microbench"),
    (["--runs", "x.csv", "--peak-tflops", "1"], "--peak-tflops belongs to --microbench"),
    (["--microbench", "--device", "cpu", "--peak-tflops", "0"], "must be a finite number in (0"),
    (["--microbench", "--device", "cpu", "--nproc", "0"], "--nproc"),
    (["--microbench", "--device", "cpu", "--nproc", "64", "--peak-tflops", "1"], "ranks per core here"),
    (["--runs", "x.csv", "--dtype", "fp32"], "--dtype belongs to --microbench"),
])
def test_cli_microbench_bad_input_is_one_line(argv, words):
    p = run_cli("calibrate", *argv)
    assert p.returncode == 2 and words in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cuda_without_a_gpu_is_refused():
    p = run_cli("calibrate", "--microbench", "--device", "cuda")
    assert p.returncode == 2 and "use --device cpu" in p.stderr, p.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (make gpu-check runs it)")
@pytest.mark.timeout(300)
def test_cuda_gemms_follow_the_efficiency_model():
    from parallel_lab.distributed.instruments.microbench import GEMM_SHAPES, preset_for_gpu, run_microbench

    bench = run_microbench("cuda", "bf16", nproc=1, shapes=GEMM_SHAPES["cuda"])
    cluster = ClusterSpec.preset(preset_for_gpu(bench.device_name) or "h100-sxm")
    fitted, g, _ = fit_microbench(bench.gemms, [], cluster, cluster.peak_flops, attention=bench.attention)
    assert 0.3 < g.matmul_efficiency <= 1.0 and g.rms < 0.25, (g, bench.gemms)
    # a fused causal kernel on a datacenter GPU: between a tenth of peak and the peak
    assert 0.1 < fitted.profile.attention_efficiency < 1.0, bench.attention
    assert replace(fitted, profile=None) == replace(cluster, profile=None)


def test_a_gpu_name_maps_to_its_own_peak_or_to_none():
    from parallel_lab.distributed.instruments.microbench import preset_for_gpu

    assert preset_for_gpu("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert preset_for_gpu("NVIDIA H200") == "h200"
    assert preset_for_gpu("NVIDIA A100-SXM4-80GB") == "a100-80gb"
    # other boards of the same GPU run at lower clocks: the SXM peak would make e_max come out too low
    assert preset_for_gpu("NVIDIA H100 PCIe") is None and preset_for_gpu("NVIDIA H100 NVL") is None
    assert preset_for_gpu("NVIDIA H200 NVL") is None and preset_for_gpu("Tesla T4") is None
