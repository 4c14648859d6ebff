"""The ledger's ``activations`` and ``logits_and_loss``: what a rank saves for backward, per micro-batch,
times what it keeps in flight.

Per block, Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(Sec. 4, Table 2): ``sbh (34 + 5 a s / h)`` bytes without parallelism, ``sbh (10 + 24/t + 5as/(ht))`` with
TP, ``sbh/t (34 + 5as/h)`` with SP, generalised as :func:`activation_terms` documents (GQA, SwiGLU,
dropout, flash/fused kernels, CP, MoE, recomputation); or the runnable blocks' saves op by op
(``parallel_lab.activations``, ``formula="per-op"``). A stage holds ``per block x`` the blocks and
micro-batches in flight at its peak (``rank_view.block_inflight``); the last stage also the head's
fp32 log-probabilities and inputs, ``(s/cp) b (4 ceil(V/tp) + 2 h d)`` per kept micro-batch.
"""

from __future__ import annotations

from typing import Any

from . import activations
from .errors import ParallelLabError
from .rank_view import rank_view
from .specs import ModelSpec, Plan

#: Bytes of a dropout mask element (torch keeps a bool mask; Korthikanti counts 1 byte).
MASK_BYTES = 1
#: Cross-entropy works in fp32: the log-probabilities it keeps for backward are 4 bytes each.
LOSS_BYTES = 4


def activation_terms(model: ModelSpec, plan: Plan) -> dict[str, float]:
    """Bytes one transformer block saves for backward for one micro-batch on one GPU, by part.

    Korthikanti et al. 2022 count, per layer, with 2-byte activations and 1-byte dropout masks
    (``s`` sequence, ``b`` micro-batch, ``h`` hidden, ``a`` heads, ``t`` TP degree):

    * attention ``11 sbh + 5 a s^2 b``: the QKV input 2sbh, Q and K 4sbh, V 2sbh, the output projection's
      input 2sbh, the output dropout mask sbh; scores: softmax output 2as^2b, attention dropout output 2as^2b
      and its mask as^2b;
    * MLP ``19 sbh``: input 2sbh, GeLU input 8sbh, second linear's input 8sbh, dropout mask sbh;
    * the two LayerNorms' inputs ``4 sbh``.

    Total ``sbh (34 + 5 a s / h)``. Of the 34, the masks are 2 (one byte each after attention and MLP) and
    the score term's masks are ``a s^2 b``. The parts that TP does not split (norm inputs 4, the QKV and MLP
    inputs 2 + 2, the two masks 1 + 1: 10 sbh) are split by sequence parallelism; Q/K/V/out (8), the MLP
    intermediates (16) and the scores are split by t: ``sbh (10 + 24/t + 5as/(ht))``, with SP
    ``sbh/t (34 + 5as/h)``.

    Generalisation used here (it gives the paper's numbers exactly for a gpt block with dropout in a
    2-byte dtype): every saved activation costs ``d = plan.dtype_bytes`` per element and every mask 1
    byte; no dropout (llama, or ``dropout=0``) means no masks and no dropout output (the scores keep
    only the softmax output, ``d a s^2 b``); key/value widths follow GQA (``kv_heads * head_dim``);
    the llama MLP (SwiGLU) keeps its input, the gate output (SiLU's input), SiLU's output, the up output
    and the down projection's input: ``h + 4 ffn`` elements (gpt: ``h + 2 ffn``). Each norm keeps its input
    (what a fused RMSNorm/LayerNorm kernel saves besides per-row statistics); the tiny model's written-out
    RMSNorm also keeps ``x * rstd``, which the per-op model counts and this formula does not (measured at full
    size in fake tensors, tests/distributed/test_measure.py). Context parallelism
    splits the sequence: the ``sbh`` terms use ``s / cp``; the score term uses the local queries against
    all keys, ``a (s/cp) s b``, whichever CP kind (ring, all-gather and Ulysses all compute exactly that
    many scores per rank; implementations with a fused/flash kernel save none of them, like selective
    recomputation). All-gather CP also keeps the gathered keys and values of the other ranks' blocks for
    backward, ``2 (seq - s/cp) b kv d`` (``cp_gathered_kv``; recomputation re-gathers them instead).

    Kernels (named Plan fields, so a reader sees which model produced a number): ``attention="flash"``
    (FlashAttention, Dao et al. 2022) replaces the score terms by an fp32 log-sum-exp per local query and head,
    ``4 a s b / t`` (the output it keeps is the output projection's input, already counted);
    ``mlp="fused"`` keeps only the first matmuls' outputs: ``mlp_intermediate`` is ``2 f`` per token for
    llama (gate and up outputs) and ``f`` for gpt (the fc output).

    Recomputation: ``selective`` drops the score terms (the attention core is recomputed from Q, K, V);
    ``full`` keeps only the layer input, ``sbh * d`` (Korthikanti's 2sbh; split by t with SP). ``op-sac``
    (torchtitan's op-level selective activation checkpointing) keeps the layer input and every second
    matmul output (llama: wq, wv, gate, down, ``sb (q/t + kv/t + f/t + h) d``;
    ``activations.op_sac_kept_matmuls`` says which). The
    transient working set of the one layer being recomputed is not included (as in the paper).
    """
    model.require_shape("activation memory")
    d, s, b, h = plan.dtype_bytes, plan.seq / plan.cp, plan.micro_batch, model.hidden
    t = plan.tp
    sp = t if plan.sp else 1
    if plan.recompute == "full":
        return {"layer_input": s * b * h * d / sp}
    if plan.recompute == "op-sac":
        return {"layer_input": s * b * h * d / sp,
                "kept_matmul_outputs": s * b * activations.op_sac_kept_width(model, plan) * d}
    drop = model.dropout > 0
    mask = MASK_BYTES if drop else 0
    view = rank_view(model, plan)
    q_local, kv_local, f_local = view.q_width, view.kv_width, model.ffn / t
    sb = s * b
    terms = {
        "norm_inputs": 2 * sb * h * d / sp,
        "attention_input": sb * h * d / sp,
        "qkv": sb * (q_local + 2 * kv_local) * d,
        "attention_output_input": sb * q_local * d,
        "attention_dropout_mask": sb * h * mask / sp,
        "mlp_input": sb * h * d / sp,
        "mlp_intermediate": sb * f_local * _mlp_saved_widths(model, plan) * d,
        "mlp_dropout_mask": sb * h * mask / sp,
    }
    if model.is_moe:
        terms.update(_moe_terms(model, plan, terms["mlp_intermediate"]))
    if plan.recompute == "none" and plan.cp > 1 and plan.cp_kind == "allgather":
        # all-gather CP keeps the gathered K and V for backward (the other ranks' blocks; its own are in qkv)
        terms["cp_gathered_kv"] = 2 * (plan.seq - s) * b * kv_local * d
    if plan.recompute == "none" and plan.attention == "flash":
        terms["log_sum_exp"] = model.heads / t * sb * activations.LSE_BYTES
    elif plan.recompute == "none":
        heads_local = model.heads / t
        score = heads_local * s * plan.seq * b          # local queries x all keys
        terms["scores"] = score * (d + (d + MASK_BYTES if drop else 0))
    return terms


def _moe_terms(model: ModelSpec, plan: Plan, dense_intermediate: float) -> dict[str, float]:
    """A mixture-of-experts block's MLP terms, averaged over the blocks (``first_dense`` of them are dense):
    the dispatched buffer ``E b C h d`` (``E C ~ capacity_factor * top_k * s``), the experts' intermediates on
    their slots and the shared experts' on every token, the picked outputs of the combine ``s b k h d``, and
    the router's fp32 probabilities ``s b E 4`` (ids and gates are per token and expert choice: omitted)."""
    d, s, b, h = plan.dtype_bytes, plan.seq, plan.micro_batch, model.hidden
    moe = model.moe_layers / model.layers
    slots = model.experts * b * model.expert_capacity(plan.seq)
    widths = 2 if model.flavour == "gpt" else 4
    inter = (slots + s * b * model.shared_experts) * model.expert_ffn * widths * d
    return {"mlp_intermediate": dense_intermediate * (1 - moe) + inter * moe,
            "moe_dispatched": slots * h * d * moe,
            "moe_combine": s * b * model.top_k * h * d * moe,
            "moe_router": s * b * model.experts * 4 * moe}


def _mlp_saved_widths(model: ModelSpec, plan: Plan) -> int:
    """ffn-wide tensors the MLP saves per token: eager gpt 2 (GeLU input, proj input), eager llama 4 (gate
    output, SiLU output, up output, down input); fused: only the first matmuls' outputs (gpt 1, llama 2)."""
    if plan.mlp == "fused":
        return 1 if model.flavour == "gpt" else 2
    return 2 if model.flavour == "gpt" else 4


def activation_bytes_per_layer(model: ModelSpec, plan: Plan, *, formula: str = "korthikanti") -> float:
    """Bytes one transformer block saves for backward, per micro-batch, on one GPU.

    ``formula="korthikanti"``: :func:`activation_terms` summed (Korthikanti et al. 2022, generalised);
    ``formula="per-op"``: ``parallel_lab.activations.per_op_bytes(...)["per_block_bytes"]`` (the saved
    tensors of the runnable blocks, op by op). Seed: L=32 layers of s=4096, b=1, h=4096, a=32, no
    recomputation: ``32 * sbh (34 + 5as/h) = 104,152,956,928`` bytes.
    """
    if formula == "korthikanti":
        return float(sum(activation_terms(model, plan).values()))
    if formula == "per-op":
        return float(_per_op(model, plan)["per_block_bytes"])
    raise ParallelLabError(f"activation formula {formula!r} is not known; pick korthikanti or per-op")


def _per_op(model: ModelSpec, plan: Plan, layers: int | None = None) -> dict[str, Any]:
    """``parallel_lab.activations.per_op_bytes``: ``per_block_bytes`` and the ``block``/``shared``/
    ``embedding``/``head`` entries of one micro-batch."""
    return activations.per_op_bytes(model, plan, layers=layers)


def activation_bytes(model: ModelSpec, plan: Plan, stage: int = 0, *, formula: str = "korthikanti") -> float:
    """Activation bytes of stage ``stage``: per-micro-batch bytes x in-flight micro-batches.

    Korthikanti: per-layer bytes x ``rank_view.block_inflight`` (the stage's blocks x in-flight micro-batches,
    chunk by chunk). Per-op: the same for the blocks, plus what every forward shares (llama's rotary
    tables) and, on stage 0, the embedding's saved inputs, per in-flight micro-batch of the stage.
    """
    view = rank_view(model, plan, stage)
    inflight, blocks = view.inflight, view.blocks_inflight
    if formula == "per-op":
        mine = view.layers
        d = _per_op(model, plan, layers=len(mine))
        extra = sum(e["bytes"] for e in d["shared"])
        if stage == 0:
            extra += sum(e["bytes"] for e in d["embedding"])
        per_block = d["per_block_bytes"]
        if model.is_moe and model.first_dense and mine:      # dense and MoE blocks: the stage's mean block
            per_block = sum(sum(x.nbytes for x in activations.block_saves(model, plan, layer=i))
                            for i in mine) / len(mine)
        return float(per_block * blocks + extra * inflight)
    return activation_bytes_per_layer(model, plan, formula=formula) * blocks


def logits_bytes(model: ModelSpec, plan: Plan, *, formula: str = "korthikanti") -> float:
    """The head's logits and what cross-entropy keeps, on the last stage.

    Per micro-batch: the fp32 log-probabilities that cross-entropy saves for backward (vocabulary-parallel)
    and the two ``s b h`` inputs the final norm and the head keep: ``(s/cp) b (4 ceil(V/tp) + 2 h d)``.
    The logits in the compute dtype are not kept: the loss casts them to fp32 and log_softmax saves only
    its output (measured at full size in fake tensors, distributed/instruments/measure.py). Times the micro-batches
    the last stage keeps at once (``schedules.head_inflight``: GPipe ``m``, ZB-H1 ``min(p, m)`` until the
    delayed W, 1F1B and interleaved 1). Chunked cross-entropy (``plan.loss_chunk > 0``): the same inputs and an fp32
    log-sum-exp per token, ``(s/cp) b (4 + 2 h d)``; the one chunk of logits alive while it is computed,
    ``loss_chunk V 4``, is transient and not counted.
    """
    model.require_shape("logits memory")
    view = rank_view(model, plan, plan.pp - 1)
    kept = view.head_inflight
    if formula == "per-op":
        return float(sum(e["bytes"] for e in _per_op(model, plan)["head"])) * kept
    inputs = 2 * model.hidden * plan.dtype_bytes         # the final norm's and the head's inputs, per token
    if plan.loss_chunk:      # chunked: one fp32 log-sum-exp per token instead of the logits (transient chunk
        return plan.seq / plan.cp * plan.micro_batch * (activations.LSE_BYTES + inputs) * kept   # not counted)
    kept_per_token = view.vocab * LOSS_BYTES + inputs
    per_mb = plan.seq / plan.cp * plan.micro_batch * kept_per_token
    return per_mb * kept


def check_activation_model(activation_model: str) -> None:
    if activation_model not in ("korthikanti", "per-op"):
        raise ParallelLabError(f"activation_model={activation_model!r} is not known; "
                               "pick korthikanti or per-op")


