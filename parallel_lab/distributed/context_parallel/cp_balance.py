"""Context parallelism's load balance: which tokens each of the ``cp`` ranks holds, and the work it gets.

With a causal mask the last tokens attend to the most keys, so contiguous slices give the last rank
``2 cp - 1`` times the work of the first. Llama 3's *zigzag* cuts each sequence into ``2 cp`` chunks and
gives rank ``i`` chunks ``i`` and ``2 cp - 1 - i``: every rank then does the same attention work,
counted as the (query, key) pairs the mask allows (:func:`work_per_rank`), not as tokens. Document masks
(packed sequences) break that balance; ``balance="work"`` deals ``2 cp pieces`` smaller chunks by their
work under the micro-batch's documents instead (on 4 x 1024 packed tokens over 4 ranks the busiest
rank's work falls from 1.27 to 1.03 times the mean; tests/distributed/test_context_parallel.py).

Ulysses moves heads instead of tokens: ``cp`` must divide the query heads, and key/value heads it does
not divide are repeated ``cp / gcd(kv_heads, cp)`` times (:func:`kv_replication`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from parallel_lab.errors import ParallelLabError

BALANCES = ("zigzag", "contiguous", "work")
#: ``balance="work"`` deals ``2 * cp * WORK_PIECES`` chunks by attention work.
WORK_PIECES = 2


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

