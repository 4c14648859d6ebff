"""A command line in a child process, followed from an explorer without ever blocking the kernel.

The Run tab (``parallel-lab run ... --json``) and the Memory tab's "measure this plan" (``parallel-lab memory
... --measure --json``) take seconds to minutes of CPU. Each runs the CLI itself in a child process of its
own session (:class:`CliJob`), so the app shows exactly what the command prints and the kernel's event loop
never waits: one reader thread collects stdout (the JSON answer), another follows stderr line by line (the
progress the command prints there) and hands every line, and the end, back to the loop (:func:`loop_caller`).
Cancel sends SIGTERM to the child's whole process group (a launcher and its ranks), SIGKILL after a grace
period; a kernel that exits stops its jobs the same way. :func:`plan_flags` and :func:`model_flags` spell a
``Plan`` and a ``ModelSpec`` as the CLI's flags; :func:`check_spelled` parses them back with the CLI's own
flag definitions (``parallel_lab/plan_flags.py``), so a plan the command line would read differently is
refused before anything starts.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ...errors import ParallelLabError
from ...plan_flags import PLAN_FIELDS, SHAPE_FLAGS, flags_parser, model_from_args, plan_from_args
from ...specs import MODEL_PRESETS, ModelSpec, Plan

REPO = Path(__file__).resolve().parents[3]


class CliJob:
    """``argv`` in a child process of its own session.

    ``on_line(line)`` is called for every line the child writes on stderr that ``is_progress`` accepts,
    ``on_done(job)`` once at the end, each through ``call`` (by default directly, from the reader thread;
    an explorer passes :func:`loop_caller`). After the end: ``report`` (stdout parsed as JSON when the
    child exited 0), ``error`` (the child's last error line otherwise), ``returncode``, ``cancelled``;
    ``lines`` holds every stderr line.
    """

    def __init__(self, argv: Sequence[str], on_line: Callable[[str], None], on_done: Callable[[CliJob], None],
                 call: Callable[..., None] | None = None, *,
                 is_progress: Callable[[str], Any] = lambda line: True) -> None:
        self.argv = list(argv)
        self.report: dict[str, Any] | None = None
        self.error: str | None = None
        self.returncode: int | None = None
        self.cancelled = False
        self.lines: list[str] = []
        self._is_progress = is_progress
        self._call = call or (lambda fn, *a: fn(*a))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
        self.proc = subprocess.Popen(self.argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self._out: list[bytes] = []
        self._stdout_reader = threading.Thread(target=lambda: self._out.append(self.proc.stdout.read()),
                                               daemon=True)
        self._stdout_reader.start()
        atexit.register(self._stop_at_exit)            # a kernel that stops takes its job's processes with it
        self.thread = threading.Thread(target=self._follow, args=(on_line, on_done), daemon=True)
        self.thread.start()

    def _follow(self, on_line: Callable[[str], None], on_done: Callable[[CliJob], None]) -> None:
        buf = ""
        for chunk in iter(lambda: self.proc.stderr.read1(4096), b""):
            buf += chunk.decode(errors="replace")
            *pieces, buf = re.split(r"[\r\n]", buf)       # a progress bar rewrites its line with \r
            for piece in pieces:
                self.lines.append(piece)
                if self._is_progress(piece):
                    self._call(on_line, piece)
        self.lines.append(buf)
        self.returncode = self.proc.wait()
        self._stdout_reader.join()
        for pipe in (self.proc.stdout, self.proc.stderr):  # a finished job holds no descriptors
            pipe.close()
        atexit.unregister(self._stop_at_exit)            # nor a reference from the interpreter's exit hooks
        if self.returncode == 0 and not self.cancelled:
            try:
                self.report = json.loads(b"".join(self._out))
            except ValueError as err:
                self.error = f"the command's JSON could not be read: {err}"
        elif not self.cancelled:
            lines = [x.strip() for x in self.lines if x.strip() and not self._is_progress(x)]
            said = [x for x in lines if "error:" in x or "failed:" in x or "stopped:" in x]
            self.error = (said or lines or [f"exit status {self.returncode}"])[-1]
        self._call(on_done, self)

    def _stop_at_exit(self) -> None:
        if self.running():
            self.cancel(grace_s=2.0)

    def running(self) -> bool:
        return self.proc.poll() is None

    def cancel(self, grace_s: float = 5.0) -> None:
        """Stop the child and everything it started (SIGTERM to its process group, SIGKILL after ``grace_s``)."""
        self.cancelled = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def wait(self, timeout_s: float | None = None) -> None:
        """Until the child has ended and ``on_done`` was handed over (or ``timeout_s``)."""
        self.thread.join(timeout_s)


def group_gone(pgid: int) -> bool:
    """Whether no process of the process group ``pgid`` is left (a cancelled job's child and its ranks)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def loop_caller() -> Callable[..., None]:
    """Hand a call to the running event loop (the kernel's) from another thread; directly when none runs."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        try:
            loop = asyncio.get_event_loop_policy().get_event_loop()
        except RuntimeError:
            loop = None
    if loop is None or not loop.is_running():
        return lambda fn, *a: fn(*a)
    return lambda fn, *a: loop.call_soon_threadsafe(fn, *a)


# --------------------------------------------------------------------------------------------------
# A plan as the command line spells it
# --------------------------------------------------------------------------------------------------

def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _spell(names: Sequence[str], obj: Any, default: Any) -> list[str]:
    """``--name value`` for every field of ``obj`` that differs from ``default`` (a true boolean: ``--name``)."""
    out: list[str] = []
    for f in names:
        v = getattr(obj, f)
        if v == getattr(default, f) or v is None or v is False:
            continue
        out += [_flag(f)] if v is True else [_flag(f), str(v)]
    return out


def plan_flags(plan: Plan) -> list[str]:
    """``plan`` as the CLI's plan flags: the degrees always, every other field where it is not Plan's
    default (the CLI's defaults are Plan's, ``parallel_lab.plan_flags.add_plan_args``)."""
    degrees = [x for f in ("dp", "tp", "pp", "cp") for x in (_flag(f), str(getattr(plan, f)))]
    rest = [f for f in PLAN_FIELDS if f not in ("dp", "tp", "pp", "cp")]
    return degrees + _spell(rest, plan, Plan())


def model_flags(model: ModelSpec) -> list[str]:
    """``--model NAME`` for a preset, else the shape flags (``parallel_lab.plan_flags.SHAPE_FLAGS``) of ``model``."""
    if model.name in MODEL_PRESETS and ModelSpec.preset(model.name) == model:
        return ["--model", model.name]
    defaults = {f.name: f.default for f in dataclasses.fields(ModelSpec)}
    base = SimpleNamespace(**{**defaults, "layers": 0, "hidden": 0, "heads": 0})    # the shape always given
    return _spell(SHAPE_FLAGS, model, base)


def cli_argv(command: str, model: ModelSpec, plan: Plan, *extra: str, python: str = sys.executable) -> list[str]:
    """``python -m parallel_lab COMMAND <model flags> <plan flags> EXTRA...``."""
    return [python, "-m", "parallel_lab", command, *model_flags(model), *plan_flags(plan), *extra]


def check_spelled(argv: Sequence[str], model: ModelSpec, plan: Plan) -> None:
    """Parse ``argv`` (from :func:`cli_argv`) with the CLI's own flag definitions (``plan_flags``); raise
    ParallelLabError naming the difference when the command would compute another model or plan than ``model``
    and ``plan``."""
    args, _ = flags_parser().parse_known_args(list(argv[4:]))
    got_model = model_from_args(args)
    got_plan = plan_from_args(args, got_model)
    # a llama has no position table: the CLI's max_positions (for gpt) does not change what it builds
    ignore = ("max_positions",) if model.flavour == "llama" else ()
    if diff := _differences(got_model, model, ignore):
        raise ParallelLabError(f"the command line reads this model differently ({diff}: CLI, here); "
                               "a custom gpt shape's position table is sized to the sequence "
                               "there: pick a preset or the llama flavour")
    if diff := _differences(got_plan, plan):
        raise ParallelLabError(f"the command line reads this plan differently ({diff}: CLI, here); "
                               f"please report it")


def _differences(a: Any, b: Any, ignore: Sequence[str] = ()) -> dict[str, tuple[Any, Any]]:
    return {f.name: (getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(b)
            if f.name not in ignore and getattr(a, f.name) != getattr(b, f.name)}
