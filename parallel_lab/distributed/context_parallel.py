"""Context parallelism: the sequence is split over ``cp`` ranks, and attention is the only op that needs
the other ranks' tokens. Three ways to give it them, each a custom autograd function that replaces the
model's attention core (``block.attn.core``):

* **ring** (Liu et al. 2023, "Ring Attention with Blockwise Transformers"): every rank keeps its queries;
  the key/value blocks travel around the ring of the ``cp`` ranks. At ring step ``t`` rank ``r`` holds
  the block of rank ``r - t`` and sends it on to ``r + 1`` while it computes with it (asynchronous
  send/receive: the transfer of the next block overlaps the computation on the current one). Partial
  results are merged exactly with the online softmax (Milakov & Gimelshein 2018; the running maximum ``m``,
  sum ``l`` and output accumulator of FlashAttention, Dao et al. 2022)::

        m' = max(m, rowmax(S)),  l' = l e^(m - m') + rowsum(e^(S - m')),
        acc' = acc e^(m - m') + e^(S - m') V,        out = acc / l,  lse = m + log l

  Backward runs the ring again: the key/value blocks travel forward once more, and beside them an
  accumulator of the block's key/value gradients, started by the first rank that is not the block's
  owner and handed on ``cp - 1`` hops until it reaches home, where the owner adds its own part.
  Per layer and micro-batch one rank sends ``cp - 1`` K/V blocks forward, and ``cp - 1`` K/V blocks plus
  ``cp - 1`` dK/dV accumulators backward; K and V travel together as one ``(2, b, kv_heads, s, d)``
  message (fewer messages: latency, not bandwidth, dominates small blocks).
* **allgather** (Llama 3, Dubey et al. 2024, Sec. 3.3.2): all-gather K and V of every rank (small with
  grouped-query attention), then compute the local queries against all of them; backward reduce-scatters
  dK and dV. The gather is asynchronous: the rank attends to its own block while the others arrive.
  Llama 3 chose this form because any mask (document masks) is easy in it.
* **ulysses** (Jacobs et al. 2023, DeepSpeed-Ulysses): one all-to-all turns Q, K, V from
  sequence-sharded (all heads, ``s/cp`` tokens) to head-sharded (``heads/cp`` heads, the whole sequence),
  ordinary attention runs on the whole sequence, and a second all-to-all brings the output back; backward
  does the same with the gradients. It needs ``cp`` to divide the query heads. Key/value heads that ``cp``
  does not divide (tiny-llama: 2 kv heads, cp = 4) are **replicated** ``cp / gcd(kv_heads, cp)`` times
  before the all-to-all (the extra bytes are counted), so every rank gets the key/value heads its query
  heads use; their gradients are summed back.

Load balance (Llama 3): with a causal mask the last tokens attend to the most keys, so contiguous
slices give the last rank ``2 cp - 1`` times the work of the first. :meth:`ContextParallel.shard_micro`
cuts each sequence into ``2 cp`` chunks and gives rank ``i`` the chunks ``i`` and ``2 cp - 1 - i``
("zigzag"), so every rank does the same attention work (:func:`work_per_rank` counts it: query/key pairs
a mask allows, the figure that matters, not tokens). Positions stay those of the full sequence (RoPE or
learned positions are right for the chunks a rank holds) and document ids (packed sequences) travel with
them: every rank knows the document of every token, so a query attends only within its own document,
whichever rank holds the key. Document masks break the zigzag's perfect balance (a rank whose chunks fall
in short documents has less work); :func:`work_per_rank` measures how much, and ``balance="work"``
(:func:`rank_indices`) deals ``4 cp`` smaller chunks by their attention work under the micro-batch's
documents instead: on a packed batch of 4 x 1024 tokens over 4 ranks the busiest rank's work falls from
1.27 to 1.03 times the mean (tests/distributed/test_context_parallel.py). :func:`apply_cp` uses the zigzag, the
scheme Llama 3 describes (the plan has no field for the choice).

All three compute with the same blockwise kernel (:func:`attend_forward`, :func:`attend_backward`): the
sequence is cut into tiles at chunk boundaries (at most ``tile`` tokens), a tile pair that the mask
fully hides is skipped, a fully visible one needs no mask, and only tiles on a mask's edge build one. So a
rank's time follows its attention work, and one rank running the kernel over the whole sequence is the
fair single-process reference (bench/bench_cp.py).

Saved for backward (what ``activations.py`` predicts for ``cp > 1``): ring: the local Q (scaled, grouped
by key/value head), the local K and V stacked, the output (the same storage as the ``wo`` input, so not
counted twice) and the fp32 log-sum-exp ``(b, heads, s)``; allgather: the same with the gathered K and V
(``cp`` times larger) instead of the local ones; ulysses: Q, K and V of its heads over the whole sequence,
the head-sharded output and its log-sum-exp. No ``(s x s)`` probabilities are kept.

Gradients of the weights are averaged over ``dp x cp`` by the data-parallel object (``Grid.grad_group``
is ``dp_cp`` when ``cp > 1``): every rank's loss is the mean over its ``b s / cp`` tokens, so the average
over the ``cp`` ranks is the mean over the whole sequence.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from parallel_lab.distributed.instruments import CommTracer, TracedWork
from parallel_lab.distributed.model import AttnContext, Batch, make_context, repeat_kv
from parallel_lab.specs import CP_KINDS, ParallelLabError

NEG_INF = float("-inf")
#: Largest tile (tokens) of the blockwise kernel; tiles never cross a chunk boundary.
DEFAULT_TILE = 256
BALANCES = ("zigzag", "contiguous", "work")
#: ``balance="work"`` deals ``2 * cp * WORK_PIECES`` chunks by attention work.
WORK_PIECES = 2


# --------------------------------------------------------------------------------------------------
# Which tokens a rank holds (load balance)
# --------------------------------------------------------------------------------------------------

def _chunks(seq: int, n: int, members: Sequence[int]) -> Tensor:
    c = seq // n
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in members])


def rank_indices(seq: int, cp: int, balance: str = "zigzag", doc_ids: Tensor | None = None,
                 causal: bool = True, pieces: int = WORK_PIECES) -> list[Tensor]:
    """For each of the ``cp`` ranks, the indices into the full sequence of the ``seq / cp`` tokens it holds,
    in local order (increasing position).

    ``zigzag`` (Llama 3): of ``2 cp`` equal chunks, rank ``i`` holds chunks ``i`` and ``2 cp - 1 - i``.
    ``contiguous``: the ``i``-th of ``cp`` equal slices (unbalanced under a causal mask).
    ``work``: ``2 cp pieces`` equal chunks dealt by attention work, largest first, each to the rank with
    the least work so far that still has room (every rank gets as many tokens). The work of a chunk is
    the (query, key) pairs its queries may attend, with the documents ``doc_ids (b, seq)`` of the
    micro-batch. Without documents and with ``pieces=1`` this deals exactly the zigzag; with documents it
    keeps the work balanced where the zigzag does not (a rank's chunks may fall in short documents).
    """
    if balance not in BALANCES:
        raise ParallelLabError(f"balance={balance!r}; pick one of {', '.join(BALANCES)}")
    n = 2 * cp * (pieces if balance == "work" else 1)
    if seq % n:
        raise ParallelLabError(f"seq={seq} is not divisible by {n} (balance={balance!r} cuts the sequence "
                               f"into {n} chunks); pick seq a multiple of {n}")
    if balance == "contiguous":
        return [_chunks(seq, cp, [r]) for r in range(cp)]
    if balance == "zigzag":
        return [_chunks(seq, n, [r, n - 1 - r]) for r in range(cp)]
    pos, c = torch.arange(seq), seq // n
    docs = [None if doc_ids is None else doc_ids[:, i * c:(i + 1) * c] for i in range(n)]
    work = [allowed_pairs(pos[i * c:(i + 1) * c], pos, docs[i], doc_ids, causal) for i in range(n)]
    load, members = [0] * cp, [[] for _ in range(cp)]
    for i in sorted(range(n), key=lambda i: (-work[i], i)):
        r = min((r for r in range(cp) if len(members[r]) < n // cp), key=lambda r: (load[r], r))
        members[r].append(i)
        load[r] += work[i]
    return [_chunks(seq, n, sorted(m)) for m in members]


def rank_index(seq: int, cp: int, rank: int, balance: str = "zigzag") -> Tensor:
    """The indices of rank ``rank`` for a layout that does not depend on documents (zigzag, contiguous)."""
    if balance == "work":
        raise ParallelLabError("balance='work' depends on the documents of the micro-batch; use rank_indices")
    return rank_indices(seq, cp, balance)[rank]


def allowed_pairs(q_pos: Tensor, k_pos: Tensor, q_doc: Tensor | None = None, k_doc: Tensor | None = None,
                  causal: bool = True) -> int:
    """Number of (query, key) pairs the mask allows, summed over the batch: the attention work.

    ``q_pos (s_q,)``, ``k_pos (s_k,)``; ``q_doc (b, s_q)``, ``k_doc (b, s_k)`` or None.
    """
    ok = torch.ones(1, len(q_pos), len(k_pos), dtype=torch.bool)
    if causal:
        ok = ok & (q_pos[:, None] >= k_pos[None, :])[None]
    if q_doc is not None:
        ok = ok & (q_doc[:, :, None] == k_doc[:, None, :])
    return int(ok.sum())


def work_per_rank(seq: int, cp: int, balance: str = "zigzag", doc_ids: Tensor | None = None,
                  causal: bool = True) -> list[int]:
    """Attention work (allowed query/key pairs, all rows of the batch) of each of ``cp`` ranks.

    Each rank's queries attend to the keys of the whole sequence; ``doc_ids (b, seq)`` adds document masks.
    With a causal mask and no documents, ``zigzag`` gives every rank exactly the same count.
    """
    pos = torch.arange(seq)
    out = []
    for idx in rank_indices(seq, cp, balance, doc_ids, causal):
        q_doc = None if doc_ids is None else doc_ids[:, idx]
        out.append(allowed_pairs(pos[idx], pos, q_doc, doc_ids, causal))
    return out


def kv_replication(heads: int, kv_heads: int, cp: int) -> int:
    """How many times Ulysses repeats each key/value head so that ``cp`` divides them, consistently with
    the query heads: ``cp / gcd(kv_heads, cp)`` (1 when ``cp`` divides ``kv_heads``).

    Rank ``j`` gets query heads ``[j H/cp, (j+1) H/cp)`` and repeated key/value heads
    ``[j H'/cp, (j+1) H'/cp)`` with ``H' = kv_heads * f``; ``cp | H`` makes ``f`` divide ``H / kv_heads``,
    so each query head still finds its key/value head on its own rank.
    """
    if heads % cp:
        ok = [c for c in range(1, heads + 1) if heads % c == 0]
        raise ParallelLabError(
            f"Ulysses puts heads={heads} query heads (on this tensor-parallel rank) on cp={cp} ranks; "
            f"cp must divide them: pick cp in {{{', '.join(map(str, ok))}}} or cp_kind='ring' / 'allgather'")
    return cp // math.gcd(kv_heads, cp)


# --------------------------------------------------------------------------------------------------
# Token runs and tiles: what the mask of a block looks like, without building it
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tile:
    """Tokens ``[start, stop)`` of a run of consecutive positions ``pmin..pmax``; per batch row the
    smallest and largest document id (None without documents)."""

    start: int
    stop: int
    pmin: int
    pmax: int
    dmin: tuple[int, ...] | None
    dmax: tuple[int, ...] | None


@dataclass
class Tokens:
    """Positions ``(s,)`` and document ids ``(b, s)`` (or None) of some tokens, cut into tiles."""

    positions: Tensor
    doc_ids: Tensor | None
    tiles: list[Tile]

    @classmethod
    def of(cls, positions: Tensor, doc_ids: Tensor | None, tile: int, chunk: int | None = None) -> Tokens:
        """Tiles of at most ``tile`` tokens that never cross a multiple of ``chunk`` (the load-balancing
        chunks: two adjacent chunks on one rank stay two tiles, so ranks cut the same tiles) or a jump
        in the positions."""
        pos = positions.tolist()
        docs = None if doc_ids is None else doc_ids.cpu()
        chunk = chunk or len(pos)
        tiles, start = [], 0
        for i in range(1, len(pos) + 1):
            if i == len(pos) or pos[i] != pos[i - 1] + 1 or i - start == tile or i % chunk == 0:
                dmin = dmax = None
                if docs is not None:
                    dmin = tuple(docs[:, start:i].min(1).values.tolist())
                    dmax = tuple(docs[:, start:i].max(1).values.tolist())
                tiles.append(Tile(start, i, pos[start], pos[i - 1], dmin, dmax))
                start = i
        return cls(positions, doc_ids, tiles)

    @classmethod
    def cat(cls, parts: Sequence[Tokens], tile: int, chunk: int | None = None) -> Tokens:
        docs = None if parts[0].doc_ids is None else torch.cat([p.doc_ids for p in parts], dim=1)
        return cls.of(torch.cat([p.positions for p in parts]), docs, tile, chunk)

    def __len__(self) -> int:
        return len(self.positions)


def tile_mask(q: Tokens, qt: Tile, k: Tokens, kt: Tile, causal: bool) -> Tensor | bool | None:
    """The additive mask of one (query tile, key tile) pair, shaped ``(b or 1, 1, tq, 1, tk)`` (0 or -inf);
    ``False``: the mask hides every pair (skip the tile); ``None``: it hides none (no mask needed)."""
    partial = False
    if causal:
        if qt.pmax < kt.pmin:
            return False
        partial = qt.pmin < kt.pmax
    if q.doc_ids is not None:
        rows = range(len(qt.dmin))
        if all(qt.dmax[i] < kt.dmin[i] or kt.dmax[i] < qt.dmin[i] for i in rows):
            return False
        partial = partial or not all(qt.dmin[i] == qt.dmax[i] == kt.dmin[i] == kt.dmax[i] for i in rows)
    if not partial:
        return None
    qp, kp = q.positions[qt.start:qt.stop], k.positions[kt.start:kt.stop]
    ok = torch.ones(1, len(qp), len(kp), dtype=torch.bool, device=qp.device)
    if causal:
        ok = ok & (qp[:, None] >= kp[None, :])[None]
    if q.doc_ids is not None:
        ok = ok & (q.doc_ids[:, qt.start:qt.stop, None] == k.doc_ids[:, None, kt.start:kt.stop])
    if not bool(ok.any()):
        return False
    bias = torch.zeros(ok.shape, dtype=torch.float32, device=ok.device).masked_fill_(~ok, NEG_INF)
    return bias[:, None, :, None, :]


# --------------------------------------------------------------------------------------------------
# The blockwise kernel (one process): online softmax forward, recomputing backward
# --------------------------------------------------------------------------------------------------
# Layouts: queries are grouped by key/value head, ``qg (b, g, s, r, d)`` with ``g`` key/value heads and
# ``r = heads / g`` query heads per key/value head (grouped-query attention without repeating K and V):
# a query tile ``qg[:, :, a:z]`` reshapes to ``(b, g, tq * r, d)`` without a copy and multiplies the
# key tile ``(b, g, tk, d)`` directly. ``qg`` is pre-scaled by ``1 / sqrt(d)``.

def group_queries(q: Tensor, g: int, scale: float) -> Tensor:
    """``q (b, heads, s, d)`` -> ``scale * q`` as a contiguous ``(b, g, s, heads / g, d)``."""
    b, h, s, d = q.shape
    out = torch.empty(b, g, s, h // g, d, dtype=q.dtype, device=q.device)
    torch.mul(q.reshape(b, g, h // g, s, d).transpose(2, 3), scale, out=out)
    return out


def ungroup(xg: Tensor) -> Tensor:
    """``(b, g, s, r, d)`` -> ``(b, g r, s, d)`` as a view of a ``(b, s, g r, d)`` tensor (one copy)."""
    b, g, s, r, d = xg.shape
    out = torch.empty(b, s, g, r, d, dtype=xg.dtype, device=xg.device)
    out.copy_(xg.transpose(1, 2))
    return out.view(b, s, g * r, d).transpose(1, 2)


class OnlineSoftmax:
    """Running maximum ``m``, sum ``l`` and output accumulator of the queries ``qg``; fp32."""

    def __init__(self, b: int, g: int, s: int, r: int, d: int, device: torch.device):
        self.acc = torch.zeros(b, g, s, r, d, dtype=torch.float32, device=device)
        self.m = torch.full((b, g, s, r), NEG_INF, dtype=torch.float32, device=device)
        self.l = torch.zeros(b, g, s, r, dtype=torch.float32, device=device)

    def update(self, a: int, z: int, scores: Tensor, v: Tensor) -> None:
        """Fold in the scores ``(b, g, tq, r, tk)`` of queries ``a:z`` against values ``v (b, g, tk, d)``."""
        m_old = self.m[:, :, a:z]
        m_new = torch.maximum(m_old, scores.amax(-1))
        ref = m_new.masked_fill(m_new == NEG_INF, 0.0)         # rows with nothing visible yet: avoid inf-inf
        p = scores.sub_(ref[..., None]).exp_()                  # in place: the caller's scores are scratch
        alpha = torch.exp(m_old - ref)
        b, g, tq, r, tk = p.shape
        self.l[:, :, a:z].mul_(alpha).add_(p.sum(-1))
        pv = torch.matmul(p.view(b, g, tq * r, tk), v.to(p.dtype)).view(b, g, tq, r, -1)
        self.acc[:, :, a:z].mul_(alpha[..., None]).add_(pv)
        self.m[:, :, a:z] = m_new

    def finish(self) -> tuple[Tensor, Tensor]:
        """``out = acc / l`` (in place, 0 for a query that sees nothing) and ``lse = m + log l``."""
        lse = self.m + torch.log(self.l)
        self.acc /= self.l.masked_fill(self.l == 0, 1.0)[..., None]
        return self.acc, lse


@dataclass
class KernelStats:
    """What the kernel did on this rank: tile pairs computed / skipped, query-key pairs computed."""

    tiles_computed: int = 0
    tiles_skipped: int = 0
    pairs_computed: int = 0

    def add(self, other: KernelStats) -> None:
        self.tiles_computed += other.tiles_computed
        self.tiles_skipped += other.tiles_skipped
        self.pairs_computed += other.pairs_computed


def attend_forward(state: OnlineSoftmax, qg: Tensor, k: Tensor, v: Tensor, q: Tokens, kv: Tokens,
                   causal: bool, stats: KernelStats | None = None) -> None:
    """Fold the key/value block ``k, v (b, g, s_k, d)`` (tokens ``kv``) into ``state`` for queries ``q``."""
    b, g, _, r, d = qg.shape
    for qt in q.tiles:
        q_t = qg[:, :, qt.start:qt.stop].reshape(b, g, -1, d)
        for kt in kv.tiles:
            mask = tile_mask(q, qt, kv, kt, causal)
            if mask is False:
                if stats is not None:
                    stats.tiles_skipped += 1
                continue
            k_t = k[:, :, kt.start:kt.stop]
            scores = torch.matmul(q_t, k_t.transpose(-1, -2)).view(b, g, qt.stop - qt.start, r, -1)
            scores = scores.float()
            if mask is not None:
                scores.add_(mask)
            state.update(qt.start, qt.stop, scores, v[:, :, kt.start:kt.stop])
            if stats is not None:
                stats.tiles_computed += 1
                stats.pairs_computed += b * (qt.stop - qt.start) * (kt.stop - kt.start)


def attend_backward(qg: Tensor, k: Tensor, v: Tensor, dog: Tensor, lse: Tensor, delta: Tensor, q: Tokens,
                    kv: Tokens, causal: bool, dqg: Tensor, dk: Tensor, dv: Tensor) -> None:
    """Add this key/value block's part of the gradients (FlashAttention's backward, recomputing ``P``).

    ``dog``: output gradient grouped like ``qg``; ``lse``, ``delta = rowsum(dO * O)``: ``(b, g, s, r)``.
    ``dqg`` (like ``qg``) receives the gradient of the *scaled* queries; ``dk, dv (b, g, s_k, d)`` fp32.
    """
    b, g, _, r, d = qg.shape
    lse = lse.masked_fill(lse == NEG_INF, float("inf"))          # a query that sees nothing: P = 0
    for qt in q.tiles:
        a, z = qt.start, qt.stop
        q_t = qg[:, :, a:z].reshape(b, g, -1, d)
        do_t = dog[:, :, a:z].reshape(b, g, -1, d)
        dq_t = dqg[:, :, a:z].view(b, g, -1, d)
        lse_t, delta_t = lse[:, :, a:z, :, None], delta[:, :, a:z, :, None]
        for kt in kv.tiles:
            mask = tile_mask(q, qt, kv, kt, causal)
            if mask is False:
                continue
            k_t, v_t = k[:, :, kt.start:kt.stop], v[:, :, kt.start:kt.stop]
            scores = torch.matmul(q_t, k_t.transpose(-1, -2)).view(b, g, z - a, r, -1).float()
            if mask is not None:
                scores.add_(mask)
            p = scores.sub_(lse_t).exp_()                                        # (b, g, tq, r, tk)
            dp = torch.matmul(do_t, v_t.transpose(-1, -2)).view(p.shape).float()
            ds = dp.sub_(delta_t).mul_(p).view(b, g, (z - a) * r, -1)          # P * (dP - delta)
            p = p.view(ds.shape)
            dv[:, :, kt.start:kt.stop] += torch.matmul(p.transpose(-1, -2), do_t.float())
            dk[:, :, kt.start:kt.stop] += torch.matmul(ds.transpose(-1, -2), q_t.float())
            dq_t += torch.matmul(ds, k_t.float()).to(dq_t.dtype)


def local_attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, doc_ids: Tensor | None = None,
                    causal: bool = True, tile: int = DEFAULT_TILE) -> Tensor:
    """Single-process attention with the blockwise kernel (forward only): the reference of the benchmark.

    ``q (b, heads, s, d)``, ``k, v (b, kv_heads, s, d)``; returns ``(b, heads, s, d)``.
    """
    toks = Tokens.of(positions, doc_ids, tile)
    b, h, s, d = q.shape
    g = k.shape[1]
    qg = group_queries(q, g, 1.0 / math.sqrt(d))
    state = OnlineSoftmax(b, g, s, h // g, d, q.device)
    attend_forward(state, qg, k, v, toks, toks, causal)
    return ungroup(state.finish()[0].to(q.dtype))


# --------------------------------------------------------------------------------------------------
# The context-parallel group: communication, and time spent computing / waiting
# --------------------------------------------------------------------------------------------------

@dataclass
class OverlapStats:
    """Seconds spent in the kernel (``compute``) and blocked waiting for communication (``wait``) per
    phase. With overlap, ``wait`` is the part of the communication the computation did not hide (and any
    time the peer was slower); without, it is the whole transfer. (gloo's works do not report completion
    before ``wait``, so the time blocked is what can be measured.)"""

    compute_s: dict[str, float] = field(default_factory=lambda: {"forward": 0.0, "backward": 0.0})
    wait_s: dict[str, float] = field(default_factory=lambda: {"forward": 0.0, "backward": 0.0})
    kernel: KernelStats = field(default_factory=KernelStats)

    def reset(self) -> None:
        self.__init__()


class CPGroup:
    """This rank's context-parallel group: its members (global ranks), its index, the tracer.

    ``overlap=False`` waits for each transfer before computing (to measure what overlap saves).
    """

    def __init__(self, tracer: CommTracer, ranks: Sequence[int], index: int, group: Any = None,
                 overlap: bool = True):
        self.tracer, self.ranks, self.index, self.group = tracer, list(ranks), index, group
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

    def exchange(self, send: Tensor, recv: Tensor) -> list[TracedWork]:
        """Send ``send`` to the next rank of the ring and receive ``recv`` from the previous one (posted
        together, so that NCCL does not deadlock on a blocking pair)."""
        return self.tracer.batch_isend_irecv([("send", send, self.next), ("recv", recv, self.prev)], "cp",
                                             group=self.group)

    def wait(self, works: Sequence[TracedWork], phase: str) -> None:
        """Wait for the transfers (each once: waiting twice on a gloo receive blocks until the next one)."""
        t0 = time.perf_counter()
        for w in works:
            if not getattr(w, "waited", False):
                w.wait()
                w.waited = True
        self.stats.wait_s[phase] += time.perf_counter() - t0

    def timed(self, phase: str) -> _Timer:
        return _Timer(self.stats.compute_s, phase)


class _Timer:
    def __init__(self, into: dict[str, float], key: str):
        self.into, self.key = into, key

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.into[self.key] += time.perf_counter() - self.t0


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
                if acc_in is not None:
                    dkv += acc_in
                dkv = dkv.to(kv.dtype)
                acc_in = torch.empty_like(dkv)                     # the last step receives my own block's
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
        work = grp.tracer.all_gather(gathered.flatten(0, 1), kv_local, "cp", group=grp.group, async_op=True)
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
        work = grp.tracer.reduce_scatter(dkv, dkv_all.flatten(0, 1), "cp", group=grp.group, async_op=True)
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
        grp.wait([grp.tracer.all_to_all(recv, send, "cp", group=grp.group, async_op=True)], "forward")
        S, r = n * s, hq // hk                       # recv[i]: my heads for rank i's tokens
        qg = torch.empty(b, hk, S, r, d, dtype=q.dtype, device=q.device)
        torch.mul(recv[:, :, :hq].reshape(n, b, hk, r, s, d).permute(1, 2, 0, 4, 3, 5),
                  1.0 / math.sqrt(d), out=qg.view(b, hk, n, s, r, d))
        kvh = recv[:, :, hq:].reshape(n, b, 2, hk, s, d).permute(2, 1, 3, 0, 4, 5).reshape(2, b, hk, S, d)
        state = OnlineSoftmax(b, hk, S, r, d, q.device)
        with grp.timed("forward"):
            attend_forward(state, qg, kvh[0], kvh[1], seq.all, seq.all, causal, grp.stats.kernel)
        acc, lse = state.finish()
        out_h = acc.to(q.dtype)                                    # (b, hk, S, r, d)
        back = out_h.view(b, hk, n, s, r, d).permute(2, 0, 1, 4, 3, 5).reshape(n, b, hq, s, d)
        back = back.contiguous()
        got = torch.empty_like(back)                               # got[j]: head group j of my tokens
        grp.wait([grp.tracer.all_to_all(got, back, "cp", group=grp.group, async_op=True)], "forward")
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
        grp.wait([grp.tracer.all_to_all(recv, send, "cp", group=grp.group, async_op=True)], "backward")
        dog = recv.reshape(n, b, hk, r, s, d).permute(1, 2, 0, 4, 3, 5).reshape(b, hk, S, r, d)
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
        grp.wait([grp.tracer.all_to_all(got, back, "cp", group=grp.group, async_op=True)], "backward")
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
    ids) and remembers, for the local positions tensor it creates, the full sequence's positions and
    document ids: the core finds them from ``ctx.positions`` (every rank knows the whole micro-batch, so
    the other ranks' positions and documents cost no communication).
    """

    def __init__(self, kind: str, grp: CPGroup, balance: str = "zigzag", tile: int = DEFAULT_TILE):
        if kind not in CP_KINDS:
            raise ParallelLabError(f"cp_kind={kind!r}; pick one of {', '.join(CP_KINDS)}")
        if balance not in BALANCES:
            raise ParallelLabError(f"balance={balance!r}; pick one of {', '.join(BALANCES)}")
        self.kind, self.grp, self.balance, self.tile = kind, grp, balance, tile
        self.n_chunks = 2 * grp.size * (WORK_PIECES if balance == "work" else 1)
        self._full: dict[int, tuple[Tensor, Tensor | None, list[Tensor]]] = {}

    def indices(self, seq: int, doc_ids: Tensor | None = None, causal: bool = True) -> list[Tensor]:
        """Every rank's token indices (:func:`rank_indices`; ``work`` balance uses the documents)."""
        docs = None if doc_ids is None else doc_ids.cpu()
        return rank_indices(seq, self.grp.size, self.balance, docs, causal)

    def index(self, seq: int, doc_ids: Tensor | None = None, causal: bool = True) -> Tensor:
        """This rank's token indices."""
        return self.indices(seq, doc_ids, causal)[self.grp.index]

    def _cut(self, positions: Tensor, doc_ids: Tensor | None, causal: bool) -> tuple[Tensor, Tensor | None]:
        """This rank's positions and documents; remembers the full ones and every rank's indices for the
        core, under the local positions tensor (forgotten when it is freed)."""
        every = [i.to(positions.device) for i in self.indices(len(positions), doc_ids, causal)]
        idx = every[self.grp.index]
        local_pos = positions[idx]
        key = id(local_pos)
        self._full[key] = (positions, doc_ids, every)
        weakref.finalize(local_pos, self._full.pop, key, None)
        return local_pos, None if doc_ids is None else doc_ids[:, idx]

    def shard_micro(self, batch: Batch) -> Batch:
        """This rank's chunks of every sequence of the micro-batch, with their positions and documents
        (the model's attention is causal)."""
        pos, docs = self._cut(batch.positions, batch.doc_ids, causal=True)
        idx = self._full[id(pos)][2][self.grp.index]
        return Batch(batch.tokens[:, idx], batch.targets[:, idx], pos, docs)

    def local_context(self, positions: Tensor, doc_ids: Tensor | None = None,
                      causal: bool = True) -> AttnContext:
        """The attention context of this rank for a full sequence (tests and benchmarks use it)."""
        pos, docs = self._cut(positions, doc_ids, causal)
        return make_context(pos, docs, causal)

    def view(self, ctx: AttnContext) -> SeqView:
        """The tokens of the queries and of every rank's block, built once per forward (``ctx.cache``)."""
        key = ("context_parallel", id(self))
        if key not in ctx.cache:
            full = self._full.get(id(ctx.positions))
            if full is None:
                raise ParallelLabError(
                    "the context-parallel attention core got positions that ContextParallel.shard_micro did "
                    "not cut; pass micro-batches through rt.shard_micro (or ContextParallel.local_context)")
            pos, docs, every = full
            chunk = len(pos) // self.n_chunks
            blocks = [Tokens.of(pos[idx], None if docs is None else docs[:, idx], self.tile, chunk)
                      for idx in every]
            ctx.cache[key] = SeqView(blocks[self.grp.index], blocks, Tokens.cat(blocks, self.tile, chunk))
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


def apply_cp(rt: Any) -> None:
    """Context parallelism from the plan: swap every block's attention core, cut micro-batches into this
    rank's chunks (``rt.shard_micro``). Gradients are synchronised over ``dp x cp`` by the data-parallel
    object the composition builds next (``Grid.grad_group``)."""
    plan, grid, model = rt.plan, rt.grid, rt.model
    spec = model.spec
    if spec.dropout > 0:
        raise ParallelLabError(f"dropout={spec.dropout}: the context-parallel attention cores do not drop "
                               f"attention probabilities; use a model with dropout=0 for cp > 1")
    if plan.seq % (2 * plan.cp):
        raise ParallelLabError(f"seq={plan.seq} is not divisible by 2*cp={2 * plan.cp}; "
                               f"pick seq a multiple of {2 * plan.cp}")
    if plan.cp_kind == "ulysses":
        kv_replication(spec.heads // plan.tp, max(1, spec.kv_heads // plan.tp), plan.cp)
    grp = CPGroup(rt.tracer, grid.ranks["cp"], grid.cp_rank, grid.groups["cp"])
    cp = ContextParallel(plan.cp_kind, grp)
    for blk in model.blocks.values():
        blk.attn.core = ContextParallelAttention(cp)
    before = rt.shard_micro
    rt.shard_micro = lambda batch: cp.shard_micro(before(batch))
    rt.extras["cp"] = cp
