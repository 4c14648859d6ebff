"""Fused kernels on CPU: what real GPU kernels save for backward, so that every activation model is measured.

Each autograd function computes what the eager ops compute but keeps only what the fused GPU kernel keeps;
backward recomputes the rest:

* :class:`FlashAttention` (``attention="flash"``; Dao et al. 2022, Sec. 3.1): the blockwise online-softmax
  kernel of ``context_parallel/blockwise_attention.py``; saves q, k, v (unrepeated), the output and an fp32
  log-sum-exp ``(b, heads, s)``, so the score bytes per layer go from ``d a s^2 b`` to ``4 a s b``.
* :class:`SwiGLUDown` / :class:`GeluProj` (``mlp="fused"``): the activation and the second linear in one
  function keeping only the first linears' outputs (llama ``2 f`` per token instead of ``4 f``).
* :class:`ChunkedLinearCrossEntropy` (``loss_chunk > 0``): head and cross-entropy over token chunks; the
  ``s b V`` logits never exist at once.
* :func:`op_sac_context` (``recompute="op-sac"``): torchtitan's op-level selective checkpointing.

``parallel_lab.activations`` predicts the saved bytes; tests/distributed/test_kernels.py compares them
byte for byte with the saved-tensor meter. Details: docs/kernels.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from parallel_lab.distributed.context_parallel import blockwise_attention as blockwise

# --------------------------------------------------------------------------------------------------
# FlashAttention-style core
# --------------------------------------------------------------------------------------------------

class FlashAttention(torch.autograd.Function):
    """``q (b, H, s, d)``, ``k, v (b, Hkv, s, d)``, tokens ``toks``; returns ``(b, H, s, d)``."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, toks: blockwise.Tokens, causal: bool) -> Tensor:
        b, h, s, d = q.shape
        g = k.shape[1]
        qg = blockwise.group_queries(q, g, 1.0 / math.sqrt(d))              # (b, g, s, h/g, d), scratch
        state = blockwise.OnlineSoftmax(b, g, s, h // g, d, q.device)
        blockwise.attend_forward(state, qg, k, v, toks, toks, causal)
        acc, lse = state.finish()
        out = blockwise.ungroup(acc.to(q.dtype))                              # view of a (b, s, H, d) tensor
        ctx.save_for_backward(q, k, v, out, lse)                    # lse: (b, g, s, h/g) fp32
        ctx.toks, ctx.causal = toks, causal
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        d, g = q.shape[-1], k.shape[1]
        qg = blockwise.group_queries(q, g, 1.0 / math.sqrt(d))
        dog = blockwise.group_queries(dout, g, 1.0)
        delta = (dog.float() * blockwise.group_queries(out, g, 1.0).float()).sum(-1)
        dqg = torch.zeros_like(qg)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        blockwise.attend_backward(qg, k, v, dog, lse, delta, ctx.toks, ctx.toks, ctx.causal, dqg, dk, dv)
        dq = blockwise.ungroup(dqg * (1.0 / math.sqrt(d))).to(q.dtype)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None


class FlashCore(nn.Module):
    """Drop-in for ``model.DotProductAttention`` (same signature) that runs :class:`FlashAttention`."""

    def __init__(self, tile: int = blockwise.DEFAULT_TILE):
        super().__init__()
        self.tile = tile

    def forward(self, q: Tensor, k: Tensor, v: Tensor, ctx: Any) -> Tensor:
        key = ("flash_tokens", self.tile)
        if key not in ctx.cache:
            ctx.cache[key] = blockwise.Tokens.of(ctx.positions, ctx.doc_ids, self.tile)
        return FlashAttention.apply(q, k, v, ctx.cache[key], ctx.causal)

    def extra_repr(self) -> str:
        return f"tile={self.tile}"


# --------------------------------------------------------------------------------------------------
# Fused MLP: activation and second matmul, saving only the first matmuls' outputs
# --------------------------------------------------------------------------------------------------

class SwiGLUDown(torch.autograd.Function):
    """``(silu(a) * u) @ W^T`` for gate output ``a``, up output ``u`` (``(..., f)``), ``W (h, f)``."""

    @staticmethod
    def forward(ctx: Any, a: Tensor, u: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(a, u, weight)                          # weight: a parameter, not an activation
        return F.linear(F.silu(a) * u, weight)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        a, u, weight = ctx.saved_tensors
        sig = torch.sigmoid(a)
        silu = a * sig
        c = silu * u                                                  # recomputed down input (..., f)
        dw = dy.reshape(-1, dy.shape[-1]).t() @ c.reshape(-1, c.shape[-1])     # (h, f)
        dc = dy @ weight                                              # (..., f)
        da = dc * u * (sig * (1 + a * (1 - sig)))                     # d silu(a) / da = sig (1 + a (1 - sig))
        du = dc * silu
        return da, du, dw


class GeluProj(torch.autograd.Function):
    """``gelu_tanh(z) @ W^T`` for the fc output ``z (..., f)`` and ``W (h, f)``."""

    @staticmethod
    def forward(ctx: Any, z: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(z, weight)
        return F.linear(F.gelu(z, approximate="tanh"), weight)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, Tensor]:
        z, weight = ctx.saved_tensors
        with torch.enable_grad():                                     # gelu's own derivative, recomputed
            zz = z.detach().requires_grad_(True)
            act = F.gelu(zz, approximate="tanh")
        dw = dy.reshape(-1, dy.shape[-1]).t() @ act.detach().reshape(-1, act.shape[-1])
        (dz,) = torch.autograd.grad(act, zz, dy @ weight)
        return dz, dw


def fused_mlp(mlp: nn.Module, x: Tensor) -> Tensor:
    """The MLP of ``model.MLP`` with the fused second half. The second linear may be a plain ``nn.Linear``
    or tensor parallelism's row-parallel linear (its ``reduce`` sums the partial products over the group,
    and the replicated bias is added once after the sum, as in ``RowParallelLinear.forward``)."""
    second = mlp.down if mlp.swiglu else mlp.proj
    if mlp.swiglu:
        y = SwiGLUDown.apply(mlp.gate(x), mlp.up(x), second.weight)
    else:
        y = GeluProj.apply(mlp.fc(x), second.weight)
    reduce = getattr(second, "reduce", None)
    if reduce is not None:
        y = reduce(y)
    return y if second.bias is None else y + second.bias


# --------------------------------------------------------------------------------------------------
# Op-level selective activation checkpointing (torchtitan's policy)
# --------------------------------------------------------------------------------------------------

aten = torch.ops.aten

#: The ops whose outputs torchtitan's op-level policy keeps (matmuls, the fused attention kernels, the
#: reduce-scatter of sequence parallelism, ``max`` of float8 scaling); every other op is recomputed.
OP_SAC_SAVE = {
    aten.mm.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten.max.default,
}


def op_sac_context(meter: Any = None) -> tuple[Any, Any]:
    """The two dispatch modes of ``torch.utils.checkpoint`` for one checkpointed block (``context_fn``).

    Policy (torchtitan's ``op_sac``): keep the output of every op in :data:`OP_SAC_SAVE`, except every
    second ``aten.mm`` (counted per block forward: the 2nd, 4th, ... are recomputed), recompute the rest.
    A linear without bias is one ``aten.mm``; a linear with bias is ``aten.addmm``, which the list does not
    name. The kept outputs live in checkpoint's cache, not in autograd's saved tensors, so ``meter`` (a
    ``SavedTensorMeter``, optional) is told about each one and holds its charge as long as the cache lives.
    """
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    mm_count = [0]
    held: list[Any] = []

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func is aten.mm.default:
            mm_count[0] += 1
        save = func in OP_SAC_SAVE and not (func is aten.mm.default and mm_count[0] % 2 == 0)
        if save and meter is not None:
            out = ctx.op_output
            held.extend(meter.hold(t) for t in (out if isinstance(out, (tuple, list)) else (out,))
                        if isinstance(t, Tensor))
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    fwd, rec = create_selective_checkpoint_contexts(policy)
    fwd.storage[("parallel_lab: meter charges",)] = held      # released when checkpoint drops its cache
    return fwd, rec


# --------------------------------------------------------------------------------------------------
# Chunked cross-entropy fused with the LM head
# --------------------------------------------------------------------------------------------------

class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``h @ W^T`` against ``targets`` without ever holding all the logits.

    ``h (N, hidden)``, ``W (V, hidden)``, ``targets (N,)``. Forward runs ``chunk`` rows at a time: their
    fp32 logits, log-sum-exp and target logit, then drops the logits. Saved: ``h``, the targets and the
    fp32 log-sum-exp ``(N,)``: ``N (hidden d + 8 + 4)`` bytes instead of the eager ``N V (d + 4)``.
    Backward recomputes each chunk's logits: ``dlogits = (softmax - onehot) / N``, ``dh = dlogits W``,
    ``dW = dlogits^T h``.
    """

    @staticmethod
    def forward(ctx: Any, h: Tensor, weight: Tensor, targets: Tensor, chunk: int) -> Tensor:
        n = h.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=h.device)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for a in range(0, n, chunk):
            z = F.linear(h[a:a + chunk], weight).float()                  # (c, V): this chunk only
            lse[a:a + chunk] = torch.logsumexp(z, dim=-1)
            total += (lse[a:a + chunk] - z.gather(1, targets[a:a + chunk, None])[:, 0]).sum()
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.chunk = chunk
        return total / n

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None, None]:
        h, weight, targets, lse = ctx.saved_tensors
        n, chunk = h.shape[0], ctx.chunk
        dh = torch.empty_like(h)
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        scale = grad.float() / n
        for a in range(0, n, chunk):
            z = F.linear(h[a:a + chunk], weight).float()
            p = torch.exp(z - lse[a:a + chunk, None])                     # softmax, recomputed
            p.scatter_add_(1, targets[a:a + chunk, None], torch.full_like(p[:, :1], -1.0))
            p *= scale
            dh[a:a + chunk] = (p @ weight.float()).to(h.dtype)
            dw += p.t() @ h[a:a + chunk].float()
        return dh, dw.to(weight.dtype), None, None


@dataclass(frozen=True)
class HeadInput:
    """What the head hands the loss when the cross-entropy is chunked (``Plan.loss_chunk > 0``): the
    normed hidden states ``(b, s, hidden)`` and the LM head's weight, instead of ``(b, s, V)`` logits."""

    hidden: Tensor
    weight: Tensor
    chunk: int


def chunked_cross_entropy(x: HeadInput, targets: Tensor) -> Tensor:
    """Mean cross-entropy over every token, ``chunk`` tokens of logits at a time."""
    return ChunkedLinearCrossEntropy.apply(x.hidden.flatten(0, 1), x.weight, targets.flatten(), x.chunk)
