"""Public tests of zero1_step: one step on 2 ranks gives one process's parameters (1e-5)."""

from __future__ import annotations

from parallel_lab.grading.harness import Fail, doing, points, require, run_ranks
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


@points(3)
def test_one_step_equals_one_process(sub):
    require(sub, "Zero1")
    check_params(run_ranks(train, 2, sub, 1), 1)
