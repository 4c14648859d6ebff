"""Data parallelism: every rank holds the whole model, trains on its slice of the batch, and the ranks
average their gradients before the optimizer step (the gradients of the mean loss over the global batch).

Three classes share one small interface that the training loop (``dist/train.py``) drives, and that the
ZeRO implementations (``dist/zero.py``) implement too:

* :class:`LocalGrads`: no synchronisation (a gradient group of one rank); the base class.
* :class:`NaiveDDP`: after the last backward of a step, one all-reduce per gradient, in reverse
  registration order (the order backward produces them), then divide by the group size.
* :class:`BucketedDDP` (Li et al. 2020, "PyTorch Distributed"): gradients live in flat *bucket* buffers
  (each ``p.grad`` is a view into its bucket, so no copy and no extra memory); a post-accumulate-grad
  hook marks a parameter ready, and as soon as a bucket is complete its asynchronous all-reduce is
  launched, overlapping with the rest of backward. The optimizer step waits for all buckets.

The interface, per step::

    dp.zero_grad()
    for i, micro_batch in enumerate(micro_batches):
        dp.set_sync(i == last)          # earlier micro-batches accumulate locally (DDP's no_sync)
        loss = ...; loss.backward()
    dp.finish()                         # complete the gradient synchronisation (wait, average)
    dp.step()                           # optimizer step (ZeRO: on the shard, then all-gather)

Bucket rule (the one ``parallel_lab.comm.ddp_buckets`` predicts): walk the trainable parameters in
reverse registration order; a bucket closes when adding the next gradient would make it exceed
``bucket_mb * 10**6`` bytes; a bucket holds at least one gradient. Buckets are all-reduced in that
order on every rank. Parameters with ``requires_grad=False`` take no part. Gradients are averaged over
the gradient group: ``dp``, or ``dp x cp`` with context parallelism (conventions).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from parallel_lab.comm import pack_buckets
from parallel_lab.distributed.instruments import CommTracer, TracedWork, measure_state
from parallel_lab.distributed.model import make_optimizer
from parallel_lab.specs import Plan


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` with ``requires_grad``, in registration order (a tied weight once)."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


class LocalGrads:
    """Gradients kept local (no data parallelism); the interface every data-parallel class implements.

    ``group_size``: ranks in the gradient group (for averaging); subclasses communicate over the
    tracer's ``"dp"`` group.
    """

    def __init__(self, model: nn.Module, plan: Plan, tracer: CommTracer, group_size: int = 1):
        self.model, self.plan, self.tracer, self.group_size = model, plan, tracer, group_size
        self.named = trainable(model)
        self.params = [p for _, p in self.named]
        self.optimizer = make_optimizer(self.params, plan)
        self.sync = True

    def set_sync(self, sync: bool) -> None:
        """Whether the coming backward is the step's last (gradients are synchronised during/after it)."""
        self.sync = sync

    def finish(self) -> None:
        """Complete the gradient synchronisation of this step."""

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def measure_state(self) -> dict[str, int]:
        """Parameters, gradients, optimizer states of this rank, in bytes (call before zero_grad)."""
        return measure_state(self.model.parameters(), self.optimizer, [p.grad for p in self.params])

    def local_parameters(self) -> dict[str, Tensor]:
        """This rank's parameters by name, as full (un-sharded by ZeRO) tensors; untraced. Mixed precision:
        the fp32 master copies (``MasterAdamW``), the weights the bf16 parameters are rounded from."""
        masters = self.optimizer.master_of() if hasattr(self.optimizer, "master_of") else {}
        return {n: masters.get(id(p), p).detach() for n, p in self.model.named_parameters()}


class NaiveDDP(LocalGrads):
    """All-reduce every gradient after backward, one call per parameter, in reverse registration order."""

    def finish(self) -> None:
        for p in reversed(self.params):
            if p.grad is None:                # unused on this step: contribute zeros, keep calls aligned
                p.grad = torch.zeros_like(p)
            self.tracer.all_reduce(p.grad, "dp")
            p.grad.div_(self.group_size)


class Bucket:
    """A flat gradient buffer and the parameters whose ``.grad`` are views into it."""

    def __init__(self, index: int, params: list[tuple[str, nn.Parameter]], device: torch.device,
                 dtype: torch.dtype):
        self.index = index
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.buffer = torch.zeros(sum(p.numel() for p in self.params), device=device, dtype=dtype)
        self.ready: set[int] = set()
        self.work: TracedWork | None = None
        off = 0
        for p in self.params:
            p.grad = self.buffer[off:off + p.numel()].view_as(p)
            off += p.numel()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.params)


Named = list[tuple[str, nn.Parameter]]


def bucket_plan(named: Named, bucket_mb: float) -> list[Named]:
    """Group ``named`` (registration order) into buckets by ``comm.pack_buckets``, the rule the prediction
    uses: reverse registration order, a bucket closes before it would exceed ``bucket_mb`` MB."""
    by_name = dict(named)
    items = [(name, p.numel() * p.element_size()) for name, p in reversed(named)]
    return [[(name, by_name[name]) for name, _ in bucket] for bucket in pack_buckets(items, bucket_mb * 1e6)]


class BucketedDDP(LocalGrads):
    """Gradients in flat buckets of ``plan.bucket_mb`` MB; each bucket's async all-reduce starts as soon as
    backward has produced all its gradients (and all earlier buckets have started)."""

    def __init__(self, model: nn.Module, plan: Plan, tracer: CommTracer, group_size: int = 1):
        super().__init__(model, plan, tracer, group_size)
        dev = self.params[0].device if self.params else torch.device("cpu")
        dtype = self.params[0].dtype if self.params else torch.float32
        plan_ = bucket_plan(self.named, plan.bucket_mb)
        self.buckets = [Bucket(i, b, dev, dtype) for i, b in enumerate(plan_)]
        self._where: dict[int, tuple[Bucket, int]] = {}
        for bucket in self.buckets:
            for j, p in enumerate(bucket.params):
                self._where[id(p)] = (bucket, j)
        self._next = 0                       # index of the next bucket to launch
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def _on_grad(self, p: Tensor) -> None:
        if not self.sync:
            return
        bucket, j = self._where[id(p)]
        bucket.ready.add(j)
        self._launch_ready()

    def _launch(self, bucket: Bucket) -> None:
        bucket.buffer.div_(self.group_size)            # average: divide first, then sum over the group
        bucket.work = self.tracer.all_reduce(bucket.buffer, "dp", async_op=True)

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].complete:
            self._launch(self.buckets[self._next])
            self._next += 1

    def finish(self) -> None:
        while self._next < len(self.buckets):          # buckets with unused parameters: launch anyway
            self._launch(self.buckets[self._next])
            self._next += 1
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.ready.clear()
            bucket.work = None
        self._next = 0

    def zero_grad(self) -> None:
        for bucket in self.buckets:          # keep p.grad as views into the buckets
            bucket.buffer.zero_()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()


def apply_dp(model: nn.Module, plan: Plan, tracer: CommTracer, group_size: int) -> LocalGrads:
    """The data-parallel gradient handling of ``plan`` for ``model`` (ZeRO stages live in dist/zero.py)."""
    if group_size == 1:
        return LocalGrads(model, plan, tracer, 1)
    cls = NaiveDDP if plan.dp_kind == "naive" else BucketedDDP
    return cls(model, plan, tracer, group_size)


def describe_buckets(dp: Any) -> list[dict[str, Any]]:
    """Bucket sizes and contents of a BucketedDDP (for reports and tests)."""
    return [{"index": b.index, "bytes": b.nbytes, "params": list(b.names)}
            for b in getattr(dp, "buckets", [])]
