"""Model state measured from the tensors: parameters, gradients and optimizer states (bytes per rank).

``measure_state`` counts the distinct *storages* behind the tensors a rank keeps (a storage shared by
several tensors, such as DDP's gradient views into a bucket, counts once), so a sharded implementation
that passes its shards is charged its shards. Optimizer step counters (0-dim tensors) are not state per
parameter and are not counted, as the ledger does not count them: the three categories are compared
with ``ledger.state_bytes`` exactly (docs/conventions.md, "Memory ledger categories").

:func:`memtracker_snapshot` asks torch's own ``MemTracker`` for a second opinion on the same step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake


def storage_key(t: Tensor) -> tuple[int, str]:
    """Identity of the storage behind ``t`` (address and device; fake tensors of ``instruments/measure.py``
    have no address, so they are keyed by the storage object itself)."""
    st = t.untyped_storage()
    if is_fake(t):
        return (st._cdata, str(t.device))
    return (st.data_ptr(), str(t.device))

def storage_bytes(tensors: Iterable[Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a storage shared by several counts once)."""
    seen: dict[tuple[int, str], int] = {}
    for t in tensors:
        if t is None:
            continue
        n = t.untyped_storage().nbytes()
        if n:
            seen[storage_key(t)] = n
    return sum(seen.values())


class BufferMeter:
    """Peak bytes of the communication buffers of one rank, by part (the ledger's ``comm_buffer_parts``).

    The implementations call :meth:`sample` where a buffer is alive: at a collective, with the tensors
    handed to it or made for it that are not model state (a flat gradient, a gathered unit, a received
    activation), or with a byte count they computed. A sample counts the
    distinct storages (``storage_bytes``); ``peaks[part]`` keeps the largest. No hooks: one byte count
    per call.
    """

    def __init__(self) -> None:
        self.peaks: dict[str, int] = {}

    def sample(self, part: str, tensors: Iterable[Tensor | None] = (), nbytes: int | None = None) -> None:
        n = storage_bytes(tensors) if nbytes is None else int(nbytes)
        if n > self.peaks.get(part, -1):
            self.peaks[part] = n


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """Per-parameter state tensors of an optimizer (``exp_avg``, ``momentum_buffer``...), not 0-dim
    step counters."""
    out = []
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, Tensor) and v.dim() > 0:
                out.append(v)
    return out


def measure_state(params: Iterable[Tensor], optimizer: torch.optim.Optimizer | None = None,
                  grads: Iterable[Tensor | None] | None = None) -> dict[str, int]:
    """``{"parameters", "gradients", "optimizer_states"}`` bytes, measured from the tensors.

    ``params``: the tensors this rank keeps as parameters (a sharded implementation passes its shards);
    ``grads``: default each parameter's ``.grad``. Call it after backward, before gradients are freed.
    """
    params = list(params)
    grads = [p.grad for p in params] if grads is None else list(grads)
    return {"parameters": storage_bytes(params),
            "gradients": storage_bytes(grads),
            "optimizer_states": storage_bytes(optimizer_state_tensors(optimizer)) if optimizer else 0}




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


