"""Hidden tests of sp_collectives: on 4 ranks (b=3, s=8, h=6) each operator alone, forward and backward, with
different inputs on every rank; the token-mixing TP region; the bytes each rank sends against TP's all-reduces."""

from __future__ import annotations

import functools

from parallel_lab.grading.harness import Fail, doing, points, run_ranks
from parallel_lab.grading.micro import rel_err, ring_wire_bytes

SHAPE = (3, 8, 6, 8, 5)         # b, s, h, ffn, seed
B, S, H = SHAPE[:3]


def _pub():
    import public_tests

    return public_tests


def per_rank(k: int, shape: tuple) -> object:
    """Rank k's own seeded tensor."""
    import torch

    return torch.randn(*shape, generator=torch.Generator().manual_seed(100 + k))


def alone(grid, sub):
    """Each operator alone on this rank's inputs: forward output and the gradient for this rank's upstream grad."""
    t, r = grid.world, grid.rank
    n = S // t
    doing(grid, "GatherSequence alone")
    shard = per_rank(r, (B, n, H)).requires_grad_(True)
    full = sub.GatherSequence.apply(shard)
    full.backward(per_rank(10 + r, (B, S, H)))
    doing(grid, "ReduceScatterSequence alone")
    partial = per_rank(20 + r, (B, S, H)).requires_grad_(True)
    mine = sub.ReduceScatterSequence.apply(partial)
    mine.backward(per_rank(30 + r, (B, n, H)))
    return full.detach(), shard.grad, mine.detach(), partial.grad, _pub().sp_mlp(grid, sub, SHAPE)


def _off(got, want) -> str:
    if tuple(got.shape) != tuple(want.shape):
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    return f"off by {rel_err(got, want):.2e} (relative)"


@functools.cache
def results(sub):
    return run_ranks(alone, 4, sub)


@points(2)
def test_gather_alone_on_four_ranks(sub):
    import torch

    t, n = 4, S // 4
    want = torch.cat([per_rank(k, (B, n, H)) for k in range(t)], dim=1)
    dsum = sum(per_rank(10 + k, (B, S, H)) for k in range(t))
    for r, (full, gshard, *_) in enumerate(results(sub)):
        if tuple(full.shape) != tuple(want.shape) or rel_err(full, want) > 1e-6:
            raise Fail(f"rank {r} of 4: GatherSequence's output is not the 4 shards side by side along the sequence "
                       f"(b=3, each shard 2 tokens): {_off(full, want)}")
        exp = dsum[:, r * n:(r + 1) * n]
        if gshard is None or tuple(gshard.shape) != tuple(exp.shape) or rel_err(gshard, exp) > 1e-5:
            raise Fail(f"rank {r} of 4: GatherSequence's backward, each rank giving a different upstream gradient, "
                       f"is not the sum over the ranks of the gradients of tokens {r * n}..{(r + 1) * n - 1}")


@points(2)
def test_reduce_scatter_alone_on_four_ranks(sub):
    import torch

    t, n = 4, S // 4
    total = sum(per_rank(20 + k, (B, S, H)) for k in range(t))
    dfull = torch.cat([per_rank(30 + k, (B, n, H)) for k in range(t)], dim=1)
    for r, (_, _, mine, gpartial, _) in enumerate(results(sub)):
        exp = total[:, r * n:(r + 1) * n]
        if tuple(mine.shape) != tuple(exp.shape) or rel_err(mine, exp) > 1e-5:
            raise Fail(f"rank {r} of 4: ReduceScatterSequence's output is not the sum over the ranks of tokens "
                       f"{r * n}..{(r + 1) * n - 1}: {_off(mine, exp)}")
        if gpartial is None or tuple(gpartial.shape) != tuple(dfull.shape) or rel_err(gpartial, dfull) > 1e-6:
            raise Fail(f"rank {r} of 4: ReduceScatterSequence's backward is not every rank's upstream gradient side by "
                       "side along the sequence: each partial sum's gradient is the gradient of the sum")


@points(2)
def test_token_mixing_region_on_four_ranks(sub):
    _pub().check_mlp([res[4] for res in results(sub)], SHAPE)


@points(1)
def test_bytes_per_rank_equal_tensor_parallel_all_reduces(sub):
    m = B * S * H * 4
    tp = 2 * ring_wire_bytes("all_reduce", m, 4)          # TP without SP: g's and f's all-reduce
    for r, res in enumerate(results(sub)):
        _, _, _, fwd, bwd = res[4]
        sent = sum(ring_wire_bytes(k, b, g) for k, b, g in fwd + bwd)
        if abs(sent - tp) > 1e-6 * tp:
            raise Fail(f"rank {r} of 4: the region's collectives send {sent:,.0f} B per rank (ring algorithms); TP's "
                       f"two all-reduces of the activation send {tp:,.0f} B, and SP's gathers and reduce-scatters "
                       "should send exactly as much")
