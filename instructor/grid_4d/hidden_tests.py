"""Hidden tests of grid_4d: against the library's grid for many shapes, then groups used on 4 ranks."""

from __future__ import annotations

from parallel_lab.grading.harness import Fail, doing, points, run_ranks
from parallel_lab.specs import Plan

SHAPES = ((2, 2, 2, 2), (1, 2, 1, 4), (4, 1, 2, 1), (2, 3, 1, 2), (3, 1, 1, 1), (1, 1, 4, 2))


@points(3)
def test_groups_equal_library(sub):
    from parallel_lab.distributed.runtime.grid import all_groups

    for dp, pp, cp, tp in SHAPES:
        plan = Plan(dp=dp, pp=pp, cp=cp, tp=tp)
        for dim in ("dp", "pp", "cp", "tp"):
            got = sub.rank_groups(dp, pp, cp, tp, dim)
            want = sorted(all_groups(plan, dim))
            if got != want:
                raise Fail(f"dp={dp} pp={pp} cp={cp} tp={tp}, {dim} groups: {got[:3]}... expected {want[:3]}... "
                           "(rank ids fill arange(world).view(dp, pp, cp, tp), TP innermost)")


def _sums(grid, sub, shape):
    import torch
    import torch.distributed as dist

    out = {}
    for dim in ("dp", "pp", "tp"):
        doing(grid, f"creating the {dim} groups")
        mine = None
        for ranks in sub.rank_groups(*shape, dim):       # every rank creates every group, in the same order
            g = dist.new_group(ranks)
            if grid.rank in ranks:
                mine = g
        t = torch.tensor([float(grid.rank)])
        doing(grid, f"all-reduce in its {dim} group")
        dist.all_reduce(t, group=mine)
        out[dim] = int(t.item())
    return out


@points(3)
def test_groups_on_four_ranks(sub):
    from parallel_lab.distributed.runtime.grid import group_of

    for shape in ((2, 1, 1, 2), (2, 2, 1, 1)):
        plan = Plan(dp=shape[0], pp=shape[1], cp=shape[2], tp=shape[3])
        got = run_ranks(_sums, 4, sub, shape)
        for r, sums in enumerate(got):
            for dim, s in sums.items():
                want = sum(group_of(plan, dim, r))
                if s != want:
                    raise Fail(f"dp={shape[0]} pp={shape[1]} tp={shape[3]}: rank {r}'s all-reduce in its {dim} "
                               f"group summed {s}, the ranks of its {dim} group sum to {want}")
