"""The tiny decoder every runnable parallelism is checked against: model, weights, optimizer recipe.

One model, two block flavours (gpt: LayerNorm, tanh-GeLU, learned positions, biases, dropout; llama:
RMSNorm, RoPE, SwiGLU, grouped-query attention), built from a :class:`~parallel_lab.specs.ModelSpec`, with
no parallel code in it. The parallelisms change it from the outside through seams that are part of its
API: separate linears (``wq wk wv wo``, ``fc proj`` / ``gate up down``) that TP swaps for sharded ones; a
swappable attention core ``block.attn.core`` computing ``softmax(q k^T / sqrt(d) + mask) v`` on
unrepeated K/V, which CP replaces; explicit positions and document ids; pipeline pieces (``embed``, the
blocks keyed ``"0".."L-1"``, ``head``) that a stage keeps or deletes. Attention materialises its scores so
that the bytes it saves are Korthikanti et al.'s ``sbh(34 + 5as/h)`` per layer.

Parameters follow ``ModelSpec.parameter_shapes()`` in name and order (a test checks it);
:func:`init_weights` draws the full weights from one CPU generator whatever the plan (GPT-2's
normal(0, 0.02), residual projections 0.02 / sqrt(2L)), and parallel code cuts its shards from them.
Every choice and its reason is in docs/model.md. The data are in ``data.py``, the single-process
reference in ``reference.py``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from parallel_lab.distributed.model.kernels import (
    FlashCore,
    HeadInput,
    chunked_cross_entropy,
    fused_mlp,
    op_sac_context,
)
from parallel_lab.distributed.model.moe import MoE
from parallel_lab.errors import ParallelLabError
from parallel_lab.sharding import is_frozen
from parallel_lab.specs import RECOMPUTE, ROPE_THETA, ModelSpec, Plan

NORM_EPS = 1e-5
INIT_STD = 0.02
RESIDUAL_PROJECTIONS = ("attn.wo", "mlp.proj", "mlp.down")


# --------------------------------------------------------------------------------------------------
# Per-forward context shared by every attention call
# --------------------------------------------------------------------------------------------------

@dataclass
class AttnContext:
    """What all blocks of one forward share: token positions, document ids, and caches built from them.

    ``positions``: ``(s,)`` int64, the position of each local token in its full sequence (a CP rank
    holds non-contiguous chunks, so these need not be ``arange``). ``doc_ids``: ``(b, s)`` int64 or None;
    tokens attend only within their document. ``causal``: mask future positions.
    ``cache`` holds tensors derived once per forward (rotary tables, the mask bias); a replacement core
    may store its own entries there.
    """

    positions: Tensor
    doc_ids: Tensor | None = None
    causal: bool = True
    cache: dict = field(default_factory=dict)

    def mask_bias(self, dtype: torch.dtype, kv_positions: Tensor | None = None,
                  kv_doc_ids: Tensor | None = None) -> Tensor | None:
        """Additive mask ``(1 or b, 1, s_q, s_k)``: 0 where a query may attend a key, -inf elsewhere.

        Keys default to the queries' own positions and documents (single-process attention).
        """
        kv_pos = self.positions if kv_positions is None else kv_positions
        kv_doc = self.doc_ids if kv_doc_ids is None else kv_doc_ids
        key = ("mask_bias", dtype, kv_positions is None, kv_doc_ids is None)
        if kv_positions is None and kv_doc_ids is None and key in self.cache:
            return self.cache[key]
        allowed = None
        if self.causal:
            allowed = (self.positions[:, None] >= kv_pos[None, :])[None, None]      # (1, 1, sq, sk)
        if self.doc_ids is not None:
            same = (self.doc_ids[:, :, None] == kv_doc[:, None, :])[:, None]      # (b, 1, sq, sk)
            allowed = same if allowed is None else allowed & same
        bias = None
        if allowed is not None:
            bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
            bias.masked_fill_(~allowed, float("-inf"))
        if kv_positions is None and kv_doc_ids is None:
            self.cache[key] = bias
        return bias

    def rope(self, head_dim: int, dtype: torch.dtype, theta: float = ROPE_THETA,
             scaling: str = "none") -> tuple[Tensor, Tensor]:
        """Rotary tables ``cos, sin`` of shape ``(s, 1, head_dim)`` for these positions (built once);
        ``theta``, ``scaling``: ``ModelSpec.rope_theta`` and ``rope_scaling`` (:func:`rope_frequencies`)."""
        key = ("rope", head_dim, dtype, theta, scaling)
        if key not in self.cache:
            inv_freq = rope_frequencies(head_dim, theta, scaling, self.positions.device)
            angles = self.positions.to(torch.float64)[:, None] * inv_freq[None, :]      # (s, d/2)
            angles = torch.cat([angles, angles], dim=-1)[:, None, :]                    # (s, 1, d)
            self.cache[key] = (angles.cos().to(dtype), angles.sin().to(dtype))
        return self.cache[key]


def rope_frequencies(head_dim: int, theta: float = ROPE_THETA, scaling: str = "none",
                     device: torch.device | str | None = None) -> Tensor:
    """The ``head_dim / 2`` rotation frequencies ``theta^(-2i/d)`` (float64); ``scaling="llama3"``: Llama 3.1's
    (factor 8, wavelengths of 1..4 x 8192 / 4 blended, longer ones divided by 8: Meta's reference code)."""
    inv = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    if scaling == "none":
        return inv
    if scaling != "llama3":
        raise ParallelLabError(f"rope scaling {scaling!r} is not known; pick none or llama3")
    factor, low, high, original = 8.0, 1.0, 4.0, 8192.0
    wavelen = 2 * math.pi / inv
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv / factor + smooth * inv
    out = torch.where(wavelen > original / low, inv / factor, inv)
    return torch.where((wavelen >= original / high) & (wavelen <= original / low), blended, out)


def make_context(positions: Tensor, doc_ids: Tensor | None = None, causal: bool = True) -> AttnContext:
    return AttnContext(positions=positions, doc_ids=doc_ids, causal=causal)


# --------------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------------

def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """Inverted dropout keeping a boolean mask for backward (1 byte per element on every device)."""
    if not training or p == 0.0:
        return x
    return torch.native_dropout(x, p, True)[0]


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` (Zhang & Sennrich 2019), no bias, no mean subtraction."""

    def __init__(self, dim: int, eps: float = NORM_EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * rstd * self.weight


def make_norm(spec: ModelSpec) -> nn.Module:
    if spec.flavour == "gpt":
        return nn.LayerNorm(spec.hidden, eps=NORM_EPS)
    return RMSNorm(spec.hidden)


def rotate_half(x: Tensor) -> Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dimension (the "rotate half" form of RoPE)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary position embedding (Su et al. 2021) on ``x (b, s, heads, d)`` with tables ``(s, 1, d)``."""
    return x * cos + rotate_half(x) * sin


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """``(b, kv_heads, s, d) -> (b, kv_heads * n_rep, s, d)``: a key/value head serves n_rep query heads."""
    if n_rep == 1:
        return x
    b, hkv, s, d = x.shape
    return x[:, :, None].expand(b, hkv, n_rep, s, d).reshape(b, hkv * n_rep, s, d)


class DotProductAttention(nn.Module):
    """The attention core: ``softmax(q k^T / sqrt(d) + mask) v``, with dropout on the probabilities.

    ``q``: ``(b, heads, s_q, d)``; ``k, v``: ``(b, kv_heads, s_k, d)``, ``heads % kv_heads == 0``.
    Returns ``(b, heads, s_q, d)``. This is the module context parallelism replaces.
    """

    def __init__(self, dropout_p: float = 0.0):
        super().__init__()
        self.dropout_p = dropout_p

    def forward(self, q: Tensor, k: Tensor, v: Tensor, ctx: AttnContext) -> Tensor:
        n_rep = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        scores = (q * (1.0 / math.sqrt(q.shape[-1]))) @ k.transpose(-2, -1)      # (b, h, sq, sk)
        bias = ctx.mask_bias(scores.dtype)
        if bias is not None:
            scores = scores + bias
        probs = dropout(torch.softmax(scores, dim=-1), self.dropout_p, self.training)
        return probs @ v


class Attention(nn.Module):
    """Multi-head (gpt) or grouped-query (llama) self-attention with separate q/k/v/o projections."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        q_dim, kv_dim = spec.heads * spec.head_dim, spec.kv_dim
        self.head_dim = spec.head_dim
        self.rotary = spec.flavour == "llama"
        self.rope_args = (spec.rope_theta, spec.rope_scaling)
        self.wq = nn.Linear(spec.hidden, q_dim, bias=spec.bias)
        self.wk = nn.Linear(spec.hidden, kv_dim, bias=spec.bias)
        self.wv = nn.Linear(spec.hidden, kv_dim, bias=spec.bias)
        self.wo = nn.Linear(q_dim, spec.hidden, bias=spec.bias)
        self.core: nn.Module = DotProductAttention(spec.dropout)
        self.selective_recompute = False

    def forward(self, x: Tensor, ctx: AttnContext) -> Tensor:
        d = self.head_dim
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        b, s = q.shape[:2]                        # from the projections: with SP, x holds s / tp tokens
        q = q.view(b, s, -1, d)                   # -1: the local head count (heads / tp under TP)
        k = k.view(b, s, -1, d)
        v = v.view(b, s, -1, d)
        if self.rotary:
            cos, sin = ctx.rope(d, q.dtype, *self.rope_args)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.selective_recompute and self.training:
            out = checkpoint(self.core, q, k, v, ctx, use_reentrant=False)
        else:
            out = self.core(q, k, v, ctx)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """gpt: ``proj(gelu_tanh(fc(x)))``; llama (SwiGLU, Shazeer 2020): ``down(silu(gate(x)) * up(x))``.
    ``width``: the hidden width (default ``spec.ffn``; an expert's is ``spec.expert_ffn``)."""

    def __init__(self, spec: ModelSpec, width: int | None = None):
        super().__init__()
        f = spec.ffn if width is None else width
        self.swiglu = spec.flavour == "llama"
        if self.swiglu:
            self.gate = nn.Linear(spec.hidden, f, bias=spec.bias)
            self.up = nn.Linear(spec.hidden, f, bias=spec.bias)
            self.down = nn.Linear(f, spec.hidden, bias=spec.bias)
        else:
            self.fc = nn.Linear(spec.hidden, f, bias=spec.bias)
            self.proj = nn.Linear(f, spec.hidden, bias=spec.bias)
        self.fused = False                        # Plan.mlp == "fused": distributed/kernels.fused_mlp

    def forward(self, x: Tensor) -> Tensor:
        if self.fused:
            return fused_mlp(self, x)
        if self.swiglu:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm residual block: ``x + drop(attn(norm(x)))``, then ``x + drop(mlp(norm(x)))``; block ``layer``
    of a mixture-of-experts spec has a :class:`~parallel_lab.distributed.model.moe.MoE` as its ``mlp``."""

    def __init__(self, spec: ModelSpec, layer: int = 0):
        super().__init__()
        self.attn_norm = make_norm(spec)
        self.attn = Attention(spec)
        self.mlp_norm = make_norm(spec)
        if spec.is_moe_layer(layer):
            self.mlp: nn.Module = MoE(spec, partial(MLP, spec))
        else:
            self.mlp = MLP(spec)
        self.dropout_p = spec.dropout
        self.full_recompute = False
        self.op_sac = False                       # recompute="op-sac": torchtitan's op-level policy
        self.sac_meter: Any = None                # a SavedTensorMeter told about the outputs op-sac keeps

    def _forward(self, x: Tensor, ctx: AttnContext) -> Tensor:
        x = x + dropout(self.attn(self.attn_norm(x), ctx), self.dropout_p, self.training)
        return x + dropout(self.mlp(self.mlp_norm(x)), self.dropout_p, self.training)

    def forward(self, x: Tensor, ctx: AttnContext) -> Tensor:
        if self.full_recompute and self.training:
            # the whole block again, as Megatron does: torch would stop at the last tensor backward needs
            # and skip what follows it (e.g. tensor parallelism's last all-reduce of the block)
            with set_checkpoint_early_stop(False):
                return checkpoint(self._forward, x, ctx, use_reentrant=False)
        if self.op_sac and self.training:
            return checkpoint(self._forward, x, ctx, use_reentrant=False,
                              context_fn=partial(op_sac_context, self.sac_meter))
        return self._forward(x, ctx)


# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------

class Transformer(nn.Module):
    """Decoder-only transformer built from a ModelSpec; parameter names follow ``spec.parameter_shapes()``.

    ``recompute``: "none", "full" (each block keeps only its input and recomputes the rest in backward)
    or "selective" (the attention core is recomputed; Korthikanti et al. 2022) or "op-sac" (each block
    checkpointed with torchtitan's op-level policy, ``kernels.op_sac_context``). ``attention``: "eager"
    (:class:`DotProductAttention`, scores materialised) or "flash" (``kernels.FlashCore``); ``mlp``: "eager"
    or "fused" (``kernels.fused_mlp``): the saved-tensor choices of ``Plan.attention`` and ``Plan.mlp``.
    """

    def __init__(self, spec: ModelSpec, recompute: str = "none", attention: str = "eager", mlp: str = "eager",
                 loss_chunk: int = 0):
        super().__init__()
        spec.require_shape("the runnable model")
        self.spec = spec
        self.tok_emb: nn.Embedding | None = nn.Embedding(spec.vocab, spec.hidden)
        self.pos_emb: nn.Embedding | None = (
            nn.Embedding(spec.max_positions, spec.hidden) if spec.flavour == "gpt" else None)
        self.blocks = nn.ModuleDict({str(i): Block(spec, i) for i in range(spec.layers)})
        self.final_norm: nn.Module | None = make_norm(spec)
        self.lm_head: nn.Linear | None = (
            None if spec.tied_embeddings else nn.Linear(spec.hidden, spec.vocab, bias=False))
        self.has_head = True
        self.set_recompute(recompute)
        self.set_kernels(attention, mlp, loss_chunk)

    def set_kernels(self, attention: str = "eager", mlp: str = "eager", loss_chunk: int = 0) -> None:
        """Which attention core and MLP the blocks run (before any parallelism replaces the core), and the
        tokens per chunk of the cross-entropy (0: the whole logits at once)."""
        if isinstance(loss_chunk, bool) or not isinstance(loss_chunk, int) or loss_chunk < 0:
            raise ParallelLabError(f"loss_chunk={loss_chunk!r} must be an integer >= 0 (0: eager cross-entropy)")
        self.loss_chunk = loss_chunk
        if attention not in ("eager", "flash"):
            raise ParallelLabError(f"attention={attention!r} is not known; pick eager or flash")
        if mlp not in ("eager", "fused"):
            raise ParallelLabError(f"mlp={mlp!r} is not known; pick eager or fused")
        if attention == "flash" and self.spec.dropout > 0:
            raise ParallelLabError(f"attention='flash' has no attention dropout but dropout={self.spec.dropout}; "
                                   "set the model's dropout=0 or attention='eager'")
        for blk in self.blocks.values():
            blk.attn.core = FlashCore() if attention == "flash" else DotProductAttention(self.spec.dropout)
            if mlp == "fused" and not isinstance(blk.mlp, MLP):
                raise ParallelLabError("mlp='fused' is not implemented for mixture-of-experts blocks; "
                                       "use mlp='eager'")
            blk.mlp.fused = mlp == "fused"

    def set_recompute(self, recompute: str) -> None:
        if recompute not in RECOMPUTE:
            raise ParallelLabError(f"recompute={recompute!r} is not known; pick one of {', '.join(RECOMPUTE)}")
        self.recompute = recompute
        for blk in self.blocks.values():
            blk.full_recompute = recompute == "full"
            blk.op_sac = recompute == "op-sac"
            blk.attn.selective_recompute = recompute == "selective"

    # ---- pieces (pipeline stages use them one by one) --------------------------------------------
    def embed(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """Token embedding (+ learned positions and dropout for gpt): ``(b, s) -> (b, s, h)``."""
        h = self.tok_emb(tokens)
        if self.pos_emb is not None:
            # an assert the tensor library checks, not a value read into Python: fake tensors (memory
            # --measure) have no values to read, and it keeps a GPU from synchronising every step
            n = self.pos_emb.num_embeddings
            torch._assert_async(positions.max() < n, f"a position exceeds max_positions={n}; use a shorter seq")
            h = h + self.pos_emb(positions)
            h = dropout(h, self.spec.dropout, self.training)
        return h

    def run_blocks(self, h: Tensor, ctx: AttnContext) -> Tensor:
        for blk in self.blocks.values():
            h = blk(h, ctx)
        return h

    def head(self, h: Tensor) -> Tensor | HeadInput:
        """Final norm and LM head: ``(b, s, h) -> (b, s, vocab)`` logits; with ``loss_chunk > 0`` the normed
        states and the head's weight for :func:`loss_fn`'s chunked cross-entropy (no logits)."""
        h = self.final_norm(h)
        if self.loss_chunk:
            return HeadInput(h, self.lm_head.weight if self.lm_head is not None else self.tok_emb.weight,
                             self.loss_chunk)
        if self.lm_head is not None:
            return self.lm_head(h)
        return F.linear(h, self.tok_emb.weight)

    def forward(self, x: Tensor, positions: Tensor | None = None, doc_ids: Tensor | None = None,
                ctx: AttnContext | None = None) -> Tensor:
        """Run the pieces this module holds: ``x`` is token ids ``(b, s)`` when it holds the embedding,
        else hidden states ``(b, s, h)``; returns logits when it holds the head, else hidden states."""
        if ctx is None:
            if positions is None:
                positions = torch.arange(x.shape[1], device=x.device)
            ctx = make_context(positions, doc_ids)
        h = self.embed(x, ctx.positions) if self.tok_emb is not None and not x.is_floating_point() else x
        h = self.run_blocks(h, ctx)
        return self.head(h) if self.has_head and self.final_norm is not None else h


def loss_fn(logits: Tensor | HeadInput, targets: Tensor) -> Tensor:
    """Mean cross-entropy over every token: ``logits (b, s, V)``, ``targets (b, s)`` (or the chunked
    cross-entropy of ``kernels.chunked_cross_entropy`` when the head returned a ``HeadInput``)."""
    if isinstance(logits, HeadInput):
        return chunked_cross_entropy(logits, targets)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# --------------------------------------------------------------------------------------------------
# Deterministic weights
# --------------------------------------------------------------------------------------------------

def init_weights(spec: ModelSpec, seed: int = 0) -> dict[str, Tensor]:
    """Full fp32 weights by name, drawn in ``parameter_shapes()`` order from one CPU generator.

    The same (spec, seed) gives bitwise the same tensors whatever the plan, process or device.
    """
    g = torch.Generator().manual_seed(seed)
    std_resid = INIT_STD / math.sqrt(2 * spec.layers)
    out: dict[str, Tensor] = {}
    for name, shape in spec.parameter_shapes():
        is_norm = "norm" in name
        if name.endswith(".bias"):
            t = torch.zeros(shape)
        elif is_norm:
            t = torch.ones(shape)
        else:
            std = std_resid if any(r in name for r in RESIDUAL_PROJECTIONS) else INIT_STD
            t = torch.empty(shape).normal_(0.0, std, generator=g)
        out[name] = t
    return out


def build_model(spec: ModelSpec, seed: int = 0, recompute: str = "none",
                device: torch.device | str = "cpu", attention: str = "eager", mlp: str = "eager",
                loss_chunk: int = 0) -> Transformer:
    """A Transformer holding ``init_weights(spec, seed)``, on ``device``, in training mode.

    Built on ``device`` directly, its default initialisation then overwritten (under ``torch.device("meta")``
    the first meta op imports torch's Python decompositions, about 1.5 CPU-s in every rank)."""
    with torch.device(device):
        model = Transformer(spec, recompute=recompute, attention=attention, mlp=mlp, loss_chunk=loss_chunk)
    load_full_weights(model, init_weights(spec, seed))
    return model.train()


@torch.no_grad()
def load_full_weights(model: nn.Module, weights: dict[str, Tensor]) -> None:
    """Copy full tensors into the model's parameters of the same name (all must be present)."""
    params = dict(model.named_parameters())
    missing = set(params) - set(weights)
    if missing:
        raise ParallelLabError(f"no weights given for {sorted(missing)[:4]}...")
    for name, p in params.items():
        p.copy_(weights[name])


def freeze(model: nn.Module, frozen: Iterable[str]) -> None:
    """``requires_grad=False`` for the parameters named in ``frozen``: a name of ``parameter_shapes()`` or
    a prefix such as ``"blocks.0"`` (the rule of ``sharding.is_frozen``, which the predictions use)."""
    params = dict(model.named_parameters())
    for pattern in frozen:
        hit = [n for n in params if is_frozen(n, (pattern,))]
        if not hit:
            raise ParallelLabError(f"cannot freeze {pattern!r}: no parameter has that name or prefix; names "
                                   f"are those of ModelSpec.parameter_shapes(), e.g. 'blocks.0.attn_norm'")
        for n in hit:
            params[n].requires_grad_(False)


# --------------------------------------------------------------------------------------------------
# The optimizer every implementation and the reference use
# --------------------------------------------------------------------------------------------------

#: Hyperparameters every implementation uses (no gradient clipping: it would need a global norm).
ADAMW = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-6, "weight_decay": 0.1}
SGD = {"lr": 0.05, "momentum": 0.9}


def make_optimizer(params: Iterable[Tensor], plan: Plan) -> torch.optim.Optimizer:
    """The optimizer of ``plan.optimizer`` with fixed hyperparameters (``foreach=False``: no hidden
    temporaries, so measured state is the textbook ``exp_avg`` and ``exp_avg_sq`` / momentum buffer)."""
    params = [p for p in params if p.requires_grad]
    if plan.optimizer in ("adam-fp32", "fsdp2-mixed"):      # fsdp2-mixed: fp32 master weights and AdamW
        return torch.optim.AdamW(params, foreach=False, **ADAMW)
    if plan.optimizer == "sgd-momentum":
        return torch.optim.SGD(params, foreach=False, **SGD)
    if plan.optimizer == "adam-mixed":                        # fp32 master copies of (bf16) parameters
        from parallel_lab.distributed.model.mixed_precision import MasterAdamW

        return MasterAdamW(params, **ADAMW)
    raise ParallelLabError(f"optimizer={plan.optimizer!r} is not runnable here; the runnable optimizers are "
                           f"adam-fp32, sgd-momentum (fp32 compute on CPU) and adam-mixed (bf16 with fp32 master)")
