"""Data parallelism: every rank holds the whole model, trains on its slice of the batch, and the ranks
average their gradients before the optimizer step, ``g = (1/n) sum_r g_r`` (Li et al. 2020, "PyTorch
Distributed"). Used the way torch's ``DistributedDataParallel`` is::

    model = BucketedDDP(model, bucket_mb=25)      # or NaiveDDP(model); group=None: the default group
    opt = torch.optim.AdamW(model.parameters())   # any torch optimizer
    opt.zero_grad(); model(x).sum().backward(); opt.step()

* :class:`NaiveDDP`: after backward, one all-reduce per gradient, in reverse registration order.
* :class:`BucketedDDP`: gradients live in flat buckets (``p.grad`` a view into its bucket, torch's
  ``gradient_as_bucket_view=True``); a complete bucket's async all-reduce starts at once, overlapping
  the rest of backward. Buckets (``sharding.pack_buckets``): reverse registration order, closed before
  exceeding ``bucket_mb * 10**6`` bytes, at least one gradient each.

The library's loop drives the same classes through :class:`LocalGrads`; the collectives are plain
``torch.distributed`` calls (``dp_communications.py``). Details: docs/data_parallel.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from parallel_lab.distributed import probe
from parallel_lab.distributed.data_parallel.dp_communications import all_reduce_sum, broadcast_from_first
from parallel_lab.distributed.model.model import make_optimizer
from parallel_lab.distributed.model.state import measure_state, storage_bytes
from parallel_lab.sharding import pack_buckets
from parallel_lab.specs import Plan

Named = list[tuple[str, nn.Parameter]]


def trainable(model: nn.Module) -> Named:
    """``(name, parameter)`` with ``requires_grad``, in registration order (a tied weight once)."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def queue_at_end_of_backward(fn: Any) -> None:
    """Run ``fn()`` once the current backward pass has finished (torch's DDP and FSDP use the same hook
    of the autograd engine); call from inside a backward hook."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


class NoSync:
    """The sync switch of the DDP wrappers and ZeRO (ZeRO-3 ignores it): ``require_backward_grad_sync`` (torch
    DDP's name for "this backward synchronises", set by the owner's ``__init__``) and :meth:`no_sync`."""

    require_backward_grad_sync: bool

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally (torch DDP's ``no_sync``; ZeRO-2 with
        ``accumulate="sharded"`` reduce-scatters every pass regardless)."""
        old, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old


class DataParallel(NoSync, nn.Module):
    """What both DDP wrappers share: the wrapped module, the group, the hooks and the sync switch.

    ``finish_in_backward``: average at the end of every synchronising backward (torch-style use); the
    library's loop passes False and calls :meth:`finish` itself (a pipeline step runs several backward
    passes per micro-batch).
    """

    def __init__(self, module: nn.Module, group: Any = None, *, finish_in_backward: bool = True):
        super().__init__()
        self.module = module
        self.group = group
        self.group_size = dist.get_world_size(group)
        # torch DDP's convention: names the module asks DDP to leave alone (expert parallelism's experts)
        ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self.named = [(n, p) for n, p in trainable(module) if n not in ignore]
        self.params = [p for _, p in self.named]
        self.require_backward_grad_sync = True        # torch DDP's name for "this backward synchronises"
        self.finish_in_backward = finish_in_backward
        self._active = False                          # a synchronising backward started, not yet finished
        broadcast_from_first([*(p for n, p in module.named_parameters() if n not in ignore), *module.buffers()],
                             group)
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def _hook(self, p: Tensor) -> None:
        if not self.require_backward_grad_sync:
            return
        if not self._active:
            self._active = True
            if self.finish_in_backward:
                queue_at_end_of_backward(self.finish)
        self._on_grad(p)

    def _on_grad(self, p: Tensor) -> None:
        """A gradient of a synchronising backward is complete."""

    def finish(self) -> None:
        """Complete the averaging of this step's gradients (unused parameters contribute zeros)."""
        self._sync()
        self._active = False

    def _sync(self) -> None:
        raise NotImplementedError

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()


class NaiveDDP(DataParallel):
    """All-reduce every gradient after backward, one call per parameter, in reverse registration order."""

    def _sync(self) -> None:
        for p in reversed(self.params):
            if p.grad is None:                # unused on this step: contribute zeros, keep calls aligned
                p.grad = torch.zeros_like(p)
            all_reduce_sum(p.grad, self.group)
            p.grad.div_(self.group_size)


class Bucket:
    """A flat gradient buffer and, for each of its parameters, the view its ``.grad`` should be."""

    def __init__(self, index: int, params: Named, device: torch.device, dtype: torch.dtype):
        self.index = index
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.buffer = torch.zeros(sum(p.numel() for p in self.params), device=device, dtype=dtype)
        self.views: list[Tensor] = []
        off = 0
        for p in self.params:
            self.views.append(self.buffer[off:off + p.numel()].view_as(p))     # (numel,) -> p.shape
            p.grad = self.views[-1]
            off += p.numel()
        self.ready: set[int] = set()
        self.work: Any = None                            # the all-reduce in flight (a torch Work)

    def adopt(self, j: int) -> None:
        """Make parameter ``j``'s gradient the bucket's view: copy it in if it lives elsewhere (after
        ``zero_grad(set_to_none=True)`` autograd allocates a fresh ``.grad``); zeros if it has none."""
        p, view = self.params[j], self.views[j]
        g = p.grad
        if g is None:
            view.zero_()
        elif g is not view:                            # autograd accumulates into the view in place
            view.copy_(g)                              # (by identity: fake tensors have no data pointer)
        p.grad = view

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.params)


def bucket_plan(named: Named, bucket_mb: float) -> list[Named]:
    """Group ``named`` (registration order) into buckets by ``sharding.pack_buckets``, the rule the prediction
    uses: reverse registration order, a bucket closes before it would exceed ``bucket_mb`` MB."""
    by_name = dict(named)
    items = [(name, p.numel() * p.element_size()) for name, p in reversed(named)]
    return [[(name, by_name[name]) for name, _ in bucket] for bucket in pack_buckets(items, bucket_mb * 1e6)]


class BucketedDDP(DataParallel):
    """Gradients in flat buckets of ``bucket_mb`` MB; each bucket's async all-reduce starts as soon as
    backward has produced all its gradients (and all earlier buckets have started)."""

    def __init__(self, module: nn.Module, bucket_mb: float = 25.0, group: Any = None, *,
                 finish_in_backward: bool = True):
        super().__init__(module, group, finish_in_backward=finish_in_backward)
        dev = self.params[0].device if self.params else torch.device("cpu")
        dtype = self.params[0].dtype if self.params else torch.float32
        self.buckets = [Bucket(i, b, dev, dtype) for i, b in enumerate(bucket_plan(self.named, bucket_mb))]
        self._where = {id(p): (b, j) for b in self.buckets for j, p in enumerate(b.params)}
        self._next = 0                       # index of the next bucket to launch

    def _hook(self, p: Tensor) -> None:
        if not self.require_backward_grad_sync:        # accumulating: the gradient lives in its bucket too
            bucket, j = self._where[id(p)]
            bucket.adopt(j)
            return
        super()._hook(p)

    def _on_grad(self, p: Tensor) -> None:
        bucket, j = self._where[id(p)]
        bucket.adopt(j)
        bucket.ready.add(j)
        while self._next < len(self.buckets) and self.buckets[self._next].complete:
            self._launch(self.buckets[self._next])

    def _launch(self, bucket: Bucket) -> None:
        for j in range(len(bucket.params)):            # parameters without a gradient this step: zeros
            if j not in bucket.ready:
                bucket.adopt(j)
        bucket.buffer.div_(self.group_size)            # average: divide first, then sum over the group
        bucket.work = all_reduce_sum(bucket.buffer, self.group, async_op=True)
        self._next += 1

    def _sync(self) -> None:
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.ready.clear()
            bucket.work = None
        self._next = 0


class LocalGrads:
    """The library loop's data-parallel object (``rt.dp``): a DDP wrapper (or none: a gradient group of
    one rank) plus the plan's optimizer. ZeRO's classes (``distributed/zero/zero.py``) have the same methods.

    Per step: ``zero_grad()``; per micro-batch ``set_sync(last)`` then backward; ``finish()``; ``step()``.
    ``measure_state()`` reports the gradients at their peak over the step: sampled at every micro-batch
    boundary and after ``finish`` (the gradients held between micro-batches; within one backward a
    unit's or bucket's transient copy is a communication buffer, ``ledger_buffers.comm_buffer_bytes``).
    """

    def __init__(self, model: nn.Module, plan: Plan, ddp: DataParallel | None = None):
        self.model, self.plan, self.ddp = model, plan, ddp
        self.named = trainable(model)
        self.params = [p for _, p in self.named]
        self.optimizer = make_optimizer(self.params, plan)
        self.peak_gradient_bytes = 0
        self.peak_held_bytes = 0                         # gradients and buckets together

    @property
    def buckets(self) -> list[Bucket]:
        return getattr(self.ddp, "buckets", [])

    def sample_gradients(self) -> None:
        grads = [p.grad for p in self.params]
        self.peak_gradient_bytes = max(self.peak_gradient_bytes, storage_bytes(grads))
        if self.buckets:
            self.peak_held_bytes = max(self.peak_held_bytes, storage_bytes([*grads, *(b.buffer for b in self.buckets)]))

    def set_sync(self, sync: bool) -> None:
        """Whether the coming backward is the step's last (gradients are synchronised during/after it)."""
        self.sample_gradients()
        if self.ddp is not None:
            self.ddp.require_backward_grad_sync = sync

    def finish(self) -> None:
        """Complete the gradient synchronisation of this step."""
        if self.ddp is not None:
            self.ddp.finish()
        self.sample_gradients()
        if self.buckets:              # what the buckets hold beyond the gradients (0: the gradients are views)
            probe.sample("gradient_buckets", nbytes=self.peak_held_bytes - self.peak_gradient_bytes)

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)       # the buckets adopt the new gradients (see Bucket)
        self.peak_gradient_bytes = self.peak_held_bytes = 0

    def measure_state(self) -> dict[str, int]:
        """Parameters, gradients (peak of the step), optimizer states of this rank, in bytes."""
        out = measure_state(self.model.parameters(), self.optimizer, [p.grad for p in self.params])
        out["gradients"] = max(out["gradients"], self.peak_gradient_bytes)
        return out

    def local_parameters(self) -> dict[str, Tensor]:
        """This rank's parameters by name, as full (un-sharded by ZeRO) tensors; untraced. Mixed precision:
        the fp32 master copies (``MasterAdamW``), the weights the bf16 parameters are rounded from."""
        masters = self.optimizer.master_of() if hasattr(self.optimizer, "master_of") else {}
        return {n: masters.get(id(p), p).detach() for n, p in self.model.named_parameters()}


def apply_dp(model: nn.Module, plan: Plan, group: Any, group_size: int) -> LocalGrads:
    """The data-parallel gradient handling of ``plan`` for ``model`` over ``group`` (the gradient group:
    dp, or dp x cp; ``group_size`` ranks); ZeRO stages live in distributed/zero/zero.py."""
    if group_size == 1:
        return LocalGrads(model, plan)
    if plan.dp_kind == "naive":
        ddp: DataParallel = NaiveDDP(model, group, finish_in_backward=False)
    else:
        ddp = BucketedDDP(model, plan.bucket_mb, group, finish_in_backward=False)
    return LocalGrads(model, plan, ddp)


def describe_buckets(dp: Any) -> list[dict[str, Any]]:
    """Bucket sizes and contents of a BucketedDDP (for reports and tests)."""
    return [{"index": b.index, "bytes": b.nbytes, "params": list(b.names)}
            for b in getattr(dp, "buckets", [])]
