"""Mutant: subtracts the max without guarding -inf (a fully masked pair gives NaN)."""

from __future__ import annotations

import torch
from torch import Tensor


def merge(o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    top = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = wa + wb
    return (wa[..., None] * o_a + wb[..., None] * o_b) / total[..., None], top + torch.log(total)
