"""What a rank keeps, counted by storage: parameters, gradients and optimizer states (bytes per rank).

``measure_state`` counts the distinct *storages* behind the tensors a rank keeps (a storage shared by
several tensors, such as DDP's gradient views into a bucket, counts once), so a sharded implementation
that passes its shards is charged its shards. Optimizer step counters (0-dim tensors) are not state per
parameter and are not counted, as the ledger does not count them: the three categories are compared
with ``ledger.state_bytes`` exactly (docs/conventions.md, "Memory ledger categories").
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor
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
