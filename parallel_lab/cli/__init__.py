"""``parallel-lab``: the command line of the lab; one module per subcommand, registered in :data:`SUBCOMMANDS`.

    parallel-lab memory  --model llama3-8b --seq 8192 --tp 4 --dp 2
    parallel-lab comm    --layers 32 --hidden 4096 --heads 32 --seq 4096 --tp 8 --json
    parallel-lab flops   --model llama3-405b --seq 8192 --dp 128 --tp 8 --pp 16 --grad-accum 16

Every subcommand prints a readable table, or with ``--json`` one JSON object whose keys are documented in
the README (numbers unrounded: bytes, FLOPs, seconds; never NaN or Infinity). One error path: anything a
user can get wrong (a flag, a value, a model, a plan, a plan file, a file to write) prints one line
``parallel-lab CMD: error: ...`` on stderr, naming the bad value and a fix, and exits with status 2,
never a traceback; a run that fails after it started exits 3 or 4 (:mod:`.output`), Ctrl-C 130.

Adding a subcommand is one self-contained edit: a module with ``add(sub)``, which calls
:func:`~parallel_lab.plan_flags.subcommand` (it adds ``--json``) and the shared flag helpers of
:mod:`parallel_lab.plan_flags`, and a handler ``args -> Output``; then append its ``add`` to
:data:`SUBCOMMANDS`. Handlers that need heavy imports (torch) import them inside the handler, so that the
other subcommands stay fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import ParallelLabError
from ..grading.cli import add_grade
from . import bubble, calibrate, comm, compare, flops, launch, memory, plan, reshard, run
from .output import MAX_MESSAGE, PROG, RunFailed, bounded

EXIT_USAGE = 2          #: bad input of any kind
EXIT_INTERNAL = 70      #: a bug of parallel_lab (EX_SOFTWARE); the one line asks for a report

#: One registrar per subcommand, in the order ``--help`` lists them. To add a subcommand, append yours.
#: (``bubble`` and ``plan``: schedules/planner; ``run``: the runnable core, importing torch in its handler;
#: ``grade``: parallel_lab/grading/cli.py.)
SUBCOMMANDS: list[Callable[[Any], None]] = [memory.add, comm.add, flops.add, bubble.add, plan.add, run.add,
                                            compare.add, launch.add, calibrate.add, reshard.add, add_grade]


class Parser(argparse.ArgumentParser):
    """argparse with the lab's one-line errors: ``parallel-lab CMD: error: ...`` and exit 2 (no usage dump)."""

    def error(self, message: str) -> Any:   # type: ignore[override]
        hint = f"; see {self.prog} --help"
        print(f"{self.prog}: error: {bounded(message, MAX_MESSAGE - len(self.prog) - len(hint))}{hint}",
              file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog=PROG,
        description="parallel_lab: memory, communication and FLOPs of multi-GPU LLM training plans.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in SUBCOMMANDS:
        register(sub)
    return parser


def _jsonable(x: Any) -> Any:
    """Plain JSON types: string keys, lists for tuples."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 2 invalid input, 3/4 a failed or stuck run, 130 Ctrl-C)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    where = f"{PROG} {args.command}"
    try:
        out = args.handler(args)
        if out is None:                                  # nothing to print (torchrun ranks other than 0)
            return 0
        text = json.dumps(_jsonable(out.data), indent=2, allow_nan=False) if args.json else out.text
    except ParallelLabError as e:
        print(f"{where}: error: {bounded(str(e))}", file=sys.stderr)
        return EXIT_USAGE
    except RunFailed as e:
        print(e.report, file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print(f"\n{where}: interrupted (Ctrl-C); every process it started was stopped", file=sys.stderr)
        return 130
    except (MemoryError, RecursionError) as e:
        print(f"{where}: error: the input is too large to compute ({type(e).__name__}); use smaller "
              f"values", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:                               # a bug: still one line, and a distinct status
        print(f"{where}: internal error: {bounded(f'{type(e).__name__}: {e}', 300)}; please report it "
              f"with the command line", file=sys.stderr)
        return EXIT_INTERNAL
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:                                 # e.g. `parallel-lab comm ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
