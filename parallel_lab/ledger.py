"""The memory ledger: bytes per GPU in six named categories, and whether they fit in HBM.

Categories (docs/conventions.md): ``parameters``, ``gradients``, ``optimizer_states`` (the model state),
``activations`` (what the transformer blocks save for backward, times the in-flight micro-batches),
``logits_and_loss`` and ``comm_buffers``.

Model state (Rajbhandari et al. 2020, "ZeRO"). Each parameter costs ``param_bytes + grad_bytes +
optim_bytes`` (2 + 2 + 12 for mixed-precision Adam). ZeRO-1 shards the optimizer states over the
data-parallel ranks, ZeRO-2 also the gradients, ZeRO-3 also the parameters. Gradients are counted at their
peak over the step: ZeRO-2 accumulating over several micro-batches in full gradients (the default
``zero2_accumulate="unsharded"``) holds them whole until the last one (:func:`gradients_sharded`); ZeRO-3 under
a pipeline holds the stage gathered and its full gradients in ``comm_buffers`` (:func:`zero3_held_gradient_bytes`).
Sharding is by *units* (conventions): a unit of ``n`` elements is padded to ``g * ceil(n / g)`` and every rank keeps
``ceil(n / g)`` of them, so a sharded category costs ``sum over units of ceil(n_u / g) * bytes``. The
sharding group ``g`` is the gradient-synchronisation group: ``dp``, or ``dp * cp`` with context parallelism
(conventions: gradients are synchronised over dp x cp, as in Megatron).

What one GPU holds (the TP split of every tensor, the kv-head rule, the vocabulary padding, the pipeline
stages, ZeRO units) is ``parallel_lab.layout``'s; this module only prices it in bytes.

Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (Sec. 4, Table 2), generalised as documented in :func:`activation_bytes_per_layer`.

The total sums each category at its own peak (conservative); :func:`peak_moments` prices what is alive
at named moments of a step instead, checked against torch's tracker in fake tensors.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from . import activations
from .comm import ep_dispatch_bytes
from .layout import (  # noqa: F401  (LocalParam, local_parameters, is_frozen: re-exported, their home is layout)
    LocalParam,
    bucket_bytes,
    chunk_layers,
    grad_comm_bytes,
    is_frozen,
    kv_heads_local,
    kv_replication,
    kv_width_local,
    layers_per_stage,
    local_parameters,
    padded,
    param_comm_bytes,
    q_width_local,
    shard_group,
    shard_size,
    stage_layers,
    stage_params,
    unit_sizes,
    vocab_local,
)
from .schedules.generators import compute_orders
from .schedules.inflight import head_inflight, messages_at_once, peak_activation_units, split_backward
from .specs import ClusterSpec, ModelSpec, ParallelLabError, Plan

CATEGORIES = ("parameters", "gradients", "optimizer_states", "activations", "logits_and_loss", "comm_buffers")
DEFAULT_CLUSTER = "h100-sxm"
#: Bytes of a dropout mask element (torch keeps a bool mask; Korthikanti counts 1 byte).
MASK_BYTES = 1
#: Cross-entropy works in fp32: the log-probabilities it keeps for backward are 4 bytes each.
LOSS_BYTES = 4


# --------------------------------------------------------------------------------------------------
# Model state
# --------------------------------------------------------------------------------------------------

def _stage_or_all(plan: Plan, stage: int | None) -> list[int]:
    if stage is None:
        return list(range(plan.pp))
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < plan.pp:
        raise ParallelLabError(f"stage={stage!r} is not a pipeline stage of pp={plan.pp}; "
                               f"pick 0..{plan.pp - 1}")
    return [stage]


def stage_state_bytes(model: ModelSpec, plan: Plan, stage: int) -> dict[str, float]:
    """:func:`state_bytes` of one stage, for a plan already validated (the planner calls it memoised)."""
    o = plan.optim
    g = shard_group(plan)
    units = list(unit_sizes(model, plan, stage).values())
    full = sum(units)
    sharded = sum(shard_size(n, g) for n in units)
    return {
        "parameters": float((sharded if plan.zero >= 3 else full) * o.param_bytes),
        "gradients": float((sharded if gradients_sharded(plan) else full) * o.grad_bytes),
        "optimizer_states": float((sharded if plan.zero >= 1 else full) * o.optim_bytes),
    }


def gradients_sharded(plan: Plan) -> bool:
    """Whether a rank's gradients stay sharded over the whole step (their peak is ``ceil(n_u / g)`` per
    unit): ZeRO-3; ZeRO-2 unless it holds the full gradients over several micro-batches
    (``zero2_accumulate="unsharded"`` with ``grad_accum > 1``: the peak is the full gradients, between
    micro-batches). A unit's full gradient before its reduce-scatter is a comm buffer."""
    return _gradients_sharded(plan.zero, plan.zero2_accumulate, plan.microbatches)


def _gradients_sharded(zero: int, zero2_accumulate: str, m: int) -> bool:
    if zero == 2:
        return zero2_accumulate == "sharded" or m == 1
    return zero >= 3


def zero_notes(plan: Plan) -> list[str]:
    """What the ZeRO variant of ``plan`` does to gradients and bytes, in words (empty without ZeRO-1/2)."""
    m = plan.microbatches
    if plan.zero == 1 and plan.zero1_reduce == "all_reduce":
        return ["gradients: ZeRO-1 all-reduces the gradients (torch's ZeroRedundancyOptimizer under DDP): "
                "1.5x DDP's bytes; the paper's ZeRO-1 reduce-scatters them (zero1_reduce='reduce_scatter')"]
    if plan.zero == 2 and m > 1 and plan.zero2_accumulate == "unsharded":
        return [f"gradients: ZeRO-2 holds the full gradients until the last of {m} micro-batches, then "
                f"reduce-scatters once; zero2_accumulate='sharded' keeps them sharded and reduce-scatters "
                f"every micro-batch ({m}x the reduce-scatter bytes)"]
    if plan.zero == 2 and m > 1:
        return [f"gradients: ZeRO-2 reduce-scatters every one of the {m} micro-batches into the shard"]
    return []


def state_bytes(model: ModelSpec, plan: Plan, stage: int | None = None) -> dict[str, float]:
    """Model-state bytes per GPU: ``{"parameters", "gradients", "optimizer_states"}``.

    Exact from :meth:`ModelSpec.parameter_shapes` (TP and PP split, ZeRO by units, see the module
    docstring); for a model given as a bare count ``P`` a single unit: ``ceil(P / dp)`` elements per
    sharded category. ``stage=None`` reports the stage with the most state. Example (the seed article):
    ``P = 7e9``, ``dp = 8``, adam-mixed: 112.0, 38.5, 26.25, 14.0 GB for ZeRO 0..3.
    """
    plan.validate(model)
    per = [stage_state_bytes(model, plan, s) for s in _stage_or_all(plan, stage)]
    return max(per, key=lambda d: sum(d.values()))


# --------------------------------------------------------------------------------------------------
# Activations (Korthikanti et al. 2022)
# --------------------------------------------------------------------------------------------------

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
    q_local, kv_local, f_local = q_width_local(model, t), kv_width_local(model, t), model.ffn / t
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


def inflight_microbatches(schedule: str, p: int, m: int, v: int = 1, stage: int = 0) -> float:
    """Micro-batches whose activations stage ``stage`` holds at its peak, in units of the whole stage.

    * no pipeline (``p == 1``): 1 (each micro-batch's backward follows its forward);
    * otherwise the count read off the schedule's own action lists,
      :func:`parallel_lab.schedules.inflight.peak_activation_units` (closed forms checked against the lists):
      GPipe ``m``; 1F1B ``min(m, p - r)`` (Narayanan et al. 2021); ZB-H1 ``min(m, p)`` on every stage,
      counted until the W pass (Qi et al. 2023: the first stage's 1F1B peak, later stages hold more);
      interleaved 1F1B with ``v`` chunks ``min(m v, 2 (p - r - 1) + (v - 1) p + 1) / v``, for stage 0
      Korthikanti et al.'s factor ``p (1 + (p - 1)/(p v))`` (Sec. 4.2.3); ``v = 1`` is plain 1F1B.
    """
    if p < 1 or m < 1 or v < 1 or not 0 <= stage < p:
        raise ParallelLabError(f"in-flight micro-batches need p >= 1, m >= 1, v >= 1, 0 <= stage < p; "
                               f"got p={p}, m={m}, v={v}, stage={stage}")
    if p == 1:
        return 1.0
    return peak_activation_units(schedule, p, m, v, stage)


@functools.lru_cache(maxsize=4096)
def block_inflight(layers: int, schedule: str, pp: int, m: int, v: int, stage: int, split: str = "layers") -> float:
    """Blocks times micro-batches whose activations stage ``stage`` holds at its peak: the multiplier of one
    block's per-micro-batch bytes.

    Equal chunks: the stage's blocks x :func:`inflight_microbatches`. Unequal chunks (slots that do not
    divide ``pp * v``, or ``split="embed-head"`` whose first and last chunks lose a block to the embedding
    and the head): the schedule's own action list of the stage, each forward of chunk ``c`` adding its
    blocks and its backward (ZB-H1: its W) removing them, and the peak of that sum.
    """
    cut = chunk_layers(layers, pp, v, split)
    blocks = [len(cut[c * pp + stage]) for c in range(v)]      # local chunk c is model chunk c * pp + stage
    if pp == 1:
        return float(sum(blocks))
    if len(set(blocks)) == 1:
        return sum(blocks) * inflight_microbatches(schedule, pp, m, v, stage)
    actions = compute_orders(schedule, pp, m, v)[stage]
    split_b = split_backward(list(actions))
    live = peak = 0
    for a in actions:
        if a.kind == "F":
            live += blocks[a.chunk]
        elif (a.kind == "B" and (a.microbatch, a.chunk) not in split_b) or a.kind == "W":
            live -= blocks[a.chunk]
        peak = max(peak, live)
    return float(peak)


def activation_bytes(model: ModelSpec, plan: Plan, stage: int = 0, *, formula: str = "korthikanti") -> float:
    """Activation bytes of stage ``stage``: per-micro-batch bytes x in-flight micro-batches.

    Korthikanti: per-layer bytes x :func:`block_inflight` (the stage's blocks x in-flight micro-batches,
    chunk by chunk). Per-op: the same for the blocks, plus what every forward shares (llama's rotary
    tables) and, on stage 0, the embedding's saved inputs, per in-flight micro-batch of the stage.
    """
    inflight = inflight_microbatches(plan.schedule, plan.pp, plan.microbatches, plan.interleave, stage)
    blocks = block_inflight(model.layers, plan.schedule, plan.pp, plan.microbatches, plan.interleave, stage,
                            plan.pp_split)
    if formula == "per-op":
        mine = stage_layers(model.layers, plan.pp, plan.interleave, stage, plan.pp_split)
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


# --------------------------------------------------------------------------------------------------
# Logits and communication buffers
# --------------------------------------------------------------------------------------------------

def logits_bytes(model: ModelSpec, plan: Plan, *, formula: str = "korthikanti") -> float:
    """The head's logits and what cross-entropy keeps, on the last stage.

    Per micro-batch: the fp32 log-probabilities that cross-entropy saves for backward (vocabulary-parallel)
    and the two ``s b h`` inputs the final norm and the head keep: ``(s/cp) b (4 ceil(V/tp) + 2 h d)``.
    The logits in the compute dtype are not kept: the loss casts them to fp32 and log_softmax saves only
    its output (measured at full size in fake tensors, distributed/instruments/measure.py). Times the micro-batches
    the last stage keeps at once (``schedules.inflight.head_inflight``: GPipe ``m``, ZB-H1 ``min(p, m)`` until the
    delayed W, 1F1B and interleaved 1). Chunked cross-entropy (``plan.loss_chunk > 0``): the same inputs and an fp32
    log-sum-exp per token, ``(s/cp) b (4 + 2 h d)``; the one chunk of logits alive while it is computed,
    ``loss_chunk V 4``, is transient and not counted.
    """
    model.require_shape("logits memory")
    kept = head_inflight(plan.schedule, plan.pp, plan.microbatches, plan.interleave)
    if formula == "per-op":
        return float(sum(e["bytes"] for e in _per_op(model, plan)["head"])) * kept
    inputs = 2 * model.hidden * plan.dtype_bytes         # the final norm's and the head's inputs, per token
    if plan.loss_chunk:      # chunked: one fp32 log-sum-exp per token instead of the logits (transient chunk
        return plan.seq / plan.cp * plan.micro_batch * (activations.LSE_BYTES + inputs) * kept   # not counted)
    kept_per_token = vocab_local(model, plan.tp) * LOSS_BYTES + inputs
    per_mb = plan.seq / plan.cp * plan.micro_batch * kept_per_token
    return per_mb * kept


def zero3_gathered_bytes(model: ModelSpec, plan: Plan, stage: int = 0) -> int:
    """Peak bytes of gathered (unsharded) parameters of ZeRO-3 on one rank of ``stage``.

    Per block units: the root unit (gathered when forward starts, kept until its gradient is complete)
    plus the two largest block units (the one computing and the next one, prefetched); with
    ``zero_unit="root"``: the whole padded model. Units padded to ``g * ceil(n / g)`` elements, in the
    gathered dtype (``layout.param_comm_bytes``). 0 without ZeRO-3. ``distributed/zero/zero.py`` measures this peak.
    """
    g = shard_group(plan)
    if plan.zero != 3 or g == 1:
        return 0
    units = {u: padded(n, g) for u, n in unit_sizes(model, plan, stage).items()}
    if plan.pp > 1:                          # under a pipeline the whole stage stays gathered through the step
        return sum(units.values()) * param_comm_bytes(plan)
    blocks = sorted((n for u, n in units.items() if u != "root"), reverse=True)
    return (units.get("root", 0) + sum(blocks[:2])) * param_comm_bytes(plan)


def zero3_held_gradient_bytes(model: ModelSpec, plan: Plan, stage: int = 0) -> int:
    """Bytes of full (unsharded) gradients that ZeRO-3 under a pipeline holds on one rank of ``stage``.

    With ``pp > 1`` the stage's units stay gathered through the step and each unit's flat gradient is
    summed over the micro-batches in the reduce dtype until the reduce-scatter at the end of the step:
    the whole stage, padded, ``sum_u g ceil(n_u / g) * d_reduce``, plus (when the compute dtype differs)
    one unit's compute-dtype gradient being added in, ``max_u g ceil(n_u / g) * d_param``. This is what
    FSDP2 does under ``torch.distributed.pipelining``: without gradient sync until the last backward it
    accumulates the unsharded gradients in ``reduce_dtype`` (fp32); Meta's Llama 3 run too ("gradients
    accumulated in FP32"). 0 without ZeRO-3 or a pipeline (then one unit's gradient at a time is in
    flight: :func:`zero3_reduce_input_bytes`). ``distributed/zero/fsdp.py`` measures this peak
    (``info["peak_held_gradient_bytes"]``).
    """
    g = shard_group(plan)
    if plan.zero != 3 or g == 1 or plan.pp == 1:
        return 0
    units = [padded(n, g) for n in unit_sizes(model, plan, stage).values()]
    pb, gb = param_comm_bytes(plan), grad_comm_bytes(plan)
    return sum(units) * gb + (max(units) * pb if pb != gb else 0)


def zero3_reduce_input_bytes(model: ModelSpec, plan: Plan, stage: int = 0) -> int:
    """Bytes of one unit's full gradient on its way to the reduce-scatter (ZeRO-3 without a pipeline).

    When a unit's flat gradient is complete it is cast to the reduce dtype (fp32, ``grad_comm_bytes``):
    for a moment the gathered-dtype gradient and its fp32 copy both exist, ``g ceil(n / g) (d_param +
    d_reduce)`` for the largest unit (one copy when the dtypes agree: fp32 training casts nothing). The
    previous unit's reduce-scatter completes before the next cast (one in flight). 0 without ZeRO-3, or
    under a pipeline (:func:`zero3_held_gradient_bytes`). ``distributed/zero/fsdp.py`` measures this peak
    (``info["peak_reduce_input_bytes"]``).
    """
    g = shard_group(plan)
    if plan.zero != 3 or g == 1 or plan.pp > 1:
        return 0
    big = max(padded(n, g) for n in unit_sizes(model, plan, stage).values())
    pb, gb = param_comm_bytes(plan), grad_comm_bytes(plan)
    return big * (pb + gb if pb != gb else gb)


def comm_buffer_bytes(model: ModelSpec, plan: Plan, stage: int = 0) -> tuple[float | None, list[str]]:
    """Transient communication buffers at the peak, with one note per part: the model-state part
    (:func:`state_buffer_bytes`) plus the activation part (:func:`activation_buffer_bytes`), the sum of
    :func:`comm_buffer_parts`.

    Returns ``(None, notes)`` when the buffers cannot be computed (ZeRO on a bare parameter count).
    """
    state, notes = state_buffer_bytes(model, plan, stage)
    if state is None:
        return None, notes
    return state + (activation_buffer_bytes(model, plan, stage) if model.shape_known else 0.0), notes


def comm_buffer_parts(model: ModelSpec, plan: Plan, stage: int = 0) -> dict[str, float] | None:
    """:func:`comm_buffer_bytes` by part, each at its own peak (the parts the runnable code samples in
    ``tracer.buffers``, ``distributed/instruments/memory.py``; zero parts left out): ``zero_reduce``,
    ``zero_gather``, ``zero3_gathered``, ``zero3_reduce_input``, ``zero3_held_gradients``, ``sp``, ``pp``,
    ``cp``. None where :func:`state_buffer_bytes` is."""
    state, _ = state_buffer_parts(model, plan, stage)
    if state is None:
        return None
    parts = {**state, **(activation_buffer_parts(model, plan, stage) if model.shape_known else {})}
    return {k: v for k, v in parts.items() if v}


def state_buffer_bytes(model: ModelSpec, plan: Plan, stage: int = 0) -> tuple[float | None, list[str]]:
    """The data-parallel buffers of ``stage`` at the peak (they depend on its parameters only), the sum of
    :func:`state_buffer_parts`, with one note per part."""
    parts, notes = state_buffer_parts(model, plan, stage)
    return (None if parts is None else float(sum(parts.values()))), notes


def state_buffer_parts(model: ModelSpec, plan: Plan, stage: int = 0) -> tuple[dict[str, float] | None, list[str]]:
    """The data-parallel buffers of ``stage`` by part, each at its own peak (``S = ceil(n / g)`` elements of
    the largest unit, ``g S`` padded):

    * DDP: none. The bucketed gradients are views into the buckets (torch's ``gradient_as_bucket_view=True``,
      also while accumulating), the naive all-reduce works in place on ``.grad``;
    * ZeRO-1/2, ``zero_reduce``: the largest unit's padded flat gradient ``g S`` (the reduce input) and,
      where the output is a temporary, its shard ``S`` (ZeRO-1's reduce-scatter, whose output is written
      into the full ``.grad``; ZeRO-2 reducing every micro-batch, whose output is added to the shard;
      counted also at ``m = 1``, where it is the shard itself); ``zero_gather``: the step's all-gather of the
      updated unit, its padded output ``g S`` and its input shard ``S`` in the parameter dtype;
    * ZeRO-3: the gathered root unit (kept from the start of forward to the end of backward), plus two
      gathered block units (the one in use and the prefetched next one), plus the largest unit's full
      gradient awaiting its reduce-scatter (:func:`zero3_reduce_input_bytes`); under a pipeline the whole
      stage gathered and its full gradients held (:func:`zero3_held_gradient_bytes`).
    """
    notes: list[str] = []
    parts: dict[str, float] = {}
    g = shard_group(plan)
    gb, pb = grad_comm_bytes(plan), param_comm_bytes(plan)
    if g > 1 and plan.zero == 0 and plan.dp_kind == "bucketed":
        notes.append("comm_buffers: none for DDP's buckets: the gradients are views into them "
                     "(torch's default, gradient_as_bucket_view=False, would keep a second copy)")
    if g > 1 and plan.zero:
        if not model.shape_known:
            notes.append(f"comm_buffers: not computed; a bare parameter count gives no ZeRO-{plan.zero} unit sizes "
                         "(give the shape)")
            if plan.zero == 3 and plan.zero_unit == "block":
                notes.append("ZeRO-3 on a bare count: taken as many small units (one per block, the rest "
                             "negligible), each gathered before its forward and again before its backward "
                             "(comm: 1.5x DDP) and none held gathered (parameters: fully sharded)")
            return None, notes
        big = max(padded(n, g) for n in unit_sizes(model, plan, stage).values())
        if plan.zero in (1, 2):
            temp_out = ((plan.zero == 1 and plan.zero1_reduce == "reduce_scatter")
                        or (plan.zero == 2 and plan.zero2_accumulate == "sharded"))
            parts["zero_reduce"] = float(big * gb + (big // g * gb if temp_out else 0))
            parts["zero_gather"] = float((big + big // g) * pb)
            notes.append("comm_buffers: the largest unit's flat gradient" + (" and its reduced shard" if temp_out
                         else "") + "; its gathered parameters and their shard in the step")
        elif plan.pp > 1:
            parts["zero3_gathered"] = float(zero3_gathered_bytes(model, plan, stage))
            parts["zero3_held_gradients"] = float(zero3_held_gradient_bytes(model, plan, stage))
            notes.append("comm_buffers: ZeRO-3 under a pipeline keeps the stage's units gathered through the "
                         "step and their full gradients accumulating until the reduce_scatter at its end "
                         "(FSDP's reshard_after_forward=False with gradient sync on the last backward)")
        else:
            parts["zero3_gathered"] = float(zero3_gathered_bytes(model, plan, stage))
            parts["zero3_reduce_input"] = float(zero3_reduce_input_bytes(model, plan, stage))
            if plan.zero_unit == "root":
                notes.append("comm_buffers: ZeRO-3 with a single root unit gathers the whole model at once "
                             "(no peak saving) + its full gradient before the reduce_scatter")
            else:
                notes.append("comm_buffers: ZeRO-3 gathered root unit + 2 gathered blocks (prefetch) + the "
                             "largest unit's full gradient (and its fp32 copy) before its reduce_scatter")
    return parts, notes


def pp_message_bytes(model: ModelSpec, plan: Plan) -> float:
    """One pipeline message: a micro-batch's activation at a stage boundary, ``s b h`` (``s = seq / cp``),
    split by tp with SP."""
    return plan.seq / plan.cp * plan.micro_batch * model.hidden * plan.dtype_bytes / (plan.tp if plan.sp else 1)


def activation_buffer_bytes(model: ModelSpec, plan: Plan, stage: int = 0) -> float:
    """The activation-sized buffers in flight on ``stage`` (all but ``pp`` the same on every stage), the sum of
    :func:`activation_buffer_parts`."""
    return float(sum(activation_buffer_parts(model, plan, stage).values()))


def activation_buffer_parts(model: ModelSpec, plan: Plan, stage: int = 0) -> dict[str, float]:
    """The activation-sized buffers by part, each at its own peak (``s = seq / cp`` local tokens):

    * ``sp``: one full-sequence ``s b h`` tensor (the all-gather's output, the reduce-scatter's input; the
      activation formula stores only the sharded copy); with ``b > 1`` two, since the batch-first layout
      reorders the rank-major gathered shards into a copy (``tp_communications``);
    * ``pp``: the activations (``s b h``, split by tp with SP) that one P2P action of the stage's list
      posts together at most, :func:`schedules.inflight.messages_at_once`: 1F1B's steady state a send and a receive,
      GPipe's last stage one receive, interleaved 1F1B and DualPipeV up to four;
    * ``cp``: all-gather: backward's reduce-scatter of dK and dV, its input (every rank's blocks, ``seq``
      tokens: the gathered K and V forward are saved for backward, activations) and its output (this rank's
      block), ``2 b kv (seq + s) d``; ring: backward's step, where the K, V block being computed on, the
      next one arriving, the dK, dV block sent on (cast to the compute dtype) and the one arriving are
      alive together, four ``2 s b kv d`` blocks (three with cp = 2: no next block at the last step; the
      fp32 accumulators of dK, dV are working memory, as all-gather's; the forward holds at most two);
      Ulysses: the first all-to-all's input and output, Q, K and V of the local tokens (key/value heads
      repeated :func:`layout.kv_replication` times), ``2 s b (q + 2 kv f) d`` (backward's last one is as
      large);
    * ``ep``: one all-to-all's input and output, ``2 E b C h d`` (:func:`comm.ep_dispatch_bytes`: the
      dispatched slots going out and the ones arriving), plus ``h d`` in backward's combine, whose
      incoming gradient is a view of the gradient of the buffer padded with the empty slots' zero row.
    """
    d, s, b, h = plan.dtype_bytes, plan.seq / plan.cp, plan.micro_batch, model.hidden
    parts: dict[str, float] = {}
    if plan.sp:
        parts["sp"] = s * b * h * d * (2 if b > 1 else 1)
    if plan.pp > 1:
        messages = messages_at_once(plan.schedule, plan.pp, plan.microbatches, plan.interleave)[stage]
        parts["pp"] = messages * pp_message_bytes(model, plan)
    if plan.cp > 1:
        kv = kv_width_local(model, plan.tp)
        if plan.cp_kind == "ring":
            parts["cp"] = (3 if plan.cp == 2 else 4) * 2 * s * b * kv * d
        elif plan.cp_kind == "allgather":
            parts["cp"] = 2 * (plan.seq + s) * b * kv * d
        else:
            f = kv_replication(model.heads // plan.tp, kv_heads_local(model, plan.tp), plan.cp)
            parts["cp"] = 2 * s * b * (q_width_local(model, plan.tp) + 2 * kv * f) * d
    if plan.ep > 1 and model.is_moe:       # + one row: combine's incoming gradient is a view of the padded
        parts["ep"] = 2.0 * ep_dispatch_bytes(model, plan) + model.hidden * d    # (E b C + 1, h) one
    return parts


# --------------------------------------------------------------------------------------------------
# The ledger
# --------------------------------------------------------------------------------------------------

@dataclass
class MemoryLedger:
    """Bytes per GPU by category, for one pipeline stage, and the verdict against HBM.

    ``peak``: :func:`peak_moments` of the plan (its fullest stage, or the stage asked for), priced with the
    same activation model; None for a model given as a bare count. ``fits`` is ``need_bytes <= hbm_bytes *
    (1 - margin)``, where ``need_bytes`` is the larger of the total (every category at its own peak) and the
    peak at one moment: the moment's transients (eager attention's ``s^2`` score gradients, the loss's fp32
    logit gradients) belong to no category and can exceed the categories' sum.
    """

    per_gpu_bytes: dict[str, float]
    hbm_bytes: float
    margin: float
    stage: int = 0
    notes: list[str] = field(default_factory=list)
    peak: PeakMoments | None = None

    @property
    def total_bytes(self) -> float:
        return float(sum(self.per_gpu_bytes.values()))

    @property
    def need_bytes(self) -> float:
        """What the verdict weighs: the total, or the peak at one moment where that is larger."""
        return max(self.total_bytes, self.peak.peak_bytes if self.peak is not None else 0.0)

    @property
    def peak_decides(self) -> bool:
        """Whether the peak at one moment, not the total, is what the verdict weighs."""
        return self.peak is not None and self.peak.peak_bytes > self.total_bytes

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.hbm_bytes * (1 - self.margin)

    @property
    def state_bytes(self) -> float:
        return sum(self.per_gpu_bytes.get(k, 0.0) for k in ("parameters", "gradients", "optimizer_states"))

    def to_json(self) -> dict[str, Any]:
        return {"per_gpu_bytes": dict(self.per_gpu_bytes), "total_bytes": self.total_bytes,
                "need_bytes": self.need_bytes, "hbm_bytes": self.hbm_bytes, "fits": self.fits,
                "margin": self.margin, "stage": self.stage, "notes": list(self.notes)}


def _ledger_of_stage(model: ModelSpec, plan: Plan, cluster: ClusterSpec, activation_model: str,
                     stage: int, margin: float) -> MemoryLedger:
    per = dict(stage_state_bytes(model, plan, stage))
    notes: list[str] = zero_notes(plan)
    if model.shape_known:
        per["activations"] = activation_bytes(model, plan, stage, formula=activation_model)
        if stage == plan.pp - 1:
            per["logits_and_loss"] = logits_bytes(model, plan, formula=activation_model)
        else:
            per["logits_and_loss"] = 0.0
        inflight = inflight_microbatches(plan.schedule, plan.pp, plan.microbatches, plan.interleave, stage)
        if plan.pp > 1:
            n_layers = len(stage_layers(model.layers, plan.pp, plan.interleave, stage, plan.pp_split))
            blocks = block_inflight(model.layers, plan.schedule, plan.pp, plan.microbatches, plan.interleave,
                                    stage, plan.pp_split)
            notes.append(f"activations: {n_layers} layers "
                         f"x {inflight:g} in-flight micro-batches ({plan.schedule})"
                         + ("" if blocks == n_layers * inflight else
                            f"; unequal chunks: peak {blocks:g} block-micro-batches from the schedule"))
            counts = layers_per_stage(model.layers, plan.pp, plan.interleave, plan.pp_split)
            if len(set(counts)) > 1:
                notes.append(f"layers per stage: {', '.join(map(str, counts))} ({model.layers} layers over "
                             f"{plan.pp} stages, uneven" + (", the embedding and the head taking a slot each)"
                                                            if plan.pp_split == "embed-head" else ")"))
        if plan.recompute == "full":
            notes.append("activations: full recomputation keeps the layer inputs only; the transient "
                         "activations of the one layer being recomputed are not counted")
    else:
        notes.append(f"{model.name}: given as a bare parameter count, so activations and logits are not "
                     "computed (give --model or --layers/--hidden/--heads)")
    cb, cb_notes = comm_buffer_bytes(model, plan, stage)
    if cb is not None:
        per["comm_buffers"] = cb
    notes += cb_notes
    return MemoryLedger({k: per[k] for k in CATEGORIES if k in per}, cluster.hbm_bytes, margin, stage, notes)


def _check_activation_model(activation_model: str) -> None:
    if activation_model not in ("korthikanti", "per-op"):
        raise ParallelLabError(f"activation_model={activation_model!r} is not known; "
                               "pick korthikanti or per-op")


def memory(model: ModelSpec, plan: Plan, cluster: ClusterSpec | None = None, *,
           activation_model: str = "korthikanti", stage: int | None = None,
           margin: float = 0.1) -> MemoryLedger:
    """The memory ledger per GPU of ``plan`` training ``model`` on ``cluster`` (default h100-sxm).

    ``stage=None`` reports the pipeline stage with the largest total (usually stage 0), and the peak at one
    moment of the stage where it is highest. ``activation_model``: ``"korthikanti"`` (formulas) or
    ``"per-op"`` (saved tensors of the real blocks). The verdict weighs the larger of the two
    (:class:`MemoryLedger`).
    """
    _check_activation_model(activation_model)
    if not 0 <= margin < 1:
        raise ParallelLabError(f"margin={margin} must be a fraction in [0, 1); e.g. margin=0.1")
    cluster = cluster or ClusterSpec.preset(DEFAULT_CLUSTER)
    plan.validate(model)
    ledgers = [_ledger_of_stage(model, plan, cluster, activation_model, s, margin)
               for s in _stage_or_all(plan, stage)]
    led = max(ledgers, key=lambda led: led.total_bytes)
    if model.shape_known:
        led.peak = peak_moments(model, plan, stage, activation_model=activation_model)
    return led


# --------------------------------------------------------------------------------------------------
# The peak at one moment (beside the ledger's sum of per-category peaks)
# --------------------------------------------------------------------------------------------------

#: The moments of a step :func:`peak_moments` prices, in the order they happen.
MOMENTS = ("loss", "loss backward", "first backward", "second backward", "root gradient", "root reduce-scatter",
           "step")


@dataclass
class PeakMoments:
    """Bytes alive at named moments of one training step on one GPU of ``stage``, part by part.

    ``moments[name]`` maps a part (a ledger category as alive at that moment, or a named transient that no
    category holds) to bytes. The peak is the moment with the largest sum (:attr:`peak`).
    """

    stage: int
    moments: dict[str, dict[str, float]]
    activation_model: str = "per-op"          # what priced the in-flight saves (peak_moments' docstring)

    def total(self, moment: str) -> float:
        return float(sum(self.moments[moment].values()))

    @property
    def peak(self) -> str:
        """The moment where the step's memory peaks."""
        return max(self.moments, key=self.total)

    @property
    def peak_bytes(self) -> float:
        return self.total(self.peak)

    def to_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "peak": self.peak, "peak_bytes": self.peak_bytes,
                "activation_model": self.activation_model,
                "moments": {k: {"total": self.total(k), "parts": dict(v)} for k, v in self.moments.items()}}


def _root_gradient_moments(plan: Plan, units: dict[str, int], state: dict[str, float]
                           ) -> tuple[dict[str, float], dict[str, float]]:
    """ZeRO-3 without a pipeline, the end of backward (``distributed/zero/fsdp.py``), two moments:

    * ``root gradient`` (the token embedding's backward): the root unit (embedding, head, final norm) still
      gathered; its parameters' gradients in the gathered dtype beside the unit's flat gradient they are
      summed into; the previous unit's reduce-scatter in flight (its fp32 flat gradient: it completes at
      the next reduce-scatter);
    * ``root reduce-scatter``: the root unit freed, its flat gradient and fp32 copy
      (:func:`zero3_reduce_input_bytes`'s rule) and the fp32 output shard.

    Both hold the other units' reduced fp32 shards (all units' after an earlier micro-batch). Measured in
    fake tensors: tests/test_peak.py (FlashAttention at 2K tokens, where no saved activation hides them)."""
    g, pb, gb = shard_group(plan), param_comm_bytes(plan), grad_comm_bytes(plan)
    n_root = units.get("root", 0)
    others = [n for k, n in units.items() if k != "root"]
    shards = sum(shard_size(n, g) for n in others) + (shard_size(n_root, g) if plan.microbatches > 1 else 0)
    state_parts = {"parameters": state["parameters"], "optimizer_states": state["optimizer_states"],
                   "gradients": float(shards * gb)}
    flat = padded(n_root, g)
    summing = {**state_parts, "gathered units": float(flat * pb),
               "root unit's flat gradient and its parameters' gradients": float((flat + n_root) * pb),
               "previous unit's reduce-scatter input": float(padded(others[0], g) * gb) if others else 0.0}
    cast = 0 if pb == gb else flat * gb
    reducing = {**state_parts, "root unit's flat gradient and its fp32 copy": float(flat * pb + cast),
                "reduce-scatter output shard": float(flat // g * gb)}
    return summing, reducing


def _grads_before(model: ModelSpec, plan: Plan, stage: int, state: dict[str, float]) -> float:
    """Gradient bytes alive during the forward/backward of the stage's peak micro-batch that earlier
    micro-batches (or a persistent buffer) made: bucketed DDP's flat buckets always exist (they are
    ``.grad``); any variant holds what accumulation keeps once a backward precedes the activation peak
    (``m`` > the stage's in-flight micro-batches): full gradients (ZeRO-0/1, ZeRO-2 unsharded), the shards
    (ZeRO-2 sharded, ZeRO-3), ZeRO-3 under a pipeline its held full gradients."""
    full = state["gradients"] if not gradients_sharded(plan) else float(
        sum(unit_sizes(model, plan, stage).values()) * plan.optim.grad_bytes)
    bucketed = plan.zero == 0 and plan.dp_kind == "bucketed" and shard_group(plan) > 1
    inflight = inflight_microbatches(plan.schedule, plan.pp, plan.microbatches, plan.interleave, stage)
    accumulated = plan.microbatches > inflight
    if not accumulated:
        return full if bucketed else 0.0
    if plan.zero == 3 and plan.pp > 1:
        return float(zero3_held_gradient_bytes(model, plan, stage))
    if plan.zero >= 2 and gradients_sharded(plan):
        return state["gradients"]
    return full          # bucketed DDP accumulates into its buckets (gradients are bucket views, no copy)


def _fresh_grads(model: ModelSpec, plan: Plan, stage: int, last_stage: bool) -> float:
    """Weight gradients the peak micro-batch has made when backward reaches the last block's attention core
    (the head's on the last stage, the block's output projection, MLP norm and MLP) as new tensors: in the
    gathered dtype under ZeRO-3 (they wait for their unit's other gradients), else in the gradient dtype;
    none where they land in an existing buffer (bucketed DDP copies each into its bucket at once; gradient
    accumulation adds into ``.grad``)."""
    bucketed = plan.zero == 0 and plan.dp_kind == "bucketed" and shard_group(plan) > 1
    inplace = plan.microbatches > 1 and (plan.zero < 2 or not gradients_sharded(plan))
    if (bucketed or inplace) and not (plan.zero == 3 and plan.pp == 1):
        return 0.0
    params = local_parameters(model, plan, stage)
    blocks = [p.name.split(".")[1] for p in params if p.name.startswith("blocks.")]
    last = f"blocks.{blocks[-1]}." if blocks else None
    after_core = (".attn.wo.", ".mlp_norm.", ".mlp.")
    n = sum(p.numel for p in params
            if (last and p.name.startswith(last) and any(k in p.name[len(last) - 1:] for k in after_core))
            or (last_stage and (p.name.startswith(("final_norm.", "lm_head.")))))
    return float(n * (param_comm_bytes(plan) if plan.zero == 3 else plan.optim.grad_bytes))


def _after_core_bytes(model: ModelSpec, plan: Plan) -> float:
    """Bytes of one block's saves that backward frees before it reaches the attention core: everything the
    per-op model lists after the core (the output projection's input unless a flash core shares it)."""
    saves = activations.block_saves(model, plan)
    ops = [x.op for x in saves]
    if "attn.wo" not in ops or plan.recompute in ("full", "op-sac"):
        return 0.0
    start = ops.index("attn.wo") + (1 if plan.attention == "flash" and plan.recompute != "selective" else 0)
    return float(sum(x.nbytes for x in saves[start:]))


def _core_backward_bytes(model: ModelSpec, plan: Plan) -> dict[str, float]:
    """The attention core's backward working set of one block (``cp = 1``): eager attention holds the
    gradients of the probabilities and of the scores together, ``2 a s_q s_k b d``; selective recompute adds
    the re-run core's saves (the probabilities, q, k, v), full recompute the re-run block's saves up to
    the core. Flash: no ``s^2`` tensor (its gradients of q, k, v are ``s b h``-sized, not counted)."""
    if plan.cp > 1:
        return {}
    t = activations.local_dims(model, plan)
    out: dict[str, float] = {}
    eager = plan.attention == "eager"
    if eager:
        out["score and probability gradients"] = 2.0 * t.b * t.heads * t.s * t.s * plan.dtype_bytes
    plain = activations.block_saves(model, plan.with_(recompute="none", attention="eager" if eager else "flash"))
    if plan.recompute == "selective":           # the core's own saves (eager: q, k^T, probabilities, v)
        out["recomputed core"] = float(sum(x.nbytes for x in plain if x.op.startswith("core")))
    elif plan.recompute == "full":
        ops = [x.op for x in plain]
        out["recomputed block"] = float(sum(x.nbytes for x in plain[:ops.index("attn.wo")]))
    return out


def _mask_bytes(model: ModelSpec, plan: Plan, backward: bool) -> float:
    """The eager core's causal mask bias ``(1, 1, s, s)`` in the compute dtype: one per forward, kept to
    backward by selective/full recompute (an input of the checkpointed core), by a pipeline stage for each
    of its ``m`` micro-batches; freed after the forward otherwise (measured: README, "Measured at real scale")."""
    if plan.attention != "eager" or plan.cp > 1:
        return 0.0
    one = float(plan.seq * plan.seq * plan.dtype_bytes)
    if plan.pp > 1:
        return one * plan.microbatches
    return one if plan.recompute in ("selective", "full") or not backward else 0.0


def _step_temporaries(model: ModelSpec, plan: Plan, stage: int) -> float:
    """The optimizer step's transients: AdamW (``foreach=False``) makes two fp32 temporaries of the
    largest parameter it steps (per-parameter without ZeRO, a unit's shard with ZeRO); ``adam-mixed``
    without ZeRO also casts every gradient to an fp32 copy first (``MasterAdamW``); ZeRO-1/2 then gathers
    the largest unit's updated parameters (its flat buffer and the shard cast for the all-gather)."""
    g = shard_group(plan)
    units = unit_sizes(model, plan, stage)
    if plan.zero >= 1:
        largest = max(shard_size(n, g) for n in units.values())
    else:
        largest = max(p.numel for p in local_parameters(model, plan, stage))
    if plan.optimizer == "sgd-momentum":
        temps = 0.0
    else:
        temps = 2.0 * largest * 4
    if plan.optimizer == "adam-mixed" and plan.zero == 0:
        temps += sum(units.values()) * 4
    if plan.zero in (1, 2) and g > 1:
        big = max(padded(n, g) for n in units.values())
        temps = max(temps, (big + shard_size(big, g)) * param_comm_bytes(plan))
    return temps


def peak_moments(model: ModelSpec, plan: Plan, stage: int | None = None, *,
                 activation_model: str = "per-op") -> PeakMoments:
    """Bytes alive at up to seven moments of one steady-state step on ``stage``, by part; the peak is their max.

    The ledger's ``total_bytes`` sums each category at its own peak; here each moment counts what exists
    then. ``activation_model`` prices the saved activations and logits of the in-flight micro-batches (the
    ``activations`` and ``logits_and_loss`` parts, the same as :func:`memory`'s); the transients of each
    moment (a core's working set, gradients in flight) and which of a block's saves backward has freed are
    always the runnable kernels' (per-op). With ``"per-op"`` every part is what torch holds, measured in
    fake tensors (tests/test_peak.py). Rules, torch's autograd as measured here (distributed/instruments/measure.py,
    README "Measured at real scale"):

    * parameters and optimizer states: always (the moments exist from the first step on);
    * gradients: :func:`_grads_before` during forward/backward; after the reduction at the step;
    * ``loss`` (last stage: the cross-entropy's forward): every in-flight activation, the kept logits, and
      the logits in the compute dtype and their fp32 cast (``loss_chunk``: one chunk's); ZeRO-3 the root unit;
    * ``loss backward``: the kept logits plus the gradients of the log-probabilities and of the fp32
      logits, ``2 s b V 4`` (``loss_chunk``: one chunk's, plus the fp32 head-weight gradient accumulator and
      an fp32 copy of the weight, ``2 V h 4``); ZeRO-3's root unit gathered;
    * ``first backward`` (the last block's attention core): activations less the block's saves after the
      core (:func:`_after_core_bytes`), the core's working set (:func:`_core_backward_bytes`), the fresh
      weight gradients (:func:`_fresh_grads`), the gradients of the residual stream and the core's output
      ``2 s b h d``, the logits freed (but other kept micro-batches'), ZeRO-3's gathered units
      (:func:`zero3_gathered_bytes`); its reduce-scatter input comes later;
    * ``second backward`` (ZeRO-3 without a pipeline): the next block's core, with the last block's saves
      freed and its flat gradient, cast to fp32, reducing (measured with full recompute: tests/test_peak.py);
    * ``root gradient`` and ``root reduce-scatter`` (ZeRO-3 without a pipeline): the end of backward,
      :func:`_root_gradient_moments`;
    * ``step``: state with the reduced gradients and :func:`_step_temporaries`; no activations.

    Pipeline and SP/CP activation buffers (:func:`activation_buffer_bytes`) count in forward and backward;
    the eager causal mask per :func:`_mask_bytes`. Not a moment of every stage: ``loss`` and ``loss
    backward`` only on the last. ``stage=None``: the stage with the highest peak.
    """
    plan.validate(model)
    model.require_shape("the peak at one moment")
    _check_activation_model(activation_model)
    if stage is None:
        return max((peak_moments(model, plan, s, activation_model=activation_model) for s in range(plan.pp)),
                   key=lambda pm: pm.peak_bytes)
    _stage_or_all(plan, stage)
    state = stage_state_bytes(model, plan, stage)
    last = stage == plan.pp - 1
    base = {"parameters": state["parameters"], "optimizer_states": state["optimizer_states"],
            "gradients": _grads_before(model, plan, stage, state)}
    act = activation_bytes(model, plan, stage, formula=activation_model)
    logits = logits_bytes(model, plan, formula=activation_model) if last else 0.0
    bufs = activation_buffer_bytes(model, plan, stage)
    g = shard_group(plan)
    units = unit_sizes(model, plan, stage)
    unpiped_zero3 = plan.zero == 3 and g > 1 and plan.pp == 1
    gathered = float(zero3_gathered_bytes(model, plan, stage))
    root = gathered
    if unpiped_zero3:                                  # between blocks only the root unit stays gathered
        root = float(padded(units.get("root", 0), g) * param_comm_bytes(plan))
    t = activations.local_dims(model, plan)
    rows, vocab = t.b * t.s, vocab_local(model, plan.tp)
    moments: dict[str, dict[str, float]] = {}
    if last:
        cast = 0 if plan.dtype_bytes == LOSS_BYTES else LOSS_BYTES
        loss_rows = min(plan.loss_chunk, rows) if plan.loss_chunk else rows
        moments["loss"] = {**base, "activations": act, "logits_and_loss": logits,
                           "logits and their fp32 cast": float(loss_rows * vocab * (plan.dtype_bytes + cast)),
                           "gathered units": root, "activation buffers": bufs,
                           "causal mask": _mask_bytes(model, plan, backward=False)}
        moments["loss backward"] = {**base, "activations": act, "logits_and_loss": logits,
                                    "log-probability and logit gradients": float(2 * loss_rows * vocab * LOSS_BYTES),
                                    "gathered units": root, "activation buffers": bufs,
                                    "causal mask": _mask_bytes(model, plan, backward=True)}
        if plan.loss_chunk:          # kernels.ChunkedLinearCrossEntropy: an fp32 dW accumulator and weight copy
            moments["loss backward"]["fp32 head-weight gradient and weight copy"] = float(
                2 * vocab * model.hidden * LOSS_BYTES)
    kept = head_inflight(plan.schedule, plan.pp, plan.microbatches, plan.interleave) if last else 1
    first = {**base, "activations": act - _after_core_bytes(model, plan),
             "logits_and_loss": logits * (kept - 1) / kept,
             **_core_backward_bytes(model, plan),
             "fresh weight gradients": _fresh_grads(model, plan, stage, last),
             "residual and core-output gradients": 2.0 * t.b * t.s_n * t.h * plan.dtype_bytes,
             "gathered units": gathered, "activation buffers": bufs,
             "causal mask": _mask_bytes(model, plan, backward=True)}
    moments["first backward"] = first
    if unpiped_zero3:
        blocks = [n for k, n in units.items() if k != "root"]
        if len(blocks) > 1:
            # the next block's core: the last block's saves freed, its flat gradient cast to fp32 and reducing
            # (it completes at the next reduce-scatter), its reduced fp32 shard kept
            per_block = activation_bytes_per_layer(model, plan, formula=activation_model)
            moments["second backward"] = {
                **first, "activations": first["activations"] - per_block,
                "gradients": first["gradients"] + shard_size(blocks[-1], g) * grad_comm_bytes(plan),
                "previous unit's reduce-scatter input": float(padded(blocks[-1], g) * grad_comm_bytes(plan))}
        moments["root gradient"], moments["root reduce-scatter"] = _root_gradient_moments(plan, units, state)
    step_grads = state["gradients"]
    if plan.zero == 2:                      # reduce-scattered into the shards by the step, however accumulated
        step_grads = float(sum(shard_size(n, g) for n in units.values()) * plan.optim.grad_bytes)
    moments["step"] = {"parameters": state["parameters"], "gradients": step_grads,
                       "optimizer_states": state["optimizer_states"],
                       "optimizer temporaries": _step_temporaries(model, plan, stage)}
    return PeakMoments(stage, {k: {p: float(v) for p, v in moments[k].items()} for k in MOMENTS if k in moments},
                       activation_model)
