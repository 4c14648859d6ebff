"""The 4-D grid: groups are the lines of arange(world).view(dp, pp, cp, tp)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from parallel_lab.distributed.runtime.grid import Grid, all_groups, coords, group_of, mesh
from parallel_lab.distributed.runtime.launch import launch
from parallel_lab.specs import Plan


def test_dp2_tp2_groups():
    p = Plan(dp=2, tp=2)
    assert all_groups(p, "tp") == [[0, 1], [2, 3]]
    assert all_groups(p, "dp") == [[0, 2], [1, 3]]
    assert all_groups(p, "pp") == [[0], [1], [2], [3]]
    assert coords(p, 3) == {"dp": 1, "pp": 0, "cp": 0, "tp": 1}


def test_pp2_cp2_groups_and_dp_cp():
    p = Plan(pp=2, cp=2)
    assert all_groups(p, "cp") == [[0, 1], [2, 3]]
    assert all_groups(p, "pp") == [[0, 2], [1, 3]]
    assert all_groups(p, "dp_cp") == [[0, 1], [2, 3]]
    p = Plan(dp=2, cp=2)
    assert all_groups(p, "dp_cp") == [[0, 1, 2, 3]]
    assert all_groups(p, "dp") == [[0, 2], [1, 3]]


@pytest.mark.parametrize("shape", [(2, 2, 2, 2), (1, 4, 1, 2), (3, 1, 2, 1)])
def test_every_group_is_a_line_of_the_mesh(shape):
    dp, pp, cp, tp = shape
    p = Plan(dp=dp, pp=pp, cp=cp, tp=tp)
    m = torch.arange(p.world).view(dp, pp, cp, tp)
    assert torch.equal(mesh(p), m)
    for r in range(p.world):
        c = coords(p, r)
        assert int(m[c["dp"], c["pp"], c["cp"], c["tp"]]) == r
        assert group_of(p, "tp", r) == m[c["dp"], c["pp"], c["cp"], :].tolist()
        assert group_of(p, "cp", r) == m[c["dp"], c["pp"], :, c["tp"]].tolist()
        assert group_of(p, "pp", r) == m[c["dp"], :, c["cp"], c["tp"]].tolist()
        assert group_of(p, "dp", r) == m[:, c["pp"], c["cp"], c["tp"]].tolist()
        assert group_of(p, "dp_cp", r) == m[:, c["pp"], :, c["tp"]].flatten().tolist()
    for axis, dim in enumerate(("dp", "pp", "cp", "tp")):   # mesh.py's groups, in the mesh's line order
        assert all_groups(p, dim) == m.movedim(axis, -1).reshape(-1, shape[axis]).tolist()
    assert all_groups(p, "dp_cp") == m.permute(1, 3, 0, 2).reshape(pp * tp, dp * cp).tolist()
    for dim in ("dp", "pp", "cp", "tp"):             # each dim's groups partition the world
        assert sorted(r for g in all_groups(p, dim) for r in g) == list(range(p.world))


def _sum_over_groups(grid):
    out = {}
    for dim in ("dp", "pp", "cp", "tp", "dp_cp"):
        t = torch.tensor([float(grid.rank)])
        dist.all_reduce(t, group=grid.groups[dim])
        out[dim] = (t.item(), grid.ranks[dim])
    return out, grid.pp_prev, grid.pp_next, grid.coords


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("plan", [Plan(dp=2, tp=2), Plan(pp=2, cp=2)], ids=["dp2tp2", "pp2cp2"])
def test_process_groups_reduce_over_their_members(plan):
    for rank, (sums, prev, nxt, c) in enumerate(launch(_sum_over_groups, plan, timeout_s=60)):
        for dim, (total, ranks) in sums.items():
            assert ranks == group_of(plan, dim, rank)
            assert total == sum(ranks)
        pp_ranks = group_of(plan, "pp", rank)
        i = pp_ranks.index(rank)
        assert prev == (pp_ranks[i - 1] if i else None)
        assert nxt == (pp_ranks[i + 1] if i + 1 < len(pp_ranks) else None)
        assert c == coords(plan, rank)


@pytest.mark.parametrize("plan", [Plan(dp=2, pp=2, cp=2, tp=2), Plan(dp=6, pp=2, ep=3), Plan(dp=4, cp=2, ep=2),
                                  Plan(dp=3, cp=2, tp=2)], ids=["2222", "dp6-ep3", "dp4-cp2-ep2", "dp3-cp2-tp2"])
def test_a_ranks_own_groups_are_its_lines_of_all_groups(plan):
    """``group_of`` (from the coordinates) is the one line of ``all_groups`` holding the rank, in its order;
    a grid built with only its own groups (measure's lone fake rank) has the same members as a full one."""
    dims = ("dp", "pp", "cp", "tp", "dp_cp", *(("ep", "edp") if plan.ep > 1 else ()))
    for r in range(plan.world):
        for dim in dims:
            assert [g for g in all_groups(plan, dim) if r in g] == [group_of(plan, dim, r)], (dim, r)
        full, own = Grid.create(plan, r), Grid.create(plan, r, own_groups_only=True)
        assert own.ranks == full.ranks and set(own.ranks) == set(dims)
