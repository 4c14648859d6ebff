"""Observing ``torch.distributed`` from outside: the one tracing mechanism of runs, lessons and the grader.

While at least one observer is installed (:func:`observing`), the module attributes of ``torch.distributed``
that move data (:data:`KINDS`, plus ``batch_isend_irecv``) are wrapped; code that calls them as
``dist.NAME(...)`` at call time is seen, code holding the functions themselves is not. Each call is
described as a :class:`Call` by the conventions' table (docs/conventions.md)::

    all_reduce: the tensor   all_gather: the gathered output   reduce_scatter: the full input
    all_to_all: this rank's input   send / recv / broadcast: the tensor

and handed to every observer's ``wrap(call, run)`` (``wrap_batch(calls, run)`` for a batch of
point-to-point ops), which runs ``run()`` and may wrap what it returns. ``dist.P2POp`` is wrapped too, so
that an op built with the wrapped ``dist.isend`` still holds torch's own (``P2POp`` checks it).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch.distributed as dist
from torch import Tensor

#: ``torch.distributed`` function -> (kind, the argument that is the message).
KINDS = {
    "all_reduce": ("all_reduce", "tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "all_gather_single": ("all_gather", "output_tensor"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "all_to_all_single": ("all_to_all", "input"),
    "broadcast": ("broadcast", "tensor"),
    "send": ("send", "tensor"),
    "recv": ("recv", "tensor"),
    "isend": ("send", "tensor"),
    "irecv": ("recv", "tensor"),
}


def nbytes(t: Tensor) -> int:
    """Bytes of the tensor's elements (the payload of a call, not its storage)."""
    return t.numel() * t.element_size()


@dataclass
class Call:
    """One observed call: ``kind``, ``message_bytes``, its ``group`` (None: the default group), the
    other global rank ``peer`` of a point-to-point call, and whether it returns a ``Work`` (``async_op``)."""

    kind: str
    message_bytes: int
    group: Any
    peer: int | None
    async_op: bool

    @property
    def group_size(self) -> int:
        return 2 if self.kind in ("send", "recv") else dist.get_world_size(self.group)


class Observer(Protocol):
    def wrap(self, call: Call, run: Callable[[], Any]) -> Any: ...

    def wrap_batch(self, calls: list[Call], run: Callable[[], list[Any]]) -> list[Any]: ...


_observers: list[Observer] = []
_originals: dict[str, Any] = {}


def _through_observers(hook: str, what: Call | list[Call], run: Callable[[], Any]) -> Any:
    """Run ``run`` wrapped by every observer's ``hook`` (``wrap`` or ``wrap_batch``), the first installed outermost."""
    for obs in reversed(_observers):
        run = partial(getattr(obs, hook), what, run)
    return run()


def _call_wrapper(name: str, orig: Callable) -> Callable:
    kind, message = KINDS[name]
    sig = inspect.signature(orig)
    p2p = name in ("send", "recv", "isend", "irecv")

    def observed(*a: Any, **kw: Any) -> Any:
        args = sig.bind(*a, **kw).arguments
        peer = args.get("dst" if "dst" in sig.parameters else "src") if p2p else None
        call = Call(kind, nbytes(args[message]), args.get("group"), peer,
                    name in ("isend", "irecv") or bool(args.get("async_op", False)))
        return _through_observers("wrap", call, partial(orig, *a, **kw))

    observed.__wrapped__ = orig
    return observed


def _batch_wrapper(orig: Callable) -> Callable:
    isend = _originals["isend"]

    def observed(p2p_op_list: list[Any]) -> list[Any]:
        calls = [Call("send" if op.op is isend else "recv", nbytes(op.tensor), op.group, op.peer, True)
                 for op in p2p_op_list]
        return _through_observers("wrap_batch", calls, partial(orig, p2p_op_list))

    observed.__wrapped__ = orig
    return observed


def _p2p_op_wrapper(orig: type) -> Callable:
    def p2p_op(op: Callable, *a: Any, **kw: Any) -> Any:
        return orig(getattr(op, "__wrapped__", op), *a, **kw)      # torch's isend/irecv, as P2POp checks

    return p2p_op


def _install() -> None:
    for name in KINDS:
        orig = getattr(dist, name, None)
        if orig is not None:
            _originals[name] = orig
            setattr(dist, name, _call_wrapper(name, orig))
    for name, make in (("batch_isend_irecv", _batch_wrapper), ("P2POp", _p2p_op_wrapper)):
        _originals[name] = getattr(dist, name)
        setattr(dist, name, make(_originals[name]))


def _uninstall() -> None:
    for name, orig in _originals.items():
        setattr(dist, name, orig)
    _originals.clear()


@contextmanager
def observing(observer: Observer) -> Iterator[None]:
    """``observer`` sees every wrapped ``torch.distributed`` call made inside (nested: each sees it)."""
    if not _observers:
        _install()
    _observers.append(observer)
    try:
        yield
    finally:
        _observers.remove(observer)
        if not _observers:
            _uninstall()
