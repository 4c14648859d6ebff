"""The memory ledger: bytes per GPU in six named categories, and whether they fit in HBM.

Categories (docs/conventions.md): ``parameters``, ``gradients``, ``optimizer_states`` (the model state,
Rajbhandari et al. 2020, "ZeRO": ``2 + 2 + 12`` bytes per parameter for mixed-precision Adam, ZeRO-1/2/3
sharding the optimizer states, then the gradients, then the parameters over ``g = dp * cp`` by units of
``ceil(n_u / g)`` elements), ``activations`` and ``logits_and_loss`` (Korthikanti et al. 2022 times the
in-flight micro-batches, :mod:`parallel_lab.ledger_activations`) and ``comm_buffers``
(:mod:`parallel_lab.ledger_buffers`). What a rank holds and keeps in flight is its
:class:`parallel_lab.rank_view.RankView`, computed once per (model, plan, stage); this module sums the
categories over it. The total sums each category at its own peak (conservative); the verdict also weighs
the peak at one moment of a step (:mod:`parallel_lab.ledger_peak`). Derivations: docs/conventions.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import ParallelLabError
from .hardware import ClusterSpec
from .ledger_activations import activation_bytes, check_activation_model, logits_bytes
from .ledger_buffers import comm_buffer_bytes
from .ledger_peak import PeakMoments, peak_moments
from .rank_view import check_stage, rank_view
from .sharding import layers_per_stage
from .specs import ModelSpec, Plan

CATEGORIES = ("parameters", "gradients", "optimizer_states", "activations", "logits_and_loss", "comm_buffers")
DEFAULT_CLUSTER = "h100-sxm"


# --------------------------------------------------------------------------------------------------
# Model state
# --------------------------------------------------------------------------------------------------

def stage_state_bytes(model: ModelSpec, plan: Plan, stage: int) -> dict[str, float]:
    """:func:`state_bytes` of one stage, for a plan already validated: the rank view's
    :attr:`~parallel_lab.rank_view.RankView.state` (ZeRO-2 holds its gradients whole between micro-batches
    unless it reduce-scatters every one; ZeRO-3 under a pipeline holds its full gradients as a comm buffer)."""
    return dict(rank_view(model, plan, stage).state)


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
    sharded category. ``stage=None`` reports the stage with the most state. Example (the tutorial's table):
    ``P = 7e9``, ``dp = 8``, adam-mixed: 112.0, 38.5, 26.25, 14.0 GB for ZeRO 0..3.
    """
    plan.validate(model)
    per = [stage_state_bytes(model, plan, s) for s in check_stage(plan, stage)]
    return max(per, key=lambda d: sum(d.values()))


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
        view = rank_view(model, plan, stage)
        inflight = view.inflight
        if plan.pp > 1:
            n_layers, blocks = len(view.layers), view.blocks_inflight
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


def memory(model: ModelSpec, plan: Plan, cluster: ClusterSpec | None = None, *,
           activation_model: str = "korthikanti", stage: int | None = None,
           margin: float = 0.1) -> MemoryLedger:
    """The memory ledger per GPU of ``plan`` training ``model`` on ``cluster`` (default h100-sxm).

    ``stage=None`` reports the pipeline stage with the largest total (usually stage 0), and the peak at one
    moment of the stage where it is highest. ``activation_model``: ``"korthikanti"`` (formulas) or
    ``"per-op"`` (saved tensors of the real blocks). The verdict weighs the larger of the two
    (:class:`MemoryLedger`).
    """
    check_activation_model(activation_model)
    if not 0 <= margin < 1:
        raise ParallelLabError(f"margin={margin} must be a fraction in [0, 1); e.g. margin=0.1")
    cluster = cluster or ClusterSpec.preset(DEFAULT_CLUSTER)
    plan.validate(model)
    ledgers = [_ledger_of_stage(model, plan, cluster, activation_model, s, margin)
               for s in check_stage(plan, stage)]
    led = max(ledgers, key=lambda led: led.total_bytes)
    if model.shape_known:
        led.peak = peak_moments(model, plan, stage, activation_model=activation_model)
    return led


