"""The action data of a pipeline schedule: ``F``, ``B``, ``W`` and ``P2P`` batches, the chunk placement, ``Schedule``.

A schedule is one action list per pipeline rank. ``F(mb, c)`` / ``B(mb, c)`` run micro-batch ``mb``'s
forward / backward through local chunk ``c``; ``W(mb, c)`` is the weight-gradient half of a split backward
(ZB-H1's W pass: with a ``W`` on the rank, ``B`` computes only the input gradient). ``P2P(ops)`` posts a batch
of ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B`` ops together (Megatron's ``send_forward_recv_backward``,
torch's ``batch_isend_irecv``). Chunk ``c`` of rank ``r`` is virtual stage ``s = c p + r`` of ``V = p v``
(Megatron's interleaved placement, Narayanan et al. 2021), or, on a V (ZB-V, DualPipeV), rank ``r`` holds
stages ``r`` and ``2 p - 1 - r``: a :class:`Placement` table that every rule about neighbours reads.
The full semantics (what each op sends, when a batch completes): ``docs/schedules.md``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from ..errors import ParallelLabError

ActionKind = Literal["F", "B", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "P2P"]

COMPUTE_KINDS: tuple[str, ...] = ("F", "B", "W")
P2P_OP_KINDS: tuple[str, ...] = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


@dataclass(frozen=True)
class Action:
    """One step of a rank's list: a compute action, a point-to-point op, or a ``P2P`` batch of ops."""

    kind: ActionKind
    microbatch: int = -1
    chunk: int = 0
    peer: int | None = None
    ops: tuple[Action, ...] = ()

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_send(self) -> bool:
        return self.kind in ("SEND_F", "SEND_B")

    def __str__(self) -> str:
        if self.kind == "P2P":
            return "P2P[" + ", ".join(str(o) for o in self.ops) + "]"
        s = f"{self.kind}(mb={self.microbatch}, chunk={self.chunk}"
        if self.peer is not None:
            s += f", peer={self.peer}"
        return s + ")"


@dataclass(frozen=True)
class Placement:
    """Which virtual stage each model chunk of each rank holds: ``stages[rank][chunk]``.

    Chunks of a rank are numbered in model order (chunk 0 holds the rank's earliest layers). Two
    placements are generated: Megatron's *interleaved* one (``stages[r][c] = c p + r``; ``v = 1`` is the
    plain pipeline) and the *V* one of ZB-V and DualPipeV (Qi et al. 2024, section 6): ``v = 2`` and rank
    ``r`` holds virtual stages ``r`` and ``2 p - 1 - r``, so rank 0 holds the embedding and the head and
    the turn from stage ``p - 1`` to stage ``p`` stays on rank ``p - 1`` (no message). A learner's schedule
    may bring any other table; every rule about neighbours and peers is read off this table.
    """

    stages: tuple[tuple[int, ...], ...]
    name: str = "custom"

    def __post_init__(self) -> None:
        if not self.stages or any(len(row) != len(self.stages[0]) or not row for row in self.stages):
            raise ParallelLabError(f"placement {self.stages}: every rank must hold the same number (>= 1) of "
                                   "chunks; e.g. ((0, 3), (1, 2)) for two ranks in a V")
        flat = sorted(s for row in self.stages for s in row)
        if flat != list(range(len(flat))):
            raise ParallelLabError(f"placement {self.stages}: the virtual stages held must be 0..{len(flat) - 1}, "
                                   "each exactly once")
        if any(list(row) != sorted(row) for row in self.stages):
            raise ParallelLabError(f"placement {self.stages}: a rank's chunks are numbered in model order; "
                                   f"write each rank's stages in increasing order")

    @classmethod
    def interleaved(cls, p: int, v: int = 1) -> Placement:
        """Megatron's placement: chunk ``c`` of rank ``r`` is virtual stage ``c p + r``."""
        return cls(tuple(tuple(c * p + r for c in range(v)) for r in range(p)),
                   "interleaved" if v > 1 else "contiguous")

    @classmethod
    def v_shape(cls, p: int) -> Placement:
        """ZB-V's and DualPipeV's placement: rank ``r`` holds virtual stages ``r`` and ``2 p - 1 - r``."""
        return cls(tuple((r, 2 * p - 1 - r) for r in range(p)), "v")

    @classmethod
    def from_stage_ranks(cls, rank_of: dict[int, int]) -> Placement:
        """The placement that puts virtual stage ``s`` on rank ``rank_of[s]`` (what a CSV file implies)."""
        p = 1 + max(rank_of.values(), default=-1)
        rows = tuple(tuple(sorted(s for s, r in rank_of.items() if r == rank)) for rank in range(p))
        made = cls(rows)
        for known in (cls.interleaved(p, made.v), cls.v_shape(p)):
            if known.stages == rows:
                return known
        return made

    @property
    def p(self) -> int:
        return len(self.stages)

    @property
    def v(self) -> int:
        return len(self.stages[0])

    @property
    def n_stages(self) -> int:
        return self.p * self.v

    def stage(self, rank: int, chunk: int) -> int:
        """The virtual stage of ``chunk`` on ``rank``."""
        return self.stages[rank][chunk]

    def holder(self, stage: int) -> tuple[int, int]:
        """``(rank, chunk)`` that holds virtual stage ``stage``."""
        for r, row in enumerate(self.stages):
            if stage in row:
                return r, row.index(stage)
        raise ParallelLabError(f"virtual stage {stage} is not in 0..{self.n_stages - 1}")

    def neighbour(self, rank: int, chunk: int, step: int) -> tuple[int, int] | None:
        """``(rank, chunk)`` of the virtual stage ``step`` (+1: next, -1: previous) away, None past an end."""
        s = self.stage(rank, chunk) + step
        return self.holder(s) if 0 <= s < self.n_stages else None


class Schedule(list):
    """One action list per pipeline rank (a ``list[list[Action]]``), with the :class:`Placement` of the
    chunks it names (None: the interleaved placement, inferred from the chunks used) and, per rank, the
    (F, B) pairs that run overlapped (DualPipe's F&B: one group, their messages posted together)."""

    def __init__(self, ranks: Iterable[Iterable[Action]] = (), placement: Placement | None = None,
                 overlapped: Iterable[Iterable[tuple[Action, Action]]] | None = None):
        super().__init__(list(r) for r in ranks)
        self.placement = placement
        self.overlapped: list[set[tuple[Action, Action]]] = (
            [set(x) for x in overlapped] if overlapped is not None else [set() for _ in self])


def placement_of(schedule: list[list[Action]]) -> Placement:
    """The schedule's placement: its own, or the interleaved one for the chunks its actions use."""
    own = getattr(schedule, "placement", None)
    if own is not None:
        return own
    v = 1 + max((a.chunk for acts in schedule for a in acts if a.is_compute), default=0)
    return Placement.interleaved(max(len(schedule), 1), v)


def F(mb: int, chunk: int = 0) -> Action:
    return Action("F", mb, chunk)


def B(mb: int, chunk: int = 0) -> Action:
    return Action("B", mb, chunk)


def W(mb: int, chunk: int = 0) -> Action:
    return Action("W", mb, chunk)


def P2P(*ops: Action) -> Action:
    """A batch of point-to-point ops, posted together and waited for together."""
    return Action("P2P", ops=tuple(ops))


def virtual_stage(rank: int, chunk: int, p: int, placement: Placement | None = None) -> int:
    """The virtual stage of ``chunk`` on pipeline rank ``rank``: ``placement.stage(rank, chunk)``; without a
    placement Megatron's ``chunk * p + rank``."""
    if placement is not None:
        return placement.stage(rank, chunk)
    return chunk * p + rank


def num_chunks(schedule: list[list[Action]]) -> int:
    """``v``: model chunks per rank (the placement's; else 1 + the largest chunk index used)."""
    return placement_of(schedule).v


def num_microbatches(schedule: Schedule) -> int:
    return 1 + max((a.microbatch for acts in schedule for a in acts if a.is_compute), default=-1)


def where(rank: int, idx: int, a: Action) -> str:
    """Where action ``a`` sits, for error messages: ``rank r, action i <a>``."""
    return f"rank {rank}, action {idx} {a}"
