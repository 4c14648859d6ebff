"""Reference solution of online_softmax."""

from __future__ import annotations

import torch
from torch import Tensor


def merge(o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    top = torch.maximum(lse_a, lse_b)
    safe = top.masked_fill(top == float("-inf"), 0.0)              # both empty: keep 0 and -inf
    wa, wb = torch.exp(lse_a - safe), torch.exp(lse_b - safe)
    total = wa + wb
    lse = safe + torch.log(total)
    denom = total.masked_fill(total == 0, 1.0)[..., None]
    return (wa[..., None] * o_a + wb[..., None] * o_b) / denom, lse
