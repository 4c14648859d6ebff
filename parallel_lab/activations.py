"""Per-op model of the bytes a training forward saves for backward (layer 1: pure Python, no torch).

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", Sec. 4.1) count
``s b h (34 + 5 a s / h)`` bytes per transformer layer for 2-byte activations. This module derives the same
figure op by op, for the runnable model (``parallel_lab.distributed.model.model``) exactly as torch stores
it, so that the measured bytes (``distributed.instruments.saved.SavedTensorMeter``) can be compared with the
prediction tensor by tensor. Every entry is one *storage* kept alive for backward, listed once under the
first op that saves it; parameters are not activations.

Kernels (``attention="flash"``, ``mlp="fused"``), recomputation (``selective``, ``full``, ``op-sac``) and
parallelism (TP divides heads and ffn, SP the sequence of the norm/dropout regions, CP the sequence) change
what is saved and its local shape. The per-block table of what each op saves, and the rules for kernels,
recomputation and parallelism, are in docs/activations.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from parallel_lab import sharding
from parallel_lab.errors import ParallelLabError
from parallel_lab.specs import ModelSpec, Plan

T = TypeVar("T")

MASK_BYTES = 1     # torch.native_dropout keeps a bool mask
ID_BYTES = 8       # int64 token / position ids
STAT_BYTES = 4     # LayerNorm mean and rstd are kept in fp32
LOSS_BYTES = 4     # the loss upcasts logits to fp32 before log_softmax
LSE_BYTES = 4      # the context-parallel cores keep the softmax's log-sum-exp in fp32


@dataclass(frozen=True)
class Saved:
    """One storage saved for backward: which op saves it, what it is, its shape and element size."""

    op: str
    tensor: str
    shape: tuple[int, ...]
    dtype_bytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype_bytes

    def as_dict(self) -> dict:
        return {"op": self.op, "tensor": self.tensor, "shape": list(self.shape),
                "dtype_bytes": self.dtype_bytes, "bytes": self.nbytes}


@dataclass(frozen=True)
class LocalDims:
    """The shapes one rank sees: b, s (tokens of the attention region), s_n (norm/residual region)."""

    b: int
    s: int
    s_n: int
    h: int
    d: int
    heads: int
    kv_heads: int
    ffn: int


def local_dims(model: ModelSpec, plan: Plan) -> LocalDims:
    """Local sizes under TP (heads, kv heads, ffn / tp), SP (norm region seq / tp) and CP (seq / cp)."""
    tp, cp = plan.tp, plan.cp
    sharding.check_tp(model, tp)
    if plan.seq % cp:
        raise ParallelLabError(f"cp={cp} must divide seq={plan.seq}")
    s = plan.seq // cp
    s_n = s // tp if plan.sp else s
    return LocalDims(b=plan.micro_batch, s=s, s_n=s_n, h=model.hidden, d=model.head_dim,
                     heads=model.heads // tp, kv_heads=sharding.kv_heads_local(model, tp), ffn=model.ffn // tp)


def _norm(model: ModelSpec, op: str, t: LocalDims, a: int, stat: int) -> list[Saved]:
    if model.flavour == "gpt":   # native_layer_norm: input, mean, rstd
        return [Saved(op, "input", (t.b, t.s_n, t.h), a),
                Saved(op, "mean", (t.b, t.s_n, 1), stat),
                Saved(op, "rstd", (t.b, t.s_n, 1), stat)]
    return [Saved(op, "input", (t.b, t.s_n, t.h), a),            # x (for x^2 and x * rstd)
            Saved(op, "rstd", (t.b, t.s_n, 1), a),
            Saved(op, "x * rstd", (t.b, t.s_n, t.h), a)]         # for the weight's gradient


def _cp_core(model: ModelSpec, plan: Plan, t: LocalDims, a: int) -> list[Saved]:
    """The context-parallel attention cores of ``dist/context_parallel.py`` (blockwise, online softmax):
    no ``(s x s)`` probabilities, but the inputs, the output and an fp32 log-sum-exp per query and head.

    The output of ring and all-gather is allocated so that the ``wo`` input is a view of it (one storage,
    listed under ``attn.wo``). Ulysses keeps the head-sharded tensors of the whole sequence (``s cp``
    tokens, ``heads / cp`` heads, key/value heads repeated ``cp / gcd(kv_heads, cp)`` times).
    """
    c, kv = plan.cp, t.kv_heads
    if plan.cp_kind == "ulysses":
        kv_rep = kv * sharding.kv_replication(t.heads, kv, c)
        S = t.s * c
        op, hq = "core (ulysses)", t.heads // c
        return [Saved(op, "q / sqrt(d), own heads, whole sequence", (t.b, hq, S, t.d), a),
                Saved(op, "k and v, own heads, whole sequence", (2, t.b, kv_rep // c, S, t.d), a),
                Saved(op, "head-sharded output", (t.b, hq, S, t.d), a),
                Saved(op, "log-sum-exp (fp32)", (t.b, hq, S), LSE_BYTES)]
    kv_shape = (2, t.b, kv, t.s, t.d) if plan.cp_kind == "ring" else (c, 2, t.b, kv, t.s, t.d)
    what = "local k and v, stacked" if plan.cp_kind == "ring" else "all-gathered k and v"
    return [Saved(f"core ({plan.cp_kind})", "q / sqrt(d), grouped by kv head", (t.b, t.heads, t.s, t.d), a),
            Saved(f"core ({plan.cp_kind})", what, kv_shape, a),
            Saved(f"core ({plan.cp_kind})", "log-sum-exp (fp32)", (t.b, t.heads, t.s), LSE_BYTES)]


def _core(model: ModelSpec, plan: Plan, t: LocalDims, a: int) -> list[Saved]:
    """The attention core softmax(q k^T / sqrt(d) + mask) v as written in distributed.model.model.DotProductAttention
    (``cp = 1``); with context parallelism, the cores of ``dist/context_parallel.py`` (:func:`_cp_core`).
    """
    if plan.cp > 1:
        return _cp_core(model, plan, t, a)
    s_k = t.s
    # repeat_kv expands a key/value head to the query heads it serves and reshapes; with one kv head on this
    # rank the reshape is a view of the unrepeated tensor, and with a micro-batch of 1 so is matmul's own
    # flattening to (b * heads, s, d): what is saved is then the unrepeated storage. Otherwise it is a copy.
    kv_saved = 1 if t.b == 1 and t.kv_heads == 1 else t.heads
    what = "(one kv head, a view of the unrepeated tensor)" if kv_saved < t.heads else "(repeated to all heads)"
    qkv = [Saved("core.qk", "q / sqrt(d)", (t.b, t.heads, t.s, t.d), a),
           Saved("core.qk", f"k^T {what}", (t.b, kv_saved, t.d, s_k), a)]
    probs = [Saved("core.softmax", "probabilities", (t.b, t.heads, t.s, s_k), a)]
    if model.dropout > 0:
        probs += [Saved("core.dropout", "mask", (t.b, t.heads, t.s, s_k), MASK_BYTES),
                  Saved("core.pv", "dropped probabilities", (t.b, t.heads, t.s, s_k), a)]
    v = [Saved("core.pv", f"v {what}", (t.b, kv_saved, s_k, t.d), a)]
    return qkv + probs + v


def block_matmuls(model: ModelSpec, plan: Plan, t: LocalDims) -> list[tuple[str, int, bool]]:
    """The block's matmuls in forward order: ``(name, local output width, bias fused into it)``. The fused
    MLP's second matmul has no bias inside it (``kernels.fused_mlp`` adds the bias after)."""
    mlp = ([("mlp.fc", t.ffn), ("mlp.proj", t.h)] if model.flavour == "gpt"
           else [("mlp.gate", t.ffn), ("mlp.up", t.ffn), ("mlp.down", t.h)])
    attn = [("attn.wq", t.heads * t.d), ("attn.wk", t.kv_heads * t.d), ("attn.wv", t.kv_heads * t.d),
            ("attn.wo", t.h)]
    out = [(name, width, bool(model.bias)) for name, width in attn + mlp]
    if plan.mlp == "fused":
        out[-1] = (out[-1][0], out[-1][1], False)
    return out


def op_sac_kept_matmuls(model: ModelSpec, plan: Plan, t: LocalDims) -> list[tuple[str, int]]:
    """The matmul outputs torchtitan's op-level policy keeps: a matmul without bias is one ``aten.mm``,
    and of those the 1st, 3rd, 5th, ... are kept (llama: wq, wv, gate, down); a linear with bias is an
    ``aten.addmm``, which the policy does not keep (so an eager gpt block keeps only its input, like
    ``full``; the fused gpt MLP's bias-free second matmul is its one kept output)."""
    return op_sac_keeps([(name, width) for name, width, bias in block_matmuls(model, plan, t) if not bias])


def op_sac_keeps(mms: Sequence[T]) -> list[T]:
    """torchtitan's op-level policy on a block's ``aten.mm`` calls in forward order: every second one is
    saved, starting with the first (the others are recomputed)."""
    return list(mms[0::2])


def op_sac_kept_width(model: ModelSpec, plan: Plan) -> int:
    """Elements per local token of the matmul outputs op-sac keeps (the ledger's formula uses it)."""
    return sum(width for _, width in op_sac_kept_matmuls(model, plan, local_dims(model, plan)))


def _mlp_widths(model: ModelSpec, t: LocalDims, width: int, rows: tuple[int, ...], a: int, op: str) -> list[Saved]:
    """What an eager MLP of hidden ``width`` saves besides its input, on ``rows`` tokens."""
    if model.flavour == "gpt":
        return [Saved(f"{op} gelu", "fc output", (*rows, width), a),
                Saved(f"{op} proj", "gelu output", (*rows, width), a)]
    return [Saved(f"{op} silu", "gate output", (*rows, width), a),
            Saved(f"{op} silu * up", "silu output", (*rows, width), a),
            Saved(f"{op} silu * up", "up output", (*rows, width), a),
            Saved(f"{op} down", "silu * up", (*rows, width), a)]


def moe_saves(model: ModelSpec, plan: Plan, t: LocalDims, a: int) -> list[Saved]:
    """What the mixture-of-experts MLP (``distributed/model/moe.py``) saves, for one micro-batch: the router's fp32
    probabilities, the top-k ids and gates, the slot sources of the dispatch (``E b C`` ids and one dump row),
    the dispatched buffer ``(E, b C, h)`` and each expert's intermediates on its ``b C`` slots, the combine's
    ids and picked outputs ``(b s, k, h)``, the shared expert's intermediates, the aux loss's ``f_e``. With
    expert parallelism the buffer a rank's local experts read holds ``ep b C`` slots for each of ``E / ep``
    experts: the same size."""
    e, k, cap = model.experts, model.top_k, model.expert_capacity(plan.seq)
    slots = e * t.b * cap
    out = [Saved("mlp.router + shared", "normed input", (t.b, t.s, t.h), a),
           Saved("router softmax", "probabilities (fp32)", (t.b, t.s, e), STAT_BYTES),
           Saved("top-k", "expert ids", (t.b, t.s, k), ID_BYTES),
           Saved("gate renormalisation", "top-k probabilities (fp32)", (t.b, t.s, k), STAT_BYTES),
           Saved("gate renormalisation", "their sum (fp32)", (t.b, t.s, 1), STAT_BYTES),
           Saved("dispatch", "slot sources (+1 dump row)", (slots + 1,), ID_BYTES),
           Saved("experts", "dispatched tokens", (slots, t.h), a)]
    out += _mlp_widths(model, t, model.expert_ffn, (slots,), a, "experts")
    out += [Saved("combine", "slot ids", (t.b * t.s, k), ID_BYTES),
            Saved("combine", "expert outputs picked", (t.b * t.s, k, t.h), a),
            Saved("combine", "gates (fp32)", (t.b, t.s, k), STAT_BYTES)]
    if model.shared_experts:
        out += _mlp_widths(model, t, model.shared_experts * model.expert_ffn, (t.b, t.s), a, "shared")
    if model.aux_loss_coef:
        out.append(Saved("aux loss", "f_e per sequence (fp32)", (t.b, e), STAT_BYTES))
    return out


def block_saves(model: ModelSpec, plan: Plan, ln_stats_bytes: int = STAT_BYTES,
                layer: int | None = None) -> list[Saved]:
    """Storages one transformer block saves for backward, op by op, for one micro-batch (block ``layer``;
    default: a mixture-of-experts block when the model has any)."""
    model.require_shape("the per-op activation model")
    t = local_dims(model, plan)
    a = plan.dtype_bytes
    if plan.recompute == "full":
        return [Saved("checkpoint", "block input", (t.b, t.s_n, t.h), a)]
    if plan.recompute == "op-sac":
        return [Saved("checkpoint", "block input", (t.b, t.s_n, t.h), a)] + [
            Saved(f"{name} (op-sac)", "matmul output", (t.b * t.s, width), a)
            for name, width in op_sac_kept_matmuls(model, plan, t)]
    drop = model.dropout > 0
    out: list[Saved] = []
    out += _norm(model, "attn_norm", t, a, ln_stats_bytes)
    out.append(Saved("attn.wq/wk/wv", "normed input", (t.b, t.s_n, t.h), a))
    flash = plan.attention == "flash" and plan.cp == 1
    if plan.recompute == "selective" or flash:   # checkpointed or flash core keeps its unrepeated inputs
        op = "core (checkpoint)" if plan.recompute == "selective" else "core (flash)"
        q_store = "rope(q)" if model.flavour == "llama" else "q"
        k_store = "rope(k)" if model.flavour == "llama" else "k"
        out += [Saved(op, q_store, (t.b, t.s, t.heads * t.d), a),
                Saved(op, k_store, (t.b, t.s, t.kv_heads * t.d), a),
                Saved(op, "v", (t.b, t.s, t.kv_heads * t.d), a)]
        if plan.recompute != "selective":        # the output is the wo input below (one storage)
            out.append(Saved(op, "log-sum-exp (fp32)", (t.b, t.heads, t.s), LSE_BYTES))
    else:
        out += _core(model, plan, t, a)
    out.append(Saved("attn.wo", "attention output", (t.b, t.s, t.heads * t.d), a))
    if drop:
        out.append(Saved("attn dropout", "mask", (t.b, t.s_n, t.h), MASK_BYTES))
    out += _norm(model, "mlp_norm", t, a, ln_stats_bytes)
    if model.is_moe_layer(model.first_dense if layer is None else layer):
        out += moe_saves(model, plan, t, a)
    elif plan.mlp == "fused":                      # kernels.fused_mlp: the first matmuls' outputs only
        first = "mlp.fc" if model.flavour == "gpt" else "mlp.gate/up"
        out.append(Saved(first, "normed input", (t.b, t.s_n, t.h), a))
        if model.flavour == "gpt":
            out.append(Saved("gelu+proj (fused)", "fc output", (t.b, t.s, t.ffn), a))
        else:
            out += [Saved("swiglu+down (fused)", "gate output", (t.b, t.s, t.ffn), a),
                    Saved("swiglu+down (fused)", "up output", (t.b, t.s, t.ffn), a)]
    elif model.flavour == "gpt":
        out += [Saved("mlp.fc", "normed input", (t.b, t.s_n, t.h), a),
                Saved("gelu", "fc output", (t.b, t.s, t.ffn), a),
                Saved("mlp.proj", "gelu output", (t.b, t.s, t.ffn), a)]
    else:
        out += [Saved("mlp.gate/up", "normed input", (t.b, t.s_n, t.h), a),
                Saved("silu", "gate output", (t.b, t.s, t.ffn), a),
                Saved("silu * up", "silu output", (t.b, t.s, t.ffn), a),
                Saved("silu * up", "up output", (t.b, t.s, t.ffn), a),
                Saved("mlp.down", "silu * up", (t.b, t.s, t.ffn), a)]
    if drop:
        out.append(Saved("mlp dropout", "mask", (t.b, t.s_n, t.h), MASK_BYTES))
    return out


def shared_saves(model: ModelSpec, plan: Plan) -> list[Saved]:
    """Saved once per forward and used by every block: llama's rotary tables (not under full recompute)."""
    if model.flavour != "llama" or plan.recompute in ("full", "op-sac"):
        return []
    t = local_dims(model, plan)
    return [Saved("rope", "cos", (t.s, 1, t.d), plan.dtype_bytes),
            Saved("rope", "sin", (t.s, 1, t.d), plan.dtype_bytes)]


def embedding_saves(model: ModelSpec, plan: Plan) -> list[Saved]:
    """Token ids for the embedding's backward (gpt: also position ids and the embedding dropout mask)."""
    t = local_dims(model, plan)
    out = [Saved("tok_emb", "token ids", (t.b, t.s), ID_BYTES)]
    if model.flavour == "gpt":
        out.append(Saved("pos_emb", "position ids", (t.s,), ID_BYTES))
        if model.dropout > 0:
            out.append(Saved("embedding dropout", "mask", (t.b, t.s, t.h), MASK_BYTES))
    return out


def head_saves(model: ModelSpec, plan: Plan, ln_stats_bytes: int = STAT_BYTES) -> list[Saved]:
    """Final norm, LM head input, and the loss (fp32 log-probabilities, targets, a scalar weight).

    With ``tp > 1`` the head's input is the whole (with SP: all-gathered) sequence, and the
    vocabulary-parallel cross-entropy of ``dist/tensor_parallel.py`` keeps this rank's ``V/tp`` columns of
    the fp32 softmax and the target ids local to its vocabulary shard (no scalar weight). With
    ``loss_chunk > 0`` (``distributed/kernels.ChunkedLinearCrossEntropy``): the head input, the targets and
    an fp32 log-sum-exp per token, no logits.
    """
    t = local_dims(model, plan)
    a = plan.dtype_bytes
    rows = t.b * t.s
    head = _norm(model, "final_norm", t, a, ln_stats_bytes)
    if plan.loss_chunk:                          # kernels.ChunkedLinearCrossEntropy: no logits kept
        op = f"lm_head + cross_entropy (chunks of {plan.loss_chunk} tokens)"
        return head + [Saved(op, "normed input", (rows, t.h), a),
                       Saved(op, "targets", (rows,), ID_BYTES),
                       Saved(op, "log-sum-exp (fp32)", (rows,), LSE_BYTES)]
    head.append(Saved("lm_head", "normed input", (rows, t.h), a))
    if plan.tp > 1:
        return head + [Saved("cross_entropy", "softmax, this rank's vocabulary columns (fp32)",
                             (rows, sharding.vocab_local(model, plan.tp)), LOSS_BYTES),
                       Saved("cross_entropy", "target ids in this rank's vocabulary (-1 elsewhere)", (rows,),
                             ID_BYTES)]
    return head + [Saved("cross_entropy", "log-probabilities (fp32)", (rows, model.vocab), LOSS_BYTES),
                   Saved("cross_entropy", "targets", (rows,), ID_BYTES),
                   Saved("cross_entropy", "total weight", (), LOSS_BYTES)]


def _total(items: list[Saved]) -> int:
    return sum(x.nbytes for x in items)


def per_op_bytes(model: ModelSpec, plan: Plan, layers: int | None = None, *,
                 ln_stats_bytes: int = STAT_BYTES) -> dict:
    """Bytes saved for backward by one micro-batch on one rank, op by op.

    ``layers``: blocks on this rank (default all; a pipeline stage passes its own count). Returns::

        {"block": [entry, ...], "per_block_bytes": int,     # one transformer block
         "shared": [...], "embedding": [...], "head": [...], # entries: op, tensor, shape, dtype_bytes, bytes
         "layers": L,
         "activations": embedding + shared + L * per_block,  # the ledger's `activations` (one micro-batch)
         "logits_and_loss": head}                           # the ledger's `logits_and_loss`

    The head's bytes are in ``logits_and_loss``; everything from the token ids to the last block's
    internals is in ``activations``. ``ln_stats_bytes``: bytes of LayerNorm's saved mean and rstd, fp32
    (4) on GPUs; torch's CPU kernel keeps them in the input dtype (pass ``plan.dtype_bytes`` to be exact
    for a bf16 run on CPU; the difference is two ``(b, s)`` vectors per norm).
    """
    model.require_shape("the per-op activation model")
    n_layers = model.layers if layers is None else layers
    block, shared = block_saves(model, plan, ln_stats_bytes), shared_saves(model, plan)
    emb, head = embedding_saves(model, plan), head_saves(model, plan, ln_stats_bytes)
    per_block = _total(block)
    return {
        "block": [x.as_dict() for x in block],
        "per_block_bytes": per_block,
        "shared": [x.as_dict() for x in shared],
        "embedding": [x.as_dict() for x in emb],
        "head": [x.as_dict() for x in head],
        "layers": n_layers,
        "activations": _total(emb) + _total(shared) + n_layers * per_block,
        "logits_and_loss": _total(head),
    }
