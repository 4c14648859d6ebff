"""ZeRO-1, ZeRO-2 and ZeRO-3 (FSDP-style): data parallelism that shards the model state over the ranks.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models". With
``g`` ranks in the gradient group and ``Psi`` trainable parameters, per rank (fp32 AdamW: 4 + 4 + 8 bytes
per parameter)::

    stage 1  optimizer states sharded      4 Psi +  4 Psi     + 8 Psi / g
    stage 2  + gradients sharded           4 Psi + (4 + 8) Psi / g
    stage 3  + parameters sharded                 (4 + 4 + 8) Psi / g   (+ the units gathered now)

:class:`Zero12` (torch's ``ZeroRedundancyOptimizer`` convention): as soon as a unit's gradients are
complete in the step's last backward, its flat gradient is reduce-scattered (asynchronously, averaged);
each rank steps its owned shard of ``S_u`` elements, then the updated parameters are all-gathered. ZeRO-1
keeps the full ``p.grad``, ZeRO-2 frees it and keeps a gradient shard. ZeRO-3 lives in ``fsdp.py``. Units:
``units.py``; the collectives, one per unit (``comm._zero_collectives``): ``zero_communications.py``.
Variants, comm buffers and mixed precision: docs/zero.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from parallel_lab.distributed import probe
from parallel_lab.distributed.data_parallel.data_parallel import Named, NoSync, queue_at_end_of_backward, trainable
from parallel_lab.distributed.data_parallel.dp_communications import all_reduce_sum, broadcast_from_first
from parallel_lab.distributed.model.state import measure_state, optimizer_state_tensors, storage_bytes
from parallel_lab.distributed.zero.fsdp import Zero3
from parallel_lab.distributed.zero.torch_loop import clip_sharded_, load_zero12_shard_state, zero12_shard_state
from parallel_lab.distributed.zero.units import (
    MIXED,
    Unit,
    complete_partial_grads,
    gather_shards,
    group_index,
    group_units,
    shard_optimizer,
)
from parallel_lab.distributed.zero.zero_communications import all_gather_flat, reduce_scatter_sum, wait_posted
from parallel_lab.errors import ParallelLabError
from parallel_lab.specs import Plan, check_zero_variants

W_SCHEDULES = ("zb-h1", "zb-v", "dualpipev")

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


class Zero12(NoSync, torch.optim.Optimizer):
    """ZeRO-1 (``stage=1``) or ZeRO-2 (``stage=2``): an optimizer that also synchronises the gradients.

    Torch's calling convention, ``Zero12(params, optimizer_class=torch.optim.AdamW, lr=...)``
    (``ZeroRedundancyOptimizer``'s), with any torch optimizer class; no DDP wrapper is needed: the
    gradients are reduced by hooks during backward, rank 0's parameters are broadcast at construction.
    ``group``: the data-parallel group (default: the default group). ``units``: lists of parameters
    sharded together (default: one unit of all). ``reduce`` (ZeRO-1): ``"reduce_scatter"`` (the paper) or
    ``"all_reduce"`` (torch's ZeroRedundancyOptimizer under DDP). ``accumulate`` (ZeRO-2):
    ``"unsharded"`` (hold the full gradients until the last micro-batch) or ``"sharded"``
    (reduce-scatter every micro-batch). ``no_sync()`` marks accumulation passes. The library's loop
    passes ``finish_in_backward=False`` and calls ``set_sync``/``finish`` itself.
    """

    def __init__(self, params: Iterable[Any], optimizer_class: Any = torch.optim.AdamW, *, stage: int = 1,
                 group: Any = None, units: UnitsArg = None, reduce: str = "reduce_scatter",
                 accumulate: str = "unsharded", finish_in_backward: bool = True, **defaults: Any):
        super().__init__(list(params), defaults)
        if len(self.param_groups) != 1:
            raise ParallelLabError(f"Zero12 takes one parameter group, got {len(self.param_groups)}; pass "
                                   f"the parameters as one list and the options as keyword arguments")
        check_zero12_options(stage, reduce, accumulate)
        self.stage, self.reduce, self.accumulate = stage, reduce, accumulate
        self.group, self.group_size, self.index = group, dist.get_world_size(group), group_index(group)
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
        self._pending: tuple[int, Tensor, Tensor | None, Any] | None = None     # the call in flight
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    @property
    def every_microbatch(self) -> bool:
        return self.stage == 2 and self.accumulate == "sharded"

    # ---- gradient synchronisation ----------------------------------------------------------------
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
            probe.sample("flat_gradients", [flat])
            work = all_reduce_sum(flat, self.group, async_op=True)
            self._pending = (i, flat, None, work)
            return
        out = torch.empty(u.shard, dtype=flat.dtype, device=self.device)
        # ZeRO-1's output is a temporary (written into p.grad); ZeRO-2's becomes the gradient shard, unless
        # one exists from an earlier micro-batch (then it is added to it)
        temp = self.stage == 1 or self.grad_shards[i] is not None
        probe.sample("flat_gradients", [flat, out] if temp else [flat])
        work = reduce_scatter_sum(out, flat, self.group, async_op=True)
        if self.stage == 2:                            # ZeRO-2: the full gradient lives on in `flat` only
            for p in u.params:
                p.grad = None
        self._pending = (i, flat, out, work)

    def _complete(self) -> None:
        """Wait for the call in flight; ZeRO-2 keeps (or adds to) the gradient shard, ZeRO-1 the owned elements."""
        done, self._pending = wait_posted(self._pending), None
        if done is None:
            return
        i, flat, out = done
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
            src = shard.detach().to(self.dtype)        # fp32: the shard cut from the parameters; bf16: a copy
            probe.sample("gathered_parameters", [full, src])
            all_gather_flat(full, src, self.group)
            for p, v in zip(u.params, u.split(full), strict=True):
                p.copy_(v)
            shard.grad = None
            if not self.mixed:
                shard.data = torch.empty(0, device=self.device)
        self.grad_shards = [None] * len(self.units)   # the step used them (also after a model.zero_grad())
        self._synced = False
        return loss

    def complete_partial_grads(self, names: list[str], all_reduce: Any) -> None:
        """ZeRO-2: gradients of ``names`` that are partial over another group (TP with SP), after :meth:`finish`,
        on the gradient shards (``units.complete_partial_grads``). ZeRO-1 keeps full ``p.grad``: complete
        those instead."""
        if self.stage != 2:
            raise ParallelLabError(f"complete_partial_grads is ZeRO-2's (stage={self.stage} keeps full p.grad)")
        complete_partial_grads(self.units, self.grad_shards, names, all_reduce, self.dtype, self.device)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self.grad_shards = [None] * len(self.units)
        self._synced = False
        self.peak_gradient_bytes = 0

    # ---- a plain torch loop's calls (torch_loop.py; docs/runs.md) ----------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` of the full averaged gradients, between backward and
        :meth:`step` (the plain torch call sees only local or no gradients here)."""
        self.finish()
        if self.stage == 2:
            self.grad_shards = [g if g is not None else torch.zeros(u.shard, dtype=self.dtype, device=self.device)
                                for g, u in zip(self.grad_shards, self.units, strict=True)]
            owned = scale = list(self.grad_shards)
        else:                                          # ZeRO-1: the owned elements of p.grad are averaged
            owned = [u.owned([p.grad for p in u.params], torch.float32, self.device) for u in self.units]
            scale = [p.grad for p in self.params if p.grad is not None]
        return clip_sharded_(owned, scale, max_norm, norm_type, self.group)

    def layout(self) -> dict[str, Any]:
        return {"stage": self.stage, "group_size": self.group_size, "index": self.index,
                "units": [u.numel for u in self.units]}

    def state_dict(self) -> dict[str, Any]:
        """Torch's param groups (lr, ...) and this rank's shards' optimizer states (``torch_loop.py``)."""
        return {**super().state_dict(), **zero12_shard_state(self)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        load_zero12_shard_state(self, state_dict)
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})

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
    if plan.zero == 3 and plan.pp > 1 and plan.schedule in W_SCHEDULES:
        raise ParallelLabError(f"zero=3 with schedule={plan.schedule!r} is not runnable here: its W actions take "
                               "weight gradients of the stage's parameters, which ZeRO-3 replaces by views of "
                               "gathered buffers; use gpipe, 1f1b or interleaved with zero=3")
    if plan.optimizer == MIXED and plan.zero != 3:
        raise ParallelLabError("optimizer='fsdp2-mixed' is FSDP2's mixed precision and runs with zero=3 "
                               "only; use zero=3, or optimizer='adam-fp32'")


def apply_zero(rt: Any) -> None:
    """Set ``rt.dp`` to the ZeRO stage of ``rt.plan`` over the gradient group (``dp``, or ``dp x cp``)."""
    plan, grid = rt.plan, rt.grid
    check_zero(None, plan)
    g, group = rt.grad_group_size, grid.groups[grid.grad_group]
    if plan.zero == 3:
        index = grid.ranks[grid.grad_group].index(grid.rank)
        zero: Any = Zero3(rt.model, plan, group, g, index, rt)
    else:
        cls, defaults = shard_optimizer(plan)
        zero = Zero12(rt.model.parameters(), cls, stage=plan.zero, group=group,
                      units=group_units(trainable(rt.model), plan.zero_unit), reduce=plan.zero1_reduce,
                      accumulate=plan.zero2_accumulate, finish_in_backward=False, **defaults)
        zero.model = rt.model
    rt.dp = zero
    rt.extras.setdefault("reports", {})["zero"] = lambda: dict(zero.info)     # -> RankResult.info["zero"]
