"""Mixed precision for DDP and ZeRO-1/2, with TP, PP and CP: bf16 compute, fp32 master weights and optimizer.

Micikevicius et al. 2018, "Mixed Precision Training"; Rajbhandari et al. 2020, "ZeRO", Sec. 3.1. Bytes per
parameter (``ledger.state_bytes``, ``g`` ranks in the gradient group)::

    DDP  2 + 2 + 12      ZeRO-1  2 + 2 + 12 / g      ZeRO-2  2 + (2 + 12) / g

bf16 parameters and gradients (communicated in bf16), an fp32 master copy that the AdamW update goes to
(a bf16 weight would round most of an update away), fp32 Adam moments, an fp32 loss. One step: backward in
bf16; gradients all-reduced (DDP, ZeRO-1) or reduce-scattered (ZeRO-2); ``master.grad = grad.float()``;
AdamW on the master; the bf16 parameters re-rounded (ZeRO: gathered) from it. With TP, PP and CP every
message travels in bf16. :class:`MasterAdamW` is DDP's optimizer; ``zero/zero.py`` keeps one fp32 master
shard per unit. The dtype table and why each tensor has its dtype: docs/mixed_precision.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from parallel_lab.errors import ParallelLabError
from parallel_lab.specs import ModelSpec, Plan

#: Optimizers run with bf16 parameters and gradients and an fp32 master copy (the ZeRO paper's layout).
MIXED_OPTIMIZERS = ("adam-mixed",)
COMPUTE_DTYPE = torch.bfloat16


def is_mixed(plan: Plan) -> bool:
    """Whether ``plan`` trains with bf16 parameters and an fp32 master copy (``optimizer="adam-mixed"``)."""
    return plan.optimizer in MIXED_OPTIMIZERS


def check_mixed(spec: ModelSpec | None, plan: Plan) -> None:
    """Mixed-precision plans this code cannot run, with the fix (called by ``train.check_runnable``)."""
    if plan.optimizer == "adam-mixed-fp32-grad":
        raise ParallelLabError("optimizer='adam-mixed-fp32-grad' (an fp32 gradient-accumulation buffer beside "
                               "the bf16 gradients, 20 B/param) is not runnable here; use adam-mixed (bf16 "
                               "gradients accumulate in bf16) or adam-fp32")
    if not is_mixed(plan):
        return
    if plan.dtype != "bf16":
        raise ParallelLabError(f"optimizer={plan.optimizer!r} keeps bf16 parameters and computes in bf16; "
                               f"use --dtype bf16 (dtype={plan.dtype!r} given), or optimizer='adam-fp32'")
    if plan.zero == 3:
        raise ParallelLabError("optimizer='adam-mixed' with zero=3 is not runnable; ZeRO-3's mixed "
                               "precision is optimizer='fsdp2-mixed' (FSDP2 style), or use zero in {0, 1, 2}")


def to_compute_dtype(model: nn.Module, plan: Plan) -> nn.Module:
    """Cast ``model``'s parameters to bf16 for a mixed-precision plan (in place; the same Parameter objects)."""
    return model.to(COMPUTE_DTYPE) if is_mixed(plan) else model


class MasterAdamW:
    """AdamW on fp32 master copies of (bf16) parameters; after each step the parameters are refreshed
    from their masters (rounded to the parameters' dtype).

    The arithmetic on the masters is ``torch.optim.AdamW``'s (``hyper``), so on fp32 parameters this is
    AdamW exactly. ``state[p]`` lists the master and the moments: 4 + 4 + 4 bytes per element, what
    ``instruments.measure_state`` counts as optimizer states.
    """

    def __init__(self, params: Iterable[Tensor], **hyper: Any):
        self.params = [p for p in params if p.requires_grad]
        self.masters = [p.detach().float().clone() for p in self.params]
        self.inner = torch.optim.AdamW(self.masters, foreach=False, **hyper)

    @property
    def state(self) -> dict[Tensor, dict[str, Tensor]]:
        return {p: {"master": m, **self.inner.state.get(m, {})} for p, m in zip(self.params, self.masters,
                                                                                  strict=True)}

    @torch.no_grad()
    def step(self) -> None:
        for p, m in zip(self.params, self.masters, strict=True):
            m.grad = None if p.grad is None else p.grad.float()      # transient fp32 copy of the gradient
        self.inner.step()
        for p, m in zip(self.params, self.masters, strict=True):
            p.copy_(m)                                                # round to bf16
            m.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def master_of(self) -> dict[int, Tensor]:
        """``id(parameter) -> fp32 master``."""
        return {id(p): m for p, m in zip(self.params, self.masters, strict=True)}
