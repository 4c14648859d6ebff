"""``parallel-lab``: the command line of the lab.

    parallel-lab memory  --model llama3-8b --seq 8192 --tp 4 --dp 2
    parallel-lab comm    --layers 32 --hidden 4096 --heads 32 --seq 4096 --tp 8 --json
    parallel-lab flops   --model llama3-405b --seq 8192 --dp 128 --tp 8 --pp 16 --grad-accum 16

Every subcommand prints a readable table, or with ``--json`` one JSON object whose keys are documented in
the README (numbers unrounded: bytes, FLOPs, seconds; never NaN or Infinity). One error path: anything a
user can get wrong (a flag, a value, a model, a plan, a plan file, a file to write) prints one line
``parallel-lab CMD: error: ...`` on stderr, naming the bad value and a fix, and exits with status 2,
never a traceback. A run that fails after it started prints a short report instead (which rank, what it
was doing, how it ended, where its log is) and exits with :data:`EXIT_RUN_FAILED` (a rank died or
raised), :data:`EXIT_RUN_TIMEOUT` (no progress, or over the wall-clock limit) or 130 (Ctrl-C).

Every number has a range (:data:`LIMITS`), so that no single value can make a call take seconds or
gigabytes: GPUs and degrees up to 2^17, pipeline stages up to 64, layers up to 512, and so on; out of
range is an error that says the range. Messages are bounded (:data:`MAX_MESSAGE` characters; a long
value is shown truncated).

Adding a subcommand is one self-contained edit: write ``_add_<name>(sub)``, which calls
:func:`subcommand` (it adds ``--json``) and the shared flag helpers, and a handler ``args -> Output``;
then append ``_add_<name>`` to :data:`SUBCOMMANDS`. Handlers that need heavy imports (torch) import them
inside the handler, so that the other subcommands stay fast.

Shared flags (stable; documented in the README):

* model: ``--model PRESET`` | ``--layers --hidden --heads [--kv-heads --ffn --vocab --flavour
  --tied-embeddings]`` | ``--params N`` (see :func:`add_model_args`, :func:`model_from_args`);
* plan and machine: ``--seq --micro-batch --grad-accum --dp --tp --pp --cp --zero --sp --recompute
  --optimizer --schedule --interleave --dtype --cp-kind --dp-kind --bucket-mb --zero-unit --gpus
  --cluster --activation-model`` (see :func:`add_plan_args`, :func:`plan_from_args`,
  :func:`cluster_from_args`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .schedules.generators import SCHEDULE_NAMES, V_SCHEDULES
from .specs import (
    A100_PEAK_FLOPS,
    ATTENTION_KERNELS_A100,
    ATTENTION_KERNELS_H100,
    ATTENTION_KINDS,
    CLUSTER_PRESETS,
    CP_KINDS,
    DP_KINDS,
    DTYPE_BYTES,
    GB,
    MLP_KINDS,
    MODEL_PRESETS,
    OPTIMIZERS,
    PP_SPLITS,
    RECOMPUTE,
    RUN_DEFAULTS,
    SCHEDULES,
    ZERO1_REDUCES,
    ZERO2_ACCUMULATES,
    ZERO_UNITS,
    ClusterSpec,
    GiB,
    ModelSpec,
    ParallelLabError,
    Plan,
    attention_kernel_efficiency,
)
from .subcommands import Output, add_json_arg, subcommand  # noqa: F401  (Output: handlers' type)

PROG = "parallel-lab"
EXIT_USAGE = 2          #: bad input of any kind
EXIT_RUN_FAILED = 3     #: ``run``: a rank raised, died (signal, OOM killer) or could not start
EXIT_RUN_TIMEOUT = 4    #: ``run``: no step completed within --timeout, or over --time-limit
EXIT_INTERNAL = 70      #: a bug of parallel_lab (EX_SOFTWARE); the one line asks for a report
MAX_MESSAGE = 600       #: characters of one error line

#: Inclusive ranges of the integer flags (the bound keeps every call fast and small; see the docstring).
#: The ledger's cost grows as pp x layers (every stage's parameters, ~0.1 ms per pair here), the planner's
#: with the divisors of the GPU count: 512 layers (published models have <= 126), 64 stages and 2^17 GPUs
#: (Llama 3 405B trained on 16,384) keep each call under a second on this machine.
LIMITS: dict[str, tuple[int, int]] = {
    "layers": (1, 512), "hidden": (1, 2**20), "heads": (1, 2**16), "kv_heads": (1, 2**16),
    "ffn": (1, 2**24), "vocab": (1, 2**24), "seq": (1, 2**24), "micro_batch": (1, 2**16),
    "grad_accum": (1, 2**20), "dp": (1, 2**17), "tp": (1, 2**17), "pp": (1, 64), "cp": (1, 2**17),
    "interleave": (1, 512), "gpus": (1, 2**17), "stage": (0, 63), "global_batch": (1, 2**30),
    "stages": (1, 2**20), "microbatches": (1, 2**20), "width": (20, 10_000), "top": (1, 10_000),
    "max_tp": (1, 2**17), "steps": (1, 100_000), "seed": (0, 2**63 - 1), "zero": (0, 3),
    "experts": (1, 2**16), "top_k": (1, 2**16), "expert_ffn": (1, 2**24), "ep": (1, 2**17), "nproc": (1, 64),
}
#: Largest finite float accepted by a time or size flag (keeps sums and products finite).
MAX_FLOAT = 1e15

#: Shape flags: given together instead of --model or --params.
SHAPE_FLAGS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "flavour", "tied_embeddings", "experts",
               "top_k", "expert_ffn", "shared_experts", "capacity_factor")
#: Plan flags that map one-to-one onto :class:`Plan` fields (None = not given, Plan's default applies).
PLAN_FIELDS = ("dp", "tp", "pp", "cp", "zero", "sp", "micro_batch", "grad_accum", "seq", "recompute",
               "optimizer", "dtype", "schedule", "interleave", "cp_kind", "dp_kind", "bucket_mb", "zero_unit",
               "zero1_reduce", "zero2_accumulate", "attention", "mlp", "pp_split", "loss_chunk", "ep")
DEFAULT_CLUSTER = "h100-sxm"
#: Plan fields ``parallel-lab run`` fills when not given: CPU-sized and runnable (fp32). Its --help shows
#: these; ``distributed.runtime.run`` and the example plan files take them from here.
RUN_TIMEOUT_S = 60.0        #: ``run --timeout``: seconds without a completed step before a run counts as stuck
#: ``run`` refuses worlds over this many ranks per available core (each rank is a process with torch, and a
#: step of the tiny model takes ~0.05 s alone; 8 ranks per core already run ~8x slower per step).
MAX_RANKS_PER_CORE = 8
RANK_OVERHEAD_BYTES = 400 * 10**6   #: resident memory of one rank beyond its model state (torch, gloo, buffers)


class RunFailed(Exception):
    """A run that started and then failed: ``report`` (a few lines for the user) and the exit ``code``."""

    def __init__(self, report: str, code: int):
        super().__init__(report)
        self.report, self.code = report, code


# --------------------------------------------------------------------------------------------------
# Shared flags
# --------------------------------------------------------------------------------------------------

def shorten(value: Any, n: int = 40) -> str:
    """``repr(value)`` cut to ``n`` characters (messages never echo a whole file or a huge number)."""
    r = repr(value) if not isinstance(value, str) else repr(value[:n + 1])
    return r if len(r) <= n else r[:n - 3] + "..."


def int_in(name: str) -> Callable[[str], int]:
    """An argparse type: a whole number within ``LIMITS[name]``."""
    lo, hi = LIMITS[name]

    def parse(text: str) -> int:
        if len(text) > 30:
            raise argparse.ArgumentTypeError(f"{shorten(text)} is not a whole number in [{lo:,}, {hi:,}]")
        try:
            value = int(text)
        except ValueError:
            try:
                f = float(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{shorten(text)} is not a whole number; e.g. {max(lo, 1)}") \
                    from None
            if not (math.isfinite(f) and f == int(f)):
                raise argparse.ArgumentTypeError(f"{shorten(text)} is not a whole number; e.g. {max(lo, 1)}") \
                    from None
            value = int(f)
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{shorten(text)} is outside [{lo:,}, {hi:,}]")
        return value

    parse.__name__ = name           # argparse names the type in "invalid <name> value"
    return parse


def float_in(lo: float, hi: float = MAX_FLOAT, *, open_lo: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in ``[lo, hi]`` (``(lo, hi]`` with ``open_lo``)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{shorten(text)} is not a number") from None
        low_ok = value > lo if open_lo else value >= lo
        if not (math.isfinite(value) and low_ok and value <= hi):
            raise argparse.ArgumentTypeError(f"{shorten(text)} must be a finite number in "
                                             f"{'(' if open_lo else '['}{lo:g}, {hi:g}]")
        return value

    parse.__name__ = "number"
    return parse


def _count(text: str) -> int:
    """A positive count that may be written in float notation (``7e9``, ``6.74e9``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shorten(text)} is not a number; e.g. 7e9") from None
    if not math.isfinite(value) or value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"{shorten(text)} is not a positive whole number; e.g. 7e9")
    if value > 1e16:
        raise argparse.ArgumentTypeError(f"{shorten(text)} parameters is over 1e16; e.g. 7e9")
    return int(value)


_positive_float = float_in(0.0, open_lo=True)


def _tokens(text: str) -> str:
    """A global batch in tokens: a whole number, optionally with K/M/G (powers of 2^10), up to 2^40."""
    from .planner import parse_tokens

    t = text.strip().upper()
    try:
        num = float(t[:-1] if t[-1:] in ("K", "M", "G") else t)
    except ValueError:
        num = float("nan")
    if not (math.isfinite(num) and 0 < num <= 2**40):
        raise argparse.ArgumentTypeError(f"{shorten(text)} is not a token count; e.g. 16M (= 16*2^20 tokens) "
                                         "or 16777216")
    try:
        if parse_tokens(text) > 2**40:
            raise argparse.ArgumentTypeError(f"{shorten(text)} tokens is over 2^40")
    except ParallelLabError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The model flags: a preset, an explicit shape, or a bare parameter count (exactly one)."""
    g = parser.add_argument_group("model (one of --model, the shape flags, or --params)")
    g.add_argument("--model", metavar="PRESET", help=f"a preset: {', '.join(MODEL_PRESETS)}")
    g.add_argument("--layers", type=int_in("layers"), help="transformer blocks L")
    g.add_argument("--hidden", type=int_in("hidden"), help="hidden size h")
    g.add_argument("--heads", type=int_in("heads"), help="attention heads a")
    g.add_argument("--kv-heads", type=int_in("kv_heads"), help="key/value heads (GQA); default: heads")
    g.add_argument("--ffn", type=int_in("ffn"),
                   help="MLP width; default 4h (gpt) or Llama's 8h/3 rounded to 256")
    g.add_argument("--vocab", type=int_in("vocab"), help="vocabulary size; default 32000")
    g.add_argument("--flavour", choices=("gpt", "llama"), help="block flavour; default gpt")
    g.add_argument("--tied-embeddings", action="store_true", default=None,
                   help="share the input embedding with the output head")
    g.add_argument("--experts", type=int_in("experts"), help="mixture of experts: routed experts per block")
    g.add_argument("--top-k", type=int_in("top_k"), help="experts each token is routed to (default 2)")
    g.add_argument("--expert-ffn", type=int_in("expert_ffn"), help="an expert's MLP width (default --ffn)")
    g.add_argument("--shared-experts", type=int, help="experts every token goes through (default 0)")
    g.add_argument("--capacity-factor", type=_positive_float,
                   help="expert capacity = min(seq, ceil(factor * top_k * seq / experts)) tokens per sequence "
                        "(default 1.25)")
    g.add_argument("--params", type=_count, metavar="N",
                   help="a model known only by its parameter count (e.g. 7e9): "
                        "state memory and DP bytes only")


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    """The plan flags (one per :class:`Plan` field), ``--gpus``, ``--cluster`` and ``--activation-model``.

    Every flag defaults to None, meaning "not given": the :class:`Plan` default applies
    (dp=tp=pp=cp=1, zero 0, seq 2048, micro-batch 1, bf16, adam-mixed, 1f1b, ...).
    """
    g = parser.add_argument_group("plan")
    g.add_argument("--seq", type=int_in("seq"), help="sequence length in tokens (default 2048)")
    g.add_argument("--micro-batch", type=int_in("micro_batch"),
                   help="sequences per micro-batch per model replica (default 1)")
    g.add_argument("--grad-accum", "--microbatches", type=int_in("grad_accum"), dest="grad_accum",
                   help="micro-batches per optimizer step (= pipeline micro-batches m; default 1)")
    g.add_argument("--dp", type=int_in("dp"), help="data-parallel degree (inferred from --gpus when omitted)")
    g.add_argument("--tp", type=int_in("tp"), help="tensor-parallel degree")
    g.add_argument("--pp", type=int_in("pp"), help="pipeline-parallel degree (stages)")
    g.add_argument("--cp", type=int_in("cp"), help="context-parallel degree")
    g.add_argument("--ep", type=int_in("ep"),
                   help="expert-parallel degree (mixture of experts; borrowed from dp: must divide dp and experts)")
    g.add_argument("--zero", type=int_in("zero"), choices=(0, 1, 2, 3), help="ZeRO stage (default 0 = plain DDP)")
    g.add_argument("--sp", action="store_true", default=None, help="sequence parallelism (needs --tp >= 2)")
    g.add_argument("--recompute", choices=RECOMPUTE,
                   help="activation recomputation (Korthikanti's none/selective/full, torchtitan's op-sac)")
    g.add_argument("--optimizer", choices=tuple(OPTIMIZERS),
                   help="optimizer state layout (default adam-mixed)")
    g.add_argument("--dtype", choices=tuple(DTYPE_BYTES), help="compute dtype of activations and messages")
    g.add_argument("--schedule", choices=SCHEDULES, help="pipeline schedule (default 1f1b)")
    g.add_argument("--interleave", type=int_in("interleave"),
                   help="model chunks per stage v (needs --schedule interleaved)")
    g.add_argument("--cp-kind", choices=CP_KINDS, help="context parallelism: ring, allgather or ulysses")
    g.add_argument("--dp-kind", choices=DP_KINDS, help="DDP gradient sync: bucketed or naive")
    g.add_argument("--bucket-mb", type=_positive_float, help="DDP bucket cap in MB (10^6 bytes; default 25)")
    g.add_argument("--zero-unit", choices=ZERO_UNITS, help="ZeRO/FSDP units: per block or one root unit")
    g.add_argument("--zero1-reduce", choices=ZERO1_REDUCES,
                   help="ZeRO-1 gradients: reduce_scatter (the paper, default) or all_reduce (torch's "
                        "ZeroRedundancyOptimizer under DDP: 1.5x the bytes)")
    g.add_argument("--zero2-accumulate", choices=ZERO2_ACCUMULATES,
                   help="ZeRO-2 over micro-batches: unsharded (hold full gradients, default) or sharded "
                        "(reduce-scatter every micro-batch)")
    g.add_argument("--attention", choices=ATTENTION_KINDS,
                   help="attention kernel's saved tensors: eager (scores kept, default) or flash (q, k, v, out, lse)")
    g.add_argument("--mlp", choices=MLP_KINDS,
                   help="MLP's saved tensors: eager (every intermediate, default) or fused (first matmuls' outputs)")
    g.add_argument("--loss-chunk", type=int, metavar="TOKENS",
                   help="chunked cross-entropy fused with the LM head, TOKENS per chunk (default 0: eager logits)")
    g.add_argument("--pp-split", choices=PP_SPLITS,
                   help="pipeline split: layers (default) or embed-head (embedding and head take a layer slot each)")
    g.add_argument("--gpus", type=int_in("gpus"),
                   help="total GPUs; must equal dp*tp*pp*cp (dp is inferred if omitted)")
    g.add_argument("--cluster", metavar="PRESET", help=f"machine: {', '.join(CLUSTER_PRESETS)} "
                   f"(default {DEFAULT_CLUSTER})")
    g.add_argument("--activation-model", choices=("korthikanti", "per-op"),
                   help="activation memory: Korthikanti et al. 2022 formulas (default) or the per-op model")


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    """The :class:`ModelSpec` the flags describe; contradictory or incomplete flags raise ParallelLabError."""
    preset = getattr(args, "model", None)
    params = getattr(args, "params", None)
    shape = {f: getattr(args, f, None) for f in SHAPE_FLAGS}
    given_shape = sorted("--" + f.replace("_", "-") for f, v in shape.items() if v is not None)
    if preset is not None and (given_shape or params is not None):
        extra = given_shape + (["--params"] if params is not None else [])
        raise ParallelLabError(f"--model {preset} already fixes the shape; drop {' '.join(extra)} "
                               f"(or drop --model and give the shape flags)")
    if preset is not None:
        return ModelSpec.preset(preset)
    if params is not None:
        if given_shape:
            raise ParallelLabError(f"--params {params:g} describes a model without a shape; drop "
                                   f"{' '.join(given_shape)} or drop --params")
        return ModelSpec.from_params(params)
    missing = [f"--{f}" for f in ("layers", "hidden", "heads") if shape[f] is None]
    if missing:
        if len(missing) == 3 and not given_shape:
            raise ParallelLabError("no model given; use --model PRESET (e.g. --model llama2-7b), "
                                   "or --layers/--hidden/--heads, or --params N (e.g. --params 7e9)")
        raise ParallelLabError("an explicit shape needs --layers, --hidden and --heads; "
                               f"missing {' '.join(missing)}")
    kw: dict[str, Any] = {f: v for f, v in shape.items() if v is not None}
    kw.setdefault("flavour", "gpt")
    # A custom gpt shape gets a learned position table long enough for the requested sequence.
    seq = getattr(args, "seq", None)
    if kw["flavour"] == "gpt":
        kw["max_positions"] = max(2048, seq or 0)
    return ModelSpec(**kw)


def cluster_from_args(args: argparse.Namespace) -> ClusterSpec:
    """The :class:`ClusterSpec` preset named by ``--cluster`` (default h100-sxm), or a profile file written
    by ``parallel-lab calibrate`` (a path ending in ``.json``: the preset with its fitted step-time model)."""
    name = getattr(args, "cluster", None) or DEFAULT_CLUSTER
    if name.endswith(".json"):
        from .calibrate import load_profile

        return load_profile(name)
    return ClusterSpec.preset(name)


def plan_from_args(args: argparse.Namespace, model: ModelSpec | None = None) -> Plan:
    """The :class:`Plan` the flags describe, validated against the model (and ``--gpus``).

    When ``--gpus`` is given and ``--dp`` is not, ``dp = gpus / (tp * pp * cp)`` if that divides.
    """
    if model is None:
        model = model_from_args(args)
    kw: dict[str, Any] = {f: getattr(args, f) for f in PLAN_FIELDS if getattr(args, f, None) is not None}
    gpus = getattr(args, "gpus", None)
    if gpus is not None:
        if gpus < 1:
            raise ParallelLabError(f"--gpus {gpus} must be a positive integer")
        if "dp" not in kw:
            rest = kw.get("tp", 1) * kw.get("pp", 1) * kw.get("cp", 1)
            if gpus % rest:
                raise ParallelLabError(
                    f"--gpus {gpus} is not divisible by tp*pp*cp = {rest}, so dp cannot be inferred; "
                    f"pick --gpus a multiple of {rest} or give --dp")
            kw["dp"] = gpus // rest
    plan = Plan(**kw)
    return plan.validate(model, gpus=gpus)


# --------------------------------------------------------------------------------------------------
# Formatting
# --------------------------------------------------------------------------------------------------

def fmt_bytes(n: float) -> str:
    """``12.35 GB (11.50 GiB)``: GB = 10^9 bytes, GiB = 2^30 bytes (MB/MiB, kB/KiB below 0.1 GB, 0.1 MB)."""
    if abs(n) >= 0.1 * GB or n == 0:
        return f"{n / GB:,.2f} GB ({n / GiB:,.2f} GiB)"
    if abs(n) >= 1e5:
        return f"{n / 1e6:,.2f} MB ({n / 2**20:,.2f} MiB)"
    return f"{n / 1e3:,.2f} kB ({n / 2**10:,.2f} KiB)"


def table(rows: Sequence[Sequence[Any]], header: Sequence[str] | None = None,
          left: Sequence[int] = (0,)) -> str:
    """A plain aligned text table: columns ``left`` left-aligned (default the first), the others right."""
    all_rows = [list(map(str, r)) for r in ([header] if header else []) + list(rows)]
    if not all_rows:
        return ""
    widths = [max(len(r[i]) for r in all_rows if i < len(r)) for i in range(max(map(len, all_rows)))]
    lines = []
    for k, r in enumerate(all_rows):
        cells = [c.ljust(widths[i]) if i in left else c.rjust(widths[i]) for i, c in enumerate(r)]
        lines.append("  ".join(cells).rstrip())
        if header and k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def echo(model: ModelSpec, plan: Plan) -> dict[str, Any]:
    """The ``model`` and ``plan`` keys every JSON answer carries (what was actually computed)."""
    return {"model": {"name": model.name, "n_params": model.n_params, "shape_known": model.shape_known},
            "plan": plan.to_dict()}


def describe(model: ModelSpec, plan: Plan) -> str:
    p = plan
    return (f"{model.summary()}\nplan: dp={p.dp} tp={p.tp} pp={p.pp} cp={p.cp}"
            + (f" ep={p.ep}" if p.ep > 1 else "") + f" zero={p.zero} sp={p.sp} "
            f"seq={p.seq} micro_batch={p.micro_batch} grad_accum={p.grad_accum} recompute={p.recompute} "
            f"optimizer={p.optimizer} dtype={p.dtype} schedule={p.schedule}"
            + (f" interleave={p.interleave}" if p.interleave > 1 else "")
            + f" attention={p.attention} mlp={p.mlp}" + f" ({p.world} GPUs)")


# --------------------------------------------------------------------------------------------------
# memory
# --------------------------------------------------------------------------------------------------

def _add_memory(sub: Any) -> None:
    p = subcommand(sub, "memory", _memory, "memory ledger per GPU by category, and whether it fits")
    add_model_args(p)
    add_plan_args(p)
    p.add_argument("--stage", type=int_in("stage"), help="pipeline stage to report (default: the fullest one)")
    p.add_argument("--margin", type=float_in(0.0, 0.99), default=0.1,
                   help="HBM safety margin, fraction in [0, 0.99] (default 0.1)")
    p.add_argument("--measure", action="store_true",
                   help="also run one training step of the reported stage's rank at full size in fake tensors "
                        "and print measured beside predicted (torch; seconds to minutes)")


def _memory(args: argparse.Namespace) -> Output:
    from .ledger import memory

    model = model_from_args(args)
    plan = plan_from_args(args, model)
    cluster = cluster_from_args(args)
    led = memory(model, plan, cluster, activation_model=args.activation_model or "korthikanti",
                 stage=args.stage, margin=args.margin)
    rows = [(k, fmt_bytes(v)) for k, v in led.per_gpu_bytes.items()]
    rows.append(("total", fmt_bytes(led.total_bytes)))
    budget = led.hbm_bytes * (1 - led.margin)
    verdict = "fits" if led.fits else "does NOT fit"
    pm = led.peak                # the sum above adds each category at its own peak; this is one moment
    peak_line = [] if pm is None else [
        f"peak at one moment: {fmt_bytes(pm.peak_bytes)} ({pm.peak}"
        + (f", stage {pm.stage}" if pm.stage != led.stage else "") + f"; {pm.activation_model} activations)"]
    weighed = "its peak at one moment" if led.peak_decides else "the total"
    text = "\n".join([
        describe(model, plan),
        f"memory per GPU (pipeline stage {led.stage} of {plan.pp}):",
        table(rows, ("category", "bytes")),
        *peak_line,
        f"{verdict}: {fmt_bytes(led.need_bytes)} ({weighed}) vs {fmt_bytes(budget)} usable "
        f"({cluster.name} HBM {fmt_bytes(led.hbm_bytes)} minus a {led.margin:.0%} margin)",
        *[f"note: {n}" for n in led.notes],
    ])
    data = {**led.to_json(), **echo(model, plan)}
    if pm is not None:
        data["peak_at_one_moment"] = pm.to_json()
    if args.measure:
        from .distributed.instruments.measure import measure

        def say(msg: str) -> None:
            print(f"{PROG} memory --measure: {msg}", file=sys.stderr, flush=True)

        for m in measure(model, plan, led.stage, progress=say):
            data.setdefault("measured", []).append(m.to_json())
            text += f"\n\n{m.title()}\n" + table(m.table_rows(fmt_bytes), m.TABLE_HEADER) + "".join(
                f"\nnote: {n}" for n in m.notes)
    return Output(data, text)


# --------------------------------------------------------------------------------------------------
# comm
# --------------------------------------------------------------------------------------------------

def _add_comm(sub: Any) -> None:
    p = subcommand(sub, "comm", _comm,
                   "communication per GPU per optimizer step, by dimension and collective")
    add_model_args(p)
    add_plan_args(p)
    p.add_argument("--stage", type=int_in("stage"), help="pipeline stage to report (default: the busiest one)")


def _comm(args: argparse.Namespace) -> Output:
    from .comm import report

    model = model_from_args(args)
    plan = plan_from_args(args, model)
    cluster = cluster_from_args(args)
    rep = report(model, plan, cluster, stage=args.stage)
    rows = [(c.dim, c.kind, c.phase, f"{c.message_bytes:,}", c.group_size, c.count, fmt_bytes(c.wire_bytes),
             c.note) for c in rep.collectives]
    dims = [(d, fmt_bytes(b), f"{rep.time_s.get(d, 0.0) * 1e3:,.3f} ms", rep.tiers.get(d, ""))
            for d, b in rep.per_step_bytes.items()]
    text = "\n".join([
        describe(model, plan),
        f"collectives of one GPU (pipeline stage {rep.stage}) for one optimizer step on {cluster.name}:",
        table(rows, ("dim", "kind", "phase", "message B", "group", "count", "sent (wire)", "what"),
              left=(0, 1, 2, 7)),
        "",
        table(dims, ("dim", "sent per step", "alpha-beta time", "link"), left=(0, 3)),
    ])
    return Output({**rep.to_json(), **echo(model, plan)}, text)


# --------------------------------------------------------------------------------------------------
# flops
# --------------------------------------------------------------------------------------------------

def _add_flops(sub: Any) -> None:
    p = subcommand(sub, "flops", _flops, "model and hardware FLOPs per optimizer step (whole global batch)")
    add_model_args(p)
    add_plan_args(p)
    p.add_argument("--step-time", type=_positive_float, metavar="SECONDS",
                   help="measured step time; adds MFU and HFU against the cluster's peak")


def _flops(args: argparse.Namespace) -> Output:
    from .flops import CONVENTIONS, mfu, step_flops

    model = model_from_args(args)
    model.require_shape("FLOPs")
    plan = plan_from_args(args, model)
    cluster = cluster_from_args(args)
    rep = step_flops(model, plan)
    data = {**rep.to_json(), **echo(model, plan)}
    rows = [("model FLOPs per step (palm)", f"{rep.model_flops_per_step:.4e}"),
            ("model FLOPs per step (causal)", f"{rep.model_flops_causal_per_step:.4e}"),
            ("hardware FLOPs per step", f"{rep.hardware_flops_per_step:.4e}"),
            ("tokens per step", f"{rep.tokens_per_step:,}"),
            ("model FLOPs per token", f"{rep.model_flops_per_step / rep.tokens_per_step:.4e}")]
    if args.step_time is not None:
        floor = rep.model_flops_per_step / (plan.world * cluster.peak_flops)
        if args.step_time < floor:
            raise ParallelLabError(f"--step-time {args.step_time:g} s is shorter than the {floor:.4g} s that "
                                   f"{rep.model_flops_per_step:.3e} model FLOPs take at the peak of {plan.world:,} "
                                   f"x {cluster.name}; a measured step cannot beat the peak (MFU > 100%)")
        data["step_time_s"] = args.step_time
        data["mfu"] = mfu(model, plan, args.step_time, cluster)
        data["hfu"] = rep.hardware_flops_per_step / (args.step_time * plan.world * cluster.peak_flops)
        data["mfu_causal"] = rep.model_flops_causal_per_step / (args.step_time * plan.world * cluster.peak_flops)
        rows += [("MFU (palm)", f"{data['mfu']:.2%}"), ("MFU (causal)", f"{data['mfu_causal']:.2%}"),
                 ("HFU", f"{data['hfu']:.2%}"),
                 ("model TFLOP/s per GPU (palm)",
                  f"{rep.model_flops_per_step / args.step_time / plan.world / 1e12:,.1f}")]
    text = "\n".join([describe(model, plan), table(rows), f"palm: {rep.formula}",
                      f"causal: {CONVENTIONS['causal']}",
                      "hardware: palm plus the forward work recomputation repeats (Korthikanti et al. 2022's "
                      "HFU count; a causal kernel's own count is lower, its masked half skipped)"])
    return Output(data, text)


# --------------------------------------------------------------------------------------------------
# bubble
# --------------------------------------------------------------------------------------------------

BUBBLE_HELP = (
    "Simulate one pipeline schedule (the action lists the executor runs) and print its bubble ratio, idle "
    "fraction, in-flight micro-batches and a text timeline. Costs are per micro-batch per model chunk: F "
    "forward, B the input-gradient part of a backward, W its weight-gradient part; a backward that the "
    "schedule does not split costs B + W. Defaults F = B = W = 1 (so F = 1, full backward 2; with these "
    "GPipe and 1F1B give exactly (p-1)/m).")


def _add_bubble(sub: Any) -> None:
    p = subcommand(sub, "bubble", _bubble, "pipeline bubble and timeline of a schedule (simulated)",
                   description=BUBBLE_HELP)
    p.add_argument("--schedule", choices=SCHEDULE_NAMES, help="pipeline schedule (or --schedule-file)")
    p.add_argument("--schedule-file", metavar="FILE.csv",
                   help="a schedule in torch's pipelining CSV format (compute-only or with comms), validated")
    p.add_argument("--stages", type=int_in("stages"), metavar="P", help="pipeline stages (ranks) p")
    p.add_argument("--microbatches", type=int_in("microbatches"), metavar="M", help="micro-batches per step m")
    p.add_argument("--interleave", type=int_in("interleave"), default=1, metavar="V",
                   help="model chunks per stage v (interleaved only; default 1)")
    p.add_argument("--f", type=_positive_float, default=1.0, help="forward time per chunk (default 1)")
    p.add_argument("--b", type=_positive_float, default=1.0,
                   help="input-gradient backward time per chunk (default 1)")
    p.add_argument("--w", type=float_in(0.0), default=1.0,
                   help="weight-gradient backward time per chunk (default 1; >= 0)")
    p.add_argument("--p2p", type=float_in(0.0), default=0.0, help="time of one point-to-point message (default 0)")
    p.add_argument("--width", type=int_in("width"), default=120,
                   help="timeline width in characters (default 120)")


#: Largest p * m * v the simulator is asked for: it takes about a second there on a loaded 2-core machine
#: and grows faster than linearly. Beyond it ``bubble`` answers with the closed form only.
BUBBLE_SIM_LIMIT = 2048


def _bubble(args: argparse.Namespace) -> Output:
    from .schedules.checks import validate
    from .schedules.generators import build_schedule
    from .simulate import Costs, bubble_closed_form, simulate, text_timeline

    costs = Costs(args.f, args.b, args.w, args.p2p)
    if (args.schedule is None) == (args.schedule_file is None):
        raise ParallelLabError("give --schedule NAME (with --stages and --microbatches) or --schedule-file FILE.csv")
    if args.schedule_file is not None:
        from .schedule_csv import load

        sched = load(args.schedule_file)
        name, formula = args.schedule_file, None
    else:
        if args.stages is None or args.microbatches is None:
            raise ParallelLabError(f"--schedule {args.schedule} needs --stages P and --microbatches M")
        if args.stages * args.microbatches * args.interleave > BUBBLE_SIM_LIMIT:
            return _bubble_closed_form(args, costs)
        sched = validate(build_schedule(args.schedule, args.stages, args.microbatches, args.interleave))
        name = args.schedule
        closed = bubble_closed_form(args.schedule, args.stages, args.microbatches, args.interleave,
                                    Costs(costs.f, costs.b, costs.w))
        formula = None if closed is None else closed[0]      # these costs may have no expression
    res = simulate(sched, costs)
    data = {"schedule": name, **res.to_dict()}
    p2p_note = "" if costs.p2p == 0 else " (formula for p2p = 0)"
    data["bubble_ratio_formula"] = formula
    ratio, idle = res.bubble_lines(None if args.schedule_file else args.schedule)
    text = "\n".join([
        f"{name}: p={res.p} stages, m={res.m} micro-batches" + (f", v={res.v} chunks" if res.v > 1 else ""),
        ratio + ("" if formula is None else f"; closed form {formula:.4f}{p2p_note}"),
        idle,
        "peak in-flight (micro-batch, chunk) pairs per rank: " + " ".join(map(str, res.peak_inflight)),
        text_timeline(res, args.width),
    ])
    return Output(data, text)


def _bubble_closed_form(args: argparse.Namespace, costs: Any) -> Output:
    """``bubble`` above :data:`BUBBLE_SIM_LIMIT`: the schedule's closed form, where one applies."""
    from .simulate import bubble_closed_form

    p, m, v = args.stages, args.microbatches, args.interleave
    size = f"p*m*v = {p:,}*{m:,}*{v:,} = {p * m * v:,}"
    if args.schedule == "interleaved" and m % p:
        raise ParallelLabError(f"interleaved 1F1B runs micro-batches in groups of p={p}; m={m} is not a "
                               f"multiple of it; pick m in {{{p}, {2 * p}, {3 * p}, ...}}")
    closed = bubble_closed_form(args.schedule, p, m, v, costs)
    if closed is None:
        why = "--p2p > 0" if costs.p2p != 0 else f"{args.schedule} with these costs"
        raise ParallelLabError(f"{size} is over the simulator's limit of {BUBBLE_SIM_LIMIT:,} and {why} has no "
                               f"closed form; pick --stages x --microbatches x --interleave <= {BUBBLE_SIM_LIMIT:,}")
    formula, expression = closed
    data = {"schedule": args.schedule, "p": p, "m": m, "v": v,
            "costs": {"f": costs.f, "b": costs.b, "w": costs.w, "p2p": costs.p2p},
            "bubble_ratio": formula, "bubble_ratio_formula": formula, "simulated": False}
    text = "\n".join([
        f"{args.schedule}: p={p} stages, m={m} micro-batches" + (f", v={v} chunks" if v > 1 else ""),
        f"bubble_ratio  {formula:.4f} ({formula:.1%}) from the closed form "
        f"{expression}; {size} is over the "
        f"simulator's limit of {BUBBLE_SIM_LIMIT:,}, so no timeline is drawn",
    ])
    return Output(data, text)


# --------------------------------------------------------------------------------------------------
# plan
# --------------------------------------------------------------------------------------------------

PLAN_HELP = (
    "Enumerate every valid (tp, cp, pp, dp, zero, micro-batch, accumulation, recompute, schedule, "
    "interleave, sp) for a model on N GPUs, drop those that do not fit (ledger, with the margin) or break "
    "divisibility, batch or node limits, estimate the step time (compute at the cluster's achievable "
    "fraction of peak + communication that cannot overlap + pipeline bubble; see parallel_lab/planner.py) "
    "and rank. The global batch is in tokens (16M = 16*2^20) or in sequences (--global-batch).")


def _add_plan(sub: Any) -> None:
    p = subcommand(sub, "plan", _plan, "rank every valid 4-D plan for a model on N GPUs",
                   description=PLAN_HELP)
    add_model_args(p)
    g = p.add_argument_group("search")
    g.add_argument("--cluster", metavar="PRESET", help=f"machine: {', '.join(CLUSTER_PRESETS)} "
                   f"(default {DEFAULT_CLUSTER})")
    g.add_argument("--gpus", type=int_in("gpus"), required=True, help="number of GPUs")
    g.add_argument("--seq", type=int_in("seq"), required=True, help="sequence length in tokens")
    g.add_argument("--global-batch-tokens", metavar="TOKENS", type=_tokens,
                   help="global batch in tokens; K/M/G are 2^10/2^20/2^30 (16M = 16,777,216)")
    g.add_argument("--global-batch", type=int_in("global_batch"), metavar="N", help="global batch in sequences")
    g.add_argument("--top", type=int_in("top"), default=10, help="plans to print (default 10; --json too)")
    g.add_argument("--fix", metavar="F=V,...", help="pin Plan fields, e.g. --fix tp=8,pp=16,schedule=1f1b")
    g.add_argument("--schedules", metavar="S,...",
                   help="pipeline schedules to try (default 1f1b,interleaved,zb-h1; gpipe only when asked)")
    g.add_argument("--zero-stages", metavar="Z,...", help="ZeRO stages to try (default 0,1,2,3)")
    g.add_argument("--zero2-accumulate", metavar="A,...",
                   help="ZeRO-2 gradient accumulation to try: unsharded (full gradients until the last micro-batch, "
                        "the default), sharded (reduce-scatter every micro-batch, as FSDP), or both")
    g.add_argument("--recompute", metavar="R,...",
                   help="recompute modes to try (default none,selective,full)")
    g.add_argument("--max-tp", type=int_in("max_tp"), help="largest TP degree (default: GPUs per node)")
    g.add_argument("--cp-kind", choices=CP_KINDS, default="ring", help="context parallelism (default ring)")
    g.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adam-mixed", help="default adam-mixed")
    g.add_argument("--dtype", choices=tuple(DTYPE_BYTES), default="bf16", help="default bf16")
    g.add_argument("--margin", type=float_in(0.0, 0.99), default=0.1,
                   help="HBM safety margin, fraction in [0, 0.99] (default 0.1)")
    g.add_argument("--attention", choices=ATTENTION_KINDS, default="eager", help="attention kernel (default eager)")
    g.add_argument("--mlp", choices=MLP_KINDS, default="eager", help="MLP kernel (default eager)")
    g.add_argument("--pp-split", choices=PP_SPLITS, default="layers", help="pipeline split (default layers)")
    g.add_argument("--save", metavar="FILE", help="write the best plan as a plan file (YAML)")
    g.add_argument("--phase", help="phase name for --save (default: seq<N>), e.g. pretrain-8k")


def _split(text: str | None, cast: Callable[[str], Any] = str) -> tuple[Any, ...] | None:
    if not text:
        return None
    try:
        return tuple(cast(x.strip()) for x in text.split(",") if x.strip())
    except ValueError:
        raise ParallelLabError(f"{text!r} is not a comma-separated list of the right values") from None


def _plan(args: argparse.Namespace) -> Output:
    from .planfile import save_plan
    from .planner import Constraints, parse_fix, plan_search

    model = model_from_args(args)
    cluster = cluster_from_args(args)
    fixed = parse_fix(args.fix)
    for k, v in fixed.items():
        lo, hi = LIMITS.get(k, (None, None))
        if isinstance(v, int) and not isinstance(v, bool) and lo is not None and not lo <= v <= hi:
            raise ParallelLabError(f"--fix {k}={v} is outside [{lo:,}, {hi:,}]; e.g. --fix {k}={max(lo, 1)}")
    kw: dict[str, Any] = {"fixed": fixed, "max_tp": args.max_tp, "cp_kind": args.cp_kind,
                          "optimizer": args.optimizer, "dtype": args.dtype, "margin": args.margin,
                          "attention": args.attention, "mlp": args.mlp, "pp_split": args.pp_split}
    for name, text, cast in (("schedules", args.schedules, str), ("zero_stages", args.zero_stages, int),
                             ("recompute", args.recompute, str),
                             ("zero2_accumulate", args.zero2_accumulate, str)):
        if _split(text, cast):
            kw[name] = _split(text, cast)
    bad = [s for s in kw.get("schedules", ()) if s not in SCHEDULES]
    if bad:
        raise ParallelLabError(f"--schedules {bad}: pick from {', '.join(SCHEDULES)}")
    if args.global_batch is None and args.global_batch_tokens is None:
        raise ParallelLabError("give the global batch: --global-batch-tokens 16M or --global-batch N "
                               "(sequences)")
    res = plan_search(model, cluster, args.gpus, args.seq, global_batch=args.global_batch,
                      global_batch_tokens=args.global_batch_tokens, constraints=Constraints(**kw))
    data = res.to_json(args.top)
    shown, dropped = res.top(args.top), res.dropped_at_peak(args.top)
    rows = []
    for i, e in enumerate(shown):
        f = e.fields
        sched = "-" if f["pp"] == 1 else \
            f["schedule"] + (f" v={f['interleave']}" if f["interleave"] > 1 else "")
        ex = e.exposed_s
        zero = f"{f['zero']}s" if f.get("zero2_accumulate") == "sharded" else f["zero"]     # s: FSDP's per-mb RS
        dp_cell = f["dp"] if f.get("ep", 1) == 1 else f"{f['dp']} (ep {f['ep']})"
        rows.append((i + 1, dp_cell, f["tp"], f["pp"], f["cp"], zero, "sp" if f["sp"] else "",
                     f["micro_batch"], f["grad_accum"], f["recompute"], sched,
                     f"{e.need_bytes / GB:,.3g}", f"{e.headroom_bytes / GB:,.3g}", f"{e.step_time_s:,.4g}",
                     f"{e.mfu:.1%}", f"{e.bubble_ratio:.3f}",
                     " ".join(f"{d}={ex[d] * 1e3:,.0f}" for d in ("tp", "cp", "pp", "dp", "ep") if ex.get(d))))
    lines = [
        model.summary(),
        f"{args.gpus:,} x {cluster.name}, seq {args.seq:,}, global batch {res.global_batch:,} sequences "
        f"= {res.global_batch * args.seq:,} tokens; {res.families} families, {res.candidates:,} candidates, "
        f"{len(res.estimates):,} fit by their totals; searched in {res.elapsed_s:.2f} s",
        table(rows, ("#", "dp", "tp", "pp", "cp", "zero", "sp", "mb", "m", "recompute", "schedule", "mem GB",
                     "free GB", "step s", "MFU", "bubble", "exposed comm (ms)"), left=(6, 9, 10, 16)),
        "rejected families: " + (", ".join(f"{k} {v}" for k, v in res.rejected.items()) or "none"),
    ]
    if not shown and res.estimates:            # nothing to tabulate: say why instead of an empty table
        lines[2] = (f"every one of the {len(dropped):,} plans checked fits by its total but not at its peak at "
                    f"one moment (memory's verdict)")
        dropped_note = "checked"
    else:
        dropped_note = "ranked among these"
    if any(e.fields.get("zero2_accumulate") == "sharded" for e in shown):
        lines.insert(-1, "zero 2s: ZeRO-2 reduce-scattering every micro-batch (zero2_accumulate=sharded)")
    if dropped:
        lines.insert(-1, f"left out: {len(dropped)} plan{'s' * (len(dropped) > 1)} {dropped_note} that "
                         f"{'fit by their totals' if len(dropped) > 1 else 'fits by its total'} but not at "
                         f"{'their peaks' if len(dropped) > 1 else 'its peak'} at one moment ("
                         + ", ".join(f"{_plan_degrees(e)} {e.need_bytes / GB:,.3g} GB" for e in dropped[:3])
                         + (", ..." if len(dropped) > 3 else "") + ")")
    if res.scan_stopped(args.top):
        lines.insert(-1, f"checked the first {res.scan_limit(args.top):,} of the {len(res.estimates):,} plans that fit "
                         f"by their totals at their peak at one moment: {len(shown)} fit; the rest are unchecked")
    if not shown:
        lines.append("no plan fits: allow more GPUs, recomputation, ZeRO, or a smaller micro-batch")
    if args.save:
        if not shown:
            raise ParallelLabError("no plan fits, so there is nothing to --save")
        pf = save_plan(args.save, model, cluster, shown[0].plan, phase=args.phase or f"seq{args.seq}",
                       gpus=args.gpus)
        data["saved"] = {"path": args.save, "phase": pf.phase}
        lines.append(f"saved the best plan as {args.save} (phase {pf.phase})")
    return Output(data, "\n".join(lines))


def _plan_degrees(e: Any) -> str:
    """``dp 32 pp 2 zero 3 mb 1 selective 1f1b``: enough of a planner row to tell it from its neighbours."""
    f = e.fields
    out = " ".join(f"{k} {f[k]}" for k in ("dp", "tp", "pp", "cp", "zero", "micro_batch")
                   if f[k] != 1 or k in ("dp", "zero", "micro_batch")).replace("micro_batch", "mb")
    out += " sp" * bool(f["sp"]) + f" {f['recompute']}"
    if f["pp"] > 1:
        out += f" {f['schedule']}" + (f" v={f['interleave']}" if f["interleave"] > 1 else "")
    return out


# --------------------------------------------------------------------------------------------------
# run (the runnable core; imports torch only when chosen)
# --------------------------------------------------------------------------------------------------

def _add_run(sub: Any) -> None:
    p = subcommand(sub, "run", _run,
                   "train the tiny model under a plan on CPU processes (or GPUs) and compare measured "
                   "with predicted: losses, parameters, bytes per dim, memory per category")
    add_model_args(p)
    add_plan_args(p)
    p.add_argument("--plan", dest="plan_file", metavar="FILE",
                   help="a plan file (YAML, see parallel-lab plan); flags given as well override its fields")
    p.add_argument("--steps", type=int_in("steps"), default=3, help="optimizer steps (default 3)")
    p.add_argument("--seed", type=int_in("seed"), default=0, help="seed of the weights and the synthetic data")
    p.add_argument("--packed", action="store_true",
                   help="pack several documents per sequence (document masks)")
    p.add_argument("--timeout", type=_positive_float, default=RUN_TIMEOUT_S, metavar="SECONDS",
                   help="progress timeout: when no rank completes a step for this long the run is stopped and "
                        f"the stuck rank named (default {RUN_TIMEOUT_S:g})")
    p.add_argument("--time-limit", type=_positive_float, metavar="SECONDS",
                   help="optional wall-clock limit of the whole run (default: none)")
    _add_fault_arg(p)
    for action in p._actions:
        if action.dest == "schedule":     # run also executes the V schedules as action lists
            action.choices = (*SCHEDULES, *V_SCHEDULES)
            action.help = (f"{action.help}; run also takes {' and '.join(V_SCHEDULES)} (a pipeline alone, "
                           "2 chunks per rank in a V)")
    _help_for_runs(p, "run")


def _help_for_runs(p: argparse.ArgumentParser, command: str) -> None:
    """``--help`` of a command that trains the tiny model shows the defaults it really uses (RUN_DEFAULTS,
    not Plan's) and that its predictions use the per-op activation model."""
    for action in p._actions:
        if action.dest in RUN_DEFAULTS and action.help:
            base = re.sub(r"\s*\(default [^)]*\)", "", action.help)
            action.help = f"{base} (default for {command}: {RUN_DEFAULTS[action.dest]})"
        if action.dest == "activation_model":
            action.help = (f"{command} predicts activations with the per-op model only (the tensors the runnable "
                           "blocks save); korthikanti is for `memory`")


def _check_per_op(args: argparse.Namespace, command: str) -> None:
    if getattr(args, "activation_model", None) not in (None, "per-op"):
        raise ParallelLabError(
            f"--activation-model {args.activation_model}: {command} compares what the ranks save with the per-op "
            "model (the runnable blocks' own tensors), the only model it can measure; drop the flag, or use "
            f"`parallel-lab memory --activation-model {args.activation_model}` for the formulas")


def _fault(text: str) -> Any:
    from .distributed.runtime.faults import Fault

    try:
        return Fault.parse(text)
    except ParallelLabError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_fault_arg(p: argparse.ArgumentParser, which: str = "") -> None:
    p.add_argument("--inject-fault", dest="faults", type=_fault, action="append", default=[],
                   metavar="KIND:RANK[:STEP]",
                   help=f"inject a fault{which} (repeatable): die, hang, slow or nan on RANK from STEP (1-based, "
                        "default 1), or unscaled-accum (every rank: micro-batch gradients not divided by "
                        "grad_accum); see parallel_lab/distributed/runtime/faults.py")


def _plan_from_file(path: str) -> tuple[ModelSpec | None, Plan]:
    import importlib.util

    if importlib.util.find_spec("parallel_lab.planfile") is None:
        raise ParallelLabError(f"--plan {path}: plan files need parallel_lab/planfile.py, which is not in "
                               "this version; give the plan as flags (--dp, --tp, ...)")
    from .planfile import load_plan  # type: ignore[attr-defined]

    loaded: Any = load_plan(path)
    if isinstance(loaded, Plan):
        return None, loaded
    plan = loaded.get("plan") if isinstance(loaded, dict) else getattr(loaded, "plan", None)
    model = loaded.get("model") if isinstance(loaded, dict) else getattr(loaded, "model", None)
    if not isinstance(plan, Plan):
        raise ParallelLabError(f"--plan {path}: the file did not give a plan")
    return (model if isinstance(model, ModelSpec) else None), plan


def _run(args: argparse.Namespace) -> Output | None:
    from .distributed.runtime.launch import LaunchTimeout, RankError
    from .distributed.runtime.run import run
    from .distributed.runtime.train import check_runnable

    _check_per_op(args, "run")
    no_model = args.model is None and args.params is None and all(
        getattr(args, f, None) is None for f in SHAPE_FLAGS)
    file_model, plan = (None, None)
    if args.plan_file is not None:
        file_model, plan = _plan_from_file(args.plan_file)
    if no_model:
        args.model = None if file_model is not None else "tiny-llama"
    model = file_model if (no_model and file_model is not None) else model_from_args(args)
    v_schedule = args.schedule if args.schedule in V_SCHEDULES else None
    if v_schedule is not None:        # action lists, not a Plan.schedule (distributed/run.check_schedule)
        args.schedule = None
    if plan is None:
        for name, value in RUN_DEFAULTS.items():
            if getattr(args, name, None) is None:
                setattr(args, name, value)
        plan = plan_from_args(args, model)
    else:
        given = {f: getattr(args, f) for f in PLAN_FIELDS if getattr(args, f, None) is not None}
        plan = plan.with_(**given).validate(model)
    check_runnable(model, plan)
    if v_schedule is not None:
        from .distributed.runtime.run import check_schedule

        check_schedule(model, plan, v_schedule)
    check_fits_this_machine(model, plan)
    try:
        rep = run(model, plan, steps=args.steps, seed=args.seed, packed=args.packed, timeout_s=args.timeout,
                  time_limit_s=args.time_limit, progress=True, schedule=v_schedule, faults=args.faults)
    except RankError as e:
        raise _rank_failed(e, args.steps) from None
    except LaunchTimeout as e:
        raise RunFailed(f"\n{PROG} run: stopped: {e}\n  if steps of this plan really take longer, raise "
                        f"--timeout (now {args.timeout:g} s)", EXIT_RUN_TIMEOUT) from None
    if rep is None:                                  # a torchrun rank other than 0: rank 0 prints the report
        return None
    data = {**rep.to_json(), "predicted_activation_model": "per-op"}
    note = ("predicted activations: the per-op model of the tensors saved for backward "
            "(parallel_lab/activations.py; `parallel-lab memory --activation-model per-op`), not the "
            "Korthikanti formulas that `memory` uses by default")
    return Output(data, rep.summary() + "\n" + note)


def _rank_failed(e: Any, steps: int) -> Exception:
    """The short report of a rank that raised or died (or a one-line error when the rank found bad input)."""
    if e.exc_type == "ParallelLabError":
        return ParallelLabError(f"rank {e.rank}: {e.last_line.split(':', 1)[-1].strip()}")
    done = "before its first step" if not e.step else f"after step {e.step} of {steps}"
    if e.signal is not None:
        how = f"was killed by signal {e.signal}" + (" (SIGKILL: kill -9 or the out-of-memory killer)"
                                                    if e.signal == 9 else "")
    elif e.exc_type is None:
        how = e.last_line.replace("process ", "", 1)
    else:
        line = re.sub(rf"^[\w.]*\.{re.escape(e.exc_type)}:", f"{e.exc_type}:", e.last_line)   # drop the module path
        how = f"raised {bounded(line, 300)}"
    log = (f"its traceback: {e.log}" if e.log else
           "it left no traceback (its own output, if any, is above)")
    doing = f"\n  its last action: {e.last_action}" if getattr(e, "last_action", None) else ""
    return RunFailed(f"\n{PROG} run: failed: rank {e.rank} {how} {done}; the other ranks were stopped{doing}\n"
                     f"  {log}", EXIT_RUN_FAILED)


# --------------------------------------------------------------------------------------------------
# compare (two plans, the same data: do the loss curves agree?)
# --------------------------------------------------------------------------------------------------

def _add_compare(sub: Any) -> None:
    p = subcommand(sub, "compare", _compare,
                   "train two plans on the same data and say whether their loss curves agree",
                   "Train the tiny model under plan A and plan B on the same data (same seed, global batch and "
                   "sequence length) and compare the losses step by step. A and B are plan files or "
                   "FIELD=VALUE,... over the run defaults and the plan flags given, e.g. "
                   "`parallel-lab compare dp=2 dp=1,grad_accum=2 --optimizer sgd-momentum`.")
    p.add_argument("plan_a", metavar="PLAN_A", help="a plan file, or FIELD=VALUE,... (e.g. dp=2)")
    p.add_argument("plan_b", metavar="PLAN_B", help="a plan file, or FIELD=VALUE,... (e.g. dp=1,grad_accum=2)")
    add_model_args(p)
    add_plan_args(p)
    p.add_argument("--steps", type=int_in("steps"), default=3, help="optimizer steps (default 3)")
    p.add_argument("--seed", type=int_in("seed"), default=0, help="seed of the weights and the synthetic data")
    p.add_argument("--tolerance", type=float_in(0.0, 1.0, open_lo=True), default=1e-4,
                   help="largest relative loss difference at any step for the plans to agree (default 1e-4)")
    p.add_argument("--timeout", type=_positive_float, default=RUN_TIMEOUT_S, metavar="SECONDS",
                   help=f"progress timeout of each run (default {RUN_TIMEOUT_S:g})")
    _add_fault_arg(p, " into plan B's run")
    _help_for_runs(p, "compare")


def _compare(args: argparse.Namespace) -> Output:
    from .distributed.runtime.compare import compare, plan_from_text
    from .distributed.runtime.launch import LaunchTimeout, RankError
    from .distributed.runtime.train import check_runnable

    _check_per_op(args, "compare")
    if args.model is None and args.params is None and all(getattr(args, f, None) is None for f in SHAPE_FLAGS):
        args.model = "tiny-llama"
    model = model_from_args(args)
    for name, value in RUN_DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    base = plan_from_args(args, model)
    plans = []
    for text in (args.plan_a, args.plan_b):
        file_model, plan = plan_from_text(text, base)
        if file_model is not None and file_model != model:
            raise ParallelLabError(f"plan file {text} is for {file_model.summary()}; compare trains "
                                   f"{model.summary()}: give --model or a FIELD=VALUE plan")
        check_runnable(model, plan.validate(model))
        check_fits_this_machine(model, plan)
        plans.append(plan)
    try:
        c = compare(model, plans[0], plans[1], steps=args.steps, seed=args.seed, tolerance=args.tolerance,
                    faults_b=args.faults, timeout_s=args.timeout)
    except RankError as e:
        raise _rank_failed(e, args.steps) from None
    except LaunchTimeout as e:
        raise RunFailed(f"\n{PROG} compare: stopped: {e}", EXIT_RUN_TIMEOUT) from None
    return Output(c.to_json(), c.summary())


def available_memory_bytes() -> int:
    """Memory this process may still use: MemAvailable, or the cgroup's limit minus its use if smaller."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            room = int(limit) - used
            avail = room if avail is None else min(avail, room)
    except (OSError, ValueError):
        pass
    return avail if avail is not None else 2**62


def check_fits_this_machine(model: ModelSpec, plan: Plan) -> None:
    """Refuse, before any process starts, a run whose ranks cannot all live on this machine.

    World: at most :data:`MAX_RANKS_PER_CORE` ranks per available core. Memory: the ledger's bytes of
    the fullest rank (cluster ``cpu-gloo``) for each of ``world`` ranks plus the one-process reference,
    plus :data:`RANK_OVERHEAD_BYTES` per rank, against :func:`available_memory_bytes`.
    """
    model.require_shape("training it on CPU ranks")
    from .cluster_job import ranks_on_this_machine
    from .ledger import memory

    here, reference = ranks_on_this_machine(plan.world)     # under torchrun: this node's ranks only
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    most = MAX_RANKS_PER_CORE * cores
    if here > most:
        raise ParallelLabError(f"the plan has {here:,} ranks on this machine (dp*tp*pp*cp = {plan.dp}*{plan.tp}*"
                               f"{plan.pp}*{plan.cp}) but it runs at most {most} ({MAX_RANKS_PER_CORE} per core x "
                               f"{cores} cores); pick smaller degrees, e.g. --dp 2 --tp 2")
    per_rank = memory(model, plan, ClusterSpec.preset("cpu-gloo")).total_bytes
    need = (here + reference) * per_rank + here * RANK_OVERHEAD_BYTES
    have = available_memory_bytes()
    if need > have:
        ref = " + the one-process reference" if reference else ""
        raise ParallelLabError(f"{here} ranks{ref} need about {fmt_bytes(need)} "
                               f"({here + reference} x {fmt_bytes(per_rank)} by the ledger + {here} x "
                               f"{RANK_OVERHEAD_BYTES / 1e6:.0f} MB per process) but this machine has "
                               f"{fmt_bytes(have)} available; pick a smaller model (e.g. --model tiny-llama) or "
                               f"shard more (--zero 3, --tp, --pp)")


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------

def _add_calibrate(sub: Any) -> None:
    p = subcommand(sub, "calibrate", _calibrate, "fit the step-time model to measured runs; write a profile",
                   description="Fit the roofline step-time model (matmul efficiency; with runs of several token "
                               "counts also the per-micro-batch overhead) to runs measured on a cluster, or with "
                               "--microbench to GEMMs and all-reduces timed on this machine, and write a profile "
                               "file that --cluster PROFILE.json gives to plan and the other commands.")
    p.add_argument("--runs", metavar="FILE",
                   help="CSV or YAML of runs (see parallel_lab/calibrate.py)")
    p.add_argument("--cluster", metavar="PRESET",
                   help=f"the cluster the runs were measured on, or a profile file (default {DEFAULT_CLUSTER}; "
                        "with --microbench on cpu: cpu-gloo, on cuda: the preset of the GPU's name)")
    p.add_argument("--out", metavar="PROFILE.json", help="where to write the profile (default: print only)")
    p.add_argument("--fit-on", metavar="ROWS",
                   help="fit to these runs only, 1-based and comma-separated (e.g. 2); every run is still compared "
                        "(default: fit to all)")
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
                        + " of peak; specs.ATTENTION_KERNELS; default: the --cluster profile's, else fa2's)")
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


def _calibrate(args: argparse.Namespace) -> Output:
    from .calibrate import fit_profile, load_runs, profile_to_json, with_attention_kernel

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
        raise ParallelLabError("--no-fit compares with a profile: give --cluster PROFILE.json")
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
    """``calibrate --microbench``: time GEMMs and all-reduces on this machine, fit, print, write the profile."""
    if args.runs or args.no_fit or args.flops_convention or args.attention_kernel or args.fit_on is not None:
        raise ParallelLabError("--microbench measures here: drop --runs, --fit-on, --no-fit, --flops-convention "
                               "and --attention-kernel")
    from .calibrate import fit_microbench, microbench_to_json
    from .distributed.instruments.microbench import device_of, preset_for_gpu, run_microbench, visible_gpus
    from .distributed.runtime.launch import LaunchTimeout, RankError
    from .flops import ATTENTION_FWD_BWD

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
        raise _rank_failed(e, 1) from None
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
        lines.append(table([(fmt_bytes(s.message_bytes), f"{s.seconds * 1e6:,.1f}",
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


#: One registrar per subcommand, in the order ``--help`` lists them. To add a subcommand, append yours.
#: (``bubble`` and ``plan``: schedules/planner; ``run``: the runnable core, importing torch in its handler.)
def _add_launch(sub: Any) -> None:
    p = subcommand(sub, "launch", _launch,
                   "turn a plan file into the job a cluster runs: per-node torchrun command, sbatch script, "
                   "torchtitan flags")
    p.add_argument("plan_file", metavar="PLAN.yaml", help="a plan file (see parallel-lab plan --save)")
    p.add_argument("--torchrun", action="store_true", help="print the torchrun command of every node (default)")
    p.add_argument("--slurm", action="store_true", help="print (or --out: write) an sbatch script")
    p.add_argument("--out", metavar="FILE", help="with --slurm: write the script to FILE")
    p.add_argument("--entry", choices=("parallel-lab", "torchtitan"), default="parallel-lab",
                   help="what each rank runs: the lab's `parallel_lab run --plan` or torchtitan's trainer")
    p.add_argument("--rdzv-endpoint", metavar="HOST[:PORT]",
                   help="the c10d rendezvous, spelled as torchrun spells it (default: $HEAD_NODE, the first node "
                        "of the allocation, port 29500)")
    p.add_argument("--rdzv-port", dest="port", type=int, default=None,
                   help="only the rendezvous port (default 29500; or give it in --rdzv-endpoint)")
    p.add_argument("--torchtitan-config", metavar="MODULE:CONFIG",
                   help="torchtitan's --module and --config (default: from the model preset, e.g. llama3:llama3_8b)")
    p.add_argument("--time", default="04:00:00", help="sbatch --time (default 04:00:00)")
    p.add_argument("--partition", help="sbatch --partition")


def _launch(args: argparse.Namespace) -> Output:
    from . import cluster_job
    from .planfile import load_plan

    pf = load_plan(args.plan_file)
    head, port = cluster_job.rendezvous(args.rdzv_endpoint, args.port)
    job = cluster_job.job_of(pf, port)
    cmd = cluster_job.torchrun_command(pf, args.plan_file, entry=args.entry, port=port, head=head or "$HEAD_NODE",
                                       config=args.torchtitan_config)
    data: dict[str, Any] = {"nodes": job.nodes, "gpus_per_node": job.gpus_per_node, "world": job.world,
                            "entry": args.entry, "torchrun": cmd}
    try:
        data["torchtitan_flags"] = cluster_job.torchtitan_flags(pf)
    except ParallelLabError as e:
        data["torchtitan_flags"] = None
        data["torchtitan_note"] = str(e)
    data["torchtitan_notes"] = cluster_job.torchtitan_notes(pf, args.torchtitan_config)
    lines = [f"{pf.phase}: {job.nodes} node(s) x {job.gpus_per_node} GPUs ({pf.cluster.name}), "
             f"c10d rendezvous on {head or 'the head node'}, port {job.port}"]
    if args.slurm:
        script = cluster_job.sbatch_script(pf, args.plan_file, entry=args.entry, port=port, time=args.time,
                                           partition=args.partition, config=args.torchtitan_config, head=head)
        data["sbatch"] = script
        if args.out:
            with open(args.out, "w") as f:
                f.write(script)
            lines.append(f"wrote {args.out}: sbatch {args.out}")
        else:
            lines.append(script.rstrip())
    if args.entry == "torchtitan":
        lines += [f"note: {n}" for n in data["torchtitan_notes"]]
    if args.torchrun or not args.slurm:
        where = "" if head else ", HEAD_NODE = the first node's address"
        lines += [f"on every node, the same line (c10d numbers the nodes{where}):", "  " + cmd]
    return Output(data, "\n".join(lines))


def _add_reshard(sub: Any) -> None:
    p = subcommand(sub, "reshard", _reshard,
                   "what moving a checkpoint from one plan to another costs: bytes each rank writes, reads and "
                   "moves, and the time on a cluster (--run: do it on CPU ranks and measure)")
    p.add_argument("plan_a", metavar="PLAN_A.yaml", help="the plan the checkpoint was written under")
    p.add_argument("plan_b", metavar="PLAN_B.yaml", help="the plan that loads it")
    p.add_argument("--cluster", help="cluster preset or calibrated profile for the time (default: PLAN_B's)")
    p.add_argument("--run", action="store_true", help="train --steps under A on CPU ranks, save, load under B, "
                   "train one step more; compare states bitwise and bytes with the prediction")
    p.add_argument("--steps", type=int_in("steps"), default=1, help="with --run: steps under A before saving (1)")


def _reshard(args: argparse.Namespace) -> Output:
    from . import reshard
    from .planfile import load_plan

    a, b = load_plan(args.plan_a), load_plan(args.plan_b)
    if a.model != b.model:
        raise ParallelLabError(f"{args.plan_a} is for {a.model.name}, {args.plan_b} for {b.model.name}; a checkpoint "
                               f"moves between plans of the same model")
    cluster = cluster_from_args(args) if args.cluster else b.cluster
    pred = reshard.predict(a.model, a.plan, b.plan, cluster)
    data: dict[str, Any] = {**pred.to_json(), "cluster": cluster.name}
    text = reshard.summary(pred, a.phase, b.phase)
    if args.run:
        from .distributed.runtime.launch import LaunchTimeout, RankError
        from .distributed.runtime.reshard_run import reshard_run

        for pf in (a, b):
            check_fits_this_machine(pf.model, pf.plan)
        try:
            res = reshard_run(a.model, a.plan, b.plan, steps=args.steps,
                              more_steps=1 if a.plan.global_batch == b.plan.global_batch else 0)
        except RankError as e:
            raise _rank_failed(e, args.steps) from None
        except LaunchTimeout as e:
            raise RunFailed(f"\n{PROG} reshard: stopped: {e}", EXIT_RUN_TIMEOUT) from None
        data["measured"] = res.to_json()
        text += "\n" + res.summary()
    return Output(data, text)


from parallel_lab.grading.cli import add_grade  # noqa: E402 - `grade` (parallel_lab/grading/cli.py)

SUBCOMMANDS: list[Callable[[Any], None]] = [_add_memory, _add_comm, _add_flops, _add_bubble, _add_plan,
                                            _add_run, _add_compare, _add_launch, _add_calibrate, _add_reshard,
                                            add_grade]


class Parser(argparse.ArgumentParser):
    """argparse with the lab's one-line errors: ``parallel-lab CMD: error: ...`` and exit 2 (no usage dump)."""

    def error(self, message: str) -> Any:   # type: ignore[override]
        hint = f"; see {self.prog} --help"
        print(f"{self.prog}: error: {bounded(message, MAX_MESSAGE - len(self.prog) - len(hint))}{hint}",
              file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def bounded(message: str, n: int = MAX_MESSAGE) -> str:
    """One line of at most ``n`` characters; a word over 60 characters (a pasted value) is cut to 40."""
    one = " ".join(w if len(w) <= 60 else w[:40] + "..." for w in str(message).split())
    return one if len(one) <= n else one[:n - 3] + "..."


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog=PROG,
        description="parallel_lab: memory, communication and FLOPs of multi-GPU LLM training plans.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in SUBCOMMANDS:
        register(sub)
    return parser


def _jsonable(x: Any) -> Any:
    """Plain JSON types: string keys, lists for tuples."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 2 invalid input, 3/4 a failed or stuck run, 130 Ctrl-C)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    where = f"{PROG} {args.command}"
    try:
        out = args.handler(args)
        if out is None:                                  # nothing to print (torchrun ranks other than 0)
            return 0
        text = json.dumps(_jsonable(out.data), indent=2, allow_nan=False) if args.json else out.text
    except ParallelLabError as e:
        print(f"{where}: error: {bounded(str(e))}", file=sys.stderr)
        return EXIT_USAGE
    except RunFailed as e:
        print(e.report, file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print(f"\n{where}: interrupted (Ctrl-C); every process it started was stopped", file=sys.stderr)
        return 130
    except (MemoryError, RecursionError) as e:
        print(f"{where}: error: the input is too large to compute ({type(e).__name__}); use smaller "
              f"values", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:                               # a bug: still one line, and a distinct status
        print(f"{where}: internal error: {bounded(f'{type(e).__name__}: {e}', 300)}; please report it "
              f"with the command line", file=sys.stderr)
        return EXIT_INTERNAL
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:                                 # e.g. `parallel-lab comm ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
