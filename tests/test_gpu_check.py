"""``make gpu-check`` (bench/gpu_check.py): exits cleanly without a GPU; its CPU-checkable parts are checked."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import REPO

from bench.gpu_check import calibrate_run, check_microbench, saved_activations
from parallel_lab.calibrate import run_from_dict
from parallel_lab.distributed.runtime.run import predicted_activations
from parallel_lab.specs import ModelSpec, Plan


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: make gpu-check runs the real checks")
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    p = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--out", str(tmp_path / "out")], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "no NVIDIA GPU visible" in p.stdout and "nothing to check" in p.stdout
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])
def test_sdpa_flash_kernel_saves_what_the_flash_model_predicts(mixed):
    """The check's kernel path on this CPU: torch's own SDPA flash kernel (CPU build) saves exactly the bytes
    of the per-op ``attention="flash"`` model, as our CPU FlashAttention does; eager too."""
    torch.set_num_threads(1)
    spec = ModelSpec.preset("tiny-llama").with_(layers=2)
    dtype = {"optimizer": "adam-mixed", "dtype": "bf16"} if mixed else {"optimizer": "adam-fp32", "dtype": "fp32"}
    flash = Plan(seq=128, micro_batch=2, attention="flash", **dtype)
    eager = flash.with_(attention="eager")
    want = predicted_activations(spec, flash)
    assert saved_activations(spec, flash, torch.device("cpu"), sdpa_flash=True) == want
    assert saved_activations(spec, flash, torch.device("cpu"), sdpa_flash=False) == want
    assert saved_activations(spec, eager, torch.device("cpu"), sdpa_flash=False) == predicted_activations(spec, eager)
    assert want < predicted_activations(spec, eager)              # no (s x s) probabilities


def test_measured_step_times_are_in_calibrates_format():
    plan = Plan(seq=2048, micro_batch=1, optimizer="adam-mixed", dtype="bf16")
    run = run_from_dict(calibrate_run("NVIDIA H100 80GB HBM3", plan, 0.5))
    assert run.model.name == "llama3.2-1b" and 1.2e9 < run.model.n_params < 1.3e9
    assert run.plan == plan and run.tflops_per_gpu > 0


def test_the_micro_benchmark_check_on_cpu():
    """Check 5's own code on this CPU (GEMMs only, one rank; the cuda run is make gpu-check's): its rows are the
    fit's rms residual, recomputed here from the samples it writes into profile.json."""
    import math

    from parallel_lab.distributed.instruments.microbench import GEMM_SHAPES

    # the check times bf16 GEMMs; CPUs with AMX tiles run those at over 1 TFLOP/s on one core, so the peak
    # given is one no CPU reaches (the check's rows, not the fitted efficiency, are what this test holds)
    rows, data, text = check_microbench("cpu", 1, peak_flops=1e14)
    residuals = [g["residual"] for g in data["microbench"]["gemm"]]
    assert len(residuals) == len(GEMM_SHAPES["cpu"]) and data["microbench"]["all_reduce"] == []
    rms = math.sqrt(sum(r * r for r in residuals) / len(residuals))
    assert rows[0]["measured"] == pytest.approx(rms) and rows[0]["ok"] == (rms <= 0.15)
    # the attention row: the largest residual of the timed cores around the one fitted efficiency
    spread = max(abs(a["residual"]) for a in data["microbench"]["attention"])
    assert len(rows) == 2 and rows[1]["measured"] == pytest.approx(spread) and "attention" in rows[1]["check"]
    assert data["peak_flops"] == 1e14 and "e_max" in text and "intra" not in data
