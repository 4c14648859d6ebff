"""Data parallelism's communication: plain ``torch.distributed`` calls on the gradient group.

Two calls (Li et al. 2020, "PyTorch Distributed"): at wrap time rank 0's weights are broadcast so the
ranks start equal; after backward every gradient is summed over the group (an all-reduce; the caller
divides by the group size, before or after, for the mean). The comm tracer sees these calls from outside
(``instruments/observe.py``); the group alone says their accounting dim (``dp``: dp, or dp x cp).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def broadcast_from_first(tensors: Iterable[Tensor], group: Any = None) -> None:
    """Copy the group's first rank's ``tensors`` to every rank of ``group`` (set-up, not a step: runs
    outside a measured step). What ``DistributedDataParallel`` does at wrap time, so that ranks started
    from different weights agree."""
    src = dist.get_process_group_ranks(group)[0] if group is not None else 0
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t.data, src=src, group=group)


def all_reduce_sum(t: Tensor, group: Any = None, async_op: bool = False) -> Any:
    """Sum ``t`` over ``group`` in place; with ``async_op`` a work to ``wait()`` for (message = ``t``)."""
    return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
