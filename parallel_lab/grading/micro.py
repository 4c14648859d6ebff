"""The small shapes the exercises' tests train on CPU ranks, and the one-process references they compare with.

``MICRO`` (llama flavour, 2 blocks, h=32, 4 heads / 2 kv heads, ffn 64, vocab 64) trains a step in a few
milliseconds, so a hidden test can run it on 2 or 4 ranks and against one process within its time limit.
The plans are fp32 (``adam-fp32``): gradients and messages are 4 bytes per element.
"""

from __future__ import annotations

from parallel_lab.specs import ModelSpec, Plan

MICRO = ModelSpec(layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64, flavour="llama", name="micro")
SEQ = 16


def micro_plan(**kw: object) -> Plan:
    """An fp32 plan of ``MICRO`` at ``SEQ`` tokens, 2 sequences per micro-batch, with ``kw`` changed."""
    base = {"seq": SEQ, "micro_batch": 2, "optimizer": "adam-fp32", "dtype": "fp32"}
    return Plan(**{**base, **kw})


# The tensor-parallel MLP case (exercise tp_mlp): a GPT MLP y = gelu(x A^T) B^T, loss sum(y^2).
MLP_H, MLP_FFN, MLP_B, MLP_S = 32, 64, 2, 16


def mlp_case() -> tuple:
    """Seeded ``(A (ffn, h), B (h, ffn), x (b, s, h))``."""
    import torch

    g = torch.Generator().manual_seed(0)
    return (torch.randn(MLP_FFN, MLP_H, generator=g) * 0.2, torch.randn(MLP_H, MLP_FFN, generator=g) * 0.2,
            torch.randn(MLP_B, MLP_S, MLP_H, generator=g))


def mlp_reference() -> tuple:
    """One process: ``(y, dL/dx, dL/dA, dL/dB)`` for ``L = sum(y^2)``."""
    import torch.nn.functional as F

    A, Bw, x = (t.clone().requires_grad_(True) for t in mlp_case())
    y = F.gelu(x @ A.T) @ Bw.T
    (y * y).sum().backward()
    return y.detach(), x.grad, A.grad, Bw.grad


def rel_err(a: object, b: object) -> float:
    """``max |a - b| / max |b|`` (tensors)."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# Attention blocks (exercise online_softmax): q (b, s, d), k and v (b, t, d); scores scaled by 1/sqrt(d).

def block_attention(q: object, k: object, v: object, mask: object = None) -> tuple:
    """Attention of ``q`` over one block of keys: ``(o, lse)``, ``o = softmax(S) v`` (b, s, d) normalised within
    the block, ``lse = logsumexp(S)`` (b, s); ``mask`` (s, t) True where allowed. A query that sees nothing
    in the block gets ``o = 0`` and ``lse = -inf``."""
    import math

    import torch

    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])           # (b, s, t)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, -1)                                      # (b, s)
    p = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])
    return p @ v, lse


def full_attention(q: object, k: object, v: object, mask: object = None) -> object:
    """One process: ``softmax(q k^T / sqrt(d)) v`` over all keys (the reference)."""
    import math

    import torch

    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, -1) @ v


def measured_rank(grid: object, plan: object, spec: object = None) -> dict:
    """One training step of ``plan`` on this rank through the library (``train_rank``): the measured state
    and activation bytes and the traced calls ``(dim, kind, message_bytes, group_size)`` of this rank."""
    from parallel_lab.distributed.runtime.train import train_rank

    res = train_rank(grid, spec or MICRO, plan, steps=1, return_params=False)
    return {"memory": dict(res.memory), "calls": [(e.dim, e.kind, e.message_bytes, e.group_size) for e in res.events]}


def ring_wire_bytes(kind: str, message_bytes: int, group_size: int) -> float:
    """Bytes one rank sends for one call under the ring algorithms (the conventions' table)."""
    from parallel_lab.comm import Collective

    return Collective("dp", kind, message_bytes, group_size).wire_bytes_per_call

#: A GPT-flavoured MICRO (LayerNorm, GeLU MLP of 4h, learned positions, no dropout) for activation measurements.
MICRO_GPT = ModelSpec(layers=2, hidden=32, heads=4, ffn=128, vocab=64, flavour="gpt", max_positions=64, dropout=0.0,
                      name="micro-gpt")
