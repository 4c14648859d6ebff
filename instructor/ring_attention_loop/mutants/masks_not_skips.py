"""Mutant: computes a fully masked block for every chunk in the queries' future instead of skipping it: right values,
world blocks on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from parallel_lab.grading.micro import block_attention


def merge(o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    top = torch.maximum(lse_a, lse_b)
    safe = top.masked_fill(top == float("-inf"), 0.0)
    wa, wb = torch.exp(lse_a - safe), torch.exp(lse_b - safe)
    total = wa + wb
    denom = total.masked_fill(total == 0, 1.0)[..., None]
    return (wa[..., None] * o_a + wb[..., None] * o_b) / denom, safe + torch.log(total)


def send_recv(t: Tensor, to: int, frm: int) -> Tensor:
    buf = torch.empty_like(t)
    works = [dist.isend(t.contiguous(), to), dist.irecv(buf, frm)]
    for w in works:
        w.wait()
    return buf


def ring_attention(q: Tensor, k: Tensor, v: Tensor, rank: int, world: int) -> Tensor:
    c = q.shape[1]
    o, lse = block_attention(q, k, v, torch.ones(c, c, dtype=torch.bool).tril())      # the diagonal chunk
    kv = torch.stack([k, v])
    for step in range(1, world):
        kv = send_recv(kv, (rank + 1) % world, (rank - 1) % world)
        src = (rank - step) % world                      # whose chunk arrived: it came from rank - 1
        if src < rank:
            o, lse = merge(o, lse, *block_attention(q, kv[0], kv[1]))
        else:                                            # the future: mask everything
            none = torch.zeros(q.shape[1], q.shape[1], dtype=torch.bool)
            o, lse = merge(o, lse, *block_attention(q, kv[0], kv[1], none))
    return o
