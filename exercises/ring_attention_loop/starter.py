"""Exercise ring_attention_loop (implement): the causal ring-attention loop.

Ring attention (Liu et al. 2023; the context parallelism of Llama 3) splits a sequence of ``s`` tokens into
``world`` contiguous chunks of ``c = s / world``: rank ``r`` holds the queries, keys and values of positions
``[r c, (r + 1) c)``, each ``(b, c, d)``. No rank ever holds the whole sequence's keys: the K/V chunks travel
round the ring, one hop per step, and each rank folds the attention of its queries over each chunk that
reaches it into a running result ``(o, lse)`` with the online-softmax merge (exercise online_softmax).

Implement :func:`ring_attention` (causal: a query at position ``i`` sees the keys at positions ``<= i``)
and :func:`merge` (your answer to online_softmax). Contract:

* compute each block with ``block_attention(q, k, v, mask)`` (``(o, lse)``; ``mask (c, c)``, True where
  allowed): the grader counts the calls, and a chunk wholly in the future of your queries costs nothing;
* move K/V only with :func:`send_recv` (or ``dist.isend`` / ``dist.irecv`` / ``dist.send`` / ``dist.recv``),
  each rank's chunks once round the ring and no further: every rank needs every earlier chunk once;
* scores of several hundred must not overflow, and no output may be NaN.

Graded: the ranks' outputs side by side equal one process's causal attention within 1e-5 (relative) on 2,
3 and 4 ranks, also with huge scores; the bytes each rank sends and receives; the blocks each rank computes.
Check: ``parallel-lab grade ring_attention_loop exercises/ring_attention_loop/starter.py``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from parallel_lab.grading.micro import block_attention


def merge(o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    # TODO: your online_softmax answer: the combined (o, lse) of two partial results over disjoint keys
    raise NotImplementedError("merge")


def send_recv(t: Tensor, to: int, frm: int) -> Tensor:
    """Send ``t`` to rank ``to`` and receive a tensor like it from rank ``frm`` (every rank calls it alike)."""
    buf = torch.empty_like(t)
    works = [dist.isend(t.contiguous(), to), dist.irecv(buf, frm)]
    for w in works:
        w.wait()
    return buf


def ring_attention(q: Tensor, k: Tensor, v: Tensor, rank: int, world: int) -> Tensor:
    """This rank's causal attention output ``(b, c, d)`` for its queries over every key at or before them."""
    # TODO: start from your own chunk; then world - 1 ring steps: which chunk has arrived, and do your queries
    # see all of it, part of it, or none of it?
    raise NotImplementedError("ring_attention")


__all__ = ["block_attention", "dist", "merge", "ring_attention", "send_recv"]
