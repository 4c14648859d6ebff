"""DeepSpeed-Ulysses context parallelism (Jacobs et al. 2023).

One all-to-all turns Q, K, V from sequence-sharded ``(b, H, s/cp, d)`` into head-sharded
``(b, H/cp, s, d)``; each rank runs ordinary attention over the whole sequence for its heads, and a second
all-to-all turns the output back (backward: the same two all-to-alls in reverse). ``cp`` must divide the
query heads; kv heads are repeated where it does not divide them (``sharding.kv_replication``), and their
gradients summed over the replicas. Derivation: docs/context_parallel.md.
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
)
from parallel_lab.distributed.context_parallel.ring_attention import CPGroup, SeqView
from parallel_lab.distributed.model.model import repeat_kv
from parallel_lab.sharding import kv_replication


def _by_destination(q: Tensor, k: Tensor, v: Tensor, n: int) -> Tensor:
    """The all-to-all's send buffer to head-sharded: destination ``j`` gets query heads ``j hq ..`` and
    key/value heads ``j hk ..`` of this rank's tokens; ``(b, h, s, d) -> (n, b, hq + 2 hk, s, d)``."""
    b, h, s, d = q.shape
    hq, hk = h // n, k.shape[1] // n
    send = torch.empty(n, b, hq + 2 * hk, s, d, dtype=q.dtype, device=q.device)
    send[:, :, :hq] = q.reshape(b, n, hq, s, d).transpose(0, 1)            # (b, h, s, d) -> (n, b, hq, s, d)
    send[:, :, hq:hq + hk] = k.reshape(b, n, hk, s, d).transpose(0, 1)
    send[:, :, hq + hk:] = v.reshape(b, n, hk, s, d).transpose(0, 1)
    return send


class UlyssesAttention(torch.autograd.Function):
    """DeepSpeed-Ulysses: all-to-all to head-sharded, attention over the whole sequence, all-to-all back."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, grp: CPGroup, seq: SeqView, causal: bool) -> Tensor:
        b, h, s, d = q.shape
        n = grp.size
        f = kv_replication(h, k.shape[1], n)                       # kv heads repeated until n divides them
        hq, hk = h // n, k.shape[1] * f // n
        send = _by_destination(q, repeat_kv(k, f), repeat_kv(v, f), n)      # (n, b, hq + 2 hk, s, d)
        recv = torch.empty_like(send)
        probe.sample("cp", [send, recv])
        grp.wait([comm.all_to_all(recv, send, grp.group)], "forward")
        del send
        S, r = n * s, hq // hk                       # recv[i]: my heads for rank i's tokens
        qg = torch.empty(b, hk, S, r, d, dtype=q.dtype, device=q.device)
        torch.mul(recv[:, :, :hq].reshape(n, b, hk, r, s, d).permute(1, 2, 0, 4, 3, 5),
                  1.0 / math.sqrt(d), out=qg.view(b, hk, n, s, r, d))
        kvh = recv[:, :, hq:].reshape(n, b, 2, hk, s, d).permute(2, 1, 3, 0, 4, 5).reshape(2, b, hk, S, d)
        del recv                                                   # qg and kvh are copies
        state = OnlineSoftmax(b, hk, S, r, d, q.device)
        with grp.timed("forward"):
            attend_forward(state, qg, kvh[0], kvh[1], seq.all, seq.all, causal, grp.stats.kernel)
        acc, lse = state.finish()
        out_h = acc.to(q.dtype)                                    # (b, hk, S, r, d)
        back = out_h.view(b, hk, n, s, r, d).permute(2, 0, 1, 4, 3, 5).reshape(n, b, hq, s, d)
        back = back.contiguous()
        got = torch.empty_like(back)                               # got[j]: head group j of my tokens
        probe.sample("cp", [back, got])
        grp.wait([comm.all_to_all(got, back, grp.group)], "forward")
        ctx.save_for_backward(qg, kvh, out_h, lse)
        ctx.grp, ctx.seq, ctx.causal, ctx.f = grp, seq, causal, f
        return got.transpose(0, 1).reshape(b, h, s, d)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        qg, kvh, out_h, lse = ctx.saved_tensors
        grp, seq, causal, f = ctx.grp, ctx.seq, ctx.causal, ctx.f
        b, hk, S, r, d = qg.shape
        n = grp.size
        s, hq = S // n, hk * r
        h = hq * n
        send = dout.reshape(b, n, hq, s, d).transpose(0, 1).contiguous()
        recv = torch.empty_like(send)
        probe.sample("cp", [send, recv])
        grp.wait([comm.all_to_all(recv, send, grp.group)], "backward")
        dog = recv.reshape(n, b, hk, r, s, d).permute(1, 2, 0, 4, 3, 5).reshape(b, hk, S, r, d)
        del send, recv                                             # dog is a copy
        delta = (dog.float() * out_h.float()).sum(-1)
        dqg = torch.zeros_like(qg)
        dkv = torch.zeros(kvh.shape, dtype=torch.float32, device=kvh.device)
        with grp.timed("backward"):
            attend_backward(qg, kvh[0], kvh[1], dog, lse, delta, seq.all, seq.all, causal, dqg, dkv[0],
                            dkv[1])
        back = torch.empty(n, b, hq + 2 * hk, s, d, dtype=qg.dtype, device=qg.device)
        back[:, :, :hq] = (dqg * (1.0 / math.sqrt(d))).view(b, hk, n, s, r, d).permute(2, 0, 1, 4, 3, 5) \
            .reshape(n, b, hq, s, d)
        back[:, :, hq:] = dkv.to(qg.dtype).view(2, b, hk, n, s, d).permute(3, 1, 0, 2, 4, 5) \
            .reshape(n, b, 2 * hk, s, d)
        got = torch.empty_like(back)                               # got[j]: head group j of my tokens
        probe.sample("cp", [back, got])
        grp.wait([comm.all_to_all(got, back, grp.group)], "backward")
        dq = got[:, :, :hq].transpose(0, 1).reshape(b, h, s, d)
        dk = got[:, :, hq:hq + hk].transpose(0, 1).reshape(b, n * hk, s, d)
        dv = got[:, :, hq + hk:].transpose(0, 1).reshape(b, n * hk, s, d)
        if f > 1:                                                  # sum over the replicas of a kv head
            dk = dk.view(b, -1, f, s, d).sum(2)
            dv = dv.view(b, -1, f, s, d).sum(2)
        return dq, dk, dv, None, None, None
