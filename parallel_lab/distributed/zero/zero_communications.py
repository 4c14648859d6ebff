"""ZeRO's communication: plain ``torch.distributed`` calls on the gradient group, one per unit.

Rajbhandari et al. 2020: a unit's flat gradient (``g S_u`` elements, padded) is reduce-scattered, each rank
keeping the ``S_u`` it owns; after the step on the shard, the updated shards are all-gathered back into the
full flat buffer (ZeRO-3 gathers before every forward and backward of the unit too). Messages: the
reduce-scatter's full input, the all-gather's full output (docs/conventions.md). ZeRO-1's all-reduce
variant is data parallelism's (``dp_communications.all_reduce_sum``). The comm tracer sees the calls from
outside; the unit a call belongs to is not needed by the accounting.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor

from parallel_lab.distributed.collectives import all_gather_flat_fn, reduce_scatter_flat_fn


def reduce_scatter_sum(output: Tensor, input: Tensor, group: Any = None, async_op: bool = False) -> Any:
    """Sum ``input`` (``g`` shards) over ``group``; this rank's shard into ``output``."""
    fn = reduce_scatter_flat_fn()
    return fn(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_gather_flat(output: Tensor, input: Tensor, group: Any = None, async_op: bool = False) -> Any:
    """Every rank's shard ``input``, rank by rank, into ``output`` (``g`` shards)."""
    fn = all_gather_flat_fn()
    return fn(output, input, group=group, async_op=async_op)


def all_reduce_op(t: Tensor, op: Any, group: Any = None) -> None:
    """Reduce ``t`` over ``group`` with ``op`` in place (a gradient norm: SUM of powers, or MAX)."""
    dist.all_reduce(t, op=op, group=group)


def wait_posted(posted: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """Wait for an asynchronous call posted as ``(..., work)`` (the reduce-scatter a unit's backward
    overlaps); return what was posted before the Work, or None if nothing was in flight."""
    if posted is None:
        return None
    posted[-1].wait()
    return posted[:-1]
