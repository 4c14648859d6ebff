"""Exercise zero3_gather_free (implement): ZeRO-3 / FSDP's gather before use and free after.

ZeRO stage 3 (Rajbhandari et al. 2020; PyTorch FSDP, Zhao et al. 2023) shards the parameters themselves.
A model here is a stack of blocks ``y = x + g * tanh(x W^T + b)`` (:func:`block_forward`), grouped into
*units* (lists of block indices). A unit's tensors ``[W, b, g]`` per block, flattened in order and padded
with zeros to ``world * S`` elements, ``S = ceil(n / world)``, are sharded: rank ``r`` keeps only elements
``[r S, (r + 1) S)``, an ``nn.Parameter`` in ``Zero3.shards`` (one per unit). Implement :class:`Zero3`
and :class:`GatherFree` (one unit's forward and backward) so that:

* every ``shards[u].grad`` after ``loss.backward()`` is the rank's part of the gradient of the *global*
  mean loss (each rank's loss is the mean over its own rows; all ranks have as many rows);
* a unit's full parameters exist only while that unit computes, in forward and in backward: with one unit
  per block, one block's at most (the grader watches the storage of every all-gather's output; freed
  means no reference to it is left);
* the only collectives are ``dist.all_gather_into_tensor`` / ``dist.reduce_scatter_tensor`` (or the
  ``*_flat_fn()`` below) over the padded unit: per unit one in forward, two in backward.

An autograd Function's ``forward`` records nothing for backward: ``backward`` may redo the unit from the
saved input (``torch.enable_grad()``, ``torch.autograd.grad``). Graded: gradients within 1e-5 of one
process; the peak of gathered bytes (per-block units, one root unit); the calls.
Check: ``parallel-lab grade zero3_gather_free exercises/zero3_gather_free/starter.py``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor, nn

from parallel_lab.distributed.collectives import all_gather_flat_fn, reduce_scatter_flat_fn


def block_forward(x: Tensor, w: Tensor, b: Tensor, g: Tensor) -> Tensor:
    """One block: ``x (rows, h) -> (rows, h)``."""
    return x + g * torch.tanh(x @ w.T + b)


def flatten(tensors: list[Tensor]) -> Tensor:
    """The tensors' elements, one after the other, as a 1-D tensor (a copy)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(flat: Tensor, shapes: list[torch.Size]) -> list[Tensor]:
    """Views of the first elements of ``flat`` with ``shapes`` (padding at the end is ignored)."""
    out, at = [], 0
    for s in shapes:
        n = math.prod(s)
        out.append(flat[at:at + n].view(s))
        at += n
    return out


def run_unit(x: Tensor, full: Tensor, shapes: list[torch.Size]) -> Tensor:
    """A unit's blocks, one after the other, with its full flat parameters ``full`` (``[W, b, g]`` per block)."""
    tensors = unflatten(full, shapes)
    for i in range(0, len(tensors), 3):
        x = block_forward(x, *tensors[i:i + 3])
    return x


class GatherFree(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, shard: Tensor, zero: Zero3, u: int) -> Tensor:
        # TODO: unit u's output from x; what must exist while it computes, and what must not after?
        raise NotImplementedError("GatherFree.forward")

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor, Tensor, None, None]:
        # TODO: (gradient at x, gradient of this rank's shard of the global mean loss, None, None)
        raise NotImplementedError("GatherFree.backward")


class Zero3:
    """Rank ``rank`` of ``world``: ``blocks`` are the full tensors ``[W, b, g]`` of each block (alike on every
    rank), ``units`` the block indices of each unit, in forward order."""

    def __init__(self, blocks: list[list[Tensor]], units: list[list[int]], rank: int, world: int):
        self.units, self.rank, self.world = units, rank, world
        self.shapes = [[t.shape for i in unit for t in blocks[i]] for unit in units]
        self.shards: list[nn.Parameter] = []
        # TODO: one nn.Parameter per unit: this rank's S elements of the unit's padded flat parameters

    def forward(self, x: Tensor) -> Tensor:
        # TODO: x (rows, h) through every unit in order, with GatherFree
        raise NotImplementedError("Zero3.forward")


__all__ = ["GatherFree", "Zero3", "all_gather_flat_fn", "block_forward", "dist", "reduce_scatter_flat_fn",
           "run_unit"]
