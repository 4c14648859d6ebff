"""Hidden tests of online_softmax: many blocks and orders, large scores, masked blocks, a 2-rank ring."""

from __future__ import annotations

import math

from parallel_lab.grading.harness import Fail, doing, points, run_ranks
from parallel_lab.grading.micro import block_attention, full_attention, rel_err


def _pub():
    import public_tests

    return public_tests


@points(2)
def test_many_blocks_any_order(sub):
    import torch

    q, k, v = _pub().qkv(seed=1, t=20)
    want = full_attention(q, k, v)
    for cuts, order in (([4, 9, 15], None), ([4, 9, 15], [3, 1, 0, 2]), ([1, 2, 3, 19], [4, 0, 3, 1, 2])):
        o, lse = _pub().merged(sub, q, k, v, cuts, order)
        err = rel_err(o, want)
        if err > 1e-5:
            raise Fail(f"{len(cuts) + 1} blocks merged in order {order or 'left to right'}: output off by {err:.2e}")
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        if rel_err(lse, torch.logsumexp(scores, -1)) > 1e-5:
            raise Fail("the merged lse is not the log-sum-exp over all keys")


@points(2)
def test_large_scores(sub):
    q, k, v = _pub().qkv(seed=2, scale=12.0)           # scores of several hundred
    o, _ = _pub().merged(sub, q, k, v, [6])
    if not bool(o.isfinite().all()):
        raise Fail("with scores of several hundred your merge returns inf or NaN: exp(lse) overflows; "
                   "subtract the larger lse before exponentiating")
    err = rel_err(o, full_attention(q, k, v))
    if err > 1e-5:
        raise Fail(f"with large scores the merged output is off by {err:.2e}")


@points(2)
def test_fully_masked_block(sub):
    import torch

    q, k, v = _pub().qkv(seed=3, s=8, t=8)
    causal = torch.ones(8, 8, dtype=torch.bool).tril()     # query i sees keys 0..i
    # queries 0..2 see nothing of blocks 1 and 2; merging those two first puts -inf on both sides
    for cuts, order in (([4], None), ([3, 6], [1, 2, 0])):
        o, _ = _pub().merged(sub, q, k, v, cuts, order, mask=causal)
        if not bool(o.isfinite().all()):
            raise Fail(f"causal mask, key blocks cut at {cuts}, merged in order {order or 'left to right'}: a query "
                       "that sees no key of the blocks merged so far (lse = -inf on both sides) gets NaN; treat "
                       "-inf as weight 0 and guard the max when both sides are -inf")
        err = rel_err(o, full_attention(q, k, v, causal))
        if err > 1e-5:
            raise Fail(f"causal attention merged over blocks cut at {cuts} is off by {err:.2e}")


def _ring(grid, sub):
    import torch.distributed as dist

    q, k, v = _pub().qkv(seed=4, s=12, t=12)
    n, r = grid.world, grid.rank
    c = 12 // n
    q_r, kv = q[:, r * c:(r + 1) * c], (k[:, r * c:(r + 1) * c].clone(), v[:, r * c:(r + 1) * c].clone())
    o, lse = block_attention(q_r, *kv)
    for step in range(1, n):
        doing(grid, f"ring step {step}")
        send, recv = (r + 1) % n, (r - 1) % n
        incoming = (kv[0].clone(), kv[1].clone())
        for t, buf in zip(kv, incoming, strict=True):     # even ranks send first: no deadlock
            if r % 2 == 0:
                dist.send(t, send)
                dist.recv(buf, recv)
            else:
                dist.recv(buf, recv)
                dist.send(t, send)
        kv = incoming
        o, lse = sub.merge(o, lse, *block_attention(q_r, *kv))
    return o


@points(2)
def test_ring_on_two_ranks(sub):
    import torch

    q, k, v = _pub().qkv(seed=4, s=12, t=12)
    out = torch.cat(run_ranks(_ring, 2, sub), dim=1)
    err = rel_err(out, full_attention(q, k, v))
    if err > 1e-5:
        raise Fail(f"ring attention on 2 ranks with your merge differs from one process's attention by {err:.2e}")
