"""Tensor parallelism's communication: the TP group and Megatron's conjugate operators ``f`` and ``g``.

Each region of a block (attention, MLP) is entered and left through a pair of operators that are each
other's transpose (Shoeybi et al. 2019; the sequence-parallel pair from Korthikanti et al. 2022)::

    f = copy_to_tp:                          forward identity,          backward all-reduce
    g = reduce_from_tp:                      forward all-reduce,        backward identity
    gather_from_sequence_parallel:           forward all-gather (seq),  backward reduce-scatter
    reduce_scatter_to_sequence_parallel:     forward reduce-scatter,    backward all-gather

An all-reduce is a reduce-scatter followed by an all-gather, so SP moves the same bytes as ``f``/``g``.
SP's full-sequence tensors (the all-gather's output, the reduce-scatter's input) are communication buffers,
sampled as part ``sp`` through ``distributed/probe.py`` (``ledger_buffers.activation_buffer_parts``).
Activations are batch-first ``(b, s, ...)``; sequence parallelism shards dimension 1 (rank ``r`` holds
tokens ``[r s/t, (r+1) s/t)``). Every call is a plain ``torch.distributed`` call on the TP group; the one
group serves two accounting dims, so each call is tagged with the label the caller gives (``tp`` in the
blocks, ``tp_vocab`` for the embedding and the loss; docs/conventions.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from parallel_lab.distributed import probe
from parallel_lab.distributed.collectives import all_gather_flat_fn, reduce_scatter_flat_fn


@dataclass
class TPGroup:
    """This rank's tensor-parallel group ``group``: ``size`` ranks, this one at position ``rank``; every call
    counts under the accounting ``label`` given ("tp" inside the blocks, "tp_vocab" for the vocabulary).

    Activations are batch-first ``(b, s, ...)``; sequence parallelism shards dimension 1, rank ``r``
    holding tokens ``[r s/t, (r+1) s/t)``.
    """

    group: Any
    size: int
    rank: int

    def all_reduce(self, x: Tensor, label: str, op: Any = dist.ReduceOp.SUM, group: Any = None) -> Tensor:
        """Sum (or ``op``) ``x`` over the group (or ``group``: GQA's kv-sharing ranks), in place; message = ``x``."""
        with probe.tagged(dim=label):
            dist.all_reduce(x, op=op, group=self.group if group is None else group)
        return x

    def gather_sequence(self, shard: Tensor, label: str) -> Tensor:
        """``(b, s/t, ...) -> (b, s, ...)``: all-gather of the sequence shards; message = the full output."""
        b, n, rest = shard.shape[0], shard.shape[1], shard.shape[2:]
        out = torch.empty((self.size * b, n, *rest), dtype=shard.dtype, device=shard.device)
        all_gather = all_gather_flat_fn()
        with probe.tagged(dim=label):
            all_gather(out, shard.contiguous(), group=self.group)      # rank k's shard: rows [k b, (k+1) b)
        full = out.view(self.size, b, n, *rest).transpose(0, 1).reshape(b, self.size * n, *rest)
        probe.sample("sp", [out, full])                   # rank-major -> batch-first: a copy when b > 1
        return full

    def reduce_scatter_sequence(self, full: Tensor, label: str) -> Tensor:
        """``(b, s, ...) -> (b, s/t, ...)``: sum over the group, keep this rank's tokens; message = full."""
        b, s, rest = full.shape[0], full.shape[1], full.shape[2:]
        n = s // self.size
        stacked = full.reshape(b, self.size, n, *rest).transpose(0, 1).reshape(self.size * b, n, *rest)
        out = torch.empty((b, n, *rest), dtype=full.dtype, device=full.device)
        probe.sample("sp", [full, stacked])                # the partial sums, reordered (a copy when b > 1)
        reduce_scatter = reduce_scatter_flat_fn()
        with probe.tagged(dim=label):
            reduce_scatter(out, stacked, group=self.group)
        return out


# --------------------------------------------------------------------------------------------------
# The conjugate operators (tiny autograd functions)
# --------------------------------------------------------------------------------------------------

class CopyToTP(torch.autograd.Function):
    """Megatron's ``f``. Forward: identity (every rank already holds ``X``). Backward: all-reduce of the
    gradient (each rank's slice of the region contributes a partial ``dL/dX``)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, tp: TPGroup, label: str) -> Tensor:
        ctx.tp, ctx.label = tp, label
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return ctx.tp.all_reduce(grad.clone(memory_format=torch.contiguous_format), ctx.label), None, None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's ``g``. Forward: all-reduce of the partial outputs. Backward: identity (the summed
    output's gradient is what every rank's partial output needs)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, tp: TPGroup, label: str) -> Tensor:
        ctx.mark_dirty(x)
        return tp.all_reduce(x, label)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return grad, None, None


class SequenceParallelEdge(torch.autograd.Function):
    """SP's two edges of a region, each the other's conjugate. Entry: all-gather of the sequence shards
    forward, ``(b, s/t, h) -> (b, s, h)``, reduce-scatter of the gradient backward (sum the ranks' partial
    ``dL/dX``, keep this rank's tokens). Exit: reduce-scatter of the partial outputs forward,
    ``(b, s, h) -> (b, s/t, h)``, all-gather of the shards' gradients backward. (Megatron writes the two
    edges as two Functions; one class shows that each is the other read backwards.)"""

    @staticmethod
    def forward(ctx: Any, x: Tensor, tp: TPGroup, label: str, entry: bool) -> Tensor:
        ctx.tp, ctx.label, ctx.entry = tp, label, entry
        return tp.gather_sequence(x, label) if entry else tp.reduce_scatter_sequence(x, label)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        tp, label = ctx.tp, ctx.label
        return (tp.reduce_scatter_sequence(grad, label) if ctx.entry else tp.gather_sequence(grad, label),
                None, None, None)


def copy_to_tp(x: Tensor, tp: TPGroup, label: str = "tp") -> Tensor:
    return CopyToTP.apply(x, tp, label)


def reduce_from_tp(x: Tensor, tp: TPGroup, label: str = "tp") -> Tensor:
    return ReduceFromTP.apply(x, tp, label)


def gather_from_sequence_parallel(x: Tensor, tp: TPGroup, label: str = "tp") -> Tensor:
    return SequenceParallelEdge.apply(x, tp, label, True)         # entry


def reduce_scatter_to_sequence_parallel(x: Tensor, tp: TPGroup, label: str = "tp") -> Tensor:
    return SequenceParallelEdge.apply(x, tp, label, False)        # exit

