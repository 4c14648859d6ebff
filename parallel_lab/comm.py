"""Communication of one GPU for one optimizer step: every collective, its bytes and its time.

:func:`collectives` lists the calls one rank makes, as :class:`Collective` records with the fields of
docs/conventions.md (``dim, kind, message_bytes, group_size``, plus ``count``, ``phase`` and ``note``), so
that the runnable code (``parallel_lab.distributed``) can be compared with it call by call. One function per
parallelism builds its part, so each can be read (and adjusted to the runnable code) on its own:
:func:`_dp_collectives`, :func:`_zero_collectives`, :func:`_tp_collectives`, :func:`_tp_vocab_collectives`,
:func:`_pp_collectives`, :func:`_cp_collectives`, :func:`_ep_collectives` (expert parallelism's all-to-alls;
its expert gradients are averaged in :func:`_dp_collectives` over the expert-data-parallel group).

Notation: ``s`` sequence, ``b`` micro-batch, ``h`` hidden, ``d`` bytes per element of the compute dtype,
``m`` micro-batches per step (``grad_accum``), ``L`` layers on this rank's pipeline stage. With context
parallelism each rank holds ``s / cp`` tokens, and every "s" below is that local length.

Time (alpha-beta, ring algorithms; Thakur et al. 2005, as in the NCCL tests' "bus bandwidth"): a call
costs ``steps * latency + wire_bytes / bandwidth`` on the link tier its group lands on (intra-node when all
its ranks share a node in the placement ``arange(world).view(dp, pp, cp, tp)``, inter-node otherwise);
ring steps: all-reduce ``2 (n - 1)``, all-gather, reduce-scatter and all-to-all ``n - 1``, send 1.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any

from .errors import ParallelLabError
from .flops import recomputed
from .hardware import ClusterSpec, LinkTier
from .mesh import group_tier
from .sharding import (
    ddp_buckets,
    expert_grad_tensors,
    grad_comm_bytes,
    is_expert_param,
    is_frozen,
    kv_heads_local,
    kv_replication,
    kv_width_local,
    param_comm_bytes,
    q_width_local,
    shard_group,
    stage_blocks,
    stage_layers,
    stage_params,
    trainable,
    unit_sizes,
    vocab_local,
)
from .sharding import padded as padded_numel
from .specs import ModelSpec, Plan

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "recv", "broadcast")
DIMS = ("dp", "tp", "tp_vocab", "pp", "cp", "ep")
PHASES = ("forward", "backward", "step")
#: Cross-entropy's vocab-parallel reductions (max, sum of exponentials, target logit) run in fp32.
CE_BYTES = 4


@dataclass(frozen=True)
class Collective:
    """``count`` identical calls of one rank in one optimizer step (fields as in docs/conventions.md).

    ``message_bytes``: the payload of one call (all-reduce: the tensor; all-gather: the gathered output;
    reduce-scatter: the full input; all-to-all: this rank's input; send/recv: the tensor).
    ``group_size``: ranks in the group (2 for a point-to-point send/recv).
    """

    dim: str
    kind: str
    message_bytes: int
    group_size: int
    count: int = 1
    phase: str = "backward"
    note: str = ""
    #: the ZeRO/FSDP unit a dp call moves (``"root"``, ``"blocks.3"``, ...); ``None`` for every other call
    unit: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ParallelLabError(f"Collective.kind={self.kind!r}; pick one of {', '.join(KINDS)}")
        if self.phase not in PHASES:
            raise ParallelLabError(f"Collective.phase={self.phase!r}; pick one of {', '.join(PHASES)}")
        if self.message_bytes < 0 or self.count < 0 or self.group_size < 1:
            raise ParallelLabError(f"Collective {self.kind}: message_bytes={self.message_bytes}, "
                                   f"count={self.count} must be >= 0 and group_size={self.group_size} >= 1")

    @property
    def wire_bytes_per_call(self) -> float:
        """Bytes this rank sends for one call (ring algorithms; conventions' table)."""
        n, M = self.group_size, self.message_bytes
        if self.kind == "all_reduce":
            return 2 * (n - 1) / n * M
        if self.kind in ("all_gather", "reduce_scatter", "all_to_all"):
            return (n - 1) / n * M
        if self.kind in ("send", "broadcast"):
            return float(M)
        return 0.0                                          # recv: counted at the sender

    @property
    def wire_bytes(self) -> float:
        """Bytes this rank sends for all ``count`` calls."""
        return self.count * self.wire_bytes_per_call

    @property
    def payload_bytes(self) -> int:
        """``message_bytes * count``: what the runnable code's tracer sums."""
        return self.message_bytes * self.count

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "wire_bytes": self.wire_bytes}


# --------------------------------------------------------------------------------------------------
# Shared quantities
# --------------------------------------------------------------------------------------------------

def _n_layers(model: ModelSpec, plan: Plan, stage: int) -> int:
    return stage_blocks(model.layers, plan.pp, plan.interleave, stage, plan.pp_split)


def _act_bytes(model: ModelSpec, plan: Plan) -> int:
    """``(s/cp) b h d``: one activation tensor of the local sequence."""
    return (plan.seq // plan.cp) * plan.micro_batch * model.hidden * plan.dtype_bytes


# --------------------------------------------------------------------------------------------------
# One function per parallelism
# --------------------------------------------------------------------------------------------------

def _dp_collectives(model: ModelSpec, plan: Plan, stage: int, frozen: tuple[str, ...]) -> list[Collective]:
    """Plain data parallelism (ZeRO 0) over the ``dp * cp`` group, once per optimizer step.

    ``naive``: one all-reduce per trainable parameter tensor, in reverse registration order.
    ``bucketed``: one all-reduce per bucket of :func:`ddp_buckets`. Gradient accumulation accumulates
    locally (no sync) and synchronises once, after the last micro-batch.
    """
    g = shard_group(plan)
    if g == 1 or plan.zero:
        return []
    gb = grad_comm_bytes(plan)
    # expert parallelism: each routed expert's gradient is averaged over the dp / ep ranks holding it
    experts = [Collective("dp", "all_reduce", numel * gb, g // plan.ep, 1, "backward", f"expert grad {name}")
               for name, numel in expert_grad_tensors(model, plan, stage, frozen) if g // plan.ep > 1]
    if plan.dp_kind == "naive":
        return [Collective("dp", "all_reduce", numel * gb, g, 1, "backward", f"grad {name}")
                for name, numel in reversed(trainable(model, plan, stage, frozen))
                if not (plan.ep > 1 and is_expert_param(name))] + experts
    out = []
    for i, bucket in enumerate(ddp_buckets(model, plan, stage, frozen)):
        first, last = bucket[0][0], bucket[-1][0]
        what = first if len(bucket) == 1 else f"{first} .. {last} ({len(bucket)} tensors)"
        out.append(Collective("dp", "all_reduce", sum(b for _, b in bucket), g, 1, "backward",
                              f"bucket {i}: {what}"))
    return out + experts


def _zero_collectives(model: ModelSpec, plan: Plan, stage: int, frozen: tuple[str, ...]) -> list[Collective]:
    """ZeRO-1/2/3 over the ``dp * cp`` group, unit by unit (units: docs/conventions.md).

    Every message is a unit's padded flat buffer, ``g * ceil(n_u / g)`` elements. Per step, with ``Psi``
    the gradient bytes (Rajbhandari et al. 2020, Sec. 7: DDP's all-reduce moves 2 Psi per GPU):

    * ZeRO-1 and ZeRO-2: reduce-scatter each unit's flat gradient after the last micro-batch (Psi), then
      all-gather each unit's updated parameters after the optimizer step (Psi): 2 Psi, DDP's volume.
      ``zero1_reduce="all_reduce"`` (torch's ZeroRedundancyOptimizer under DDP) all-reduces the gradient
      instead (2 Psi): 3 Psi, 1.5x. ``zero2_accumulate="sharded"`` reduce-scatters every micro-batch.
    * ZeRO-3 (FSDP-style, every micro-batch): a block unit is all-gathered before its forward, again
      before its backward, and its gradient reduce-scattered after its backward (gradients accumulate on
      the shards): 3 Psi, 1.5x. The root unit is all-gathered once at the start of forward, kept until
      the end of backward, and reduce-scattered once (under a pipeline every unit is gathered once per step
      and reduce-scattered once: the stage stays gathered through its micro-batches, ``distributed/zero/fsdp.py``).
      With ``zero_unit="root"`` the single unit behaves
      like the root unit. A model given by its count only is taken as block units (FSDP wraps every
      block, the rest is negligible): every parameter gathered twice, and nothing large held gathered,
      as ``ledger_buffers.comm_buffer_bytes`` assumes for it.

    Gradients travel as bf16 for bf16-gradient optimizers (else fp32); gathered parameters in the
    parameter dtype (FSDP2 mixed precision: the compute dtype).
    """
    g = shard_group(plan)
    if g == 1 or not plan.zero:
        return []
    gb, pb = grad_comm_bytes(plan), param_comm_bytes(plan)
    units = unit_sizes(model, plan, stage, frozen)
    padded = {u: padded_numel(n, g) for u, n in units.items()}
    m = plan.microbatches
    out: list[Collective] = []
    backward_order = list(reversed(padded))
    if plan.zero in (1, 2):
        kind = "all_reduce" if plan.zero == 1 and plan.zero1_reduce == "all_reduce" else "reduce_scatter"
        count = m if plan.zero == 2 and plan.zero2_accumulate == "sharded" else 1
        how = " (all-reduce: torch's ZeroRedundancyOptimizer form, 1.5x DDP's bytes)" if kind == "all_reduce" \
            else f" (every micro-batch: {m}x)" if count > 1 else ""
        out += [Collective("dp", kind, padded[u] * gb, g, count, "backward", f"grad of unit {u}{how}", u)
                for u in backward_order]
        out += [Collective("dp", "all_gather", padded[u] * pb, g, 1, "step", f"updated params of unit {u}", u)
                for u in padded]
        return out
    if plan.pp > 1:      # under a pipeline: the stage gathered once per step, its gradients reduced once
        out += [Collective("dp", "all_gather", padded[u] * pb, g, 1, "forward",
                           f"params of unit {u}, kept through the step's micro-batches (pipeline)", u) for u in padded]
        return out + [Collective("dp", "reduce_scatter", padded[u] * gb, g, 1, "backward", f"grad of unit {u}", u)
                      for u in backward_order]
    blocks_of_a_count = not model.shape_known and plan.zero_unit == "block"
    name = {u: "the model's block units (a bare count: taken as many small units)" if blocks_of_a_count
            else f"unit {u}" for u in padded}
    for u in padded:
        # the root unit is gathered once and held from forward to backward (a count-only model: block units)
        kept = u == "root" and not blocks_of_a_count
        out.append(Collective("dp", "all_gather", padded[u] * pb, g, m, "forward", f"params of {name[u]}", u))
        if not kept:
            out.append(Collective("dp", "all_gather", padded[u] * pb, g, m, "backward",
                                  f"params of {name[u]} again", u))
    out += [Collective("dp", "reduce_scatter", padded[u] * gb, g, m, "backward", f"grad of {name[u]}", u)
            for u in backward_order]
    return out


def _tp_collectives(model: ModelSpec, plan: Plan, stage: int, frozen: tuple[str, ...]) -> list[Collective]:
    """Megatron tensor parallelism inside the blocks of this stage (Shoeybi et al. 2019; Korthikanti 2022).

    Without SP, per layer and micro-batch: forward 2 all-reduces of ``s b h d`` (the ``g`` operator after
    attention's ``wo`` and the MLP's ``proj``/``down``), backward 2 (the ``f`` operator's all-reduce of the
    gradient at the attention and MLP inputs). With SP the all-reduces become pairs: forward all-gather
    before attention and MLP and reduce-scatter after them; backward the transposes (reduce-scatter and
    all-gather); message = the full ``s b h d``. As in Megatron, the column-parallel linears keep only their
    sequence shard of the input for backward (the ``sbh/t`` activations of Korthikanti's SP formula) and
    all-gather it again in backward for the weight gradients: one more all-gather per region, so SP moves
    1.25 times TP's bytes in the blocks (runnable: ``dist/tensor_parallel.py``). Full recomputation repeats
    the forward's collectives during backward. With SP the gradients of parameters replicated across TP
    (norm weights and biases, row-parallel biases, final norm, gpt's position embedding) are partial sums
    over the sequence shards: one all-reduce of their flat concatenation per step. With
    ``tp > kv_heads`` the replicated key/value weights' gradients are all-reduced over the
    ``tp / kv_heads`` ranks sharing a head, once per step.
    """
    t = plan.tp
    if t == 1 or not model.shape_known:
        return []
    out = scaled(tp_layer_collectives(model, plan), _n_layers(model, plan, stage) * plan.microbatches)
    return out + tp_step_collectives(model, plan, stage, frozen)


def scaled(colls: list[Collective], k: int) -> list[Collective]:
    """``colls`` made ``k`` times as often (one layer's calls -> a stage's, one micro-batch's -> a step's)."""
    return [replace(c, count=c.count * k) for c in colls]


def tp_layer_collectives(model: ModelSpec, plan: Plan) -> list[Collective]:
    """The TP calls of one transformer block for one micro-batch (see :func:`_tp_collectives`)."""
    t, M = plan.tp, _act_bytes(model, plan)
    if t == 1:
        return []
    if not plan.sp:
        fwd = [Collective("tp", "all_reduce", M, t, 2, "forward", "g: after attention wo and MLP down/proj")]
        bwd = [Collective("tp", "all_reduce", M, t, 2, "backward", "f: grads at attention and MLP inputs")]
    else:
        fwd = [Collective("tp", "all_gather", M, t, 2, "forward", "g: SP gather before attention and MLP"),
               Collective("tp", "reduce_scatter", M, t, 2, "forward", "g-bar: after attention wo and MLP down")]
        bwd = [Collective("tp", "reduce_scatter", M, t, 2, "backward", "grads of the forward all_gathers"),
               Collective("tp", "all_gather", M, t, 2, "backward", "grads of the forward reduce_scatters"),
               Collective("tp", "all_gather", M, t, 2, "backward",
                          "SP: the saved input shard gathered again for the weight gradients")]
    out = fwd + bwd
    if plan.recompute == "full":
        out += [replace(c, phase="backward", note="recomputed forward: " + c.note) for c in fwd]
    return out


def tp_step_collectives(model: ModelSpec, plan: Plan, stage: int = 0,
                        frozen: tuple[str, ...] = ()) -> list[Collective]:
    """The TP calls made once per step: SP's all-reduce of the TP-replicated parameters' gradients, and the
    all-reduce of replicated key/value heads' gradients when ``tp > kv_heads``."""
    t = plan.tp
    if t == 1:
        return []
    gb = grad_comm_bytes(plan)
    params = stage_params(model, plan, stage, tuple(frozen))
    out = []
    if plan.sp and params.tp_replicated:
        out.append(Collective("tp", "all_reduce", params.tp_replicated * gb, t, 1, "backward",
                              "SP: grads of TP-replicated parameters (norms, row-parallel biases, "
                              "position embedding)"))
    if t > model.kv_heads and params.kv:
        out.append(Collective("tp", "all_reduce", params.kv * gb, t // model.kv_heads, 1, "backward",
                              "GQA: grads of kv heads replicated over tp/kv_heads ranks"))
    return out


def _tp_vocab_collectives(model: ModelSpec, plan: Plan, stage: int,
                          frozen: tuple[str, ...]) -> list[Collective]:
    """Vocabulary-parallel embedding (stage 0) and head + cross-entropy (last stage), per micro-batch.

    Embedding: each rank looks up its vocabulary rows and zeros the others; the partial outputs are summed
    by an all-reduce of ``s b h d`` in forward (with SP a reduce-scatter, whose backward is an all-gather).
    Head: its input is replicated, so backward all-reduces the input gradient ``s b h d`` (with SP: the
    final norm's output is all-gathered in forward and the gradient reduce-scattered in backward).
    Cross-entropy over vocab shards (Megatron): three fp32 all-reduces of ``s b`` values in forward: the
    max logit, the sum of exponentials and the target logit.
    """
    t = plan.tp
    if t == 1 or not model.shape_known:
        return []
    m, M = plan.microbatches, _act_bytes(model, plan)
    out: list[Collective] = []
    if stage == 0:
        if plan.sp:
            out += [Collective("tp_vocab", "reduce_scatter", M, t, m, "forward",
                               "embedding partial sums (SP)"),
                    Collective("tp_vocab", "all_gather", M, t, m, "backward", "embedding output grad (SP)")]
        else:
            out.append(Collective("tp_vocab", "all_reduce", M, t, m, "forward", "embedding partial sums"))
    if stage == plan.pp - 1:
        if plan.sp:
            out += [Collective("tp_vocab", "all_gather", M, t, m, "forward", "head input (SP)"),
                    Collective("tp_vocab", "reduce_scatter", M, t, m, "backward", "head input grad (SP)")]
        else:
            out.append(Collective("tp_vocab", "all_reduce", M, t, m, "backward", "head input grad"))
        ce = (plan.seq // plan.cp) * plan.micro_batch * CE_BYTES
        out.append(Collective("tp_vocab", "all_reduce", ce, t, 3 * m, "forward",
                              "cross-entropy: max, sum-exp, target logit (fp32)"))
    return out


def _pp_collectives(model: ModelSpec, plan: Plan, stage: int, frozen: tuple[str, ...]) -> list[Collective]:
    """Point-to-point between pipeline stages, per micro-batch.

    Each model chunk sends its output activation (``s b h d``; ``s b h d / tp`` with SP, whose activations
    are sequence-sharded) to the next chunk in forward and receives the gradient back in backward. Stage
    ``r`` holds ``v`` chunks; all but the model's last chunk send forward, all but the first receive.
    With tied embeddings, the first and last stages all-reduce the embedding gradient once per step.
    """
    p = plan.pp
    if p == 1 or not model.shape_known:
        return []
    v, m = plan.interleave, plan.microbatches
    M = _act_bytes(model, plan) // (plan.tp if plan.sp else 1)
    sends = v - (1 if stage == p - 1 else 0)
    recvs = v - (1 if stage == 0 else 0)
    out = []
    if sends:
        out += [Collective("pp", "send", M, 2, sends * m, "forward", "activation to the next stage"),
                Collective("pp", "recv", M, 2, sends * m, "backward", "gradient from the next stage")]
    if recvs:
        out += [Collective("pp", "recv", M, 2, recvs * m, "forward", "activation from the previous stage"),
                Collective("pp", "send", M, 2, recvs * m, "backward", "gradient to the previous stage")]
    if model.tied_embeddings and stage in (0, p - 1) and not is_frozen("tok_emb.weight", frozen):
        emb = vocab_local(model, plan.tp) * model.hidden * grad_comm_bytes(plan)
        out.append(Collective("pp", "all_reduce", emb, 2, 1, "backward",
                              "tied embedding grad (first + last stage)"))
    return out


def _cp_collectives(model: ModelSpec, plan: Plan, stage: int, frozen: tuple[str, ...]) -> list[Collective]:
    """Context parallelism inside attention, per layer and micro-batch, exactly as
    ``dist/context_parallel.py`` runs it (``s`` = local ``s / cp`` tokens, ``kv`` = the key width on this TP
    rank; K and V always travel together as one ``(2, b, kv_heads, s, d)`` message: ``M_kv = 2 s b kv d``).

    * ring (Liu et al. 2023): forward, the K/V block travels ``cp - 1`` hops: ``cp - 1`` sends of ``M_kv``
      and as many receives. Backward, the K/V block travels again (``cp - 1``) and beside it the block's
      dK/dV accumulator, started by the owner's ring neighbour and handed on until it reaches home:
      ``cp - 1`` more sends and receives of ``M_kv``.
    * allgather (Llama 3): forward one all-gather of K and V (message: the gathered ``cp M_kv``);
      backward one reduce-scatter of dK and dV (message: the full ``cp M_kv``).
    * ulysses (Jacobs et al. 2023): forward one all-to-all of Q, K, V to head-sharded (message: this
      rank's input ``s b (q + 2 kv') d``) and one of the output back (``s b q d``); backward the same two
      with the gradients. ``kv'`` is ``kv`` with each key/value head repeated ``cp / gcd(kv_heads, cp)``
      times so that ``cp`` divides them (tiny-llama, cp 4: 2 kv heads sent as 4).
    Every recomputation that runs the attention core again (``flops.recomputed``: selective, op-sac and full)
    repeats the core's forward traffic during backward.
    """
    if plan.cp == 1 or not model.shape_known:
        return []
    return scaled(cp_layer_collectives(model, plan), _n_layers(model, plan, stage) * plan.microbatches)


def cp_layer_collectives(model: ModelSpec, plan: Plan) -> list[Collective]:
    """The CP calls of one transformer block for one micro-batch (see :func:`_cp_collectives`)."""
    c = plan.cp
    if c == 1:
        return []
    s, b, d = plan.seq // c, plan.micro_batch, plan.dtype_bytes
    kv = kv_width_local(model, plan.tp)
    q = q_width_local(model, plan.tp)
    Mkv = 2 * s * b * kv * d
    if plan.cp_kind == "ring":
        fwd = [Collective("cp", "send", Mkv, 2, c - 1, "forward", "ring: K/V block to the next rank"),
               Collective("cp", "recv", Mkv, 2, c - 1, "forward", "ring: K/V block from the previous")]
        bwd = [Collective("cp", "send", Mkv, 2, c - 1, "backward", "ring: K/V block again"),
               Collective("cp", "recv", Mkv, 2, c - 1, "backward", "ring: K/V block again"),
               Collective("cp", "send", Mkv, 2, c - 1, "backward", "ring: dK/dV accumulator"),
               Collective("cp", "recv", Mkv, 2, c - 1, "backward", "ring: dK/dV accumulator")]
    elif plan.cp_kind == "allgather":
        fwd = [Collective("cp", "all_gather", c * Mkv, c, 1, "forward", "gather K and V")]
        bwd = [Collective("cp", "reduce_scatter", c * Mkv, c, 1, "backward", "dK and dV")]
    else:
        kv_rep = kv * kv_replication(model.heads // plan.tp, kv_heads_local(model, plan.tp), c)
        Mqkv, Mq = s * b * (q + 2 * kv_rep) * d, s * b * q * d
        fwd = [Collective("cp", "all_to_all", Mqkv, c, 1, "forward", "Q, K, V to head-sharded"),
               Collective("cp", "all_to_all", Mq, c, 1, "forward", "output back to sequence-sharded")]
        bwd = [Collective("cp", "all_to_all", Mq, c, 1, "backward", "output grad to head-sharded"),
               Collective("cp", "all_to_all", Mqkv, c, 1, "backward", "dQ, dK, dV back")]
    out = fwd + bwd
    if recomputed(model, plan.recompute, plan.mlp)[1]:         # the core runs again, and so do its collectives
        out += [replace(x, phase="backward", note="recomputed forward: " + x.note) for x in fwd]
    return out


def ep_dispatch_bytes(model: ModelSpec, plan: Plan) -> int:
    """One dispatch (or combine) all-to-all of one MoE block for one micro-batch: this rank's input buffer
    ``E b C h d`` with ``C = model.expert_capacity(s)`` slots per expert and sequence (the fixed-capacity
    layout of GShard: ``E C = capacity_factor * top_k * s``, so about ``capacity_factor * top_k * s b h d``)."""
    return model.experts * plan.micro_batch * model.expert_capacity(plan.seq) * model.hidden * plan.dtype_bytes


def _ep_collectives(model: ModelSpec, plan: Plan, stage: int, frozen: tuple[str, ...]) -> list[Collective]:
    """Expert parallelism (GShard; Lepikhin et al. 2021), per MoE block and micro-batch, over the ``ep`` group:
    forward an all-to-all dispatching each rank's buffer ``(E, b C, h)`` to the experts' owners and one
    combining the experts' outputs back (:func:`ep_dispatch_bytes` each); backward the same two with the
    gradients, in reverse. Full recomputation repeats the forward's two during backward. A fraction
    ``(ep - 1) / ep`` of each buffer leaves the GPU (``wire_bytes``)."""
    if plan.ep == 1 or not model.is_moe:
        return []
    blocks = [i for i in stage_layers(model.layers, plan.pp, plan.interleave, stage, plan.pp_split)
              if model.is_moe_layer(i)]
    if not blocks:
        return []
    n, M, ep = len(blocks) * plan.microbatches, ep_dispatch_bytes(model, plan), plan.ep
    out = [Collective("ep", "all_to_all", M, ep, 2 * n, "forward", "dispatch + combine (tokens to experts, back)"),
           Collective("ep", "all_to_all", M, ep, 2 * n, "backward", "gradients of combine + dispatch")]
    if plan.recompute == "full":
        out.append(Collective("ep", "all_to_all", M, ep, 2 * n, "backward", "recomputed dispatch + combine"))
    return out


#: Each dim's collectives, one function per parallelism (dp has two: DDP and ZeRO).
PARTS = (("dp", _dp_collectives), ("dp", _zero_collectives), ("tp", _tp_collectives),
         ("tp_vocab", _tp_vocab_collectives), ("pp", _pp_collectives), ("cp", _cp_collectives),
         ("ep", _ep_collectives))


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------

def _stages(plan: Plan, stage: int | None) -> list[int]:
    if stage is None:
        return list(range(plan.pp))
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < plan.pp:
        raise ParallelLabError(f"stage={stage!r} is not a pipeline stage of pp={plan.pp}; pick 0..{plan.pp - 1}")
    return [stage]


def _stage_collectives(model: ModelSpec, plan: Plan, stage: int, frozen: tuple[str, ...]) -> list[Collective]:
    return [c for _, part in PARTS for c in part(model, plan, stage, frozen) if c.count]


def stage_collectives(model: ModelSpec, plan: Plan, stage: int = 0, *, dims: Iterable[str] = DIMS,
                      frozen: Iterable[str] = ()) -> list[Collective]:
    """The collectives of dims ``dims`` one rank of ``stage`` makes per step, for a plan already validated
    (:func:`collectives` validates and picks the stage; the planner calls this one, memoised)."""
    want, frozen = set(dims), tuple(frozen)
    return [c for dim, part in PARTS if dim in want for c in part(model, plan, stage, frozen) if c.count]


def _busiest(model: ModelSpec, plan: Plan, stage: int | None,
             frozen: tuple[str, ...]) -> tuple[int, list[Collective]]:
    plan.validate(model)
    frozen = tuple(frozen)
    options = [(s, _stage_collectives(model, plan, s, frozen)) for s in _stages(plan, stage)]
    return max(options, key=lambda sc: sum(c.wire_bytes for c in sc[1]))


def collectives(model: ModelSpec, plan: Plan, *, stage: int | None = None,
                frozen: Iterable[str] = ()) -> list[Collective]:
    """Every collective one rank of pipeline stage ``stage`` makes in one optimizer step.

    ``stage=None``: the stage that sends the most bytes. ``frozen``: parameter names (or name prefixes
    such as ``"blocks.0"``) without gradients; they take no part in gradient synchronisation.
    """
    return _busiest(model, plan, stage, tuple(frozen))[1]


def per_step_bytes(colls: Iterable[Collective]) -> dict[str, float]:
    """Wire bytes per dimension (what one GPU sends per step)."""
    out: dict[str, float] = {}
    for c in colls:
        out[c.dim] = out.get(c.dim, 0.0) + c.wire_bytes
    return out


def payload_bytes(colls: Iterable[Collective]) -> dict[str, int]:
    """Payload bytes per dimension: the sum of ``message_bytes * count`` (integers, for ``==`` checks)."""
    out: dict[str, int] = {}
    for c in colls:
        out[c.dim] = out.get(c.dim, 0) + c.payload_bytes
    return out


def ring_steps(kind: str, group_size: int) -> int:
    """Latency-bound steps of the ring algorithm for one call."""
    n = group_size
    if n == 1 or kind == "recv":
        return 0
    if kind == "all_reduce":
        return 2 * (n - 1)
    if kind in ("all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        return n - 1
    if kind == "send":
        return 1
    raise ParallelLabError(f"collective kind {kind!r} is not known; pick one of {', '.join(KINDS)}")


def collective_time(kind: str, message_bytes: float, group_size: int, tier: LinkTier) -> float:
    """Seconds for one call: ``ring_steps * latency + wire_bytes / bandwidth`` (alpha-beta model)."""
    wire = Collective("dp", kind, int(message_bytes), group_size).wire_bytes_per_call
    return ring_steps(kind, group_size) * tier.latency + wire / tier.bandwidth


@dataclass
class CommReport:
    """Collectives of one rank for one step, with wire bytes, payload bytes and time per dimension."""

    stage: int
    collectives: list[Collective]
    per_step_bytes: dict[str, float]
    payload_bytes: dict[str, int]
    time_s: dict[str, float]
    tiers: dict[str, str]
    cluster: str

    def to_json(self) -> dict[str, Any]:
        return {"per_step_bytes": dict(self.per_step_bytes),
                "collectives": [c.to_json() for c in self.collectives],
                "time_s": dict(self.time_s), "payload_bytes": dict(self.payload_bytes), "stage": self.stage,
                "tiers": dict(self.tiers), "cluster": self.cluster}


def report(model: ModelSpec, plan: Plan, cluster: ClusterSpec | None = None, stage: int | None = None, *,
           frozen: Iterable[str] = ()) -> CommReport:
    """:func:`collectives` with wire bytes and alpha-beta time per dimension on ``cluster`` (h100-sxm)."""
    cluster = cluster or ClusterSpec.preset("h100-sxm")
    st, colls = _busiest(model, plan, stage, tuple(frozen))
    tiers = {dim: group_tier(cluster, plan, dim, st) for dim in per_step_bytes(colls)}
    time_s: dict[str, float] = {}
    for c in colls:
        time_s[c.dim] = time_s.get(c.dim, 0.0) + c.count * collective_time(c.kind, c.message_bytes,
                                                                             c.group_size, tiers[c.dim])
    return CommReport(st, colls, per_step_bytes(colls), payload_bytes(colls), time_s,
                      {d: t.name for d, t in tiers.items()}, cluster.name)
