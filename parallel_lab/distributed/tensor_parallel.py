"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism (Korthikanti et al. 2022).

The ``t`` ranks of a TP group split every transformer block's matrices so that each rank holds ``1/t`` of
them and computes ``1/t`` of each matrix product:

* a **column-parallel** linear ``Y = X A^T`` keeps the output rows ``A_r`` (``wq, wk, wv``, ``fc`` or
  ``gate, up``): from the full input ``X`` each rank computes its slice of the output, ``Y_r = X A_r^T``;
  attention heads and the MLP's hidden units are therefore split;
* a **row-parallel** linear keeps the input columns ``B_r`` (``wo``, ``proj`` or ``down``): from its slice of
  the input each rank computes a *partial* output ``X_r B_r^T``; the sum over ranks is the full output.

Two conjugate operators glue the regions together (Megatron's ``f`` and ``g``)::

    f: forward identity,   backward all-reduce    (enter the parallel region: copy X to all ranks)
    g: forward all-reduce, backward identity      (leave it: sum the partial outputs)

so a block costs 2 all-reduces of ``s b h`` in forward (``g`` after attention and after the MLP) and 2 in
backward (``f`` before them). **Sequence parallelism** (SP) splits what lies *between* the regions
(norms, dropout, residual adds) along the sequence, and replaces ``f``/``g`` by::

    all-gather along the sequence (forward) / reduce-scatter (backward)   before attention and MLP
    reduce-scatter along the sequence (forward) / all-gather (backward)   after them

An all-reduce is a reduce-scatter followed by an all-gather, so the bytes moved stay the same, while
every activation outside the regions is stored ``1/t`` times (Korthikanti's ``sbh/t (34 + 5as/h)``). Like
Megatron, the column-parallel linears keep only their sequence *shard* for backward and all-gather it
again there for the weight gradient (one extra all-gather per region: memory for communication).
Parameters that are replicated on every TP rank but see only a sequence shard (norm weights and biases,
row-parallel biases, gpt's position embedding) get partial gradients; one all-reduce of their flat
concatenation per step completes them.

The **vocabulary** is split too (``dim="tp_vocab"`` in the tracer, see docs/conventions.md): the embedding
keeps rows ``[r V/t, (r+1) V/t)``, zeroes the lookups of other ranks' tokens and sums (all-reduce; with SP
reduce-scatter); the LM head keeps the same rows and produces this rank's logit columns, and the
cross-entropy reduces the max, the sum of exponentials and the target logit over the ranks (three fp32
all-reduces of ``s b`` values) so the ``s b V`` logits are never built on one rank.

Grouped-query attention: with ``t <= kv_heads`` the key/value heads are split like the query heads; with
``t > kv_heads`` each rank keeps the one kv head its query heads use, so ``t / kv_heads`` ranks hold the
same head, and its weight gradient (a partial sum over their query heads) is all-reduced among them.

:func:`apply_tp` applies all of this to the reference model from the outside (``train.Runtime``): the
shards are cut from the full weights (same seed, same function at any ``t``) and every parameter keeps
its reference name. All collectives of the step go through the ``CommTracer``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from parallel_lab import layout
from parallel_lab.distributed.grid import all_groups
from parallel_lab.distributed.instruments import CommTracer
from parallel_lab.specs import ModelSpec, ParallelLabError, Plan, divisors

# --------------------------------------------------------------------------------------------------
# The TP group and its collectives along the sequence
# --------------------------------------------------------------------------------------------------


@dataclass
class TPGroup:
    """This rank's tensor-parallel group: ``size`` ranks, this one at position ``rank``; every call is
    traced under the accounting ``label`` given ("tp" inside the blocks, "tp_vocab" for the vocabulary).

    Activations are batch-first ``(b, s, ...)``; sequence parallelism shards dimension 1, rank ``r``
    holding tokens ``[r s/t, (r+1) s/t)``.
    """

    tracer: CommTracer
    size: int
    rank: int

    def all_reduce(self, x: Tensor, label: str, op: Any = dist.ReduceOp.SUM) -> Tensor:
        """Sum (or ``op``) ``x`` over the group, in place; message = ``x``."""
        self.tracer.all_reduce(x, label, op=op)
        return x

    def gather_sequence(self, shard: Tensor, label: str) -> Tensor:
        """``(b, s/t, ...) -> (b, s, ...)``: all-gather of the sequence shards; message = the full output."""
        b, n, rest = shard.shape[0], shard.shape[1], shard.shape[2:]
        out = torch.empty((self.size * b, n, *rest), dtype=shard.dtype, device=shard.device)
        self.tracer.all_gather(out, shard.contiguous(), label)      # rank k's shard: rows [k b, (k+1) b)
        return out.view(self.size, b, n, *rest).transpose(0, 1).reshape(b, self.size * n, *rest)

    def reduce_scatter_sequence(self, full: Tensor, label: str) -> Tensor:
        """``(b, s, ...) -> (b, s/t, ...)``: sum over the group, keep this rank's tokens; message = full."""
        b, s, rest = full.shape[0], full.shape[1], full.shape[2:]
        n = s // self.size
        stacked = full.reshape(b, self.size, n, *rest).transpose(0, 1).reshape(self.size * b, n, *rest)
        out = torch.empty((b, n, *rest), dtype=full.dtype, device=full.device)
        self.tracer.reduce_scatter(out, stacked, label)
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


class GatherFromSequenceParallel(torch.autograd.Function):
    """SP's entry into a region. Forward: all-gather of the sequence shards, ``(b, s/t, h) -> (b, s, h)``.
    Backward: reduce-scatter of the gradient (sum the ranks' partial ``dL/dX``, keep this rank's tokens)."""

    @staticmethod
    def forward(ctx: Any, shard: Tensor, tp: TPGroup, label: str) -> Tensor:
        ctx.tp, ctx.label = tp, label
        return tp.gather_sequence(shard, label)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return ctx.tp.reduce_scatter_sequence(grad, ctx.label), None, None


class ReduceScatterToSequenceParallel(torch.autograd.Function):
    """SP's exit from a region. Forward: reduce-scatter of the partial outputs along the sequence,
    ``(b, s, h) -> (b, s/t, h)``. Backward: all-gather of the shards' gradients (every rank's partial output
    needs the gradient of the whole sequence)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, tp: TPGroup, label: str) -> Tensor:
        ctx.tp, ctx.label = tp, label
        return tp.reduce_scatter_sequence(x, label)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return ctx.tp.gather_sequence(grad, ctx.label), None, None


def copy_to_tp(x: Tensor, tp: TPGroup, label: str = "tp") -> Tensor:
    return CopyToTP.apply(x, tp, label)


def reduce_from_tp(x: Tensor, tp: TPGroup, label: str = "tp") -> Tensor:
    return ReduceFromTP.apply(x, tp, label)


def gather_from_sequence_parallel(x: Tensor, tp: TPGroup, label: str = "tp") -> Tensor:
    return GatherFromSequenceParallel.apply(x, tp, label)


def reduce_scatter_to_sequence_parallel(x: Tensor, tp: TPGroup, label: str = "tp") -> Tensor:
    return ReduceScatterToSequenceParallel.apply(x, tp, label)


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
    the region's :class:`GatherFromSequenceParallel`), ``dW = dY^T X`` and ``db = sum dY`` with ``X``
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
# Parallel linear layers, embedding, cross-entropy
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


# --------------------------------------------------------------------------------------------------
# Applying TP to the reference model
# --------------------------------------------------------------------------------------------------

def check_tp(spec: ModelSpec, plan: Plan) -> None:
    """What the runnable TP needs beyond ``Plan.validate``; a ParallelLabError naming the fix otherwise."""
    t = plan.tp
    layout.check_tp(spec, t)              # heads, kv heads and ffn: the one rule of the analytic core
    if spec.vocab % t:
        raise ParallelLabError(f"tp={t} does not divide vocab={spec.vocab}: the runnable vocabulary-parallel "
                               f"embedding needs equal shards; pick tp in "
                               f"{{{', '.join(map(str, divisors(spec.vocab)))}}}")
    local_seq = plan.seq // plan.cp
    if plan.sp and local_seq % t:
        raise ParallelLabError(f"sequence parallelism splits the {local_seq} local tokens (seq/cp) over "
                               f"tp={t}; pick seq a multiple of {t * plan.cp}")
    if plan.zero >= 2 and (plan.sp or t > spec.kv_heads):
        raise ParallelLabError(f"tp={t} with {'sp' if plan.sp else f'kv_heads={spec.kv_heads} < tp'} "
                               f"all-reduces replicated gradients after the data-parallel sync, whose "
                               f"result zero={plan.zero} keeps sharded; use zero 0 or 1, or drop sp and "
                               f"keep tp <= kv_heads")


def _split(n: int, t: int, r: int) -> tuple[int, int]:
    return r * n // t, (r + 1) * n // t


@dataclass
class _Layout:
    """How each sharded parameter is cut: ``axis`` and, for replicated kv heads, the ranks that keep
    distinct heads (the first rank of each group sharing one)."""

    axis: int
    distinct: list[int] | None = None


class TensorParallelState:
    """What :func:`apply_tp` leaves on the runtime (``rt.extras["tp"]``): the group, each sharded
    parameter's layout, the names whose gradients TP completes, and the kv-head process group."""

    def __init__(self, tp: TPGroup, group: Any, sp: bool):
        self.tp, self.group, self.sp = tp, group, sp
        self.layout: dict[str, _Layout] = {}
        self.replicated: list[str] = []          # grads partial over the sequence shards (SP)
        self.kv_shared: list[str] = []           # wk, wv replicated over tp / kv_heads ranks
        self.kv_group: Any = None

    # ---- gradients TP must complete after the data-parallel sync ---------------------------------
    def finalize_grads(self, model: nn.Module) -> None:
        """SP: one all-reduce over TP of the flat gradients of the replicated parameters; GQA with
        ``tp > kv_heads``: one all-reduce of the kv weights' gradients over the ranks sharing a head."""
        params = dict(model.named_parameters())
        for names, group in ((self.replicated, None), (self.kv_shared, self.kv_group)):
            ps = [params[n] for n in names if n in params and params[n].requires_grad]
            if not ps:
                continue
            for p in ps:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in ps])
            self.tp.tracer.all_reduce(flat, "tp", group=group)
            off = 0
            for p in ps:
                p.grad.copy_(flat[off:off + p.numel()].view_as(p))
                off += p.numel()

    # ---- full tensors for comparisons (untraced) -------------------------------------------------
    def gather_full(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """Full parameters (or gradients) by name from every TP rank's shards; untraced collectives."""
        out = dict(tensors)
        for name, t in tensors.items():
            lay = self.layout.get(name)
            if lay is None:
                continue
            parts = [torch.empty_like(t) for _ in range(self.tp.size)]
            dist.all_gather(parts, t.contiguous(), group=self.group)
            if lay.distinct is not None:
                parts = [parts[r] for r in lay.distinct]
            out[name] = torch.cat(parts, dim=lay.axis)
        return out


def _region_entry(tp: TPGroup, sp: bool) -> Callable[[nn.Module, tuple], tuple]:
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


def _head_entry(tp: TPGroup, sp: bool) -> Callable[[nn.Module, tuple, Tensor], Tensor]:
    """Forward hook of ``final_norm``: the LM head's input enters the vocabulary-parallel region."""

    def hook(module: nn.Module, args: tuple, out: Tensor) -> Tensor:
        if sp:
            return gather_from_sequence_parallel(out, tp, "tp_vocab")
        return copy_to_tp(out, tp, "tp_vocab")

    return hook


def apply_tp(rt: Any) -> None:
    """Tensor (and, with ``plan.sp``, sequence) parallelism on ``rt.model`` (a ``train.Runtime``).

    Swaps the blocks' linears for column/row-parallel ones, the embedding and head for vocabulary-parallel
    ones, sets ``rt.loss`` (vocab-parallel cross-entropy), ``rt.gather_full`` and ``rt.finalize_grads``;
    state in ``rt.extras["tp"]`` (:class:`TensorParallelState`).
    """
    model, plan, grid = rt.model, rt.plan, rt.grid
    spec: ModelSpec = model.spec
    check_tp(spec, plan)
    t, r, sp = plan.tp, grid.tp_rank, plan.sp
    tp = TPGroup(rt.tracer, t, r)
    state = TensorParallelState(tp, grid.groups["tp"], sp)
    if t > spec.kv_heads:                    # every rank creates every kv-sharing group, in the same order
        share = t // spec.kv_heads
        for ranks in all_groups(plan, "tp"):
            for k in range(spec.kv_heads):
                members = ranks[k * share:(k + 1) * share]
                pg = dist.new_group(members)
                if grid.rank in members:
                    state.kv_group = pg

    reduce = ((lambda y: reduce_scatter_to_sequence_parallel(y, tp, "tp")) if sp
              else (lambda y: reduce_from_tp(y, tp, "tp")))
    kv_rows = (_split(spec.kv_dim, t, r) if t <= spec.kv_heads else
               (r // (t // spec.kv_heads) * spec.head_dim, (r // (t // spec.kv_heads) + 1) * spec.head_dim))
    kv_distinct = None if t <= spec.kv_heads else list(range(0, t, t // spec.kv_heads))
    for i, blk in model.blocks.items():
        pre = f"blocks.{i}."
        attn, mlp = blk.attn, blk.mlp
        column = {"attn.wq": _split(spec.heads * spec.head_dim, t, r), "attn.wk": kv_rows, "attn.wv": kv_rows}
        column.update({f"mlp.{n}": _split(spec.ffn, t, r) for n in ("fc", "gate", "up") if hasattr(mlp, n)})
        row = {"attn.wo": _split(spec.heads * spec.head_dim, t, r)}
        row.update({f"mlp.{n}": _split(spec.ffn, t, r) for n in ("proj", "down") if hasattr(mlp, n)})
        for path, (a, b) in column.items():
            owner, leaf = (attn if path.startswith("attn") else mlp), path.split(".")[1]
            setattr(owner, leaf, ColumnParallelLinear(getattr(owner, leaf), a, b))
            distinct = kv_distinct if leaf in ("wk", "wv") else None
            state.layout[pre + path + ".weight"] = _Layout(0, distinct)
            if getattr(owner, leaf).bias is not None:
                state.layout[pre + path + ".bias"] = _Layout(0, distinct)
            if distinct is not None:
                state.kv_shared += [pre + path + ".weight"] + (
                    [pre + path + ".bias"] if getattr(owner, leaf).bias is not None else [])
        for path, (a, b) in row.items():
            owner, leaf = (attn if path.startswith("attn") else mlp), path.split(".")[1]
            setattr(owner, leaf, RowParallelLinear(getattr(owner, leaf), a, b, reduce))
            state.layout[pre + path + ".weight"] = _Layout(1)
        attn.register_forward_pre_hook(_region_entry(tp, sp))
        mlp.register_forward_pre_hook(_region_entry(tp, sp))

    v0, v1 = _split(spec.vocab, t, r)
    model.tok_emb = VocabParallelEmbedding(model.tok_emb, v0, v1, tp, sp)
    state.layout["tok_emb.weight"] = _Layout(0)
    if model.lm_head is not None:
        model.lm_head = ColumnParallelLinear(model.lm_head, v0, v1)     # this rank's logit columns
        state.layout["lm_head.weight"] = _Layout(0)
    model.final_norm.register_forward_hook(_head_entry(tp, sp))
    if sp and model.pos_emb is not None:
        model.pos_emb = SequenceParallelPositions(model.pos_emb, tp)

    if sp:   # every parameter TP leaves whole sees only this rank's tokens: partial gradients
        state.replicated = [n for n, _ in model.named_parameters() if n not in state.layout]
    rt.loss = lambda logits, batch: vocab_parallel_cross_entropy(logits, batch.targets, v0, tp)
    rt.gather_full.append(state.gather_full)
    if state.replicated or state.kv_shared:
        rt.finalize_grads.append(lambda: state.finalize_grads(rt.model))
    rt.extras["tp"] = state


__all__ = ["ColumnParallelLinear", "CopyToTP", "GatherFromSequenceParallel", "ReduceFromTP",
           "ReduceScatterToSequenceParallel", "RowParallelLinear", "SequenceParallelInput",
           "SequenceParallelPositions", "TPGroup", "TensorParallelState", "VocabParallelEmbedding",
           "apply_tp", "check_tp", "copy_to_tp", "gather_from_sequence_parallel", "reduce_from_tp",
           "reduce_scatter_to_sequence_parallel", "vocab_parallel_cross_entropy"]
