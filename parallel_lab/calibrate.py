"""Fit the step-time model's parameters to measured runs, and save them as a cluster profile.

A *run* is a plan trained on a cluster and its measured throughput (``tflops_per_gpu``, counted as
:data:`RUN_COUNTS` says, or ``step_time_s``), read from a small CSV or YAML file (at most :data:`MAX_RUNS`
runs, :data:`MAX_RUNS_BYTES`). :func:`fit_profile` chooses the roofline's ``matmul_efficiency`` ``e_max``
(``steptime``, "Roofline compute") to minimise ``sum (log predicted - log measured)^2`` over the runs, and
fits ``overhead_s`` too when the runs have two token counts ``micro_batch * seq / cp``; the other
parameters keep their priors (``hardware.StepProfile``). Predictions are
:func:`parallel_lab.planner.evaluate`'s, so a profile given back as ``--cluster PROFILE.json`` changes the
planner's ranking and nothing else. :func:`fit_microbench` fits ``e_max``, ``d_half`` and the intra-node
tier from timed GEMMs and all-reduces (``parallel_lab.microfit``). The full contract: docs/calibrate.md.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from .errors import ParallelLabError
from .flops import CONVENTIONS, step_flops
from .hardware import (
    ATTENTION_KERNELS,
    ClusterSpec,
    LinkTier,
    StepProfile,
    attention_kernel_efficiency,
    default_attention_efficiency,
)
from .inputs import PLAN_FILE_LIMITS, read_text
from .microfit import AttentionSample, CommSample, GemmFit, GemmSample, LinkFit, fit_attention, fit_gemm, fit_link
from .specs import ModelSpec, Plan

#: How a published TFLOP/s figure counts its FLOPs: the model FLOPs of ``flops.CONVENTIONS`` (``palm``, the full
#: square; ``causal``, the visible pairs) or ``hardware``, what the GPUs executed, recomputation included
#: (``flops.StepFlops.hardware_flops_per_step``, the full square: Narayanan et al. 2021, eq. 3, which the
#: Megatron-LM papers' teraFLOP/s use)
RUN_COUNTS: tuple[str, ...] = (*CONVENTIONS, "hardware")
#: how a profile's source names the published kernel its attention speed is (``with_attention_kernel``)
ATTENTION_NOTE = "; attention prior: "

_INT = ("dp", "tp", "pp", "cp", "ep", "zero", "micro_batch", "grad_accum", "seq", "interleave", "loss_chunk", "gpus",
        "max_positions")
_FLOAT = ("bucket_mb",)
_RANGES = {**PLAN_FILE_LIMITS["plan"], **PLAN_FILE_LIMITS["gpus"],
           "max_positions": PLAN_FILE_LIMITS["model"]["max_positions"]}
MAX_RUNS_BYTES = 256 * 1024      #: a runs file is a few kB
MAX_PROFILE_BYTES = 4 * 2**20   #: a profile with every micro-benchmark sample is tens of kB
MAX_RUNS = 100                   #: runs in one file (each is a step-time evaluation per step of the fit)
_BOOL = ("sp",)
_PLAN = {f.name for f in fields(Plan)}


@dataclass(frozen=True)
class Run:
    """One measured run: the model, the plan, and the measured TFLOP/s per GPU (in ``convention``)."""

    name: str
    model: ModelSpec
    plan: Plan
    tflops_per_gpu: float
    convention: str = "palm"

    def model_flops(self) -> float:
        """FLOPs of one step, counted in the run's convention (:data:`RUN_COUNTS`)."""
        f = step_flops(self.model, self.plan)
        if self.convention == "hardware":
            return f.hardware_flops_per_step
        return f.model_flops_per_step if self.convention == "palm" else f.model_flops_causal_per_step


def _value(key: str, raw: Any, index: int) -> Any:
    """One cell of a run, of its field's type and within the plan file's range (``inputs.PLAN_FILE_LIMITS``)."""
    if key in _INT:
        lo, hi = _RANGES[key]
        text = str(raw).strip()
        if isinstance(raw, bool) or not (isinstance(raw, int) or text.isascii() and text.isdigit()) \
                or not lo <= int(text) <= hi:
            raise ParallelLabError(f"run {index}: {key}={_cell(raw)} must be a whole number in [{lo:,}, {hi:,}]")
        return int(text)
    if key in _BOOL:
        return raw if isinstance(raw, bool) else str(raw).strip().lower() in ("1", "true", "yes", "on")
    if key in _FLOAT:
        return _positive(key, raw, index)
    if not isinstance(raw, str):
        raise ParallelLabError(f"run {index}: {key}={_cell(raw)} must be a name (text)")
    return raw.strip()


def _cell(raw: Any) -> str:
    r = repr(raw)
    return r if len(r) <= 40 else r[:37] + "..."


def _positive(key: str, raw: Any, index: int, hi: float = 1e15) -> float:
    try:
        value = float(raw) if not isinstance(raw, bool) and isinstance(raw, (int, float, str)) else math.nan
    except ValueError:
        value = math.nan
    if not 0 < value <= hi:
        raise ParallelLabError(f"run {index}: {key}={_cell(raw)} must be a number in (0, {hi:g}]")
    return value


def run_from_dict(d: dict[str, Any], index: int = 0, convention: str | None = None) -> Run:
    """A :class:`Run` from one CSV row or YAML mapping (unknown keys are an error naming them);
    ``convention`` overrides the row's ``flops_convention``."""
    if isinstance(d, dict) and None in d:
        raise ParallelLabError(f"run {index} has more cells than the header has columns; one cell per column")
    if not isinstance(d, dict) or not all(isinstance(k, str) for k in d):
        raise ParallelLabError(f"run {index}: {_cell(d)} is not a row of named columns; give a header row (CSV) "
                               f"or a mapping per run (YAML)")
    d = {k.strip(): v for k, v in d.items() if v not in (None, "")}
    known = _PLAN | {"model", "name", "tflops_per_gpu", "step_time_s", "gpus", "flops_convention", "max_positions"}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ParallelLabError(f"run {index}: unknown column(s) {unknown}; use Plan fields, model, name, gpus, "
                               "tflops_per_gpu or step_time_s")
    if "model" not in d:
        raise ParallelLabError(f"run {index}: no 'model' column; give a preset name such as llama3-405b")
    model = ModelSpec.preset(_value("model", d["model"], index))
    if "max_positions" in d:        # a learned position table trained longer than the preset's
        model = replace(model, max_positions=_value("max_positions", d["max_positions"], index))
    plan = Plan(**{k: _value(k, v, index) for k, v in d.items() if k in _PLAN}).validate(
        model, _value("gpus", d["gpus"], index) if "gpus" in d else None)
    conv = convention or str(d.get("flops_convention", "palm")).strip()
    if conv not in RUN_COUNTS:
        raise ParallelLabError(f"run {index}: flops_convention={conv!r} is not known; pick one of "
                               f"{', '.join(RUN_COUNTS)}")
    run = Run(str(d.get("name", f"run {index}")), model, plan, 1.0, conv)
    if "tflops_per_gpu" in d:
        tflops = _positive("tflops_per_gpu", d["tflops_per_gpu"], index, 1e6)
    elif "step_time_s" in d:
        tflops = run.model_flops() / (_positive("step_time_s", d["step_time_s"], index, 1e9) * plan.world) / 1e12
    else:
        raise ParallelLabError(f"run {index}: give tflops_per_gpu or step_time_s")
    if not tflops > 0:
        raise ParallelLabError(f"run {index}: measured throughput {tflops} must be > 0")
    return replace(run, tflops_per_gpu=tflops)


def load_runs(path: str | Path, convention: str | None = None) -> list[Run]:
    """Runs from a ``.csv`` or ``.yaml``/``.yml`` file (module docstring); ``convention`` overrides each
    run's ``flops_convention``."""
    p = Path(path)
    if not p.exists():
        raise ParallelLabError(f"runs file {str(p)!r} does not exist")
    where = f"runs file {str(p)[:200]!r}"
    if p.suffix.lower() not in (".csv", ".yaml", ".yml"):
        raise ParallelLabError(f"{where}: use .csv or .yaml")
    text = read_text(p, "runs file", MAX_RUNS_BYTES)
    if p.suffix.lower() == ".csv":
        try:
            rows: Any = list(csv.DictReader(io.StringIO(text, newline="")))
        except csv.Error as e:
            raise ParallelLabError(f"{where} is not a valid CSV file ({e}); one run per row under a header") from None
    else:
        from .planfile import parse_plan_text

        data = parse_plan_text(text.encode(), where)
        rows = data.get("runs", []) if isinstance(data, dict) else data
    if not rows:
        raise ParallelLabError(f"{where} holds no runs")
    if not isinstance(rows, list) or len(rows) > MAX_RUNS:
        raise ParallelLabError(f"{where}: give a list of at most {MAX_RUNS} runs (each a mapping of columns), "
                               f"or {{runs: [...]}}")
    try:
        return [run_from_dict(r, i, convention) for i, r in enumerate(rows)]
    except ParallelLabError as e:
        raise ParallelLabError(f"{where}: {e}") from None


def predicted_tflops(run: Run, cluster: ClusterSpec) -> float:
    """Model TFLOP/s per GPU (in the run's convention) the step-time model predicts for ``run`` on
    ``cluster`` (its profile)."""
    from .planner import evaluate

    est = evaluate(run.model, cluster, run.plan)
    return run.model_flops() / (est.step_time_s * run.plan.world) / 1e12


def _loss(runs: list[Run], cluster: ClusterSpec) -> float:
    return sum((math.log(predicted_tflops(r, cluster)) - math.log(r.tflops_per_gpu)) ** 2 for r in runs)


def _golden(f: Any, lo: float, hi: float, iters: int = 40) -> float:
    """Minimiser of a unimodal ``f`` on ``[lo, hi]`` (golden-section search)."""
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return (a + b) / 2


def _root(f: Any, lo: float, hi: float, xtol: float = 1e-9, iters: int = 60) -> float | None:
    """A root of a continuous increasing ``f`` on ``[lo, hi]`` (None if ``f`` keeps one sign there): regula
    falsi, Illinois variant, a few evaluations where bisection or a golden search take dozens."""
    f_lo, f_hi = f(lo), f(hi)
    if f_lo > 0 or f_hi < 0:
        return None
    side, mid = 0, lo
    for _ in range(iters):
        if f_hi == f_lo:
            break
        mid = (lo * f_hi - hi * f_lo) / (f_hi - f_lo)
        f_mid = f(mid)
        if abs(f_mid) < 1e-12 or hi - lo < xtol:
            return mid
        if f_mid < 0:
            lo, f_lo = mid, f_mid
            f_hi, side = (f_hi / 2 if side == -1 else f_hi), -1
        else:
            hi, f_hi = mid, f_mid
            f_lo, side = (f_lo / 2 if side == 1 else f_lo), 1
    return mid


def _profile_or_default(cluster: ClusterSpec, peak_flops: float) -> StepProfile:
    """``cluster``'s profile, else the defaults with the attention prior of a GPU of ``peak_flops``."""
    return cluster.profile or StepProfile(attention_efficiency=default_attention_efficiency(peak_flops))


def fit_profile(runs: list[Run], cluster: ClusterSpec,
                prior: StepProfile | None = None) -> tuple[ClusterSpec, list[str]]:
    """``cluster`` with a fitted :class:`StepProfile`, and the names of the fitted parameters."""
    if not runs:
        raise ParallelLabError("calibrate needs at least one run")
    prior = prior or _profile_or_default(cluster, cluster.peak_flops)
    token_counts = {r.plan.micro_batch * r.plan.seq // r.plan.cp for r in runs}
    fitted = ["matmul_efficiency"] + (["overhead_s"] if len(token_counts) > 1 else [])

    # the kernel the prior's attention speed came from (with_attention_kernel) stays in the source
    _, kept, kernel = prior.source.partition(ATTENTION_NOTE)
    table = ATTENTION_KERNELS.get(cluster.peak_flops, ("", {}))[1]
    named = kept and kernel in table and \
        prior.attention_efficiency == attention_kernel_efficiency(kernel, cluster.peak_flops)
    source = f"fitted to {len(runs)} run(s): " + ", ".join(r.name for r in runs) + (ATTENTION_NOTE + kernel
                                                                                     if named else "")

    def with_(e: float, o: float) -> ClusterSpec:
        return replace(cluster, profile=replace(prior, matmul_efficiency=e, overhead_s=o, source=source))

    def best_e(o: float) -> float:
        if len(runs) == 1:       # one run is matched exactly: the predicted throughput rises with e
            r = runs[0]
            e = _root(lambda e: math.log(predicted_tflops(r, with_(e, o)) / r.tflops_per_gpu), 0.05, 1.0)
            if e is not None:
                return e
        return _golden(lambda e: _loss(runs, with_(e, o)), 0.05, 1.0)

    if "overhead_s" in fitted:
        o = _golden(lambda o: _loss(runs, with_(best_e(o), o)), 0.0, 0.05, iters=20)
    else:
        o = prior.overhead_s
    return with_(best_e(o), o), fitted


def with_attention_kernel(cluster: ClusterSpec, kernel: str) -> ClusterSpec:
    """``cluster`` whose profile's attention prior is ``kernel``'s published rate on the cluster's GPU
    (``hardware.attention_kernel_efficiency``: H100 and A100 figures, found by the cluster's peak; H200, the
    same compute die, shares H100's), named at the end of the profile's source (a kernel named there before
    is replaced). Refused, with the fix, on a GPU or kernel with no published figure here."""
    prof = cluster.profile or StepProfile()
    eff = attention_kernel_efficiency(kernel, cluster.peak_flops)
    source = prof.source.partition(ATTENTION_NOTE)[0]
    return replace(cluster, profile=replace(prof, attention_efficiency=eff, source=f"{source}{ATTENTION_NOTE}{kernel}"))


def attention_efficiency_needed(run: Run, fit_runs: list[Run], cluster: ClusterSpec,
                                lo: float = 0.05, hi: float = 1.0) -> float | None:
    """The ``attention_efficiency`` at which ``run`` is predicted exactly once ``matmul_efficiency`` is fitted
    to ``fit_runs`` with it (None if no value in ``[lo, hi]`` does): a question, not a fit. It says how fast
    the attention kernel of a run must have been for the model to hold, to be compared with what published
    kernels reach (``StepProfile``'s prior), never used as a profile."""
    def miss(e_attn: float) -> float:
        base = replace(cluster, profile=replace(cluster.profile or StepProfile(), attention_efficiency=e_attn))
        return math.log(predicted_tflops(run, fit_profile(fit_runs, base)[0]) / run.tflops_per_gpu)

    return _root(miss, lo, hi, xtol=1e-4)


def _cluster_json(cluster: ClusterSpec) -> dict[str, Any]:
    """What a profile file says of its cluster: the preset, the step-time profile, the peak, and the
    intra-node tier where it differs from the preset's (a measured one)."""
    assert cluster.profile is not None
    out = {"cluster": cluster.name, "profile": asdict(cluster.profile), "peak_flops": cluster.peak_flops}
    if cluster.intra != ClusterSpec.preset(cluster.name).intra:
        out["intra"] = asdict(cluster.intra)
    return out


def profile_to_json(cluster: ClusterSpec, runs: list[Run], fitted: list[str]) -> dict[str, Any]:
    """The profile file's content: the cluster preset, the fitted parameters, each run against the fit."""
    return {**_cluster_json(cluster), "fitted": fitted,
            "runs": [{"name": r.name, "flops_convention": r.convention, "measured_tflops_per_gpu": r.tflops_per_gpu,
                      "predicted_tflops_per_gpu": predicted_tflops(r, cluster)} for r in runs]}


def fit_microbench(gemms: list[GemmSample], comms: list[CommSample], cluster: ClusterSpec, peak_flops: float,
                   source: str = "micro-benchmarks", attention: list[AttentionSample] | None = None,
                   ) -> tuple[ClusterSpec, GemmFit, LinkFit | None]:
    """``cluster`` with the fitted GEMM efficiency (a :class:`StepProfile` keeping the other parameters of
    ``cluster.profile``), ``peak_flops``, given all-reduce samples the fitted intra-node tier, and given
    attention samples the measured ``attention_efficiency`` (``microfit.fit_attention``)."""
    gemm = fit_gemm(gemms, peak_flops)
    link = fit_link(comms, f"{cluster.intra.name} (measured)") if comms else None
    profile = replace(_profile_or_default(cluster, peak_flops), matmul_efficiency=gemm.matmul_efficiency,
                      half_width=gemm.half_width, source=source)
    if attention:
        profile = replace(profile, attention_efficiency=fit_attention(attention, peak_flops)[0])
    return replace(cluster, peak_flops=peak_flops, intra=link.tier if link else cluster.intra,
                   profile=profile), gemm, link


def microbench_to_json(cluster: ClusterSpec, gemms: list[GemmSample], comms: list[CommSample], gemm: GemmFit,
                       link: LinkFit | None, attention: list[AttentionSample] | None = None,
                       **where: Any) -> dict[str, Any]:
    """The profile file of :func:`profile_to_json` plus the peak, the measured tier and every sample with its
    residual, or for an attention core its fraction of peak (``where``: device, dtype, ... as measured)."""
    fitted = (["matmul_efficiency", "half_width"] + (["intra.latency", "intra.bandwidth"] if link else [])
              + (["attention_efficiency"] if attention else []))
    fractions = fit_attention(attention, cluster.peak_flops)[1] if attention else []
    return {**_cluster_json(cluster), "fitted": fitted, "runs": [],
            "microbench": {**where,
                           "gemm": [{**asdict(s), "residual": r} for s, r in zip(gemms, gemm.residuals, strict=True)],
                           "all_reduce": [{**asdict(s), "residual": r}
                                          for s, r in zip(comms, link.residuals if link else [], strict=True)],
                           "attention": [{**asdict(s), "of_peak": f,
                                          "residual": f / cluster.profile.attention_efficiency - 1}
                                         for s, f in zip(attention or [], fractions, strict=True)],
                           "gemm_rms_residual": gemm.rms, "all_reduce_rms_residual": link.rms if link else None,
                           "notes": [n for n in (gemm.note, link.note if link else "") if n]}}


def load_profile(path: str | Path) -> ClusterSpec:
    """The cluster of a profile file written by ``parallel-lab calibrate`` (preset + fitted profile, and from
    ``--microbench`` the measured peak and intra-node tier)."""
    p = Path(path)
    text = read_text(p, "profile file", MAX_PROFILE_BYTES)
    try:
        data = json.loads(text)
        cluster = ClusterSpec.preset(data["cluster"])
        profile = StepProfile(**data["profile"])
        cluster = replace(cluster, profile=profile, peak_flops=float(data.get("peak_flops", cluster.peak_flops)))
        if "intra" in data:
            cluster = replace(cluster, intra=LinkTier(**data["intra"]))
        _within_limits(cluster)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        why = " ".join(f"{type(e).__name__}: {e}".split())[:200]
        raise ParallelLabError(f"{str(p)[:200]!r} is not a profile file written by parallel-lab calibrate "
                               f"({why})") from None
    return cluster


def _within_limits(cluster: ClusterSpec) -> None:
    """A profile's numbers within the plan file's ranges (``inputs.PLAN_FILE_LIMITS``: finite, far above any GPU)."""
    assert cluster.profile is not None
    values = {("cluster", "peak_flops"): cluster.peak_flops, ("link", "bandwidth"): cluster.intra.bandwidth,
              ("link", "latency"): cluster.intra.latency,
              **{("profile", k): v for k, v in asdict(cluster.profile).items() if k != "source"}}
    for (group, key), v in values.items():
        lo, hi = PLAN_FILE_LIMITS[group][key]
        if not lo <= v <= hi:
            raise ValueError(f"{key}={v!r} is outside [{lo:g}, {hi:g}]")
