"""Exercise sp_collectives (implement): sequence parallelism's pair of collectives.

Megatron-LM's sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models") splits the tokens of the LayerNorm and dropout regions over the ``t`` tensor-parallel
ranks: between two TP regions an activation ``(b, s, h)`` lives as ``(b, s / t, h)`` per rank, rank ``r``
holding tokens ``[r s/t, (r + 1) s/t)``. Tensor parallelism's ``f`` and ``g`` (exercise tp_mlp) become:

* :class:`GatherSequence` (entering a TP region): forward, every rank gets the whole sequence ``(b, s, h)``
  from the ranks' shards, in token order;
* :class:`ReduceScatterSequence` (leaving it): forward, each rank holds a partial sum ``(b, s, h)`` (a
  row-parallel layer's output); every rank gets the sum over the ranks of its own tokens ``(b, s / t, h)``.

Implement both as ``torch.autograd.Function``s, forward and backward. What must each backward do so that
the gradients equal one process's? Use ``dist.all_gather_into_tensor`` and ``dist.reduce_scatter_tensor``
(or ``all_gather_flat_fn()`` / ``reduce_scatter_flat_fn()`` below) on the default group; they work on the
first dimension, and ``b > 1``. Graded: a TP region between the two (gather, column-parallel fc, a running
mean over the tokens, row-parallel proj, reduce-scatter) gives one process's output and gradients within
1e-5 on 2 and 4 ranks; each operator alone; its calls and bytes per rank.
Check: ``parallel-lab grade sp_collectives exercises/sp_collectives/starter.py``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from parallel_lab.distributed.collectives import all_gather_flat_fn, reduce_scatter_flat_fn


class GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard: Tensor) -> Tensor:            # (b, s/t, h) -> (b, s, h)
        raise NotImplementedError("TODO: GatherSequence forward")

    @staticmethod
    def backward(ctx, dfull: Tensor) -> Tensor:           # (b, s, h) -> (b, s/t, h)
        raise NotImplementedError("TODO: GatherSequence backward")


class ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial: Tensor) -> Tensor:          # (b, s, h) -> (b, s/t, h)
        raise NotImplementedError("TODO: ReduceScatterSequence forward")

    @staticmethod
    def backward(ctx, dshard: Tensor) -> Tensor:          # (b, s/t, h) -> (b, s, h)
        raise NotImplementedError("TODO: ReduceScatterSequence backward")


__all__ = ["GatherSequence", "ReduceScatterSequence", "all_gather_flat_fn", "dist", "reduce_scatter_flat_fn"]
