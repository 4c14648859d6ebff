"""Mutant: forgets that interleaving divides the bubble by v."""

from __future__ import annotations


def bubble_ratio(schedule, p, m, v=1):
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / m
    if schedule == "interleaved":
        return (p - 1) / m
    if schedule == "zb-h1":
        return (p - 1) * (1 + 1 - 1) / (m * 3)
    raise ValueError(f"unknown schedule {schedule!r}")


def peak_inflight(schedule, p, m, stage):
    return m if schedule == "gpipe" else min(p - stage, m)
