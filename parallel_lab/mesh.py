"""The process grid: ranks, their coordinates, the groups along each dimension, nodes and link tiers.

The 4-D grid: ``arange(world).view(dp, pp, cp, tp)`` (TP innermost, DP outermost, as Megatron and
torchtitan place them). Expert parallelism borrows its ranks from data parallelism: data-parallel coordinate
``d`` has expert rank ``d % ep``, the expert-data-parallel group ``edp`` the ranks with the same ``d % ep``
(docs/moe.md). Nodes are runs of ``gpus_per_node`` consecutive ranks (torchrun's numbering), so a group is on
one node exactly when its lowest and highest ranks are (:func:`tier_of`). docs/conventions.md is the contract.
What each rank holds of the model is :mod:`parallel_lab.sharding`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from .errors import ParallelLabError

if TYPE_CHECKING:                                   # annotations only
    from .hardware import ClusterSpec, LinkTier
    from .specs import Plan


GRID_DIMS = ("dp", "pp", "cp", "tp")


class GridShape(NamedTuple):
    """The degrees that place ranks (a Plan has the same attributes; the planner uses this light form)."""

    dp: int
    pp: int
    cp: int
    tp: int
    interleave: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.cp * self.tp


def rank_of(plan: Plan, dp: int = 0, pp: int = 0, cp: int = 0, tp: int = 0) -> int:
    """Global rank of grid coordinates in the placement ``arange(world).view(dp, pp, cp, tp)``."""
    return ((dp * plan.pp + pp) * plan.cp + cp) * plan.tp + tp


def coords(plan: Plan, rank: int) -> dict[str, int]:
    """Grid coordinates ``{"dp", "pp", "cp", "tp"}`` of a global rank."""
    if not 0 <= rank < plan.world:
        raise ParallelLabError(f"rank={rank} is outside the world of {plan.world} ranks of this plan")
    rest, tp = divmod(rank, plan.tp)
    rest, cp = divmod(rest, plan.cp)
    dp, pp = divmod(rest, plan.pp)
    return {"dp": dp, "pp": pp, "cp": cp, "tp": tp}


def all_groups(plan: Plan, dim: str) -> list[list[int]]:
    """Every group along ``dim`` (``dp``, ``pp``, ``cp``, ``tp``, or ``dp_cp``: the gradient group with context
    parallelism) as lists of global ranks: the lines of ``arange(world).view(dp, pp, cp, tp)`` along that
    axis, in the order every rank creates them (``mesh.movedim(axis, -1).reshape(-1, size)``)."""
    sizes = {"dp": plan.dp, "pp": plan.pp, "cp": plan.cp, "tp": plan.tp}
    if dim in ("ep", "edp"):                       # expert parallelism, borrowed from dp (module docstring)
        blocks = [g for g in all_groups(plan, "dp")]
        if dim == "ep":
            return [g[i:i + plan.ep] for g in blocks for i in range(0, plan.dp, plan.ep)]
        return [g[j::plan.ep] for g in blocks for j in range(plan.ep)]
    if dim == "dp_cp":
        return [group_of(plan, dim, rank_of(plan, 0, p, 0, t)) for p in range(plan.pp) for t in range(plan.tp)]
    if dim not in sizes:
        raise ParallelLabError(f"dim {dim!r} is not a grid dimension; pick dp, pp, cp, tp, dp_cp, ep or edp")
    others = [d for d in GRID_DIMS if d != dim]
    groups = []
    for a in range(sizes[others[0]]):
        for b in range(sizes[others[1]]):
            for c in range(sizes[others[2]]):        # each line's first rank; group_of spells the line
                groups.append(group_of(plan, dim, rank_of(plan, **dict(zip(others, (a, b, c), strict=True)))))
    return groups


def group_of(plan: Plan, dim: str, rank: int) -> list[int]:
    """The members of ``rank``'s group along ``dim``: its line of :func:`all_groups`, in the same order,
    found from its coordinates in O(group size) (all_groups lists the whole world's)."""
    c = coords(plan, rank)
    sizes = {"dp": plan.dp, "pp": plan.pp, "cp": plan.cp, "tp": plan.tp}
    if dim in ("ep", "edp"):                       # lines inside the dp group (module docstring)
        line, d = group_of(plan, "dp", rank), c["dp"]
        return line[d - d % plan.ep:d - d % plan.ep + plan.ep] if dim == "ep" else line[d % plan.ep::plan.ep]
    if dim == "dp_cp":
        return [rank_of(plan, d, c["pp"], j, c["tp"]) for d in range(plan.dp) for j in range(plan.cp)]
    if dim not in sizes:
        raise ParallelLabError(f"dim {dim!r} is not a grid dimension; pick dp, pp, cp, tp, dp_cp, ep or edp")
    return [rank_of(plan, **{**c, dim: i}) for i in range(sizes[dim])]


def pp_neighbours(plan: Plan, stage: int) -> list[int]:
    """This stage and the stages it exchanges activations with (interleaving wraps around)."""
    if plan.interleave > 1:
        return sorted({stage, (stage - 1) % plan.pp, (stage + 1) % plan.pp})
    return [s for s in (stage - 1, stage, stage + 1) if 0 <= s < plan.pp]


def group_ranks(plan: Plan, dim: str, stage: int = 0) -> list[int]:
    """The ranks of the ``dim`` group that contains grid point ``(dp=0, pp=stage, cp=0, tp=0)``.

    ``dp``: the ``dp x cp`` gradient group; ``tp``/``tp_vocab``: the TP group; ``cp``: the CP group;
    ``pp``: this stage and its pipeline neighbours; ``ep``: the expert-parallel group (dp coordinates 0..ep-1).
    """
    first = rank_of(plan, 0, stage, 0, 0)
    if dim in ("ep", "cp"):
        return group_of(plan, dim, first)
    if dim == "dp":
        return group_of(plan, "dp_cp", first)
    if dim in ("tp", "tp_vocab"):
        return group_of(plan, "tp", first)
    if dim == "pp":
        return [rank_of(plan, 0, s, 0, 0) for s in pp_neighbours(plan, stage)]
    raise ParallelLabError(f"dim {dim!r} is not known; pick one of dp, tp, tp_vocab, pp, cp, ep")


def group_span(plan: Plan, dim: str, stage: int = 0) -> tuple[int, int]:
    """Lowest and highest rank of :func:`group_ranks` (ranks increase along every grid dim), in O(1)."""
    if dim == "ep":
        return rank_of(plan, 0, stage, 0, 0), rank_of(plan, plan.ep - 1, stage, 0, 0)
    if dim == "dp":
        return rank_of(plan, 0, stage, 0, 0), rank_of(plan, plan.dp - 1, stage, plan.cp - 1, 0)
    if dim in ("tp", "tp_vocab"):
        return rank_of(plan, 0, stage, 0, 0), rank_of(plan, 0, stage, 0, plan.tp - 1)
    if dim == "cp":
        return rank_of(plan, 0, stage, 0, 0), rank_of(plan, 0, stage, plan.cp - 1, 0)
    if dim == "pp":
        near = pp_neighbours(plan, stage)
        return rank_of(plan, 0, near[0], 0, 0), rank_of(plan, 0, near[-1], 0, 0)
    raise ParallelLabError(f"dim {dim!r} is not known; pick one of dp, tp, tp_vocab, pp, cp, ep")


def node_of(rank: int, ranks_per_node: int) -> int:
    """The node of a global rank: nodes are runs of ``ranks_per_node`` consecutive ranks (torchrun numbers the
    ranks ``RANK = GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK``, the group rank being the agent's place in the
    rendezvous)."""
    return rank // ranks_per_node


def node_count(world: int, ranks_per_node: int) -> int:
    """Nodes a world of ``world`` ranks occupies: the last rank's node plus one (the last node may be partly
    filled), ``ceil(world / ranks_per_node)``."""
    if world < 1:
        raise ParallelLabError(f"node_count(world={world}): a world has at least one rank; pass world >= 1")
    return node_of(world - 1, ranks_per_node) + 1


def crosses_nodes(ranks: list[int], ranks_per_node: int) -> bool:
    """Whether a group's ranks lie on more than one node (its collectives use the inter-node links)."""
    return node_of(min(ranks), ranks_per_node) != node_of(max(ranks), ranks_per_node)


def crossing_groups(plan: Plan, dim: str, ranks_per_node: int) -> list[list[int]]:
    """The groups along ``dim`` (:func:`all_groups`) that cross a node boundary."""
    return [g for g in all_groups(plan, dim) if crosses_nodes(g, ranks_per_node)]


def same_node(cluster: ClusterSpec, lo: int, hi: int) -> bool:
    """Whether ranks ``lo..hi`` share a node (nodes are runs of ``gpus_per_node`` consecutive ranks)."""
    return not crosses_nodes([lo, hi], cluster.gpus_per_node)


def tier_of(cluster: ClusterSpec, ranks: list[int]) -> LinkTier:
    """``intra`` when all ranks share one node, else ``inter``."""
    return cluster.intra if same_node(cluster, min(ranks), max(ranks)) else cluster.inter


def group_tier(cluster: ClusterSpec, plan: Plan, dim: str, stage: int = 0) -> LinkTier:
    """The link tier the ``dim`` group of ``stage`` lands on (what :func:`tier_of` says of its ranks)."""
    return cluster.intra if same_node(cluster, *group_span(plan, dim, stage)) else cluster.inter


def ep_coords(plan: Plan, rank: int) -> dict[str, int]:
    """``{"ep": d % ep, "edp": d // ep}`` for the data-parallel coordinate ``d`` of ``rank``."""
    d = coords(plan, rank)["dp"]
    return {"ep": d % plan.ep, "edp": d // plan.ep}
