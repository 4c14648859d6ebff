"""The names of torch's flat all-gather and reduce-scatter, looked up at call time.

torch 2.13 calls them ``all_gather_single`` / ``reduce_scatter_single``; older releases
``all_gather_into_tensor`` / ``reduce_scatter_tensor``. Every communications module asks here, at call
time (not import time), so that a measurement wrapping ``torch.distributed`` sees the call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist


def all_gather_flat_fn() -> Callable:
    """``fn(output, input, group=..., async_op=...)``: every rank's ``input`` into ``output``, rank by rank."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_flat_fn() -> Callable:
    """``fn(output, input, op=..., group=..., async_op=...)``: sum ``input`` over the group, keep this rank's part."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
