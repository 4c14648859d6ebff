"""The mixture-of-experts MLP of the tiny model: top-k router, experts as MLPs, capacity, shared expert, aux loss.

No parallel code: expert parallelism replaces the one seam ``moe.expert_layer`` (the dispatched buffer
``(E, b C, h)`` -> the experts' outputs). Per sequence of ``s`` tokens:

* router ``p = softmax(x W_r^T)`` in fp32 (Switch); top-k choices renormalised (Mixtral's gate);
* capacity ``C = min(s, ceil(capacity_factor * top_k * s / E))`` per expert, filled by first choices in
  token order, then second choices (GShard's priority); a choice that finds its expert full is dropped;
* ``y = sum_k gate_k * expert_{e_k}(x)`` (+ ``shared(x)`` with shared experts);
* load-balancing loss (Switch, Fedus et al. 2021, eq. 4): ``aux = coef * E * sum_e f_e P_e``, its gradient
  added in backward (:class:`AddAuxLossGrad`, as Megatron's ``MoEAuxLossAutoScaler``).

Tokens per expert accumulate in ``moe.counts`` for the reports. docs/moe.md derives the all-to-all bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from parallel_lab.specs import ModelSpec


class AddAuxLossGrad(torch.autograd.Function):
    """Forward: ``out`` unchanged. Backward: ``out``'s gradient, and ``scale`` as the gradient of ``aux``."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, aux: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


def route(probs: Tensor, top_k: int, capacity: int) -> tuple[Tensor, Tensor, Tensor]:
    """Top-k choices and their capacity slots. ``probs (b, s, E)`` -> ``gate_p (b, s, k)`` (probabilities of
    the choices), ``expert (b, s, k)`` int64, ``slot (b, s, k)`` int64: the choice's position in its expert's
    buffer of this sequence, ``-1`` when dropped (GShard's priority: choice 0 of every token first)."""
    b, s, n_exp = probs.shape
    gate_p, expert = probs.topk(top_k, dim=-1)                                  # (b, s, k)
    with torch.no_grad():
        by_choice = expert.transpose(1, 2).reshape(b, top_k * s)                # (b, k s): choice-major
        onehot = F.one_hot(by_choice, n_exp)                                   # (b, k s, E)
        pos = (onehot.cumsum(1) - 1).gather(2, by_choice[..., None])[..., 0]   # (b, k s)
        slot = torch.where(pos < capacity, pos, torch.full_like(pos, -1))
        slot = slot.view(b, top_k, s).transpose(1, 2)                          # (b, s, k)
    return gate_p, expert, slot


class MoE(nn.Module):
    """The mixture-of-experts MLP (module docstring). Parameters: ``router.weight (E, h)``, ``experts.{e}.*``
    (``make_mlp(expert_ffn)`` each: the model's :class:`~parallel_lab.distributed.model.model.MLP`), ``shared.*``."""

    def __init__(self, spec: ModelSpec, make_mlp: Callable[[int], nn.Module]):
        super().__init__()
        self.n_experts, self.top_k = spec.experts, spec.top_k
        self.capacity_factor, self.aux_loss_coef = spec.capacity_factor, spec.aux_loss_coef
        self.spec = spec
        self.router = nn.Linear(spec.hidden, spec.experts, bias=False)
        self.experts = nn.ModuleDict({str(e): make_mlp(spec.expert_ffn) for e in range(spec.experts)})
        self.shared = make_mlp(spec.shared_experts * spec.expert_ffn) if spec.shared_experts else None
        self.expert_layer = self.local_experts         # the seam expert parallelism replaces
        self.aux_grad_scale = 1.0
        self.fused = False
        self.reset_counts()

    def reset_counts(self) -> None:
        """Zero the token counters: ``counts["routed"][e]`` choices routed to ``e``, ``counts["kept"][e]``
        those within capacity, ``counts["aux"]`` the sum of the aux losses of the forwards since."""
        self.counts: dict[str, Any] = {"routed": [0] * self.n_experts, "kept": [0] * self.n_experts,
                                       "aux": 0.0, "forwards": 0}

    def local_experts(self, buf: Tensor) -> Tensor:
        """Every expert on its rows: ``(E, n, h) -> (E, n, h)``."""
        return torch.stack([self.experts[str(e)](buf[e]) for e in range(self.n_experts)])

    def forward(self, x: Tensor) -> Tensor:
        b, s, h = x.shape
        n_exp, k = self.n_experts, self.top_k
        cap = self.spec.expert_capacity(s)
        probs = torch.softmax(self.router(x).float(), dim=-1)                  # (b, s, E) fp32
        gate_p, expert, slot = route(probs, k, cap)
        gate = gate_p / gate_p.sum(-1, keepdim=True)                             # (b, s, k)
        with torch.no_grad():
            kept = slot >= 0
            seq = torch.arange(b, device=x.device)[:, None, None]
            # row of each kept choice in the dispatched buffer (E, b, C): e b C + sequence C + slot
            dest = torch.where(kept, (expert * b + seq) * cap + slot, torch.full_like(slot, n_exp * b * cap))
            src = torch.full((n_exp * b * cap + 1,), b * s, dtype=torch.long, device=x.device)
            tok = (seq * s + torch.arange(s, device=x.device)[None, :, None]).expand(b, s, k)
            src[dest.flatten()] = tok.flatten()                                 # empty slots: the zero row
            src = src[:-1]
            routed = F.one_hot(expert.flatten(), n_exp).sum(0)
            within = F.one_hot(expert[kept], n_exp).sum(0)
        x_pad = torch.cat([x.reshape(b * s, h), x.new_zeros(1, h)])              # (b s + 1, h)
        buf = x_pad[src].view(n_exp, b * cap, h)                                 # (E, b C, h): dispatch
        y = self.expert_layer(buf).reshape(n_exp * b * cap, h)
        y_pad = torch.cat([y, y.new_zeros(1, h)])                                # (E b C + 1, h)
        picked = y_pad[dest.reshape(b * s, k)]                                   # (b s, k, h): combine
        out = (picked * gate.view(b * s, k, 1).to(picked.dtype)).sum(1).view(b, s, h)
        if self.shared is not None:
            out = out + self.shared(x)
        self.counts["routed"] = [a + int(c) for a, c in zip(self.counts["routed"], routed, strict=True)]
        self.counts["kept"] = [a + int(c) for a, c in zip(self.counts["kept"], within, strict=True)]
        self.counts["forwards"] += 1
        if self.aux_loss_coef and self.training:
            with torch.no_grad():
                frac = F.one_hot(expert.flatten(1), n_exp).sum(1).float() / (s * k)   # (b, E) f_e
            aux = self.aux_loss_coef * n_exp * (frac * probs.mean(1)).sum(-1).mean()
            self.counts["aux"] += float(aux.detach())
            out = AddAuxLossGrad.apply(out, aux, self.aux_grad_scale)
        return out


def moe_layers(model: nn.Module) -> dict[str, MoE]:
    """The model's MoE modules by block name (``"0"``, ``"1"``, ...; a pipeline stage has only its own)."""
    blocks = getattr(model, "blocks", {})
    return {name: blk.mlp for name, blk in blocks.items() if isinstance(blk.mlp, MoE)}


def set_aux_grad_scale(model: nn.Module, scale: float) -> None:
    """The weight of the aux loss's gradient in every MoE block (``1 / m`` for ``m`` micro-batches per step)."""
    for moe in moe_layers(model).values():
        moe.aux_grad_scale = scale


def token_counts(model: nn.Module) -> dict[str, dict[str, Any]]:
    """``{block: {"routed": [...], "kept": [...], "aux": float, "forwards": int}}`` since the last reset."""
    return {name: {k: (list(v) if isinstance(v, list) else v) for k, v in moe.counts.items()}
            for name, moe in moe_layers(model).items()}
