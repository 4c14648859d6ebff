"""Micro-benchmarks of the costs the step-time model is built from: one GEMM, one all-reduce, one attention core.

:func:`time_gemms` times ``(T x k) @ (k x n)`` in the compute dtype on a device (``cpu``, ``cuda``: a
parameter, never assumed): inputs allocated once, a warm-up, then ``repeats`` rounds over all shapes,
each timing enough back-to-back calls to last ``min_rep_s`` between two synchronisations; a sample is the
median seconds of one call. :func:`time_all_reduce` does the same for ``all_reduce`` of several message sizes on
``nproc`` ranks started by the project's launcher (gloo on CPU, nccl on GPUs), every rank timing the same
calls between barriers; a sample is the median over repetitions of the slowest rank's time.
``parallel_lab.microfit`` turns the samples into ``e_max, d_half`` (``e(d) = e_max d / (d + d_half)``,
``steptime.gemm_time``) and a link tier's alpha and bus bandwidth (``comm.collective_time``), which
``parallel-lab calibrate --microbench`` writes as a profile file.

:func:`time_attention` times torch's fused causal attention (``F.scaled_dot_product_attention(q, k, v,
is_causal=True)`` with whichever backend torch picks, then its backward) for ``(batch, heads, seq, head_dim)``
shapes, which ``microfit.fit_attention`` turns into the profile's ``attention_efficiency``.

On CPU the GEMMs and the attention cores run on one torch thread, as one rank does (``launch`` sets one
thread per rank), so a profile describes the compute of one rank. The grids (:data:`GEMM_SHAPES`,
:data:`MESSAGE_BYTES`, :data:`ATTENTION_SHAPES`) are small on CPU (a few seconds) and span a GPU's range on
cuda (tens of seconds).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel_lab.errors import ParallelLabError
from parallel_lab.microfit import AttentionSample, CommSample, GemmSample
from parallel_lab.optimizers import DTYPE_BYTES

TORCH_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

#: ``(T, k, n)`` per device type: a few token counts on square weights, and narrow shards (small ``n``).
GEMM_SHAPES: dict[str, list[tuple[int, int, int]]] = {
    "cpu": [(t, 256, 256) for t in (4, 16, 64, 256)] + [(256, 512, 512), (512, 512, 64), (512, 512, 16)],
    "cuda": [(t, w, w) for t in (64, 256, 1024, 4096, 16384) for w in (2048, 8192)]
    + [(8192, 8192, n) for n in (128, 512, 2048)],
}
#: ``(batch, heads, seq, head_dim)`` of the timed attention cores per device type (long sequences on cuda,
#: head dim 128 as in the published kernel figures, ``hardware.ATTENTION_KERNELS_H100``)
ATTENTION_SHAPES: dict[str, list[tuple[int, int, int, int]]] = {
    "cpu": [(1, 4, 256, 64), (1, 4, 512, 64)],
    "cuda": [(1, 16, 4096, 128), (1, 16, 8192, 128), (1, 16, 16384, 128)],
}
#: all-reduce message sizes (bytes) per device type
MESSAGE_BYTES: dict[str, list[int]] = {
    "cpu": [4 << 10, 64 << 10, 1 << 20, 8 << 20],
    "cuda": [64 << 10, 1 << 20, 16 << 20, 128 << 20, 512 << 20],
}


@dataclass
class Microbench:
    """What was measured, where."""

    device: str
    dtype: str
    gemms: list[GemmSample] = field(default_factory=list)
    all_reduce: list[CommSample] = field(default_factory=list)
    attention: list[AttentionSample] = field(default_factory=list)
    device_name: str = ""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _calls_per_rep(one_call_s: float, min_rep_s: float) -> int:
    """Back-to-back calls that last about ``min_rep_s`` (one repetition), from the time of one call."""
    return max(1, min(10_000, int(min_rep_s / one_call_s) + 1))


def _warm_then_time_one(call: Any, device: torch.device, warmup: int) -> float:
    for _ in range(warmup):
        call()
    return _timed(call, device, 1)


def _timed(call: Any, device: torch.device, inner: int) -> float:
    """Seconds of one ``call()``, from ``inner`` back-to-back calls between two synchronisations."""
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(inner):
        call()
    _sync(device)
    return max(time.perf_counter() - t0, 1e-9) / inner


def device_of(device: str | None) -> torch.device:
    """``cpu`` or ``cuda`` (None: cuda when present); a cuda request without a GPU is one clear error."""
    name = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise ParallelLabError(f"device {name!r} is not supported; pick cpu or cuda")
    if name == "cuda" and not torch.cuda.is_available():
        raise ParallelLabError("device cuda asked for, but torch sees no GPU (torch.cuda.is_available() is False); "
                               "use --device cpu")
    return torch.device(name)


def visible_gpus() -> int:
    """GPUs torch sees here (0 without CUDA), without initialising CUDA (ranks can still fork)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def time_gemms(shapes: Sequence[tuple[int, int, int]], device: str | torch.device = "cpu", dtype: str = "bf16",
               warmup: int = 2, repeats: int = 9, min_rep_s: float = 2e-3) -> list[GemmSample]:
    """Median seconds of ``(T x k) @ (k x n)`` for each ``(T, k, n)`` (module docstring). The repetitions go
    round the shapes, so that a burst of load elsewhere on the machine does not fall on one shape only."""
    dev = torch.device(device)
    if dtype not in TORCH_DTYPES:
        raise ParallelLabError(f"dtype {dtype!r} is not known; pick one of {', '.join(TORCH_DTYPES)}")
    gen = torch.Generator(device="cpu").manual_seed(0)
    calls = []
    for t, k, n in shapes:
        a = torch.randn(t, k, generator=gen).to(dev, TORCH_DTYPES[dtype])       # (T, k)
        b = torch.randn(k, n, generator=gen).to(dev, TORCH_DTYPES[dtype])       # (k, n)
        c = torch.empty(t, n, device=dev, dtype=TORCH_DTYPES[dtype])            # (T, n)
        calls.append(lambda a=a, b=b, c=c: torch.matmul(a, b, out=c))
    inner = [_calls_per_rep(_warm_then_time_one(call, dev, warmup), min_rep_s) for call in calls]
    times: list[list[float]] = [[] for _ in shapes]
    for _ in range(repeats):
        for i, call in enumerate(calls):
            times[i].append(_timed(call, dev, inner[i]))
    return [GemmSample(t, k, n, statistics.median(ts)) for (t, k, n), ts in zip(shapes, times, strict=True)]


def time_attention(shapes: Sequence[tuple[int, int, int, int]], device: str | torch.device = "cpu",
                   dtype: str = "bf16", warmup: int = 2, repeats: int = 9,
                   min_rep_s: float = 2e-3) -> list[AttentionSample]:
    """Median seconds of one causal attention forward + backward for each ``(batch, heads, seq, head_dim)``
    (module docstring); the repetitions go round the shapes, as :func:`time_gemms`'s do."""
    dev = torch.device(device)
    if dtype not in TORCH_DTYPES:
        raise ParallelLabError(f"dtype {dtype!r} is not known; pick one of {', '.join(TORCH_DTYPES)}")
    gen = torch.Generator(device="cpu").manual_seed(0)
    calls = []
    for b, h, s, d in shapes:
        q, k, v, g = (torch.randn(b, h, s, d, generator=gen).to(dev, TORCH_DTYPES[dtype]) for _ in range(4))
        for t in (q, k, v):                                                    # (b, h, s, d)
            t.requires_grad_(True)

        def call(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v, g: torch.Tensor = g) -> None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)    # (b, h, s, d)
            torch.autograd.grad(out, (q, k, v), g)
        calls.append(call)
    inner = [_calls_per_rep(_warm_then_time_one(call, dev, warmup), min_rep_s) for call in calls]
    times: list[list[float]] = [[] for _ in shapes]
    for _ in range(repeats):
        for i, call in enumerate(calls):
            times[i].append(_timed(call, dev, inner[i]))
    return [AttentionSample(b, h, s, d, statistics.median(ts)) for (b, h, s, d), ts in zip(shapes, times, strict=True)]


def _all_reduce_rank(grid: Any, sizes: list[int], dtype: str, warmup: int, repeats: int,
                     min_rep_s: float) -> list[tuple[int, float]]:
    """On every rank: ``(bytes, seconds)`` per size, the median over repetitions (going round the sizes) of
    the slowest rank's time; every rank makes the same calls."""
    dev, elem = grid.device, DTYPE_BYTES[dtype]
    # zeros: thousands of all-reduces of ones would double the values to inf (the timing does not care)
    xs = [torch.zeros(max(1, size // elem), device=dev, dtype=TORCH_DTYPES[dtype]) for size in sizes]

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    calls = [lambda x=x: dist.all_reduce(x) for x in xs]
    inner = []
    for call in calls:
        for _ in range(warmup):
            call()
        dist.barrier()
        # the slowest rank's time of one call: every rank then makes the same number of calls
        inner.append(_calls_per_rep(slowest(_timed(call, dev, 1)), min_rep_s))
    times: list[list[float]] = [[] for _ in sizes]
    for rep in range(repeats):
        for i, call in enumerate(calls):
            dist.barrier()
            times[i].append(slowest(_timed(call, dev, inner[i])))
        if grid.notify is not None:
            grid.notify(rep)
    return [(x.numel() * elem, statistics.median(ts)) for x, ts in zip(xs, times, strict=True)]


def time_all_reduce(sizes: Sequence[int], nproc: int, device: str | None = None, dtype: str = "bf16",
                    warmup: int = 2, repeats: int = 9, min_rep_s: float = 5e-3,
                    timeout_s: float = 60.0) -> list[CommSample]:
    """Median seconds of ``all_reduce`` of each message size on ``nproc`` launched ranks (module docstring)."""
    from parallel_lab.distributed.runtime.launch import launch

    if nproc < 2:
        raise ParallelLabError(f"nproc={nproc}: an all-reduce needs at least 2 ranks")
    if dtype not in TORCH_DTYPES:
        raise ParallelLabError(f"dtype {dtype!r} is not known; pick one of {', '.join(TORCH_DTYPES)}")
    results = launch(_all_reduce_rank, nproc, list(sizes), dtype, warmup, repeats, min_rep_s, device=device,
                     timeout_s=timeout_s, time_limit_s=4 * timeout_s)
    mine = next(r for r in results if r is not None)      # under torchrun only this rank's entry is filled
    return [CommSample(b, nproc, s) for b, s in mine]


def run_microbench(device: str | None = None, dtype: str = "bf16", nproc: int = 1,
                   shapes: Sequence[tuple[int, int, int]] | None = None, sizes: Sequence[int] | None = None,
                   timeout_s: float = 60.0,
                   attention_shapes: Sequence[tuple[int, int, int, int]] | None = None) -> Microbench:
    """The all-reduces (``nproc >= 2``; first, so that ranks fork from a process without a thread pool), then
    the GEMMs and the attention cores in this process (one thread on CPU). Default grids:
    :data:`GEMM_SHAPES`, :data:`MESSAGE_BYTES`, :data:`ATTENTION_SHAPES`."""
    dev = device_of(device)
    res = Microbench(dev.type, dtype)
    if nproc >= 2:
        res.all_reduce = time_all_reduce(sizes or MESSAGE_BYTES[dev.type], nproc, dev.type, dtype,
                                         timeout_s=timeout_s)
    res.device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)
    try:
        res.gemms = time_gemms(shapes or GEMM_SHAPES[dev.type], dev, dtype)
        res.attention = time_attention(attention_shapes or ATTENTION_SHAPES[dev.type], dev, dtype)
    finally:
        torch.set_num_threads(threads)
    return res


#: cluster preset for a CUDA device name (``torch.cuda.get_device_name``), first match wins
GPU_PRESETS: tuple[tuple[str, str], ...] = (("H200", "h200"), ("H100", "h100-sxm"), ("A100", "a100-80gb"))


#: board variants whose peak differs from the SXM part of the same name (lower clocks): no preset, so the
#: caller asks for ``--peak-tflops`` instead of fitting against the wrong peak
OTHER_BOARDS = {"H100": ("PCIE", "NVL"), "H200": ("NVL",)}


def preset_for_gpu(name: str) -> str | None:
    """The cluster preset whose datasheet peak belongs to GPU ``name``, or None (unknown, or a PCIe/NVL
    board of a GPU whose preset is the SXM part)."""
    upper = name.upper()
    for key, preset in GPU_PRESETS:
        if key in upper:
            return None if any(b in upper for b in OTHER_BOARDS.get(key, ())) else preset
    return None
