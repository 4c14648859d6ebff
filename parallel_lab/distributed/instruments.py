"""Instruments: measure what the analytic core predicts (docs/conventions.md is the contract).

Communication. :class:`CommTracer` is the one door through which every collective and point-to-point
call of the implementations goes. Each method takes the accounting ``dim`` (``dp``, ``tp``, ``tp_vocab``,
``pp``, ``cp``) and records a :class:`CommEvent` with the fields of ``parallel_lab.comm.Collective``:
``kind``, ``message_bytes`` (the *payload*: all-reduce the tensor, all-gather the gathered output,
reduce-scatter the full input, all-to-all this rank's input, send/recv the tensor), ``group_size``
(2 for point-to-point), plus ``rank``, start/end times and the ``phase`` the caller set.
:func:`compare_calls` checks a list of events against predicted collectives call by call (a multiset of
``(dim, kind, message_bytes, group_size)`` with counts), :func:`payload_by_dim` sums them per dim.
Reporting code (gathering results for a comparison) calls ``torch.distributed`` directly, untraced.

Memory. :func:`measure_state` measures parameters, gradients and optimizer states from the tensors
(each storage once; optimizer step counters, which are 0-dim tensors, are not state per parameter and
are not counted). :class:`SavedTensorMeter` measures activations as the bytes saved for backward, with
``torch.autograd.graph.saved_tensors_hooks``: every saved tensor is charged with its whole *storage*
(a saved view keeps its base alive, so a view is charged its base's bytes), each storage once while any
saved reference to it lives, and storages that belong to parameters (the weight a linear saves, or a
transposed view of it) are not activations and are skipped. The meter tracks the live total and its
peak, so pipeline schedules that hold several micro-batches show their in-flight peak.
:func:`memtracker_snapshot` asks torch's own ``MemTracker`` for a second opinion.

Timeline. :class:`Timeline` records per-rank spans (compute, communication) with a process-independent
clock (``time.perf_counter`` is CLOCK_MONOTONIC on Linux, shared by the processes of one machine);
the pipeline executor and the widgets draw them.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake
from torch.autograd.graph import saved_tensors_hooks

# ``all_gather_single`` / ``reduce_scatter_single`` are the 2.13 names; older torch has the *_tensor ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def nbytes(t: Tensor) -> int:
    """Bytes of the tensor's elements (the payload of a call, not its storage)."""
    return t.numel() * t.element_size()


# --------------------------------------------------------------------------------------------------
# Communication
# --------------------------------------------------------------------------------------------------

@dataclass
class CommEvent:
    """One traced call on one rank (fields as ``comm.Collective``, plus timing)."""

    rank: int
    dim: str
    kind: str
    message_bytes: int
    group_size: int
    t_start: float
    t_end: float | None
    phase: str = ""
    peer: int | None = None

    def key(self) -> tuple[str, str, int, int]:
        return (self.dim, self.kind, self.message_bytes, self.group_size)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class TracedWork:
    """Wraps an async ``Work``: ``wait()`` waits and stamps the event's end time."""

    def __init__(self, work: Any, event: CommEvent | None):
        self.work, self.event = work, event

    def wait(self) -> bool:
        ok = self.work.wait() if self.work is not None else True
        if self.event is not None and self.event.t_end is None:
            self.event.t_end = time.perf_counter()
        return ok

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()


class CommTracer:
    """Every collective of the implementations, recorded as :class:`CommEvent`.

    ``groups`` maps a dim label to its process group (``Grid.groups_by_dim()``); a call may also pass
    ``group=`` explicitly. ``phase`` is a free label the training loop sets ("forward", "backward",
    "step"); ``enabled=False`` makes the tracer a pass-through (no events).
    """

    def __init__(self, rank: int, groups: dict[str, Any] | None = None, enabled: bool = True):
        self.rank = rank
        self.groups = dict(groups or {})
        self.enabled = enabled
        self.phase = ""
        self.events: list[CommEvent] = []

    # ---- bookkeeping -----------------------------------------------------------------------------
    def group(self, dim: str, group: Any = None) -> Any:
        if group is not None:
            return group
        return self.groups.get(dim)

    @contextmanager
    def phase_as(self, phase: str) -> Iterator[None]:
        old, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = old

    def clear(self) -> None:
        self.events.clear()

    def _start(self, dim: str, kind: str, message_bytes: int, group: Any, peer: int | None = None,
               group_size: int | None = None) -> CommEvent | None:
        if not self.enabled:
            return None
        n = group_size if group_size is not None else dist.get_world_size(group)
        ev = CommEvent(self.rank, dim, kind, int(message_bytes), n, time.perf_counter(), None, self.phase,
                       peer)
        self.events.append(ev)
        return ev

    @staticmethod
    def _finish(work: Any, ev: CommEvent | None, async_op: bool) -> Any:
        if async_op:
            return TracedWork(work, ev)
        if ev is not None:
            ev.t_end = time.perf_counter()
        return None

    # ---- collectives -----------------------------------------------------------------------------
    def all_reduce(self, tensor: Tensor, dim: str, op: Any = dist.ReduceOp.SUM, group: Any = None,
                   async_op: bool = False) -> TracedWork | None:
        """In-place all-reduce; message = the tensor."""
        g = self.group(dim, group)
        ev = self._start(dim, "all_reduce", nbytes(tensor), g)
        return self._finish(dist.all_reduce(tensor, op=op, group=g, async_op=async_op), ev, async_op)

    def all_gather(self, output: Tensor, input: Tensor, dim: str, group: Any = None,
                   async_op: bool = False) -> TracedWork | None:
        """Gather equal shards into ``output`` (n x input); message = the gathered output."""
        g = self.group(dim, group)
        ev = self._start(dim, "all_gather", nbytes(output), g)
        return self._finish(_all_gather(output, input, group=g, async_op=async_op), ev, async_op)

    def reduce_scatter(self, output: Tensor, input: Tensor, dim: str, op: Any = dist.ReduceOp.SUM,
                       group: Any = None, async_op: bool = False) -> TracedWork | None:
        """Reduce ``input`` (n x output) and keep this rank's shard; message = the full input."""
        g = self.group(dim, group)
        ev = self._start(dim, "reduce_scatter", nbytes(input), g)
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
        return TracedWork(dist.isend(tensor, dst=peer, group=self.group(dim, group)), ev)

    def irecv(self, tensor: Tensor, peer: int, dim: str = "pp", group: Any = None) -> TracedWork:
        ev = self._start(dim, "recv", nbytes(tensor), None, peer, group_size=2)
        return TracedWork(dist.irecv(tensor, src=peer, group=self.group(dim, group)), ev)

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
        if len(works) != len(events):            # some backends return one work for the batch
            return [TracedWork(w, None) for w in works] + [TracedWork(None, e) for e in events]
        return [TracedWork(w, e) for w, e in zip(works, events, strict=True)]


# --------------------------------------------------------------------------------------------------
# Comparing measured calls with predicted collectives
# --------------------------------------------------------------------------------------------------

def event_counts(events: Iterable[CommEvent]) -> Counter:
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


def compare_calls(events: Iterable[CommEvent], colls: Iterable[Any], times: int = 1) -> dict[str, Counter]:
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


# --------------------------------------------------------------------------------------------------
# Memory: model state
# --------------------------------------------------------------------------------------------------

def _storage_key(t: Tensor) -> tuple[int, str]:
    st = t.untyped_storage()
    if is_fake(t):      # fake tensors (distributed/measure.py) have no address: key by the storage itself
        return (st._cdata, str(t.device))
    return (st.data_ptr(), str(t.device))


def storage_bytes(tensors: Iterable[Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a storage shared by several counts once)."""
    seen: dict[tuple[int, str], int] = {}
    for t in tensors:
        if t is None:
            continue
        n = t.untyped_storage().nbytes()
        if n:
            seen[_storage_key(t)] = n
    return sum(seen.values())


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """Per-parameter state tensors of an optimizer (``exp_avg``, ``momentum_buffer``...), not 0-dim
    step counters."""
    out = []
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, Tensor) and v.dim() > 0:
                out.append(v)
    return out


def measure_state(params: Iterable[Tensor], optimizer: torch.optim.Optimizer | None = None,
                  grads: Iterable[Tensor | None] | None = None) -> dict[str, int]:
    """``{"parameters", "gradients", "optimizer_states"}`` bytes, measured from the tensors.

    ``params``: the tensors this rank keeps as parameters (a sharded implementation passes its shards);
    ``grads``: default each parameter's ``.grad``. Call it after backward, before gradients are freed.
    """
    params = list(params)
    grads = [p.grad for p in params] if grads is None else list(grads)
    return {"parameters": storage_bytes(params),
            "gradients": storage_bytes(grads),
            "optimizer_states": storage_bytes(optimizer_state_tensors(optimizer)) if optimizer else 0}


# --------------------------------------------------------------------------------------------------
# Memory: activations (bytes saved for backward)
# --------------------------------------------------------------------------------------------------

class _Saved:
    """What the pack hook returns: holds the tensor; its death releases the storage's charge."""

    __slots__ = ("tensor", "key", "meter", "__weakref__")

    def __init__(self, tensor: Tensor, key: tuple[int, str] | None, meter: SavedTensorMeter):
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        if self.key is not None:
            self.meter._release(self.key)


#: Modules whose forward starts a scope, and the ledger category the scope belongs to.
DEFAULT_SCOPES = {"tok_emb": "activations", "pos_emb": "activations", "blocks.": "activations",
                  "final_norm": "logits_and_loss", "lm_head": "logits_and_loss"}


class SavedTensorMeter:
    """Bytes saved for backward, by storage, charged to the scope (module) that first saves them.

    Usage::

        meter = SavedTensorMeter(model)          # registers forward pre-hooks for the scopes
        with meter:                              # forward (and backward) of one or more micro-batches
            loss = loss_fn(model(x), y); loss.backward()
        meter.peak["activations"], meter.forward_bytes["blocks.1"], meter.peak_total

    ``model``: its parameters are excluded (their storages are looked up again whenever a scope starts and
    at ``__enter__``, after the hooks of other plug-ins that gather parameters, so parameters
    re-materialised by ZeRO-3 are excluded too; looking them up at every save doubled a tiny model's
    forward time); :meth:`exclude` adds other storages that are not activations. Scopes:
    a module whose name is in ``scopes`` (exact, or a prefix ending in ".": ``"blocks."`` gives
    ``blocks.0``, ``blocks.1``...) starts a scope when its forward begins; the scope lasts until the next
    one starts. ``forward_bytes[scope]`` counts storages newly charged in that scope (first save wins);
    ``live[category]`` and ``peak[category]`` are the bytes alive now and at the peak.
    """

    def __init__(self, model: nn.Module | None = None, scopes: dict[str, str] | None = None):
        self.model = model
        self.scopes = DEFAULT_SCOPES if scopes is None else scopes
        self._excluded: set[tuple[int, str]] = set()
        self._charged: dict[tuple[int, str], list] = {}   # key -> [nbytes, refs, category]
        self.scope, self.category = "activations", "activations"
        self._param_keys: set[tuple[int, str]] = set()
        self.forward_bytes: Counter = Counter()
        self.live: Counter = Counter()
        self.peak: Counter = Counter()
        self.peak_total = 0
        self._handles: list[Any] = []
        self._hooks: saved_tensors_hooks | None = None
        if model is not None:
            self.watch(model)

    # ---- scopes ----------------------------------------------------------------------------------
    def _category_of(self, name: str) -> str | None:
        for key, cat in self.scopes.items():
            if name == key or (key.endswith(".") and name.startswith(key) and "." not in name[len(key):]):
                return cat
        return None

    def watch(self, model: nn.Module) -> None:
        for name, module in model.named_modules():
            cat = self._category_of(name)
            if cat is not None:
                self._handles.append(module.register_forward_pre_hook(self._enter_scope(name, cat)))

    def _enter_scope(self, name: str, category: str):
        def hook(module: nn.Module, args: Any) -> None:
            self.scope, self.category = name, category
            self._refresh_parameters()
        return hook

    def _refresh_parameters(self) -> None:
        if self.model is not None:
            self._param_keys = {_storage_key(p) for p in self.model.parameters()}

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ---- exclusion -------------------------------------------------------------------------------
    def exclude(self, *tensors: Tensor) -> None:
        """Storages that are not activations (e.g. a gathered flat parameter buffer)."""
        for t in tensors:
            self._excluded.add(_storage_key(t))

    def include(self, *tensors: Tensor) -> None:
        """Undo :meth:`exclude`; call it before the storage is freed (its address may be reused)."""
        for t in tensors:
            self._excluded.discard(_storage_key(t))

    def _is_excluded(self, key: tuple[int, str]) -> bool:
        return key in self._excluded or key in self._param_keys

    # ---- hooks -----------------------------------------------------------------------------------
    def _pack(self, t: Tensor) -> _Saved:
        # Keep a detached alias (same storage): a tensor an op saves may be that op's own output, and holding
        # it with its grad_fn would make a reference cycle through the autograd graph (node -> saved ->
        # tensor -> node) that Python's gc cannot see, leaking any graph that is not consumed by an ordinary
        # backward (a forward without backward, or the nodes a pipeline's weight-gradient pass skips).
        # Autograd re-attaches the grad_fn on unpack.
        n = t.untyped_storage().nbytes()
        key = _storage_key(t)
        t = t.detach()
        if n == 0 or self._is_excluded(key):
            return _Saved(t, None, self)
        entry = self._charged.get(key)
        if entry is None:
            entry = self._charged[key] = [n, 0, self.category]
            self.forward_bytes[self.scope] += n
            self.live[self.category] += n
            self.peak[self.category] = max(self.peak[self.category], self.live[self.category])
            self.peak_total = max(self.peak_total, sum(self.live.values()))
        entry[1] += 1
        return _Saved(t, key, self)

    @staticmethod
    def _unpack(s: _Saved) -> Tensor:
        return s.tensor

    def _release(self, key: tuple[int, str]) -> None:
        entry = self._charged.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._charged[key]
            self.live[entry[2]] -= entry[0]

    def reset(self) -> None:
        """Forget the per-scope counts and peaks (live storages stay charged)."""
        self.forward_bytes.clear()
        self.peak = Counter(self.live)
        self.peak_total = sum(self.live.values())

    def __enter__(self) -> SavedTensorMeter:
        self.scope, self.category = "activations", "activations"
        self._refresh_parameters()
        self._hooks = saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        self._hooks = None

    @property
    def live_total(self) -> int:
        return sum(self.live.values())


# --------------------------------------------------------------------------------------------------
# Torch's MemTracker as a second opinion
# --------------------------------------------------------------------------------------------------

def memtracker_snapshot(model: nn.Module, optimizer: torch.optim.Optimizer,
                        step: Any) -> dict[str, dict[str, int]]:
    """Run ``step()`` (forward + backward + optimizer step) under torch's ``MemTracker``.

    Returns ``{"peak": {...}, "current": {...}}``: torch's bytes per category (``Parameter``,
    ``Gradient``, ``Optstate``, ``Activation``, ``Temp``, ``Total``), summed over devices. Run one step
    before (optimizer states are created lazily). Works on CPU. Torch counts what our meters leave out:
    ``Optstate`` includes the 4-byte step counters (current) and the optimizer's temporaries (peak).
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    mt.track_external(model, optimizer)
    with mt:
        step()
    out: dict[str, dict[str, int]] = {}
    for kind in ("peak", "current"):
        acc: dict[str, int] = {}
        for per_dev in mt.get_tracker_snapshot(kind).values():
            for k, v in per_dev.items():
                name = str(getattr(k, "value", k))
                acc[name] = acc.get(name, 0) + int(v)
        out[kind] = acc
    return out


# --------------------------------------------------------------------------------------------------
# Timeline
# --------------------------------------------------------------------------------------------------

@dataclass
class Span:
    """One interval on one rank: ``kind`` "compute" or "comm"; ``name`` e.g. "F", "B", "dp:all_reduce"."""

    rank: int
    kind: str
    name: str
    t_start: float
    t_end: float
    micro_batch: int | None = None
    stage: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Timeline:
    """Per-rank spans; ``with timeline.span("F", micro_batch=3): ...`` records one."""

    def __init__(self, rank: int):
        self.rank = rank
        self.spans: list[Span] = []

    @contextmanager
    def span(self, name: str, kind: str = "compute", micro_batch: int | None = None,
             stage: int | None = None) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.spans.append(Span(self.rank, kind, name, t0, time.perf_counter(), micro_batch, stage))

    def with_comm(self, events: Iterable[CommEvent]) -> list[Span]:
        """This timeline's spans plus one "comm" span per finished traced call, sorted by start."""
        comm = [Span(e.rank, "comm", f"{e.dim}:{e.kind}", e.t_start, e.t_end) for e in events
                if e.t_end is not None]
        return sorted(self.spans + comm, key=lambda s: s.t_start)


def align(spans: Iterable[Span]) -> list[Span]:
    """Spans of several ranks shifted so that the earliest start is 0 (seconds)."""
    spans = list(spans)
    if not spans:
        return []
    t0 = min(s.t_start for s in spans)
    return [Span(s.rank, s.kind, s.name, s.t_start - t0, s.t_end - t0, s.micro_batch, s.stage) for s in spans]
