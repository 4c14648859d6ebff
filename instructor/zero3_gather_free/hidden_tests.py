"""Hidden tests of zero3_gather_free: 4 blocks of h=5 (padded units) in units of two sizes and as one root unit;
gradients, the peak of gathered bytes and the order of backward's calls."""

from __future__ import annotations

import functools

from parallel_lab.grading.harness import Fail, points, run_ranks

H, BLOCKS, ROWS, SEED = 5, 4, 6, 3
MIXED, ROOT = [[0, 1], [2], [3]], [[0, 1, 2, 3]]


def _pub():
    import public_tests

    return public_tests


@functools.cache
def results(sub):
    """The 2 ranks' runs with mixed units and with one root unit, launched once."""
    return run_ranks(_pub().train, 2, sub, H, BLOCKS, ROWS, SEED, (MIXED, ROOT))


@points(2)
def test_gradients_of_padded_mixed_units(sub):
    _pub().check_grads(results(sub), H, BLOCKS, ROWS, SEED, MIXED, 0)


@points(1)
def test_gradients_with_one_root_unit(sub):
    _pub().check_grads(results(sub), H, BLOCKS, ROWS, SEED, ROOT, 1)


@points(1)
def test_losses_are_the_ranks_means(sub):
    import torch

    blocks, x = _pub().case(H, BLOCKS, ROWS, SEED)
    per = ROWS // 2
    for r, runs in enumerate(results(sub)):
        y = x[r * per:(r + 1) * per]
        for w, b, g in blocks:
            y = y + g * torch.tanh(y @ w.T + b)
        want = float((y * y).mean())
        if abs(runs[0][0] - want) > 1e-5 * max(1.0, abs(want)):
            raise Fail(f"rank {r}: the loss of its 3 rows is {runs[0][0]:.6g}, one process's on the same rows "
                       f"{want:.6g}: is every unit's forward run with its full, gathered parameters?")


@points(1)
def test_peak_is_the_largest_unit(sub):
    blocks, _ = _pub().case(H, BLOCKS, ROWS, SEED)
    largest = max(_pub().padded_numel(blocks, u, 2) for u in MIXED) * 4
    for r, runs in enumerate(results(sub)):
        if runs[0][2] != largest:
            raise Fail(f"rank {r}: units of 2, 1 and 1 blocks (h=5, padded): up to {runs[0][2]:,} B of gathered "
                       f"parameters alive at once, expected the largest unit's {largest:,} B: free each unit's "
                       "gathered parameters once it has computed, in forward and in backward")


@points(1)
def test_backward_gathers_then_reduce_scatters_each_unit_in_reverse(sub):
    blocks, _ = _pub().case(H, BLOCKS, ROWS, SEED)
    want = []
    for u in reversed(MIXED):
        b = _pub().padded_numel(blocks, u, 2) * 4
        want += [("all_gather", b, 2), ("reduce_scatter", b, 2)]
    for r, runs in enumerate(results(sub)):
        got = runs[0][4]
        if got != want:
            raise Fail(f"rank {r}: backward's calls in order {got}; expected, from the last unit to the first, an "
                       f"all-gather then a reduce-scatter of each padded unit: {want}")
