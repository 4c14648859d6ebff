"""What one rank holds and keeps in flight, computed once per (model, plan, stage).

A :class:`RankView` gathers the facts that the ledger, its peak model and the planner's fast path price:
the stage's local parameters and ZeRO units (``parallel_lab.sharding``: TP split, kv-head rule, vocabulary
padding, pipeline chunks), the shard group ``g = dp * cp`` and the shards ``ceil(n_u / g)``, the model
state by category (Rajbhandari et al. 2020, "ZeRO": ``param + grad + optim`` bytes per element, each
category whole or sharded), the stage's layers, the micro-batches and blocks it holds at its peak
(Narayanan et al. 2021, :func:`block_inflight`), the logits the last stage keeps, the P2P messages its
list posts at once, and the local head, kv and vocabulary widths. Each fact is computed on first use and
kept; :func:`rank_view` caches the view per (model, plan, stage), so a plan's walk from ``ledger.memory``
to its verdict asks ``sharding`` and ``schedules`` once per fact.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from functools import cached_property

from .errors import ParallelLabError
from .schedules.generators import compute_orders
from .schedules.inflight import head_inflight, messages_at_once, peak_activation_units, split_backward
from .sharding import (
    LocalParam,
    chunk_layers,
    grad_comm_bytes,
    kv_heads_local,
    kv_width_local,
    local_parameters,
    padded,
    param_comm_bytes,
    q_width_local,
    shard_group,
    shard_size,
    stage_layers,
    unit_sizes,
    vocab_local,
)
from .specs import ModelSpec, Plan


def inflight_microbatches(schedule: str, p: int, m: int, v: int = 1, stage: int = 0) -> float:
    """Micro-batches whose activations stage ``stage`` holds at its peak, in units of the whole stage.

    * no pipeline (``p == 1``): 1 (each micro-batch's backward follows its forward);
    * otherwise the count read off the schedule's own action lists,
      :func:`parallel_lab.schedules.peak_activation_units` (closed forms checked against the lists):
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


def grads_stay_sharded(zero: int, zero2_accumulate: str, m: int) -> bool:
    """Whether a rank's gradients stay sharded over the whole step (their peak is ``ceil(n_u / g)`` per
    unit): ZeRO-3; ZeRO-2 unless it holds the full gradients over several micro-batches
    (``zero2_accumulate="unsharded"`` with ``m > 1``: the peak is the full gradients, between
    micro-batches). A unit's full gradient before its reduce-scatter is a comm buffer."""
    if zero == 2:
        return zero2_accumulate == "sharded" or m == 1
    return zero >= 3


def gradients_sharded(plan: Plan) -> bool:
    """:func:`grads_stay_sharded` of ``plan`` (its ZeRO stage, ZeRO-2 accumulation and micro-batches)."""
    return grads_stay_sharded(plan.zero, plan.zero2_accumulate, plan.microbatches)


def check_stage(plan: Plan, stage: int | None) -> list[int]:
    """``[stage]``, or every stage for ``stage=None``; an error names a stage that ``plan`` lacks."""
    if stage is None:
        return list(range(plan.pp))
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < plan.pp:
        raise ParallelLabError(f"stage={stage!r} is not a pipeline stage of pp={plan.pp}; "
                               f"pick 0..{plan.pp - 1}")
    return [stage]


def _under_tp(local: Callable[[ModelSpec, int], int]) -> cached_property:
    """A cached property of a :class:`RankView`: ``local(model, tp)``, a width this rank holds under TP."""
    return cached_property(lambda self: local(self.model, self.plan.tp))


class RankView:
    """One rank of pipeline stage ``stage`` of ``plan`` training ``model``: what it holds and keeps in
    flight. Every attribute is computed on first use and kept (build views with :func:`rank_view`)."""

    def __init__(self, model: ModelSpec, plan: Plan, stage: int) -> None:
        self.model, self.plan, self.stage = model, plan, stage
        self.first, self.last = stage == 0, stage == plan.pp - 1

    # ---- parameters and ZeRO shards ------------------------------------------------------------------
    @cached_property
    def params(self) -> tuple[LocalParam, ...]:
        """The stage's local parameters, in registration order (``sharding.local_parameters``)."""
        return tuple(local_parameters(self.model, self.plan, self.stage))

    @cached_property
    def units(self) -> dict[str, int]:
        """Trainable local elements per ZeRO unit (``sharding.unit_sizes``; one unit for a bare count)."""
        return unit_sizes(self.model, self.plan, self.stage)

    @cached_property
    def group(self) -> int:
        """The ranks a unit is sharded over: the gradient-sync group ``dp * cp``."""
        return shard_group(self.plan)

    @cached_property
    def elements(self) -> int:
        """Local elements of the stage, every unit whole."""
        return sum(self.units.values())

    @cached_property
    def shard_elements(self) -> int:
        """Local elements of the stage's shards, ``sum_u ceil(n_u / g)``."""
        g = self.group
        return sum(shard_size(n, g) for n in self.units.values())

    @cached_property
    def largest_padded(self) -> int:
        """The largest unit padded to ``g * ceil(n / g)`` elements."""
        g = self.group
        return max(padded(n, g) for n in self.units.values())

    @cached_property
    def param_comm_bytes(self) -> int:
        """Bytes per element of gathered parameters (``sharding.param_comm_bytes``)."""
        return param_comm_bytes(self.plan)

    @cached_property
    def grad_comm_bytes(self) -> int:
        """Bytes per element of communicated gradients (``sharding.grad_comm_bytes``)."""
        return grad_comm_bytes(self.plan)

    @cached_property
    def gradients_sharded(self) -> bool:
        """:func:`gradients_sharded` of the plan."""
        return gradients_sharded(self.plan)

    @cached_property
    def state(self) -> dict[str, float]:
        """Model-state bytes: ``parameters`` (sharded under ZeRO-3), ``gradients`` (sharded while they stay
        sharded), ``optimizer_states`` (sharded under ZeRO >= 1), each ``elements * bytes``."""
        p, o = self.plan, self.plan.optim
        full, sharded = self.elements, self.shard_elements
        return {
            "parameters": float((sharded if p.zero >= 3 else full) * o.param_bytes),
            "gradients": float((sharded if self.gradients_sharded else full) * o.grad_bytes),
            "optimizer_states": float((sharded if p.zero >= 1 else full) * o.optim_bytes),
        }

    # ---- pipeline: layers, in-flight micro-batches, messages ------------------------------------------
    @cached_property
    def layers(self) -> list[int]:
        """The model layers (blocks) of the stage, every chunk (``sharding.stage_layers``)."""
        p = self.plan
        return stage_layers(self.model.layers, p.pp, p.interleave, self.stage, p.pp_split)

    @cached_property
    def inflight(self) -> float:
        """:func:`inflight_microbatches` of the stage."""
        p = self.plan
        return inflight_microbatches(p.schedule, p.pp, p.microbatches, p.interleave, self.stage)

    @cached_property
    def blocks_inflight(self) -> float:
        """:func:`block_inflight` of the stage."""
        p = self.plan
        return block_inflight(self.model.layers, p.schedule, p.pp, p.microbatches, p.interleave, self.stage,
                              p.pp_split)

    @cached_property
    def head_inflight(self) -> int:
        """Micro-batches whose logits the last stage keeps at once (``schedules.head_inflight``)."""
        p = self.plan
        return head_inflight(p.schedule, p.pp, p.microbatches, p.interleave)

    @cached_property
    def messages(self) -> int:
        """P2P messages the stage's list posts at once at most (``schedules.messages_at_once``; 0 at pp=1)."""
        p = self.plan
        return messages_at_once(p.schedule, p.pp, p.microbatches, p.interleave)[self.stage] if p.pp > 1 else 0

    # ---- local widths under TP -----------------------------------------------------------------------
    q_width = _under_tp(q_width_local)
    kv_width = _under_tp(kv_width_local)
    kv_heads = _under_tp(kv_heads_local)

    @cached_property
    def vocab(self) -> int:
        """Vocabulary rows of the local embedding and head (padded to a multiple of ``tp``)."""
        return vocab_local(self.model, self.plan.tp)


@functools.lru_cache(maxsize=4096)
def rank_view(model: ModelSpec, plan: Plan, stage: int = 0) -> RankView:
    """The :class:`RankView` of ``stage``, one per (model, plan, stage) (``plan`` already validated)."""
    return RankView(model, plan, stage)
