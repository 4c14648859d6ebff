"""The allocation trace of a training step: every storage torch makes, in order, and when it is freed.

:class:`AllocTrace` is a ``TorchDispatchMode``: each op's outputs whose storage is new are recorded as
``("alloc", key, nbytes)``, and a ``weakref.finalize`` on the storage records ``("free", key)`` when torch
releases it (torch keeps one Python object per live storage, so the callback fires when the storage dies,
views included). Storages that exist before the mode starts (parameters, optimizer states) are added with
:meth:`AllocTrace.existing`. The events feed ``parallel_lab.allocator.replay`` (docs/reserve.md);
``measure.training_step_trace`` records a step of the lab's model with it.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class AllocTrace(TorchDispatchMode):
    """Record the storages the ops make and free (module docstring); ``events`` in order."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple] = []
        self._live: dict[int, int] = {}             # the StorageImpl's address -> key
        self._n = 0

    def _free(self, cdata: int, key: int) -> None:
        if self._live.get(cdata) == key:
            del self._live[cdata]
            self.events.append(("free", key))

    def track(self, t: Any) -> None:
        """Record ``t``'s storage as allocated now, unless already recorded."""
        if not isinstance(t, Tensor) or t.device.type == "meta":
            return
        st = t.untyped_storage()
        cdata = st._cdata
        if cdata in self._live or st.nbytes() == 0:
            return
        self._n += 1
        self._live[cdata] = self._n
        self.events.append(("alloc", self._n, int(st.nbytes())))
        weakref.finalize(st, self._free, cdata, self._n)

    def existing(self, tensors: list[Tensor]) -> None:
        """Storages made before the trace (parameters, optimizer states), allocated at its start."""
        for t in tensors:
            self.track(t)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self.track(t)
        return out

    def key_of(self, t: Any) -> int | None:
        """The key of ``t``'s storage while it is alive and recorded, else None."""
        return self._live.get(t.untyped_storage()._cdata) if isinstance(t, Tensor) else None

    def stop(self) -> None:
        """Stop recording frees (storages still alive stay allocated in :attr:`events`)."""
        self._live.clear()


def steady_state(events: list[tuple], first: list[int]) -> list[tuple]:
    """``events`` with the allocations of the keys ``first`` moved to the start: state a first step creates
    lazily (AdamW's moments) and every later step holds from its start."""
    keys = set(first)
    return [e for e in events if e[0] == "alloc" and e[1] in keys] + [
        e for e in events if not (e[0] == "alloc" and e[1] in keys)]


def reserve_of_trace(events: list[tuple]) -> dict[str, float]:
    """The trace replayed (``parallel_lab.allocator``): its peak of requested bytes and the peak reserved
    with torch's default options and with ``expandable_segments:True``."""
    from parallel_lab.allocator import AllocatorConfig, replay

    default, expandable = replay(events), replay(events, AllocatorConfig(expandable_segments=True))
    return {"peak_requested": float(default.peak_requested), "reserved": float(default.peak_reserved),
            "reserved_expandable": float(expandable.peak_reserved), "events": float(len(events))}
