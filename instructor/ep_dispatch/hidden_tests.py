"""Hidden tests of ep_dispatch: the kept choices against the library's router over random cases; the output and
the three all-to-alls on 2 ranks (6 experts, top-1) and on 4 ranks (8 experts, top-2); a rank that receives no
row at all."""

from __future__ import annotations

from parallel_lab.grading.harness import Fail, diff_calls, points

TWO = (6, 1, 10, 12, 1.0, 5)               # experts, top_k, seq, hidden, capacity_factor, seed
FOUR = (8, 2, 8, 8, 1.0, 3)
EMPTY = (4, 1, 6, 8, 4.0, 2, 12.0)         # ... and skew: every token picks expert 0, nothing reaches rank 1


def _pt():
    import public_tests

    return public_tests


@points(2)
def test_kept_choices_against_the_router(sub):
    import torch

    from parallel_lab.distributed.model.moe import route

    g = torch.Generator().manual_seed(4)
    for s, n_exp, k, cap in ((16, 4, 2, 3), (9, 8, 3, 1), (7, 3, 1, 7), (20, 5, 2, 4)):
        probs = torch.softmax(torch.randn(1, s, n_exp, generator=g) * 2, -1)
        _, expert, slot = route(probs, k, cap)
        got = sub.kept_choices(expert[0].clone(), n_exp, cap)
        want = slot[0] >= 0
        if tuple(got.shape) != tuple(want.shape) or not torch.equal(got.bool(), want):
            n = int((got.bool() != want).sum()) if tuple(got.shape) == tuple(want.shape) else "all"
            raise Fail(f"{s} tokens, {n_exp} experts, top-{k}, capacity {cap}: {n} choices kept or dropped unlike "
                       f"the MoE's router (priority: choice 0 of every token first, each expert's first {cap} kept)")


@points(2)
def test_output_two_ranks_top1(sub):
    _pt().check_output(sub, 2, TWO)


@points(3)
def test_output_four_ranks(sub):
    _pt().check_output(sub, 4, FOUR)


@points(2)
def test_all_to_alls_as_predicted(sub):
    pt = _pt()
    for ep, args in ((2, TWO), (4, FOUR)):
        want = pt.predicted_calls(ep, args)
        for r, (_, calls) in enumerate(pt.ranks(sub, ep, args)):
            msg = diff_calls(calls, want[r])
            if msg:
                raise Fail(f"ep={ep}, rank {r}: {msg} (the counts, then the kept rows out, then the rows back)")


@points(1)
def test_a_rank_that_receives_nothing(sub):
    pt = _pt()
    _, routes = pt.reference(2, EMPTY)
    assert all(int(e.max()) < 2 for e, *_ in routes), "the case should send nothing to rank 1"
    pt.check_output(sub, 2, EMPTY)
