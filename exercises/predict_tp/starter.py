"""Exercise predict_tp (predict): tensor parallelism's bytes and time on a given link.

Megatron tensor parallelism over ``t`` ranks (no sequence parallelism) all-reduces one activation tensor
of ``s b h`` elements (``d`` bytes each) twice per layer in forward (the ``g`` operator after attention
and after the MLP) and twice in backward (``f``), per micro-batch. A ring all-reduce of ``M`` bytes over
``t`` ranks makes each rank send ``2 (t - 1) / t M`` and takes ``2 (t - 1)`` latency-bound steps; on a link
of bandwidth ``B`` (bytes/s per GPU per direction) and latency ``alpha`` one call takes
``2 (t - 1) alpha + 2 (t - 1) / t M / B`` (the alpha-beta model).

Implement ``tp_message_bytes(s, b, h, d)`` (one all-reduce), ``tp_bytes_per_step(layers, s, b, h, t, d, m)``
(bytes one GPU sends in the blocks per optimizer step of ``m`` micro-batches) and ``tp_time_per_step(layers,
s, b, h, t, d, m, bandwidth, latency)`` (seconds of those all-reduces, none overlapped). Graded (relative
1e-6): against ``parallel_lab.comm`` (dim ``tp``) for several models, TP degrees and links (NVLink 4 at
450 GB/s and 3 us; 400G InfiniBand at 50 GB/s and 10 us); against the messages traced on 2 CPU ranks.
Check: ``parallel-lab grade predict_tp exercises/predict_tp/starter.py``.
"""

from __future__ import annotations


def tp_message_bytes(s: int, b: int, h: int, d: int) -> int:
    # TODO
    raise NotImplementedError("tp_message_bytes")


def tp_bytes_per_step(layers: int, s: int, b: int, h: int, t: int, d: int, m: int = 1) -> float:
    # TODO
    raise NotImplementedError("tp_bytes_per_step")


def tp_time_per_step(layers: int, s: int, b: int, h: int, t: int, d: int, m: int, bandwidth: float,
                     latency: float) -> float:
    # TODO
    raise NotImplementedError("tp_time_per_step")
