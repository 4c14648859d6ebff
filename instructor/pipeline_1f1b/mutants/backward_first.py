"""Mutant: in the steady state the backward comes before the forward (deadlocks the last stage)."""

from __future__ import annotations

from parallel_lab.schedules.actions import Action, B, F


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    orders = []
    for r in range(p):
        warm = min(p - r - 1, m)
        order = [F(i) for i in range(warm)]
        for i in range(m - warm):
            order += [B(i), F(warm + i)]
        order += [B(i) for i in range(m - warm, m)]
        orders.append(order)
    return orders
