"""``parallel-lab reshard``: what moving a checkpoint from one plan to another costs (:mod:`parallel_lab.reshard`);
``--run`` does it on CPU ranks and measures."""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import ParallelLabError
from ..plan_flags import Output, check_fits_this_machine, cluster_from_args, int_in, subcommand
from .output import EXIT_RUN_TIMEOUT, PROG, RunFailed, rank_failed


def add(sub: Any) -> None:
    p = subcommand(sub, "reshard", handle,
                   "what moving a checkpoint from one plan to another costs: bytes each rank writes, reads and "
                   "moves, and the time on a cluster (--run: do it on CPU ranks and measure)")
    p.add_argument("plan_a", metavar="PLAN_A.yaml", help="the plan the checkpoint was written under")
    p.add_argument("plan_b", metavar="PLAN_B.yaml", help="the plan that loads it")
    p.add_argument("--cluster", help="cluster preset or calibrated profile for the time (default: PLAN_B's)")
    p.add_argument("--run", action="store_true", help="train --steps under A on CPU ranks, save, load under B, "
                   "train one step more; compare states bitwise and bytes with the prediction")
    p.add_argument("--steps", type=int_in("steps"), default=1, help="with --run: steps under A before saving (1)")


def handle(args: argparse.Namespace) -> Output:
    from .. import reshard
    from ..planfile import load_plan

    a, b = load_plan(args.plan_a), load_plan(args.plan_b)
    if a.model != b.model:
        raise ParallelLabError(f"{args.plan_a} is for {a.model.name}, {args.plan_b} for {b.model.name}; a checkpoint "
                               f"moves between plans of the same model")
    cluster = cluster_from_args(args) if args.cluster else b.cluster
    pred = reshard.predict(a.model, a.plan, b.plan, cluster)
    data: dict[str, Any] = {**pred.to_json(), "cluster": cluster.name}
    text = reshard.summary(pred, a.phase, b.phase)
    if args.run:
        from ..distributed.runtime.launch import LaunchTimeout, RankError
        from ..distributed.runtime.reshard_run import reshard_run

        for pf in (a, b):
            check_fits_this_machine(pf.model, pf.plan)
        try:
            res = reshard_run(a.model, a.plan, b.plan, steps=args.steps,
                              more_steps=1 if a.plan.global_batch == b.plan.global_batch else 0)
        except RankError as e:
            raise rank_failed(e, args.steps) from None
        except LaunchTimeout as e:
            raise RunFailed(f"\n{PROG} reshard: stopped: {e}", EXIT_RUN_TIMEOUT) from None
        data["measured"] = res.to_json()
        text += "\n" + res.summary()
    return Output(data, text)
