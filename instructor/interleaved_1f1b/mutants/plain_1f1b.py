"""Mutant: plain 1F1B that ignores the chunks: every action on chunk 0 (what v = 1 does)."""

from __future__ import annotations

from parallel_lab.schedules.actions import Action, B, F


def interleaved_1f1b(p: int, m: int, v: int) -> list[list[Action]]:
    orders = []
    for r in range(p):
        warm = min(p - r - 1, m)
        order = [F(i) for i in range(warm)]
        for i in range(m - warm):
            order += [F(warm + i), B(i)]
        order += [B(i) for i in range(m - warm, m)]
        orders.append(order)
    return orders
