"""ZeRO-3 / FSDP: parameters, gradients and optimizer states sharded over the gradient group.

Zhao et al. 2023, "PyTorch FSDP"; Rajbhandari et al. 2020 (ZeRO stage 3). Per rank ``(4 + 4 + 8) Psi / g``
bytes of fp32 AdamW state, plus the units gathered now (``ledger_buffers.zero3_gathered_bytes``: the root
unit and two blocks). :class:`Zero3` keeps only each unit's owned shard (``S_u`` elements); the model's
parameters are views into a gathered flat buffer (FSDP1's ``use_orig_params=False``). Per micro-batch a
block unit is all-gathered before its forward (the next one prefetched), freed after it, all-gathered
again before its backward (a hook on the block's output gradient), and its flat gradient reduce-scattered into
the gradient shard; the root unit is gathered once and kept until its gradient is complete. Under a
pipeline the stage's units are gathered once per step and reduce-scattered once
(``reshard_after_forward=False``). Units: ``units.py``; the collectives (``comm._zero_collectives``):
``zero_communications.py``. The full mechanism, memory and mixed precision: docs/zero.md.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from parallel_lab.distributed import probe
from parallel_lab.distributed.data_parallel.data_parallel import NoSync, trainable
from parallel_lab.distributed.model.state import measure_state, storage_bytes
from parallel_lab.distributed.zero.torch_loop import (
    clip_sharded_,
    patch_model_zero_grad,
    zero3_load_state_dict,
    zero3_state_dict,
    zero_shard_grads,
)
from parallel_lab.distributed.zero.units import (
    MIXED,
    build_units,
    complete_partial_grads,
    gather_shards,
    shard_optimizer,
)
from parallel_lab.distributed.zero.zero_communications import all_gather_flat, reduce_scatter_sum, wait_posted
from parallel_lab.errors import ParallelLabError
from parallel_lab.specs import Plan


class _Zero:
    """What ZeRO-3 shares with the library loop's interface: the units, the shard index, the optimizer."""

    stage = 0

    def __init__(self, model: nn.Module, plan: Plan, group: Any, group_size: int, index: int):
        self.model, self.plan, self.group = model, plan, group
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
        cls, defaults = shard_optimizer(self.plan)
        return cls(params, **defaults)

    def _gather_shards(self) -> dict[str, Tensor]:
        return gather_shards(self.units, self.shards, self.group, self.device)


class Zero3(NoSync, _Zero):
    """ZeRO-3 / FSDP: parameters, gradients and optimizer states sharded; see the module docstring.

    ``group``: the gradient group. ``rt``: the Runtime (for its phases under a pipeline). Hooks are
    installed on the model
    (root unit) and on each block with a unit (``zero_unit="block"``).
    """

    stage = 3

    def __init__(self, model: nn.Module, plan: Plan, group: Any, group_size: int, index: int,
                 rt: Any = None):
        super().__init__(model, plan, group, group_size, index)
        self.rt = rt
        mixed = plan.optimizer == MIXED and plan.dtype == "bf16"
        self.param_dtype = torch.bfloat16 if mixed else torch.float32
        # Where each trainable parameter lives (a shared parameter may be registered under several names).
        where: dict[int, list[tuple[nn.Module, str]]] = {}
        names: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            if p.requires_grad:
                mod, _, attr = name.rpartition(".")
                where.setdefault(id(p), []).append((model.get_submodule(mod), attr))
                names.setdefault(id(p), []).append(name)
        self.aliases = {n[0]: n for n in names.values()}    # a parameter's names (state dicts)
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
        self.accumulated: list[Tensor | None] = [None] * n   # under a pipeline: fp32 sums over micro-batches
        self.work: list[Any] = [None] * n              # each unit's gather in flight (a torch Work)
        self.live = [False] * n                        # storage allocated (gathered or being gathered)
        self.fresh = [False] * n                       # the pending gather is a forward one (new leaf)
        self._pending: tuple[int, Tensor, Tensor, Any] | None = None    # the reduce-scatter in flight
        self._reduced = [False] * n
        self._finished = True                          # no gradient reduced since the last finish()
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
        # Under a pipeline a stage's micro-batches are in flight together and the executor calls the blocks
        # directly: the stage's units are gathered once per step (at zero_grad), kept through every micro-batch,
        # and reduce-scattered once at finish (FSDP's reshard_after_forward=False, torchtitan's choice for PP).
        self.keep = plan.pp > 1
        self.require_backward_grad_sync = True          # no_sync(): accepted; see docs/runs.md
        patch_model_zero_grad(self)

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
        self.work[i] = all_gather_flat(self.leaf[i].data, src, self.group, async_op=True)

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
        probe.not_activations(leaf)                    # gathered parameters are not activations

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
        probe.activations_again(leaf)                  # before the address can be reused
        leaf.untyped_storage().resize_(0)
        self.live[i] = False

    def _sample(self) -> None:
        """Parameter bytes now: shards + gathered buffers + any parameters the model still holds."""
        if not probe.on():
            return
        gathered = sum(self.leaf[i].untyped_storage().nbytes() for i in range(len(self.units)) if self.live[i])
        probe.sample("gathered_units", nbytes=gathered)
        probe.sample("parameters", nbytes=storage_bytes(self.shards) + storage_bytes(self.model.parameters())
                     + gathered)

    # ---- hooks ---------------------------------------------------------------------------------------
    def _before_model(self, module: nn.Module, args: Any) -> None:
        if self.keep:
            return
        if self.root is not None:
            self._start_gather(self.root, fresh=True)
        if self.blocks:
            self._start_gather(self.blocks[0], fresh=True)       # prefetch the first block
        if self.root is not None:
            self._wait_gather(self.root)

    def _after_model(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled() and self.root is not None:   # no backward will come
            self._free(self.root)
        if not self.blocks:                # one unit: its forward is the first block's
            self._complete_last_backward()

    def _complete_last_backward(self) -> None:
        """The previous micro-batch's last reduce-scatter (the root unit's, its fp32 input 4 B per element),
        waited for once the next forward's first block has run: it overlaps that block, and does not live
        on through the rest of the micro-batch (it did, to the first reduce-scatter of the next backward)."""
        if self._pending is not None and not self.keep:
            self._complete()

    def _before_block_hook(self, k: int):
        def hook(module: nn.Module, args: Any) -> None:
            i = self.blocks[k]
            self._start_gather(i, fresh=True)
            if k + 1 < len(self.blocks):
                self._start_gather(self.blocks[k + 1], fresh=True)   # prefetch: overlaps this block
            self._wait_gather(i)
        return hook

    def _after_block_hook(self, k: int):
        def hook(module: nn.Module, args: Any, output: Tensor) -> None:
            if self.keep:
                return
            i = self.blocks[k]
            self._free(i)
            if k == 0:
                self._complete_last_backward()
            if torch.is_grad_enabled() and isinstance(output, Tensor) and output.requires_grad:
                # FSDP2's pre-backward hook; it returns None, so the gradient passes unchanged
                output.register_hook(lambda grad: self._before_block_backward(k))
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
        if self.keep:                                  # under a pipeline: summed in fp32, reduced in finish
            self._accumulate(i, leaf)
            return
        grad = leaf.grad
        leaf.grad = None
        self._free(i)
        self._reduce_scatter(i, grad)

    def _accumulate(self, i: int, leaf: Tensor) -> None:
        """Under a pipeline: add this micro-batch's flat gradient of unit ``i`` into its fp32 accumulator
        (FSDP2 without gradient sync accumulates the unsharded gradient in ``reduce_dtype``); the
        compute-dtype gradient and the accumulators are alive together for a moment (the sampled peak)."""
        grad, self._finished = leaf.grad, False
        if grad.dtype == torch.float32:                # fp32 training: the leaf's own gradient accumulates
            self.accumulated[i] = grad
        elif self.accumulated[i] is None:
            self.accumulated[i] = grad.float()
        else:
            self.accumulated[i].add_(grad)
        held = sum(a.untyped_storage().nbytes() for a in self.accumulated if a is not None)
        if grad is not self.accumulated[i]:
            held += grad.untyped_storage().nbytes()
            leaf.grad = None
        probe.sample("held_gradients", nbytes=held)

    def _reduce_scatter(self, i: int, grad: Tensor) -> None:
        self._complete()
        self._finished = False
        full = grad
        grad = grad.float() if grad.dtype != torch.float32 else grad     # reduce in fp32
        if not self.keep:                              # the unit's gradient and its fp32 copy, both alive
            inflight = full.untyped_storage().nbytes() + (grad.untyped_storage().nbytes() if grad is not full else 0)
            probe.sample("reducing_gradients", nbytes=inflight)
        del full
        grad.div_(self.group_size)
        out = torch.empty(self.units[i].shard, dtype=torch.float32, device=self.device)
        work = reduce_scatter_sum(out, grad, self.group, async_op=True)
        self._pending = (i, grad, out, work)
        self._reduced[i] = True

    def _complete(self) -> None:
        """Wait for the reduce-scatter in flight; its output is (or adds to) the unit's gradient shard."""
        done, self._pending = wait_posted(self._pending), None
        if done is None:
            return
        i, _, out = done
        grad = self.shards[i].grad
        self.shards[i].grad = out if grad is None else grad.add_(out)

    def finish(self) -> None:
        if self.keep:                                  # every unit's gradient summed over the micro-batches
            for i in reversed(range(len(self.units))):
                acc, self.accumulated[i] = self.accumulated[i], None
                grad = acc if acc is not None else torch.zeros(self.units[i].padded, device=self.device)
                self.leaf[i].grad = None
                self._free(i)
                self._reduce_scatter(i, grad)
                del acc, grad
        for i in range(len(self.units)):              # a unit whose gradient never came: zeros, calls aligned
            if not self._reduced[i] and self.leaf[i].requires_grad:
                self._free(i)
                self._reduce_scatter(i, torch.zeros(self.units[i].padded, device=self.device))
        self._complete()
        self._finished = True

    def step(self) -> None:
        if not self._finished:                         # a plain torch loop calls no finish()
            self.finish()
        self.optimizer.step()

    def complete_partial_grads(self, names: list[str], all_reduce: Any) -> None:
        """Gradients of ``names`` that are partial over another group (TP with SP), after :meth:`finish`, on
        the fp32 gradient shards (``units.complete_partial_grads``)."""
        grads = [s.grad for s in self.shards]
        complete_partial_grads(self.units, grads, names, all_reduce, torch.float32, self.device)
        for s, g in zip(self.shards, grads, strict=True):
            s.grad = g

    def zero_grad(self, set_to_none: bool = True) -> None:
        zero_shard_grads(self.shards, set_to_none)
        if self.keep:                                  # gather the whole stage for this step
            with self.rt.phase_as("forward") if self.rt is not None else nullcontext():
                for i in range(len(self.units)):
                    self._start_gather(i, fresh=True)
                for i in range(len(self.units)):
                    self._wait_gather(i)

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
        self.model.__dict__.pop("zero_grad", None)     # patch_model_zero_grad's

    # ---- a plain torch loop's calls (torch_loop.py; docs/runs.md) --------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` of the full averaged gradients (FSDP1's method), between
        backward and :meth:`step`: the model has no parameters for the plain torch call to see."""
        if not self._finished:
            self.finish()
        for s in self.shards:
            s.grad = s.grad if s.grad is not None else torch.zeros_like(s)
        grads = [s.grad for s in self.shards]
        return clip_sharded_(grads, grads, max_norm, norm_type, self.group)

    def state_dict(self) -> dict[str, Tensor]:
        return zero3_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Tensor], strict: bool = True) -> None:
        zero3_load_state_dict(self, state_dict, strict)
