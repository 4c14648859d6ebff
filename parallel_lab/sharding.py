"""What one rank holds of the model (the process grid is :mod:`parallel_lab.mesh`): one home per rule.

Tensor parallelism (Megatron, Shoeybi et al. 2019): column-parallel ``wq, wk, wv, fc | gate, up`` keep
``fan_out / tp`` output rows, row-parallel ``wo, proj | down`` keep ``fan_in / tp`` input columns; norms,
row-parallel biases and gpt's position embedding are replicated. ``tp`` must divide ``heads`` and ``ffn``;
grouped-query key/value heads are split when ``tp`` divides ``kv_heads`` and replicated (each rank keeps the
one head its query heads use, ``tp / kv_heads`` copies of each) when ``kv_heads`` divides ``tp``. No other
``tp`` can cut them evenly. The embedding and the head keep ``ceil(vocab / tp)`` rows (vocabulary padded).

ZeRO and FSDP (Rajbhandari et al. 2020): a *unit* of ``n`` trainable elements is padded to ``g ceil(n/g)``
and rank ``r`` of the gradient-sync group (``g = dp * cp``) owns ``[r S, (r+1) S)``, ``S = ceil(n/g)``.
DDP buckets: gradients in reverse registration order, a bucket closes before it would exceed the cap.
Pipeline stages: contiguous chunks, the first ``layers % chunks`` one layer longer; chunk ``c`` on stage
``c % pp`` (Megatron's interleaving). docs/conventions.md is the contract these rules implement.
Expert parallelism (GShard, Lepikhin et al. 2021): ``ep`` divides ``experts`` and ``dp`` (it borrows its ranks
from data parallelism, as torchtitan and Megatron do); data-parallel coordinate ``d`` has expert rank ``d % ep``
and holds experts ``[(d % ep) E/ep, (d % ep + 1) E/ep)``; its expert gradients are averaged over the ``dp / ep``
ranks with the same expert rank (the expert-data-parallel group ``edp``). docs/moe.md has the derivation.
The ledger, comm, activations, the planner and every runnable parallelism take their rules from here.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from .errors import ParallelLabError, divisors, fmt_set

if TYPE_CHECKING:                                   # annotations only: specs imports this module
    from .specs import ModelSpec, Plan


# --------------------------------------------------------------------------------------------------
# Tensor parallelism: heads, kv heads, rows
# --------------------------------------------------------------------------------------------------

def kv_splits(kv_heads: int, tp: int) -> bool:
    """Whether ``tp`` ranks can hold the key/value heads evenly: split (``tp | kv``) or replicated (``kv | tp``)."""
    return kv_heads % tp == 0 or tp % kv_heads == 0


def valid_tp(model: ModelSpec) -> list[int]:
    """Every TP degree that splits ``model``'s heads, kv heads and ffn evenly."""
    return [t for t in divisors(model.heads)
            if model.ffn % t == 0 and kv_splits(model.kv_heads, t)]


def check_tp(model: ModelSpec, tp: int) -> None:
    """Raise a ParallelLabError naming the fix when ``tp`` cannot cut ``model`` (module docstring)."""
    if model.heads % tp:
        raise ParallelLabError(f"tp={tp} does not divide heads={model.heads}; pick tp in {fmt_set(valid_tp(model))}")
    if model.ffn % tp:
        raise ParallelLabError(f"tp={tp} does not divide ffn={model.ffn}; pick tp in {fmt_set(valid_tp(model))}")
    if not kv_splits(model.kv_heads, tp):
        raise ParallelLabError(
            f"tp={tp} cannot split kv_heads={model.kv_heads} (it neither divides them nor is a multiple of "
            f"them, so key/value heads cannot be split or replicated evenly); pick tp in {fmt_set(valid_tp(model))}")


def kv_heads_local(model: ModelSpec, tp: int) -> int:
    """Key/value heads one TP rank holds: ``kv_heads / tp``, or 1 (replicated) when ``tp > kv_heads``."""
    return model.kv_heads // tp if tp <= model.kv_heads else 1


def kv_replicas(model: ModelSpec, tp: int) -> int:
    """TP ranks that hold the same key/value head (1 when the heads are split)."""
    return tp // model.kv_heads if tp > model.kv_heads else 1


def kv_width_local(model: ModelSpec, tp: int) -> int:
    """Width of the keys (or values) one TP rank holds: ``kv_heads_local * head_dim``."""
    return kv_heads_local(model, tp) * model.head_dim


def kv_replication(heads: int, kv_heads: int, cp: int) -> int:
    """How many times Ulysses repeats each key/value head so that ``cp`` divides them, consistently with
    the query heads: ``cp / gcd(kv_heads, cp)`` (1 when ``cp`` divides ``kv_heads``).

    Rank ``j`` gets query heads ``[j H/cp, (j+1) H/cp)`` and repeated key/value heads
    ``[j H'/cp, (j+1) H'/cp)`` with ``H' = kv_heads * f``; ``cp | H`` makes ``f`` divide ``H / kv_heads``,
    so each query head still finds its key/value head on its own rank.
    """
    if heads % cp:
        ok = [c for c in range(1, heads + 1) if heads % c == 0]
        raise ParallelLabError(
            f"Ulysses all-to-all puts heads={heads} (query heads per tensor-parallel rank) on cp={cp} ranks; "
            f"cp must divide them: pick cp in {{{', '.join(map(str, ok))}}} or cp_kind='ring' / 'allgather'")
    return cp // math.gcd(kv_heads, cp)


def q_width_local(model: ModelSpec, tp: int) -> int:
    """Width of the queries (and of the attention output) one TP rank holds."""
    return model.heads // tp * model.head_dim


def vocab_local(model: ModelSpec, tp: int) -> int:
    """Vocabulary rows of the embedding (and the head) on one TP rank: ``ceil(vocab / tp)``."""
    return math.ceil(model.vocab / tp)


COLUMN_PARALLEL = ("wq", "wk", "wv", "fc", "gate", "up")
ROW_PARALLEL = ("wo", "proj", "down")


def column_rows(model: ModelSpec, leaf: str, fan_out: int, tp: int) -> int:
    """Local output rows of the column-parallel weight ``leaf`` (``wk``/``wv`` follow the kv-head rule)."""
    if leaf in ("wk", "wv"):
        return kv_width_local(model, tp)
    return fan_out // tp


def check_cut(model: ModelSpec, plan: Plan) -> None:
    """The rules a plan must meet to cut a model of known shape (``Plan.validate`` asks them): TP divides the
    heads, kv heads and ffn; ``pp * interleave`` chunks fit the layer slots; CP cuts ``seq`` into ``2 cp``
    chunks; SP cuts it over ``tp``; Ulysses spreads the heads over ``cp``; flash keeps no dropout mask; gpt's
    learned positions cover ``seq``. Each raises a ParallelLabError naming the fix."""
    check_tp(model, plan.tp)
    chunks = plan.pp * plan.interleave
    slots = model.layers + (2 if plan.pp_split == "embed-head" else 0)
    if chunks > slots:
        raise ParallelLabError(
            f"pp*interleave = {plan.pp}*{plan.interleave} = {chunks} model chunks but only "
            f"{slots} slots (layers={model.layers}, pp_split={plan.pp_split}); "
            f"pick pp*interleave <= {slots}"
        )
    if plan.seq % (2 * plan.cp) and plan.cp > 1:
        raise ParallelLabError(
            f"seq={plan.seq} is not divisible by 2*cp={2 * plan.cp} (load-balanced context "
            f"parallelism cuts the sequence into 2*cp chunks); pick seq a multiple of {2 * plan.cp}"
        )
    if plan.sp and plan.seq % plan.tp:
        raise ParallelLabError(
            f"sequence parallelism splits seq={plan.seq} over tp={plan.tp}; "
            f"pick seq a multiple of {plan.tp}"
        )
    if plan.cp > 1 and plan.cp_kind == "ulysses":
        kv_replication(model.heads // plan.tp, kv_heads_local(model, plan.tp), plan.cp)
    if plan.attention == "flash" and model.dropout > 0:
        raise ParallelLabError(
            f"attention='flash' keeps no dropout mask but the model has dropout={model.dropout}; "
            f"use attention='eager' or a model with dropout=0"
        )
    if model.flavour == "gpt" and plan.seq > model.max_positions:
        raise ParallelLabError(
            f"seq={plan.seq} exceeds max_positions={model.max_positions} of the learned position "
            f"embedding; pick seq <= {model.max_positions}"
        )


# --------------------------------------------------------------------------------------------------
# The TP slice: which rows or columns of a full parameter one TP rank holds
# --------------------------------------------------------------------------------------------------

#: A part of a full tensor: one ``(start, stop)`` index range per dimension.
Box = tuple[tuple[int, int], ...]


class TPSlice(NamedTuple):
    """What one TP rank holds of a full parameter: ``box``, its ranges of the full tensor's indices; ``axis``,
    the dimension TP cuts (``None``: whole on every rank); ``first``, whether the rank is the lowest of the TP
    ranks holding this same box (the one that writes it to a checkpoint)."""

    box: Box
    axis: int | None
    first: bool


def _cut(n: int, tp: int, r: int) -> tuple[int, int]:
    """Part ``r`` of ``n`` indices cut into ``tp`` equal parts."""
    return r * n // tp, (r + 1) * n // tp


def tp_slice(model: ModelSpec, name: str, shape: tuple[int, ...], tp: int, r: int) -> TPSlice:
    """The part of the full parameter ``name`` (of ``shape``) that rank ``r`` of ``tp`` holds (module docstring):
    column-parallel output rows, row-parallel weights' input columns, the one kv head of ``kv_replicas`` ranks
    when ``tp > kv_heads``, ``vocab_local`` vocabulary rows (the last rank's cut at ``vocab``); the rest whole."""
    full: Box = tuple((0, s) for s in shape)
    if tp == 1:
        return TPSlice(full, None, True)
    parts = name.split(".")
    if parts[0] in ("tok_emb", "lm_head"):
        v = vocab_local(model, tp)
        return TPSlice(((min(r * v, shape[0]), min((r + 1) * v, shape[0])), *full[1:]), 0, True)
    if parts[0] != "blocks" or parts[2] not in ("attn", "mlp"):
        return TPSlice(full, None, r == 0)                               # norms, pos_emb: replicated
    leaf = parts[3]
    if leaf in ("wk", "wv") and tp > model.kv_heads:                    # one kv head, shared by kv_replicas ranks
        share = kv_replicas(model, tp)
        head = r // share
        return TPSlice(((head * model.head_dim, (head + 1) * model.head_dim), *full[1:]), 0, r % share == 0)
    if leaf in COLUMN_PARALLEL:
        return TPSlice((_cut(shape[0], tp, r), *full[1:]), 0, True)
    if leaf in ROW_PARALLEL and parts[-1] == "weight":
        return TPSlice((full[0], _cut(shape[1], tp, r)), 1, True)
    if leaf in ROW_PARALLEL:
        return TPSlice(full, None, r == 0)                               # row-parallel bias: replicated
    raise ParallelLabError(f"{name} with tp={tp}: tensor-parallel experts are not modelled here; split the "
                           f"experts with ep (borrowed from dp) and set tp=1")


# --------------------------------------------------------------------------------------------------
# Pipeline stages
# --------------------------------------------------------------------------------------------------

#: How the pipeline split counts slots: ``layers`` (blocks only, the embedding rides on stage 0 and the head
#: on the last stage) or ``embed-head`` (the embedding and the head each take one layer slot, so the first
#: and last stages hold one block fewer: Meta's Llama 3 layout, Megatron's
#: ``--account-for-embedding-in-pipeline-split`` with ``--account-for-loss-in-pipeline-split``).
PP_SPLITS: tuple[str, ...] = ("layers", "embed-head")


def chunk_layers(layers: int, pp: int, interleave: int = 1, split: str = "layers") -> list[list[int]]:
    """The layer ids of each of the ``pp * interleave`` model chunks, in model order.

    Contiguous split of ``layers`` slots (``split="embed-head"``: ``layers + 2`` slots, the first the
    embedding and the last the head, so a chunk may hold no block at all); when the slots are not
    divisible, the first ``slots % chunks`` chunks get one extra slot (as ``numpy.array_split``). Chunk ``c``
    runs on pipeline stage ``c % pp``. Embeddings live on stage 0 with chunk 0; the final norm and the head
    on the stage of the last chunk, ``pp - 1``.
    """
    if split not in PP_SPLITS:
        raise ParallelLabError(f"pp_split={split!r} is not known; pick one of {', '.join(PP_SPLITS)}")
    extra = 2 if split == "embed-head" else 0
    slots, chunks = layers + extra, pp * interleave
    if chunks < 1 or chunks > slots:
        raise ParallelLabError(f"pp*interleave = {pp}*{interleave} = {chunks} chunks cannot split "
                               f"{slots} slots (layers={layers}, pp_split={split}); "
                               f"pick pp*interleave in 1..{slots}")
    q, r = divmod(slots, chunks)
    out, start = [], 0
    for c in range(chunks):
        n = q + (1 if c < r else 0)
        ids = range(start - extra // 2, start + n - extra // 2)      # slot i holds block i - 1 (embed-head)
        out.append([i for i in ids if 0 <= i < layers])
        start += n
    return out


def stage_layers(layers: int, pp: int, interleave: int = 1, stage: int = 0, split: str = "layers") -> list[int]:
    """The layer ids that pipeline stage ``stage`` holds (all its chunks), in model order."""
    if not 0 <= stage < pp:
        raise ParallelLabError(f"stage={stage} is not a pipeline stage; pick stage in 0..{pp - 1}")
    if interleave == 1 and split == "layers":        # closed form: one chunk per stage
        q, r = divmod(layers, pp)
        if pp > layers:
            chunk_layers(layers, pp, interleave)     # raises with the message
        start = stage * q + min(stage, r)
        return list(range(start, start + q + (1 if stage < r else 0)))
    return [i for c, ids in enumerate(chunk_layers(layers, pp, interleave, split)) if c % pp == stage for i in ids]


@functools.cache
def layers_per_stage(layers: int, pp: int, interleave: int = 1, split: str = "layers") -> tuple[int, ...]:
    """How many blocks each pipeline stage holds (:func:`chunk_layers` once, its chunks summed by stage)."""
    counts = [0] * pp
    for c, ids in enumerate(chunk_layers(layers, pp, interleave, split)):
        counts[c % pp] += len(ids)
    return tuple(counts)


def stage_blocks(layers: int, pp: int, interleave: int = 1, stage: int = 0, split: str = "layers") -> int:
    """How many transformer blocks stage ``stage`` holds."""
    return len(stage_layers(layers, pp, interleave, stage, split))


# --------------------------------------------------------------------------------------------------
# Experts (mixture of experts) and the expert-parallel groups
# --------------------------------------------------------------------------------------------------

def is_expert_param(name: str) -> bool:
    """Whether a parameter belongs to a routed expert (``blocks.{i}.mlp.experts.{e}.*``): these are split
    over the expert-parallel group; the router and a shared expert are not."""
    return ".mlp.experts." in name


def expert_of(name: str) -> int:
    """The expert index of a routed expert's parameter name (``blocks.3.mlp.experts.5.up.weight -> 5``)."""
    return int(name.split(".mlp.experts.", 1)[1].split(".", 1)[0])


def local_experts(experts: int, ep: int, ep_rank: int) -> range:
    """The experts expert rank ``ep_rank`` of ``ep`` holds: a contiguous block of ``experts / ep``."""
    n = experts // ep
    return range(ep_rank * n, (ep_rank + 1) * n)


def check_ep(model: ModelSpec, plan: Plan) -> None:
    """The rules of expert parallelism: ``ep`` divides ``experts`` (and ``dp``, checked by ``Plan``); the
    experts are not cut by tensor or context parallelism here (capacity is counted per whole sequence)."""
    if model.experts % plan.ep:
        raise ParallelLabError(f"ep={plan.ep} does not divide experts={model.experts}; "
                               f"pick ep in {fmt_set([d for d in divisors(model.experts) if plan.dp % d == 0])}")
    if plan.tp > 1:
        raise ParallelLabError(f"tp={plan.tp} with a mixture-of-experts model: tensor-parallel experts are not "
                               "modelled here; split the experts with ep (borrowed from dp) and set tp=1")
    if plan.cp > 1:
        raise ParallelLabError(f"cp={plan.cp} with a mixture-of-experts model: expert capacity is counted per "
                               "whole sequence here; set cp=1")



# --------------------------------------------------------------------------------------------------
# The parameters one rank holds
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LocalParam:
    """One parameter tensor as one GPU holds it: ``numel`` local elements, its ZeRO ``unit``, and whether
    it is replicated (not split) across the TP group."""

    name: str
    numel: int
    unit: str
    tp_replicated: bool


def _local(model: ModelSpec, name: str, shape: tuple[int, ...], tp: int) -> tuple[int, bool]:
    """``(local elements, replicated across TP)`` of one parameter of the full model: TP rank 0's slice, the
    fullest (every rank is counted with the padded vocabulary shard)."""
    cut = tp_slice(model, name, shape, tp, 0)
    return math.prod(b - a for a, b in cut.box), cut.axis is None


def local_parameters(model: ModelSpec, plan: Plan, stage: int = 0) -> list[LocalParam]:
    """The parameters of pipeline stage ``stage`` on one TP rank, in registration order.

    Units: ``blocks.{i}`` per block and ``root`` for the rest (``zero_unit="block"``), or a single ``root``
    (``zero_unit="root"``). With tied embeddings and ``pp > 1`` the last stage keeps its own copy of the
    embedding for the head (Megatron), whose gradient is all-reduced with stage 0's.
    """
    model.require_shape("the per-tensor parameter layout")
    return list(_local_parameters(model, plan.tp, plan.pp, plan.interleave, plan.zero_unit, stage, plan.pp_split,
                                  plan.ep))


@functools.lru_cache(maxsize=256)
def _local_parameters(model: ModelSpec, tp: int, pp: int, interleave: int, zero_unit: str,
                      stage: int, split: str = "layers", ep: int = 1) -> tuple[LocalParam, ...]:
    layers = set(stage_layers(model.layers, pp, interleave, stage, split))
    first, last = stage == 0, stage == pp - 1
    on_stage = {"tok_emb": first, "pos_emb": first, "final_norm": last, "lm_head": last}
    out: list[LocalParam] = []
    for name, shape in model.parameter_shapes():
        parts = name.split(".")
        if parts[0] == "blocks":
            layer = int(parts[1])
            if layer not in layers or (ep > 1 and is_expert_param(name) and expert_of(name) >= model.experts // ep):
                continue                             # expert rank 0's names; every expert rank holds as many
            unit = f"blocks.{layer}" if zero_unit == "block" else "root"
        elif on_stage[parts[0]]:
            unit = "root"
        else:
            continue
        numel, rep = _local(model, name, shape, tp)
        out.append(LocalParam(name, numel, unit, rep))
    if model.tied_embeddings and pp > 1 and last:
        out.append(LocalParam("tok_emb.weight", vocab_local(model, tp) * model.hidden, "root", tp == 1))
    return tuple(out)


def is_frozen(name: str, frozen: tuple[str, ...] | list[str]) -> bool:
    """A parameter is frozen when its name equals an entry of ``frozen`` or starts with ``entry + "."``."""
    return any(name == f or name.startswith(f.rstrip(".") + ".") for f in frozen)


def trainable(model: ModelSpec, plan: Plan, stage: int = 0, frozen: tuple[str, ...] = ()) -> list[tuple[str, int]]:
    """``(name, local elements)`` of this rank's trainable parameters, in registration order."""
    if not model.shape_known:
        return [("<all parameters>", model.n_params)]
    return [(p.name, p.numel) for p in local_parameters(model, plan, stage) if not is_frozen(p.name, frozen)]


@dataclass(frozen=True)
class StageParams:
    """What one TP rank of one pipeline stage holds, as sizes: everything the ledger, comm and the planner
    need about its parameters. A stage is known by ``(tp, blocks, first, last)`` and the ZeRO unit rule:
    every block has the same parameters (so the planner memoises on exactly these)."""

    units: tuple[tuple[str, int], ...]      # (unit, trainable local elements), registration order, non-empty
    numels: tuple[int, ...]                 # every local tensor's elements, registration order
    tp_replicated: int                      # elements replicated across TP (norms, row biases, pos_emb)
    kv: int                                 # elements of wk and wv (replicated when tp > kv_heads)

    @property
    def total(self) -> int:
        return sum(n for _, n in self.units)


def stage_params(model: ModelSpec, plan: Plan, stage: int = 0, frozen: tuple[str, ...] = ()) -> StageParams:
    """:class:`StageParams` of ``stage`` (exact from :meth:`ModelSpec.parameter_shapes`, or one unit of
    ``n_params`` elements for a model given by count only)."""
    if not model.shape_known:
        return StageParams((("root", model.n_params),), (model.n_params,), 0, 0)
    if frozen:
        return _stage_params_of(tuple(p for p in local_parameters(model, plan, stage)
                                      if not is_frozen(p.name, frozen)))
    return _stage_params(model, plan.tp, plan.pp, plan.interleave, plan.zero_unit, stage, plan.pp_split, plan.ep)


@functools.lru_cache(maxsize=4096)
def _stage_params(model: ModelSpec, tp: int, pp: int, interleave: int, zero_unit: str, stage: int,
                  split: str = "layers", ep: int = 1) -> StageParams:
    return _stage_params_of(_local_parameters(model, tp, pp, interleave, zero_unit, stage, split, ep))


def _stage_params_of(params: tuple[LocalParam, ...]) -> StageParams:
    units: dict[str, int] = {}
    for p in params:
        units[p.unit] = units.get(p.unit, 0) + p.numel
    return StageParams(tuple((u, n) for u, n in units.items() if n), tuple(p.numel for p in params),
                       sum(p.numel for p in params if p.tp_replicated),
                       sum(p.numel for p in params if p.name.split(".")[-2] in ("wk", "wv")))


# --------------------------------------------------------------------------------------------------
# ZeRO units and shards; DDP buckets
# --------------------------------------------------------------------------------------------------

def shard_group(plan: Plan) -> int:
    """Ranks a ZeRO unit is sharded over: the gradient-sync group ``dp * cp``."""
    return plan.dp * plan.cp


def shard_size(n: int, g: int) -> int:
    """Elements of a unit of ``n`` that each of ``g`` ranks owns: ``ceil(n / g)`` (the last shard padded)."""
    return -(-n // g)


def padded(n: int, g: int) -> int:
    """A unit of ``n`` elements padded to ``g * ceil(n / g)`` (every shard the same size)."""
    return g * shard_size(n, g)


def shard_range(n: int, g: int, r: int) -> tuple[int, int]:
    """``[start, end)`` of the padded flat unit that rank ``r`` of ``g`` owns."""
    s = shard_size(n, g)
    return r * s, (r + 1) * s


def unit_sizes(model: ModelSpec, plan: Plan, stage: int = 0, frozen: tuple[str, ...] = ()) -> dict[str, int]:
    """Trainable local elements per ZeRO unit of ``stage`` (in registration order; empty units dropped)."""
    return dict(stage_params(model, plan, stage, tuple(frozen)).units)


def grad_comm_bytes(plan: Plan) -> int:
    """Bytes per element of the gradients that are communicated (bf16 for the 2-byte-gradient layouts)."""
    return 2 if plan.optim.grad_bytes == 2 else 4


def param_comm_bytes(plan: Plan) -> int:
    """Bytes per element of gathered parameters (FSDP2 mixed precision gathers compute-dtype copies)."""
    return plan.dtype_bytes if plan.optimizer == "fsdp2-mixed" else plan.optim.param_bytes


def pack_buckets(items: list[tuple[str, int]], cap_bytes: float) -> list[list[tuple[str, int]]]:
    """Cut ``(name, bytes)`` items, already in all-reduce order, into buckets of at most ``cap_bytes``:
    a bucket closes when the next item would overflow it, and always holds at least one item.

    The one definition of the bucket rule: :func:`ddp_buckets` predicts with it and the runnable
    ``distributed.data_parallel.data_parallel.BucketedDDP`` builds its buckets with it.
    """
    buckets: list[list[tuple[str, int]]] = []
    current: list[tuple[str, int]] = []
    size = 0
    for name, nbytes in items:
        if current and size + nbytes > cap_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append((name, nbytes))
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def ddp_buckets(model: ModelSpec, plan: Plan, stage: int = 0,
                frozen: tuple[str, ...] = ()) -> list[list[tuple[str, int]]]:
    """DDP's gradient buckets: lists of ``(name, gradient bytes)``, in the order they are all-reduced.

    Walk the trainable parameters in *reverse* registration order (the order their gradients become ready
    in backward) and :func:`pack_buckets` them under ``bucket_mb * 10**6`` bytes. Unlike torch's DDP there
    is no special small first bucket. Gradient bytes: :func:`grad_comm_bytes`. With ``ep > 1`` the routed
    experts are not in the buckets (they are averaged over the ``edp`` group, :func:`expert_grad_tensors`).
    """
    gb = grad_comm_bytes(plan)
    items = [(name, numel * gb) for name, numel in reversed(trainable(model, plan, stage, frozen))
             if not (plan.ep > 1 and is_expert_param(name))]
    return pack_buckets(items, plan.bucket_mb * 1e6)


def expert_grad_tensors(model: ModelSpec, plan: Plan, stage: int = 0,
                        frozen: tuple[str, ...] = ()) -> list[tuple[str, int]]:
    """With ``ep > 1``: ``(name, local elements)`` of the routed experts' trainable tensors of ``stage``, in the
    order their gradients are averaged over the ``edp`` group (reverse registration order, one call each)."""
    if plan.ep == 1:
        return []
    return [(n, k) for n, k in reversed(trainable(model, plan, stage, frozen)) if is_expert_param(n)]


def bucket_bytes(model: ModelSpec, plan: Plan, stage: int = 0) -> tuple[int, ...]:
    """The sizes of :func:`ddp_buckets` (memoised on what they depend on: the stage's tensors, the cap)."""
    if not model.shape_known or plan.ep > 1:
        return tuple(sum(b for _, b in bucket) for bucket in ddp_buckets(model, plan, stage))
    sp = _stage_params(model, plan.tp, plan.pp, plan.interleave, plan.zero_unit, stage, plan.pp_split)
    return _bucket_sizes(sp.numels, grad_comm_bytes(plan), plan.bucket_mb)


@functools.lru_cache(maxsize=4096)
def _bucket_sizes(numels: tuple[int, ...], gb: int, bucket_mb: float) -> tuple[int, ...]:
    buckets = pack_buckets([("", n * gb) for n in reversed(numels)], bucket_mb * 1e6)
    return tuple(sum(b for _, b in bucket) for bucket in buckets)
