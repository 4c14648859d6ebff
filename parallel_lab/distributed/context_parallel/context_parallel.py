"""Context parallelism: the sequence is split over ``cp`` ranks; attention is the only op that needs the
other ranks' tokens. Three ways to give it them, each an autograd function that replaces the model's
attention core (``block.attn.core``) and computes with the blockwise kernel of ``attention.py``:

* **ring** (Liu et al. 2023): queries stay; K/V blocks travel around the ring, the next block's transfer
  overlapping the current block's kernel; backward sends K/V forward again with a dK/dV accumulator that
  reaches its owner after ``cp - 1`` hops. Per layer and micro-batch: ``cp - 1`` K/V messages forward,
  ``cp - 1`` K/V plus ``cp - 1`` dK/dV backward (K and V as one ``(2, b, kv_heads, s, d)`` message).
* **allgather** (Llama 3, Dubey et al. 2024, Sec. 3.3.2): all-gather K and V (small with GQA), attend the
  local queries to all of them while the gather completes; backward reduce-scatters dK and dV.
* **ulysses** (Jacobs et al. 2023): all-to-all from sequence-sharded to head-sharded Q, K, V, ordinary
  attention over the whole sequence, all-to-all back; ``cp`` must divide the query heads, kv heads are
  repeated where it does not divide them (``sharding.kv_replication``).

Each rank holds the zigzag chunks ``i`` and ``2 cp - 1 - i`` of every sequence (``cp_balance``), with
their true positions and document ids, so masks stay right whichever rank holds a key. Saved for backward
(what ``activations.py`` predicts): the local Q, the (local or gathered) K and V, the output and the fp32
log-sum-exp; no ``(s x s)`` probabilities. Weight gradients are averaged over ``dp x cp`` by the
data-parallel object. Derivations and the measured balance: docs/context_parallel.md.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from parallel_lab import sharding
from parallel_lab.distributed import probe
from parallel_lab.distributed.context_parallel import cp_communications as comm
from parallel_lab.distributed.context_parallel.blockwise_attention import (
    DEFAULT_TILE,
    OnlineSoftmax,
    Tokens,
    attend_backward,
    attend_forward,
    group_queries,
    ungroup,
)
from parallel_lab.distributed.context_parallel.cp_balance import BALANCES, WORK_PIECES, rank_indices
from parallel_lab.distributed.context_parallel.cp_stats import OverlapStats, Timer
from parallel_lab.distributed.model.data import Batch
from parallel_lab.distributed.model.model import AttnContext, make_context, repeat_kv
from parallel_lab.distributed.runtime.runtime import Runtime
from parallel_lab.errors import ParallelLabError
from parallel_lab.sharding import kv_replication
from parallel_lab.specs import CP_KINDS, ModelSpec, Plan

# --------------------------------------------------------------------------------------------------
# The context-parallel group: communication, and time spent computing / waiting
# --------------------------------------------------------------------------------------------------

class CPGroup:
    """This rank's context-parallel group: its members (global ranks), its index, the process group.

    ``overlap=False`` waits for each transfer before computing (to measure what overlap saves).
    """

    def __init__(self, ranks: Sequence[int], index: int, group: Any = None, overlap: bool = True):
        self.ranks, self.index, self.group = list(ranks), index, group
        self.overlap = overlap
        self.stats = OverlapStats()

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def next(self) -> int:
        return self.ranks[(self.index + 1) % self.size]

    @property
    def prev(self) -> int:
        return self.ranks[(self.index - 1) % self.size]

    def exchange(self, send: Tensor, recv: Tensor) -> list[comm.Transfer]:
        """Send ``send`` to the next rank of the ring and receive ``recv`` from the previous one."""
        return comm.exchange(send, recv, self.next, self.prev, self.group)

    def wait(self, works: Sequence[comm.Transfer], phase: str) -> None:
        """Wait for the transfers (each once), timing the wait."""
        t0 = time.perf_counter()
        for w in works:
            w.wait()
        self.stats.wait_s[phase] += time.perf_counter() - t0

    def timed(self, phase: str) -> Timer:
        return Timer(self.stats.compute_s, phase)



@dataclass
class SeqView:
    """The tokens attention sees on one rank: its queries, each rank's block, and all of them in rank
    order (the order of an all-gather or all-to-all)."""

    local: Tokens
    blocks: list[Tokens]
    all: Tokens



# --------------------------------------------------------------------------------------------------
# The three autograd functions
# --------------------------------------------------------------------------------------------------

class RingAttention(torch.autograd.Function):
    """Ring attention; inputs ``q (b, H, s, d)``, ``k, v (b, Hkv, s, d)`` of the local tokens."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, grp: CPGroup, seq: SeqView,
                causal: bool) -> Tensor:
        b, h, s, d = q.shape
        g = k.shape[1]
        qg = group_queries(q, g, 1.0 / math.sqrt(d))
        kv_local = torch.stack([k, v])                             # (2, b, g, s, d): one message
        state = OnlineSoftmax(b, g, s, h // g, d, q.device)
        kv, n = kv_local, grp.size
        for t in range(n):
            src = (grp.index - t) % n
            works, nxt = [], None
            if t < n - 1:                                          # pass the block on while computing
                nxt = torch.empty_like(kv)
                probe.sample("cp", [None if kv is kv_local else kv, nxt])  # kv_local: saved
                works = grp.exchange(kv, nxt)
                if not grp.overlap:
                    grp.wait(works, "forward")
            with grp.timed("forward"):
                attend_forward(state, qg, kv[0], kv[1], seq.local, seq.blocks[src], causal, grp.stats.kernel)
            if nxt is not None:
                grp.wait(works, "forward")
                kv = nxt
        acc, lse = state.finish()
        out = ungroup(acc.to(q.dtype))
        ctx.save_for_backward(qg, kv_local, out, lse)
        ctx.grp, ctx.seq, ctx.causal = grp, seq, causal
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        qg, kv_local, out, lse = ctx.saved_tensors
        grp, seq, causal = ctx.grp, ctx.seq, ctx.causal
        b, g, s, r, d = qg.shape
        dog = group_queries(dout, g, 1.0)
        delta = (dog.float() * group_queries(out, g, 1.0).float()).sum(-1)
        dqg = torch.zeros_like(qg)
        n = grp.size
        kv, own, acc_in, acc_works = kv_local, None, None, []
        for t in range(n):
            src = (grp.index - t) % n
            works, nxt = [], None
            if t < n - 1:                                          # K, V travel the ring again
                nxt = torch.empty_like(kv)
                probe.sample("cp", [None if kv is kv_local else kv, nxt, acc_in])
                works = grp.exchange(kv, nxt)
                if not grp.overlap:
                    grp.wait(works, "backward")
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            with grp.timed("backward"):
                attend_backward(qg, kv[0], kv[1], dog, lse, delta, seq.local, seq.blocks[src], causal,
                                dqg, dkv[0], dkv[1])
            if t == 0:
                own = dkv                                          # my block's own part stays home
            else:                                                  # block src's accumulator: add, hand on
                grp.wait(acc_works, "backward")                    # (from step 2 on it came from prev)
                acc_works = []                                     # done transfers still hold their tensors
                if acc_in is not None:
                    dkv += acc_in
                    acc_in = None
                # a precision choice: the accumulator travels in the compute dtype (half of fp32's bytes,
                # what comm counts), so in bf16 each hop rounds the partial sum; an fp32 accumulator on the
                # wire would be exact to fp32 and send twice the bytes
                dkv = dkv.to(kv.dtype)
                acc_in = torch.empty_like(dkv)                     # the last step receives my own block's
                probe.sample("cp", [None if kv is kv_local else kv, nxt, dkv, acc_in])
                acc_works = grp.exchange(dkv, acc_in)
                if not grp.overlap:
                    grp.wait(acc_works, "backward")
            if nxt is not None:
                grp.wait(works, "backward")
                kv = nxt
        grp.wait(acc_works, "backward")
        dkv = own if acc_in is None else own + acc_in
        dq = ungroup(dqg * (1.0 / math.sqrt(d))).to(qg.dtype)
        return dq, dkv[0].to(kv_local.dtype), dkv[1].to(kv_local.dtype), None, None, None


class AllGatherAttention(torch.autograd.Function):
    """All-gather context parallelism (Llama 3); inputs as :class:`RingAttention`."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, grp: CPGroup, seq: SeqView,
                causal: bool) -> Tensor:
        b, h, s, d = q.shape
        g, n = k.shape[1], grp.size
        qg = group_queries(q, g, 1.0 / math.sqrt(d))
        kv_local = torch.stack([k, v])
        gathered = torch.empty((n, *kv_local.shape), dtype=kv_local.dtype, device=kv_local.device)
        probe.sample("cp", [kv_local])          # the input; the gathered K, V are saved (activations)
        work = comm.all_gather(gathered.flatten(0, 1), kv_local, grp.group)
        if not grp.overlap:
            grp.wait([work], "forward")
        state = OnlineSoftmax(b, g, s, h // g, d, q.device)
        with grp.timed("forward"):                                 # my own block while the others arrive
            attend_forward(state, qg, kv_local[0], kv_local[1], seq.local, seq.blocks[grp.index], causal,
                           grp.stats.kernel)
        grp.wait([work], "forward")
        with grp.timed("forward"):
            for j in range(n):
                if j != grp.index:
                    attend_forward(state, qg, gathered[j, 0], gathered[j, 1], seq.local, seq.blocks[j],
                                   causal, grp.stats.kernel)
        acc, lse = state.finish()
        out = ungroup(acc.to(q.dtype))
        ctx.save_for_backward(qg, gathered, out, lse)
        ctx.grp, ctx.seq, ctx.causal = grp, seq, causal
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        qg, gathered, out, lse = ctx.saved_tensors
        grp, seq, causal = ctx.grp, ctx.seq, ctx.causal
        d = qg.shape[-1]
        dog = group_queries(dout, qg.shape[1], 1.0)
        delta = (dog.float() * group_queries(out, qg.shape[1], 1.0).float()).sum(-1)
        dqg = torch.zeros_like(qg)
        dkv_all = torch.zeros(gathered.shape, dtype=torch.float32, device=gathered.device)
        with grp.timed("backward"):
            for j in range(grp.size):
                attend_backward(qg, gathered[j, 0], gathered[j, 1], dog, lse, delta, seq.local, seq.blocks[j],
                                causal, dqg, dkv_all[j, 0], dkv_all[j, 1])
        dkv_all = dkv_all.to(gathered.dtype)
        dkv = torch.empty(gathered.shape[1:], dtype=gathered.dtype, device=gathered.device)
        probe.sample("cp", [dkv_all, dkv])      # every rank's dK, dV and this rank's sum
        work = comm.reduce_scatter(dkv, dkv_all.flatten(0, 1), grp.group)
        dq = ungroup(dqg * (1.0 / math.sqrt(d))).to(qg.dtype)     # while dK, dV are reduced
        grp.wait([work], "backward")
        return dq, dkv[0].to(gathered.dtype), dkv[1].to(gathered.dtype), None, None, None


class UlyssesAttention(torch.autograd.Function):
    """DeepSpeed-Ulysses: all-to-all to head-sharded, attention over the whole sequence, all-to-all back."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, grp: CPGroup, seq: SeqView,
                causal: bool) -> Tensor:
        b, h, s, d = q.shape
        n, g0 = grp.size, k.shape[1]
        f = kv_replication(h, g0, n)
        k, v = repeat_kv(k, f), repeat_kv(v, f)
        hq, hk = h // n, g0 * f // n
        # to head-sharded: destination j gets query heads j*hq.., key/value heads j*hk.. of my tokens
        send = torch.empty(n, b, hq + 2 * hk, s, d, dtype=q.dtype, device=q.device)
        send[:, :, :hq] = q.reshape(b, n, hq, s, d).transpose(0, 1)
        send[:, :, hq:hq + hk] = k.reshape(b, n, hk, s, d).transpose(0, 1)
        send[:, :, hq + hk:] = v.reshape(b, n, hk, s, d).transpose(0, 1)
        recv = torch.empty_like(send)
        probe.sample("cp", [send, recv])
        grp.wait([comm.all_to_all(recv, send, grp.group)], "forward")
        del send
        S, r = n * s, hq // hk                       # recv[i]: my heads for rank i's tokens
        qg = torch.empty(b, hk, S, r, d, dtype=q.dtype, device=q.device)
        torch.mul(recv[:, :, :hq].reshape(n, b, hk, r, s, d).permute(1, 2, 0, 4, 3, 5),
                  1.0 / math.sqrt(d), out=qg.view(b, hk, n, s, r, d))
        kvh = recv[:, :, hq:].reshape(n, b, 2, hk, s, d).permute(2, 1, 3, 0, 4, 5).reshape(2, b, hk, S, d)
        del recv                                                   # qg and kvh are copies
        state = OnlineSoftmax(b, hk, S, r, d, q.device)
        with grp.timed("forward"):
            attend_forward(state, qg, kvh[0], kvh[1], seq.all, seq.all, causal, grp.stats.kernel)
        acc, lse = state.finish()
        out_h = acc.to(q.dtype)                                    # (b, hk, S, r, d)
        back = out_h.view(b, hk, n, s, r, d).permute(2, 0, 1, 4, 3, 5).reshape(n, b, hq, s, d)
        back = back.contiguous()
        got = torch.empty_like(back)                               # got[j]: head group j of my tokens
        probe.sample("cp", [back, got])
        grp.wait([comm.all_to_all(got, back, grp.group)], "forward")
        ctx.save_for_backward(qg, kvh, out_h, lse)
        ctx.grp, ctx.seq, ctx.causal, ctx.f = grp, seq, causal, f
        return got.transpose(0, 1).reshape(b, h, s, d)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        qg, kvh, out_h, lse = ctx.saved_tensors
        grp, seq, causal, f = ctx.grp, ctx.seq, ctx.causal, ctx.f
        b, hk, S, r, d = qg.shape
        n = grp.size
        s, hq = S // n, hk * r
        h = hq * n
        send = dout.reshape(b, n, hq, s, d).transpose(0, 1).contiguous()
        recv = torch.empty_like(send)
        probe.sample("cp", [send, recv])
        grp.wait([comm.all_to_all(recv, send, grp.group)], "backward")
        dog = recv.reshape(n, b, hk, r, s, d).permute(1, 2, 0, 4, 3, 5).reshape(b, hk, S, r, d)
        del send, recv                                             # dog is a copy
        delta = (dog.float() * out_h.float()).sum(-1)
        dqg = torch.zeros_like(qg)
        dkv = torch.zeros(kvh.shape, dtype=torch.float32, device=kvh.device)
        with grp.timed("backward"):
            attend_backward(qg, kvh[0], kvh[1], dog, lse, delta, seq.all, seq.all, causal, dqg, dkv[0],
                            dkv[1])
        back = torch.empty(n, b, hq + 2 * hk, s, d, dtype=qg.dtype, device=qg.device)
        back[:, :, :hq] = (dqg * (1.0 / math.sqrt(d))).view(b, hk, n, s, r, d).permute(2, 0, 1, 4, 3, 5) \
            .reshape(n, b, hq, s, d)
        back[:, :, hq:] = dkv.to(qg.dtype).view(2, b, hk, n, s, d).permute(3, 1, 0, 2, 4, 5) \
            .reshape(n, b, 2 * hk, s, d)
        got = torch.empty_like(back)                               # got[j]: head group j of my tokens
        probe.sample("cp", [back, got])
        grp.wait([comm.all_to_all(got, back, grp.group)], "backward")
        dq = got[:, :, :hq].transpose(0, 1).reshape(b, h, s, d)
        dk = got[:, :, hq:hq + hk].transpose(0, 1).reshape(b, n * hk, s, d)
        dv = got[:, :, hq + hk:].transpose(0, 1).reshape(b, n * hk, s, d)
        if f > 1:                                                  # sum over the replicas of a kv head
            dk = dk.view(b, -1, f, s, d).sum(2)
            dv = dv.view(b, -1, f, s, d).sum(2)
        return dq, dk, dv, None, None, None


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
