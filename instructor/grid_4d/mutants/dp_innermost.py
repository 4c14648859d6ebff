"""Mutant: DP innermost (ranks of a DP group consecutive): TP groups would span nodes."""

from __future__ import annotations

import itertools


def rank_groups(dp: int, pp: int, cp: int, tp: int, dim: str) -> list[list[int]]:
    sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
    order = ["dp", "pp", "cp", "tp"]

    def rank(c: dict[str, int]) -> int:
        return ((c["tp"] * cp + c["cp"]) * pp + c["pp"]) * dp + c["dp"]

    others = [d for d in order if d != dim]
    groups = []
    for fixed in itertools.product(*(range(sizes[d]) for d in others)):
        base = dict(zip(others, fixed, strict=True))
        groups.append(sorted(rank({**base, dim: i}) for i in range(sizes[dim])))
    return sorted(groups)
