"""Public tests of pipeline_1f1b: the library's validator accepts it, and its bubble for p=4, m=8."""

from __future__ import annotations

from parallel_lab.errors import ParallelLabError
from parallel_lab.grading.harness import Fail, points, require


def built(sub, p, m):
    from parallel_lab.schedules.checks import validate
    from parallel_lab.schedules.p2p import with_p2p

    (fn,) = require(sub, "one_f_one_b")
    orders = fn(p, m)
    if len(orders) != p:
        raise Fail(f"one_f_one_b({p}, {m}) returned {len(orders)} lists; expected one per stage, {p}")
    try:
        return validate(with_p2p(orders))
    except ParallelLabError as e:
        raise Fail(f"one_f_one_b({p}, {m}) is not a valid schedule: {e}") from None


@points(2)
def test_valid(sub):
    for p, m in ((2, 4), (4, 8), (4, 2)):
        built(sub, p, m)


@points(1)
def test_bubble_p4_m8(sub):
    from parallel_lab.simulate import simulate

    got = simulate(built(sub, 4, 8)).bubble_ratio
    if abs(got - 3 / 8) > 1e-9:
        raise Fail(f"simulated bubble {got:.4f}; 1F1B's is (p - 1) / m = 0.375 for p=4, m=8")
