"""Pipeline stages: which blocks each pipeline rank holds, and the model cut down to them.

The ``L`` blocks are cut into ``V = p * v`` contiguous chunks (``sharding.chunk_layers``; the first ``L % V``
chunks get one block more). Chunk ``c`` of pipeline rank ``r`` is virtual stage ``s = c * p + r``
(Narayanan et al. 2021, interleaved placement) or, on a V (ZB-V, DualPipeV), ``r`` and ``2p - 1 - r``
(``schedules.Placement``). Virtual stage 0 also holds the embedding, stage ``V - 1`` the final norm, the
head and the loss; a rank keeps only its pieces. Derivation: ``docs/pipeline.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from parallel_lab.errors import ParallelLabError
from parallel_lab.schedules.actions import Placement
from parallel_lab.sharding import chunk_layers
from parallel_lab.specs import ModelSpec, Plan


@dataclass(frozen=True)
class StageLayout:
    """Pipeline rank ``rank`` of ``p``: ``v`` chunks; chunk ``c`` is virtual stage
    ``placement.stage(rank, c)`` (``c*p + rank`` interleaved; ``rank`` and ``2p-1-rank`` on a V)."""

    rank: int
    p: int
    v: int
    chunks: tuple[tuple[int, ...], ...]        # block ids of each local chunk, in model order
    placement: Placement | None = None         # None: Megatron's interleaved placement

    @property
    def place(self) -> Placement:
        return self.placement or Placement.interleaved(self.p, self.v)

    def virtual(self, chunk: int) -> int:
        return self.place.stage(self.rank, chunk)

    @property
    def n_virtual(self) -> int:
        return self.p * self.v

    def is_first(self, chunk: int) -> bool:
        return self.virtual(chunk) == 0

    def is_last(self, chunk: int) -> bool:
        return self.virtual(chunk) == self.n_virtual - 1

    def local_neighbour(self, chunk: int, step: int) -> int | None:
        """The local chunk holding virtual stage ``virtual(chunk) + step`` when it is on this rank too."""
        nb = self.place.neighbour(self.rank, chunk, step)
        return nb[1] if nb is not None and nb[0] == self.rank else None

    @property
    def has_embedding(self) -> bool:
        return self.place.holder(0)[0] == self.rank

    @property
    def has_head(self) -> bool:
        return self.place.holder(self.n_virtual - 1)[0] == self.rank

    @property
    def layers(self) -> list[int]:
        return [i for ids in self.chunks for i in ids]

    def describe(self) -> str:
        parts = [f"chunk {c} (virtual stage {self.virtual(c)}): blocks {list(ids)}"
                 for c, ids in enumerate(self.chunks)]
        if self.has_embedding:
            parts.insert(0, "embedding")
        if self.has_head:
            parts.append("final norm + head + loss")
        return f"pipeline rank {self.rank}: " + "; ".join(parts)


def stage_layout(spec: ModelSpec, plan: Plan, rank: int, placement: Placement | None = None) -> StageLayout:
    """The chunks of pipeline rank ``rank`` (``sharding.chunk_layers``: contiguous, uneven allowed), placed by
    ``placement`` (default: interleaved with ``plan.interleave`` chunks)."""
    if not 0 <= rank < plan.pp:
        raise ParallelLabError(f"pipeline rank {rank} is not in 0..{plan.pp - 1}")
    place = placement or Placement.interleaved(plan.pp, plan.interleave)
    if place.p != plan.pp:
        raise ParallelLabError(f"the schedule's placement has {place.p} ranks but pp={plan.pp}; build the "
                               f"schedule for p={plan.pp}")
    cut = chunk_layers(spec.layers, plan.pp, place.v, plan.pp_split)
    chunks = tuple(tuple(cut[place.stage(rank, c)]) for c in range(place.v))
    return StageLayout(rank, plan.pp, place.v, chunks, placement)


def layers_per_stage(spec: ModelSpec, plan: Plan) -> list[int]:
    """Blocks held by each pipeline rank (all its chunks); uneven when ``p * v`` does not divide ``L``."""
    return [len(stage_layout(spec, plan, r).layers) for r in range(plan.pp)]


def keep_stage(model: nn.Module, layout: StageLayout) -> nn.Module:
    """Delete the pieces of ``model`` (a ``distributed.model.model.Transformer``) that ``layout`` does not hold."""
    keep = {str(i) for i in layout.layers}
    for name in [n for n in model.blocks if n not in keep]:
        del model.blocks[name]
    if not layout.has_embedding:
        model.tok_emb = None
        model.pos_emb = None
    if not layout.has_head:
        model.final_norm = None
        model.lm_head = None
        model.has_head = False
    return model
