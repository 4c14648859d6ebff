"""Results a submission cannot write: its process records what its code handed back, a judge decides.

The submission's process (the *recorder*) executes each use of ``sub`` (a proxy of the submission) that a test
run by the driver asks for (:mod:`parallel_lab.grading.remote`): every value its code hands back (an attribute, a
call's result or exception, ``len``, ``iter``, ``str``...) and the result of every ``run_ranks`` that is given
``sub`` goes to a pipe as a *frame* of plain data (JSON, and raw bytes for tensors: never pickle), and the test
goes on with what the frame decodes to. Once every process of the submission is gone, a *judge* forked from the
grader (it never imports the submission) runs the same test with a proxy that answers from those frames, and its
assertions decide. No frame can say "passed": a frame that does not decode, or a test that asks of the tape what
the run did not record, fails that test. Objects the test handed in come back by reference (a model's
parameters), other objects as handles.

Rules for a test: pass ``sub`` to ``run_ranks`` as an argument (never in a closure); what the submission does
to the test's own objects counts through what comes back (a rank's return value), and values measured
inside the submission's processes (a rank's gradients, its recorded collectives) are its outputs: the
judge checks them, it cannot vouch for how they were made. Both sides seed ``random`` and torch before each
test, and the recorder restores their state after each call into the submission.
"""

from __future__ import annotations

import builtins
import ctypes
import dataclasses
import enum
import hashlib
import importlib
import json
import math
import numbers
import random
import struct
import sys
import traceback
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

MAGIC = b"PLT1"
_HEAD = struct.Struct(">4sII")
MAX_HEADER = 1 << 20      #: bytes of one frame's JSON header
MAX_TAPE = 64 << 20       #: bytes one process of a submission may record in all
MAX_DEPTH = 48
MAX_NODES = 500_000
_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
           "complex64", "complex128")
_OPS = {"getattr": lambda o, a: getattr(o, a[0]), "call": lambda o, a: o(*a[0], **a[1]), "len": lambda o, a: len(o),
        "bool": lambda o, a: bool(o), "str": lambda o, a: str(o), "repr": lambda o, a: repr(o),
        "iter": lambda o, a: iter(o), "next": lambda o, a: next(o), "getitem": lambda o, a: o[a[0]],
        "contains": lambda o, a: a[0] in o, "float": lambda o, a: float(o), "int": lambda o, a: int(o),
        "index": lambda o, a: o.__index__(), "format": lambda o, a: format(o, a[0])}


class Malformed(ValueError):
    """Bytes that are not the recorder's frames, or a frame that does not decode."""


class TapeError(BaseException):
    """The judge's test asked of the tape what the run did not record (not catchable as ``Exception``)."""


# --------------------------------------------------------------------------------------------------
# Frames: a 12-byte head (magic, header length, payload length), a JSON header, raw payload bytes
# --------------------------------------------------------------------------------------------------

def frame(header: dict, blobs: list[bytes] | tuple = ()) -> bytes:
    h = json.dumps({**header, "bl": [len(b) for b in blobs]} if blobs else header, separators=(",", ":")).encode()
    payload = b"".join(blobs)
    return _HEAD.pack(MAGIC, len(h), len(payload)) + h + payload


def split_blobs(header: dict, payload: bytes) -> list[bytes]:
    lengths = header.get("bl", [])
    if not isinstance(lengths, list) or not all(isinstance(n, int) and n >= 0 for n in lengths) \
            or sum(lengths) != len(payload):
        raise Malformed("a frame's blob lengths do not add up to its payload")
    out, at = [], 0
    for n in lengths:
        out.append(payload[at:at + n])
        at += n
    return out


class FrameReader:
    """Frames out of a byte stream; :class:`Malformed` for anything else or for over ``limit`` bytes in all."""

    def __init__(self, limit: int = MAX_TAPE) -> None:
        self.buf, self.total, self.limit = bytearray(), 0, limit

    def feed(self, chunk: bytes) -> list[tuple[dict, bytes]]:
        self.buf += chunk
        out = []
        while len(self.buf) >= _HEAD.size:
            magic, hn, pn = _HEAD.unpack_from(self.buf)
            if magic != MAGIC or hn > MAX_HEADER:
                raise Malformed("bytes that are not a frame")
            if self.total + _HEAD.size + hn + pn > self.limit:
                raise Malformed(f"over {self.limit >> 20} MB of recorded data")
            end = _HEAD.size + hn + pn
            if len(self.buf) < end:
                break
            try:
                header = json.loads(bytes(self.buf[_HEAD.size:_HEAD.size + hn]))
            except ValueError:
                raise Malformed("a frame whose header is not JSON") from None
            if not isinstance(header, dict):
                raise Malformed("a frame whose header is not an object")
            out.append((header, bytes(self.buf[_HEAD.size + hn:end])))
            self.total += end
            del self.buf[:end]
        return out


# --------------------------------------------------------------------------------------------------
# Values: JSON trees, tensors as raw bytes, the library's dataclasses by name, objects by handle or reference
# --------------------------------------------------------------------------------------------------

def _lib_class(name: str) -> type:
    """A class of the library (``module:qualname`` under ``parallel_lab.``); :class:`Malformed` for any other."""
    mod, _, qual = name.partition(":")
    parts = mod.split(".") + qual.split(".")
    if not mod.startswith("parallel_lab.") or not qual or not all(p.isidentifier() and not p.startswith("_")
                                                                    for p in parts):   # no __main__, no privates
        raise Malformed(f"not a class of the library: {name[:80]!r}")
    obj: Any = importlib.import_module(mod)
    for part in qual.split("."):
        obj = getattr(obj, part, None)
    if not isinstance(obj, type):
        raise Malformed(f"not a class of the library: {name[:80]!r}")
    return obj


def _name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _is_lib(cls: type) -> bool:
    return cls.__module__.startswith("parallel_lab.") and "<" not in cls.__qualname__


def _tensor_bytes(t: Any) -> bytes:
    n = t.numel() * t.element_size()
    return ctypes.string_at(t.data_ptr(), n) if n else b""


class Encoder:
    """``enc(value)`` as a JSON tree; tensors' bytes in ``blobs``; ``refs`` (``id -> key``) are the test's own
    objects; ``handle(obj)`` numbers any other object (None: such an object cannot be encoded)."""

    def __init__(self, refs: dict[int, str], handle: Callable[[Any], int] | None) -> None:
        self.blobs: list[bytes] = []
        self.refs, self.handle, self.nodes = refs, handle, 0

    def enc(self, v: Any, depth: int = 0) -> Any:
        self.nodes += 1
        if depth > MAX_DEPTH or self.nodes > MAX_NODES:
            raise Malformed("a value nested too deep or too large to carry")
        if v is None or isinstance(v, bool):
            return v
        if isinstance(v, enum.Enum) and _is_lib(type(v)):
            return {"E": _name(type(v)), "v": self.enc(v.value, depth + 1)}
        if isinstance(v, str):
            return str(v)
        if isinstance(v, int):
            return int(v)
        if isinstance(v, float):
            return float(v) if math.isfinite(v) else {"F": repr(float(v))}
        if id(v) in self.refs:
            return {"R": self.refs[id(v)]}
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(v, torch.Tensor):
            return self._tensor(v, torch)
        if torch is not None and isinstance(v, torch.Size):
            return {"Z": [int(x) for x in v]}
        if isinstance(v, (bytes, bytearray)):
            self.blobs.append(bytes(v))
            return {"Y": len(self.blobs) - 1}
        items = lambda xs: [self.enc(x, depth + 1) for x in xs]  # noqa: E731
        if isinstance(v, tuple) and hasattr(type(v), "_fields") and _is_lib(type(v)):
            return {"N": _name(type(v)), "v": items(v)}
        if isinstance(v, (tuple, list, set, frozenset)):
            tag = {tuple: "T", list: "L", set: "S", frozenset: "Q"}[next(c for c in (tuple, list, frozenset, set)
                                                                          if isinstance(v, c))]
            return {tag: items(v)}
        if isinstance(v, dict):
            kind = "Counter" if isinstance(v, Counter) else "OrderedDict" if isinstance(v, OrderedDict) else ""
            return {"D": [[self.enc(k, depth + 1), self.enc(x, depth + 1)] for k, x in v.items()], "c": kind}
        if isinstance(v, complex):
            return {"C": [self.enc(v.real), self.enc(v.imag)]}
        if dataclasses.is_dataclass(v) and not isinstance(v, type) and _is_lib(type(v)):
            return {"O": _name(type(v)), "f": {f.name: self.enc(getattr(v, f.name), depth + 1)
                                               for f in dataclasses.fields(v) if f.init}}
        if isinstance(v, numbers.Integral):
            return int(v)
        if isinstance(v, numbers.Real):
            return self.enc(float(v), depth)
        if self.handle is None:
            raise Malformed(f"a {type(v).__name__[:40]} that is not plain data")
        return {"H": self.handle(v)}

    def _tensor(self, v: Any, torch: Any) -> dict:
        dtype = str(v.dtype).removeprefix("torch.")
        if v.layout != torch.strided or v.is_quantized or v.device.type == "meta" or dtype not in _DTYPES:
            raise Malformed(f"a tensor of {dtype} ({v.layout}) that the grader cannot carry")
        t = v.detach().to("cpu").contiguous()
        self.blobs.append(_tensor_bytes(t))
        return {"X": len(self.blobs) - 1, "d": dtype, "s": list(t.shape), "g": bool(v.requires_grad),
                "P": isinstance(v, torch.nn.Parameter)}


class Decoder:
    """The value of an :class:`Encoder` tree: ``ref(key)`` resolves the test's objects, ``proxy(n)`` handles."""

    def __init__(self, blobs: list[bytes], ref: Callable[[str], Any], proxy: Callable[[int], Any]) -> None:
        self.blobs, self.ref, self.proxy, self.nodes = blobs, ref, proxy, 0

    def dec(self, t: Any, depth: int = 0) -> Any:
        self.nodes += 1
        if depth > MAX_DEPTH or self.nodes > MAX_NODES:
            raise Malformed("a value nested too deep")
        if t is None or isinstance(t, (bool, int, float, str)):
            return t
        if not isinstance(t, dict) or not t:
            raise Malformed("a value that is not a tree of the recorder")
        tag = next(iter(t))
        v = t[tag]
        items = lambda: [self.dec(x, depth + 1) for x in self._list(v)]  # noqa: E731
        if tag in ("T", "L", "S", "Q"):
            return {"T": tuple, "L": list, "S": set, "Q": frozenset}[tag](items())
        if tag == "D":
            pairs = [(self.dec(p[0], depth + 1), self.dec(p[1], depth + 1)) for p in map(self._pair, self._list(v))]
            cls = {"Counter": Counter, "OrderedDict": OrderedDict}.get(t.get("c", ""), dict)
            try:
                return cls(pairs)
            except TypeError:
                raise Malformed("a dict key that is not hashable") from None
        if tag == "F" and v in ("nan", "inf", "-inf"):
            return float(v)
        if tag == "R" and isinstance(v, str):
            return self.ref(v)
        if tag == "H" and isinstance(v, int):
            return self.proxy(v)
        if tag == "X":
            return self._tensor(t)
        if tag == "Z":
            import torch

            return torch.Size(int(x) for x in self._list(v))
        if tag == "Y" and isinstance(v, int) and 0 <= v < len(self.blobs):
            return self.blobs[v]
        if tag == "C":
            re_, im = items()
            return complex(re_, im)
        if tag in ("O", "N", "E") and isinstance(v, str):
            cls = _lib_class(v)
            try:
                if tag == "O" and dataclasses.is_dataclass(cls) and isinstance(t.get("f"), dict):
                    return cls(**{str(k): self.dec(x, depth + 1) for k, x in t["f"].items()})
                if tag == "N" and issubclass(cls, tuple):
                    return cls(*[self.dec(x, depth + 1) for x in self._list(t.get("v"))])
                if tag == "E" and issubclass(cls, enum.Enum):
                    return cls(self.dec(t.get("v"), depth + 1))
            except (TypeError, ValueError) as e:
                raise Malformed(f"a {v.split(':')[-1][:40]} that the library refuses: {str(e)[:100]}") from None
        raise Malformed(f"an unknown value tag {str(tag)[:10]!r}")

    @staticmethod
    def _pair(p: Any) -> list:
        if not isinstance(p, list) or len(p) != 2:
            raise Malformed("a dict item that is not a pair")
        return p

    @staticmethod
    def _list(v: Any) -> list:
        if not isinstance(v, list):
            raise Malformed("a value that is not a tree of the recorder")
        return v

    def _tensor(self, t: dict) -> Any:
        import torch

        idx, dtype, shape = t.get("X"), t.get("d"), t.get("s")
        if not (isinstance(idx, int) and 0 <= idx < len(self.blobs) and dtype in _DTYPES and isinstance(shape, list)
                and all(isinstance(n, int) and n >= 0 for n in shape)):
            raise Malformed("a tensor that does not decode")
        dt = getattr(torch, dtype)
        data = self.blobs[idx]
        if len(data) != math.prod(shape) * torch.empty((), dtype=dt).element_size():
            raise Malformed("a tensor whose bytes do not match its shape")
        out = torch.frombuffer(bytearray(data), dtype=dt).reshape(shape) if data else torch.empty(shape, dtype=dt)
        if t.get("P"):
            return torch.nn.Parameter(out, requires_grad=bool(t.get("g")) and out.is_floating_point())
        return out.requires_grad_(True) if t.get("g") and (out.is_floating_point() or out.is_complex()) else out


# --------------------------------------------------------------------------------------------------
# Exceptions the submission raised: their class (the nearest of Python's or the library's), text and place
# --------------------------------------------------------------------------------------------------

def submission_error(exc: BaseException) -> str:
    """``TypeName: first line at submission.py line N (in fn)``: an error as the learner sees it."""
    tb = traceback.extract_tb(exc.__traceback__)
    subs = [f for f in tb if Path(f.filename).name == "submission.py"]
    where = f" at submission.py line {subs[-1].lineno} (in {subs[-1].name})" if subs else ""
    text = str(exc).strip().splitlines()
    said = f": {text[0][:200]}" if text else ""
    return f"{type(exc).__name__}{said}{where}"


def _known(cls: type) -> bool:
    return getattr(builtins, cls.__name__, None) is cls or _is_lib(cls)


def exc_record(e: BaseException) -> dict:
    base = next((c for c in type(e).__mro__ if _known(c)), Exception)
    mine = any(Path(f.filename).name == "submission.py" for f in traceback.extract_tb(e.__traceback__))
    return {"b": base.__name__ if getattr(builtins, base.__name__, None) is base else _name(base),
            "m": str(e)[:4000], "s": submission_error(e), "me": mine}


def rebuild(x: Any) -> BaseException:
    """The exception of an :func:`exc_record`, carrying the learner-facing summary as ``_pl_origin``."""
    if not isinstance(x, dict) or not isinstance(x.get("b"), str) or not isinstance(x.get("m"), str):
        raise Malformed("an exception record that does not decode")
    cls = getattr(builtins, x["b"], None) if ":" not in x["b"] else _lib_class(x["b"])
    if not (isinstance(cls, type) and issubclass(cls, BaseException)):
        raise Malformed("an exception record that does not decode")
    try:
        e = cls(x["m"])
    except Exception:         # noqa: BLE001 - a class that wants other arguments
        e = RuntimeError(x["m"])
    e._pl_origin = (str(x.get("s", ""))[:400], bool(x.get("me")))
    return e


def error_message(e: BaseException) -> str:
    """What a test's failure says: the submission's error (from the run) or an error of the test on its data."""
    summary, mine = getattr(e, "_pl_origin", (submission_error(e), False))
    return f"{'your code raised' if mine else 'the test could not use your submission:'} {summary}"


# --------------------------------------------------------------------------------------------------
# The two sides: proxies whose every use is an event, recorded by the run and replayed by the judge
# --------------------------------------------------------------------------------------------------

def _op(kind: str) -> Callable[..., Any]:
    def run(self: Proxy, *args: Any, **kwargs: Any) -> Any:
        s, h = object.__getattribute__(self, "_pl")
        return s.op(kind, h, args if kind != "call" else (args, kwargs))
    return run


class Proxy:
    """The test's view of a submission object: every use goes through its session (recorded or replayed)."""

    __slots__ = ("_pl",)

    def __init__(self, session: Session, h: int) -> None:
        object.__setattr__(self, "_pl", (session, h))

    def __getattribute__(self, name: str) -> Any:
        if name == "__class__":               # isinstance() asks for it: the proxy's own class, no event
            return Proxy
        s, h = object.__getattribute__(self, "_pl")
        return s.op("getattr", h, (name,))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"the tests cannot set {name} on the submission's objects")

    __call__, __len__, __bool__, __str__, __repr__, __iter__, __next__ = (_op(k) for k in (
        "call", "len", "bool", "str", "repr", "iter", "next"))
    __getitem__, __contains__, __float__, __int__, __index__, __format__ = (_op(k) for k in (
        "getitem", "contains", "float", "int", "index", "format"))
    __hash__ = object.__hash__
    __eq__ = object.__eq__


def _walk(v: Any, path: str, out: list[tuple[str, Any]], depth: int = 0) -> None:
    """The test's own objects in call arguments (a model's parameters, buffers and submodules by name)."""
    if depth > 6 or len(out) > 5000 or v is None or isinstance(v, (bool, int, float, str, Proxy)):
        return
    torch = sys.modules.get("torch")
    if isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            _walk(x, f"{path}.{i}", out, depth + 1)
        return
    if isinstance(v, dict):
        for i, x in enumerate(v.values()):
            _walk(x, f"{path}.{i}", out, depth + 1)
        return
    out.append((path, v))
    if torch is not None and isinstance(v, torch.nn.Module):
        for tag, named in (("p", v.named_parameters()), ("b", v.named_buffers()), ("m", v.named_modules())):
            out.extend((f"{path}.{tag}.{n}", x) for n, x in named if n)


def _has_proxy(v: Any, depth: int = 0) -> bool:
    if isinstance(v, Proxy):
        return True
    if depth < 4 and isinstance(v, (list, tuple)):
        return any(_has_proxy(x, depth + 1) for x in v)
    if depth < 4 and isinstance(v, dict):
        return any(_has_proxy(x, depth + 1) for x in v.values())
    return False


def _digest(v: Any, depth: int = 0) -> Any:
    """A description of call arguments that both sides compute alike (tensors by a hash of their bytes)."""
    torch = sys.modules.get("torch")
    if isinstance(v, Proxy):
        return ["H", object.__getattribute__(v, "_pl")[1]]
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return repr(v)
    if torch is not None and isinstance(v, torch.Tensor) and v.layout == torch.strided and v.device.type == "cpu":
        t = v.detach().contiguous()
        return ["X", str(t.dtype), list(t.shape), hashlib.sha256(_tensor_bytes(t)).hexdigest()[:16]]
    if depth < 6 and isinstance(v, (list, tuple)):
        return [_digest(x, depth + 1) for x in v]
    if depth < 6 and isinstance(v, dict):
        return [[_digest(k, depth + 1), _digest(x, depth + 1)] for k, x in v.items()]
    return getattr(v, "__qualname__", None) or type(v).__qualname__


class Session:
    """What both sides share: the event count of the test, the test's objects handed in, proxies by handle."""

    def __init__(self) -> None:
        self.proxies: dict[int, Proxy] = {}
        self.test, self.n = "", 0
        self.root = self.proxy(0)

    def proxy(self, h: int) -> Proxy:
        if h not in self.proxies:
            self.proxies[h] = Proxy(self, h)
        return self.proxies[h]

    def begin(self, test: str) -> None:
        self.test, self.n = test, 0

    def _event(self, kind: str, h: int, args: tuple) -> tuple[str, list[tuple[str, Any]]]:
        """This event's signature, and the test's objects among its arguments (keyed by test, event, path)."""
        sig = hashlib.sha256(json.dumps([kind, h, _digest(args)]).encode()).hexdigest()[:24]
        found: list[tuple[str, Any]] = []
        if kind in ("call", "ranks"):
            _walk(args, f"{self.test}#{self.n}", found)
        self.n += 1
        return sig, found

    def op(self, kind: str, h: int, args: tuple, run: Callable[..., Any] | None = None) -> Any:
        raise NotImplementedError


def seed() -> None:
    """Both sides start each test from the same random state."""
    random.seed(0)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(0)


def _unwrap(v: Any, objs: dict[int, Any], depth: int = 0) -> Any:
    if isinstance(v, Proxy):
        return objs[object.__getattribute__(v, "_pl")[1]]
    if depth < 4 and type(v) in (list, tuple):
        return type(v)(_unwrap(x, objs, depth + 1) for x in v)
    if depth < 4 and type(v) is dict:
        return {k: _unwrap(x, objs, depth + 1) for k, x in v.items()}
    return v


class Recorder(Session):
    """The run's side, in the submission's process: calls the real objects, writes each result as a frame."""

    def __init__(self, write: Callable[[bytes], None], module: Any) -> None:
        self.write, self.objs, self.ids = write, {0: module}, {id(module): 0}
        self.refs: dict[int, str] = {}
        self.keys: dict[str, Any] = {}
        super().__init__()

    def handle(self, obj: Any) -> int:
        if id(obj) not in self.ids:
            self.ids[id(obj)] = len(self.objs)
            self.objs[len(self.objs)] = obj
        return self.ids[id(obj)]

    def _ref(self, key: str) -> Any:
        return self.keys[key]

    def op(self, kind: str, h: int, args: tuple, run: Callable[..., Any] | None = None) -> Any:
        sig, found = self._event(kind, h, args)
        for key, obj in found:
            if id(obj) not in self.refs:
                self.refs[id(obj)], self.keys[key] = key, obj
        head = {"k": "ev", "op": kind, "h": h, "a": sig}
        torch = sys.modules.get("torch")
        state = (random.getstate(), torch.random.get_rng_state() if torch is not None else None)
        try:
            real = _unwrap(args, self.objs)
            v = run(*real[0], **real[1]) if run is not None else _OPS[kind](self.objs[h], real)
        except BaseException as e:   # noqa: BLE001 - the submission's error is recorded, then raised as replayed
            x = exc_record(e)
            self.write(frame({**head, "x": x}))
            raise rebuild(x) from None
        finally:
            random.setstate(state[0])
            if state[1] is not None:
                torch.random.set_rng_state(state[1])
        enc = Encoder(self.refs, self.handle)
        try:
            tree = enc.enc(v)
        except Malformed as e:
            x = {"b": "TypeError", "m": str(e), "s": f"TypeError: your code returned {e}", "me": True}
            self.write(frame({**head, "x": x}))
            raise rebuild(x) from None
        self.write(frame({**head, "r": tree}, enc.blobs))
        return Decoder(enc.blobs, self._ref, self.proxy).dec(tree)


class Replayer(Session):
    """The judge's side: answers each use of a proxy with the next recorded event, which must match it."""

    def __init__(self) -> None:
        self.keys: dict[str, Any] = {}
        self.events: Iterator[tuple[dict, bytes]] = iter(())
        self.note = ""
        super().__init__()

    def begin_tape(self, test: str, frames: list[tuple[dict, bytes]], note: str) -> None:
        self.begin(test)
        self.events, self.note = iter(frames), note

    def _ref(self, key: str) -> Any:
        if key not in self.keys:
            raise Malformed("a reference to an object the test never handed in")
        return self.keys[key]

    def op(self, kind: str, h: int, args: tuple, run: Callable[..., Any] | None = None) -> Any:
        sig, found = self._event(kind, h, args)
        for key, obj in found:
            self.keys.setdefault(key, obj)
        return self.answer(kind, h, sig, next(self.events, None))

    def answer(self, kind: str, h: int, sig: str, ev: tuple[dict, bytes] | None) -> Any:
        """The value (or the exception) of the event ``ev``, which must be the one the test asks for."""
        if ev is None:
            why = f" (there: {self.note[:300]})" if self.note else ""
            raise TapeError("the run of this test in your process recorded less than the test asks of your code: it "
                            f"ended early, or something in your process changed the test{why}")
        head, payload = ev
        if (head.get("k"), head.get("op"), head.get("h"), head.get("a")) != ("ev", kind, h, sig):
            raise TapeError("the run of this test in your process recorded other calls than the test makes (does your "
                            "code change the tests, the harness or the grader in its process?)")
        try:
            if "x" in head:
                raise rebuild(head["x"])
            return Decoder(split_blobs(head, payload), self._ref, self.proxy).dec(head.get("r"))
        except Malformed as e:
            raise TapeError(f"what your process recorded does not decode: {e}") from None

    def finish(self) -> None:
        if next(self.events, None) is not None:
            raise TapeError("the run of this test in your process recorded more than the test asks of your code "
                            "(does your code write to the grader's pipe, or change the tests in its process?)")


#: the session of this process: a :class:`Recorder` in the submission's, a :class:`Replayer` in the judge
ACTIVE: Session | None = None


def boundary(run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``run(*args, **kwargs)``, an event of the session when the arguments hold the submission (``run_ranks``)."""
    if ACTIVE is None or not _has_proxy((args, kwargs)):
        return run(*args, **kwargs)
    return ACTIVE.op("ranks", -1, (args, kwargs), run)
