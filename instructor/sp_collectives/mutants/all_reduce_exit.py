"""Mutant: ReduceScatterSequence all-reduces the partial sums and keeps this rank's tokens: right values, right
sharding, but a full all-reduce (twice a reduce-scatter's bytes) in forward and in GatherSequence's backward."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from parallel_lab.distributed.collectives import all_gather_flat_fn


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
    summed = full.contiguous().clone()
    dist.all_reduce(summed)
    r = dist.get_rank()
    return summed[:, r * n:(r + 1) * n].contiguous()


class GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard: Tensor) -> Tensor:
        return gather_seq(shard)

    @staticmethod
    def backward(ctx, dfull: Tensor) -> Tensor:
        return reduce_scatter_seq(dfull)


class ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial: Tensor) -> Tensor:
        return reduce_scatter_seq(partial)

    @staticmethod
    def backward(ctx, dshard: Tensor) -> Tensor:
        return gather_seq(dshard)
