"""Public tests of predict_bubble: the README's example, 1F1B on 4 stages with 8 micro-batches."""

from __future__ import annotations

from parallel_lab.grading.feedback import check
from parallel_lab.grading.harness import Fail, points, require


@points(2)
def test_readme_example(sub):
    fn, peak = require(sub, "bubble_ratio", "peak_inflight")
    fb = check(fn("1f1b", 4, 8), 0.375, rtol=1e-9, name="1F1B p=4 m=8 bubble")   # `parallel-lab bubble` prints 0.3750
    if not fb:
        raise Fail(fb.message)
    got = [peak("1f1b", 4, 8, r) for r in range(4)]
    if got != [4, 3, 2, 1]:
        raise Fail(f"peak in-flight per stage {got}; `parallel-lab bubble` shows 4 3 2 1")
