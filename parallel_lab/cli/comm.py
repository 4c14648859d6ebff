"""``parallel-lab comm``: the collectives of one GPU for one optimizer step, by dimension, and their alpha-beta
time (:mod:`parallel_lab.comm`)."""

from __future__ import annotations

import argparse
from typing import Any

from ..plan_flags import Output, cluster_from_args, int_in, model_from_args, plan_from_args, plan_subcommand
from ..quantities import fmt_bytes_gib
from .output import describe, echo, table


def add(sub: Any) -> None:
    p = plan_subcommand(sub, "comm", handle,
                        "communication per GPU per optimizer step, by dimension and collective")
    p.add_argument("--stage", type=int_in("stage"), help="pipeline stage to report (default: the busiest one)")


def handle(args: argparse.Namespace) -> Output:
    from ..comm import report

    model = model_from_args(args)
    plan = plan_from_args(args, model)
    cluster = cluster_from_args(args)
    rep = report(model, plan, cluster, stage=args.stage)
    rows = [(c.dim, c.kind, c.phase, f"{c.message_bytes:,}", c.group_size, c.count, fmt_bytes_gib(c.wire_bytes),
             c.note) for c in rep.collectives]
    dims = [(d, fmt_bytes_gib(b), f"{rep.time_s.get(d, 0.0) * 1e3:,.3f} ms", rep.tiers.get(d, ""))
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
