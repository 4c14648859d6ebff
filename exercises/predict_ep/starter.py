"""Exercise predict_ep (predict): expert parallelism's all-to-all bytes and the experts' memory per GPU.

A mixture-of-experts block with ``E`` experts routes each token to ``k`` of them. Each expert takes at most
``C = min(s, ceil(capacity_factor * k * s / E))`` tokens of a sequence of ``s`` tokens (GShard's capacity). A
GPU fills a fixed buffer ``(E, b C, h)`` for its micro-batch of ``b`` sequences (``d`` bytes per element) and
exchanges it with one all-to-all over the ``ep`` GPUs of its expert-parallel group (dispatch), then once more
to bring the experts' outputs back (combine); backward repeats both with the gradients: 4 all-to-alls per MoE
block and micro-batch. An all-to-all of ``M`` bytes over ``ep`` ranks makes each rank send ``(ep - 1) / ep M``.
With ``ep`` GPUs, each holds ``E / ep`` experts of every MoE block.

Implement ``expert_capacity(s, experts, top_k, capacity_factor)``, ``dispatch_bytes(s, b, h, d, experts,
top_k, capacity_factor)`` (one all-to-all's buffer), ``ep_bytes_per_step(moe_layers, s, b, h, d, experts,
top_k, capacity_factor, ep, m)`` (bytes one GPU sends for expert parallelism per optimizer step of ``m``
micro-batches) and ``params_per_gpu(dense_params, expert_params, ep)`` (the parameters one GPU holds, given
the model's non-expert and routed-expert parameter counts). Graded (relative 1e-9): against
``parallel_lab.comm`` (dim ``ep``) and ``parallel_lab.ledger`` for Mixtral 8x7B, DeepSeekMoE 16B and the tiny
MoE at several ``ep``, capacity factors and micro-batches.
Check: ``parallel-lab grade predict_ep exercises/predict_ep/starter.py``.
"""

from __future__ import annotations


def expert_capacity(s: int, experts: int, top_k: int, capacity_factor: float) -> int:
    # TODO
    raise NotImplementedError("expert_capacity")


def dispatch_bytes(s: int, b: int, h: int, d: int, experts: int, top_k: int, capacity_factor: float) -> int:
    # TODO
    raise NotImplementedError("dispatch_bytes")


def ep_bytes_per_step(moe_layers: int, s: int, b: int, h: int, d: int, experts: int, top_k: int,
                      capacity_factor: float, ep: int, m: int = 1) -> float:
    # TODO
    raise NotImplementedError("ep_bytes_per_step")


def params_per_gpu(dense_params: int, expert_params: int, ep: int) -> int:
    # TODO
    raise NotImplementedError("params_per_gpu")
