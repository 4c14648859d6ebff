"""What a test of an exercise uses: points, failures with a message for the learner, ranks that fail, not hang.

A test is a function ``test_NAME(sub)`` in an exercise's ``public_tests.py`` (shipped to learners) or
``hidden_tests.py`` (instructor bundle only); ``sub`` is the learner's submission, imported as a module
named ``submission``. ``@points(n)`` and ``@limit(seconds)`` set what a test is worth and its wall-clock
limit; ``@checks(property, hint)`` names the property a public test checks and a hint, both appended to its
failure message. A test passes when it returns and fails when it raises: :class:`Fail` (or ``assert``) with
a message that says what is wrong and how to look for it, all a learner sees of a hidden test. A function
given to ``run_ranks`` with ``sub`` runs in the submission's processes (a hidden test's goes by value, with the
globals it names): keep checks and expected values out of it.

``run_ranks(fn, world, *args)`` runs ``fn(grid, *args)`` on ``world`` CPU ranks through the project's
launcher (fork, a free port, one torch thread per rank, a process-group timeout) with a short launch timeout.
A rank that raises, exits or hangs becomes a :class:`Fail` naming the rank and what it was doing: its last
``doing(grid, "...")`` note, and for a hang the line of the submission it was stuck on and the
torch.distributed call it waited in (each rank dumps its stack shortly before the timeout).
``record_collectives()`` observes ``torch.distributed``'s collectives inside a rank as the comm tracer does
(``instruments/observe.py``) and records each call as ``(kind, message_bytes, group_size)`` by the
conventions' table, so a test can compare the submission's calls with ``parallel_lab.comm`` call by call.
Submissions call collectives as ``dist.all_reduce(...)``.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

DEFAULT_POINTS = 1
DEFAULT_LIMIT_S = 120.0
RANK_TIMEOUT_S = 60.0
#: multiplies rank timeouts; the grader's child process sets it from ``Limits.scale`` (``--time-scale``)
TIME_SCALE = 1.0


class Fail(AssertionError):
    """A failed test; the message is shown to the learner."""


def points(n: int) -> Callable[[Callable], Callable]:
    def mark(fn: Callable) -> Callable:
        fn.points = n
        return fn
    return mark


def limit(seconds: float) -> Callable[[Callable], Callable]:
    def mark(fn: Callable) -> Callable:
        fn.limit_s = seconds
        return fn
    return mark


def checks(prop: str, hint: str) -> Callable[[Callable], Callable]:
    """Name the property a test checks and a hint; a failed check's message ends with both (the learner sees
    the message, never the test's code). Errors the submission raises are left to the grader to report."""
    def mark(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(sub: Any) -> Any:
            try:
                return fn(sub)
            except AssertionError as e:
                raise Fail(f"{str(e) or 'a check failed'}\n  checks: {prop}\n  hint: {hint}") from None
        run.checks, run.hint = prop, hint
        return run
    return mark


def require(sub: Any, *names: str) -> list[Any]:
    """The submission's objects ``names``; a :class:`Fail` naming the first one missing."""
    out = []
    for n in names:
        if not hasattr(sub, n):
            raise Fail(f"the submission defines no `{n}`; keep the starter's names")
        out.append(getattr(sub, n))
    return out


# --------------------------------------------------------------------------------------------------
# Ranks
# --------------------------------------------------------------------------------------------------

def doing(grid: Any, what: str) -> None:
    """Tell the grader what this rank is doing now (shown if the rank fails or hangs)."""
    note = getattr(grid, "notify", None)
    if note is not None:
        note(what)


def _stack_file(root: str, rank: int) -> Path:
    return Path(root) / f"rank{rank}.stack"


def _ranked(grid: Any, fn: Callable, stack_dir: str, dump_after_s: float, args: tuple, kwargs: dict) -> Any:
    with open(_stack_file(stack_dir, grid.rank), "w") as f:
        faulthandler.dump_traceback_later(dump_after_s, exit=False, file=f)
        try:
            out = fn(grid, *args, **kwargs)
        finally:
            faulthandler.cancel_dump_traceback_later()
    Path(stack_dir, f"rank{grid.rank}.done").touch()
    return out


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<fn>\S+)')


def where_stuck(stack_text: str) -> str:
    """From a faulthandler dump: the submission line and the torch.distributed call it waited in."""
    frames = [m.groupdict() for m in _FRAME.finditer(stack_text)]     # innermost first
    if not frames:
        return ""
    sub = next((f for f in frames if Path(f["file"]).name == "submission.py"), None)
    dist_call = next((f for f in frames if "distributed_c10d" in f["file"] or "torch/distributed" in f["file"]),
                     None)
    parts = []
    if sub:
        parts.append(f"at submission.py line {sub['line']} (in {sub['fn']})")
    if dist_call:
        parts.append(f"waiting in torch.distributed.{dist_call['fn']}")
    return ", ".join(parts)


def _rank_error_summary(tb: str) -> str:
    """The learner-facing part of a rank's traceback: the last line and the last submission frame."""
    lines = tb.strip().splitlines()
    last = lines[-1] if lines else "unknown error"
    subs = re.findall(r'File "[^"]*submission\.py", line (\d+), in (\S+)', tb)
    where = f" at submission.py line {subs[-1][0]} (in {subs[-1][1]})" if subs else ""
    return f"{last.replace('parallel_lab.grading.harness.Fail: ', '')}{where}"


def run_ranks(fn: Callable, world: int, *args: Any, timeout_s: float = RANK_TIMEOUT_S, plan: Any = None,
              **kwargs: Any) -> list[Any]:
    """``fn(grid, *args, **kwargs)`` on ``world`` ranks (or on ``plan``'s grid); the results in rank order.

    Raises :class:`Fail` naming the rank: what it raised, that it exited, or where it hung. Given the
    submission (``sub``) among the arguments, the ranks' results are the run's recorded output
    (:func:`parallel_lab.grading.tape.boundary`): the judge replays them, never starting ranks of its own.
    """
    from parallel_lab.grading import tape

    return tape.boundary(_run_ranks, fn, world, *args, timeout_s=timeout_s, plan=plan, **kwargs)


def _run_ranks(fn: Callable, world: int, *args: Any, timeout_s: float, plan: Any, **kwargs: Any) -> list[Any]:
    from parallel_lab.distributed.runtime.launch import LaunchTimeout, RankError, launch

    timeout_s *= TIME_SCALE
    last: dict[int, str] = {}
    with tempfile.TemporaryDirectory(prefix="ranks-") as stacks:
        try:
            return launch(_ranked, plan if plan is not None else world, fn, stacks, max(1.0, timeout_s - 1.5),
                          args, kwargs, timeout_s=timeout_s, pg_timeout_s=timeout_s + 30,
                          on_progress=lambda r, msg: last.__setitem__(r, str(msg)))
        except RankError as e:
            note = f" while {last[e.rank]}" if e.rank in last else ""
            if "before returning a result" in str(e):
                raise Fail(f"rank {e.rank} died{note}: {str(e).splitlines()[0].split(': ', 1)[1]} (os._exit, "
                           f"a crash, or the memory limit?)") from None
            raise Fail(f"rank {e.rank} raised{note}: {_rank_error_summary(e.traceback)}") from None
        except LaunchTimeout:
            n = world if plan is None else plan.world
            lines = []
            for r in range(n):
                p = _stack_file(stacks, r)
                dump = p.read_text() if p.exists() else ""
                what = f" while {last[r]}" if r in last else ""
                if Path(stacks, f"rank{r}.done").exists():
                    lines.append(f"rank {r} finished its work")
                elif dump.strip():
                    stuck = where_stuck(dump)
                    lines.append(f"rank {r}{what}{': ' + stuck if stuck else ': still running'}")
                else:
                    lines.append(f"rank {r}{what}: gone without a result (os._exit, a crash, or the memory limit?)")
            raise Fail(f"the ranks did not finish within {timeout_s:g} s (a hang or deadlock: a collective that "
                       "not every rank calls, or calls in a different order); " + "; ".join(lines)) from None


# --------------------------------------------------------------------------------------------------
# Recording the submission's collectives
# --------------------------------------------------------------------------------------------------

class _Recorder:
    """An observer of ``instruments/observe.py`` that keeps ``(kind, message_bytes, group_size)``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def wrap(self, call: Any, run: Callable[[], Any]) -> Any:
        self.calls.append((call.kind, call.message_bytes, call.group_size))
        return run()

    def wrap_batch(self, calls: list[Any], run: Callable[[], list[Any]]) -> list[Any]:
        self.calls.extend((c.kind, c.message_bytes, c.group_size) for c in calls)
        return run()


@contextlib.contextmanager
def record_collectives() -> Iterator[list[tuple[str, int, int]]]:
    """Inside: every ``dist.<collective>`` call is appended as ``(kind, message_bytes, group_size)``, seen
    by the comm tracer's own mechanism (``distributed/instruments/observe.py``)."""
    from parallel_lab.distributed.instruments.observe import observing

    rec = _Recorder()
    with observing(rec):
        yield rec.calls


def expected_calls(colls: Any) -> list[tuple[str, int, int]]:
    """``parallel_lab.comm.Collective`` records as a sorted list of calls ``(kind, message_bytes, group)``."""
    return sorted((c.kind, c.message_bytes, c.group_size) for c in colls for _ in range(c.count))


def diff_calls(measured: list[tuple[str, int, int]], predicted: list[tuple[str, int, int]]) -> str:
    """'' when the two multisets of calls agree, else a short description of the difference."""
    from collections import Counter

    m, p = Counter(measured), Counter(predicted)
    if m == p:
        return ""
    extra = sorted((m - p).elements())
    missing = sorted((p - m).elements())
    def fmt(cs: list[tuple[str, int, int]]) -> str:
        return ", ".join(f"{k} of {b:,} B over {g}" for k, b, g in cs[:4]) + (" ..." if len(cs) > 4 else "")

    out = []
    if extra:
        out.append(f"calls the prediction does not have: {fmt(extra)}")
    if missing:
        out.append(f"predicted calls you did not make: {fmt(missing)}")
    return f"{len(measured)} calls made, {len(predicted)} predicted; " + "; ".join(out)


def cpu_count() -> int:
    return os.cpu_count() or 1
