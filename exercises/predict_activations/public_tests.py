"""Public tests of predict_activations: the seed's 7B-class figure (Korthikanti's formula, 2 bytes)."""

from __future__ import annotations

from parallel_lab.grading.feedback import check
from parallel_lab.grading.harness import Fail, points, require


@points(2)
def test_seed_figure(sub):
    (fn,) = require(sub, "activations_per_layer")
    fb = check(32 * fn(4096, 1, 4096, 32), 104_152_956_928, rtol=1e-9, unit="B",
               terms={"5 a s / h score term": 32 * 5 * 32 * 4096 * 4096, "34 s b h": 32 * 34 * 4096 * 4096},
               name="32 layers, s=4096, h=4096, a=32")
    if not fb:
        raise Fail(fb.message)
