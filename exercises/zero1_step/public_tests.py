"""Public tests of zero1_step: one step on 2 ranks gives one process's parameters (1e-5), and each rank keeps
AdamW state for its shard only."""

from __future__ import annotations

import functools

from parallel_lab.grading.harness import Fail, checks, doing, points, require, run_ranks
from parallel_lab.grading.micro import MICRO, micro_plan


def train(grid, sub, steps):
    from parallel_lab.distributed.model.data import synthetic_batch
    from parallel_lab.distributed.model.model import build_model, loss_fn
    from parallel_lab.distributed.model.state import optimizer_state_tensors, storage_bytes
    from parallel_lab.grading.harness import record_collectives

    plan = micro_plan(dp=2)
    model = build_model(MICRO, seed=0)
    z = sub.Zero1(model)
    calls = []
    for step in range(steps):
        b = synthetic_batch(MICRO, plan, step).rows(2 * grid.rank, 2 * grid.rank + 2)
        for p in model.parameters():
            p.grad = None
        doing(grid, f"backward of step {step}")
        loss_fn(model(b.tokens, b.positions), b.targets).backward()
        doing(grid, f"Zero1.step() of step {step}")
        with record_collectives() as c:
            z.step()
        calls.append(list(c))
    state = storage_bytes(optimizer_state_tensors(z.optimizer)) if z.optimizer is not None else 0
    return {n: p.detach().clone() for n, p in model.named_parameters()}, calls, state


def session_values():
    """One process's parameters after 1 and 2 steps (computed once per grading session)."""
    from parallel_lab.distributed.model.reference import reference_train

    return {steps: reference_train(MICRO, micro_plan(dp=2), steps).params for steps in (1, 2)}


SESSION: dict = {}


def check_params(results, steps):
    ref = (SESSION or session_values())[steps]
    for r, (params, _, _) in enumerate(results):
        for n in ref:
            err = float((params[n] - ref[n]).abs().max())
            if err > 1e-5:
                raise Fail(f"rank {r}: after {steps} step(s) parameter {n} differs from one process's training by "
                           f"{err:.2e} (averaged gradients? every shard gathered back on every rank?)")


@functools.cache
def one_step(sub):
    """The 2 ranks' parameters, calls and optimizer-state bytes after one step, run once."""
    return run_ranks(train, 2, sub, 1)


@points(3)
@checks("one ZeRO-1 step equals one process's AdamW step on the full batch", "each rank steps only its shard: "
        "with the average gradient of that shard, and then every rank needs every updated shard")
def test_one_step_equals_one_process(sub):
    require(sub, "Zero1")
    check_params(one_step(sub), 1)


@points(1)
@checks("ZeRO-1's saving: each rank's AdamW keeps state for its shard of ceil(n / g) elements only",
        "what does torch.optim.AdamW allocate state for? Give it a parameter of S elements")
def test_optimizer_state_is_a_shard(sub):
    import math

    from parallel_lab.distributed.model.model import build_model

    require(sub, "Zero1")
    n = sum(p.numel() for p in build_model(MICRO, seed=0).parameters() if p.requires_grad)
    most = 2 * 4 * math.ceil(n / 2)           # two fp32 moments of the shard (and AdamW's step counter)
    for r, (_, _, state) in enumerate(one_step(sub)):
        if not 0 < state <= most + 64:
            raise Fail(f"rank {r}: the optimizer keeps {state:,} B of state; two fp32 moments of {n:,} / 2 elements "
                       f"are {most:,} B")
