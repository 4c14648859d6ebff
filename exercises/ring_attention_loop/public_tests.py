"""Public tests of ring_attention_loop: on 3 ranks (b=2, chunks of 3 tokens, d=4) the outputs side by side equal one
process's causal attention, also with scores of several hundred; each rank sends and receives its K/V chunks' bytes
world - 1 times and computes one block per chunk at or before its queries."""

from __future__ import annotations

import functools

from parallel_lab.grading.harness import Fail, checks, doing, points, record_collectives, require, run_ranks
from parallel_lab.grading.micro import full_attention, rel_err


def qkv(b: int, s: int, d: int, seed: int, scale: float) -> tuple:
    """Seeded ``q, k, v (b, s, d)``; ``scale`` multiplies q and k (scores grow as its square)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, s, d, generator=g) * scale, torch.randn(b, s, d, generator=g) * scale,
            torch.randn(b, s, d, generator=g))


def causal_reference(b: int, s: int, d: int, seed: int, scale: float) -> object:
    import torch

    q, k, v = qkv(b, s, d, seed, scale)
    return full_attention(q, k, v, torch.ones(s, s, dtype=torch.bool).tril())


class Counted:
    """``block_attention`` that counts its calls."""

    def __init__(self, fn) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *a, **kw):
        self.calls += 1
        return self.fn(*a, **kw)


def ring_rank(grid, sub, cases):
    """Per case ``(b, s, d, seed, scale)``: this rank's output, its point-to-point calls, its block count."""
    out = []
    original = sub.block_attention
    for b, s, d, seed, scale in cases:
        q, k, v = qkv(b, s, d, seed, scale)
        c, r = s // grid.world, grid.rank
        sub.block_attention = blocks = Counted(original)
        try:
            with record_collectives() as calls:
                doing(grid, f"ring_attention on chunks of {c} tokens (b={b}, d={d})")
                o = sub.ring_attention(*(t[:, r * c:(r + 1) * c].clone() for t in (q, k, v)), r, grid.world)
        finally:
            sub.block_attention = original
        out.append((o.detach(), list(calls), blocks.calls))
    return out


CASES = ((2, 9, 4, 0, 1.0), (2, 9, 4, 1, 10.0))         # b, s, d, seed, scale: ordinary, then huge scores


@functools.cache
def results(sub):
    return run_ranks(ring_rank, 3, sub, CASES)


def check_output(res: list, case: tuple, which: int, what: str) -> None:
    import torch

    want = causal_reference(*case)
    outs = [runs[which][0] for runs in res]
    c = case[1] // len(res)
    for r, o in enumerate(outs):
        if tuple(o.shape) != (case[0], c, case[2]):
            raise Fail(f"rank {r} of {len(res)}: output {tuple(o.shape)}, expected its queries' (b, c, d) = "
                       f"{(case[0], c, case[2])}")
        if not bool(o.isfinite().all()):
            raise Fail(f"rank {r} of {len(res)} ({what}): the output holds NaN or inf")
    got = torch.cat(outs, dim=1)
    for r in range(len(res)):
        err = rel_err(got[:, r * c:(r + 1) * c], want[:, r * c:(r + 1) * c])
        if err > 1e-5:
            raise Fail(f"{what}, {len(res)} ranks: rank {r}'s output (positions {r * c}..{(r + 1) * c - 1}) differs "
                       f"from one process's causal attention by {err:.2e} (relative)")


def check_traffic(res: list, case: tuple) -> None:
    b, s, d = case[:3]
    n = len(res)
    kv = 2 * b * (s // n) * d * 4
    for r, runs in enumerate(res):
        _, calls, blocks = runs[0]
        other = [k for k, _, _ in calls if k not in ("send", "recv")]
        sent = sum(m for k, m, _ in calls if k == "send")
        got = sum(m for k, m, _ in calls if k == "recv")
        if other or sent != (n - 1) * kv or got != (n - 1) * kv:
            also = f" and called {other}" if other else ""
            raise Fail(f"rank {r} of {n}: sent {sent:,} B and received {got:,} B{also}; its K and V chunks are "
                       f"{kv:,} B and each must go round the ring once: {(n - 1) * kv:,} B each way in {n - 1} "
                       "steps, point to point only")
        if blocks != r + 1:
            raise Fail(f"rank {r} of {n}: {blocks} calls of block_attention; its queries see {r + 1} chunk(s) (its "
                       "own and the earlier ones): a chunk wholly in their future needs no block")


@points(2)
@checks("the ring's output: each rank's queries attend causally to every earlier position, merged over the chunks "
        "that reach them", "which rank's chunk holds you at ring step j, and where do its positions lie against "
        "your queries: all before, the diagonal, or all after?")
def test_three_ranks_equal_causal_attention(sub):
    require(sub, "ring_attention", "merge")
    check_output(results(sub), CASES[0], 0, "ordinary scores")


@points(1)
@checks("the online-softmax merge stays finite and exact with scores of several hundred", "exp(300) overflows "
        "float32: rescale both sides by the larger lse before exponentiating")
def test_huge_scores(sub):
    require(sub, "ring_attention", "merge")
    check_output(results(sub), CASES[1], 1, "scores of several hundred")


@points(2)
@checks("the ring's cost: world - 1 steps moving each rank's K and V chunks once round, point to point, and one "
        "block computed per chunk at or before the rank's queries", "count your sends; and ask of each chunk "
        "before computing: can any of my queries see any of its keys?")
def test_ring_steps_bytes_and_blocks(sub):
    require(sub, "ring_attention", "merge")
    check_traffic(results(sub), CASES[0])
