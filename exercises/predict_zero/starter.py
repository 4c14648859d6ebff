"""Exercise predict_zero (predict): ZeRO's memory and bytes per GPU.

``Psi`` trainable parameters, ``g`` data-parallel ranks, mixed-precision Adam at 2 + 2 + 12 bytes per
parameter (bf16 weights and gradients, fp32 master, momentum and variance; Rajbhandari et al. 2020).
Here a single unit holds every parameter (sharded into ``ceil(Psi / g)`` elements per rank), and the
collectives of one step are, with bf16 messages of ``2 Psi`` bytes (padded to ``g ceil(Psi / g)`` elements):

* stage 0 (DDP): all-reduce the gradients;
* stage 1 (optimizer states sharded): reduce-scatter the gradients (each rank needs only its shard to step),
  then all-gather the updated parameters (the ZeRO paper, Sec. 7; torch's ZeroRedundancyOptimizer all-reduces
  instead, 1.5x the bytes);
* stage 2 (+ gradients sharded): reduce-scatter the gradients, all-gather the parameters;
* stage 3 (+ parameters sharded; the unit gathered once per step, kept through backward): all-gather
  the parameters before forward, reduce-scatter the gradients after backward.

A ring all-reduce of ``M`` bytes makes each rank send ``2 (g - 1) / g M``; an all-gather or a
reduce-scatter of ``M`` (the full buffer) ``(g - 1) / g M``.

Implement ``zero_state(psi, g, stage, bytes_per_param)``: ``{"parameters", "gradients",
"optimizer_states"}`` per GPU, and ``zero_dp_bytes(psi, g, stage, elem_bytes)``: the bytes one GPU sends per
optimizer step. Graded (relative 1e-6): against ``parallel_lab.ledger`` and ``parallel_lab.comm`` for many
``(Psi, g, stage)``; against a real run of every stage on 2 CPU ranks (fp32, 4 + 4 + 8 bytes; bytes
measured from the tensors and from the messages the ranks sent).
Check: ``parallel-lab grade predict_zero exercises/predict_zero/starter.py``.
"""

from __future__ import annotations

import math


def zero_state(psi: int, g: int, stage: int, bytes_per_param: tuple[int, int, int] = (2, 2, 12)) -> dict[str, float]:
    # TODO
    raise NotImplementedError("zero_state")


def zero_dp_bytes(psi: int, g: int, stage: int, elem_bytes: int = 2) -> float:
    # TODO
    raise NotImplementedError("zero_dp_bytes")


__all__ = ["math", "zero_dp_bytes", "zero_state"]
