"""``parallel-lab bubble``: one pipeline schedule simulated (:mod:`parallel_lab.simulate`): bubble ratio, idle
fraction, in-flight micro-batches and a text timeline; above :data:`BUBBLE_SIM_LIMIT` the closed form."""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import ParallelLabError
from ..plan_flags import Output, float_in, int_in, positive_float, subcommand
from ..schedules.generators import SCHEDULE_NAMES


def add(sub: Any) -> None:
    p = subcommand(sub, "bubble", handle, "pipeline bubble and timeline of a schedule (simulated)", description=(
        "Simulate one pipeline schedule (the action lists the executor runs) and print its bubble ratio, idle "
        "fraction, in-flight micro-batches and a text timeline. Costs are per micro-batch per model chunk: F "
        "forward, B the input-gradient part of a backward, W its weight-gradient part; a backward that the "
        "schedule does not split costs B + W. Defaults F = B = W = 1 (so F = 1, full backward 2; with these "
        "GPipe and 1F1B give exactly (p-1)/m)."))
    p.add_argument("--schedule", choices=SCHEDULE_NAMES, help="pipeline schedule (or --schedule-file)")
    p.add_argument("--schedule-file", metavar="FILE.csv",
                   help="a schedule in torch's pipelining CSV format (compute-only or with comms), validated")
    p.add_argument("--stages", type=int_in("stages"), metavar="P", help="pipeline stages (ranks) p")
    p.add_argument("--microbatches", type=int_in("microbatches"), metavar="M", help="micro-batches per step m")
    p.add_argument("--interleave", type=int_in("interleave"), default=1, metavar="V",
                   help="model chunks per stage v (interleaved only; default 1)")
    p.add_argument("--f", type=positive_float, default=1.0, help="forward time per chunk (default 1)")
    p.add_argument("--b", type=positive_float, default=1.0,
                   help="input-gradient backward time per chunk (default 1)")
    p.add_argument("--w", type=float_in(0.0), default=1.0,
                   help="weight-gradient backward time per chunk (default 1; >= 0)")
    p.add_argument("--p2p", type=float_in(0.0), default=0.0, help="time of one point-to-point message (default 0)")
    p.add_argument("--width", type=int_in("width"), default=120,
                   help="timeline width in characters (default 120)")


#: Largest p * m * v the simulator is asked for: it takes about a second there on a 2-core laptop CPU
#: and grows faster than linearly. Beyond it ``bubble`` answers with the closed form only.
BUBBLE_SIM_LIMIT = 2048


def handle(args: argparse.Namespace) -> Output:
    from ..schedules.checks import validate
    from ..schedules.generators import build_schedule
    from ..simulate import Costs, bubble_closed_form, simulate, text_timeline

    costs = Costs(args.f, args.b, args.w, args.p2p)
    if (args.schedule is None) == (args.schedule_file is None):
        raise ParallelLabError("give --schedule NAME (with --stages and --microbatches) or --schedule-file FILE.csv")
    if args.schedule_file is not None:
        from ..schedule_csv import load

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
    from ..simulate import bubble_closed_form

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
