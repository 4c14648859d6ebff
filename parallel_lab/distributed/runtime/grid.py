"""The 4-D process grid (dp, pp, cp, tp) of a Plan, and the process groups of one rank.

Every rank is a point of ONE tensor ``torch.arange(world).view(dp, pp, cp, tp)`` (docs/conventions.md):
TP innermost (neighbouring ranks, the fastest links), then CP, PP, and DP outermost. A rank's group along
a dimension is the line of that tensor through its point, e.g. its TP group is ``mesh[d, p, c, :]``.
``dp_cp`` (``mesh[:, p, :, t]``) is the gradient-synchronisation group when context parallelism is on
(Megatron synchronises gradients over dp x cp). With expert parallelism, ``ep`` (dp coordinates
``[k ep, (k+1) ep)``) and ``edp`` (those with the same ``d % ep``) are lines inside the dp group
(``parallel_lab.mesh``).

Every rank creates every group of every dimension, in the same order (``torch.distributed.new_group``
is collective over the whole world), and keeps the ones it belongs to; a lone process that stands for one
rank (``measure``) creates only its own. Nodes are runs of ``ranks_per_node``
consecutive ranks (torchrun's ``LOCAL_WORLD_SIZE``): a group spanning two of them talks over the
inter-node links (``parallel_lab.mesh.crosses_nodes``, the rule of the link tiers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from parallel_lab import mesh as grid_rules
from parallel_lab.errors import ParallelLabError
from parallel_lab.specs import Plan

DIMS = grid_rules.GRID_DIMS


def mesh(plan: Plan) -> torch.Tensor:
    """``arange(world).view(dp, pp, cp, tp)``: the global rank at each grid point."""
    return torch.arange(plan.world).view(plan.dp, plan.pp, plan.cp, plan.tp)


def coords(plan: Plan, rank: int) -> dict[str, int]:
    """Grid coordinates ``{"dp", "pp", "cp", "tp"}`` of a global rank (``parallel_lab.mesh.coords``: the one rule)."""
    return grid_rules.coords(plan, rank)


def all_groups(plan: Plan, dim: str) -> list[list[int]]:
    """Every group along ``dim`` (``dp``, ``pp``, ``cp``, ``tp`` or ``dp_cp``), as lists of global ranks,
    in a fixed order (the order every rank creates them in): ``parallel_lab.mesh.all_groups``, the lines of
    :func:`mesh` (a test checks the two agree)."""
    return grid_rules.all_groups(plan, dim)


def group_of(plan: Plan, dim: str, rank: int) -> list[int]:
    """The ranks of ``rank``'s group along ``dim`` (``parallel_lab.mesh.group_of``)."""
    return grid_rules.group_of(plan, dim, rank)


def _index_in(dim: str) -> property:
    """A property: this rank's index in its ``dim`` group, its coordinate along ``dim``."""
    return property(lambda self: self.ranks[dim].index(self.rank), doc=f"This rank's index in its {dim} group.")


@dataclass
class Grid:
    """One rank's place in the grid: coordinates, groups (``ProcessGroup``), and pipeline neighbours.

    Build it with :meth:`create` on every rank after ``init_process_group`` (the launcher does).
    ``groups[dim]`` is this rank's group along ``dim`` (``dp``, ``pp``, ``cp``, ``tp``, ``dp_cp``) and
    ``ranks[dim]`` its members as global ranks. ``pp_prev`` / ``pp_next``: global ranks of the previous and
    next pipeline stage (None at the ends). ``notify(msg)``: send a progress message to the caller of
    ``launch`` (its ``on_progress`` callback); None outside the launcher. ``record(text, waiting)``: tell the
    launcher what this rank is doing now (``waiting``: blocked in a call that needs its peers), which it
    names when the rank dies or hangs (``distributed/runtime/diagnosis.py``); None outside the launcher.
    """

    plan: Plan
    rank: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    groups: dict[str, Any] = field(default_factory=dict)
    ranks: dict[str, list[int]] = field(default_factory=dict)
    notify: Callable[[Any], None] | None = None      # set by the launcher: report progress to the caller
    record: Callable[[str, bool], None] | None = None    # set by the launcher: this rank's current action
    ranks_per_node: int = 0                          # torchrun's LOCAL_WORLD_SIZE; 0: every rank on one node

    @classmethod
    def create(cls, plan: Plan, rank: int, device: torch.device | str = "cpu",
               ranks_per_node: int | None = None, own_groups_only: bool = False) -> Grid:
        """Create all groups (collective: every rank calls this with the same plan). ``ranks_per_node``: the
        ranks one node runs (torchrun's ``LOCAL_WORLD_SIZE``); default all of them. ``own_groups_only``: one
        process stands for one rank of a world that does not run (``measure``'s fake process group), so it
        creates only the groups it is in: O(group sizes), not O(world) (a dp 65,536 plan: 171 s before)."""
        if dist.is_initialized() and dist.get_world_size() != plan.world:
            raise ParallelLabError(
                f"the plan needs dp*pp*cp*tp = {plan.world} ranks but the process group has "
                f"{dist.get_world_size()}; launch with world={plan.world}")
        rpn = plan.world if ranks_per_node is None else ranks_per_node
        if not 0 < rpn <= plan.world or plan.world % rpn:
            raise ParallelLabError(f"ranks_per_node={rpn} (LOCAL_WORLD_SIZE) must divide the world of "
                                   f"{plan.world} ranks; start the same --nproc-per-node on every node")
        grid = cls(plan, rank, torch.device(device), ranks_per_node=rpn)
        for dim in (*DIMS, "dp_cp", *(("ep", "edp") if plan.ep > 1 else ())):
            for ranks in ([group_of(plan, dim, rank)] if own_groups_only else all_groups(plan, dim)):
                pg = None
                if dist.is_initialized():
                    pg = dist.group.WORLD if len(ranks) == plan.world else dist.new_group(ranks)
                if rank in ranks:
                    grid.groups[dim], grid.ranks[dim] = pg, ranks
        return grid

    # ---- coordinates -----------------------------------------------------------------------------
    @property
    def world(self) -> int:
        return self.plan.world

    @property
    def coords(self) -> dict[str, int]:
        return {d: self.ranks[d].index(self.rank) for d in DIMS}

    dp_rank = _index_in("dp")
    pp_rank = _index_in("pp")
    cp_rank = _index_in("cp")
    tp_rank = _index_in("tp")

    @property
    def pp_prev(self) -> int | None:
        i = self.pp_rank
        return self.ranks["pp"][i - 1] if i > 0 else None

    @property
    def pp_next(self) -> int | None:
        i = self.pp_rank
        return self.ranks["pp"][i + 1] if i + 1 < len(self.ranks["pp"]) else None

    def size(self, dim: str) -> int:
        return len(self.ranks[dim])

    # ---- nodes: which groups use the links between machines ----------------------------------------
    @property
    def node(self) -> int:
        return grid_rules.node_of(self.rank, self.ranks_per_node or self.world)

    def crossing(self) -> dict[str, list[int]]:
        """This rank's groups (``dp``, ``pp``, ``cp``, ``tp``, ``dp_cp``) whose ranks lie on several nodes."""
        return {d: r for d, r in self.ranks.items() if grid_rules.crosses_nodes(r, self.ranks_per_node or self.world)}

    # ---- what the tracer needs -------------------------------------------------------------------
    @property
    def grad_group(self) -> str:
        """The grid dimension gradients are synchronised over: ``dp_cp`` when cp > 1, else ``dp``."""
        return "dp_cp" if self.plan.cp > 1 else "dp"

    def groups_by_dim(self) -> dict[str, Any]:
        """Process group per accounting dim of the conventions (``dp`` means dp x cp when cp > 1)."""
        return {"dp": self.groups[self.grad_group], "tp": self.groups["tp"], "tp_vocab": self.groups["tp"],
                "pp": self.groups["pp"], "cp": self.groups["cp"], "ep": self.groups.get("ep")}

    def __repr__(self) -> str:
        c = self.coords
        return (f"Grid(rank={self.rank}/{self.world}, dp={c['dp']}, pp={c['pp']}, cp={c['cp']}, "
                f"tp={c['tp']}, device={self.device})")
