"""What a context-parallel rank spent its attention time on: computing, or waiting for the other ranks.

:class:`OverlapStats` accumulates, per phase (forward, backward), the seconds spent in the blockwise
kernel (``compute_s``) and the seconds blocked waiting for a transfer (``wait_s``), plus the kernel's
tile counts (``attention.KernelStats``). With overlap (the default: the next block's transfer is posted
before the current block is computed) ``wait_s`` is the part of the communication the computation did not
hide, and any time the peer was slower; without it (``CPGroup(overlap=False)``) it is the whole transfer.
gloo's works do not report completion before ``wait``, so the time blocked is what can be measured.
bench/bench_cp.py prints both, with and without overlap, for each variant.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from parallel_lab.distributed.context_parallel.blockwise_attention import KernelStats


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



class Timer:
    """``with Timer(into, key):`` adds the seconds spent inside to ``into[key]``."""

    def __init__(self, into: dict[str, float], key: str):
        self.into, self.key = into, key

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.into[self.key] += time.perf_counter() - self.t0

