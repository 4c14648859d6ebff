"""Public tests of predict_ep: Mixtral 8x7B at 4096 tokens, bf16 (lesson 09's figures)."""

from __future__ import annotations

from parallel_lab.grading.feedback import check
from parallel_lab.grading.harness import Fail, points, require


@points(1)
def test_mixtral_capacity(sub):
    (fn,) = require(sub, "expert_capacity")
    if fn(4096, 8, 2, 1.25) != 1280:
        raise Fail(f"Mixtral's capacity at s=4096 (8 experts, top-2, factor 1.25) is 1280 slots; you have "
                   f"{fn(4096, 8, 2, 1.25)}")


@points(2)
def test_mixtral_dispatch(sub):
    (fn,) = require(sub, "dispatch_bytes")
    # `parallel-lab comm --model mixtral-8x7b --dp 8 --ep 8 --seq 4096`: one all-to-all of 83,886,080 B
    fb = check(fn(4096, 1, 4096, 2, 8, 2, 1.25), 83_886_080, rtol=1e-9, unit="B", name="one dispatch")
    if not fb:
        raise Fail(fb.message)
