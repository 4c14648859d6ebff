"""FLOPs of one optimizer step (the whole global batch on all GPUs) and model FLOPs utilisation.

Model FLOPs per token (Kaplan et al. 2020; PaLM, Chowdhery et al. 2022, App. B)::

    6 * N_matmul  +  12 * L * q_dim * s

``N_matmul``: the weights in matrix multiplications (block linears and the head; no embedding look-ups,
norms or biases). The attention term counts the full ``s x s`` square (convention ``palm``) or only the
``s (s + 1) / 2`` pairs a causal mask leaves (``causal``); :data:`CONVENTIONS` names both and
``step_flops`` reports both. For a GPT block this is Narayanan et al. 2021's
``72 B s L h^2 (1 + s/(6h) + V/(12 h L))``. Hardware FLOPs add what recomputation runs again
(:func:`recomputed`). MFU: model FLOPs per second over the peak of all GPUs. The derivation and the
measurement against torch's FlopCounterMode are in docs/step_time.md.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from . import activations
from .errors import ParallelLabError
from .hardware import FLASH_BACKWARD_OVER_FORWARD, ClusterSpec
from .sharding import is_expert_param
from .specs import ModelSpec, Plan

FORMULA = "6*N_matmul*T + 12*L*q_dim*s*T (PaLM App. B / Narayanan et al. 2021; no causal halving)"
#: Attention FLOP conventions: ``palm`` counts the full ``s x s`` square of scores (the tutorial's and
#: the papers' MFU figures); ``causal`` counts only the query-key pairs a causal mask leaves visible,
#: ``s (s + 1) / 2`` per sequence, i.e. ``(s + 1) / 2`` keys per token (what a kernel that skips masked
#: tiles does, up to its diagonal tiles).
CONVENTIONS: dict[str, str] = {
    "palm": FORMULA,
    "causal": "6*N_matmul*T + 12*L*q_dim*(s+1)/2*T (causal: only the visible query-key pairs)",
}


@functools.lru_cache(maxsize=256)
def matmul_params(model: ModelSpec) -> tuple[int, int]:
    """``(N_blocks, N_head)``: weights of the blocks' linear layers and of the output head. Mixture of experts:
    the active ones, a token's ``top_k`` of the ``experts`` routed experts (capacity padding not counted)."""
    model.require_shape("FLOPs")
    blocks = sum(math.prod(s) for n, s in model.parameter_shapes()
                 if n.startswith("blocks.") and n.endswith(".weight") and len(s) == 2 and not is_expert_param(n))
    routed = sum(math.prod(s) for n, s in model.parameter_shapes() if is_expert_param(n) and len(s) == 2)
    return blocks + routed * model.top_k // max(model.experts, 1), model.vocab * model.hidden


@dataclass(frozen=True)
class FlopsReport:
    """FLOPs of one optimizer step over the global batch (all GPUs together)."""

    model_flops_per_step: float            # PaLM convention (full square)
    hardware_flops_per_step: float
    tokens_per_step: int
    formula: str = FORMULA
    model_flops_causal_per_step: float = 0.0   # causal convention (visible pairs only)

    def to_json(self) -> dict[str, Any]:
        return {"model_flops_per_step": self.model_flops_per_step,
                "hardware_flops_per_step": self.hardware_flops_per_step,
                "tokens_per_step": self.tokens_per_step, "formula": self.formula,
                "model_flops_causal_per_step": self.model_flops_causal_per_step,
                "conventions": dict(CONVENTIONS)}


def attention_keys(seq: int, convention: str = "palm") -> float:
    """Keys each query attends to on average: ``s`` (PaLM's full square) or ``(s + 1) / 2`` (causal)."""
    if convention not in CONVENTIONS:
        raise ParallelLabError(f"FLOP convention {convention!r} is not known; pick one of {', '.join(CONVENTIONS)}")
    return float(seq) if convention == "palm" else (seq + 1) / 2


#: Forward + backward work of the attention core, in units of its forward (``4 s k q`` FLOPs per sequence
#: of ``s`` queries against ``k`` keys each): an eager core's backward runs two matmuls per forward matmul
#: (dP and dV, then dQ and dK), 2x; FlashAttention's backward first recomputes the scores from Q and K, 2.5x
#: (``hardware.FLASH_BACKWARD_OVER_FORWARD``: the benchmarks' FLOP count, which their TFLOP/s figures use).
ATTENTION_FWD_BWD: dict[str, float] = {"eager": 3.0, "flash": 1.0 + FLASH_BACKWARD_OVER_FORWARD}


def attention_core_flops(tokens: float, keys: float, q_width: float, kernel: str | None = None) -> float:
    """FLOPs of an attention core over ``tokens`` queries of ``keys`` keys each and ``q_width = heads x
    head_dim``: ``4 tokens keys q_width`` forward (``Q K^T`` and ``P V``); with ``kernel`` its forward +
    backward, :data:`ATTENTION_FWD_BWD` times that (what ``steptime.roofline_layer`` charges and
    ``microfit.AttentionSample`` counts)."""
    fwd = 4.0 * tokens * keys * q_width
    return fwd if kernel is None else ATTENTION_FWD_BWD[kernel] * fwd


def flops_per_token(model: ModelSpec, seq: int, convention: str = "palm") -> float:
    """Model FLOPs per trained token at sequence length ``seq``: ``6 N_matmul + 12 L q_dim k``, with ``k``
    the keys per query of the convention (:func:`attention_keys`: ``s`` for PaLM, ``(s + 1) / 2`` causal)."""
    n_blocks, n_head = matmul_params(model)
    q_dim = model.heads * model.head_dim
    return 6.0 * (n_blocks + n_head) + model.layers * attention_core_flops(
        1.0, attention_keys(seq, convention), q_dim, "eager")


def op_sac_recomputed_params(model: ModelSpec, plan: Plan) -> int:
    """Weights of the block matmuls op-sac recomputes (the bias-free ones it does not keep, plus every
    linear with a bias), all layers: the recomputed forward is ``2 *`` this per token plus the core."""
    kept = {name for name, _ in activations.op_sac_kept_matmuls(model, plan, activations.local_dims(model, plan))}
    return sum(math.prod(s) for n, s in model.parameter_shapes()
               if n.startswith("blocks.") and n.endswith(".weight") and len(s) == 2
               and n.split(".", 2)[2].rsplit(".", 1)[0] not in kept)


def recomputed(model: ModelSpec, recompute: str, mlp: str = "eager") -> tuple[int, bool]:
    """What backward runs again of the forward under ``recompute``, all layers: ``(matmul weights
    recomputed, whether the attention core is)``. ``none``: nothing; ``selective`` (Korthikanti et al. 2022):
    the core; ``full``: every block matmul and the core; ``op-sac``: the matmuls torchtitan's policy does not
    keep (:func:`op_sac_recomputed_params`) and the core, as the lab's kernels run it (torchtitan's list
    keeps the outputs of aten's SDPA kernels, which the lab's attention is not). The one home of this rule:
    hardware FLOPs, the stage FLOPs and the roofline's recomputed forward all read it."""
    if recompute == "none":
        return 0, False
    if recompute == "selective":
        return 0, True
    if recompute == "full":
        return matmul_params(model)[0], True
    if recompute == "op-sac":
        return op_sac_recomputed_params(model, Plan(mlp=mlp)), True
    raise ParallelLabError(f"recompute={recompute!r} is not known; pick none, selective, full or op-sac")


def step_flops(model: ModelSpec, plan: Plan) -> FlopsReport:
    """Model and hardware FLOPs of one step: ``global_batch * seq`` tokens (see the module docstring)."""
    plan.validate(model)
    tokens = plan.global_batch_tokens
    attn_fwd = model.layers * attention_core_flops(1.0, plan.seq, model.heads * model.head_dim)   # per token
    model_flops = flops_per_token(model, plan.seq) * tokens
    params, core = recomputed(model, plan.recompute, plan.mlp)
    extra = 2.0 * params + (attn_fwd if core else 0.0)
    return FlopsReport(model_flops, model_flops + extra * tokens, tokens,
                       model_flops_causal_per_step=flops_per_token(model, plan.seq, "causal") * tokens)


def mfu(model: ModelSpec, plan: Plan, step_time_s: float, cluster: ClusterSpec) -> float:
    """Model FLOPs utilisation: ``model_flops_per_step / (step_time * GPUs * peak_flops)``."""
    if not step_time_s > 0:
        raise ParallelLabError(f"step_time_s={step_time_s} must be > 0 seconds")
    return step_flops(model, plan).model_flops_per_step / (step_time_s * plan.world * cluster.peak_flops)
