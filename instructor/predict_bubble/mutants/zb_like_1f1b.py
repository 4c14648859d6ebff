"""Mutant: gives ZB-H1 the bubble of 1F1B."""

from __future__ import annotations


def bubble_ratio(schedule, p, m, v=1):
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / m
    if schedule == "interleaved":
        return (p - 1) / (v * m)
    if schedule == "zb-h1":
        return (p - 1) / m
    raise ValueError(f"unknown schedule {schedule!r}")


def peak_inflight(schedule, p, m, stage):
    return m if schedule == "gpipe" else min(p - stage, m)
