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
vocabulary is split too (``tp_vocab.py``). :func:`apply_tp` edits the reference model from the outside,
cutting shards from the full weights; every parameter keeps its name. Derivation: docs/tensor_parallel.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from parallel_lab import sharding
from parallel_lab.distributed.runtime.grid import all_groups
from parallel_lab.distributed.runtime.runtime import Runtime
from parallel_lab.distributed.tensor_parallel.tp_communications import (
    TPGroup,
    copy_to_tp,
    gather_from_sequence_parallel,
    reduce_from_tp,
    reduce_scatter_to_sequence_parallel,
)
from parallel_lab.distributed.tensor_parallel.vocab_parallel import (
    SequenceParallelPositions,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from parallel_lab.errors import ParallelLabError, divisors
from parallel_lab.specs import ModelSpec, Plan

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


# --------------------------------------------------------------------------------------------------
# Applying TP to the reference model
# --------------------------------------------------------------------------------------------------

def check_tp(spec: ModelSpec, plan: Plan) -> None:
    """What the runnable TP needs beyond ``Plan.validate``; a ParallelLabError naming the fix otherwise."""
    t = plan.tp
    sharding.check_tp(spec, t)              # heads, kv heads and ffn: the one rule of the analytic core
    if spec.vocab % t:
        raise ParallelLabError(f"tp={t} does not divide vocab={spec.vocab}: the runnable vocabulary-parallel "
                               f"embedding needs equal shards; pick tp in "
                               f"{{{', '.join(map(str, divisors(spec.vocab)))}}}")
    local_seq = plan.seq // plan.cp
    if plan.sp and local_seq % t:
        raise ParallelLabError(f"sequence parallelism splits the {local_seq} local tokens (seq/cp) over "
                               f"tp={t}; pick seq a multiple of {t * plan.cp}")


def _cut(spec: ModelSpec, name: str, full: nn.Module, t: int, r: int) -> tuple[int, int, int, list[int] | None]:
    """``(axis, start, stop, distinct)``: the rows (axis 0) or columns (axis 1) of the full weight ``name`` that
    rank ``r`` of ``t`` keeps (``sharding.tp_slice``), and, when ranks share one slice (a replicated kv head), the
    first holder of each distinct slice (``None`` when every rank's slice is its own)."""
    shape = tuple(full.weight.shape)
    cut = sharding.tp_slice(spec, name, shape, t, r)
    start, stop = cut.box[cut.axis]
    firsts = [q for q in range(t) if sharding.tp_slice(spec, name, shape, t, q).first]
    return cut.axis, start, stop, (None if len(firsts) == t else firsts)


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
    def finalize_grads(self, model: nn.Module, dp: Any = None) -> None:
        """SP: one all-reduce over TP of the flat gradients of the replicated parameters; GQA with
        ``tp > kv_heads``: one all-reduce of the kv weights' gradients over the ranks sharing a head.

        After ZeRO-2/3's reduce-scatter (``dp.stage >= 2``) only gradient shards are left: the same
        message, built from them (``units.complete_partial_grads``, as Megatron-LM does)."""
        params = dict(model.named_parameters())
        for names, group in ((self.replicated, None), (self.kv_shared, self.kv_group)):
            if getattr(dp, "stage", 0) >= 2:     # ZeRO-3 took the parameters out of the model: its units know
                dp.complete_partial_grads(names, lambda flat, g=group: self.tp.all_reduce(flat, "tp", group=g))
                continue
            ps = [params[n] for n in names if n in params and params[n].requires_grad]
            if not ps:
                continue
            for p in ps:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in ps])
            self.tp.all_reduce(flat, "tp", group=group)
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


def apply_tp(rt: Runtime) -> None:
    """Tensor (and, with ``plan.sp``, sequence) parallelism on ``rt.model``.

    Swaps the blocks' linears for column/row-parallel ones, the embedding and head for vocabulary-parallel
    ones, sets ``rt.loss`` (vocab-parallel cross-entropy), ``rt.gather_full`` and ``rt.finalize_grads``;
    state in ``rt.extras["tp"]`` (:class:`TensorParallelState`).
    """
    model, plan, grid = rt.model, rt.plan, rt.grid
    spec: ModelSpec = model.spec
    check_tp(spec, plan)
    t, r, sp = plan.tp, grid.tp_rank, plan.sp
    tp = TPGroup(grid.groups["tp"], t, r)
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
    for i, blk in model.blocks.items():
        pre = f"blocks.{i}."
        attn, mlp = blk.attn, blk.mlp
        paths = ["attn.wq", "attn.wk", "attn.wv"] + [f"mlp.{n}" for n in ("fc", "gate", "up") if hasattr(mlp, n)]
        paths += ["attn.wo"] + [f"mlp.{n}" for n in ("proj", "down") if hasattr(mlp, n)]
        for path in paths:
            owner, leaf = (attn if path.startswith("attn") else mlp), path.split(".")[1]
            full, name = getattr(owner, leaf), pre + path + ".weight"
            axis, a, b, distinct = _cut(spec, name, full, t, r)
            if axis == 1:                                                # row-parallel: input columns
                setattr(owner, leaf, RowParallelLinear(full, a, b, reduce))
                state.layout[name] = _Layout(1)
                continue
            setattr(owner, leaf, ColumnParallelLinear(full, a, b))      # column-parallel: output rows
            names = [name] + ([pre + path + ".bias"] if full.bias is not None else [])
            state.layout.update({n: _Layout(0, distinct) for n in names})
            if distinct is not None:
                state.kv_shared += names
        attn.register_forward_pre_hook(_region_entry(tp, sp))
        mlp.register_forward_pre_hook(_region_entry(tp, sp))

    v0, v1 = sharding.tp_slice(spec, "tok_emb.weight", tuple(model.tok_emb.weight.shape), t, r).box[0]
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
        rt.finalize_grads.append(lambda: state.finalize_grads(rt.model, rt.dp))
    rt.extras["tp"] = state


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "SequenceParallelInput", "TensorParallelState", "apply_tp",
           "check_tp"]
