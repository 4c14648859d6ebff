"""Reference solution of predict_bubble."""

from __future__ import annotations


def bubble_ratio(schedule, p, m, v=1):
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / m
    if schedule == "interleaved":
        return (p - 1) / (v * m)
    if schedule == "zb-h1":
        return (p - 1) * (1 + 1 - 1) / (m * 3)
    raise ValueError(f"unknown schedule {schedule!r}")


def peak_inflight(schedule, p, m, stage):
    return m if schedule == "gpipe" else min(p - stage, m)


BUBBLE_VS_MEMORY = """1F1B keeps the bubble of GPipe but holds at most p - r micro-batches on stage r instead of m, so
it is GPipe's memory that it saves. Interleaving divides the bubble by v at the price of v times as many
point-to-point messages, and its first stage holds more micro-batches in flight. ZB-H1 keeps 1F1B's memory
bound but must hold the inputs of the deferred weight gradients a little longer. With few micro-batches and
little memory I would accept 1F1B's bubble rather than recompute activations."""
