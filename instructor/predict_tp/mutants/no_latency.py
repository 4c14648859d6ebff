"""Mutant: forgets the latency term (bandwidth only)."""

from __future__ import annotations


def tp_message_bytes(s, b, h, d):
    return s * b * h * d


def tp_bytes_per_step(layers, s, b, h, t, d, m=1):
    return 4 * layers * m * 2 * (t - 1) / t * tp_message_bytes(s, b, h, d)


def tp_time_per_step(layers, s, b, h, t, d, m, bandwidth, latency):
    calls = 4 * layers * m
    return 0 * calls * latency + tp_bytes_per_step(layers, s, b, h, t, d, m) / bandwidth
