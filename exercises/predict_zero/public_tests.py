"""Public tests of predict_zero: the seed's example, 7.5B parameters on 64 GPUs (ZeRO paper, Figure 1)."""

from __future__ import annotations

from parallel_lab.grading.feedback import check
from parallel_lab.grading.harness import Fail, points, require


@points(2)
def test_zero_paper_figure1(sub):
    (fn,) = require(sub, "zero_state")
    psi, g = 7_500_000_000, 64
    # Figure 1 of Rajbhandari et al. 2020: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per GPU for stages 0..3
    for stage, gb in ((0, 120.0), (1, 31.4), (2, 16.6), (3, 1.88)):
        fb = check(sum(fn(psi, g, stage).values()) / 1e9, gb, rtol=0.01, name=f"stage {stage} total (GB)")
        if not fb:
            raise Fail(fb.message)
