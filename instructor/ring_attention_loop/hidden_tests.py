"""Hidden tests of ring_attention_loop: 4 ranks (b=1, chunks of 2 tokens, d=8), ordinary and huge scores, bytes and
blocks; 2 ranks on another shape (b=3, chunks of 5 tokens, d=4)."""

from __future__ import annotations

import functools

from parallel_lab.grading.harness import points, run_ranks

FOUR = ((1, 8, 8, 11, 1.0), (1, 8, 8, 12, 8.0))        # b, s, d, seed, scale
TWO = ((3, 10, 4, 13, 1.0),)


def _pub():
    import public_tests

    return public_tests


@functools.cache
def four(sub):
    return run_ranks(_pub().ring_rank, 4, sub, FOUR)


@functools.cache
def two(sub):
    return run_ranks(_pub().ring_rank, 2, sub, TWO)


@points(2)
def test_four_ranks_equal_causal_attention(sub):
    _pub().check_output(four(sub), FOUR[0], 0, "ordinary scores")


@points(1)
def test_four_ranks_huge_scores(sub):
    _pub().check_output(four(sub), FOUR[1], 1, "scores of several hundred")


@points(1)
def test_two_ranks_another_shape(sub):
    _pub().check_output(two(sub), TWO[0], 0, "b=3, chunks of 5 tokens")


@points(2)
def test_four_ranks_steps_bytes_and_blocks(sub):
    _pub().check_traffic(four(sub), FOUR[0])
