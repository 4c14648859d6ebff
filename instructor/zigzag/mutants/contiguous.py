"""Mutant: contiguous slices (the unbalanced layout)."""

from __future__ import annotations


def zigzag_indices(seq: int, cp: int, rank: int) -> list[int]:
    c = seq // cp
    return list(range(rank * c, (rank + 1) * c))


def causal_work(indices: list[int]) -> int:
    return sum(i + 1 for i in indices)
