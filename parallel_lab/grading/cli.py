"""``parallel-lab grade``: the grader's command line (registered in ``parallel_lab/cli/__init__.py``).

    parallel-lab grade EXERCISE [PATH] [--bundle DIR|ARCHIVE] [--json]
    parallel-lab grade --batch SUBMISSIONS_DIR --bundle DIR --out grades.csv
    parallel-lab grade --list

``PATH`` defaults to the exercise's starter, ``exercises/EXERCISE/starter.py`` (or ``.yaml``), the file a learner
edits.
Without ``--bundle`` only the public tests run. Importing this module does not import torch.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from parallel_lab.plan_flags import Output, subcommand


def _handle(args: argparse.Namespace) -> Any:
    from parallel_lab.errors import ParallelLabError
    from parallel_lab.grading import catalog, runner

    exercises_dir = runner.Path(args.exercises) if args.exercises else runner.default_exercises_dir()
    limits = runner.Limits(memory_mb=args.memory_mb, cpu_s=args.cpu_s, scale=args.time_scale)
    if args.list:
        names = runner.list_exercises(exercises_dir)
        rows, table = catalog.listing(names)
        return Output({"exercises": names, "details": rows}, table)
    if args.batch:
        if args.exercise or args.path:
            raise ParallelLabError("--batch grades a directory; drop EXERCISE and PATH")
        if not args.out:
            raise ParallelLabError("--batch needs --out grades.csv")

        done: list[tuple[str, runner.Grade]] = []

        def progress(learner: str, g: runner.Grade) -> None:     # stderr: --json's stdout stays one object
            print(f"{learner:<16} {g.exercise:<22} {g.points:g}/{g.max_points}  ({g.seconds:.1f} s)",
                  file=sys.stderr, flush=True)
            done.append((learner, g))
            runner.write_csv(done, args.out)       # after each: the CSV holds every grade given so far

        rows = runner.grade_batch(args.batch, bundle=args.bundle, exercises_dir=exercises_dir, limits=limits,
                                  on_grade=progress)
        runner.write_csv(rows, args.out)
        data = {"out": args.out, "grades": [{"learner": lr, **g.to_json()} for lr, g in rows]}
        total = sum(g.points for _, g in rows)
        most = sum(g.max_points for _, g in rows)
        return Output(data, f"graded {len(rows)} submission(s): {total:g} / {most} points; wrote {args.out}")
    if not args.exercise:
        raise ParallelLabError("name an EXERCISE (see parallel-lab grade --list), or use --batch DIR")
    runner.check_name(args.exercise)
    starters = sorted((exercises_dir / args.exercise).glob("starter.*"))
    path = args.path or str(starters[0] if starters else exercises_dir / args.exercise / "starter.py")
    g = runner.grade(args.exercise, path, bundle=args.bundle, exercises_dir=exercises_dir, limits=limits)
    return Output(g.to_json(), g.summary())


def add_grade(sub: Any) -> None:
    """Register ``grade`` on the CLI's subparsers."""

    p = subcommand(sub, "grade", _handle, "grade a submission of an exercise (or a class with --batch)",
                   __doc__.split("\n\n")[1] if __doc__ else None)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("exercise", nargs="?", help="exercise name (directory under exercises/)")
    p.add_argument("path", nargs="?", help="the submission (default: the exercise's starter.py)")
    p.add_argument("--bundle", help="instructor bundle (directory or archive): adds the hidden tests")
    p.add_argument("--batch", metavar="DIR", help="grade DIR/LEARNER/EXERCISE.py for every learner")
    p.add_argument("--out", metavar="CSV", help="with --batch: where to write the grades")
    p.add_argument("--exercises", metavar="DIR", help="the exercises directory (default ./exercises)")
    p.add_argument("--list", action="store_true", help="list the exercises: order, lesson, time, points")
    p.add_argument("--memory-mb", type=int, default=3072, help="address-space limit per process (3072)")
    p.add_argument("--cpu-s", type=int, default=300, help="CPU-seconds limit per process (300)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply every test's time limit (1.0)")
