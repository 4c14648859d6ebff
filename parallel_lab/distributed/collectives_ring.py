"""A ring all-reduce written with point-to-point sends, to be read: a reduce-scatter, then an all-gather.

:func:`ring_all_reduce_` sums a tensor over the ranks of a group in place, as ``dist.all_reduce`` does, with
nothing but ``dist.isend`` and ``dist.recv``. The tensor is cut into ``n`` chunks. At each of the ``2 (n - 1)``
steps every rank sends one chunk to the next rank of the ring and receives one from the previous rank
(posting its send first, so that no rank waits for its neighbour to start receiving).

* :func:`ring_reduce_scatter_` (``n - 1`` steps): the received chunk is *added* to the rank's own copy; at
  step ``s`` rank ``r`` sends chunk ``(r - s) % n``. Afterwards rank ``r`` holds chunk ``(r + 1) % n``
  summed over all ranks.
* :func:`ring_all_gather_` (``n - 1`` steps): the received (complete) chunk *replaces* the rank's copy.

Each rank sends ``2 (n - 1)`` chunks of ``M / n`` bytes: ``2 (n - 1) / n * M``, ``comm.Collective``'s wire
bytes. ``on_step(phase, step)`` is called after every step (lesson 00 copies the tensor there to draw it).
NCCL's ring all-reduce is this algorithm with the chunks cut further and pipelined; this one is for reading.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

StepHook = Callable[[str, int], None]


def _ring(x: torch.Tensor, group: Any) -> tuple[torch.Tensor, int, int, int, int]:
    """``(chunks, rank, n, next global rank, previous global rank)`` of ``x`` on ``group``'s ring."""
    group = group or dist.group.WORLD
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if x.numel() % n or not x.is_contiguous():
        raise ValueError(f"a ring over {n} ranks needs a contiguous tensor of a multiple of {n} elements, "
                         f"got {x.numel()}")
    nxt, prev = (dist.get_global_rank(group, (r + d) % n) for d in (1, -1))
    return x.view(n, -1), r, n, nxt, prev


def _step(chunks: torch.Tensor, send: int, recv: int, nxt: int, prev: int, group: Any) -> torch.Tensor:
    """Send chunk ``send`` to the next rank while receiving the previous rank's chunk ``recv``; return it."""
    incoming = torch.empty_like(chunks[recv])
    work = dist.isend(chunks[send], dst=nxt, group=group)
    dist.recv(incoming, src=prev, group=group)
    work.wait()
    return incoming


def ring_reduce_scatter_(x: torch.Tensor, group: Any = None, on_step: StepHook | None = None) -> int:
    """Reduce-scatter phase in place; returns the chunk index this rank now holds complete."""
    chunks, r, n, nxt, prev = _ring(x, group)
    for s in range(n - 1):
        got = (r - 1 - s) % n
        chunks[got] += _step(chunks, (r - s) % n, got, nxt, prev, group)     # add the neighbour's partial sum
        if on_step is not None:
            on_step("reduce-scatter", s + 1)
    return (r + 1) % n


def ring_all_gather_(x: torch.Tensor, group: Any = None, on_step: StepHook | None = None) -> None:
    """All-gather phase in place: rank ``r`` starts with chunk ``(r + 1) % n`` and ends with all of them."""
    chunks, r, n, nxt, prev = _ring(x, group)
    for s in range(n - 1):
        got = (r - s) % n
        chunks[got] = _step(chunks, (r + 1 - s) % n, got, nxt, prev, group)  # a complete chunk: replace
        if on_step is not None:
            on_step("all-gather", s + 1)


def ring_all_reduce_(x: torch.Tensor, group: Any = None, on_step: StepHook | None = None) -> torch.Tensor:
    """Sum ``x`` over the ranks of ``group`` in place (``dist.all_reduce``'s result) and return it."""
    ring_reduce_scatter_(x, group, on_step)
    ring_all_gather_(x, group, on_step)
    return x
