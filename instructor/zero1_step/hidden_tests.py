"""Hidden tests of zero1_step: two steps, calls against comm, optimizer states against the ledger."""

from __future__ import annotations

import functools

from parallel_lab import comm, ledger
from parallel_lab.grading.harness import Fail, diff_calls, expected_calls, points, run_ranks
from parallel_lab.grading.micro import MICRO, micro_plan

PLAN = micro_plan(dp=2, zero=1, zero_unit="root")


def _public():
    import public_tests  # loaded by the grader from the exercise's directory

    return public_tests


@functools.cache
def results(sub):
    return run_ranks(_public().train, 2, sub, 2)


@points(3)
def test_two_steps_equal_one_process(sub):
    _public().check_params(results(sub), 2)


@points(2)
def test_calls_match_prediction(sub):
    predicted = expected_calls(c for c in comm.collectives(MICRO, PLAN) if c.dim == "dp")
    for r, (_, calls, _) in enumerate(results(sub)):
        msg = diff_calls(calls[0], predicted)
        if msg:
            raise Fail(f"rank {r}, step 0: {msg} (ZeRO-1: one reduce-scatter of the padded flat gradient, one "
                       "all-gather of the padded flat parameters)")


@points(2)
def test_optimizer_states_are_sharded(sub):
    want = int(ledger.state_bytes(MICRO, PLAN)["optimizer_states"])
    for r, (_, _, state) in enumerate(results(sub)):
        if state != want:
            raise Fail(f"rank {r}: the optimizer keeps {state:,} B of state; ZeRO-1 predicts {want:,} B "
                       f"(8 B x ceil(n/g) for AdamW's two moments of the owned shard only; "
                       f"{state / want:.2f}x the prediction)")
