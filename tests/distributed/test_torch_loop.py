"""Our DDP wrappers and ZeRO-1/2 optimizers used as torch's are, in a plain torch training loop, against
``torch.nn.parallel.DistributedDataParallel`` with a plain optimizer.

Every rank builds its model from a *different* seed (the wrappers must broadcast rank 0's weights), takes
its own rows of each global batch, and runs ``opt.zero_grad()`` (torch's default ``set_to_none=True``, or
``model.zero_grad()``), ``loss.backward()`` and ``opt.step()`` for several steps, with two micro-batches
per step (the first under ``no_sync()``) in one variant. Parameters are compared with DDP's on every
rank. fp32 with two ranks: halving is exact and a sum of two is commutative, so every variant that sums
the same numbers as DDP is bitwise equal to it. ZeRO-2 reduce-scattering every micro-batch sums in
another order ((a0 + b0)/2 + (a1 + b1)/2 against DDP's ((a0 + a1) + (b0 + b1))/2): rounding, which
AdamW's normalised step amplifies for tiny gradients (observed 2.3e-5 after 4 steps); tolerance 1e-4,
well below the ~lr = 3e-3 per step that one rank stepping on its own gradient would show.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from parallel_lab.distributed.data_parallel.data_parallel import BucketedDDP, NaiveDDP
from parallel_lab.distributed.model.data import synthetic_batch
from parallel_lab.distributed.model.model import build_model, loss_fn
from parallel_lab.distributed.runtime.launch import launch
from parallel_lab.distributed.zero.zero import Zero12
from parallel_lab.specs import ModelSpec, Plan

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

SPEC = ModelSpec.preset("tiny-llama").with_(layers=2)
STEPS, REORDERED_TOL = 4, 1e-4
HYPER = {"lr": 3e-3, "weight_decay": 0.1, "foreach": False}


def _train(grid, variant: str, accum: int, zero_grad: str) -> dict[str, torch.Tensor]:
    """``STEPS`` steps of one variant on this rank; returns the final parameters by name."""
    plan = Plan(dp=grid.world, micro_batch=2 * accum, seq=32, optimizer="adam-fp32", dtype="fp32")
    model = build_model(SPEC, seed=100 + grid.rank)            # every rank starts elsewhere
    opt: torch.optim.Optimizer
    if variant == "torch DDP":
        model = wrapped = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.1)
        opt = torch.optim.AdamW(model.parameters(), **HYPER)
    elif variant == "naive":
        model = wrapped = NaiveDDP(model)
        opt = torch.optim.AdamW(model.parameters(), **HYPER)
    elif variant == "bucketed":
        model = wrapped = BucketedDDP(model, bucket_mb=0.1)
        opt = torch.optim.AdamW(model.parameters(), **HYPER)
    else:                                                    # "zero1", "zero1 all_reduce", "zero2 ..."
        stage = int(variant[4])
        kw = {"reduce": "all_reduce"} if "all_reduce" in variant else {}
        kw |= {"accumulate": "sharded"} if "sharded" in variant else {}
        units = [list(b.parameters()) for b in model.blocks.values()]
        rest = [p for n, p in model.named_parameters() if not n.startswith("blocks.")]
        opt = wrapped = Zero12(model.parameters(), torch.optim.AdamW, stage=stage,
                               units=[rest, *units] if "units" in variant else None, **kw, **HYPER)
    for step in range(STEPS):
        batch = synthetic_batch(SPEC, plan, step)
        mine = batch.rows(grid.rank * plan.micro_batch, (grid.rank + 1) * plan.micro_batch)
        (model if zero_grad == "model" else opt).zero_grad()
        for i in range(accum):
            micro = mine.rows(i * 2, (i + 1) * 2)
            quiet = wrapped.no_sync() if i < accum - 1 else contextlib.nullcontext()
            with quiet:
                loss = loss_fn(model(micro.tokens, micro.positions), micro.targets) / accum
                loss.backward()
        opt.step()
    inner = model.module if hasattr(model, "module") else model
    return {n: p.detach().clone() for n, p in inner.named_parameters()}


def _run(grid, variants: list[str], accum: int, zero_grad: str) -> dict[str, dict[str, torch.Tensor]]:
    return {v: _train(grid, v, accum, zero_grad) for v in ["torch DDP", *variants]}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


VARIANTS = ["naive", "bucketed", "zero1", "zero1 all_reduce", "zero1 units", "zero2", "zero2 units sharded"]


@pytest.mark.parametrize("accum,zero_grad", [(1, "optimizer"), (2, "model")])
def test_wrappers_match_torch_ddp_in_a_plain_loop(accum, zero_grad):
    results = launch(_run, 2, VARIANTS, accum, zero_grad, timeout_s=170)
    start = {n: p.detach() for n, p in build_model(SPEC, seed=100).named_parameters()}
    for rank, res in enumerate(results):
        ref = res["torch DDP"]
        assert _max_diff(ref, start) > 1e-3                  # training moved the weights
        assert _max_diff(ref, results[0]["torch DDP"]) == 0.0  # DDP keeps the replicas equal
        for v in VARIANTS:
            tol = REORDERED_TOL if "sharded" in v and accum > 1 else 0.0
            assert _max_diff(res[v], ref) <= tol, (rank, v, _max_diff(res[v], ref))


def _bucketed_after_zero_grad(grid, how: str) -> float:
    """Max |grad - the average of both ranks' gradients| after a second backward that follows
    ``how`` (the bug: the views into the buckets were dropped and each rank kept its own gradient)."""
    model = BucketedDDP(build_model(SPEC, seed=0), bucket_mb=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    plan = Plan(dp=2, micro_batch=2, seq=32, optimizer="adam-fp32", dtype="fp32")
    batch = synthetic_batch(SPEC, plan, 0)
    for _ in range(2):
        {"optimizer": opt.zero_grad, "model": model.zero_grad}[how]()
        mine = batch.rows(2 * grid.rank, 2 * grid.rank + 2)
        loss_fn(model(mine.tokens, mine.positions), mine.targets).backward()
    ours = {n: p.grad.clone() for n, p in model.module.named_parameters()}
    ref = build_model(SPEC, seed=0)                            # the average of the two ranks' gradients
    both = batch.rows(0, 4)
    loss_fn(ref(both.tokens, both.positions), both.targets).backward()
    return max(float((ours[n] - p.grad).abs().max()) for n, p in ref.named_parameters())


@pytest.mark.parametrize("how", ["optimizer", "model"])
def test_bucketed_ddp_keeps_averaging_after_zero_grad_set_to_none(how):
    """Regression: after ``zero_grad()`` (set_to_none=True) the gradients are still averaged."""
    diffs = launch(_bucketed_after_zero_grad, 2, how, timeout_s=100)
    assert max(diffs) <= 1e-6, diffs
