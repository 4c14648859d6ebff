"""Public tests of pipeline_1f1b: the library's validator accepts it, its bubble for p=4, m=8, and the micro-batches
in flight per stage for p=3, m=6 and p=5, m=7 (simulated timelines, ``parallel_lab.simulate``)."""

from __future__ import annotations

from parallel_lab.errors import ParallelLabError
from parallel_lab.grading.harness import Fail, checks, points, require


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
@checks("a valid schedule: every backward after its forward, every stage's order consistent with its "
        "neighbours' (no deadlock)", "a backward needs the gradient from the next stage: which stage can run "
        "B(0) first?")
def test_valid(sub):
    for p, m in ((2, 4), (4, 8), (4, 2)):
        built(sub, p, m)


@points(1)
@checks("1F1B's bubble, (p - 1) / m", "idle time comes from the warm-up and the drain; does any stage wait "
        "in the steady state?")
def test_bubble_p4_m8(sub):
    from parallel_lab.simulate import simulate

    got = simulate(built(sub, 4, 8)).bubble_ratio
    if abs(got - 3 / 8) > 1e-9:
        raise Fail(f"simulated bubble {got:.4f}; 1F1B's is (p - 1) / m = 0.375 for p=4, m=8")


@points(2)
@checks("1F1B's memory bound: stage r never holds more than min(p - r, m) micro-batches' activations",
        "a micro-batch is in flight from its forward to its backward on that stage: how many forwards must "
        "stage r run before the first backward can reach it?")
def test_inflight_bound(sub):
    from parallel_lab.simulate import simulate

    for p, m in ((3, 6), (5, 7)):
        got = simulate(built(sub, p, m)).peak_inflight
        want = [min(p - r, m) for r in range(p)]
        if got != want:
            raise Fail(f"p={p}, m={m}: micro-batches in flight per stage {got}; 1F1B holds {want}")
