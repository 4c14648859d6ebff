"""Tensor parallelism applied to the model: the surgery and its parameter bookkeeping.

:func:`apply_tp` swaps every block's linears for the column/row-parallel layers of ``tensor_parallel.py``
(Megatron-LM, Shoeybi et al. 2019), cutting each rank's rows ``A_r`` or columns ``B_r`` from the full
weights by the one TP rule, ``sharding.tp_slice``; the embedding and head become vocabulary-parallel
(``vocab_parallel.py``). :class:`TensorParallelState` remembers each sharded parameter's cut (to gather
full tensors for comparisons) and completes the gradients TP leaves partial: with SP (Korthikanti et al.
2022) the replicated parameters' (one all-reduce over TP per step); with grouped-query attention and
``t > kv_heads`` the kv weights', all-reduced among the ``t / kv_heads`` ranks sharing a head.
Derivation: docs/tensor_parallel.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from parallel_lab import sharding
from parallel_lab.distributed.runtime.grid import all_groups
from parallel_lab.distributed.runtime.runtime import Runtime
from parallel_lab.distributed.tensor_parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    head_entry,
    region_entry,
    row_reduce,
)
from parallel_lab.distributed.tensor_parallel.tp_communications import TPGroup
from parallel_lab.distributed.tensor_parallel.vocab_parallel import (
    SequenceParallelPositions,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from parallel_lab.errors import ParallelLabError, divisors
from parallel_lab.specs import ModelSpec, Plan


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

    reduce = row_reduce(tp, sp)
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
        attn.register_forward_pre_hook(region_entry(tp, sp))
        mlp.register_forward_pre_hook(region_entry(tp, sp))

    v0, v1 = sharding.tp_slice(spec, "tok_emb.weight", tuple(model.tok_emb.weight.shape), t, r).box[0]
    model.tok_emb = VocabParallelEmbedding(model.tok_emb, v0, v1, tp, sp)
    state.layout["tok_emb.weight"] = _Layout(0)
    if model.lm_head is not None:
        model.lm_head = ColumnParallelLinear(model.lm_head, v0, v1)     # this rank's logit columns
        state.layout["lm_head.weight"] = _Layout(0)
    model.final_norm.register_forward_hook(head_entry(tp, sp))
    if sp and model.pos_emb is not None:
        model.pos_emb = SequenceParallelPositions(model.pos_emb, tp)

    if sp:   # every parameter TP leaves whole sees only this rank's tokens: partial gradients
        state.replicated = [n for n, _ in model.named_parameters() if n not in state.layout]
    rt.loss = lambda logits, batch: vocab_parallel_cross_entropy(logits, batch.targets, v0, tp)
    rt.gather_full.append(state.gather_full)
    if state.replicated or state.kv_shared:
        rt.finalize_grads.append(lambda: state.finalize_grads(rt.model, rt.dp))
    rt.extras["tp"] = state


__all__ = ["TensorParallelState", "apply_tp", "check_tp"]
