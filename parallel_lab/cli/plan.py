"""``parallel-lab plan``: every valid 4-D plan for a model on N GPUs, ranked by estimated step time
(:mod:`parallel_lab.planner`); ``--save`` writes the best as a plan file."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from ..engines import DEFAULT_ENGINE, ENGINES
from ..errors import ParallelLabError
from ..hardware import CLUSTER_PRESETS
from ..inputs import LIMITS
from ..ledger import DEFAULT_CLUSTER
from ..optimizers import DTYPE_BYTES, OPTIMIZERS
from ..plan_flags import (
    Output,
    add_model_args,
    cluster_from_args,
    float_in,
    int_in,
    model_from_args,
    shorten,
    subcommand,
)
from ..sharding import PP_SPLITS
from ..specs import ATTENTION_KINDS, CP_KINDS, GB, MLP_KINDS, SCHEDULES
from .output import table


def _tokens(text: str) -> str:
    """A global batch in tokens: a whole number, optionally with K/M/G (powers of 2^10), up to 2^40."""
    from ..planner_constraints import parse_tokens

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


PLAN_HELP = (
    "Enumerate every valid (tp, cp, pp, dp, zero, micro-batch, accumulation, recompute, schedule, "
    "interleave, sp) for a model on N GPUs, drop those that do not fit (ledger, with the margin) or break "
    "divisibility, batch or node limits, estimate the step time (compute at the cluster's achievable "
    "fraction of peak + communication that cannot overlap + pipeline bubble; see parallel_lab/planner.py) "
    "and rank. The global batch is in tokens (16M = 16*2^20) or in sequences (--global-batch).")


def add(sub: Any) -> None:
    p = subcommand(sub, "plan", handle, "rank every valid 4-D plan for a model on N GPUs",
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
    g.add_argument("--engine", choices=ENGINES, default=DEFAULT_ENGINE,
                   help="what will run the plan: lab (every choice the ledger models, the default) or torchtitan "
                        "(only its schedules, FSDP for ZeRO 0/2/3, op-level selective recompute, all-gather CP, "
                        "fsdp2-mixed, flash attention; saved in the plan file)")
    g.add_argument("--cp-kind", choices=CP_KINDS, help="context parallelism (default ring; allgather under "
                   "--engine torchtitan)")
    g.add_argument("--optimizer", choices=tuple(OPTIMIZERS),
                   help="default adam-mixed (fsdp2-mixed under --engine torchtitan)")
    g.add_argument("--dtype", choices=tuple(DTYPE_BYTES), default="bf16", help="default bf16")
    g.add_argument("--margin", type=float_in(0.0, 0.99), default=0.1,
                   help="HBM safety margin, fraction in [0, 0.99] (default 0.1)")
    g.add_argument("--attention", choices=ATTENTION_KINDS,
                   help="attention kernel (default eager; flash under --engine torchtitan)")
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


def handle(args: argparse.Namespace) -> Output:
    from ..planfile import save_plan
    from ..planner import plan_search
    from ..planner_constraints import Constraints, parse_fix

    model = model_from_args(args)
    cluster = cluster_from_args(args)
    fixed = parse_fix(args.fix)
    for k, v in fixed.items():
        lo, hi = LIMITS.get(k, (None, None))
        if isinstance(v, int) and not isinstance(v, bool) and lo is not None and not lo <= v <= hi:
            raise ParallelLabError(f"--fix {k}={v} is outside [{lo:,}, {hi:,}]; e.g. --fix {k}={max(lo, 1)}")
    kw: dict[str, Any] = {"fixed": fixed, "max_tp": args.max_tp, "dtype": args.dtype, "margin": args.margin,
                          "mlp": args.mlp, "pp_split": args.pp_split, "engine": args.engine}
    kw.update({k: getattr(args, k) for k in ("cp_kind", "optimizer", "attention") if getattr(args, k) is not None})
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
    data["engine"] = args.engine
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
    if args.engine == "torchtitan":
        c = Constraints(**kw)
        lines.insert(3, f"engine torchtitan (what its trainer runs): schedules {','.join(c.schedules)}, "
                        f"zero {','.join(map(str, c.zero_stages))}, recompute {','.join(c.recompute)}, "
                        f"cp_kind {c.cp_kind}, optimizer {c.optimizer}, attention {c.attention}")
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
                       gpus=args.gpus, engine=args.engine)
        data["saved"] = {"path": args.save, "phase": pf.phase, "engine": pf.engine}
        lines.append(f"saved the best plan as {args.save} (phase {pf.phase}, engine {pf.engine})")
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
