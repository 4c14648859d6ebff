"""Public tests of ddp_buckets: the bucket partition, and averaged gradients on 2 ranks."""

from __future__ import annotations

from parallel_lab import sharding
from parallel_lab.grading.harness import Fail, points, require, run_ranks
from parallel_lab.grading.micro import MICRO, micro_plan

CAP_MB = 0.012         # 12 kB buckets: 12 buckets of 1-3 gradients for MICRO (4-byte gradients)


def _grads(grid, sub, cap_bytes):
    import torch

    from parallel_lab.distributed.model.data import synthetic_batch
    from parallel_lab.distributed.model.model import build_model, loss_fn

    plan = micro_plan(dp=2)
    model = build_model(MICRO, seed=0)
    sync = sub.BucketedAllReduce(model, cap_bytes)
    b = synthetic_batch(MICRO, plan, 0).rows(2 * grid.rank, 2 * grid.rank + 2)
    loss_fn(model(b.tokens, b.positions), b.targets).backward()
    sync.finish()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, torch.__version__


def reference_grads():
    from parallel_lab.distributed.model.data import synthetic_batch
    from parallel_lab.distributed.model.model import build_model, loss_fn

    model = build_model(MICRO, seed=0)
    b = synthetic_batch(MICRO, micro_plan(dp=2), 0)
    loss_fn(model(b.tokens, b.positions), b.targets).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@points(2)
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
def test_gradients_are_the_full_batch_average(sub):
    require(sub, "BucketedAllReduce")
    out = run_ranks(_grads, 2, sub, CAP_MB * 1e6)
    ref = reference_grads()
    for r, (g, _) in enumerate(out):
        worst = max(ref, key=lambda n: float((g[n] - ref[n]).abs().max()))
        err = float((g[worst] - ref[worst]).abs().max())
        if err > 1e-5:
            ratio = float(g[worst].norm() / ref[worst].norm())
            raise Fail(f"rank {r}: gradient of {worst} differs from one process's full-batch gradient by {err:.2e} "
                       f"(|yours| / |expected| = {ratio:.3f}; 2.000 means the sum, not the average)")
