"""Public tests of grid_4d: the groups of a dp=2, tp=2 grid, then of grids where PP and CP are both above 1
(against the library's ``parallel_lab.distributed.runtime.grid``)."""

from __future__ import annotations

from parallel_lab.grading.harness import Fail, checks, points, require


@points(2)
@checks("the groups of a 2-D grid: TP groups of consecutive ranks, DP groups strided", "write the ranks of "
        "dp=2, tp=2 as a 2 x 2 table: which ranks share a row, which a column?")
def test_dp2_tp2(sub):
    (fn,) = require(sub, "rank_groups")
    for dim, want in (("tp", [[0, 1], [2, 3]]), ("dp", [[0, 2], [1, 3]]), ("pp", [[0], [1], [2], [3]])):
        got = fn(2, 1, 1, 2, dim)
        if got != want:
            raise Fail(f"rank_groups(dp=2, pp=1, cp=1, tp=2, {dim!r}) = {got}, expected {want}")


@points(2)
@checks("the nesting order of all four dimensions, TP innermost, then CP, then PP, DP outermost",
        "with pp=2 and cp=2, are the ranks of a CP group 1 apart or 2 apart? Write a rank's four coordinates "
        "as the digits of a number whose last digit is its TP coordinate")
def test_pp_and_cp_together(sub):
    from parallel_lab.distributed.runtime.grid import all_groups
    from parallel_lab.specs import Plan

    (fn,) = require(sub, "rank_groups")
    for dp, pp, cp, tp in ((1, 2, 2, 1), (2, 2, 3, 1), (1, 3, 2, 2)):
        for dim in ("dp", "pp", "cp", "tp"):
            got, want = fn(dp, pp, cp, tp, dim), sorted(all_groups(Plan(dp=dp, pp=pp, cp=cp, tp=tp), dim))
            if got != want:
                raise Fail(f"rank_groups(dp={dp}, pp={pp}, cp={cp}, tp={tp}, {dim!r}) = {got[:3]}..., expected "
                           f"{want[:3]}...")
