"""Exercise tp_mlp (implement): Megatron's f and g operators and a column- then row-parallel MLP.

A GPT MLP computes ``y = gelu(x A^T) B^T`` with ``A`` of shape ``(ffn, h)`` (``fc``) and ``B`` of shape
``(h, ffn)`` (``proj``). Tensor parallelism over ``t`` ranks (Shoeybi et al. 2019) keeps on rank ``r``
the rows ``A_r = A[r ffn/t : (r+1) ffn/t]`` (column-parallel: each rank computes its slice of the hidden
units, the GeLU needs no communication) and the matching columns ``B_r = B[:, r ffn/t : (r+1) ffn/t]``
(row-parallel: each rank computes a partial ``y``; the sum over ranks is ``y``). Two operators glue this:

* ``f`` (:class:`CopyToParallel`): forward identity, backward all-reduce of the gradient (every rank used
  the full ``x``, so the gradient at ``x`` is the sum of the ranks' contributions);
* ``g`` (:class:`ReduceFromParallel`): forward all-reduce of the partial outputs, backward identity.

Implement both as ``torch.autograd.Function``s and :class:`ParallelMLP`. Use ``dist.all_reduce(...)`` on
the default group (the world is the TP group here). Graded: the output, the gradient at ``x`` and the
gradients of your shards equal one process's within 1e-5 (seeded data); exactly one all-reduce of
``b s h`` elements in forward and one in backward, as ``parallel_lab.comm`` predicts for the MLP.
Check: ``parallel-lab grade tp_mlp exercises/tp_mlp/starter.py``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn


class CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        raise NotImplementedError("TODO: f forward")

    @staticmethod
    def backward(ctx, dy: Tensor) -> Tensor:
        raise NotImplementedError("TODO: f backward")


class ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        raise NotImplementedError("TODO: g forward")

    @staticmethod
    def backward(ctx, dy: Tensor) -> Tensor:
        raise NotImplementedError("TODO: g backward")


class ParallelMLP(nn.Module):
    """Rank ``rank`` of ``world``: keeps ``fc`` rows and ``proj`` columns of the full weights given."""

    def __init__(self, fc_weight: Tensor, proj_weight: Tensor, rank: int, world: int):
        super().__init__()
        # TODO: self.fc = nn.Parameter(<rows of fc_weight>); self.proj = nn.Parameter(<columns of proj_weight>)

    def forward(self, x: Tensor) -> Tensor:                  # x: (b, s, h) -> (b, s, h)
        raise NotImplementedError("TODO: f, column-parallel fc, gelu, row-parallel proj, g")


__all__ = ["CopyToParallel", "F", "ParallelMLP", "ReduceFromParallel", "dist"]
