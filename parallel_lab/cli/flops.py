"""``parallel-lab flops``: model and hardware FLOPs per optimizer step, and MFU/HFU for a measured step time
(:mod:`parallel_lab.flops`)."""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import ParallelLabError
from ..plan_flags import Output, cluster_from_args, model_from_args, plan_from_args, plan_subcommand, positive_float
from .output import describe, echo, table


def add(sub: Any) -> None:
    p = plan_subcommand(sub, "flops", handle, "model and hardware FLOPs per optimizer step (whole global batch)")
    p.add_argument("--step-time", type=positive_float, metavar="SECONDS",
                   help="measured step time; adds MFU and HFU against the cluster's peak")


def handle(args: argparse.Namespace) -> Output:
    from ..flops import CONVENTIONS, mfu, step_flops

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
