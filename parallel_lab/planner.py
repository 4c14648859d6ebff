"""The 4-D planner: enumerate every valid way to split a model over N GPUs, estimate each, rank them.

Input: a model, a cluster, the number of GPUs, the sequence length, the global batch (in sequences, or
in tokens: ``16M`` tokens is ``16 * 2**20 = 16,777,216`` tokens, 2048 sequences of 8192, the batch Llama 3
used), and optional constraints. Output: every plan ``(tp, cp, pp, dp, zero, micro_batch, grad_accum,
recompute, schedule, interleave, sp)`` that keeps the global batch, respects the divisibility rules of
:meth:`Plan.validate`, keeps tensor parallelism inside a node and fits in memory with the safety margin,
ranked by estimated step time; and the families (``tp, cp, pp, dp`` degrees) that were rejected, counted
by reason: ``divisibility``, ``batch``, ``tp_across_nodes``, ``oom``.

Memory is the ledger's (:func:`parallel_lab.ledger.memory`): the largest stage total against
``hbm * (1 - margin)``. The peak at one moment, which ``memory``'s verdict also weighs, costs about 0.5 ms
a stage, too slow for 10^5 candidates: the search ranks by totals, and :meth:`PlannerResult.top` then checks
the plans it shows, in rank order, against ``memory``'s whole verdict (``ledger.MemoryLedger.fits``) and
leaves out those whose peak exceeds the budget (:meth:`PlannerResult.dropped_at_peak`), so a plan the
planner proposes is one ``parallel-lab memory`` says fits.
Communication is the comm module's (:func:`parallel_lab.comm.report`): each group's
collectives on the link tier its ranks land on in the placement ``arange(world).view(dp, pp, cp, tp)`` (TP
innermost, then CP, PP, DP). To estimate some 10^5 candidates in well under a second (Llama 3 405B on
16,384 GPUs: 73,602 candidates; Llama 2 7B: 64,632; ``bench/bench_planner.py`` prints the times), the
planner evaluates both through a fast path (:class:`_Fast`) that caches what depends on few degrees
(per-stage parameter units, DDP buckets, activation bytes per layer) and sums the same closed forms, and
the search computes each part once at the loop level it depends on (:meth:`_Search.family`); tests check
it against ``ledger.memory`` and ``comm.report`` plan by plan, and :func:`evaluate` uses the two modules
themselves.
Only stage 0 (most layers, the embedding, the most in-flight micro-batches) and the last stage (the head
and the logits) are evaluated: no middle stage exceeds both (also checked against the ledger).

Not searched: the optimizer layout, dtype, CP kind (ring by default) and DP kind (bucketed) are fixed by
:class:`Constraints`; GPipe is searched only when asked (it never beats 1F1B here: same bubble and
traffic, more micro-batches in flight).

Step time (per optimizer step, assumptions stated, no constant tuned to any result):

``step = (compute + tp + cp_exposed) * (1 + bubble_ratio) + pp + dp_exposed``

* ``compute``: hardware FLOPs of the busiest pipeline stage (its layers, plus the head on the last stage;
  recomputation adds its forward FLOPs) for all its micro-batches, split over its ``tp * cp`` GPUs, at
  ``cluster.mfu_achievable`` of peak (the efficiency of well-tuned kernels, 0.5 for the GPU presets).
* ``tp``: all tensor-parallel collectives (and the vocabulary-parallel ones), alpha-beta on their tier:
  they sit between the matmuls of every layer, on the critical path, with no overlap assumed.
* ``cp_exposed``: ring attention sends the next K/V block while computing on the current one, so only the
  part of the ring's time beyond the attention's own compute is exposed; all-gather and Ulysses CP wait
  for their collectives (fully exposed).
* ``bubble_ratio``: the closed form of :func:`parallel_lab.simulate.bubble_formula` for the schedule
  (checked against the simulator), with ``F : B : W = 1 : 1 : 1`` (backward twice the forward; with
  full recomputation ``B`` includes one more forward). It multiplies everything on the per-micro-batch
  critical path (compute, TP, CP). Stages are taken as equal (the busiest stage's time is used).
* ``pp``: every point-to-point transfer of the stage counts: in the executor's lists a receive is posted
  just before its consumer, so its transfer is not hidden (the simulator shows about one message per
  micro-batch and direction on the critical path).
* ``dp_exposed``: gradient synchronisation runs once per step after the last micro-batch's backward and
  overlaps with it (bucket by bucket, unit by unit): exposed is ``max(last collective, sync - one
  micro-batch's backward)``. The ZeRO-1/2 all-gather of updated parameters overlaps with the next step's
  first forward in the same way. ZeRO-3 gathers and reduce-scatters every micro-batch, prefetched under
  the whole step's compute: exposed is ``max(one unit's collectives, zero3 time - compute)``.

MFU = model FLOPs per step (``flops.step_flops``) / (step time * GPUs * peak), Chowdhery et al. 2022.
"""

from __future__ import annotations

import gc
import math
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache
from operator import add, itemgetter
from typing import Any

from . import comm as comm_mod
from . import layout, ledger
from .flops import flops_per_token, step_flops
from .schedules.inflight import head_inflight, messages_at_once
from .specs import (
    CP_KINDS,
    RECOMPUTE,
    SCHEDULES,
    ZERO2_ACCUMULATES,
    ClusterSpec,
    LinkTier,
    ModelSpec,
    ParallelLabError,
    Plan,
    divisors,
)
from .steptime import (
    NO_DP,
    DpTimes,
    StageFlops,
    StageTimes,
    bubble,
    combine,
    critical_parts,
    critical_path,
    dp_exposed,
    dp_times,
    plan_bubble,
    roofline_stage,
    stages_to_check,
)

REASONS = ("divisibility", "batch", "tp_across_nodes", "oom")
#: The Plan fields of a row of ``parallel-lab plan --json``.
ROW_FIELDS = ("dp", "tp", "pp", "cp", "zero", "zero2_accumulate", "sp", "micro_batch", "grad_accum", "recompute",
              "schedule", "interleave")
#: Plan fields a constraint may fix (``--fix tp=8,pp=16``).
FIXABLE = ("dp", "tp", "pp", "cp", "zero", "sp", "micro_batch", "grad_accum", "recompute", "schedule",
           "interleave", "cp_kind", "ep")


def shorten_list(values: Iterable[Any], n: int = 4) -> str:
    """``['128', 'x']``, at most ``n`` values, each cut to 20 characters (error messages stay short)."""
    vals = [str(v)[:20] for v in values]
    return repr(vals[:n] + (["..."] if len(vals) > n else []))


def parse_tokens(text: str | int) -> int:
    """``"16M"`` -> ``16 * 2**20`` tokens (K, M, G are powers of 2**10, as Llama 3's "16M tokens");
    a plain number is taken as is (``"16777216"``, ``"1.6e7"``)."""
    if isinstance(text, int):
        return text
    t = str(text).strip().upper()
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}
    try:
        if t and t[-1] in mult:
            value = float(t[:-1]) * mult[t[-1]]
        else:
            value = float(t)
    except ValueError:
        raise ParallelLabError(f"global batch {text!r} is not a token count; e.g. 16M (= 16*2^20 tokens) "
                               "or 16777216") from None
    if value < 1 or value != int(value):
        raise ParallelLabError(f"global batch {text!r} must be a whole positive number of tokens")
    return int(value)


def global_batch_sequences(seq: int, global_batch: int | None = None,
                           global_batch_tokens: int | str | None = None) -> int:
    """Sequences per optimizer step from either a count of sequences or of tokens (exactly one)."""
    if (global_batch is None) == (global_batch_tokens is None):
        raise ParallelLabError("give the global batch either in sequences (global_batch=2048) or in tokens "
                               "(global_batch_tokens='16M'), not both and not neither")
    if global_batch is not None:
        if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
            raise ParallelLabError(f"global_batch={global_batch!r} must be a positive number of sequences")
        return global_batch
    tokens = parse_tokens(global_batch_tokens)  # type: ignore[arg-type]
    if tokens % seq:
        raise ParallelLabError(f"global batch of {tokens:,} tokens is not a whole number of sequences of "
                               f"seq={seq}; pick a multiple of {seq}")
    return tokens // seq


@dataclass(frozen=True)
class Constraints:
    """What the planner may choose. ``fixed`` pins Plan fields (e.g. ``{"tp": 8, "pp": 16}``); the other
    fields list the options tried. ``max_tp`` defaults to the GPUs of one node.

    GPipe is left out of the default schedules: in this model it has 1F1B's bubble and traffic and holds
    ``m >= min(m, p)`` micro-batches, so it never beats its 1F1B twin. Add it to ``schedules`` (or fix
    ``schedule="gpipe"``) to see it ranked."""

    fixed: dict[str, Any] = field(default_factory=dict)
    max_tp: int | None = None
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = ("none", "selective", "full")
    schedules: tuple[str, ...] = ("1f1b", "interleaved", "zb-h1")
    sp: tuple[bool, ...] = (False, True)
    cp_kind: str = "ring"
    optimizer: str = "adam-mixed"
    dtype: str = "bf16"
    margin: float = 0.1
    max_micro_batch: int | None = None
    attention: str = "eager"
    mlp: str = "eager"
    pp_split: str = "layers"
    #: ZeRO-2's gradient accumulation variants tried (``Plan.zero2_accumulate``): hold the full gradients
    #: until the last micro-batch ("unsharded"), or reduce-scatter every micro-batch ("sharded", FSDP's)
    zero2_accumulate: tuple[str, ...] = ("unsharded",)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.fixed) - set(FIXABLE))
        if unknown:
            raise ParallelLabError(f"cannot fix {unknown}; fixable fields: {', '.join(FIXABLE)}")
        if self.cp_kind not in CP_KINDS:
            raise ParallelLabError(f"cp_kind={self.cp_kind!r}; pick one of {', '.join(CP_KINDS)}")
        if not 0 <= self.margin < 1:
            raise ParallelLabError(f"margin={self.margin} must be a fraction in [0, 1); e.g. 0.1")
        for name, values, known in (("recompute", self.recompute, RECOMPUTE), ("schedules", self.schedules, SCHEDULES),
                                    ("zero_stages", self.zero_stages, (0, 1, 2, 3)),
                                    ("zero2_accumulate", self.zero2_accumulate, ZERO2_ACCUMULATES)):
            bad = [v for v in values if v not in known]
            if bad or not values:
                raise ParallelLabError(f"{name}={shorten_list(bad or values)} is not known; pick from "
                                       f"{', '.join(map(str, known))}")

    def options(self, name: str, default: Iterable[Any]) -> list[Any]:
        return [self.fixed[name]] if name in self.fixed else list(default)


def parse_fix(text: str | None) -> dict[str, Any]:
    """``"tp=8,pp=16,schedule=interleaved"`` -> ``{"tp": 8, "pp": 16, "schedule": "interleaved"}``."""
    out: dict[str, Any] = {}
    if not text:
        return out
    for part in text.split(","):
        if "=" not in part:
            raise ParallelLabError(f"--fix entry {part!r} is not NAME=VALUE; e.g. --fix tp=8,pp=16")
        k, v = (s.strip() for s in part.split("=", 1))
        k = k.replace("-", "_")
        if k not in FIXABLE:
            raise ParallelLabError(f"--fix {k}: not a fixable field; pick from {', '.join(FIXABLE)}")
        if k in ("recompute", "schedule", "cp_kind"):
            out[k] = v
        elif k == "sp":
            out[k] = v.lower() in ("1", "true", "yes", "on")
        else:
            try:
                out[k] = int(v)
            except ValueError:
                raise ParallelLabError(f"--fix {k}={v!r} must be an integer") from None
    return out


# --------------------------------------------------------------------------------------------------
# Estimates
# --------------------------------------------------------------------------------------------------

@dataclass
class Estimate:
    """One plan with its memory and step-time estimate (see the module docstring for the model).

    ``fields`` are the Plan's fields; ``plan`` builds (and keeps) the :class:`Plan` on first use, so that
    the search need not build one per candidate.
    """

    fields: dict[str, Any]
    memory_bytes: float              # largest stage total (the ledger's)
    usable_bytes: float              # hbm * (1 - margin)
    compute_s: float                 # the busiest stage's compute for the step
    bubble_ratio: float
    comm_s: dict[str, float]         # alpha-beta time per dim (the stage that sets the step time)
    exposed_s: dict[str, float]      # what of it is on the critical path
    step_time_s: float
    mfu: float
    _plan: Plan | None = field(default=None, repr=False, compare=False)
    #: ``memory``'s verdict on the plan, the larger of the total and the peak at one moment
    #: (``ledger.MemoryLedger.need_bytes``); set by :meth:`PlannerResult.top`, None until checked
    need_bytes: float | None = field(default=None, compare=False)

    @property
    def plan(self) -> Plan:
        if self._plan is None:
            self._plan = Plan(**self.fields)
        return self._plan

    @property
    def headroom_bytes(self) -> float:
        """What is left of ``usable_bytes``: after the verdict's need once it is checked, else the total."""
        return self.usable_bytes - (self.memory_bytes if self.need_bytes is None else self.need_bytes)

    @property
    def bubble_s(self) -> float:
        critical = self.compute_s + self.exposed_s.get("tp", 0.0) + self.exposed_s.get("cp", 0.0)
        return critical * self.bubble_ratio

    def row(self) -> dict[str, Any]:
        """The JSON row of ``parallel-lab plan --json``."""
        f = self.fields
        out = {k: f[k] for k in ROW_FIELDS}
        if "ep" in f:
            out["ep"] = f["ep"]
        if self.need_bytes is not None:
            out["need_bytes"] = self.need_bytes
        out.update({"memory_bytes": self.memory_bytes, "headroom_bytes": self.headroom_bytes,
                    "step_time_s": self.step_time_s, "mfu": self.mfu, "bubble_ratio": self.bubble_ratio,
                    "compute_s": self.compute_s, "exposed_comm_s": dict(self.exposed_s),
                    "comm_s": dict(self.comm_s)})
        return out


def evaluate(model: ModelSpec, cluster: ClusterSpec, plan: Plan, *, margin: float = 0.1,
             bubble_ratio: float | None = None) -> Estimate:
    """Estimate one plan with ``ledger.memory`` and ``comm.report`` themselves (the slow, reference path).

    Memory is the ledger's largest stage; times follow :mod:`parallel_lab.steptime`. ``bubble_ratio``
    replaces the schedule's closed form, for a what-if the Plan cannot express (Llama 3 405B's interleaving
    of 126 layers in 128 chunks, two of which hold only the embedding and the head)."""
    plan.validate(model, cluster=cluster)
    led = ledger.memory(model, plan, cluster, margin=margin)
    rate = cluster.mfu_achievable * cluster.peak_flops
    tok = plan.micro_batch * plan.microbatches * plan.seq / (plan.tp * plan.cp)
    fl = StageFlops(model, plan.seq, plan.pp_split, plan.mlp, plan.attention)
    stages = []
    for s in stages_to_check(plan.pp, plan.pp_split):
        rep = comm_mod.report(model, plan, cluster, stage=s)
        tier = layout.group_tier(cluster, plan, "dp", s)
        compute, attention = _compute(model, cluster, fl, plan.seq, plan.tp, plan.cp, plan.micro_batch,
                                      plan.microbatches, plan.pp, plan.interleave, s, plan.recompute, tok, rate)
        stages.append(StageTimes(compute, attention, dict(rep.time_s),
                                 dp_times(rep.collectives, tier, plan.zero, plan.microbatches),
                                 _tp_overlap(cluster, plan.sp)))
    bub = plan_bubble(plan) if bubble_ratio is None else bubble_ratio
    mf = step_flops(model, plan).model_flops_per_step
    step, comm_s, exposed, compute = combine(plan.zero, plan.cp_kind, plan.microbatches, plan.recompute, bub,
                                             stages)
    mfu = mf / (step * plan.world * cluster.peak_flops)
    return Estimate(plan.to_dict(), led.total_bytes, cluster.hbm_bytes * (1 - margin), compute, bub,
                    dict(comm_s), exposed, step, mfu, _plan=plan, need_bytes=led.need_bytes)


def _compute(model: ModelSpec, cluster: ClusterSpec, fl: StageFlops, seq: int, tp: int, cp: int, mb: int, m: int,
             pp: int, v: int, stage: int, recompute: str, tok: float, rate: float) -> tuple[float, float]:
    """(compute, attention) seconds of a stage: the roofline of ``cluster.profile`` when it has one, else
    the stage's hardware FLOPs at ``mfu_achievable`` of peak (``steptime`` module docstring)."""
    if cluster.profile is None:
        return fl.stage(pp, v, stage, recompute) * tok / rate, fl.attention(pp, v, stage) * tok / rate
    return roofline_stage(model, cluster.profile, cluster.peak_flops, seq, tp, cp, mb, m, fl.n_layers(pp, v, stage),
                          v, stage == pp - 1, recompute, fl.attention_kernel, fl.mlp)


def _tp_overlap(cluster: ClusterSpec, sp: bool) -> float:
    return cluster.profile.tp_overlap if cluster.profile is not None and sp else 0.0


# --------------------------------------------------------------------------------------------------
# The fast path: the ledger's and comm's own functions, memoised on the few quantities each depends on
# --------------------------------------------------------------------------------------------------

def _variant(plan: Plan, **changes: Any) -> Plan:
    """``dataclasses.replace(plan, **changes)`` without re-running ``Plan.__post_init__``'s checks.

    The fast path builds some 10^4 plans that differ from a validated one in a few degrees chosen by the
    search (whose validity the search itself checked) or that stand for one pipeline stage; validating each
    again costs more than the estimate. Nothing outside the planner's memo functions sees these plans."""
    new = object.__new__(Plan)
    new.__dict__.update(plan.__dict__)
    new.__dict__.update(changes)
    return new


class _Fast:
    """Memory and step times of a plan from the ledger's and comm's own functions, each memoised on the
    few quantities it depends on: a pipeline stage's parameters on ``(tp, pp, interleave, stage)`` (the
    layout caches them by block count, embedding and head), the activations on ``(tp, sp, cp,
    micro_batch, recompute)``, one block's TP and CP calls for one micro-batch on the same, scaled by the
    stage's blocks and micro-batches exactly as comm scales them; a stage's DP calls on ``(tp, pp,
    interleave, stage, dp * cp, ZeRO variant)``, and on ``m`` only where comm's calls change with it. Tests
    compare :meth:`memory` with ``ledger.memory`` and :meth:`times` with ``comm.report`` plan by plan.
    The memo lives in the object: one search, one model.
    """

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, seq: int, c: Constraints) -> None:
        self.model, self.cluster, self.seq, self.c = model, cluster, seq, c
        self.base = Plan(seq=seq, optimizer=c.optimizer, dtype=c.dtype, cp_kind=c.cp_kind, attention=c.attention,
                         mlp=c.mlp, pp_split=c.pp_split)
        self.fl = StageFlops(model, seq, c.pp_split, c.mlp, c.attention)
        self.rate = cluster.mfu_achievable * cluster.peak_flops
        self.tp_overlap = {sp: _tp_overlap(cluster, sp) for sp in (False, True)}
        self._memo: dict[tuple, Any] = {}
        #: ``comm.collective_time(kind, message_bytes, group_size, tier)``, memoised in this object (one search)
        self._t = cache(comm_mod.collective_time)

    def _time(self, colls: list[comm_mod.Collective], tier: LinkTier) -> float:
        """Seconds of ``colls`` on ``tier`` (comm's alpha-beta model, as ``comm.report`` sums it)."""
        return sum(c.count * self._t(c.kind, c.message_bytes, c.group_size, tier) for c in colls)

    def _once(self, key: tuple, compute: Any) -> Any:
        memo = self._memo
        if key not in memo:
            memo[key] = compute()
        return memo[key]

    def _stage_plan(self, tp: int, pp: int, v: int, **kw: Any) -> Plan:
        """A plan with the stage layout of ``(tp, pp, v)`` (for the functions that read only that)."""
        return _variant(self.base, tp=tp, pp=pp, interleave=v, grad_accum=pp,
                       schedule="interleaved" if v > 1 else "1f1b", **kw)

    def _edge_plan(self, first: bool, last: bool, **kw: Any) -> tuple[Plan, int]:
        """A plan and stage whose stage holds the embedding iff ``first`` and the head iff ``last``."""
        pp = 1 if first and last else (2 if first != last else 3)
        stage = 0 if first else (pp - 1 if last else 1)
        return _variant(self.base, pp=pp, grad_accum=pp, **kw), stage

    # ---- memory (ledger) ----------------------------------------------------------------------------
    def state_and_buffers(self, tp: int, pp: int, v: int, stage: int, g: int, zero: int,
                          zero_unit: str = "block", dp_kind: str = "bucketed", m: int = 1,
                          accumulate: str = "unsharded") -> tuple[float, float]:
        """``ledger.stage_state_bytes`` and ``ledger.state_buffer_bytes`` of the stage (``m`` micro-batches:
        ZeRO-2 holds full gradients between them unless it reduce-scatters every one)."""
        grads_sharded = ledger._gradients_sharded(zero, accumulate, m)

        def compute() -> tuple[float, float]:
            plan = self._stage_plan(tp, pp, v, dp=g, zero=zero, zero_unit=zero_unit, dp_kind=dp_kind,
                                    zero2_accumulate=accumulate)
            plan = _variant(plan, grad_accum=m)
            buf, _ = ledger.state_buffer_bytes(self.model, plan, stage)
            return float(sum(ledger.stage_state_bytes(self.model, plan, stage).values())), float(buf or 0.0)
        return self._once(("state", tp, pp, v, stage, g, zero, zero_unit, dp_kind, grads_sharded, accumulate),
                          compute)

    def act_per_layer(self, tp: int, sp: bool, cp: int, mb: int, recompute: str) -> float:
        got = self._memo.get(key := ("act", tp, sp, cp, mb, recompute))
        if got is None:
            got = self._memo[key] = ledger.activation_bytes_per_layer(
                self.model, _variant(self.base, tp=tp, sp=sp, cp=cp, micro_batch=mb, recompute=recompute))
        return got

    def logits_per_mb(self, tp: int, cp: int, mb: int) -> float:
        return self._once(("logits", tp, cp, mb), lambda: ledger.logits_bytes(
            self.model, _variant(self.base, tp=tp, cp=cp, micro_batch=mb)))

    def act_buffers(self, tp: int, sp: bool, cp: int, mb: int, cp_kind: str) -> float:
        """``ledger.activation_buffer_bytes`` but its ``pp`` part (:meth:`pp_buffers`)."""
        got = self._memo.get(key := ("abuf", tp, sp, cp, mb, cp_kind))
        if got is None:
            got = self._memo[key] = ledger.activation_buffer_bytes(self.model, _variant(
                self.base, tp=tp, sp=sp, cp=cp, micro_batch=mb, pp=1, cp_kind=cp_kind))
        return got

    def pp_buffers(self, tp: int, sp: bool, cp: int, mb: int, schedule: str, pp: int, m: int, v: int,
                   stage: int) -> float:
        """``ledger.activation_buffer_parts``' ``pp`` part of ``stage``: the messages its list posts at once
        (``schedules.messages_at_once``) times ``ledger.pp_message_bytes``."""
        if pp == 1:
            return 0.0
        one = self._once(("ppmsg", tp, sp, cp, mb), lambda: ledger.pp_message_bytes(
            self.model, _variant(self.base, tp=tp, sp=sp, cp=cp, micro_batch=mb)))
        return messages_at_once(schedule, pp, m, v)[stage] * one

    def memory(self, plan: Plan, stage: int) -> float:
        """Bytes of stage ``stage`` per GPU, as ``ledger.memory(model, plan, stage=stage).total_bytes``."""
        p = plan
        state, buf = self.state_and_buffers(p.tp, p.pp, p.interleave, stage, p.dp * p.cp, p.zero, p.zero_unit,
                                            p.dp_kind, p.microbatches, p.zero2_accumulate)
        act = (self.act_per_layer(p.tp, p.sp, p.cp, p.micro_batch, p.recompute)
               * ledger.block_inflight(self.model.layers, p.schedule, p.pp, p.microbatches, p.interleave, stage,
                                       p.pp_split))
        logits = 0.0
        if stage == p.pp - 1:
            logits = self.logits_per_mb(p.tp, p.cp, p.micro_batch) * head_inflight(
                p.schedule, p.pp, p.microbatches, p.interleave)
        return (state + act + logits + buf + self.act_buffers(p.tp, p.sp, p.cp, p.micro_batch, p.cp_kind)
                + self.pp_buffers(p.tp, p.sp, p.cp, p.micro_batch, p.schedule, p.pp, p.microbatches, p.interleave,
                                  stage))

    # ---- times (comm) -------------------------------------------------------------------------------
    def tiers(self, dp: int, pp: int, cp: int, tp: int, stage: int, v: int = 1) -> dict[str, LinkTier]:
        """Link tier per dim: ``layout.group_tier`` of each group of ``stage``."""
        key = ("tiers", dp, pp, cp, tp, stage, v > 1)
        memo = self._memo
        if key not in memo:
            grid = layout.GridShape(dp, pp, cp, tp, v)
            memo[key] = {dim: layout.group_tier(self.cluster, grid, dim, stage) for dim in ("dp", "tp", "cp", "pp")}
        return memo[key]

    def dp_times(self, tp: int, pp: int, v: int, stage: int, g: int, zero: int, tier: LinkTier,
                 zero_unit: str = "block", accumulate: str = "unsharded", m: int = 1) -> DpTimes:
        """``steptime.dp_times`` of comm's dp collectives of the stage (ZeRO-3's per micro-batch; ZeRO-2
        with ``accumulate="sharded"`` reduce-scatters each of the ``m`` micro-batches; ZeRO-3 under a
        pipeline gathers and reduce-scatters once per step, so its per-micro-batch share depends on ``m``)."""
        m = m if accumulate == "sharded" or (zero == 3 and pp > 1) else 0   # only then does m matter

        def compute() -> DpTimes:
            plan, colls = self._dp_collectives(tp, pp, v, stage, g, zero, zero_unit, accumulate, m)
            return dp_times(colls, tier, zero, plan.microbatches, time=self._t)
        return self._once(("dp", tp, pp, v, stage, g, zero, tier.name, zero_unit, accumulate, m), compute)

    def _dp_collectives(self, tp: int, pp: int, v: int, stage: int, g: int, zero: int, zero_unit: str,
                        accumulate: str, m: int) -> tuple[Plan, list[comm_mod.Collective]]:
        """The stage plan and comm's dp collectives of the stage (``m`` micro-batches; 0: the stage plan's).

        Comm's counts are affine in ``m`` (as :meth:`_per_mb_and_step` uses): when the calls for ``m`` and
        ``2 m`` micro-batches are equal, they are the same for every ``m`` (ZeRO-3 under a pipeline
        gathers once per step), and are kept once; else they are asked of comm for each ``m``."""
        def stage_plan(mm: int) -> Plan:
            plan = self._stage_plan(tp, pp, v, dp=g, zero=zero, zero_unit=zero_unit, zero2_accumulate=accumulate)
            return _variant(plan, grad_accum=mm) if mm else plan

        def colls(plan: Plan) -> list[comm_mod.Collective]:
            return comm_mod.stage_collectives(self.model, plan, stage, dims=("dp",))
        if not m:
            plan = stage_plan(0)
            return plan, colls(plan)
        memo, key, plan = self._memo, ("dp_calls", tp, pp, v, stage, g, zero, zero_unit, accumulate), stage_plan(m)
        if key not in memo:
            here = colls(plan)
            memo[key] = here if here == colls(stage_plan(2 * m)) else None
            return plan, here
        return plan, memo[key] if memo[key] is not None else colls(plan)

    def _per_mb_and_step(self, dim: str, plan: Plan, stage: int, tier: LinkTier) -> tuple[float, float]:
        """(seconds per micro-batch, seconds once per step) of comm's ``dim`` calls: counts are affine in
        the number of micro-batches ``m``, so two evaluations (``m0`` and ``2 m0``) separate them exactly."""
        m0 = plan.grad_accum
        one = self._time(comm_mod.stage_collectives(self.model, plan, stage, dims=(dim,)), tier)
        two = self._time(comm_mod.stage_collectives(self.model, _variant(plan, grad_accum=2 * m0), stage,
                                                    dims=(dim,)), tier)
        return (two - one) / m0, 2 * one - two

    def times_raw(self, dp: int, t: int, pp: int, c: int, v: int, m: int, mb: int, sp: bool, recompute: str,
                  cp_kind: str, stage: int) -> StageTimes:
        """:meth:`stage_times`, memoised (for :meth:`times`; the search asks each one once)."""
        key = ("times", dp, t, pp, c, v, m, mb, sp, recompute, cp_kind, stage)
        memo = self._memo
        if key not in memo:
            memo[key] = self.stage_times(dp, t, pp, c, v, m, mb, sp, recompute, cp_kind, stage)
        return memo[key]

    def stage_times(self, dp: int, t: int, pp: int, c: int, v: int, m: int, mb: int, sp: bool, recompute: str,
                    cp_kind: str, stage: int) -> StageTimes:
        """Compute and the TP, CP and PP seconds of one stage for one step (no DP fields: :meth:`dp_times`).

        Comm's TP, PP and CP calls see a micro-batch only through its local tokens ``(seq / cp) *
        micro_batch``: one block's calls for one micro-batch, and the stage's calls once per step, are
        memoised on that product (the plans stand for it with ``micro_batch = 1``) and scaled by the stage's
        blocks and micro-batches as comm scales them (tests compare every figure with ``comm.report``, so a
        change in comm that broke this would be caught)."""
        memo, out = self._memo, {}
        where = memo.get(key := ("where", dp, t, pp, c, v, stage))
        if where is None:               # the groups' link tiers, the stage's blocks, its embedding and head
            where = memo[key] = (self.tiers(dp, pp, c, t, stage, v), self.fl.n_layers(pp, v, stage), stage == 0,
                                 stage == pp - 1)
        tiers, L, first, last = where
        tokens = (self.seq // c) * mb
        if t > 1:
            tt = tiers["tp"]
            layer = memo.get(key := ("tp_layer", t, sp, recompute, tokens, tt.name))
            if layer is None:           # one block, one micro-batch
                layer = memo[key] = self._time(comm_mod.tp_layer_collectives(self.model, _variant(
                    self.base, tp=t, sp=sp, recompute=recompute, seq=tokens, micro_batch=1)), tt)
            step = memo.get(key := ("tp_step", t, sp, pp, v, stage, tt.name))
            if step is None:            # once per step (SP's replicated gradients, replicated kv heads)
                step = memo[key] = self._time(comm_mod.tp_step_collectives(
                    self.model, self._stage_plan(t, pp, v, sp=sp), stage), tt)
            out["tp"] = L * m * layer + step
            vocab = memo.get(key := ("tp_vocab", t, sp, tokens, first, last, tt.name))
            if vocab is None:           # the vocabulary-parallel embedding and head
                plan, s = self._edge_plan(first, last, tp=t, sp=sp, seq=tokens, micro_batch=1)
                vocab = memo[key] = self._per_mb_and_step("tp_vocab", plan, s, tt)
            out["tp_vocab"] = m * vocab[0] + vocab[1]
        if pp > 1:
            tpp = tiers["pp"]
            p2p = memo.get(key := ("pp", t, sp, tokens, v, first, last, tpp.name))
            if p2p is None:
                plan, s = self._edge_plan(first, last, tp=t, sp=sp, seq=tokens, micro_batch=1, interleave=v,
                                          schedule="interleaved" if v > 1 else "1f1b")
                p2p = memo[key] = self._per_mb_and_step("pp", plan, s, tpp)
            out["pp"] = m * p2p[0] + p2p[1]
        if c > 1:
            tc = tiers["cp"]
            ring = memo.get(key := ("cp_layer", t, c, tokens, recompute, cp_kind, tc.name))
            if ring is None:            # one block, one micro-batch
                ring = memo[key] = self._time(comm_mod.cp_layer_collectives(self.model, _variant(
                    self.base, tp=t, cp=c, seq=tokens * c, micro_batch=1, recompute=recompute,
                    cp_kind=cp_kind)), tc)
            out["cp"] = L * m * ring
        tok = mb * m * self.seq / (t * c)
        # without a roofline profile the compute sees the micro-batches only through the tokens of the step
        # (the same for every micro-batch size of a family); with one, through both sizes
        sizes = (mb, m) if self.cluster.profile is not None else ()
        flops = memo.get(key := ("compute", t, c, pp, v, stage, recompute, tok, sizes))
        if flops is None:
            flops = memo[key] = _compute(self.model, self.cluster, self.fl, self.seq, t, c, mb, m, pp, v, stage,
                                         recompute, tok, self.rate)
        return StageTimes(*flops, out, NO_DP, self.tp_overlap[sp])

    def times(self, plan: Plan, stage: int) -> StageTimes:
        """Seconds of stage ``stage``: compute, and per dim ``comm.report(..., stage=stage).time_s``."""
        p = plan
        if p.dp * p.cp > 1 and p.zero == 0 and p.dp_kind == "naive":
            raise ParallelLabError("the planner's fast path models bucketed DDP only; use evaluate()")
        st = self.times_raw(p.dp, p.tp, p.pp, p.cp, p.interleave, p.microbatches, p.micro_batch, p.sp,
                            p.recompute, p.cp_kind, stage)
        st = StageTimes(st.compute, st.attention, dict(st.comm))
        g = p.dp * p.cp
        if g > 1:
            tier = self.tiers(p.dp, p.pp, p.cp, p.tp, stage, p.interleave)["dp"]
            st.dp = self.dp_times(p.tp, p.pp, p.interleave, stage, g, p.zero, tier, p.zero_unit,
                                  p.zero2_accumulate, p.microbatches)
            st.comm["dp"] = st.dp.total(p.microbatches)
        return st


# --------------------------------------------------------------------------------------------------
# Enumeration
# --------------------------------------------------------------------------------------------------

#: :meth:`PlannerResult.top` checks at most ``PEAK_SCAN_PER_PLAN`` plans per plan asked for (and at least
#: ``PEAK_SCAN_MIN``) at their peak at one moment.
PEAK_SCAN_PER_PLAN, PEAK_SCAN_MIN = 16, 64


@dataclass
class PlannerResult:
    """Ranked plans (best first), rejected families by reason, and what was searched."""

    estimates: Sequence[Estimate]
    rejected: dict[str, int]
    families: int
    candidates: int
    elapsed_s: float
    model: ModelSpec
    cluster: ClusterSpec
    gpus: int
    seq: int
    global_batch: int
    margin: float = 0.1
    _at_peak: dict[int, bool] = field(default_factory=dict, repr=False, compare=False)

    def fits_at_peak(self, i: int) -> bool:
        """Whether ``estimates[i]`` also passes ``memory``'s whole verdict: the larger of its total and its
        peak at one moment within ``hbm * (1 - margin)`` (``ledger.MemoryLedger.fits``, the rule the
        ``memory`` command and the plan files use). The search ranks by totals (module docstring); this is
        asked of the plans shown, once each, and sets their ``need_bytes``."""
        ok = self._at_peak.get(i)
        if ok is None:
            e = self.estimates[i]
            led = ledger.memory(self.model, e.plan, self.cluster, margin=self.margin)
            e.need_bytes = led.need_bytes
            ok = self._at_peak[i] = led.fits
        return ok

    def scan_limit(self, n: int | None) -> int:
        """How many estimates :meth:`top` checks at their peak for ``n`` plans: ``PEAK_SCAN_PER_PLAN * n``
        (at least ``PEAK_SCAN_MIN``), every one for ``n=None``; a peak costs up to ~20 ms (405B), so a search
        whose plans nearly all fail at their peak stops there instead of checking 10^4 of them."""
        total = len(self.estimates)
        return total if n is None else min(total, max(PEAK_SCAN_MIN, PEAK_SCAN_PER_PLAN * n))

    def _shown(self, n: int | None) -> list[int]:
        """Indices of the first ``n`` estimates (all if None) that fit at their peak too, among the first
        :meth:`scan_limit` by total."""
        out: list[int] = []
        for i in range(self.scan_limit(n)):
            if n is not None and len(out) >= n:
                break
            if self.fits_at_peak(i):
                out.append(i)
        return out

    def scan_stopped(self, n: int | None) -> bool:
        """Whether :meth:`top` found fewer than ``n`` plans because it stopped at :meth:`scan_limit`, with
        plans left that fit by their totals (they were not checked at their peak)."""
        return n is not None and len(self._shown(n)) < n and self.scan_limit(n) < len(self.estimates)

    def top(self, n: int | None = None) -> list[Estimate]:
        """The ``n`` best plans (all if None) that fit by ``memory``'s verdict, best first: the ranking with
        the plans whose peak at one moment exceeds the budget left out (:meth:`dropped_at_peak`)."""
        return [self.estimates[i] for i in self._shown(n)]

    def dropped_at_peak(self, n: int | None = None) -> list[Estimate]:
        """The plans ranked above the last of :meth:`top`'s ``n`` (fewer than ``n`` found: among the
        :meth:`scan_limit` checked) that fit by their totals but not at their peak at one moment (:meth:`top`
        leaves them out)."""
        shown = self._shown(n)
        end = shown[-1] + 1 if n is not None and len(shown) == n else self.scan_limit(n)
        return [self.estimates[i] for i in range(end) if not self.fits_at_peak(i)]

    def _first_match(self, fields: dict[str, Any]) -> int | None:
        """Index of the best plan whose fields match ``fields`` and that fits at its peak (only the matches are
        checked at their peak)."""
        for j, e in enumerate(self.estimates):
            if all(e.fields[k] == v for k, v in fields.items()) and self.fits_at_peak(j):
                return j
        return None

    def best_matching(self, **fields: Any) -> Estimate | None:
        """The best plan whose fields match ``fields`` that passes ``memory``'s whole verdict (None if none):
        cheap, unlike :meth:`rank_of`, which checks every plan above it."""
        j = self._first_match(fields)
        return None if j is None else self.estimates[j]

    def rank_of(self, **fields: Any) -> int | None:
        """1-based rank, in :meth:`top`, of the best plan whose fields match ``fields`` (None if none fits);
        the matches and every plan above the first that fits have their peak checked (up to ~20 ms each)."""
        j = self._first_match(fields)
        return None if j is None else sum(self.fits_at_peak(k) for k in range(j)) + 1

    def to_json(self, top: int | None = None) -> dict[str, Any]:
        """The JSON of ``parallel-lab plan``: with ``top``, the best ``top`` of :meth:`top` and the plans
        dropped at their peak among them; without, every plan that fits by its total, unchecked at its peak
        (checking 10^5 peaks would take minutes), ``dropped_at_peak`` then None."""
        rows = self.top(top) if top is not None else self.estimates
        return {"plans": [e.row() for e in rows], "rejected": dict(self.rejected),
                "dropped_at_peak": None if top is None else [e.row() for e in self.dropped_at_peak(top)],
                "families": self.families, "candidates": self.candidates, "fitting": len(self.estimates),
                "elapsed_s": self.elapsed_s, "model": self.model.name, "cluster": self.cluster.name,
                "gpus": self.gpus, "seq": self.seq, "global_batch": self.global_batch,
                "global_batch_tokens": self.global_batch * self.seq, "margin": self.margin}


def _family_reason(model: ModelSpec, cluster: ClusterSpec, c: Constraints, tp: int, cp: int, pp: int,
                   seq: int) -> str | None:
    try:
        Plan(tp=tp, cp=cp, pp=pp, seq=seq, cp_kind=c.cp_kind, attention=c.attention, mlp=c.mlp,
             pp_split=c.pp_split).validate(model)
    except ParallelLabError:
        return "divisibility"
    if tp > (c.max_tp or cluster.gpus_per_node):
        return "tp_across_nodes"
    return None


def _schedules(model: ModelSpec, c: Constraints, pp: int, m: int) -> list[tuple[str, int]]:
    """(schedule, interleave) options for ``pp`` stages and ``m`` micro-batches."""
    if pp == 1:
        return [("1f1b", 1)]
    out: list[tuple[str, int]] = []
    slots = model.layers + (2 if c.pp_split == "embed-head" else 0)
    fixed_v = c.fixed.get("interleave")
    for s in c.options("schedule", c.schedules):
        if s != "interleaved":
            out.append((s, 1))
        elif m % pp == 0 and fixed_v is not None:         # a fixed v may leave chunks unequal
            out += [(s, fixed_v)] if 1 < fixed_v and pp * fixed_v <= slots else []
        elif m % pp == 0 and c.pp_split == "layers":      # searched: the v that split the layers evenly
            out += [(s, v) for v in divisors(slots) if v > 1 and slots % (pp * v) == 0]
        # embed-head chunks are never equal (the first and last lose a block), so their in-flight peak is
        # read off the action list (ledger.block_inflight): searched only for a fixed interleave
    if fixed_v is not None:
        out = [(s, v) for s, v in out if v == fixed_v]
    return out


def _families(gpus: int, c: Constraints) -> Iterable[tuple[int, int, int, int]]:
    """Every ``(tp, cp, pp, dp)`` with ``tp * cp * pp * dp == gpus`` that the fixed degrees allow."""
    for tp in c.options("tp", divisors(gpus)):
        for cp in c.options("cp", divisors(gpus // tp)):
            for pp in c.options("pp", divisors(gpus // (tp * cp))):
                dp, rest = divmod(gpus, tp * cp * pp)
                if rest == 0 and c.fixed.get("dp", dp) == dp:
                    yield tp, cp, pp, dp


class RankedPlans(Sequence):
    """The fitting plans, best first, as a sequence of :class:`Estimate` built on first access.

    The search keeps one small record per fitting plan (its step time, memory and where its parts are);
    building the :class:`Estimate` (fields, per-dim dicts) only for the plans looked at keeps the search
    fast."""

    def __init__(self, records: list[_Record], build: Any) -> None:
        self._records = records
        self._build = build
        self._built: dict[int, Estimate] = {}

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self._records)
        if not -n <= i < n:
            raise IndexError(i)
        i %= n
        if i not in self._built:
            self._built[i] = self._build(self._records[i])
        return self._built[i]


@dataclass
class _Family:
    """One ``(tp, cp, pp, dp)`` family being searched, with its caches over (interleave, ZeRO stage)."""

    tp: int
    cp: int
    pp: int
    dp: int
    stages: list[int]
    tiers: list[LinkTier]          # the DP group's tier, per stage
    zeros: list[tuple[int, str]]   # (ZeRO stage, ZeRO-2 accumulation) variants
    _state: dict[tuple[int, tuple[int, str], bool], list[float]] = field(default_factory=dict)
    _dp: dict[tuple[int, tuple[int, str], int], list[DpTimes]] = field(default_factory=dict)

    def zeros_for(self, m: int) -> list[tuple[int, str]]:
        """The ZeRO variants that differ at ``m`` micro-batches. With ``m > 1`` ZeRO-2 that holds full
        gradients until the last micro-batch is ZeRO-1 (same memory, same reduce-scatter and all-gather):
        listed once, as ZeRO-1. With ``m == 1`` its two accumulations are the same plan: listed once."""
        zs = self.zeros
        return [(z, acc) for z, acc in zs
                if not (z == 2 and acc == "unsharded" and m > 1 and (1, "unsharded") in zs)
                and not (z == 2 and acc == "sharded" and m == 1 and (2, "unsharded") in zs)]

    def state(self, fast: _Fast, v: int, zv: tuple[int, str], m: int) -> list[float]:
        """Per stage: model-state bytes plus the ZeRO/DDP communication buffers (``m`` micro-batches)."""
        key = (v, zv, m > 1)
        if key not in self._state:
            g = self.dp * self.cp
            self._state[key] = [sum(fast.state_and_buffers(self.tp, self.pp, v, s, g, zv[0], m=m, accumulate=zv[1]))
                                for s in self.stages]
        return self._state[key]

    def dp_times(self, fast: _Fast, v: int, zv: tuple[int, str], m: int) -> list[DpTimes]:
        """Per stage: :meth:`_Fast.dp_times` (zeros without data parallelism)."""
        key = (v, zv, m if zv[1] == "sharded" or (zv[0] == 3 and self.pp > 1) else 0)
        if key not in self._dp:
            g = self.dp * self.cp
            self._dp[key] = [fast.dp_times(self.tp, self.pp, v, s, g, zv[0], tier, accumulate=zv[1], m=m)
                             if g > 1 else DpTimes() for s, tier in zip(self.stages, self.tiers, strict=True)]
        return self._dp[key]


#: One (family, micro-batch, schedule, recomputation, SP) choice, everything but the ZeRO stage, as a plain
#: tuple: ``(tp, cp, pp, dp, micro_batch, m, schedule, interleave, recompute, sp, bubble ratio)``.
_Variant = tuple[int, int, int, int, int, int, str, int, str, bool, float]
#: One fitting plan, a plain tuple: ``(step time, memory, variant, ZeRO stage, Plan.zero2_accumulate, index
#: of the checked stage that sets the step time, that stage's exposed DP seconds)``. Step time and memory
#: are the sort keys; :meth:`_Search.build` rebuilds the :class:`Estimate` from the rest. A search keeps
#: some 10^5 of them, made of numbers and strings only: the garbage collector stops tracking such tuples
#: the first time it sees them, so the full collections that follow in the session (each walks every
#: tracked object) do not walk the search's result again (``bench/bench_planner.py`` times one).
_Record = tuple[float, float, _Variant, int, str, int, float]


class _Search:
    """One search: the loops of :func:`plan_search`, sharing one :class:`_Fast`."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, gpus: int, seq: int, batch: int,
                 c: Constraints) -> None:
        self.model, self.cluster, self.gpus, self.batch, self.c = model, cluster, gpus, batch, c
        self.fast = _Fast(model, cluster, seq, c)
        self.usable = cluster.hbm_bytes * (1 - c.margin)
        self.model_flops = flops_per_token(model, seq) * batch * seq
        self.common = {"seq": seq, "optimizer": c.optimizer, "dtype": c.dtype, "cp_kind": c.cp_kind,
                       "attention": c.attention, "mlp": c.mlp, "pp_split": c.pp_split}
        self.records: list[_Record] = []
        self.candidates = 0

    def family(self, tp: int, cp: int, pp: int, dp: int) -> int:
        """Estimate every variant of one family (micro-batch, schedule, recompute, SP, ZeRO); returns how
        many fit.

        The loops nest micro-batch size > recomputation > SP > schedule > ZeRO variant, and each part of an
        estimate is computed at the outermost loop it depends on: in-flight micro-batches and model state
        per micro-batch size; the exposed DP time per recomputation (it does not depend on SP); stage
        times per SP choice and interleave; the bubble per schedule; memory and step time per candidate
        (:meth:`_variants`)."""
        c, fast = self.c, self.fast
        before = len(self.records)
        stages = stages_to_check(pp, fast.base.pp_split)
        fam = _Family(tp, cp, pp, dp, stages, [fast.tiers(dp, pp, cp, tp, s)["dp"] for s in stages],
                      [(z, acc) for z in c.options("zero", c.zero_stages) if z == 0 or dp > 1
                       for acc in (c.zero2_accumulate if z == 2 else ("unsharded",))])
        per_replica = self.batch // dp
        for mb in c.options("micro_batch", divisors(per_replica)):
            m, rest = divmod(per_replica, mb)
            if rest or (c.max_micro_batch and mb > c.max_micro_batch) or c.fixed.get("grad_accum", m) != m:
                continue
            # What the recomputation and SP choices share, once per micro-batch size: per schedule, each
            # checked stage's activation multiplier (its blocks x in-flight micro-batches) and the bytes of
            # the last stage's in-flight logits; per interleave, each ZeRO variant's model state and buffers.
            logits = fast.logits_per_mb(tp, cp, mb)
            scheds = [(sched, v, [ledger.block_inflight(self.model.layers, sched, pp, m, v, s, fast.base.pp_split)
                                  for s in stages], logits * head_inflight(sched, pp, m, v))
                      for sched, v in _schedules(self.model, c, pp, m)]
            zeros = fam.zeros_for(m)
            states = {v: [(zv, fam.state(fast, v, zv, m)) for zv in zeros] for _, v, _, _ in scheds}
            candidates = len(scheds) * len(zeros)      # per (recompute, SP) choice
            for recompute in c.options("recompute", c.recompute):
                # per interleave and ZeRO variant, the exposed DP time of each checked stage (SP's too)
                exposed: dict[int, dict[tuple[int, str], list[float]]] = {}
                for sp in c.options("sp", c.sp):
                    if not sp or tp > 1:
                        self.candidates += candidates
                        self._variants(fam, mb, m, recompute, sp, scheds, states, exposed)
        return len(self.records) - before

    def _variants(self, fam: _Family, mb: int, m: int, recompute: str, sp: bool,
                  scheds: list[tuple[str, int, list[float], float]],
                  states: dict[int, list[tuple[tuple[int, str], list[float]]]],
                  exposed: dict[int, dict[tuple[int, str], list[float]]]) -> None:
        """Every schedule and ZeRO stage of one (micro-batch, recompute, SP) choice of a family.

        A candidate fits when its largest checked stage does: state + buffers + activations (+ logits on
        the last). Its step time is, over the checked stages, the largest critical path (compute, TP, CP
        and PP, scaled by the schedule's bubble) plus that stage's exposed DP time. The stage times depend
        on the interleave, not the schedule; the exposed DP time on the interleave, the ZeRO variant and
        the stage's compute, not on SP: ``exposed`` keeps it per (interleave, ZeRO variant) for both SP
        choices. Both are computed for the first candidate that fits."""
        c, fast = self.c, self.fast
        tp, cp, pp, dp = fam.tp, fam.cp, fam.pp, fam.dp
        apl = fast.act_per_layer(tp, sp, cp, mb, recompute)
        abuf = fast.act_buffers(tp, sp, cp, mb, c.cp_kind)
        timed_v: dict[int, tuple[list[StageTimes], list[tuple[float, float, float, float]]]] = {}
        usable, records, later = self.usable, self.records, range(1, len(fam.stages))
        for sched, v, layers_x_inflight, logits in scheds:
            act = [apl * n + abuf + fast.pp_buffers(tp, sp, cp, mb, sched, pp, m, v, s)
                   for n, s in zip(layers_x_inflight, fam.stages, strict=True)]
            act[-1] += logits                                                  # the last stage's logits
            variant = None
            exposed_v = exposed.get(v)
            if exposed_v is None:
                exposed_v = exposed[v] = {}
            for zv, sb in states[v]:
                mem = max(map(add, sb, act))                                   # the largest checked stage
                if mem > usable:
                    continue
                if variant is None:
                    timed = timed_v.get(v)
                    if timed is None:    # per checked stage: its times, and what of them the bubble scales
                        sts = [fast.stage_times(dp, tp, pp, cp, v, m, mb, sp, recompute, c.cp_kind, s)
                               for s in fam.stages]
                        timed = timed_v[v] = sts, [critical_parts(st, c.cp_kind) for st in sts]
                    bub = bubble(sched, pp, m, v, recompute)
                    variant = (tp, cp, pp, dp, mb, m, sched, v, recompute, sp, bub)
                    cores = [critical_path(st, c.cp_kind, bub, parts)[0] for st, parts in zip(*timed, strict=True)]
                dps = exposed_v.get(zv)
                if dps is None:      # per checked stage: the exposed DP seconds
                    dps = exposed_v[zv] = [dp_exposed(zv[0], st.compute, m, recompute, dpt)
                                           for st, dpt in zip(timed[0], fam.dp_times(fast, v, zv, m), strict=True)]
                # the checked stage with the longest step sets it (the first, on a tie)
                i, step = 0, cores[0] + dps[0]
                for j in later:
                    step_j = cores[j] + dps[j]
                    if step_j > step:
                        i, step = j, step_j
                records.append((step, mem, variant, zv[0], zv[1], i, dps[i]))

    def build(self, record: _Record) -> Estimate:
        """The :class:`Estimate` of one record, its parts asked again of the fast path (memo hits: the same
        numbers the search ranked by)."""
        step, memory, variant, zero, accumulate, i, dp_exposed_s = record
        tp, cp, pp, dp, mb, m, schedule, v, recompute, sp, bub = variant
        fast, cp_kind = self.fast, self.c.cp_kind
        stage = stages_to_check(pp, fast.base.pp_split)[i]
        st = fast.stage_times(dp, tp, pp, cp, v, m, mb, sp, recompute, cp_kind, stage)
        _, tp_s, cp_s, pp_s = critical_path(st, cp_kind, bub)
        comm_s = dict(st.comm)
        if dp * cp > 1:
            tier = fast.tiers(dp, pp, cp, tp, stage)["dp"]           # the tier _Family.dp_times used
            comm_s["dp"] = fast.dp_times(tp, pp, v, stage, dp * cp, zero, tier, accumulate=accumulate,
                                         m=m).total(m)
        fields = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "zero": zero, "sp": sp, "micro_batch": mb,
                  "grad_accum": m, "recompute": recompute, "schedule": schedule, "interleave": v,
                  "zero2_accumulate": accumulate, **self.common}
        exposed = {"tp": tp_s, "cp": cp_s, "pp": pp_s, "dp": dp_exposed_s}
        mfu = self.model_flops / (step * self.gpus * self.cluster.peak_flops)
        return Estimate(fields, memory, self.usable, st.compute, bub, comm_s, exposed, step, mfu)


def plan_search(model: ModelSpec, cluster: ClusterSpec, gpus: int, seq: int, *,
                global_batch: int | None = None, global_batch_tokens: int | str | None = None,
                constraints: Constraints | None = None) -> PlannerResult:
    """Every valid plan for ``model`` on ``gpus`` GPUs of ``cluster``, ranked by estimated step time.

    A *family* is one choice of degrees ``(tp, cp, pp, dp)``; it is rejected for ``divisibility`` (heads,
    ffn, kv heads, layers or ``seq`` over ``2 cp``: :meth:`Plan.validate`), ``tp_across_nodes``, ``batch``
    (the global batch does not split over ``dp``), or ``oom`` (no variant fits). Within a family every
    micro-batch size, schedule (and interleave), recomputation, SP and ZeRO stage is estimated.
    """
    t0 = time.perf_counter()
    c = constraints or Constraints()
    model.require_shape("the planner")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ParallelLabError(f"gpus={gpus!r} must be a positive integer")
    batch = global_batch_sequences(seq, global_batch, global_batch_tokens)
    if model.is_moe:
        return _moe_search(model, cluster, gpus, seq, batch, c, t0)
    fixed_world = math.prod(c.fixed.get(k, 1) for k in ("dp", "tp", "pp", "cp"))
    if gpus % fixed_world:
        raise ParallelLabError(f"the fixed degrees multiply to {fixed_world}, which does not divide "
                               f"gpus={gpus}; fix degrees whose product divides the GPU count")
    search = _Search(model, cluster, gpus, seq, batch, c)
    rejected: Counter[str] = Counter()
    families = 0
    # The search allocates some 10^5 small tuples and no reference cycles: pausing the cyclic garbage
    # collector, which would otherwise rescan them again and again, saves about a third of the time.
    collecting = gc.isenabled()
    gc.disable()
    try:
        for tp, cp, pp, dp in _families(gpus, c):
            families += 1
            reason = _family_reason(model, cluster, c, tp, cp, pp, seq) or ("batch" if batch % dp else None)
            if reason is None and not search.family(tp, cp, pp, dp):
                reason = "oom"
            if reason:
                rejected[reason] += 1
    finally:
        if collecting:
            gc.enable()
    # ranked by step time, then memory, then the order found: records are appended in that order and a sort
    # is stable, so sorting by memory and then by step time gives that ranking (two sorts on float keys
    # are faster than one on tuples)
    records = sorted(search.records, key=itemgetter(1))     # memory
    records.sort(key=itemgetter(0))                         # step time
    estimates = RankedPlans(records, search.build)
    reasons = {r: rejected[r] for r in REASONS if rejected[r]}
    return PlannerResult(estimates, reasons, families, search.candidates, time.perf_counter() - t0, model,
                         cluster, gpus, seq, batch, c.margin)


def _moe_search(model: ModelSpec, cluster: ClusterSpec, gpus: int, seq: int, batch: int, c: Constraints,
                t0: float) -> PlannerResult:
    """The search for a mixture-of-experts model: families ``(dp, pp, ep)`` (tp = cp = 1, ``layout.check_ep``),
    ``ep`` over the divisors of ``dp`` that divide ``experts``; per family the three smallest micro-batch sizes, the
    schedules, recomputations and ZeRO stages (ZeRO only with ep = 1), each estimated by :func:`evaluate` (the
    ledger and comm themselves: their expert terms, and the all-to-all time on the ep group's link tier)."""
    rejected: Counter[str] = Counter()
    records: list[Estimate] = []
    families = candidates = 0
    base = {"seq": seq, "optimizer": c.optimizer, "dtype": c.dtype, "attention": c.attention, "mlp": c.mlp,
            "pp_split": c.pp_split}
    for pp in c.options("pp", [d for d in divisors(gpus) if d <= model.layers]):
        if gpus % pp:
            continue
        dp = gpus // pp
        if c.fixed.get("dp", dp) != dp or c.fixed.get("tp", 1) != 1 or c.fixed.get("cp", 1) != 1:
            continue
        for ep in c.options("ep", [d for d in divisors(dp) if model.experts % d == 0]):
            families += 1
            if batch % dp:
                rejected["batch"] += 1
                continue
            per_replica = batch // dp
            fitted = 0
            mbs = [mb for mb in divisors(per_replica) if not c.max_micro_batch or mb <= c.max_micro_batch][:3]
            for mb in c.options("micro_batch", mbs):
                m = per_replica // mb
                scheds = [s for s in c.options("schedule", c.schedules) if s != "interleaved"] if pp > 1 else ["1f1b"]
                for sched in scheds:
                    for recompute in c.options("recompute", c.recompute):
                        for zero in c.options("zero", c.zero_stages if ep == 1 and dp > 1 else (0,)):
                            candidates += 1
                            try:
                                plan = Plan(dp=dp, pp=pp, ep=ep, zero=zero, micro_batch=mb, grad_accum=m,
                                            schedule=sched, recompute=recompute, **base)
                                est = evaluate(model, cluster, plan, margin=c.margin)
                            except ParallelLabError:
                                rejected["divisibility"] += 1
                                continue
                            if est.memory_bytes <= est.usable_bytes:
                                records.append(est)
                                fitted += 1
            if not fitted:
                rejected["oom"] += 1
    ranked = sorted(records, key=lambda e: (e.step_time_s, e.memory_bytes))
    reasons = {r: rejected[r] for r in REASONS if rejected[r]}
    return PlannerResult(ranked, reasons, families, candidates, time.perf_counter() - t0, model, cluster, gpus,
                         seq, batch, c.margin)
