"""Expert parallelism: each rank of the ``ep`` group holds ``E / ep`` experts; tokens travel to them and back.

The mixture-of-experts block (``moe.py``) builds a dispatched buffer ``(E, b C, h)``: expert ``e``'s ``b C``
capacity slots of this rank's micro-batch. With ``ep`` ranks, rows of experts ``[j E/ep, (j+1) E/ep)`` belong
to rank ``j``, so one ``all_to_all_single`` with equal splits sends every rank's slots to the experts' owners
(GShard, Lepikhin et al. 2021; "dispatch"), the local experts run on ``ep b C`` slots each, and a second
all-to-all returns the outputs ("combine"). An equal-split all-to-all is its own transpose, so backward is
the same two calls with the gradients, in reverse. Per MoE block and micro-batch, four calls of this rank's
buffer, ``E b C h d`` bytes each (``comm.ep_dispatch_bytes``; ``E C ~ capacity_factor * top_k * s``).

Where ``ep`` sits (``mesh``): it borrows from data parallelism. Data-parallel coordinate ``d`` has expert rank
``d % ep``; the dense parameters are averaged over all ``dp`` ranks as usual (DDP leaves the experts alone:
``_ddp_params_and_buffers_to_ignore``); an expert's gradient, which already sums the tokens of its ep
group, is summed over the ``dp / ep`` ranks that hold it (the ``edp`` group, one all-reduce per tensor) and
divided by ``dp``. The model's code is unchanged: :func:`apply_ep` deletes the
experts a rank does not hold and replaces the one seam ``moe.expert_layer``. Collectives:
``ep_communications.py``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from parallel_lab import mesh, sharding
from parallel_lab.distributed.expert_parallel.ep_communications import AllToAll, all_reduce_expert_grad
from parallel_lab.distributed.model.moe import MoE, moe_layers, set_aux_grad_scale, token_counts
from parallel_lab.distributed.runtime.runtime import Runtime
from parallel_lab.errors import ParallelLabError
from parallel_lab.sharding import is_expert_param
from parallel_lab.specs import ModelSpec, Plan


class ExpertParallel:
    """``moe.expert_layer`` for expert rank ``ep_rank`` of ``ep``: dispatch, the local experts, combine."""

    def __init__(self, moe: MoE, ep: int, ep_rank: int, group: Any):
        self.moe, self.ep, self.group = moe, ep, group
        self.local = list(sharding.local_experts(moe.n_experts, ep, ep_rank))

    def __call__(self, buf: Tensor) -> Tensor:
        n_exp, n, h = buf.shape                                                   # (E, b C, h)
        ep, n_local = self.ep, len(self.local)
        recv = AllToAll.apply(buf.reshape(n_exp * n, h), self.group)      # chunk j: rank j's slots
        x = recv.view(ep, n_local, n, h).transpose(0, 1).reshape(n_local, ep * n, h)   # (E/ep, ep b C, h)
        y = torch.stack([self.moe.experts[str(e)](x[i]) for i, e in enumerate(self.local)])
        back = y.view(n_local, ep, n, h).transpose(0, 1).reshape(ep * n_local * n, h)  # chunk j: to rank j
        return AllToAll.apply(back, self.group).view(n_exp, n, h)


def check_ep(spec: ModelSpec, plan: Plan) -> None:
    """Plans the runnable expert parallelism cannot execute (before any process starts)."""
    if not spec.is_moe:
        return
    if plan.dtype != "fp32":
        raise ParallelLabError(f"dtype={plan.dtype!r} with a mixture-of-experts model: the runnable MoE computes "
                               "in fp32; use --dtype fp32")
    if plan.mlp != "eager":
        raise ParallelLabError(f"mlp={plan.mlp!r} is not implemented for mixture-of-experts blocks; use mlp='eager'")
    if plan.recompute != "none":
        raise ParallelLabError(f"recompute={plan.recompute!r} with a mixture-of-experts model: recomputing a block "
                               "would route again and count its tokens twice; use recompute='none'")
    if plan.pp > 1 and plan.schedule not in ("gpipe", "1f1b", "interleaved"):
        raise ParallelLabError(f"schedule={plan.schedule!r} splits backward into B and W, which the all-to-all's "
                               "backward does not follow; use gpipe, 1f1b or interleaved with experts")


def apply_ep(rt: Runtime) -> None:
    """Every MoE model: the aux loss's gradient weight ``1 / m`` and the token counts report. With ``ep > 1``:
    keep this rank's experts, route through :class:`ExpertParallel`, leave the experts out of DDP and average
    their gradients over the ``edp`` group (module docstring)."""
    plan, grid = rt.plan, rt.grid
    set_aux_grad_scale(rt.model, 1.0 / plan.microbatches)
    rt.extras.setdefault("reports", {})["moe"] = lambda: token_counts(rt.model)
    if plan.ep == 1:
        return
    ep_rank = mesh.ep_coords(plan, grid.rank)["ep"]
    for moe in moe_layers(rt.model).values():
        keep = set(sharding.local_experts(moe.n_experts, plan.ep, ep_rank))
        for e in range(moe.n_experts):
            if e not in keep:
                del moe.experts[str(e)]
        moe.expert_layer = ExpertParallel(moe, plan.ep, ep_rank, grid.groups["ep"])
    rt.model._ddp_params_and_buffers_to_ignore = [n for n, _ in rt.model.named_parameters() if is_expert_param(n)]
    edp = grid.groups["edp"] if grid.size("edp") > 1 else None
    rt.finalize_grads.append(lambda: _average_expert_grads(rt.model, edp, plan.dp))
    rt.param_owner = rt.param_owner or (grid.dp_rank < plan.ep and grid.cp_rank == 0 and grid.tp_rank == 0)


def _average_expert_grads(model: nn.Module, edp: Any, dp: int) -> None:
    """The gradient of the global mean loss for each local expert tensor (reverse registration order).

    An expert's gradient on its owner already sums the contributions of the tokens of every rank of its ep
    group (their gradients came back through the all-to-all); summing over the ``edp`` group (when it has more
    than one rank) adds the other ep groups', and dividing by ``dp`` turns the sum of the ``dp`` local mean
    losses into the global mean, as DDP's average does for the dense parameters."""
    for name, p in reversed(list(model.named_parameters())):
        if not (is_expert_param(name) and p.requires_grad):
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if edp is not None:
            all_reduce_expert_grad(p.grad, edp)
        p.grad.div_(dp)


def moe_report(spec: ModelSpec, plan: Plan, results: list[Any]) -> dict[str, Any]:
    """Tokens per expert and per expert rank, measured over a run (``RankResult.info["moe"]`` of every rank).

    ``routed[e]``: top-k choices that picked expert ``e`` (all blocks, ranks and steps); ``kept[e]``: those
    within capacity; ``per_ep_rank[j]``: kept tokens the experts of expert rank ``j`` computed (what that rank
    works on; the busiest sets the pace); ``imbalance``: ``max / mean`` of ``routed`` (1.0 is perfect
    balance); ``dropped``: the fraction of choices over capacity; ``aux_loss``: mean of the blocks' aux losses.
    """
    routed, kept = [0] * spec.experts, [0] * spec.experts
    aux, forwards = 0.0, 0
    for r in results:
        for counts in r.info.get("moe", {}).values():
            routed = [a + b for a, b in zip(routed, counts["routed"], strict=True)]
            kept = [a + b for a, b in zip(kept, counts["kept"], strict=True)]
            aux += counts["aux"]
            forwards += counts["forwards"]
    per_rank = [sum(kept[e] for e in sharding.local_experts(spec.experts, plan.ep, j)) for j in range(plan.ep)]
    mean = sum(routed) / spec.experts
    return {"routed": routed, "kept": kept, "per_ep_rank": per_rank,
            "imbalance": max(routed) / mean if mean else 1.0,
            "dropped": 1 - sum(kept) / sum(routed) if sum(routed) else 0.0,
            "aux_loss": aux / forwards if forwards else 0.0}


def format_moe_report(rep: dict[str, Any]) -> str:
    """The report's lines: tokens per expert (routed and kept), per expert rank, imbalance, drops, aux loss."""
    lines = ["tokens per expert (all blocks, ranks and steps)", "expert    routed      kept"]
    lines += [f"{e:>6} {a:>9,} {b:>9,}" for e, (a, b) in enumerate(zip(rep["routed"], rep["kept"], strict=True))]
    lines.append("tokens per expert rank: " + ", ".join(f"{j}: {n:,}" for j, n in enumerate(rep["per_ep_rank"])))
    lines.append(f"imbalance (max / mean routed) {rep['imbalance']:.3f}; dropped over capacity "
                 f"{rep['dropped']:.2%}; aux loss {rep['aux_loss']:.5f}")
    return "\n".join(lines)
