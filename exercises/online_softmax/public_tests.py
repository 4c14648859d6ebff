"""Public tests of online_softmax: two blocks merged equal full attention (relative 1e-5), also with scores in the
hundreds and under a causal mask that leaves some queries without a key in a block."""

from __future__ import annotations

from parallel_lab.grading.harness import Fail, checks, points, require
from parallel_lab.grading.micro import block_attention, full_attention, rel_err


def qkv(seed=0, s=8, t=12, d=16, scale=1.0):
    import torch

    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, s, d, generator=g) * scale, torch.randn(2, t, d, generator=g) * scale,
            torch.randn(2, t, d, generator=g))


def merged(sub, q, k, v, cuts, order=None, mask=None):
    parts = []
    bounds = [0, *cuts, k.shape[1]]
    for a, z in zip(bounds, bounds[1:], strict=False):
        parts.append(block_attention(q, k[:, a:z], v[:, a:z], None if mask is None else mask[:, a:z]))
    order = order or list(range(len(parts)))
    o, lse = parts[order[0]]
    for i in order[1:]:
        o, lse = sub.merge(o, lse, *parts[i])
    return o, lse


@points(2)
@checks("the merge of two partial softmax results over disjoint key blocks", "each block's output is "
        "normalised by its own sum of exponentials: by how much must it be reweighted in the total?")
def test_two_blocks(sub):
    require(sub, "merge")
    q, k, v = qkv()
    o, _ = merged(sub, q, k, v, [5])
    err = rel_err(o, full_attention(q, k, v))
    if err > 1e-5:
        raise Fail(f"two merged blocks differ from full attention by {err:.2e} (relative): weight each block's "
                   "output by exp(lse_block - lse_total)")


@points(1)
@checks("a merge that never overflows: scores of a few hundred", "exp(300) is inf in float32: which "
        "difference of lse values can you exponentiate instead, and stay below 1?")
def test_scores_in_the_hundreds(sub):
    require(sub, "merge")
    q, k, v = qkv(seed=5, s=6, t=10, scale=10.0)
    o, _ = merged(sub, q, k, v, [3])
    if not bool(o.isfinite().all()):
        raise Fail("with scores of a few hundred your merge returns inf or NaN")
    err = rel_err(o, full_attention(q, k, v))
    if err > 1e-5:
        raise Fail(f"with scores of a few hundred the merged output is off by {err:.2e} (relative)")


@points(1)
@checks("a causal mask: a block where a query sees no key (lse = -inf, o = 0) changes nothing, even when both "
        "sides are empty", "what is exp(-inf - (-inf))? Give an empty side a weight of 0 without computing it")
def test_fully_masked_blocks(sub):
    import torch

    require(sub, "merge")
    q, k, v = qkv(seed=6, s=6, t=6)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    o, _ = merged(sub, q, k, v, [2, 4], [2, 1, 0], mask=causal)      # queries 0, 1 see nothing of blocks 2 and 1
    if not bool(o.isfinite().all()):
        raise Fail("causal mask, key blocks [0, 2), [2, 4), [4, 6) merged last to first: queries 0 and 1 get NaN or "
                   "inf after merging the two blocks they see nothing of")
    err = rel_err(o, full_attention(q, k, v, causal))
    if err > 1e-5:
        raise Fail(f"causal attention merged over three blocks is off by {err:.2e} (relative)")
