"""Exercise online_softmax (implement): the merge step of ring attention.

Ring attention (Liu et al. 2023; the context parallelism of Llama 3) never builds a query's full row of
scores: each rank attends its queries to one block of keys and values at a time, as the blocks travel
round the ring, and folds each partial result into a running one. A partial result over a block is
``(o, lse)``: ``o = softmax(S_block) V_block`` normalised within the block, shape ``(b, s, d)``, and
``lse = log sum exp(S_block)`` per query, shape ``(b, s)`` (``parallel_lab.grading.micro.block_attention``
computes one). Two partial results over disjoint key blocks combine exactly:

    lse = log(exp(lse_a) + exp(lse_b))
    o   = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b

Implement ``merge(o_a, lse_a, o_b, lse_b) -> (o, lse)``. It must be numerically safe: scores of 100 or
more must not overflow (never exponentiate an lse itself), and a block in which a query sees no key
(causal masking: ``lse = -inf``, ``o = 0``) must leave the other side unchanged, never a NaN.
Graded: merged over 2 to 5 blocks in any order the result equals one process's full softmax attention
within 1e-5 (relative); large scores; fully masked blocks; and a 2-rank ring that sends the K/V blocks
round with ``dist.send``/``dist.recv`` and merges with your function.
Check: ``parallel-lab grade online_softmax exercises/online_softmax/starter.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def merge(o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    # TODO: the combined (o, lse) of two partial attention results
    raise NotImplementedError("merge")


__all__ = ["Tensor", "merge", "torch"]
