"""The peak at one moment of a step, beside the ledger's sum of per-category peaks.

The ledger's total sums each category at its own peak; :func:`peak_moments` counts what torch holds
together at up to seven named moments of one steady-state step (the loss, its backward, the first and
second block backward, ZeRO-3's root gradient and its reduce-scatter, the optimizer step): the rank's
state and in-flight saves (its :class:`parallel_lab.rank_view.RankView`) plus each moment's transients
(eager attention's ``2 a s^2 b d`` score gradients, the loss's fp32 logit gradients ``2 s b V 4``,
fresh weight gradients, gathered ZeRO-3 units, AdamW's temporaries). The rules follow torch's autograd
as measured in fake tensors (tests/test_peak.py; README, "Measured at real scale").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import activations
from .ledger_activations import (
    LOSS_BYTES,
    activation_bytes,
    activation_bytes_per_layer,
    check_activation_model,
    logits_bytes,
)
from .ledger_buffers import activation_buffer_bytes, zero3_gathered_bytes, zero3_held_gradient_bytes
from .rank_view import RankView, check_stage, rank_view
from .sharding import padded, shard_size
from .specs import ModelSpec, Plan

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


def _root_gradient_moments(view: RankView) -> tuple[dict[str, float], dict[str, float]]:
    """ZeRO-3 without a pipeline, the end of backward (``distributed/zero/fsdp.py``), two moments:

    * ``root gradient`` (the token embedding's backward): the root unit (embedding, head, final norm) still
      gathered; its parameters' gradients in the gathered dtype beside the unit's flat gradient they are
      summed into; the previous unit's reduce-scatter in flight (its fp32 flat gradient: it completes at
      the next reduce-scatter);
    * ``root reduce-scatter``: the root unit freed, its flat gradient and fp32 copy
      (:func:`zero3_reduce_input_bytes`'s rule) and the fp32 output shard.

    Both hold the other units' reduced fp32 shards (all units' after an earlier micro-batch). Measured in
    fake tensors: tests/test_peak.py (FlashAttention at 2K tokens, where no saved activation hides them)."""
    plan, units, state = view.plan, view.units, view.state
    g, pb, gb = view.group, view.param_comm_bytes, view.grad_comm_bytes
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


def _grads_before(view: RankView) -> float:
    """Gradient bytes alive during the forward/backward of the stage's peak micro-batch that earlier
    micro-batches (or a persistent buffer) made: bucketed DDP's flat buckets always exist (they are
    ``.grad``); any variant holds what accumulation keeps once a backward precedes the activation peak
    (``m`` > the stage's in-flight micro-batches): full gradients (ZeRO-0/1, ZeRO-2 unsharded), the shards
    (ZeRO-2 sharded, ZeRO-3), ZeRO-3 under a pipeline its held full gradients."""
    plan, state = view.plan, view.state
    full = state["gradients"] if not view.gradients_sharded else float(view.elements * plan.optim.grad_bytes)
    bucketed = plan.zero == 0 and plan.dp_kind == "bucketed" and view.group > 1
    accumulated = plan.microbatches > view.inflight
    if not accumulated:
        return full if bucketed else 0.0
    if plan.zero == 3 and plan.pp > 1:
        return float(zero3_held_gradient_bytes(view.model, plan, view.stage))
    if plan.zero >= 2 and view.gradients_sharded:
        return state["gradients"]
    return full          # bucketed DDP accumulates into its buckets (gradients are bucket views, no copy)


def _fresh_grads(view: RankView) -> float:
    """Weight gradients the peak micro-batch has made when backward reaches the last block's attention core
    (the head's on the last stage, the block's output projection, MLP norm and MLP) as new tensors: in the
    gathered dtype under ZeRO-3 (they wait for their unit's other gradients), else in the gradient dtype;
    none where they land in an existing buffer (bucketed DDP copies each into its bucket at once; gradient
    accumulation adds into ``.grad``)."""
    plan = view.plan
    bucketed = plan.zero == 0 and plan.dp_kind == "bucketed" and view.group > 1
    inplace = plan.microbatches > 1 and (plan.zero < 2 or not view.gradients_sharded)
    if (bucketed or inplace) and not (plan.zero == 3 and plan.pp == 1):
        return 0.0
    params = view.params
    blocks = [p.name.split(".")[1] for p in params if p.name.startswith("blocks.")]
    last = f"blocks.{blocks[-1]}." if blocks else None
    after_core = (".attn.wo.", ".mlp_norm.", ".mlp.")
    n = sum(p.numel for p in params
            if (last and p.name.startswith(last) and any(k in p.name[len(last) - 1:] for k in after_core))
            or (view.last and (p.name.startswith(("final_norm.", "lm_head.")))))
    return float(n * (view.param_comm_bytes if plan.zero == 3 else plan.optim.grad_bytes))


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


def _step_temporaries(view: RankView) -> float:
    """The optimizer step's transients: AdamW (``foreach=False``) makes two fp32 temporaries of the
    largest parameter it steps (per-parameter without ZeRO, a unit's shard with ZeRO); ``adam-mixed``
    without ZeRO also casts every gradient to an fp32 copy first (``MasterAdamW``); ZeRO-1/2 then gathers
    the largest unit's updated parameters (its flat buffer and the shard cast for the all-gather)."""
    plan, g, units = view.plan, view.group, view.units
    if plan.zero >= 1:
        largest = max(shard_size(n, g) for n in units.values())
    else:
        largest = max(p.numel for p in view.params)
    if plan.optimizer == "sgd-momentum":
        temps = 0.0
    else:
        temps = 2.0 * largest * 4
    if plan.optimizer == "adam-mixed" and plan.zero == 0:
        temps += sum(units.values()) * 4
    if plan.zero in (1, 2) and g > 1:
        big = max(padded(n, g) for n in units.values())
        temps = max(temps, (big + shard_size(big, g)) * view.param_comm_bytes)
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
    check_activation_model(activation_model)
    if stage is None:
        return max((peak_moments(model, plan, s, activation_model=activation_model) for s in range(plan.pp)),
                   key=lambda pm: pm.peak_bytes)
    check_stage(plan, stage)
    view = rank_view(model, plan, stage)
    state, last = view.state, view.last
    base = {"parameters": state["parameters"], "optimizer_states": state["optimizer_states"],
            "gradients": _grads_before(view)}
    act = activation_bytes(model, plan, stage, formula=activation_model)
    logits = logits_bytes(model, plan, formula=activation_model) if last else 0.0
    bufs = activation_buffer_bytes(model, plan, stage)
    g, units = view.group, view.units
    unpiped_zero3 = plan.zero == 3 and g > 1 and plan.pp == 1
    gathered = float(zero3_gathered_bytes(model, plan, stage))
    root = gathered
    if unpiped_zero3:                                  # between blocks only the root unit stays gathered
        root = float(padded(units.get("root", 0), g) * view.param_comm_bytes)
    t = activations.local_dims(model, plan)
    rows, vocab = t.b * t.s, view.vocab
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
    kept = view.head_inflight if last else 1
    first = {**base, "activations": act - _after_core_bytes(model, plan),
             "logits_and_loss": logits * (kept - 1) / kept,
             **_core_backward_bytes(model, plan),
             "fresh weight gradients": _fresh_grads(view),
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
                "gradients": first["gradients"] + shard_size(blocks[-1], g) * view.grad_comm_bytes,
                "previous unit's reduce-scatter input": float(padded(blocks[-1], g) * view.grad_comm_bytes)}
        moments["root gradient"], moments["root reduce-scatter"] = _root_gradient_moments(view)
    step_grads = state["gradients"]
    if plan.zero == 2:                      # reduce-scattered into the shards by the step, however accumulated
        step_grads = float(view.shard_elements * plan.optim.grad_bytes)
    moments["step"] = {"parameters": state["parameters"], "gradients": step_grads,
                       "optimizer_states": state["optimizer_states"],
                       "optimizer temporaries": _step_temporaries(view)}
    return PeakMoments(stage, {k: {p: float(v) for p, v in moments[k].items()} for k in MOMENTS if k in moments},
                       activation_model)
