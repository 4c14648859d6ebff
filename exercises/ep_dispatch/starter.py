"""Exercise ep_dispatch (implement): expert parallelism's dispatch and combine, with all_to_all and a capacity.

Each of the ``ep`` ranks (the world here) holds one sequence ``x (s, h)`` and the experts
``[r E/ep, (r+1) E/ep)`` of ``E`` (``experts[i]`` is expert ``r E/ep + i``, a module ``(n, h) -> (n, h)``).
The router gave each token ``k`` choices: ``expert (s, k)`` int64 and ``gate (s, k)``. An expert takes at most
``capacity`` choices of this rank's sequence, in GShard's priority order: the first choice of every token in
token order, then every token's second choice, and so on; a choice that finds its expert full is dropped and
adds nothing (the block's residual carries the token). Output: ``y[t] = sum of gate[t, j] expert_j(x[t])``
over the kept choices ``j`` of token ``t`` (zero when all are dropped), as one process's MoE computes.

Implement ``kept_choices`` (the capacity, no communication) and ``dispatch_combine``, with exactly three
``dist.all_to_all_single`` calls on the default group, in this order: (1) the ``E`` per-expert counts of
kept rows (int64, equal splits): what each rank will receive from each rank; (2) the kept rows of ``x``,
packed by destination rank and, within it, by expert (uneven ``input_split_sizes`` /
``output_split_sizes``); then run each local expert on its rows; (3) the outputs back, the reverse splits.
Settle first: how do you find, on the receiving rank, which rows belong to which expert, and, back home,
which token and gate each returned row belongs to? Graded on 2 and 4 CPU ranks: the kept choices on hand
and router-made cases; the output equals the library's one-process MoE within 1e-5; the three calls carry
``8 E``, ``4 h`` x (rows sent) and ``4 h`` x (rows received) bytes (fp32).
Check: ``parallel-lab grade ep_dispatch exercises/ep_dispatch/starter.py``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def kept_choices(expert: Tensor, n_experts: int, capacity: int) -> Tensor:
    """``(s, k)`` bool: True where the choice ``expert[t, j]`` fits in its expert's capacity."""
    # TODO: walk the choices in priority order with a count per expert
    raise NotImplementedError("kept_choices")


def dispatch_combine(x: Tensor, expert: Tensor, gate: Tensor, capacity: int, experts: list) -> Tensor:
    """This rank's MoE output ``(s, h)`` (no autograd needed: the grader calls it under ``torch.no_grad()``)."""
    # ep, rank = dist.get_world_size(), dist.get_rank()
    # TODO: kept choices; rows sorted by expert; counts exchange; rows exchange; local experts; rows back;
    # TODO: y = sum over kept choices of gate * returned row (index_add_ on the token index)
    raise NotImplementedError("dispatch_combine")


__all__ = ["Tensor", "dispatch_combine", "dist", "kept_choices", "torch"]
