"""``parallel-lab calibrate``: fit the step-time model to measured runs, or with ``--microbench`` to GEMMs and
all-reduces timed here, and write a profile (:mod:`parallel_lab.calibrate`)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from ..errors import ParallelLabError
from ..hardware import (
    A100_PEAK_FLOPS,
    ATTENTION_KERNELS_A100,
    ATTENTION_KERNELS_H100,
    ClusterSpec,
    attention_kernel_efficiency,
)
from ..inputs import LIMITS
from ..ledger import DEFAULT_CLUSTER
from ..optimizers import DTYPE_BYTES
from ..plan_flags import MAX_RANKS_PER_CORE, Output, cluster_from_args, float_in, int_in, subcommand
from ..quantities import fmt_bytes_gib
from .output import EXIT_RUN_TIMEOUT, PROG, RunFailed, rank_failed, table


def add(sub: Any) -> None:
    p = subcommand(sub, "calibrate", handle, "fit the step-time model to measured runs; write a profile",
                   description="Fit the roofline step-time model (matmul efficiency; with runs of several token "
                               "counts also the per-micro-batch overhead) to runs measured on a cluster, or with "
                               "--microbench to GEMMs and all-reduces timed on the local machine, and write a profile "
                               "file that --cluster PROFILE.json gives to plan and the other commands.")
    p.add_argument("--runs", metavar="FILE",
                   help="CSV or YAML of runs (see parallel_lab/calibrate.py)")
    p.add_argument("--cluster", metavar="PRESET",
                   help=f"the cluster the runs were measured on, or a profile file (default {DEFAULT_CLUSTER}; "
                        "with --microbench on cpu: cpu-gloo, on cuda: the preset of the GPU's name)")
    p.add_argument("--out", metavar="PROFILE.json", help="where to write the profile (default: print only)")
    p.add_argument("--fit-on", metavar="ROWS",
                   help="fit to these runs only, 1-based, comma-separated (default: all); every run is compared")
    p.add_argument("--no-fit", action="store_true",
                   help="only compare the runs with the --cluster profile's predictions (no fitting)")
    p.add_argument("--flops-convention", choices=("palm", "causal", "hardware"), default=None,
                   help="how the runs' TFLOP/s count: palm = model FLOPs with the full s x s square, causal = with "
                        "the visible half, hardware = what ran, recomputation included (Megatron-LM's eq. 3) "
                        "(default: each run's flops_convention column, else palm)")
    kernels = tuple(dict.fromkeys([*ATTENTION_KERNELS_H100, *ATTENTION_KERNELS_A100]))
    p.add_argument("--attention-kernel", choices=kernels, default=None,
                   help="the attention prior: a fused kernel's published speed on the cluster's GPU (H100: "
                        + ", ".join(f"{k} {attention_kernel_efficiency(k):.3f}" for k in ATTENTION_KERNELS_H100)
                        + "; A100: " + ", ".join(f"{k} {attention_kernel_efficiency(k, A100_PEAK_FLOPS):.3f}"
                                                 for k in ATTENTION_KERNELS_A100)
                        + " of peak; hardware.ATTENTION_KERNELS; default: the --cluster profile's, else fa2's)")
    g = p.add_argument_group("micro-benchmarks (instead of --runs)")
    g.add_argument("--microbench", action="store_true",
                   help="time GEMMs (-> matmul_efficiency, half_width) and all-reduces (-> the intra-node tier's "
                        "latency and bandwidth) here; see parallel_lab/distributed/instruments/microbench.py")
    g.add_argument("--device", choices=("cpu", "cuda"), help="where to time them (default: cuda when present)")
    g.add_argument("--dtype", choices=tuple(DTYPE_BYTES), help="compute dtype of the GEMMs and messages (default bf16)")
    g.add_argument("--nproc-per-node", "--nproc", dest="nproc", type=int_in("nproc"),
                   help="ranks of the all-reduce (default: 2 on cpu, every visible GPU on cuda; 1: GEMMs only)")
    g.add_argument("--peak-tflops", type=float_in(0.0, 1e6, open_lo=True),
                   help="dense peak TFLOP/s of one device in --dtype, which e_max is a fraction of (required on "
                        "cpu; default on cuda: the --cluster preset's datasheet bf16 peak)")


def handle(args: argparse.Namespace) -> Output:
    from ..calibrate import fit_profile, load_runs, profile_to_json, with_attention_kernel

    if args.microbench:
        return _calibrate_microbench(args)
    if args.runs is None:
        raise ParallelLabError("calibrate needs --runs FILE (measured runs) or --microbench (time GEMMs and "
                               "all-reduces here)")
    given = [f for f in ("device", "dtype", "nproc", "peak_tflops") if getattr(args, f) is not None]
    if given:
        raise ParallelLabError(f"--{given[0].replace('_', '-')} belongs to --microbench; drop it or add --microbench")
    if args.no_fit and args.fit_on is not None:
        raise ParallelLabError("--fit-on chooses the runs to fit; with --no-fit nothing is fitted: drop one")
    runs = load_runs(args.runs, args.flops_convention)
    cluster = cluster_from_args(args)
    if args.no_fit and cluster.profile is None:
        raise ParallelLabError(f"--no-fit compares with a profile; {cluster.name} has none (the fixed mfu_achievable "
                               "model): give --cluster PROFILE.json or a preset with a fitted profile")
    if args.attention_kernel:
        cluster = with_attention_kernel(cluster, args.attention_kernel)
    if args.no_fit:
        fitted: list[str] = []
    else:
        cluster, fitted = fit_profile(_fit_rows(args.fit_on, runs), cluster)
    data = profile_to_json(cluster, runs, fitted)
    _write_profile(args.out, data)
    rows = [(k, f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in data["profile"].items()]
    rows += [(f"{r['name']} (TFLOP/s per GPU, {r['flops_convention']})",
              f"measured {r['measured_tflops_per_gpu']:.1f}  predicted {r['predicted_tflops_per_gpu']:.1f}")
             for r in data["runs"]]
    text = "\n".join([f"cluster {cluster.name}; fitted: {', '.join(fitted) or 'nothing (--no-fit)'}", table(rows)]
                     + ([f"profile written to {args.out}"] if args.out else []))
    return Output(data, text)


def _fit_rows(text: str | None, runs: list[Any]) -> list[Any]:
    """The runs ``--fit-on`` names (1-based, comma-separated), all of them without it."""
    if text is None:
        return runs
    try:
        rows = [int(x) for x in text.split(",")]
    except ValueError:
        rows = []
    if not rows or any(not 1 <= r <= len(runs) for r in rows):
        raise ParallelLabError(f"--fit-on {text!r}: give run numbers from 1 to {len(runs)}, comma-separated, "
                               "e.g. --fit-on 2")
    return [runs[r - 1] for r in dict.fromkeys(rows)]


def _write_profile(path: str | None, data: dict[str, Any]) -> None:
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump(data, f, indent=2)
    except OSError as e:
        raise ParallelLabError(f"cannot write the profile to {path!r} ({e.strerror}); pick a writable --out") from None


def _calibrate_microbench(args: argparse.Namespace) -> Output:
    """``calibrate --microbench``: time GEMMs and all-reduces on the local machine, fit, print, write the profile."""
    if args.runs or args.no_fit or args.flops_convention or args.attention_kernel or args.fit_on is not None:
        raise ParallelLabError("--microbench measures here: drop --runs, --fit-on, --no-fit, --flops-convention "
                               "and --attention-kernel")
    from ..calibrate import fit_microbench, microbench_to_json
    from ..distributed.instruments.microbench import device_of, preset_for_gpu, run_microbench, visible_gpus
    from ..distributed.runtime.launch import LaunchTimeout, RankError
    from ..flops import ATTENTION_FWD_BWD

    dev, dtype = device_of(args.device), args.dtype or "bf16"
    nproc = args.nproc or (2 if dev.type == "cpu" else min(LIMITS["nproc"][1], visible_gpus()))
    if dev.type == "cuda" and nproc > visible_gpus():
        raise ParallelLabError(f"--nproc {nproc} needs {nproc} GPUs but {visible_gpus()} are visible; use "
                               f"--nproc {visible_gpus()} or fewer")
    if dev.type == "cpu" and nproc > MAX_RANKS_PER_CORE * (os.cpu_count() or 1):
        raise ParallelLabError(f"--nproc {nproc} is over {MAX_RANKS_PER_CORE} ranks per core here; e.g. --nproc 2")
    given = cluster_from_args(args) if args.cluster else None
    if args.peak_tflops is None and dev.type == "cpu":
        raise ParallelLabError("on cpu there is no datasheet peak: give --peak-tflops X, one core's dense peak in "
                               f"--dtype {dtype} (one rank per core: GHz x FLOPs per cycle, e.g. 2.8 GHz x 64 "
                               "fp32 FLOPs with AVX-512's two FMA units = 0.18); the fit refuses a peak below the "
                               "fastest GEMM it times")
    if args.peak_tflops is None and dtype != "bf16":
        raise ParallelLabError(f"the presets' datasheet peaks are dense bf16; for --dtype {dtype} give "
                               "--peak-tflops X, the GPU's dense peak in that dtype")
    try:
        bench = run_microbench(dev.type, dtype, nproc)
    except RankError as e:
        raise rank_failed(e, 1) from None
    except LaunchTimeout as e:
        raise RunFailed(f"\n{PROG} calibrate: stopped: {e}", EXIT_RUN_TIMEOUT) from None
    # the GPU's name only after the ranks started: asking it initialises CUDA, and ranks then cannot fork
    base = given or ClusterSpec.preset("cpu-gloo" if dev.type == "cpu"
                                       else preset_for_gpu(bench.device_name) or DEFAULT_CLUSTER)
    if args.peak_tflops is not None:
        peak, peak_from = args.peak_tflops * 1e12, "--peak-tflops"
    else:
        peak, peak_from = base.peak_flops, f"the {base.name} preset's datasheet peak"
    where = {"device": dev.type, "device_name": bench.device_name, "dtype": dtype, "nproc": nproc}
    cluster, gemm, link = fit_microbench(bench.gemms, bench.all_reduce, base, peak,
                                         source=f"micro-benchmarks on {bench.device_name} ({dtype})",
                                         attention=bench.attention)
    data = microbench_to_json(cluster, bench.gemms, bench.all_reduce, gemm, link, bench.attention, **where)
    _write_profile(args.out, data)
    lines = [f"micro-benchmarks on {bench.device_name} ({dev.type}, {dtype}); peak "
             f"{peak / 1e12:.4g} TFLOP/s from {peak_from}; cluster {cluster.name}"]
    lines.append(table([(f"{s.tokens} x {s.k} x {s.n}", s.d, f"{s.seconds * 1e6:,.1f}",
                         f"{s.flops / s.seconds / 1e12:.4g}", f"{s.flops / s.seconds / peak:.3f}", f"{r:+.1%}")
                        for s, r in zip(bench.gemms, gemm.residuals, strict=True)],
                       header=("GEMM T x k x n", "d", "us", "TFLOP/s", "of peak", "fit/meas - 1")))
    lines.append(f"fit e(d) = e_max d / (d + d_half): e_max {gemm.matmul_efficiency:.4f}, d_half "
                 f"{gemm.half_width:.2f}; rms residual {gemm.rms:.1%}" + (f" ({gemm.note})" if gemm.note else ""))
    if bench.attention:
        lines.append(table([(s.shape, f"{s.seconds * 1e3:,.2f}", f"{s.flops / s.seconds / 1e12:.4g}",
                             f"{a['of_peak']:.3f}", f"{a['residual']:+.1%}")
                            for s, a in zip(bench.attention, data["microbench"]["attention"], strict=True)],
                           header=("causal attention b x h x s x d", "ms", "TFLOP/s", "of peak", "fit/meas - 1")))
        lines.append(f"attention_efficiency {cluster.profile.attention_efficiency:.4f}: the median fraction of peak "
                     "of torch's fused causal attention, forward + backward, counted as the roofline charges it "
                     f"({ATTENTION_FWD_BWD['flash']:g} x 4 s (s+1)/2 d per head)")
    if link:
        lines.append(table([(fmt_bytes_gib(s.message_bytes), f"{s.seconds * 1e6:,.1f}",
                             f"{s.message_bytes / s.seconds / 1e9:.4g}", f"{r:+.1%}")
                            for s, r in zip(bench.all_reduce, link.residuals, strict=True)],
                           header=(f"all_reduce over {nproc} ranks", "us", "algo GB/s", "fit/meas - 1")))
        lines.append(f"fit t = 2(n-1) alpha + 2(n-1)/n M / bandwidth: alpha {link.tier.latency * 1e6:.2f} us per "
                     f"ring step, bus bandwidth {link.tier.bandwidth / 1e9:.4g} GB/s; rms residual {link.rms:.1%}"
                     + (f" ({link.note})" if link.note else ""))
    else:
        lines.append(f"all-reduce: not timed (--nproc {nproc}); the intra-node tier stays {cluster.intra.name}'s")
    lines.append(f"profile written to {args.out}" if args.out else "(no --out: nothing written)")
    return Output(data, "\n".join(lines))
