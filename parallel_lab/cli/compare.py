"""``parallel-lab compare``: train two plans on the same data and say whether their loss curves agree
(:mod:`parallel_lab.distributed.runtime.compare`)."""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import ParallelLabError
from ..plan_flags import (
    SHAPE_FLAGS,
    Output,
    check_fits_this_machine,
    float_in,
    int_in,
    model_from_args,
    plan_from_args,
    plan_subcommand,
    positive_float,
)
from ..specs import RUN_DEFAULTS
from .output import EXIT_RUN_TIMEOUT, PROG, RunFailed, rank_failed
from .run import RUN_TIMEOUT_S, add_fault_arg, check_per_op, help_for_runs


def add(sub: Any) -> None:
    p = plan_subcommand(sub, "compare", handle,
                        "train two plans on the same data and say whether their loss curves agree",
                        "Train the tiny model under plan A and plan B on the same data (same seed, global batch and "
                        "sequence length) and compare the losses step by step. A and B are plan files or "
                        "FIELD=VALUE,... over the run defaults and the plan flags given, e.g. "
                        "`parallel-lab compare dp=2 dp=1,grad_accum=2 --optimizer sgd-momentum`.")
    p.add_argument("plan_a", metavar="PLAN_A", help="a plan file, or FIELD=VALUE,... (e.g. dp=2)")
    p.add_argument("plan_b", metavar="PLAN_B", help="a plan file, or FIELD=VALUE,... (e.g. dp=1,grad_accum=2)")
    p.add_argument("--steps", type=int_in("steps"), default=3, help="optimizer steps (default 3)")
    p.add_argument("--seed", type=int_in("seed"), default=0, help="seed of the weights and the synthetic data")
    p.add_argument("--tolerance", type=float_in(0.0, 1.0, open_lo=True), default=1e-4,
                   help="largest relative loss difference at any step for the plans to agree (default 1e-4)")
    p.add_argument("--timeout", type=positive_float, default=RUN_TIMEOUT_S, metavar="SECONDS",
                   help=f"progress timeout of each run (default {RUN_TIMEOUT_S:g})")
    add_fault_arg(p, " into plan B's run")
    help_for_runs(p, "compare")


def handle(args: argparse.Namespace) -> Output:
    from ..distributed.runtime.compare import compare, plan_from_text
    from ..distributed.runtime.launch import LaunchTimeout, RankError
    from ..distributed.runtime.train import check_runnable

    check_per_op(args, "compare")
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
        raise rank_failed(e, args.steps) from None
    except LaunchTimeout as e:
        raise RunFailed(f"\n{PROG} compare: stopped: {e}", EXIT_RUN_TIMEOUT) from None
    return Output(c.to_json(), c.summary())
