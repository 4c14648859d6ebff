"""``parallel-lab memory``: the memory ledger per GPU by category, and whether the plan fits
(:mod:`parallel_lab.ledger`); ``--measure`` runs one step of the stage's rank in fake tensors beside it."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..engines import DEFAULT_ENGINE, ENGINES
from ..errors import ParallelLabError
from ..plan_flags import Output, cluster_from_args, float_in, int_in, model_from_args, plan_from_args, plan_subcommand
from ..quantities import fmt_bytes_gib
from .output import PROG, describe, echo, table


def add(sub: Any) -> None:
    p = plan_subcommand(sub, "memory", handle, "memory ledger per GPU by category, and whether it fits")
    p.add_argument("--stage", type=int_in("stage"), help="pipeline stage to report (default: the fullest one)")
    p.add_argument("--margin", type=float_in(0.0, 0.99), default=0.1,
                   help="HBM safety margin, fraction in [0, 0.99] (default 0.1)")
    p.add_argument("--measure", action="store_true",
                   help="also run one training step of the reported stage's rank at full size in fake tensors "
                        "and print measured beside predicted (torch; seconds to minutes)")
    p.add_argument("--engine", choices=ENGINES, default=DEFAULT_ENGINE,
                   help="with --measure: whose job is measured, the lab's model (lab, default) or torchtitan 0.3's "
                        "own Llama 3 job under its parallelize function (torchtitan; the titan extra)")
    p.add_argument("--alloc-conf", default="", metavar="OPTIONS",
                   help="PYTORCH_CUDA_ALLOC_CONF the reserve is modelled under, e.g. expandable_segments:True "
                        "(also max_split_size_mb:N, roundup_power2_divisions:N; default: torch's defaults)")


def reserve_lines(res: Any, hbm: float) -> list[str]:
    """The reserve beside the tensors' peak (:mod:`parallel_lab.ledger_reserve`), in three lines."""
    lo, hi = res.priors["cuda_context_range"]
    expandable = ", expandable segments" if res.config.expandable_segments else ""
    return [
        f"reserve (beside the verdict, which weighs the tensors; docs/reserve.md): tensors' peak "
        f"{fmt_bytes_gib(res.tensors_peak)} + cuBLAS workspaces {fmt_bytes_gib(res.cublas_workspace)} + allocator "
        f"{fmt_bytes_gib(res.allocator_overhead)} (segments, rounding, cached blocks{expandable}) = max reserved "
        f"{fmt_bytes_gib(res.allocator_reserved)}",
        f"outside the allocator: CUDA context ~{fmt_bytes_gib(res.cuda_context)} (prior, {lo / 1e9:g}-{hi / 1e9:g} "
        f"GB), NCCL buffers ~{fmt_bytes_gib(res.nccl_buffers)} ({res.priors['nccl_channels']} channels per "
        f"communicator, a prior)",
        f"nvidia-smi would show ~{fmt_bytes_gib(res.nvidia_smi_estimate)} of {fmt_bytes_gib(hbm)}"]


def handle(args: argparse.Namespace) -> Output:
    from ..allocator import AllocatorConfig
    from ..ledger import memory
    from ..ledger_reserve import reserve

    model = model_from_args(args)
    plan = plan_from_args(args, model)
    cluster = cluster_from_args(args)
    titan = None
    if args.engine == "torchtitan":
        titan = _measure_titan(args, model, plan)
    led = memory(model, plan, cluster, activation_model=args.activation_model or "korthikanti",
                 stage=args.stage, margin=args.margin)
    rows = [(k, fmt_bytes_gib(v)) for k, v in led.per_gpu_bytes.items()]
    rows.append(("total", fmt_bytes_gib(led.total_bytes)))
    budget = led.hbm_bytes * (1 - led.margin)
    verdict = "fits" if led.fits else "does NOT fit"
    pm = led.peak                # the sum above adds each category at its own peak; this is one moment
    peak_line = [] if pm is None else [
        f"peak at one moment: {fmt_bytes_gib(pm.peak_bytes)} ({pm.peak}"
        + (f", stage {pm.stage}" if pm.stage != led.stage else "") + f"; {pm.activation_model} activations)"]
    weighed = "its peak at one moment" if led.peak_decides else "the total"
    res = None
    if pm is not None:
        res = reserve(model, plan, cluster, pm.stage, activation_model=pm.activation_model,
                      config=AllocatorConfig.parse(args.alloc_conf))
    text = "\n".join([
        describe(model, plan),
        f"memory per GPU (pipeline stage {led.stage} of {plan.pp}):",
        table(rows, ("category", "bytes")),
        *peak_line,
        f"{verdict}: {fmt_bytes_gib(led.need_bytes)} ({weighed}) vs {fmt_bytes_gib(budget)} usable "
        f"({cluster.name} HBM {fmt_bytes_gib(led.hbm_bytes)} minus a {led.margin:.0%} margin)",
        *(reserve_lines(res, led.hbm_bytes) if res is not None else []),
        *[f"note: {n}" for n in led.notes],
    ])
    data = {**led.to_json(), **echo(model, plan)}
    if pm is not None:
        data["peak_at_one_moment"] = pm.to_json()
    data["reserve"] = res.to_json() if res is not None else None
    if titan is not None:
        data["measured_torchtitan"] = titan.to_json()
        text += _measured_text(titan)
    elif args.measure:
        from ..distributed.instruments.measure import measure

        def say(msg: str) -> None:
            print(f"{PROG} memory --measure: {msg}", file=sys.stderr, flush=True)

        for m in measure(model, plan, led.stage, progress=say):
            data.setdefault("measured", []).append(m.to_json())
            text += _measured_text(m)
    return Output(data, text)


def _measured_text(m: Any) -> str:
    """A measurement (the lab's or torchtitan's job) as printed below the ledger: title, table, notes."""
    return f"\n\n{m.title()}\n" + table(m.table_rows(fmt_bytes_gib), m.TABLE_HEADER) + "".join(
        f"\nnote: {n}" for n in m.notes)


def _measure_titan(args: argparse.Namespace, model: Any, plan: Any) -> Any:
    """``--measure --engine torchtitan``: refused (exit 2, one line) without --measure, without torchtitan, or
    for a plan torchtitan cannot run (``measure_titan`` checks both before it builds anything); else
    torchtitan's job measured (``instruments/titan_measure.py``)."""
    if not args.measure:
        raise ParallelLabError("--engine torchtitan selects whose job --measure runs; add --measure")
    from ..distributed.instruments.titan_measure import measure_titan

    def say(msg: str) -> None:
        print(f"{PROG} memory --measure --engine torchtitan: {msg}", file=sys.stderr, flush=True)

    return measure_titan(model, plan, progress=say)
