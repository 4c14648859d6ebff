"""Mutant: GatherSequence's backward keeps this rank's tokens of its own gradient (no reduce-scatter): the input
gradient misses the other ranks' contributions."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from parallel_lab.distributed.collectives import all_gather_flat_fn, reduce_scatter_flat_fn


def gather_seq(shard: Tensor) -> Tensor:
    """(b, n, h) on each rank -> (b, world n, h), rank k's tokens at [k n, (k+1) n)."""
    t = dist.get_world_size()
    b, n, h = shard.shape
    out = torch.empty(t * b * n * h, dtype=shard.dtype)
    all_gather_flat_fn()(out, shard.contiguous().reshape(-1))
    return out.view(t, b, n, h).transpose(0, 1).reshape(b, t * n, h)


def reduce_scatter_seq(full: Tensor) -> Tensor:
    """(b, s, h) partial sums on each rank -> (b, s / world, h): the sum over ranks of this rank's tokens."""
    t = dist.get_world_size()
    b, s, h = full.shape
    n = s // t
    stacked = full.reshape(b, t, n, h).transpose(0, 1).contiguous().reshape(-1)
    out = torch.empty(b * n * h, dtype=full.dtype)
    reduce_scatter_flat_fn()(out, stacked)
    return out.view(b, n, h)


class GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard: Tensor) -> Tensor:
        return gather_seq(shard)

    @staticmethod
    def backward(ctx, dfull: Tensor) -> Tensor:
        n = dfull.shape[1] // dist.get_world_size()
        r = dist.get_rank()
        return dfull[:, r * n:(r + 1) * n].contiguous()


class ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial: Tensor) -> Tensor:
        return reduce_scatter_seq(partial)

    @staticmethod
    def backward(ctx, dshard: Tensor) -> Tensor:
        return gather_seq(dshard)
