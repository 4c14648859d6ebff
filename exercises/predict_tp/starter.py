"""Exercise predict_tp (predict): tensor parallelism's bytes and time on a given link.

Megatron tensor parallelism over ``t`` ranks (no sequence parallelism) glues each block's attention and
MLP with two operators: ``f`` before a column-parallel layer (identity in forward, all-reduce in backward)
and ``g`` after a row-parallel one (all-reduce in forward, identity in backward); every all-reduce carries
one activation tensor of ``s b h`` elements, ``d`` bytes each. How many all-reduces does a layer make per
micro-batch, in forward and in backward?

The collectives are ring algorithms (lesson 02; ``docs/conventions.md``, "Collectives"). Work out, for an
all-reduce of ``M`` bytes over ``t`` ranks, how many bytes each rank sends and in how many steps (each step
waits for one message from a neighbour). Time one call with the alpha-beta model: every step pays the
link's latency ``alpha`` once, and the bytes a rank sends flow at the link's bandwidth ``B`` (bytes/s per GPU
per direction).

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
