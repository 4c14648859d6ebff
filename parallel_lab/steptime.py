"""The step-time model: seconds per optimizer step of one plan, from FLOPs, collectives and the bubble.

    step = (compute + tp + cp_exposed) * (1 + bubble_ratio) + pp + dp_exposed + optimizer

``compute``: hardware FLOPs of the busiest stage over its ``tp * cp`` GPUs at ``cluster.mfu_achievable`` of
peak, or, with a fitted profile, the roofline (:func:`roofline_stage`): each GEMM ``(T x k) @ (k x n)``
takes ``2 T n k / (peak e(d))`` with ``e(d) = e_max d / (d + d_half)`` for its smallest dimension ``d``,
and attention its causal count at ``attention_efficiency``, plus the memory-bound ops' bytes at HBM
speed (``parallel_lab.membound``; ``optimizer``: the optimizer step's). ``tp`` is exposed (with SP a fraction
``tp_overlap`` hides, Megatron's TP overlap); ring CP hides its transfers behind attention; ``bubble_ratio``
is :func:`parallel_lab.simulate.bubble_formula`; ``pp`` every point-to-point transfer; ``dp_exposed``
the gradient sync beyond the backward it overlaps. Collective times are comm's alpha-beta model on the
tier each group lands on. MFU = model FLOPs per step / (step time * GPUs * peak), Chowdhery et al. 2022.
No constant is tuned to a published result: ``parallel-lab calibrate`` fits ``e_max`` (and
``overhead_s``) to measured runs. Each assumption, one line each, is in docs/step_time.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache

from . import membound, sharding
from .comm import Collective, collective_time
from .flops import ATTENTION_FWD_BWD, attention_core_flops, attention_keys, matmul_params, recomputed
from .hardware import LinkTier, StepProfile
from .sharding import stage_blocks
from .simulate import Costs, bubble_formula
from .specs import RECOMPUTE, ModelSpec, Plan


@dataclass(frozen=True)
class DpTimes:
    """The data-parallel calls of one stage, in the pieces the overlap rules need (module docstring)."""

    sync: float = 0.0           # gradient synchronisation (ZeRO 0, 1, 2), once per step
    last: float = 0.0           # its last call, which has no backward left to hide behind
    gather: float = 0.0         # ZeRO-1/2: all-gather of the updated parameters after the step
    first: float = 0.0          # its first call; ZeRO-3: the largest unit's gathers + reduce-scatter
    zero3_per_mb: float = 0.0   # ZeRO-3: all its traffic for one micro-batch
    spread: bool = False        # the sync is made every micro-batch (ZeRO-2 zero2_accumulate="sharded")

    def total(self, m: int) -> float:
        return self.sync + self.gather + self.zero3_per_mb * m


#: No data-parallel calls (a frozen value, shared).
NO_DP = DpTimes()


@dataclass
class StageTimes:
    """Seconds of one pipeline stage for one step (inputs of :func:`combine`)."""

    compute: float
    attention: float
    comm: dict[str, float]
    dp: DpTimes = NO_DP
    tp_overlap: float = 0.0     # fraction of the TP time hidden (profile.tp_overlap with SP, else 0)
    optimizer: float = 0.0      # the optimizer step's memory-bound time, once per step after the last backward


def dp_times(colls: Iterable[Collective], tier: LinkTier, zero: int, m: int,
             time: Callable[[str, int, int, LinkTier], float] = collective_time) -> DpTimes:
    """Read comm's ``dp`` collectives of one stage (in comm's order) into :class:`DpTimes`.

    ZeRO-3's calls are made every micro-batch (``count = m``); the others once per step. ``time`` is
    :func:`comm.collective_time` (the planner passes a memoised one)."""
    sync = last = gather = first = z3 = 0.0
    spread = False
    units: dict[str | None, float] = {}
    for c in colls:
        if c.dim != "dp":
            continue
        t = time(c.kind, c.message_bytes, c.group_size, tier)
        if zero == 3:
            z3 += c.count * t / m
            units[c.unit] = units.get(c.unit, 0.0) + t
        elif c.phase == "step":
            gather += c.count * t
            first = first or t
        else:
            sync += c.count * t
            last = t
            spread = spread or c.count > 1
    if units:
        first = max(units.values())
    return DpTimes(sync, last, gather, first, z3, spread)


def costs(recompute: str) -> Costs:
    """F : B : W for the bubble: backward twice the forward, split evenly; full recompute adds a forward."""
    return Costs(1.0, 2.0 if recompute == "full" else 1.0, 1.0)


#: (forward, backward) shares of a micro-batch's compute, from :func:`costs`.
SHARES = {r: (c.f / (c.f + c.b + c.w), (c.b + c.w) / (c.f + c.b + c.w))
          for r, c in ((r, costs(r)) for r in RECOMPUTE)}


@lru_cache(maxsize=4096)
def bubble(schedule: str, pp: int, m: int, v: int, recompute: str) -> float:
    """The bubble ratio the model assumes (0 without a pipeline)."""
    return 0.0 if pp == 1 else bubble_formula(schedule, pp, m, v, costs(recompute))


def plan_bubble(plan: Plan) -> float:
    """The pipeline bubble ratio the step-time model assumes for ``plan``."""
    return bubble(plan.schedule, plan.pp, plan.microbatches, plan.interleave, plan.recompute)


def dp_exposed(zero: int, compute: float, m: int, recompute: str, d: DpTimes) -> float:
    """The data-parallel time left on the critical path (module docstring)."""
    if zero == 3:
        z3 = d.zero3_per_mb * m
        return max(d.first, z3 - compute) if z3 else 0.0
    f_share, b_share = SHARES[recompute]
    per_mb = compute / m
    # a sync made once hides behind the last backward; one made every micro-batch behind everything after
    # the first forward, except the last micro-batch's, which has only the last backward to hide behind
    if not d.sync:
        out = 0.0
    elif d.spread:
        out = max(d.last, d.sync / m - per_mb * b_share, d.sync - (compute - per_mb * f_share))
    else:
        out = max(d.last, d.sync - per_mb * b_share)
    if d.gather:
        out += max(d.first, d.gather - per_mb * f_share)
    return out


def critical_parts(st: StageTimes, cp_kind: str) -> tuple[float, float, float, float]:
    """What of a stage's step is on the per-micro-batch critical path (compute, exposed TP, CP and EP), and
    its parts: exposed tp, exposed cp, pp; :func:`critical_path` scales the first by the bubble."""
    tp = (st.comm.get("tp", 0.0) + st.comm.get("tp_vocab", 0.0)) * (1.0 - st.tp_overlap)
    cp = st.comm.get("cp", 0.0)
    cp_exp = max(0.0, cp - st.attention) if cp_kind == "ring" else cp
    pp = st.comm.get("pp", 0.0)
    ep = st.comm.get("ep", 0.0)            # expert parallelism's all-to-alls block the layer: not overlapped
    return st.compute + tp + cp_exp + ep, tp, cp_exp, pp


def critical_path(st: StageTimes, cp_kind: str, bubble_ratio: float,
                  parts: tuple[float, float, float, float] | None = None) -> tuple[float, float, float, float]:
    """(per-micro-batch critical path times the pipeline factor, + PP) and its parts: tp, exposed cp, pp.

    ``parts``: :func:`critical_parts` of ``st``, when the caller has it (one stage under several schedules)."""
    per_mb, tp, cp_exp, pp = parts or critical_parts(st, cp_kind)
    return per_mb * (1.0 + bubble_ratio) + pp, tp, cp_exp, pp


def combine(zero: int, cp_kind: str, m: int, recompute: str, bubble_ratio: float,
            stages: list[StageTimes]) -> tuple[float, dict[str, float], dict[str, float], float, float]:
    """The step time of the module docstring; the stage with the longest step sets it.

    Returns (step time, comm time per dim, exposed time per dim, compute, optimizer step) of that stage."""
    best: tuple[float, dict[str, float], dict[str, float], float, float] | None = None
    for st in stages:
        core, tp, cp_exp, pp = critical_path(st, cp_kind, bubble_ratio)
        dp = dp_exposed(zero, st.compute, m, recompute, st.dp)
        step = core + dp + st.optimizer
        if best is None or step > best[0]:
            exposed = {"tp": tp, "cp": cp_exp, "pp": pp, "dp": dp}
            if st.comm.get("ep"):
                exposed["ep"] = st.comm["ep"]
            best = (step, st.comm, exposed, st.compute, st.optimizer)
    assert best is not None
    return best


def stages_to_check(pp: int, split: str = "layers") -> list[int]:
    """The stages whose memory and time can be the largest, which the planner and ``evaluate`` check.

    * Stage 0 holds the most layers (chunks get the extra layers first), the embedding and the most
      in-flight micro-batches; the last stage the head and the logits.
    * Stage 1, the first with two neighbours, as many layers as any middle stage and their most in-flight
      micro-batches: a middle stage sends and receives on both sides, twice stage 0's P2P time. With
      ``split="embed-head"`` stage 0 also gives a block slot to the embedding.
    * Interleaved 1F1B with ``m = p``: the ranks from ``ceil(p / 2)`` on post two more P2P messages
      (``schedules.inflight.messages_at_once``), which under full recomputation with a layer per chunk can outweigh
      the in-flight micro-batches they hold fewer of: ``ceil(p / 2)``, and ``(p - 1) / 2`` (three messages)
      for an odd ``p``.
    """
    middle = {1, (pp + 1) // 2, (pp - 1) // 2} if pp > 2 else set()
    return sorted({0, pp - 1} | middle | ({min(1, pp - 1)} if split == "embed-head" else set()))


class StageFlops:
    """Hardware FLOPs per token of a pipeline stage (``flops.py``'s formula, split by stage)."""

    def __init__(self, model: ModelSpec, seq: int, split: str = "layers", mlp: str = "eager",
                 attention: str = "eager") -> None:
        n_blocks, n_head = matmul_params(model)
        q = model.heads * model.head_dim
        self.model, self.split, self.mlp, self.attention_kernel = model, split, mlp, attention
        attn_fwd = attention_core_flops(1.0, seq, q)                        # per token: the full square
        self.attn = ATTENTION_FWD_BWD["eager"] * attn_fwd                   # forward + backward, as flops.py
        self.per_layer = 6.0 * n_blocks / model.layers + self.attn
        self.extra: dict[str, float] = {}
        for r in RECOMPUTE:                  # per layer: the matmuls and the core that backward runs again
            params, core = recomputed(model, r, mlp)
            self.extra[r] = 2.0 * params / model.layers + (attn_fwd if core else 0.0)
        self.head = 6.0 * n_head
        self._nl: dict[tuple[int, int, int], int] = {}

    def n_layers(self, pp: int, v: int, stage: int) -> int:
        key = (pp, v, stage)
        if key not in self._nl:
            self._nl[key] = stage_blocks(self.model.layers, pp, v, stage, self.split)
        return self._nl[key]

    def stage(self, pp: int, v: int, stage: int, recompute: str) -> float:
        head = self.head if stage == pp - 1 else 0.0
        return self.n_layers(pp, v, stage) * (self.per_layer + self.extra[recompute]) + head

    def attention(self, pp: int, v: int, stage: int) -> float:
        return self.n_layers(pp, v, stage) * self.attn


# --------------------------------------------------------------------------------------------------
# Roofline compute (cluster profiles fitted by `parallel-lab calibrate`)
# --------------------------------------------------------------------------------------------------

@lru_cache(maxsize=256)
def block_gemms(model: ModelSpec, tp: int) -> tuple[tuple[str, int, int], ...]:
    """``(name, n, k)`` of each weight GEMM of one block on one TP rank: output and input widths."""
    out = []
    for name, shape in model.parameter_shapes():
        parts = name.split(".")
        if parts[0] != "blocks" or parts[1] != "0" or parts[-1] != "weight" or len(shape) != 2:
            continue
        (fan_out, fan_in), leaf = shape, parts[3]
        if leaf in sharding.COLUMN_PARALLEL:
            out.append((leaf, sharding.column_rows(model, leaf, fan_out, tp), fan_in))
        else:
            out.append((leaf, fan_out, fan_in // tp))
    return tuple(out)


def gemm_rate(d: float, peak: float, prof: StepProfile) -> float:
    """FLOP/s of a GEMM whose smallest dimension is ``d``: ``peak * e(d)``, ``e(d) = e_max d / (d + d_half)``."""
    return peak * prof.matmul_efficiency * d / (d + prof.half_width)


def gemm_time(tokens: float, n: int, k: int, peak: float, prof: StepProfile) -> float:
    """Forward seconds of ``(tokens x k) @ (k x n)`` at the shape's efficiency (module docstring)."""
    return 2.0 * tokens * n * k / gemm_rate(min(tokens, n, k), peak, prof)


@lru_cache(maxsize=8192)
def roofline_layer(model: ModelSpec, prof: StepProfile, peak: float, seq: int, tp: int, cp: int, mb: int,
                   recompute: str, attention: str = "eager", mlp: str = "eager") -> tuple[float, float, float]:
    """``(block forward+backward, its attention part, the recomputed forward)`` seconds of one block for one
    micro-batch on one rank (tokens ``mb * seq / cp``; the GEMMs see them all, SP gathers them first). The
    GEMMs' backward is twice their forward; the attention core's is ``flops.ATTENTION_FWD_BWD[kernel]``
    less one (FlashAttention recomputes the scores). A fused kernel (and CP's blockwise cores) computes the
    causal half at ``attention_efficiency``; an eager core computes every score with two GEMMs of inner width
    ``head_dim`` at their roofline efficiency, the softmax's memory traffic left out (a lower bound)."""
    tokens = mb * seq / cp
    gemms = {name: gemm_time(tokens, n, k, peak, prof) for name, n, k in block_gemms(model, tp)}
    fwd = sum(gemms.values())
    if attention == "flash" or cp > 1:       # a fused kernel, or CP's blockwise cores: masked blocks skipped
        kernel, keys, rate = "flash", attention_keys(seq, "causal"), peak * prof.attention_efficiency
    else:                                    # eager: two GEMMs over every key (the mask zeroes, never skips)
        # of inner width head_dim; the softmax's memory traffic is not counted
        kernel, keys, rate = "eager", attention_keys(seq, "palm"), gemm_rate(model.head_dim, peak, prof)
    attn_fwd = attention_core_flops(tokens, keys, sharding.q_width_local(model, tp)) / rate
    params, core = recomputed(model, recompute, mlp)
    again = fwd * params / max(1, matmul_params(model)[0]) + (attn_fwd if core else 0.0)
    attn = ATTENTION_FWD_BWD[kernel] * attn_fwd
    return 3.0 * fwd + attn, attn, again


def roofline_parts(model: ModelSpec, prof: StepProfile, peak: float, plan_seq: int, tp: int, cp: int, mb: int,
                   last: bool, recompute: str, attention: str = "eager", mlp: str = "eager", sp: bool = False,
                   hbm_bandwidth: float = 0.0) -> tuple[float, float, float, float]:
    """One micro-batch's ``(block, recomputed, head, attention)`` seconds under the roofline: a block's
    forward and backward with its memory-bound work, what recomputation adds to a block, the head (last
    stage only) and a block's attention core. :func:`roofline_stage` scales them to a stage's step."""
    layer, attn, again = roofline_layer(model, prof, peak, plan_seq, tp, cp, mb, recompute, attention, mlp)
    head = 0.0
    if last:
        tokens = mb * plan_seq / cp
        head = 3.0 * gemm_time(tokens, sharding.vocab_local(model, tp), model.hidden, peak, prof)
    if hbm_bandwidth:
        rate = hbm_bandwidth * prof.hbm_efficiency
        layer += membound.block_bytes(model, plan_seq, tp, cp, sp, mb, recompute, attention) / rate
        if last:
            head += membound.head_bytes(model, plan_seq, tp, cp, sp, mb) / rate
    return layer, again, head, attn


def stage_of_parts(parts: tuple[float, float, float, float], prof: StepProfile, m: int, n_layers: int,
                   v: int) -> tuple[float, float]:
    """``(compute, attention)`` of a stage's step from :func:`roofline_parts`: ``m`` micro-batches of
    ``n_layers`` blocks, the head, and ``overhead_s`` per micro-batch per chunk."""
    layer, again, head, attn = parts
    compute = m * (n_layers * (layer + again) + head + v * prof.overhead_s)
    return compute, m * n_layers * attn


def roofline_stage(model: ModelSpec, prof: StepProfile, peak: float, plan_seq: int, tp: int, cp: int, mb: int,
                   m: int, n_layers: int, v: int, last: bool, recompute: str, attention: str = "eager",
                   mlp: str = "eager", sp: bool = False, hbm_bandwidth: float = 0.0) -> tuple[float, float]:
    """``(compute, attention)`` seconds of one stage for the whole step under the roofline (``m``
    micro-batches, ``n_layers`` blocks, the head on the last stage, ``overhead_s`` per micro-batch per
    chunk), plus the memory-bound work (``membound``) at ``hbm_bandwidth * hbm_efficiency`` (none at 0)."""
    parts = roofline_parts(model, prof, peak, plan_seq, tp, cp, mb, last, recompute, attention, mlp, sp,
                           hbm_bandwidth)
    return stage_of_parts(parts, prof, m, n_layers, v)
