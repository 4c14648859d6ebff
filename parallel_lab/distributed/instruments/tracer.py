"""The communication tracer: every collective of the implementations, as a ``comm.Collective`` plus timing.

:class:`CommTracer` is the one door through which the step code's collectives and point-to-point calls
go. Each method takes the accounting ``dim`` (``dp``, ``tp``, ``tp_vocab``, ``pp``, ``cp``) and records a
:class:`TracedCall`: the rank, the call as the analytic core describes it (a ``comm.Collective`` with
``count=1``: ``kind``, ``message_bytes``, ``group_size``, the ``phase`` the caller set, the ZeRO ``unit``
if given) and when it started and ended. ``message_bytes`` is the payload (docs/conventions.md):

    all_reduce: the tensor   all_gather: the gathered output   reduce_scatter: the full input
    all_to_all: this rank's input   send / recv / broadcast: the tensor   (group_size 2 for send/recv)

:func:`compare_calls` checks traced calls against predicted collectives call by call (a multiset of
``(dim, kind, message_bytes, group_size)`` with counts); :func:`payload_by_dim` sums either per dim.
Reporting code (gathering results for a comparison) calls ``torch.distributed`` directly, untraced.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch.distributed as dist
from torch import Tensor

from parallel_lab.comm import Collective
from parallel_lab.distributed.instruments.memory import BufferMeter

# ``all_gather_single`` / ``reduce_scatter_single`` are the 2.13 names; older torch has the *_tensor ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def nbytes(t: Tensor) -> int:
    """Bytes of the tensor's elements (the payload of a call, not its storage)."""
    return t.numel() * t.element_size()


@dataclass
class TracedCall:
    """One traced call on one rank: the ``collective`` (``count=1``) and when it ran (``perf_counter`` s).

    ``dim``, ``kind``, ``message_bytes``, ``group_size``, ``phase`` and ``unit`` read through to the
    collective; ``peer`` is the other global rank of a point-to-point call; ``t_end`` is ``None`` until
    an asynchronous call has been waited for.
    """

    rank: int
    collective: Collective
    t_start: float
    t_end: float | None = None
    peer: int | None = None

    dim = property(lambda self: self.collective.dim)
    kind = property(lambda self: self.collective.kind)
    message_bytes = property(lambda self: self.collective.message_bytes)
    group_size = property(lambda self: self.collective.group_size)
    unit = property(lambda self: self.collective.unit)

    @property
    def phase(self) -> str:
        return self.collective.phase

    @phase.setter
    def phase(self, phase: str) -> None:               # a batched p2p op learns its phase after posting
        self.collective = replace(self.collective, phase=phase)

    def key(self) -> tuple[str, str, int, int]:
        return (self.dim, self.kind, self.message_bytes, self.group_size)


def describe(ev: TracedCall) -> str:
    """``"backward dp all_reduce of 1,024 B"``: a call as the diagnosis names it."""
    to = f" with rank {ev.peer}" if ev.peer is not None else ""
    return f"{ev.phase} {ev.dim} {ev.kind} of {ev.message_bytes:,} B{to}"


class TracedWork:
    """Wraps an async ``Work``: ``wait()`` waits and stamps the event's end time. ``on_action(text,
    waiting)``: told when the wait starts and ends (the tracer's, see :class:`CommTracer`)."""

    def __init__(self, work: Any, event: TracedCall | None,
                 on_action: Callable[[str, bool], None] | None = None):
        self.work, self.event, self.on_action = work, event, on_action

    def wait(self) -> bool:
        if self.on_action is not None and self.event is not None:
            self.on_action(f"waiting for {describe(self.event)}", True)
        ok = self.work.wait() if self.work is not None else True
        if self.event is not None and self.event.t_end is None:
            self.event.t_end = time.perf_counter()
        if self.on_action is not None and self.event is not None:
            self.on_action(f"after {describe(self.event)}", False)
        return ok

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()


class CommTracer:
    """Every collective of the implementations, recorded as :class:`TracedCall`.

    ``groups`` maps a dim label to its process group (``Grid.groups_by_dim()``); a call may also pass
    ``group=`` explicitly. ``phase`` is the step phase the training loop sets with :meth:`phase_as`
    ("forward", "backward", "step"; outside any, the ``phase`` given here: a ``Collective`` always has
    one); ``enabled=False`` makes the tracer a pass-through (no events). ``on_action(text, waiting)``, if
    set, hears of every call as it starts, blocks and ends (``diagnosis.ActionLog``: what a dead or hung
    rank was doing, and how long it waited for its peers). ``buffers``: the rank's ``BufferMeter``, which the
    implementations sample at their calls (the communication buffers' peaks by part).
    """

    def __init__(self, rank: int, groups: dict[str, Any] | None = None, enabled: bool = True,
                 phase: str = "forward"):
        self.rank = rank
        self.groups = dict(groups or {})
        self.enabled = enabled
        self.phase = phase
        self.events: list[TracedCall] = []
        self.buffers = BufferMeter()
        self.on_action: Callable[[str, bool], None] | None = None

    # ---- bookkeeping -----------------------------------------------------------------------------
    def group(self, dim: str, group: Any = None) -> Any:
        if group is not None:
            return group
        return self.groups.get(dim)

    @contextmanager
    def phase_as(self, phase: str) -> Iterator[None]:
        old, self.phase = self.phase, phase
        if self.on_action is not None:
            self.on_action(f"{phase} phase", False)
        try:
            yield
        finally:
            self.phase = old

    def clear(self) -> None:
        self.events.clear()

    def _start(self, dim: str, kind: str, message_bytes: int, group: Any, peer: int | None = None,
               group_size: int | None = None, unit: str | None = None) -> TracedCall | None:
        if not self.enabled:
            return None
        n = group_size if group_size is not None else dist.get_world_size(group)
        call = Collective(dim, kind, int(message_bytes), n, phase=self.phase, unit=unit)
        ev = TracedCall(self.rank, call, time.perf_counter(), None, peer)
        self.events.append(ev)
        if self.on_action is not None:
            self.on_action(f"in {describe(ev)}", True)
        return ev

    def _finish(self, work: Any, ev: TracedCall | None, async_op: bool) -> Any:
        if async_op:
            if self.on_action is not None and ev is not None:
                self.on_action(f"posted {describe(ev)}", False)
            return TracedWork(work, ev, self.on_action)
        if ev is not None:
            ev.t_end = time.perf_counter()
            if self.on_action is not None:
                self.on_action(f"after {describe(ev)}", False)
        return None

    # ---- collectives -----------------------------------------------------------------------------
    def all_reduce(self, tensor: Tensor, dim: str, op: Any = dist.ReduceOp.SUM, group: Any = None,
                   async_op: bool = False, unit: str | None = None) -> TracedWork | None:
        """In-place all-reduce; message = the tensor."""
        g = self.group(dim, group)
        ev = self._start(dim, "all_reduce", nbytes(tensor), g, unit=unit)
        return self._finish(dist.all_reduce(tensor, op=op, group=g, async_op=async_op), ev, async_op)

    def all_gather(self, output: Tensor, input: Tensor, dim: str, group: Any = None,
                   async_op: bool = False, unit: str | None = None) -> TracedWork | None:
        """Gather equal shards into ``output`` (n x input); message = the gathered output."""
        g = self.group(dim, group)
        ev = self._start(dim, "all_gather", nbytes(output), g, unit=unit)
        return self._finish(_all_gather(output, input, group=g, async_op=async_op), ev, async_op)

    def reduce_scatter(self, output: Tensor, input: Tensor, dim: str, op: Any = dist.ReduceOp.SUM,
                       group: Any = None, async_op: bool = False, unit: str | None = None) -> TracedWork | None:
        """Reduce ``input`` (n x output) and keep this rank's shard; message = the full input."""
        g = self.group(dim, group)
        ev = self._start(dim, "reduce_scatter", nbytes(input), g, unit=unit)
        return self._finish(_reduce_scatter(output, input, op=op, group=g, async_op=async_op), ev, async_op)

    def all_to_all(self, output: Tensor, input: Tensor, dim: str, output_split_sizes: list[int] | None = None,
                   input_split_sizes: list[int] | None = None, group: Any = None,
                   async_op: bool = False) -> TracedWork | None:
        """``all_to_all_single``; message = this rank's input."""
        g = self.group(dim, group)
        ev = self._start(dim, "all_to_all", nbytes(input), g)
        work = dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=g,
                                      async_op=async_op)
        return self._finish(work, ev, async_op)

    def broadcast(self, tensor: Tensor, src: int, dim: str, group: Any = None,
                  async_op: bool = False) -> TracedWork | None:
        """Broadcast from global rank ``src``; message = the tensor."""
        g = self.group(dim, group)
        ev = self._start(dim, "broadcast", nbytes(tensor), g)
        return self._finish(dist.broadcast(tensor, src=src, group=g, async_op=async_op), ev, async_op)

    # ---- point to point (peers are global ranks) -------------------------------------------------
    def send(self, tensor: Tensor, peer: int, dim: str = "pp", group: Any = None) -> None:
        ev = self._start(dim, "send", nbytes(tensor), None, peer, group_size=2)
        dist.send(tensor, dst=peer, group=self.group(dim, group))
        self._finish(None, ev, False)

    def recv(self, tensor: Tensor, peer: int, dim: str = "pp", group: Any = None) -> None:
        ev = self._start(dim, "recv", nbytes(tensor), None, peer, group_size=2)
        dist.recv(tensor, src=peer, group=self.group(dim, group))
        self._finish(None, ev, False)

    def isend(self, tensor: Tensor, peer: int, dim: str = "pp", group: Any = None) -> TracedWork:
        ev = self._start(dim, "send", nbytes(tensor), None, peer, group_size=2)
        return self._finish(dist.isend(tensor, dst=peer, group=self.group(dim, group)), ev, True)

    def irecv(self, tensor: Tensor, peer: int, dim: str = "pp", group: Any = None) -> TracedWork:
        ev = self._start(dim, "recv", nbytes(tensor), None, peer, group_size=2)
        return self._finish(dist.irecv(tensor, src=peer, group=self.group(dim, group)), ev, True)

    def batch_isend_irecv(self, ops: Iterable[tuple[str, Tensor, int]], dim: str = "pp",
                          group: Any = None) -> list[TracedWork]:
        """``ops``: ``("send" | "recv", tensor, peer)``; launched together (``dist.batch_isend_irecv``)."""
        ops = list(ops)
        g = self.group(dim, group)
        p2p, events = [], []
        for kind, tensor, peer in ops:
            if kind not in ("send", "recv"):
                raise ValueError(f"batch_isend_irecv op {kind!r}; use 'send' or 'recv'")
            fn = dist.isend if kind == "send" else dist.irecv
            p2p.append(dist.P2POp(fn, tensor, peer, group=g))
            events.append(self._start(dim, kind, nbytes(tensor), None, peer, group_size=2))
        works = dist.batch_isend_irecv(p2p) if p2p else []
        if self.on_action is not None and events and events[-1] is not None:
            self.on_action(f"posted {len(events)} point-to-point ops ({describe(events[-1])})", False)
        if len(works) != len(events):            # some backends return one work for the batch
            return [TracedWork(w, None) for w in works] + [TracedWork(None, e, self.on_action) for e in events]
        return [TracedWork(w, e, self.on_action) for w, e in zip(works, events, strict=True)]


# --------------------------------------------------------------------------------------------------
# Comparing measured calls with predicted collectives
# --------------------------------------------------------------------------------------------------

def event_counts(events: Iterable[TracedCall]) -> Counter:
    """Multiset of ``(dim, kind, message_bytes, group_size)`` of traced calls."""
    return Counter(e.key() for e in events)


def collective_counts(colls: Iterable[Any], times: int = 1) -> Counter:
    """Multiset of predicted calls (``comm.Collective`` has a ``count``), repeated ``times`` (e.g. steps)."""
    c: Counter = Counter()
    for x in colls:
        n = getattr(x, "count", 1) * times
        if n:
            c[(x.dim, x.kind, int(x.message_bytes), x.group_size)] += n
    return c


def compare_calls(events: Iterable[TracedCall], colls: Iterable[Any], times: int = 1) -> dict[str, Counter]:
    """Call-by-call difference: ``{"missing": predicted but not traced, "extra": traced but not predicted}``.

    Both empty means the multisets are equal.
    """
    measured, predicted = event_counts(events), collective_counts(colls, times)
    return {"missing": predicted - measured, "extra": measured - predicted}


def payload_by_dim(items: Iterable[Any]) -> dict[str, int]:
    """Sum of ``message_bytes`` (times ``count`` for predicted collectives) per dim, as integers."""
    out: dict[str, int] = {}
    for x in items:
        out[x.dim] = out.get(x.dim, 0) + int(x.message_bytes) * getattr(x, "count", 1)
    return out
