"""What ZeRO's classes need beyond the algorithm to be used in a plain torch loop (docs/runs.md, "Using
the wrappers in your own loop"): gradient clipping over sharded gradients and state dicts.

Gradient clipping: with sharded gradients a rank holds only its shard, so ``torch.nn.utils.clip_grad_norm_``
on the model's parameters sees a wrong (ZeRO-1's reduce-scatter, ZeRO-2: no gradients; ZeRO-3: no
parameters) norm. :func:`clip_sharded_` is what FSDP1's ``clip_grad_norm_`` method does: the norm of the
owned shards, summed over the group (one all-reduce of one number), then every shard scaled by torch's
factor ``min(1, max_norm / (norm + 1e-6))``. State dicts: ZeRO-1/2's optimizer state is this rank's shards
(as FSDP's sharded optimizer state; torch's ``ZeroRedundancyOptimizer`` consolidates it on one rank
instead); ZeRO-3's model state is the full parameters under the plain module's names.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from parallel_lab.distributed.zero.zero_communications import all_reduce_op
from parallel_lab.errors import ParallelLabError


def clip_sharded_(owned: list[Tensor], scale: list[Tensor], max_norm: float, norm_type: float = 2.0,
                  group: Any = None) -> Tensor:
    """Clip as ``torch.nn.utils.clip_grad_norm_`` would the full gradients: ``owned`` are this rank's
    shards (each element of the full gradient on exactly one rank); ``scale`` the tensors multiplied by
    the clip factor. Returns the total norm (a 0-d tensor, the same on every rank)."""
    norm_type = float(norm_type)
    if not (norm_type > 0 and max_norm >= 0):
        raise ParallelLabError(f"clip_grad_norm_ needs max_norm >= 0 and norm_type > 0 (or inf), got "
                               f"max_norm={max_norm!r}, norm_type={norm_type!r}")
    dev = owned[0].device if owned else torch.device("cpu")
    if math.isinf(norm_type):
        local = torch.stack([g.detach().abs().max() for g in owned if g.numel()] or [torch.zeros((), device=dev)])
        total = local.max().float()
        all_reduce_op(total, dist.ReduceOp.MAX, group)
    else:
        total = sum((g.detach().float().abs().pow(norm_type).sum() for g in owned), torch.zeros((), device=dev))
        all_reduce_op(total, dist.ReduceOp.SUM, group)
        total = total.pow(1.0 / norm_type)
    factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for t in scale:
        t.detach().mul_(factor.to(t.dtype))
    return total


def check_layout(saved: dict[str, Any], mine: dict[str, Any], what: str) -> None:
    """A sharded state loads only on the rank, group size and units that saved it."""
    if saved != mine:
        raise ParallelLabError(f"{what}: this state dict was saved with layout {saved}, this rank's is {mine}; "
                               f"load it on the same rank with the same group size and units (a sharded "
                               f"state), or start the optimizer afresh")


def zero12_shard_state(opt: Any) -> dict[str, Any]:
    """ZeRO-1/2's state beyond its param groups: per unit this rank's shard optimizer state (and the fp32
    master shard with low-precision parameters), and the layout they belong to."""
    return {"shards": [o.state_dict() for o in opt.optimizers],
            "masters": [s.detach().clone() for s in opt.shards] if opt.mixed else [],
            "layout": opt.layout()}


def load_zero12_shard_state(opt: Any, state: dict[str, Any]) -> None:
    """The inverse of :func:`zero12_shard_state` (refused for another layout or a plain torch state)."""
    if "layout" not in state:
        raise ParallelLabError("Zero12.load_state_dict takes what Zero12.state_dict() returned (a sharded state "
                               "with 'layout' and 'shards'); a plain torch optimizer's state does not fit")
    check_layout(state["layout"], opt.layout(), "Zero12.load_state_dict")
    for o, s in zip(opt.optimizers, state["shards"], strict=True):
        o.load_state_dict(s)
    with torch.no_grad():
        for shard, m in zip(opt.shards, state["masters"], strict=False):
            shard.copy_(m)


def zero_shard_grads(shards: list[Tensor], set_to_none: bool = True) -> None:
    """``zero_grad`` of the gradient shards: dropped, or zeroed in place (``set_to_none=False``)."""
    for s in shards:
        if set_to_none or s.grad is None:
            s.grad = None
        else:
            s.grad.zero_()


def patch_model_zero_grad(zero: Any) -> None:
    """``model.zero_grad()`` of a ZeRO-3 model also drops the gradient shards (its parameters live there,
    as an FSDP2 module's ``zero_grad`` reaches its sharded parameters)."""
    model = zero.model

    def zero_grad(set_to_none: bool = True) -> None:
        nn.Module.zero_grad(model, set_to_none)
        zero_shard_grads(zero.shards, set_to_none)
    model.zero_grad = zero_grad


def zero3_state_dict(zero: Any) -> dict[str, Tensor]:
    """The model's state under the plain module's names (FSDP2's keys), sharded parameters gathered in full
    (FSDP1's full state dict); a collective: every rank of the group calls it."""
    out = dict(zero.model.state_dict())
    for name, t in zero._gather_shards().items():
        for alias in zero.aliases[name]:
            out[alias] = t
    return out


def zero3_load_state_dict(zero: Any, state: dict[str, Tensor], strict: bool = True) -> None:
    """Cut this rank's shards from the full parameters in ``state`` (what :func:`zero3_state_dict` gives);
    the rest (buffers, frozen parameters) loads into the model."""
    sharded = {a for names in zero.aliases.values() for a in names}
    missing = sorted(n for u in zero.units for n in u.names if n not in state)
    result = zero.model.load_state_dict({k: v for k, v in state.items() if k not in sharded}, strict=False)
    unexpected = result.unexpected_keys
    missing += [k for k in result.missing_keys if k not in sharded]
    if strict and (missing or unexpected):
        raise ParallelLabError(f"Zero3.load_state_dict: {len(missing)} missing keys {missing[:3]}, "
                               f"{len(unexpected)} unexpected keys {unexpected[:3]}; "
                               f"pass the model's full state dict (Zero3.state_dict()), or strict=False")
    with torch.no_grad():
        for u, shard in zip(zero.units, zero.shards, strict=True):
            if all(n in state for n in u.names):
                shard.copy_(u.owned([state[n] for n in u.names], torch.float32, shard.device))
