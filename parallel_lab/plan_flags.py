"""The command line's building blocks, shared by ``parallel_lab/cli/`` and the app (layer 1, torch-free).

A subcommand is a handler ``args -> Output`` registered with :func:`subcommand` (which gives it ``--json``).
The shared flags (stable; documented in the README):

* model: ``--model PRESET`` | ``--layers --hidden --heads [--kv-heads --ffn --vocab --flavour
  --tied-embeddings]`` | ``--params N`` (see :func:`add_model_args`, :func:`model_from_args`);
* plan and machine: ``--seq --micro-batch --grad-accum --dp --tp --pp --cp --zero --sp --recompute
  --optimizer --schedule --interleave --dtype --cp-kind --dp-kind --bucket-mb --zero-unit --gpus
  --cluster --activation-model`` (see :func:`add_plan_args`, :func:`plan_from_args`,
  :func:`cluster_from_args`).

Every number has a range (:data:`LIMITS`), so that no single value can make a call take seconds or
gigabytes: GPUs and degrees up to 2^17, pipeline stages up to 64, layers up to 512, and so on; out of
range is an error that says the range. :func:`check_fits_this_machine` refuses, before any process
starts, a run whose ranks cannot all live on the machine it runs on.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import ParallelLabError
from .hardware import CLUSTER_PRESETS, ClusterSpec
from .inputs import LIMITS
from .optimizers import DTYPE_BYTES, OPTIMIZERS
from .quantities import fmt_bytes_gib
from .sharding import PP_SPLITS
from .specs import (
    ATTENTION_KINDS,
    CP_KINDS,
    DP_KINDS,
    MLP_KINDS,
    MODEL_PRESETS,
    RECOMPUTE,
    SCHEDULES,
    ZERO1_REDUCES,
    ZERO2_ACCUMULATES,
    ZERO_UNITS,
    ModelSpec,
    Plan,
)


@dataclass
class Output:
    """What a handler returns: ``data`` is printed for ``--json``, ``text`` otherwise."""

    data: dict[str, Any]
    text: str


def add_json_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def subcommand(sub: Any, name: str, handler: Callable[[argparse.Namespace], Output], help: str,
               description: str | None = None) -> argparse.ArgumentParser:
    """Create subcommand ``name`` running ``handler``; it always has ``--json``."""
    p = sub.add_parser(name, help=help, description=description or help)
    add_json_arg(p)
    p.set_defaults(handler=handler)
    return p


def plan_subcommand(sub: Any, name: str, handler: Callable[[argparse.Namespace], Output], help: str,
                    description: str | None = None) -> argparse.ArgumentParser:
    """:func:`subcommand` with the model flags and the plan flags (:func:`add_model_args`, :func:`add_plan_args`)."""
    p = subcommand(sub, name, handler, help, description)
    add_model_args(p)
    add_plan_args(p)
    return p


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
#: ``run`` refuses worlds over this many ranks per available core (each rank is a process with torch, and a
#: step of the tiny model takes ~0.05 s alone; 8 ranks per core already run ~8x slower per step).
MAX_RANKS_PER_CORE = 8
RANK_OVERHEAD_BYTES = 400 * 10**6   #: resident memory of one rank beyond its model state (torch, gloo, buffers)


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


positive_float = float_in(0.0, open_lo=True)


def _int_args(group: Any, **helps: str) -> None:
    """One flag ``--NAME`` (``_`` spelt ``-``) per keyword, in order: a positive whole number (:func:`int_in`)."""
    for name, text in helps.items():
        group.add_argument(f"--{name.replace('_', '-')}", type=int_in(name), help=text)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The model flags: a preset, an explicit shape, or a bare parameter count (exactly one)."""
    g = parser.add_argument_group("model (one of --model, the shape flags, or --params)")
    g.add_argument("--model", metavar="PRESET", help=f"a preset: {', '.join(MODEL_PRESETS)}")
    _int_args(g, layers="transformer blocks L", hidden="hidden size h", heads="attention heads a",
              kv_heads="key/value heads (GQA); default: heads",
              ffn="MLP width; default 4h (gpt) or Llama's 8h/3 rounded to 256", vocab="vocabulary size; default 32000")
    g.add_argument("--flavour", choices=("gpt", "llama"), help="block flavour; default gpt")
    g.add_argument("--tied-embeddings", action="store_true", default=None,
                   help="share the input embedding with the output head")
    _int_args(g, experts="mixture of experts: routed experts per block",
              top_k="experts each token is routed to (default 2)", expert_ffn="an expert's MLP width (default --ffn)")
    g.add_argument("--shared-experts", type=int, help="experts every token goes through (default 0)")
    g.add_argument("--capacity-factor", type=positive_float,
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
    _int_args(g, dp="data-parallel degree (inferred from --gpus when omitted)", tp="tensor-parallel degree",
              pp="pipeline-parallel degree (stages)", cp="context-parallel degree",
              ep="expert-parallel degree (mixture of experts; borrowed from dp: must divide dp and experts)")
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
    g.add_argument("--bucket-mb", type=positive_float, help="DDP bucket cap in MB (10^6 bytes; default 25)")
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


def flags_parser() -> argparse.ArgumentParser:
    """A parser of the model and plan flags alone (:func:`add_model_args`, :func:`add_plan_args`): the app reads
    back with it the command lines it spells, with ``parse_known_args`` (a subcommand's own flags are left)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_model_args(parser)
    add_plan_args(parser)
    return parser


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
    """Refuse, before any process starts, a run whose ranks cannot all live on the machine it runs on.

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
        raise ParallelLabError(f"the plan has {here:,} ranks on this host (dp*tp*pp*cp = {plan.dp}*{plan.tp}*"
                               f"{plan.pp}*{plan.cp}) but it runs at most {most} ({MAX_RANKS_PER_CORE} per core x "
                               f"{cores} cores); pick smaller degrees, e.g. --dp 2 --tp 2")
    per_rank = memory(model, plan, ClusterSpec.preset("cpu-gloo")).total_bytes
    need = (here + reference) * per_rank + here * RANK_OVERHEAD_BYTES
    have = available_memory_bytes()
    if need > have:
        ref = " + the one-process reference" if reference else ""
        raise ParallelLabError(f"{here} ranks{ref} need about {fmt_bytes_gib(need)} "
                               f"({here + reference} x {fmt_bytes_gib(per_rank)} by the ledger + {here} x "
                               f"{RANK_OVERHEAD_BYTES / 1e6:.0f} MB per process) but this host has "
                               f"{fmt_bytes_gib(have)} available; pick a smaller model (e.g. --model tiny-llama) or "
                               f"shard more (--zero 3, --tp, --pp)")
