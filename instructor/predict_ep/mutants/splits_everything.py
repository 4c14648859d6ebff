"""Mutant: divides the whole model by ep (the dense part is not split by expert parallelism)."""

from __future__ import annotations

import math


def expert_capacity(s, experts, top_k, capacity_factor):
    return min(s, math.ceil(capacity_factor * top_k * s / experts))


def dispatch_bytes(s, b, h, d, experts, top_k, capacity_factor):
    return experts * b * expert_capacity(s, experts, top_k, capacity_factor) * h * d


def ep_bytes_per_step(moe_layers, s, b, h, d, experts, top_k, capacity_factor, ep, m=1):
    return 4 * moe_layers * m * (ep - 1) / ep * dispatch_bytes(s, b, h, d, experts, top_k, capacity_factor)


def params_per_gpu(dense_params, expert_params, ep):
    return (dense_params + expert_params) // ep
