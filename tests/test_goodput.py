"""The goodput and overlap closed forms against values worked out by hand."""

from __future__ import annotations

import math

import pytest

from parallel_lab import goodput, overlap


def test_young_interval_by_hand():
    # C = 60 s, M = 3 h = 10,800 s: sqrt(2 x 60 x 10,800) = sqrt(1,296,000) = 1138.42 s
    assert goodput.optimal_interval(60, 10_800) == pytest.approx(1138.42, abs=0.01)
    # the waste C/T + (T/2 + R)/M at T = 1138.42, R = 600: 0.052705 + 0.108261 = 0.160966
    assert goodput.goodput(1138.42, 60, 10_800, 600) == pytest.approx(1 - 0.160966, abs=1e-5)


def test_the_optimum_is_the_best_interval():
    t = goodput.optimal_interval(60, 10_800)
    best = goodput.goodput(t, 60, 10_800, 600)
    assert all(goodput.goodput(t * k, 60, 10_800, 600) < best for k in (0.5, 0.9, 1.1, 2.0))
    assert goodput.goodput(10, 60, 10_800) == 0.0                     # checkpointing more than working


def test_llama3_snapshot():
    # 54 days x 86,400 s / 419 unexpected interruptions = 11,135.1 s, 3.09 h (Dubey et al. 2024, 3.3.4)
    assert goodput.llama3_job_mtbf_s() == pytest.approx(11_135.1, abs=0.1)
    # a job MTBF that falls as 1/N: one GPU's 3.09 h x 16,384 = 5.78 years; on 2,048 GPUs 24.7 h
    gpu = goodput.llama3_job_mtbf_s() * 16_384
    assert gpu / (365 * 86400) == pytest.approx(5.785, abs=0.001)
    assert goodput.job_mtbf(gpu, 2048) / 3600 == pytest.approx(24.74, abs=0.01)


def test_slow_rank_by_hand():
    # (1 - 1e-4)^16,384 = exp(16,384 ln(0.9999)) = exp(-1.638482) = 0.194275
    assert goodput.p_no_slow_rank(1e-4, 16_384) == pytest.approx(0.194275, abs=1e-6)
    assert goodput.p_no_slow_rank(1e-4, 1) == pytest.approx(0.9999)
    # slowdown 2: 1 + (1 - 0.194275) = 1.805725 steps
    assert goodput.expected_step(1.0, 2.0, 1e-4, 16_384) == pytest.approx(1.805725, abs=1e-6)
    assert goodput.bisection_rounds(16_384) == 14 and goodput.bisection_rounds(1) == 0
    assert goodput.bisection_rounds(1000) == math.ceil(math.log2(1000)) == 10


def test_dualpipe_pair_by_hand():
    # f = 1, b = 2, an all-to-all of 1.5 each way: 1:1 compute to communication (DeepSeek-V3, section 3.2.1)
    assert overlap.pair_time(1, 2, 1.5, 1.5, overlap=False) == 6
    assert overlap.pair_time(1, 2, 1.5, 1.5, overlap=True) == 3
    assert overlap.exposed_comm(1, 2, 1.5, 1.5, overlap=True) == 0
    assert overlap.exposed_comm(1, 2, 3, 3, overlap=True) == 3             # twice the compute: half exposed
    assert overlap.exposed_comm(1, 2, 0.5, 0.5, overlap=False) == 1
