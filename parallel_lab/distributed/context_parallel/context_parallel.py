"""Context parallelism: the sequence is split over ``cp`` ranks; attention is the only op that needs the
other ranks' tokens. Three ways to give it them, each an autograd function that replaces the model's
attention core (``block.attn.core``) and computes with the blockwise kernel of ``blockwise_attention.py``:

* **ring** (Liu et al. 2023; ``ring_attention.py``): queries stay; K/V blocks travel around the ring, the
  next block's transfer overlapping the current block's kernel; backward sends K/V forward again with a
  dK/dV accumulator that reaches its owner after ``cp - 1`` hops. Per layer and micro-batch: ``cp - 1``
  K/V messages forward, ``cp - 1`` K/V plus ``cp - 1`` dK/dV backward (one ``(2, b, kv_heads, s, d)`` each).
* **allgather** (Llama 3, Dubey et al. 2024, Sec. 3.3.2; ``allgather_attention.py``): all-gather K and V
  (small with GQA), attend the local queries to all of them; backward reduce-scatters dK and dV.
* **ulysses** (Jacobs et al. 2023; ``ulysses_attention.py``): all-to-all from sequence-sharded to
  head-sharded Q, K, V, ordinary attention over the whole sequence, all-to-all back; ``cp`` must divide the
  query heads, kv heads are repeated where it does not divide them (``sharding.kv_replication``).

Each rank holds the zigzag chunks ``i`` and ``2 cp - 1 - i`` of every sequence (``cp_balance``), with
their true positions and document ids, so masks stay right whichever rank holds a key. Saved for backward
(what ``activations.py`` predicts): the local Q, the (local or gathered) K and V, the output and the fp32
log-sum-exp; no ``(s x s)`` probabilities. Weight gradients are averaged over ``dp x cp`` by the
data-parallel object. Derivations and the measured balance: docs/context_parallel.md.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import Tensor, nn

from parallel_lab import sharding
from parallel_lab.distributed.context_parallel.allgather_attention import AllGatherAttention
from parallel_lab.distributed.context_parallel.blockwise_attention import DEFAULT_TILE, Tokens
from parallel_lab.distributed.context_parallel.cp_balance import BALANCES, WORK_PIECES, rank_indices
from parallel_lab.distributed.context_parallel.ring_attention import CPGroup, RingAttention, SeqView
from parallel_lab.distributed.context_parallel.ulysses_attention import UlyssesAttention
from parallel_lab.distributed.model.data import Batch
from parallel_lab.distributed.model.model import AttnContext, make_context
from parallel_lab.distributed.runtime.runtime import Runtime
from parallel_lab.errors import ParallelLabError
from parallel_lab.sharding import kv_replication
from parallel_lab.specs import CP_KINDS, ModelSpec, Plan

FUNCTIONS = {"ring": RingAttention, "allgather": AllGatherAttention, "ulysses": UlyssesAttention}

# --------------------------------------------------------------------------------------------------
# Plugging into the model
# --------------------------------------------------------------------------------------------------

class ContextParallel:
    """One rank's context parallelism: the kind, the group, which tokens it holds, and the attention core.

    :meth:`shard_micro` cuts a micro-batch into this rank's chunks (tokens, targets, positions, document
    ids) and remembers, for the local positions tensor it creates, the tiles of every rank's block, cut
    from the full sequence's positions and document ids: the core finds them from ``ctx.positions`` (every
    rank knows the whole micro-batch, so the other ranks' positions and documents cost no communication).
    """

    def __init__(self, kind: str, grp: CPGroup, balance: str = "zigzag", tile: int = DEFAULT_TILE):
        if kind not in CP_KINDS:
            raise ParallelLabError(f"cp_kind={kind!r}; pick one of {', '.join(CP_KINDS)}")
        if balance not in BALANCES:
            raise ParallelLabError(f"balance={balance!r}; pick one of {', '.join(BALANCES)}")
        self.kind, self.grp, self.balance, self.tile = kind, grp, balance, tile
        self.n_chunks = 2 * grp.size * (WORK_PIECES if balance == "work" else 1)
        self._full: dict[int, tuple[SeqView, list[Tensor]]] = {}

    def indices(self, seq: int, doc_ids: Tensor | None = None, causal: bool = True) -> list[Tensor]:
        """Every rank's token indices (:func:`rank_indices`; ``work`` balance uses the documents)."""
        docs = None if doc_ids is None else doc_ids.cpu()
        return rank_indices(seq, self.grp.size, self.balance, docs, causal)

    def index(self, seq: int, doc_ids: Tensor | None = None, causal: bool = True) -> Tensor:
        """This rank's token indices."""
        return self.indices(seq, doc_ids, causal)[self.grp.index]

    def _cut(self, positions: Tensor, doc_ids: Tensor | None, causal: bool) -> tuple[Tensor, Tensor | None]:
        """This rank's positions and documents. Remembers, under the local positions tensor (forgotten when
        it is freed), every rank's indices and the tiles of every rank's block: cut here, once per
        micro-batch, from the positions' values (a fake-tensor measurement shards a real batch)."""
        every = [i.to(positions.device) for i in self.indices(len(positions), doc_ids, causal)]
        idx = every[self.grp.index]
        local_pos = positions[idx]
        chunk = len(positions) // self.n_chunks
        blocks = [Tokens.of(positions[i], None if doc_ids is None else doc_ids[:, i], self.tile, chunk)
                  for i in every]
        key = id(local_pos)
        self._full[key] = (SeqView(blocks[self.grp.index], blocks, Tokens.cat(blocks, self.tile, chunk)), every)
        weakref.finalize(local_pos, self._full.pop, key, None)
        return local_pos, None if doc_ids is None else doc_ids[:, idx]

    def shard_micro(self, batch: Batch) -> Batch:
        """This rank's chunks of every sequence of the micro-batch, with their positions and documents
        (the model's attention is causal)."""
        pos, docs = self._cut(batch.positions, batch.doc_ids, causal=True)
        idx = self._full[id(pos)][1][self.grp.index]
        return Batch(batch.tokens[:, idx], batch.targets[:, idx], pos, docs)

    def local_context(self, positions: Tensor, doc_ids: Tensor | None = None,
                      causal: bool = True) -> AttnContext:
        """The attention context of this rank for a full sequence (tests and benchmarks use it)."""
        pos, docs = self._cut(positions, doc_ids, causal)
        return make_context(pos, docs, causal)

    def view(self, ctx: AttnContext) -> SeqView:
        """The tokens of the queries and of every rank's block (cut by :meth:`_cut`; ``ctx.cache``)."""
        key = ("context_parallel", id(self))
        if key not in ctx.cache:
            full = self._full.get(id(ctx.positions))
            if full is None:
                raise ParallelLabError(
                    "the context-parallel attention core got positions that ContextParallel.shard_micro did "
                    "not cut; pass micro-batches through rt.shard_micro (or ContextParallel.local_context)")
            ctx.cache[key] = full[0]
        return ctx.cache[key]


class ContextParallelAttention(nn.Module):
    """The attention core of a context-parallel rank (replaces ``DotProductAttention``)."""

    def __init__(self, cp: ContextParallel):
        super().__init__()
        self.cp = cp

    def forward(self, q: Tensor, k: Tensor, v: Tensor, ctx: AttnContext) -> Tensor:
        fn = FUNCTIONS[self.cp.kind]
        return fn.apply(q, k, v, self.cp.grp, self.cp.view(ctx), ctx.causal)

    def extra_repr(self) -> str:
        return f"kind={self.cp.kind}, cp={self.cp.grp.size}, balance={self.cp.balance}"


def check_cp(spec: ModelSpec, plan: Plan) -> None:
    """Plans the context-parallel cores cannot run (``train.check_runnable`` calls it before any process)."""
    if spec.dropout > 0:
        raise ParallelLabError(f"dropout={spec.dropout}: the context-parallel attention cores do not drop "
                               f"attention probabilities; use a model with dropout=0 for cp > 1")
    if plan.seq % (2 * plan.cp):
        raise ParallelLabError(f"seq={plan.seq} is not divisible by 2*cp={2 * plan.cp}; "
                               f"pick seq a multiple of {2 * plan.cp}")
    if plan.cp_kind == "ulysses":
        kv_replication(spec.heads // plan.tp, sharding.kv_heads_local(spec, plan.tp), plan.cp)


def apply_cp(rt: Runtime) -> None:
    """Context parallelism from the plan: swap every block's attention core, cut micro-batches into this
    rank's chunks (``rt.shard_micro``). Gradients are synchronised over ``dp x cp`` by the data-parallel
    object the composition builds next (``Grid.grad_group``)."""
    plan, grid, model = rt.plan, rt.grid, rt.model
    check_cp(model.spec, plan)
    grp = CPGroup(grid.ranks["cp"], grid.cp_rank, grid.groups["cp"])
    cp = ContextParallel(plan.cp_kind, grp)
    for blk in model.blocks.values():
        blk.attn.core = ContextParallelAttention(cp)
    before = rt.shard_micro
    rt.shard_micro = lambda batch: cp.shard_micro(before(batch))
    rt.extras.setdefault("reports", {})["cp"] = lambda: cp_report(grp)       # -> RankResult.info["cp"]


def cp_report(grp: CPGroup) -> dict[str, Any]:
    """What this rank's attention did over the run: the forward kernel's tile pairs and (query, key) pairs
    computed (whole tiles, masked edges included) and tiles skipped, and seconds computing / blocked waiting
    per phase (``cp_stats.OverlapStats``). Lesson 05 compares the pairs per rank with the ring's tiles."""
    k = grp.stats.kernel
    return {"pairs_computed": k.pairs_computed, "tiles_computed": k.tiles_computed,
            "tiles_skipped": k.tiles_skipped, "compute_s": dict(grp.stats.compute_s),
            "wait_s": dict(grp.stats.wait_s)}
