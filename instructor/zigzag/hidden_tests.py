"""Hidden tests of zigzag: against the library's layout and its count of allowed pairs, over many shapes."""

from __future__ import annotations

from parallel_lab.grading.harness import Fail, points

CASES = ((8, 1), (8, 2), (24, 3), (32, 4), (64, 8), (48, 2), (120, 5))


@points(3)
def test_layout_equals_library(sub):
    from parallel_lab.distributed.context_parallel.cp_balance import rank_indices

    for seq, cp in CASES:
        lib = rank_indices(seq, cp, "zigzag")
        held = []
        for r in range(cp):
            got = [int(i) for i in sub.zigzag_indices(seq, cp, r)]
            if got != lib[r].tolist():
                raise Fail(f"seq={seq}, cp={cp}, rank {r}: {got[:6]}... differs from the zigzag layout "
                           f"{lib[r].tolist()[:6]}... (chunks r and 2 cp - 1 - r of 2 cp chunks, increasing)")
            held += got
        if sorted(held) != list(range(seq)):
            raise Fail(f"seq={seq}, cp={cp}: the ranks do not hold every position exactly once")


@points(2)
def test_work_equals_library_count(sub):
    import torch

    from parallel_lab.distributed.context_parallel.cp_balance import allowed_pairs, work_per_rank

    pos = torch.arange(64)
    for idx in ([0, 5, 9], list(range(64)), [63], list(range(10, 30))):
        want = allowed_pairs(pos[idx], pos)
        got = sub.causal_work(idx)
        if got != want:
            raise Fail(f"causal_work({idx[:4]}...) = {got}; the causal mask allows {want} (query, key) pairs")
    for seq, cp in CASES:
        got = [sub.causal_work(sub.zigzag_indices(seq, cp, r)) for r in range(cp)]
        if got != work_per_rank(seq, cp, "zigzag"):
            raise Fail(f"seq={seq}, cp={cp}: work per rank {got}, expected {work_per_rank(seq, cp, 'zigzag')}")
        if len(set(got)) != 1:
            raise Fail(f"seq={seq}, cp={cp}: work per rank {got} is not balanced")
