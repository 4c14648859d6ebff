"""The grader: each submission in a fresh, limited process; every test a line of points and feedback.

``grade(exercise, path, bundle=...)`` grades one submission; ``grade_batch(dir, bundle=...)`` a class
(``DIR/LEARNER/EXERCISE.py``, or ``.yaml`` for a plan file), written to a CSV by ``write_csv``. The CLI is
``parallel-lab grade EXERCISE [PATH] [--bundle DIR] [--json]`` and ``parallel-lab grade --batch DIR --out
grades.csv``. Without a bundle only the public tests run (the learner's loop).

Isolation, per submission. The grader imports torch once, then forks a child per submission (a fresh
process: it never shares state with another submission; the parent runs no submission code). The child
starts a new session (its own process group), lowers its limits (``RLIMIT_AS`` address space,
``RLIMIT_CPU``, no core files), works in a new temporary directory holding a copy of the submission as
``submission.py`` on ``sys.path`` (so worker functions pickle by reference), refuses Python sockets bound
to a fixed port (an audit hook: ranks rendezvous on a port the launcher asks the OS for), imports the
submission and runs the tests in order, reporting each over a pipe. The parent gives each test its
wall-clock limit: a child that overruns it, or dies (``os._exit``, a signal, the memory limit), is killed
with its whole process group, the test is failed with what happened, and a new child carries on with the
next test. Distributed tests run their ranks through :func:`parallel_lab.grading.harness.run_ranks`, which
names the rank that raised, exited or hung.

This is not a security boundary: the submission runs as your user, can read your files and can use the
network. Grade untrusted code inside a container, for example::

    docker run --rm --network none --memory 4g --cpus 2 -v $PWD:/lab:ro -w /lab IMAGE \\
        parallel-lab grade --batch /lab/submissions --bundle /lab/instructor --out /tmp/grades.csv

Determinism: tests seed their data and state their tolerances; the same submission gets the same grade.
A test file may define ``session_values()``: references and measurements that do not depend on the
submission (a one-process training run, the bytes measured on ranks running the library's code). The
grader computes them once per session, before it forks any submission's process, and each test module
sees them as ``SESSION``; so a class of 100 submissions pays for them once.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import resource
import select
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from parallel_lab.errors import ParallelLabError
from parallel_lab.grading import harness
from parallel_lab.grading.catalog import answers_text
from parallel_lab.grading.harness import DEFAULT_LIMIT_S, DEFAULT_POINTS

REPO = Path(__file__).resolve().parents[2]
SUBMISSION_SUFFIXES = (".py", ".yaml", ".yml")
IMPORT_LIMIT_S = 30.0        # wall clock for importing a submission (torch is already imported)


@dataclass(frozen=True)
class Limits:
    """Per-submission limits. ``memory_mb``: address space of each process (ranks too); ``cpu_s``: CPU
    seconds of each process; ``scale``: multiplies every test's wall-clock limit (slow machines)."""

    memory_mb: int = 3072
    cpu_s: int = 300
    scale: float = 1.0


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
    return sorted(p.name for p in d.iterdir() if (p / "public_tests.py").exists())


def open_bundle(bundle: str | Path | None, into: Path) -> Path | None:
    """The instructor bundle as a directory: a directory as is, an archive (.tar.gz, .zip) unpacked."""
    if bundle is None:
        return None
    b = Path(bundle).resolve()
    if b.is_dir():
        return b
    if b.is_file():
        shutil.unpack_archive(str(b), str(into))
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


def test_files(exercise: str, exercises_dir: Path, bundle: Path | None) -> list[tuple[Path, str]]:
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
        mod = _load(path, f"{vis}_tests")
        _warm(path, mod)
        for name, fn in vars(mod).items():
            if name.startswith("test_") and callable(fn):
                specs.append(TestSpec(str(path), name, vis, getattr(fn, "points", DEFAULT_POINTS),
                                      getattr(fn, "limit_s", DEFAULT_LIMIT_S)))
    return specs


# --------------------------------------------------------------------------------------------------
# The child: one submission, tests in order, one JSON line per event
# --------------------------------------------------------------------------------------------------

def _refuse_fixed_ports(event: str, args: tuple) -> None:
    if event == "socket.bind" and len(args) >= 2:
        addr = args[1]
        if isinstance(addr, tuple) and len(addr) >= 2 and isinstance(addr[1], int) and addr[1] != 0:
            raise PermissionError(f"the submission bound a fixed port {addr[1]}; fixed ports collide when two "
                                  "jobs run at once: let the OS pick one (bind to port 0) or use the launcher")


def _limit_self(limits: Limits) -> None:
    mem = limits.memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 5))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _submission_error(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    subs = [f for f in tb if Path(f.filename).name == "submission.py"]
    where = f" at submission.py line {subs[-1].lineno} (in {subs[-1].name})" if subs else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _child(fd: int, work: Path, submission: Path, files: list[tuple[Path, str]], tests: list[TestSpec],
           limits: Limits) -> None:
    def emit(**obj: Any) -> None:
        os.write(fd, (json.dumps(obj) + "\n").encode())

    os.setsid()
    _limit_self(limits)
    harness.TIME_SCALE = limits.scale
    warnings.filterwarnings("ignore", category=FutureWarning)    # torch 2.13's renamed collectives
    os.chdir(work)
    tempfile.tempdir = str(work)          # the ranks' scratch too: the grader removes it all afterwards
    sys.addaudithook(_refuse_fixed_ports)
    if submission.suffix == ".py":
        shutil.copy(submission, work / "submission.py")
    else:
        shutil.copy(submission, work / f"submission{submission.suffix}")
        (work / "submission.py").write_text(f"PATH = {str(work / ('submission' + submission.suffix))!r}\n")
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
    mods: dict[str, Any] = {}
    for path, vis in files:                    # public first: hidden tests may `import public_tests`
        mods[str(path)] = _load(path, f"{vis}_tests")
        mods[str(path)].SESSION = _SESSION.get(str(path), {})
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
                 message=str(e) or "a check failed (no message)")
        except BaseException as e:        # noqa: BLE001 - the submission's error becomes the message
            mine = any(Path(f.filename).name == "submission.py" for f in traceback.extract_tb(e.__traceback__))
            who = "your code raised" if mine else "the test could not use your submission:"
            emit(event="result", test=t.key, passed=False, seconds=time.perf_counter() - t0,
                 message=f"{who} {_submission_error(e)}")
    os._exit(0)


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


def _run_some(submission: Path, files: list[tuple[Path, str]], tests: list[TestSpec], limits: Limits
              ) -> list[tuple[TestSpec, dict]]:
    """Fork one child for ``tests``; return the results it produced, and a failure for the test it died in."""
    work = Path(tempfile.mkdtemp(prefix="grade-"))    # the child's working directory, removed afterwards
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                      # the child
        os.close(r)
        try:
            _child(w, work, submission, files, tests, limits)
        finally:
            os._exit(0)
    os.close(w)
    by_name = {t.key: t for t in tests}
    done: list[tuple[TestSpec, dict]] = []
    current: TestSpec | None = None
    started = time.monotonic()
    deadline = started + IMPORT_LIMIT_S * limits.scale  # import of the submission
    buf = b""
    try:
        while True:
            wait = deadline - time.monotonic()
            if wait <= 0:
                _kill_group(pid)
                if current is not None:
                    what = (f"exceeded its wall-clock limit of {current.limit_s * limits.scale:g} s (a hang, a "
                            "deadlock, or a loop that never ends?)")
                elif not done:
                    what = (f"the submission took over {IMPORT_LIMIT_S * limits.scale:g} s to import (an endless "
                            "loop at module level?)")
                else:
                    what = "the grading process stopped answering between two tests"
                if current is not None:
                    done.append((current, {"passed": False, "message": what, "seconds": time.monotonic() - started}))
                else:                                      # no test started: the same fate for all of them
                    done += [(t, {"passed": False, "message": what, "seconds": 0.0}) for t in tests[len(done):]]
                return done
            ready, _, _ = select.select([r], [], [], min(wait, 1.0))
            if not ready:
                continue
            chunk = os.read(r, 65536)
            if not chunk:                                  # the child is gone
                _, status = os.waitpid(pid, 0)
                if current is not None:
                    done.append((current, {"passed": False, "seconds": time.monotonic() - started,
                                           "message": f"the grading process {_status_text(status)} during this "
                                                      "test"}))
                try:
                    os.killpg(pid, signal.SIGKILL)     # ranks it left behind
                except (ProcessLookupError, PermissionError):
                    pass
                return done
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                ev = json.loads(line)
                if ev["event"] == "start":
                    current = by_name[ev["test"]]
                    started = time.monotonic()
                    deadline = started + current.limit_s * limits.scale
                else:
                    done.append((by_name[ev["test"]], ev))
                    current = None
                    deadline = time.monotonic() + 30.0       # between tests
    finally:
        os.close(r)
        shutil.rmtree(work, ignore_errors=True)


def grade(exercise: str, submission: str | Path, *, bundle: str | Path | None = None,
          exercises_dir: str | Path | None = None, limits: Limits | None = None) -> Grade:
    """Grade one submission of ``exercise``: public tests, plus hidden tests when ``bundle`` is given."""
    import torch  # imported once here so that each forked child starts warm

    import parallel_lab.distributed.runtime.run  # noqa: F401 - with the model, train and launch modules
    from parallel_lab.distributed.runtime.launch import prime_lazy_imports

    torch.set_num_threads(1)    # one thread per process (and no thread pool to break in forked children)
    prime_lazy_imports()        # once here, not once per submission's child (each forks its ranks)

    limits = limits or Limits()
    exercises_dir = (Path(exercises_dir) if exercises_dir else default_exercises_dir()).resolve()
    submission = Path(submission)
    if not submission.is_file():
        raise ParallelLabError(f"submission {str(submission)!r} is not a file; pass the path of your solution")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bundle-") as tmp:
        b = open_bundle(bundle, Path(tmp))
        files = test_files(exercise, exercises_dir, b)
        tests = discover(files)
        out = Grade(exercise, str(submission))
        todo = list(tests)
        while todo:
            results = _run_some(submission.resolve(), files, todo, limits)
            if not results:                                 # nothing came back at all
                results = [(todo[0], {"passed": False, "message": "the grading process died at start",
                                      "seconds": 0.0})]
            for t, ev in results:
                out.results.append(TestResult(t.name, t.visibility, t.points if ev["passed"] else 0, t.points,
                                              bool(ev["passed"]), ev.get("message", ""),
                                              round(float(ev.get("seconds", 0.0)), 2)))
            finished = {t.key for t, _ in results}
            todo = [t for t in todo if t.key not in finished]
    out.seconds = time.monotonic() - t0
    return out


def submissions_in(directory: str | Path, exercises: Iterable[str]) -> list[tuple[str, str, Path]]:
    """``(learner, exercise, path)`` for ``DIR/LEARNER/EXERCISE.{py,yaml}`` files, sorted."""
    known = set(exercises)
    out = []
    for learner in sorted(p for p in Path(directory).iterdir() if p.is_dir()):
        for f in sorted(learner.iterdir()):
            if f.suffix in SUBMISSION_SUFFIXES and f.stem in known:
                out.append((learner.name, f.stem, f))
    return out


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
            g = grade(ex, path, bundle=b, exercises_dir=exercises_dir, limits=limits)
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
