"""The allocation trace of a training step: every storage torch makes, in order, and when it is freed.

:class:`AllocTrace` is a ``TorchDispatchMode``: each op's outputs whose storage is new are recorded as
``("alloc", key, nbytes)``, and a ``weakref.finalize`` on the storage records ``("free", key)`` when torch
releases it (torch keeps one Python object per live storage, so the callback fires when the storage dies,
views included). Storages that exist before the mode starts (parameters, optimizer states) are added with
:meth:`AllocTrace.existing`. The events feed ``parallel_lab.allocator.replay`` (docs/reserve.md).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from parallel_lab.distributed.model.model import Transformer, build_model, loss_fn
from parallel_lab.specs import ModelSpec


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


def training_step_trace(spec: ModelSpec, seq: int, micro_batch: int = 1, *, seed: int = 0,
                        fake: bool = False) -> list[tuple]:
    """The allocation events of the second training step (forward, backward, AdamW step, ``zero_grad``) of
    the lab's model in fp32 on one process: the first step creates AdamW's moments, which the second holds
    from its start, as every later step does. ``fake``: under ``FakeTensorMode`` (full-size shapes, no
    memory; scalar reads answer as in ``measure.py``), else real tensors on CPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from parallel_lab.distributed.instruments.measure import _ValuesOfTheBatch

    torch.manual_seed(seed)
    tokens = torch.randint(0, spec.vocab, (micro_batch, seq + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    trace = AllocTrace()
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext(), \
            _ValuesOfTheBatch() if fake else contextlib.nullcontext():
        net = Transformer(spec).train() if fake else build_model(spec, seed=seed)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3, foreach=False)

        def step() -> None:
            loss = loss_fn(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        trace.existing([*net.parameters(),
                        *(v for st in opt.state.values() for v in st.values() if isinstance(v, Tensor))])
        with trace:
            step()
        trace.stop()
    return trace.events
