"""The blockwise attention kernel every context-parallel variant computes with (one process, no communication).

Attention ``softmax(q k^T / sqrt(d) + mask) v`` over key/value *blocks*, never materialising the
``(s x s)`` probabilities: partial results are merged exactly with the online softmax (Milakov &
Gimelshein 2018; FlashAttention's running maximum ``m``, sum ``l`` and accumulator, Dao et al. 2022)::

    m' = max(m, rowmax(S)),  l' = l e^(m - m') + rowsum(e^(S - m')),
    acc' = acc e^(m - m') + e^(S - m') V,        out = acc / l,  lse = m + log l

Backward recomputes ``P = exp(S - lse)`` per tile and adds ``dV += P^T dO``, ``dS = P (dP - delta)``
with ``delta = rowsum(dO * O)``, ``dK += dS^T Q``, ``dQ += dS K``. Tiles are cut at load-balancing chunk
boundaries (at most ``tile`` tokens): a tile pair the mask fully hides (causal or document mask) is
skipped, a fully visible one needs no mask, and only tiles on a mask's edge build one (:func:`tile_mask`),
so a rank's time follows its attention work. :func:`local_attention` runs the kernel over a whole
sequence: the fair single-process reference of bench/bench_cp.py. Derivations: docs/context_parallel.md.
In fake tensors (``memory --measure``) the loop runs a few representative pairs (blockwise_replay.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from parallel_lab.distributed.context_parallel.blockwise_replay import replay_runs

NEG_INF = float("-inf")
#: Largest tile (tokens) of the blockwise kernel; tiles never cross a chunk boundary.
DEFAULT_TILE = 256
REPLAY_FAKE = True          # in fake tensors: a few tile pairs (blockwise_replay.py); False: all (tests)


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


def tile_mask(q: Tokens, qt: Tile, k: Tokens, kt: Tile, causal: bool, build: bool = True) -> Tensor | bool | None:
    """The additive mask of one (query tile, key tile) pair, shaped ``(b or 1, 1, tq, 1, tk)`` (0 or -inf);
    ``False``: the mask hides every pair (skip the tile); ``None``: it hides none (no mask needed);
    ``build=False``: ``True`` instead of building a mask (the tiles' metadata only, no tensor)."""
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
    if not build:
        return True
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
                   causal: bool, stats: KernelStats | None = None,
                   pairs: Iterable[tuple[Tile, Tile]] | None = None) -> None:
    """Fold the key/value block ``k, v (b, g, s_k, d)`` (tokens ``kv``) into ``state`` for queries ``q``;
    ``pairs``: the (query tile, key tile) pairs run (default: all; in fake tensors, blockwise_replay's)."""
    if pairs is None and REPLAY_FAKE and is_fake(qg):       # measured: a few pairs, the same peak
        for run in replay_runs(q, kv, causal, tile_mask, qg.shape[0], stats):
            attend_forward(state, qg, k, v, q, kv, causal, None, run)
        return
    b, g, _, r, d = qg.shape
    last = None
    for qt, kt in pairs if pairs is not None else ((qt, kt) for qt in q.tiles for kt in kv.tiles):
        if qt is not last:
            q_t, last = qg[:, :, qt.start:qt.stop].reshape(b, g, -1, d), qt
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
                    kv: Tokens, causal: bool, dqg: Tensor, dk: Tensor, dv: Tensor,
                    pairs: Iterable[tuple[Tile, Tile]] | None = None) -> None:
    """Add this key/value block's part of the gradients (FlashAttention's backward, recomputing ``P``).

    ``dog``: output gradient grouped like ``qg``; ``lse``, ``delta = rowsum(dO * O)``: ``(b, g, s, r)``.
    ``dqg`` (like ``qg``) receives the gradient of the *scaled* queries; ``dk, dv (b, g, s_k, d)`` fp32.
    ``pairs`` (the runs of blockwise_replay, in fake tensors): only these pairs, ``lse`` already masked.
    """
    if pairs is None:
        lse = lse.masked_fill(lse == NEG_INF, float("inf"))      # a query that sees nothing: P = 0
        if REPLAY_FAKE and is_fake(qg):                          # measured: a few pairs, the same peak
            for run in replay_runs(q, kv, causal, tile_mask, qg.shape[0]):
                attend_backward(qg, k, v, dog, lse, delta, q, kv, causal, dqg, dk, dv, run)
            return
    b, g, _, r, d = qg.shape
    last = None
    for qt, kt in pairs if pairs is not None else ((qt, kt) for qt in q.tiles for kt in kv.tiles):
        a, z = qt.start, qt.stop
        if qt is not last:
            q_t, last = qg[:, :, a:z].reshape(b, g, -1, d), qt
            do_t = dog[:, :, a:z].reshape(b, g, -1, d)
            dq_t = dqg[:, :, a:z].view(b, g, -1, d)
            lse_t, delta_t = lse[:, :, a:z, :, None], delta[:, :, a:z, :, None]
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
