"""Public tests of grid_4d: the groups of a dp=2, tp=2 grid."""

from __future__ import annotations

from parallel_lab.grading.harness import Fail, points, require


@points(2)
def test_dp2_tp2(sub):
    (fn,) = require(sub, "rank_groups")
    for dim, want in (("tp", [[0, 1], [2, 3]]), ("dp", [[0, 2], [1, 3]]), ("pp", [[0], [1], [2], [3]])):
        got = fn(2, 1, 1, 2, dim)
        if got != want:
            raise Fail(f"rank_groups(dp=2, pp=1, cp=1, tp=2, {dim!r}) = {got}, expected {want}")
