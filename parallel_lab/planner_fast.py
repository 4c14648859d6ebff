"""The planner's fast path: the ledger's and comm's own functions, memoised on the few quantities each
depends on, so that some 10^5 candidates are estimated in well under a second.

What a stage's rank holds comes from its :class:`parallel_lab.rank_view.RankView` (model state, ZeRO
shards, in-flight micro-batches, messages at once); activations, logits and buffers from the ledger's
modules; collectives from :mod:`parallel_lab.comm`, timed with its alpha-beta model. Plans standing for
a stage or a micro-batch size are built with :func:`dataclasses.replace`. Tests compare
:meth:`FastPath.memory` with ``ledger.memory`` and :meth:`FastPath.times` with ``comm.report`` plan by plan.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from typing import Any

from . import comm as comm_mod
from . import ledger_activations, ledger_buffers, membound, mesh
from .errors import ParallelLabError
from .hardware import ClusterSpec, LinkTier
from .planner_constraints import Constraints
from .rank_view import grads_stay_sharded, rank_view
from .schedules.inflight import messages_at_once
from .specs import ModelSpec, Plan
from .steptime import (
    NO_DP,
    DpTimes,
    StageFlops,
    StageTimes,
    dp_times,
    roofline_parts,
    stage_of_parts,
)


def stage_compute(model: ModelSpec, cluster: ClusterSpec, fl: StageFlops, seq: int, tp: int, cp: int, mb: int,
                  m: int, pp: int, v: int, stage: int, recompute: str, tok: float, rate: float,
                  sp: bool = False, memo: dict | None = None) -> tuple[float, float]:
    """(compute, attention) seconds of a stage: the roofline of ``cluster.profile`` when it has one (with
    the memory-bound work at the cluster's ``hbm_bandwidth``), else the stage's hardware FLOPs at
    ``mfu_achievable`` of peak (``steptime`` module docstring). ``memo``: one micro-batch's roofline parts,
    kept per (tp, cp, mb, recompute, sp, last) and shared by every m, pp, v and stage (the planner's search)."""
    if cluster.profile is None:
        return fl.stage(pp, v, stage, recompute) * tok / rate, fl.attention(pp, v, stage) * tok / rate
    last = stage == pp - 1
    key = ("roofline", tp, cp, mb, recompute, sp, last)
    parts = memo.get(key) if memo is not None else None
    if parts is None:
        parts = roofline_parts(model, cluster.profile, cluster.peak_flops, seq, tp, cp, mb, last, recompute,
                               fl.attention_kernel, fl.mlp, sp, cluster.hbm_bandwidth)
        if memo is not None:
            memo[key] = parts
    return stage_of_parts(parts, cluster.profile, m, fl.n_layers(pp, v, stage), v)


def stage_optimizer(model: ModelSpec, cluster: ClusterSpec, fl: StageFlops, optimizer: str, tp: int, pp: int, v: int,
                    stage: int, zero: int, shards: int) -> float:
    """Seconds of a stage's optimizer step at the cluster's HBM speed (``membound.optimizer_bytes``; ZeRO
    shards it over ``shards = dp * cp``); 0 without a roofline profile or an HBM bandwidth."""
    if cluster.profile is None or not cluster.hbm_bandwidth:
        return 0.0
    b = membound.optimizer_bytes(model, optimizer, tp, fl.n_layers(pp, v, stage), stage == pp - 1,
                                 shards if zero else 1)
    return b / (cluster.hbm_bandwidth * cluster.profile.hbm_efficiency)


def tp_overlap(cluster: ClusterSpec, sp: bool) -> float:
    """The fraction of TP time the cluster's profile hides behind compute with SP (0 without a profile)."""
    return cluster.profile.tp_overlap if cluster.profile is not None and sp else 0.0


class FastPath:
    """Memory and step times of a plan from the ledger's and comm's own functions, each memoised on the
    few quantities it depends on: a pipeline stage's parameters on ``(tp, pp, interleave, stage)`` (the
    sharding caches them by block count, embedding and head), the activations on ``(tp, sp, cp,
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
        self.tp_overlap = {sp: tp_overlap(cluster, sp) for sp in (False, True)}
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
        return replace(self.base, **{"tp": tp, "pp": pp, "interleave": v, "grad_accum": pp,
                                     "schedule": "interleaved" if v > 1 else "1f1b", **kw})

    def _edge_plan(self, first: bool, last: bool, **kw: Any) -> tuple[Plan, int]:
        """A plan and stage whose stage holds the embedding iff ``first`` and the head iff ``last``."""
        pp = 1 if first and last else (2 if first != last else 3)
        stage = 0 if first else (pp - 1 if last else 1)
        return replace(self.base, **{"pp": pp, "grad_accum": pp, **kw}), stage

    # ---- memory (ledger) ----------------------------------------------------------------------------
    def state_and_buffers(self, tp: int, pp: int, v: int, stage: int, g: int, zero: int,
                          zero_unit: str = "block", dp_kind: str = "bucketed", m: int = 1,
                          accumulate: str = "unsharded") -> tuple[float, float]:
        """The rank view's model state (:attr:`RankView.state`) and ``ledger_buffers.state_buffer_bytes`` of
        the stage (``m`` micro-batches: ZeRO-2 holds full gradients between them unless it reduce-scatters
        every one)."""
        grads_sharded = grads_stay_sharded(zero, accumulate, m)

        def compute() -> tuple[float, float]:
            plan = self._stage_plan(tp, pp, v, dp=g, zero=zero, zero_unit=zero_unit, dp_kind=dp_kind,
                                    zero2_accumulate=accumulate, grad_accum=m)
            buf, _ = ledger_buffers.state_buffer_bytes(self.model, plan, stage)
            return float(sum(rank_view(self.model, plan, stage).state.values())), float(buf or 0.0)
        return self._once(("state", tp, pp, v, stage, g, zero, zero_unit, dp_kind, grads_sharded, accumulate),
                          compute)

    def act_per_layer(self, tp: int, sp: bool, cp: int, mb: int, recompute: str) -> float:
        got = self._memo.get(key := ("act", tp, sp, cp, mb, recompute))
        if got is None:
            got = self._memo[key] = ledger_activations.activation_bytes_per_layer(
                self.model, replace(self.base, tp=tp, sp=sp, cp=cp, micro_batch=mb, recompute=recompute))
        return got

    def logits_per_mb(self, tp: int, cp: int, mb: int) -> float:
        return self._once(("logits", tp, cp, mb), lambda: ledger_activations.logits_bytes(
            self.model, replace(self.base, tp=tp, cp=cp, micro_batch=mb)))

    def act_buffers(self, tp: int, sp: bool, cp: int, mb: int, cp_kind: str) -> float:
        """``ledger_buffers.activation_buffer_bytes`` but its ``pp`` part (:meth:`pp_buffers`)."""
        got = self._memo.get(key := ("abuf", tp, sp, cp, mb, cp_kind))
        if got is None:
            got = self._memo[key] = ledger_buffers.activation_buffer_bytes(self.model, replace(
                self.base, tp=tp, sp=sp, cp=cp, micro_batch=mb, pp=1, cp_kind=cp_kind))
        return got

    def pp_buffers(self, tp: int, sp: bool, cp: int, mb: int, schedule: str, pp: int, m: int, v: int,
                   stage: int) -> float:
        """``ledger_buffers.activation_buffer_parts``' ``pp`` part of ``stage``: the messages its list posts at once
        (``schedules.messages_at_once``) times ``ledger_buffers.pp_message_bytes``."""
        if pp == 1:
            return 0.0
        one = self._once(("ppmsg", tp, sp, cp, mb), lambda: ledger_buffers.pp_message_bytes(
            self.model, replace(self.base, tp=tp, sp=sp, cp=cp, micro_batch=mb)))
        return messages_at_once(schedule, pp, m, v)[stage] * one

    def memory(self, plan: Plan, stage: int) -> float:
        """Bytes of stage ``stage`` per GPU, as ``ledger.memory(model, plan, stage=stage).total_bytes``: the
        memoised parts times what the stage's rank view keeps in flight."""
        p, view = plan, rank_view(self.model, plan, stage)
        state, buf = self.state_and_buffers(p.tp, p.pp, p.interleave, stage, p.dp * p.cp, p.zero, p.zero_unit,
                                            p.dp_kind, p.microbatches, p.zero2_accumulate)
        act = (self.act_per_layer(p.tp, p.sp, p.cp, p.micro_batch, p.recompute)
               * view.blocks_inflight)
        logits = 0.0
        if view.last:
            logits = self.logits_per_mb(p.tp, p.cp, p.micro_batch) * view.head_inflight
        return (state + act + logits + buf + self.act_buffers(p.tp, p.sp, p.cp, p.micro_batch, p.cp_kind)
                + self.pp_buffers(p.tp, p.sp, p.cp, p.micro_batch, p.schedule, p.pp, p.microbatches, p.interleave,
                                  stage))

    # ---- times (comm) -------------------------------------------------------------------------------
    def tiers(self, dp: int, pp: int, cp: int, tp: int, stage: int, v: int = 1) -> dict[str, LinkTier]:
        """Link tier per dim: ``mesh.group_tier`` of each group of ``stage``."""
        key = ("tiers", dp, pp, cp, tp, stage, v > 1)
        memo = self._memo
        if key not in memo:
            grid = mesh.GridShape(dp, pp, cp, tp, v)
            memo[key] = {dim: mesh.group_tier(self.cluster, grid, dim, stage) for dim in ("dp", "tp", "cp", "pp")}
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
            return self._stage_plan(tp, pp, v, dp=g, zero=zero, zero_unit=zero_unit, zero2_accumulate=accumulate,
                                    **({"grad_accum": mm} if mm else {}))

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
        two = self._time(comm_mod.stage_collectives(self.model, replace(plan, grad_accum=2 * m0), stage,
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
                layer = memo[key] = self._time(comm_mod.tp_layer_collectives(self.model, replace(
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
                ring = memo[key] = self._time(comm_mod.cp_layer_collectives(self.model, replace(
                    self.base, tp=t, cp=c, seq=tokens * c, micro_batch=1, recompute=recompute,
                    cp_kind=cp_kind)), tc)
            out["cp"] = L * m * ring
        tok = mb * m * self.seq / (t * c)
        # without a roofline profile the compute sees the micro-batches only through the tokens of the step
        # (the same for every micro-batch size of a family); with one, through both sizes
        sizes = (mb, m, sp) if self.cluster.profile is not None else ()
        flops = memo.get(key := ("compute", t, c, pp, v, stage, recompute, tok, sizes))
        if flops is None:
            flops = memo[key] = stage_compute(self.model, self.cluster, self.fl, self.seq, t, c, mb, m, pp, v, stage,
                                              recompute, tok, self.rate, sp, memo)
        return StageTimes(*flops, out, NO_DP, self.tp_overlap[sp])

    def times(self, plan: Plan, stage: int) -> StageTimes:
        """Seconds of stage ``stage``: compute, and per dim ``comm.report(..., stage=stage).time_s``."""
        p = plan
        if p.dp * p.cp > 1 and p.zero == 0 and p.dp_kind == "naive":
            raise ParallelLabError("the planner's fast path models bucketed DDP only; use evaluate()")
        st = self.times_raw(p.dp, p.tp, p.pp, p.cp, p.interleave, p.microbatches, p.micro_batch, p.sp,
                            p.recompute, p.cp_kind, stage)
        g = p.dp * p.cp
        st = StageTimes(st.compute, st.attention, dict(st.comm), optimizer=stage_optimizer(
            self.model, self.cluster, self.fl, p.optimizer, p.tp, p.pp, p.interleave, stage, p.zero, g))
        if g > 1:
            tier = self.tiers(p.dp, p.pp, p.cp, p.tp, stage, p.interleave)["dp"]
            st.dp = self.dp_times(p.tp, p.pp, p.interleave, stage, g, p.zero, tier, p.zero_unit,
                                  p.zero2_accumulate, p.microbatches)
            st.comm["dp"] = st.dp.total(p.microbatches)
        return st
