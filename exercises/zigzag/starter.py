"""Exercise zigzag (implement): load balancing of causal attention over context-parallel ranks.

Context parallelism cuts a sequence of ``seq`` tokens over ``cp`` ranks. Under a causal mask the query at
position ``i`` attends ``i + 1`` keys, so the rank holding the last slice does most of the work while the
first waits. The zigzag layout (Llama 3, Dubey et al. 2024) cuts the sequence into ``2 cp`` equal chunks
and gives rank ``r`` chunks ``r`` and ``2 cp - 1 - r``: an early and a late chunk, equal work on every
rank.

Implement ``zigzag_indices(seq, cp, rank)``: the positions rank ``rank`` holds, increasing, as a list of
ints (``seq`` is a multiple of ``2 cp``), and ``causal_work(indices)``: the (query, key) pairs those queries
may attend under a causal mask over the whole sequence. Graded: the layout equals the library's
(``parallel_lab.distributed.context_parallel.cp_balance.rank_indices``) for many ``(seq, cp)``, every position is held
exactly once, your work counts equal the library's count of allowed pairs, and every rank's work is equal.
Check: ``parallel-lab grade zigzag exercises/zigzag/starter.py``.
"""

from __future__ import annotations


def zigzag_indices(seq: int, cp: int, rank: int) -> list[int]:
    # TODO: chunks rank and 2*cp - 1 - rank of 2*cp equal chunks
    raise NotImplementedError("zigzag_indices")


def causal_work(indices: list[int]) -> int:
    # TODO: query at position i sees keys 0..i
    raise NotImplementedError("causal_work")
