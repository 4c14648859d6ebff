"""Communication buffers' peaks by part, and torch's own memory tracker for a second opinion.

:class:`BufferMeter` keeps the peak bytes of each part the implementations sample through the probe
(``distributed/probe.py``); :func:`memtracker_snapshot` runs a step under torch's ``MemTracker``. The
state itself (parameters, gradients, optimizer states) is counted by ``model/state.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from parallel_lab.distributed.model.state import storage_bytes

#: The probe's part names that are not the ledger's own (``ledger.comm_buffer_parts``). The others map to
#: themselves: ``sp``, ``pp``, ``cp``, ``ep`` name a parallelism's own buffers, the dim the ledger names them by.
LEDGER_PART = {"gradient_buckets": "ddp_buckets", "flat_gradients": "zero_reduce",
               "gathered_parameters": "zero_gather", "gathered_units": "zero3_gathered",
               "reducing_gradients": "zero3_reduce_input", "held_gradients": "zero3_held_gradients"}

#: The probe's parts that are model state, not communication buffers (``CommTracer.state``).
STATE_PARTS = ("parameters",)
#: ZeRO-3's report (``RankResult.info["zero"]``): each key is the peak of a part (0: never sampled).
ZERO3_PEAKS = {"peak_parameter_bytes": "parameters", "peak_held_gradient_bytes": "zero3_held_gradients",
               "peak_reduce_input_bytes": "zero3_reduce_input"}


class BufferMeter:
    """Peak bytes of the communication buffers of one rank, by part (the ledger's ``comm_buffer_parts``).

    The implementations sample (``probe.sample``) where a buffer is alive: at a collective, with the tensors
    handed to it or made for it that are not model state (a flat gradient, a gathered unit, a received
    activation), or with a byte count they computed. A sample counts the
    distinct storages (``storage_bytes``); ``peaks[part]`` keeps the largest. No hooks: one byte count
    per call.
    """

    def __init__(self) -> None:
        self.peaks: dict[str, int] = {}

    def sample(self, part: str, tensors: Iterable[Tensor | None] = (), nbytes: int | None = None) -> None:
        """``part``: the probe's name (:data:`LEDGER_PART`) or the ledger's."""
        part = LEDGER_PART.get(part, part)
        n = storage_bytes(tensors) if nbytes is None else int(nbytes)
        if n > self.peaks.get(part, -1):
            self.peaks[part] = n


def memtracker_snapshot(model: nn.Module, optimizer: torch.optim.Optimizer,
                        step: Any) -> dict[str, dict[str, int]]:
    """Run ``step()`` (forward + backward + optimizer step) under torch's ``MemTracker``.

    Returns ``{"peak": {...}, "current": {...}}``: torch's bytes per category (``Parameter``,
    ``Gradient``, ``Optstate``, ``Activation``, ``Temp``, ``Total``), summed over devices. Run one step
    before (optimizer states are created lazily). Works on CPU. Torch counts what our meters leave out:
    ``Optstate`` includes the 4-byte step counters (current) and the optimizer's temporaries (peak).
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    mt.track_external(model, optimizer)
    with mt:
        step()
    out: dict[str, dict[str, int]] = {}
    for kind in ("peak", "current"):
        acc: dict[str, int] = {}
        for per_dev in mt.get_tracker_snapshot(kind).values():
            for k, v in per_dev.items():
                name = str(getattr(k, "value", k))
                acc[name] = acc.get(name, 0) + int(v)
        out[kind] = acc
    return out
