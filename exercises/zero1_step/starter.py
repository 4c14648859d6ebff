"""Exercise zero1_step (implement): the ZeRO-1 sharded optimizer step.

ZeRO stage 1 (Rajbhandari et al. 2020) keeps the optimizer states of only ``1/g`` of the parameters on
each of the ``g`` data-parallel ranks. Here one *unit* holds every trainable parameter (the conventions'
``zero_unit="root"``): concatenate them, in registration order, into one flat vector of ``n`` elements,
padded with zeros to ``g * S`` with ``S = ceil(n / g)``; rank ``r`` owns elements ``[r S, (r + 1) S)``.
One step, after the ranks' backward passes:

1. reduce-scatter the flat (padded) gradient (``dist.reduce_scatter_tensor``: rank ``r`` receives the sum
   of elements ``[r S, (r + 1) S)``) and divide by ``g``: its shard of the gradient of the global mean loss
   (the ZeRO paper's stage 1: ``Psi`` bytes, where torch's ZeroRedundancyOptimizer all-reduces, ``2 Psi``);
2. run AdamW on the owned shard only: an ``nn.Parameter`` of ``S`` elements, its ``.grad`` that averaged
   shard, ``torch.optim.AdamW([shard], foreach=False, **ADAMW)``;
3. all-gather the updated shards (``dist.all_gather_into_tensor``) and copy them back into the model.

Implement :class:`Zero1` (``self.optimizer`` must be the shard's AdamW: the grader measures its state).
Graded: after 2 steps the parameters equal one process's full-batch training within 1e-5; the calls equal
``parallel_lab.comm``'s ZeRO-1 prediction call by call (message bytes of the padded flat buffer); the
optimizer states equal ``parallel_lab.ledger``'s ZeRO-1 bytes exactly (``ceil(n/g) * 8`` bytes).
Check: ``parallel-lab grade zero1_step exercises/zero1_step/starter.py``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from parallel_lab.distributed.model.model import ADAMW


class Zero1:
    def __init__(self, model: nn.Module):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer: torch.optim.Optimizer | None = None
        # TODO: the owned shard (nn.Parameter of S elements, from the flat parameters) and its AdamW

    def step(self) -> None:
        # TODO: reduce-scatter + average the flat gradient, AdamW on the shard, all-gather, copy back
        raise NotImplementedError("step")


__all__ = ["ADAMW", "Zero1", "dist", "math", "torch"]
