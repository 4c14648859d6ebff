"""``make gpu-check``: the CPU-measured models checked on NVIDIA GPUs, in under 5 minutes.

Everything else in this project runs on CPU ranks. On a machine with CUDA this script checks what CPU
cannot show, and writes what it measured under ``--out`` (default ``bench/results/gpu_check``):

1. **The ledger against the CUDA allocator.** Llama 3.2 1B (1.24B parameters, preset ``llama3.2-1b``) trains
   a few steps on one GPU with ``adam-mixed`` (bf16 compute, fp32 master and AdamW: 2 + 2 + 12 bytes per
   parameter, Rajbhandari et al. 2020) through ``parallel-lab run``'s own composition. State bytes must
   equal ``ledger.state_bytes`` exactly, saved activations the per-op model within 2%, and
   ``torch.cuda.max_memory_allocated`` the ledger's peak (``ledger.memory(..., activation_model="per-op")``)
   within 15% (allocator rounding, cuBLAS workspaces and temporaries the ledger does not list).
2. **Each activation model against CUDA's kernels.** Two blocks of the same shape, forward + backward, with
   ``attention`` eager (scores materialised) and ``flash`` run by CUDA's own SDPA flash kernel
   (``SDPBackend.FLASH_ATTENTION``, Dao et al. 2022: q, k, v, output and an fp32 log-sum-exp saved), ``mlp``
   eager and fused: the saved bytes (saved-tensor meter) against ``parallel_lab.activations``' per-op model.
3. **NCCL**, where there are at least 2 GPUs: ``parallel-lab run`` with dp=2, tp=2 (and dp2 x tp2 with 4) on
   the tiny model: bytes per collective equal to ``comm.collectives``, parameters equal to the one-process
   reference within 1e-4.
4. **Step times** of the 1B model (median after warm-up) as ``runs.yaml``, the format ``parallel-lab calibrate
   --runs runs.yaml --cluster h100-sxm`` reads (``parallel_lab/calibrate.py``).
5. **Micro-benchmarks** (``parallel-lab calibrate --microbench --device cuda``): bf16 GEMMs fitted to
   ``e(d) = e_max d / (d + d_half)`` against the datasheet peak of the GPU's preset, all-reduces over every
   GPU (where there are 2 or more) fitted to latency and bus bandwidth; the fitted profile is printed and
   written as ``profile.json``, and each fit's rms residual must stay within 15% (GEMM) and 25% (all-reduce).

Without a GPU it says so and exits 0 (tests/test_gpu_check.py). The device is chosen here only (``cuda``);
the library code takes it from the launcher (``distributed/launch.pick_device``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from parallel_lab import comm, ledger
from parallel_lab.errors import ParallelLabError
from parallel_lab.hardware import ClusterSpec
from parallel_lab.specs import ModelSpec, Plan

MODEL = "llama3.2-1b"
STEPS, WARMUP = 4, 1
BUDGET_S = 280.0


def no_gpu_reason() -> str | None:
    """Why there is nothing to check here, or None on a machine with a usable NVIDIA GPU."""
    if not torch.cuda.is_available():
        return (f"no NVIDIA GPU visible: torch.cuda.is_available() is False (torch {torch.__version__}, CUDA "
                f"build {torch.version.cuda or 'none'})")
    return None


class SdpaFlashCore(torch.nn.Module):
    """The attention core run by torch's SDPA flash kernel (``model.DotProductAttention``'s signature)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: Any) -> torch.Tensor:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if getattr(ctx, "doc_ids", None) is not None:
            raise ValueError("the SDPA flash core takes unpacked causal sequences only (packed documents need a mask)")
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):       # q (b, heads, s, d); k, v (b, kv_heads, s, d)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                    enable_gqa=q.shape[1] != k.shape[1])


# --------------------------------------------------------------------------------------------------
# On the rank (launched by parallel_lab.distributed.runtime.launch on cuda:0)
# --------------------------------------------------------------------------------------------------

def saved_activations(spec: ModelSpec, plan: Plan, device: torch.device, sdpa_flash: bool) -> int:
    """Peak bytes saved for backward by one forward + backward of ``plan``'s micro-batch (saved-tensor meter);
    ``sdpa_flash``: the attention core is torch's SDPA flash kernel (CUDA's on a GPU, the CPU one here)."""
    from parallel_lab.distributed.instruments.saved import SavedTensorMeter
    from parallel_lab.distributed.model.data import synthetic_batch
    from parallel_lab.distributed.model.mixed_precision import to_compute_dtype
    from parallel_lab.distributed.model.model import build_model, loss_fn

    model = build_model(spec, 0, recompute=plan.recompute, device=device,
                        attention="eager" if sdpa_flash else plan.attention, mlp=plan.mlp)
    if sdpa_flash:
        for blk in model.blocks.values():
            blk.attn.core = SdpaFlashCore()
    to_compute_dtype(model, plan)
    batch = synthetic_batch(spec, plan, 0, 0).rows(0, plan.micro_batch).to(device)
    meter = SavedTensorMeter(model)
    with meter:
        loss_fn(model(batch.tokens, batch.positions, batch.doc_ids), batch.targets).backward()
    meter.remove()
    return int(meter.peak["activations"])


def _one_gpu_rank(grid: Any, spec: ModelSpec, plan: Plan, kernel_plans: list[Plan]) -> dict[str, Any]:
    """Check 1 (memory, step times of ``plan``) and check 2 (activations of each of ``kernel_plans``)."""
    from parallel_lab.distributed.instruments.tracer import CommTracer
    from parallel_lab.distributed.model.data import synthetic_batch
    from parallel_lab.distributed.model.mixed_precision import to_compute_dtype
    from parallel_lab.distributed.model.model import build_model
    from parallel_lab.distributed.runtime.train import parallelize

    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(grid.device)}
    model = build_model(spec, 0, recompute=plan.recompute, device=grid.device, attention=plan.attention,
                        mlp=plan.mlp)
    to_compute_dtype(model, plan)
    rt = parallelize(model, grid, plan, CommTracer(grid.rank, grid.groups_by_dim()))
    torch.cuda.reset_peak_memory_stats(grid.device)        # from here: the state, then training
    times = []
    for step in range(WARMUP + STEPS):
        micro = rt.micro_batches(synthetic_batch(spec, plan, step, 0))
        torch.cuda.synchronize(grid.device)
        t0 = time.perf_counter()
        rt.train_step(micro)
        torch.cuda.synchronize(grid.device)
        times.append(time.perf_counter() - t0)
    out["state"] = dict(rt.dp.measure_state())
    out["activations"] = int(rt.meter.peak["activations"])
    out["max_memory_allocated"] = int(torch.cuda.max_memory_allocated(grid.device))
    out["step_s"] = statistics.median(times[WARMUP:])
    rt.meter.remove()
    del rt, model
    torch.cuda.empty_cache()
    small = spec.with_(layers=2)
    out["kernels"] = [saved_activations(small, p, grid.device, p.attention == "flash") for p in kernel_plans]
    return out


# --------------------------------------------------------------------------------------------------
# The checks, in the caller
# --------------------------------------------------------------------------------------------------

def _row(name: str, measured: float, predicted: float, tol: float | None) -> dict[str, Any]:
    gap = (measured - predicted) / predicted if predicted else 0.0
    ok = measured == predicted if tol is None else abs(gap) <= tol
    return {"check": name, "measured": measured, "predicted": predicted, "gap": gap,
            "tolerance": "exact" if tol is None else tol, "ok": bool(ok)}


def check_one_gpu(seq: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Checks 1, 2 and 4 in one launched rank; returns the rows and the calibrate run."""
    from parallel_lab.distributed.runtime.launch import launch
    from parallel_lab.distributed.runtime.run import predicted_activations

    spec = ModelSpec.preset(MODEL)
    plan = Plan(seq=seq, micro_batch=1, optimizer="adam-mixed", dtype="bf16")
    kernel_plans = [plan.with_(attention=a, mlp=m) for a in ("eager", "flash") for m in ("eager", "fused")]
    (res,) = launch(_one_gpu_rank, plan, spec, plan, kernel_plans, device="cuda", timeout_s=BUDGET_S)
    rows = [_row(f"1B {k}", res["state"][k], int(v), None) for k, v in ledger.state_bytes(spec, plan).items()]
    rows.append(_row("1B saved activations (per-op)", res["activations"], predicted_activations(spec, plan), 0.02))
    peak = ledger.memory(spec, plan, activation_model="per-op", stage=0).total_bytes
    rows.append(_row("1B max_memory_allocated vs ledger peak", res["max_memory_allocated"], peak, 0.15))
    small = spec.with_(layers=2)
    for p, got in zip(kernel_plans, res["kernels"], strict=True):
        kernel = "CUDA SDPA flash" if p.attention == "flash" else "eager"
        rows.append(_row(f"activations attention={p.attention} ({kernel}) mlp={p.mlp}", got,
                         predicted_activations(small, p), 0.02))
    return rows, calibrate_run(res["gpu"], plan, res["step_s"])


def calibrate_run(gpu: str, plan: Plan, step_s: float) -> dict[str, Any]:
    """One row of ``runs.yaml`` in ``parallel_lab.calibrate``'s format (the 1B model on one GPU)."""
    fields = ("seq", "micro_batch", "grad_accum", "optimizer", "dtype", "attention", "mlp")
    return {"name": f"gpu-check {gpu}", "model": MODEL, "gpus": plan.world,
            **{f: getattr(plan, f) for f in fields}, "step_time_s": float(step_s)}


def check_nccl(n_gpus: int) -> list[dict[str, Any]]:
    """Check 3: ``parallel-lab run`` on NCCL (it picks cuda and nccl itself when CUDA is present)."""
    from parallel_lab.distributed.runtime.run import run
    from parallel_lab.specs import RUN_DEFAULTS

    spec = ModelSpec.preset("tiny-llama")
    plans = [Plan(dp=2, **RUN_DEFAULTS), Plan(tp=2, sp=True, **RUN_DEFAULTS)]
    if n_gpus >= 4:
        plans.append(Plan(dp=2, tp=2, zero=2, **RUN_DEFAULTS))
    rows = []
    for p in plans:
        rep = run(spec, p, steps=2, timeout_s=120)
        name = f"nccl dp={p.dp} tp={p.tp} zero={p.zero}"
        rows.append(_row(f"{name} max |param - reference|", rep.max_abs_param_diff, 0.0, None)
                    | {"ok": rep.max_abs_param_diff <= 1e-4, "tolerance": 1e-4})
        for dim, c in rep.comm.items():
            rows.append(_row(f"{name} {dim} bytes", c["measured_bytes"], c["predicted_bytes"], None))
        calls = sum(c.count for c in comm.collectives(spec, p)) * 2
        rows.append(_row(f"{name} calls of rank 0", len(rep.ranks[0].events), calls, None))
    return rows


def check_microbench(device: str, nproc: int, peak_flops: float | None = None) -> tuple[list[dict[str, Any]],
                                                                                     dict[str, Any], str]:
    """Check 5: the micro-benchmarks on ``device`` (``nproc`` ranks for the all-reduce; 1: GEMMs only), fitted
    against ``peak_flops`` (default: the datasheet peak of the GPU's preset). Returns the rows, the profile
    file's content and the fitted profile as text."""
    from parallel_lab.calibrate import fit_microbench, microbench_to_json
    from parallel_lab.distributed.instruments.microbench import preset_for_gpu, run_microbench

    bench = run_microbench(device, "bf16", nproc)
    base = ClusterSpec.preset(preset_for_gpu(bench.device_name) or ("cpu-gloo" if device == "cpu" else "h100-sxm"))
    peak = peak_flops or base.peak_flops
    cluster, gemm, link = fit_microbench(bench.gemms, bench.all_reduce, base, peak,
                                         source=f"gpu-check micro-benchmarks on {bench.device_name} (bf16)",
                                         attention=bench.attention)
    data = microbench_to_json(cluster, bench.gemms, bench.all_reduce, gemm, link, bench.attention, device=device,
                              device_name=bench.device_name, dtype="bf16", nproc=nproc)
    rows = [{"check": f"GEMM e(d) fit rms residual ({len(bench.gemms)} shapes)", "measured": gemm.rms,
             "predicted": 0.0, "gap": gemm.rms, "tolerance": 0.15, "ok": gemm.rms <= 0.15}]
    if bench.attention:       # one attention speed for every shape: the spread of the timed cores around it
        spread = max(abs(a["residual"]) for a in data["microbench"]["attention"])
        e = cluster.profile.attention_efficiency
        rows.append({"check": f"attention: one efficiency ({e:.3f} of peak) for {len(bench.attention)} shapes, "
                              "largest |fit/meas - 1|", "measured": spread, "predicted": 0.0, "gap": spread,
                     "tolerance": 0.25, "ok": spread <= 0.25 and 0.1 < e < 1.0})
    text = (f"{bench.device_name}: e_max {gemm.matmul_efficiency:.4f}, d_half {gemm.half_width:.1f} against "
            f"{peak / 1e12:.0f} TFLOP/s ({base.name}); best GEMM "
            f"{max(s.flops / s.seconds for s in bench.gemms) / 1e12:.1f} TFLOP/s; causal attention (torch SDPA) "
            f"attention_efficiency {cluster.profile.attention_efficiency:.3f}")
    if link:
        rows.append({"check": f"all-reduce alpha-beta fit rms residual ({nproc} GPUs)", "measured": link.rms,
                     "predicted": 0.0, "gap": link.rms, "tolerance": 0.25, "ok": link.rms <= 0.25})
        text += (f"; all-reduce over {nproc}: alpha {link.tier.latency * 1e6:.2f} us per ring step, bus bandwidth "
                 f"{link.tier.bandwidth / 1e9:.1f} GB/s")
    return rows, data, text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/gpu_check", help="folder for results.json and runs.yaml")
    ap.add_argument("--seq", type=int, default=2048, help="tokens per sequence of the 1B model (default 2048)")
    args = ap.parse_args(argv)
    reason = no_gpu_reason()
    if reason is not None:
        print(f"gpu-check: {reason}; nothing to check on this host (the CPU tests cover the rest)")
        return 0
    t0 = time.perf_counter()
    n = torch.cuda.device_count()
    print(f"gpu-check: {n} GPU(s), torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    rows, run = check_one_gpu(args.seq)
    if n >= 2 and time.perf_counter() - t0 < BUDGET_S - 60:
        rows += check_nccl(n)
    elif n >= 2:
        print("gpu-check: NCCL checks skipped: the 5-minute budget is spent", flush=True)
    profile, fitted = None, ""
    if time.perf_counter() - t0 < BUDGET_S - 45:
        try:
            micro_rows, profile, fitted = check_microbench("cuda", min(n, 8))
        except ParallelLabError as err:                # a refused fit must not lose checks 1-4's results
            micro_rows = [{"check": "micro-benchmark fit", "measured": 0, "predicted": 0, "ok": False,
                           "gap": 0.0, "note": str(err)}]
            print(f"gpu-check: micro-benchmark fit refused: {err}", flush=True)
        rows += micro_rows
    else:
        print("gpu-check: micro-benchmarks skipped: the 5-minute budget is spent", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if profile is not None:
        (out / "profile.json").write_text(json.dumps(profile, indent=2))
        print(f"gpu-check: fitted profile ({out / 'profile.json'}, --cluster for plan): {fitted}", flush=True)
    (out / "results.json").write_text(json.dumps({"rows": rows, "wall_s": time.perf_counter() - t0}, indent=1))
    import yaml

    (out / "runs.yaml").write_text(yaml.safe_dump({"runs": [run]}, sort_keys=False))
    for r in rows:
        pred = f"{r['predicted']:,.6g}" if isinstance(r["predicted"], float) else f"{r['predicted']:,}"
        meas = f"{r['measured']:,.6g}" if isinstance(r["measured"], float) else f"{r['measured']:,}"
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['check']:<58} {meas:>16} {pred:>16} {r['gap']:+.2%}")
    print(f"gpu-check: 1B step {run['step_time_s'] * 1e3:.1f} ms; wrote {out / 'results.json'} and "
          f"{out / 'runs.yaml'} (parallel-lab calibrate --runs {out / 'runs.yaml'} --cluster h100-sxm); "
          f"{time.perf_counter() - t0:.0f} s")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
