"""Exercise grid_4d (implement): the 4-D process grid and its groups.

A plan with degrees ``dp, pp, cp, tp`` places its ``dp pp cp tp`` ranks on a grid: rank ids fill
``arange(world).view(dp, pp, cp, tp)``, TP innermost, so that the ranks of a TP group are consecutive
(the same node, the fastest links), then CP, then PP, and DP outermost (its all-reduce happens once per
step and tolerates slower links). A *group* along a dimension is the set of ranks whose other three
coordinates are equal.

Implement ``rank_groups(dp, pp, cp, tp, dim)``: every group along ``dim`` (``"dp"``, ``"pp"``, ``"cp"`` or
``"tp"``) as a list of lists of ranks, each increasing, the groups sorted by their first rank. Pure
Python (no torch needed). Graded: the groups equal the library's (``parallel_lab.distributed.runtime.grid``) for
many shapes; then on 4 CPU ranks (dp=2, tp=2, and dp=2, pp=2) every rank creates your groups with
``dist.new_group`` and all-reduces its rank id in its group: the sums must be those of the right groups.
Check: ``parallel-lab grade grid_4d exercises/grid_4d/starter.py``.
"""

from __future__ import annotations


def rank_groups(dp: int, pp: int, cp: int, tp: int, dim: str) -> list[list[int]]:
    # TODO: which rank sits at coordinates (d, p, c, t)? Then vary one coordinate, the others fixed
    raise NotImplementedError("rank_groups")
