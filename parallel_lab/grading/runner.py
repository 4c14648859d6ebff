"""The grader: each submission in a fresh, limited process; every test a line of points and feedback.

``grade(exercise, path, bundle=...)`` grades one submission; ``grade_batch(dir, bundle=...)`` a class
(``DIR/LEARNER/EXERCISE.py``, or ``.yaml`` for a plan file), written to a CSV by ``write_csv``; the CLI is
``parallel-lab grade``. Without a bundle only the public tests run (the learner's loop).

Per submission, a driver forked from the grader runs the tests (it holds them, hidden ones included) and the
submission's process executes what they ask of its code: forked by a zygote that never held a hidden test
(:mod:`parallel_lab.grading.zygote`, :mod:`parallel_lab.grading.remote`), it starts a new session, lowers its
limits, enters namespaces that hide the bundle and close the network where Linux allows
(:mod:`parallel_lab.grading.contain`), imports the submission and records what its code hands back as data
frames on a pipe; its output is drained and capped, a test past its limit is killed with its process group,
and every descendant left is killed after it. Then a judge forked from the grader, which never imports the
submission, replays each test from its frames and decides (:mod:`parallel_lab.grading.tape`,
:mod:`parallel_lab.grading.judge`). Feedback is bounded and never quotes a hidden file. ``session_values()``
of a test file are computed once per session. Details: docs/grading.md.
"""

from __future__ import annotations

import csv
import math
import os
import re
import select
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from parallel_lab.errors import ParallelLabError
from parallel_lab.grading import contain, judge, remote, tape, zygote
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
        mod = judge.load(path, f"{vis}_tests")
        _warm(path, mod)
        for name, fn in vars(mod).items():
            if name.startswith("test_") and callable(fn):
                specs.append(TestSpec(str(path), name, vis, getattr(fn, "points", DEFAULT_POINTS),
                                      getattr(fn, "limit_s", DEFAULT_LIMIT_S)))
    return specs


# --------------------------------------------------------------------------------------------------
# The parent: deadlines, kills, carrying on
# --------------------------------------------------------------------------------------------------

class _Child:
    """A process the grader forked itself: ``poll`` and ``wait`` for its exit status."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def poll(self) -> int | None:
        wpid, st = os.waitpid(self.pid, os.WNOHANG)
        return st if wpid == self.pid else None

    def wait(self) -> int:
        return os.waitpid(self.pid, 0)[1]


class _Zygoted(_Child):
    """A submission's process, forked by the zygote: its exit status comes from there."""

    def __init__(self, pid: int, zygote: Any) -> None:
        super().__init__(pid)
        self.zygote = zygote

    def poll(self) -> int | None:
        return self.zygote.poll(self.pid)

    def wait(self) -> int:
        return self.zygote.wait(self.pid)


def _kill_group(child: _Child) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        child.wait()
    except (ChildProcessError, OSError):
        pass


def _forked(body: Callable[[int], None]) -> Callable[[int, int, int, int], _Child]:
    """Start ``body(fd)`` in a process forked from the grader (a judge), stdout and stderr to ``out_w``."""
    def start(r: int, w: int, out_r: int, out_w: int) -> _Child:
        pid = os.fork()
        if pid == 0:
            try:
                os.close(r)
                os.close(out_r)
                os.dup2(out_w, 1)
                os.dup2(out_w, 2)
                os.close(out_w)
                body(w)
            finally:
                os._exit(0)
        return _Child(pid)
    return start


#: the zygote of this grading process (:mod:`parallel_lab.grading.zygote`), started at its first grade
_ZYGOTE: zygote.Zygote | None = None


def _the_zygote() -> zygote.Zygote:
    global _ZYGOTE
    if _ZYGOTE is None or not _ZYGOTE.alive():
        _ZYGOTE = zygote.Zygote()
    return _ZYGOTE


def _status_text(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        why = {signal.SIGKILL: " (the memory or CPU limit?)", signal.SIGXCPU: " (the CPU-time limit)",
               signal.SIGSEGV: " (a crash)"}.get(sig, "")
        return f"was killed by signal {signal.Signals(sig).name}{why}"
    return f"exited with status {os.WEXITSTATUS(status)} (os._exit or sys.exit in your code?)"


MALFORMED = ("your process's pipe to the grader carried bytes that are not its recorder's frames, or frames out of "
             "order (forged or garbled: does your code write to file descriptors it did not open?); every test "
             "left fails")
PRINTED = (f"printed over {contain.MAX_OUTPUT >> 20} MB to stdout/stderr (a print in a loop?); the output is "
           "captured and capped, and the process was stopped")


def _result_ok(head: dict) -> bool:
    return (isinstance(head.get("passed"), bool) and isinstance(head.get("message", ""), str)
            and isinstance(head.get("seconds", 0.0), (int, float)))


class _Stop(Exception):
    """Stop the child: ``what`` fails ``running`` (the test it runs since ``t0``), or every test left."""

    def __init__(self, what: str, running: TestSpec | None = None, t0: float = 0.0):
        super().__init__(what)
        self.what, self.running, self.t0 = what, running, t0


def _process(start: Callable[[int, int, int, int], _Child], tests: list[TestSpec], limits: Limits, closing: str
             ) -> tuple[list[tuple[TestSpec, dict]], int]:
    """``start(r, w, out_r, out_w)`` a process that writes frames to ``w``, its stdout and stderr drained; watch
    its frames (a test is done at its ``closing`` frame). The tests done, a failure for the one it stopped or
    died in, and the processes that left its group."""
    r, w = os.pipe()
    out_r, out_w = os.pipe()                          # stdout and stderr: drained, capped
    keep = set(contain.descendants(os.getpid()))      # this process's own children: not the submission's
    try:
        child = start(r, w, out_r, out_w)
    finally:
        os.close(w)
        os.close(out_w)
    pid = child.pid
    done: list[tuple[TestSpec, dict]] = []
    try:
        try:
            _watch(child, r, out_r, tests, limits, done, closing)
        except _Stop as stop:
            _kill_group(child)
            if stop.running is None:                      # no test running: the same fate for all left
                done += [(t, {"passed": False, "message": stop.what, "seconds": 0.0}) for t in tests[len(done):]]
            else:
                done.append((stop.running, {"passed": False, "message": stop.what,
                                            "seconds": time.monotonic() - stop.t0}))
    finally:
        os.close(r)
        os.close(out_r)
        escaped = contain.sweep(pid, keep)
    return done, escaped


def _judged(work: Path, files: list[tuple[Path, str]], tests: list[TestSpec], tapes: dict[str, dict] | None,
            limits: Limits) -> list[tuple[TestSpec, dict]]:
    """The judges' verdicts on ``tests``: replayed from ``tapes``, or run on a plan file (``tapes`` None)."""
    out: list[tuple[TestSpec, dict]] = []
    todo = list(tests)
    while todo:
        setup = judge.setup_of(work, limits, files, _SOURCES, _SESSION, ISOLATE)
        res, _ = _process(_forked(lambda w, todo=todo, setup=setup: judge.judge(judge.emitter(w), work, todo, tapes,
                                                                                     limits, setup)),
                          todo, limits, "result")
        res = res or [(todo[0], {"passed": False, "message": "the judge died at start", "seconds": 0.0})]
        out += res
        todo = todo[len(res):]
    return out


def _run_some(submission: Path, files: list[tuple[Path, str]], tests: list[TestSpec], limits: Limits
              ) -> list[tuple[TestSpec, dict]]:
    """Grade a prefix of ``tests``: the submission's process records them until it ends or is stopped, then
    judges decide each test it finished (a plan file has no process of its own: a judge runs its tests)."""
    work = Path(tempfile.mkdtemp(prefix="grade-"))    # the child's working directory, removed afterwards
    try:
        if submission.suffix != ".py":
            shutil.copy(submission, work / f"submission{submission.suffix}")
            (work / "submission.py").write_text(f"PATH = {str(work / ('submission' + submission.suffix))!r}\n")
            return _judged(work, files, tests, None, limits)
        shutil.copy(submission, work / "submission.py")
        ran, escaped = _recorded(work, files, tests, limits)
        tapes = {t.key: ev for t, ev in ran if "tape" in ev}
        verdicts = {t.key: {**ev, "seconds": tapes[t.key]["seconds"]}
                    for t, ev in _judged(work, files, [t for t, _ in ran if t.key in tapes], tapes, limits)}
        done = [(t, verdicts[t.key] if t.key in tapes else ev) for t, ev in ran]
        if escaped and done and done[-1][1].get("passed"):
            done[-1] = (done[-1][0], {"passed": False, "seconds": done[-1][1].get("seconds", 0.0),
                                      "message": f"{escaped} process(es) of the submission left its process "
                                                 "group (setsid or a double fork?) and were still running after "
                                                 "it ended; they were killed: end what you start"})
        return done
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _recorded(work: Path, files: list[tuple[Path, str]], tests: list[TestSpec], limits: Limits
              ) -> tuple[list[tuple[TestSpec, dict]], int]:
    """The run of ``tests``: a driver forked from here (it holds the tests) asks, the submission's process forked
    by the zygote (it never holds a hidden test) executes and records (:mod:`parallel_lab.grading.remote`)."""
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    setup = judge.setup_of(work, limits, files, _SOURCES, _SESSION, False)
    driver = os.fork()
    if driver == 0:
        try:
            os.close(req_r)
            os.close(rep_w)
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
            remote.drive(req_w, rep_r, tests, setup())
        finally:
            os._exit(0)
    os.close(req_w)
    os.close(rep_r)
    public = [str(p) for p, vis in files if vis == "public"]
    spec = {"work": str(work), "memory_mb": limits.memory_mb, "cpu_s": limits.cpu_s, "scale": limits.scale,
            "public": public[0] if public else "", "isolate": ISOLATE,
            "hide": sorted({str(p.parents[1]) for p, vis in files if vis == "hidden"})}

    ends = [req_r, rep_w]                             # the executor's: closed here once it has them

    def start(r: int, w: int, out_r: int, out_w: int) -> _Child:
        z = _the_zygote()
        return _Zygoted(z.fork(spec, [w, out_w, *ends]), z)

    try:
        return _process(start, tests, limits, "end")
    finally:
        for fd in ends:
            os.close(fd)
        _kill_group(_Child(driver))


def _gone(current: TestSpec | None, status: int, started: float, done: list[tuple[TestSpec, dict]]) -> None:
    if current is not None:
        done.append((current, {"passed": False, "seconds": time.monotonic() - started,
                               "message": f"the grading process {_status_text(status)} during this test"}))


def _watch(child: _Child, r: int, out_r: int, tests: list[TestSpec], limits: Limits, done: list[tuple[TestSpec, dict]],
           closing: str) -> None:
    """Read the child's frames into ``done`` until it ends; raise :class:`_Stop` to stop it. A recording child
    closes a test with ``end`` (its frames are the test's tape), a judge with ``result``."""
    current: TestSpec | None = None
    started = time.monotonic()
    deadline = started + IMPORT_LIMIT_S * limits.scale  # import of the submission
    reader, frames, printed, fds = tape.FrameReader(), [], 0, [r, out_r]
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
            status = child.poll()                         # if gone: one more look at the pipe
            continue
        chunk = os.read(r, 1 << 16)
        if not chunk:                                    # the child is gone
            if status is None:
                status = child.wait()
            return _gone(current, status, started, done)
        try:
            got = reader.feed(chunk)
        except tape.Malformed as e:
            raise _Stop(f"{MALFORMED} ({e})") from None
        for head, payload in got:
            expected = tests[len(done)] if len(done) < len(tests) else None
            kind = head.get("k")
            if kind == "start" and current is None and expected is not None and head.get("test") == expected.key:
                current, frames, started = expected, [], time.monotonic()
                deadline = started + expected.limit_s * limits.scale
            elif kind == "ev" and closing == "end" and current is not None:
                frames.append((head, payload))
            elif kind == closing and current is not None and head.get("test") == current.key \
                    and (closing == "end" or _result_ok(head)):
                ev = {"tape": frames, "note": str(head.get("note", ""))[:400],
                      "seconds": time.monotonic() - started} if closing == "end" else head
                done.append((current, ev))
                current = None
                deadline = time.monotonic() + 30.0       # between tests
            elif kind == "import_error" and closing == "end" and current is None and not done:
                raise _Stop(f"the submission does not import: {str(head.get('m', ''))[:300]}")
            else:
                raise _Stop(MALFORMED)


def grade(exercise: str, submission: str | Path, *, bundle: str | Path | None = None,
          exercises_dir: str | Path | None = None, limits: Limits | None = None) -> Grade:
    """Grade one submission of ``exercise``: public tests, plus hidden tests when ``bundle`` is given."""
    import torch  # imported once here so that each forked child starts warm

    import parallel_lab.distributed.runtime.run  # noqa: F401 - with the model, train and launch modules
    from parallel_lab.distributed.runtime.launch import prime_lazy_imports

    torch.set_num_threads(1)    # one thread per process (and no thread pool to break in forked children)
    prime_lazy_imports()        # once here, not once per submission's child (each forks its ranks)
    contain.become_subreaper()  # what a submission leaves behind comes back here, to be swept
    contain.undumpable()        # no other process of this user reads this one's memory (the hidden tests)
    _the_zygote()               # the submissions' clean parent, started now: it imports torch meanwhile

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
