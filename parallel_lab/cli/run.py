"""``parallel-lab run``: train the tiny model under a plan on CPU processes (or GPUs) and compare measured with
predicted (:mod:`parallel_lab.distributed.runtime.run`, imported in the handler: the only torch here).

Also the pieces ``compare`` shares with it: the run defaults in ``--help``, the per-op check, ``--inject-fault``.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from ..errors import ParallelLabError
from ..plan_flags import (
    PLAN_FIELDS,
    SHAPE_FLAGS,
    Output,
    check_fits_this_machine,
    int_in,
    model_from_args,
    plan_from_args,
    plan_subcommand,
    positive_float,
)
from ..schedules.generators import V_SCHEDULES
from ..specs import RUN_DEFAULTS, SCHEDULES, ModelSpec, Plan
from .output import EXIT_RUN_TIMEOUT, PROG, RunFailed, rank_failed

RUN_TIMEOUT_S = 60.0        #: ``run --timeout``: seconds without a completed step before a run counts as stuck


def add(sub: Any) -> None:
    p = plan_subcommand(sub, "run", handle,
                        "train the tiny model under a plan on CPU processes (or GPUs) and compare measured "
                        "with predicted: losses, parameters, bytes per dim, memory per category")
    p.add_argument("--plan", dest="plan_file", metavar="FILE",
                   help="a plan file (YAML, see parallel-lab plan); flags given as well override its fields")
    p.add_argument("--steps", type=int_in("steps"), default=3, help="optimizer steps (default 3)")
    p.add_argument("--seed", type=int_in("seed"), default=0, help="seed of the weights and the synthetic data")
    p.add_argument("--packed", action="store_true",
                   help="pack several documents per sequence (document masks)")
    p.add_argument("--timeout", type=positive_float, default=RUN_TIMEOUT_S, metavar="SECONDS",
                   help="progress timeout: when no rank completes a step for this long the run is stopped and "
                        f"the stuck rank named (default {RUN_TIMEOUT_S:g})")
    p.add_argument("--time-limit", type=positive_float, metavar="SECONDS",
                   help="optional wall-clock limit of the whole run (default: none)")
    add_fault_arg(p)
    for action in p._actions:
        if action.dest == "schedule":     # run also executes the V schedules as action lists
            action.choices = (*SCHEDULES, *V_SCHEDULES)
            action.help = (f"{action.help}; run also takes {' and '.join(V_SCHEDULES)} (a pipeline alone, "
                           "2 chunks per rank in a V)")
    help_for_runs(p, "run")


def help_for_runs(p: argparse.ArgumentParser, command: str) -> None:
    """``--help`` of a command that trains the tiny model shows the defaults it really uses (RUN_DEFAULTS,
    not Plan's) and that its predictions use the per-op activation model."""
    for action in p._actions:
        if action.dest in RUN_DEFAULTS and action.help:
            base = re.sub(r"\s*\(default [^)]*\)", "", action.help)
            action.help = f"{base} (default for {command}: {RUN_DEFAULTS[action.dest]})"
        if action.dest == "activation_model":
            action.help = (f"{command} predicts activations with the per-op model only (the tensors the runnable "
                           "blocks save); korthikanti is for `memory`")


def check_per_op(args: argparse.Namespace, command: str) -> None:
    if getattr(args, "activation_model", None) not in (None, "per-op"):
        raise ParallelLabError(
            f"--activation-model {args.activation_model}: {command} compares what the ranks save with the per-op "
            "model (the runnable blocks' own tensors), the only model it can measure; drop the flag, or use "
            f"`parallel-lab memory --activation-model {args.activation_model}` for the formulas")


def _fault(text: str) -> Any:
    from ..distributed.runtime.faults import Fault

    try:
        return Fault.parse(text)
    except ParallelLabError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_fault_arg(p: argparse.ArgumentParser, which: str = "") -> None:
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
    from ..planfile import load_plan  # type: ignore[attr-defined]

    loaded: Any = load_plan(path)
    if isinstance(loaded, Plan):
        return None, loaded
    plan = loaded.get("plan") if isinstance(loaded, dict) else getattr(loaded, "plan", None)
    model = loaded.get("model") if isinstance(loaded, dict) else getattr(loaded, "model", None)
    if not isinstance(plan, Plan):
        raise ParallelLabError(f"--plan {path}: the file did not give a plan")
    return (model if isinstance(model, ModelSpec) else None), plan


def handle(args: argparse.Namespace) -> Output | None:
    from ..distributed.runtime.launch import LaunchTimeout, RankError
    from ..distributed.runtime.run import run
    from ..distributed.runtime.train import check_runnable

    check_per_op(args, "run")
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
        from ..distributed.runtime.run import check_schedule

        check_schedule(model, plan, v_schedule)
    check_fits_this_machine(model, plan)
    try:
        rep = run(model, plan, steps=args.steps, seed=args.seed, packed=args.packed, timeout_s=args.timeout,
                  time_limit_s=args.time_limit, progress=True, schedule=v_schedule, faults=args.faults)
    except RankError as e:
        raise rank_failed(e, args.steps) from None
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
