"""Public tests of zigzag: the layout for seq=16, cp=2, and its work."""

from __future__ import annotations

from parallel_lab.grading.harness import Fail, points, require


@points(2)
def test_layout_seq16_cp2(sub):
    (fn,) = require(sub, "zigzag_indices")
    want = {0: [0, 1, 2, 3, 12, 13, 14, 15], 1: [4, 5, 6, 7, 8, 9, 10, 11]}
    for r, w in want.items():
        got = list(fn(16, 2, r))
        if got != w:
            raise Fail(f"zigzag_indices(16, 2, {r}) = {got}, expected {w}")


@points(1)
def test_work_is_balanced_seq16_cp2(sub):
    fn, work = require(sub, "zigzag_indices", "causal_work")
    got = [work(fn(16, 2, r)) for r in range(2)]
    if got != [68, 68]:
        raise Fail(f"causal work per rank {got}; expected [68, 68] (query i attends i + 1 keys)")
