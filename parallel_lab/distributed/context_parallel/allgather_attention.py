"""All-gather context parallelism (Llama 3, Dubey et al. 2024, Sec. 3.3.2).

Every rank all-gathers K and V of all ranks (small with grouped-query attention: ``2 s kv_heads d`` per
rank), attends its own block while the others arrive, then the local queries to all of them, merged
with the online softmax (``blockwise_attention.OnlineSoftmax``); backward reduce-scatters dK and dV.
Llama 3 chose this form because any mask (document masks) is easy in it. Saved: the local Q, the
gathered K and V, the output and the fp32 log-sum-exp. Derivation: docs/context_parallel.md.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from parallel_lab.distributed import probe
from parallel_lab.distributed.context_parallel import cp_communications as comm
from parallel_lab.distributed.context_parallel.blockwise_attention import (
    OnlineSoftmax,
    attend_backward,
    attend_forward,
    group_queries,
    ungroup,
)
from parallel_lab.distributed.context_parallel.ring_attention import CPGroup, SeqView, backward_inputs, finish_forward


class AllGatherAttention(torch.autograd.Function):
    """All-gather context parallelism (Llama 3); inputs as :class:`RingAttention`."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, grp: CPGroup, seq: SeqView,
                causal: bool) -> Tensor:
        b, h, s, d = q.shape
        g, n = k.shape[1], grp.size
        qg = group_queries(q, g, 1.0 / math.sqrt(d))
        kv_local = torch.stack([k, v])
        gathered = torch.empty((n, *kv_local.shape), dtype=kv_local.dtype, device=kv_local.device)
        probe.sample("cp", [kv_local])          # the input; the gathered K, V are saved (activations)
        work = comm.all_gather(gathered.flatten(0, 1), kv_local, grp.group)
        if not grp.overlap:
            grp.wait([work], "forward")
        state = OnlineSoftmax(b, g, s, h // g, d, q.device)
        with grp.timed("forward"):                                 # my own block while the others arrive
            attend_forward(state, qg, kv_local[0], kv_local[1], seq.local, seq.blocks[grp.index], causal,
                           grp.stats.kernel)
        grp.wait([work], "forward")
        with grp.timed("forward"):
            for j in range(n):
                if j != grp.index:
                    attend_forward(state, qg, gathered[j, 0], gathered[j, 1], seq.local, seq.blocks[j],
                                   causal, grp.stats.kernel)
        return finish_forward(ctx, state, q.dtype, qg, gathered, grp, seq, causal)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        grp, seq, causal = ctx.grp, ctx.seq, ctx.causal
        qg, gathered, lse, dog, delta, dqg = backward_inputs(ctx, dout)
        dkv_all = torch.zeros(gathered.shape, dtype=torch.float32, device=gathered.device)
        with grp.timed("backward"):
            for j in range(grp.size):
                attend_backward(qg, gathered[j, 0], gathered[j, 1], dog, lse, delta, seq.local, seq.blocks[j],
                                causal, dqg, dkv_all[j, 0], dkv_all[j, 1])
        dkv_all = dkv_all.to(gathered.dtype)
        dkv = torch.empty(gathered.shape[1:], dtype=gathered.dtype, device=gathered.device)
        probe.sample("cp", [dkv_all, dkv])      # every rank's dK, dV and this rank's sum
        work = comm.reduce_scatter(dkv, dkv_all.flatten(0, 1), grp.group)
        dq = ungroup(dqg * (1.0 / math.sqrt(qg.shape[-1]))).to(qg.dtype)     # while dK, dV are reduced
        grp.wait([work], "backward")
        return dq, dkv[0].to(gathered.dtype), dkv[1].to(gathered.dtype), None, None, None
