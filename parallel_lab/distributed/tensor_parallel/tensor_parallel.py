"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism (Korthikanti et al. 2022).

The ``t`` ranks of a TP group split every block's matrices: a **column-parallel** linear ``Y = X A^T``
keeps output rows ``A_r`` (``wq wk wv``, ``fc`` / ``gate up``: heads and hidden units are split), a
**row-parallel** linear keeps input columns ``B_r`` (``wo``, ``proj`` / ``down``) and yields a partial
output summed over the ranks. The regions are glued by the conjugate operators of ``tp_communications.py``
(``f``: identity / all-reduce, ``g``: all-reduce / identity), so a block costs 2 all-reduces of ``s b h``
in forward and 2 in backward. With SP the norms, dropout and residuals between the regions are split
along the sequence (all-gather before a region, reduce-scatter after it: the same bytes), every activation
there is stored ``1/t`` times (``sbh/t (34 + 5as/h)``), and, as in Megatron, column-parallel linears save
only their sequence shard and all-gather it again in backward. Replicated parameters that see a shard
(norms, row-parallel biases, gpt's positions) get one all-reduce of their gradients per step.

Grouped-query attention: ``t <= kv_heads`` splits the kv heads; ``t > kv_heads`` gives each rank the kv
head its query heads use and all-reduces its gradient among the ``t / kv_heads`` ranks sharing it. The
vocabulary is split too (``vocab_parallel.py``). ``tp_model.apply_tp`` edits the reference model from the
outside, cutting shards from the full weights; every parameter keeps its name. Derivation: docs/tensor_parallel.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from parallel_lab.distributed.tensor_parallel.tp_communications import (
    TPGroup,
    copy_to_tp,
    gather_from_sequence_parallel,
    reduce_from_tp,
    reduce_scatter_to_sequence_parallel,
)

# --------------------------------------------------------------------------------------------------
# Sequence-parallel input of a region: the shard is saved, the gathered copy is rebuilt in backward
# --------------------------------------------------------------------------------------------------

class _Regather:
    """Backward's all-gather of a region's saved input shard, done once for all the region's linears
    (q, k, v or gate, up) and dropped when the last of them has used it."""

    def __init__(self, tp: TPGroup):
        self.tp, self.users, self.full = tp, 0, None

    def get(self, shard: Tensor) -> Tensor:
        if self.full is None:
            self.full = self.tp.gather_sequence(shard, "tp")
        return self.full

    def release(self) -> None:
        self.users -= 1
        if self.users == 0:
            self.full = None


@dataclass
class SequenceParallelInput:
    """What a region's column-parallel linears receive under SP: ``full``, the all-gathered input
    (forward only), and ``shard``, this rank's tokens (what they save for backward)."""

    shard: Tensor
    full: Tensor
    regather: _Regather


class _LinearOnGatheredInput(torch.autograd.Function):
    """``Y = X W^T + b`` with ``X`` all-gathered along the sequence, saving only this rank's shard of ``X``.

    Forward: ``Y`` from the gathered ``X``. Backward: ``dX = dY W`` (its reduce-scatter happens once, in
    the region's ``gather_from_sequence_parallel``), ``dW = dY^T X`` and ``db = sum dY`` with ``X``
    all-gathered again from the saved shard (Korthikanti et al. 2022, Sec. 4.2.2)."""

    @staticmethod
    def forward(ctx: Any, full: Tensor, shard: Tensor, weight: Tensor, bias: Tensor | None,
                regather: _Regather) -> Tensor:
        ctx.regather, ctx.has_bias = regather, bias is not None
        regather.users += 1
        ctx.save_for_backward(shard, weight)
        return F.linear(full, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, Tensor, Tensor | None, None]:
        shard, weight = ctx.saved_tensors
        x = ctx.regather.get(shard)
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_weight = g2.t() @ x.reshape(-1, x.shape[-1])
        grad_bias = g2.sum(0) if ctx.has_bias else None
        ctx.regather.release()
        return grad @ weight, None, grad_weight, grad_bias, None


# --------------------------------------------------------------------------------------------------
# Parallel linear layers and the regions' entry (f) and exit (g)
# --------------------------------------------------------------------------------------------------

class ColumnParallelLinear(nn.Module):
    """Output rows ``[start, stop)`` of a full linear: ``Y_r = X A_r^T + b_r`` (Megatron's column split).

    The input must already be the region's input on every rank: the caller applied ``f`` (a tensor) or,
    with SP, the all-gather (a :class:`SequenceParallelInput`). Parameters ``weight`` (and ``bias``) are
    copies of the full layer's rows, under the full layer's names.
    """

    def __init__(self, full: nn.Linear, start: int, stop: int):
        super().__init__()
        self.in_features, self.out_features = full.in_features, stop - start
        self.weight = nn.Parameter(full.weight.detach()[start:stop].clone(),
                                   requires_grad=full.weight.requires_grad)
        self.bias = None if full.bias is None else nn.Parameter(
            full.bias.detach()[start:stop].clone(), requires_grad=full.bias.requires_grad)

    def forward(self, x: Tensor | SequenceParallelInput) -> Tensor:
        if isinstance(x, SequenceParallelInput):
            return _LinearOnGatheredInput.apply(x.full, x.shard, self.weight, self.bias, x.regather)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Input columns ``[start, stop)`` of a full linear: ``Y = sum_r X_r B_r^T + b`` (Megatron's row split).

    Each rank computes its partial product, ``reduce`` sums it over the group (``g``: all-reduce, or with
    SP a reduce-scatter along the sequence), and the bias, replicated on every rank, is added once after
    the sum.
    """

    def __init__(self, full: nn.Linear, start: int, stop: int, reduce: Callable[[Tensor], Tensor]):
        super().__init__()
        self.in_features, self.out_features = stop - start, full.out_features
        self.weight = nn.Parameter(full.weight.detach()[:, start:stop].clone(),
                                   requires_grad=full.weight.requires_grad)
        self.bias = full.bias
        self.reduce = reduce

    def forward(self, x: Tensor) -> Tensor:
        y = self.reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


def region_entry(tp: TPGroup, sp: bool) -> Callable[[nn.Module, tuple], tuple]:
    """Forward pre-hook of ``attn`` / ``mlp``: ``f`` on the input, or with SP the all-gather (the shard
    goes along for the column-parallel linears to save)."""

    def hook(module: nn.Module, args: tuple) -> tuple:
        x, *rest = args
        if sp:
            entered: Any = SequenceParallelInput(x, gather_from_sequence_parallel(x, tp, "tp"), _Regather(tp))
        else:
            entered = copy_to_tp(x, tp, "tp")
        return (entered, *rest)

    return hook


def head_entry(tp: TPGroup, sp: bool) -> Callable[[nn.Module, tuple, Tensor], Tensor]:
    """Forward hook of ``final_norm``: the LM head's input enters the vocabulary-parallel region."""

    def hook(module: nn.Module, args: tuple, out: Tensor) -> Tensor:
        if sp:
            return gather_from_sequence_parallel(out, tp, "tp_vocab")
        return copy_to_tp(out, tp, "tp_vocab")

    return hook


def row_reduce(tp: TPGroup, sp: bool) -> Callable[[Tensor], Tensor]:
    """``g`` of a row-parallel linear: the all-reduce of the partial outputs, or with SP the reduce-scatter
    along the sequence."""
    if sp:
        return lambda y: reduce_scatter_to_sequence_parallel(y, tp, "tp")
    return lambda y: reduce_from_tp(y, tp, "tp")


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "SequenceParallelInput", "head_entry", "region_entry",
           "row_reduce"]
