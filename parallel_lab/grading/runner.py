"""The grader: each submission in a fresh, limited process; every test a line of points and feedback.

``grade(exercise, path, bundle=...)`` grades one submission; ``grade_batch(dir, bundle=...)`` a class
(``DIR/LEARNER/EXERCISE.py``, or ``.yaml`` for a plan file), written to a CSV by ``write_csv``; the CLI is
``parallel-lab grade``. Without a bundle only the public tests run (the learner's loop).

Per submission the grader forks a child (the parent runs no submission code) that starts a new session,
lowers its limits, loads the tests (hidden ones from text the grader read), enters namespaces that hide the
bundle and close the network where Linux allows (:mod:`parallel_lab.grading.contain`), and runs the tests
in order, each event a signed line on a pipe; its output is drained and capped, a test past its limit is
killed with its process group, and every descendant left is killed after it. Feedback is bounded and never
quotes a hidden file. Tests run inside the submission's process, so this is not a security boundary: grade
untrusted code inside a container as well. A test file's ``session_values()`` (references that do not
depend on the submission) are computed once per session. Details: docs/grading.md.
"""

from __future__ import annotations

import csv
import importlib.util
import itertools
import json
import math
import os
import re
import resource
import secrets
import select
import shutil
import signal
import sys
import tempfile
import time
import traceback
import types
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from parallel_lab.errors import ParallelLabError
from parallel_lab.grading import contain, harness
from parallel_lab.grading.catalog import answers_text
from parallel_lab.grading.harness import DEFAULT_LIMIT_S, DEFAULT_POINTS

REPO = Path(__file__).resolve().parents[2]
SUBMISSION_SUFFIXES = (".py", ".yaml", ".yml")
IMPORT_LIMIT_S = 30.0        # wall clock for importing a submission (torch is already imported)
#: enter user, mount and network namespaces in each submission's process (:func:`contain.isolate`)
ISOLATE = os.environ.get("PARALLEL_LAB_GRADE_NAMESPACES", "1") != "0"
MIN_MEMORY_MB = 1024         # the grading process holds ~700 MB of address space before any test
EXERCISE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


@dataclass(frozen=True)
class Limits:
    """Per-submission limits. ``memory_mb``: address space of each process (ranks too); ``cpu_s``: CPU
    seconds of each process; ``scale``: multiplies every test's wall-clock limit (slow machines)."""

    memory_mb: int = 3072
    cpu_s: int = 300
    scale: float = 1.0

    def __post_init__(self) -> None:
        for flag, value, low, high, usual in (("--memory-mb", self.memory_mb, MIN_MEMORY_MB, 2**22, 3072),
                                              ("--cpu-s", self.cpu_s, 1, 86_400, 300),
                                              ("--time-scale", self.scale, 0.01, 100, 1)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not low <= value <= high:
                raise ParallelLabError(f"{flag} {value!r} is outside [{low:,}, {high:,}]; e.g. {flag} {usual}")


@dataclass
class TestResult:
    name: str
    visibility: str          # "public" or "hidden"
    points: float
    max_points: int
    passed: bool
    message: str
    seconds: float


@dataclass
class Grade:
    exercise: str
    submission: str
    results: list[TestResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def points(self) -> float:
        return sum(r.points for r in self.results)

    @property
    def max_points(self) -> int:
        return sum(r.max_points for r in self.results)

    def to_json(self) -> dict[str, Any]:
        return {"exercise": self.exercise, "submission": self.submission, "points": self.points,
                "max_points": self.max_points, "seconds": round(self.seconds, 2),
                "tests": [asdict(r) for r in self.results]}

    def summary(self) -> str:
        w = max([len(r.name) for r in self.results] + [4])
        lines = [f"{self.exercise}: {self.points:g} / {self.max_points} points ({self.submission})"]
        for r in self.results:
            mark = "ok  " if r.passed else "FAIL"
            lines.append(f"  {mark} {r.name:<{w}} {r.points:g}/{r.max_points}  [{r.visibility}]"
                         + ("" if r.passed else "\n       " + r.message.replace("\n", "\n       ")))
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Finding exercises, bundles and tests
# --------------------------------------------------------------------------------------------------

def default_exercises_dir() -> Path:
    here = Path.cwd() / "exercises"
    return here if here.is_dir() else REPO / "exercises"


def list_exercises(exercises_dir: Path | None = None) -> list[str]:
    d = exercises_dir or default_exercises_dir()
    if not d.is_dir():
        raise ParallelLabError(f"the exercises directory {str(d)[:200]!r} is not a directory; pass --exercises DIR "
                               "(the folder holding one folder per exercise)")
    return sorted(p.name for p in d.iterdir() if (p / "public_tests.py").exists())


def open_bundle(bundle: str | Path | None, into: Path) -> Path | None:
    """The instructor bundle as a directory: a directory as is, an archive (.tar.gz, .zip) unpacked."""
    if bundle is None:
        return None
    b = Path(bundle).resolve()
    if b.is_dir():
        return b
    if b.is_file():
        try:
            shutil.unpack_archive(str(b), str(into))
        except (shutil.ReadError, ValueError, OSError, EOFError) as e:
            raise ParallelLabError(f"instructor bundle {str(b)[:200]!r} is not a directory nor a readable archive "
                                   f"({type(e).__name__}); pass --bundle DIR, .tar.gz or .zip") from None
        kids = [p for p in into.iterdir() if p.is_dir()]
        return kids[0] if len(kids) == 1 and not (into / "README.md").exists() else into
    raise ParallelLabError(f"instructor bundle {str(b)!r} does not exist; pass --bundle DIR or an archive")


@dataclass(frozen=True)
class TestSpec:
    file: str
    name: str
    visibility: str
    points: int
    limit_s: float

    @property
    def key(self) -> str:
        return f"{self.visibility}:{self.name}"


def _load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ParallelLabError(f"cannot import {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def check_name(exercise: str) -> None:
    """Refuse a name that cannot be an exercise's folder (one line, before any file is looked up)."""
    if not EXERCISE_NAME.fullmatch(exercise) or ".." in exercise:
        raise ParallelLabError(f"{exercise[:40]!r}{'...' if len(exercise) > 40 else ''} is not an exercise name "
                               "(letters, digits, _ . -, at most 64); see parallel-lab grade --list")


def test_files(exercise: str, exercises_dir: Path, bundle: Path | None) -> list[tuple[Path, str]]:
    check_name(exercise)
    ex = exercises_dir / exercise
    if not ex.is_dir():
        known = ", ".join(list_exercises(exercises_dir))
        raise ParallelLabError(f"no exercise {exercise!r} in {exercises_dir}; pick one of {known}")
    out = [(ex / "public_tests.py", "public")] if (ex / "public_tests.py").exists() else []
    if bundle is not None:
        hidden = bundle / exercise / "hidden_tests.py"
        if not hidden.exists():
            raise ParallelLabError(f"the bundle {bundle} has no {exercise}/hidden_tests.py")
        out.append((hidden, "hidden"))
    return out


#: ``session_values()`` of each test file, computed once per grading process (``_warm``), before any
#: submission child is forked: children inherit a copy and no submission can alter what another one sees.
_SESSION: dict[str, dict[str, Any]] = {}
#: the text of each hidden test file, read by the grader: the child builds the module from it, never
#: opening the bundle's file itself, and the grader withholds feedback that quotes it
_SOURCES: dict[str, str] = {}


def _warm(path: Path, mod: Any) -> None:
    """Compute the test file's ``session_values()`` (measurements and references that do not depend on the
    submission) here, in the grader, once; the child sets them as the module's ``SESSION``."""
    fn = getattr(mod, "session_values", None)
    if fn is not None and str(path) not in _SESSION:
        _SESSION[str(path)] = fn()


def discover(files: list[tuple[Path, str]]) -> list[TestSpec]:
    """The tests of the files, in file order (collected in the parent: the submission is not imported)."""
    specs = []
    for path, vis in files:
        if vis == "hidden":
            _SOURCES[str(path)] = path.read_text()
        mod = _load(path, f"{vis}_tests")
        _warm(path, mod)
        for name, fn in vars(mod).items():
            if name.startswith("test_") and callable(fn):
                specs.append(TestSpec(str(path), name, vis, getattr(fn, "points", DEFAULT_POINTS),
                                      getattr(fn, "limit_s", DEFAULT_LIMIT_S)))
    return specs


# --------------------------------------------------------------------------------------------------
# The child: one submission, tests in order, one signed JSON line per event
# --------------------------------------------------------------------------------------------------

def _limit_self(limits: Limits) -> None:
    mem = limits.memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 5))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _submission_error(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    subs = [f for f in tb if Path(f.filename).name == "submission.py"]
    where = f" at submission.py line {subs[-1].lineno} (in {subs[-1].name})" if subs else ""
    text = str(exc).strip().splitlines()
    said = f": {text[0][:200]}" if text else ""
    return f"{type(exc).__name__}{said}{where}"


def _load_source(text: str, name: str) -> Any:
    """A test module from its text (hidden tests: the child never opens the bundle's file)."""
    mod = types.ModuleType(name)
    sys.modules[name] = mod
    exec(compile(text, f"<{name}>", "exec"), mod.__dict__)
    return mod


def _child(emit: Callable[..., None], work: Path, submission: Path, files: list[tuple[Path, str]],
           tests: list[TestSpec], limits: Limits) -> None:
    os.setsid()
    _limit_self(limits)
    harness.TIME_SCALE = limits.scale
    warnings.filterwarnings("ignore", category=FutureWarning)    # torch 2.13's renamed collectives
    os.chdir(work)
    tempfile.tempdir = str(work)          # the ranks' scratch too: the grader removes it all afterwards
    if submission.suffix == ".py":
        shutil.copy(submission, work / "submission.py")
    else:
        shutil.copy(submission, work / f"submission{submission.suffix}")
        (work / "submission.py").write_text(f"PATH = {str(work / ('submission' + submission.suffix))!r}\n")
    mods: dict[str, Any] = {}
    for path, vis in files:               # before the submission runs; public first (hidden may import it)
        src = _SOURCES.get(str(path))
        mods[str(path)] = _load_source(src, f"{vis}_tests") if src is not None else _load(path, f"{vis}_tests")
        mods[str(path)].SESSION = _SESSION.get(str(path), {})
    _SOURCES.clear()
    if ISOLATE:                           # the bundle out of sight, loopback only (where Linux allows)
        contain.isolate({path.parents[1] for path, vis in files if vis == "hidden"})
    sys.addaudithook(contain.guard_hook)
    sys.path.insert(0, str(work))
    sys.modules.pop("submission", None)
    try:
        import submission as sub
    except BaseException as e:             # noqa: BLE001 - any error of the learner's file is feedback
        msg = f"the submission does not import: {_submission_error(e)}"
        for t in tests:
            emit(event="start", test=t.key)
            emit(event="result", test=t.key, passed=False, message=msg, seconds=0.0)
        os._exit(0)
    for t in tests:
        emit(event="start", test=t.key)
        t0 = time.perf_counter()
        try:
            getattr(mods[t.file], t.name)(sub)
            emit(event="result", test=t.key, passed=True, message="", seconds=time.perf_counter() - t0)
        except MemoryError:
            emit(event="result", test=t.key, passed=False, seconds=time.perf_counter() - t0,
                 message=f"ran out of memory (limit {limits.memory_mb} MB per process): does something grow "
                         "without bound?")
        except AssertionError as e:
            emit(event="result", test=t.key, passed=False, seconds=time.perf_counter() - t0,
                 message=str(e)[:4 * contain.MAX_MESSAGE] or "a check failed (no message)")
        except BaseException as e:        # noqa: BLE001 - the submission's error becomes the message
            mine = any(Path(f.filename).name == "submission.py" for f in traceback.extract_tb(e.__traceback__))
            who = "your code raised" if mine else "the test could not use your submission:"
            emit(event="result", test=t.key, passed=False, seconds=time.perf_counter() - t0,
                 message=f"{who} {_submission_error(e)}")
    os._exit(0)


def _emitter(fd: int, key: bytes) -> Callable[..., None]:
    seq = itertools.count()

    def emit(**obj: Any) -> None:
        os.write(fd, contain.sign(key, next(seq), json.dumps(obj).encode()))
    return emit


# --------------------------------------------------------------------------------------------------
# The parent: deadlines, kills, carrying on
# --------------------------------------------------------------------------------------------------

def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _status_text(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        why = {signal.SIGKILL: " (the memory or CPU limit?)", signal.SIGXCPU: " (the CPU-time limit)",
               signal.SIGSEGV: " (a crash)"}.get(sig, "")
        return f"was killed by signal {signal.Signals(sig).name}{why}"
    return f"exited with status {os.WEXITSTATUS(status)} (os._exit or sys.exit in your code?)"


FORGED = ("a result line the grader did not sign, or out of order (forged or garbled: does your code write to "
          "file descriptors it did not open?); every test left fails")
PRINTED = (f"printed over {contain.MAX_OUTPUT >> 20} MB to stdout/stderr (a print in a loop?); the output is "
           "captured and capped, and the process was stopped")


def _event(body: bytes | None, expected: TestSpec | None, current: TestSpec | None) -> dict | None:
    """A verified line as an event, if it is the one the protocol expects next; else None."""
    try:
        ev = json.loads(body) if body is not None else None
    except ValueError:
        return None
    if not isinstance(ev, dict) or expected is None or ev.get("test") != expected.key:
        return None
    if ev.get("event") == "start" and current is None:
        return ev
    ok = (isinstance(ev.get("passed"), bool) and isinstance(ev.get("message", ""), str)
          and isinstance(ev.get("seconds", 0.0), (int, float)))
    return ev if ev.get("event") == "result" and current is expected and ok else None


class _Stop(Exception):
    """Stop the child: ``what`` fails ``running`` (the test it runs since ``t0``), or every test left."""

    def __init__(self, what: str, running: TestSpec | None = None, t0: float = 0.0):
        super().__init__(what)
        self.what, self.running, self.t0 = what, running, t0


def _run_some(submission: Path, files: list[tuple[Path, str]], tests: list[TestSpec], limits: Limits
              ) -> list[tuple[TestSpec, dict]]:
    """Fork one child for ``tests``; return the results it produced, and a failure for the test it died in."""
    work = Path(tempfile.mkdtemp(prefix="grade-"))    # the child's working directory, removed afterwards
    key = secrets.token_bytes(32)
    r, w = os.pipe()
    out_r, out_w = os.pipe()                          # the submission's stdout and stderr: drained, capped
    keep = set(contain.descendants(os.getpid()))      # this process's own children: not the submission's
    pid = os.fork()
    if pid == 0:                                      # the child
        try:
            os.close(r)
            os.close(out_r)
            os.dup2(out_w, 1)
            os.dup2(out_w, 2)
            os.close(out_w)
            _child(_emitter(w, key), work, submission, files, tests, limits)
        finally:
            os._exit(0)
    os.close(w)
    os.close(out_w)
    done: list[tuple[TestSpec, dict]] = []
    try:
        try:
            _watch(pid, r, out_r, key, tests, limits, done)
        except _Stop as stop:
            _kill_group(pid)
            if stop.running is None:                      # no test running: the same fate for all left
                done += [(t, {"passed": False, "message": stop.what, "seconds": 0.0}) for t in tests[len(done):]]
            else:
                done.append((stop.running, {"passed": False, "message": stop.what,
                                            "seconds": time.monotonic() - stop.t0}))
        return done
    finally:
        os.close(r)
        os.close(out_r)
        escaped = contain.sweep(pid, keep)
        if escaped and done and done[-1][1].get("passed"):
            done[-1] = (done[-1][0], {"passed": False, "seconds": done[-1][1].get("seconds", 0.0),
                                      "message": f"{escaped} process(es) of the submission left its process "
                                                 "group (setsid or a double fork?) and were still running after "
                                                 "it ended; they were killed: end what you start"})
        shutil.rmtree(work, ignore_errors=True)


def _gone(current: TestSpec | None, status: int, started: float, done: list[tuple[TestSpec, dict]]) -> None:
    if current is not None:
        done.append((current, {"passed": False, "seconds": time.monotonic() - started,
                               "message": f"the grading process {_status_text(status)} during this test"}))


def _watch(pid: int, r: int, out_r: int, key: bytes, tests: list[TestSpec], limits: Limits,
           done: list[tuple[TestSpec, dict]]) -> None:
    """Read the child's lines into ``done`` until it ends; raise :class:`_Stop` to stop it."""
    current: TestSpec | None = None
    started = time.monotonic()
    deadline = started + IMPORT_LIMIT_S * limits.scale  # import of the submission
    buf, printed, seq, fds = b"", 0, 0, [r, out_r]
    status: int | None = None
    while True:
        wait = deadline - time.monotonic()
        if wait <= 0:
            if current is not None:
                raise _Stop(f"exceeded its wall-clock limit of {current.limit_s * limits.scale:g} s (a hang, a "
                            "deadlock, or a loop that never ends?)", current, started)
            if not done:
                raise _Stop(f"the submission took over {IMPORT_LIMIT_S * limits.scale:g} s to import (an endless "
                            "loop at module level?)")
            raise _Stop("the grading process stopped answering between two tests")
        ready, _, _ = select.select(fds, [], [], min(wait, 0.5))
        if out_r in ready:
            chunk = os.read(out_r, 1 << 16)
            printed += len(chunk)
            if not chunk:
                fds.remove(out_r)
            elif printed > contain.MAX_OUTPUT:
                raise _Stop(PRINTED, current, started)
        if r not in ready:
            if status is not None:                       # exited, and nothing more in the pipe
                return _gone(current, status, started, done)
            wpid, st = os.waitpid(pid, os.WNOHANG)
            if wpid == pid:
                status = st                               # one more look at the pipe, then gone
            continue
        chunk = os.read(r, 65536)
        if not chunk:                                    # the child is gone
            if status is None:
                _, status = os.waitpid(pid, 0)
            return _gone(current, status, started, done)
        buf += chunk
        if len(buf) > contain.MAX_LINE:
            raise _Stop(FORGED)
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            expected = tests[len(done)] if len(done) < len(tests) else None
            ev = _event(contain.verify(key, seq, line), expected, current)
            seq += 1
            if ev is None:
                raise _Stop(FORGED)
            if ev["event"] == "start":
                current = expected
                started = time.monotonic()
                deadline = started + expected.limit_s * limits.scale
            else:
                done.append((expected, ev))
                current = None
                deadline = time.monotonic() + 30.0       # between tests


def grade(exercise: str, submission: str | Path, *, bundle: str | Path | None = None,
          exercises_dir: str | Path | None = None, limits: Limits | None = None) -> Grade:
    """Grade one submission of ``exercise``: public tests, plus hidden tests when ``bundle`` is given."""
    import torch  # imported once here so that each forked child starts warm

    import parallel_lab.distributed.runtime.run  # noqa: F401 - with the model, train and launch modules
    from parallel_lab.distributed.runtime.launch import prime_lazy_imports

    torch.set_num_threads(1)    # one thread per process (and no thread pool to break in forked children)
    prime_lazy_imports()        # once here, not once per submission's child (each forks its ranks)
    contain.become_subreaper()  # what a submission leaves behind comes back here, to be swept

    limits = limits or Limits()
    exercises_dir = (Path(exercises_dir) if exercises_dir else default_exercises_dir()).resolve()
    submission = Path(submission)
    try:
        is_file = submission.is_file()
    except OSError:                       # a name too long for the file system
        is_file = False
    if not is_file:
        raise ParallelLabError(f"submission {str(submission)[:200]!r} is not a file; pass the path of your solution")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bundle-") as tmp:
        b = open_bundle(bundle, Path(tmp))
        files = test_files(exercise, exercises_dir, b)
        tests = discover(files)
        secret = contain.secret_lines(_SOURCES[str(f)] for f, vis in files if vis == "hidden")
        out = Grade(exercise, str(submission))
        todo = list(tests)
        while todo:
            results = _run_some(submission.resolve(), files, todo, limits)
            if not results:                                 # nothing came back at all
                results = [(todo[0], {"passed": False, "message": "the grading process died at start",
                                      "seconds": 0.0})]
            for t, ev in results:
                out.results.append(TestResult(t.name, t.visibility, t.points if ev["passed"] else 0, t.points,
                                              bool(ev["passed"]), contain.clean_message(ev.get("message", ""), secret),
                                              round(float(ev.get("seconds", 0.0)), 2)))
            finished = {t.key for t, _ in results}
            todo = [t for t in todo if t.key not in finished]
    out.seconds = time.monotonic() - t0
    return out


def submissions_in(directory: str | Path, exercises: Iterable[str]) -> list[tuple[str, str, Path]]:
    """``(learner, exercise, path)`` for ``DIR/LEARNER/EXERCISE.{py,yaml}`` files, sorted."""
    known = set(exercises)
    out = []
    if not Path(directory).is_dir():
        raise ParallelLabError(f"--batch {str(directory)[:200]!r} is not a directory; pass the folder that holds "
                               "one folder per learner (DIR/LEARNER/EXERCISE.py)")
    for learner in sorted(p for p in Path(directory).iterdir() if p.is_dir()):
        for f in sorted(learner.iterdir()):
            if f.suffix in SUBMISSION_SUFFIXES and f.stem in known:
                out.append((learner.name, f.stem, f))
    return out


def _not_graded(exercise: str, path: Path, why: str) -> Grade:
    """The row of a submission that could not be graded: 0 points, one failure ``grading`` saying why."""
    return Grade(exercise, str(path), [TestResult("grading", "public", 0, 0, False, why[:contain.MAX_MESSAGE], 0.0)])


def grade_batch(directory: str | Path, *, bundle: str | Path | None = None, exercises_dir: str | Path | None = None,
                limits: Limits | None = None, on_grade: Callable[[str, Grade], None] | None = None
                ) -> list[tuple[str, Grade]]:
    """Grade every submission of a class; ``on_grade(learner, grade)`` after each one."""
    exercises_dir = Path(exercises_dir) if exercises_dir else default_exercises_dir()
    subs = submissions_in(directory, list_exercises(exercises_dir))
    if not subs:
        raise ParallelLabError(f"no submissions in {directory}: expected DIR/LEARNER/EXERCISE.py (exercises: "
                               f"{', '.join(list_exercises(exercises_dir))})")
    out = []
    with tempfile.TemporaryDirectory(prefix="bundle-") as tmp:
        b = open_bundle(bundle, Path(tmp))          # an archive is unpacked once for the whole class
        for learner, ex, path in subs:
            try:
                g = grade(ex, path, bundle=b, exercises_dir=exercises_dir, limits=limits)
            except ParallelLabError as e:
                g = _not_graded(ex, path, str(e))
            except Exception as e:       # noqa: BLE001 - one submission's failure never ends a class's grading
                g = _not_graded(ex, path, f"the grader failed on this submission ({type(e).__name__}: "
                                          f"{str(e)[:200]}); grade it alone, and report it if it happens again")
            out.append((learner, g))
            if on_grade is not None:
                on_grade(learner, g)
    return out


CSV_FIELDS = ("learner", "exercise", "points", "max_points", "failed_tests", "feedback", "written_answers")


def write_csv(rows: list[tuple[str, Grade]], path: str | Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for learner, g in rows:
            failed = [r for r in g.results if not r.passed]
            w.writerow([learner, g.exercise, f"{g.points:g}", g.max_points, " ".join(r.name for r in failed),
                        " | ".join(f"{r.name}: {r.message}" for r in failed), answers_text(g.exercise, g.submission)])
