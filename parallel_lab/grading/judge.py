"""The judge, which decides, and the test modules' setup shared by the driver and the judge.

The run (the tape) comes from :mod:`parallel_lab.grading.remote`: a driver forked from the grader runs each
test against the submission's process, which executes and records (frames ``start``, the events, ``end``).
:func:`judge` runs in a process forked from the grader after every process of the submission is gone; it never
imports the submission (a ``.yaml`` plan file aside, whose ``submission.py`` the grader wrote): it replays
each test from its frames with a :class:`tape.Replayer` and writes ``start`` and ``result`` frames, the only
verdicts the grader reads. :func:`setup_of` (new session, limits, the test modules with ``SESSION``) serves
the driver and the judge, the two processes that hold hidden tests; neither runs submission code.
Design: :mod:`parallel_lab.grading.tape`; the grader's side (deadlines, kills, sweep): ``runner.py``.
"""

from __future__ import annotations

import importlib.util
import os
import resource
import sys
import tempfile
import time
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from parallel_lab.errors import ParallelLabError
from parallel_lab.grading import contain, harness, tape

Emit = Callable[..., None]


def writer(fd: int) -> Callable[[bytes], None]:
    def write(data: bytes) -> None:
        while data:
            data = data[os.write(fd, data):]
    return write


def emitter(fd: int) -> Emit:
    write = writer(fd)
    return lambda **obj: write(tape.frame(obj))


def load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ParallelLabError(f"cannot import {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _load_source(text: str, name: str) -> Any:
    """A test module from its text (hidden tests: neither process opens the bundle's file)."""
    mod = types.ModuleType(name)
    sys.modules[name] = mod
    exec(compile(text, f"<{name}>", "exec"), mod.__dict__)
    return mod


def confine(work: Path, memory_mb: int, cpu_s: int, scale: float) -> None:
    """A submission's process: a new session, lower limits (address space, CPU seconds, no core file), the
    tests' time scale, ``work`` as the directory and the temporary directory (the grader removes it all)."""
    os.setsid()
    mem = memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 5))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    harness.TIME_SCALE = scale
    warnings.filterwarnings("ignore", category=FutureWarning)    # torch 2.13's renamed collectives
    os.chdir(work)
    tempfile.tempdir = str(work)


def _setup(work: Path, limits: Any, scale: float, files: list[tuple[Path, str]], sources: dict[str, str],
           session: dict[str, dict], isolate: bool) -> dict[str, Any]:
    """:func:`confine`, then the test modules (public first), then namespaces."""
    confine(work, limits.memory_mb, limits.cpu_s, scale)
    mods: dict[str, Any] = {}
    for path, vis in files:               # before the submission runs; public first (hidden may import it)
        src = sources.get(str(path))
        mods[str(path)] = _load_source(src, f"{vis}_tests") if src is not None else load(path, f"{vis}_tests")
        mods[str(path)].SESSION = session.get(str(path), {})
    sources.clear()
    if isolate:                           # the bundle out of sight, loopback only (where Linux allows)
        contain.isolate({path.parents[1] for path, vis in files if vis == "hidden"})
    return mods


def judge(emit: Emit, work: Path, tests: list[Any], tapes: dict[str, dict] | None, limits: Any,
          mods_of: Callable[[], dict]) -> None:
    """The judge: each test replayed from its frames (``tapes``), or run on the grader-written ``submission.py``
    of a plan file (``tapes`` None); one ``start`` and one ``result`` frame per test."""
    mods = mods_of()
    sys.path[:] = [p for p in sys.path if p not in ("", ".", str(work))]
    if tapes is None:
        sub: Any = load(work / "submission.py", "submission")
    else:
        rep = tape.Replayer()
        tape.ACTIVE = rep
        sub = rep.root
    for t in tests:
        emit(k="start", test=t.key)
        tape.seed()
        if tapes is not None:
            rep.begin_tape(t.key, tapes[t.key]["tape"], tapes[t.key]["note"])
        t0 = time.perf_counter()
        try:
            getattr(mods[t.file], t.name)(sub)
            if tapes is not None:
                rep.finish()
            message = ""
        except tape.TapeError as e:
            message = str(e)
        except MemoryError:
            message = (f"ran out of memory (limit {limits.memory_mb} MB per process): does something grow without "
                       "bound?")
        except AssertionError as e:
            message = str(e)[:4 * contain.MAX_MESSAGE] or "a check failed (no message)"
        except BaseException as e:        # noqa: BLE001 - the submission's error becomes the message
            message = tape.error_message(e)
        emit(k="result", test=t.key, passed=not message, message=message, seconds=time.perf_counter() - t0)
    os._exit(0)


def setup_of(work: Path, limits: Any, files: list[tuple[Path, str]], sources: dict[str, str],
             session: dict[str, dict], isolate: bool) -> Callable[[], dict]:
    return lambda: _setup(work, limits, limits.scale, files, sources, session, isolate)
