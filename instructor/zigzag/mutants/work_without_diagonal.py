"""Mutant: counts keys 0..i-1 (forgets that a query attends to itself)."""

from __future__ import annotations


def zigzag_indices(seq: int, cp: int, rank: int) -> list[int]:
    c = seq // (2 * cp)
    first, second = rank, 2 * cp - 1 - rank
    return list(range(first * c, (first + 1) * c)) + list(range(second * c, (second + 1) * c))


def causal_work(indices: list[int]) -> int:
    return sum(i for i in indices)
