"""Fit the roofline's GEMM efficiency and a link tier's alpha-beta to micro-benchmark samples.

GEMMs: ``t = 2 T k n / (peak e(d))`` with ``e(d) = e_max d / (d + d_half)`` gives ``peak t / (2 T k n) =
1/e_max + (d_half/e_max) / d``, a line in ``1/d`` (:func:`fit_gemm`, relative least squares).
All-reduce: ``steps * alpha + wire / bandwidth`` with the ring's ``steps = 2 (n - 1)`` and ``wire =
2 (n - 1) / n * M`` (:func:`fit_link`; the bandwidth is nccl-tests' "bus bandwidth").
Attention: the median fraction of peak of the timed causal cores under the roofline's own count
(:func:`fit_attention`). The fits refuse input they cannot fit, naming the fix; residuals are
``predicted / measured - 1`` computed with the planner's own cost functions. Details: docs/step_time.md.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from .comm import collective_time
from .errors import ParallelLabError
from .flops import attention_core_flops, attention_keys
from .hardware import LinkTier, StepProfile
from .steptime import gemm_time

_UNIT_LATENCY = LinkTier("unit latency", 1.0, 1.0)     # collective_time with it, at 0 bytes: the ring steps
_UNIT_BANDWIDTH = LinkTier("unit bandwidth", 1.0, 0.0)  # ... and without latency: the wire bytes


@dataclass(frozen=True)
class GemmSample:
    """One timed GEMM ``(tokens x k) @ (k x n)``: median seconds of one call."""

    tokens: int
    k: int
    n: int
    seconds: float

    @property
    def flops(self) -> float:
        return 2.0 * self.tokens * self.k * self.n

    @property
    def d(self) -> int:
        """The smallest dimension, which sets the efficiency."""
        return min(self.tokens, self.k, self.n)


@dataclass(frozen=True)
class AttentionSample:
    """One timed causal attention core, ``batch x heads`` sequences of ``seq`` tokens at head dim ``head_dim``:
    median seconds of one forward + backward."""

    batch: int
    heads: int
    seq: int
    head_dim: int
    seconds: float

    @property
    def flops(self) -> float:
        """Forward + backward FLOPs as the roofline charges them (module docstring)."""
        return attention_core_flops(self.batch * self.seq, attention_keys(self.seq, "causal"),
                                    self.heads * self.head_dim, "flash")

    @property
    def shape(self) -> str:
        return f"{self.batch} x {self.heads} x {self.seq} x {self.head_dim}"


def fit_attention(samples: Sequence[AttentionSample], peak_flops: float) -> tuple[float, list[float]]:
    """``attention_efficiency``, the median of the samples' fractions of ``peak_flops`` (at which the
    roofline gives back the median core's time), and the fractions."""
    if not samples:
        raise ParallelLabError("no attention samples to fit; time at least one shape")
    for s in samples:
        if not s.seconds > 0:                          # also NaN
            raise ParallelLabError(f"attention sample {s.shape}: time {s.seconds!r} s is not > 0; time it again")
    fractions = [s.flops / s.seconds / peak_flops for s in samples]
    for s, f in zip(samples, fractions, strict=True):
        if not f <= 1:
            raise ParallelLabError(f"attention sample {s.shape} ran at {f:.2f} of the peak {peak_flops / 1e12:.4g} "
                                   "TFLOP/s; the peak is too low: give the device's dense peak in this dtype")
    return statistics.median(fractions), fractions


@dataclass(frozen=True)
class CommSample:
    """One timed collective (median seconds of one call, the slowest rank's) of ``message_bytes`` over
    ``group_size`` ranks."""

    message_bytes: int
    group_size: int
    seconds: float
    kind: str = "all_reduce"


class _Residuals:
    """A fit's per-sample residuals (``predicted / measured - 1``) and their root mean square."""

    residuals: list[float]

    @property
    def rms(self) -> float:
        return math.sqrt(sum(r * r for r in self.residuals) / len(self.residuals)) if self.residuals else 0.0


@dataclass(frozen=True)
class GemmFit(_Residuals):
    """``e_max`` and ``d_half`` against ``peak_flops``, with each sample's residual."""

    matmul_efficiency: float
    half_width: float
    peak_flops: float
    residuals: list[float] = field(default_factory=list)
    note: str = ""


@dataclass(frozen=True)
class LinkFit(_Residuals):
    """The fitted tier (``latency`` alpha per ring step, ``bandwidth`` bus bytes/s) and the residuals."""

    tier: LinkTier
    residuals: list[float] = field(default_factory=list)
    note: str = ""


def _check_times(what: str, seconds: Sequence[float]) -> None:
    for i, t in enumerate(seconds):
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
            raise ParallelLabError(f"{what} sample {i}: seconds={t!r} must be a finite time > 0; a zero comes from "
                                   "a timer coarser than one call: time more calls per repetition")


def _relative_ls(u: Sequence[float], v: Sequence[float]) -> tuple[float, float]:
    """``(a, b)`` minimising ``sum (a u_i + b v_i - 1)^2`` (normal equations of two unknowns)."""
    suu, svv, suv = sum(x * x for x in u), sum(x * x for x in v), sum(x * y for x, y in zip(u, v, strict=True))
    su, sv = sum(u), sum(v)
    det = suu * svv - suv * suv
    if det <= 1e-12 * suu * svv:
        raise ParallelLabError("the samples cannot tell the two parameters apart (collinear); vary the size more")
    return (su * svv - sv * suv) / det, (sv * suu - su * suv) / det


def fit_gemm(samples: Sequence[GemmSample], peak_flops: float) -> GemmFit:
    """``e_max, d_half`` of ``e(d) = e_max d / (d + d_half)`` from timed GEMMs (module docstring)."""
    if not (math.isfinite(peak_flops) and peak_flops > 0):
        raise ParallelLabError(f"peak_flops={peak_flops!r} must be > 0 FLOP/s; give the device's dense peak "
                               "(--peak-tflops)")
    for i, s in enumerate(samples):
        if min(s.tokens, s.k, s.n) < 1:
            raise ParallelLabError(f"GEMM sample {i}: shape ({s.tokens} x {s.k}) @ ({s.k} x {s.n}) needs every "
                                   "dimension >= 1")
    _check_times("GEMM", [s.seconds for s in samples])
    ds = sorted({s.d for s in samples})
    if len(ds) < 2:
        raise ParallelLabError(f"fitting e_max and d_half needs GEMMs of at least two different smallest "
                               f"dimensions d = min(T, k, n); got d = {ds}: add shapes with another T (e.g. 16 and "
                               "1024 tokens)")
    y = [peak_flops * s.seconds / s.flops for s in samples]            # 1 / e(d_i)
    u, v = [1.0 / yi for yi in y], [1.0 / (s.d * yi) for s, yi in zip(samples, y, strict=True)]
    a, b = _relative_ls(u, v)
    note = ""
    if b < 0:                       # no slower at small d: the best line with d_half = 0
        a, b = sum(u) / sum(x * x for x in u), 0.0
        note = "small shapes ran no slower than large ones here: d_half = 0"
    e_max = 1.0 / a
    if not 0 < e_max <= 1:
        best = max(s.flops / s.seconds for s in samples)
        raise ParallelLabError(f"the fitted e_max = {e_max:.4g} is not in (0, 1]: the GEMMs reach "
                               f"{best / 1e12:.4g} TFLOP/s against a peak of {peak_flops / 1e12:.4g}; give the "
                               "device's real dense peak (--peak-tflops) for this dtype")
    fit = GemmFit(e_max, b * e_max, peak_flops, note=note)
    prof = StepProfile(matmul_efficiency=fit.matmul_efficiency, half_width=fit.half_width)
    res = [gemm_time(s.tokens, s.n, s.k, peak_flops, prof) / s.seconds - 1.0 for s in samples]
    return GemmFit(fit.matmul_efficiency, fit.half_width, peak_flops, res, note)


def fit_link(samples: Sequence[CommSample], name: str = "measured") -> LinkFit:
    """``alpha`` and bus ``bandwidth`` of one link tier from timed collectives (module docstring)."""
    if any(s.group_size < 2 for s in samples):
        raise ParallelLabError("a collective over one rank moves nothing; time it with --nproc 2 or more")
    _check_times(f"{name} collective", [s.seconds for s in samples])
    sizes = sorted({s.message_bytes for s in samples})
    if len(sizes) < 2 or sizes[-1] <= 0:
        raise ParallelLabError(f"fitting latency and bandwidth needs at least two message sizes; got {sizes} "
                               "bytes: add e.g. 4 KB and 16 MB")
    steps = [collective_time(s.kind, 0, s.group_size, _UNIT_LATENCY) for s in samples]
    wire = [collective_time(s.kind, s.message_bytes, s.group_size, _UNIT_BANDWIDTH) for s in samples]
    u = [st / s.seconds for st, s in zip(steps, samples, strict=True)]
    v = [w / s.seconds for w, s in zip(wire, samples, strict=True)]
    alpha, beta = _relative_ls(u, v)
    note = ""
    if alpha < 0:                   # the best line through the origin
        alpha, beta = 0.0, sum(v) / sum(x * x for x in v)
        note = "the fitted latency was negative: alpha = 0"
    if not beta > 0:
        raise ParallelLabError(f"the {name} times do not grow with the message size ({sizes[0]} to {sizes[-1]} "
                               "bytes): time larger messages (e.g. up to 64 MB)")
    tier = LinkTier(name, 1.0 / beta, alpha)
    res = [collective_time(s.kind, s.message_bytes, s.group_size, tier) / s.seconds - 1.0 for s in samples]
    return LinkFit(tier, res, note)
