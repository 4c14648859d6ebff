"""ZeRO's units: flat, padded buffers of parameters, and the shard one rank owns (docs/conventions.md).

A *unit* is one transformer block (``blocks.{i}``) plus a *root* unit with everything else
(``zero_unit="block"``), or a single root unit (``zero_unit="root"``). A unit's trainable parameters, in
registration order (a tied weight once), form one flat buffer of ``n`` elements padded to ``g * S`` with
``S = ceil(n / g)``, ``g`` the ranks of the gradient group (``dp``, or ``dp x cp``); the rank with index
``r`` in that group owns elements ``[r S, (r + 1) S)`` (the last rank's shard holds the padding zeros).
A sharded category therefore costs ``sum_u S_u * bytes`` on every rank, what ``ledger.state_bytes``
predicts, and every ZeRO message is a padded flat buffer of ``g * S_u`` elements
(``comm._zero_collectives``). ZeRO-1/2 (``zero.py``) and ZeRO-3 (``fsdp.py``) share these units.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from parallel_lab.distributed.collectives import all_gather_flat_fn
from parallel_lab.distributed.data_parallel.data_parallel import Named, trainable
from parallel_lab.distributed.model.mixed_precision import is_mixed
from parallel_lab.distributed.model.model import ADAMW, make_optimizer
from parallel_lab.sharding import shard_size
from parallel_lab.specs import Plan

_untraced_all_gather = all_gather_flat_fn()

#: Optimizers the ZeRO classes can run: fp32 ones (any stage) and FSDP2-style mixed precision (stage 3).
MIXED = "fsdp2-mixed"


class Unit:
    """The trainable parameters of one unit as a flat buffer of ``padded = g * shard`` elements.

    ``names``/``params``/``shapes``/``numels`` in registration order; rank ``index`` owns
    ``[lo, hi) = [index * shard, (index + 1) * shard)``.
    """

    def __init__(self, name: str, named: list[tuple[str, nn.Parameter]], group_size: int, index: int):
        self.name = name
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.shapes = [p.shape for p in self.params]
        self.numels = [p.numel() for p in self.params]
        self.numel = sum(self.numels)
        self.shard = shard_size(self.numel, group_size)
        self.padded = group_size * self.shard
        self.lo, self.hi = index * self.shard, (index + 1) * self.shard

    def owned(self, tensors: list[Tensor | None], dtype: torch.dtype, device: torch.device) -> Tensor:
        """A new ``shard``-element tensor: elements ``[lo, hi)`` of the concatenation of ``tensors``
        (``None`` counts as zeros; the padding is zeros)."""
        out = torch.zeros(self.shard, dtype=dtype, device=device)
        off = 0
        for t, n in zip(tensors, self.numels, strict=True):
            a, b = max(off, self.lo), min(off + n, self.hi)
            if a < b and t is not None:
                out[a - self.lo:b - self.lo].copy_(t.detach().reshape(-1)[a - off:b - off])
            off += n
        return out

    def write_owned(self, tensors: list[Tensor], shard: Tensor) -> None:
        """Write ``shard`` (``shard`` elements) into elements ``[lo, hi)`` of the concatenation of ``tensors``
        (the inverse of :meth:`owned`; the padding is dropped)."""
        off = 0
        for t, n in zip(tensors, self.numels, strict=True):
            a, b = max(off, self.lo), min(off + n, self.hi)
            if a < b:
                t.view(-1)[a - off:b - off].copy_(shard[a - self.lo:b - self.lo])
            off += n

    def flatten(self, tensors: list[Tensor | None], dtype: torch.dtype, device: torch.device) -> Tensor:
        """The padded flat buffer of ``tensors`` (``None`` as zeros)."""
        parts = [t.detach().reshape(-1).to(dtype) if t is not None
                 else torch.zeros(n, dtype=dtype, device=device)
                 for t, n in zip(tensors, self.numels, strict=True)]
        parts.append(torch.zeros(self.padded - self.numel, dtype=dtype, device=device))
        return torch.cat(parts)

    def split(self, flat: Tensor) -> list[Tensor]:
        """Views of ``flat`` shaped as the unit's parameters (the padding left out)."""
        chunks = flat.split([*self.numels, self.padded - self.numel])
        return [c.view(s) for c, s in zip(chunks, self.shapes, strict=False)]


def unit_of(name: str, zero_unit: str) -> str:
    """``blocks.{i}`` for a block's parameter with ``zero_unit="block"``, else ``root``."""
    parts = name.split(".")
    return f"blocks.{parts[1]}" if zero_unit == "block" and parts[0] == "blocks" else "root"


def group_units(named: Named, zero_unit: str) -> list[tuple[str, Named]]:
    """``(unit name, its (name, parameter) list)`` of ``named``, ordered by each unit's first parameter."""
    groups: dict[str, Named] = {}
    for name, p in named:
        groups.setdefault(unit_of(name, zero_unit), []).append((name, p))
    return list(groups.items())


def build_units(model: nn.Module, zero_unit: str, group_size: int, index: int) -> list[Unit]:
    """The non-empty units of ``model``'s trainable parameters, ordered by their first parameter."""
    return [Unit(u, named, group_size, index) for u, named in group_units(trainable(model), zero_unit)]


def group_index(group: Any) -> int:
    """This rank's index in ``group`` (the order of the shards in a gathered buffer)."""
    return dist.get_group_rank(group, dist.get_rank()) if group is not None else dist.get_rank()


def shard_optimizer(plan: Plan) -> tuple[Any, dict[str, Any]]:
    """``(optimizer_class, defaults)`` that steps one fp32 shard for ``plan`` (mixed precision: fp32 AdamW
    on the fp32 master shards; otherwise the plan's own optimizer, ``model.make_optimizer``)."""
    if plan.optimizer == MIXED or is_mixed(plan):
        return torch.optim.AdamW, {"foreach": False, **ADAMW}
    return functools.partial(make_optimizer, plan=plan), {}


def gather_shards(units: list[Unit], shards: list[Tensor], group: Any, device: torch.device) -> dict[str, Tensor]:
    """Full fp32 parameters by name, all-gathered from the units' shards (untraced: reporting)."""
    out: dict[str, Tensor] = {}
    for u, shard in zip(units, shards, strict=True):
        full = torch.empty(u.padded, dtype=torch.float32, device=device)
        _untraced_all_gather(full, shard.detach().float(), group=group)
        out.update({n: v.clone() for n, v in zip(u.names, u.split(full), strict=True)})
    return out


def complete_partial_grads(units: list[Unit], grads: list[Tensor | None], names: list[str],
                           all_reduce: Callable[[Tensor], Any], dtype: torch.dtype, device: torch.device) -> None:
    """ZeRO-2/3: finish gradients that are partial sums over another group (TP's replicated parameters with
    sequence parallelism), after the data-parallel reduce-scatter left each rank only its shards ``grads``.

    As Megatron-LM does after its distributed optimizer's reduce-scatter: ``all_reduce`` gets the full
    concatenation of ``names``' gradients (the same message as without ZeRO, ``comm.tp_step_collectives``),
    holding this rank's owned elements and zeros elsewhere; the ranks of that group own the same elements
    (equal shapes, equal shard index), so the owned elements come back complete and are written into the
    shards. ``grads[i]``: unit ``i``'s gradient shard (``None``: zeros, created here when needed). Names in
    no unit (another pipeline stage's, frozen) are skipped; none left: no call.
    """
    where = {}
    for i, u in enumerate(units):
        off = 0
        for n, k in zip(u.names, u.numels, strict=True):
            where[n] = (i, off, k)
            off += k
    spans, pos = [], 0                                  # (unit, first, last owned element in its shard, pos)
    for n in (n for n in names if n in where):
        i, off, k = where[n]
        a, b = max(off, units[i].lo), min(off + k, units[i].hi)
        if a < b:
            spans.append((i, a - units[i].lo, b - units[i].lo, pos + a - off))
        pos += k
    if not pos:
        return
    flat = torch.zeros(pos, dtype=dtype, device=device)     # full length: the message of the plain TP path
    for i, a, b, at in spans:
        if grads[i] is not None:
            flat[at:at + b - a].copy_(grads[i][a:b])
    all_reduce(flat)
    for i, a, b, at in spans:
        if grads[i] is None:
            grads[i] = torch.zeros(units[i].shard, dtype=dtype, device=device)
        grads[i][a:b].copy_(flat[at:at + b - a])
