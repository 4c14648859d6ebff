"""Mutant: each rank sends the whole message per call (forgets (g - 1) / g)."""

from __future__ import annotations

import math


def zero_state(psi, g, stage, bytes_per_param=(2, 2, 12)):
    shard = math.ceil(psi / g)
    p, gr, o = bytes_per_param
    return {"parameters": p * (shard if stage >= 3 else psi), "gradients": gr * (shard if stage >= 2 else psi),
            "optimizer_states": o * (shard if stage >= 1 else psi)}


def zero_dp_bytes(psi, g, stage, elem_bytes=2):
    message = g * math.ceil(psi / g) * elem_bytes if stage else psi * elem_bytes
    halves = {0: 2, 1: 2, 2: 2, 3: 2}[stage]          # all-reduce = 2 halves, all-gather / reduce-scatter = 1
    return halves * message
