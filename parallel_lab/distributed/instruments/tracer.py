"""The communication tracer: every collective of the implementations, as a ``comm.Collective`` plus timing.

:class:`CommTracer` observes the plain ``torch.distributed`` calls of the step code from outside: while
``with tracer.observe():`` is on (``Runtime.train_step`` enters it), ``instruments/observe.py`` wraps them
and the tracer records each as a :class:`TracedCall`: the rank, the call as the analytic core describes it
(a ``comm.Collective`` with ``count=1``: ``kind``, ``message_bytes``, ``group_size``, the ``phase`` the loop
set, the ZeRO ``unit`` the probe names) and when it started and ended. The ``dim`` is the group's (the
grid's ``groups_by_dim()`` inverted, the first dim of a shared group) unless the algorithm tags another
(``probe.tagged(dim=...)``); ``message_bytes`` follows the conventions' table (``observe.py``).

:func:`compare_calls` checks traced calls against predicted collectives call by call (a multiset of
``(dim, kind, message_bytes, group_size)`` with counts); :func:`payload_by_dim` sums either per dim.
Reporting code (gathering results for a comparison) runs outside ``observe``, untraced.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch.distributed as dist
from torch import Tensor

from parallel_lab.comm import Collective
from parallel_lab.distributed import probe
from parallel_lab.distributed.collectives import all_gather_flat_fn, reduce_scatter_flat_fn
from parallel_lab.distributed.instruments.memory import STATE_PARTS, ZERO3_PEAKS, BufferMeter
from parallel_lab.distributed.instruments.observe import Call, observing


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


class _OpWait:
    """Completion of one posted op: waits the works its batch returned, then stamps its traced event."""

    def __init__(self, works: Sequence[TracedWork], own: TracedWork | None):
        self.works, self.own = works, own

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        if self.own is not None:
            self.own.wait()


def op_waits(works: Sequence[TracedWork], n_ops: int) -> list[_OpWait]:
    """One completion per posted op of an observed ``dist.batch_isend_irecv`` (``works``: the batch's works
    wrapped, then its traced events when the counts differ): gloo gives one work per op (each op waits its
    own); NCCL coalesces the batch into one work (each op then waits it and stamps its own event)."""
    if len(works) == n_ops and all(w.work is not None for w in works):
        return [_OpWait([], w) for w in works]
    batch = [w for w in works if w.work is not None]
    events = [w for w in works if w.event is not None]
    return [_OpWait(batch, events[j] if j < len(events) else None) for j in range(n_ops)]


class CommTracer:
    """Every observed collective, recorded as :class:`TracedCall` (module docstring).

    ``groups`` maps a dim label to its process group (``Grid.groups_by_dim()``): a call's dim is the first
    label of its group, unless ``probe.tagged(dim=...)`` says another. ``phase`` is the step phase the
    training loop sets with :meth:`phase_as` ("forward", "backward", "step"; outside any, the ``phase``
    given here: a ``Collective`` always has one); ``enabled=False`` records nothing. ``on_action(text,
    waiting)``, if set, hears of every call as it starts, blocks and ends (``diagnosis.ActionLog``: what a
    dead or hung rank was doing, and how long it waited for its peers). ``buffers``: the rank's
    ``BufferMeter``, fed by the implementations' ``probe.sample`` while observing (``state``: the parts that
    are model state, ``memory.STATE_PARTS``).

    The methods ``all_reduce(tensor, dim, ...)`` and so on call ``torch.distributed`` on the dim's group
    under that dim, observed (for tests and lessons that drive the tracer by hand).
    """

    def __init__(self, rank: int, groups: dict[str, Any] | None = None, enabled: bool = True,
                 phase: str = "forward"):
        self.rank = rank
        self.groups = dict(groups or {})
        self.enabled = enabled
        self.phase = phase
        self.events: list[TracedCall] = []
        self.buffers = BufferMeter()
        self.state = BufferMeter()
        self.on_action: Callable[[str, bool], None] | None = None
        self._depth = 0

    # ---- bookkeeping -----------------------------------------------------------------------------
    def group(self, dim: str, group: Any = None) -> Any:
        if group is not None:
            return group
        return self.groups.get(dim)

    def dim_of(self, group: Any) -> str:
        """The accounting dim of a call on ``group`` (None: the default group): the probe's tag, else the
        first dim of :attr:`groups` that maps to this group."""
        tag = probe.current("dim")
        if tag is not None:
            return tag
        g = dist.group.WORLD if group is None else group
        for dim, h in self.groups.items():
            if h is g:
                return dim
        raise ValueError(f"a collective on a group of ranks {dist.get_process_group_ranks(g)} that no dim of "
                         f"the tracer maps to (dims {sorted(self.groups)}); pass the group in "
                         f"CommTracer(groups=...) or tag the call with probe.tagged(dim=...)")

    @contextmanager
    def observe(self) -> Iterator[None]:
        """Record the ``torch.distributed`` calls made inside, and the probe's buffer samples (re-entrant)."""
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self._depth = 1
        try:
            with observing(self), probe.listening(self):
                yield
        finally:
            self._depth = 0

    def sample(self, part: str, tensors: Iterable[Tensor | None], nbytes: int | None) -> None:
        """The probe's sample (``probe.sample``): to :attr:`state` or :attr:`buffers`."""
        (self.state if part in STATE_PARTS else self.buffers).sample(part, tensors, nbytes)

    def exclude(self, *tensors: Tensor) -> None:
        """The probe's ``not_activations``: the saved-tensor meter's, not the tracer's."""

    def include(self, *tensors: Tensor) -> None:
        """The probe's ``activations_again``: the saved-tensor meter's."""

    def zero3_peaks(self) -> dict[str, int]:
        """ZeRO-3's peaks for its report (``memory.ZERO3_PEAKS``)."""
        peaks = {**self.buffers.peaks, **self.state.peaks}
        return {key: peaks.get(part, 0) for key, part in ZERO3_PEAKS.items()}

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

    def _start(self, call: Call) -> TracedCall | None:
        if not self.enabled:
            return None
        coll = Collective(self.dim_of(call.group), call.kind, int(call.message_bytes), call.group_size,
                          phase=self.phase, unit=probe.current("unit"))
        ev = TracedCall(self.rank, coll, time.perf_counter(), None, call.peer)
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
        return work

    # ---- the observer (observe.py) -----------------------------------------------------------------
    def wrap(self, call: Call, run: Callable[[], Any]) -> Any:
        ev = self._start(call)
        return self._finish(run(), ev, call.async_op)

    def wrap_batch(self, calls: list[Call], run: Callable[[], list[Any]]) -> list[_OpWait]:
        """A batch of point-to-point ops (``dist.batch_isend_irecv``): one event per op, and one completion
        per op (:func:`op_waits`) that stamps it. ``probe.tagged(phases=...)``: each op's phase."""
        events = [self._start(c) for c in calls]
        works = run() if calls else []
        if self.on_action is not None and events and events[-1] is not None:
            self.on_action(f"posted {len(events)} point-to-point ops ({describe(events[-1])})", False)
        for ev, phase in zip(events, probe.current("phases") or (), strict=False):
            if ev is not None:
                ev.phase = phase
        if len(works) != len(events):            # some backends return one work for the batch
            wrapped = [TracedWork(w, None) for w in works] + [TracedWork(None, e, self.on_action) for e in events]
        else:
            wrapped = [TracedWork(w, e, self.on_action) for w, e in zip(works, events, strict=True)]
        return op_waits(wrapped, len(calls))

    # ---- calls by dim, observed --------------------------------------------------------------------
    @contextmanager
    def _as(self, dim: str, unit: str | None = None) -> Iterator[None]:
        with self.observe(), probe.tagged(dim=dim, **({"unit": unit} if unit is not None else {})):
            yield

    def all_reduce(self, tensor: Tensor, dim: str, op: Any = dist.ReduceOp.SUM, group: Any = None,
                   async_op: bool = False, unit: str | None = None) -> TracedWork | None:
        """In-place all-reduce; message = the tensor."""
        with self._as(dim, unit):
            return dist.all_reduce(tensor, op=op, group=self.group(dim, group), async_op=async_op)

    def all_gather(self, output: Tensor, input: Tensor, dim: str, group: Any = None,
                   async_op: bool = False, unit: str | None = None) -> TracedWork | None:
        """Gather equal shards into ``output`` (n x input); message = the gathered output."""
        with self._as(dim, unit):
            fn = all_gather_flat_fn()
            return fn(output, input, group=self.group(dim, group), async_op=async_op)

    def reduce_scatter(self, output: Tensor, input: Tensor, dim: str, op: Any = dist.ReduceOp.SUM,
                       group: Any = None, async_op: bool = False, unit: str | None = None) -> TracedWork | None:
        """Reduce ``input`` (n x output) and keep this rank's shard; message = the full input."""
        with self._as(dim, unit):
            fn = reduce_scatter_flat_fn()
            return fn(output, input, op=op, group=self.group(dim, group), async_op=async_op)

    def all_to_all(self, output: Tensor, input: Tensor, dim: str, output_split_sizes: list[int] | None = None,
                   input_split_sizes: list[int] | None = None, group: Any = None,
                   async_op: bool = False) -> TracedWork | None:
        """``all_to_all_single``; message = this rank's input."""
        with self._as(dim):
            return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                          group=self.group(dim, group), async_op=async_op)

    def broadcast(self, tensor: Tensor, src: int, dim: str, group: Any = None,
                  async_op: bool = False) -> TracedWork | None:
        """Broadcast from global rank ``src``; message = the tensor."""
        with self._as(dim):
            return dist.broadcast(tensor, src=src, group=self.group(dim, group), async_op=async_op)

    # ---- point to point (peers are global ranks) -------------------------------------------------
    def send(self, tensor: Tensor, peer: int, dim: str = "pp", group: Any = None) -> None:
        with self._as(dim):
            dist.send(tensor, dst=peer, group=self.group(dim, group))

    def recv(self, tensor: Tensor, peer: int, dim: str = "pp", group: Any = None) -> None:
        with self._as(dim):
            dist.recv(tensor, src=peer, group=self.group(dim, group))

    def isend(self, tensor: Tensor, peer: int, dim: str = "pp", group: Any = None) -> TracedWork:
        with self._as(dim):
            return dist.isend(tensor, dst=peer, group=self.group(dim, group))

    def irecv(self, tensor: Tensor, peer: int, dim: str = "pp", group: Any = None) -> TracedWork:
        with self._as(dim):
            return dist.irecv(tensor, src=peer, group=self.group(dim, group))

    def batch_isend_irecv(self, ops: Iterable[tuple[str, Tensor, int]], dim: str = "pp",
                          group: Any = None) -> list[_OpWait]:
        """``ops``: ``("send" | "recv", tensor, peer)``; launched together (``dist.batch_isend_irecv``)."""
        ops = list(ops)
        g = self.group(dim, group)
        for kind, _, _ in ops:
            if kind not in ("send", "recv"):
                raise ValueError(f"batch_isend_irecv op {kind!r}; use 'send' or 'recv'")
        with self._as(dim):
            if not ops:
                return []
            p2p = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, peer, group=g)
                   for kind, t, peer in ops]
            return dist.batch_isend_irecv(p2p)


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
