"""Public tests of zigzag: the layout for seq=16, cp=2, the work of fixed lists of positions, and the work of
the layout."""

from __future__ import annotations

from parallel_lab.grading.harness import Fail, checks, points, require


@points(2)
@checks("the zigzag layout: rank r holds chunk r and its mirror, in increasing order", "cut 16 positions "
        "into 4 chunks and pair the first with the last")
def test_layout_seq16_cp2(sub):
    (fn,) = require(sub, "zigzag_indices")
    want = {0: [0, 1, 2, 3, 12, 13, 14, 15], 1: [4, 5, 6, 7, 8, 9, 10, 11]}
    for r, w in want.items():
        got = list(fn(16, 2, r))
        if got != w:
            raise Fail(f"zigzag_indices(16, 2, {r}) = {got}, expected {w}")


@points(1)
@checks("the causal work of a list of query positions", "how many keys may the query at position i attend, "
        "itself included?")
def test_work_of_fixed_positions(sub):
    (work,) = require(sub, "causal_work")
    cases = (
        (list(range(8)), 36, "queries 0..7 attend 1, 2, ..., 8 keys: 1 + 2 + ... + 8 = 8 * 9 / 2"),
        ([3, 12], 17, "a list of positions, not of ranks: query 3 attends 4 keys and query 12 attends 13"),
    )
    for indices, want, why in cases:
        got = work(indices)
        if got != want:
            raise Fail(f"causal_work({indices}) = {got}, expected {want}: query i attends keys 0..i, i + 1 of "
                       f"them; {why}")


@points(1)
@checks("the layout balances the causal work over the ranks", "an early chunk does little work and a late one "
        "much: do the two chunks of every rank add up to the same?")
def test_work_is_balanced_seq16_cp2(sub):
    fn, work = require(sub, "zigzag_indices", "causal_work")
    got = [work(fn(16, 2, r)) for r in range(2)]
    if got != [68, 68]:
        raise Fail(f"causal work per rank {got}; expected [68, 68] (query i attends i + 1 keys)")
