"""Mixed precision for DDP and ZeRO-1/2, with TP, PP and CP: bf16 compute, fp32 master weights and optimizer.

Micikevicius et al. 2018, "Mixed Precision Training"; Rajbhandari et al. 2020, "ZeRO", Sec. 3.1 (the
``2 + 2 + 12`` bytes per parameter of ``optimizer="adam-mixed"`` in the ledger). What lives in which
dtype, and why:

=====================  =====  ==================================================================
tensor                 dtype  why
=====================  =====  ==================================================================
parameters (2 B)       bf16   forward and backward run bf16 matmuls; every activation saved for
                              backward is bf16 too (``plan.dtype_bytes = 2`` in the per-op model)
gradients (2 B)        bf16   backward produces them in the parameters' dtype; they accumulate over
                              micro-batches in bf16 (``p.grad += ...``) and are all-reduced (DDP,
                              ZeRO-1) or reduce-scattered (ZeRO-2) in bf16: half of fp32's bytes
master weights (4 B)   fp32   an Adam update is about ``lr`` (3e-3 here, far less late in training);
                              added to a bf16 weight (8-bit mantissa, steps of ``2^-8 |w|``) most of it
                              would round away, so updates accumulate in an fp32 copy and the bf16
                              parameters are re-rounded from it after every step
Adam m and v (4 + 4)   fp32   moments of small gradients need the mantissa (``v`` is a running mean
                              of squares); they are the optimizer's, never communicated
the loss               fp32   ``model.loss_fn`` upcasts the logits before the softmax
=====================  =====  ==================================================================

bf16 has fp32's exponent range, so unlike fp16 no loss scaling is needed. Gradients accumulate in bf16
across micro-batches (``adam-mixed``: 2 B per gradient, as the ledger counts); the fp32 accumulation
buffer of ``adam-mixed-fp32-grad`` (20 B per parameter) is not implemented here.

One step, per rank (``g`` ranks in the gradient group)::

    forward, backward in bf16          -> bf16 p.grad (summed over the rank's micro-batches)
    DDP:    all_reduce(p.grad / g)     bf16, per parameter or per bucket
    ZeRO-1: all_reduce(flat grad / g)  bf16, per unit          ZeRO-2: reduce_scatter, bf16, per unit
    master.grad = grad.float()         the whole master (DDP) or the owned shard of it (ZeRO-1/2)
    AdamW on the fp32 master
    DDP:    p = master.to(bf16)        ZeRO-1/2: all_gather(shard.to(bf16)), per unit, into p

With TP, PP and CP nothing else changes: the model's parameters are bf16, so every activation, its
gradient, and every message between ranks (TP's all-reduces and sequence gathers, the vocabulary-parallel
loss's partial logits statistics, PP's hand-offs, CP's K/V blocks) travels in bf16, 2 bytes per element,
as ``comm.collectives`` predicts from ``plan.dtype_bytes``; the master copy is per local (TP-sharded,
stage-local) parameter. bf16 sums are not associative, so a run whose partial sums are split across ranks
(TP's row-parallel outputs, CP's attention blocks, four gradients summed by a ring) differs from the
one-process reference in the last bits; tests/distributed/test_fourd.py states the tolerance.

Bytes per parameter (``ledger.state_bytes``): DDP ``2 + 2 + 12``; ZeRO-1 ``2 + 2 + 12 / g``; ZeRO-2
``2 + (2 + 12) / g``. The master is created from the bf16 parameters (as Megatron-LM does), so the run
starts from the bf16-rounded initial weights. The fp32 gradient copy ``grad.float()`` lives only during
the step (a transient, like the other communication buffers).

:class:`MasterAdamW` is DDP's optimizer (``model.make_optimizer`` returns it for ``adam-mixed``);
``distributed/zero/zero.py`` keeps one fp32 master shard per unit itself. ``reference.reference_train(..., mixed=True)``
is the single-process reference with the same arithmetic.
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
