"""Expert parallelism's communication: the dispatch/combine all-to-all and the experts' gradient sum.

GShard (Lepikhin et al. 2021): one ``all_to_all_single`` with equal splits sends every rank's capacity slots
to the experts' owners ("dispatch") and a second brings the outputs back ("combine"); an equal-split
all-to-all is its own transpose, so backward is the same call on the gradient (message: this rank's input,
``comm.ep_dispatch_bytes``). An expert's gradient is summed over the ``edp`` ranks that hold it. Plain
``torch.distributed`` calls; the accounting dims are tagged through the probe because the groups do not
say them alone (``ep`` may be the world that ``dp`` also is; ``edp``'s sum counts as ``dp``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from parallel_lab.distributed import probe


def all_to_all(x: Tensor, group: Any) -> Tensor:
    """Equal-split ``all_to_all_single`` of ``x`` (rows) over ``group``: chunk ``j`` goes to rank ``j``."""
    out = torch.empty_like(x)
    x = x.contiguous()
    probe.sample("ep", [x, out])                           # the slots going out and those arriving
    with probe.tagged(dim="ep"):
        dist.all_to_all_single(out, x, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """Equal-split all-to-all over the ``ep`` group; backward: the same call on the gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return all_to_all(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return all_to_all(grad, ctx.group), None


def all_reduce_expert_grad(grad: Tensor, edp: Any) -> None:
    """Sum an expert's gradient over the ``edp`` ranks holding it, in place (counted as ``dp``)."""
    with probe.tagged(dim="dp"):
        dist.all_reduce(grad, group=edp)
