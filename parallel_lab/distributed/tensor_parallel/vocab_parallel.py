"""Tensor parallelism over the vocabulary: the embedding, gpt's positions under SP, and the cross-entropy.

The embedding keeps rows ``[r V/t, (r+1) V/t)`` (Megatron), looks up the tokens it holds (zeros for the
others) and sums over the TP group (all-reduce; with SP a reduce-scatter along the sequence). The LM head
keeps the same rows and produces this rank's logit columns ``z``; the loss never builds the ``s b V``
logits on one rank: with three fp32 all-reduces of ``s b`` values,

    m = max_all(max z),   S = sum_all(sum exp(z - m)),   loss = mean over tokens of log S - (z_t - m)

and backward is ``(softmax(z) - onehot(t)) / N`` on this rank's columns. Every call is traced as
``tp_vocab`` (docs/conventions.md), kept apart from the blocks' ``tp`` figure.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from parallel_lab.distributed.tensor_parallel.tp_communications import (
    TPGroup,
    reduce_from_tp,
    reduce_scatter_to_sequence_parallel,
)


class _VocabLookup(torch.autograd.Function):
    """Embedding lookup of the rows this rank holds. ``ids``: local row ids, -1 for another rank's tokens.

    Forward: ``weight[ids]``, zero where ``ids < 0``. Backward: the gradient rows summed into the
    looked-up rows (other ranks' tokens contribute nothing). Saves only ``ids``.
    """

    @staticmethod
    def forward(ctx: Any, ids: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.rows = weight.shape[0]
        out = F.embedding(ids.clamp(min=0), weight)
        return out.masked_fill_((ids < 0).unsqueeze(-1), 0.0)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor]:
        (ids,) = ctx.saved_tensors
        keep = ids >= 0
        grad_weight = torch.zeros((ctx.rows, grad.shape[-1]), dtype=grad.dtype, device=grad.device)
        grad_weight.index_add_(0, ids[keep], grad[keep])
        return None, grad_weight


class VocabParallelEmbedding(nn.Module):
    """Token embedding with vocabulary rows ``[start, stop)`` on this rank (Megatron).

    Forward: look up the tokens this rank holds, zeros for the others, then sum over the TP group:
    all-reduce (``g``), or with SP a reduce-scatter along the sequence. Backward: the conjugate
    (identity, or all-gather), then each rank's rows get their tokens' gradients.
    """

    def __init__(self, full: nn.Embedding, start: int, stop: int, tp: TPGroup, sp: bool):
        super().__init__()
        self.start, self.stop, self.tp, self.sp = start, stop, tp, sp
        self.weight = nn.Parameter(full.weight.detach()[start:stop].clone(),
                                   requires_grad=full.weight.requires_grad)

    def forward(self, tokens: Tensor) -> Tensor:
        local = tokens - self.start
        local = local.masked_fill((local < 0) | (local >= self.stop - self.start), -1)
        partial = _VocabLookup.apply(local, self.weight)
        if self.sp:
            return reduce_scatter_to_sequence_parallel(partial, self.tp, "tp_vocab")
        return reduce_from_tp(partial, self.tp, "tp_vocab")


class SequenceParallelPositions(nn.Module):
    """gpt's learned positions under SP: the full table (replicated), returning this rank's tokens' rows.

    The lookup runs over all positions (saving the position ids as the reference model does) and keeps
    rows ``[r s/t, (r+1) s/t)``; the table's gradient is then a partial sum, completed by the TP
    all-reduce of replicated gradients.
    """

    def __init__(self, full: nn.Embedding, tp: TPGroup):
        super().__init__()
        self.num_embeddings = full.num_embeddings
        self.weight = full.weight
        self.tp = tp

    def forward(self, positions: Tensor) -> Tensor:
        n = positions.shape[0] // self.tp.size
        return F.embedding(positions, self.weight)[self.tp.rank * n:(self.tp.rank + 1) * n]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy from vocabulary-sharded logits (Megatron's vocab-parallel cross-entropy).

    Forward, per token, with this rank's logit columns ``z`` (fp32) and the three all-reduces over the TP
    group: ``m = max_all(max z)``; the target logit ``z_t - m`` (from the rank that holds ``t``, summed);
    ``S = sum_all(sum exp(z - m))``; loss ``= log S - (z_t - m)``, averaged over the tokens.
    Backward: ``(softmax(z) - onehot(t)) / N`` on this rank's columns; saves the local softmax and the
    local target ids (-1 where another rank holds the target).
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, start: int, tp: TPGroup) -> Tensor:
        z = logits.reshape(-1, logits.shape[-1]).float()
        n_tok, n_col = z.shape
        m = z.max(dim=-1).values
        tp.all_reduce(m, "tp_vocab", op=dist.ReduceOp.MAX)
        z = z - m.unsqueeze(-1)
        local = targets.reshape(-1) - start
        local = local.masked_fill((local < 0) | (local >= n_col), -1)
        rows = torch.arange(n_tok, device=z.device)
        target_logit = z[rows, local.clamp(min=0)].masked_fill(local < 0, 0.0)
        tp.all_reduce(target_logit, "tp_vocab")
        e = z.exp_()
        sum_exp = e.sum(dim=-1)
        tp.all_reduce(sum_exp, "tp_vocab")
        loss = (sum_exp.log() - target_logit).mean()
        softmax = e.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        softmax, local = ctx.saved_tensors
        g = softmax.clone()
        hit = (local >= 0).nonzero().squeeze(-1)
        g[hit, local[hit]] -= 1.0
        g.mul_(grad / softmax.shape[0])
        return g.view(ctx.shape).to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits: Tensor, targets: Tensor, start: int, tp: TPGroup) -> Tensor:
    """Mean cross-entropy of ``logits (b, s, V/t)`` (columns ``[start, start + V/t)``) against ``targets``."""
    return _VocabParallelCrossEntropy.apply(logits, targets, start, tp)

