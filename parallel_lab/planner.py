"""The 4-D planner: enumerate every valid way to split a model over N GPUs, estimate each, rank them.

Every plan ``(tp, cp, pp, dp, zero, micro_batch, grad_accum, recompute, schedule, interleave, sp)`` that
keeps the global batch, passes :meth:`Plan.validate`, keeps TP inside a node and fits in
``hbm * (1 - margin)`` (the ledger's largest stage total), ranked by estimated step time

``step = (compute + tp + cp_exposed) * (1 + bubble_ratio) + pp + dp_exposed``

(compute at ``mfu_achievable`` of peak or the cluster's roofline profile; alpha-beta collectives on the
link tier each group lands on; the schedule's closed-form bubble, Narayanan et al. 2021, Qi et al.
2023; DP overlapped with the last backward). MFU = model FLOPs per step / (step time * GPUs * peak),
Chowdhery et al. 2022. Rejected families are counted by reason: ``divisibility``, ``batch``,
``tp_across_nodes``, ``oom``. The search estimates through :class:`parallel_lab.planner_fast.FastPath`
and computes each part once at the loop level it depends on (:meth:`_Search.family`); :func:`evaluate`
uses ``ledger.memory`` and ``comm.report`` themselves. Only stage 0 and the last stage are evaluated.
The assumptions, term by term: docs/planner.md.
"""

from __future__ import annotations

import gc
import math
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from operator import add, itemgetter
from typing import Any

from . import comm as comm_mod
from . import ledger, mesh
from .errors import ParallelLabError, divisors
from .flops import flops_per_token, step_flops
from .hardware import ClusterSpec, LinkTier
from .planner_constraints import Constraints, global_batch_sequences
from .planner_fast import FastPath, stage_compute, stage_optimizer, tp_overlap
from .planner_result import Estimate, PlannerResult
from .rank_view import block_inflight
from .schedules.inflight import head_inflight
from .specs import ModelSpec, Plan
from .steptime import (
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
    stages_to_check,
)

REASONS = ("divisibility", "batch", "tp_across_nodes", "oom")


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
        tier = mesh.group_tier(cluster, plan, "dp", s)
        compute, attention = stage_compute(model, cluster, fl, plan.seq, plan.tp, plan.cp, plan.micro_batch,
                                           plan.microbatches, plan.pp, plan.interleave, s, plan.recompute, tok,
                                           rate, plan.sp)
        stages.append(StageTimes(compute, attention, dict(rep.time_s),
                                 dp_times(rep.collectives, tier, plan.zero, plan.microbatches),
                                 tp_overlap(cluster, plan.sp),
                                 stage_optimizer(model, cluster, fl, plan.optimizer, plan.tp, plan.pp, plan.interleave,
                                                 s, plan.zero, plan.dp * plan.cp)))
    bub = plan_bubble(plan) if bubble_ratio is None else bubble_ratio
    mf = step_flops(model, plan).model_flops_per_step
    step, comm_s, exposed, compute, opt = combine(plan.zero, plan.cp_kind, plan.microbatches, plan.recompute, bub,
                                                  stages)
    mfu = mf / (step * plan.world * cluster.peak_flops)
    return Estimate(plan.to_dict(), led.total_bytes, cluster.hbm_bytes * (1 - margin), compute, bub,
                    dict(comm_s), exposed, step, mfu, _plan=plan, need_bytes=led.need_bytes, optimizer_s=opt)


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
        # read off the action list (``rank_view.block_inflight``): searched only for a fixed interleave
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
    _opt: dict[tuple[int, int], list[float]] = field(default_factory=dict)

    def zeros_for(self, m: int) -> list[tuple[int, str]]:
        """The ZeRO variants that differ at ``m`` micro-batches. With ``m > 1`` ZeRO-2 that holds full
        gradients until the last micro-batch is ZeRO-1 (same memory, same reduce-scatter and all-gather):
        listed once, as ZeRO-1. With ``m == 1`` its two accumulations are the same plan: listed once."""
        zs = self.zeros
        return [(z, acc) for z, acc in zs
                if not (z == 2 and acc == "unsharded" and m > 1 and (1, "unsharded") in zs)
                and not (z == 2 and acc == "sharded" and m == 1 and (2, "unsharded") in zs)]

    def state(self, fast: FastPath, v: int, zv: tuple[int, str], m: int) -> list[float]:
        """Per stage: model-state bytes plus the ZeRO/DDP communication buffers (``m`` micro-batches)."""
        key = (v, zv, m > 1)
        if key not in self._state:
            g = self.dp * self.cp
            self._state[key] = [sum(fast.state_and_buffers(self.tp, self.pp, v, s, g, zv[0], m=m, accumulate=zv[1]))
                                for s in self.stages]
        return self._state[key]

    def optimizer(self, fast: FastPath, v: int, zero: int) -> list[float]:
        """Per stage: the optimizer step's seconds (:func:`planner_fast.stage_optimizer`)."""
        key = (v, zero)
        if key not in self._opt:
            self._opt[key] = [stage_optimizer(fast.model, fast.cluster, fast.fl, fast.c.optimizer, self.tp, self.pp,
                                              v, s, zero, self.dp * self.cp) for s in self.stages]
        return self._opt[key]

    def dp_times(self, fast: FastPath, v: int, zv: tuple[int, str], m: int) -> list[DpTimes]:
        """Per stage: :meth:`FastPath.dp_times` (zeros without data parallelism)."""
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
    """One search: the loops of :func:`plan_search`, sharing one :class:`FastPath`."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, gpus: int, seq: int, batch: int,
                 c: Constraints) -> None:
        self.model, self.cluster, self.gpus, self.batch, self.c = model, cluster, gpus, batch, c
        self.fast = FastPath(model, cluster, seq, c)
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
            scheds = [(sched, v, [block_inflight(self.model.layers, sched, pp, m, v, s, fast.base.pp_split)
                                  for s in stages], logits * head_inflight(sched, pp, m, v))
                      for sched, v in _schedules(self.model, c, pp, m)]
            zeros = fam.zeros_for(m)
            states = {v: [(zv, fam.state(fast, v, zv, m)) for zv in zeros] for _, v, _, _ in scheds}
            candidates = len(scheds) * len(zeros)      # per (recompute, SP) choice
            for recompute in c.options("recompute", c.recompute):
                for sp in c.options("sp", c.sp):
                    # per interleave and ZeRO variant, the exposed DP time of each checked stage (the
                    # compute it hides behind depends on SP through the memory-bound work)
                    exposed: dict[int, dict[tuple[int, str], tuple[list[float], list[float]]]] = {}
                    if not sp or tp > 1:
                        self.candidates += candidates
                        self._variants(fam, mb, m, recompute, sp, scheds, states, exposed)
        return len(self.records) - before

    def _variants(self, fam: _Family, mb: int, m: int, recompute: str, sp: bool,
                  scheds: list[tuple[str, int, list[float], float]],
                  states: dict[int, list[tuple[tuple[int, str], list[float]]]],
                  exposed: dict[int, dict[tuple[int, str], tuple[list[float], list[float]]]]) -> None:
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
                dps_opt = exposed_v.get(zv)
                if dps_opt is None:  # per checked stage: the exposed DP seconds, and those plus the optimizer step
                    dps = [dp_exposed(zv[0], st.compute, m, recompute, dpt)
                           for st, dpt in zip(timed[0], fam.dp_times(fast, v, zv, m), strict=True)]
                    dps_opt = exposed_v[zv] = dps, [d + o for d, o in zip(dps, fam.optimizer(fast, v, zv[0]),
                                                                          strict=True)]
                dps, after = dps_opt
                # the checked stage with the longest step sets it (the first, on a tie)
                i, step = 0, cores[0] + after[0]
                for j in later:
                    step_j = cores[j] + after[j]
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
        opt = stage_optimizer(fast.model, fast.cluster, fast.fl, self.c.optimizer, tp, pp, v, stage, zero, dp * cp)
        return Estimate(fields, memory, self.usable, st.compute, bub, comm_s, exposed, step, mfu, optimizer_s=opt)


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
    """The search for a mixture-of-experts model: families ``(dp, pp, ep)`` (tp = cp = 1, ``sharding.check_ep``),
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
