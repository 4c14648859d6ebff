"""The neutral probe: what an algorithm tells a measurement, a no-op unless a measurement listens.

The parallelisms call ``torch.distributed`` plainly; the comm tracer (``instruments/tracer.py``) observes
those calls from outside. Where the call alone does not say what the accounting needs, the algorithm says
it here (docs/conventions.md, "Composition"):

* ``with tagged(dim="tp_vocab"):``: the calls inside count under that dim (one group serving two
  accounting dims); ``tagged(unit=name)``: a ZeRO unit's label; ``tagged(phases=(...))``: the phase of
  each op of a point-to-point batch (a pipeline's may carry forward and backward messages together).
* ``sample(part, tensors, nbytes=...)``: a temporary buffer alive now (the instruments keep each part's
  peak, counting distinct storages, and map the part to the ledger's ``comm_buffer_parts``).
* ``not_activations(t)`` / ``activations_again(t)``: a storage that autograd saves but that is model state
  (ZeRO-3's gathered parameters), for the saved-tensor meter.

A measurement installs a :class:`Listener` (:func:`listening`, or :func:`install` for an object's lifetime,
held weakly); with none installed, every function returns at once.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol


class Listener(Protocol):
    def sample(self, part: str, tensors: Iterable[Any], nbytes: int | None) -> None: ...

    def exclude(self, *tensors: Any) -> None: ...

    def include(self, *tensors: Any) -> None: ...


_refs: list[weakref.ref] = []
_tags: list[dict[str, Any]] = []


def install(listener: Listener) -> None:
    """Listen until :func:`uninstall` or the listener is collected (held weakly)."""
    _refs.append(weakref.ref(listener))


def uninstall(listener: Listener) -> None:
    _refs[:] = [r for r in _refs if r() is not None and r() is not listener]


@contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """Install ``listener`` for the duration (a measurement's: the comm tracer's)."""
    install(listener)
    try:
        yield
    finally:
        uninstall(listener)


def _listeners() -> list[Listener]:
    return [x for x in (r() for r in _refs) if x is not None]


def on() -> bool:
    """Whether a measurement listens."""
    return bool(_listeners())


@contextmanager
def tagged(**tags: Any) -> Iterator[None]:
    """The calls inside carry ``tags`` (``dim``, ``unit``; ``phases``: one per op of a batch); inner tags win."""
    if not _refs:
        yield
        return
    _tags.append(tags)
    try:
        yield
    finally:
        del _tags[next(i for i in range(len(_tags) - 1, -1, -1) if _tags[i] is tags)]


def current(name: str) -> Any:
    """The innermost value of tag ``name`` in force, or None."""
    for tags in reversed(_tags):
        if name in tags:
            return tags[name]
    return None


def sample(part: str, tensors: Iterable[Any] = (), nbytes: int | None = None) -> None:
    """A temporary buffer of ``part`` is alive: ``tensors`` (distinct storages counted) or ``nbytes``."""
    for listener in _listeners():
        listener.sample(part, tensors, nbytes)


def not_activations(*tensors: Any) -> None:
    """The storages of ``tensors`` are model state, not activations, until :func:`activations_again`."""
    for listener in _listeners():
        listener.exclude(*tensors)


def activations_again(*tensors: Any) -> None:
    """Undo :func:`not_activations`; call it before the storage is freed (its address may be reused)."""
    for listener in _listeners():
        listener.include(*tensors)
