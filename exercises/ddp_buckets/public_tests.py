"""Public tests of ddp_buckets: the bucket partition, averaged gradients on 2 ranks, and all-reduces launched during
backward (12 kB buckets)."""

from __future__ import annotations

import functools

from parallel_lab import sharding
from parallel_lab.grading.harness import Fail, checks, points, record_collectives, require, run_ranks
from parallel_lab.grading.micro import MICRO, micro_plan

CAP_MB = 0.012         # 12 kB buckets: 12 buckets of 1-3 gradients for MICRO (4-byte gradients)


def _grads(grid, sub, cap_bytes):
    from parallel_lab.distributed.model.data import synthetic_batch
    from parallel_lab.distributed.model.model import build_model, loss_fn

    plan = micro_plan(dp=2)
    model = build_model(MICRO, seed=0)
    sync = sub.BucketedAllReduce(model, cap_bytes)
    b = synthetic_batch(MICRO, plan, 0).rows(2 * grid.rank, 2 * grid.rank + 2)
    with record_collectives() as calls:
        loss_fn(model(b.tokens, b.positions), b.targets).backward()
        in_backward = len(calls)
        sync.finish()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, (in_backward, len(calls))


@functools.cache
def results(sub):
    """The 2 ranks' gradients and (all-reduces launched during backward, all-reduces in all), run once."""
    return run_ranks(_grads, 2, sub, CAP_MB * 1e6)


def reference_grads():
    from parallel_lab.distributed.model.data import synthetic_batch
    from parallel_lab.distributed.model.model import build_model, loss_fn

    model = build_model(MICRO, seed=0)
    b = synthetic_batch(MICRO, micro_plan(dp=2), 0)
    loss_fn(model(b.tokens, b.positions), b.targets).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@points(2)
@checks("the buckets: reverse registration order, closed before they would exceed the cap", "print the "
        "parameters' names and sizes in the order backward produces their gradients, then fill 12 kB buckets")
def test_bucket_partition(sub):
    (cls,) = require(sub, "BucketedAllReduce")
    from parallel_lab.distributed.model.model import build_model

    model = build_model(MICRO, seed=0)
    names = {id(p): n for n, p in model.named_parameters()}
    got = [[names[id(p)] for p in b] for b in cls(model, CAP_MB * 1e6).buckets]
    want = [[n for n, _ in b] for b in sharding.ddp_buckets(MICRO, micro_plan(dp=2, bucket_mb=CAP_MB))]
    if got != want:
        first = next((i for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w), min(len(got), len(want)))
        raise Fail(f"{len(got)} buckets, expected {len(want)}; bucket {first} differs: yours starts "
                   f"{got[first][:2] if first < len(got) else 'nothing'}, expected {want[first][:2]} (walk the "
                   "parameters in reverse registration order; close a bucket before it would exceed the cap)")


@points(2)
@checks("the gradients after finish(): the average over the ranks, equal to one process's full-batch gradient",
        "the loss is a mean over the global batch: what does an all-reduce compute, and what is left to do?")
def test_gradients_are_the_full_batch_average(sub):
    require(sub, "BucketedAllReduce")
    out = results(sub)
    ref = reference_grads()
    for r, (g, _) in enumerate(out):
        worst = max(ref, key=lambda n: float((g[n] - ref[n]).abs().max()))
        err = float((g[worst] - ref[worst]).abs().max())
        if err > 1e-5:
            ratio = float(g[worst].norm() / ref[worst].norm())
            raise Fail(f"rank {r}: gradient of {worst} differs from one process's full-batch gradient by {err:.2e} "
                       f"(|yours| / |expected| = {ratio:.3f}; 2.000 means the sum, not the average)")


@points(2)
@checks("overlap: every bucket's all-reduce is launched during backward, as soon as its last gradient is ready",
        "a hook runs while backward goes on; which hook call sees a bucket complete? Launch with async_op=True "
        "and wait in finish()")
def test_all_reduces_launch_during_backward(sub):
    require(sub, "BucketedAllReduce")
    for r, (_, (in_backward, total)) in enumerate(results(sub)):
        if not total or in_backward < total:
            raise Fail(f"rank {r}: {in_backward} of {total} all-reduces were launched during backward")
