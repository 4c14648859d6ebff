"""Public tests of predict_tp: the README's example, 32 layers of h=4096 at s=4096 over 8 GPUs (bf16)."""

from __future__ import annotations

from parallel_lab.grading.feedback import check
from parallel_lab.grading.harness import Fail, points, require


@points(2)
def test_readme_example(sub):
    (fn,) = require(sub, "tp_bytes_per_step")
    # `parallel-lab comm --layers 32 --hidden 4096 --heads 32 --seq 4096 --tp 8`: tp 7.52 GB per step
    fb = check(fn(32, 4096, 1, 4096, 8, 2, 1), 7.516e9, rtol=0.001, unit="B", name="TP bytes per step")
    if not fb:
        raise Fail(fb.message)
