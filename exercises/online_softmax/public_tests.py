"""Public tests of online_softmax: two blocks merged equal full attention (relative 1e-5)."""

from __future__ import annotations

from parallel_lab.grading.harness import Fail, points, require
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
def test_two_blocks(sub):
    require(sub, "merge")
    q, k, v = qkv()
    o, _ = merged(sub, q, k, v, [5])
    err = rel_err(o, full_attention(q, k, v))
    if err > 1e-5:
        raise Fail(f"two merged blocks differ from full attention by {err:.2e} (relative): weight each block's "
                   "output by exp(lse_block - lse_total)")
