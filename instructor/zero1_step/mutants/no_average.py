"""Mutant: sums the gradients over the ranks instead of averaging."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from parallel_lab.distributed.model.model import ADAMW


class Zero1:
    def __init__(self, model: nn.Module):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.g, self.rank = dist.get_world_size(), dist.get_rank()
        self.n = sum(p.numel() for p in self.params)
        self.S = math.ceil(self.n / self.g)
        flat = self._flat([p.detach() for p in self.params])
        self.shard = nn.Parameter(flat[self.rank * self.S:(self.rank + 1) * self.S].clone())
        self.optimizer = torch.optim.AdamW([self.shard], foreach=False, **ADAMW)

    def _flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.zeros(self.g * self.S)
        flat[:self.n] = torch.cat([t.reshape(-1) for t in tensors])
        return flat

    def step(self) -> None:
        grad = self._flat([p.grad for p in self.params])
        own = torch.empty(self.S)
        dist.reduce_scatter_tensor(own, grad)            # the paper's ZeRO-1: each rank gets its shard's sum
        self.shard.grad = own
        self.optimizer.step()
        full = torch.empty(self.g * self.S)
        dist.all_gather_into_tensor(full, self.shard.detach())
        off = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(full[off:off + p.numel()].view_as(p))
                off += p.numel()
