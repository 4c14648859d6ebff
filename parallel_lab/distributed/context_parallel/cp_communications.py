"""Context parallelism's communication: plain ``torch.distributed`` calls on the ``cp`` group.

* ring (Liu et al. 2023): K/V (and backward's dK/dV accumulator) to the next rank, from the previous one,
  posted together as one ``batch_isend_irecv`` (so that NCCL does not deadlock on a blocking pair);
* all-gather (Llama 3): K, V gathered from every rank; backward reduce-scatters dK, dV;
* Ulysses (Jacobs et al. 2023): all-to-all between sequence-sharded and head-sharded Q, K, V and back.

Each returns :class:`Transfer` objects, waited for at most once. The comm tracer sees the calls from
outside; they are tagged ``cp`` through the probe, because the cp group may be the world that the
``dp x cp`` gradient group also is (docs/conventions.md).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor

from parallel_lab.distributed import probe
from parallel_lab.distributed.collectives import all_gather_flat_fn, reduce_scatter_flat_fn


class Transfer:
    """A posted call's work, waited for at most once (waiting twice on a gloo receive blocks until the next)."""

    def __init__(self, work: Any):
        self.work, self.done = work, False

    def wait(self) -> None:
        if not self.done:
            self.work.wait()
            self.done = True


def exchange(send: Tensor, recv: Tensor, next_rank: int, prev_rank: int, group: Any) -> list[Transfer]:
    """``send`` to the next rank of the ring, ``recv`` from the previous one (global ranks), posted together."""
    with probe.tagged(dim="cp"):
        ops = [dist.P2POp(dist.isend, send, next_rank, group=group),
               dist.P2POp(dist.irecv, recv, prev_rank, group=group)]
        return [Transfer(w) for w in dist.batch_isend_irecv(ops)]


def all_gather(output: Tensor, input: Tensor, group: Any) -> Transfer:
    """Every rank's ``input``, rank by rank, into ``output`` (async)."""
    fn = all_gather_flat_fn()
    with probe.tagged(dim="cp"):
        return Transfer(fn(output, input, group=group, async_op=True))


def reduce_scatter(output: Tensor, input: Tensor, group: Any) -> Transfer:
    """Sum ``input`` (a shard per rank) over the group; this rank's shard into ``output`` (async)."""
    fn = reduce_scatter_flat_fn()
    with probe.tagged(dim="cp"):
        return Transfer(fn(output, input, group=group, async_op=True))


def all_to_all(output: Tensor, input: Tensor, group: Any) -> Transfer:
    """Equal-split ``all_to_all_single``: chunk ``j`` of ``input`` to rank ``j``, chunk ``i`` of ``output``
    from rank ``i`` (async)."""
    with probe.tagged(dim="cp"):
        return Transfer(dist.all_to_all_single(output, input, group=group, async_op=True))
