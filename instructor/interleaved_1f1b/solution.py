"""Reference solution of interleaved_1f1b."""

from __future__ import annotations

from parallel_lab.schedules.actions import Action, B, F


def interleaved_1f1b(p: int, m: int, v: int) -> list[list[Action]]:
    if v > 1 and m % p:
        raise ValueError(f"interleaved 1F1B needs m a multiple of p; m={m}, p={p}")
    total = m * v

    def kth(k: int, backward: bool) -> tuple[int, int]:
        """The k-th forward (or backward) of a rank: (micro-batch, chunk)."""
        group, pos = divmod(k, p * v)
        chunk = pos // p
        return group * p + pos % p, (v - 1 - chunk) if backward else chunk

    orders = []
    for r in range(p):
        warm = min(total, p - r - 1 if v == 1 else (v - 1) * p + 2 * (p - r - 1))
        order = [F(*kth(k, False)) for k in range(warm)]
        for k in range(total - warm):
            order += [F(*kth(warm + k, False)), B(*kth(k, True))]
        order += [B(*kth(k, True)) for k in range(total - warm, total)]
        orders.append(order)
    return orders
