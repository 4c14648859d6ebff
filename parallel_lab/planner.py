"""The 4-D planner: enumerate every valid way to split a model over N GPUs, estimate each, rank them.

Input: a model, a cluster, the number of GPUs, the sequence length, the global batch (in sequences, or
in tokens: ``16M`` tokens is ``16 * 2**20 = 16,777,216`` tokens, 2048 sequences of 8192, the batch Llama 3
used), and optional constraints. Output: every plan ``(tp, cp, pp, dp, zero, micro_batch, grad_accum,
recompute, schedule, interleave, sp)`` that keeps the global batch, respects the divisibility rules of
:meth:`Plan.validate`, keeps tensor parallelism inside a node and fits in memory with the safety margin,
ranked by estimated step time; and the families (``tp, cp, pp, dp`` degrees) that were rejected, counted
by reason: ``divisibility``, ``batch``, ``tp_across_nodes``, ``oom``.

Memory is the ledger's (:func:`parallel_lab.ledger.memory`): the largest stage total against
``hbm * (1 - margin)``. Communication is the comm module's (:func:`parallel_lab.comm.report`): each group's
collectives on the link tier its ranks land on in the placement ``arange(world).view(dp, pp, cp, tp)`` (TP
innermost, then CP, PP, DP). To estimate some 10^5 candidates in under a second (Llama 3 405B on 16,384
GPUs: 93,558 candidates, about 0.45 s of CPU here; ``bench/bench_planner.py``), the planner evaluates
both through a fast path (:class:`_Fast`) that caches what depends on few degrees (per-stage parameter
units, DDP buckets, activation bytes per layer) and sums the same closed forms; tests check it against
``ledger.memory`` and ``comm.report`` plan by plan, and :func:`evaluate` uses the two modules themselves.
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
from dataclasses import dataclass, field, replace
from functools import cache, lru_cache
from typing import Any

from . import comm as comm_mod
from . import ledger
from .flops import flops_per_token, matmul_params, step_flops
from .schedules import head_inflight, peak_activation_units
from .simulate import Costs, bubble_formula
from .specs import (
    CP_KINDS,
    ClusterSpec,
    LinkTier,
    ModelSpec,
    ParallelLabError,
    Plan,
    divisors,
    stage_layers,
)

REASONS = ("divisibility", "batch", "tp_across_nodes", "oom")
#: The Plan fields of a row of ``parallel-lab plan --json``.
ROW_FIELDS = ("dp", "tp", "pp", "cp", "zero", "sp", "micro_batch", "grad_accum", "recompute", "schedule",
              "interleave")
#: Plan fields a constraint may fix (``--fix tp=8,pp=16``).
FIXABLE = ("dp", "tp", "pp", "cp", "zero", "sp", "micro_batch", "grad_accum", "recompute", "schedule",
           "interleave", "cp_kind")


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

    def __post_init__(self) -> None:
        unknown = sorted(set(self.fixed) - set(FIXABLE))
        if unknown:
            raise ParallelLabError(f"cannot fix {unknown}; fixable fields: {', '.join(FIXABLE)}")
        if self.cp_kind not in CP_KINDS:
            raise ParallelLabError(f"cp_kind={self.cp_kind!r}; pick one of {', '.join(CP_KINDS)}")
        if not 0 <= self.margin < 1:
            raise ParallelLabError(f"margin={self.margin} must be a fraction in [0, 1); e.g. 0.1")

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

    @property
    def plan(self) -> Plan:
        if self._plan is None:
            self._plan = Plan(**self.fields)
        return self._plan

    @property
    def headroom_bytes(self) -> float:
        return self.usable_bytes - self.memory_bytes

    @property
    def bubble_s(self) -> float:
        critical = self.compute_s + self.exposed_s.get("tp", 0.0) + self.exposed_s.get("cp", 0.0)
        return critical * self.bubble_ratio

    def row(self) -> dict[str, Any]:
        """The JSON row of ``parallel-lab plan --json``."""
        f = self.fields
        out = {k: f[k] for k in ROW_FIELDS}
        out.update({"memory_bytes": self.memory_bytes, "headroom_bytes": self.headroom_bytes,
                    "step_time_s": self.step_time_s, "mfu": self.mfu, "bubble_ratio": self.bubble_ratio,
                    "compute_s": self.compute_s, "exposed_comm_s": dict(self.exposed_s),
                    "comm_s": dict(self.comm_s)})
        return out


@dataclass
class _StageTimes:
    """Seconds of one pipeline stage for one step (inputs of :func:`_combine`)."""

    compute: float
    attention: float
    comm: dict[str, float]
    dp_sync: float = 0.0        # gradient synchronisation (zero 0, 1, 2)
    dp_last: float = 0.0        # its last collective, which has no backward left to hide behind
    dp_gather: float = 0.0      # ZeRO-1/2: all-gather of the updated parameters after the step
    dp_first: float = 0.0       # its first collective; ZeRO-3: the largest unit's gathers + reduce-scatter
    zero3: float = 0.0          # ZeRO-3: all its traffic (every micro-batch)


def _costs(recompute: str) -> Costs:
    """F : B : W for the bubble: backward twice the forward, split evenly; full recompute adds a forward."""
    return Costs(1.0, 2.0 if recompute == "full" else 1.0, 1.0)


#: (forward, backward) shares of a micro-batch's compute, from :func:`_costs`.
_SHARES = {r: (c.f / (c.f + c.b + c.w), (c.b + c.w) / (c.f + c.b + c.w))
           for r, c in ((r, _costs(r)) for r in ("none", "selective", "full"))}


def _dp_exposed(zero: int, compute: float, m: int, recompute: str, sync: float, last: float, gather: float,
                first: float, zero3: float) -> float:
    """The data-parallel time left on the critical path (module docstring)."""
    if zero == 3:
        return max(first, zero3 - compute) if zero3 else 0.0
    f_share, b_share = _SHARES[recompute]
    per_mb = compute / m
    dp = max(last, sync - per_mb * b_share) if sync else 0.0
    if gather:
        dp += max(first, gather - per_mb * f_share)
    return dp


def _core(st: _StageTimes, cp_kind: str, bubble_ratio: float) -> tuple[float, float, float, float]:
    """(per-micro-batch critical path times the pipeline factor, + PP) and its parts: tp, exposed cp, pp."""
    tp = st.comm.get("tp", 0.0) + st.comm.get("tp_vocab", 0.0)
    cp = st.comm.get("cp", 0.0)
    cp_exp = max(0.0, cp - st.attention) if cp_kind == "ring" else cp
    pp = st.comm.get("pp", 0.0)
    return (st.compute + tp + cp_exp) * (1.0 + bubble_ratio) + pp, tp, cp_exp, pp


def _combine(zero: int, cp_kind: str, m: int, recompute: str, bubble_ratio: float,
             stages: list[_StageTimes]) -> tuple[float, dict[str, float], dict[str, float], float]:
    """The step-time model of the module docstring; the stage with the longest step sets it.

    Returns (step time, comm time per dim, exposed time per dim, compute) of that stage."""
    best: tuple[float, dict[str, float], dict[str, float], float] | None = None
    for st in stages:
        core, tp, cp_exp, pp = _core(st, cp_kind, bubble_ratio)
        dp = _dp_exposed(zero, st.compute, m, recompute, st.dp_sync, st.dp_last, st.dp_gather, st.dp_first,
                         st.zero3)
        step = core + dp
        if best is None or step > best[0]:
            best = (step, st.comm, {"tp": tp, "cp": cp_exp, "pp": pp, "dp": dp}, st.compute)
    assert best is not None
    return best


def _stages_to_check(pp: int) -> list[int]:
    """Stage 0 holds the most layers (chunks get the extra layers first), the embedding and the most
    in-flight micro-batches; the last stage the head and the logits. No middle stage exceeds both."""
    return sorted({0, pp - 1})


def evaluate(model: ModelSpec, cluster: ClusterSpec, plan: Plan, *, margin: float = 0.1,
             bubble_ratio: float | None = None) -> Estimate:
    """Estimate one plan with ``ledger.memory`` and ``comm.report`` themselves (the slow, reference path).

    Memory is the ledger's largest stage; times follow the module docstring. ``bubble_ratio`` replaces the
    schedule's closed form, for a what-if the Plan cannot express (Llama 3 405B's interleaving of 126
    layers in 128 chunks, two of which hold only the embedding and the head)."""
    plan.validate(model, cluster=cluster)
    led = ledger.memory(model, plan, cluster, margin=margin)
    rate = cluster.mfu_achievable * cluster.peak_flops
    tok = plan.micro_batch * plan.microbatches * plan.seq / (plan.tp * plan.cp)
    fl = _Flops(model, plan.seq)
    stages = []
    for s in _stages_to_check(plan.pp):
        rep = comm_mod.report(model, plan, cluster, stage=s)
        st = _StageTimes(fl.stage(plan.pp, plan.interleave, s, plan.recompute) * tok / rate,
                         fl.attention(plan.pp, plan.interleave, s) * tok / rate, dict(rep.time_s))
        tier = comm_mod.tier_of(cluster, comm_mod.group_ranks(plan, "dp", s))
        units: dict[str, float] = {}
        for c in rep.collectives:
            if c.dim != "dp":
                continue
            t = c.count * comm_mod.collective_time(c.kind, c.message_bytes, c.group_size, tier)
            if plan.zero == 3:
                st.zero3 += t
                unit = c.unit
                units[unit] = units.get(unit, 0.0) + t / c.count
            elif c.phase == "step":
                st.dp_gather += t
                st.dp_first = st.dp_first or t
            else:
                st.dp_sync += t
                st.dp_last = t
        if units:
            st.dp_first = max(units.values())
        stages.append(st)
    bubble = _bubble(plan.schedule, plan.pp, plan.microbatches, plan.interleave, plan.recompute) \
        if bubble_ratio is None else bubble_ratio
    mf = step_flops(model, plan).model_flops_per_step
    step, comm_s, exposed, compute = _combine(plan.zero, plan.cp_kind, plan.microbatches, plan.recompute,
                                              bubble, stages)
    mfu = mf / (step * plan.world * cluster.peak_flops)
    return Estimate(plan.to_dict(), led.total_bytes, cluster.hbm_bytes * (1 - margin), compute, bubble,
                    dict(comm_s), exposed, step, mfu, _plan=plan)


def plan_bubble(plan: Plan) -> float:
    """The pipeline bubble ratio the planner assumes for ``plan`` (0 without a pipeline)."""
    return _bubble(plan.schedule, plan.pp, plan.microbatches, plan.interleave, plan.recompute)


@lru_cache(maxsize=4096)
def _bubble(schedule: str, pp: int, m: int, v: int, recompute: str) -> float:
    return 0.0 if pp == 1 else bubble_formula(schedule, pp, m, v, _costs(recompute))


class _Flops:
    """Hardware FLOPs per token of a pipeline stage (``flops.py``'s formula, split by stage)."""

    def __init__(self, model: ModelSpec, seq: int) -> None:
        n_blocks, n_head = matmul_params(model)
        q = model.heads * model.head_dim
        self.model = model
        self.per_layer = 6.0 * n_blocks / model.layers + 12.0 * q * seq
        attn_fwd = 4.0 * q * seq
        self.extra = {"none": 0.0, "selective": attn_fwd, "full": 2.0 * n_blocks / model.layers + attn_fwd}
        self.head = 6.0 * n_head
        self.attn = 12.0 * q * seq
        self._nl: dict[tuple[int, int, int], int] = {}

    def n_layers(self, pp: int, v: int, stage: int) -> int:
        key = (pp, v, stage)
        if key not in self._nl:
            self._nl[key] = len(stage_layers(self.model.layers, pp, v, stage))
        return self._nl[key]

    def stage(self, pp: int, v: int, stage: int, recompute: str) -> float:
        head = self.head if stage == pp - 1 else 0.0
        return self.n_layers(pp, v, stage) * (self.per_layer + self.extra[recompute]) + head

    def attention(self, pp: int, v: int, stage: int) -> float:
        return self.n_layers(pp, v, stage) * self.attn


# --------------------------------------------------------------------------------------------------
# The fast path: the ledger's and the comm module's formulas, with what depends on few degrees cached
# --------------------------------------------------------------------------------------------------

@cache
def _t(kind: str, message: float, n: int, tier: LinkTier) -> float:
    """``comm.collective_time``, memoised."""
    return comm_mod.collective_time(kind, message, n, tier)


def _zero_units(info: dict[str, Any], zero_unit: str) -> tuple[list[int], list[str]]:
    """Sizes and names of a stage's ZeRO units: one per block plus the root, or one root unit."""
    if zero_unit == "root":
        return [sum(info["units"])], ["root"]
    return info["units"], info["unit_names"]


class _Fast:
    """Memory and communication of a plan from cached pieces.

    Term by term the same as ``ledger._ledger_of_stage`` and ``comm._*_collectives``; tests compare
    :meth:`memory` with ``ledger.memory`` and :meth:`times` with ``comm.report`` plan by plan.
    """

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, seq: int, c: Constraints) -> None:
        self.model, self.cluster, self.seq, self.c = model, cluster, seq, c
        self.base = Plan(seq=seq, optimizer=c.optimizer, dtype=c.dtype, cp_kind=c.cp_kind)
        self.d = self.base.dtype_bytes
        self.gb = ledger._grad_comm_bytes(self.base)
        self.pb = ledger._param_comm_bytes(self.base)
        self.o = self.base.optim
        self.fl = _Flops(model, seq)
        self.rate = cluster.mfu_achievable * cluster.peak_flops
        self._stage: dict[tuple, dict[str, Any]] = {}
        self._state: dict[tuple, tuple[float, float]] = {}
        self._dp: dict[tuple, tuple[float, float, float, float, float]] = {}
        self._act: dict[tuple, float] = {}
        self._logit: dict[tuple, float] = {}
        self._tiers: dict[tuple, dict[str, LinkTier]] = {}
        self._times: dict[tuple, _StageTimes] = {}

    # ---- pieces that depend on few degrees --------------------------------------------------------
    def stage_info(self, tp: int, pp: int, v: int, stage: int) -> dict[str, Any]:
        """Per (tp, pp, v, stage): ZeRO unit sizes, DDP buckets, SP-replicated and GQA kv numels.

        Every block has the same parameters, so a stage is known by its block count and whether it holds
        the embedding (first) or the head (last): that is the cache key."""
        key = (tp, self.fl.n_layers(pp, v, stage), stage == 0, stage == pp - 1)
        if key in self._stage:
            return self._stage[key]
        params = self._stage_parameters(tp, pp, v, stage)
        units: dict[str, int] = {}
        for p in params:
            units[p.unit] = units.get(p.unit, 0) + p.numel
        cap = self.base.bucket_mb * 1e6
        buckets: list[int] = []
        size = 0
        for p in reversed(params):                       # comm.ddp_buckets' rule
            nbytes = p.numel * self.gb
            if size and size + nbytes > cap:
                buckets.append(size)
                size = 0
            size += nbytes
        if size:
            buckets.append(size)
        info = {
            "units": [n for n in units.values() if n],
            "unit_names": [u for u, n in units.items() if n],
            "buckets": buckets,
            "top2": sum(sorted(buckets, reverse=True)[:2]),
            "rep": sum(p.numel for p in params if p.tp_replicated),
            "kv": sum(p.numel for p in params if p.name.split(".")[-2] in ("wk", "wv")),
        }
        self._stage[key] = info
        return info

    def _stage_parameters(self, tp: int, pp: int, v: int, stage: int) -> list[ledger.LocalParam]:
        """``ledger.local_parameters`` of the stage, computed on a copy of the model cut to the stage's
        block count (every block has the same parameters; the ledger walks every layer of the model, which
        costs milliseconds for 126 layers). Block names are renumbered from 0; the tests compare with the
        ledger."""
        n = self.fl.n_layers(pp, v, stage)
        first, last = stage == 0, stage == pp - 1
        cut = self.model.with_(layers=n)
        one = replace(self.base, tp=tp, pp=1, grad_accum=1)
        params = [p for p in ledger.local_parameters(cut, one, 0)
                  if (first or p.name.split(".")[0] not in ("tok_emb", "pos_emb"))
                  and (last or p.name.split(".")[0] not in ("final_norm", "lm_head"))]
        if self.model.tied_embeddings and pp > 1 and last:   # the last stage's copy of the embedding
            plan = replace(self.base, tp=tp, pp=pp, interleave=v, grad_accum=pp,
                           schedule="interleaved" if v > 1 else "1f1b")
            params.append(ledger.local_parameters(self.model, plan, stage)[-1])
        return params

    def state_and_buffers(self, tp: int, pp: int, v: int, stage: int, g: int, zero: int,
                          zero_unit: str = "block", m: int = 1) -> tuple[float, float]:
        """Model-state bytes and the ZeRO/DDP part of the comm buffers (``ledger`` formulas)."""
        grads_sharded = ledger._gradients_sharded(zero, self.base.zero2_accumulate, m)
        key = (tp, pp, v, stage, g, zero, zero_unit, grads_sharded)
        if key in self._state:
            return self._state[key]
        info = self.stage_info(tp, pp, v, stage)
        units, names = _zero_units(info, zero_unit)
        full = sum(units)
        sharded = sum(math.ceil(n / g) for n in units)
        o = self.o
        state = ((sharded if zero >= 3 else full) * o.param_bytes
                 + (sharded if grads_sharded else full) * o.grad_bytes
                 + (sharded if zero >= 1 else full) * o.optim_bytes)
        buf = 0.0
        if g > 1 and zero == 0:
            buf = float(info["top2"])                  # bucketed DDP (the planner's dp_kind)
        elif g > 1:
            padded = [g * math.ceil(n / g) for n in units]
            if zero in (1, 2):
                buf = max(padded) * (self.gb + self.pb)
            else:
                root = sum(n for u, n in zip(names, padded, strict=True) if u == "root")
                blocks = sorted((n for u, n in zip(names, padded, strict=True) if u != "root"), reverse=True)
                buf = root * self.pb + sum(blocks[:2]) * self.pb + max(padded) * self.gb
        self._state[key] = (float(state), float(buf))
        return self._state[key]

    def act_per_layer(self, tp: int, sp: bool, cp: int, mb: int, recompute: str) -> float:
        key = (tp, sp, cp, mb, recompute)
        if key not in self._act:
            plan = replace(self.base, tp=tp, sp=sp, cp=cp, micro_batch=mb, recompute=recompute)
            self._act[key] = ledger.activation_bytes_per_layer(self.model, plan)
        return self._act[key]

    def logits_per_mb(self, tp: int, cp: int, mb: int) -> float:
        key = (tp, cp, mb)
        if key not in self._logit:
            plan = replace(self.base, tp=tp, cp=cp, micro_batch=mb)
            self._logit[key] = ledger.logits_bytes(self.model, plan)
        return self._logit[key]

    def act_buffers(self, tp: int, sp: bool, cp: int, mb: int, pp: int, cp_kind: str) -> float:
        """The activation part of ``ledger.comm_buffer_bytes`` (SP gather, PP send/receive, CP blocks)."""
        d, s, h = self.d, self.seq / cp, self.model.hidden
        total = 0.0
        if sp:
            total += s * mb * h * d
        if pp > 1:
            total += 2 * s * mb * h * d / (tp if sp else 1)
        if cp > 1:
            kv = ledger._kv_local(self.model, tp)
            if cp_kind == "ring":
                total += 2 * 2 * s * mb * kv * d
            elif cp_kind == "allgather":
                total += 2 * self.seq * mb * kv * d
            else:
                total += s * mb * (h / tp + 2 * kv) * d
        return total

    def tiers(self, dp: int, pp: int, cp: int, tp: int, stage: int, v: int = 1) -> dict[str, LinkTier]:
        """Link tier per dim, as ``comm.tier_of(cluster, comm.group_ranks(plan, dim, stage))``.

        In the placement ``arange(world).view(dp, pp, cp, tp)`` ranks increase along every dim, and nodes
        are runs of ``gpus_per_node`` consecutive ranks, so a group shares one node exactly when its
        lowest and highest ranks do (checked against ``comm`` in tests)."""
        key = (dp, pp, cp, tp, stage, v > 1)
        if key not in self._tiers:
            def rank(i: int, s: int, j: int, k: int) -> int:
                return ((i * pp + s) * cp + j) * tp + k

            if v > 1:    # interleaved: chunks wrap around from the last stage to the first
                near = [(stage - 1) % pp, stage, (stage + 1) % pp]
            else:
                near = [x for x in (stage - 1, stage, stage + 1) if 0 <= x < pp]
            spans = {"dp": (rank(0, stage, 0, 0), rank(dp - 1, stage, cp - 1, 0)),
                     "tp": (rank(0, stage, 0, 0), rank(0, stage, 0, tp - 1)),
                     "cp": (rank(0, stage, 0, 0), rank(0, stage, cp - 1, 0)),
                     "pp": (rank(0, min(near), 0, 0), rank(0, max(near), 0, 0))}
            n = self.cluster.gpus_per_node
            self._tiers[key] = {dim: self.cluster.intra if lo // n == hi // n else self.cluster.inter
                                for dim, (lo, hi) in spans.items()}
        return self._tiers[key]

    def dp_times(self, tp: int, pp: int, v: int, stage: int, g: int, zero: int,
                 tier: LinkTier, zero_unit: str = "block") -> tuple[float, float, float, float, float]:
        """(sync, last, gather, first, zero3 per micro-batch) of ``comm._dp/_zero_collectives``."""
        key = (tp, pp, v, stage, g, zero, tier, zero_unit)
        if key in self._dp:
            return self._dp[key]
        info = self.stage_info(tp, pp, v, stage)
        units, names = _zero_units(info, zero_unit)
        sync = last = gather = first = z3 = 0.0
        if zero == 0:
            ts = [_t("all_reduce", nb, g, tier) for nb in reversed(info["buckets"][::-1])]
            sync, last = sum(ts), (ts[-1] if ts else 0.0)
        else:
            padded = [g * math.ceil(n / g) for n in units]
            if zero in (1, 2):
                ts = [_t("reduce_scatter", n * self.gb, g, tier) for n in reversed(padded)]
                sync, last = sum(ts), ts[-1]
                gs = [_t("all_gather", n * self.pb, g, tier) for n in padded]
                gather, first = sum(gs), gs[0]
            else:
                per = [(1 if u == "root" else 2) * _t("all_gather", n * self.pb, g, tier)
                       + _t("reduce_scatter", n * self.gb, g, tier)
                       for u, n in zip(names, padded, strict=True)]
                z3, first = sum(per), max(per)
        self._dp[key] = (sync, last, gather, first, z3)
        return self._dp[key]

    # ---- a whole plan -------------------------------------------------------------------------------
    def memory(self, plan: Plan, stage: int) -> float:
        """Bytes of stage ``stage`` per GPU, as ``ledger.memory(model, plan, stage=stage).total_bytes``."""
        p = plan
        g = p.dp * p.cp
        state, buf = self.state_and_buffers(p.tp, p.pp, p.interleave, stage, g, p.zero, p.zero_unit,
                                            p.microbatches)
        if g > 1 and p.zero == 0 and p.dp_kind == "naive":
            buf = 0.0
        inflight = 1.0 if p.pp == 1 else \
            peak_activation_units(p.schedule, p.pp, p.microbatches, p.interleave, stage)
        act = (self.act_per_layer(p.tp, p.sp, p.cp, p.micro_batch, p.recompute)
               * self.fl.n_layers(p.pp, p.interleave, stage) * inflight)
        logits = 0.0
        if stage == p.pp - 1:
            kept = head_inflight(p.schedule, p.pp, p.microbatches, p.interleave)
            logits = self.logits_per_mb(p.tp, p.cp, p.micro_batch) * kept
        return state + act + logits + buf + self.act_buffers(p.tp, p.sp, p.cp, p.micro_batch, p.pp, p.cp_kind)

    def times(self, plan: Plan, stage: int) -> _StageTimes:
        """Seconds of stage ``stage``: compute, and per dim ``comm.report(..., stage=stage).time_s``."""
        p = plan
        if p.dp * p.cp > 1 and p.zero == 0 and p.dp_kind == "naive":
            raise ParallelLabError("the planner's fast path models bucketed DDP only; use evaluate()")
        st = self._times_raw(p.dp, p.tp, p.pp, p.cp, p.interleave, p.microbatches, p.micro_batch, p.sp,
                             p.recompute, p.cp_kind, stage)
        st = _StageTimes(st.compute, st.attention, dict(st.comm))
        self.add_dp(st, p.dp, p.tp, p.pp, p.cp, p.interleave, p.microbatches, p.zero, stage, p.zero_unit)
        return st

    def add_dp(self, st: _StageTimes, dp: int, tp: int, pp: int, cp: int, v: int, m: int, zero: int,
               stage: int, zero_unit: str = "block") -> None:
        """Fill the data-parallel fields of ``st`` (and ``st.comm["dp"]``)."""
        g = dp * cp
        if g == 1:
            return
        tier = self.tiers(dp, pp, cp, tp, stage, v)["dp"]
        sync, last, gather, first, z3 = self.dp_times(tp, pp, v, stage, g, zero, tier, zero_unit)
        st.dp_sync, st.dp_last, st.dp_gather, st.dp_first, st.zero3 = sync, last, gather, first, z3 * m
        st.comm["dp"] = sync + gather + z3 * m

    def times_raw(self, dp: int, t: int, pp: int, c: int, v: int, m: int, mb: int, sp: bool, recompute: str,
                  cp_kind: str, stage: int) -> _StageTimes:
        """Compute and the TP, CP and PP times of one stage (no DP fields; see :meth:`add_dp`)."""
        key = (dp, t, pp, c, v, m, mb, sp, recompute, cp_kind, stage)
        if key in self._times:
            return self._times[key]
        self._times[key] = self._times_raw(dp, t, pp, c, v, m, mb, sp, recompute, cp_kind, stage)
        return self._times[key]

    def _times_raw(self, dp: int, t: int, pp: int, c: int, v: int, m: int, mb: int, sp: bool, recompute: str,
                   cp_kind: str, stage: int) -> _StageTimes:
        model = self.model
        tiers = self.tiers(dp, pp, c, t, stage, v)
        L = self.fl.n_layers(pp, v, stage)
        M = (self.seq // c) * mb * model.hidden * self.d
        full = recompute == "full"
        out: dict[str, float] = {}
        info = self.stage_info(t, pp, v, stage)
        if t > 1:
            tt = tiers["tp"]
            ar = _t("all_reduce", M, t, tt)
            pair = _t("all_gather", M, t, tt) + _t("reduce_scatter", M, t, tt)
            one = pair if sp else ar
            tp = 2 * L * m * one * (3 if full else 2)
            if sp:                             # backward all-gathers each region's saved input shard again
                tp += 2 * L * m * _t("all_gather", M, t, tt)
            if sp and info["rep"]:
                tp += _t("all_reduce", info["rep"] * self.gb, t, tt)
            if t > model.kv_heads and info["kv"]:
                tp += _t("all_reduce", info["kv"] * self.gb, t // model.kv_heads, tt)
            out["tp"] = tp
            tv = m * one if stage == 0 else 0.0
            if stage == pp - 1:
                ce = (self.seq // c) * mb * comm_mod.CE_BYTES
                tv += m * one + 3 * m * _t("all_reduce", ce, t, tt)
            out["tp_vocab"] = tv
        if pp > 1:
            Mp = M // (t if sp else 1)
            n_msgs = (v - (1 if stage == pp - 1 else 0)) + (v - (1 if stage == 0 else 0))
            out["pp"] = n_msgs * m * _t("send", Mp, 2, tiers["pp"])
            if model.tied_embeddings and stage in (0, pp - 1):
                emb = math.ceil(model.vocab / t) * model.hidden * self.gb
                out["pp"] += _t("all_reduce", emb, 2, tiers["pp"])
        if c > 1:
            tc = tiers["cp"]
            n = L * m
            kv = ledger._kv_local(model, t)
            Mkv = 2 * (self.seq // c) * mb * kv * self.d                 # K and V in one message
            if cp_kind == "ring":
                snd = _t("send", Mkv, 2, tc)
                fwd = (c - 1) * n * snd
                cp = fwd + 2 * (c - 1) * n * snd
            elif cp_kind == "allgather":
                fwd = n * _t("all_gather", c * Mkv, c, tc)
                cp = fwd + n * _t("reduce_scatter", c * Mkv, c, tc)
            else:
                Mq = (self.seq // c) * mb * (model.heads * model.head_dim // t) * self.d
                kv_rep = Mkv * (c // math.gcd(kv // model.head_dim, c))
                fwd = n * (_t("all_to_all", Mq + kv_rep, c, tc) + _t("all_to_all", Mq, c, tc))
                cp = 2 * fwd
            out["cp"] = cp + (fwd if recompute != "none" else 0.0)
        tok = mb * m * self.seq / (t * c)
        return _StageTimes(self.fl.stage(pp, v, stage, recompute) * tok / self.rate,
                           self.fl.attention(pp, v, stage) * tok / self.rate, out)


# --------------------------------------------------------------------------------------------------
# Enumeration
# --------------------------------------------------------------------------------------------------

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

    def rank_of(self, **fields: Any) -> int | None:
        """1-based rank of the best plan whose fields match ``fields`` (None if none fits)."""
        for i, e in enumerate(self.estimates):
            if all(e.fields[k] == v for k, v in fields.items()):
                return i + 1
        return None

    def to_json(self, top: int | None = None) -> dict[str, Any]:
        rows = self.estimates if top is None else self.estimates[:top]
        return {"plans": [e.row() for e in rows], "rejected": dict(self.rejected),
                "families": self.families, "candidates": self.candidates, "fitting": len(self.estimates),
                "elapsed_s": self.elapsed_s, "model": self.model.name, "cluster": self.cluster.name,
                "gpus": self.gpus, "seq": self.seq, "global_batch": self.global_batch,
                "global_batch_tokens": self.global_batch * self.seq, "margin": self.margin}


def _family_reason(model: ModelSpec, cluster: ClusterSpec, c: Constraints, tp: int, cp: int, pp: int,
                   seq: int) -> str | None:
    try:
        Plan(tp=tp, cp=cp, pp=pp, seq=seq, cp_kind=c.cp_kind).validate(model)
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
    for s in c.options("schedule", c.schedules):
        if s != "interleaved":
            out.append((s, 1))
        elif m % pp == 0:
            out += [(s, v) for v in divisors(model.layers) if v > 1 and model.layers % (pp * v) == 0]
    if "interleave" in c.fixed:
        out = [(s, v) for s, v in out if v == c.fixed["interleave"]]
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

    def __init__(self, records: list[tuple], build: Any) -> None:
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
    zeros: list[int]
    _state: dict[tuple[int, int, bool], list[float]] = field(default_factory=dict)
    _dp: dict[tuple[int, int], list[tuple[float, ...]]] = field(default_factory=dict)

    def state(self, fast: _Fast, v: int, zero: int, m: int) -> list[float]:
        """Per stage: model-state bytes plus the ZeRO/DDP communication buffers."""
        key = (v, zero, m > 1)
        if key not in self._state:
            g = self.dp * self.cp
            self._state[key] = [sum(fast.state_and_buffers(self.tp, self.pp, v, s, g, zero, m=m))
                                for s in self.stages]
        return self._state[key]

    def dp_times(self, fast: _Fast, v: int, zero: int) -> list[tuple[float, ...]]:
        """Per stage: :meth:`_Fast.dp_times` (zeros without data parallelism)."""
        key = (v, zero)
        if key not in self._dp:
            g = self.dp * self.cp
            self._dp[key] = [fast.dp_times(self.tp, self.pp, v, s, g, zero, tier) if g > 1 else (0.0,) * 5
                             for s, tier in zip(self.stages, self.tiers, strict=True)]
        return self._dp[key]


class _Search:
    """One search: the loops of :func:`plan_search`, sharing one :class:`_Fast`."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, gpus: int, seq: int, batch: int,
                 c: Constraints) -> None:
        self.model, self.cluster, self.gpus, self.batch, self.c = model, cluster, gpus, batch, c
        self.fast = _Fast(model, cluster, seq, c)
        self.usable = cluster.hbm_bytes * (1 - c.margin)
        self.model_flops = flops_per_token(model, seq) * batch * seq
        self.common = {"seq": seq, "optimizer": c.optimizer, "dtype": c.dtype, "cp_kind": c.cp_kind}
        # one record per fitting plan: (step, memory, n, variant, zero, stage index, dp exposed, dp times)
        self.records: list[tuple] = []
        self.candidates = 0

    def family(self, tp: int, cp: int, pp: int, dp: int) -> int:
        """Estimate every variant of one family (micro-batch, schedule, recompute, SP, ZeRO); returns how
        many fit."""
        c, fast = self.c, self.fast
        before = len(self.records)
        stages = _stages_to_check(pp)
        fam = _Family(tp, cp, pp, dp, stages, [fast.tiers(dp, pp, cp, tp, s)["dp"] for s in stages],
                      [z for z in c.options("zero", c.zero_stages) if z == 0 or dp > 1])
        per_replica = self.batch // dp
        for mb in c.options("micro_batch", divisors(per_replica)):
            m, rest = divmod(per_replica, mb)
            if rest or (c.max_micro_batch and mb > c.max_micro_batch) or c.fixed.get("grad_accum", m) != m:
                continue
            # per schedule, the activation multiplier of each stage: its layers x in-flight micro-batches
            scheds = {(sched, v): [fast.fl.n_layers(pp, v, s) * self._inflight(sched, pp, m, v, s)
                                   for s in stages] for sched, v in _schedules(self.model, c, pp, m)}
            for recompute in c.options("recompute", c.recompute):
                for sp in c.options("sp", c.sp):
                    if not sp or tp > 1:
                        self._variants(fam, mb, m, recompute, sp, scheds)
        return len(self.records) - before

    @staticmethod
    def _inflight(sched: str, pp: int, m: int, v: int, stage: int) -> float:
        return 1.0 if pp == 1 else peak_activation_units(sched, pp, m, v, stage)

    def _variants(self, fam: _Family, mb: int, m: int, recompute: str, sp: bool,
                  scheds: dict[tuple[str, int], list[float]]) -> None:
        """Every schedule and ZeRO stage of one (micro-batch, recompute, SP) choice of a family."""
        c, fast = self.c, self.fast
        tp, cp, pp, dp = fam.tp, fam.cp, fam.pp, fam.dp
        apl = fast.act_per_layer(tp, sp, cp, mb, recompute)
        abuf = fast.act_buffers(tp, sp, cp, mb, pp, c.cp_kind)
        lpm = fast.logits_per_mb(tp, cp, mb)
        timed_v: dict[int, list[tuple[_StageTimes, tuple[float, float, float, float]]]] = {}
        for (sched, v), layers_x_inflight in scheds.items():
            act = [apl * n + abuf for n in layers_x_inflight]
            act[-1] += lpm * head_inflight(sched, pp, m, v)                  # the last stage's logits
            bubble = _bubble(sched, pp, m, v, recompute)
            variant = None
            for zero in fam.zeros:
                self.candidates += 1
                sb = fam.state(fast, v, zero, m)
                mem = sb[0] + act[0]
                if len(sb) == 2 and sb[1] + act[1] > mem:
                    mem = sb[1] + act[1]
                if mem > self.usable:
                    continue
                if variant is None:
                    timed = timed_v.get(v)
                    if timed is None:      # TP, CP, PP and compute are the same for every schedule
                        sts = [fast.times_raw(dp, tp, pp, cp, v, m, mb, sp, recompute, c.cp_kind, s)
                               for s in fam.stages]
                        timed = timed_v[v] = [(st, _core(st, c.cp_kind, 0.0)) for st in sts]
                    cores = [((st.compute + k[1] + k[2]) * (1.0 + bubble) + k[3], k[1], k[2], k[3])
                             for st, k in timed]
                    variant = (tp, cp, pp, dp, mb, m, sched, v, recompute, sp, bubble, timed, cores)
                best = None
                for i, dpt in enumerate(fam.dp_times(fast, v, zero)):
                    st, core = variant[11][i][0], variant[12][i]
                    dpe = _dp_exposed(zero, st.compute, m, recompute, *dpt[:4], dpt[4] * m)
                    if best is None or core[0] + dpe > best[0]:
                        best = (core[0] + dpe, i, dpe, dpt)
                assert best is not None
                self.records.append((best[0], mem, len(self.records), variant, zero, *best[1:]))

    def build(self, record: tuple) -> Estimate:
        """The :class:`Estimate` of one record (see :meth:`family`)."""
        step, mem, _, variant, zero, i, dpe, dpt = record
        tp, cp, pp, dp, mb, m, sched, v, recompute, sp, bubble, timed, cores = variant
        st, core = timed[i][0], cores[i]
        comm_s = dict(st.comm)
        if dp * cp > 1:
            comm_s["dp"] = dpt[0] + dpt[2] + dpt[4] * m
        fields = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "zero": zero, "sp": sp, "micro_batch": mb,
                  "grad_accum": m, "recompute": recompute, "schedule": sched, "interleave": v, **self.common}
        exposed = {"tp": core[1], "cp": core[2], "pp": core[3], "dp": dpe}
        mfu = self.model_flops / (step * self.gpus * self.cluster.peak_flops)
        return Estimate(fields, mem, self.usable, st.compute, bubble, comm_s, exposed, step, mfu)


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
    estimates = RankedPlans(sorted(search.records, key=lambda r: r[:3]), search.build)
    reasons = {r: rejected[r] for r in REASONS if rejected[r]}
    return PlannerResult(estimates, reasons, families, search.candidates, time.perf_counter() - t0, model,
                         cluster, gpus, seq, batch, c.margin)
