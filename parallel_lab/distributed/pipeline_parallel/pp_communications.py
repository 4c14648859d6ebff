"""Pipeline parallelism's communication: the point-to-point messages between neighbouring stages.

A ``P2P`` action of the schedule posts its sends and receives together, one ``dist.batch_isend_irecv`` on the
``pp`` group (peers are global ranks), and waits for none: each op gets its own completion, waited for when
its tensor is needed (a receive) or at the end of the step (a send). gloo returns one work per op; NCCL may
coalesce the batch into one work, which then completes every op of the batch. The messages are the
activations ``(b, s, h)`` forward and their gradients backward (``comm.pp`` counts them). The comm tracer
sees the call from outside (``instruments/observe.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch import Tensor


class _Batch:
    """Completion of one op of a coalesced batch: every work of the batch."""

    def __init__(self, works: Sequence[Any]):
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


def post(ops: Sequence[tuple[str, Tensor, int]], group: Any) -> list[Any]:
    """Post ``ops`` (``("send" | "recv", tensor, global peer)``) together; one completion (``wait()``) per op."""
    if not ops:
        return []
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, peer, group=group)
                                    for kind, t, peer in ops])
    return list(works) if len(works) == len(ops) else [_Batch(works) for _ in ops]
