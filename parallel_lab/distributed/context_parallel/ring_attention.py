"""Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers"): queries stay, K/V travel.

At ring step ``t`` rank ``r`` computes with the K/V block of rank ``r - t`` while passing it on to ``r + 1``
(the next block's transfer overlaps the current block's kernel, ``blockwise_attention.attend_forward``).
The partial results merge exactly with the online softmax (Milakov & Gimelshein 2018; FlashAttention)::

    m' = max(m, rowmax(S)),  l' = l e^(m - m') + rowsum(e^(S - m')),
    acc' = acc e^(m - m') + e^(S - m') V,        out = acc / l,  lse = m + log l

Backward runs the ring again: K/V travel forward once more beside a dK/dV accumulator that reaches its
owner after ``cp - 1`` hops. Per layer and micro-batch: ``cp - 1`` K/V messages forward, ``cp - 1`` K/V plus
``cp - 1`` dK/dV backward (K and V as one ``(2, b, kv_heads, s, d)`` message; ``cp_communications.exchange``).
Saved: the local Q, K/V, the output and the fp32 log-sum-exp. Derivation: docs/context_parallel.md.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from parallel_lab.distributed import probe
from parallel_lab.distributed.context_parallel import cp_communications as comm
from parallel_lab.distributed.context_parallel.blockwise_attention import (
    OnlineSoftmax,
    Tokens,
    attend_backward,
    attend_forward,
    group_queries,
    ungroup,
)
from parallel_lab.distributed.context_parallel.cp_stats import OverlapStats, Timer


class CPGroup:
    """This rank's context-parallel group: its members (global ranks), its index, the process group.

    ``overlap=False`` waits for each transfer before computing (to measure what overlap saves).
    """

    def __init__(self, ranks: Sequence[int], index: int, group: Any = None, overlap: bool = True):
        self.ranks, self.index, self.group = list(ranks), index, group
        self.overlap = overlap
        self.stats = OverlapStats()

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def next(self) -> int:
        return self.ranks[(self.index + 1) % self.size]

    @property
    def prev(self) -> int:
        return self.ranks[(self.index - 1) % self.size]

    def exchange(self, send: Tensor, recv: Tensor) -> list[comm.Transfer]:
        """Send ``send`` to the next rank of the ring and receive ``recv`` from the previous one."""
        return comm.exchange(send, recv, self.next, self.prev, self.group)

    def wait(self, works: Sequence[comm.Transfer], phase: str) -> None:
        """Wait for the transfers (each once), timing the wait."""
        t0 = time.perf_counter()
        for w in works:
            w.wait()
        self.stats.wait_s[phase] += time.perf_counter() - t0

    def timed(self, phase: str) -> Timer:
        return Timer(self.stats.compute_s, phase)


@dataclass
class SeqView:
    """The tokens attention sees on one rank: its queries, each rank's block, and all of them in rank
    order (the order of an all-gather or all-to-all)."""

    local: Tokens
    blocks: list[Tokens]
    all: Tokens


def finish_forward(ctx: Any, state: OnlineSoftmax, dtype: torch.dtype, qg: Tensor, kv: Tensor, grp: CPGroup,
                   seq: SeqView, causal: bool) -> Tensor:
    """Close the online softmax: the output ``(b, H, s, d)`` in ``dtype``; save the grouped queries, the K/V
    the backward attends to again, the output and the fp32 log-sum-exp."""
    acc, lse = state.finish()
    out = ungroup(acc.to(dtype))
    ctx.save_for_backward(qg, kv, out, lse)
    ctx.grp, ctx.seq, ctx.causal = grp, seq, causal
    return out


def backward_inputs(ctx: Any, dout: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """What :func:`finish_forward` saved, ``qg, kv, lse``, with the grouped output gradient ``dog``,
    ``delta = rowsum(dO * O)`` and the zero accumulator ``dqg`` of the (grouped, scaled) query gradient."""
    qg, kv, out, lse = ctx.saved_tensors
    dog = group_queries(dout, qg.shape[1], 1.0)
    delta = (dog.float() * group_queries(out, qg.shape[1], 1.0).float()).sum(-1)
    return qg, kv, lse, dog, delta, torch.zeros_like(qg)


class RingAttention(torch.autograd.Function):
    """Ring attention; inputs ``q (b, H, s, d)``, ``k, v (b, Hkv, s, d)`` of the local tokens."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, grp: CPGroup, seq: SeqView,
                causal: bool) -> Tensor:
        b, h, s, d = q.shape
        g = k.shape[1]
        qg = group_queries(q, g, 1.0 / math.sqrt(d))
        kv_local = torch.stack([k, v])                             # (2, b, g, s, d): one message
        state = OnlineSoftmax(b, g, s, h // g, d, q.device)
        kv, n = kv_local, grp.size
        for t in range(n):
            src = (grp.index - t) % n
            works, nxt = [], None
            if t < n - 1:                                          # pass the block on while computing
                nxt = torch.empty_like(kv)
                probe.sample("cp", [None if kv is kv_local else kv, nxt])  # kv_local: saved
                works = grp.exchange(kv, nxt)
                if not grp.overlap:
                    grp.wait(works, "forward")
            with grp.timed("forward"):
                attend_forward(state, qg, kv[0], kv[1], seq.local, seq.blocks[src], causal, grp.stats.kernel)
            if nxt is not None:
                grp.wait(works, "forward")
                kv = nxt
        return finish_forward(ctx, state, q.dtype, qg, kv_local, grp, seq, causal)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        qg, kv_local, lse, dog, delta, dqg = backward_inputs(ctx, dout)
        grp, seq, causal = ctx.grp, ctx.seq, ctx.causal
        n = grp.size
        kv, own, acc_in, acc_works = kv_local, None, None, []
        for t in range(n):
            src = (grp.index - t) % n
            works, nxt = [], None
            if t < n - 1:                                          # K, V travel the ring again
                nxt = torch.empty_like(kv)
                probe.sample("cp", [None if kv is kv_local else kv, nxt, acc_in])
                works = grp.exchange(kv, nxt)
                if not grp.overlap:
                    grp.wait(works, "backward")
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            with grp.timed("backward"):
                attend_backward(qg, kv[0], kv[1], dog, lse, delta, seq.local, seq.blocks[src], causal,
                                dqg, dkv[0], dkv[1])
            if t == 0:
                own = dkv                                          # my block's own part stays home
            else:                                                  # block src's accumulator: add, hand on
                grp.wait(acc_works, "backward")                    # (from step 2 on it came from prev)
                acc_works = []                                     # done transfers still hold their tensors
                if acc_in is not None:
                    dkv += acc_in
                    acc_in = None
                # a precision choice: the accumulator travels in the compute dtype (half of fp32's bytes,
                # what comm counts), so in bf16 each hop rounds the partial sum; an fp32 accumulator on the
                # wire would be exact to fp32 and send twice the bytes
                dkv = dkv.to(kv.dtype)
                acc_in = torch.empty_like(dkv)                     # the last step receives my own block's
                probe.sample("cp", [None if kv is kv_local else kv, nxt, dkv, acc_in])
                acc_works = grp.exchange(dkv, acc_in)
                if not grp.overlap:
                    grp.wait(acc_works, "backward")
            if nxt is not None:
                grp.wait(works, "backward")
                kv = nxt
        grp.wait(acc_works, "backward")
        dkv = own if acc_in is None else own + acc_in
        dq = ungroup(dqg * (1.0 / math.sqrt(qg.shape[-1]))).to(qg.dtype)
        return dq, dkv[0].to(kv_local.dtype), dkv[1].to(kv_local.dtype), None, None, None
