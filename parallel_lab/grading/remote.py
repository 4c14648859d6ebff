"""Tests driven from outside the submission's process: it executes what a test asks, never the test's code.

A *driver* (forked from the grader, never importing the submission) runs each test with ``sub`` a
:class:`Driver` proxy: every use of it is sent to the submission's process (the *executor*, forked from the
clean :mod:`parallel_lab.grading.zygote`) as a request, executed there by a :class:`tape.Recorder` on the real
objects, and answered with the same frame that goes on the tape for the judge. A request carries the
arguments (inputs), pickled by the driver: the submission's objects by handle, and a function of a hidden test
module (a rank function for ``run_ranks``) by value, with only the module globals it names; nothing else of a
hidden test (its checks, expected values, ``SESSION``, source) is ever in the executor. The executor answers
in plain-data frames (:mod:`parallel_lab.grading.tape`), never pickle.
"""

from __future__ import annotations

import importlib
import io
import marshal
import os
import pickle
import sys
import types
from collections.abc import Callable
from typing import Any

from parallel_lab.grading import contain, judge, tape

#: modules a test file is loaded as in the driver and the judge whose functions travel by value
HIDDEN_MODULES = ("hidden_tests",)


def _names(code: types.CodeType) -> set[str]:
    out = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out |= _names(c)
    return out


def _function(code: bytes, name: str, qualname: str, module: str, globs: dict, defaults: Any, kwdefaults: Any,
              cells: Any) -> types.FunctionType:
    """A function shipped by value, rebuilt in the executor."""
    g = {"__builtins__": __builtins__, "__name__": module, **globs}
    closure = tuple(types.CellType(c) for c in cells) if cells is not None else None
    fn = types.FunctionType(marshal.loads(code), g, name, defaults, closure)
    fn.__qualname__, fn.__module__, fn.__kwdefaults__ = qualname, module, kwdefaults
    return fn


class _Shipper(pickle.Pickler):
    """Pickles a request: proxies as their handles; functions of a hidden module by value."""

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is tape.Proxy:
            return object.__getattribute__(obj, "_pl")[1]
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.ModuleType):
            return importlib.import_module, (obj.__name__,)
        if isinstance(obj, types.FunctionType) and obj.__module__ in HIDDEN_MODULES:
            names = _names(obj.__code__) - {obj.__name__}
            globs = {n: obj.__globals__[n] for n in sorted(names) if n in obj.__globals__}
            cells = [c.cell_contents for c in obj.__closure__] if obj.__closure__ else None
            return _function, (marshal.dumps(obj.__code__), obj.__name__, obj.__qualname__, obj.__module__, globs,
                               obj.__defaults__, obj.__kwdefaults__, cells)
        return NotImplemented


class _Unshipper(pickle.Unpickler):
    def __init__(self, data: bytes, proxy: Callable[[int], Any]) -> None:
        super().__init__(io.BytesIO(data))
        self.proxy = proxy

    def persistent_load(self, pid: Any) -> Any:
        if not isinstance(pid, int):
            raise pickle.UnpicklingError("not a handle")
        return self.proxy(pid)


def _read_frames(fd: int) -> Any:
    """Frames from ``fd`` until it closes (a generator); :class:`tape.Malformed` for anything else."""
    reader = tape.FrameReader()
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except OSError:
            return
        if not chunk:
            return
        yield from reader.feed(chunk)


class Driver(tape.Replayer):
    """The driver's side: each use of a proxy is a request to the executor, answered by its frame."""

    def __init__(self, send: Callable[[bytes], None], replies: Any) -> None:
        super().__init__()
        self.send, self.replies = send, replies

    def op(self, kind: str, h: int, args: tuple, run: Callable[..., Any] | None = None) -> Any:
        sig, found = self._event(kind, h, args)
        for key, obj in found:
            self.keys.setdefault(key, obj)
        buf = io.BytesIO()
        _Shipper(buf, protocol=pickle.HIGHEST_PROTOCOL).dump((args, run))
        try:
            self.send(tape.frame({"k": "op", "op": kind, "h": h}, [buf.getvalue()]))
            ev = next(self.replies, None)
        except (OSError, tape.Malformed):
            ev = None
        return self.answer(kind, h, sig, ev)


def drive(send_fd: int, reply_fd: int, tests: list[Any], mods: dict[str, Any]) -> None:
    """The driver: every test in order against the executor; it decides nothing (the judge replays the tape)."""
    send = judge.writer(send_fd)
    drv = Driver(send, _read_frames(reply_fd))
    tape.ACTIVE = drv
    try:
        for t in tests:
            send(tape.frame({"k": "test", "test": t.key}))
            tape.seed()
            drv.begin(t.key)
            try:
                getattr(mods[t.file], t.name)(drv.root)
            except BaseException:          # noqa: BLE001, S110 - the judge decides, from the tape
                pass
            send(tape.frame({"k": "done", "test": t.key}))
        send(tape.frame({"k": "bye"}))
    except OSError:                        # the executor is gone
        pass
    os._exit(0)


def execute(tape_fd: int, request_fd: int, reply_fd: int, work: str) -> None:
    """The executor, in the submission's process: import it, then do what the driver asks, frame by frame."""
    to_grader, to_driver = judge.writer(tape_fd), judge.writer(reply_fd)

    def both(data: bytes) -> None:
        to_grader(data)
        to_driver(data)

    sys.addaudithook(contain.guard_hook)
    sys.path.insert(0, work)
    sys.modules.pop("submission", None)
    try:
        import submission as sub
    except BaseException as e:             # noqa: BLE001 - any error of the learner's file is feedback
        to_grader(tape.frame({"k": "import_error", "m": tape.submission_error(e)}))
        os._exit(0)
    rec = tape.Recorder(both, sub)
    tape.ACTIVE = rec
    for head, payload in _read_frames(request_fd):
        kind = head.get("k")
        if kind == "test":
            to_grader(tape.frame({"k": "start", "test": str(head.get("test"))}))
            tape.seed()
            rec.begin(str(head.get("test")))
        elif kind == "done":
            to_grader(tape.frame({"k": "end", "test": str(head.get("test")), "note": ""}))
        elif kind == "op":
            args, run = _Unshipper(payload, rec.proxy).load()
            try:
                rec.op(str(head.get("op")), int(head.get("h", 0)), args, run)
            except BaseException:          # noqa: BLE001, S110 - recorded as the event's exception
                pass
        else:
            break
    os._exit(0)
