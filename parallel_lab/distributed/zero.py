"""ZeRO-1, ZeRO-2 and ZeRO-3 (FSDP-style): data parallelism that shards the model state over the ranks.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models";
Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel". Every rank still
trains on its own slice of the batch; what changes is who keeps which part of the model state. With
``g`` ranks in the gradient group (``dp``, or ``dp x cp`` with context parallelism) and ``Psi``
trainable parameters, per rank (fp32 AdamW: 4 + 4 + 8 bytes per parameter)::

    stage 1  optimizer states sharded      4 Psi +  4 Psi     + 8 Psi / g
    stage 2  + gradients sharded           4 Psi + (4 + 8) Psi / g
    stage 3  + parameters sharded                 (4 + 4 + 8) Psi / g   (+ the units gathered now)

Units and flat buffers (docs/conventions.md). A *unit* is one transformer block (``blocks.{i}``) plus a
*root* unit with everything else (``zero_unit="block"``), or a single root unit (``zero_unit="root"``).
A unit's trainable parameters, in registration order (a tied weight once), form one flat buffer of
``n`` elements padded to ``g * S`` with ``S = ceil(n / g)``; the rank with index ``r`` in the gradient
group owns elements ``[r S, (r + 1) S)``. So a sharded category costs ``sum_u S_u * bytes`` on every
rank, exactly what ``ledger.state_bytes`` predicts (the last rank's shard holds the padding zeros).

The collectives, one per unit, are exactly those of ``parallel_lab.comm._zero_collectives`` (messages are
padded flat buffers, ``g * S_u`` elements):

* **ZeRO-1 / ZeRO-2** (:class:`Zero12`, an optimizer with torch's ``ZeroRedundancyOptimizer(params,
  optimizer_class=..., **defaults)`` convention, usable in a plain torch loop without a DDP wrapper):
  during the step's last backward, as soon as a unit's gradients are complete, its flat gradient is
  reduce-scattered (asynchronously, overlapping the rest of backward; averaged): each rank receives the
  ``S_u`` elements it owns. ZeRO-1 keeps the full ``p.grad`` (the owned slice overwritten with the
  average); ZeRO-2 frees the unit's ``p.grad`` at once and accumulates into a gradient shard. The step:
  unit by unit, each rank runs the inner optimizer on its owned shard only (states of ``S_u`` elements),
  then the updated parameters are all-gathered and copied back into the full parameters. Variants:
  ``zero1_reduce="all_reduce"`` (torch's ZeroRedundancyOptimizer under DDP: the whole gradient
  all-reduced, 1.5x the bytes); ``zero2_accumulate``: "unsharded" (earlier micro-batches accumulate in
  the full ``p.grad``, one reduce-scatter per step) or "sharded" (a reduce-scatter every micro-batch).
* **ZeRO-3** (:class:`Zero3`): only the owned shard of each unit persists (an ``nn.Parameter`` of
  ``S_u`` elements, what the optimizer steps). The model's parameters are replaced by views into a
  gathered flat buffer (an autograd leaf), as FSDP1 does with ``use_orig_params=False``. Per micro-batch:
  the root unit is all-gathered when the model's forward starts and kept until its gradient is complete
  (the end of backward); a block unit is all-gathered before the block's forward (the next block's
  gather is launched asynchronously while this one computes: prefetch), freed after it; all-gathered
  again when the gradient reaches the block's output (a custom autograd function around the block,
  :class:`RegatherBeforeBackward`, which also prefetches the previous block), and when the leaf's
  gradient is complete (a post-accumulate-grad hook) the buffer is freed and the flat gradient is
  reduce-scattered into the gradient shard (one reduce-scatter in flight). "Free" resizes the buffer's
  storage to 0 bytes; the tensors autograd saved stay valid and see the data again after the re-gather,
  which writes through ``leaf.data`` (its own version counter, so autograd's saved-tensor checks pass).
  With ``zero_unit="root"`` the single unit behaves like the root unit: the whole model is gathered at
  once and the peak saving disappears (the seed's failure mode; ``info["peak_parameter_bytes"]``).

Memory. Peak parameter memory of ZeRO-3 (sampled from the storages at every gather and free): the
shards, plus the gathered root unit and two gathered blocks (the one computing and the prefetched one),
``ledger.state_bytes(...)["parameters"] + ledger.zero3_gathered_bytes(...)``; with root-only units the
whole padded model. Gathered buffers are excluded from the saved-tensor meter (``rt.meter.exclude``).

Mixed precision (ZeRO-3, ``optimizer="fsdp2-mixed"``, ``dtype="bf16"``; FSDP2's ``MixedPrecisionPolicy``
with ``param_dtype=bf16, reduce_dtype=fp32``): fp32 shards, fp32 gradient shards and fp32 AdamW; each
unit is cast to bf16 and gathered in bf16 (2 bytes per element), the block computes in bf16, and its
bf16 flat gradient is cast to fp32 before the reduce-scatter. ZeRO-1/2 with ``optimizer="adam-mixed"``
(the ZeRO paper's layout, ``dist/mixed_precision.py``): bf16 parameters and gradients (bf16 all-reduce /
reduce-scatter and all-gather), a persistent fp32 master shard per unit (``Zero12.shards``) and fp32 AdamW.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from parallel_lab.distributed.data_parallel import (
    Named,
    broadcast_from_first,
    queue_at_end_of_backward,
    trainable,
)
from parallel_lab.distributed.instruments import (
    CommTracer,
    TracedWork,
    measure_state,
    optimizer_state_tensors,
    storage_bytes,
)
from parallel_lab.distributed.mixed_precision import is_mixed
from parallel_lab.distributed.model import ADAMW, make_optimizer
from parallel_lab.specs import ParallelLabError, Plan, check_zero_variants

# ``all_gather_single`` is the 2.13 name; older torch has ``all_gather_into_tensor``.
_untraced_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: Optimizers the ZeRO classes can run: fp32 ones (any stage) and FSDP2-style mixed precision (stage 3).
MIXED = "fsdp2-mixed"


# --------------------------------------------------------------------------------------------------
# Units: flat, padded buffers of parameters, and the shard a rank owns
# --------------------------------------------------------------------------------------------------

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
        self.shard = math.ceil(self.numel / group_size)
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


def _group_index(group: Any) -> int:
    """This rank's index in ``group`` (the order of the shards in a gathered buffer)."""
    return dist.get_group_rank(group, dist.get_rank()) if group is not None else dist.get_rank()


def _optimizer_of(plan: Plan) -> tuple[Any, dict[str, Any]]:
    """``(optimizer_class, defaults)`` that steps one fp32 shard for ``plan`` (mixed precision: fp32 AdamW
    on the fp32 master shards; otherwise the plan's own optimizer, ``model.make_optimizer``)."""
    if plan.optimizer == MIXED or is_mixed(plan):
        return torch.optim.AdamW, {"foreach": False, **ADAMW}
    return functools.partial(make_optimizer, plan=plan), {}


# --------------------------------------------------------------------------------------------------
# Shared plumbing (ZeRO-3)
# --------------------------------------------------------------------------------------------------

class _Zero:
    """What ZeRO-3 shares with the library loop's interface: the units, the shard index, the optimizer."""

    stage = 0

    def __init__(self, model: nn.Module, plan: Plan, tracer: Any, group_size: int, index: int):
        self.model, self.plan, self.tracer = model, plan, tracer
        self.group_size, self.index = group_size, index
        self.named = trainable(model)
        self.params = [p for _, p in self.named]
        self.units = build_units(model, plan.zero_unit, group_size, index)
        self.sync = True
        dev = self.params[0].device if self.params else torch.device("cpu")
        self.device = dev
        self.info: dict[str, Any] = {"units": {u.name: u.numel for u in self.units}}

    def set_sync(self, sync: bool) -> None:
        self.sync = sync

    def _optimizer(self, params: list[Tensor]) -> torch.optim.Optimizer:
        cls, defaults = _optimizer_of(self.plan)
        return cls(params, **defaults)

    def _gather_shards(self) -> dict[str, Tensor]:
        return gather_shards(self.units, self.shards, self.tracer.group("dp"), self.device)


def gather_shards(units: list[Unit], shards: list[Tensor], group: Any, device: torch.device) -> dict[str, Tensor]:
    """Full fp32 parameters by name, all-gathered from the units' shards (untraced: reporting)."""
    out: dict[str, Tensor] = {}
    for u, shard in zip(units, shards, strict=True):
        full = torch.empty(u.padded, dtype=torch.float32, device=device)
        _untraced_all_gather(full, shard.detach().float(), group=group)
        out.update({n: v.clone() for n, v in zip(u.names, u.split(full), strict=True)})
    return out


# --------------------------------------------------------------------------------------------------
# ZeRO-1 and ZeRO-2
# --------------------------------------------------------------------------------------------------

UnitsArg = Sequence[tuple[str, Named]] | Sequence[Sequence[Tensor]] | None


def _named_units(units: UnitsArg, params: list[Tensor]) -> list[tuple[str, Named]]:
    """Normalise ``units``: ``None`` (one unit of every parameter), lists of parameters, or
    ``(unit name, [(name, parameter), ...])`` pairs (the library's units)."""
    if units is None:
        return [("root", [(str(i), p) for i, p in enumerate(params)])]
    out: list[tuple[str, Named]] = []
    for k, u in enumerate(units):
        if isinstance(u, tuple) and len(u) == 2 and isinstance(u[0], str):
            out.append((u[0], list(u[1])))
        else:
            out.append((f"unit{k}", [(f"{k}.{j}", p) for j, p in enumerate(u)]))
    given = [id(p) for _, named in out for _, p in named]
    if sorted(given) != sorted(id(p) for p in params) or len(set(given)) != len(given):
        raise ParallelLabError("units= must hold every trainable parameter exactly once; "
                               "pass units=None for one unit of all parameters")
    return out


class Zero12(torch.optim.Optimizer):
    """ZeRO-1 (``stage=1``) or ZeRO-2 (``stage=2``): an optimizer that also synchronises the gradients.

    Torch's calling convention, ``Zero12(params, optimizer_class=torch.optim.AdamW, lr=...)``
    (``ZeroRedundancyOptimizer``'s), with any torch optimizer class; no DDP wrapper is needed: the
    gradients are reduced by hooks during backward, rank 0's parameters are broadcast at construction.
    ``group``: the data-parallel group (default: the default group). ``units``: lists of parameters
    sharded together (default: one unit of all). ``reduce`` (ZeRO-1): ``"reduce_scatter"`` (the paper) or
    ``"all_reduce"`` (torch's ZeroRedundancyOptimizer under DDP). ``accumulate`` (ZeRO-2):
    ``"unsharded"`` (hold the full gradients until the last micro-batch) or ``"sharded"``
    (reduce-scatter every micro-batch). ``no_sync()`` marks accumulation passes. The library's loop
    passes ``tracer`` and ``finish_in_backward=False`` and calls ``set_sync``/``finish`` itself.
    """

    def __init__(self, params: Iterable[Any], optimizer_class: Any = torch.optim.AdamW, *, stage: int = 1,
                 group: Any = None, units: UnitsArg = None, reduce: str = "reduce_scatter",
                 accumulate: str = "unsharded", tracer: CommTracer | None = None,
                 finish_in_backward: bool = True, **defaults: Any):
        super().__init__(list(params), defaults)
        if len(self.param_groups) != 1:
            raise ParallelLabError(f"Zero12 takes one parameter group, got {len(self.param_groups)}; pass "
                                   f"the parameters as one list and the options as keyword arguments")
        check_zero12_options(stage, reduce, accumulate)
        self.stage, self.reduce, self.accumulate = stage, reduce, accumulate
        self.group, self.group_size, self.index = group, dist.get_world_size(group), _group_index(group)
        self.tracer = tracer if tracer is not None else CommTracer(dist.get_rank(), {"dp": group}, False)
        self.finish_in_backward = finish_in_backward
        self.params = [p for p in self.param_groups[0]["params"] if p.requires_grad]
        broadcast_from_first(self.param_groups[0]["params"], group)
        self.units = [Unit(n, named, self.group_size, self.index) for n, named in _named_units(units, self.params)]
        self.device = self.params[0].device if self.params else torch.device("cpu")
        # One optimizer per unit: its single parameter is the unit's shard, whose data is set for the step
        # only (fp32 parameters: a view of nothing between steps), so the states are S_u elements and the
        # step can go unit by unit, each followed by that unit's all-gather. Low-precision parameters (bf16,
        # dist/mixed_precision.py): the shard is the unit's persistent fp32 master shard.
        self.dtype = self.params[0].dtype if self.params else torch.float32    # parameters' and gradients'
        self.mixed = self.dtype != torch.float32
        with torch.no_grad():
            self.shards = [nn.Parameter(u.owned(u.params, torch.float32, self.device) if self.mixed
                                        else torch.empty(0, device=self.device)) for u in self.units]
        self.optimizers = [optimizer_class([s], **defaults) for s in self.shards]
        self.grad_shards: list[Tensor | None] = [None] * len(self.units)
        self.info: dict[str, Any] = {"units": {u.name: u.numel for u in self.units}}
        self.require_backward_grad_sync = True
        self.peak_gradient_bytes = 0
        self.model: nn.Module | None = None            # the module, when known (names in local_parameters)
        self._unit_of = {id(p): i for i, u in enumerate(self.units) for p in u.params}
        self._order = list(reversed(range(len(self.units))))        # backward produces the last unit first
        self._ready = [0] * len(self.units)
        self._next = 0
        self._active = False                 # a reducing backward pass is under way
        self._synced = False                 # this step's gradients have been reduced at least once
        self._pending: tuple[int, Tensor, Tensor | None, TracedWork] | None = None
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    @property
    def every_microbatch(self) -> bool:
        return self.stage == 2 and self.accumulate == "sharded"

    # ---- gradient synchronisation ----------------------------------------------------------------
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate full local gradients (ignored with ``accumulate="sharded"``)."""
        old, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def set_sync(self, sync: bool) -> None:
        """Library loop: whether the coming backward is the step's last (module docstring)."""
        if self._active:                               # the previous micro-batch's pass (sharded)
            self._end_pass()
        self.sample_gradients()
        self.require_backward_grad_sync = sync

    def _on_grad(self, p: Tensor) -> None:
        if not (self.require_backward_grad_sync or self.every_microbatch):
            return
        if not self._active:
            self._active = True
            if self.finish_in_backward:
                queue_at_end_of_backward(self._end_pass)
        self._ready[self._unit_of[id(p)]] += 1
        while self._next < len(self._order):
            i = self._order[self._next]
            if self._ready[i] < len(self.units[i].params):
                break
            self._launch(i)

    def _launch(self, i: int) -> None:
        """Start the unit's reduce-scatter (or ZeRO-1's all-reduce variant); one in flight at a time."""
        self._complete()
        self._next += 1
        u = self.units[i]
        flat = u.flatten([p.grad for p in u.params], self.dtype, self.device)
        flat.div_(self.group_size)                     # average: divide first, then sum over the group
        if self.reduce == "all_reduce":
            work = self.tracer.all_reduce(flat, "dp", group=self.group, async_op=True)
            self._pending = (i, flat, None, work)
            return
        out = torch.empty(u.shard, dtype=flat.dtype, device=self.device)
        work = self.tracer.reduce_scatter(out, flat, "dp", group=self.group, async_op=True)
        if self.stage == 2:                            # ZeRO-2: the full gradient lives on in `flat` only
            for p in u.params:
                p.grad = None
        self._pending = (i, flat, out, work)

    def _complete(self) -> None:
        if self._pending is None:
            return
        i, flat, out, work = self._pending
        self._pending = None
        work.wait()
        u = self.units[i]
        with torch.no_grad():
            if self.stage == 2:
                if self.grad_shards[i] is None:
                    self.grad_shards[i] = out
                else:
                    self.grad_shards[i].add_(out)
                return
            for p in u.params:                         # ZeRO-1 keeps full gradients (persistent)
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            if out is None:                            # all-reduce: every element averaged
                for p, v in zip(u.params, u.split(flat), strict=True):
                    p.grad.copy_(v)
            else:                                      # reduce-scatter: the owned elements averaged
                u.write_owned([p.grad for p in u.params], out)

    def _end_pass(self) -> None:
        """End of a reducing backward: launch the units not yet launched (unused parameters: zeros)."""
        while self._next < len(self._order):
            self._launch(self._order[self._next])
        self._complete()
        self._next = 0
        self._ready = [0] * len(self.units)
        self._active, self._synced = False, True

    def finish(self) -> None:
        """Complete the gradient synchronisation of this step."""
        if self._active or not self._synced:
            self._end_pass()
        self.sample_gradients()

    # ---- optimizer step on the shard, then all-gather ---------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.finish()
        hyper = {k: v for k, v in self.param_groups[0].items() if k != "params"}   # e.g. an LR scheduler's
        for i, u in enumerate(self.units):
            shard = self.shards[i]
            for k, v in hyper.items():
                self.optimizers[i].param_groups[0][k] = v
            if not self.mixed:                         # fp32: the shard is cut from the parameters
                shard.data = u.owned(u.params, torch.float32, self.device)
            if self.stage == 1:
                shard.grad = u.owned([p.grad for p in u.params], torch.float32, self.device)
            else:
                g = self.grad_shards[i]
                shard.grad = g.float() if g is not None else torch.zeros_like(shard.data)
            self.optimizers[i].step()
            full = torch.empty(u.padded, dtype=self.dtype, device=self.device)
            self.tracer.all_gather(full, shard.detach().to(self.dtype), "dp", group=self.group)
            for p, v in zip(u.params, u.split(full), strict=True):
                p.copy_(v)
            shard.grad = None
            if not self.mixed:
                shard.data = torch.empty(0, device=self.device)
        self.grad_shards = [None] * len(self.units)   # the step used them (also after a model.zero_grad())
        self._synced = False
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self.grad_shards = [None] * len(self.units)
        self._synced = False
        self.peak_gradient_bytes = 0

    # ---- measurement -----------------------------------------------------------------------------
    def _gradient_tensors(self) -> list[Tensor | None]:
        return [p.grad for p in self.params] + list(self.grad_shards)

    def sample_gradients(self) -> None:
        self.peak_gradient_bytes = max(self.peak_gradient_bytes, storage_bytes(self._gradient_tensors()))

    def measure_state(self) -> dict[str, int]:
        """Parameters, gradients (their peak over the step, as ``data_parallel.LocalGrads``) and optimizer
        states (the shards' states; with low-precision parameters also the fp32 master shards)."""
        out = measure_state(self.param_groups[0]["params"], None, self._gradient_tensors())
        out["gradients"] = max(out["gradients"], self.peak_gradient_bytes)
        out["optimizer_states"] = sum(storage_bytes(optimizer_state_tensors(o)) for o in self.optimizers)
        if self.mixed:                                 # the fp32 master shards: 4 of the 12 bytes
            out["optimizer_states"] += storage_bytes(self.shards)
        return out

    def local_parameters(self) -> dict[str, Tensor]:
        """Full parameters by name (``self.model``'s names when set, else the units'); low-precision
        parameters: the fp32 masters, gathered from the shards (untraced: reporting)."""
        out = {n: p.detach() for n, p in self.model.named_parameters()} if self.model is not None else \
            {n: p.detach() for u in self.units for n, p in zip(u.names, u.params, strict=True)}
        if self.mixed:
            out.update(gather_shards(self.units, self.shards, self.group, self.device))
        return out

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()


# --------------------------------------------------------------------------------------------------
# ZeRO-3
# --------------------------------------------------------------------------------------------------

class RegatherBeforeBackward(torch.autograd.Function):
    """Identity on a block's output; its backward runs just before the block's own backward and
    all-gathers the block's parameters again (and prefetches the previous block's)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, zero: Zero3, i: int) -> Tensor:
        ctx.zero, ctx.i = zero, i
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        ctx.zero._before_block_backward(ctx.i)
        return grad, None, None


class Zero3(_Zero):
    """ZeRO-3 / FSDP: parameters, gradients and optimizer states sharded; see the module docstring.

    ``rt``: the Runtime (for its meter, created after ``apply_zero``). Hooks are installed on the model
    (root unit) and on each block with a unit (``zero_unit="block"``).
    """

    stage = 3

    def __init__(self, model: nn.Module, plan: Plan, tracer: Any, group_size: int, index: int,
                 rt: Any = None):
        super().__init__(model, plan, tracer, group_size, index)
        self.rt = rt
        mixed = plan.optimizer == MIXED and plan.dtype == "bf16"
        self.param_dtype = torch.bfloat16 if mixed else torch.float32
        # Where each trainable parameter lives (a shared parameter may be registered under several names).
        where: dict[int, list[tuple[nn.Module, str]]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            if p.requires_grad:
                mod, _, attr = name.rpartition(".")
                where.setdefault(id(p), []).append((model.get_submodule(mod), attr))
        self.locations = [[where[id(p)] for p in u.params] for u in self.units]
        with torch.no_grad():                          # cut the shards from the full weights
            self.shards = [nn.Parameter(u.owned(u.params, torch.float32, self.device)) for u in self.units]
        for locs in self.locations:                    # the model no longer holds these parameters
            for per_param in locs:
                for mod, attr in per_param:
                    mod._parameters.pop(attr, None)
        for u in self.units:
            u.params = []                              # drop the full tensors (memory)
        self.named = []
        self.params = list(self.shards)
        self.optimizer = self._optimizer(self.shards)
        n = len(self.units)
        self.leaf: list[Tensor | None] = [None] * n    # the gathered flat buffer of the current forward
        self.work: list[TracedWork | None] = [None] * n
        self.live = [False] * n                        # storage allocated (gathered or being gathered)
        self.fresh = [False] * n                       # the pending gather is a forward one (new leaf)
        self._pending: tuple[int, Tensor, Tensor, TracedWork] | None = None
        self._reduced = [False] * n
        self.peak_parameter_bytes = 0
        self.info["peak_parameter_bytes"] = 0
        for i in range(n):                             # placeholders: views of an empty buffer
            self.leaf[i] = torch.empty(self.units[i].padded, dtype=self.param_dtype, device=self.device)
            self._install(i)
            self.leaf[i].untyped_storage().resize_(0)
        self.root = next((i for i, u in enumerate(self.units) if u.name == "root"), None)
        self.blocks = [i for i, u in enumerate(self.units) if u.name != "root"]
        self._handles = [model.register_forward_pre_hook(self._before_model),
                         model.register_forward_hook(self._after_model)]
        for k, i in enumerate(self.blocks):
            block = model.get_submodule(self.units[i].name)
            self._handles.append(block.register_forward_pre_hook(self._before_block_hook(k)))
            self._handles.append(block.register_forward_hook(self._after_block_hook(k)))
        self._frozen_mixed_check()

    def _frozen_mixed_check(self) -> None:
        if self.param_dtype != torch.float32 and any(not p.requires_grad for p in self.model.parameters()):
            raise ParallelLabError("frozen parameters with optimizer='fsdp2-mixed' (bf16 compute) are not "
                                   "supported (they would stay fp32); use optimizer='adam-fp32'")

    # ---- gather / free -----------------------------------------------------------------------------
    def _start_gather(self, i: int, fresh: bool) -> None:
        """Launch unit ``i``'s all-gather (async). ``fresh``: into a new leaf (a forward), else refill the
        current leaf's storage (before backward; autograd's saved views see the data again)."""
        if self.live[i]:
            return
        u = self.units[i]
        if fresh:
            self.leaf[i] = torch.empty(u.padded, dtype=self.param_dtype, device=self.device)
        else:
            self.leaf[i].untyped_storage().resize_(u.padded * self.leaf[i].element_size())
        self.live[i], self.fresh[i] = True, fresh
        self._sample()
        src = self.shards[i].detach()
        if src.dtype != self.param_dtype:
            src = src.to(self.param_dtype)
        self.work[i] = self.tracer.all_gather(self.leaf[i].data, src, "dp", async_op=True)

    def _wait_gather(self, i: int) -> None:
        """Wait for unit ``i``'s gather (starting it if needed); a forward gather installs new views."""
        if not self.live[i]:
            self._start_gather(i, fresh=True)
        if self.work[i] is None:
            return
        self.work[i].wait()
        self.work[i] = None
        leaf = self.leaf[i]
        if self.fresh[i]:
            if torch.is_grad_enabled():
                leaf.requires_grad_(True)
                leaf.register_post_accumulate_grad_hook(lambda t, i=i: self._on_grad(i, t))
                self._reduced[i] = False
            self._install(i)
        if self.rt is not None and self.rt.meter is not None:
            self.rt.meter.exclude(leaf)                # gathered parameters are not activations

    def _install(self, i: int) -> None:
        """Point the model's attributes at views of unit ``i``'s gathered buffer."""
        for view, per_param in zip(self.units[i].split(self.leaf[i]), self.locations[i], strict=True):
            for mod, attr in per_param:
                setattr(mod, attr, view)

    def _free(self, i: int) -> None:
        if not self.live[i]:
            return
        if self.work[i] is not None:                   # never free a buffer a collective still writes
            self.work[i].wait()
            self.work[i] = None
        leaf = self.leaf[i]
        if self.rt is not None and self.rt.meter is not None:
            self.rt.meter.include(leaf)                # before the address can be reused
        leaf.untyped_storage().resize_(0)
        self.live[i] = False

    def _sample(self) -> None:
        """Peak parameter bytes: shards + gathered buffers + any parameters the model still holds."""
        live = storage_bytes(self.shards) + storage_bytes(self.model.parameters())
        live += sum(self.leaf[i].untyped_storage().nbytes() for i in range(len(self.units)) if self.live[i])
        if live > self.peak_parameter_bytes:
            self.peak_parameter_bytes = live
            self.info["peak_parameter_bytes"] = live

    # ---- hooks ---------------------------------------------------------------------------------------
    def _before_model(self, module: nn.Module, args: Any) -> None:
        if self.root is not None:
            self._start_gather(self.root, fresh=True)
        if self.blocks:
            self._start_gather(self.blocks[0], fresh=True)       # prefetch the first block
        if self.root is not None:
            self._wait_gather(self.root)

    def _after_model(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled() and self.root is not None:   # no backward will come
            self._free(self.root)

    def _before_block_hook(self, k: int):
        def hook(module: nn.Module, args: Any) -> None:
            i = self.blocks[k]
            self._start_gather(i, fresh=True)
            if k + 1 < len(self.blocks):
                self._start_gather(self.blocks[k + 1], fresh=True)   # prefetch: overlaps this block
            self._wait_gather(i)
        return hook

    def _after_block_hook(self, k: int):
        def hook(module: nn.Module, args: Any, output: Tensor) -> Tensor | None:
            i = self.blocks[k]
            self._free(i)
            if torch.is_grad_enabled() and isinstance(output, Tensor) and output.requires_grad:
                return RegatherBeforeBackward.apply(output, self, k)
            return None
        return hook

    def _before_block_backward(self, k: int) -> None:
        i = self.blocks[k]
        self._start_gather(i, fresh=False)
        if k > 0:
            self._start_gather(self.blocks[k - 1], fresh=False)      # prefetch the previous block
        self._wait_gather(i)

    # ---- gradients -----------------------------------------------------------------------------------
    def _on_grad(self, i: int, leaf: Tensor) -> None:
        """Unit ``i``'s flat gradient is complete: free the parameters, reduce-scatter the gradient."""
        grad = leaf.grad
        leaf.grad = None
        self._free(i)
        self._reduce_scatter(i, grad)

    def _reduce_scatter(self, i: int, grad: Tensor) -> None:
        self._complete()
        grad = grad.float() if grad.dtype != torch.float32 else grad     # reduce in fp32
        grad.div_(self.group_size)
        out = torch.empty(self.units[i].shard, dtype=torch.float32, device=self.device)
        work = self.tracer.reduce_scatter(out, grad, "dp", async_op=True)
        self._pending = (i, grad, out, work)
        self._reduced[i] = True

    def _complete(self) -> None:
        if self._pending is None:
            return
        i, _, out, work = self._pending
        self._pending = None
        work.wait()
        shard = self.shards[i]
        if shard.grad is None:
            shard.grad = out
        else:
            shard.grad.add_(out)

    def finish(self) -> None:
        for i in range(len(self.units)):              # a unit whose gradient never came: zeros, calls aligned
            if not self._reduced[i] and self.leaf[i].requires_grad:
                self._free(i)
                self._reduce_scatter(i, torch.zeros(self.units[i].padded, device=self.device))
        self._complete()

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        for s in self.shards:
            s.grad = None

    # ---- measurement and reporting ---------------------------------------------------------------------
    def measure_state(self) -> dict[str, int]:
        frozen = list(self.model.parameters())          # what the model still holds (frozen parameters)
        return measure_state(self.shards + frozen, self.optimizer, [s.grad for s in self.shards])

    def local_parameters(self) -> dict[str, Tensor]:
        """Full parameters by name, all-gathered from the shards (untraced: reporting, not training)."""
        out = {n: p.detach() for n, p in self.model.named_parameters()}
        out.update(self._gather_shards())
        return out

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()


# --------------------------------------------------------------------------------------------------
# Plug-in
# --------------------------------------------------------------------------------------------------

def check_zero12_options(stage: int, reduce: str, accumulate: str) -> None:
    """The ZeRO-1/2 variants (the rules of ``specs.check_zero_variants``, for the torch-style class)."""
    if stage not in (1, 2):
        raise ParallelLabError(f"Zero12 needs stage in {{1, 2}}, got stage={stage!r}; ZeRO-3 is Zero3")
    check_zero_variants(stage, reduce, accumulate, "Zero12")


def check_zero(spec: Any, plan: Plan) -> None:
    """Plans this file cannot run (``train.check_runnable`` calls it before any process starts)."""
    if plan.zero not in (1, 2, 3):
        raise ParallelLabError(f"apply_zero needs zero in {{1, 2, 3}}, got zero={plan.zero}")
    if plan.zero2_accumulate == "sharded" and plan.pp > 1:
        raise ParallelLabError("zero2_accumulate='sharded' with pp > 1 is not runnable here (the stages' "
                               "backward passes interleave); use zero2_accumulate='unsharded' with pp > 1")
    if plan.zero == 3 and plan.pp > 1:
        raise ParallelLabError("zero=3 with pp > 1 is not runnable here (a stage's micro-batches in flight "
                               "would share one gathered buffer per unit); use zero in {1, 2} with pp > 1")
    if plan.optimizer == MIXED and plan.zero != 3:
        raise ParallelLabError("optimizer='fsdp2-mixed' is FSDP2's mixed precision and runs with zero=3 "
                               "only; use zero=3, or optimizer='adam-fp32'")


def apply_zero(rt: Any) -> None:
    """Set ``rt.dp`` to the ZeRO stage of ``rt.plan`` over the gradient group (``dp``, or ``dp x cp``)."""
    plan, grid = rt.plan, rt.grid
    check_zero(None, plan)
    g = rt.grad_group_size
    if plan.zero == 3:
        index = grid.ranks[grid.grad_group].index(grid.rank)
        zero: Any = Zero3(rt.model, plan, rt.tracer, g, index, rt)
    else:
        cls, defaults = _optimizer_of(plan)
        zero = Zero12(rt.model.parameters(), cls, stage=plan.zero, group=rt.tracer.group("dp"),
                      units=group_units(trainable(rt.model), plan.zero_unit), reduce=plan.zero1_reduce,
                      accumulate=plan.zero2_accumulate, tracer=rt.tracer, finish_in_backward=False, **defaults)
        zero.model = rt.model
    rt.dp = zero
    rt.extras.setdefault("reports", {})["zero"] = lambda: dict(zero.info)     # -> RankResult.info["zero"]
