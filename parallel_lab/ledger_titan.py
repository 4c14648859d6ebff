"""The ledger of torchtitan 0.3's own Llama 3 job (``memory --measure --engine torchtitan``): what its block, its
chunked loss and FSDP2's buffers keep, derived from its code, each checked against the job measured in fake
tensors (``distributed/instruments/titan_measure.py``, docs/measure.md). The lab's own ledger is unchanged.

* :func:`titan_block_terms`: one llama3 block's saves without checkpointing (fused ``wqkv``, complex RoPE, flex
  attention, ``torch.rms_norm``); :func:`titan_op_sac_terms`: under its op-level SelectiveAC.
* :func:`titan_loss_terms`: ``ChunkedLossWrapper`` between two chunks (fp32 gradient buffer, the last chunk's
  logits, the chunk copies, FSDP2's fp32 no-sync gradient of the output head).
* :func:`titan_fsdp2_buffers`: FSDP2's four buffer kinds, each at its peak, for torchtitan's units.
"""

from __future__ import annotations

import math

from . import activations
from .errors import ParallelLabError
from .rank_view import rank_view
from .sharding import padded
from .specs import ModelSpec, Plan

#: torchtitan 0.3's llama3 block (``models/common``): one fused ``wqkv`` matmul, then ``wo``, and the feed-forward
#: ``w2(silu(w1 x) * w3 x)``: the aten.linear calls its SelectiveAC policy counts, in forward order
TITAN_MATMULS = ("wqkv", "wo", "w1", "w3", "w2")
#: what ``torch.rms_norm`` saves per token: "composite" (its CPU path, the one measured here: the bf16 input cast
#: to fp32 and saved, the fp32 ``x * rstd`` and the fp32 rstd), "fused" (``aten._fused_rms_norm``, which torch
#: dispatches to on CUDA: the input and the fp32 rstd; not measured here, no GPU)
NORM_KINDS = ("composite", "fused")
FP32 = 4
#: ComplexRoPE's cache rows, gathered per block by position: complex64, ``head_dim / 2`` values per token
COMPLEX64 = 8


def _require_titan_block(model: ModelSpec, what: str) -> None:
    if model.flavour != "llama" or model.is_moe:
        raise ParallelLabError(f"torchtitan's {what} is modelled for its dense llama3 block; model {model.name!r} "
                               f"is {model.flavour}{' MoE' if model.is_moe else ''}")


def titan_block_terms(model: ModelSpec, plan: Plan, *, norm: str) -> dict[str, float]:
    """Bytes one torchtitan llama3 block saves without checkpointing, per micro-batch (``norm``: NORM_KINDS).
    Each RMSNorm: composite ``h (4 + 4) + 4``, fused ``h d + 4`` per token; ``wqkv`` and ``w1``/``w3``: the
    normed input; RoPE: the complex64 cache rows it multiplies q and k by (``head_dim / 2`` per token, once);
    flex attention: q, k, v, its output (also ``wo``'s input) and the fp32 log-sum-exp and max score per query
    and head; SwiGLU: silu's input, silu's output, w3's output and w2's input (4 ffn). Measured exact with the
    composite norm (docs/measure.md)."""
    _require_titan_block(model, "block")
    if norm not in NORM_KINDS:
        raise ParallelLabError(f"norm={norm!r} is not known; pick one of {', '.join(NORM_KINDS)}")
    view = rank_view(model, plan)
    d, sb, h, t = plan.dtype_bytes, plan.seq / plan.cp * plan.micro_batch, model.hidden, plan.tp
    sp = t if plan.sp else 1
    per_norm = h * 2 * FP32 + FP32 if norm == "composite" else h * d + FP32
    return {"norms": 2 * sb * per_norm / sp,
            "matmul_inputs": 2 * sb * h * d,
            "rope_cache": sb * model.head_dim // 2 * COMPLEX64,
            "attention_qkv": sb * (view.q_width + 2 * view.kv_width) * d,
            "attention_output": sb * view.q_width * d,
            "attention_stats": sb * model.heads / t * 2 * activations.LSE_BYTES,
            "swiglu": sb * 4 * model.ffn / t * d}


def titan_op_sac_terms(model: ModelSpec, plan: Plan) -> dict[str, float]:
    """Bytes one torchtitan llama3 block keeps under its op-level SelectiveAC (``recompute="op-sac"``), per
    micro-batch: the block input, the 1st, 3rd and 5th of :data:`TITAN_MATMULS` (its "every second mm" rule on
    the fused QKV: wqkv, w1, w2, not the lab's wq, wv, gate, down) and every output of the attention kernel,
    which its save list names (flex attention: the output and the fp32 log-sum-exp and max score per query and
    head); with sequence parallelism also the outputs of the two reduce-scatters after ``wo`` and ``w2`` (its
    save list names ``reduce_scatter_tensor``), ``s b h d / t`` each. Measured exact in fake tensors, TP + SP in
    bench/bench_titan_memory.py (docs/measure.md)."""
    _require_titan_block(model, "op-level checkpointing")
    view = rank_view(model, plan)
    d, sb, h = plan.dtype_bytes, plan.seq / plan.cp * plan.micro_batch, model.hidden
    widths = dict(zip(TITAN_MATMULS, (view.q_width + 2 * view.kv_width, h, model.ffn / plan.tp,
                                      model.ffn / plan.tp, h), strict=True))
    kept = activations.op_sac_keeps(TITAN_MATMULS)
    sp = plan.tp if plan.sp else 1
    return {"layer_input": sb * h * d / sp,
            "kept_matmul_outputs": sb * sum(widths[k] for k in kept) * d,
            "attention_output": sb * view.q_width * d,
            "attention_stats": sb * model.heads / plan.tp * 2 * activations.LSE_BYTES,
            "reduce_scatter_outputs": 2 * sb * h * d / sp if plan.sp else 0.0}


def titan_activation_bytes(model: ModelSpec, plan: Plan, stage: int = 0, *, norm: str = "composite") -> float:
    """The ``activations`` of torchtitan's job, per block in flight: op-sac :func:`titan_op_sac_terms`, ``full``
    the block input (what its checkpoint wrapper saves), none :func:`titan_block_terms`. Without checkpointing
    a composite norm does not save its bf16 input, but the decoder's loop still holds the running block's input
    when it returns: ``s b h d`` once (the fused norm saves it, so it is in its terms)."""
    view = rank_view(model, plan, stage)
    sbh_d = plan.seq / plan.cp * plan.micro_batch * model.hidden * plan.dtype_bytes / (plan.tp if plan.sp else 1)
    if plan.recompute == "op-sac":
        return float(sum(titan_op_sac_terms(model, plan).values())) * view.blocks_inflight
    if plan.recompute == "full":
        return sbh_d * view.blocks_inflight
    if plan.recompute != "none":
        raise ParallelLabError(f"torchtitan has no {plan.recompute!r} checkpointing; pick none, full or op-sac")
    held = sbh_d if norm == "composite" else 0.0
    return float(sum(titan_block_terms(model, plan, norm=norm).values())) * view.blocks_inflight + held


def titan_loss_terms(model: ModelSpec, plan: Plan, *, chunks: int) -> dict[str, float]:
    """What torchtitan's ``ChunkedLossWrapper`` (``chunks`` per sequence) keeps between two chunks, per
    micro-batch: its ``GradAccumulator``'s fp32 ``[b, s, h]`` buffer; the last chunk's bf16 logits, still bound to
    the loop's ``logits`` when the next chunk enters the head (``s b V d / chunks``); the chunk copies of the
    hidden states and of the int64 labels (``split(dim=1).contiguous()`` copies only when ``b > 1``: at ``b = 1``
    a sequence slice is contiguous); and FSDP2's no-sync accumulation of the head's gradient, upcast to the fp32
    reduce dtype (``FSDPParam.to_accumulated_grad_if_needed``: ``V h 4``, whatever the batch)."""
    _require_titan_block(model, "chunked loss")
    view = rank_view(model, plan, plan.pp - 1)
    d, s, b, h = plan.dtype_bytes, plan.seq / plan.cp, plan.micro_batch, model.hidden
    return {"grad_accumulator": s * b * h * FP32,
            "last_chunk_logits": s * b * view.vocab * d / chunks if chunks > 1 else 0.0,
            "hidden_chunk_copies": s * b * h * d if b > 1 and chunks > 1 else 0.0,
            "label_chunk_copies": s * b * activations.ID_BYTES if b > 1 and chunks > 1 else 0.0,
            "head_grad_fp32": float(view.vocab * h * FP32) if plan.zero == 3 and chunks > 1 else 0.0}


def titan_units(model: ModelSpec, plan: Plan) -> dict[str, list[tuple[int, ...]]]:
    """torchtitan's FSDP2 units (``apply_fsdp_to_decoder``, untied embeddings): ``tok_embeddings``, ``[norm,
    lm_head]``, one per block, each a list of its parameters' local shapes under TP (column-parallel weights
    split their rows, row-parallel ones their columns, the embedding and head their vocabulary)."""
    _require_titan_block(model, "FSDP2 layout")
    view, h, f = rank_view(model, plan), model.hidden, model.ffn // plan.tp
    q, kv, v = view.q_width, view.kv_width, view.vocab
    block = [(q + 2 * kv, h), (h, q), (f, h), (f, h), (h, f), (h,), (h,)]
    return {"tok_embeddings": [(v, h)], "norm+lm_head": [(h,), (v, h)], "block": block}


def titan_fsdp2_buffers(model: ModelSpec, plan: Plan) -> dict[str, float]:
    """FSDP2's buffers for torchtitan's units (:func:`titan_units`), each kind at its own peak (what the tracker
    reports): every parameter padded to ``g ceil(rows / g)`` rows. The largest unit (the output head with the
    final norm, kept unsharded through the chunked loss) sets three: its bf16 unsharded parameters; the head
    weight's bf16 unsharded gradient and its fp32 reduce-scatter input (``post_backward`` reduces only the
    parameters that have a gradient: the norm's comes later); the all-gather output of a unit stays alive until
    the next unit's copy-out (``AllGatherState``), so the largest unit's and a block's together."""
    g, d = plan.dp, plan.dtype_bytes
    if plan.zero != 3 or g == 1:
        return {}

    def numel(shapes: list[tuple[int, ...]]) -> int:
        return sum(padded(s[0], g) * math.prod(s[1:]) for s in shapes)

    units = titan_units(model, plan)
    big = max(units.values(), key=numel)
    head = max(numel([s]) for s in big)
    return {"unsharded_params": numel(big) * d,
            "all_gather": (numel(big) + numel(units["block"])) * d,
            "unsharded_grads": head * d,
            "reduce_scatter": head * FP32}
